"""What dart-generate, dart-serve, dart-bench and dart-train share (the help formatter is the build
CLIs', :mod:`dartcore.cli._help`): checks of
arguments and files that run before a model loads (loading SmolLM2 costs ~4 s, a wrong
path should not), and one-line errors that name the flag and the fix."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from dartcore.cli._help import HelpFormatter
from dartcore.errors import DartError, IndexFormatError, TokenizerMismatchError

__all__ = [
    "UsageError",
    "MissingFileError",
    "ArgumentParser",
    "HelpFormatter",
    "closest",
    "check_choice",
    "check_tree",
    "check_index",
    "check_target",
    "check_drafter",
    "check_paths",
    "run_cli",
    "tree_param",
    "add_max_nodes",
    "add_target_weights",
    "check_target_weights",
    "deprecated",
    "sampling_params",
]

DEMO_INDEX = "artifacts/demo/smollm2.idx"


class UsageError(DartError, ValueError):
    """A command-line argument that cannot work; the message names the flag and the fix."""


class MissingFileError(DartError, FileNotFoundError):
    """A file or directory named on the command line does not exist."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (no usage block) naming --help."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def tree_param(text: str) -> tuple[str, object]:
    """A ``--tree-param KEY=VALUE``: true/false as bools, then int, then float, else the text."""
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


def deprecated(old: str, new: str) -> None:
    """The one-line notice an old spelling of a flag prints (it still works)."""
    print(
        f"warning: {old} is deprecated, use {new} (the old spelling goes in the next release)",
        file=sys.stderr,
    )


def _node_count(flag: str, adaptive: bool):
    what = "'adaptive' or a node count >= 0" if adaptive else "a node count >= 0"

    def parse(text: str):
        if adaptive and text == "adaptive":
            return text
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {text!r}") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{flag} must be {what}, got {value}")
        return value

    return parse


def add_max_nodes(
    parser: argparse.ArgumentParser,
    help: str,
    *,
    default=None,
    adaptive: bool = False,
    old: str | None = None,
) -> None:
    """``--max-nodes``, the node budget (root excluded), spelled the same in every CLI; ``old``:
    a former spelling kept as a deprecated alias (it prints a one-line notice). ``adaptive``:
    the value may also be ``adaptive`` (the budget controller)."""
    parser.add_argument(
        "--max-nodes",
        dest="max_nodes",
        type=_node_count("--max-nodes", adaptive),
        default=default,
        help=help,
    )
    if old is not None:

        class Alias(argparse.Action):
            def __call__(self, parser, namespace, values, option_string=None):
                deprecated(old, "--max-nodes")
                namespace.max_nodes = values

        parser.add_argument(
            old,
            dest="max_nodes",
            action=Alias,
            type=_node_count(old, adaptive),
            help=argparse.SUPPRESS,
        )


def sampling_params(args):
    """The request parameters of ``args`` (--max-new-tokens, --temperature, --top-p, --top-k,
    --seed, --stop) as one :class:`dartcore.sampling.SamplingParams`, which checks them; a bad
    value is a UsageError naming the flag, before any model loads."""
    from dartcore.sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            stop=args.stop,
        )
    except (TypeError, ValueError) as exc:
        name, _, rest = str(exc).partition(" ")
        raise UsageError(f"--{name.replace('_', '-')} {rest}") from None


def closest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest choice, or ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f" (did you mean {match[0]!r}?)" if match else ""


def check_choice(flag: str, value: str, choices: Iterable[str]) -> str:
    choices = list(choices)
    if value not in choices:
        raise UsageError(
            f"{flag} {value!r} is not one of {', '.join(choices)}{closest(value, choices)}"
        )
    return value


def check_tree(value: str, flag: str = "--tree") -> str:
    from dartcore.trees import tree_builders

    return check_choice(flag, value, tree_builders())


def check_index(
    path: str | None,
    *,
    needed_by: list[str],
    flag: str = "--index",
    alternative: str = "--tree dart-no-ngram or ar",
):
    """Open the index (header and checksummed metadata only: O(1)) or say what to pass.
    Returns the opened :class:`~dartcore.NgramIndex`, or None when no tree needs one."""
    if path is None:
        if needed_by:
            raise UsageError(
                f"{' and '.join(needed_by)} need{'s' if len(needed_by) == 1 else ''} an n-gram index: pass "
                f"{flag} FILE (bash tools/demo.sh builds {DEMO_INDEX}; ngram-build --tokenizer smollm2 "
                f"builds one), or use {alternative}"
            )
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory, not an index file" if p.is_dir() else "does not exist"
        raise MissingFileError(
            f"{flag} {path} {what}: pass an index built by ngram-build "
            f"(bash tools/demo.sh builds {DEMO_INDEX})"
        )
    from dartcore.index import NgramIndex

    try:
        index = NgramIndex(p)
        index.metadata  # noqa: B018 - parse it now, so a corrupt block fails here
    except IndexFormatError as exc:
        raise IndexFormatError(f"{flag} {path}: {_one_line(exc).replace(f'{p}: ', '')}") from None
    return index


def index_tokenizer(index) -> str | None:
    meta = index.metadata if index is not None else {}
    return (meta.get("tokenizer") or {}).get("name") if isinstance(meta, dict) else None


def check_index_tokenizer(index, target: str, flag: str = "--index") -> None:
    """Compare the tokenizer names before the model loads where both are dartcore's own
    (a built-in target's tokenizer is named after it); the decoder compares fingerprints."""
    from dartcore.models.targets import BUILTIN_TARGETS

    name = index_tokenizer(index)
    builtin = {"qwen3", *BUILTIN_TARGETS}
    if name in builtin and target.lower() in BUILTIN_TARGETS and name != target.lower():
        raise TokenizerMismatchError(
            f"{flag} {index.path} was built with the {name} tokenizer, but --target {target} uses the "
            f"{target.lower()} tokenizer: rebuild it with ngram-build --tokenizer {target.lower()} "
            f"(or pass {DEMO_INDEX} after bash tools/demo.sh)"
        )


def add_target_weights(p: argparse.ArgumentParser) -> None:
    """``--quantized / --no-quantized`` and ``--numerics``: how a GGUF target's weights load,
    spelled the same by every CLI and forwarded to :func:`dartcore.models.hub.load_target`
    (None: its defaults)."""
    p.add_argument(
        "--quantized",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep a GGUF target's Q4_0 / Q4_1 / Q8_0 weights as blocks (default where the "
        "native kernels run on the CPU in float32); --no-quantized: the float32 conversion",
    )
    p.add_argument(
        "--numerics",
        choices=("int8", "exact"),
        help="a GGUF target's block products: int8 (integer kernels, the default where they "
        "run) or exact (each weight formed in float32: Hugging Face generate's tokens)",
    )


def check_target_weights(args) -> tuple[bool, str]:
    """The (quantized, numerics) that ``args`` (--target, --device, --dtype, --quantized,
    --numerics) load the target with, refused before any model loads when they cannot work
    together (a non-GGUF target with --numerics int8, say)."""
    import torch

    from dartcore.models.hub import target_weights

    dtype = getattr(torch, args.dtype) if getattr(args, "dtype", None) else None
    return target_weights(
        args.target,
        device=args.device,
        dtype=dtype,
        quantized=args.quantized,
        numerics=args.numerics,
    )


def check_target(value: str, flag: str = "--target") -> str:
    from dartcore.models.targets import BUILTIN_TARGETS, TARGET_ALIASES

    if value.lower() in BUILTIN_TARGETS or value.lower() in TARGET_ALIASES:
        return value
    p = Path(value).expanduser()
    if not p.exists():
        raise MissingFileError(
            f"{flag} {value!r} is neither a built-in target ({', '.join(sorted(BUILTIN_TARGETS))}) nor an "
            f"existing Hugging Face model directory or .gguf file{closest(value, BUILTIN_TARGETS)}"
        )
    if not ((p / "config.json").is_file() or (p.is_file() and p.suffix == ".gguf")):
        raise UsageError(
            f"{flag} {value}: expected a Hugging Face model directory (with config.json) "
            f"or a .gguf file"
        )
    return value


def check_drafter(value: str, flag: str = "--drafter") -> str:
    from dartcore.drafter import BUILTIN_DRAFTERS, CONFIG_NAME, WEIGHTS_NAME

    if value.lower() in BUILTIN_DRAFTERS:
        return value
    p = Path(value).expanduser()
    if not ((p / CONFIG_NAME).is_file() and (p / WEIGHTS_NAME).is_file()):
        what = (
            "does not exist"
            if not p.exists()
            else f"holds no drafter ({CONFIG_NAME} + {WEIGHTS_NAME})"
        )
        raise MissingFileError(
            f"{flag} {value} {what}: pass a built-in drafter ({', '.join(sorted(BUILTIN_DRAFTERS))}) or the "
            f"drafter/ directory that dart-train writes{closest(value, BUILTIN_DRAFTERS)}"
        )
    return value


def check_paths(flag: str, values: Iterable[str]) -> None:
    for v in values:
        if not Path(v).expanduser().exists():
            raise MissingFileError(f"{flag} {v} does not exist: pass existing files or directories")


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, OSError) and exc.strerror:  # "[Errno 2] msg: 'path'" -> "msg (path)"
        text = exc.strerror
        if exc.filename and str(exc.filename) not in text:
            text += f" ({exc.filename})"
    return " ".join(text.split())


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run ``body``; a user error becomes one line on stderr and exit status 2 (as argparse's
    usage errors), Ctrl-C one line and 130."""
    try:
        return body()
    except UsageError as exc:
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (DartError, FileNotFoundError, ValueError, TypeError) as exc:
        # The library's argument checks raise ValueError/TypeError naming the argument (a
        # temperature out of range, say): a user error here too, not a traceback.
        print(f"{prog}: error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
