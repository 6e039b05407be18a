"""DartDecoder: lossless speculative decoding with a drafter, a trigram index
and tree verification, one request at a time.

The loop is :mod:`dartcore.rounds`' (docs/architecture.md, "Data flow")::

    prefill once, then per round until done:
    limits  the round's depth and node budget
    draft   drafter(taps of the newly committed positions, their next tokens) -> d rows of logits
    search  tree builder(logits, context, index) -> tree rooted at the last committed token
    verify  one target forward over the flattened tree (positions L + depth, ancestor mask)
    accept  walk the tree with the target's own choices -> path + bonus token;
            keep only the path's KV entries, compacted in place; stop checks

The batched engine (:mod:`dartcore.engine`, ``generate_batch``) calls the same round functions
over all its running sequences. Prompts come in and text goes out through :mod:`dartcore.prompts`;
the request's parameters are one :class:`~dartcore.sampling.SamplingParams`.

The plain autoregressive baseline is the same loop with the ``ar`` builder (the tree is the root
alone), so speedups compare like with like.

Output is the target's: under greedy decoding token for token what
``model.generate(do_sample=False)`` produces, under sampling the same distribution as the AR
sampler (one :class:`~dartcore.sampling.Sampler` for both).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dartcore import rounds
from dartcore.errors import ContextLengthError
from dartcore.fit import check_drafter, check_index, check_needs, eos_ids
from dartcore.live import live_layer
from dartcore.models.backend import backend_for
from dartcore.models.hybrid import make_target
from dartcore.prompts import TextStream, decode, prompt_ids
from dartcore.rounds import GenerationResult, GenerationStats, Parts, StageClock
from dartcore.sampling import DEFAULTS, SamplingParams
from dartcore.trees import default_tree, make_tree_builder, node_budget

__all__ = ["DartDecoder", "GenerationResult", "GenerationStats", "StreamChunk"]


@dataclass
class StreamChunk:
    tokens: list[int]  # tokens committed since the previous chunk
    text: str  # text they add (held back while a multi-byte character is incomplete)
    result: GenerationResult | None = None  # set on the last chunk only


def _part(name: str, doc: str) -> property:
    """A decoder attribute that lives in its :class:`~dartcore.rounds.Parts` (settable)."""
    return property(
        lambda self: getattr(self.parts, name),
        lambda self, value: setattr(self.parts, name, value),
        doc=doc,
    )


class DartDecoder:
    """Speculative decoding of a Hugging Face Llama / Qwen3 target, or of a hybrid Gated
    DeltaNet one (Qwen3-Next, Qwen3.5: :mod:`dartcore.models.hybrid`).

    ``DartDecoder(model, tokenizer, drafter=None, index=None, *, tree=None, device=None,
    dtype=None, **tree_params)``: ``model`` is a loaded HF causal LM (moved in place when
    ``device`` / ``dtype`` are given), ``drafter`` a :class:`dartcore.DartDrafter` for this
    target, ``index`` a :class:`dartcore.NgramIndex` built with the target's tokenizer, ``tree``
    a registered tree builder (``dart``, ``dart+live``, ``dart-chain``, ``ngram-only``, ``ar``,
    ...; see :mod:`dartcore.trees`; None: :func:`~dartcore.trees.default_tree`, ``dart+live``
    on CPU, ``dart`` on CUDA) and ``tree_params`` its parameters (``max_nodes``,
    ``beam_width``, ``k``, ...). The node budget, ``decoder.max_nodes``, defaults to
    ``CPU_MAX_NODES`` (4) on CPU (``CPU_BLOCKS_MAX_NODES``, 2, for a target of GGML block
    weights) and to the paper's ``GPU_MAX_NODES`` (59) on CUDA
    (:func:`dartcore.trees.node_budget`). The drafter is moved to the target's device.
    ``max_context`` caps the context below the model's ``max_position_embeddings``;
    ``eos_token_ids`` overrides the EOS ids read from the generation config and tokenizer
    (``()`` = never stop on EOS). ``learn`` (False, True or a shared
    :class:`~dartcore.live.LiveLayer`): finished requests go into a live n-gram layer that the
    ``dart+live`` / ``dart+mix`` / ``suffix`` trees read (:mod:`dartcore.live`); outputs never
    change, only speed. ``lazy_logits`` (default: on for CPU without the native
    kernels, off otherwise) computes the LM head only for the tree nodes the acceptance walk
    visits. ``draft_numerics`` (``"exact"`` / ``"int8"``, default the target's): the drafter's
    products on the native CPU backend, fp16 weights or Q4_0 blocks (drafts only). Device and
    CPU specifics (weight layouts, native kernels, lazy logits) are the
    ``backend``'s (:mod:`dartcore.models.backend`), chosen here once.
    """

    target = _part("target", "the :class:`~dartcore.models.transformer.TargetModel`")
    backend = _part("backend", "device and CPU specifics (:mod:`dartcore.models.backend`)")
    builder = _part("builder", "the tree builder")
    tokenizer = _part("tokenizer", "the target's tokenizer")
    drafter = _part("drafter", "the drafter, or None when the builder needs none")
    index = _part("index", "the n-gram index, or None")
    eos_token_ids = _part("eos_token_ids", "tokens that end generation")
    max_nodes = _part("max_nodes", "the node budget per round (root excluded)")
    context_length = _part("context_length", "tokens a sequence may reach")

    def __init__(
        self,
        model,
        tokenizer,
        drafter=None,
        index=None,
        *,
        tree: str | None = None,
        device=None,
        dtype=None,
        max_context: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        lazy_logits: bool | None = None,
        learn=False,
        draft_numerics: str | None = None,
        **tree_params,
    ):
        if device is not None or dtype is not None:
            model.to(device=device, dtype=dtype)
        model.eval()
        target = make_target(model)  # TargetModel, or HybridTarget for a hybrid family
        backend = backend_for(target, lazy_logits=lazy_logits, draft_numerics=draft_numerics)
        self.tree = tree = default_tree(target.device.type) if tree is None else tree
        builder = make_tree_builder(tree, **tree_params)
        check_needs(tree, builder, drafter, index)
        if not builder.needs_drafter:
            drafter = None
        if drafter is not None:
            check_drafter(drafter, target, tokenizer)
            drafter = backend.prepare_drafter(drafter)
        if index is not None:
            check_index(index, tokenizer, target)
        context = target.max_positions or (1 << 31)
        eos = eos_ids(model, tokenizer) if eos_token_ids is None else tuple(map(int, eos_token_ids))
        self.parts = Parts(
            target=target,
            backend=backend,
            builder=builder,
            tokenizer=tokenizer,
            drafter=drafter,
            index=index,
            eos_token_ids=eos,
            # The node budget (root excluded), decided once; each round caps it by the room left.
            max_nodes=node_budget(
                builder,
                drafter=drafter,
                device=target.device.type,
                blocks=bool(getattr(target, "blocks", False)),
            ),
            context_length=min(context, max_context) if max_context else context,
            live=live_layer(learn, target.vocab_size),
        )
        # generate_batch's budget controller under "adaptive", kept from call to call
        self._controller = None

    @property
    def lazy_logits(self) -> bool:
        return self.backend.lazy_logits

    @classmethod
    def from_pretrained(
        cls,
        target,
        drafter=None,
        index=None,
        *,
        tree: str | None = None,
        device=None,
        dtype=None,
        quantized: bool | None = None,
        numerics: str | None = None,
        **tree_params,
    ) -> DartDecoder:
        """Load everything by name or path: ``target`` (e.g. ``"smollm2"``) with ``quantized`` /
        ``numerics`` as :func:`dartcore.models.hub.load_target` loads it (a GGUF target's blocks
        on the integer path where its kernels run by default; ``numerics="exact"`` gives the
        float32 model's outputs), ``drafter`` a drafter directory or name
        (:func:`dartcore.models.hub.load_drafter`), ``index`` an index file, opened as every
        decoding entry point opens one (:data:`dartcore.index.DECODE_VERIFY`, ``DECODE_PREFAULT``)."""
        from dartcore.index import DECODE_PREFAULT, DECODE_VERIFY, NgramIndex
        from dartcore.models.hub import load_drafter, load_target

        model, tokenizer = load_target(
            target, dtype=dtype, device=str(device or "cpu"), quantized=quantized, numerics=numerics
        )
        if drafter is not None:
            drafter = load_drafter(drafter, model, tokenizer)
        if index is not None:
            index = NgramIndex(index, verify=DECODE_VERIFY, prefault=DECODE_PREFAULT)
        return cls(model, tokenizer, drafter, index, tree=tree, device=device, **tree_params)

    # -- public entry points --------------------------------------------------------------

    def generate(
        self,
        prompt,
        *,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        temperature: float = DEFAULTS.temperature,
        top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        streamer=None,
    ) -> GenerationResult:
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
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)
        ids, params = self._open(prompt, max_new_tokens, kw)
        # the chunks' text only for a streamer that reads it (each one decodes the output so far)
        texts = streamer is not None and not hasattr(streamer, "put")
        for chunk in self._stream(ids, params, texts=texts):
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

    def generate_batch(
        self,
        prompts,
        *,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        temperature: float = DEFAULTS.temperature,
        top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        max_batch: int = 16,
        budget: int | str | None = None,
    ) -> list[GenerationResult]:
        """:meth:`generate` for several prompts decoded together by the batched engine
        (:class:`dartcore.engine.Engine`): one result per prompt, in order. ``prompts`` is a
        non-empty list of prompts of one kind (strings, token-id sequences, or chat message
        lists); at most ``max_batch`` decode at once, the rest wait for a free slot.
        ``budget``: nodes per sequence per round (default the decoder's ``max_nodes``, as
        ``generate``; 0 = plain AR) or ``"adaptive"`` (the budget controller). Prompt i
        samples with seed ``seed + i`` (None: unseeded). Under greedy decoding every result
        equals ``generate`` on that prompt alone. Per-stage times are the engine's
        (``GenerationStats.seconds`` stays zero here). Under ``"adaptive"`` the decoder keeps
        its engine's controller, and the next call goes on with what it learned (verify costs,
        the nodes' calibration, the judge's measured rates) instead of learning them again."""
        from dartcore.engine import Engine  # the engine never imports the decoder

        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        SamplingParams(max_new_tokens=max_new_tokens, **kw)  # checked before the engine is made
        size = dict(max_new_tokens=max_new_tokens, max_batch=max_batch, budget=budget)
        engine = Engine.for_prompts(self.parts, prompts, controller=self._controller, **size)
        self._controller = engine.controller or self._controller
        return engine.generate(prompts, max_new_tokens=max_new_tokens, **kw)

    def stream(
        self,
        prompt,
        *,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        temperature: float = DEFAULTS.temperature,
        top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> Iterator[StreamChunk]:
        """Like :meth:`generate`, as an iterator of :class:`StreamChunk`; the last
        chunk carries the :class:`GenerationResult`. Arguments are checked
        before the first chunk."""
        kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, stop=stop, seed=seed)
        return self._stream(*self._open(prompt, max_new_tokens, kw))

    def _open(self, prompt, max_new_tokens, kw) -> tuple[list[int], SamplingParams]:
        """The prompt's token ids and the sampling parameters (``kw``), checked."""
        params = SamplingParams(max_new_tokens=max_new_tokens, **kw)
        ids = prompt_ids(self.tokenizer, prompt, self.target.vocab_size)
        if len(ids) >= self.context_length:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens leaves no room in the context of {self.context_length} tokens"
            )
        return ids, params

    # -- the loop ---------------------------------------------------------------------------

    def _stream(
        self, ids: list[int], params: SamplingParams, *, texts: bool = True
    ) -> Iterator[StreamChunk]:
        """The chunks of one generation; ``texts=False``: each chunk's text left empty (no
        decoding of the output so far each round), the result's text still made."""
        stats = GenerationStats(prompt_tokens=len(ids))
        start = time.perf_counter()
        text = TextStream(self.tokenizer)
        generated: list[int] = []
        if params.max_new_tokens == 0:
            stats.finish_reason = "empty"
        else:
            seq = rounds.new_sequence(
                self.parts, ids, params.max_new_tokens, params.sampler(), params.stop, stats
            )
            generated = seq.generated
            for new in self._rounds(seq):
                yield StreamChunk(tokens=new, text=text.update(generated) if texts else "")
        stats.total_s = time.perf_counter() - start
        stats.new_tokens = len(generated)
        if self.parts.live is not None and generated and params.learn:
            self.parts.live.learn(ids, generated)
        result = GenerationResult(
            tokens=list(generated), text=decode(self.tokenizer, generated), stats=stats
        )
        yield StreamChunk(tokens=[], text=text.finish(result.text) if texts else "", result=result)

    def _rounds(self, seq: rounds.Sequence) -> Iterator[list[int]]:
        """Prefill, then limits / plan / draft / search / verify / accept until done; yields each
        round's committed tokens (already appended to ``seq.generated``)."""
        parts = self.parts
        clock = StageClock(seq.stats.seconds, parts.backend)
        done = rounds.prefill(parts, seq)
        clock.lap("prefill")
        yield list(seq.generated)
        clock.lap("accept")  # the consumer's time (text decoding, streaming) counts as "other"
        while not done:
            with parts.backend.round_scope():
                depth, _ = rounds.limits(parts, seq)
                rounds.plan(parts, [seq], [depth])
                (drafted,) = rounds.draft(parts, [seq], [depth])
                clock.lap("draft")
                (tree,) = rounds.search(parts, [seq], [drafted], [depth])
                clock.lap("search")
                (out,) = rounds.verify(parts, [seq], [tree])
                clock.lap("verify")
                base = len(seq.generated)
                done = rounds.accept(parts, seq, tree, out)
            clock.lap("accept")
            yield seq.generated[base:]
            clock.lap("accept")
