"""ngram-build --engine ray on a local Ray (2 CPUs, started once for the module): the index
is byte-identical to the local engine's, a map task whose worker dies is retried with the
same result, a killed driver resumes; and the partitioned reduce of the local engine.
Bad input (no Ray, an unreachable --address) gives one-line errors."""

from __future__ import annotations

import builtins
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("dartcore._native", reason="the Rust extension is not built (pip install -e .)")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dartcore.cli.ngram_build import main  # noqa: E402
from dartcore.ngram_build.ray_engine import FAULT_ENV  # noqa: E402
from dartcore.ngram_build.reduce import partition_bounds  # noqa: E402
from test_ngram_build import _many_shards  # noqa: E402


def run(*args) -> int:
    return main([str(a) for a in args])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    t = tmp_path_factory.mktemp("raycorpus")
    root = _many_shards(t, n_shards=5, docs_per=60, seed=3)
    ref = t / "local.idx"
    assert run("--corpus-dir", root, "--output", ref, "--quiet") == 0
    return root, ref.read_bytes()


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'dartcore[ray]')")
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    except Exception as e:  # a sandbox without the ports or /dev/shm Ray needs
        pytest.skip(
            f"a local Ray cannot start here: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        )
    yield ray
    ray.shutdown()


def test_local_partitioned_reduce_is_byte_identical(corpus, tmp_path):
    root, ref = corpus
    for p in (2, 7):
        out = tmp_path / f"p{p}.idx"
        assert run("--corpus-dir", root, "--output", out, "--quiet", "--reduce-partitions", p) == 0
        assert out.read_bytes() == ref
        assert not (tmp_path / f"p{p}.idx.work").exists()


def test_partition_bounds_cut_at_first_tokens(tmp_path):
    import numpy as np

    from dartcore.index import IndexBuilder

    b = IndexBuilder(100, memory_limit="64M")
    rng = np.random.default_rng(0)
    b._inner.add_many([rng.integers(0, 100, size=500).astype(np.uint32) for _ in range(20)])
    runs = b._inner.write_runs(str(tmp_path / "runs"))
    bounds = partition_bounds(runs, 4)
    assert bounds[0] == 0 and bounds[-1] == (1 << 64) - 1
    assert bounds == sorted(set(bounds))
    assert 2 <= len(bounds) - 1 <= 4
    assert all(x % (1 << 42) == 0 for x in bounds[:-1])  # a first token's first key
    assert partition_bounds(runs, 1) == [0, (1 << 64) - 1]


def test_unreachable_address_is_one_line(corpus, tmp_path, capsys):
    pytest.importorskip("ray", reason="Ray is not installed")
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray is already connected in this process")
    root, _ = corpus
    assert (
        run(
            "--corpus-dir",
            root,
            "--output",
            tmp_path / "x.idx",
            "--engine",
            "ray",
            "--quiet",
            "--address",
            "127.0.0.1:1",
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "ngram-build: error (IndexBuildError): cannot start or reach --address 127.0.0.1:1"
    )
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "x.idx").exists()


def test_ray_not_installed_is_one_line(corpus, tmp_path, capsys, monkeypatch):
    root, _ = corpus
    real = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert (
        run("--corpus-dir", root, "--output", tmp_path / "x.idx", "--engine", "ray", "--quiet") == 2
    )
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "ngram-build: error (IndexBuildError): --engine ray needs Ray: pip install 'dartcore[ray]'"
    )
    assert not (tmp_path / "x.idx").exists()


def test_address_without_ray_engine_is_refused(corpus, tmp_path, capsys):
    root, _ = corpus
    assert (
        run("--corpus-dir", root, "--output", tmp_path / "x.idx", "--address", "auto", "--quiet")
        == 2
    )
    assert "--address is for --engine ray" in capsys.readouterr().err


@pytest.mark.slow  # a local Ray takes ~20 s to start
def test_ray_build_is_byte_identical_to_local(local_ray, corpus, tmp_path, capsys):
    root, ref = corpus
    out = tmp_path / "ray.idx"
    assert run("--corpus-dir", root, "--output", out, "--engine", "ray", "--json") == 0
    assert out.read_bytes() == ref
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["engine"] == "ray"
    assert sorted(t["shard"] for t in summary["map_tasks"]) == list(range(5))
    assert sum(t["tokens"] for t in summary["map_tasks"]) == summary["tokens"]
    assert len(summary["reduce_partitions"]) >= 1
    assert not (tmp_path / "ray.idx.work").exists()


@pytest.mark.slow  # a local Ray takes ~20 s to start
def test_killed_map_task_is_retried(local_ray, corpus, tmp_path, monkeypatch):
    root, ref = corpus
    monkeypatch.setenv(FAULT_ENV, "2")
    out = tmp_path / "retried.idx"
    work = tmp_path / "w"
    assert (
        run(
            "--corpus-dir",
            root,
            "--output",
            out,
            "--engine",
            "ray",
            "--quiet",
            "--work-dir",
            work,
            "--keep-work",
        )
        == 0
    )
    assert (work / "ray-00002" / "fault-injected").exists()  # the first attempt did die
    assert out.read_bytes() == ref


@pytest.mark.slow  # a local Ray takes ~20 s to start
def test_killed_driver_resumes(local_ray, corpus, tmp_path, monkeypatch, capsys):
    """A driver that died after mapping some shards: those are kept, the rest mapped on
    --resume; without --resume the half-done work dir is refused."""
    import dartcore.ngram_build.ray_engine as eng

    root, ref = corpus
    out = tmp_path / "resumed.idx"
    work = tmp_path / "resumed.idx.work"
    real = eng.run_reduce

    def die(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(eng, "run_reduce", die)
    assert run("--corpus-dir", root, "--output", out, "--engine", "ray", "--quiet") == 130
    monkeypatch.setattr(eng, "run_reduce", real)
    mapped = sorted(p.name for p in work.iterdir() if p.name.startswith("ray-"))
    assert mapped == [f"ray-{i:05d}" for i in range(5)]
    assert run("--corpus-dir", root, "--output", out, "--engine", "ray", "--quiet") == 2
    capsys.readouterr()
    assert (
        run(
            "--corpus-dir",
            root,
            "--output",
            out,
            "--engine",
            "ray",
            "--quiet",
            "--resume",
            "--json",
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["map_tasks"] == []  # every shard was mapped before: none is mapped again
    assert out.read_bytes() == ref
    assert not work.exists()


@pytest.mark.slow  # a local Ray takes ~20 s to start
def test_a_task_error_is_the_build_error(local_ray, tmp_path, capsys):
    """A map task that raises (a damaged shard under --strict) is not retried: its own
    error, one line, is the build's; the good shards are kept for --resume."""
    root = _many_shards(tmp_path, n_shards=2, docs_per=10, seed=4)
    (root / "documents" / "part-009.json.gz").write_bytes(b"\x1f\x8b\x08\x00broken")
    out = tmp_path / "strict.idx"
    assert run("--corpus-dir", root, "--output", out, "--engine", "ray", "--quiet", "--strict") == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith("ngram-build: error (CorpusError): ")
        and "--strict" in err
        and "--resume" in err
    )
    assert len(err.splitlines()) == 1
    assert not out.exists()
