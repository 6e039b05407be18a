"""Type stubs of the native module ``dartcore._native`` (crates/dartcore-py)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, final

import numpy as np
import numpy.typing as npt

__version__: str
__all__ = [
    "__version__",
    "NgramIndex",
    "IndexBuilder",
    "merge_runs",
    "merge_indexes",
    "merge_run_range",
    "set_num_threads",
    "num_threads",
    "numa_topology",
    "pin_numa_node",
    "search_defaults",
    "search_official",
    "beam_search",
    "beam_search_batch",
    "ngram_tree",
    "top_b",
    "best_first",
    "ancestor_bits",
    "topk_logprobs",
    "linear_rows",
    "linear_available",
    "dequantize_rows",
    "dequantize_rows_at",
    "pack_rows",
    "linear_isa",
    "interleave_rows",
    "int8_kernel",
    "deinterleave_rows",
    "add_rms_norm",
    "refine_top",
    "block_attention",
    "LayerStack",
    "LIVE_WEIGHT",
    "context_match",
    "LiveLayer",
    "LiveDelta",
    "_bench",
    "_testing",
    "convert_dart_trie",
]

# ----------------------------------------------------------------------------- index

LIVE_WEIGHT: float

def context_match(
    context: npt.NDArray[np.int64], max_len: int, min_match: int, max_match: int, measure: int
) -> tuple[int, npt.NDArray[np.int64]]: ...

@final
class LiveLayer:
    """The live n-gram layer (use :class:`dartcore.live.LiveLayer`)."""

    def __new__(cls, capacity: int, vocab_size: int) -> LiveLayer: ...
    def insert(self, tokens: npt.NDArray[np.int64]) -> None: ...
    def insert_list(self, tokens: list[int]) -> bool: ...
    def clear(self) -> None: ...
    def suffix_lookup(
        self, context: npt.NDArray[np.int64], max_len: int, min_match: int, max_match: int
    ) -> tuple[int, npt.NDArray[np.int64]]: ...
    def probs(
        self, context: npt.NDArray[np.int64], candidates: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]: ...
    def __len__(self) -> int: ...
    @property
    def inserted(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    def nbytes(self) -> int: ...
    def save(self, path: str, metadata_json: str = "{}") -> dict[str, Any]: ...
    def set_shared(self, deltas: list[LiveDelta]) -> None: ...
    @property
    def shared_count(self) -> int: ...

@final
class LiveDelta:
    """A delta index mapped for sharing (use :class:`dartcore.live.SharedLive`)."""

    def __new__(cls, path: str, vocab_size: int) -> LiveDelta: ...
    @property
    def tokens(self) -> int: ...
    @property
    def documents(self) -> int: ...
    def metadata_json(self) -> str: ...

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
def merge_indexes(
    inputs: list[str],
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
    live: LiveLayer | None = None,
    live_weight: float = ...,
) -> _TreeArrays: ...
def beam_search_batch(
    index: NgramIndex | None,
    ctx_flat: npt.NDArray[np.int64],
    ctx_offsets: npt.NDArray[np.int64],
    topk_tokens: npt.NDArray[np.int64],
    topk_logprobs: npt.NDArray[np.float32],
    params: dict[str, Any],
    live: LiveLayer | None = None,
    live_weight: float = ...,
) -> list[_TreeArrays]: ...
def ngram_tree(
    index: NgramIndex,
    context: npt.NDArray[np.int64],
    depth: int,
    k: int,
    params: dict[str, Any],
    live: LiveLayer | None = None,
    live_weight: float = ...,
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

# ----------------------------------------------------------------------------- linear
# (crates/dartcore-py/src/linear.rs) dart-linear's row kernels: out = x @ w.T + bias for up to
# 16 rows. ``format``: "f32" (w float32), "f16" / "bf16" (w uint16 bit patterns), or GGML block
# rows (w uint8): "q4_0", "q4_1", "q8_0" as a file stores them, with "_packed" (pack_rows) or
# "_int8" (interleave_rows) for the layouts the kernels stream.

def linear_available() -> bool: ...
def linear_isa() -> str | None: ...
def linear_rows(
    x: npt.NDArray[np.float32],
    w: npt.NDArray[np.float32] | npt.NDArray[np.uint16] | npt.NDArray[np.uint8],
    bias: npt.NDArray[np.float32] | None,
    out: npt.NDArray[np.float32],
    threads: int = 1,
    format: str = "f32",
) -> None: ...
def dequantize_rows(
    w: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], format: str
) -> None: ...
def dequantize_rows_at(
    w: npt.NDArray[np.uint8],
    ids: npt.NDArray[np.int64],
    out: npt.NDArray[np.float32],
    format: str,
) -> None: ...
def pack_rows(w: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8], format: str) -> None: ...

# ----------------------------------------------------------------------------- layer ops
# (crates/dartcore-py/src/ops.rs, stack.rs) a Llama-family block's rows through dart-linear.
# Every array is C-contiguous; ``out`` and the caches are written in place.

def refine_top(
    values: npt.NDArray[np.float32],
    x: npt.NDArray[np.float32],
    w: npt.NDArray[np.float32],
    bias: npt.NDArray[np.float32] | None,
    m: int,
) -> None: ...
def add_rms_norm(
    h: npt.NDArray[np.float32],
    delta: npt.NDArray[np.float32] | None,
    weight: npt.NDArray[np.float32],
    eps: float,
    out: npt.NDArray[np.float32],
) -> None: ...
def block_attention(
    qkv: npt.NDArray[np.float32],
    heads: int,
    kv_heads: int,
    cos: npt.NDArray[np.float32],
    sin: npt.NDArray[np.float32],
    k_cache: npt.NDArray[np.float32],
    v_cache: npt.NDArray[np.float32],
    prefix: int,
    mask: npt.NDArray[np.bool_] | None,
    scale: float,
    out: npt.NDArray[np.float32],
    q_norm: npt.NDArray[np.float32] | None = None,
    k_norm: npt.NDArray[np.float32] | None = None,
    norm_eps: float = 1e-6,
    threads: int = 1,
) -> None: ...

# A product: (w, format, bias | None), as linear_rows takes them.
_Product = tuple[npt.NDArray[Any], str, npt.NDArray[np.float32] | None]
# A layer: (input_norm, post_norm, q_norm | None, k_norm | None, qkv, o, gate_up, down).
_Layer = tuple[
    npt.NDArray[np.float32],
    npt.NDArray[np.float32],
    npt.NDArray[np.float32] | None,
    npt.NDArray[np.float32] | None,
    _Product,
    _Product,
    _Product,
    _Product,
]
# A forward's segment: (k_cache, v_cache, prefix, start, end, mask | None).
_Segment = tuple[
    npt.NDArray[np.float32], npt.NDArray[np.float32], int, int, int, npt.NDArray[np.bool_] | None
]

@final
class LayerStack:
    """A decoder's layers held in place for dart-linear's block forward."""

    def __new__(
        cls,
        layers: list[_Layer],
        final_norm: npt.NDArray[np.float32],
        heads: int,
        kv_heads: int,
        head_dim: int,
        inter: int,
        eps: float,
        scale: float,
        threads: int = 1,
    ) -> LayerStack: ...
    def forward(
        self,
        h: npt.NDArray[np.float32],
        cos: npt.NDArray[np.float32],
        sin: npt.NDArray[np.float32],
        segments: list[_Segment],
        taps: list[int],
        tap_out: npt.NDArray[np.float32] | None,
        out: npt.NDArray[np.float32],
    ) -> None: ...
    def __len__(self) -> int: ...

# dart-linear's integer path for GGML block weights (crates/dart-linear/src/int8.rs)
def int8_kernel() -> str | None: ...
def interleave_rows(w: npt.NDArray[np.uint8], format: str) -> npt.NDArray[np.uint8]: ...
def deinterleave_rows(w: npt.NDArray[np.uint8], n: int, format: str) -> npt.NDArray[np.uint8]: ...
