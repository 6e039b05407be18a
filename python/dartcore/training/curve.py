"""Training curve of a dart-train run (``OUT/log.jsonl``) as a PNG.

python -m dartcore.training.curve artifacts/run/log.jsonl curve.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["read_log", "plot_curve"]


def read_log(path) -> tuple[list[dict], list[dict]]:
    """(training steps, evaluations) of a log.jsonl, by step. A resumed run repeats the
    steps after its checkpoint; the later record of a step wins."""
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            (evals if rec.get("eval") else steps)[rec["step"]] = rec
    return [steps[k] for k in sorted(steps)], [evals[k] for k in sorted(evals)]


def _smooth(xs: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plot_curve(log_path, png_path, *, title: str = "dart-train") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals = read_log(log_path)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [r["tokens"] / 1e3 for r in steps]
    ax1.plot(x, [r["loss"] for r in steps], alpha=0.25, color="C0", label="loss (per step)")
    ax1.plot(x, _smooth([r["loss"] for r in steps], 20), color="C0", label="loss (20-step mean)")
    d = len(steps[0]["kl"]) if steps else 0
    for k in (0, d // 2, d - 1) if d else ():
        ax1.plot(
            x,
            _smooth([r["kl"][k] for r in steps], 20),
            lw=1,
            label=f"KL position {k + 1} (20-step mean)",
        )
    ax1.set_xlabel("training tokens (thousands)")
    ax1.set_ylabel("nats")
    ax1.set_yscale("log")
    ax1.set_title(f"{title}: loss = sum_k 0.6^k KL(q_k || p_k)")
    ax1.legend(fontsize=8)
    if evals:
        tok_at = {r["step"]: r["tokens"] / 1e3 for r in steps}
        ex = [tok_at.get(e["step"], 0) for e in evals]
        for k in range(len(evals[0]["hit1"])):
            ax2.plot(
                ex,
                [100 * e["hit1"][k] for e in evals],
                marker="o",
                ms=3,
                label=f"hit@1 pos {k + 1}",
            )
        ax2.plot(ex, [100 * e["top10"][0] for e in evals], ls="--", color="k", label="top-10 pos 1")
        ax2.set_xlabel("training tokens (thousands)")
        ax2.set_ylabel("% of held-out positions")
        ax2.set_title("held-out hit@1 per drafted position")
        ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m dartcore.training.curve LOG.jsonl OUT.png")
    plot_curve(sys.argv[1], sys.argv[2])
