"""dart-generate: generate text with DART speculative decoding (streams to stdout).

    dart-generate --index smollm2.idx "Write a Python function that reverses a list."
    echo "What is 17 * 23?" | dart-generate --index smollm2.idx --chat --stats
    dart-generate --tree ar "Once upon a time"          # plain autoregressive baseline
    dart-generate --index smollm2.idx --json --temperature 0.7 --seed 1 "Hello"

The prompt is rendered with the model's chat template when --chat is given;
otherwise it is tokenized as plain text. --stats prints the decoding statistics
(tau = committed tokens per target forward, bonus included; stage times) to
stderr; --json prints one JSON object (tokens, text, stats) instead of streaming.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["main"]


def _tree_param(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if value.lower() in ("true", "false"):  # flags such as ngram_first_level=false
        return key, value.lower() == "true"
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dart-generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="prompt text (default: read stdin)")
    p.add_argument("--target", default="smollm2", help="target model name or path (default: smollm2)")
    p.add_argument("--drafter", default="smollm2", help="drafter directory or built-in name (default: smollm2)")
    p.add_argument("--index", help="n-gram index built with the target's tokenizer (needed by --tree dart, ngram-only)")
    p.add_argument("--tree", default="dart",
                   help="tree builder: dart, dart-no-ngram, dart-chain, ngram-only, ar, dartree, hybrid, ddtree")
    p.add_argument("--tree-param", action="append", type=_tree_param, default=[], metavar="KEY=VALUE",
                   help="tree builder parameter, e.g. max_nodes=24, beam_width=20 (repeatable)")
    p.add_argument("--chat", action="store_true", help="render the prompt as one user message with the chat template")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--stats", action="store_true", help="print decoding statistics to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import torch

    from dartcore.decoder import DartDecoder
    from dartcore.errors import DartError

    if args.threads:
        torch.set_num_threads(args.threads)
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text.strip():
        print("dart-generate: empty prompt", file=sys.stderr)
        return 2
    needs_drafter = args.tree not in ("ar", "ngram-only")
    try:
        decoder = DartDecoder.from_pretrained(
            args.target, args.drafter if needs_drafter else None, args.index, tree=args.tree,
            device=args.device, dtype=getattr(torch, args.dtype), **dict(args.tree_param))
        prompt = [{"role": "user", "content": text}] if args.chat else text
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, stop=args.stop or None, seed=args.seed)
        if args.json:
            result = decoder.generate(prompt, **kw)
            print(json.dumps({"tokens": result.tokens, "text": result.text, "stats": result.stats.as_dict()}))
        else:
            result = None
            for chunk in decoder.stream(prompt, **kw):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                result = chunk.result or result
            sys.stdout.write("\n")
        if args.stats and result is not None:
            print(json.dumps(result.stats.as_dict(), indent=2), file=sys.stderr)
    except (DartError, ValueError, TypeError, FileNotFoundError) as exc:
        print(f"dart-generate: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
