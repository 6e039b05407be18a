"""Builds never destroy data and reject bad arguments before any work: an output that is
(or is inside) an input, resume after a corpus change, leftovers of killed builds, thread
counts, builder arguments, DART_NUM_THREADS, and `dart-index install`."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("dartcore._native", reason="the Rust extension is not built (pip install -e .)")

from dartcore.cli.dart_index import main as dart_index  # noqa: E402
from dartcore.cli.ngram_build import main  # noqa: E402
from dartcore.errors import DartError, IndexBuildArgumentError, IndexBuildError  # noqa: E402
from dartcore.index import IndexBuilder, NgramIndex, build_index, parse_size  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "it", "ran", "away", "quickly"]


def run(*args) -> int:
    return main([str(a) for a in args])


def corpus(
    tmp_path: Path, n_shards: int = 3, docs_per: int = 30, seed: int = 0, name: str = "corpus"
) -> Path:
    rng = np.random.default_rng(seed)
    root = tmp_path / name
    (root / "documents").mkdir(parents=True)
    for s in range(n_shards):
        lines = [
            json.dumps(
                {
                    "id": f"{s}-{i}",
                    "text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40)))),
                }
            )
            for i in range(docs_per)
        ]
        (root / "documents" / f"part-{s:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def err_of(capsys) -> str:
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- outputs that are inputs


def test_output_that_is_an_input_shard_is_refused(tmp_path, capsys):
    root = corpus(tmp_path)
    before = snapshot(root)
    shard = root / "documents" / "part-001.jsonl"
    link = tmp_path / "link.idx"
    link.symlink_to(shard)
    hard = tmp_path / "hard.idx"
    os.link(shard, hard)
    os.chdir(root / "documents")
    for out in (shard, link, hard, Path("../documents/part-001.jsonl")):
        assert run("--corpus", "jsonl", "--corpus-dir", root, "--output", out, "--quiet") == 2, out
        err = err_of(capsys)
        assert "IndexBuildError" in err and "--output" in err and "input" in err, err
    assert snapshot(root) == before
    assert not any(p.name.endswith(".work") for p in tmp_path.rglob("*"))


def test_output_inside_the_corpus_dir_or_the_tokenizer_is_refused(tmp_path, capsys):
    root = tmp_path / "texts"
    root.mkdir()
    (root / "a.txt").write_text("one two three four\n")
    (root / "b.txt").write_text("five six seven\n")
    before = snapshot(root)
    assert run("--corpus", "text", "--corpus-dir", root, "--output", root / "x.idx", "--quiet") == 2
    err = err_of(capsys)
    assert "inside the input directory" in err and "--output" in err
    # The tokenizer file is an input too.
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b"{}")
    assert (
        run(
            "--corpus",
            "text",
            "--files",
            root / "a.txt",
            "--tokenizer",
            tok,
            "--output",
            tok,
            "--quiet",
        )
        == 2
    )
    assert b"{}" == tok.read_bytes()
    assert snapshot(root) == before
    # A work dir inside the corpus, or holding it, is refused as well.
    assert (
        run(
            "--corpus",
            "text",
            "--corpus-dir",
            root,
            "--output",
            tmp_path / "y.idx",
            "--work-dir",
            root,
            "--quiet",
        )
        == 2
    )
    assert "--work-dir" in err_of(capsys)
    (tmp_path / "out").mkdir()
    assert (
        run(
            "--corpus",
            "text",
            "--corpus-dir",
            root,
            "--output",
            tmp_path / "out" / "y.idx",
            "--work-dir",
            tmp_path,
            "--quiet",
        )
        == 2
    )
    assert "--work-dir" in err_of(capsys)
    assert (
        run(
            "--corpus",
            "text",
            "--corpus-dir",
            root,
            "--output",
            tmp_path / "out" / "y.idx",
            "--work-dir",
            tmp_path / "out",
            "--quiet",
        )
        == 2
    )
    assert "inside --work-dir" in err_of(capsys)
    assert snapshot(root) == before


def test_reduce_output_in_the_work_dir_is_refused(tmp_path, capsys):
    root = corpus(tmp_path, n_shards=2)
    work = tmp_path / "w"
    assert run("map", "--corpus", "jsonl", "--corpus-dir", root, "--work-dir", work, "--quiet") == 0
    before = snapshot(work)
    run_file = next(work.rglob("*.dartrun"))
    for out in (work / "manifest.json", run_file, work / "x.idx"):
        assert run("reduce", "--work-dir", work, "--output", out, "--quiet") == 2
        err = err_of(capsys)
        assert "--output" in err and "input" in err, err
    assert snapshot(work) == before
    assert run("reduce", "--work-dir", work, "--output", tmp_path / "ok.idx", "--quiet") == 0


def test_reduce_refuses_shards_changed_since_map(tmp_path, capsys):
    root = corpus(tmp_path, n_shards=2)
    work = tmp_path / "w"
    assert run("map", "--corpus", "jsonl", "--corpus-dir", root, "--work-dir", work, "--quiet") == 0
    _rewrite_same_size(root / "documents" / "part-000.jsonl", keep_mtime=False)
    assert run("reduce", "--work-dir", work, "--output", tmp_path / "x.idx", "--quiet") == 2
    err = err_of(capsys)
    assert "part-000.jsonl changed" in err and "--resume" in err
    assert not (tmp_path / "x.idx").exists()
    assert (
        run(
            "map",
            "--corpus",
            "jsonl",
            "--corpus-dir",
            root,
            "--work-dir",
            work,
            "--quiet",
            "--resume",
        )
        == 0
    )
    assert run("reduce", "--work-dir", work, "--output", tmp_path / "x.idx", "--quiet") == 0
    fresh = tmp_path / "fresh.idx"
    assert run("--corpus", "jsonl", "--corpus-dir", root, "--output", fresh, "--quiet") == 0
    assert (tmp_path / "x.idx").read_bytes() == fresh.read_bytes()


def test_python_build_index_refuses_its_input_and_missing_directories(tmp_path):
    doc = tmp_path / "doc.npy"
    np.save(doc, np.array([1, 2, 3, 1, 2], np.uint32))
    before = doc.read_bytes()
    with pytest.raises(IndexBuildError, match="input") as e:
        build_index([str(doc)], doc, vocab_size=10)
    assert "output" in str(e.value)
    assert doc.read_bytes() == before
    with pytest.raises(IndexBuildError, match="does not exist") as e:
        build_index([np.array([1, 2], np.uint32)], tmp_path / "no" / "x.idx", vocab_size=10)
    assert "index file not found" not in str(e.value)
    with pytest.raises(IndexBuildError, match="is a directory"):
        build_index([np.array([1, 2], np.uint32)], tmp_path, vocab_size=10)


# ----------------------------------------------------------------------------- resume after a change


def _rewrite_same_size(path: Path, keep_mtime: bool) -> None:
    st = os.stat(path)
    data = path.read_bytes()
    # Swap two words of equal length: same size, other n-grams.
    new = data.replace(b'"the ', b'"XYZ ', 3)
    assert new != data and len(new) == len(data)
    path.write_bytes(new)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("keep_mtime", [False, True], ids=["mtime-changed", "mtime-restored"])
def test_resume_after_same_size_change_equals_fresh_build(tmp_path, keep_mtime, capsys):
    root = corpus(tmp_path, n_shards=4)
    out = tmp_path / "r.idx"
    assert (
        run(
            "--corpus",
            "jsonl",
            "--corpus-dir",
            root,
            "--output",
            out,
            "--quiet",
            "--stop-after-shards",
            3,
        )
        == 130
    )
    manifest = json.loads((tmp_path / "r.idx.work" / "manifest.json").read_text())
    assert sorted(manifest["shards"]) == ["0", "1", "2"]
    assert all(len(s["input"]["sha256"]) == 64 for s in manifest["shards"].values())
    _rewrite_same_size(root / "documents" / "part-001.jsonl", keep_mtime)
    capsys.readouterr()
    assert run("--corpus", "jsonl", "--corpus-dir", root, "--output", out, "--resume") == 0
    assert "part-001.jsonl" in capsys.readouterr().err  # says which shard is mapped again
    fresh = tmp_path / "fresh.idx"
    assert run("--corpus", "jsonl", "--corpus-dir", root, "--output", fresh, "--quiet") == 0
    assert out.read_bytes() == fresh.read_bytes()


def test_resume_after_a_shard_grew_equals_fresh_build(tmp_path):
    root = corpus(tmp_path, n_shards=3)
    out = tmp_path / "r.idx"
    assert (
        run(
            "--corpus",
            "jsonl",
            "--corpus-dir",
            root,
            "--output",
            out,
            "--quiet",
            "--stop-after-shards",
            2,
        )
        == 130
    )
    with open(root / "documents" / "part-000.jsonl", "a") as f:
        f.write(json.dumps({"text": "a brand new document about the mat"}) + "\n")
    assert (
        run("--corpus", "jsonl", "--corpus-dir", root, "--output", out, "--quiet", "--resume") == 0
    )
    fresh = tmp_path / "fresh.idx"
    assert run("--corpus", "jsonl", "--corpus-dir", root, "--output", fresh, "--quiet") == 0
    assert out.read_bytes() == fresh.read_bytes()
    assert NgramIndex(str(out)).metadata["documents"] == 3 * 30 + 1


# ----------------------------------------------------------------------------- leftovers


def test_stale_temp_files_of_killed_reduce_are_removed_live_ones_kept(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    # A killed builder's section dir (lock file free), a killed writer's .partial, and a
    # live builder's section dir (this process holds its lock).
    dead = out_dir / ".dart-ngram-sections-dead"
    dead.mkdir()
    (dead / ".lock").touch()
    (dead / "L3").write_bytes(b"x" * 1000)
    partial = out_dir / ".dart-ngram-abc123.partial"
    partial.write_bytes(b"y" * 1000)
    old = time.time() - 60
    os.utime(partial, (old, old))
    live = out_dir / ".dart-ngram-sections-live"
    live.mkdir()
    fd = os.open(live / ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    mine = out_dir / "notes.partial"
    mine.write_text("a user's file")
    try:
        build_index([np.array([1, 2, 3], np.uint32)], out_dir / "x.idx", vocab_size=10)
        assert not dead.exists() and not partial.exists()
        assert live.is_dir() and mine.read_text() == "a user's file"
    finally:
        os.close(fd)
    assert NgramIndex(str(out_dir / "x.idx")).count([1], 2) == (1, 1)


def test_kill_9_during_reduce_then_next_build_cleans_up(tmp_path):
    out = tmp_path / "big.idx"
    script = (
        "import numpy as np, sys\n"
        "from dartcore.index import build_index\n"
        "rng = np.random.default_rng(0)\n"
        "docs = [rng.integers(0, 60000, 200000, dtype=np.uint32) for _ in range(30)]\n"
        f"build_index(docs, {str(out)!r}, vocab_size=60000, memory_limit='64M')\n"
    )
    env = dict(
        os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        # Kill once the reduce is writing sections (its dir is set up and locked).
        if any(
            p.name.startswith(".dart-ngram-sections-") and (p / ".lock").exists()
            for p in tmp_path.iterdir()
        ):
            break
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".dart-ngram")]
    if not left:
        pytest.skip("the build finished (or had not started its reduce) before the kill")
    build_index([np.array([1, 2, 3], np.uint32)], tmp_path / "next.idx", vocab_size=10)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dart-ngram")]


def test_failed_build_without_finished_shards_removes_its_work_dir(tmp_path, capsys):
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.jsonl").write_text('{"text": "fine"}\nnot json\n')
    out = tmp_path / "f.idx"
    assert (
        run("--corpus", "jsonl", "--corpus-dir", root, "--output", out, "--strict", "--quiet") == 2
    )
    assert "CorpusError" in err_of(capsys)
    assert not (tmp_path / "f.idx.work").exists()


def test_failed_build_with_finished_shards_keeps_them_and_says_resume(tmp_path, capsys):
    root = corpus(tmp_path, n_shards=3)
    (root / "documents" / "part-002.jsonl").write_text('{"text": "ok"}\nbroken\n')
    out = tmp_path / "f.idx"
    assert (
        run("--corpus", "jsonl", "--corpus-dir", root, "--output", out, "--strict", "--quiet") == 2
    )
    err = err_of(capsys)
    assert "--resume" in err and "f.idx.work" in err
    assert len(json.loads((tmp_path / "f.idx.work" / "manifest.json").read_text())["shards"]) == 2


def test_lock_of_a_killed_map_is_taken_over(tmp_path):
    root = corpus(tmp_path, n_shards=2)
    work = tmp_path / "w"
    work.mkdir()
    # The pid of a live process, but no flock held: what kill -9 of a map leaves behind.
    (work / "LOCK").write_text(str(os.getpid()))
    assert (
        run(
            "--corpus",
            "jsonl",
            "--corpus-dir",
            root,
            "--output",
            tmp_path / "x.idx",
            "--work-dir",
            work,
            "--quiet",
        )
        == 0
    )


def test_live_lock_is_respected(tmp_path, capsys):
    root = corpus(tmp_path, n_shards=1)
    work = tmp_path / "w"
    work.mkdir()
    fd = os.open(work / "LOCK", os.O_CREAT | os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242")
    try:
        assert (
            run(
                "--corpus",
                "jsonl",
                "--corpus-dir",
                root,
                "--output",
                tmp_path / "x.idx",
                "--work-dir",
                work,
                "--quiet",
            )
            == 2
        )
        assert "in use by process 4242" in err_of(capsys)
    finally:
        os.close(fd)


# ----------------------------------------------------------------------------- arguments


def test_thread_counts_are_capped(tmp_path):
    t0 = time.monotonic()
    for bad in (10**6, 0, -1, 2.5, True):
        with pytest.raises(IndexBuildArgumentError, match="threads") as e:
            build_index(
                [np.array([1, 2], np.uint32)], "/tmp/never-written.idx", vocab_size=10, threads=bad
            )
        assert "4096" in str(e.value)
    assert time.monotonic() - t0 < 2
    assert not os.path.exists("/tmp/never-written.idx")
    # The largest valid count runs on at most the CPUs there are (uncapped, 4096 threads on
    # 2 CPUs took 70 s for this build).
    t0 = time.monotonic()
    build_index([np.arange(100, dtype=np.uint32)], tmp_path / "x.idx", vocab_size=200, threads=4096)
    assert time.monotonic() - t0 < 10
    assert NgramIndex(str(tmp_path / "x.idx")).count([5], 6) == (1, 1)


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"vocab_size": -5}, "vocab_size"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"vocab_size": 2**21}, "vocab_size"),
        ({"vocab_size": True}, "vocab_size"),
        ({"vocab_size": 10.0}, "vocab_size"),
        ({"min_count": 0}, "min_count"),
        ({"max_children": 0}, "max_children"),
        ({"token_bits": 99}, "token_bits"),
        ({"memory_limit": "lots"}, "memory_limit"),
        ({"memory_limit": -1}, "memory_limit"),
        ({"memory_limit": 1000}, "memory_limit"),
        ({"threads": 5000}, "threads"),
    ],
)
def test_builder_arguments_name_the_argument_and_range(kw, name):
    args = {"vocab_size": 10, **kw}
    vocab = args.pop("vocab_size")
    with pytest.raises(IndexBuildArgumentError) as e:
        IndexBuilder(vocab, **args)
    assert isinstance(e.value, ValueError) and isinstance(e.value, DartError)
    assert str(e.value).startswith(name), str(e.value)


def test_two_d_documents_are_an_error_not_flattened(tmp_path):
    with pytest.raises(IndexBuildArgumentError, match=r"1-D.*shape \(2, 3\)"):
        build_index(
            [np.array([[1, 2, 3], [4, 5, 6]], np.uint32)], tmp_path / "x.idx", vocab_size=10
        )
    assert not (tmp_path / "x.idx").exists()


def test_parse_size_errors_name_the_argument():
    assert (
        parse_size("1.5G") == 3 << 29
        and parse_size(" 64 MiB ") == 64 << 20
        and parse_size(4096) == 4096
    )
    for bad in ("lots", "-1", "0", "1e9", "", True, None, 2.5, 0, 1 << 70):
        with pytest.raises(IndexBuildArgumentError) as e:
            parse_size(bad, what="--memory")
        assert str(e.value).startswith("--memory"), str(e.value)


def test_cli_arguments_are_checked_before_work(tmp_path, capsys):
    root = corpus(tmp_path, n_shards=1)
    for flag, value in (
        ("--memory", "8X"),
        ("--threads", "1000000"),
        ("--threads", "-1"),
        ("--max-docs", "0"),
        ("--min-count", "0"),
        ("--max-children", "0"),
    ):
        with pytest.raises(SystemExit) as e:
            run(
                "--corpus",
                "jsonl",
                "--corpus-dir",
                root,
                "--output",
                tmp_path / "x.idx",
                flag,
                value,
            )
        assert e.value.code == 2
        assert flag in capsys.readouterr().err
    assert (
        run(
            "--corpus",
            "jsonl",
            "--corpus-dir",
            root,
            "--output",
            tmp_path / "x.idx",
            "--temp-dir",
            tmp_path / "nowhere",
        )
        == 2
    )
    assert "--temp-dir" in err_of(capsys)
    assert not any(p.name.endswith(".work") for p in tmp_path.iterdir())


def test_help_shows_defaults_and_a_line_per_option(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for needle in (
        "(default: 8G)",
        "(default: dolma)",
        "(default: qwen3)",
        "(default: 1)",
        "dart-index install",
    ):
        assert needle in text
    import argparse

    from dartcore.cli.ngram_build import build_parser

    for action in build_parser()._actions:
        if action.help is not argparse.SUPPRESS:
            assert action.help, action.option_strings
    with pytest.raises(SystemExit):
        dart_index(["install", "--help"])
    assert "SIGBUS" in capsys.readouterr().out


# ----------------------------------------------------------------------------- DART_NUM_THREADS


def _threads_in_child(value: str | None) -> tuple[int, int, str]:
    env = dict(
        os.environ, PYTHONPATH=str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    env.pop("DART_NUM_THREADS", None)
    if value is not None:
        env["DART_NUM_THREADS"] = value
    code = (
        "from dartcore.index import num_threads\n"
        "from dartcore.tokenizers import QwenTokenizer\n"
        "print(num_threads(), QwenTokenizer()._threads)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    a, b = r.stdout.split()
    return int(a), int(b), r.stderr


def test_dart_num_threads_one_rule_everywhere():
    cpus = len(os.sched_getaffinity(0))
    assert _threads_in_child(None)[:2] == (cpus, cpus)
    assert _threads_in_child("3")[:2] == (3, 3)
    for bad in ("abc", "0", "-2"):
        n, t, err = _threads_in_child(bad)
        assert (n, t) == (cpus, cpus)
        assert "DART_NUM_THREADS" in err and bad in err
    n, t, err = _threads_in_child("1000000")
    assert (n, t) == (4096, 4096) and "cap" in err


# ----------------------------------------------------------------------------- dart-index install


def _index(path: Path, docs, vocab=10, tokenizer="t1") -> Path:
    build_index(
        [np.array(d, np.uint32) for d in docs],
        path,
        vocab_size=vocab,
        metadata={"tokenizer": {"name": tokenizer, "fingerprint": tokenizer}},
    )
    return path


def test_install_replaces_by_rename_and_old_readers_keep_their_mapping(tmp_path, capsys):
    target = _index(tmp_path / "x.idx", [[1, 2, 3]])
    new = _index(tmp_path / "x.idx.new", [[1, 2, 4], [1, 2, 4]])
    reader = NgramIndex(str(target))  # maps the old file
    inode = os.stat(target).st_ino
    new_bytes = new.read_bytes()
    assert dart_index(["install", str(new), str(target)]) == 0
    assert target.read_bytes() == new_bytes and os.stat(target).st_ino != inode and not new.exists()
    assert reader.count([1, 2], 3) == (1, 1)  # the old mapping is intact
    assert NgramIndex(str(target)).count([1, 2], 4) == (2, 2)


def test_install_refuses_bad_new_and_keeps_target(tmp_path, capsys):
    target = _index(tmp_path / "x.idx", [[1, 2, 3]])
    before = target.read_bytes()
    bad = tmp_path / "bad.idx"
    data = bytearray(_index(tmp_path / "b.idx", [[1, 2, 4]]).read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert dart_index(["install", str(bad), str(target)]) == 2
    assert "IndexFormatError" in err_of(capsys)
    assert dart_index(["install", str(tmp_path / "missing.idx"), str(target)]) == 2
    assert "does not exist" in err_of(capsys)
    assert dart_index(["install", str(tmp_path / "b.idx"), str(tmp_path)]) == 2
    assert "is a directory" in err_of(capsys)
    other = _index(tmp_path / "o.idx", [[1, 2, 5]], tokenizer="t2")
    assert dart_index(["install", str(other), str(target)]) == 2
    assert "--force" in err_of(capsys)
    link = tmp_path / "link.idx"
    link.symlink_to(tmp_path / "b.idx")
    assert dart_index(["install", str(link), str(target)]) == 2
    assert "symlink" in err_of(capsys) and (tmp_path / "b.idx").is_file()
    assert target.read_bytes() == before and bad.is_file() and other.is_file()
    assert dart_index(["install", "--force", str(other), str(target)]) == 0


def test_install_across_filesystems_needs_copy(tmp_path, capsys):
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's temp dir")
    target = _index(tmp_path / "x.idx", [[1, 2, 3]])
    new = _index(shm / f"dart-test-{os.getpid()}.idx", [[1, 2, 4]])
    try:
        assert dart_index(["install", str(new), str(target)]) == 2
        err = err_of(capsys)
        assert "another filesystem" in err and "--copy" in err
        assert dart_index(["install", "--copy", str(new), str(target)]) == 0
        assert target.read_bytes() == new.read_bytes()
        assert not [p for p in tmp_path.iterdir() if ".install-" in p.name]
    finally:
        new.unlink(missing_ok=True)
