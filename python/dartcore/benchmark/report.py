"""Benchmark output for people: a markdown table and PNG plots (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["markdown_table", "plot_all", "plot_verify_cost"]

_STAGES = ("draft", "search", "verify", "accept")


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown_table(report: dict) -> str:
    head = (
        "| dataset | method | T | τ | tok/s | speedup | draft ms | search ms | verify ms | other ms "
        "| identical |\n|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in report["results"]:
        ident = r.get("greedy_identical")
        lines.append(
            f"| {r['dataset']} | {r['method']} | {r['temperature']:g} | {_fmt(r.get('tau'), '.2f')} "
            f"| {r['tok_per_s']:.1f} | {_fmt(r.get('speedup'), '.2f')}× | "
            + " | ".join(_fmt(r.get(f"{s}_ms_per_round"), ".1f") for s in _STAGES)
            + f" | {'—' if ident is None else ('yes' if ident else 'NO')} |"
        )
    return "\n".join(lines)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_all(report: dict, out_dir: str | Path) -> list[Path]:
    """stage_times.png, speedup.png, acceptance.png; returns the paths written."""
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for r in report["results"] if r["temperature"] == 0.0]
    datasets = sorted({r["dataset"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    paths = []

    # 1. per-round stage times (mean over datasets), stacked
    ours = [m for m in methods if any(r["method"] == m and r.get("tau") for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(ours)
    for st in _STAGES:
        vals = []
        for m in ours:
            xs = [r.get(f"{st}_ms_per_round") or 0.0 for r in rows if r["method"] == m]
            vals.append(sum(xs) / len(xs) if xs else 0.0)
        ax.bar(ours, vals, bottom=bottom, label=st)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per round (T = 0, mean over datasets)")
    ax.set_title("Where a decoding round spends its time")
    ax.legend()
    fig.autofmt_xdate(rotation=20)
    fig.tight_layout()
    paths.append(out / "stage_times.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # 2. speedup per dataset and method
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        ys = [
            next(
                (r.get("speedup") or 0.0 for r in rows if r["method"] == m and r["dataset"] == d),
                0.0,
            )
            for d in datasets
        ]
        ax.bar([i + j * width for i in range(len(datasets))], ys, width=width, label=m)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(datasets))], datasets)
    ax.set_ylabel("speedup over AR (T = 0)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths.append(out / "speedup.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # 3. acceptance-length distribution (drafted tokens accepted per round)
    fig, ax = plt.subplots(figsize=(7, 4))
    for m in ours:
        hist: list[int] = []
        for r in rows:
            if r["method"] == m:
                for a, c in enumerate(r.get("accept_hist") or []):
                    hist.extend([0] * (a + 1 - len(hist)))
                    hist[a] += c
        total = sum(hist)
        if total and m != "ar":
            ax.plot(range(len(hist)), [c / total for c in hist], marker="o", label=m)
    ax.set_xlabel("drafted tokens accepted in a round")
    ax.set_ylabel("fraction of rounds (T = 0)")
    ax.legend()
    fig.tight_layout()
    paths.append(out / "acceptance.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def plot_verify_cost(choice: dict, out_path: str | Path) -> Path:
    """Verify time and modelled committed tokens/s against tree size."""
    plt = _plt()
    curve = choice["curve"]
    xs = [c["nodes"] for c in curve]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(xs, [c["ms"] for c in curve], marker="o", color="tab:blue")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("tree nodes verified in one forward")
    ax1.set_ylabel("target forward (ms)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xs, [c["tok_per_s"] for c in curve], marker="s", color="tab:orange")
    ax2.set_ylabel(f"τ(n)/t(n) tok/s, τ {choice['tau_model']}", color="tab:orange")
    ax1.axvline(choice["budget"], color="gray", ls="--")
    ax1.set_title(f"Verify cost; best budget = {choice['budget']} nodes")
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
