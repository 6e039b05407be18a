"""Rebuild the test fixtures of this directory from the public releases they are cut from.

    python3 tests/data/regenerate.py SOURCE

SOURCE holds the releases in the layout the tests read (``eval/``, ``train/``, ``dolma-sample/``,
``official-dart/``; see README.md here for where each comes from). The Dolma sample and the
official-format drafter are copied unchanged; the evaluation and training sets are cut to their
first rows, byte for byte (JSONL: the first lines; JSON arrays: the first elements, re-serialised
with ``indent=2``); the official ``.trie`` is stored xz-compressed (the tests decompress it).
The output is deterministic: same source, same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

EVAL_ROWS = 10  # the tests read at most 7 prompts of each evaluation set
TRAIN_ROWS = 40  # the format tests and a 12-conversation training run


def _first_lines(src: Path, dst: Path, n: int) -> None:
    opener = gzip.open if src.suffix == ".gz" else open
    with opener(src, "rb") as f:
        lines = [line for line in f if line.strip()][:n]
    data = b"".join(lines)
    if dst.suffix == ".gz":
        # mtime 0 and no file name: the same bytes on every run
        with (
            open(dst, "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f,
        ):
            f.write(data)
    else:
        dst.write_bytes(data)


def _first_elements(src: Path, dst: Path, n: int) -> None:
    rows = json.loads(src.read_text(encoding="utf-8"))[:n]
    dst.write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "source", type=Path, help="directory with eval/, train/, dolma-sample/, official-dart/"
    )
    args = ap.parse_args(argv)
    src = args.source
    if not (src / "eval").is_dir():
        print(
            f"{src} has no eval/ directory: pass the directory of the public releases",
            file=sys.stderr,
        )
        return 2
    for sub in ("eval", "train", "dolma-sample/documents", "official-dart/drafter-tiny"):
        (HERE / sub).mkdir(parents=True, exist_ok=True)
    _first_lines(
        src / "eval" / "humaneval.jsonl.gz", HERE / "eval" / "humaneval.jsonl.gz", EVAL_ROWS
    )
    _first_lines(src / "eval" / "gsm8k_test.jsonl", HERE / "eval" / "gsm8k_test.jsonl", EVAL_ROWS)
    _first_elements(
        src / "eval" / "code_alpaca_2k.json", HERE / "eval" / "code_alpaca_2k.json", EVAL_ROWS
    )
    _first_lines(
        src / "train" / "gsm8k_train.jsonl", HERE / "train" / "gsm8k_train.jsonl", TRAIN_ROWS
    )
    _first_elements(
        src / "train" / "new_codealpaca.json", HERE / "train" / "new_codealpaca.json", TRAIN_ROWS
    )
    for p in sorted((src / "dolma-sample" / "documents").iterdir()):
        shutil.copyfile(p, HERE / "dolma-sample" / "documents" / p.name)
    off = src / "official-dart"
    shutil.copyfile(
        off / "expected_counts.json.gz", HERE / "official-dart" / "expected_counts.json.gz"
    )
    for name in ("config.json", "model.safetensors", "reference_io.safetensors"):
        shutil.copyfile(off / "drafter-tiny" / name, HERE / "official-dart" / "drafter-tiny" / name)
    trie = (off / "dolma-sample-qwen3.trie").read_bytes()
    (HERE / "official-dart" / "dolma-sample-qwen3.trie.xz").write_bytes(
        lzma.compress(trie, preset=9 | lzma.PRESET_EXTREME)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
