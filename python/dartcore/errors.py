"""The dartcore exception hierarchy. The Rust bindings raise these classes too: they resolve
them once, when ``dartcore._native`` is imported (crates/dartcore-py/src/errors.rs, the one
place where Rust errors are mapped), so a class renamed here must be renamed there."""

from __future__ import annotations

__all__ = [
    "DartError",
    "IndexFormatError",
    "IndexBuildError",
    "IndexBuildArgumentError",
    "IndexPathError",
    "CorpusError",
    "TokenizerError",
    "TokenizerMismatchError",
    "DrafterMismatchError",
    "TreeError",
    "ContextLengthError",
    "InternalError",
    "WeightFormatError",
]


class DartError(Exception):
    """Base class of every error dartcore raises on purpose."""


class IndexFormatError(DartError):
    """An index file is corrupt, truncated, foreign or of an unknown version."""


class IndexBuildError(DartError):
    """An index build failed (I/O, memory limit too small, interrupted)."""


class IndexBuildArgumentError(IndexBuildError, ValueError):
    """An argument of an index build is of the wrong type or out of range."""


class IndexPathError(DartError, OSError):
    """An index path names something other than a regular file (a directory, FIFO, socket or
    device): refused without opening it, so a FIFO never blocks."""


class CorpusError(DartError):
    """A corpus could not be found or read."""


class TokenizerError(DartError):
    """Unknown tokenizer name, or a tokenizer file that cannot be loaded."""


class TokenizerMismatchError(DartError):
    """An index or drafter was built with a different tokenizer than the target's."""


class DrafterMismatchError(DartError):
    """A drafter was trained for a different target model."""


class TreeError(DartError, ValueError):
    """Invalid input to a tree builder (shapes, NaN scores, budgets)."""


class ContextLengthError(DartError, ValueError):
    """A prompt (plus the requested tokens) does not fit in the model's context."""


class WeightFormatError(DartError, ValueError):
    """A weight or weight file in a form the kernels do not read: an unknown block format, a
    byte length that is not the shape's, a GGUF file that is not one (or truncated)."""


class InternalError(DartError, RuntimeError):
    """A bug in dartcore: a Rust panic caught at the binding. The message names the call."""
