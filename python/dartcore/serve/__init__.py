"""dart-serve: an OpenAI-compatible HTTP server over N worker processes, each with its own
model and batched :class:`~dartcore.engine.Engine`, all mapping one n-gram index file.

    dart-serve --target smollm2 --drafter smollm2 --index smollm2.idx --workers 2 --port 8000

Layers: :mod:`~dartcore.serve.protocol` (OpenAI request checks and bodies),
:mod:`~dartcore.serve.app` (FastAPI routes, SSE), :mod:`~dartcore.serve.pool` (the front's
workers: dispatch, restart, queue bound), :mod:`~dartcore.serve.worker` (the engine loop),
:mod:`~dartcore.serve.metrics` (Prometheus text).
"""

import importlib
from typing import Any

# Resolved on first use: a worker process imports dartcore.serve.worker without the HTTP stack.
_LAZY = {
    "create_app": "dartcore.serve.app",
    "WorkerPool": "dartcore.serve.pool",
    "WorkerStartError": "dartcore.serve.pool",
    "WorkerConfig": "dartcore.serve.worker",
    "APIError": "dartcore.serve.protocol",
    "GenRequest": "dartcore.serve.protocol",
}
__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dartcore.serve' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
