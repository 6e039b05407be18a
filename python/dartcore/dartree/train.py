"""Training the DARTree correction head on top of a FROZEN drafter.

Data: the drafter's own training data and pipeline (:mod:`dartcore.training.data`: chat
records rendered with the target's chat template, response-token anchors). For every
document we run

1. the target once on the clean sequence (taps for the drafter; teacher = the target's
   distribution at every position, as for the drafter), then
2. the drafter exactly as the decoder does (:meth:`DartDrafter.draft`, one call per anchor,
   anchors every ``stride`` response positions), keeping for every row ``k`` of anchor ``p``:
   the drafter's hidden state ``H_k``, the parent token ``x_{p+1+k}`` (teacher forcing: the
   path is the real continuation, so the target's distribution at position ``p+1+k`` is the
   right teacher for that path), the top-K candidates with their base logits, and the
   teacher's probabilities of those candidates.

The frozen part is run once ("collect"); the head then trains for many passes over the
cached examples (it is tiny, so this is cheap). Loss: ``Σ_k γ^k · (−Σ_c p_k(c) ln q̃_k(c))``
over the K candidates — the cross-entropy of the target's mass inside the candidate set,
i.e. the KL to the teacher restricted to the candidates up to a constant. AdamW, warmup +
cosine, grad clip.

Metrics (held-out documents): per depth, hit@1 of the base marginal and of the corrected
distribution (the candidate ranked first is the target's argmax) and the candidate
cross-entropy. ``dart-train --correction-head`` is the CLI (see :func:`main`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dartcore.dartree.head import CorrectionHead
from dartcore.drafter import drafter_fingerprint
from dartcore.errors import DartError
from dartcore.training.schedule import warmup_cosine

__all__ = [
    "HeadExamples",
    "HeadTrainConfig",
    "collect_examples",
    "train_head",
    "evaluate_head",
    "drafter_fingerprint",
    "main",
]


@dataclass
class HeadExamples:
    """Cached frozen-drafter outputs, one row per (anchor, depth)."""

    hidden: torch.Tensor  # [n, H] float16
    parent: torch.Tensor  # [n] int64 target ids
    cand: torch.Tensor  # [n, K] int64 target ids, by base logit descending
    base: torch.Tensor  # [n, K] float32 base logits
    teacher: torch.Tensor  # [n, K] float32 target probabilities of the candidates
    # [n] int64: index of the target's argmax among the candidates, −1 if absent
    argmax_pos: torch.Tensor
    depth: torch.Tensor  # [n] int64 (0 = row 0)

    def __len__(self) -> int:
        return int(self.parent.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    def subset(self, idx) -> HeadExamples:
        return HeadExamples(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))

    @staticmethod
    def cat(parts: list[HeadExamples]) -> HeadExamples:
        return HeadExamples(
            *(torch.cat([getattr(p, f) for p in parts]) for f in HeadExamples.__dataclass_fields__)
        )


@torch.no_grad()
def collect_examples(
    target,
    drafter,
    documents,
    *,
    k: int = 64,
    stride: int = 1,
    max_len: int = 512,
    max_examples: int | None = None,
    deadline: float | None = None,
    progress: bool = False,
) -> HeadExamples:
    """Run the frozen target + drafter over tokenised ``documents`` (``(ids, respond)``
    pairs, see :func:`dartcore.training.data.tokenize_document`) and cache head examples.

    Anchor ``p`` is used when ``x_{p+1}`` is a response token; rows ``k`` with a teacher
    (``p+1+k < len``) are kept. Stops early at ``max_examples`` or at ``deadline``
    (``time.monotonic()`` value)."""
    from tqdm import tqdm

    target.eval()
    drafter.eval()
    d = drafter.d
    parts: list[HeadExamples] = []
    total = 0
    bar = tqdm(
        total=max_examples, disable=not progress, desc="collect", unit="ex", dynamic_ncols=True
    )
    for ids, respond in documents:
        ids = torch.as_tensor(np.asarray(ids)[:max_len], dtype=torch.long)
        respond = np.asarray(respond)[:max_len]
        n = int(ids.shape[0])
        anchors = [p for p in range(0, n - 1) if respond[p + 1]][::stride]
        if not anchors:
            continue
        out = target(input_ids=ids[None], output_hidden_states=True, use_cache=False)
        taps = torch.cat([out.hidden_states[t][0] for t in drafter.taps], -1).float()
        teacher = torch.softmax(out.logits[0].float(), -1)  # row i: p(x_{i+1} | x_{<=i})
        t_arg = teacher.argmax(-1)
        state = drafter.new_state(n)
        nxt = ids[1:]
        done = 0
        rows_h, rows_parent, rows_cand, rows_base, rows_teach, rows_argpos, rows_depth = (
            [],
            [],
            [],
            [],
            [],
            [],
            [],
        )
        for p in anchors:
            logits, hidden = drafter.draft(
                state, taps[done : p + 1], nxt[done : p + 1], return_hidden=True
            )
            done = p + 1
            rows = min(d, n - 1 - p)  # teacher at position p+1+k must exist
            vals, cidx = torch.topk(logits[:rows].float(), min(k, logits.shape[-1]), dim=-1)
            cand = drafter.to_target_ids(cidx)
            pos = torch.arange(p + 1, p + 1 + rows)
            rows_h.append(hidden[:rows].to(torch.float16))
            rows_parent.append(ids[pos])
            rows_cand.append(cand)
            rows_base.append(vals)
            rows_teach.append(torch.gather(teacher[pos], 1, cand))
            hit = cand == t_arg[pos][:, None]
            rows_argpos.append(
                torch.where(hit.any(1), hit.float().argmax(1), torch.full((rows,), -1))
            )
            rows_depth.append(torch.arange(rows))
        part = HeadExamples(
            torch.cat(rows_h),
            torch.cat(rows_parent),
            torch.cat(rows_cand),
            torch.cat(rows_base),
            torch.cat(rows_teach),
            torch.cat(rows_argpos),
            torch.cat(rows_depth),
        )
        parts.append(part)
        total += len(part)
        bar.update(len(part))
        if (max_examples is not None and total >= max_examples) or (
            deadline is not None and time.monotonic() > deadline
        ):
            break
    bar.close()
    if not parts:
        raise DartError("no training examples: the documents have no response tokens to draft")
    data = HeadExamples.cat(parts)
    return data.subset(slice(0, max_examples)) if max_examples is not None else data


@dataclass
class HeadTrainConfig:
    rank: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    batch_size: int = 256
    max_steps: int = 3000
    max_minutes: float | None = None
    warmup_steps: int = 50
    grad_clip: float = 0.5
    gamma: float = 0.8  # depth weight γ^k
    eval_every: int = 250
    seed: int = 0


def _loss(
    head: CorrectionHead, embed, ex: HeadExamples, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logq = head(ex.hidden.float(), embed(ex.parent), embed(ex.cand), ex.base)
    ce = -(ex.teacher * logq).sum(-1)  # [n]
    w = gamma ** ex.depth.float()
    return (w * ce).sum() / w.sum(), logq


@torch.no_grad()
def evaluate_head(
    head: CorrectionHead, embed, ex: HeadExamples, d: int, *, batch: int = 1024
) -> dict:
    """Per depth: hit@1 of the base marginal and of the head, candidate cross-entropies."""
    hit_base = torch.zeros(d)
    hit_head = torch.zeros(d)
    ce_base = torch.zeros(d)
    ce_head = torch.zeros(d)
    count = torch.zeros(d)
    for s in range(0, len(ex), batch):
        part = ex.subset(slice(s, s + batch))
        logq = head(part.hidden.float(), embed(part.parent), embed(part.cand), part.base)
        base = torch.log_softmax(part.base.float(), -1)
        pick = logq.argmax(-1)
        for _name, acc, val in (
            ("hb", hit_base, (part.argmax_pos == 0).float()),
            ("hh", hit_head, (pick == part.argmax_pos).float()),
            ("cb", ce_base, -(part.teacher * base).sum(-1)),
            ("ch", ce_head, -(part.teacher * logq).sum(-1)),
        ):
            acc.index_add_(0, part.depth, val)
        count.index_add_(0, part.depth, torch.ones(len(part)))
    c = count.clamp(min=1)
    return {
        "examples": int(count.sum()),
        "hit1_base": (hit_base / c).tolist(),
        "hit1_head": (hit_head / c).tolist(),
        "ce_base": (ce_base / c).tolist(),
        "ce_head": (ce_head / c).tolist(),
        "hit1_base_mean": float(hit_base.sum() / c.sum()),
        "hit1_head_mean": float(hit_head.sum() / c.sum()),
    }


def train_head(
    head: CorrectionHead,
    embed,
    train: HeadExamples,
    cfg: HeadTrainConfig,
    *,
    valid: HeadExamples | None = None,
    d: int = 8,
    progress: bool = False,
    log=None,
) -> dict:
    """Train ``head`` in place on cached examples; returns the last validation metrics."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def lr_at(step: int) -> float:
        return warmup_cosine(
            step, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_ratio=0.1
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(cfg.seed)
    start = time.monotonic()
    metrics: dict = {}
    bar = tqdm(total=cfg.max_steps, disable=not progress, desc="train head", dynamic_ncols=True)
    for step in range(cfg.max_steps):
        idx = torch.randint(len(train), (min(cfg.batch_size, len(train)),), generator=gen)
        loss, _ = _loss(head, embed, train.subset(idx), cfg.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.4f}")
        last = step + 1 == cfg.max_steps or (
            cfg.max_minutes is not None and time.monotonic() - start > 60 * cfg.max_minutes
        )
        if valid is not None and ((step + 1) % cfg.eval_every == 0 or last):
            head.eval()
            metrics = {
                "step": step + 1,
                "loss": loss.item(),
                **evaluate_head(head, embed, valid, d),
            }
            head.train()
            if log is not None:
                log(metrics)
        if last:
            break
    bar.close()
    head.eval()
    return metrics


def _parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="dart-train --correction-head",
        description="Train the DARTree correction head on a frozen DART drafter.",
    )
    ap.add_argument(
        "--target", default="smollm2", help="target model name or path (dartcore.models.hub)"
    )
    ap.add_argument("--drafter", required=True, help="trained drafter directory or built-in name")
    ap.add_argument(
        "--data", nargs="+", required=True, help="training files / directories (the drafter's data)"
    )
    ap.add_argument(
        "--out", required=True, help="output directory (config.json + model.safetensors)"
    )
    ap.add_argument("--k", type=int, default=64, help="candidates per depth (K)")
    ap.add_argument("--rank", type=int, default=256, help="bottleneck width of the head")
    ap.add_argument("--stride", type=int, default=2, help="use every stride-th response anchor")
    ap.add_argument(
        "--max-len", type=int, default=512, help="truncate documents to this many tokens"
    )
    ap.add_argument(
        "--collect-minutes",
        type=float,
        default=8.0,
        help="time budget for the frozen forward passes",
    )
    ap.add_argument("--max-examples", type=int, default=200_000)
    ap.add_argument("--valid-docs", type=int, default=16, help="held-out documents for the metrics")
    ap.add_argument("--train-minutes", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--gamma", type=float, default=0.8)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument(
        "--cache",
        default=None,
        help="save the collected examples here, or load them if the file exists "
        "(retrain without re-running the frozen models; must match --drafter)",
    )
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    """``dart-train --correction-head --drafter DIR --data DIR... --out DIR``."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except (DartError, FileNotFoundError) as exc:
        print(f"dart-train --correction-head: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    from dartcore.models.hub import load_drafter, load_target
    from dartcore.training.data import read_documents, tokenize_document

    # the float model, as dart-train's: the head learns from the float32 target's choices
    model, tokenizer = load_target(args.target, quantized=False)
    model.eval()
    drafter = load_drafter(args.drafter, model, tokenizer).eval()
    for p in drafter.parameters():
        p.requires_grad_(False)
    docs = [doc for doc in read_documents(args.data) if doc.has_response]
    random.Random(args.seed).shuffle(docs)
    valid_docs, train_docs = docs[: args.valid_docs], docs[args.valid_docs :]

    def tokenised(ds):
        for doc in ds:
            yield tokenize_document(doc, tokenizer)

    progress = not args.quiet
    t0 = time.monotonic()
    fingerprint = drafter_fingerprint(drafter)
    cache = Path(args.cache) if args.cache else None
    if cache is not None and cache.is_file():
        saved = torch.load(cache, weights_only=False)
        if saved.get("drafter_fingerprint") != fingerprint:
            raise DartError(
                f"{cache} was collected with drafter {saved.get('drafter_fingerprint')}, "
                f"not {fingerprint}: delete it or pass another --cache"
            )
        valid, train = HeadExamples(**saved["valid"]), HeadExamples(**saved["train"])
    else:
        valid = collect_examples(
            model,
            drafter,
            tokenised(valid_docs),
            k=args.k,
            stride=args.stride,
            max_len=args.max_len,
            progress=progress,
        )
        train = collect_examples(
            model,
            drafter,
            tokenised(train_docs),
            k=args.k,
            stride=args.stride,
            max_len=args.max_len,
            max_examples=args.max_examples,
            deadline=t0 + 60 * args.collect_minutes,
            progress=progress,
        )
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save(
                {
                    "drafter_fingerprint": fingerprint,
                    "valid": valid.tensors(),
                    "train": train.tensors(),
                },
                cache,
            )
    collect_s = time.monotonic() - t0
    embed = drafter.embed
    hidden_size = int(train.hidden.shape[1])
    embed_dim = int(model.get_input_embeddings().weight.shape[1])
    cfg = HeadTrainConfig(
        rank=args.rank,
        lr=args.lr,
        batch_size=args.batch_size,
        max_steps=args.steps,
        max_minutes=args.train_minutes,
        gamma=args.gamma,
        eval_every=args.eval_every,
        seed=args.seed,
    )
    meta = {
        "target": args.target,
        "drafter": str(args.drafter),
        "drafter_fingerprint": fingerprint,
        "k": args.k,
        "d": drafter.d,
        "data": [str(p) for p in args.data],
        "train_examples": len(train),
        "valid_examples": len(valid),
        "collect_s": round(collect_s, 1),
        "train_config": asdict(cfg),
    }
    head = CorrectionHead(hidden_size, embed_dim, rank=args.rank, meta=meta)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "train_log.jsonl"
    log_path.write_text("")
    before = evaluate_head(head, embed, valid, drafter.d)

    def log(m):
        with open(log_path, "a") as f:
            f.write(json.dumps(m) + "\n")

    log({"step": 0, **before})
    metrics = train_head(
        head, embed, train, cfg, valid=valid, d=drafter.d, progress=progress, log=log
    )
    head.meta["valid_metrics"] = {
        k: metrics[k]
        for k in (
            "hit1_base_mean",
            "hit1_head_mean",
            "hit1_base",
            "hit1_head",
            "ce_base",
            "ce_head",
        )
        if k in metrics
    }
    head.meta["train_s"] = round(time.monotonic() - t0 - collect_s, 1)
    head.save(out)
    summary = {
        "out": str(out),
        "parameters": head.num_parameters(),
        **head.meta["valid_metrics"],
        "train_examples": len(train),
        "valid_examples": len(valid),
    }
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
