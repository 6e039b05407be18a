"""dart-serve: an OpenAI-compatible server for DART speculative decoding.

    dart-serve --target smollm2 --drafter smollm2 --index smollm2.idx --workers 2 --port 8000
    dart-serve --index smollm2.idx --max-nodes 0       # the same server, speculation off (AR steps)

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream over SSE),
GET /v1/models, GET /health, GET /metrics (Prometheus). Each of the --workers
processes loads its own model and batched engine and maps the same index file
(one copy in the page cache). Per-request speculative statistics: send
"dart": {"stats": true} in the body (openai client: extra_body=...) or the
header X-Dart-Stats: 1. SIGTERM drains the requests in flight, then exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dartcore.cli._common import (
    ArgumentParser,
    HelpFormatter,
    UsageError,
    add_max_nodes,
    add_target_weights,
    check_drafter,
    check_index,
    check_index_tokenizer,
    check_target,
    check_target_weights,
    check_tree,
    run_cli,
    tree_param,
)
from dartcore.sampling import DEFAULTS
from dartcore.serve.worker import STREAM_INTERVAL

__all__ = ["main"]


DEFAULT_FACTORY = "dartcore.serve.worker:load_engine"


def _positive(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} must be an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name} must be an integer >= {minimum}, got {value}")
        return value

    return parse


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="dart-serve", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--target", default="smollm2", help="target model name or path (default: smollm2)"
    )
    p.add_argument(
        "--drafter", default="smollm2", help="drafter directory or built-in name (default: smollm2)"
    )
    p.add_argument(
        "--index", help="n-gram index built with the target's tokenizer (needed by --tree dart)"
    )
    p.add_argument(
        "--tree", default="dart", help="tree builder (dart, dart-no-ngram, ngram-only, ar, ...)"
    )
    p.add_argument(
        "--tree-param",
        action="append",
        type=tree_param,
        default=[],
        metavar="KEY=VALUE",
        help="tree builder parameter (repeatable)",
    )
    add_max_nodes(
        p,
        "node budget per sequence and step, root excluded: 'adaptive' (the controller, default) or "
        "a fixed count; 0 = speculation off (plain AR steps)",
        default="adaptive",
        adaptive=True,
        old="--budget",
    )
    p.add_argument(
        "--workers", type=_positive("--workers"), default=1, help="worker processes (default 1)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_positive("--port", 0), default=8000)
    p.add_argument(
        "--max-batch",
        type=_positive("--max-batch"),
        default=8,
        help="sequences each worker decodes together (default 8)",
    )
    p.add_argument(
        "--max-seq-len",
        type=_positive("--max-seq-len", 2),
        default=2048,
        help="per-sequence KV capacity = the context requests are checked against (default 2048)",
    )
    p.add_argument(
        "--max-queue",
        type=_positive("--max-queue", 0),
        default=16,
        help="requests held beyond the workers' batches before answering 429 (default 16)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=_positive("--default-max-tokens"),
        default=DEFAULTS.max_new_tokens,
        help=f"max_tokens of a chat request that gives none (default {DEFAULTS.max_new_tokens})",
    )
    p.add_argument(
        "--stream-interval",
        type=float,
        default=STREAM_INTERVAL,
        metavar="SECONDS",
        help="a streamed request's new text goes out at most this often (its first token and "
        f"its end at once; 0: every engine step) (default {STREAM_INTERVAL})",
    )
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        help="model name clients send (repeatable; default: the --target name)",
    )
    p.add_argument(
        "--threads",
        type=_positive("--threads"),
        default=1,
        help="torch threads per worker (default 1)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    add_target_weights(p)
    p.add_argument(
        "--no-prefault-index",
        action="store_true",
        help="map the index lazily instead of faulting it in at start (dartcore.index.DECODE_PREFAULT)",
    )
    p.add_argument(
        "--learn",
        action="store_true",
        help="each worker keeps live n-gram layers of what it served (prompts and outputs, "
        "oldest out first) that the dart+live, dart+mix and suffix trees read; a request opts "
        'out with "dart": {"learn": false}. Outputs never change, speed does: see --learn-scope',
    )
    p.add_argument(
        "--learn-scope",
        choices=("tenant", "shared"),
        default="tenant",
        help="tenant (default): one layer per scope, named by the request "
        '("dart": {"scope": "<name>"}), else its API key (hashed), else anonymous, so that '
        "tenants cannot time each other's text; shared: one layer for all of a worker's requests",
    )
    p.add_argument(
        "--learn-scopes",
        type=_positive("--learn-scopes"),
        default=64,
        help="most scopes a worker keeps (--learn-scope tenant); the least recently used "
        "layer is dropped whole past it (default 64)",
    )
    p.add_argument(
        "--learn-capacity",
        type=_positive("--learn-capacity"),
        default=None,
        help="tokens per layer (default: 1M tokens split across --learn-scopes in tenant mode, "
        "1M shared)",
    )
    p.add_argument(
        "--learn-shared",
        metavar="DIR",
        type=Path,
        default=None,
        help="share the workers' live layers through DIR (with --learn): each worker writes its "
        "layer of a scope there as a delta index (by rename) and reads the other workers' of "
        "that scope with its own; any process given the same DIR joins. Scope rules still "
        "apply; tenants in one scope can time each other's text across workers",
    )
    p.add_argument(
        "--learn-shared-every",
        metavar="SECONDS",
        type=float,
        default=10.0,
        help="a worker writes its delta of a scope at most this often, sooner after "
        "--learn-shared-tokens new tokens (default 10)",
    )
    p.add_argument(
        "--learn-shared-tokens",
        type=_positive("--learn-shared-tokens"),
        default=1 << 16,
        help="new tokens in a layer that make its delta due before --learn-shared-every (default 65536)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds SIGTERM waits for requests in flight (default 60)",
    )
    p.add_argument(
        "--engine-factory",
        default=DEFAULT_FACTORY,
        help="module:function that loads a worker's engine (default: the real model and Engine)",
    )
    p.add_argument(
        "--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug")
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli("dart-serve", lambda: _run(args))


def _check(args) -> None:
    """What a user can get wrong, checked in the front before any worker loads a model."""
    check_tree(args.tree)
    from dartcore.trees import make_tree_builder, reads_live

    try:
        builder = make_tree_builder(args.tree, **dict(args.tree_param))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--tree-param for --tree {args.tree}: {exc}") from None
    if args.learn and not reads_live(builder):
        print(
            f"dart-serve: --learn: the {args.tree} tree reads no live layer (dart+live, dart+mix "
            "and suffix do); what the workers learn speeds nothing up until it is merged into "
            "the index (--learn-shared, dart-index merge)",
            file=sys.stderr,
        )
    check_target(args.target)
    check_target_weights(args)
    if builder.needs_drafter:
        check_drafter(args.drafter)
    index = check_index(
        args.index, needed_by=[f"--tree {args.tree}"] if builder.needs_index else []
    )
    if index is not None:
        check_index_tokenizer(index, args.target)
    # `index` goes out of scope here: the front keeps no mapping, only the workers share one.


def _run(args) -> int:
    if args.learn_shared is not None and not args.learn:
        raise UsageError("--learn-shared shares live layers: it needs --learn")
    if not 0 <= args.stream_interval <= 10:
        raise UsageError(
            f"--stream-interval must be in [0, 10] seconds, got {args.stream_interval}"
        )
    if not args.learn_shared_every > 0:
        raise UsageError(f"--learn-shared-every must be > 0 seconds, got {args.learn_shared_every}")
    if args.engine_factory == DEFAULT_FACTORY:
        _check(args)
    import uvicorn

    from dartcore.serve import WorkerConfig, WorkerPool, WorkerStartError, create_app

    config = WorkerConfig(
        target=args.target,
        drafter=args.drafter,
        index=args.index,
        tree=args.tree,
        budget=args.max_nodes,
        max_batch=args.max_batch,
        max_seq_len=args.max_seq_len,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        quantized=args.quantized,
        numerics=args.numerics,
        prefault_index=not args.no_prefault_index,
        learn=args.learn,
        learn_scope=args.learn_scope,
        learn_scopes=args.learn_scopes,
        learn_capacity=args.learn_capacity,
        learn_shared=str(args.learn_shared) if args.learn_shared is not None else None,
        learn_shared_every=args.learn_shared_every,
        learn_shared_tokens=args.learn_shared_tokens,
        default_max_tokens=args.default_max_tokens,
        stream_interval=args.stream_interval,
        tree_params=dict(args.tree_param),
        engine_factory=args.engine_factory,
    )
    models = tuple(args.served_model_name) or (Path(args.target).name,)
    pool = WorkerPool(config, args.workers, max_queue=args.max_queue)
    app = create_app(pool, models, drain_timeout=args.drain_timeout)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            http="h11",
            lifespan="on",
            log_level=args.log_level,
            timeout_graceful_shutdown=args.drain_timeout,
            access_log=args.log_level in ("info", "debug"),
        )
    )
    try:
        server.run()
    except WorkerStartError as exc:
        print(f"dart-serve: {exc}", file=sys.stderr)
        return 1
    except SystemExit:  # uvicorn exits with status 3 when the app's startup fails
        if server.started:
            raise
    if not server.started:
        why = (
            f"a worker could not start: {pool.start_error}"
            if pool.start_error
            else "see the errors above"
        )
        print(f"dart-serve: the server did not start ({why})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
