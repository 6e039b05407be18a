"""dart-generate and dart-bench from the command line (subprocess): --help lists every
registered tree builder and shows the defaults; every user error is one line, exit status 2,
names the flag and the fix, and comes before the model loads; --stats is readable."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from cli_helpers import cli_env, run_cli


@pytest.fixture(scope="module")
def indexes(tmp_path_factory):
    """A tiny valid index per built-in tokenizer name (qwen3, smollm2), a foreign file and a
    truncated index: only the header and metadata matter to the checks under test."""
    import numpy as np

    from dartcore.index import build_index

    root = tmp_path_factory.mktemp("cli_indexes")
    out = {}
    for name, vocab in (("qwen3", 151669), ("smollm2", 49152)):
        path = root / f"{name}.idx"
        build_index(
            [np.array([5, 6, 7, 5, 6], dtype=np.uint32)],
            path,
            vocab_size=vocab,
            metadata={"tokenizer": {"name": name, "fingerprint": "0" * 16, "vocab_size": vocab}},
        )
        out[name] = path
    (root / "foreign.idx").write_bytes(b"not an index at all" * 10)
    out["foreign"] = root / "foreign.idx"
    data = out["smollm2"].read_bytes()
    (root / "truncated.idx").write_bytes(data[: len(data) // 2])
    out["truncated"] = root / "truncated.idx"
    return out


def _one_line_error(r, prog: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    err = r.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"{prog}: error: "), err
    assert "Loading weights" not in r.stderr  # the model never loaded
    return err


@pytest.mark.parametrize("module", ["dart_generate", "dart_bench"])
def test_help_lists_every_registered_tree_builder(module):
    # the registry as a fresh process sees it (tests register private builders in this one)
    listed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from dartcore.trees import tree_builders; print(' '.join(tree_builders()))",
        ],
        capture_output=True,
        text=True,
        env=cli_env(),
        check=True,
    )
    names = listed.stdout.split()
    r = run_cli(module, "--help")
    assert r.returncode == 0
    # argparse wraps lines, also after a hyphen ("dart- official")
    text = " ".join(r.stdout.split())
    text = re.sub(r"(?<=\w)- (?=\w)", "-", text)
    assert {"dart", "dart+ctx", "dart+ngram"} <= set(names)
    for name in names:
        assert re.search(rf"(?<![\w+-]){re.escape(name)}(?![\w+-])", text), name


def test_help_shows_defaults():
    r = run_cli("dart_generate", "--help")
    text = " ".join(r.stdout.split())
    assert "stop after this many new tokens (default: 256)" in text
    assert (
        "(default: dart+live on the CPU, dart on CUDA)" in text and "(default: 0, greedy)" in text
    )
    r = run_cli("dart_bench", "--help")
    text = " ".join(r.stdout.split())
    for flag, default in (
        ("--n", "5"),
        ("--temperatures", "0,1"),
        ("--max-new-tokens", "128"),
        ("--out", "artifacts/bench"),
        ("--datasets", "humaneval,gsm8k,code_alpaca"),
    ):
        assert f"(default: {default})" in text, flag
    from dartcore.benchmark.runner import DEFAULT_METHODS

    assert f"(default: {','.join(DEFAULT_METHODS)})" in text.replace(" ", "").replace(
        "(default:", "(default: "
    )


@pytest.mark.parametrize(
    "args, cls, needles",
    [
        (["--tree", "dartt", "hi"], None, ["--tree 'dartt'", "did you mean 'dart'"]),
        (["hi"], None, ["--tree dart+live needs an n-gram index", "--index", "tools/demo.sh"]),
        (
            ["--index", "/nonexistent/smollm2.idx", "hi"],
            "MissingFileError",
            ["--index /nonexistent/smollm2.idx", "ngram-build"],
        ),
        (["--index", "{foreign}", "hi"], "IndexFormatError", ["--index", "ngram-build"]),
        (["--index", "{truncated}", "hi"], "IndexFormatError", ["--index"]),
        (
            ["--index", "{qwen3}", "hi"],
            "TokenizerMismatchError",
            ["--index", "qwen3", "smollm2", "ngram-build --tokenizer smollm2"],
        ),
        (
            ["--index", "{smollm2}", "--drafter", "/nonexistent/drafter", "hi"],
            "MissingFileError",
            ["--drafter", "dart-train"],
        ),
        (
            ["--target", "smollm3", "--tree", "ar", "hi"],
            "MissingFileError",
            ["--target", "did you mean 'smollm2'"],
        ),
        (["--tree", "ar", "--tree-param", "max_nodes", "hi"], None, ["--tree-param", "KEY=VALUE"]),
        (["--tree", "ar", "--max-new-tokens", "-1", "hi"], None, ["--max-new-tokens"]),
        (["--tree", "ar", " "], None, ["empty prompt"]),
    ],
)
def test_generate_errors(indexes, args, cls, needles):
    args = [a.format(**indexes) for a in args]
    err = _one_line_error(run_cli("dart_generate", *args), "dart-generate")
    if cls:
        assert f"{cls}:" in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(
    "args, cls, needles",
    [
        (["--methods", "ar,dartt"], None, ["--methods 'dartt'", "did you mean 'dart'"]),
        (
            ["--datasets", "gsm9k", "--methods", "ar"],
            None,
            ["--datasets 'gsm9k'", "did you mean 'gsm8k'"],
        ),
        (["--datasets", "builtin", "--methods", "ar,dart"], None, ["--methods dart", "--index"]),
        (["--datasets", "builtin", "--temperatures", "0,x"], None, ["--temperatures"]),
        (
            ["--datasets", "builtin", "--methods", "ar,dart", "--index", "/nonexistent.idx"],
            "MissingFileError",
            ["--index"],
        ),
        (
            ["--datasets", "builtin", "--methods", "ar,dart", "--index", "{qwen3}"],
            "TokenizerMismatchError",
            ["--index", "qwen3", "smollm2"],
        ),
        (
            ["--datasets", "humaneval", "--methods", "ar", "--data-dir", "/nonexistent"],
            None,
            ["--data-dir"],
        ),
        (
            [
                "--datasets",
                "builtin",
                "--methods",
                "ar,dart",
                "--index",
                "{smollm2}",
                "--drafter",
                "/nonexistent",
            ],
            "MissingFileError",
            ["--drafter"],
        ),
    ],
)
def test_bench_errors(indexes, tmp_path, args, cls, needles):
    args = [a.format(**indexes) for a in args] + ["--out", str(tmp_path / "bench")]
    err = _one_line_error(run_cli("dart_bench", *args), "dart-bench")
    if cls:
        assert f"{cls}:" in err
    for needle in needles:
        assert needle in err, (needle, err)
    assert not (tmp_path / "bench").exists()  # nothing written before the checks pass


def test_bench_without_eval_data_names_the_fix(tmp_path):
    err = _one_line_error(
        run_cli(
            "dart_bench",
            "--methods",
            "ar",
            "--datasets",
            "gsm8k",
            cwd=tmp_path,
            DARTCORE_DATA=str(tmp_path),
        ),
        "dart-bench",
    )
    assert "CorpusError:" in err and "--datasets gsm8k" in err and "--data-dir" in err


def test_stats_are_readable():
    from dartcore.cli.dart_generate import format_stats
    from dartcore.decoder import GenerationStats

    s = GenerationStats(
        prompt_tokens=31,
        new_tokens=64,
        rounds=30,
        accept_hist=[10, 12, 8],
        total_s=1.2345678901234,
        finish_reason="length",
    )
    s.seconds = {
        "prefill": 0.10602130400002352,
        "draft": 0.2,
        "search": 0.01,
        "verify": 1.2345,
        "accept": 0.05,
    }
    text = format_stats(s.as_dict())
    assert "64 new after 31 prompt tokens (length)" in text
    assert f"{64 / 1.2345678901234:.1f} tok/s" in text and "1.23 s" in text
    assert f"tau         {(10 + 24 + 24) / 30:.2f}" in text
    assert "prefill 106 ms (9 %)" in text and "verify 1.23 s (100 %)" in text
    assert not re.search(r"\d\.\d{5,}", text)  # no raw floats


def test_the_node_budget_is_max_nodes_in_every_cli_and_old_spellings_still_work():
    notice = "is deprecated, use --max-nodes"
    for module in ("dart_generate", "dart_bench", "dart_serve"):
        assert "--max-nodes" in run_cli(module, "--help").stdout, module
    # dart-generate: --tree-param max_nodes= still sets the budget (a bad one fails as before), with a notice
    r = run_cli("dart_generate", "--tree", "ar", "--tree-param", "max_nodes=0", "hi")
    assert (
        r.returncode == 2
        and f"--tree-param max_nodes= {notice}" in r.stderr
        and "max_nodes" in r.stderr
    )
    r = run_cli("dart_generate", "--tree", "ar", "--max-nodes", "0", "hi")
    assert r.returncode == 2 and notice not in r.stderr and "max_nodes" in r.stderr
    r = run_cli(
        "dart_generate", "--tree", "ar", "--max-nodes", "3", "--tree-param", "max_nodes=4", "hi"
    )
    assert r.returncode == 2 and "disagree" in r.stderr
    # dart-serve: --budget is --max-nodes (checked the same way), with a notice
    r = run_cli("dart_serve", "--budget", "3", "--index", "/nonexistent/smollm2.idx")
    assert r.returncode == 2 and f"--budget {notice}" in r.stderr and "--index" in r.stderr
    r = run_cli("dart_serve", "--max-nodes", "-1")
    assert r.returncode == 2 and "--max-nodes must be 'adaptive' or a node count >= 0" in r.stderr


def test_dart_serve_says_when_learn_feeds_a_tree_that_reads_no_live_layer():
    """--learn with a tree that reads no live layer (the default dart) gets a one-line notice;
    a tree that reads it gets none. Both then fail on the missing target as usual."""
    notice = "reads no live layer"
    r = run_cli("dart_serve", "--learn", "--target", "/nonexistent/model")
    assert r.returncode == 2 and notice in r.stderr and "--learn: the dart tree" in r.stderr
    for tree in ("dart+live", "dart+mix", "suffix"):
        r = run_cli("dart_serve", "--learn", "--tree", tree, "--target", "/nonexistent/model")
        assert r.returncode == 2 and notice not in r.stderr, (tree, r.stderr)
    r = run_cli("dart_serve", "--target", "/nonexistent/model")
    assert r.returncode == 2 and notice not in r.stderr
    from dartcore.trees import make_tree_builder, reads_live

    assert [reads_live(make_tree_builder(t)) for t in ("dart", "dart+ctx", "ar", "dart+live")] == [
        False,
        False,
        False,
        True,
    ]


@pytest.mark.slow
def test_numerics_picks_the_block_products_and_both_decode():
    # the default target is the shipped GGUF: int8 and exact numerics both load and decode
    for numerics in ("int8", "exact"):
        r = run_cli(
            "dart_generate", "--tree", "ar", "--numerics", numerics, "--max-new-tokens", "4", "Hi"
        )
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip(), numerics
    r = run_cli("dart_generate", "--tree", "ar", "--numerics", "fast", "Hi")
    assert r.returncode == 2 and "--numerics" in r.stderr
