"""DartDecoder: lossless speculative decoding with a drafter, a trigram index
and tree verification.

One round of the loop (ARCHITECTURE.md "Data flow")::

    draft   drafter(taps of the newly committed positions, their next tokens) -> d rows of logits
    search  tree builder(logits, context, index) -> tree rooted at the last committed token
    verify  one target forward over the flattened tree (positions L + depth, ancestor mask)
    accept  walk the tree with the target's own choices -> path + bonus token;
            keep only the path's KV entries, compacted in place

In the code: ``_rounds`` runs ``_prefill`` once, then per round ``_limits`` (the
round's depth and node budget, decided there only), ``_draft``, ``_search``,
``_verify`` and ``_accept``, each on the one ``_Sequence`` that holds the
sequence's state between rounds (caches, committed tokens, the last round's
taps). Device and CPU specifics are the backend's (:mod:`dartcore.models.backend`).
The draft, search and verify steps take a list of sequences: ``generate`` passes one,
the batched engine (:mod:`dartcore.engine`, ``generate_batch``) all its running ones,
so both run the same code -- one drafter pass, one target forward over every
sequence's tree rows.

The plain autoregressive baseline is the same loop with the ``ar`` builder (the
tree is the root alone), so speedups compare like with like.

Output is the target's: under greedy decoding token for token what
``model.generate(do_sample=False)`` produces, under sampling the same
distribution as the AR sampler (one :class:`~dartcore.sampling.Sampler` for
both).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from dartcore.builders import BeamBuilder, TreeInputs, _target_topk, make_tree_builder, node_budget, root_only
from dartcore.errors import ContextLengthError, DrafterMismatchError, TokenizerMismatchError, TreeError
from dartcore.models.backend import TorchBackend, backend_for
from dartcore.models.cache import KVCache
from dartcore.models.transformer import ForwardOutput, TargetModel
from dartcore.sampling import Sampler, SamplingParams, check_seed
from dartcore.tree import Tree
from dartcore.verify import accept, ancestor_mask, flatten, prune

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
    budget_hist: list[int] = field(default_factory=list)  # [n] = rounds verified with a budget of n nodes
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

    def _count(self, accepted: int, budget: int = 0) -> None:
        for hist, i in ((self.accept_hist, accepted), (self.budget_hist, budget)):
            if len(hist) <= i:
                hist.extend([0] * (i + 1 - len(hist)))
            hist[i] += 1
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
    """Per-stage wall time; the backend synchronises the device so a stage's kernels count in it."""

    def __init__(self, stats: GenerationStats, backend: TorchBackend):
        self.stats = stats
        self.backend = backend
        self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        self.backend.synchronize()
        now = time.perf_counter()
        self.stats.seconds[stage] += now - self.t
        self.t = now


@dataclass
class _Sequence:
    """Everything one sequence's decoding carries from round to round (batch 1 holds one)."""

    cache: KVCache  # every committed token except the newest (the next root)
    drafter_state: Any  # the drafter's KV cache, or None without a drafter
    committed: list[int]  # prompt + output so far; the last one is the next tree's root
    generated: list[int]  # output only
    max_new_tokens: int
    stops: list[str]
    sampler: Sampler
    stats: GenerationStats
    new_taps: torch.Tensor | None = None  # target taps of the positions not yet drafted from
    new_next: list[int] = field(default_factory=list)  # the token after each of those positions
    limit: int = 0  # committed tokens this sequence may reach (the context, or its KV slot)
    budget: int = 0  # this round's node budget
    path: list[int] = field(default_factory=lambda: [0])  # the last round's accepted nodes, root first

    @property
    def prefix(self) -> int:
        """Tokens in the target's cache (all committed tokens but the root)."""
        return self.cache.length


@dataclass
class _Drafted:
    logits: torch.Tensor | None = None  # [rows, V_draft]
    hidden: torch.Tensor | None = None  # [rows, H] (builders with needs_hidden)


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
    The node budget defaults to ``CPU_MAX_NODES`` (4) on CPU (``CPU_BLOCKS_MAX_NODES``, 2, for a
    target of GGML block weights) and to the paper's
    ``GPU_MAX_NODES`` (59) on CUDA (:func:`dartcore.builders.node_budget`); it is
    ``decoder.max_nodes``. The drafter is moved to the target's device.
    ``max_context`` caps the context below the model's
    ``max_position_embeddings``; ``eos_token_ids`` overrides the EOS ids read
    from the generation config and tokenizer (``()`` = never stop on EOS).
    ``lazy_logits`` (default: on for CPU without the native kernels, off otherwise)
    computes the LM head only for the tree nodes the acceptance walk visits.
    Device and CPU specifics (weight layouts, native kernels, lazy logits) are
    the ``backend``'s (:mod:`dartcore.models.backend`), chosen here once.
    """

    def __init__(self, model, tokenizer, drafter=None, index=None, *, tree: str = "dart",
                 device=None, dtype=None, max_context: int | None = None,
                 eos_token_ids: Sequence[int] | None = None, lazy_logits: bool | None = None,
                 **tree_params):
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        model.eval()
        self.target = TargetModel(model)
        self.backend = backend_for(self.target, lazy_logits=lazy_logits)
        self.tokenizer = tokenizer
        self.tree = tree
        self.builder = make_tree_builder(tree, **tree_params)
        self.drafter = drafter if self.builder.needs_drafter else None
        self.index = index
        if self.builder.needs_drafter and drafter is None:
            raise ValueError(f"tree builder {tree!r} needs a drafter: pass drafter= (--drafter for dart-generate), "
                             "or use tree='ngram-only' / 'ar'")
        if self.builder.needs_index and index is None:
            other = "tree='dart-no-ngram'" if self.builder.needs_drafter else "tree='ar'"
            raise ValueError(f"tree builder {tree!r} needs an n-gram index built with the target's tokenizer: pass "
                             "index= (--index for dart-generate; build one with ngram-build --tokenizer ...), "
                             f"or use {other}")
        if self.drafter is not None:
            _check_drafter(self.drafter, self.target, tokenizer)
            self.drafter = self.backend.prepare_drafter(self.drafter)
        if index is not None:
            _check_index(index, tokenizer, self.target)
        # The node budget (root excluded), decided once; each round caps it by the room left.
        self.max_nodes = node_budget(self.builder, drafter=self.drafter, device=self.target.device.type,
                                     blocks=bool(getattr(self.target, "blocks", False)))
        context = self.target.max_positions or (1 << 31)
        self.context_length = min(context, max_context) if max_context else context
        self.eos_token_ids = (tuple(int(t) for t in eos_token_ids) if eos_token_ids is not None
                              else _eos_ids(model, tokenizer))

    @property
    def lazy_logits(self) -> bool:
        return self.backend.lazy_logits

    @classmethod
    def from_pretrained(cls, target, drafter=None, index=None, *, tree: str = "dart", device=None,
                        dtype=None, quantized: bool | None = None, numerics: str | None = None,
                        **tree_params) -> DartDecoder:
        """Load everything by name or path: ``target`` for :mod:`dartcore.models.hub`
        (e.g. ``"smollm2"``), ``drafter`` a drafter directory or name, ``index``
        an index file. ``quantized`` (default: on for a GGUF target on the CPU in float32
        where the native kernels run): keep the GGUF's Q4_0 / Q4_1 / Q8_0 tensors as their
        blocks, streamed by the native kernels -- the same outputs as the dequantised float32
        model from a fraction of the memory and bytes per token (:mod:`dartcore.models.gguf`).
        ``numerics`` (blocks only; default ``"int8"`` where the integer kernels run, else
        ``"exact"``): see :class:`dartcore.models.transformer.TargetModel`."""
        import torch

        from dartcore.kernels.linear import native_linear_available
        from dartcore.models.hub import gguf_source, load_target

        if quantized is None:
            quantized = (gguf_source(target) is not None and str(device or "cpu") == "cpu"
                         and dtype in (None, torch.float32) and native_linear_available())
        if numerics is None:
            from dartcore.kernels.linear import int8_kernel

            numerics = "int8" if quantized and int8_kernel() is not None else "exact"
        model, tokenizer = load_target(target, dtype=dtype, device=str(device or "cpu"), quantized=bool(quantized),
                                       numerics=numerics)
        drafter_obj = None
        if drafter is not None:
            from dartcore.drafter import DartDrafter

            drafter_obj = DartDrafter.from_pretrained(drafter, model, tokenizer=tokenizer)
        index_obj = None
        if index is not None:
            from dartcore.index import NgramIndex

            # The quick check (CRCs of the small sections, sampled body checks: tens of ms at any
            # size) so that a damaged body is an error here, not wrong probabilities later.
            index_obj = NgramIndex(index, verify="quick")
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

    def generate_batch(self, prompts, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                       top_k: int = 0, stop: str | Sequence[str] | None = None, seed: int | None = None,
                       max_batch: int = 16, budget: int | str | None = None) -> list[GenerationResult]:
        """:meth:`generate` for several prompts decoded together by the batched engine
        (:class:`dartcore.engine.Engine`): one result per prompt, in order. ``prompts`` is a
        non-empty list of prompts of one kind (strings, token-id sequences, or chat message
        lists); at most ``max_batch`` decode at once, the rest wait for a free slot.
        ``budget``: nodes per sequence per round (default the decoder's ``max_nodes``, as
        ``generate``; 0 = plain AR) or ``"adaptive"`` (the budget controller). Prompt i
        samples with seed ``seed + i`` (None: unseeded). Under greedy decoding every result
        equals ``generate`` on that prompt alone. Per-stage times are the engine's
        (``GenerationStats.seconds`` stays zero here)."""
        from dartcore.engine import Engine, SamplingParams as RequestParams

        if isinstance(prompts, (str, dict)) or not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts (strings, token ids or chat messages), got "
                            f"{type(prompts).__name__}; for one prompt use generate()")
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        kinds = {_prompt_kind(p) for p in prompts}
        if len(kinds) > 1:
            raise TypeError(f"prompts mixes {' and '.join(sorted(kinds))}: give prompts of one kind")
        seed = check_seed(seed)
        params = [RequestParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=None if seed is None else seed + i, stop=stop or ()) for i in range(len(prompts))]
        ids = []
        for i, p in enumerate(prompts):
            try:
                ids.append(self._prompt_ids(p))
            except (TypeError, ValueError) as e:
                raise type(e)(f"prompts[{i}]: {e}") from None
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        # room for the prompt, the output and one tree of the largest budget a round can get
        nodes = max(self.max_nodes, getattr(self.drafter, "d", 0)) if budget == "adaptive" else (
            self.max_nodes if budget is None or not isinstance(budget, int) else budget)
        capacity = min(self.context_length, max(len(x) for x in ids) + params[0].max_new_tokens + nodes + 1)
        engine = Engine(self, max_batch=min(len(prompts), max_batch), max_seq_len=max(capacity, 2),
                        budget=self.max_nodes if budget is None else budget)
        start = time.perf_counter()
        rids = [engine.add_request(x, p) for x, p in zip(ids, params)]
        done: dict[str, tuple[float, Any]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (time.perf_counter(), out)
        results = []
        for rid in rids:
            t, out = done[rid]
            stats = GenerationStats(prompt_tokens=out.stats["prompt_tokens"], new_tokens=len(out.tokens),
                                    rounds=out.stats["rounds"], accept_hist=out.stats["accept_hist"],
                                    budget_hist=out.stats["budget_hist"], total_s=t - start,
                                    finish_reason=out.stats.get("finish_detail") or "empty")
            results.append(GenerationResult(tokens=list(out.tokens), text=self._decode(out.tokens), stats=stats))
        return results

    def stream(self, prompt, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int = 0, stop: str | Sequence[str] | None = None,
               seed: int | None = None) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, as an iterator of :class:`StreamChunk`; the last
        chunk carries the :class:`GenerationResult`. Arguments are checked
        before the first chunk."""
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        if isinstance(max_new_tokens, (bool, np.bool_)) or not isinstance(max_new_tokens, (int, np.integer)):
            raise TypeError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r} "
                            f"({type(max_new_tokens).__name__})")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        seed = check_seed(seed)
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
        clock = _Clock(stats, self.backend)
        seq = self._start(ids, max_new_tokens, sampler, stops, stats, generated)
        done = self._prefill(seq)
        clock.lap("prefill")
        yield list(generated)
        clock.lap("accept")  # the consumer's time (text decoding, streaming) counts as "other"
        while not done:
            with self.backend.round_scope():
                max_depth, _ = self._limits(seq)  # sets seq.budget
                (drafted,) = self._draft([seq], [max_depth])
                clock.lap("draft")
                (tree,) = self._search([seq], [drafted], [max_depth])
                clock.lap("search")
                (out,) = self._verify([seq], [tree])
                clock.lap("verify")
                base = len(generated)
                done = self._accept(seq, tree, out)
            clock.lap("accept")
            yield generated[base:]
            clock.lap("accept")

    # -- the steps of a round ---------------------------------------------------------------

    def _start(self, ids: list[int], max_new_tokens: int, sampler: Sampler, stops: list[str],
               stats: GenerationStats, generated: list[int], *, cache: KVCache | None = None,
               drafter_state=None) -> _Sequence:
        """A sequence's state; its caches sized for the prompt, the output and one tree, or
        the given ones (a slot of the engine's pool)."""
        if cache is None:
            capacity = min(self.context_length, len(ids) + max_new_tokens + self.max_nodes + 1)
            cache = self.target.new_cache(capacity)
            drafter_state = self.drafter.new_state(cache.capacity) if self.drafter is not None else None
        return _Sequence(cache=cache, drafter_state=drafter_state, committed=list(ids), generated=generated,
                         max_new_tokens=max_new_tokens, stops=stops, sampler=sampler, stats=stats,
                         limit=min(self.context_length, cache.capacity))

    def _taps(self) -> tuple[int, ...]:
        return tuple(self.drafter.taps) if self.drafter is not None else ()

    def _prefill(self, seq: _Sequence) -> bool:
        """The prompt through the target; its next token is the first one generated (and the
        first tree's root). True when generation is already over."""
        ids = seq.committed
        out = self.target.forward(seq.cache, torch.tensor(ids, dtype=torch.long), torch.arange(len(ids)),
                                  taps=self._taps(), logits_rows=slice(-1, None))
        seq.cache.commit(len(ids))
        token = seq.sampler.choose(out.logits[-1])
        seq.new_taps, seq.new_next = out.taps, list(ids[1:]) + [token]
        seq.committed.append(token)
        return self._commit(seq, [token])

    def _limits(self, seq: _Sequence, max_nodes: int | None = None) -> tuple[int, int]:
        """This round's deepest usable node and node budget (root excluded): the one place
        the budget is decided (``max_nodes``, by default the decoder's, capped by the room
        left in the caches); the builder receives exactly that. Sets ``seq.budget``."""
        max_depth = min(seq.max_new_tokens - len(seq.generated), seq.limit - len(seq.committed)) - 1
        asked = self.max_nodes if max_nodes is None else max_nodes
        # No node fits when one token is left (max_depth 0): that round is a plain step.
        seq.budget = max(0, min(asked, seq.cache.capacity - seq.prefix - 1)) if max_depth > 0 else 0
        return max_depth, seq.budget

    def _draft(self, seqs: list[_Sequence], depths: list[int]) -> list[_Drafted]:
        """One drafter pass over the positions each sequence committed since it last drafted:
        d rows of logits per sequence (no more rows than its tree can use). Sequences with
        nothing to draft (budget 0, or one token left) skip it; their positions wait."""
        out = [_Drafted() for _ in seqs]
        drafter = self.drafter
        if drafter is None:
            return out
        todo = [i for i, (seq, depth) in enumerate(zip(seqs, depths)) if depth > 0 and seq.budget > 0]
        if not todo:
            return out
        # A tree of `budget` nodes is never deeper than `budget`: draft no more rows than that.
        rows = [min(drafter.d, seqs[i].budget, depths[i]) for i in todo]
        want_hidden = self.builder.needs_hidden
        results = self.backend.draft_batch(
            drafter, [seqs[i].drafter_state for i in todo], [seqs[i].new_taps for i in todo],
            [torch.tensor(seqs[i].new_next, dtype=torch.long) for i in todo], rows=rows, return_hidden=want_hidden)
        for i, r in zip(todo, results):
            out[i] = _Drafted(*r) if want_hidden else _Drafted(logits=r)
            seqs[i].new_taps, seqs[i].new_next = None, []  # now in the drafter's state
        return out

    def _search(self, seqs: list[_Sequence], drafted: list[_Drafted], depths: list[int]) -> list[Tree]:
        """Each sequence's draft tree, rooted at its last committed token: the DART beam
        search for all of them in one native call per (depth, budget) group where the
        builder is the plain Eq. (10) one, else one builder call per sequence."""
        trees: list[Tree | None] = [None] * len(seqs)
        work = [i for i, (seq, depth) in enumerate(zip(seqs, depths)) if depth > 0 and seq.budget > 0]
        for i in range(len(seqs)):
            if i not in work:
                trees[i] = root_only(seqs[i].committed[-1])
        if len(work) > 1 and type(self.builder) is BeamBuilder and all(drafted[i].logits is not None for i in work):
            self._beam_batch(seqs, drafted, depths, work, trees)
        for i in work:
            seq, depth = seqs[i], depths[i]
            tree = trees[i]
            if tree is None:
                tree = self.builder(TreeInputs(
                    context=np.asarray(seq.committed, dtype=np.int64), logits=drafted[i].logits,
                    hidden=drafted[i].hidden, drafter=self.drafter, index=self.index, max_depth=depth,
                    max_nodes=seq.budget, eos_token_ids=self.eos_token_ids,
                ))
            # The built-in builders keep to the budget; a custom one that does not is cut to it.
            tree = prune(flatten(tree), max_depth=depth, max_nodes=seq.budget + 1)
            if int(tree.tokens[0]) != seq.committed[-1]:
                raise TreeError(f"tree root {int(tree.tokens[0])} is not the last committed token {seq.committed[-1]}")
            trees[i] = tree
        return trees

    def _beam_batch(self, seqs, drafted, depths, work, trees) -> None:
        """``beam_search_batch`` for the sequences ``work`` (see :meth:`_search`): the top-k of
        every drafter row in one pass, then one native search per (depth, budget) group."""
        from dartcore.tree import beam_search_batch

        builder = self.builder
        logits = torch.cat([drafted[i].logits for i in work])
        tokens, logprobs = _target_topk(TreeInputs(context=np.zeros(1, dtype=np.int64), logits=logits,
                                                   drafter=self.drafter), builder.k)
        groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
        off = 0
        for i in work:
            rows = drafted[i].logits.shape[0]
            groups.setdefault((min(rows, depths[i]), seqs[i].budget), []).append((i, off))
            off += rows
        index = self.index if builder.needs_index else None
        for (depth, budget), members in groups.items():
            tok = np.stack([tokens[o:o + depth] for _, o in members])
            lp = np.stack([logprobs[o:o + depth] for _, o in members])
            built = beam_search_batch(index, [np.asarray(seqs[i].committed, dtype=np.int64) for i, _ in members],
                                      tok, lp, builder.search, max_nodes=budget,
                                      eos_token_ids=tuple(self.eos_token_ids))
            for (i, _), tree in zip(members, built):
                trees[i] = tree

    def _verify(self, seqs: list[_Sequence], trees: list[Tree]) -> list[ForwardOutput]:
        """One target forward over every sequence's tree: node j of sequence i at position
        prefix_i + depth(j), seeing sequence i's cached prefix and j's ancestors."""
        sizes = [len(t) for t in trees]
        tokens = torch.from_numpy(np.concatenate([t.tokens for t in trees]))
        positions = torch.from_numpy(np.concatenate([t.depths + s.prefix for t, s in zip(trees, seqs)]))
        masks = [torch.from_numpy(ancestor_mask(t.parents)) for t in trees]
        out = self.target.forward_batch([s.cache for s in seqs], sizes, tokens, positions, masks, taps=self._taps(),
                                        logits_rows=self.backend.verify_logits_rows())
        if len(seqs) == 1:
            return [out]
        parts, a = [], 0
        every_row = out.logits.shape[0] == out.hidden.shape[0]
        for n in sizes:
            parts.append(ForwardOutput(logits=out.logits[a:a + n] if every_row else out.logits,
                                       taps=None if out.taps is None else out.taps[a:a + n],
                                       hidden=out.hidden[a:a + n]))
            a += n
        return parts

    def _accept(self, seq: _Sequence, tree: Tree, out: ForwardOutput, logits=None) -> bool:
        """Walk the tree with the target's own choices, keep the accepted path's KV entries
        and commit the path + the bonus token. True when generation is over. ``logits``: the
        tree's logits by node when the caller made them (``backend.tree_logits_batch``)."""
        if logits is None:
            logits = self.backend.tree_logits(out, tree.parents)
        acc = accept(tree, logits, seq.sampler)
        seq.cache.compact(acc.path)
        new = [int(t) for t in tree.tokens[acc.path[1:]]] + [acc.bonus]
        seq.stats._count(acc.accepted, len(tree) - 1)
        seq.path = acc.path
        seq.committed.extend(new)
        if self.drafter is not None:
            taps = out.taps[torch.as_tensor(acc.path, device=out.taps.device)]
            # Positions a round without a draft committed wait for the next draft.
            seq.new_taps = taps if seq.new_taps is None else torch.cat((seq.new_taps, taps))
            seq.new_next = seq.new_next + new
        return self._commit(seq, new)

    def _commit(self, seq: _Sequence, new: list[int]) -> bool:
        """Append ``new`` to the output, cut at the first stop condition; True when
        generation is over."""
        generated, stats = seq.generated, seq.stats
        base = len(generated)
        for i, tok in enumerate(new):
            generated.append(tok)
            if tok in self.eos_token_ids:
                stats.finish_reason = "eos"
            elif seq.stops and any(s in self._decode(generated, skip_special=False) for s in seq.stops):
                stats.finish_reason = "stop"
            elif len(generated) >= seq.max_new_tokens:
                stats.finish_reason = "length"
            else:
                continue
            del generated[base + i + 1:]
            return True
        if len(seq.committed) >= seq.limit:
            stats.finish_reason = "context"
            return True
        return False

    # -- helpers -------------------------------------------------------------------------------

    def _decode(self, tokens: list[int], skip_special: bool = True) -> str:
        if not tokens:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special)

    def _prompt_ids(self, prompt) -> list[int]:
        """The prompt as token ids: a string (tokenised), chat messages (the chat template),
        or one flat sequence of integer ids -- a list / tuple of ints, or a 1-D integer
        tensor / array (``[1, n]``, a batch of one, too). Anything else is a TypeError or
        ValueError naming ``prompt``."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one token of text")
            ids = self.tokenizer(prompt)["input_ids"]
            if len(ids) and isinstance(ids[0], list):  # tokenizers may return [[...]]
                ids = ids[0]
            return self._check_ids(list(ids), "the tokenised prompt")
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
            if not all(isinstance(m, dict) for m in prompt):
                raise TypeError("prompt: chat messages must all be dicts {'role': ..., 'content': ...}")
            rendered = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
            if len(ids) and isinstance(ids[0], list):
                ids = ids[0]
            return self._check_ids(list(ids), "the rendered chat prompt")
        if isinstance(prompt, (torch.Tensor, np.ndarray)):
            is_tensor = isinstance(prompt, torch.Tensor)
            integer = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex
                       and prompt.dtype != torch.bool) if is_tensor else prompt.dtype.kind in "iu"
            if not integer:
                raise TypeError(f"prompt must hold integer token ids, got a {type(prompt).__name__} of dtype "
                                f"{prompt.dtype}")
            shape = tuple(prompt.shape)
            if len(shape) == 2 and shape[0] == 1:
                prompt = prompt[0]
            elif len(shape) != 1:
                raise ValueError(f"prompt must be 1-D token ids (or [1, n]): DartDecoder decodes one sequence at a "
                                 f"time (batch size 1), got shape {shape}")
            ids = prompt.detach().cpu().tolist() if is_tensor else prompt.tolist()
            return self._check_ids(ids, "prompt")
        if isinstance(prompt, (list, tuple)):
            for i, t in enumerate(prompt):
                if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                    raise TypeError(f"prompt must be one flat sequence of integer token ids (or a string, or chat "
                                    f"messages); prompt[{i}] is {t!r} ({type(t).__name__})")
            return self._check_ids([int(t) for t in prompt], "prompt")
        raise TypeError(f"prompt must be a string, token ids or chat messages, not {type(prompt).__name__}")

    def _check_ids(self, ids: list, what: str) -> list[int]:
        if len(ids) == 0:
            raise ValueError(f"empty prompt: {what} has no tokens (give at least one)")
        ids = [int(t) for t in ids]
        vocab = self.target.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the target's vocabulary [0, {vocab})")
        return ids


def _prompt_kind(prompt) -> str:
    """What kind of prompt ``prompt`` is, for generate_batch's one-kind check."""
    if isinstance(prompt, str):
        return "strings"
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return "chat messages"
    return "token ids"


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


def _tokenizer_name(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "name", None)
    return repr(name) if name else type(tokenizer).__name__


def _check_index(index, tokenizer, target: TargetModel) -> None:
    """Refuse an index built with another tokenizer (by its recorded fingerprint), or one
    whose vocabulary the target cannot produce; warn when it records no tokenizer."""
    meta = getattr(index, "metadata", None) or {}
    info = (meta.get("tokenizer") or {}) if isinstance(meta, dict) else {}
    recorded = info.get("fingerprint") if isinstance(info, dict) else None
    vocab = getattr(index, "vocab_size", None)
    if vocab is not None and int(vocab) > target.vocab_size:
        raise TokenizerMismatchError(
            f"the n-gram index has a vocabulary of {int(vocab)} tokens but the target only {target.vocab_size}: it "
            "was built with another tokenizer; rebuild it with the target's (ngram-build --tokenizer ...)")
    if recorded is None:
        checked = (f"; only its vocabulary size was checked ({int(vocab)} <= {target.vocab_size})"
                   if vocab is not None else "")
        warnings.warn("the n-gram index records no tokenizer, so dartcore cannot check that it was built with the "
                      f"target's tokenizer ({_tokenizer_name(tokenizer)}){checked}. Build indexes with ngram-build "
                      "--tokenizer ...", stacklevel=3)
        return
    from dartcore.errors import TokenizerError
    from dartcore.tokenizers import fingerprint

    try:
        mine = fingerprint(tokenizer)
    except TokenizerError:
        return  # a custom tokenizer dartcore cannot fingerprint: the caller vouches for it
    if recorded != mine:
        name = info.get("name") or "an unnamed tokenizer"
        raise TokenizerMismatchError(
            f"the n-gram index was built with tokenizer {name!r} (fingerprint {recorded}), but the target's "
            f"tokenizer is {_tokenizer_name(tokenizer)} (fingerprint {mine}): rebuild the index with the target's "
            "tokenizer (ngram-build --tokenizer ...)"
        )


StreamerCallback = Callable[[list[int], str], None]
