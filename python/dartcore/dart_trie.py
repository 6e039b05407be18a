"""Convert the official DART ``.trie`` (``fvliang/dart-qwen3-ngram``: ``small.trie``,
``full.trie``) into a dartcore index::

    ngram-build --from-dart-trie full.trie --tokenizer qwen3 --output qwen3-dolma.idx

The conversion streams the file (the released ``full.trie`` is ~43.5 GB; the official code
reads it whole into RAM) in bounded memory (``--memory``), with temporary files on disk
(next to the output, or ``--temp-dir``): see ``crates/dart-ngram/src/dart_trie.rs``. The
index has the trie's counts exactly; its metadata records the origin (file name and size).
The official counts are int32: a negative count, or one below its children's sum (a count
that wrapped past 2^31 - 1), is an :class:`~dartcore.errors.IndexFormatError` naming the node.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["convert_dart_trie"]

# headroom left to the interpreter and the tokenizer out of --memory
_RESERVE = 64 << 20


class _Progress:
    """One tqdm bar per stage ("read": bytes of the trie, "join": bigram nodes)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.stage, self.bar, self.pos = enabled, None, None, 0

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if stage != self.stage:
            self.close()
            self.stage, self.pos = stage, 0
            if stage == "write":
                self.bar = tqdm(total=None, desc="write index", bar_format="{desc}: {elapsed}")
            else:
                unit = "B" if stage == "read" else " bigrams"
                self.bar = tqdm(
                    total=total,
                    desc=f"{stage} trie" if stage == "read" else "join",
                    unit=unit,
                    unit_scale=True,
                    unit_divisor=1024 if stage == "read" else 1000,
                    dynamic_ncols=True,
                )
        if done > self.pos:
            self.bar.update(done - self.pos)
            self.pos = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def convert_dart_trie(
    trie,
    output,
    *,
    tokenizer: str = "qwen3",
    memory: int = 8 << 30,
    temp_dir=None,
    min_count: int = 1,
    max_children: int | None = None,
    threads: int | None = None,
    progress: bool = False,
) -> dict:
    """Convert the DART ``.trie`` at ``trie`` into the index ``output`` (temp file + rename;
    never over the input). ``tokenizer``: the one the trie was built with (its vocabulary
    bounds the token ids; the index records it as an ngram-build index does). Returns the
    build summary plus the trie's node counts, wall time and peak RSS."""
    from dartcore import __version__, _native
    from dartcore.ngram_build.inputs import check_not_an_input, check_output
    from dartcore.ngram_build.map import rss_bytes
    from dartcore.ngram_build.reduce import peak_rss_bytes
    from dartcore.tokenizers import load_tokenizer

    trie, output = Path(trie).expanduser(), Path(output).expanduser()
    if not trie.is_file():
        raise FileNotFoundError(2, f"no DART .trie at {trie} (--from-dart-trie)", str(trie))
    check_output(output)
    check_not_an_input(output, [trie])  # also through a symlink or a hard link
    t0 = time.monotonic()
    tok = load_tokenizer(tokenizer)
    metadata = {
        "tokenizer": {
            "name": tok.name,
            "fingerprint": tok.fingerprint,
            "vocab_size": tok.vocab_size,
            "eos_id": tok.eos_id,
        },
        "origin": {
            "format": "dart-trie",
            "file": trie.name,
            "bytes": trie.stat().st_size,
            "counts": "TrieNgram(3) node counts, converted exactly",
        },
        "build": {
            "tool": "ngram-build --from-dart-trie",
            "dartcore_version": __version__,
            "min_count": min_count,
            "max_children": max_children,
        },
    }
    limit = max(int(memory) - rss_bytes() - _RESERVE, 16 << 20)
    bar = _Progress(progress)
    try:
        summary = dict(
            _native.convert_dart_trie(
                str(trie),
                str(output),
                vocab_size=tok.vocab_size,
                metadata_json=json.dumps(metadata, sort_keys=True),
                memory_limit=limit,
                temp_dir=None if temp_dir is None else str(temp_dir),
                min_count=min_count,
                max_children=max_children,
                threads=threads or None,
                progress=bar,
            )
        )
    finally:
        bar.close()
    summary["wall_s"] = time.monotonic() - t0
    summary["peak_rss_bytes"] = peak_rss_bytes()
    summary["memory_limit_bytes"] = int(memory)
    summary["nodes"] = summary["unigram_nodes"] + summary["bigram_nodes"] + summary["trigram_nodes"]
    return summary


def main_from_args(args) -> int:
    """``ngram-build --from-dart-trie FILE ...`` (the parsed ngram-build arguments)."""
    s = convert_dart_trie(
        args.from_dart_trie,
        args.output,
        tokenizer=args.tokenizer,
        memory=args.memory,
        temp_dir=args.temp_dir,
        min_count=args.min_count,
        max_children=args.max_children,
        threads=args.threads or None,
        progress=not (args.quiet or args.json),
    )
    if args.json:
        print(json.dumps(s))
    elif not args.quiet:
        print(
            f"wrote {s['output']}: {s['nodes']:,} nodes (unigram {s['unigram_nodes']:,}, bigram "
            f"{s['bigram_nodes']:,}, trigram {s['trigram_nodes']:,}) from {s['trie_nodes']:,} trie nodes, "
            f"{s['documents']:,} documents, {s['tokens']:,} tokens; {s['wall_s']:.1f} s "
            f"({s['trie_nodes'] / max(s['wall_s'], 1e-9) / 1e6:.2f} M nodes/s), peak RSS "
            f"{s['peak_rss_bytes'] / 2**30:.2f} GiB (--memory {s['memory_limit_bytes'] / 2**30:.2f} GiB)"
        )
    return 0
