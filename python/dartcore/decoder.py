"""DartDecoder: lossless speculative decoding with a drafter, a trigram index
and tree verification (batch 1).

One round of the loop (ARCHITECTURE.md "Data flow")::

    draft   drafter(taps of the newly committed positions, their next tokens) -> d rows of logits
    search  tree builder(logits, context, index) -> tree rooted at the last committed token
    verify  one target forward over the flattened tree (positions L + depth, ancestor mask)
    accept  walk the tree with the target's own choices -> path + bonus token;
            keep only the path's KV entries, compacted in place

The plain autoregressive baseline is the same loop with the ``ar`` builder (the
tree is the root alone), so speedups compare like with like.

Output is the target's: under greedy decoding token for token what
``model.generate(do_sample=False)`` produces, under sampling the same
distribution as the AR sampler (one :class:`~dartcore.sampling.Sampler` for
both).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dartcore.builders import CPU_MAX_NODES, GPU_MAX_NODES, TreeInputs, make_tree_builder, root_only
from dartcore.errors import ContextLengthError, DrafterMismatchError, TokenizerMismatchError, TreeError
from dartcore.kernels.linear import native_linears_, torch_threads
from dartcore.models.transformer import TargetModel, column_major_linears_
from dartcore.sampling import Sampler, SamplingParams
from dartcore.verify import FlatTree, accept, ancestor_mask, flatten, prune

__all__ = ["DartDecoder", "GenerationResult", "GenerationStats", "StreamChunk"]

STAGES = ("prefill", "draft", "search", "verify", "accept")


@dataclass
class GenerationStats:
    """What one ``generate`` call did.

    ``tau`` is the mean number of tokens committed per target verify forward,
    **bonus token included** (accepted drafted tokens + 1), over the rounds
    after prefill; plain AR decoding has tau = 1.0. The first new token comes
    from the prefill forward and is not part of tau. 0.0 when no round ran.
    ``accept_hist[a]`` counts the rounds that accepted ``a`` drafted tokens.
    ``seconds`` holds wall time per stage: prefill, draft, search, verify and
    accept (acceptance walk, KV compaction, stop checks: everything else; with
    lazy logits, the default on CPU, the LM-head rows the walk reads are
    computed here too).
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    accept_hist: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    total_s: float = 0.0
    finish_reason: str = ""  # "eos" | "stop" | "length" (max_new_tokens) | "context" | "empty"

    @property
    def tau(self) -> float:
        if self.rounds == 0:
            return 0.0
        return sum((a + 1) * c for a, c in enumerate(self.accept_hist)) / self.rounds

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole call (prefill included)."""
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def _count(self, accepted: int) -> None:
        if len(self.accept_hist) <= accepted:
            self.accept_hist.extend([0] * (accepted + 1 - len(self.accept_hist)))
        self.accept_hist[accepted] += 1
        self.rounds += 1

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["tau"] = self.tau
        out["tokens_per_s"] = self.tokens_per_s
        return out


@dataclass
class GenerationResult:
    tokens: list[int]  # new tokens only (EOS / stop-string tokens included when they ended it)
    text: str  # decoded new tokens, special tokens skipped
    stats: GenerationStats


@dataclass
class StreamChunk:
    tokens: list[int]  # tokens committed since the previous chunk
    text: str  # text they add (held back while a multi-byte character is incomplete)
    result: GenerationResult | None = None  # set on the last chunk only


class _Clock:
    """Per-stage wall time; synchronises CUDA so a stage's kernels count in it."""

    def __init__(self, stats: GenerationStats, device: torch.device):
        self.stats = stats
        self.cuda = device.type == "cuda"
        self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.stats.seconds[stage] += now - self.t
        self.t = now


class _LazyLogits:
    """Row i of the tree's logits, computed on first use, together with the row
    of i's first child (the builders' best guess for the next accepted node).

    On CPU the LM head dominates a small forward (SmolLM2: a 49152 x 576 fp32
    matrix, ~15-20 ms per matrix-vector product on the dev box) and MKL's
    row-major GEMM costs about the same for 1 and 2 rows (1.00 / 1.08 / 1.33 /
    2.35x for 1 / 2 / 3 / 4 rows, measured on one core), so the acceptance walk
    computes only the rows it visits, two at a time: ``accepted + 1`` rows in
    about ``(accepted + 2) // 2`` products, where the whole tree would cost
    several. On CUDA the batched product is essentially free and the decoder
    computes all rows at once."""

    def __init__(self, target: TargetModel, hidden: torch.Tensor, parents: np.ndarray | None = None):
        self.target = target
        self.hidden = hidden
        self.rows: dict[int, torch.Tensor] = {}
        self.first_child: dict[int, int] = {}
        if parents is not None:
            for i in range(len(parents) - 1, 0, -1):  # reversed: the lowest index wins
                self.first_child[int(parents[i])] = i

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self.rows.get(i)
        if row is None:
            c = self.first_child.get(i)
            if c is not None and c not in self.rows:
                both = self.target.logits(self.hidden[[i, c]])
                row, self.rows[c] = both[0], both[1]
            else:
                row = self.target.logits(self.hidden[i:i + 1])[0]
            self.rows[i] = row
        return row


class DartDecoder:
    """Speculative decoding of a Hugging Face Llama / Qwen3 target.

    ``DartDecoder(model, tokenizer, drafter=None, index=None, *, tree="dart",
    device=None, dtype=None, **tree_params)``: ``model`` is a loaded HF causal
    LM (moved in place when ``device`` / ``dtype`` are given), ``drafter`` a
    :class:`dartcore.DartDrafter` for this target, ``index`` a
    :class:`dartcore.NgramIndex` built with the target's tokenizer, ``tree`` a
    registered tree builder (``dart``, ``dart-no-ngram``, ``dart-chain``,
    ``ngram-only``, ``ar``, ...; see :mod:`dartcore.builders`) and
    ``tree_params`` its parameters (``max_nodes``, ``beam_width``, ``k``, ...).
    The node budget defaults to ``CPU_MAX_NODES`` (4) on CPU and to the paper's
    ``GPU_MAX_NODES`` (59) on CUDA. The drafter is moved to the target's device.
    ``max_context`` caps the context below the model's
    ``max_position_embeddings``; ``eos_token_ids`` overrides the EOS ids read
    from the generation config and tokenizer (``()`` = never stop on EOS).
    ``lazy_logits`` (default: on for CPU, off for CUDA) computes the LM head
    only for the tree nodes the acceptance walk visits.
    """

    def __init__(self, model, tokenizer, drafter=None, index=None, *, tree: str = "dart",
                 device=None, dtype=None, max_context: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, lazy_logits: bool | None = None,
                 **tree_params):
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        model.eval()
        self.target = TargetModel(model)
        self.tokenizer = tokenizer
        self.tree = tree
        self.builder = make_tree_builder(tree, **tree_params)
        if (self.target.device.type == "cuda" and "max_nodes" not in tree_params
                and getattr(self.builder, "max_nodes", None) == CPU_MAX_NODES):
            # A budget nobody chose: the CPU default is far too small for a GPU.
            self.builder = make_tree_builder(tree, max_nodes=GPU_MAX_NODES, **tree_params)
        self.drafter = drafter if self.builder.needs_drafter else None
        self.index = index
        if self.builder.needs_drafter and drafter is None:
            raise ValueError(f"tree builder {tree!r} needs a drafter (or use tree='ngram-only' / 'ar')")
        if self.builder.needs_index and index is None:
            raise ValueError(f"tree builder {tree!r} needs an n-gram index built with the target's tokenizer "
                             "(ngram-build --tokenizer ...)")
        if self.drafter is not None:
            _check_drafter(self.drafter, self.target, tokenizer)
            if isinstance(self.drafter, torch.nn.Module):
                self.drafter.to(self.target.device)  # the drafter runs where the target runs
            if self.target.device.type == "cpu" and isinstance(self.drafter, torch.nn.Module):
                if self.target.native_linear:
                    # weights streamed once for the d rows, fp16 where they are fp16-exact (the
                    # shipped drafters are stored in fp16: same drafts, half the bytes); the
                    # layer's own ops native too where the drafter supports it
                    use = getattr(self.drafter, "use_native_ops", None)  # a DartDrafter's own
                    if use is not None:
                        use(threads=self.target.threads)
                    else:
                        native_linears_(self.drafter, narrow=True, threads=self.target.threads)
                else:
                    column_major_linears_(self.drafter)  # 2x faster d-row drafting with MKL
        if index is not None:
            _check_index(index, tokenizer)
        context = self.target.max_positions or (1 << 31)
        self.context_length = min(context, max_context) if max_context else context
        self.eos_token_ids = (tuple(int(t) for t in eos_token_ids) if eos_token_ids is not None
                              else _eos_ids(model, tokenizer))
        # Lazy where a product of several rows costs several of one row (MKL on the CPU); the
        # native kernel and CUDA compute a tree's rows for about the price of one.
        self.lazy_logits = (self.target.device.type != "cuda" and not self.target.native_linear
                            if lazy_logits is None else bool(lazy_logits))

    @classmethod
    def from_pretrained(cls, target, drafter=None, index=None, *, tree: str = "dart", device=None,
                        dtype=None, **tree_params) -> DartDecoder:
        """Load everything by name or path: ``target`` for :mod:`dartcore.models.hub`
        (e.g. ``"smollm2"``), ``drafter`` a drafter directory or name, ``index``
        an index file."""
        from dartcore.models.hub import load_target

        model, tokenizer = load_target(target, dtype=dtype, device=str(device or "cpu"))
        drafter_obj = None
        if drafter is not None:
            from dartcore.drafter import DartDrafter

            drafter_obj = DartDrafter.from_pretrained(drafter, model, tokenizer=tokenizer)
        index_obj = None
        if index is not None:
            from dartcore.index import NgramIndex

            index_obj = NgramIndex(index)
        return cls(model, tokenizer, drafter_obj, index_obj, tree=tree, device=device, **tree_params)

    # -- public entry points --------------------------------------------------------------

    def generate(self, prompt, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, stop: str | Sequence[str] | None = None,
                 seed: int | None = None, streamer=None) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt`` (a string, a
        list / array / tensor of token ids, or a list of chat messages
        ``[{"role": ..., "content": ...}]`` rendered with the chat template).

        temperature 0 is greedy; top_p / top_k are the AR sampler's warpers;
        ``seed`` makes sampling reproducible. Generation ends at an EOS token
        (included), right after the token that completes a ``stop`` string
        (included), at ``max_new_tokens``, or when the model's context is full.
        ``max_new_tokens = 0`` returns an empty result without running the
        model. ``streamer``: a callable ``(tokens, text)`` called per committed
        chunk, or an object with ``put(tensor)`` / ``end()`` (HF streamers).
        Never prints.
        """
        result = None
        for chunk in self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                 top_p=top_p, top_k=top_k, stop=stop, seed=seed):
            if streamer is not None and chunk.tokens:
                if hasattr(streamer, "put"):
                    streamer.put(torch.tensor(chunk.tokens, dtype=torch.long))
                else:
                    streamer(chunk.tokens, chunk.text)
            result = chunk.result
        if streamer is not None and hasattr(streamer, "end"):
            streamer.end()
        assert result is not None
        return result

    def stream(self, prompt, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: str | Sequence[str] | None = None,
               seed: int | None = None) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, as an iterator of :class:`StreamChunk`; the last
        chunk carries the :class:`GenerationResult`. Arguments are checked
        before the first chunk."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        if int(max_new_tokens) != max_new_tokens or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        ids = self._prompt_ids(prompt)
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens leaves no room in the context of {self.context_length} tokens"
            )
        return self._stream(ids, int(max_new_tokens), Sampler(params, seed), stops)

    # -- the loop ---------------------------------------------------------------------------

    def _stream(self, ids: list[int], max_new_tokens: int, sampler: Sampler,
                stops: list[str]) -> Iterator[StreamChunk]:
        stats = GenerationStats(prompt_tokens=len(ids))
        start = time.perf_counter()
        generated: list[int] = []
        shown = ""
        for new in self._rounds(ids, max_new_tokens, sampler, stops, stats, generated):
            text = self._decode(generated)
            # Hold back an incomplete multi-byte character (decodes as U+FFFD).
            visible = text[:-1] if text.endswith("\ufffd") else text
            delta = visible[len(shown):] if visible.startswith(shown) else visible
            shown = visible
            yield StreamChunk(tokens=new, text=delta)
        stats.total_s = time.perf_counter() - start
        stats.new_tokens = len(generated)
        text = self._decode(generated)
        result = GenerationResult(tokens=list(generated), text=text, stats=stats)
        yield StreamChunk(tokens=[], text=text[len(shown):] if text.startswith(shown) else "", result=result)

    def _rounds(self, ids: list[int], max_new_tokens: int, sampler: Sampler, stops: list[str],
                stats: GenerationStats, generated: list[int]) -> Iterator[list[int]]:
        """Prefill, then draft / search / verify / accept until done; yields each
        round's committed tokens after appending them to ``generated``."""
        if max_new_tokens == 0:
            stats.finish_reason = "empty"
            return
        target, drafter = self.target, self.drafter
        clock = _Clock(stats, target.device)
        # The cache holds every committed token except the newest (the next root).
        budget = self._node_budget()
        capacity = min(self.context_length, len(ids) + max_new_tokens + budget + 1)
        cache = target.new_cache(capacity)
        capacity = cache.capacity
        taps = tuple(drafter.taps) if drafter is not None else ()
        # A tree of `budget` nodes is never deeper than `budget`: draft no more rows than that.
        draft_rows = min(drafter.d, budget) if drafter is not None else 0
        dstate = drafter.new_state(capacity) if drafter is not None else None

        # prefill
        out = target.forward(cache, torch.tensor(ids, dtype=torch.long), torch.arange(len(ids)),
                             taps=taps, logits_rows=slice(-1, None))
        cache.commit(len(ids))
        token = sampler.choose(out.logits[-1])
        committed = list(ids) + [token]
        new_taps, new_next = out.taps, list(ids[1:]) + [token]
        clock.lap("prefill")
        done = self._commit(generated, [token], max_new_tokens, stops, stats, len(committed))
        yield list(generated)
        clock.lap("accept")  # the consumer's time (text decoding, streaming) counts as "other"
        if done:
            return

        while True:
            # the round's small torch ops on one thread where the native kernel's helpers spin
            with self._small_ops():
                prefix = cache.length  # == len(committed) - 1
                max_depth = min(max_new_tokens - len(generated), self.context_length - len(committed)) - 1
                max_nodes = capacity - prefix  # root included
                logits = hidden = None
                # max_depth == 0 only in the last round (one token left): nothing to draft.
                if drafter is not None and max_depth > 0:
                    drafted = drafter.draft(dstate, new_taps, torch.tensor(new_next, dtype=torch.long),
                                            return_hidden=self.builder.needs_hidden,
                                            rows=min(draft_rows, max_depth))
                    logits, hidden = drafted if self.builder.needs_hidden else (drafted, None)
                clock.lap("draft")
                if max_depth > 0:
                    tree = self.builder(TreeInputs(
                        context=np.asarray(committed, dtype=np.int64), logits=logits, hidden=hidden,
                        drafter=drafter, index=self.index, max_depth=max_depth, max_nodes=max_nodes - 1,
                        eos_token_ids=self.eos_token_ids,
                    ))
                else:
                    tree = root_only(committed[-1])
                flat = prune(flatten(tree), max_depth=max_depth, max_nodes=max_nodes)
                if int(flat.tokens[0]) != committed[-1]:
                    raise TreeError(f"tree root {int(flat.tokens[0])} is not the last committed token {committed[-1]}")
                clock.lap("search")
                out = self._verify(cache, flat, prefix, taps)
                clock.lap("verify")
                rows = _LazyLogits(target, out.hidden, flat.parents) if self.lazy_logits else out.logits
                acc = accept(flat, rows, sampler)
                cache.compact(acc.path)
                new = [int(t) for t in flat.tokens[acc.path[1:]]] + [acc.bonus]
                stats._count(acc.accepted)
                committed.extend(new)
                if drafter is not None:
                    new_taps = out.taps[torch.as_tensor(acc.path, device=out.taps.device)]
                    new_next = new
                base = len(generated)
                done = self._commit(generated, new, max_new_tokens, stops, stats, len(committed))
            clock.lap("accept")
            yield generated[base:]
            clock.lap("accept")
            if done:
                return

    def _verify(self, cache, flat: FlatTree, prefix: int, taps):
        tokens = torch.from_numpy(flat.tokens)
        positions = torch.from_numpy(flat.depths + prefix)
        mask = torch.from_numpy(ancestor_mask(flat.parents))
        rows = slice(0, 0) if self.lazy_logits else None
        return self.target.forward(cache, tokens, positions, mask, taps=taps, logits_rows=rows)

    def _commit(self, generated: list[int], new: list[int], max_new_tokens: int, stops: list[str],
                stats: GenerationStats, committed_len: int) -> bool:
        """Append ``new`` to ``generated``, cut at the first stop condition;
        True when generation is over."""
        base = len(generated)
        for i, tok in enumerate(new):
            generated.append(tok)
            if tok in self.eos_token_ids:
                stats.finish_reason = "eos"
            elif stops and any(s in self._decode(generated, skip_special=False) for s in stops):
                stats.finish_reason = "stop"
            elif len(generated) >= max_new_tokens:
                stats.finish_reason = "length"
            else:
                continue
            del generated[base + i + 1:]
            return True
        if committed_len >= self.context_length:
            stats.finish_reason = "context"
            return True
        return False

    # -- helpers -------------------------------------------------------------------------------

    def _small_ops(self):
        """Where the native kernel's helpers spin (the target's native path), a round's small
        torch ops (drafting, search, acceptance) run on one torch thread: an OpenMP worker
        woken by, e.g., the argmax over a tree's logits spins next to the helpers (see
        dartcore.kernels.linear.torch_threads). The prefill keeps torch's threads."""
        return torch_threads(1) if self.target.native_linear else contextlib.nullcontext()

    def _node_budget(self) -> int:
        budget = getattr(self.builder, "max_nodes", None)
        if budget is None:  # chain: one node per drafter row
            budget = getattr(self.drafter, "d", 8)
        return int(budget)

    def _decode(self, tokens: list[int], skip_special: bool = True) -> str:
        if not tokens:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one token of text")
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            rendered = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.detach().cpu().reshape(-1).tolist() if prompt.dim() <= 2 and (
                prompt.dim() < 2 or prompt.shape[0] == 1) else _batch_error()
        elif isinstance(prompt, np.ndarray):
            ids = prompt.reshape(-1).tolist() if prompt.ndim <= 2 and (
                prompt.ndim < 2 or prompt.shape[0] == 1) else _batch_error()
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise TypeError(f"prompt must be a string, token ids or chat messages, not {type(prompt).__name__}")
        if ids and isinstance(ids[0], list):  # tokenizers may return [[...]]
            ids = ids[0]
        if len(ids) == 0:
            raise ValueError("empty prompt: give at least one token")
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise TypeError("token ids must be integers") from None
        vocab = self.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the target's vocabulary [0, {vocab})")
        return ids


def _batch_error():
    raise ValueError("DartDecoder decodes one sequence at a time (batch size 1)")


def _eos_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS ids as HF ``generate`` sees them: the generation config's, else the
    model config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            return tuple(sorted({int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}))
    return ()


def _check_drafter(drafter, target: TargetModel, tokenizer) -> None:
    """Refuse a drafter trained for another target (family, layer count,
    hidden size, vocabulary, tokenizer fingerprint)."""
    cfg = getattr(drafter, "config", None)
    hf = target.config
    problems = []
    for what, mine, theirs in (
        ("family", getattr(cfg, "family", None), target.family),
        ("layer count", getattr(cfg, "num_target_layers", None), target.num_layers),
        ("hidden size", getattr(cfg, "hidden_size", None), target.hidden_size),
        ("vocabulary size", getattr(cfg, "vocab_size", None), getattr(hf, "vocab_size", None)),
    ):
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"{what} {mine!r} vs target {theirs!r}")
    taps = tuple(int(t) for t in getattr(drafter, "taps", ()))
    if any(not 0 <= t <= target.num_layers for t in taps):
        problems.append(f"taps {taps} outside a {target.num_layers}-layer target")
    recorded = getattr(cfg, "tokenizer_fingerprint", None)
    if recorded is not None and tokenizer is not None:
        try:  # the drafter records its own vocabulary hash (dartcore.drafter)
            from dartcore.drafter import tokenizer_fingerprint

            mine = tokenizer_fingerprint(tokenizer)
        except Exception:  # noqa: BLE001 - a tokenizer we cannot fingerprint is not compared
            mine = None
        if mine is not None and mine != recorded:
            problems.append(f"tokenizer fingerprint {recorded} vs target {mine}")
    if problems:
        name = getattr(cfg, "target_name", None)
        raise DrafterMismatchError(
            f"the drafter was trained for target {name!r} and does not fit this one: " + "; ".join(problems)
            + ". Train a drafter for this target with dart-train."
        )


def _check_index(index, tokenizer) -> None:
    meta = getattr(index, "metadata", None) or {}
    recorded = (meta.get("tokenizer") or {}).get("fingerprint") if isinstance(meta, dict) else None
    if recorded is None:
        return  # nothing recorded to compare against
    from dartcore.errors import TokenizerError
    from dartcore.tokenizers import fingerprint

    try:
        mine = fingerprint(tokenizer)
    except TokenizerError:
        return  # a custom tokenizer dartcore cannot fingerprint: the caller vouches for it
    if recorded != mine:
        name = (meta.get("tokenizer") or {}).get("name", "another tokenizer")
        raise TokenizerMismatchError(
            f"the n-gram index was built with {name} (fingerprint {recorded}), but the target's tokenizer "
            f"has fingerprint {mine}: rebuild the index with the target's tokenizer (ngram-build --tokenizer ...)"
        )


StreamerCallback = Callable[[list[int], str], None]
