#!/usr/bin/env python3
"""Write a Dolma-format corpus from text that ships with this machine.

Sources (each document records where it came from):
  python-stdlib   Python sources of the standard library (sysconfig "stdlib")
  site-packages   sources and docs of installed packages (sysconfig "purelib"/"platlib")
  system-python   /usr/lib/python3*, the distribution's Python modules
  usr-share-doc   /usr/share/doc: READMEs, changelogs (gzip-compressed ones are
                  decompressed), copyright files, HTML/Markdown docs

Output: ``<output>/documents/local-NNNN.json.gz``, JSON lines with Dolma's fields
``id`` (sha1 of the text), ``text``, ``source``, ``added``, ``created`` (file
mtime), and ``metadata`` ({"path", "bytes", "package"}). Identical files are
written once. Files are visited in sorted order, so the same machine gives the
same corpus.

    python tools/make_local_corpus.py --output /tmp/local-dolma --max-bytes 500M
    ngram-build --corpus dolma --corpus-dir /tmp/local-dolma --tokenizer qwen3 --output local.idx
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path

TEXT_SUFFIXES = {
    ".py",
    ".pyi",
    ".pyx",
    ".pxd",
    ".md",
    ".rst",
    ".txt",
    ".html",
    ".htm",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".hpp",
    ".cu",
    ".cuh",
    ".rs",
    ".js",
    ".ts",
    ".css",
    ".sh",
    ".pl",
    ".toml",
    ".cfg",
    ".ini",
    ".yaml",
    ".yml",
    ".jinja",
    ".tex",
    ".el",
    ".lisp",
    ".go",
    ".java",
}
DOC_NAMES = {
    "readme",
    "changelog",
    "changes",
    "news",
    "copyright",
    "authors",
    "todo",
    "history",
    "license",
    "notice",
    "thanks",
    "faq",
    "install",
    "usage",
}
MAX_FILE_BYTES = 8 << 20  # generated tables bigger than this are not prose or code
ADDED = "2026-01-01T00:00:00.000Z"  # fixed, so reruns write identical shards


def sources() -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    out = [("python-stdlib", Path(paths["stdlib"]))]
    seen = {Path(paths["stdlib"]).resolve()}
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.resolve() not in seen:
            out.append(("site-packages", p))
            seen.add(p.resolve())
    for p in sorted(Path("/usr/lib").glob("python3*")):
        if p.is_dir() and p.resolve() not in seen:
            out.append(("system-python", p))
            seen.add(p.resolve())
    out.append(("usr-share-doc", Path("/usr/share/doc")))
    return out


def wanted(path: Path, source: str) -> bool:
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    suffix = os.path.splitext(name)[1]
    if suffix in TEXT_SUFFIXES:
        return True
    if source == "usr-share-doc":
        stem = name.split(".")[0]
        return stem in DOC_NAMES or suffix in ("", ".debian")
    return False


def read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or None for binaries, non-UTF-8, empty or huge files."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES or path.is_symlink():
            return None
        data = path.read_bytes()
        if path.name.endswith(".gz"):
            data = gzip.decompress(data)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if not data.strip() or b"\x00" in data[:8192] or len(data) > MAX_FILE_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def package_of(path: Path, root: Path, source: str) -> str | None:
    rel = path.relative_to(root).parts
    if source in ("site-packages", "usr-share-doc", "system-python") and len(rel) > 1:
        return rel[0] if source != "system-python" or rel[0] != "dist-packages" else rel[1]
    return None


def walk(root: Path, source: str, stdlib_skip: set[Path]):
    for dirpath, dirnames, filenames in os.walk(root):
        d = Path(dirpath)
        # The stdlib directory contains site-packages: that is its own source.
        dirnames[:] = sorted(
            n for n in dirnames if (d / n).resolve() not in stdlib_skip and n != "__pycache__"
        )
        for name in sorted(filenames):
            path = d / name
            if wanted(path, source):
                yield path


class ShardWriter:
    def __init__(self, out_dir: Path, shard_bytes: int) -> None:
        self.dir = out_dir / "documents"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard_bytes = shard_bytes
        self.index = 0
        self.size = 0
        self.file: gzip.GzipFile | None = None
        self.paths: list[Path] = []

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        if self.file is None or self.size >= self.shard_bytes:
            self.close()
            path = self.dir / f"local-{self.index:04d}.json.gz"
            self.index += 1
            # mtime=0: byte-identical shards on reruns.
            self.file = gzip.GzipFile(str(path) + ".tmp", "wb", compresslevel=6, mtime=0)
            self.paths.append(path)
            self.size = 0
        self.file.write(line)
        self.size += len(line)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            tmp = Path(self.file.name)
            os.replace(tmp, tmp.with_suffix(""))  # drop ".tmp"
            self.file = None


class _Enough(Exception):
    """--max-bytes reached."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--output", required=True, type=Path, help="corpus directory (documents/ is created)"
    )
    ap.add_argument(
        "--max-bytes", default="0", help="stop after this much text (e.g. 500M; 0 = everything)"
    )
    ap.add_argument(
        "--shard-bytes", default="64M", help="uncompressed bytes per shard (default 64M)"
    )
    ap.add_argument(
        "--sources",
        default="python-stdlib,site-packages,system-python,usr-share-doc",
        help="comma-separated subset of the sources",
    )
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
    from dartcore.index import parse_size

    try:
        max_bytes = (
            0 if args.max_bytes.strip() == "0" else parse_size(args.max_bytes, what="--max-bytes")
        )
        shard_bytes = parse_size(args.shard_bytes, what="--shard-bytes")
    except ValueError as e:
        ap.error(str(e))
    chosen = set(args.sources.split(","))
    all_sources = sources()
    unknown = chosen - {s for s, _ in all_sources}
    if unknown:
        ap.error(f"unknown sources {sorted(unknown)}; valid: {sorted({s for s, _ in all_sources})}")
    existing = (
        list((args.output / "documents").glob("*.json.gz"))
        if (args.output / "documents").is_dir()
        else []
    )
    if existing:
        ap.error(
            f"{args.output}/documents already holds {len(existing)} shards; choose an empty --output"
        )

    skip = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    writer = ShardWriter(args.output, shard_bytes)
    seen: set[bytes] = set()
    counts: dict[str, list[int]] = {}
    total = 0
    try:
        for source, root in all_sources:
            if source not in chosen or not root.is_dir():
                continue
            for path in walk(root, source, skip if source == "python-stdlib" else set()):
                text = read_text(path)
                if text is None:
                    continue
                digest = hashlib.sha1(text.encode("utf-8")).digest()
                if digest in seen:
                    continue
                seen.add(digest)
                st = path.stat()
                size = len(text.encode("utf-8"))
                writer.write(
                    {
                        "id": digest.hex(),
                        "text": text,
                        "source": source,
                        "added": ADDED,
                        "created": dt.datetime.fromtimestamp(st.st_mtime, dt.UTC).strftime(
                            "%Y-%m-%dT%H:%M:%S.000Z"
                        ),
                        "metadata": {
                            "path": str(path),
                            "bytes": size,
                            "package": package_of(path, root, source),
                        },
                    }
                )
                c = counts.setdefault(source, [0, 0])
                c[0] += 1
                c[1] += size
                total += size
                if not args.quiet and c[0] % 2000 == 0:
                    print(
                        f"\r{total / 1e6:8.1f} MB  {sum(v[0] for v in counts.values())} documents",
                        end="",
                        file=sys.stderr,
                    )
                if max_bytes and total >= max_bytes:
                    raise _Enough
    except _Enough:
        pass
    finally:
        writer.close()
    if not args.quiet:
        print(file=sys.stderr)
    summary = {
        "output": str(args.output),
        "shards": len(writer.paths),
        "documents": sum(v[0] for v in counts.values()),
        "bytes": total,
        "by_source": {k: {"documents": v[0], "bytes": v[1]} for k, v in counts.items()},
    }
    (args.output / "SOURCES.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
