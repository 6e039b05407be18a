#!/usr/bin/env python3
"""A pre-tokenised corpus for a SmolLM2-tokenizer index at the paper's scale (~1.3 B nodes).

No corpus that large can be downloaded here, so the corpus has two parts, both written as
uint16 ``.npy`` token shards (EOS after every document) for ``ngram-build --corpus npy``:

* **real**: the demo index's text -- every document of ``--documents`` (default the demo
  corpus, ``artifacts/demo/corpus/documents/*.json.gz``: local text plus the shipped target
  responses) and the Dolma sample -- tokenised with the SmolLM2 tokenizer exactly as
  ``ngram-build --tokenizer smollm2`` tokenises it. These are the n-grams that predict the
  evaluation tasks' text.
* **synthetic**: ``--synthetic-tokens`` tokens of the Zipf-like generator of
  ``tools/bench_index.py`` over SmolLM2's 49,152 ids (EOS excluded), in documents of
  200-4,000 tokens. They predict nothing; they make the index as large as Dolma's, so that
  lookups, the page cache and the search meet an index of that size, and they dilute the
  real contexts' counts where they collide with them.

The index of both is then built, searched and decoded with (docs/index-at-scale.md)::

    python tools/make_scale_corpus.py --out /tmp/scale/tokens
    ngram-build --corpus npy --files '/tmp/scale/tokens/*.npy' --tokenizer smollm2 \\
        --memory 6G -o /tmp/scale/scale.idx --json

Rerunning skips the shards already written (each is written under a temporary name and
renamed).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


def _save(path: Path, tokens: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, tokens)
    os.replace(tmp, path)


def write_real(out: Path, files: list[str], tok, shard_tokens: int) -> int:
    """The real documents, tokenised by ``tok``, EOS after each; returns the tokens written."""
    from dartcore.corpus import open_corpus

    done = out / "real.DONE"
    if done.exists():
        return int(done.read_text())
    corpus = open_corpus("dolma", files=files)
    eos = np.array([tok.eos_id], dtype=np.uint16)
    parts, size, shard, total, batch = [], 0, 0, 0, []

    def flush_parts(final: bool) -> None:
        nonlocal parts, size, shard
        if parts and (final or size >= shard_tokens):
            _save(out / f"real-{shard:04d}.npy", np.concatenate(parts))
            parts, size, shard = [], 0, shard + 1

    def encode(batch: list[str]) -> None:
        nonlocal size, total
        for ids in tok.encode_batch(batch):
            a = np.concatenate((np.asarray(ids, dtype=np.uint16), eos))
            parts.append(a)
            size += len(a)
            total += len(a)
        flush_parts(False)

    for doc in corpus:
        batch.append(doc)
        if len(batch) == 256:
            encode(batch)
            batch = []
    if batch:
        encode(batch)
    flush_parts(True)
    done.write_text(str(total))
    return total


def write_synthetic(
    out: Path,
    tokens: int,
    *,
    vocab: int,
    eos_id: int,
    a: float,
    m: int,
    seed: int,
    shard_tokens: int,
) -> int:
    """``tokens`` synthetic tokens (ids below ``vocab`` other than EOS), EOS between documents."""
    from bench_index import zipf_tokens

    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab - 1, m)
    made, i = 0, 0
    while made < tokens:
        n = min(shard_tokens, tokens - made)
        t = zipf_tokens(rng, n, a, table, vocab - 1)  # the shard's draw happens even when it exists
        lens = rng.integers(200, 4000, n // 200 + 2)
        path = out / f"synth-{i:04d}.npy"
        if not path.exists():
            t = np.where(t >= eos_id, t + 1, t).astype(np.uint16)  # EOS only between documents
            cuts = np.cumsum(lens)
            _save(path, np.insert(t, cuts[cuts < n], eos_id))
        made += n
        i += 1
    return made


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="directory for the .npy shards")
    ap.add_argument(
        "--documents",
        action="append",
        help="glob of Dolma-format documents (repeatable; default the demo corpus and "
        "the Dolma sample)",
    )
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("DARTCORE_DATA") or str(REPO.parent / "shared" / "data"),
    )
    ap.add_argument("--synthetic-tokens", type=int, default=1_500_000_000)
    ap.add_argument("--zipf-a", type=float, default=1.15)
    ap.add_argument("--table", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard-tokens", type=int, default=20_000_000)
    args = ap.parse_args(argv)
    from dartcore.tokenizers import load_tokenizer

    docs = args.documents or [
        str(REPO / "artifacts" / "demo" / "corpus" / "documents" / "*.json.gz"),
        str(Path(args.data_dir) / "dolma-sample" / "documents" / "*"),
    ]
    files = sorted(f for g in docs for f in glob.glob(g))
    if not files:
        ap.error(f"no documents match {docs} (run tools/demo.sh first for the demo corpus)")
    args.out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer("smollm2")
    t0 = time.perf_counter()
    real = write_real(args.out, files, tok, args.shard_tokens)
    print(
        f"real: {real:,} tokens from {len(files)} files ({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    t0 = time.perf_counter()
    synth = write_synthetic(
        args.out,
        args.synthetic_tokens,
        vocab=tok.vocab_size,
        eos_id=tok.eos_id,
        a=args.zipf_a,
        m=args.table,
        seed=args.seed,
        shard_tokens=args.shard_tokens,
    )
    print(f"synthetic: {synth:,} tokens ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
