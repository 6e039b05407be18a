"""The batched engine: many requests decoded together, step by step (continuous batching).

Per :meth:`Engine.step` (docs/architecture.md, "Batched decoding")::

    admit     queued requests take free KV slots; their prompts run through the target
              (prefill, one forward each) and commit their first token
    budgets   each running sequence's node budget: fixed, or the controller's choice
              (dartcore.controller: expected committed tokens per second of the batch;
              a sequence it lets draft draws a tree of its budget + DRAW_SLACK nodes)
    draft     ONE drafter pass over every drafting sequence's new positions
    search    the trees (beam_search_batch for the DART builder, else per sequence);
              under the controller each tree is then cut to the budget chosen again from
              its own nodes' calibrated chances
    verify    ONE target forward over all trees' rows, each row at its own position under
              its own ancestor mask over its own sequence's prefix
    accept    per sequence: acceptance walk, bonus token, KV compaction, stop checks

The steps are :mod:`dartcore.rounds`' functions, the ones the single-request decoder calls
(each takes a list of sequences), so batch 1 and batch B run the same code and give the
same tokens: under greedy decoding every sequence's output is what ``generate`` gives it
alone. Prompts come in and text goes out through :mod:`dartcore.prompts`; each request's
parameters are one :class:`~dartcore.sampling.SamplingParams`. :meth:`Engine.generate`
is the batch API: a list of prompts in, one result per prompt out.

Memory: one :class:`~dartcore.models.kv_pool.KVPool` of ``max_batch`` slots of
``max_seq_len`` tokens, allocated when the engine is made. More requests than slots wait in
a FIFO queue (:meth:`Engine.num_waiting`) and join as slots free up; nothing is refused for
load. A request whose prompt does not fit a slot is refused at :meth:`Engine.add_request`.
Requests leave at EOS or a stop string (``"stop"``), at ``max_new_tokens`` or a full slot /
context (``"length"``), or by :meth:`Engine.abort` (``"abort"``), without touching the others.

An Engine is used from one thread at a time; ``step()`` holds no lock of its own.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dartcore import rounds
from dartcore.acceptance import keep_nodes
from dartcore.controller import IDLE_STRIDE, Acceptance, BudgetController, CostCurve
from dartcore.errors import ContextLengthError, DartError
from dartcore.live import LiveLayer, live_layer
from dartcore.models.kv_pool import KVPool
from dartcore.prompts import cut_at_stop, decode, prompt_ids, prompt_kind
from dartcore.rounds import GenerationResult, GenerationStats, Parts, StageClock
from dartcore.sampling import DEFAULTS, SamplingParams, check_seed
from dartcore.tree import Tree
from dartcore.trees import ArBuilder

__all__ = [
    "Engine",
    "SamplingParams",
    "RequestOutput",
    "EngineStats",
    "StepStats",
    "UnknownRequestError",
    "batch_ids",
]
# SamplingParams is dartcore.sampling's (re-exported: the request parameters have one class)

STEP_STAGES = ("prefill", "controller", "draft", "search", "verify", "accept")
# Engine steps whose stats are kept one by one (the totals cover every step).
KEEP_STEPS = 4096
MAX_BATCH = 256


class UnknownRequestError(DartError, KeyError):
    """``abort`` (or a lookup) of a request id the engine does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


@dataclass
class RequestOutput:
    request_id: str
    # committed in this step (accepted path + bonus; the first token at admission)
    new_tokens: list[int]
    tokens: list[int]  # all generated so far
    finished: bool
    finish_reason: str | None  # "stop" (EOS or a stop string), "length", "abort", or None
    stats: dict
    text: str | None = None  # on the finished output: the decoded text, cut before a stop string


@dataclass
class StepStats:
    """One engine step."""

    sequences: int = 0  # sequences that took a round (newly admitted ones only prefilled)
    admitted: int = 0
    rows_verified: int = 0
    budgets: list[int] = field(default_factory=list)
    committed: int = 0  # tokens committed by the round (the prefills' first tokens not counted)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_STAGES, 0.0))
    total_s: float = 0.0


@dataclass
class EngineStats:
    """Per engine step (the last KEEP_STEPS) and totals over every step."""

    steps: deque = field(default_factory=lambda: deque(maxlen=KEEP_STEPS))
    num_steps: int = 0
    rows_verified: int = 0
    committed: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_STAGES, 0.0))
    total_s: float = 0.0

    def add(self, step: StepStats) -> None:
        self.steps.append(step)
        self.num_steps += 1
        self.rows_verified += step.rows_verified
        self.committed += step.committed
        for k, v in step.seconds.items():
            self.seconds[k] += v
        self.total_s += step.total_s

    @property
    def controller_s(self) -> float:
        return self.seconds["controller"]

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "rows_verified": self.rows_verified,
            "committed": self.committed,
            "seconds": dict(self.seconds),
            "total_s": self.total_s,
            "mean_rows_per_step": self.rows_verified / max(self.num_steps, 1),
        }


@dataclass
class _Request:
    request_id: str
    ids: list[int]
    params: SamplingParams
    seq: rounds.Sequence | None = None  # once admitted
    slot: int = -1
    acceptance: Acceptance | None = None
    budgets: list[int] = field(default_factory=list)
    arrival: float = 0.0
    live: Any = None  # the request's own live layer (None: the decoder's)


class Engine:
    """Batched speculative decoding over ``decoder`` (a :class:`~dartcore.DartDecoder`, or the
    :class:`~dartcore.rounds.Parts` it runs on): ``max_batch`` sequences at once in a KV pool
    of ``max_seq_len`` tokens per sequence (None: the decoder's context length), each round's
    node budgets ``budget`` =
    ``"adaptive"`` (the controller) or a fixed number of nodes per sequence (0 = plain AR;
    capped by the room a sequence has left). ``max_nodes``: the controller's largest budget
    per sequence (default the drafter's depth d, at least the decoder's ``max_nodes``).
    ``remeasure``: measure the verify-cost curve again instead of reading the cached one
    (adaptive only). ``controller``: a :class:`~dartcore.controller.BudgetController` to go on
    with (adaptive only; made for the same ``max_nodes``): what an earlier engine's controller
    learned (the verify costs, the nodes' calibration, the judge's measured rates) decides
    this engine's first steps, and no cost curve is read. See the module docs."""

    def __init__(
        self,
        decoder,
        max_batch: int = 8,
        max_seq_len: int | None = None,
        budget: str | int = "adaptive",
        *,
        max_nodes: int | None = None,
        remeasure: bool = False,
        controller: BudgetController | None = None,
    ):
        if (
            isinstance(max_batch, (bool, np.bool_))
            or not isinstance(max_batch, (int, np.integer))
            or not 1 <= max_batch <= MAX_BATCH
        ):
            raise ValueError(f"max_batch must be an integer in [1, {MAX_BATCH}], got {max_batch!r}")
        parts: Parts = getattr(decoder, "parts", decoder)
        if max_seq_len is None:
            max_seq_len = parts.context_length
        if (
            isinstance(max_seq_len, (bool, np.bool_))
            or not isinstance(max_seq_len, (int, np.integer))
            or max_seq_len < 2
        ):
            raise ValueError(
                f"max_seq_len must be an integer >= 2 (tokens per sequence), got {max_seq_len!r}"
            )
        if isinstance(budget, str):
            if budget != "adaptive":
                raise ValueError(
                    f"budget must be 'adaptive' or a number of nodes >= 0, got {budget!r}"
                )
        elif (
            isinstance(budget, (bool, np.bool_))
            or not isinstance(budget, (int, np.integer))
            or budget < 0
        ):
            raise ValueError(f"budget must be 'adaptive' or a number of nodes >= 0, got {budget!r}")
        self.parts = parts
        self.max_batch = int(max_batch)
        self.max_seq_len = int(min(max_seq_len, parts.context_length))
        if budget == "adaptive" and isinstance(parts.builder, ArBuilder):
            budget = 0  # the "ar" builder: nothing to choose
        self.budget = budget
        self.pool = KVPool.for_target(
            parts.target, parts.drafter, slots=self.max_batch, capacity=self.max_seq_len
        )
        self.controller: BudgetController | None = None
        self.max_nodes = parts.max_nodes
        if controller is not None and budget != "adaptive":
            raise ValueError(f"a controller goes with budget='adaptive', not budget={budget!r}")
        if budget == "adaptive":
            if max_nodes is None:
                max_nodes = max(parts.max_nodes, getattr(parts.drafter, "d", 0))
            if (
                isinstance(max_nodes, (bool, np.bool_))
                or not isinstance(max_nodes, (int, np.integer))
                or max_nodes < 0
            ):
                raise ValueError(f"max_nodes must be a non-negative integer, got {max_nodes!r}")
            self.max_nodes = int(max_nodes)
            if controller is not None:
                if not isinstance(controller, BudgetController):
                    raise TypeError(
                        f"controller must be a BudgetController, got {type(controller).__name__}"
                    )
                if controller.max_nodes != self.max_nodes:
                    raise ValueError(
                        f"the controller was made for max_nodes={controller.max_nodes}, this "
                        f"engine's is {self.max_nodes}"
                    )
                self.controller = controller
        if budget == "adaptive" and self.controller is None:
            curve = CostCurve.for_target(
                parts.target,
                parts.backend,
                max_rows=self.max_batch * (self.max_nodes + 1),
                remeasure=remeasure,
            )
            self.controller = BudgetController(
                curve,
                max_nodes=self.max_nodes,
                idle_stride=IDLE_STRIDE,
                # the judge's fixed arm: the decoder's own budget (a CPU's; on a GPU the model's
                # trees are what the budget is for)
                fixed_nodes=min(parts.max_nodes, self.max_nodes)
                if parts.target.device.type == "cpu"
                else 0,
            )
        self.stats = EngineStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}
        self._counter = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        live: LiveLayer | None = None,
    ) -> str:
        """Queue a request (a prompt as :meth:`DartDecoder.generate` takes it); it joins at the
        next :meth:`step`. Returns its id (``request_id`` or a fresh one). ``live``: the
        :class:`~dartcore.live.LiveLayer` its trees read and it is learned into (a tenant's
        own, so tenants cannot time each other); None: the decoder's (``learn=``)."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(
                f"params must be a dartcore.sampling.SamplingParams, got {type(params).__name__}"
            )
        parts = self.parts
        if live is not None:
            if not isinstance(live, LiveLayer):
                raise TypeError(
                    f"live must be a dartcore.live.LiveLayer or None, got {type(live).__name__}"
                )
            live_layer(live, parts.target.vocab_size)  # it must cover the target's ids
        ids = prompt_ids(parts.tokenizer, prompt, parts.target.vocab_size)
        room = min(parts.context_length, self.pool.capacity)
        if len(ids) >= room:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens leaves no room in a sequence of {room} tokens "
                f"(max_seq_len={self.max_seq_len}, context {parts.context_length})"
            )
        if request_id is None:
            request_id = f"req-{next(self._counter)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._counter)}"
        elif not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty string or None, got {request_id!r}")
        elif request_id in self._requests:
            raise ValueError(
                f"request_id {request_id!r} is already in the engine: give each request its own id"
            )
        req = _Request(
            request_id=request_id, ids=ids, params=params, arrival=time.perf_counter(), live=live
        )
        self._requests[request_id] = req
        self._waiting.append(req)
        return request_id

    def abort(self, request_id: str) -> RequestOutput:
        """Stop a queued or running request now and free its slot; returns its final output
        (``finish_reason="abort"``, not reported again by :meth:`step`). An id the engine does
        not hold (never added, or already finished) raises :class:`UnknownRequestError`."""
        req = self._requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            raise UnknownRequestError(
                f"abort: no request {request_id!r} in the engine (finished requests leave "
                "it; ids come from add_request)"
            )
        if req.seq is None:
            self._waiting.remove(req)
        else:
            self._running.remove(req)
        out = self._output(req, [], "abort")
        self._finish(req)
        return out

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def num_waiting(self) -> int:
        return len(self._waiting)

    def num_running(self) -> int:
        return len(self._running)

    # -- the batch API ------------------------------------------------------------------------

    @classmethod
    def for_prompts(
        cls,
        decoder,
        prompts,
        *,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        max_batch: int = 16,
        budget: int | str | None = None,
        controller: BudgetController | None = None,
    ) -> Engine:
        """An engine sized for :meth:`generate` on ``prompts``: at most ``max_batch`` slots (no more
        than there are prompts), each with room for the longest prompt, the output and one tree
        of the largest budget a round can get. ``budget``: nodes per sequence per round (None:
        the decoder's ``max_nodes``; 0 = plain AR) or ``"adaptive"`` (the controller).
        ``controller``: an earlier engine's, gone on with where it fits (adaptive, the same
        ``max_nodes``, a cost curve that covers this engine's rows); otherwise a new one."""
        parts: Parts = getattr(decoder, "parts", decoder)
        ids = batch_ids(parts, prompts)
        params = SamplingParams(max_new_tokens=max_new_tokens)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
        nodes = (
            max(parts.max_nodes, getattr(parts.drafter, "d", 0))
            if budget == "adaptive"
            else (parts.max_nodes if budget is None or not isinstance(budget, int) else budget)
        )
        capacity = min(
            parts.context_length, max(len(x) for x in ids) + params.max_new_tokens + nodes + 1
        )
        batch = min(len(ids), max_batch)
        fits = (
            budget == "adaptive"
            and controller is not None
            and controller.max_nodes == nodes
            and float(controller.curve.rows.max()) >= batch * (nodes + 1)
        )
        return cls(
            parts,
            max_batch=batch,
            max_seq_len=max(capacity, 2),
            budget=parts.max_nodes if budget is None else budget,
            controller=controller if fits else None,
        )

    def generate(
        self,
        prompts,
        *,
        max_new_tokens: int = DEFAULTS.max_new_tokens,
        temperature: float = DEFAULTS.temperature,
        top_p: float = DEFAULTS.top_p,
        top_k: int = DEFAULTS.top_k,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
    ) -> list[GenerationResult]:
        """Decode ``prompts`` (a non-empty list of prompts of one kind: strings, token-id
        sequences, or chat message lists) to the end, together: one result per prompt, in
        order. Prompt i samples with seed ``seed + i`` (None: unseeded). Under greedy decoding
        every result equals ``DartDecoder.generate`` on that prompt alone. Per-stage times are
        the engine's (``GenerationStats.seconds`` stays zero here); ``total_s`` runs from the
        call to the request's end. The engine must hold no other request (their outputs would
        be lost here): drive those with :meth:`add_request` / :meth:`step`."""
        if self.has_unfinished():
            raise DartError(
                f"Engine.generate needs an idle engine; this one holds {self.num_waiting()} queued and "
                f"{self.num_running()} running requests: finish them with step() first"
            )
        ids = batch_ids(self.parts, prompts)
        seed = check_seed(seed)
        params = [
            SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=None if seed is None else seed + i,
                stop=stop,
            )
            for i in range(len(ids))
        ]
        start = time.perf_counter()
        rids = [self.add_request(x, p) for x, p in zip(ids, params)]
        done: dict[str, tuple[float, RequestOutput]] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    done[out.request_id] = (time.perf_counter(), out)
        results = []
        for rid in rids:
            t, out = done[rid]
            stats = GenerationStats(
                prompt_tokens=out.stats["prompt_tokens"],
                new_tokens=len(out.tokens),
                rounds=out.stats["rounds"],
                accept_hist=out.stats["accept_hist"],
                budget_hist=out.stats["budget_hist"],
                total_s=t - start,
                finish_reason=out.stats.get("finish_detail") or "empty",
            )
            results.append(
                GenerationResult(
                    tokens=list(out.tokens),
                    text=decode(self.parts.tokenizer, out.tokens),
                    stats=stats,
                )
            )
        return results

    # -- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Admit queued requests into free slots (prefill: their first token), then one round
        for every other running sequence. Returns one output per request that committed
        tokens or finished in this step."""
        parts = self.parts
        st = StepStats()
        t_start = time.perf_counter()
        clock = StageClock(st.seconds, parts.backend)
        outputs: list[RequestOutput] = []

        running = list(self._running)  # the sequences that take a round this step
        while self._waiting and self.pool.free:
            req = self._waiting.popleft()
            out = self._admit(req)
            st.admitted += 1
            if out is not None:
                outputs.append(out)
        clock.lap("prefill")

        if running:
            seqs = [r.seq for r in running]
            with parts.backend.round_scope():
                fixed = None if self.controller is not None else self.budget
                depths = []
                caps = []
                for seq in seqs:
                    depth, cap = rounds.limits(
                        parts, seq, self.max_nodes if fixed is None else fixed
                    )
                    depths.append(depth)
                    caps.append(cap)
                if self.controller is not None:
                    # who draws a tree, and of how many nodes
                    for seq, n in zip(
                        seqs, self.controller.draws([r.acceptance for r in running], caps)
                    ):
                        seq.budget = n
                clock.lap("controller")
                drafting = any(seq.budget > 0 for seq in seqs)
                # a trusted repeat is verified even where the controller stopped drafting
                # (idle: it costs a lookup); a step of such chains alone is not a drafting
                # step to the judge, and not a plain one either (more rows than sequences)
                planned = rounds.plan(
                    parts, seqs, depths, idle=self.controller is not None and self.max_nodes > 0
                )
                drew = drafting or planned
                if drew:
                    drafted = rounds.draft(parts, seqs, depths)
                    clock.lap("draft")
                    trees = rounds.search(parts, seqs, drafted, depths)
                    clock.lap("search")
                    if self.controller is not None and drafting:
                        trees = self._refine(running, trees)
                        clock.lap("controller")
                    outs = rounds.verify(parts, seqs, trees)
                    clock.lap("verify")
                    logits = parts.backend.tree_logits_batch(outs, trees)
                    for req, seq, tree, out, lg in zip(running, seqs, trees, outs, logits):
                        base = len(seq.generated)
                        done = rounds.accept(parts, seq, tree, out, lg)
                        req.budgets.append(len(tree) - 1)
                        if self.controller is not None:
                            self.controller.observe_verified(
                                tree, seq.path, calibrate=not seq.planned
                            )
                        self._emit(req, seq.generated[base:], done, st, outputs)
                    budgets = [len(t) - 1 for t in trees]
                else:  # a plain step for every sequence: nothing to draft, search or cut
                    dones = rounds.plain(parts, seqs, clock)
                    if self.controller is not None:
                        self.controller.observe_plain(len(seqs))
                    for req, seq, done in zip(running, seqs, dones):
                        req.budgets.append(0)
                        self._emit(req, seq.generated[-1:], done, st, outputs)
                    budgets = [0] * len(seqs)
            clock.lap("accept")
            st.sequences = len(seqs)
            st.rows_verified = len(seqs) + sum(budgets)
            st.budgets = budgets
            if self.controller is not None:
                self.controller.lap_ms(1e3 * st.seconds["controller"])
                self.controller.timed(
                    rows=st.rows_verified,
                    verify_ms=1e3 * st.seconds["verify"],
                    draft_ms=1e3 * (st.seconds["draft"] + st.seconds["search"])
                    if drafting
                    else None,
                    per_token_ms=1e3 * st.seconds["accept"] / max(st.committed, 1),
                )
        st.total_s = time.perf_counter() - t_start
        self.stats.add(st)
        return outputs

    # -- helpers ------------------------------------------------------------------------------

    def _emit(
        self, req: _Request, new: list[int], done: bool, st: StepStats, outputs: list
    ) -> None:
        """A running request's output of this step (``new``: the tokens it committed); a
        finished one leaves the engine."""
        st.committed += len(new)
        if done:
            self._running.remove(req)
            outputs.append(self._output(req, new, _reason(req.seq.stats.finish_reason)))
            self._finish(req)
        else:
            outputs.append(self._output(req, new, None))

    def _refine(self, running: list[_Request], trees: list[Tree]) -> list[Tree]:
        """The controller's second decision (dartcore.controller): each drawn tree's nodes
        ranked by their calibrated chances, the budgets chosen again from them, and each tree
        cut to its best ``n_i`` nodes (an ancestor-closed subtree). A planned tree (a trusted
        suffix match, no draft) carries no drafter scores to rank: it stays as it is."""
        ctrl = self.controller
        ranked = []
        for req, tree in zip(running, trees):
            if len(tree) > 1 and not req.seq.planned:
                order, marginals = ctrl.ranked(tree)
                ctrl.observe_tree(req.acceptance, marginals, req.seq.budget)
            else:
                order, marginals = np.zeros(0, dtype=np.int64), np.zeros(0)
            ranked.append((order, marginals))
        budgets = ctrl.refine([m for _, m in ranked])
        out = []
        for req, tree, (order, _), n in zip(running, trees, ranked, budgets):
            if req.seq.planned:
                n = len(tree) - 1
            elif n < len(tree) - 1:
                tree = keep_nodes(tree, np.concatenate(([0], np.sort(order[:n]))))
            req.seq.budget = n
            out.append(tree)
        return out

    def _admit(self, req: _Request) -> RequestOutput | None:
        p = req.params
        stats = GenerationStats(prompt_tokens=len(req.ids))
        req.slot, cache, dstate = self.pool.acquire()
        req.seq = rounds.new_sequence(
            self.parts,
            req.ids,
            p.max_new_tokens,
            p.sampler(),
            p.stop,
            stats,
            cache=cache,
            drafter_state=dstate,
            live=req.live,
        )
        if self.controller is not None:
            req.acceptance = self.controller.new_sequence()
        if p.max_new_tokens == 0:
            stats.finish_reason = "empty"
            out = self._output(req, [], "length")
            self._finish(req)
            return out
        done = rounds.prefill(self.parts, req.seq)
        if done:
            out = self._output(req, list(req.seq.generated), _reason(stats.finish_reason))
            self._finish(req)
            return out
        self._running.append(req)
        return self._output(req, list(req.seq.generated), None)

    def _finish(self, req: _Request) -> None:
        live, seq = self.parts.live if req.live is None else req.live, req.seq
        if live is not None and seq is not None and seq.generated and req.params.learn:
            live.learn(req.ids, seq.generated)
        if req.slot >= 0:
            self.pool.release(req.slot)
            req.slot = -1
        self._requests.pop(req.request_id, None)

    def _output(self, req: _Request, new: list[int], reason: str | None) -> RequestOutput:
        seq = req.seq
        tokens = list(seq.generated) if seq is not None else []
        stats = {
            "rounds": 0,
            "tau": 0.0,
            "accept_hist": [],
            "budget_hist": [],
            "budgets": list(req.budgets),
            "prompt_tokens": len(req.ids),
            "new_tokens": len(tokens),
        }
        if seq is not None:
            s = seq.stats
            stats.update(
                rounds=s.rounds,
                tau=s.tau,
                accept_hist=list(s.accept_hist),
                budget_hist=list(s.budget_hist),
                finish_detail=s.finish_reason or None,
            )
        text = None
        if reason is not None:  # the text ends before the stop string
            text = cut_at_stop(decode(self.parts.tokenizer, tokens), req.params.stop)
        return RequestOutput(
            request_id=req.request_id,
            new_tokens=list(new),
            tokens=tokens,
            finished=reason is not None,
            finish_reason=reason,
            stats=stats,
            text=text,
        )


def batch_ids(parts: Parts, prompts) -> list[list[int]]:
    """``prompts`` (a non-empty list of prompts of one kind) as token ids; errors name the prompt."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, (list, tuple)):
        raise TypeError(
            f"prompts must be a list of prompts (strings, token ids or chat messages), got "
            f"{type(prompts).__name__}; for one prompt use generate()"
        )
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    kinds = {prompt_kind(p) for p in prompts}
    if len(kinds) > 1:
        raise TypeError(f"prompts mixes {' and '.join(sorted(kinds))}: give prompts of one kind")
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(prompt_ids(parts.tokenizer, p, parts.target.vocab_size))
        except (TypeError, ValueError) as e:
            raise type(e)(f"prompts[{i}]: {e}") from None
    return ids


def _reason(detail: str) -> str:
    """The decoder's finish reason as the engine reports it."""
    return {
        "eos": "stop",
        "stop": "stop",
        "length": "length",
        "context": "length",
        "empty": "length",
    }.get(detail, "length")
