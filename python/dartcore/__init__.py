"""dartcore: lossless speculative decoding (DART) on a memory-mapped trigram index.

Public API (everything else is private):

    from dartcore import NgramIndex, build_index, DartDecoder, DartDrafter

Torch-dependent names are imported lazily so that the index and `ngram-build`
work without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from dartcore.errors import (
    ContextLengthError,
    CorpusError,
    DartError,
    DrafterMismatchError,
    IndexBuildError,
    IndexFormatError,
    IndexPathError,
    InternalError,
    TokenizerError,
    TokenizerMismatchError,
    TreeError,
    WeightFormatError,
)
from dartcore.renamed import install as _install_renamed

__version__ = "0.1.0"
_install_renamed()  # dartcore.build, dartcore.builders, dartcore.verify: the old module names

# name -> module that defines it; resolved on first access (PEP 562).
_LAZY = {
    "NgramIndex": "dartcore.index",
    "build_index": "dartcore.index",
    "load_tokenizer": "dartcore.tokenizers",
    "Tree": "dartcore.tree",
    "beam_search": "dartcore.tree",
    "DartDrafter": "dartcore.drafter",
    "DartDecoder": "dartcore.decoder",
    "GenerationStats": "dartcore.decoder",
    "GenerationResult": "dartcore.decoder",
    "Engine": "dartcore.engine",
    "register_tree_builder": "dartcore.trees",
}

__all__ = [
    "ContextLengthError",
    "CorpusError",
    "DartError",
    "DrafterMismatchError",
    "IndexBuildError",
    "IndexFormatError",
    "IndexPathError",
    "InternalError",
    "TokenizerError",
    "TokenizerMismatchError",
    "TreeError",
    "WeightFormatError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dartcore' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
