"""The decoding round, as flat functions over one :class:`Parts` object.

One round (docs/architecture.md, "Data flow")::

    limits  the round's deepest usable node and node budget (decided here only)
    plan    the builder's tree where it needs no draft (a trusted suffix match), else nothing
    draft   drafter(taps of the newly committed positions, their next tokens) -> d rows of logits
            (of a prompt or a plain stretch: the first CATCHUP_SINK and the last CATCHUP_WINDOW);
            skipped where :func:`plan` (called first) gave the round's tree (a trusted
            suffix match: trees.LiveBuilder)
    search  tree builder(logits, context, index) -> tree rooted at the last committed token
    verify  one target forward over the flattened tree (positions L + depth, ancestor mask)
    accept  walk the tree with the target's own choices -> path + bonus token;
            keep only the path's KV entries, compacted in place, then ``commit``

after :func:`prefill` has run the prompt once. Each function takes the parts and a
list of :class:`Sequence` (the state one sequence carries between rounds): the
single-request :class:`~dartcore.decoder.DartDecoder` passes one, the batched
:class:`~dartcore.engine.Engine` all its running ones, so batch 1 and batch B run
the same code -- one drafter pass, one target forward over every sequence's tree
rows. Device and CPU specifics are the backend's (:mod:`dartcore.models.backend`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from dartcore.acceptance import accept as walk
from dartcore.acceptance import flatten, prune
from dartcore.errors import TreeError
from dartcore.models.cache import KVCache
from dartcore.models.transformer import ForwardOutput, TargetModel
from dartcore.prompts import stop_hit
from dartcore.sampling import Sampler
from dartcore.tree import Tree, ancestor_mask, beam_search_batch, is_chain
from dartcore.trees import SUFFIX_MAX_NODES, BeamBuilder, TreeInputs, root_only, target_topk

__all__ = [
    "Parts",
    "Sequence",
    "Drafted",
    "GenerationStats",
    "GenerationResult",
    "StageClock",
    "STAGES",
    "CATCHUP_WINDOW",
    "CATCHUP_SINK",
    "new_sequence",
    "prefill",
    "limits",
    "plan",
    "draft",
    "search",
    "verify",
    "accept",
    "plain",
    "commit",
]

STAGES = ("prefill", "draft", "search", "verify", "accept")

# The most recent waiting positions a draft reads: a sequence that commits positions without
# drafting (its prompt, a stretch of plain steps at budget 0) keeps its first CATCHUP_SINK and at
# most CATCHUP_WINDOW + a quarter of the rest; past the window the older ones are dropped and
# the drafter's state starts over from the sink and the last CATCHUP_WINDOW. Measured tau
# (SmolLM2 fp32, its drafter and the bench_batch index, 9 bench_batch prompts, the decoder's
# default budget, 64 new tokens): on the prompts (44-163 tokens) 1.754 with every position,
# 1.569 / 1.682 with only the last 32 / 128, 1.688 with the first 4 and the last 32, 1.754 with
# the first 32 and the last 32; on the prompts + 96 generated tokens 1.849 with every position,
# 1.514 with the last 128, 1.614 with the first 4 and the last 128, 1.832 / 1.828 with the
# first 32 and the last 64 / 128. The drafter leans on the sequence's start (the chat
# template's system turn) and on recent positions, little on the middle.
CATCHUP_WINDOW = 128
CATCHUP_SINK = 32


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
    # [n] = rounds verified with a budget of n nodes
    budget_hist: list[int] = field(default_factory=list)
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

    def count(self, accepted: int, budget: int = 0) -> None:
        """One verified round: ``accepted`` drafted tokens kept of a tree of ``budget`` nodes."""
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


class StageClock:
    """Wall time per stage, added to ``seconds[stage]``; the backend synchronises the device
    so that a stage's kernels count in it."""

    def __init__(self, seconds: dict[str, float], backend):
        self.seconds = seconds
        self.backend = backend
        self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        self.backend.synchronize()
        now = time.perf_counter()
        self.seconds[stage] += now - self.t
        self.t = now


@dataclass
class Parts:
    """What a round runs on: the target, its attention / weights ``backend``, the tree
    ``builder``, the ``drafter`` and n-gram ``index`` (None where the builder needs none), the
    tokenizer (stop strings), the EOS ids, the node budget ``max_nodes`` (root excluded), the
    context length and the live n-gram layer (:mod:`dartcore.live`, or None)."""

    target: TargetModel
    backend: Any
    builder: Any
    tokenizer: Any
    drafter: Any = None
    index: Any = None
    eos_token_ids: tuple[int, ...] = ()
    max_nodes: int = 0
    context_length: int = 1 << 31
    live: Any = None  # the dartcore.live.LiveLayer finished requests go into, or None
    # the most recent waiting positions a draft reads (CATCHUP_WINDOW, after the sequence's
    # first CATCHUP_SINK); more: the drafter starts over
    catchup_window: int = CATCHUP_WINDOW

    @property
    def taps(self) -> tuple[int, ...]:
        return tuple(self.drafter.taps) if self.drafter is not None else ()


@dataclass
class Sequence:
    """Everything one sequence's decoding carries from round to round."""

    cache: KVCache  # every committed token except the newest (the next root)
    drafter_state: Any  # the drafter's KV cache, or None without a drafter
    committed: list[int]  # prompt + output so far; the last one is the next tree's root
    generated: list[int]  # output only
    max_new_tokens: int
    stops: tuple[str, ...]
    sampler: Sampler
    stats: GenerationStats
    # target taps of the positions not yet drafted from, one tensor per round that committed
    # them (joined once, when the sequence drafts: a sequence at budget 0 for many rounds would
    # otherwise copy its whole backlog every round)
    new_taps: list[torch.Tensor] = field(default_factory=list)
    new_next: list[int] = field(default_factory=list)  # the token after each of those positions
    # older waiting positions were dropped (parts.catchup_window): the next draft first cuts
    # the drafter's state to this many rows (its sink: the sequence's first positions), None:
    # nothing dropped; ``head``: the sink positions still waiting, kept at the front
    restart: int | None = None
    head: int = 0
    limit: int = 0  # committed tokens this sequence may reach (the context, or its KV slot)
    budget: int = 0  # this round's node budget
    # the last round's accepted nodes, root first
    path: list[int] = field(default_factory=lambda: [0])
    # this sequence's live n-gram layer (a tenant's, in dart-serve); None: the decoder's
    live: Any = None
    # this round's tree when the builder planned it (no draft, no drafter scores): see plan()
    plan: Tree | None = None
    # this round's view for the builder, made by plan() (search adds the draft); None once
    # tokens are committed (commit)
    inputs: TreeInputs | None = None
    # what the builder's judge noted of this round and when it was planned, until accept
    judged: tuple[Any, float] | None = None
    # this round's draft: (seconds of the drafter pass it was in, steady: no catch-up), or None
    drafted: tuple[float, bool] | None = None
    # what the builder's judge keeps of this sequence's own rounds (trees.ChainJudge: how its
    # drafts fared against the judge's expectation), handed to it in TreeInputs.extra
    judge_notes: dict = field(default_factory=dict)

    @property
    def planned(self) -> bool:
        return self.plan is not None

    @property
    def prefix(self) -> int:
        """Tokens in the target's cache (all committed tokens but the root)."""
        return self.cache.length


@dataclass
class Drafted:
    logits: torch.Tensor | None = None  # [rows, V_draft]
    hidden: torch.Tensor | None = None  # [rows, H] (builders with needs_hidden)


# The rows of one packed verify that chains sized by a suffix match may fill (the native
# layers' row block: a bigger block runs the torch path), shared by a batch's sequences.
CHAIN_ROWS = SUFFIX_MAX_NODES + 1


def _chain_room(seq: Sequence, batch: int) -> int:
    """The most nodes one chain of ``seq`` may take this round: its share of CHAIN_ROWS among
    the ``batch`` sequences verified together, at least its budget."""
    return max(seq.budget, CHAIN_ROWS // batch - 1)


def _inputs(parts: Parts, seq: Sequence, depth: int, batch: int, drafted: Drafted | None = None):
    """The builder's view of one sequence's round (``batch``: see :func:`_chain_room`)."""
    return TreeInputs(
        context=np.asarray(seq.committed, dtype=np.int64),
        logits=None if drafted is None else drafted.logits,
        hidden=None if drafted is None else drafted.hidden,
        drafter=parts.drafter,
        index=parts.index,
        max_depth=depth,
        max_nodes=seq.budget,
        eos_token_ids=parts.eos_token_ids,
        live=parts.live if seq.live is None else seq.live,
        max_chain=_chain_room(seq, batch),
        extra={"request": seq.judge_notes},
    )


def new_sequence(
    parts: Parts,
    ids: list[int],
    max_new_tokens: int,
    sampler: Sampler,
    stops: tuple[str, ...],
    stats: GenerationStats,
    *,
    cache: KVCache | None = None,
    drafter_state=None,
    live=None,
) -> Sequence:
    """A sequence's state; its caches sized for the prompt, the output and one tree, or the
    given ones (a slot of the engine's pool); ``live``: its own live layer (default the
    decoder's, ``parts.live``)."""
    if cache is None:
        capacity = min(parts.context_length, len(ids) + max_new_tokens + parts.max_nodes + 1)
        cache = parts.target.new_cache(capacity)
        drafter_state = (
            parts.drafter.new_state(cache.capacity) if parts.drafter is not None else None
        )
    return Sequence(
        cache=cache,
        drafter_state=drafter_state,
        committed=list(ids),
        generated=[],
        max_new_tokens=max_new_tokens,
        stops=tuple(stops),
        sampler=sampler,
        stats=stats,
        limit=min(parts.context_length, cache.capacity),
        live=live,
    )


def prefill(parts: Parts, seq: Sequence) -> bool:
    """The prompt through the target; its next token is the first one generated (and the
    first tree's root). True when generation is already over."""
    ids = seq.committed
    out = parts.target.forward(
        seq.cache,
        torch.tensor(ids, dtype=torch.long),
        torch.arange(len(ids)),
        taps=parts.taps,
        logits_rows=slice(-1, None),
    )
    seq.cache.commit(len(ids))
    token = seq.sampler.choose(out.logits[-1])
    seq.new_taps, seq.new_next = [], []
    if parts.drafter is not None:
        _wait(parts, seq, out.taps, list(ids[1:]) + [token])
    seq.committed.append(token)
    return commit(parts, seq, [token])


def limits(parts: Parts, seq: Sequence, max_nodes: int | None = None) -> tuple[int, int]:
    """This round's deepest usable node and node budget (root excluded): the one place the
    budget is decided (``max_nodes``, by default the parts', capped by the room left in the
    caches); the builder receives exactly that. Sets ``seq.budget``."""
    max_depth = min(seq.max_new_tokens - len(seq.generated), seq.limit - len(seq.committed)) - 1
    asked = parts.max_nodes if max_nodes is None else max_nodes
    # No node fits when one token is left (max_depth 0): that round is a plain step.
    seq.budget = max(0, min(asked, seq.cache.capacity - seq.prefix - 1)) if max_depth > 0 else 0
    return max_depth, seq.budget


def plan(parts: Parts, seqs: list[Sequence], depths: list[int], *, idle: bool = False) -> bool:
    """Each sequence's tree from the builder's ``plan`` (a trusted suffix match:
    trees.LiveBuilder), decided before any draft, into ``seq.plan`` (else None); True when
    any sequence has one. A builder with ``decide`` (trees.LiveBuilder's judge, for a
    sequence verified alone) hears of each round it chose for from :func:`accept`: the
    tokens it committed, its time since here and its draft's (:func:`draft`). Sequences
    with a node budget plan within it and their room; ``idle=True`` (the engine, when its
    controller has stopped drafting a sequence) also plans for sequences at budget 0,
    within their room alone. Nothing is planned for a
    builder without ``plan``, or when the parts' budget is 0 (speculation off)."""
    fn = getattr(parts.builder, "plan", None)
    decide = getattr(parts.builder, "decide", None)
    for seq, depth in zip(seqs, depths):
        tree = note = seq.inputs = None
        if fn is not None and parts.max_nodes > 0 and depth > 0 and (seq.budget > 0 or idle):
            inputs = seq.inputs = _inputs(parts, seq, depth, len(seqs))
            # the judge times a round: alone in its step, a sequence's round is the step
            if decide is not None:
                tree, note = decide(inputs, judged=len(seqs) == 1)
            else:
                tree, note = fn(inputs), None
        # a root alone is planned only where the builder's judge chose it over a draft
        seq.plan = tree if tree is not None and (len(tree) > 1 or note is not None) else None
        seq.judged = None if note is None else (note, time.perf_counter())
    return any(seq.planned for seq in seqs)


def draft(parts: Parts, seqs: list[Sequence], depths: list[int]) -> list[Drafted]:
    """One drafter pass over the positions each sequence committed since it last drafted
    (the sequence's first and at most ``parts.catchup_window`` last ones, absorbed first: see
    :func:`_catch_up`): d rows of logits per sequence (no more rows than its tree can use).
    Sequences with nothing to draft (budget 0, or one token left) skip it, and so do those
    with a planned tree (:func:`plan`, called first in the round); their positions wait."""
    out = [Drafted() for _ in seqs]
    drafter = parts.drafter
    if drafter is None:
        return out
    todo = [
        i
        for i, (seq, depth) in enumerate(zip(seqs, depths))
        if depth > 0 and seq.budget > 0 and not seq.planned
    ]
    if not todo:
        return out
    # the draft's time, for a builder's judge that hears of the round (see plan)
    timed = any(seqs[i].judged is not None for i in todo)
    t0 = time.perf_counter()
    # a steady draft reads what one round commits; more: a catch-up (a prompt, a stretch of
    # rounds without a draft)
    steady = [len(seqs[i].new_next) <= max(parts.max_nodes, drafter.d) + 1 for i in todo]
    _catch_up(parts, [seqs[i] for i in todo])
    # A tree of `budget` nodes is never deeper than `budget`: draft no more rows than that.
    rows = [min(drafter.d, seqs[i].budget, depths[i]) for i in todo]
    want_hidden = parts.builder.needs_hidden
    results = parts.backend.draft_batch(
        drafter,
        [seqs[i].drafter_state for i in todo],
        [_joined(seqs[i].new_taps) for i in todo],
        [torch.from_numpy(np.array(seqs[i].new_next, dtype=np.int64)) for i in todo],
        rows=rows,
        return_hidden=want_hidden,
    )
    if timed:
        parts.backend.synchronize()
        seconds = time.perf_counter() - t0
    for i, r, st in zip(todo, results, steady):
        out[i] = Drafted(*r) if want_hidden else Drafted(logits=r)
        seqs[i].new_taps, seqs[i].new_next = [], []  # now in the drafter's state
        if timed:
            seqs[i].drafted = (seconds, st)
    return out


def _joined(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _catch_up(parts: Parts, seqs: list[Sequence]) -> None:
    """Before a draft: each sequence's waiting positions cut to the window (its drafter state
    started over where older ones were dropped), and where more wait than a round commits (a
    prompt, a plain stretch) all but the last go into the drafter's state in one
    :meth:`~dartcore.drafter.DartDrafter.absorb` pass for every such sequence, so the draft
    itself reads the few rows of a steady one."""
    drafter = parts.drafter
    long = []
    for seq in seqs:
        _window(seq, parts.catchup_window)
        if seq.restart is not None:
            seq.drafter_state.truncate(seq.restart)
            seq.restart, seq.head = None, 0
        if len(seq.new_next) > drafter.d and hasattr(drafter, "absorb"):
            long.append(seq)
    if not long:
        return
    taps = [_joined(seq.new_taps) for seq in long]
    drafter.absorb(
        [seq.drafter_state for seq in long],
        [t[:-1] for t in taps],
        [torch.tensor(seq.new_next[:-1], dtype=torch.long) for seq in long],
    )
    for seq, t in zip(long, taps):
        seq.new_taps, seq.new_next = [t[-1:]], seq.new_next[-1:]


def _wait(parts: Parts, seq: Sequence, taps: torch.Tensor, new: list[int]) -> None:
    """Positions committed without a draft wait for the next one (their taps, the tokens after
    them); past the window and a quarter the older ones are dropped, so a sequence that runs
    plain keeps at most that many (cut to the window once per quarter window of steps)."""
    seq.new_taps.append(taps)
    seq.new_next.extend(new)
    window = parts.catchup_window
    if len(seq.new_next) > seq.head + window + window // 4:
        _window(seq, window)


def _window(seq: Sequence, window: int) -> None:
    """Keep the last ``window`` waiting positions after the sequence's first
    :data:`CATCHUP_SINK` (its sink); with older ones dropped the drafter starts over from the
    sink and these. In the drafter's state the window follows the sink directly: RoPE scores
    depend on distances, which the window keeps among its own positions."""
    if seq.restart is None:
        # sink rows the state holds already, and those still waiting (a prompt not drafted)
        keep = min(seq.drafter_state.length, CATCHUP_SINK)
        head = min(CATCHUP_SINK - keep, len(seq.new_next))
    else:
        keep, head = seq.restart, seq.head
    if len(seq.new_next) - head <= window:
        return
    taps = _joined(seq.new_taps)
    seq.new_taps = [torch.cat((taps[:head], taps[-window:]))]
    seq.new_next = seq.new_next[:head] + seq.new_next[-window:]
    seq.restart, seq.head = keep, head


def search(
    parts: Parts, seqs: list[Sequence], drafted: list[Drafted], depths: list[int]
) -> list[Tree]:
    """Each sequence's draft tree, rooted at its last committed token: the DART beam search
    for all of them in one native call per (depth, budget) group where the builder is the
    plain Eq. (10) one, else one builder call per sequence."""
    builder = parts.builder
    trees: list[Tree | None] = [None] * len(seqs)
    work = [
        i
        for i, (seq, depth) in enumerate(zip(seqs, depths))
        if depth > 0 and (seq.budget > 0 or seq.planned)
    ]
    for i in range(len(seqs)):
        if i not in work:
            trees[i] = root_only(seqs[i].committed[-1])
    if (
        len(work) > 1
        and type(builder) is BeamBuilder
        and all(drafted[i].logits is not None for i in work)
    ):
        _beam_batch(parts, seqs, drafted, depths, work, trees)
    for i in work:
        seq, depth = seqs[i], depths[i]
        tree = seq.plan if seq.planned else trees[i]
        if tree is None:
            if seq.inputs is None:
                view = _inputs(parts, seq, depth, len(seqs), drafted[i])
            else:  # plan's view of this round (and what the builder found for it there)
                view = replace(seq.inputs, logits=drafted[i].logits, hidden=drafted[i].hidden)
            tree = builder(view)
        tree = flatten(tree)
        # The built-in builders keep to the budget, a chain (and the trees of a builder that
        # sizes its chains by their match) to its room; a custom builder that does not is
        # cut to them.
        cap = seq.budget
        if len(tree) - 1 > cap and (is_chain(tree) or getattr(builder, "sizes_chains", False)):
            cap = _chain_room(seq, len(seqs))
        tree = prune(tree, max_depth=depth, max_nodes=cap + 1)
        if int(tree.tokens[0]) != seq.committed[-1]:
            raise TreeError(
                f"tree root {int(tree.tokens[0])} is not the last committed token {seq.committed[-1]}"
            )
        trees[i] = tree
    return trees


def _beam_batch(parts: Parts, seqs, drafted, depths, work, trees) -> None:
    """``beam_search_batch`` for the sequences ``work`` (see :func:`search`): the top-k of
    every drafter row in one pass, then one native search per (depth, budget) group."""
    builder = parts.builder
    logits = torch.cat([drafted[i].logits for i in work])
    tokens, logprobs = target_topk(
        TreeInputs(context=np.zeros(1, dtype=np.int64), logits=logits, drafter=parts.drafter),
        builder.k,
    )
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    off = 0
    for i in work:
        rows = drafted[i].logits.shape[0]
        groups.setdefault((min(rows, depths[i]), seqs[i].budget), []).append((i, off))
        off += rows
    index = parts.index if builder.needs_index else None
    for (depth, budget), members in groups.items():
        tok = np.stack([tokens[o : o + depth] for _, o in members])
        lp = np.stack([logprobs[o : o + depth] for _, o in members])
        built = beam_search_batch(
            index,
            [np.asarray(seqs[i].committed, dtype=np.int64) for i, _ in members],
            tok,
            lp,
            builder.search,
            max_nodes=budget,
            eos_token_ids=tuple(parts.eos_token_ids),
        )
        for (i, _), tree in zip(members, built):
            trees[i] = tree


def verify(parts: Parts, seqs: list[Sequence], trees: list[Tree]) -> list[ForwardOutput]:
    """One target forward over every sequence's tree: node j of sequence i at position
    prefix_i + depth(j), seeing sequence i's cached prefix and j's ancestors."""
    sizes = [len(t) for t in trees]
    if len(trees) == 1:
        tokens = torch.from_numpy(trees[0].tokens)
        positions = torch.from_numpy(trees[0].depths + seqs[0].prefix)
    else:
        tokens = torch.from_numpy(np.concatenate([t.tokens for t in trees]))
        positions = torch.from_numpy(
            np.concatenate([t.depths + s.prefix for t, s in zip(trees, seqs)])
        )
    # one row sees only itself: the causal mask (None) is its ancestor mask
    masks = [torch.from_numpy(ancestor_mask(t.parents)) if len(t) > 1 else None for t in trees]
    out = parts.target.forward_batch(
        [s.cache for s in seqs],
        sizes,
        tokens,
        positions,
        masks,
        taps=parts.taps,
        logits_rows=parts.backend.verify_logits_rows(),
    )
    if len(seqs) == 1:
        return [out]
    split, a = [], 0
    every_row = out.logits.shape[0] == out.hidden.shape[0]
    for n in sizes:
        split.append(
            ForwardOutput(
                logits=out.logits[a : a + n] if every_row else out.logits,
                taps=None if out.taps is None else out.taps[a : a + n],
                hidden=out.hidden[a : a + n],
            )
        )
        a += n
    return split


def accept(parts: Parts, seq: Sequence, tree: Tree, out: ForwardOutput, logits=None) -> bool:
    """Walk the tree with the target's own choices, keep the accepted path's KV entries and
    commit the path + the bonus token. True when generation is over. ``logits``: the tree's
    logits by node when the caller made them (``backend.tree_logits_batch``)."""
    if logits is None:
        logits = parts.backend.tree_logits(out, tree.parents)
    acc = walk(tree, logits, seq.sampler)
    path = acc.path
    # the tree's first len(path) nodes (a chain's accepted prefix, a root-only tree): no gather
    in_place = path[-1] == len(path) - 1
    seq.cache.compact(path)
    new = tree.tokens[path[1:]].tolist() + [acc.bonus]
    seq.stats.count(acc.accepted, len(tree) - 1)
    seq.path = path
    seq.committed.extend(new)
    if seq.judged is not None:
        note, t0 = seq.judged
        parts.builder.observe(note, new, time.perf_counter() - t0, seq.drafted)
    seq.judged = seq.drafted = None
    if parts.drafter is not None:
        taps = (
            out.taps[: len(path)]
            if in_place
            else out.taps[torch.as_tensor(path, device=out.taps.device)]
        )
        # Positions a round without a draft committed wait for the next draft.
        _wait(parts, seq, taps, new)
    return commit(parts, seq, new)


def plain(parts: Parts, seqs: list[Sequence], clock: StageClock | None = None) -> list[bool]:
    """One plain (autoregressive) step for every sequence of ``seqs``: what :func:`verify` and
    :func:`accept` do with root-only trees, without building them -- one target forward over
    the sequences' last tokens, each at its own position, and one choice per sequence (for
    greedy samplers one argmax over the batch). The batched engine takes it for a step in which
    no sequence drafts, so a batch at budget 0 pays per sequence no more than a plain decoding
    loop would. ``clock`` laps "verify" after the forward. True per sequence when its
    generation is over."""
    n = len(seqs)
    backend = parts.backend
    out = parts.target.forward_batch(
        [s.cache for s in seqs],
        [1] * n,
        torch.tensor([s.committed[-1] for s in seqs], dtype=torch.long),
        torch.tensor([s.prefix for s in seqs], dtype=torch.long),
        [None] * n,
        taps=parts.taps,
        logits_rows=backend.verify_logits_rows(),
    )
    if clock is not None:
        clock.lap("verify")
    # the rows the acceptance walk reads: every row's logits, in one LM-head product where the
    # forward left them out (as backend.tree_logits_batch computes the roots' rows)
    logits = out.logits if out.logits.shape[0] == n else parts.target.logits(out.hidden)
    chosen = _choose_rows([s.sampler for s in seqs], logits)
    taps = out.taps
    done = []
    for i, (seq, token) in enumerate(zip(seqs, chosen)):
        seq.cache.commit(1)
        seq.stats.count(0, 0)
        seq.path = [0]
        seq.committed.append(token)
        if parts.drafter is not None:
            _wait(parts, seq, taps[i : i + 1], [token])
        done.append(commit(parts, seq, [token]))
    return done


def _choose_rows(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """``samplers[i].choose(logits[i])`` for every row; greedy CPU rows by one numpy argmax
    over the batch (the same index per row: the first maximum, a NaN winning)."""
    if (
        all(s.params.greedy for s in samplers)
        and logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.float64, torch.float16)
    ):
        return np.argmax(logits.detach().numpy(), axis=1).tolist()
    return [s.choose(row) for s, row in zip(samplers, logits)]


def commit(parts: Parts, seq: Sequence, new: list[int]) -> bool:
    """Append ``new`` to the output, cut at the first stop condition (EOS, a stop string,
    ``max_new_tokens``, then the context); True when generation is over."""
    generated, stats = seq.generated, seq.stats
    seq.inputs = None  # the context moved on
    base = len(generated)
    for i, tok in enumerate(new):
        generated.append(tok)
        if tok in parts.eos_token_ids:
            stats.finish_reason = "eos"
        elif seq.stops and stop_hit(parts.tokenizer, generated, seq.stops):
            stats.finish_reason = "stop"
        elif len(generated) >= seq.max_new_tokens:
            stats.finish_reason = "length"
        else:
            continue
        del generated[base + i + 1 :]
        return True
    if len(seq.committed) >= seq.limit:
        stats.finish_reason = "context"
        return True
    return False
