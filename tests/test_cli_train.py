"""dart-train from the command line (subprocess): help, errors before the model loads, and a
run interrupted by SIGINT that resumes to the same state as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import REPO, cli_env, run_cli, save_tiny_target, write_text_corpus


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_train")
    return save_tiny_target(root / "target"), write_text_corpus(root / "corpus")


def _common(target, corpus, out, steps):
    return [
        "--target",
        str(target),
        "--data",
        str(corpus),
        "--out",
        str(out),
        "--holdout",
        "4",
        "--ctx-len",
        "64",
        "--batch-size",
        "2",
        "--anchors",
        "16",
        "--warmup",
        "2",
        "--eval-every",
        "0",
        "--threads",
        "1",
        "--checkpoint-minutes",
        "60",
        "--max-steps",
        str(steps),
    ]


def test_help_shows_defaults_and_a_line_per_option():
    r = run_cli("dart_train", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    for needle in (
        "optimizer steps in all (default: 1000)",
        "peak learning rate (AdamW) (default: 0.0005)",
        "per 100 steps",
        "Ctrl-C",
        "(default: artifacts/dart-train)",
    ):
        assert needle in text, needle


@pytest.mark.parametrize("module", ["dart_train", "dart_generate", "dart_bench"])
def test_every_option_has_help(module):
    import importlib

    parser = importlib.import_module(f"dartcore.cli.{module}")._parser()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings


@pytest.mark.parametrize(
    "args, cls, needle",
    [
        (["--target", "smollm3", "--data", "x"], "MissingFileError", "--target"),
        (
            ["--target", "smollm2", "--data", "/nonexistent/train.jsonl"],
            "MissingFileError",
            "--data",
        ),
        (
            ["--target", "smollm2", "--data", str(REPO), "--max-steps", "0"],
            None,
            "--max-steps must be positive",
        ),
        (
            [
                "--target",
                "smollm2",
                "--data",
                str(REPO),
                "--eval-only",
                "--drafter",
                "/nonexistent",
            ],
            "MissingFileError",
            "--drafter",
        ),
        (
            ["--target", "smollm2", "--data", str(REPO), "--resume", "--out", "/nonexistent/run"],
            "MissingFileError",
            "--resume",
        ),
        (["--target", "smollm2", "--data", str(REPO), "--drafter", "smollm2"], None, "--init"),
    ],
)
def test_errors_before_the_model_loads(args, cls, needle):
    t0 = time.time()
    r = run_cli("dart_train", *args)
    assert r.returncode == 2
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("dart-train: error: ") and needle in err, err
    if cls:
        assert cls in err
    assert "Loading weights" not in r.stderr  # the target never loaded
    assert time.time() - t0 < 60


def test_sigint_checkpoints_and_resumes_to_the_same_state(tiny, tmp_path):
    import torch

    target, corpus = tiny
    steps = 400
    ref = tmp_path / "ref"
    r = run_cli("dart_train", *_common(target, corpus, ref, steps), "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]

    run = tmp_path / "run"
    args = _common(target, corpus, run, steps)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dartcore.cli.dart_train", *args, "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(),
    )
    log = run / "log.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= 5:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    last = [ln for ln in err.splitlines() if ln.startswith("dart-train:")]
    assert len(last) == 1 and "SIGINT" in last[0] and "--resume" in last[0], err[-2000:]
    assert "Traceback" not in err
    stopped = torch.load(run / "checkpoint.pt", weights_only=False)
    assert 5 <= stopped["step"] < steps  # stopped early, after the steps it had logged
    assert [
        r["step"] for r in map(json.loads, log.read_text().splitlines()) if not r.get("eval")
    ] == list(range(1, stopped["step"] + 1))

    r = run_cli("dart_train", *args, "--resume", "--no-progress")
    assert r.returncode == 0, r.stderr[-2000:]
    a = torch.load(ref / "checkpoint.pt", weights_only=False)
    b = torch.load(run / "checkpoint.pt", weights_only=False)
    assert (
        a["step"] == b["step"] == steps
        and a["cursor"] == b["cursor"]
        and a["tokens"] == b["tokens"]
    )
    for k, v in a["drafter"].items():
        assert torch.equal(v, b["drafter"][k]), k
    sa, sb = a["opt"]["state"], b["opt"]["state"]
    assert sa.keys() == sb.keys()
    for p in sa:
        for k in sa[p]:
            assert torch.equal(sa[p][k], sb[p][k]), (p, k)
    steps_logged = [
        r["step"] for r in map(json.loads, log.read_text().splitlines()) if not r.get("eval")
    ]
    assert steps_logged == list(range(1, steps + 1))


def test_init_with_draft_vocab_reselects_the_vocabulary(tiny, tmp_path):
    """--init X --draft-vocab N: fine-tunes X with the N most frequent ids of the new data
    (X's rows kept for ids it had); without --draft-vocab, X's vocabulary is kept."""
    from safetensors.torch import load_file

    target, corpus = tiny
    first = tmp_path / "first"
    r = run_cli(
        "dart_train",
        *_common(target, corpus, first, 2),
        "--no-progress",
        "--draft-vocab",
        "40",
        "--export",
        str(first / "export"),
        "--export-dtype",
        "fp32",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    again = tmp_path / "again"
    r = run_cli(
        "dart_train",
        *_common(target, corpus, again, 1),
        "--no-progress",
        "--init",
        str(first / "export"),
        "--draft-vocab",
        "60",
        "--export",
        str(again / "export"),
        "--export-dtype",
        "fp32",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "re-selected the draft vocabulary" in r.stderr and "draft vocabulary 60" in r.stderr
    a, b = (
        load_file(str(first / "export" / "model.safetensors")),
        load_file(str(again / "export" / "model.safetensors")),
    )
    assert a["draft_to_target"].numel() == 40 and b["draft_to_target"].numel() == 60
    # same data: a superset
    assert set(a["draft_to_target"].tolist()) <= set(b["draft_to_target"].tolist())
    kept = tmp_path / "kept"
    r = run_cli(
        "dart_train",
        *_common(target, corpus, kept, 1),
        "--no-progress",
        "--init",
        str(first / "export"),
        "--export",
        str(kept / "export"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "draft vocabulary 40" in r.stderr
