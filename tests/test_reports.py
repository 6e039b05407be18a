"""Every figure README.md and docs/*.md cite from a report is the report's figure, and every
cited report names its machine and command (tools/check_reports.py); the checker itself is
tested on small made-up documents."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_reports", REPO / "tools" / "check_reports.py")
check_reports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_reports)

MACHINE = {"cpu": "Test CPU", "cpus": 2, "isa": "avx2"}


def test_the_repository_figures_match_their_reports():
    problems = check_reports.check(REPO)
    assert not problems, "\n".join(problems)


def _repo(tmp_path: Path, readme: str, report: dict) -> Path:
    (tmp_path / "tools" / "reports").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "tools" / "reports" / "r.json").write_text(json.dumps(report))
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


REPORT = {
    "machine": MACHINE,
    "command": "python tools/bench_x.py --json",
    "rows": [{"tok_per_s": 40.4449, "speedup": 1.3512, "hit1": 0.364, "bytes": 1258307584}],
}


@pytest.mark.parametrize(
    "text",
    [
        "40.4 tok/s, 1.35x, 36.4 %, 1.26 GB",  # the report's values as rounded, in its units
        "40 tok/s and 1.4x",  # coarser rounding of the same values
    ],
)
def test_matching_figures_pass(tmp_path, text):
    repo = _repo(
        tmp_path, f"# x\n\n## Results\n\n<!-- report: tools/reports/r.json -->\n{text}\n", REPORT
    )
    assert check_reports.check(repo) == []


@pytest.mark.parametrize(
    "text, bad", [("40.5 tok/s", "40.5"), ("1.01x at 16 clients", "1.01"), ("37 %", "37")]
)
def test_a_figure_not_in_the_report_fails(tmp_path, text, bad):
    repo = _repo(tmp_path, f"## Results\n\n<!-- report: tools/reports/r.json -->\n{text}\n", REPORT)
    problems = check_reports.check(repo)
    assert any(f" {bad} is in no cited report" in p for p in problems), problems


def test_code_and_link_targets_are_not_figures(tmp_path):
    readme = (
        "## Results\n\n<!-- report: tools/reports/r.json -->\n40.4 tok/s (`--n 77`, "
        "[see](docs/x.md#section-99)) on SmolLM2-135M-Instruct\n<!-- /report -->\n"
    )
    assert check_reports.check(_repo(tmp_path, readme, REPORT)) == []


def test_a_report_without_machine_or_command_fails(tmp_path):
    repo = _repo(
        tmp_path,
        "## Results\n\n<!-- report: tools/reports/r.json -->\n40.4 tok/s\n",
        {"rows": REPORT["rows"]},
    )
    problems = check_reports.check(repo)
    assert any("CPU model" in p and "command" in p for p in problems), problems
    (repo / "tools" / "reports" / "provenance.json").write_text(
        json.dumps(
            {"tools/reports/r.json": {"machine": MACHINE, "command": "python tools/bench_x.py"}}
        )
    )
    assert check_reports.check(repo) == []


def test_a_missing_report_fails(tmp_path):
    repo = _repo(
        tmp_path, "## Results\n\n<!-- report: tools/reports/gone.json -->\n40.4 tok/s\n", REPORT
    )
    assert any("gone.json, which is not a JSON report" in p for p in check_reports.check(repo))


def test_results_figures_outside_a_block_fail(tmp_path):
    readme = (
        "## Results\n\n<!-- report: tools/reports/r.json -->\n40.4 tok/s\n<!-- /report -->\n"
        "and 1.01x at 16 clients\n\n## Other\n\n3.5 ms here is not checked\n"
    )
    problems = check_reports.check(_repo(tmp_path, readme, REPORT))
    assert len(problems) == 1 and "'1.01x'" in problems[0], problems


def test_a_block_ends_at_the_next_heading(tmp_path):
    readme = "## Results\n\n<!-- report: tools/reports/r.json -->\n40.4 tok/s\n\n## Other\n\n99.9 tok/s\n"
    assert check_reports.check(_repo(tmp_path, readme, REPORT)) == []
