"""Whether the parts of a decoder fit together: a drafter trained for this target, an n-gram
index built with the target's tokenizer, and the target's EOS ids.

:class:`~dartcore.decoder.DartDecoder` runs these checks once, when it is made.
"""

from __future__ import annotations

import warnings

from dartcore.errors import DrafterMismatchError, TokenizerError, TokenizerMismatchError
from dartcore.models.transformer import TargetModel
from dartcore.tokenizers import fingerprint

__all__ = ["eos_ids", "check_drafter", "check_index", "check_needs", "tokenizer_name"]


def eos_ids(model, tokenizer) -> tuple[int, ...]:
    """EOS ids as HF ``generate`` sees them: the generation config's, else the
    model config's, else the tokenizer's."""
    for source in (
        getattr(model, "generation_config", None),
        getattr(model, "config", None),
        tokenizer,
    ):
        value = getattr(source, "eos_token_id", None)
        if value is not None:
            return tuple(
                sorted({int(v) for v in (value if isinstance(value, (list, tuple)) else [value])})
            )
    return ()


def check_needs(tree: str, builder, drafter, index) -> None:
    """Refuse a tree builder without the drafter or the index it needs, saying what to pass."""
    if builder.needs_drafter and drafter is None:
        raise ValueError(
            f"tree builder {tree!r} needs a drafter: pass drafter= (--drafter for dart-generate), "
            "or use tree='ngram-only' / 'ar'"
        )
    if builder.needs_index and index is None:
        other = "tree='dart-no-ngram'" if builder.needs_drafter else "tree='ar'"
        raise ValueError(
            f"tree builder {tree!r} needs an n-gram index built with the target's tokenizer: pass "
            "index= (--index for dart-generate; build one with ngram-build --tokenizer ...), "
            f"or use {other}"
        )


def check_drafter(drafter, target: TargetModel, tokenizer) -> None:
    """Refuse a drafter trained for another target (family, layer count,
    hidden size, vocabulary, tokenizer fingerprint)."""
    cfg = getattr(drafter, "config", None)
    hf = target.config
    problems = []
    for what, mine, theirs in (
        ("family", getattr(cfg, "family", None), target.family),
        ("layer count", getattr(cfg, "num_target_layers", None), target.num_layers),
        ("hidden size", getattr(cfg, "hidden_size", None), target.hidden_size),
        ("vocabulary size", getattr(cfg, "vocab_size", None), getattr(hf, "vocab_size", None)),
    ):
        if mine is not None and theirs is not None and mine != theirs:
            problems.append(f"{what} {mine!r} vs target {theirs!r}")
    taps = tuple(int(t) for t in getattr(drafter, "taps", ()))
    if any(not 0 <= t <= target.num_layers for t in taps):
        problems.append(f"taps {taps} outside a {target.num_layers}-layer target")
    recorded = getattr(cfg, "tokenizer_fingerprint", None)
    if recorded is not None and tokenizer is not None:
        try:  # in the form the drafter recorded
            mine = fingerprint(tokenizer, like=recorded)
        except Exception:  # noqa: BLE001 - a tokenizer we cannot fingerprint is not compared
            mine = recorded
        if mine != recorded:
            problems.append(f"tokenizer fingerprint {recorded} vs target {mine}")
    if problems:
        name = getattr(cfg, "target_name", None)
        raise DrafterMismatchError(
            f"the drafter was trained for target {name!r} and does not fit this one: "
            + "; ".join(problems)
            + ". Train a drafter for this target with dart-train."
        )


def tokenizer_name(tokenizer) -> str:
    name = getattr(tokenizer, "name_or_path", None) or getattr(tokenizer, "name", None)
    return repr(name) if name else type(tokenizer).__name__


def check_index(index, tokenizer, target: TargetModel) -> None:
    """Refuse an index built with another tokenizer (by its recorded fingerprint), or one
    whose vocabulary the target cannot produce; warn when it records no tokenizer."""
    meta = getattr(index, "metadata", None) or {}
    info = (meta.get("tokenizer") or {}) if isinstance(meta, dict) else {}
    recorded = info.get("fingerprint") if isinstance(info, dict) else None
    vocab = getattr(index, "vocab_size", None)
    if vocab is not None and int(vocab) > target.vocab_size:
        raise TokenizerMismatchError(
            f"the n-gram index has a vocabulary of {int(vocab)} tokens but the target only {target.vocab_size}: it "
            "was built with another tokenizer; rebuild it with the target's (ngram-build --tokenizer ...)"
        )
    if recorded is None:
        checked = (
            f"; only its vocabulary size was checked ({int(vocab)} <= {target.vocab_size})"
            if vocab is not None
            else ""
        )
        warnings.warn(
            "the n-gram index records no tokenizer, so dartcore cannot check that it was built with the "
            f"target's tokenizer ({tokenizer_name(tokenizer)}){checked}. Build indexes with ngram-build "
            "--tokenizer ...",
            stacklevel=3,
        )
        return
    try:
        mine = fingerprint(tokenizer, like=recorded)
    except TokenizerError:
        return  # a custom tokenizer dartcore cannot fingerprint: the caller vouches for it
    if recorded != mine:
        name = info.get("name") or "an unnamed tokenizer"
        raise TokenizerMismatchError(
            f"the n-gram index was built with tokenizer {name!r} (fingerprint {recorded}), but the target's "
            f"tokenizer is {tokenizer_name(tokenizer)} (fingerprint {mine}): rebuild the index with the target's "
            "tokenizer (ngram-build --tokenizer ...)"
        )
