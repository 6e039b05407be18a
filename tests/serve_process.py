"""Start and stop a dart-serve process on 127.0.0.1 for the server tests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m dartcore.cli.dart_serve ARGS`` on a free port, up until ``stop()``."""

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        start_timeout: float = 300.0,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        full_env = dict(os.environ)
        path = [str(REPO / "python"), str(TESTS)]
        if full_env.get("PYTHONPATH"):
            path.append(full_env["PYTHONPATH"])
        full_env["PYTHONPATH"] = os.pathsep.join(path)
        full_env.update(env or {})
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dartcore.cli.dart_serve", "--port", str(self.port), *args],
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dart-serve exited with {self.proc.returncode} while starting:\n{self.log()}"
                )
            try:
                status, _ = self.get("/health")
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"dart-serve did not become healthy in {start_timeout} s:\n{self.log()}"
                )
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path is not None else ""

    def request(
        self,
        method: str,
        path: str,
        body=None,
        *,
        raw: bytes | None = None,
        headers=None,
        timeout: float = 120.0,
    ) -> tuple[int, dict, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                text = resp.read().decode()
                status, hdrs = resp.status, resp.headers  # case-insensitive lookups
        except urllib.error.HTTPError as exc:
            text, status, hdrs = exc.read().decode(), exc.code, exc.headers
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = {"_text": text}
        return status, parsed, hdrs

    def get(self, path: str) -> tuple[int, dict]:
        status, body, _ = self.request("GET", path, timeout=5)
        return status, body

    def post(self, path: str, body=None, **kw) -> tuple[int, dict, Any]:
        return self.request("POST", path, body, **kw)

    def health(self) -> dict:
        return self.request("GET", "/health", timeout=5)[1]

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            return resp.read().decode()

    def worker_pids(self) -> list[int]:
        return [w["pid"] for w in self.health()["workers"]]

    def wait_healthy(self, predicate, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                status = self.health()
                if predicate(status):
                    return status
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(
            f"the server did not reach the expected state in {timeout} s: {self.health()}"
        )

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    prefix = f"{name}{{{want}}} " if labels else f"{name} "
    for line in text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix) :])
    return 0.0
