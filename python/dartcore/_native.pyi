"""Type stubs of the native module ``dartcore._native`` (crates/dartcore-py)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, final

import numpy as np
import numpy.typing as npt

__version__: str

# ----------------------------------------------------------------------------- index

@final
class NgramIndex:
    """Memory-mapped trigram index (use :class:`dartcore.index.NgramIndex`)."""

    def __new__(
        cls, path: str, *, prefault: bool = False, hugepages: bool = False, verify: str = "header"
    ) -> NgramIndex: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_children(self) -> int: ...
    @property
    def path(self) -> str | None: ...
    def metadata_json(self) -> str: ...
    def children(
        self, context: list[int], k: int = 25
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint64], int, int]: ...
    def children_batch(
        self, contexts: npt.NDArray[np.uint32], k: int
    ) -> tuple[
        npt.NDArray[np.uint32],
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint8],
    ]: ...
    def prob(self, context: list[int], token: int, unigram_backoff: bool = True) -> float: ...
    def cond_probs(
        self,
        context: list[int],
        candidates_sorted: npt.NDArray[np.uint32],
        unigram_backoff: bool = True,
    ) -> npt.NDArray[np.float64]: ...
    def count(self, context: list[int], token: int) -> tuple[int, int]: ...
    def stats(self) -> dict[str, Any]: ...
    def verify(self, level: str = "full") -> None: ...

@final
class IndexBuilder:
    def __new__(
        cls,
        vocab_size: int,
        *,
        memory_limit: int = ...,
        temp_dir: str | None = None,
        min_count: int = 1,
        max_children: int | None = None,
        threads: int | None = None,
        token_bits: int | None = None,
    ) -> IndexBuilder: ...
    @property
    def documents(self) -> int: ...
    def add(self, doc: npt.NDArray[np.uint32]) -> None: ...
    def add_many(self, docs: list[npt.NDArray[np.uint32]]) -> None: ...
    def write_runs(self, dir: str) -> list[str]: ...
    def finish(self, output: str, metadata_json: str) -> dict[str, Any]: ...

def convert_dart_trie(
    input: str,
    output: str,
    *,
    vocab_size: int,
    metadata_json: str = "{}",
    memory_limit: int = ...,
    temp_dir: str | None = None,
    min_count: int = 1,
    max_children: int | None = None,
    threads: int | None = None,
    progress: Callable[[str, int, int], object] | None = None,
) -> dict[str, Any]: ...
def merge_runs(
    runs: list[str],
    output: str,
    *,
    vocab_size: int,
    metadata_json: str = "{}",
    memory_limit: int = ...,
    temp_dir: str | None = None,
    min_count: int = 1,
    max_children: int | None = None,
    threads: int | None = None,
    token_bits: int | None = None,
) -> dict[str, Any]: ...
def merge_run_range(
    runs: list[str],
    output: str,
    *,
    vocab_size: int,
    lo: int,
    hi: int,
    memory_limit: int = ...,
) -> dict[str, Any]: ...
def set_num_threads(n: int) -> None: ...
def num_threads() -> int: ...
def numa_topology(sys_root: str | None = None) -> list[tuple[int, list[int]]]: ...
def pin_numa_node(node: int | None = None) -> None: ...

# ----------------------------------------------------------------------------- tree
# (crates/dartcore-py/src/tree.rs)
# Trees cross as (tokens int64[n], parents int64[n], depths int64[n], scores float64[n]).
# ``params`` is a dict with every key: beam_width, max_nodes, level_decay, ngram_weight,
# depth_exponent, eps, ngram_first_level, unigram_backoff, eos_token_ids (list[int]).

_TreeArrays = tuple[
    npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.float64]
]

def search_defaults() -> dict[str, Any]: ...
def search_official() -> dict[str, Any]: ...
def beam_search(
    index: NgramIndex | None,
    context: npt.NDArray[np.int64],
    topk_tokens: npt.NDArray[np.int64],
    topk_logprobs: npt.NDArray[np.float32],
    params: dict[str, Any],
) -> _TreeArrays: ...
def beam_search_batch(
    index: NgramIndex | None,
    ctx_flat: npt.NDArray[np.int64],
    ctx_offsets: npt.NDArray[np.int64],
    topk_tokens: npt.NDArray[np.int64],
    topk_logprobs: npt.NDArray[np.float32],
    params: dict[str, Any],
) -> list[_TreeArrays]: ...
def ngram_tree(
    index: NgramIndex, context: npt.NDArray[np.int64], depth: int, k: int, params: dict[str, Any]
) -> _TreeArrays: ...
def top_b(
    parents: npt.NDArray[np.int64], scores: npt.NDArray[np.float64], b: int
) -> npt.NDArray[np.int64]: ...
def best_first(
    tokens: npt.NDArray[np.int64], logprobs: npt.NDArray[np.float32], root: int, b: int
) -> _TreeArrays: ...
def ancestor_bits(parents: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]: ...
def topk_logprobs(
    logits: npt.NDArray[np.float32], k: int, id_map: npt.NDArray[np.int64] | None = None
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...

# ----------------------------------------------------------------------------- private
# Not public API (crates/dartcore-py/src/bench.rs), importable as dartcore._native._bench /
# dartcore._native._testing:
#   _bench.bench_children(index, contexts uint32[n, 2], k=25, warmup=1) -> uint64[n] (ns)
#   _bench.bench_cond_probs(index, contexts uint32[n, 2], candidates_sorted uint32[m], warmup=1) -> uint64[n]
#   _bench.bench_beam_search(index, ctx_flat, ctx_offsets, topk_tokens, topk_logprobs, params, batch) -> dict
#   _testing.pool_ping() -> int;  _testing.panic(message, in_pool=False) (raises InternalError)

_bench: types.ModuleType
_testing: types.ModuleType

# dart-linear's integer path for GGML block weights (crates/dart-linear/src/int8.rs)
def int8_kernel() -> str | None: ...
def interleave_rows(w: npt.NDArray[np.uint8], format: str) -> npt.NDArray[np.uint8]: ...
def deinterleave_rows(w: npt.NDArray[np.uint8], n: int, format: str) -> npt.NDArray[np.uint8]: ...
