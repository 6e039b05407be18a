"""Run the decoding benchmark: every (dataset, temperature, prompt) through every
method in the same process, AR first, and aggregate.

Methods: the decoder's tree builders (``ar`` = our plain autoregressive loop,
``dart``, ``dart-no-ngram``, ``dart-chain``, ``ngram-only``, and any other
registered builder such as ``dartree``) plus the Hugging Face baselines
``hf-generate`` and ``hf-prompt-lookup``. Speedups are against ``ar`` in the same
run. ``greedy_identical`` is true only if every T = 0 output of every method
equals the AR output token for token (the Hugging Face methods', which run the float
model, where the decoder runs the exact numerics).
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata

import torch

from dartcore.benchmark.baselines import hf_generate
from dartcore.benchmark.datasets import load_prompts

__all__ = [
    "BenchConfig",
    "HF_METHODS",
    "DEFAULT_METHODS",
    "run_benchmark",
    "machine_info",
    "torch_dtype",
]

HF_METHODS = ("hf-generate", "hf-prompt-lookup")
DEFAULT_METHODS = (
    "ar",
    "dart",
    "dart+ctx",
    "dart-no-ngram",
    "dart-chain",
    "ngram-only",
    "hf-generate",
    "hf-prompt-lookup",
)
STAGES = ("prefill", "draft", "search", "verify", "accept")


@dataclass
class BenchConfig:
    target: str = "smollm2"
    drafter: str | None = "smollm2"
    index: str | None = None
    datasets: tuple[str, ...] = ("humaneval", "gsm8k", "code_alpaca")
    n: int = 5
    methods: tuple[str, ...] = DEFAULT_METHODS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    data_dir: str | None = None
    tree_params: dict = field(default_factory=dict)
    prompt_lookup_tokens: int = 10
    device: str = "cpu"
    dtype: str | None = None  # "float32" (default) | "bfloat16" | "float16"
    # A GGUF target's weights (None: dartcore.models.hub.load_target's defaults, the blocks on
    # the integer path where the kernels run). The Hugging Face methods run the float model.
    quantized: bool | None = None
    numerics: str | None = None  # "int8" | "exact"


def torch_dtype(name: str | None) -> torch.dtype | None:
    """``"bfloat16"`` -> ``torch.bfloat16`` (None stays None: the loader's float32)."""
    if name is None:
        return None
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown floating dtype {name!r} (float32, bfloat16, float16)")
    return dtype


def machine_info() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    import os

    cpu, flags = platform.processor() or platform.machine(), []
    try:
        for line in open("/proc/cpuinfo").read().splitlines():
            if line.startswith("model name") and cpu == (
                platform.processor() or platform.machine()
            ):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    from dartcore.kernels.linear import int8_kernel, native_linear_isa

    return {
        "cpu": cpu,
        "isa": native_linear_isa(),
        "int8_kernel": int8_kernel(),
        "isa_flags": sorted(
            f
            for f in flags
            if f.startswith(("avx", "amx")) or f in ("fma", "f16c", "bmi2", "sse4_2")
        ),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        "packages": {
            p: version(p) for p in ("dartcore", "torch", "transformers", "numpy", "tokenizers")
        },
    }


def _one(decoders, method, model, tok, ids, cfg, temperature, seed) -> dict:
    """Run one prompt through one method; the median time of ``repeats`` runs."""
    runs = []
    for _ in range(max(1, cfg.repeats)):
        if method in HF_METHODS:
            res = hf_generate(
                model,
                tok,
                ids,
                max_new_tokens=cfg.max_new_tokens,
                temperature=temperature,
                seed=seed,
                prompt_lookup=cfg.prompt_lookup_tokens if method == "hf-prompt-lookup" else None,
            )
            runs.append(
                {
                    "tokens": res.tokens,
                    "seconds": res.seconds,
                    "rounds": None,
                    "accept_hist": [],
                    "stage_s": {},
                }
            )
        else:
            out = decoders[method].generate(
                ids, max_new_tokens=cfg.max_new_tokens, temperature=temperature, seed=seed
            )
            s = out.stats
            runs.append(
                {
                    "tokens": out.tokens,
                    "seconds": s.total_s,
                    "rounds": s.rounds,
                    "accept_hist": list(s.accept_hist),
                    "stage_s": dict(s.seconds),
                }
            )
    runs.sort(key=lambda r: r["seconds"])
    return runs[len(runs) // 2]


def _aggregate(records: list[dict], ar_rate: float | None) -> dict:
    tokens = sum(len(r["tokens"]) for r in records)
    seconds = sum(r["seconds"] for r in records)
    rounds = [r["rounds"] for r in records if r["rounds"] is not None]
    row: dict = {
        "prompts": len(records),
        "new_tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds if seconds > 0 else 0.0,
    }
    row["speedup"] = row["tok_per_s"] / ar_rate if ar_rate else None
    if rounds and sum(rounds) > 0:
        hist: list[int] = []
        for r in records:
            for a, c in enumerate(r["accept_hist"]):
                hist.extend([0] * (a + 1 - len(hist)))
                hist[a] += c
        total_rounds = sum(hist)
        row["rounds"] = total_rounds
        row["tau"] = (
            sum((a + 1) * c for a, c in enumerate(hist)) / total_rounds if total_rounds else None
        )
        row["accept_hist"] = hist
        for st in STAGES:
            secs = sum(r["stage_s"].get(st, 0.0) for r in records)
            row[f"{st}_ms_per_round" if st != "prefill" else "prefill_ms"] = (
                1e3 * secs / (total_rounds if st != "prefill" else len(records))
            )
    else:
        row["tau"] = None
        row["rounds"] = None
        row["accept_hist"] = []
    return row


def run_benchmark(cfg: BenchConfig, progress=None) -> dict:
    """Load everything, run, and return the result object (JSON-ready)."""
    from dartcore.decoder import DartDecoder
    from dartcore.index import DECODE_PREFAULT, DECODE_VERIFY, NgramIndex
    from dartcore.models.hub import load_drafter, load_target, target_weights

    torch.manual_seed(cfg.seed)
    dtype = torch_dtype(cfg.dtype)
    quantized, numerics = target_weights(
        cfg.target, device=cfg.device, dtype=dtype, quantized=cfg.quantized, numerics=cfg.numerics
    )
    model, tok = load_target(
        cfg.target, dtype=dtype, device=cfg.device, quantized=quantized, numerics=numerics
    )
    hf_model = model
    if quantized and any(m in HF_METHODS for m in cfg.methods):
        # Hugging Face's methods run the float model: the baseline a transformers user gets.
        # Its forward over the block weights is neither that nor the decoder's arithmetic once
        # the decoder adopts them on int8 (its greedy tokens then differ from both).
        hf_model, _ = load_target(cfg.target, dtype=dtype, device=cfg.device, quantized=False)
    # The decoder's outputs equal the float model's on the exact numerics only: on int8 the
    # Hugging Face rows are not compared with AR (their `identical` is None).
    compare_hf = numerics == "exact"
    drafter = index = None
    needs_drafter = any(m not in HF_METHODS and m not in ("ar", "ngram-only") for m in cfg.methods)
    if cfg.drafter and needs_drafter:
        drafter = load_drafter(cfg.drafter, model, tok)
    if cfg.index:
        index = NgramIndex(cfg.index, verify=DECODE_VERIFY, prefault=DECODE_PREFAULT)
    methods = ["ar", *[m for m in cfg.methods if m != "ar"]]  # AR first: the reference
    decoders = {
        m: DartDecoder(model, tok, drafter, index, tree=m, **cfg.tree_params.get(m, {}))
        for m in methods
        if m not in HF_METHODS
    }
    # Warm-up: first calls pay for allocations and lazy initialisation.
    for m in methods:
        _one(
            decoders,
            m,
            hf_model,
            tok,
            tok("Hello")["input_ids"],
            BenchConfig(max_new_tokens=4),
            0.0,
            0,
        )

    results, prompts_out = [], []
    identical = True
    for dataset in cfg.datasets:
        prompts = load_prompts(dataset, cfg.n, cfg.data_dir)
        encoded = [
            tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True) for p in prompts
        ]
        encoded = [list(e["input_ids"]) if hasattr(e, "keys") else list(e) for e in encoded]
        for temperature in cfg.temperatures:
            per_method: dict[str, list[dict]] = {m: [] for m in methods}
            for i, ids in enumerate(encoded):
                seed = cfg.seed + i
                ref = None
                for m in methods:
                    rec = _one(decoders, m, hf_model, tok, ids, cfg, temperature, seed)
                    per_method[m].append(rec)
                    if m == "ar":
                        ref = rec["tokens"]
                    elif temperature == 0.0 and (compare_hf or m not in HF_METHODS):
                        rec["identical"] = rec["tokens"] == ref
                        identical &= rec["identical"]
                    if progress:
                        progress(dataset, temperature, i, m, rec)
                if temperature == 0.0:
                    prompts_out.append(
                        {
                            "dataset": dataset,
                            "index": i,
                            "prompt_tokens": len(ids),
                            "text": tok.decode(ref, skip_special_tokens=True)[:400],
                        }
                    )
            ar_row = _aggregate(per_method["ar"], None)
            for m in methods:
                row = _aggregate(per_method[m], ar_row["tok_per_s"])
                row.update(dataset=dataset, method=m, temperature=temperature)
                if m in decoders and m != "ar":
                    row["max_nodes"] = decoders[m].max_nodes
                if temperature == 0.0 and m != "ar" and (compare_hf or m not in HF_METHODS):
                    row["greedy_identical"] = all(r.get("identical", False) for r in per_method[m])
                results.append(row)
    return {
        "config": {
            **asdict(cfg),
            "quantized": quantized,  # as loaded (the defaults filled in)
            "numerics": numerics,
            "datasets": list(cfg.datasets),
            "methods": list(cfg.methods),
            "temperatures": list(cfg.temperatures),
        },
        "machine": machine_info(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
        "greedy_identical": identical,
        "samples": prompts_out,
    }


def median_speedups(report: dict, temperature: float = 0.0) -> dict[str, float]:
    """Median over datasets of each method's speedup at one temperature."""
    by: dict[str, list[float]] = {}
    for r in report["results"]:
        if r["temperature"] == temperature and r.get("speedup") is not None:
            by.setdefault(r["method"], []).append(r["speedup"])
    return {m: statistics.median(v) for m, v in by.items()}
