"""ngram-build: corpus -> tokenizer -> trigram index, in bounded memory.

    ngram-build --corpus dolma --tokenizer qwen3 --output qwen3-dolma.idx

Argument parsing only: the pipeline (map, reduce, manifest, resume, progress) is
``dartcore.ngram_build``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from dartcore.cli._help import HelpFormatter
from dartcore.errors import CorpusError, DartError
from dartcore.index import MAX_THREADS, parse_size
from dartcore.ngram_build import (
    MapOptions,
    build,
    peak_rss_bytes,
    print_summary,
    run_map,
    run_reduce,
)

__all__ = ["main"]

EPILOG = """\
steps (the one-command build runs both):
  ngram-build map    --work-dir DIR [corpus/tokenizer options] [--part I/N] [--resume]
      Tokenise and count shard by shard into sorted run files in DIR and record each
      finished shard (with its size, mtime and SHA-256) in DIR/manifest.json.
      Restartable with --resume. With --part I/N this process maps shards I, I+N,
      I+2N, ... (one work dir per machine).
  ngram-build reduce --work-dir DIR [--work-dir DIR2 ...] --output OUT [--min-count N]
      k-way merge of every run listed in the manifests into the index OUT.

examples:
  ngram-build --corpus dolma --tokenizer qwen3 --output qwen3-dolma.idx --memory 8G
  ngram-build --corpus jsonl --files 'data/*.jsonl.zst' --text-field content --tokenizer ./tokenizer.json -o x.idx
  ngram-build --corpus npy --files 'tokens/*.npy' --tokenizer qwen3 --output tok.idx
  ngram-build --engine ray --address auto --corpus-dir /shared/dolma --work-dir /shared/w -o /shared/x.idx

Ctrl-C stops cleanly (temporary files removed); rerun the same command with --resume
to continue from the last finished shard. Shards that changed since they were mapped
are mapped again; the result is identical to an uninterrupted build of the corpus as
it is now. The output never replaces an input (shard, corpus directory, tokenizer
file): such an --output is refused before any work. To replace an index that running
processes map, build to a new path and use `dart-index install NEW TARGET`.
"""


def _size(flag: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, what=flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _int_at_least(flag: str, lo: int, hi: int | None = None):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            rng = f"{lo}..{hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{flag} wants an integer {rng}, got {text!r}")
        return v

    return parse


def _part(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--part wants I/N, e.g. 0/4; got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--part {text}: need 0 <= I < N")
    return i, n


def _add_input_args(ap: argparse.ArgumentParser) -> None:
    from dartcore.corpus import CORPUS_KINDS

    g = ap.add_argument_group("input")
    g.add_argument("--corpus", default="dolma", help=f"corpus kind: {' | '.join(CORPUS_KINDS)}")
    g.add_argument(
        "--corpus-dir",
        help="corpus directory (dolma: the one holding documents/; default $DOLMA_DIR)",
    )
    g.add_argument(
        "--files",
        action="append",
        help="glob of shard files (relative to --corpus-dir if given; ** recurses); repeatable",
    )
    g.add_argument(
        "--text-field", default="text", help="JSON field with the text; dotted for nested"
    )
    g.add_argument(
        "--token-dtype",
        choices=["uint16", "uint32"],
        help="npy: dtype of raw (headerless) token files (default: from the vocabulary size)",
    )
    g.add_argument(
        "--tokenizer",
        default="qwen3",
        help="qwen3 | smollm2 | tokenizer.json | tokenizer/model directory | .gguf",
    )
    g.add_argument(
        "--max-docs", type=_int_at_least("--max-docs", 1), help="stop after this many documents"
    )
    g.add_argument(
        "--max-tokens",
        type=_int_at_least("--max-tokens", 1),
        help="stop after the document that reaches this many tokens",
    )
    g.add_argument(
        "--strict",
        action="store_true",
        help="stop at the first damaged input (corrupt stream, malformed line, invalid UTF-8) "
        "instead of skipping and counting it",
    )


def _add_resource_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("resources")
    g.add_argument(
        "--memory",
        type=_size("--memory"),
        default="8G",
        help="memory budget of the whole process, e.g. 8G, 512M",
    )
    g.add_argument(
        "--threads",
        type=_int_at_least("--threads", 0, MAX_THREADS),
        default=0,
        help="threads for tokenising and counting (0: $DART_NUM_THREADS, else all CPUs)",
    )
    g.add_argument(
        "--temp-dir", help="where spill runs go while a shard is counted (default: the work dir)"
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    g.add_argument("--json", action="store_true", help="print the final summary as JSON")


def _add_reduce_args(g) -> None:
    g.add_argument(
        "--min-count",
        type=_int_at_least("--min-count", 1),
        default=1,
        help="drop bigrams/trigrams seen fewer times",
    )
    g.add_argument(
        "--max-children",
        type=_int_at_least("--max-children", 1, (1 << 32) - 1),
        help="keep at most this many children per context (default: all)",
    )


def build_parser(prog: str = "ngram-build") -> argparse.ArgumentParser:
    """The one-command parser (inputs, resources, output)."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description="Build a trigram index from a corpus (tokenise, count in bounded memory, merge).",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    _add_input_args(ap)
    ap.add_argument(
        "--from-dart-trie", type=Path, help="convert this DART .trie instead of counting a corpus"
    )
    _add_resource_args(ap)
    g = ap.add_argument_group("output")
    g.add_argument(
        "-o",
        "--output",
        required=True,
        type=Path,
        help="index file to write (never one of the inputs; replaced by rename)",
    )
    _add_reduce_args(g)
    g.add_argument(
        "--work-dir", type=Path, help="map work dir (default: OUTPUT.work next to the output)"
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted build from its work dir (changed shards are mapped again)",
    )
    g.add_argument(
        "--keep-work", action="store_true", help="keep the run files after the index is written"
    )
    g.add_argument(
        "--reduce-partitions",
        type=_int_at_least("--reduce-partitions", 0),
        default=0,
        help="merge this many first-token ranges at once, then those into the index (same bytes); "
        "0: local 1, ray the cluster's CPUs",
    )
    e = ap.add_argument_group("engine")
    e.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local: this process; ray: one Ray task per shard and per reduce partition "
        "(pip install 'dartcore[ray]'; --memory is then per task)",
    )
    e.add_argument(
        "--address",
        help="Ray cluster address (e.g. ray://head:10001 or auto); default: start a local Ray",
    )
    # test hook (simulated Ctrl-C)
    ap.add_argument("--stop-after-shards", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch-bytes", type=_size("--batch-bytes"), default=0, help=argparse.SUPPRESS)
    return ap


def _map_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ngram-build map",
        description="Map step: shards -> sorted runs + manifest.",
        formatter_class=HelpFormatter,
    )
    _add_input_args(ap)
    _add_resource_args(ap)
    ap.add_argument("--work-dir", type=Path, required=True, help="where runs and manifest.json go")
    ap.add_argument("--resume", action="store_true", help="continue a map in this work dir")
    ap.add_argument("--part", type=_part, default=(0, 1), help="map shards I, I+N, ... only (I/N)")
    ap.add_argument("--stop-after-shards", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batch-bytes", type=_size("--batch-bytes"), default=0, help=argparse.SUPPRESS)
    return ap


def _reduce_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ngram-build reduce",
        description="Reduce step: runs -> index.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--work-dir",
        type=Path,
        action="append",
        required=True,
        help="a mapped work dir (repeat to merge the parts of several machines)",
    )
    ap.add_argument("-o", "--output", type=Path, required=True, help="index file to write")
    _add_reduce_args(ap)
    ap.add_argument(
        "--reduce-partitions",
        type=_int_at_least("--reduce-partitions", 1),
        default=1,
        help="merge this many first-token ranges at once on the pool, then those (same bytes)",
    )
    _add_resource_args(ap)
    return ap


def _files_arg(args: argparse.Namespace) -> str | list[str] | None:
    """One --files glob is passed through; several are expanded (each relative to
    --corpus-dir when given) into one sorted list of shard paths."""
    globs = args.files
    if not globs:
        return None
    if len(globs) == 1:
        return globs[0]
    import glob as globlib

    paths: set[str] = set()
    for g in globs:
        pattern = os.path.expanduser(g)
        if args.corpus_dir and not os.path.isabs(pattern):
            pattern = os.path.join(os.path.expanduser(args.corpus_dir), pattern)
        matched = [p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p)]
        if not matched:
            raise CorpusError(f"--files {g!r} matches no file")
        paths.update(os.path.abspath(p) for p in matched)
    return sorted(paths)


def _map_options(args: argparse.Namespace, work_dir: Path) -> MapOptions:
    opts = MapOptions(
        corpus=args.corpus,
        corpus_dir=args.corpus_dir,
        files=_files_arg(args),
        text_field=args.text_field,
        token_dtype=args.token_dtype,
        tokenizer=args.tokenizer,
        work_dir=work_dir,
        memory=args.memory,
        threads=args.threads,
        temp_dir=args.temp_dir,
        max_docs=args.max_docs,
        max_tokens=args.max_tokens,
        resume=args.resume,
        strict=args.strict,
        quiet=args.quiet,
        part=getattr(args, "part", (0, 1)),
        batch_bytes=args.batch_bytes,
        stop_after_shards=args.stop_after_shards,
    )
    opts.check()
    return opts


def _on_sigterm(signum, frame):  # pragma: no cover - exercised through subprocess tests
    raise KeyboardInterrupt


def _main_map(argv: list[str]) -> int:
    args = _map_parser().parse_args(argv)
    manifest = run_map(_map_options(args, args.work_dir))
    shards = manifest["shards"].values()
    if not args.quiet:
        print(
            f"mapped {len(manifest['shards'])} shards into {args.work_dir} "
            f"({sum(s['documents'] for s in shards):,} documents, {sum(s['tokens'] for s in shards):,} tokens)"
        )
    if args.json:
        print(
            json.dumps(
                {k: v for k, v in manifest.items() if k != "shards"}
                | {"shards_mapped": len(manifest["shards"])}
            )
        )
    return 0


def _main_reduce(argv: list[str]) -> int:
    args = _reduce_parser().parse_args(argv)
    t0 = time.monotonic()
    summary = run_reduce(
        args.work_dir,
        args.output,
        min_count=args.min_count,
        threads=args.threads,
        memory=args.memory,
        temp_dir=args.temp_dir,
        max_children=args.max_children,
        partitions=args.reduce_partitions,
        log=None if args.quiet else (lambda s: print(s, file=sys.stderr)),
    )
    summary["wall_s"] = time.monotonic() - t0
    summary["peak_rss_bytes"] = peak_rss_bytes()
    if args.json:
        print(json.dumps(summary, default=str))
    elif not args.quiet:
        print(f"wrote {args.output}: " + ", ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


def _main_build(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.from_dart_trie is not None:
        from dartcore.dart_trie import main_from_args

        return main_from_args(args)
    output = args.output.expanduser()
    work_dir = args.work_dir or output.with_name(output.name + ".work")
    if args.address and args.engine != "ray":
        raise DartError("--address is for --engine ray")
    if args.engine == "ray":
        from dartcore.ngram_build.ray_engine import build_ray

        summary = build_ray(
            _map_options(args, work_dir),
            output,
            address=args.address,
            min_count=args.min_count,
            max_children=args.max_children,
            keep_work=args.keep_work,
            partitions=args.reduce_partitions,
        )
    else:
        summary = build(
            _map_options(args, work_dir),
            output,
            min_count=args.min_count,
            max_children=args.max_children,
            keep_work=args.keep_work,
            partitions=args.reduce_partitions or 1,
        )
    if args.json:
        print(json.dumps(summary))
    elif not args.quiet:
        print_summary(summary)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    step = argv[0] if argv and argv[0] in ("map", "reduce") else "build"
    try:
        if step == "map":
            return _main_map(argv[1:])
        if step == "reduce":
            return _main_reduce(argv[1:])
        return _main_build(argv)
    except KeyboardInterrupt:
        print(
            "\nngram-build: interrupted; temporary files removed. Finished shards are kept in the work "
            "dir: rerun the same command with --resume to continue.",
            file=sys.stderr,
        )
        return 130
    except (DartError, ValueError, OSError) as e:
        # CorpusError / TokenizerError / IndexBuildError / IndexFormatError, an option the
        # native builder rejects (ValueError), or the file system (disk full, permissions):
        # a message, no traceback.
        print(f"ngram-build: error ({type(e).__name__}): {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
