"""tools/build_llama_cpp.sh's install location and rerun rule (no build, no network here)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools" / "build_llama_cpp.sh"

pytestmark = pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads /proc/cpuinfo")


def _run(cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "DARTCORE_CACHE": str(cache), **env},
    )


def _pin() -> str:
    return re.search(r"llama-cpp-python==([0-9.]+)", (REPO / "pyproject.toml").read_text()).group(1)


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_install_dir_names_version_and_instruction_sets(tmp_path):
    done = _run(tmp_path, "--print-dir")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.name == "bin" and path.parent.parent == tmp_path / "llama.cpp"
    version, _, tag = path.parent.name.partition("-")
    assert version == _pin()
    parts = tag.split("-")
    flags = _cpu_flags()
    assert ("avx2" in parts) == ("avx2" in flags)
    assert ("avx512" in parts) == ("avx512f" in flags)
    assert ("vnni" in parts) == ("avx512_vnni" in flags)
    assert not any(p.startswith("amx") for p in parts)  # AMX is always built out
    assert not (tmp_path / "llama.cpp").exists()  # --print-dir builds nothing

    other = _run(tmp_path, "--print-dir", LLAMA_CPP_PYTHON_VERSION="9.9.9")
    assert Path(other.stdout.strip()).parent.name == f"9.9.9-{tag}"


def test_finished_build_is_reused(tmp_path):
    bin_dir = Path(_run(tmp_path, "--print-dir").stdout.strip())
    bin_dir.mkdir(parents=True)
    (bin_dir.parent / "BUILD_INFO.json").write_text("{}\n")
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(bin_dir)
    assert "already built" in done.stderr
    # nothing fetched
    assert sorted(p.name for p in (tmp_path / "llama.cpp").iterdir()) == [bin_dir.parent.name]
