#!/usr/bin/env python3
"""Decoding benchmark of DartDecoder on SmolLM2-135M-Instruct: a thin wrapper of
``dart-bench`` with this benchmark's defaults.

Methods ``ar`` (plain autoregressive decoding in the same loop = the baseline),
``dart``, ``dart-no-ngram``, ``dart-chain``, ``ngram-only``; HumanEval, GSM8K and
CodeAlpaca-2k; T = 0 and 1; 96 new tokens; plus the verify-cost curve (trees of
1..128 nodes after a cached prefix) and the budget it implies. Every other
``dart-bench`` option passes through (``--budgets 4,8,16,24`` measures τ per budget
for the budget choice; ``--no-verify-cost`` skips the curve). Writes bench.json,
bench.md and plots to --out (default artifacts/bench_decode/).

    python tools/bench_decode.py --index /tmp/smollm2.idx --n 5 --json
    python tools/bench_decode.py --verify-cost-only
"""

from __future__ import annotations

import sys

METHODS = ("ar", "dart", "dart-no-ngram", "dart-chain", "ngram-only")
DEFAULTS = {
    "--methods": ",".join(METHODS),
    "--max-new-tokens": "96",
    "--out": "artifacts/bench_decode",
}


def main(argv: list[str] | None = None) -> int:
    from dartcore.cli.dart_bench import main as dart_bench

    args = list(sys.argv[1:] if argv is None else argv)
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    for flag, value in DEFAULTS.items():
        if flag not in given:
            args += [flag, value]
    if "--no-verify-cost" in args:
        args.remove("--no-verify-cost")
    elif "--verify-cost-only" not in args:
        args.append("--verify-cost")
    return dart_bench(args)


if __name__ == "__main__":
    raise SystemExit(main())
