"""The DART paper's released drafters (``fvliang/qwen{1.7b,4b,8b,14b,32b}-dart``), loaded into
dartcore's drafter.

A released checkpoint is a ``config.json`` (a LlamaConfig plus ``draft_length``,
``draft_vocab_size``, ``target_hidden_size``) and a ``model.safetensors`` with ``fc``,
``midlayer.*``, ``norm``, ``lm_head``, ``t2d`` and ``d2t``; it holds no embedding (the
official loader takes the target's, as dartcore does).

We convert at load into a :class:`~dartcore.drafter.DartDrafter` rather than keep a second
drafter class: the official layer is dartcore's layer (same 2H-wide q/k/v input, same residual
from ``fc``'s output, same causal MASK block), so the conversion is a renaming of weights plus
three differences, and everything built on the drafter (its KV state, the native CPU draft,
the decoder, DARTree's correction head) then serves the released drafters unchanged. The
differences, each handled by :class:`OfficialDartDrafter`:

* one shared MASK vector ``mask_rep`` of width 2H is the layer input of every MASK position,
  fed *un-normalised*, and its first H values start that position's residual stream (dartcore
  feeds ``[RMSNorm(mask_emb_j); RMSNorm(mask_hidden_j)]``): ``mask_emb`` holds the raw 2H rows
  (``mask_rep`` broadcast to the ``draft_length`` MASK positions) and ``mask_rows`` returns
  them as they are; ``mask_hidden`` holds ``mask_rep[:H]``;
* the official draft step normalises twice before the LM head (its forward ends with ``norm``
  and ``compute_logits`` applies ``norm`` again): a forward pre-hook on ``lm_head`` applies the
  second ``norm``, so the head stays an ``nn.Linear`` (the native kernel and the state-dict key
  ``lm_head.weight`` still apply);
* ``d2t`` stores ``target - draft`` offsets: ``draft_to_target = arange + d2t``.

``draft_length`` MASK rows plus the last real row give ``d = draft_length + 1`` rows.

``save_pretrained`` writes the converted drafter in dartcore's format, its config marked
``variant = "official"``: :func:`dartcore.models.hub.load_drafter` (which loads a released
checkpoint too) reloads it as an :class:`OfficialDartDrafter` with the same logits
(``tests/test_official_drafter.py``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from dartcore.drafter import CONFIG_NAME, WEIGHTS_NAME, DartDrafter, DrafterConfig, default_taps
from dartcore.errors import DartError, DrafterMismatchError

__all__ = ["OfficialDartDrafter", "is_official_checkpoint", "load_official_drafter"]

_OFFICIAL_KEYS = ("draft_length", "draft_vocab_size", "target_hidden_size")

# official name -> dartcore name (the rest -- fc, norm, lm_head -- keep their names)
_RENAMES = {
    "midlayer.input_layernorm.weight": "emb_norm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight": "layer.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "layer.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "layer.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "layer.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "layer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "layer.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "layer.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "layer.down_proj.weight",
    "fc.weight": "fc.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def is_official_checkpoint(path) -> bool:
    """Whether ``path`` holds a drafter in the released DART format (its config names
    ``draft_length``, ``draft_vocab_size`` and ``target_hidden_size``)."""
    config = Path(path) / CONFIG_NAME
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(k in data for k in _OFFICIAL_KEYS)


class OfficialDartDrafter(DartDrafter):
    """A :class:`DartDrafter` computing the released DART drafter (see the module doc)."""

    VARIANT = "official"

    def __init__(self, config: DrafterConfig, target_embedding: nn.Module | None = None):
        super().__init__(config, target_embedding)
        H, masks = config.hidden_size, max(config.d - 1, 0)
        # The MASK rows' layer inputs, 2H wide and used as they are (see mask_rows); kept under
        # the name mask_emb so the native draft's cache of the MASK inputs tracks them.
        self.mask_emb = nn.Parameter(torch.zeros(masks, 2 * H))
        self.lm_head.register_forward_pre_hook(self._renorm)
        # The released layer is a Llama layer for every target: no q/k norm even where the
        # config names the target's family (Qwen3), as the decoder's drafter check wants.
        self.layer.qk_norm = False
        for name in ("q_norm", "k_norm"):
            if hasattr(self.layer, name):
                delattr(self.layer, name)

    def _renorm(self, _module, args):
        return (self.norm(args[0]),)

    def mask_rows(self):
        return self.mask_emb, self.mask_hidden


def _config(raw: dict, target_model, path: Path) -> DrafterConfig:
    tc = target_model.config
    H = int(raw["hidden_size"])
    problems = []
    for what, mine, theirs in (
        ("hidden size", int(raw["target_hidden_size"]), tc.hidden_size),
        ("vocabulary size", int(raw["vocab_size"]), tc.vocab_size),
    ):
        if mine != theirs:
            problems.append(f"{what} {mine} vs target {theirs}")
    if problems:
        raise DrafterMismatchError(
            f"the released DART drafter at {path} was made for another target: "
            + "; ".join(problems)
            + ". Use the drafter released for this target (fvliang/qwen<size>-dart) or train one with dart-train."
        )
    if H != tc.hidden_size:
        raise DartError(
            f"the drafter at {path} has hidden size {H}, its target {tc.hidden_size}: dartcore's drafter "
            "shares the target's embedding and needs them equal"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise DartError(
            f"the drafter at {path} has hidden_act={raw['hidden_act']!r}; dartcore's layer is SwiGLU (silu)"
        )
    heads = int(raw["num_attention_heads"])
    rope = dict(raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope["rope_theta"] = float(raw.get("rope_theta", 10000.0))
    L = tc.num_hidden_layers
    return DrafterConfig(
        target_name=getattr(tc, "name_or_path", None) or None,
        # the target's family, which the decoder checks; the layer itself is a Llama layer
        # whatever the target (OfficialDartDrafter drops the q/k norm a Qwen3 layer has)
        family=getattr(tc, "model_type", None)
        if getattr(tc, "model_type", None) in ("llama", "qwen3")
        else "llama",
        num_target_layers=L,
        hidden_size=H,
        vocab_size=int(raw["vocab_size"]),
        tokenizer_fingerprint=None,
        taps=default_taps(L),
        d=int(raw["draft_length"]) + 1,
        draft_vocab_size=int(raw["draft_vocab_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or H // heads),
        intermediate_size=int(raw["intermediate_size"]),
        rms_norm_eps=float(raw["rms_norm_eps"]),
        rope_parameters=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        variant="official",
    )


def load_official_drafter(path, target_model) -> OfficialDartDrafter:
    """The released drafter at ``path`` (config.json + model.safetensors) for ``target_model``,
    converted (see the module doc). Raises :class:`DrafterMismatchError` when the checkpoint
    was made for a target of another hidden size or vocabulary."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        raw = json.loads((path / CONFIG_NAME).read_text())
        cfg = _config(raw, target_model, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise DartError(
            f"{path / CONFIG_NAME} is not a valid released DART drafter config: {exc}"
        ) from exc
    state = load_file(str(path / WEIGHTS_NAME))
    missing = [k for k in (*_RENAMES, "midlayer.mask_rep", "d2t") if k not in state]
    if missing:
        raise DartError(
            f"{path / WEIGHTS_NAME} lacks {missing}: not a released DART drafter checkpoint"
        )
    H, masks = cfg.hidden_size, cfg.d - 1
    mask_rep = state["midlayer.mask_rep"].float()
    d2t = state["d2t"].long()
    if mask_rep.shape != (2 * H,) or d2t.shape != (cfg.draft_vocab_size,):
        raise DartError(
            f"{path / WEIGHTS_NAME}: mask_rep {tuple(mask_rep.shape)} (expected ({2 * H},)), "
            f"d2t {tuple(d2t.shape)} (expected ({cfg.draft_vocab_size},))"
        )
    draft_to_target = torch.arange(cfg.draft_vocab_size) + d2t
    if draft_to_target.min() < 0 or draft_to_target.max() >= cfg.vocab_size:
        raise DartError(
            f"{path / WEIGHTS_NAME}: d2t maps draft ids outside the target vocabulary [0, {cfg.vocab_size})"
        )
    ours = {new: state[old].float() for old, new in _RENAMES.items()}
    ours["mask_emb"] = mask_rep.expand(masks, 2 * H).clone()
    ours["mask_hidden"] = mask_rep[:H].expand(masks, H).clone()
    ours["draft_to_target"] = draft_to_target
    model = OfficialDartDrafter(cfg, target_model.get_input_embeddings())
    model.register_buffer("draft_to_target", model.draft_to_target, persistent=True)
    try:
        missing, unexpected = model.load_state_dict(ours, strict=False)
    except RuntimeError as exc:  # a tensor of the wrong shape
        raise DartError(f"drafter weights at {path} do not match its config: {exc}") from exc
    if missing or unexpected:
        raise DartError(
            f"drafter weights at {path} do not match its config: missing {missing}, unexpected {unexpected}"
        )
    return model.eval()
