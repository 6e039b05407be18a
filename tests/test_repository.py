"""A clone is complete: no tracked file (code, docs, defaults, reports) points at a path outside
the repository, and every document a source file cites exists in it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Paths that only exist on the machines the project was developed on, or beside a checkout.
OUTSIDE = re.compile(r"\.\./shared\b|(?<![\w.])/work/|\bshared/data\b|\bshared/ARCHITECTURE")
SKIP_DIRS = {
    ".git",
    "target",
    "artifacts",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".dev",
    "build",
    "dist",
}


def tracked_files() -> list[Path]:
    """The repository's files: git's list in a checkout, else every file outside build output."""
    if (REPO / ".git").exists():
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout
        return [REPO / p for p in out.decode().split("\0") if p]
    return [
        p for p in REPO.rglob("*") if p.is_file() and not SKIP_DIRS & set(p.relative_to(REPO).parts)
    ]


def text_of(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:  # a file deleted in the working tree but still in git's list
        return None
    if b"\0" in data[:8192]:
        return None  # binary (weights, compressed fixtures)
    return data.decode("utf-8", errors="replace")


def test_no_path_outside_the_repository():
    hits = []
    me = Path(__file__).resolve()
    for path in tracked_files():
        if path.resolve() == me:
            continue
        text = text_of(path)
        if text is None:
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{no}: {line.strip()[:120]}")
    assert not hits, (
        "paths outside the repository (point at docs/architecture.md, tests/data or "
        "$DARTCORE_DATA instead):\n" + "\n".join(hits)
    )


def test_cited_documents_exist():
    """Every ``docs/*.md``, ``tools/reports/*`` or ``tests/data/*`` that code or docs cite is in
    the repository."""
    cited = re.compile(
        r"\b((?:docs|tools/reports|tests/data|crates/[\w-]+)/[\w./-]+\.(?:md|json|png))\b"
    )
    missing = []
    for path in tracked_files():
        if path.relative_to(REPO).parts[0] == "tests":
            continue  # tests make up paths on purpose
        text = text_of(path)
        if text is None:
            continue
        for ref in set(cited.findall(text)):
            if not (REPO / ref).exists():
                missing.append(f"{path.relative_to(REPO)} cites {ref}")
    assert not missing, "\n".join(sorted(missing))


def test_cited_sections_exist():
    """A citation of a section (``docs/architecture.md, "Data flow"``) names a heading of it."""
    cite = re.compile(r'docs/architecture\.md,? "([^"]+)"')
    headings = {
        m.group(1).strip()
        for m in re.finditer(
            r"^#+ (.+)$", (REPO / "docs" / "architecture.md").read_text(), re.MULTILINE
        )
    }
    wrong = []
    for path in tracked_files():
        text = text_of(path)
        if text is None:
            continue
        wrong += [
            f"{path.relative_to(REPO)}: {name!r}"
            for name in cite.findall(text)
            if name not in headings
        ]
    assert not wrong, f"sections not in docs/architecture.md ({sorted(headings)}):\n" + "\n".join(
        wrong
    )


def _gpu_marked_test_files() -> set[str]:
    """Test files that mark a test ``gpu`` (decorator, ``pytestmark`` or a ``pytest.param``
    mark), found in their syntax tree: ``pytest.mark.gpu`` anywhere in the module."""
    import ast

    out = set()
    for path in sorted((REPO / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "gpu"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "mark"
            ):
                out.add(path.relative_to(REPO).as_posix())
                break
    return out


def test_device_check_runs_every_gpu_test_and_cuda_benchmark():
    script = (REPO / "tools" / "device_check.sh").read_text()
    listed = set(re.search(r"GPU_TESTS=\(([^)]*)\)", script).group(1).split())
    marked = _gpu_marked_test_files()
    assert "tests/test_engine_triton.py" in marked  # the finder sees the marks
    assert marked <= listed, f"tools/device_check.sh's GPU_TESTS misses {sorted(marked - listed)}"
    assert listed <= marked, f"GPU_TESTS names files without gpu tests: {sorted(listed - marked)}"
    assert '"${GPU_TESTS[@]}"' in script and "-m gpu" in script
    cuda_benches = {
        p.name
        for p in (REPO / "tools").glob("bench_*.py")
        if "cuda" in p.read_text(encoding="utf-8")
    }
    assert cuda_benches, "no CUDA benchmark found"
    missing = sorted(b for b in cuda_benches if f"tools/{b}" not in script)
    assert not missing, f"tools/device_check.sh runs no {missing}"
