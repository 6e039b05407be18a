"""dart-generate: generate text with DART speculative decoding (streams to stdout).

    dart-generate --index artifacts/demo/smollm2.idx "Write a Python function that reverses a list."
    echo "What is 17 * 23?" | dart-generate --index artifacts/demo/smollm2.idx --chat --stats
    dart-generate --tree ar "Once upon a time"          # plain autoregressive baseline
    dart-generate --index artifacts/demo/smollm2.idx --json --temperature 0.7 --seed 1 "Hello"

The prompt is rendered with the model's chat template when --chat is given;
otherwise it is tokenized as plain text. --stats prints the decoding statistics
(tau = committed tokens per target forward, bonus included; stage times) to
stderr; --json prints one JSON object (tokens, text, stats) instead of streaming.
"""

from __future__ import annotations

import argparse
import json
import sys

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
    deprecated,
    index_tokenizer,
    run_cli,
    sampling_params,
    tree_param,
)
from dartcore.sampling import DEFAULTS

__all__ = ["main", "format_stats"]


def _parser() -> argparse.ArgumentParser:
    from dartcore.trees import tree_builders

    p = ArgumentParser(prog="dart-generate", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    p.add_argument(
        "--target",
        default="smollm2",
        help="target model: built-in name, HF model directory or .gguf",
    )
    p.add_argument(
        "--drafter",
        default="smollm2",
        help="drafter directory (dart-train's drafter/) or built-in name",
    )
    p.add_argument(
        "--index",
        help="n-gram index built with the target's tokenizer (ngram-build); "
        "needed by the trees that read one (dart, ngram-only, ...)",
    )
    p.add_argument(
        "--tree",
        metavar="{" + ",".join(tree_builders()) + "}",
        help="tree builder, any registered one (default: dart+live on the CPU, dart on CUDA): "
        + ", ".join(tree_builders()),
    )
    add_max_nodes(
        p, "node budget per round, root excluded (default: the builder's; 4 on CPU, 59 on CUDA)"
    )
    p.add_argument(
        "--tree-param",
        action="append",
        type=tree_param,
        default=[],
        metavar="KEY=VALUE",
        help="tree builder parameter, e.g. beam_width=20 (repeatable)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="render the prompt as one user message with the chat template",
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULTS.max_new_tokens,
        help="stop after this many new tokens",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=DEFAULTS.temperature,
        help="sampling temperature (default: 0, greedy)",
    )
    p.add_argument(
        "--top-p", type=float, default=DEFAULTS.top_p, help="nucleus sampling mass (1 = off)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULTS.top_k,
        help="sample among the k most likely tokens (default: 0, off)",
    )
    p.add_argument("--seed", type=int, help="random seed for sampling (reproducible output)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="target weights"
    )
    add_target_weights(p)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    p.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of streaming text"
    )
    return p


def format_stats(stats: dict) -> str:
    """The decoding statistics as a few readable lines (``--stats``)."""
    sec = stats.get("seconds", {})
    total = stats.get("total_s", 0.0) or 0.0
    lines = [
        f"tokens      {stats.get('new_tokens', 0)} new after {stats.get('prompt_tokens', 0)} prompt tokens "
        f"({stats.get('finish_reason') or '-'})",
        f"speed       {stats.get('tokens_per_s', 0.0):.1f} tok/s, {total:.2f} s in all",
        f"tau         {stats.get('tau', 0.0):.2f} tokens per target forward over {stats.get('rounds', 0)} rounds",
    ]
    hist = stats.get("accept_hist") or []
    if hist:
        lines.append(
            "accepted    "
            + ", ".join(f"{a}: {c}" for a, c in enumerate(hist) if c)
            + "  (drafted tokens accepted: rounds)"
        )
    if sec:

        def dur(v: float) -> str:
            return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"

        parts = [
            f"{k} {dur(v)} ({v / total * 100:.0f} %)" if total else f"{k} {dur(v)}"
            for k, v in sec.items()
        ]
        lines.append("stages      " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return run_cli("dart-generate", lambda: _run(args))


def _run(args) -> int:
    # Everything a user can get wrong is checked here, before the ~4 s of loading the model.
    from dartcore.trees import default_tree, make_tree_builder

    args.tree = default_tree(args.device) if args.tree is None else args.tree
    check_tree(args.tree)
    params = dict(args.tree_param)
    if "max_nodes" in params:
        deprecated("--tree-param max_nodes=", "--max-nodes")
        if args.max_nodes is not None and args.max_nodes != params["max_nodes"]:
            raise UsageError(
                f"--max-nodes {args.max_nodes} and --tree-param max_nodes={params['max_nodes']} "
                "disagree: give --max-nodes only"
            )
    if args.max_nodes is not None:
        params["max_nodes"] = args.max_nodes
    try:
        builder = make_tree_builder(args.tree, **params)
    except (TypeError, ValueError) as exc:
        raise UsageError(f"--tree-param for --tree {args.tree}: {exc}") from None
    sampling = sampling_params(args)
    check_target(args.target)
    check_target_weights(args)
    needs_drafter = bool(getattr(builder, "needs_drafter", True))
    if needs_drafter:
        check_drafter(args.drafter)
    index = check_index(
        args.index, needed_by=[f"--tree {args.tree}"] if builder.needs_index else []
    )
    if index is not None:
        check_index_tokenizer(index, args.target)
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text.strip():
        raise UsageError("empty prompt: pass it as an argument or on stdin")

    import torch

    from dartcore.decoder import DartDecoder
    from dartcore.errors import TokenizerMismatchError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        decoder = DartDecoder.from_pretrained(
            args.target,
            args.drafter if needs_drafter else None,
            args.index,
            tree=args.tree,
            device=args.device,
            dtype=getattr(torch, args.dtype),
            quantized=args.quantized,
            numerics=args.numerics,
            **params,
        )
    except TokenizerMismatchError as exc:
        raise TokenizerMismatchError(
            f"--index {args.index} (tokenizer {index_tokenizer(index)!r}) does not fit --target "
            f"{args.target}: {exc}"
        ) from None
    prompt = [{"role": "user", "content": text}] if args.chat else text
    kw = dict(
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        stop=sampling.stop or None,
        seed=sampling.seed,
    )
    if args.json:
        result = decoder.generate(prompt, **kw)
        print(
            json.dumps(
                {"tokens": result.tokens, "text": result.text, "stats": result.stats.as_dict()}
            )
        )
    else:
        result = None
        try:
            for chunk in decoder.stream(prompt, **kw):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                result = chunk.result or result
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            print("dart-generate: interrupted", file=sys.stderr)
            return 130
        sys.stdout.write("\n")
    if args.stats and result is not None:
        print(format_stats(result.stats.as_dict()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
