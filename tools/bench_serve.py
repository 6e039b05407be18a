#!/usr/bin/env python3
"""Load benchmark of dart-serve on loopback: the controller vs the same server with speculation off.

For each mode (``dart``: ``--max-nodes adaptive``; ``off``: ``--max-nodes 0``, plain AR steps in
the same engine) it starts ``dart-serve`` on 127.0.0.1, then for each level of concurrent
clients (default 1, 2, 4, 8, 16) runs closed-loop streaming chat requests until
``--requests`` have finished or ``--level-seconds`` have passed (bounded both ways),
and records throughput (completion tokens / s), time to first token and latency (p50 /
p99), errors, RSS per worker and the index's Pss per worker (/proc/PID/smaps).
``--soak-minutes M`` then holds ``--soak-clients`` clients on the controller's server
for M minutes, sampling RSS every ``--soak-interval`` s (flat = no leak).

    python tools/bench_serve.py --index smollm2.idx --json > bench_serve.json
    python tools/bench_serve.py --index smollm2.idx --levels 1,2 --level-seconds 30 --requests 8
    python tools/bench_serve.py --index smollm2.idx --modes dart --levels 4 --soak-minutes 10

The table goes to stderr; --json prints the results as JSON on stdout (--out also writes a file).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# plus fixedN: --max-nodes N
MODES = {"dart": ["--max-nodes", "adaptive"], "off": ["--max-nodes", "0"]}


def _mode_args(mode: str) -> list[str]:
    if mode in MODES:
        return MODES[mode]
    if mode.startswith("fixed") and mode[5:].isdigit():
        return ["--max-nodes", mode[5:]]
    raise SystemExit(
        f"--modes: unknown mode {mode!r} (dart, off, or fixedN for a fixed budget of N nodes)"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Server:
    def __init__(self, args: list[str], log: Path, start_timeout: float):
        self.port = _free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "python")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dartcore.cli.dart_serve", "--port", str(self.port), *args],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"dart-serve exited with {self.proc.returncode}; see {log}")
            try:
                if _get(self.port, "/health")[0] == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"dart-serve did not start in {start_timeout:.0f} s; see {log}")
            time.sleep(0.5)

    def health(self) -> dict:
        return json.loads(_get(self.port, "/health")[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _memory(pid: int, index: str | None) -> dict:
    """RSS of a process and Rss / Pss of its mappings of the index file (kB)."""
    out = {"rss_kb": 0, "index_rss_kb": 0, "index_pss_kb": 0}
    target = os.path.realpath(index) if index else None
    inside = False
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    out["rss_kb"] = int(line.split()[1])
        with open(f"/proc/{pid}/smaps") as fh:
            for line in fh:
                fields = line.split()
                if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
                    inside = (
                        target is not None and len(fields) >= 6 and " ".join(fields[5:]) == target
                    )
                elif inside and fields[0] in ("Rss:", "Pss:"):
                    out["index_" + fields[0][:-1].lower() + "_kb"] += int(fields[1])
    except FileNotFoundError:
        pass
    return out


def _one_request(port: int, body: dict, timeout: float) -> dict:
    """One streaming chat request: TTFT, latency, completion tokens, or the error."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        ttft, tokens = None, 0
        while True:
            line = resp.fp.readline()
            if not line:
                return {"error": "stream ended without [DONE]"}
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                return {"error": event["error"].get("message", "error event")}
            if (
                ttft is None
                and event.get("choices")
                and event["choices"][0]["delta"].get("content")
            ):
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        return {
            "ttft": ttft if ttft is not None else time.perf_counter() - t0,
            "latency": time.perf_counter() - t0,
            "tokens": tokens,
        }
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        conn.close()


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run_level(
    port: int,
    prompts: list[str],
    clients: int,
    *,
    requests: int,
    seconds: float,
    max_tokens: int,
    model: str,
    timeout: float,
) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    started = [0]
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        while True:
            with lock:
                if started[0] >= requests or time.monotonic() > deadline:
                    return
                n = started[0]
                started[0] += 1
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompts[n % len(prompts)]}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = _one_request(port, body, timeout)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "error_samples": errors[:3],
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_p50_s": _pct([r["ttft"] for r in ok], 0.5),
        "ttft_p99_s": _pct([r["ttft"] for r in ok], 0.99),
        "latency_p50_s": _pct([r["latency"] for r in ok], 0.5),
        "latency_p99_s": _pct([r["latency"] for r in ok], 0.99),
    }


def _prompts(n: int) -> list[str]:
    from dartcore.benchmark.datasets import BUILTIN_PROMPTS, find_data_dir, load_prompts

    if find_data_dir() is None:
        return list(BUILTIN_PROMPTS)
    out = []
    for name in ("humaneval", "gsm8k", "code_alpaca"):
        out += [m[-1]["content"] for m in load_prompts(name, n)]
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--index", required=True, help="n-gram index built with the target's tokenizer")
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="smollm2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument(
        "--modes",
        default="dart,off",
        help="comma-separated: dart (the controller), off (--max-nodes 0), fixedN (--max-nodes N)",
    )
    p.add_argument("--levels", default="1,2,4,8,16", help="concurrent clients per level")
    p.add_argument("--requests", type=int, default=32, help="requests per level at most")
    p.add_argument("--level-seconds", type=float, default=60.0, help="seconds per level at most")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8, help="prompts per dataset")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--soak-minutes", type=float, default=0.0, help="then hold --soak-clients for this long"
    )
    p.add_argument("--soak-clients", type=int, default=4)
    p.add_argument("--soak-interval", type=float, default=10.0, help="seconds between RSS samples")
    p.add_argument(
        "--serve-arg", action="append", default=[], help="extra dart-serve argument (repeatable)"
    )
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default="artifacts/bench_serve")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return p


def _soak(server: Server, args, prompts: list[str], index: str) -> dict:
    samples, stop = [], threading.Event()
    level: dict = {}

    def load() -> None:
        level.update(
            run_level(
                server.port,
                prompts,
                args.soak_clients,
                requests=10**9,
                seconds=args.soak_minutes * 60,
                max_tokens=args.max_tokens,
                model=Path(args.target).name,
                timeout=args.request_timeout,
            )
        )
        stop.set()

    t0 = time.monotonic()
    t = threading.Thread(target=load)
    t.start()
    while not stop.wait(args.soak_interval):
        pids = [w["pid"] for w in server.health()["workers"]]
        samples.append(
            {
                "t_s": time.monotonic() - t0,
                "rss_kb": [_memory(pid, index)["rss_kb"] for pid in pids],
            }
        )
    t.join()
    first, last = samples[0] if samples else None, samples[-1] if samples else None
    growth = [b - a for a, b in zip(first["rss_kb"], last["rss_kb"])] if first and last else []
    return {
        "minutes": args.soak_minutes,
        "clients": args.soak_clients,
        "load": level,
        "samples": samples,
        "rss_growth_kb": growth,
    }


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)  # so that the servers started here are stopped on the way out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if not os.path.isfile(args.index):
        raise SystemExit(f"--index {args.index}: no such file (build one with ngram-build)")
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(args.prompts)
    levels = [int(x) for x in args.levels.split(",") if x]
    from dartcore.benchmark.runner import machine_info

    result = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "index_bytes": os.path.getsize(args.index),
        "cpus": os.cpu_count(),
        "machine": machine_info(),
        "command": " ".join(["python3", *sys.argv]),
        "modes": {},
    }
    for mode in [m for m in args.modes.split(",") if m]:
        serve_args = [
            "--target",
            args.target,
            "--drafter",
            args.drafter,
            "--index",
            args.index,
            "--workers",
            str(args.workers),
            "--max-batch",
            str(args.max_batch),
            "--threads",
            str(args.threads),
            "--max-queue",
            str(max(levels) * 2),
            *_mode_args(mode),
            *args.serve_arg,
        ]
        t0 = time.perf_counter()
        server = Server(serve_args, log_dir / f"server-{mode}.log", args.start_timeout)
        rows = []
        try:
            print(
                f"[{mode}] started {args.workers} workers in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )
            for clients in levels:
                row = run_level(
                    server.port,
                    prompts,
                    clients,
                    requests=args.requests,
                    seconds=args.level_seconds,
                    max_tokens=args.max_tokens,
                    model=Path(args.target).name,
                    timeout=args.request_timeout,
                )
                mem = [_memory(w["pid"], args.index) for w in server.health()["workers"]]
                row["rss_mb"] = [round(m["rss_kb"] / 1024, 1) for m in mem]
                row["index_pss_mb"] = [round(m["index_pss_kb"] / 1024, 2) for m in mem]
                rows.append(row)
                print(
                    f"[{mode}] {clients:>2} clients: {row['tokens_per_s']:.1f} tok/s, {row['requests']} requests, "
                    f"{row['errors']} errors",
                    file=sys.stderr,
                )
            entry = {"levels": rows}
            if args.soak_minutes > 0 and mode == "dart":
                entry["soak"] = _soak(server, args, prompts, args.index)
            status, metrics = _get(server.port, "/metrics")
            entry["metrics_tau"] = re.findall(
                r'^dart_tau\{worker="(\d+)"\} (\S+)$', metrics.decode(), re.M
            )
            result["modes"][mode] = entry
        finally:
            server.stop()
    _table(result, levels)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        print(text)
    return 0


def _fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _table(result: dict, levels: list[int]) -> None:
    modes = result["modes"]
    print(
        "\n| clients | mode | tok/s | vs off | TTFT p50 s | lat p50 s | lat p99 s | errors | RSS/worker MB | "
        "index Pss/worker MB |",
        file=sys.stderr,
    )
    print("|---|---|---|---|---|---|---|---|---|---|", file=sys.stderr)
    off = {r["clients"]: r for r in modes.get("off", {}).get("levels", [])}
    for clients in levels:
        for mode, entry in modes.items():
            r = next((x for x in entry["levels"] if x["clients"] == clients), None)
            if r is None:
                continue
            base = off.get(clients)
            ratio = (
                r["tokens_per_s"] / base["tokens_per_s"] if base and base["tokens_per_s"] else None
            )
            print(
                f"| {clients} | {mode} | {r['tokens_per_s']:.1f} | {_fmt(ratio)} | {_fmt(r['ttft_p50_s'])} | "
                f"{_fmt(r['latency_p50_s'])} | {_fmt(r['latency_p99_s'])} | {r['errors']} | "
                f"{','.join(str(x) for x in r['rss_mb'])} | {','.join(str(x) for x in r['index_pss_mb'])} |",
                file=sys.stderr,
            )
    soak = modes.get("dart", {}).get("soak")
    if soak:
        print(
            f"\nsoak {soak['minutes']} min at {soak['clients']} clients: RSS growth per worker "
            f"{[round(g / 1024, 1) for g in soak['rss_growth_kb']]} MB over {len(soak['samples'])} samples, "
            f"{soak['load'].get('errors', 0)} errors",
            file=sys.stderr,
        )
    print(f"index: {result['index_bytes'] / 2**20:.1f} MB on disk", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
