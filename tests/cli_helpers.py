"""Helpers of the command-line tests: run a dartcore CLI in a subprocess with this
checkout's package, and a tiny random target saved as a Hugging Face directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORDS = (
    "the cat dog sat on a mat and ran to see big small red blue one two three four five six "
    "seven eight nine ten is was it he she we they you I my your this that what where why how"
).split()


def cli_env(**extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO / "python") + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("DART_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_cli(
    module: str, *args: str, cwd=None, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"dartcore.cli.{module}", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
        env=cli_env(**env),
    )


def save_tiny_target(path: Path, model=None) -> Path:
    """A 6-layer random Llama (vocabulary 64; or ``model``) with a word-level tokenizer, as a
    local HF model directory that ``--target`` accepts."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conftest import tiny_model

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= 64
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    path.mkdir(parents=True, exist_ok=True)
    (model if model is not None else tiny_model("llama", layers=6)).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_text_corpus(path: Path, docs: int = 40, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    for i in range(docs):
        (path / f"doc{i:03d}.txt").write_text(
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120)))
        )
    return path
