"""The map step's work dir: manifest, lock, leftovers of killed runs, clean-up."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path
from typing import Any

from dartcore.errors import IndexBuildError

MANIFEST = "manifest.json"
SPILL_PREFIX = "tmp-ngram-build-spill-"
PARTITION_PREFIX = "tmp-ngram-build-partitions-"
MANIFEST_FORMAT = "dartcore-ngram-map/1"
LOCK = "LOCK"


def read_manifest(work_dir: Path) -> dict | None:
    path = work_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise IndexBuildError(
            f"{path}: unreadable manifest ({e}); remove the work dir and map again"
        ) from None
    if data.get("format") != MANIFEST_FORMAT:
        raise IndexBuildError(
            f"{path}: not a {MANIFEST_FORMAT} manifest; remove it or use another --work-dir"
        )
    return data


def write_manifest(work_dir: Path, manifest: dict) -> None:
    path = work_dir / MANIFEST
    tmp = path.with_suffix(".json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class WorkDirLock:
    """One map at a time per work dir: an flock on W/LOCK (released by the kernel when the
    process dies, so a killed build's lock is free and the next run takes it over)."""

    def __init__(self, work_dir: Path) -> None:
        self.path = work_dir / LOCK
        self.fd: int | None = None

    def __enter__(self) -> WorkDirLock:
        fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.read(fd, 32).decode().strip() or "?"
            except (OSError, UnicodeDecodeError):
                pid = "?"
            os.close(fd)
            raise IndexBuildError(
                f"{self.path.parent} is in use by process {pid}; wait for it or use another --work-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def remove_leftovers(work: Path) -> None:
    """Half-written shard dirs, spill dirs and reduce partition dirs of an interrupted or killed run (the caller
    holds the work dir's lock, so no live map owns them)."""
    for p in work.iterdir():
        if p.name.endswith(".partial") or p.name.startswith((SPILL_PREFIX, PARTITION_PREFIX)):
            shutil.rmtree(p, ignore_errors=True)


def remove_work(work: Path) -> None:
    """Delete what map wrote (never other files a user keeps in --work-dir)."""
    if not work.is_dir():
        return
    for p in work.glob("shard-*"):
        if p.is_dir() and p.name[6:11].isdigit():
            shutil.rmtree(p, ignore_errors=True)
    remove_leftovers(work)
    for name in (MANIFEST, MANIFEST + ".tmp", LOCK):
        (work / name).unlink(missing_ok=True)
    try:
        work.rmdir()
    except OSError:
        pass  # not empty: the user's own files stay
