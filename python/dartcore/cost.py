"""The verify-cost curve: the target forward's time against the rows it verifies, on this machine.

The budget controller (:mod:`dartcore.controller`) prices a tree's nodes by what the forward
that verifies them costs. :func:`measure_verify_cost` times one forward over a random tree of
each size after a cached prefix; :class:`CostCurve` interpolates the medians and is measured
once per model / device / dtype / weights kind / thread count / machine and cached on disk
(:func:`cost_cache_dir`). A cached curve is a prior, not the truth:

* the file carries the conditions it was measured under (the key above, plus the 1-minute load
  average against the logical CPUs and when); a curve measured on a busy machine -- on a
  2-vCPU VM shared with compilers, SmolLM2's one-row forward took 69 ms against 25-40 ms
  quiet -- would otherwise price every node at several times its cost for good;
* on reading it, :meth:`CostCurve.for_target` times a few one-row forwards (a spot check,
  ~0.2 s with the prefix) and measures the whole curve again when the cached one-row time
  is more than :data:`DISAGREE` times the spot time: the curve was measured while the
  machine was busier than now. A cached time *below* the spot time is kept: then it is now
  that is busy, and the quieter curve has the better shape (the controller scales it to what
  the engine measures);
* a running controller that finds the engine's forwards faster than the curve by more than
  :data:`DISAGREE` marks the file stale (:meth:`CostCurve.mark_stale`), so the next process
  measures it again even where its own spot check fell in a burst of load.

The benchmark package (``dartcore.benchmark.verify_cost``) re-exports the measurement; the
runtime never imports the benchmark package.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from dartcore.errors import DartError
from dartcore.kernels.linear import int8_kernel
from dartcore.paths import cache_root
from dartcore.tree import ancestor_mask

__all__ = [
    "DEFAULT_SIZES",
    "DISAGREE",
    "CostCurve",
    "cost_cache_dir",
    "curve_key",
    "increasing",
    "measure_verify_cost",
]

DEFAULT_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
# A cached curve whose one-row time is this many times the live one (the spot check at load,
# the engine's measured forwards while running) was measured on a busier machine: measure it
# again. Two quiet runs on the 2-vCPU dev VM agree within ~15 %, a loaded one is 1.7-2.8x.
DISAGREE = 1.5
# The spot check: this many one-row forwards after a prefix of SPOT_PREFIX tokens.
SPOT_REPEATS = 5
SPOT_PREFIX = 128
# The row counts a curve is measured at (up to the largest a step can verify).
CURVE_SIZES = (
    1,
    2,
    3,
    4,
    5,
    6,
    8,
    10,
    12,
    14,
    16,
    17,
    20,
    24,
    32,
    40,
    48,
    64,
    80,
    96,
    128,
    160,
    192,
    256,
)


def _decreasing(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit of ``values`` (pool adjacent violators)."""
    if len(values) < 2 or bool(np.all(values[1:] <= values[:-1])):
        return values.astype(np.float64, copy=True)  # already non-increasing (the usual case)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values.tolist(), weights.tolist()):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks[-1]
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2]
    return np.array([m for m, _, c in blocks for _ in range(c)], dtype=np.float64)


def increasing(values, weights) -> np.ndarray:
    """The weighted least-squares non-decreasing fit of ``values`` (pool adjacent violators)."""
    return -_decreasing(
        -np.asarray(values, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    )


def decreasing(values, weights) -> np.ndarray:
    """The weighted least-squares non-increasing fit of ``values``."""
    return _decreasing(np.asarray(values, dtype=np.float64), np.asarray(weights, dtype=np.float64))


class CostCurve:
    """Verify time (ms) against total rows, from measured points, linear in between and
    extrapolated linearly past the last one. ``path``: the cache file it came from, if any;
    ``conditions``: what the file says about its measurement."""

    def __init__(
        self, points: list[dict], *, path: Path | None = None, conditions: dict | None = None
    ):
        pts = sorted((int(p["rows"]), float(p["ms"])) for p in points)
        if not pts or pts[0][0] < 1:
            raise DartError("a verify-cost curve needs measured points with rows >= 1")
        self.points = pts
        self.path = path
        self.conditions = dict(conditions or {})
        self.rows = np.array([p[0] for p in pts], dtype=np.float64)
        # A forward of more rows never costs less: the curve is the least-squares non-decreasing
        # fit of the measured medians (pool adjacent violators). Not their lower envelope: one
        # low reading (5 rows at 39 ms after 1-4 rows at 39-47) would make every smaller size
        # as cheap, and the slope the controller weighs nodes by would vanish.
        ms = np.array([p[1] for p in pts], dtype=np.float64)
        self.ms = increasing(ms, np.ones_like(ms))

    def __call__(self, rows) -> np.ndarray | float:
        r = np.asarray(rows, dtype=np.float64)
        out = np.interp(r, self.rows, self.ms)
        if len(self.rows) >= 2:
            slope = (self.ms[-1] - self.ms[-2]) / max(self.rows[-1] - self.rows[-2], 1.0)
            out = np.where(r > self.rows[-1], self.ms[-1] + slope * (r - self.rows[-1]), out)
        return float(out) if out.ndim == 0 else out

    def as_list(self) -> list[dict]:
        return [{"rows": r, "ms": m} for r, m in self.points]

    # -- measured once per machine, cached --------------------------------------------------

    @classmethod
    def for_target(
        cls,
        target,
        backend,
        *,
        max_rows: int,
        remeasure: bool = False,
        cache_dir: Path | None = None,
        check: bool = True,
    ) -> CostCurve:
        """The curve of ``target`` on this machine up to ``max_rows`` rows: read from the
        cache (:func:`cost_cache_dir`, one file per :func:`curve_key`), else measured with
        :func:`measure_verify_cost` under the backend's round scope (what a decoding step
        runs under) and written by rename. A cached curve that is stale, or (``check``)
        whose one-row time is more than :data:`DISAGREE` times a spot measurement now, is
        measured again (module docs). ``remeasure`` (or ``DARTCORE_REMEASURE_COST=1``)
        measures again."""
        key = curve_key(target)
        path = (cache_dir or cost_cache_dir()) / f"{key['digest']}.json"
        remeasure = remeasure or os.environ.get("DARTCORE_REMEASURE_COST") == "1"
        replaced = None
        if not remeasure and path.is_file():
            try:
                data = json.loads(path.read_text())
                usable = (
                    data.get("key") == key
                    and not data.get("stale")
                    and max(p["rows"] for p in data["points"]) >= max_rows
                )
                cached = (
                    cls(data["points"], path=path, conditions=data.get("conditions"))
                    if usable
                    else None
                )
            except (OSError, ValueError, KeyError, TypeError, DartError):
                cached = None  # unreadable: measure again
            if cached is not None:
                if not check:
                    return cached
                spot = spot_verify_ms(target, backend)
                if cached(1) <= DISAGREE * spot:
                    return cached
                replaced = {
                    "one_row_ms": float(cached(1)),
                    "spot_ms": spot,
                    "conditions": cached.conditions,
                }
        sizes = sorted({r for r in CURVE_SIZES if r <= max_rows} | {max_rows})
        with backend.round_scope():  # the forward as the engine's verify runs it
            measured = measure_verify_cost(
                target,
                prefix_len=128,
                sizes=sizes,
                repeats=5,
                logits_rows=backend.verify_logits_rows(),
            )
        points = [{"rows": a["nodes"], "ms": a["ms"]} for a in measured]
        conditions = measurement_conditions()
        if replaced is not None:
            conditions["replaced"] = replaced
        _write(
            path,
            {
                "key": key,
                "points": points,
                "measured_at": conditions["time"],
                "conditions": conditions,
            },
        )
        return cls(points, path=path, conditions=conditions)

    def mark_stale(self, reason: dict) -> bool:
        """Mark the cache file this curve came from stale (``reason`` recorded in it), so the
        next :meth:`for_target` measures it again. False when there is no such file (any
        more, or another curve replaced it)."""
        if self.path is None:
            return False
        try:
            data = json.loads(self.path.read_text())
            if sorted((int(p["rows"]), float(p["ms"])) for p in data["points"]) != self.points:
                return False  # already measured again by another process
            data["stale"] = {**reason, "time": time.time()}
            _write(self.path, data)
        except (OSError, ValueError, KeyError, TypeError):
            return False
        return True


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def cost_cache_dir() -> Path:
    """Where measured verify-cost curves live: ``$DARTCORE_CACHE/verify_cost``, default
    ``~/.cache/dartcore/verify_cost``."""
    return cache_root() / "verify_cost"


def machine() -> dict:
    """The machine a curve is measured on: the CPU's model and logical CPUs (the GPU's name
    on CUDA, added by :func:`curve_key`)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count() or 0}


def measurement_conditions() -> dict:
    """What a curve's file records about the moment it was measured."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    return {
        "time": time.time(),
        "loadavg_1m": load,
        "cpus": os.cpu_count() or 0,
        "torch": torch.__version__,
    }


@functools.cache
def native_build() -> str:
    """The native extension's build, as the first 16 hex digits of its file's SHA-256 ("" when
    it is not loaded): a rebuilt kernel costs differently at every row count, so a curve from
    another build is not reused."""
    try:
        from dartcore import _native

        with open(_native.__file__, "rb") as fh:
            return hashlib.file_digest(fh, "sha256").hexdigest()[:16]
    except (ImportError, OSError, TypeError):
        return ""


def curve_key(target) -> dict:
    """What a cached curve must match to be used: the model, its shapes, device, dtype, weights
    kind (GGML blocks and their numerics, the native kernels and their build), thread counts
    and the machine; ``digest`` names the file."""
    cfg = target.config
    fields = {
        "model": str(getattr(cfg, "_name_or_path", "") or ""),
        "family": target.family,
        "layers": target.num_layers,
        "hidden": target.hidden_size,
        "heads": target.num_heads,
        "kv_heads": target.num_kv_heads,
        "vocab": target.vocab_size,
        "intermediate": int(getattr(cfg, "intermediate_size", 0) or 0),
        "device": str(target.device),
        "dtype": str(target.dtype),
        "threads": int(target.threads),
        "torch_threads": int(torch.get_num_threads()),
        "native": bool(target.native_linear),
        # GGML block weights cost differently from float32 ones at every row count
        "blocks": bool(getattr(target, "blocks", False)),
        # the integer kernels' rows cost a fraction of the exact path's
        "numerics": str(getattr(target, "numerics", "") or ""),
        "int8_kernel": int8_kernel() or "",
        "native_build": native_build(),
        **machine(),
    }
    if target.device.type == "cuda":
        fields["gpu"] = torch.cuda.get_device_name(target.device)
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
    return {**fields, "digest": digest}


def spot_verify_ms(target, backend, *, repeats: int = SPOT_REPEATS) -> float:
    """The median time (ms) of a one-row verify forward now (the spot check of a cached curve)."""
    with backend.round_scope():
        times = _time_forwards(
            target,
            prefix_len=SPOT_PREFIX,
            sizes=(1,),
            repeats=repeats,
            seed=1,
            logits_rows=backend.verify_logits_rows(),
        )
    return 1e3 * statistics.median(times[1])


def _random_tree(n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths and ancestor mask of a random depth-ordered tree of n nodes."""
    parents = np.full(n, -1, dtype=np.int64)
    depths = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        parents[i] = rng.integers(0, i)
        depths[i] = depths[parents[i]] + 1
    return torch.from_numpy(depths), torch.from_numpy(ancestor_mask(parents))


@torch.inference_mode()
def _time_forwards(
    target, *, prefix_len: int, sizes: Sequence[int], repeats: int, seed: int, logits_rows
) -> dict[int, list[float]]:
    rng = np.random.default_rng(seed)
    vocab = target.vocab_size
    cache = target.new_cache(prefix_len + max(sizes) + 1)
    prompt = torch.from_numpy(rng.integers(0, vocab, prefix_len))
    target.forward(cache, prompt, torch.arange(prefix_len), logits_rows=slice(-1, None))
    cache.commit(prefix_len)
    trees = {}
    for n in sizes:
        depths, mask = _random_tree(n, rng)
        trees[n] = (torch.from_numpy(rng.integers(0, vocab, n)), depths + prefix_len, mask)
        target.forward(cache, *trees[n], logits_rows=logits_rows)  # warm-up (allocations, kernels)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats):
        for n in sizes if rep % 2 == 0 else list(sizes)[::-1]:
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            target.forward(cache, *trees[n], logits_rows=logits_rows)
            if target.device.type == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t0)
    return times


def measure_verify_cost(
    target,
    *,
    prefix_len: int = 256,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 5,
    seed: int = 0,
    logits_rows=None,
) -> list[dict]:
    """Median wall time (ms) of one target forward over a random tree of each size
    after ``prefix_len`` cached tokens. ``target`` is a
    :class:`dartcore.models.transformer.TargetModel`; ``logits_rows`` as for its forward
    (default: logits of every row; lazy verification passes ``slice(0, 0)``).

    The repeats are interleaved: each round times every size once (in turn ascending and
    descending), so a burst of load on a shared machine lands on a few sizes' single samples,
    which each size's median drops, instead of on all the samples of the sizes it overlaps."""
    times = _time_forwards(
        target,
        prefix_len=prefix_len,
        sizes=sizes,
        repeats=repeats,
        seed=seed,
        logits_rows=logits_rows,
    )
    return [{"nodes": int(n), "ms": 1e3 * statistics.median(times[n])} for n in sizes]
