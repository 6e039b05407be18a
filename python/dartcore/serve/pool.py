"""The front's view of the workers: spawn, dispatch to the least loaded, restart the dead.

IPC: one duplex ``multiprocessing`` pipe per worker, not a shared queue. With
a pipe per worker the front knows exactly which requests each worker holds
(least-loaded dispatch is a count, not a guess), and a worker that dies shows
up as end-of-file on its own pipe: exactly its requests fail, nothing shared is
left half-written (a process killed while holding a ``multiprocessing.Queue``'s
lock can wedge every other user of that queue). Messages are small pickled
tuples, at most one per engine step per worker (see :mod:`dartcore.serve.worker`).

Workers are started with ``spawn``: the front runs an event loop and threads,
which ``fork`` would copy in an undefined state.

The event loop watches each worker's pipe itself (``add_reader`` on its socket) and reads
every whole message there when it becomes readable; everything runs on the loop. A step's
message then costs the front one wake-up of the loop, not a reader thread's as well plus the
loop's self-pipe (on the 2-vCPU VM dartcore is measured on, those wake-ups ran on the cores
the worker's next step was using).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dartcore.errors import DartError
from dartcore.serve.metrics import Metrics
from dartcore.serve.protocol import APIError, GenRequest
from dartcore.serve.worker import WorkerConfig, run_worker

__all__ = ["WorkerPool", "Stream", "WorkerStartError"]


class WorkerStartError(DartError):
    """A worker could not load its model or index (the configuration is wrong)."""


@dataclass
class Stream:
    """One request in flight, as the HTTP handler sees it: events arrive on ``queue``."""

    req: GenRequest
    worker: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    done: bool = False


class _Handle:
    def __init__(self, index: int):
        self.index = index
        self.process: Any = None
        self.conn: Any = None
        self.generation = 0  # bumped on every (re)start: a stale pipe's messages are ignored
        self.ready = False
        self.alive = False
        self.pid: int | None = None
        self.context_length: int | None = None
        self.inflight: dict[str, Stream] = {}
        self.snapshot: dict = {}
        self.restarts = 0
        self.started_at = 0.0


class WorkerPool:
    def __init__(
        self,
        config: WorkerConfig,
        workers: int = 1,
        *,
        max_queue: int = 16,
        start_timeout: float = 600.0,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.config = config
        self.max_queue = max_queue
        self.start_timeout = start_timeout
        self.handles = [_Handle(i) for i in range(workers)]
        self.metrics = Metrics(workers)
        self.draining = False
        self.closed = False
        self._ctx = mp.get_context("spawn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready_events: dict[int, asyncio.Event] = {}
        self.start_error: str | None = None  # a worker's load error, which stops the server
        self._latency = deque(maxlen=64)  # recent request seconds, for Retry-After
        self._clears: dict[tuple[int, int], asyncio.Future] = {}  # (token, worker) -> answer
        self._clear_tokens = itertools.count()

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every worker and wait until all have loaded (a load error raises WorkerStartError)."""
        self._loop = asyncio.get_running_loop()
        for h in self.handles:
            self._spawn(h)
        deadline = time.monotonic() + self.start_timeout
        while not all(h.ready for h in self.handles):
            if self.start_error is not None:
                await self.close()
                raise WorkerStartError(f"a worker could not start: {self.start_error}")
            if time.monotonic() > deadline:
                await self.close()
                raise WorkerStartError(f"workers did not load within {self.start_timeout:.0f} s")
            await asyncio.sleep(0.05)

    def _spawn(self, h: _Handle) -> None:
        parent, child = self._ctx.Pipe(duplex=True)
        h.generation += 1
        proc = self._ctx.Process(
            target=run_worker,
            args=(child, self.config, h.index),
            name=f"dart-serve-worker-{h.index}",
            daemon=True,
        )
        proc.start()
        child.close()  # the parent keeps only its end, so the worker's death reads as EOF
        h.process, h.conn, h.pid = proc, parent, proc.pid
        h.ready, h.alive, h.started_at = False, True, time.monotonic()
        fd = parent.fileno()
        self._loop.add_reader(fd, self._readable, h, parent, fd, h.generation)

    def _readable(self, h: _Handle, conn, fd: int, generation: int) -> None:
        """The worker's pipe has data: every whole message on it, in order; at its end (or a
        message cut short by a dying worker) the worker is dead."""
        while True:
            try:
                if not conn.poll():
                    return
                msg = conn.recv()
            except Exception:  # noqa: BLE001 - EOF, a reset pipe, a message cut short
                break
            self._on_message(h, generation, msg)
        self._loop.remove_reader(fd)
        conn.close()
        self._on_death(h, generation)

    async def close(self, timeout: float = 10.0) -> None:
        """Tell every worker to exit; kill those that do not within ``timeout``."""
        self.closed = True
        for h in self.handles:
            if h.alive and h.conn is not None:
                try:
                    h.conn.send(("exit",))
                except OSError:
                    pass
        deadline = time.monotonic() + timeout
        for h in self.handles:
            p = h.process
            if p is None:
                continue
            while p.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if p.is_alive():
                p.kill()
            p.join(timeout=1)

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and wait for the in-flight ones (SIGTERM)."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while any(h.inflight for h in self.handles) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    # -- messages from workers ------------------------------------------------------------

    def _on_message(self, h: _Handle, generation: int, msg) -> None:
        if generation != h.generation:
            return
        kind = msg[0]
        if kind == "step":
            _, outs, snap = msg
            if snap is not None:  # None: the load and counters sent last still hold
                h.snapshot = snap
                self.metrics.worker_snapshot(h.index, snap)
            for item in outs:
                s = h.inflight.get(item["rid"])
                if s is None:
                    continue
                if s.first_token is None:
                    s.first_token = time.perf_counter()
                    self.metrics.observe_ttft(h.index, s.first_token - s.submitted)
                if item["finished"]:
                    self._finish(h, s)
                    self.metrics.request_done(h.index, s.req.kind, item)
                s.queue.put_nowait(("out", item))
        elif kind == "error":
            _, rid, status, message, param, code = msg
            s = h.inflight.get(rid)
            if s is not None:
                self._finish(h, s)
                kind = "invalid_request_error" if status < 500 else "server_error"
                s.queue.put_nowait(
                    ("error", APIError(message, status=status, param=param, code=code, type=kind))
                )
        elif kind == "cleared":
            fut = self._clears.pop((msg[1], h.index), None)
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "ready":
            info = msg[1]
            h.ready, h.pid, h.context_length = True, info["pid"], info["context_length"]
        elif kind == "fatal":
            self.start_error = msg[1]

    def _finish(self, h: _Handle, s: Stream) -> None:
        s.done = True
        h.inflight.pop(s.req.id, None)
        seconds = time.perf_counter() - s.submitted
        self._latency.append(seconds)
        self.metrics.observe_latency(h.index, seconds)

    def _on_death(self, h: _Handle, generation: int) -> None:
        if generation != h.generation:
            return
        h.alive = h.ready = False
        proc = h.process
        if proc is not None:
            proc.join(timeout=1)
            if proc.is_alive():  # closed its pipe but lives on: it is of no use to anyone
                proc.kill()
                proc.join(timeout=1)
        code = proc.exitcode if proc is not None else None
        how = (
            f"was killed by signal {-code}"
            if code is not None and code < 0
            else f"exited with status {code}"
        )
        failed = list(h.inflight.values())
        h.inflight.clear()
        for key in [k for k in self._clears if k[1] == h.index]:
            fut = self._clears.pop(key)
            if not fut.done():  # its layers went with the process
                fut.set_result({"scopes": [], "tokens": 0, "exited": True})
        for s in failed:
            s.done = True
            s.queue.put_nowait(
                (
                    "error",
                    APIError(
                        f"worker {h.index} (pid {h.pid}) {how} while generating this request; the server is restarting "
                        "it and the other workers are unaffected: retry the request",
                        status=503,
                        type="server_error",
                        code="worker_died",
                    ),
                )
            )
            self.metrics.request_failed(h.index, s.req.kind, 503)
        if self.closed or self.start_error is not None:
            return
        self.metrics.worker_restarted(h.index)
        h.restarts += 1
        # A worker that dies while loading is retried after a pause (not in a tight loop).
        delay = (
            0.0 if time.monotonic() - h.started_at > 30 else min(30.0, 2.0 ** min(h.restarts, 5))
        )
        self._loop.call_later(delay, self._restart, h, h.generation)

    def _restart(self, h: _Handle, generation: int) -> None:
        if not self.closed and generation == h.generation and not h.alive:
            self._spawn(h)

    # -- requests -------------------------------------------------------------------------

    @property
    def context_length(self) -> int | None:
        known = [h.context_length for h in self.handles if h.context_length]
        return min(known) if known else None

    def capacity(self) -> int:
        """Requests the pool holds before refusing: a batch per ready worker plus the queue."""
        return sum(self.config.max_batch for h in self.handles if h.ready) + self.max_queue

    def inflight(self) -> int:
        return sum(len(h.inflight) for h in self.handles)

    def _retry_after(self) -> str:
        per_request = sum(self._latency) / len(self._latency) if self._latency else 1.0
        slots = max(1, sum(self.config.max_batch for h in self.handles if h.ready))
        return str(max(1, math.ceil(per_request * max(1, self.inflight() - slots + 1) / slots)))

    def submit(self, req: GenRequest) -> Stream:
        """Hand ``req`` to the least-loaded ready worker; 429 past the queue, 503 with no worker."""
        if self.draining or self.closed:
            raise APIError(
                "the server is shutting down", status=503, type="server_error", code="shutting_down"
            )
        ready = [h for h in self.handles if h.ready and h.alive]
        if not ready:
            raise APIError(
                "no worker is ready (a worker is restarting); retry shortly",
                status=503,
                type="server_error",
                code="no_worker",
                headers={"Retry-After": "5"},
            )
        if self.inflight() >= self.capacity():
            self.metrics.rejected()
            raise APIError(
                f"the server is at capacity ({self.inflight()} requests in flight, queue of "
                f"{self.max_queue}); retry later",
                status=429,
                type="rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": self._retry_after()},
            )
        h = min(ready, key=lambda w: (len(w.inflight), w.index))
        s = Stream(req=req, worker=h.index)
        h.inflight[req.id] = s
        try:
            h.conn.send(("add", req.id, req.to_worker()))
        except OSError:
            h.inflight.pop(req.id, None)
            raise APIError(
                f"worker {h.index} is restarting; retry",
                status=503,
                type="server_error",
                code="worker_died",
                headers={"Retry-After": "1"},
            ) from None
        self.metrics.request_started(h.index)
        return s

    def abort(self, s: Stream) -> None:
        """The client went away: stop generating for it."""
        if s.done:
            return
        s.done = True
        h = self.handles[s.worker]
        if h.inflight.pop(s.req.id, None) is None:
            return
        self.metrics.request_failed(h.index, s.req.kind, 499)
        try:
            h.conn.send(("abort", s.req.id))
        except OSError:
            pass

    async def clear_live(self, scope: str | None, timeout: float = 60.0) -> list[dict]:
        """Drop the live layer of scope id ``scope`` (None: every scope) in every worker;
        per worker, the scope ids dropped and the tokens they held. A worker that is loading
        holds none (a new process starts empty)."""
        token = next(self._clear_tokens)
        waits = {}
        for h in self.handles:
            if not (h.ready and h.alive and h.conn is not None):
                continue
            fut = waits[h.index] = self._loop.create_future()
            self._clears[(token, h.index)] = fut
            try:
                h.conn.send(("clear", token, scope))
            except OSError:  # dying: its layers go with it
                self._clears.pop((token, h.index), None)
                fut.set_result({"scopes": [], "tokens": 0, "exited": True})
        try:
            done = await asyncio.wait_for(asyncio.gather(*waits.values()), timeout)
        except TimeoutError:
            for index in waits:
                self._clears.pop((token, index), None)
            raise APIError(
                f"the workers did not answer the clear within {timeout:.0f} s; retry",
                status=503,
                type="server_error",
                code="clear_timeout",
            ) from None
        return [{"worker": index, **result} for index, result in zip(waits, done)]

    def worker_pids(self) -> list[int | None]:
        return [h.pid if h.alive else None for h in self.handles]

    def status(self) -> dict:
        return {
            "workers": [
                {
                    "worker": h.index,
                    "pid": h.pid,
                    "ready": h.ready,
                    "alive": h.alive,
                    "inflight": len(h.inflight),
                    "restarts": h.restarts,
                    "waiting": h.snapshot.get("waiting", 0),
                    "running": h.snapshot.get("running", 0),
                }
                for h in self.handles
            ],
            "inflight": self.inflight(),
            "capacity": self.capacity(),
            "draining": self.draining,
        }
