#!/usr/bin/env python3
"""Check that the measured figures in README.md and docs/*.md are the figures of their reports.

    python tools/check_reports.py            # exit 1 and one line per problem, else 0

How a document cites a report: an HTML comment before a table or paragraph,

    <!-- report: tools/reports/bench_tree_demo_smollm2.json, tools/reports/bench_tree_scale_smollm2.json -->

opens a *block* that runs to the next such comment, ``<!-- /report -->``, or the next heading.
Every number written in the block (outside code spans, fenced code and link targets) must be
a number of one of the named reports as the text rounds it: a report value v matches the
written x with n decimals when v, or v in another unit (× 100 for a percentage; 1e-3, 1e-6,
1e-9, 2^-20, 2^-30 for k / M / G / MiB / GiB; ÷ 60 for minutes), rounds to x at n decimals.
Numbers inside the reports' strings count too (a note, a machine name).

Every cited report must name its machine (CPU model, vCPUs, ISA) and the command that wrote
it: the report's own ``machine`` (``cpu``, ``cpus`` or ``vcpus``, ``isa``) and ``command``
fields, or, for reports written before their tool recorded those, the report's entry in
``tools/reports/provenance.json``.

A section that presents results (README.md's "Results", the docs listed in STRICT_SECTIONS) may
hold no measured figure outside a block: a number followed by a unit of time, speed, size or a
ratio (µs, ms, s, min, tok/s, ×, %, MB, GB, ...) there is an error.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from decimal import ROUND_HALF_EVEN, ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

MARK = re.compile(r"<!--\s*report:\s*(.*?)\s*-->")
END = re.compile(r"<!--\s*/report\s*-->")
HEADING = re.compile(r"^#{1,6} ")
# Where every measured figure must sit in a report block: (file, heading), or (file, None)
# for the whole file.
STRICT_SECTIONS = [
    ("README.md", "## Results"),
    ("docs/index-at-scale.md", None),
    (
        "docs/distributed-build.md",
        "## Measured: Ray against the local engine on one 2-core machine",
    ),
]
STRICT_SECTIONS += [("docs/official.md", "## What happens"), ("docs/architecture.md", None)]
STRICT_SECTIONS += [
    ("docs/benchmarks.md", h)
    for h in (
        "## Decoding (`dart-bench`, SmolLM2-135M-Instruct, fp32, CPU)",
        "## Batched decoding (`tools/bench_batch.py`)",
        "## `dart-serve` under load (`tools/bench_serve.py`)",
        "## On a GPU (`tools/device_check.sh`)",
        "## Trigram index (`tools/bench_index.py`)",
        "## `ngram-build` end to end (`tools/bench_build.py`, qwen3 tokenizer)",
        "## Tree search (`tools/bench_tree.py`)",
        "## Drafter (`tools/reports/drafter_smollm2.md`)",
        "## DARTree (`tools/reports/dartree.md`)",
    )
]

# Names with digits that are not figures, removed before numbers are read.
NAMES = re.compile(
    r"SmolLM2(?:-135M(?:-Instruct)?)?|Qwen\d(?:\.\d)?(?:-\d+(?:\.\d+)?B)?|AVX-?512|AVX2|Zen \d|Q\d_\d|Q\d_K|"
    r"fp32|fp16|bf16|float32|float16|bfloat16|int32|u32|u64|H\d00|Eq\. ?\(\d+\)|hit@\d+|top-\d+|"
    r"arXiv \d+\.\d+|[Ss]tage \d|\bk ?= ?\d+|\bd ?= ?\d+|\bw ?= ?\d+|θ ?= ?\d+|T ?= ?\d+|\d+-vCPU|"
    r"llama-cpp-python \d[\d.]*|SHA-\d+|\d[\d,]*-id\b|EPYC|Xeon|x86_64|\bv\d+\b|\d{4}-\d\d-\d\d"
)
# A number: not part of a word or of a longer number; "1.35x" is the number 1.35.
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?!(?!x\b)\w|\.\d)")
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:µs|us\b|ms\b|s\b|min\b|minutes|hours?|tok/s|tokens/s|×|x\b|%|"
    r"[KMGT]i?B\b|bytes|M tokens|B tokens)"
)
# Figures without a report that the check tolerates, each named exactly (document, text as
# written); the list should be empty. README's float32 resident size of SmolLM2 in "Quantized
# weights" has no report.
TOLERATED = {("README.md", "~930 MB")}
SCALES = (1.0, 100.0, 1e-3, 1e-6, 1e-9, 2.0**-20, 2.0**-30, 1e3, 1e6, 1 / 60, 1 / 3600)


def _strip(text: str) -> str:
    """Text without what is not prose: fenced code, code spans, link targets, comments, names."""
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)
    text = re.sub(r"`[^`\n]*`", " ", text)
    text = re.sub(r"\]\([^)]*\)", "] ", text)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.DOTALL)
    return NAMES.sub(" ", text)


def written_numbers(text: str) -> list[str]:
    """The numbers as written (thousands separators removed), in order."""
    return [
        (m.group(1) + (m.group(2) or "")).replace(",", "") for m in NUMBER.finditer(_strip(text))
    ]


def report_values(obj) -> list[float]:
    """Every number of a report: numeric leaves, and numbers inside its strings."""
    out: list[float] = []
    if isinstance(obj, bool):
        return out
    if isinstance(obj, (int, float)):
        if math.isfinite(obj):
            out.append(float(obj))
    elif isinstance(obj, str):
        out += [float(x) for x in re.findall(r"\d+(?:\.\d+)?", obj.replace(",", ""))]
    elif isinstance(obj, dict):
        for v in obj.values():
            out += report_values(v)
    elif isinstance(obj, list):
        for v in obj:
            out += report_values(v)
    return out


def _rounds_to(value: float, written: str) -> bool:
    decimals = len(written.split(".")[1]) if "." in written else 0
    quantum = Decimal(1).scaleb(-decimals)
    try:
        v = Decimal(repr(value))
        target = Decimal(written)
        return any(
            v.quantize(quantum, rounding=mode) == target
            for mode in (ROUND_HALF_UP, ROUND_HALF_EVEN)
        )
    except InvalidOperation:
        return False


def matches(written: str, values: list[float]) -> bool:
    x = float(written)
    for v in values:
        for s in SCALES:
            y = v * s
            if abs(y - x) < 1 and _rounds_to(y, written):
                return True
    return False


def _machine_and_command(report: dict, name: str, provenance: dict) -> list[str]:
    """What the report lacks of machine (CPU model, vCPUs, ISA) and command."""
    entry = provenance.get(name, {})
    machine = report.get("machine") if isinstance(report.get("machine"), dict) else {}
    machine = {**entry.get("machine", {}), **machine}
    missing = []
    if not machine.get("cpu"):
        missing.append("the CPU model (machine.cpu)")
    if not (machine.get("cpus") or machine.get("vcpus")):
        missing.append("the vCPU count (machine.cpus)")
    if not machine.get("isa"):
        missing.append("the instruction set (machine.isa)")
    if not (report.get("command") or entry.get("command")):
        missing.append("the command")
    return missing


def blocks(text: str):
    """(first line number, [report paths], block text) per report block."""
    lines = text.splitlines()
    cur: tuple[int, list[str], list[str]] | None = None
    for no, line in enumerate(lines, 1):
        m = MARK.search(line)
        if m or END.search(line) or HEADING.match(line):
            if cur is not None:
                yield cur[0], cur[1], "\n".join(cur[2])
            cur = None
        if m:
            cur = (no, [p.strip() for p in m.group(1).split(",") if p.strip()], [line[m.end() :]])
        elif cur is not None:
            cur[2].append(line)
    if cur is not None:
        yield cur[0], cur[1], "\n".join(cur[2])


def outside_blocks(text: str, heading: str | None) -> list[tuple[int, str]]:
    """(line number, figure) of the measured figures of section ``heading`` (None: the whole
    text) not in a block."""
    out, inside, in_block, fenced = [], heading is None, False, False
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if HEADING.match(line) and not fenced:
            if heading is not None:
                inside = line.strip() == heading or (
                    inside and line.count("#") > heading.count("#")
                )
            in_block = False
            continue
        if MARK.search(line):
            in_block = True
        elif END.search(line):
            in_block = False
        if inside and not in_block and not fenced:
            out += [(no, m.group(0)) for m in FIGURE.finditer(_strip(line))]
    return out


def check(repo: Path = REPO) -> list[str]:
    problems: list[str] = []
    prov_file = repo / "tools" / "reports" / "provenance.json"
    provenance = json.loads(prov_file.read_text()) if prov_file.is_file() else {}
    docs = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    cache: dict[str, list[float] | None] = {}
    for doc in docs:
        rel = doc.relative_to(repo).as_posix()
        text = doc.read_text(encoding="utf-8")
        for line, paths, body in blocks(text):
            for doc_name, figure in TOLERATED:
                if doc_name == rel:
                    body = body.replace(figure, " ")
            values: list[float] = []
            for p in paths:
                if p not in cache:
                    path = repo / p
                    if not path.is_file():
                        cache[p] = None
                    else:
                        try:
                            report = json.loads(path.read_text())
                        except json.JSONDecodeError as exc:
                            problems.append(f"{p}: not JSON ({exc})")
                            cache[p] = None
                            continue
                        cache[p] = report_values(report)
                        lacks = _machine_and_command(
                            report if isinstance(report, dict) else {}, p, provenance
                        )
                        if lacks:
                            problems.append(
                                f"{p}: names neither {' nor '.join(lacks)} (add them to the report "
                                f"or to tools/reports/provenance.json)"
                            )
                if cache[p] is None:
                    problems.append(
                        f"{rel}:{line}: cites {p}, which is not a JSON report in the repository"
                    )
                    continue
                values += cache[p]
            if not values:
                continue
            for x in written_numbers(body):
                if not matches(x, values):
                    problems.append(f"{rel}:{line}: {x} is in no cited report ({', '.join(paths)})")
        for name, heading in STRICT_SECTIONS:
            if rel == name:
                if heading is not None and heading not in text.splitlines():
                    problems.append(f"{rel}: no section {heading!r} (STRICT_SECTIONS names it)")
                for no, fig in outside_blocks(text, heading):
                    problems.append(
                        f"{rel}:{no}: the figure {fig!r} in {heading or name!r} cites no report "
                        "(put a <!-- report: tools/reports/<name>.json --> before it)"
                    )
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.parse_args(argv)
    problems = check()
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} problem(s)", file=sys.stderr)
        return 1
    print("every cited figure matches its report")
    return 0


if __name__ == "__main__":
    sys.exit(main())
