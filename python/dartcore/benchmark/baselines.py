"""The Hugging Face baselines a user would otherwise reach for: plain
``generate`` and prompt-lookup decoding (``prompt_lookup_num_tokens``), timed
the same way as our decoder (wall time of the whole call, prefill included)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["BaselineResult", "hf_generate"]


@dataclass
class BaselineResult:
    tokens: list[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


@torch.no_grad()
def hf_generate(
    model,
    tokenizer,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    prompt_lookup: int | None = None,
) -> BaselineResult:
    """One ``model.generate`` call; ``prompt_lookup`` = n-gram draft length for
    Hugging Face's prompt-lookup decoding (None = plain decoding)."""
    ids = torch.tensor([input_ids], dtype=torch.long, device=model.device)
    kwargs: dict = dict(
        max_new_tokens=max_new_tokens,
        attention_mask=torch.ones_like(ids),
        pad_token_id=tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
    )
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if prompt_lookup:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup
    if seed is not None:
        torch.manual_seed(seed)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    seconds = time.perf_counter() - start
    return BaselineResult(out[0, ids.shape[1] :].tolist(), seconds)
