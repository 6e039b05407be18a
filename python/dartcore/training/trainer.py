"""The dart-train loop: teacher forward on the clean packed sequence, prefix-shared drafter
forward, gamma-weighted KL, AdamW + warmup/cosine + grad clip, checkpoints and resume,
held-out evaluation of per-position hit@1 and top-10 coverage.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from dartcore.drafter import DartDrafter
from dartcore.errors import DartError
from dartcore.training.data import PackedSequence
from dartcore.training.forward import train_forward
from dartcore.training.loss import DEFAULT_GAMMA, gamma_kl_loss, teacher_logprobs
from dartcore.training.schedule import warmup_cosine

__all__ = [
    "TrainConfig",
    "Batch",
    "make_batch",
    "teacher_forward",
    "sample_anchors",
    "group_targets",
    "build_draft_vocab",
    "train_step",
    "evaluate",
    "EvalSet",
    "Trainer",
]


@dataclass
class TrainConfig:
    ctx_len: int = 512
    batch_size: int = 2
    anchors_per_seq: int = 128  # sampled among valid anchors; 0 = all of them
    d: int = 8
    gamma: float = DEFAULT_GAMMA
    lr: float = 5e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    warmup_steps: int = 50
    max_steps: int = 1000
    min_lr_ratio: float = 0.1
    max_minutes: float | None = None
    checkpoint_every_minutes: float = 5.0
    eval_every: int = 100
    seed: int = 0
    extra: dict = field(default_factory=dict)


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, N]
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    anchor_ok: torch.Tensor  # bool
    doc_end: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


def make_batch(seqs: list[PackedSequence], device="cpu") -> Batch:
    def stack(name, dtype):
        return torch.as_tensor(
            np.stack([getattr(s, name) for s in seqs]), dtype=dtype, device=device
        )

    return Batch(
        stack("input_ids", torch.long),
        stack("position_ids", torch.long),
        stack("doc_ids", torch.long),
        stack("anchor_ok", torch.bool),
        stack("doc_end", torch.long),
    )


@torch.no_grad()
def teacher_forward(
    target, batch: Batch, taps: tuple[int, int, int], head_ids: torch.Tensor | None = None
):
    """(taps [B, N, 3H], logits [B, N, V]) of the target on the clean packed sequence.
    Documents are isolated by passing per-document position ids and no attention mask
    (transformers then builds a packed-sequence causal mask). With ``head_ids`` only those
    columns of the target's LM head are computed (its final normed hidden state times the
    head rows of the draft vocabulary): on CPU the full 49k-wide head is ~20 % of a SmolLM2
    forward and the other columns are thrown away by the reduced-vocabulary loss anyway.

    A hybrid target (Gated DeltaNet layers, whose recurrent and conv states run across position
    ids) runs each document of a packed row on its own: the states start from zero at each
    document as they do when decoding its prompt."""
    from dartcore.models.hybrid import HYBRID_FAMILIES

    if getattr(target.config, "model_type", None) not in HYBRID_FAMILIES:
        return _teacher_rows(target, batch.input_ids, batch.position_ids, taps, head_ids)
    rows, n = batch.input_ids.shape
    tap_out = logit_out = None
    for b in range(rows):
        docs = batch.doc_ids[b]
        cuts = [0, *(torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1).tolist(), n]
        for a, e in zip(cuts[:-1], cuts[1:]):
            pos = batch.position_ids[b : b + 1, a:e]
            t, lg = _teacher_rows(
                target, batch.input_ids[b : b + 1, a:e], pos - pos[0, 0], taps, head_ids
            )
            if tap_out is None:
                tap_out = t.new_zeros(rows, n, t.shape[-1])
                logit_out = lg.new_zeros(rows, n, lg.shape[-1])
            tap_out[b, a:e], logit_out[b, a:e] = t[0], lg[0]
    return tap_out, logit_out


def _teacher_rows(target, input_ids, position_ids, taps, head_ids):
    kw = dict(
        input_ids=input_ids,
        position_ids=position_ids,
        output_hidden_states=True,
        use_cache=False,
    )
    if head_ids is None:
        out = target(**kw)
        logits = out.logits
    else:
        out = target.model(**kw)
        w = target.get_output_embeddings().weight.index_select(
            0, head_ids.to(out.last_hidden_state.device)
        )
        logits = out.last_hidden_state @ w.T
    hs = out.hidden_states
    return torch.cat([hs[t] for t in taps], dim=-1).float(), logits.float()


def next_tokens_of(batch: Batch) -> torch.Tensor:
    """x_{i+1} of clean row i (0 where i is the last token of its document)."""
    nxt = torch.zeros_like(batch.input_ids)
    nxt[:, :-1] = batch.input_ids[:, 1:]
    same = torch.zeros_like(batch.anchor_ok)
    same[:, :-1] = batch.doc_ids[:, 1:] == batch.doc_ids[:, :-1]
    return torch.where(same, nxt, torch.zeros_like(nxt))


def sample_anchors(
    anchor_ok: torch.Tensor, n: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """[B, A] anchor rows drawn without replacement among valid ones, sorted; -1 pads.
    n = 0 takes every valid anchor."""
    rows = []
    for b in range(anchor_ok.shape[0]):
        idx = torch.nonzero(anchor_ok[b]).flatten()
        if n and idx.numel() > n:
            idx = idx[torch.randperm(idx.numel(), generator=generator)[:n]].sort().values
        rows.append(idx)
    A = max(1, n if n else max(r.numel() for r in rows))
    out = torch.full((anchor_ok.shape[0], A), -1, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, : r.numel()] = r
    return out.to(anchor_ok.device)


def group_targets(anchors: torch.Tensor, doc_end: torch.Tensor, d: int):
    """Teacher positions t+1+k [B, A, d] and their validity (real anchor, same document)."""
    t = anchors.clamp(min=0)
    pos = t[..., None] + 1 + torch.arange(d, device=anchors.device)
    end = torch.gather(doc_end, 1, t)[..., None]
    valid = (anchors[..., None] >= 0) & (pos <= end)
    return pos.clamp(max=doc_end.shape[1] - 1), valid


def _gather_rows(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [B, N, ...] at pos [B, A, d] -> [B, A, d, ...]."""
    B, A, D = pos.shape
    flat = pos.reshape(B, A * D)
    idx = flat.view(B, A * D, *([1] * (x.dim() - 2))).expand(B, A * D, *x.shape[2:])
    return torch.gather(x, 1, idx).view(B, A, D, *x.shape[2:])


def build_draft_vocab(token_arrays, size: int, vocab_size: int, always=()) -> torch.Tensor:
    """The ``size`` most frequent target ids (ties: lower id first), plus ``always``, sorted."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in token_arrays:
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    always = sorted({int(a) for a in always if a is not None and 0 <= a < vocab_size})
    if size >= vocab_size:
        return torch.arange(vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))
    chosen = list(always)
    seen = set(always)
    for i in order:
        if len(chosen) >= size:
            break
        if int(i) not in seen:
            chosen.append(int(i))
            seen.add(int(i))
    return torch.as_tensor(sorted(chosen), dtype=torch.long)


def train_step(
    drafter: DartDrafter, target, batch: Batch, cfg: TrainConfig, generator=None, backend="auto"
):
    """One forward/backward (no optimizer step). Returns (loss, per-position KL, anchors used)."""
    reduced = _reduced(drafter)
    taps, logits = teacher_forward(
        target, batch, drafter.taps, drafter.draft_to_target if reduced else None
    )
    anchors = sample_anchors(batch.anchor_ok, cfg.anchors_per_seq, generator)
    pos, valid = group_targets(anchors, batch.doc_end, drafter.d)
    logq = teacher_logprobs(logits)  # already restricted to the draft vocabulary
    del logits
    logq = _gather_rows(logq, pos)
    # bf16 autocast on GPU (the loss itself is computed in fp32); fp32 on CPU.
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if taps.is_cuda else contextlib.nullcontext()
    with amp:
        out = train_forward(
            drafter,
            taps,
            next_tokens_of(batch),
            anchors,
            doc_ids=batch.doc_ids,
            position_ids=batch.position_ids,
            backend=backend,
        )
    loss, per_pos = gamma_kl_loss(out, logq, valid, gamma=cfg.gamma)
    loss.backward()
    return float(loss.detach()), per_pos, int((anchors >= 0).sum())


def _reduced(drafter: DartDrafter) -> bool:
    m = drafter.draft_to_target
    return m.numel() != drafter.config.vocab_size or not torch.equal(
        m, torch.arange(m.numel(), device=m.device)
    )


@dataclass
class EvalSet:
    """Held-out packed sequences with the teacher's taps and greedy tokens cached."""

    batches: list[Batch]
    taps: list[torch.Tensor]
    argmax: list[torch.Tensor]  # [B, N] the target's argmax at every clean position

    @classmethod
    def build(cls, target, seqs: list[PackedSequence], taps, batch_size: int = 2) -> EvalSet:
        batches, tap_list, am = [], [], []
        device = next(target.parameters()).device
        for i in range(0, len(seqs), batch_size):
            b = make_batch(seqs[i : i + batch_size], device=device)
            t, logits = teacher_forward(target, b, taps)
            batches.append(b)
            tap_list.append(t.half())  # halves the memory; taps are cast back to fp32
            am.append(logits.argmax(-1))
        return cls(batches, tap_list, am)


@torch.no_grad()
def evaluate(drafter: DartDrafter, evalset: EvalSet, *, topk: int = 10, backend="auto") -> dict:
    """Per-position hit@1 (drafter top-1 == target's greedy token) and top-10 coverage
    (target's greedy token among the drafter's top-10) over every valid anchor."""
    d = drafter.d
    hit = torch.zeros(d)
    cov = torch.zeros(d)
    n = torch.zeros(d)
    was_training = drafter.training
    drafter.eval()
    for b, taps, am in zip(evalset.batches, evalset.taps, evalset.argmax):
        anchors = sample_anchors(b.anchor_ok, 0)
        pos, valid = group_targets(anchors, b.doc_end, d)
        for s in range(0, anchors.shape[1], 256):  # bounded memory
            a = anchors[:, s : s + 256]
            p, v = pos[:, s : s + 256], valid[:, s : s + 256]
            logits = train_forward(
                drafter,
                taps.float(),
                next_tokens_of(b),
                a,
                doc_ids=b.doc_ids,
                position_ids=b.position_ids,
                backend=backend,
            )
            top = drafter.to_target_ids(logits.float().topk(topk, dim=-1).indices)  # [B, A, d, k]
            want = _gather_rows(am, p)  # [B, A, d]
            hit += ((top[..., 0] == want) & v).sum((0, 1)).float()
            cov += ((top == want[..., None]).any(-1) & v).sum((0, 1)).float()
            n += v.sum((0, 1)).float()
    drafter.train(was_training)
    n = n.clamp(min=1)
    return {"hit1": (hit / n).tolist(), f"top{topk}": (cov / n).tolist(), "count": n.tolist()}


def lr_factor(cfg: TrainConfig, step: int, elapsed_s: float = 0.0) -> float:
    """Linear warmup over ``warmup_steps``, then cosine from 1 to ``min_lr_ratio``. Progress
    is the larger of steps / max_steps and elapsed / max_minutes, so a time-budgeted run
    (``max_minutes``) still ends its cosine at the minimum whatever the machine's speed."""
    progress = elapsed_s / (cfg.max_minutes * 60) if cfg.max_minutes else None
    return warmup_cosine(
        step,
        warmup_steps=cfg.warmup_steps,
        max_steps=cfg.max_steps,
        min_ratio=cfg.min_lr_ratio,
        progress=progress,
    )


class Trainer:
    """Runs the loop, writes ``out_dir/checkpoint.pt`` (resumable), ``out_dir/log.jsonl``
    (one line per step / eval) and ``out_dir/drafter/`` (the latest weights, loadable with
    DartDrafter.from_pretrained)."""

    def __init__(
        self,
        drafter: DartDrafter,
        target,
        train_seqs: list[PackedSequence],
        cfg: TrainConfig,
        out_dir,
        *,
        evalset: EvalSet | None = None,
        backend: str = "auto",
        progress: bool = True,
    ):
        self.drafter, self.target, self.seqs, self.cfg = drafter, target, train_seqs, cfg
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.evalset, self.backend, self.progress = evalset, backend, progress
        self.device = next(drafter.parameters()).device
        for p in target.parameters():
            p.requires_grad_(False)
        self.opt = torch.optim.AdamW(
            [p for p in drafter.parameters() if p.requires_grad],
            lr=cfg.lr,
            betas=tuple(cfg.betas),
            weight_decay=cfg.weight_decay,
        )
        self.step = 0
        self.cursor = 0  # index into the (per-epoch shuffled) training sequences
        self.tokens = 0
        self.elapsed = 0.0
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.interrupted: str | None = None
        if not train_seqs:
            raise DartError(
                "no training sequences (is the data empty or all prompts without responses?)"
            )

    # -- checkpoints -------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        state = {
            "drafter": self.drafter.state_dict(),
            "drafter_config": json.loads(self.drafter.config.to_json()),
            "opt": self.opt.state_dict(),
            "step": self.step,
            "cursor": self.cursor,
            "tokens": self.tokens,
            "elapsed": self.elapsed,
            "gen": self.gen.get_state(),
            "train_config": asdict(self.cfg),
        }
        tmp = self.out / "checkpoint.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out / "checkpoint.pt")
        self.drafter.save_pretrained(self.out / "drafter")
        try:
            from dartcore.training.curve import plot_curve

            plot_curve(self.out / "log.jsonl", self.out / "curve.png")
        # a picture is never worth a failed run
        except (ImportError, ValueError, KeyError, OSError):
            pass

    def load_checkpoint(self, path=None) -> None:
        path = Path(path or self.out / "checkpoint.pt")
        if not path.is_file():
            raise FileNotFoundError(f"no checkpoint at {path}")
        state = torch.load(path, map_location="cpu", weights_only=False)
        if "draft_to_target" in state["drafter"]:
            self.drafter.register_buffer(
                "draft_to_target", self.drafter.draft_to_target, persistent=True
            )
        self.drafter.load_state_dict(state["drafter"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.cursor, self.tokens = state["step"], state["cursor"], state["tokens"]
        self.elapsed = state.get("elapsed", 0.0)
        self.gen.set_state(state["gen"])

    # -- loop --------------------------------------------------------------------------

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.seqs)))
        random.Random(self.cfg.seed * 1000 + epoch).shuffle(order)
        return order

    def _log(self, rec: dict) -> None:
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    @contextlib.contextmanager
    def _stop_on_signals(self):
        """SIGINT / SIGTERM end the run after the current step, with a checkpoint, instead of
        losing the minutes since the last one; a second signal interrupts at once."""
        self.interrupted = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def stop(signum, frame):
            self.interrupted = signal.Signals(signum).name
            for s, h in previous.items():
                signal.signal(s, h)

        for s in previous:
            signal.signal(s, stop)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    def run(self) -> dict:
        """Train to ``max_steps`` (or ``max_minutes``); a SIGINT / SIGTERM stops it early with a
        checkpoint and ``"interrupted"`` (the signal's name) in the summary."""
        with self._stop_on_signals():
            return self._run()

    def _run(self) -> dict:
        from tqdm import tqdm

        cfg = self.cfg
        self.drafter.train()
        bar = tqdm(
            total=cfg.max_steps,
            initial=self.step,
            disable=not self.progress,
            dynamic_ncols=True,
            desc="dart-train",
        )
        start = time.time() - self.elapsed
        last_ckpt = time.time()
        last_eval = None
        ema = None
        while self.step < cfg.max_steps and not self.interrupted:
            if cfg.max_minutes is not None and time.time() - start > cfg.max_minutes * 60:
                break
            epoch, i = divmod(self.cursor, len(self.seqs))
            order = self._order(epoch)
            idx = [order[(i + k) % len(order)] for k in range(cfg.batch_size)]
            batch = make_batch([self.seqs[k] for k in idx], device=self.device)
            t0 = time.time()
            self.opt.zero_grad(set_to_none=True)
            lr = cfg.lr * lr_factor(cfg, self.step, time.time() - start)
            for group in self.opt.param_groups:
                group["lr"] = lr
            loss, per_pos, n_anchors = train_step(
                self.drafter, self.target, batch, cfg, self.gen, self.backend
            )
            gnorm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
            self.opt.step()
            dt = time.time() - t0
            self.step += 1
            self.cursor += cfg.batch_size
            self.tokens += batch.tokens
            self.elapsed = time.time() - start
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            rec = {
                "step": self.step,
                "loss": loss,
                "kl": per_pos.tolist(),
                "grad_norm": float(gnorm),
                "lr": lr,
                "tokens": self.tokens,
                "anchors": n_anchors,
                "step_s": dt,
                "tok_s": batch.tokens / dt,
                "elapsed_s": self.elapsed,
            }
            self._log(rec)
            bar.update(1)
            bar.set_postfix(
                loss=f"{ema:.3f}",
                tok_s=f"{self.tokens / max(self.elapsed, 1e-9):.0f}",
                lr=f"{rec['lr']:.1e}",
            )
            if self.evalset is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
                last_eval = self.run_eval()
            if time.time() - last_ckpt > cfg.checkpoint_every_minutes * 60:
                self.save_checkpoint()
                last_ckpt = time.time()
        bar.close()
        self.save_checkpoint()
        if self.interrupted:
            return {
                "step": self.step,
                "tokens": self.tokens,
                "elapsed_s": self.elapsed,
                "eval": last_eval,
                "interrupted": self.interrupted,
            }
        if self.evalset is not None and (last_eval is None or last_eval["step"] != self.step):
            last_eval = self.run_eval()
        return {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed,
            "eval": last_eval,
        }

    def run_eval(self) -> dict:
        res = evaluate(self.drafter, self.evalset, backend=self.backend)
        res = {"step": self.step, "eval": True, **res}
        self._log(res)
        return res
