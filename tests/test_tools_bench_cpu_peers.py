"""tools/bench_cpu_peers.py's llama.cpp side against fake llama.cpp binaries (no llama.cpp needed).

The fakes are small Python programs under the real names: a llama-server that answers /health
and /completion over HTTP on 127.0.0.1 and refuses a request that breaks the benchmark's
contract (prompt as token ids, greedy, no prompt cache), a llama-bench that prints its JSON,
a llama-quantize that records what it was asked. Their answers are fixed functions of the
request, so each expected figure is computed here by hand, not read back from the tool.
"""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FAKE = r'''
import json, os, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

name = sys.argv[1]
args = sys.argv[2:]
log = os.environ.get("FAKE_LLAMA_LOG")
if log:
    with open(log, "a") as f:
        f.write(json.dumps([name, *args]) + "\n")

def opt(flag, default=None):
    return args[args.index(flag) + 1] if flag in args else default

EOS = 2
# per speculative type: ms per predicted token, drafted / accepted per answer, a changed token
SPEC = {None: (10.0, 0, 0, False), "ngram-simple": (5.0, 8, 6, False), "ngram-mod": (4.0, 10, 5, True)}

def answer(prompt, n_predict, spec):
    """The fake model: a fixed continuation of the prompt, EOS after len(prompt) % 4 + 5 tokens."""
    stop = len(prompt) % 4 + 5
    toks = [(sum(prompt) + 7 * i) % 50 + 10 for i in range(min(n_predict, stop))]
    if len(toks) < n_predict:
        toks.append(EOS)
    if SPEC[spec][3] and len(toks) > 1:
        toks[1] += 1  # a speculative type whose output differs from plain decoding
    return toks

if name == "llama-server":
    if "--version" in args:
        print("version: 4242 (fake0c1e)\nbuilt with fake cc")
        sys.exit(0)
    if "--help" in args:
        print("-m, --model FNAME    model path\n"
              "--spec-type none,draft-simple,draft-eagle3,draft-mtp,ngram-simple,ngram-map-k,ngram-mod\n"
              "                     comma-separated list of types of speculative decoding to use")
        sys.exit(0)
    spec = opt("--spec-type")
    assert os.path.isfile(opt("-m")), "model file missing"
    if opt("-lv") == "4":
        print("main: system_info: n_threads = 2 / 2 | CPU : AVX2 = 1 | AVX512 = 1 | REPACK = 1 |", flush=True)
    ready_at = time.monotonic() + 0.3

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200 if time.monotonic() > ready_at else 503, {"status": "ok"})
            else:
                self._send(404, {})

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            ok = (isinstance(req.get("prompt"), list) and all(isinstance(t, int) for t in req["prompt"])
                  and req.get("cache_prompt") is False and req.get("temperature") == 0
                  and req.get("top_k") == 1 and req.get("return_tokens") is True
                  and not req.get("ignore_eos", False))
            if self.path != "/completion" or not ok:
                self._send(400, {"error": "bad request"})
                return
            toks = answer(req["prompt"], req["n_predict"], spec)
            ms, dn, da, _ = SPEC[spec]
            timings = {"prompt_n": len(req["prompt"]), "prompt_ms": 1.0, "predicted_n": len(toks),
                       "predicted_ms": ms * len(toks), "predicted_per_second": 1000.0 / ms}
            if dn:
                timings |= {"draft_n": dn, "draft_n_accepted": da}
            self._send(200, {"content": "x", "tokens": toks, "timings": timings, "stop": True})

    HTTPServer(("127.0.0.1", int(opt("--port"))), H).serve_forever()

elif name == "llama-bench":
    out = []
    for k in [int(x) for x in opt("-p").split(",")]:
        out.append({"build_commit": "fake0c1e", "build_number": 4242, "cpu_info": "Fake CPU",
                    "backends": "CPU", "model_type": "llama 135M", "n_prompt": k, "n_gen": 0,
                    "avg_ts": 100.0 * k / (1 + 0.25 * k), "stddev_ts": 1.0})
    out.append({"build_commit": "fake0c1e", "build_number": 4242, "n_prompt": 0, "n_gen": int(opt("-n")),
                "avg_ts": 150.0, "stddev_ts": 2.0})
    print("some log line on stdout first")
    print(json.dumps(out, indent=2))

elif name == "llama-quantize":
    rest = [a for a in args if not a.startswith("--")]
    src, dst, qtype = rest[0], rest[1], rest[2]
    with open(src, "rb") as f:
        data = f.read()
    with open(dst, "wb") as f:
        f.write(data + f"|{qtype}<-{os.path.basename(src)}".encode())
'''


def _load_tool():
    spec = importlib.util.spec_from_file_location(
        "bench_cpu_peers", REPO / "tools" / "bench_cpu_peers.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_cpu_peers"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool():
    return _load_tool()


@pytest.fixture()
def fake_bin(tmp_path, monkeypatch):
    """A directory with fake llama-server / llama-bench / llama-quantize; invocations logged."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fake_llama.py").write_text(FAKE)
    for name in ("llama-server", "llama-bench", "llama-quantize"):
        exe = bin_dir / name
        exe.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" "{bin_dir / "fake_llama.py"}" {name} "$@"\n'
        )
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "BUILD_INFO.json").write_text(
        json.dumps({"llama_cpp_python_sdist": "0.3.36", "cmake_flags": ["-DGGML_AVX2=ON"]})
    )
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "calls.jsonl"))
    return bin_dir


def _calls(bin_dir: Path) -> list[list[str]]:
    path = bin_dir.parent / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _expected_answer(prompt, n_predict, changed=False):
    stop = len(prompt) % 4 + 5
    toks = [(sum(prompt) + 7 * i) % 50 + 10 for i in range(min(n_predict, stop))]
    if len(toks) < n_predict:
        toks.append(2)
    if changed:
        toks[1] += 1
    return toks


def test_spec_types_are_the_no_draft_ones(tool):
    help_text = textwrap.dedent("""\
        --spec-draft-model, -md FNAME   draft model for speculative decoding (default: unused)
        --spec-type none,draft-simple,draft-eagle3,draft-mtp,draft-dflash,draft-dspark,ngram-simple,ngram-map-k,ngram-map-k4v,ngram-mod,ngram-cache
                                        comma-separated list of types of speculative decoding to use (default: none)
        """)
    assert tool.spec_types_from_help(help_text) == [
        "ngram-simple",
        "ngram-map-k",
        "ngram-map-k4v",
        "ngram-mod",
        "ngram-cache",
    ]
    assert tool.spec_types_from_help("--lookup-ngram-min N\n--draft-max N\n") == []


def test_gguf_files_made_from_the_f32_export_once(tool, fake_bin, tmp_path):
    shipped = tmp_path / "Model-135M.Q4_1.gguf"
    shipped.write_bytes(b"GGUF-shipped")
    out = tmp_path / "gguf"
    files = tool.make_gguf_files(fake_bin, shipped, out, ["Q4_0", "Q4_K_M"], threads=2)
    assert list(files) == ["F32", "Q4_0", "Q4_K_M"]
    assert files["F32"].read_bytes() == b"GGUF-shipped|F32<-Model-135M.Q4_1.gguf"
    # every quant type from the F32 export, never from the shipped Q4_1 (that would round twice)
    assert files["Q4_0"].read_bytes() == files["F32"].read_bytes() + b"|Q4_0<-Model-135M.F32.gguf"
    assert files["Q4_K_M"].name == "Model-135M.Q4_K_M.gguf"
    calls = _calls(fake_bin)
    assert [c[0] for c in calls] == ["llama-quantize"] * 3
    assert calls[0][1] == "--allow-requantize" and calls[0][-2:] == ["F32", "2"]
    assert not list(out.glob("*.tmp"))
    tool.make_gguf_files(fake_bin, shipped, out, ["Q4_0", "Q4_K_M"], threads=2)
    assert len(_calls(fake_bin)) == 3  # reused, not made again


def test_llama_server_rows(tool, fake_bin, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    prompts = [[1, 5, 9, 11], [1, 7, 3], [1, 2, 3, 4, 5, 6]]

    class Args:
        threads = 2
        max_new_tokens = 6

    plain = tool.run_llama_server(
        fake_bin, model, "Q4_0", None, prompts, Args, tmp_path / "plain.log"
    )
    expect = [_expected_answer(p, 6) for p in prompts]
    assert plain["outputs"] == expect
    n = sum(map(len, expect))
    assert (
        plain["new_tokens"] == n
        and plain["method"] == "plain"
        and plain["engine"] == "llama-server"
    )
    assert plain["tok_per_s"] == pytest.approx(n / plain["seconds"])
    assert plain["decode_tok_per_s"] == pytest.approx(100.0)  # the fake's 10 ms a token
    assert plain["acceptance"] is None

    spec = tool.run_llama_server(
        fake_bin, model, "Q4_0", "ngram-mod", prompts, Args, tmp_path / "mod.log"
    )
    assert spec["method"] == "ngram-mod"
    assert spec["decode_tok_per_s"] == pytest.approx(250.0)
    assert spec["draft_n"] == 10 * len(prompts) and spec["acceptance"] == pytest.approx(0.5)
    server_calls = [c for c in _calls(fake_bin) if c[0] == "llama-server"]
    assert (
        "--spec-type" not in server_calls[0]
        and server_calls[1][server_calls[1].index("--spec-type") + 1] == "ngram-mod"
    )
    for c in server_calls:
        assert (
            c[c.index("--host") + 1] == "127.0.0.1"
            and c[c.index("-t") + 1] == "2"
            and c[c.index("-np") + 1] == "1"
        )

    line = tool.server_system_info(fake_bin, model, 2, tmp_path / "sys.log")
    assert line.startswith("system_info: n_threads = 2") and "AVX512 = 1" in line
    info = tool.llama_build_info(fake_bin)
    assert info["version"] == "version: 4242 (fake0c1e) built with fake cc"
    assert info["llama_cpp_python_sdist"] == "0.3.36"


def test_llama_server_that_dies_is_an_error(tool, fake_bin, tmp_path):
    class Args:
        threads = 2
        max_new_tokens = 4

    with pytest.raises(RuntimeError, match="exited"):
        tool.run_llama_server(
            fake_bin, tmp_path / "missing.gguf", "Q4_0", None, [[1, 2]], Args, tmp_path / "x.log"
        )


def test_llama_bench_rows(tool, fake_bin, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    rows = tool.run_llama_bench(fake_bin, model, "Q4_1", threads=2, reps=3)
    by = {r["method"]: r for r in rows}
    assert sorted(by) == ["pp1", "pp2", "pp4", "pp8", "tg128"]
    assert by["tg128"]["tok_per_s"] == 150.0 and by["tg128"]["forward_ms"] == pytest.approx(
        1000 / 150
    )
    for k in (1, 2, 4, 8):
        ts = 100.0 * k / (1 + 0.25 * k)
        assert by[f"pp{k}"]["tok_per_s"] == pytest.approx(ts)
        # k rows in one forward
        assert by[f"pp{k}"]["forward_ms"] == pytest.approx(10.0 * (1 + 0.25 * k))
    call = next(c for c in _calls(fake_bin) if c[0] == "llama-bench")
    assert call[call.index("-p") + 1] == "1,2,4,8" and call[call.index("-n") + 1] == "128"
    assert call[call.index("-r") + 1] == "3" and call[call.index("-o") + 1] == "json"


def _row(engine, weights, method, tok_s, outputs=None, **kw):
    return {
        "engine": engine,
        "weights": weights,
        "method": method,
        "tok_per_s": tok_s,
        "outputs": outputs,
        **kw,
    }


def test_ratios_and_agreement_within_a_run(tool):
    ref = [[11, 12, 2], [21, 22]]
    rows = [
        _row("llama-bench", "Q4_0", "tg128", 150.0),
        _row("llama-bench", "Q4_0", "pp2", 180.0),
        _row("llama-bench", "F32", "tg128", 50.0),
        _row("llama-server", "Q4_0", "plain", 100.0, ref),
        _row("llama-server", "Q4_0", "ngram-mod", 120.0, [[11, 12], [21, 23]]),
        _row("llama-server", "F32", "plain", 40.0, [[11, 12, 2], [31, 32]]),
        # dartcore returns the EOS that ended an answer where the server may not: same answer
        _row("dartcore", "Q4_0", "ar", 90.0, [[11, 12], [21, 22, 2]]),
        _row("dartcore", "Q4_0", "dart", 180.0, [[11, 12], [21, 22, 2]]),
        _row("dartcore", "fp32 (HF conversion)", "ar", 45.0, [[11, 12], [31, 32]]),
        _row("llama-cpp-python (Python loop)", "Q4_0", "plain", 60.0, ref),
    ]
    got = tool.annotate_run(rows, eos={2})
    assert got == {"best_server": "llama-server/Q4_0/ngram-mod"}
    by = {tool._key(r): r for r in rows}
    assert by["dartcore/Q4_0/dart"]["vs_best_server"] == pytest.approx(180 / 120)
    assert by["dartcore/Q4_0/dart"]["vs_tg128_same_weights"] == pytest.approx(180 / 150)
    assert by["llama-server/Q4_0/plain"]["vs_best_server"] == pytest.approx(100 / 120)
    assert by["llama-bench/Q4_0/tg128"]["vs_best_server"] == pytest.approx(150 / 120)
    assert "vs_best_server" not in by["llama-bench/Q4_0/pp2"]
    # the float32 conversion is measured against the F32 file
    assert by["dartcore/fp32 (HF conversion)/ar"]["vs_tg128_same_weights"] == pytest.approx(45 / 50)
    assert by["dartcore/fp32 (HF conversion)/ar"]["same_as_server_plain"] == 1.0
    assert by["llama-server/Q4_0/ngram-mod"]["same_as_own_plain"] == 0.5
    assert by["dartcore/Q4_0/dart"]["same_as_own_plain"] == 1.0
    assert by["dartcore/Q4_0/dart"]["same_as_server_plain"] == 1.0
    assert by["llama-cpp-python (Python loop)/Q4_0/plain"]["same_as_server_plain"] == 1.0
    assert by["llama-cpp-python (Python loop)/Q4_0/plain"]["vs_best_server"] == pytest.approx(
        60 / 120
    )


def test_summary_medians_and_ranges_over_runs(tool):
    runs = []
    for server, dart, tg in ((100.0, 150.0, 160.0), (120.0, 150.0, 140.0), (110.0, 120.0, 150.0)):
        rows = [
            _row("llama-bench", "Q4_0", "tg128", tg),
            _row("llama-server", "Q4_0", "plain", server, [[1]]),
            _row("dartcore", "Q4_0", "dart", dart, [[1]]),
        ]
        runs.append({"rows": rows, **tool.annotate_run(rows, eos=set())})
    s = tool.summarize(runs)
    k = "dartcore/Q4_0/dart"
    assert s["median_tok_per_s"][k] == 150.0 and s["range_tok_per_s"][k] == [120.0, 150.0]
    # ratios are taken within each run (1.5, 1.25, 120/110), then their median
    assert s["median_ratio_to_best_server"][k] == pytest.approx(1.25)
    assert s["range_ratio_to_best_server"][k] == pytest.approx([120 / 110, 1.5])
    # to tg128: 150/160, 150/140, 120/150
    assert s["median_ratio_to_tg128_same_weights"][k] == pytest.approx(150 / 160)
    assert s["range_ratio_to_tg128_same_weights"][k] == pytest.approx([120 / 150, 150 / 140])
    assert s["best_server_per_run"] == ["llama-server/Q4_0/plain"] * 3
    report = {
        "gguf": "m.Q4_1.gguf",
        "prompts": 1,
        "max_new_tokens": 4,
        "repeats": runs,
        "skipped": [],
        "machine": {"cpu": "Fake", "cpus": 2, "threads": 2, "isa_flags": ["avx2"]},
        "rows": runs[-1]["rows"],
        **s,
    }
    text = tool.markdown(report)
    assert "| dartcore | Q4_0 | dart | 150.0 | 120.0-150.0 |" in text
    assert "1.25x (1.09-1.50)" in text


def test_numerics_forwarded_only_where_the_keyword_exists(tool, monkeypatch):
    import dartcore

    assert tool.numerics_kwargs(None) == {}

    def with_kw(cls, target, drafter=None, index=None, *, numerics="int8", **kw):
        raise AssertionError("not called")

    def without_kw(cls, target, drafter=None, index=None, **kw):
        raise AssertionError("not called")

    monkeypatch.setattr(dartcore.DartDecoder, "from_pretrained", classmethod(with_kw))
    assert tool.numerics_kwargs("exact") == {"numerics": "exact"}
    monkeypatch.setattr(dartcore.DartDecoder, "from_pretrained", classmethod(without_kw))
    with pytest.raises(SystemExit, match="no numerics= keyword"):
        tool.numerics_kwargs("exact")


def test_same_tensors_compares_data_not_metadata(tool, tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    def write(name: str, values, title: str) -> Path:
        path = tmp_path / name
        w = GGUFWriter(str(path), "llama")
        w.add_name(title)
        w.add_tensor("blk.0.ffn_up.weight", np.asarray(values, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    a = write("a.gguf", [[1, 2, 3, 4]], "first")
    b = write("b.gguf", [[1, 2, 3, 4]], "second title, same tensors")
    c = write("c.gguf", [[1, 2, 3, 5]], "first")
    assert tool.same_tensors(a, b)
    assert not tool.same_tensors(a, c)
