"""One environment variable per directory: DARTCORE_DATA and DARTCORE_CACHE, with the old
spellings read as deprecated fallbacks; no data directory is looked for beside the checkout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dartcore.benchmark.datasets import find_data_dir, load_prompts
from dartcore.errors import CorpusError
from dartcore.paths import cache_root, data_dir_from_env

ALL = ("DARTCORE_DATA", "DARTCORE_SHARED_DATA", "DARTCORE_CACHE", "DARTCORE_CACHE_DIR")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "dartcore"
    assert data_dir_from_env() is None
    assert find_data_dir() is None  # not looked for beside the checkout
    with pytest.raises(CorpusError, match="DARTCORE_DATA"):
        load_prompts("gsm8k", 1)


def test_new_names(monkeypatch, tmp_path, test_data):
    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("DARTCORE_DATA", str(test_data))
    assert cache_root() == tmp_path / "c"
    assert find_data_dir() == test_data
    with open(test_data / "eval" / "gsm8k_test.jsonl", encoding="utf-8") as f:
        question = json.loads(f.readline())["question"]
    assert load_prompts("gsm8k", 1) == [[{"role": "user", "content": question}]]


@pytest.mark.parametrize(
    "old, new, read",
    [
        ("DARTCORE_CACHE_DIR", "DARTCORE_CACHE", cache_root),
        ("DARTCORE_SHARED_DATA", "DARTCORE_DATA", data_dir_from_env),
    ],
)
def test_old_names_still_work_with_a_warning(monkeypatch, tmp_path, old, new, read):
    monkeypatch.setenv(old, str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match=new):
        assert read() == tmp_path / "old"
    monkeypatch.setenv(new, str(tmp_path / "new"))  # the new name wins, silently
    assert read() == tmp_path / "new"


def test_named_directory_without_eval_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("DARTCORE_DATA", str(tmp_path))
    assert find_data_dir() is None
    with pytest.raises(CorpusError, match=str(tmp_path)):
        load_prompts("humaneval", 1)
    assert find_data_dir(Path(tmp_path)) is None
