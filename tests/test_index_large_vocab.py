"""A hybrid Qwen generation's vocabulary (Qwen3-Next / Qwen3.5: 248,320 entries) fits the
index format: build, open, query and search with ids up to the last one, against counting."""

from __future__ import annotations

from collections import Counter

import numpy as np

from dartcore import tree as T
from dartcore.index import NgramIndex, build_index

VOCAB = 248_320


def test_a_248k_vocabulary_builds_queries_and_searches(tmp_path):
    rng = np.random.default_rng(0)
    # ids spread over the whole range, the last one included, with repeats to count
    pool = np.concatenate([[VOCAB - 1, VOCAB - 2, 0], rng.integers(0, VOCAB, size=200)])
    docs = [rng.choice(pool, size=int(rng.integers(20, 80))) for _ in range(40)]
    docs.append(np.array([VOCAB - 1, VOCAB - 2, VOCAB - 1, VOCAB - 2, 7]))
    path = tmp_path / "big.idx"
    build_index(docs, path, vocab_size=VOCAB)
    idx = NgramIndex(path)
    assert idx.vocab_size == VOCAB
    after = Counter()
    for d in docs:
        for i in range(len(d) - 2):
            if d[i] == VOCAB - 1 and d[i + 1] == VOCAB - 2:
                after[int(d[i + 2])] += 1
    tokens, counts, total, _ = idx.children([VOCAB - 1, VOCAB - 2], k=25)
    assert dict(zip(map(int, tokens), map(int, counts))) == dict(after.most_common(25))
    assert int(total) == sum(after.values())
    toks = np.array([[VOCAB - 1, 5, 9], [VOCAB - 2, 3, 4]], dtype=np.int64)
    lps = np.log(np.full((2, 3), 1 / 3, dtype=np.float32))
    tree = T.beam_search(idx, [7, VOCAB - 2], toks, lps, max_nodes=4)
    assert tree.tokens[0] == VOCAB - 2 and VOCAB - 1 in set(int(t) for t in tree.tokens)
