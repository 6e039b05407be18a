"""Server metrics in the Prometheus text exposition format (``GET /metrics``).

Kept by the front: request counts, tokens, latencies and what each finished
request's speculative statistics add up to (tau, the acceptance histogram, the
node budgets the controller chose), plus each worker's latest snapshot (queue
depth, running sequences, engine steps and stage times). Every series carries a
``worker`` label. Written by hand: the format is a few lines of text and
another dependency would buy nothing.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["Metrics", "LATENCY_BUCKETS", "ACCEPT_BUCKETS", "BUDGET_BUCKETS"]

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ACCEPT_BUCKETS = tuple(range(0, 17))  # drafted tokens accepted per round
BUDGET_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128)  # tree nodes per round (0 = a plain AR step)


class _Hist:
    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0:
            return
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += count
                break
        else:
            self.counts[-1] += count
        self.sum += value * count
        self.n += count

    def lines(self, name: str, labels: str) -> list[str]:
        out, cum = [], 0
        for b, c in zip(self.bounds, self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels},le="{b}"}} {cum}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {_num(self.sum)}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


def _num(x: float) -> str:
    return repr(float(x)) if isinstance(x, float) else str(x)


def _hist_counts(value) -> list[tuple[float, int]]:
    """(value, count) pairs from a per-round list of values or a {value: count} mapping."""
    if isinstance(value, dict):
        out = []
        for k, c in value.items():
            try:
                out.append((float(k), int(c)))
            except (TypeError, ValueError):
                continue
        return out
    if isinstance(value, (list, tuple)):
        return [(float(v), 1) for v in value if isinstance(v, (int, float))]
    return []


class Metrics:
    def __init__(self, workers: int):
        self.workers = workers
        self.requests = defaultdict(int)  # (worker, endpoint, status) -> n
        self.rejected_total = 0
        self.started = defaultdict(int)
        self.prompt_tokens = defaultdict(int)
        self.generation_tokens = defaultdict(int)
        self.rounds = defaultdict(int)
        self.committed = defaultdict(int)  # tokens committed by verify rounds (bonus included)
        self.restarts = defaultdict(int)
        self.accept = {w: _Hist(ACCEPT_BUCKETS) for w in range(workers)}
        self.budget = {w: _Hist(BUDGET_BUCKETS) for w in range(workers)}
        self.ttft = {w: _Hist(LATENCY_BUCKETS) for w in range(workers)}
        self.latency = {w: _Hist(LATENCY_BUCKETS) for w in range(workers)}
        self.snapshots: dict[int, dict] = {}
        self.inflight_fn = None  # set by the app: worker -> requests in flight

    # -- events ---------------------------------------------------------------------------

    def request_started(self, worker: int) -> None:
        self.started[worker] += 1

    def rejected(self) -> None:
        self.rejected_total += 1

    def observe_ttft(self, worker: int, seconds: float) -> None:
        self.ttft[worker].observe(seconds)

    def request_failed(self, worker: int, endpoint: str, status: int) -> None:
        self.requests[(worker, endpoint, status)] += 1

    def request_done(
        self, worker: int, endpoint: str, item: dict, seconds: float | None = None
    ) -> None:
        status = 499 if item.get("finish_reason") == "abort" else 200
        self.requests[(worker, endpoint, status)] += 1
        self.prompt_tokens[worker] += int(item.get("prompt_tokens", 0))
        self.generation_tokens[worker] += int(item.get("completion_tokens", 0))
        stats = item.get("stats") or {}
        hist = stats.get("accept_hist", stats.get("acceptance_hist"))
        if isinstance(hist, (list, tuple)):
            for accepted, count in enumerate(hist):
                if isinstance(count, (int, float)) and count:
                    self.accept[worker].observe(accepted, int(count))
                    self.rounds[worker] += int(count)
                    self.committed[worker] += (accepted + 1) * int(count)
        budget_hist = stats.get("budget_hist")
        if isinstance(budget_hist, (list, tuple)):  # [n] = rounds verified with a budget of n nodes
            for nodes, count in enumerate(budget_hist):
                if isinstance(count, (int, float)) and count:
                    self.budget[worker].observe(nodes, int(count))
        else:
            for value, count in _hist_counts(stats.get("budgets", budget_hist)):
                self.budget[worker].observe(value, count)

    def observe_latency(self, worker: int, seconds: float) -> None:
        self.latency[worker].observe(seconds)

    def worker_snapshot(self, worker: int, snapshot: dict) -> None:
        self.snapshots[worker] = snapshot

    def worker_restarted(self, worker: int) -> None:
        self.restarts[worker] += 1

    # -- exposition -----------------------------------------------------------------------

    def render(self, inflight: dict[int, int] | None = None) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[str]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            out.extend(samples)

        ws = range(self.workers)
        family(
            "dart_requests_total",
            "counter",
            "Requests answered, by worker, endpoint and HTTP status (499: the client went away).",
            [
                f'dart_requests_total{{worker="{w}",endpoint="{e}",status="{s}"}} {n}'
                for (w, e, s), n in sorted(self.requests.items())
            ],
        )
        family(
            "dart_requests_rejected_total",
            "counter",
            "Requests refused with 429 (queue full).",
            [f"dart_requests_rejected_total {self.rejected_total}"],
        )
        family(
            "dart_requests_started_total",
            "counter",
            "Requests dispatched to each worker.",
            [f'dart_requests_started_total{{worker="{w}"}} {self.started[w]}' for w in ws],
        )
        family(
            "dart_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            [f'dart_prompt_tokens_total{{worker="{w}"}} {self.prompt_tokens[w]}' for w in ws],
        )
        family(
            "dart_generation_tokens_total",
            "counter",
            "Tokens generated by finished requests.",
            [
                f'dart_generation_tokens_total{{worker="{w}"}} {self.generation_tokens[w]}'
                for w in ws
            ],
        )
        family(
            "dart_verify_rounds_total",
            "counter",
            "Target verify rounds of finished requests.",
            [f'dart_verify_rounds_total{{worker="{w}"}} {self.rounds[w]}' for w in ws],
        )
        family(
            "dart_tau",
            "gauge",
            "Mean tokens committed per verify round (bonus included), finished requests.",
            [
                f'dart_tau{{worker="{w}"}} {_num(self.committed[w] / self.rounds[w] if self.rounds[w] else 0.0)}'
                for w in ws
            ],
        )
        family(
            "dart_accepted_tokens",
            "histogram",
            "Drafted tokens accepted per verify round.",
            [
                line
                for w in ws
                for line in self.accept[w].lines("dart_accepted_tokens", f'worker="{w}"')
            ],
        )
        family(
            "dart_budget_nodes",
            "histogram",
            "Tree node budget chosen per sequence and round (0 = AR step).",
            [
                line
                for w in ws
                for line in self.budget[w].lines("dart_budget_nodes", f'worker="{w}"')
            ],
        )
        family(
            "dart_time_to_first_token_seconds",
            "histogram",
            "Time from dispatch to the first token.",
            [
                line
                for w in ws
                for line in self.ttft[w].lines("dart_time_to_first_token_seconds", f'worker="{w}"')
            ],
        )
        family(
            "dart_request_seconds",
            "histogram",
            "Time from dispatch to the last token.",
            [
                line
                for w in ws
                for line in self.latency[w].lines("dart_request_seconds", f'worker="{w}"')
            ],
        )
        family(
            "dart_inflight_requests",
            "gauge",
            "Requests a worker holds (running or queued).",
            [f'dart_inflight_requests{{worker="{w}"}} {(inflight or {}).get(w, 0)}' for w in ws],
        )
        snap = self.snapshots
        family(
            "dart_queue_depth",
            "gauge",
            "Requests waiting in a worker's engine for a batch slot.",
            [f'dart_queue_depth{{worker="{w}"}} {snap.get(w, {}).get("waiting", 0)}' for w in ws],
        )
        family(
            "dart_running_sequences",
            "gauge",
            "Sequences in a worker's running batch.",
            [
                f'dart_running_sequences{{worker="{w}"}} {snap.get(w, {}).get("running", 0)}'
                for w in ws
            ],
        )
        counters = {w: snap.get(w, {}).get("counters", {}) for w in ws}
        engine = {w: snap.get(w, {}).get("engine", {}) for w in ws}
        family(
            "dart_engine_steps_total",
            "counter",
            "Engine steps a worker ran.",
            [f'dart_engine_steps_total{{worker="{w}"}} {counters[w].get("steps", 0)}' for w in ws],
        )
        family(
            "dart_engine_step_seconds_total",
            "counter",
            "Wall time inside engine.step().",
            [
                f'dart_engine_step_seconds_total{{worker="{w}"}} {_num(float(counters[w].get("step_s", 0.0)))}'
                for w in ws
            ],
        )
        family(
            "dart_rows_verified_total",
            "counter",
            "Tree rows the target verified (all sequences, all steps).",
            [
                f'dart_rows_verified_total{{worker="{w}"}} {int(engine[w].get("rows_verified", 0))}'
                for w in ws
            ],
        )
        family(
            "dart_stage_seconds_total",
            "counter",
            "Engine time per decoding stage.",
            [
                f'dart_stage_seconds_total{{worker="{w}",stage="{k}"}} {_num(float(v))}'
                for w in ws
                for k, v in sorted(engine[w].get("seconds", {}).items())
            ],
        )
        family(
            "dart_worker_restarts_total",
            "counter",
            "Times a dead worker was restarted.",
            [f'dart_worker_restarts_total{{worker="{w}"}} {self.restarts[w]}' for w in ws],
        )
        return "\n".join(out) + "\n"
