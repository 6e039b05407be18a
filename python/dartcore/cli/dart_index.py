"""dart-index: install, verify, describe and merge index files.

dart-index install NEW TARGET            check NEW, then replace TARGET by rename
dart-index verify PATH                   full check of a file (checksums and structure)
dart-index info PATH                     sizes, nodes and metadata
dart-index merge BASE DELTA... -o OUT    BASE plus deltas (saved live layers) into a new file
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

from dartcore.cli._help import HelpFormatter
from dartcore.errors import DartError, IndexBuildError, IndexFormatError

__all__ = ["main", "install", "merge"]

INSTALL_HELP = """\
Why not `cp new.idx x.idx`: cp writes into the existing file, in place. Every process
that has x.idx memory-mapped (a server, a decoder) reads the same pages while cp
truncates and rewrites them; a read past the shrunken end of the file is a SIGBUS and
the process dies, and one inside it sees half-old, half-new data. `dart-index install`
renames instead: TARGET becomes a new file (a new inode) in one atomic step, processes
that mapped the old file keep reading it unchanged (its space is freed when the last one
unmaps it), and every open after the rename gets the new index. A rename cannot cross
filesystems: keep NEW next to TARGET (ngram-build --output writes there) or pass --copy.
A TARGET that is a symlink is itself replaced by the new file (the file it pointed to
stays as it was).

examples:
  ngram-build --corpus-dir ~/dolma --output /srv/idx/qwen3.idx.new
  dart-index install /srv/idx/qwen3.idx.new /srv/idx/qwen3.idx
  dart-index install --copy /scratch/qwen3.idx /srv/idx/qwen3.idx
"""


def _open_checked(path: Path, what: str):
    """Open ``path`` as an index and run the full check; a clear error otherwise."""
    from dartcore.index import NgramIndex

    if not path.exists():
        raise FileNotFoundError(
            2,
            f"{what} {path} does not exist; give the path of an index built by ngram-build",
            str(path),
        )
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise IndexFormatError(f"{what} {path} is {kind}; give the path of an index file")
    try:
        idx = NgramIndex(str(path))
        idx.verify()
        meta = idx.metadata
    except (DartError, ValueError, OSError) as e:
        raise IndexFormatError(
            f"{what} {path} is not a valid index ({e}); rebuild it with ngram-build"
        ) from None
    return idx, meta


def _copy(fin, fout, size: int) -> None:
    """Copy with a progress bar (rate, ETA) on stderr."""
    from tqdm import tqdm

    with tqdm(
        total=size,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        dynamic_ncols=True,
        desc="dart-index install: copying",
        disable=size < 64 << 20,
    ) as bar:
        while chunk := fin.read(1 << 22):
            fout.write(chunk)
            bar.update(len(chunk))


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def install(
    new: str | os.PathLike,
    target: str | os.PathLike,
    *,
    copy: bool = False,
    force: bool = False,
    log=print,
) -> Path:
    """Verify ``new`` and make it ``target`` by rename (``copy``: copy it next to target
    first, so ``new`` stays and may be on another filesystem). Returns ``target``."""
    new, target = Path(new).expanduser(), Path(target).expanduser()
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise IndexBuildError(
            f"TARGET {target} is a directory; give the index file to replace, "
            f"e.g. {target / new.name}"
        )
    if not parent.is_dir():
        raise IndexBuildError(f"TARGET's directory {parent} does not exist; create it first")
    if new.exists() and target.exists() and os.path.samefile(new, target):
        raise IndexBuildError(
            f"NEW {new} and TARGET {target} are the same file; nothing to install"
        )
    if target.exists() and not target.is_file():
        raise IndexBuildError(
            f"TARGET {target} exists and is not a regular file; choose another path"
        )
    if not copy and new.is_symlink():
        raise IndexBuildError(
            f"NEW {new} is a symlink, and a rename would move the link, not the index: "
            "give the file itself, or pass --copy"
        )
    if not copy and new.exists() and os.stat(new).st_dev != os.stat(parent).st_dev:
        raise IndexBuildError(
            f"NEW {new} is on another filesystem than TARGET {target}, and a rename cannot cross "
            "filesystems: pass --copy (copies NEW next to TARGET, then renames), or build NEW in "
            f"{parent}"
        )
    size = new.stat().st_size if new.exists() else 0
    log(f"verifying {new} ({size / 2**20:,.1f} MiB, every byte) ...", file=sys.stderr)
    t0 = time.monotonic()
    _, meta = _open_checked(new, "NEW")
    log(f"verified in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    if target.exists() and not force:
        try:
            from dartcore.index import NgramIndex

            old_tok = NgramIndex(str(target)).metadata.get("tokenizer", {})
        except (DartError, ValueError, OSError):
            old_tok = {}  # a damaged TARGET is what one replaces
        new_tok = meta.get("tokenizer", {})
        if old_tok and old_tok.get("fingerprint") != new_tok.get("fingerprint"):
            raise IndexBuildError(
                f"NEW {new} was built with tokenizer {new_tok.get('name')!r} "
                f"(fingerprint {new_tok.get('fingerprint')}), TARGET {target} with {old_tok.get('name')!r} "
                f"(fingerprint {old_tok.get('fingerprint')}): the processes using TARGET would reject it; "
                "pass --force if that is intended"
            )
    src = new
    tmp: Path | None = None
    try:
        if copy:
            fd, name = tempfile.mkstemp(prefix=f".{target.name}.install-", dir=parent)
            tmp = Path(name)
            with open(new, "rb") as fin, os.fdopen(fd, "wb") as fout:
                _copy(fin, fout, size)
                fout.flush()
                os.fsync(fout.fileno())
            os.chmod(tmp, stat.S_IMODE(os.stat(new).st_mode))
            _open_checked(tmp, "the copy of NEW")
            src = tmp
        os.replace(src, target)
        tmp = None
        _fsync_dir(parent)
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
    log(f"installed {new} as {target}" + ("" if copy else f" ({new} was moved)"), file=sys.stderr)
    return target


MERGE_HELP = """\
A delta is an index too: a live layer saved with dartcore.live.LiveLayer.save (or the
deltas dart-serve --learn-shared writes), or any index built without pruning. OUT counts
what BASE and every DELTA count, as an index built from all their documents would; it is
written to a temporary file and renamed, and never over an input. Inputs whose tokenizers
differ (or whose vocabulary sizes differ, or that were built with --min-count > 1 or
--max-children) are refused. Put OUT in service with dart-index install.

examples:
  dart-index merge /srv/idx/qwen3.idx /srv/live/worker-0.delta -o /srv/idx/qwen3.idx.new
  dart-index install /srv/idx/qwen3.idx.new /srv/idx/qwen3.idx
"""


def merge(
    base: str | os.PathLike,
    deltas: list[str | os.PathLike],
    output: str | os.PathLike,
    *,
    force: bool = False,
    log=print,
) -> dict:
    """Merge ``deltas`` into ``base`` as a new index at ``output`` (see MERGE_HELP)."""
    from dartcore.index import merge_indexes

    inputs = [Path(p).expanduser() for p in [base, *deltas]]
    out = Path(output).expanduser()
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(2, f"{p} is not an index file", str(p))
        if out.exists() and os.path.samefile(p, out):
            raise IndexBuildError(f"OUT {out} is the input {p}; write the merged index elsewhere")
    t0 = time.monotonic()
    s = merge_indexes(inputs, out, force=force)
    log(
        f"merged {len(inputs)} indexes into {out}: {s['tokens']:,} tokens, {s['nodes']:,} nodes "
        f"in {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
    )
    return s


def _info(path: Path, as_json: bool) -> None:
    from dartcore.index import NgramIndex

    if not path.is_file():
        raise FileNotFoundError(2, f"{path} is not an index file", str(path))
    s = NgramIndex(str(path)).stats()
    if as_json:
        print(json.dumps(s, default=str))
        return
    tok = s.get("metadata", {}).get("tokenizer", {})
    print(
        f"index        {path}\n"
        f"nodes        {s.get('nodes', 0):,} (unigram {s.get('unigram_nodes', 0):,}, bigram "
        f"{s.get('bigram_nodes', 0):,}, trigram {s.get('trigram_nodes', 0):,})\n"
        f"file size    {path.stat().st_size / 2**20:,.1f} MiB ({s.get('bytes_per_node') or 0:.2f} bytes/node)\n"
        f"tokenizer    {tok.get('name')} (fingerprint {tok.get('fingerprint')}, vocab {s.get('vocab_size')})"
    )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="dart-index",
        description="Install, verify and describe trigram index files.",
        formatter_class=HelpFormatter,
        epilog=INSTALL_HELP,
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{install,verify,info,merge}")
    p = sub.add_parser(
        "install",
        help="verify NEW, then replace TARGET by rename (safe for running readers)",
        description="Verify NEW (opens, every checksum), then replace TARGET by rename so that "
        "processes mapping the old TARGET keep running.",
        epilog=INSTALL_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("new", metavar="NEW", type=Path, help="the new index file (moved unless --copy)")
    p.add_argument(
        "target", metavar="TARGET", type=Path, help="the index path to replace (or create)"
    )
    p.add_argument(
        "--copy",
        action="store_true",
        help="copy NEW next to TARGET and rename the copy (NEW stays; works across filesystems)",
    )
    p.add_argument(
        "--force", action="store_true", help="install even if NEW's tokenizer differs from TARGET's"
    )
    p = sub.add_parser(
        "verify",
        help="full check of an index file (checksums and structure)",
        formatter_class=HelpFormatter,
    )
    p.add_argument("path", metavar="PATH", type=Path, help="index file")
    p = sub.add_parser(
        "info", help="nodes, size and tokenizer of an index file", formatter_class=HelpFormatter
    )
    p.add_argument("path", metavar="PATH", type=Path, help="index file")
    p.add_argument(
        "--json", action="store_true", help="print every statistic and the metadata as JSON"
    )
    p = sub.add_parser(
        "merge",
        help="BASE plus deltas (saved live layers, other indexes) into a new index file",
        description="Write a new index whose counts are those of BASE and every DELTA.",
        epilog=MERGE_HELP,
        formatter_class=HelpFormatter,
    )
    p.add_argument("base", metavar="BASE", type=Path, help="the base index")
    p.add_argument("deltas", metavar="DELTA", type=Path, nargs="+", help="indexes to add to it")
    p.add_argument("-o", "--output", required=True, type=Path, help="the merged index (a new file)")
    p.add_argument(
        "--force",
        action="store_true",
        help="merge inputs that name no tokenizer (a layer saved without one) with those that do",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "install":
            install(args.new, args.target, copy=args.copy, force=args.force)
        elif args.cmd == "verify":
            t0 = time.monotonic()
            _open_checked(args.path, "PATH")
            print(
                f"{args.path}: ok ({args.path.stat().st_size / 2**20:,.1f} MiB in {time.monotonic() - t0:.1f} s)"
            )
        elif args.cmd == "merge":
            merge(args.base, args.deltas, args.output, force=args.force)
        else:
            _info(args.path, args.json)
        return 0
    except (DartError, OSError, ValueError) as e:
        print(f"dart-index: error ({type(e).__name__}): {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
