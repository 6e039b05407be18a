"""Evaluation prompts: HumanEval, GSM8K test and CodeAlpaca-2k, general conversation, as chat
messages.

The first three are the unchanged public releases (HumanEval, GSM8K, CodeAlpaca; sources and
licences in the repository's tests/data/README.md), read from ``DIR/eval/`` of the directory
named by ``--data-dir`` or ``$DARTCORE_DATA`` (:mod:`dartcore.paths`); the repository's
``tests/data`` holds their first ten prompts in the same layout. ``general`` is shipped with the package
(``assets/eval/general_heldout.jsonl``): the general-conversation prompts that
``tools/make_general_prompts.py`` held out of the drafter's training (requests the target wrote
from a task type and topic, and instructions over local documents). A handful of embedded
prompts (``builtin``) keep the README's demo runnable with no data at all. Any other name that
is a ``.jsonl`` file is read as one prompt per line: ``{"messages": [...]}`` (the conversation up to
its last user turn; the reply that follows is dropped) or ``{"prompt": ...}``.
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

from dartcore.errors import CorpusError
from dartcore.paths import data_dir_from_env

__all__ = ["DATASETS", "BUILTIN_PROMPTS", "find_data_dir", "load_prompts"]

DATASETS = ("humaneval", "gsm8k", "code_alpaca", "general", "builtin")

GENERAL_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "eval" / "general_heldout.jsonl"

BUILTIN_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Explain what a hash map is and give a short Python example.",
    "Write a Python function that checks whether a string is a palindrome.",
    "A train travels 60 miles per hour for 3 hours. How far does it travel?",
]


def find_data_dir(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The evaluation data directory (one with ``eval/``), or None when there is none: the one
    the user names (``explicit``, else ``$DARTCORE_DATA``); nothing is looked for elsewhere."""
    c = Path(explicit) if explicit else data_dir_from_env()
    return c if c is not None and (c / "eval").is_dir() else None


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _user_texts(dataset: str, data_dir: Path) -> list[str]:
    ev = data_dir / "eval"
    if dataset == "humaneval":
        rows = _read_jsonl(ev / "humaneval.jsonl.gz")
        return ["Complete the following Python function.\n\n" + r["prompt"] for r in rows]
    if dataset == "gsm8k":
        return [r["question"] for r in _read_jsonl(ev / "gsm8k_test.jsonl")]
    if dataset == "code_alpaca":
        rows = json.loads((ev / "code_alpaca_2k.json").read_text(encoding="utf-8"))
        return [r["instruction"] + (("\n\n" + r["input"]) if r.get("input") else "") for r in rows]
    raise CorpusError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASETS)}")


def _file_prompts(path: Path) -> list[list[dict]]:
    """One chat prompt per line of a JSONL file (see the module docs)."""
    try:
        rows = _read_jsonl(path)
    except (OSError, UnicodeDecodeError, EOFError, json.JSONDecodeError) as exc:
        raise CorpusError(f"cannot read prompts from {path}: {exc}") from exc
    out = []
    for i, r in enumerate(rows):
        msgs = r.get("messages") if isinstance(r, dict) else None
        if (
            isinstance(msgs, list)
            and msgs
            and all(
                isinstance(m, dict)
                and isinstance(m.get("content"), str)
                and m.get("role") in ("system", "user", "assistant")
                for m in msgs
            )
        ):
            last = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
            msgs = [{"role": m["role"], "content": m["content"]} for m in msgs[: last + 1]]
        elif isinstance(r, dict) and isinstance(r.get("prompt"), str):
            msgs = [{"role": "user", "content": r["prompt"]}]
        else:
            msgs = None
        if not msgs or msgs[-1]["role"] != "user":
            raise CorpusError(
                f'{path}:{i + 1}: expected {{"messages": [..., user]}} or {{"prompt": str}}'
            )
        out.append(msgs)
    if not out:
        raise CorpusError(f"{path}: no prompts")
    return out


def load_prompts(
    dataset: str, n: int, data_dir: str | os.PathLike[str] | None = None
) -> list[list[dict]]:
    """The first ``n`` prompts of a dataset as chat messages (ending with the user's turn)."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if dataset == "general":
        return _file_prompts(GENERAL_PROMPTS)[:n]
    if dataset not in DATASETS and dataset.endswith(".jsonl"):
        if not Path(dataset).is_file():
            raise CorpusError(f"no such prompt file: {dataset}")
        return _file_prompts(Path(dataset))[:n]
    if dataset == "builtin":
        texts = BUILTIN_PROMPTS
    else:
        root = find_data_dir(data_dir)
        if root is None:
            named = data_dir or data_dir_from_env()
            where = f"{named!s} has no eval/ directory" if named else "none found"
            raise CorpusError(
                f"dataset {dataset!r} needs the evaluation data sets (eval/*.json*; {where}); "
                "pass --data-dir or set DARTCORE_DATA, or use the 'builtin' prompts"
            )
        texts = _user_texts(dataset, root)
    return [[{"role": "user", "content": t}] for t in texts[:n]]
