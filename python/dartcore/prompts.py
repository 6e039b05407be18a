"""Requests in and text out: the one input processor and the one output processor.

Every entry point -- :meth:`DartDecoder.generate` / ``stream``, the batched
:class:`~dartcore.engine.Engine` and the dart-serve worker -- turns a prompt into
token ids with :func:`prompt_ids` and turns committed tokens back into text with
:func:`decode` / :class:`TextStream`, and checks stop strings with
:func:`stop_hit` / :func:`cut_at_stop`. The tokenizer is a Hugging Face one
(``__call__``, ``decode``, ``apply_chat_template``).

A prompt is a string (tokenised), a list of chat messages ``[{"role": ...,
"content": ...}]`` (rendered with the chat template, generation prompt added), or
one flat sequence of integer token ids (a list / tuple of ints, or a 1-D integer
tensor / array; ``[1, n]``, a batch of one, too).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dartcore.sampling import is_integer

__all__ = [
    "prompt_ids",
    "prompt_kind",
    "text_ids",
    "chat_ids",
    "check_ids",
    "decode",
    "stop_hit",
    "cut_at_stop",
    "stop_overlap",
    "TextStream",
]

# A byte-level tokenizer decodes an incomplete multi-byte character as U+FFFD.
REPLACEMENT = "\ufffd"


def prompt_kind(prompt) -> str:
    """What kind of prompt ``prompt`` is: ``"strings"``, ``"chat messages"`` or ``"token ids"``."""
    if isinstance(prompt, str):
        return "strings"
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return "chat messages"
    return "token ids"


def _flat(ids) -> list:
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    if len(ids) and isinstance(ids[0], list):  # tokenizers may return [[...]]
        ids = ids[0]
    return list(ids)


def text_ids(tokenizer, text: str) -> list[int]:
    """``text`` tokenised as the model reads it (special tokens the tokenizer adds included)."""
    return [int(t) for t in _flat(tokenizer(text))]


def chat_ids(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Chat messages rendered by the tokenizer's chat template, with the generation prompt."""
    if not all(isinstance(m, dict) for m in messages):
        raise TypeError("prompt: chat messages must all be dicts {'role': ..., 'content': ...}")
    rendered = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=True, tokenize=True
    )
    return [int(t) for t in _flat(rendered)]


def check_ids(ids: list, vocab_size: int, what: str = "prompt") -> list[int]:
    """``ids`` as ints, each in ``[0, vocab_size)``; an empty list is a ValueError."""
    if len(ids) == 0:
        raise ValueError(f"empty prompt: {what} has no tokens (give at least one)")
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt: token id {bad[0]} is outside the target's vocabulary [0, {vocab_size})"
        )
    return ids


def prompt_ids(tokenizer, prompt, vocab_size: int) -> list[int]:
    """The prompt as token ids (see the module docs). Anything else is a TypeError or
    ValueError naming ``prompt``."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt: give at least one token of text")
        return check_ids(text_ids(tokenizer, prompt), vocab_size, "the tokenised prompt")
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        return check_ids(chat_ids(tokenizer, prompt), vocab_size, "the rendered chat prompt")
    # torch and numpy are not imported here (the server's workers read prompts without them):
    # a tensor or an array exists only where its library is loaded already.
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    is_tensor = torch is not None and isinstance(prompt, torch.Tensor)
    if is_tensor or (np is not None and isinstance(prompt, np.ndarray)):
        integer = (
            (
                not prompt.dtype.is_floating_point
                and not prompt.dtype.is_complex
                and prompt.dtype != torch.bool
            )
            if is_tensor
            else prompt.dtype.kind in "iu"
        )
        if not integer:
            raise TypeError(
                f"prompt must hold integer token ids, got a {type(prompt).__name__} of dtype "
                f"{prompt.dtype}"
            )
        shape = tuple(prompt.shape)
        if len(shape) == 2 and shape[0] == 1:
            prompt = prompt[0]
        elif len(shape) != 1:
            raise ValueError(
                f"prompt must be 1-D token ids (or [1, n]): DartDecoder decodes one sequence at a "
                f"time (batch size 1), got shape {shape}"
            )
        ids = prompt.detach().cpu().tolist() if is_tensor else prompt.tolist()
        return check_ids(ids, vocab_size)
    if isinstance(prompt, (list, tuple)):
        for i, t in enumerate(prompt):
            if not is_integer(t):
                raise TypeError(
                    f"prompt must be one flat sequence of integer token ids (or a string, or chat "
                    f"messages); prompt[{i}] is {t!r} ({type(t).__name__})"
                )
        return check_ids([int(t) for t in prompt], vocab_size)
    raise TypeError(
        f"prompt must be a string, token ids or chat messages, not {type(prompt).__name__}"
    )


def decode(tokenizer, tokens: Sequence[int], skip_special: bool = True) -> str:
    """The text of ``tokens`` (special tokens skipped unless ``skip_special`` is False)."""
    if not tokens:
        return ""
    return tokenizer.decode(list(tokens), skip_special_tokens=skip_special)


def stop_hit(tokenizer, generated: Sequence[int], stops: Sequence[str]) -> bool:
    """Whether the text of ``generated`` (special tokens included) contains a stop string."""
    if not stops:
        return False
    text = decode(tokenizer, generated, skip_special=False)
    return any(s in text for s in stops)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """``text`` ending before the first stop string it contains (each checked in turn)."""
    for stop in stops:
        cut = text.find(stop)
        if cut >= 0:
            text = text[:cut]
    return text


def stop_overlap(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of ``text`` that begins a stop string: held back from a
    stream until the next tokens show whether the stop string completes (streamed text
    cannot be taken back)."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best


class TextStream:
    """Incremental text of a growing output: :meth:`update` returns the text the newest
    tokens add, holding back an incomplete multi-byte character and, with ``stops``, any
    end of the text that may begin a stop string; :meth:`finish` returns the rest of the
    final text. A decoding that rewrites text already shown adds nothing until it agrees
    again (shown text is never repeated)."""

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.shown = ""

    def update(self, tokens: Sequence[int]) -> str:
        text = decode(self.tokenizer, tokens)
        visible = text[:-1] if text.endswith(REPLACEMENT) else text
        if self.stops:
            visible = visible[: len(visible) - stop_overlap(visible, self.stops)]
        return self._advance(visible)

    def finish(self, text: str) -> str:
        return self._advance(text)

    def _advance(self, visible: str) -> str:
        if not visible.startswith(self.shown):
            return ""
        delta = visible[len(self.shown) :]
        self.shown = visible
        return delta
