"""The DART drafter: one decoder layer that drafts ``d`` future positions per forward.

Architecture (see docs/architecture.md, "Drafter"):

* taps: the target's ``hidden_states`` at indices ``(2, L//2, L-3)`` (the inputs of those
  decoder layers), concatenated to ``[n, 3H]``;
* ``g = W_f [h_lo; h_mid; h_hi]`` (3H -> H, no bias);
* input row of real position ``i``: ``[RMSNorm(emb(x_{i+1})); RMSNorm(g_i)]`` (2H wide),
  where ``x_{i+1}`` is the token the target already chose after position ``i``;
* one decoder layer of the target's family whose q/k/v projections read the 2H-wide row.
  We follow EAGLE-3: the residual stream of the layer starts at ``g_i`` (un-normalised), so
  ``h = g + Attn(row); h = h + MLP(RMSNorm(h))``, then a final RMSNorm and our own LM head;
* ``d - 1`` learned MASK rows appended at positions ``p+1 .. p+d-1`` (``p`` = last real
  position). MASK ``j`` has a learned "token" vector and a learned "hidden" vector (both H
  wide); its input row is ``[RMSNorm(mask_emb_j); RMSNorm(mask_hidden_j)]`` and its residual
  stream starts at ``mask_hidden_j`` — the same shape of computation as a real row.
* row 0 (the last real row) predicts ``x_{p+2}``; MASK ``j`` predicts ``x_{p+2+j}``.

The target's input embedding module is *shared*: the drafter keeps a plain reference to it
(not a registered submodule), so it is never copied, never saved and never trained.

Because there is a single layer, the key/value of a real row depends only on that row's
input. The drafter's KV cache (:class:`DrafterState`) therefore stores K/V of every accepted
real position, and a draft step only computes queries for the last real row and the MASK
rows.

Optionally the LM head covers a reduced *draft vocabulary* (as EAGLE-3 does): ``draft_to_target``
maps draft ids to target ids (:meth:`DartDrafter.to_target_ids`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dartcore.errors import DartError, DrafterMismatchError, TokenizerError
from dartcore.tokenizers import fingerprint as tokenizer_fingerprint

__all__ = [
    "DrafterConfig",
    "DrafterState",
    "DartDrafter",
    "BUILTIN_DRAFTERS",
    "default_taps",
    "drafter_config",
    "drafter_fingerprint",
    "drafter_path",
]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
ASSETS = Path(__file__).resolve().parent / "assets" / "drafters"
BUILTIN_DRAFTERS = {"smollm2": ASSETS / "smollm2"}
_SUPPORTED_FAMILIES = ("llama", "qwen3", "qwen3_next", "qwen3_5_text")
# Families whose drafter layer is a Qwen3 layer (per-head q/k RMSNorm). A hybrid target
# (qwen3_next, qwen3_5_text: Gated DeltaNet + gated attention) gets a plain Qwen3 layer with
# full rotary: the drafter is its own network, it reads only the target's taps, embedding and
# head.
_QK_NORM_FAMILIES = ("qwen3", "qwen3_next", "qwen3_5_text")
# Families whose final RMSNorm scales by (1 + weight): the drafter's norm copies 1 + weight.
_OFFSET_NORM_FAMILIES = ("qwen3_next", "qwen3_5_text")


def default_taps(num_layers: int) -> tuple[int, int, int]:
    """HF ``hidden_states`` indices (2, L//2, L-3) of an L-layer target."""
    if num_layers < 5:
        raise DartError(
            f"a target needs at least 5 decoder layers for taps (2, L//2, L-3); got {num_layers}"
        )
    return (2, num_layers // 2, num_layers - 3)


def drafter_fingerprint(drafter) -> str:
    """A short hash of a drafter's config and weights (which drafter a DARTree correction
    head was trained on)."""
    h = hashlib.sha256(drafter.config.to_json().encode())
    state = drafter.state_dict()
    for name in ("fc.weight", "lm_head.weight", "mask_hidden"):
        # fp16-rounded, so a checkpoint and its fp16 export have the same fingerprint.
        t = state[name].detach().cpu().to(torch.float16).contiguous()
        h.update(t.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass
class DrafterConfig:
    target_name: str | None
    family: str  # "llama" | "qwen3" | "qwen3_next" | "qwen3_5_text"
    num_target_layers: int
    hidden_size: int
    vocab_size: int  # the target's vocabulary size
    tokenizer_fingerprint: str | None
    taps: tuple[int, int, int]
    d: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_parameters: dict = field(default_factory=dict)
    max_position_embeddings: int = 4096
    attention_bias: bool = False
    mlp_bias: bool = False
    format_version: int = FORMAT_VERSION
    # "dartcore", or "official": a released DART drafter converted at load and saved by
    # save_pretrained (its MASK inputs and LM-head normalisation differ; see
    # dartcore.models.official_drafter), which dartcore.models.hub.load_drafter rebuilds as such.
    variant: str = "dartcore"

    def to_json(self) -> str:
        data = asdict(self)
        data["taps"] = list(self.taps)
        return json.dumps(data, indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> DrafterConfig:
        data = dict(data)
        version = data.get("format_version", 0)
        if version != FORMAT_VERSION:
            raise DartError(
                f"drafter format version {version}, this build reads {FORMAT_VERSION}: retrain with dart-train"
            )
        data["taps"] = tuple(int(t) for t in data["taps"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def from_target_config(
        cls,
        tc,
        *,
        d: int,
        taps,
        draft_vocab_size: int | None,
        target_name: str | None,
        fingerprint: str | None,
    ) -> DrafterConfig:
        family = getattr(tc, "model_type", None)
        if family not in _SUPPORTED_FAMILIES:
            raise DartError(
                f"drafter supports the {_SUPPORTED_FAMILIES} families, target is {family!r}"
            )
        act = getattr(tc, "hidden_act", "silu")
        if act != "silu":
            raise DartError(f"drafter layer uses SwiGLU (silu); target has hidden_act={act!r}")
        L = tc.num_hidden_layers
        taps = tuple(int(t) for t in (taps if taps is not None else default_taps(L)))
        if len(taps) != 3 or not all(0 <= t <= L for t in taps):
            raise DartError(f"taps must be three hidden_states indices in [0, {L}], got {taps}")
        if d < 1:
            raise DartError(f"d must be >= 1, got {d}")
        heads = tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads
        rope = dict(getattr(tc, "rope_parameters", None) or {})
        if not rope:
            rope = {"rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", 10000.0))}
        if family in _OFFSET_NORM_FAMILIES:
            rope.pop("partial_rotary_factor", None)  # the drafter's layer rotates whole heads
        return cls(
            target_name=target_name,
            family=family,
            num_target_layers=L,
            hidden_size=tc.hidden_size,
            vocab_size=tc.vocab_size,
            tokenizer_fingerprint=fingerprint,
            taps=taps,
            d=int(d),
            draft_vocab_size=int(draft_vocab_size or tc.vocab_size),
            num_attention_heads=heads,
            num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=tc.intermediate_size,
            rms_norm_eps=float(tc.rms_norm_eps),
            rope_parameters=rope,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 4096)),
            attention_bias=bool(getattr(tc, "attention_bias", False)),
            mlp_bias=bool(getattr(tc, "mlp_bias", False)),
        )


def drafter_path(path_or_name) -> Path:
    """The directory of a drafter given by built-in name (:data:`BUILTIN_DRAFTERS`) or path;
    ``FileNotFoundError`` saying what to pass when it holds no drafter."""
    key = str(path_or_name)
    path = BUILTIN_DRAFTERS.get(key.lower(), Path(key).expanduser())
    if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
        raise FileNotFoundError(
            f"no drafter at {path} (needs {CONFIG_NAME} and {WEIGHTS_NAME}); built-in names: "
            f"{sorted(BUILTIN_DRAFTERS)}; train one with dart-train"
        )
    return path


def drafter_config(path) -> DrafterConfig:
    """The :class:`DrafterConfig` that :meth:`DartDrafter.save_pretrained` wrote to ``path``."""
    path = Path(path)
    try:
        return DrafterConfig.from_dict(json.loads((path / CONFIG_NAME).read_text()))
    except (KeyError, TypeError, ValueError) as exc:
        raise DartError(f"{path / CONFIG_NAME} is not a valid drafter config: {exc}") from exc


# ---------------------------------------------------------------------------------------
# building blocks (plain torch)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rope: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for the target's rope parameters."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", 10000.0))
    partial = float(rope.get("partial_rotary_factor", 1.0))
    dim = int(head_dim * partial)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "linear":
        return inv / float(rope["factor"]), 1.0
    raise DartError(
        f"rope_type {rope_type!r} is not supported by the drafter (default, linear, llama3)"
    )


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, hd]; cos/sin: [T, hd] (HF 'rotate_half' convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


_FLEX = None


def _compiled_flex():
    """FlexAttention compiled once (eager flex_attention materialises the scores)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


class DrafterLayer(nn.Module):
    """One Llama / Qwen3 decoder layer with 2H-wide q/k/v input (EAGLE-3 style)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(2 * H, self.nh * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(2 * H, self.nkv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(2 * H, self.nkv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.nh * hd, H, bias=cfg.attention_bias)
        self.qk_norm = cfg.family in _QK_NORM_FAMILIES
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(H, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(H, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, H, bias=cfg.mlp_bias)

    def _heads(self, x: torch.Tensor, n: int, norm) -> torch.Tensor:
        x = x.view(*x.shape[:-1], n, self.hd)
        if norm is not None:
            x = norm(x)
        return x.transpose(-2, -3)  # [..., n, T, hd]

    def kv(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (roped) and values of input rows [..., T, 2H] -> [..., nkv, T, hd] each."""
        k = self._heads(self.k_proj(rows), self.nkv, self.k_norm if self.qk_norm else None)
        v = self._heads(self.v_proj(rows), self.nkv, None)
        return apply_rope(k, cos, sin), v

    def q(self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self._heads(self.q_proj(rows), self.nh, self.q_norm if self.qk_norm else None)
        return apply_rope(q, cos, sin)

    def attend(self, q, k, v, mask: torch.Tensor | None, *, flex_block_mask=None) -> torch.Tensor:
        """q [..., nh, Tq, hd], k/v [..., nkv, Tk, hd], boolean mask [..., Tq, Tk] (True = attend)."""
        return self.o_proj(self.heads_attention(q, k, v, mask, flex_block_mask=flex_block_mask))

    def heads_attention(
        self, q, k, v, mask: torch.Tensor | None, *, flex_block_mask=None
    ) -> torch.Tensor:
        """:meth:`attend` before the output projection: [..., Tq, nh * hd]."""
        if flex_block_mask is not None:
            out = _compiled_flex()(
                q, k, v, block_mask=flex_block_mask, enable_gqa=self.nh != self.nkv
            )
        else:
            if self.nh != self.nkv:  # explicit repeat: the CPU SDPA path then needs no GQA support
                rep = self.nh // self.nkv
                k = k.repeat_interleave(rep, dim=-3)
                v = v.repeat_interleave(rep, dim=-3)
            if mask is not None and mask.dim() == q.dim() - 1:
                mask = mask.unsqueeze(-3)  # broadcast over heads
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = out.transpose(-2, -3)
        return out.reshape(*out.shape[:-2], self.nh * self.hd)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterState:
    """The drafter's KV cache for real (accepted) positions of one sequence."""

    def __init__(self, nkv: int, head_dim: int, max_len: int, dtype, device):
        # rows past ``length`` are never read: left as allocated on the CPU (see KVCache)
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = alloc(nkv, max_len, head_dim, dtype=dtype, device=device)
        self.v = alloc(nkv, max_len, head_dim, dtype=dtype, device=device)
        self.length = 0
        self.max_len = max_len

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> DrafterState:
        """An empty state on existing storage ``[nkv, max_len, head_dim]`` (a slot of a
        :class:`~dartcore.models.kv_pool.KVPool`); nothing is allocated."""
        state = cls.__new__(cls)
        state.k, state.v = k, v
        state.length = 0
        state.max_len = int(k.shape[1])
        return state

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise DartError(f"cannot truncate a drafter state of length {self.length} to {length}")
        self.length = length

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[-2]
        if self.length + n > self.max_len:
            raise DartError(
                f"drafter state holds {self.max_len} positions; appending {n} to {self.length} overflows "
                "(create it with a larger max_len)"
            )
        self.k[:, self.length : self.length + n] = k
        self.v[:, self.length : self.length + n] = v
        self.length += n


# ---------------------------------------------------------------------------------------


def _draft_vocab_ids(draft_vocab, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary as a 1-D tensor of distinct target ids in [0, vocab_size)."""
    ids = torch.as_tensor(draft_vocab, dtype=torch.long).flatten()
    if ids.numel() == 0 or ids.min() < 0 or ids.max() >= vocab_size:
        raise DartError(f"draft_vocab must hold target ids in [0, {vocab_size})")
    if torch.unique(ids).numel() != ids.numel():
        raise DartError("draft_vocab has duplicate ids")
    return ids


class DartDrafter(nn.Module):
    VARIANT = "dartcore"  # the config variant this class computes (DrafterConfig.variant)

    def __init__(self, config: DrafterConfig, target_embedding: nn.Module | None = None):
        super().__init__()
        self.config = config
        H, D = config.hidden_size, config.d
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.emb_norm = RMSNorm(H, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.layer = DrafterLayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.mask_emb = nn.Parameter(torch.zeros(max(D - 1, 0), H))
        self.mask_hidden = nn.Parameter(torch.zeros(max(D - 1, 0), H))
        reduced = config.draft_vocab_size != config.vocab_size
        self.register_buffer(
            "draft_to_target",
            torch.arange(config.draft_vocab_size, dtype=torch.long),
            persistent=reduced,
        )
        inv, scale = rope_inv_freq(config.rope_parameters, config.head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.rope_scale = scale
        self._reset_parameters()
        # A plain attribute, not a submodule: shared with the target, never saved or trained.
        self.__dict__["_target_embedding"] = target_embedding

    # -- construction ------------------------------------------------------------------

    def _reset_parameters(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.mask_emb, std=0.02)
        nn.init.normal_(self.mask_hidden, std=0.02)

    @property
    def taps(self) -> tuple[int, int, int]:
        return self.config.taps

    @property
    def d(self) -> int:
        return self.config.d

    @property
    def target_embedding(self) -> nn.Module:
        emb = self.__dict__.get("_target_embedding")
        if emb is None:
            raise DartError(
                "drafter is not bound to a target: use DartDrafter.from_target / from_pretrained"
            )
        return emb

    @classmethod
    def from_target(
        cls,
        target_model,
        *,
        d: int = 8,
        taps=None,
        draft_vocab=None,
        target_name: str | None = None,
        tokenizer=None,
    ) -> DartDrafter:
        """A freshly initialised drafter for ``target_model`` (LM head and final norm copied
        from the target; ``draft_vocab``: optional 1-D sequence of target ids for a reduced
        draft vocabulary)."""
        tc = target_model.config
        ids = None
        if draft_vocab is not None:
            ids = _draft_vocab_ids(draft_vocab, tc.vocab_size)
        name = target_name or getattr(tc, "name_or_path", None) or None
        cfg = DrafterConfig.from_target_config(
            tc,
            d=d,
            taps=taps,
            draft_vocab_size=None if ids is None else ids.numel(),
            target_name=name,
            fingerprint=None if tokenizer is None else tokenizer_fingerprint(tokenizer),
        )
        model = cls(cfg, target_model.get_input_embeddings())
        if ids is not None:
            model.draft_to_target.copy_(ids)
            model.register_buffer("draft_to_target", model.draft_to_target, persistent=True)
        with torch.no_grad():
            head = target_model.get_output_embeddings().weight
            model.lm_head.weight.copy_(head[model.draft_to_target].float())
            final_norm = getattr(getattr(target_model, "model", None), "norm", None)
            if final_norm is not None and final_norm.weight.shape == model.norm.weight.shape:
                weight = final_norm.weight.float()
                model.norm.weight.copy_(
                    weight + 1 if cfg.family in _OFFSET_NORM_FAMILIES else weight
                )
        return model

    def with_draft_vocab(self, draft_vocab, target_model) -> DartDrafter:
        """A copy of this drafter with another draft vocabulary (1-D target ids; all of them
        for the full vocabulary). Every weight but the LM head is kept; the head row of an id
        this drafter already had is its own, a new id's row is the target's LM-head row (how
        :meth:`from_target` starts every row). For fine-tuning on text whose tokens the old
        vocabulary misses (``dart-train --init X --draft-vocab N``)."""
        import dataclasses

        if self.config.variant != "dartcore":
            raise DartError(
                f"with_draft_vocab re-sizes dartcore drafters, not {self.config.variant!r} ones"
            )
        V = self.config.vocab_size
        ids = _draft_vocab_ids(draft_vocab, V)
        head = target_model.get_output_embeddings().weight
        if head.shape[0] != V:
            raise DartError(
                f"target's LM head has {head.shape[0]} rows, the drafter's vocabulary is {V}"
            )
        if ids.numel() == V:
            ids = torch.arange(V)
        model = type(self)(
            dataclasses.replace(self.config, draft_vocab_size=ids.numel()), self.target_embedding
        )
        keep = {
            k: v
            for k, v in self.state_dict().items()
            if k not in ("lm_head.weight", "draft_to_target")
        }
        missing, unexpected = model.load_state_dict(keep, strict=False)
        if unexpected or set(missing) - {"lm_head.weight", "draft_to_target"}:
            raise DartError(
                f"with_draft_vocab: weights do not carry over (missing {missing}, unexpected {unexpected})"
            )
        if ids.numel() != V:  # the constructor made the buffer persistent for a reduced vocabulary
            model.draft_to_target.copy_(ids)
        old = {int(t): i for i, t in enumerate(self.draft_to_target.tolist())}
        pairs = [(j, old[t]) for j, t in enumerate(ids.tolist()) if t in old]
        with torch.no_grad():
            rows = head.detach()[ids].to(model.lm_head.weight.dtype).clone()
            if pairs:
                new_rows, old_rows = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs))
                rows[new_rows] = self.lm_head.weight.detach()[old_rows].to(rows.dtype)
            model.lm_head.weight.copy_(rows)
        return model.to(self.fc.weight.device).train(self.training)

    def save_pretrained(self, path, *, dtype: torch.dtype | None = None) -> None:
        """safetensors + config.json; the target's embedding table is not saved."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if dtype is not None:
            state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
        tmp = path / (WEIGHTS_NAME + ".tmp")
        save_file(
            state, str(tmp), metadata={"format": "pt", "dartcore_drafter": str(FORMAT_VERSION)}
        )
        os.replace(tmp, path / WEIGHTS_NAME)
        (path / CONFIG_NAME).write_text(self.config.to_json() + "\n")

    @classmethod
    def from_pretrained(cls, path_or_name, target_model, *, tokenizer=None) -> DartDrafter:
        """The drafter that :meth:`save_pretrained` wrote (a directory or built-in name), of
        this class's variant. :func:`dartcore.models.hub.load_drafter` loads any drafter:
        either variant, or a released DART checkpoint."""
        from safetensors.torch import load_file

        path = drafter_path(path_or_name)
        cfg = drafter_config(path)
        _check_target(cfg, target_model, tokenizer, path)
        if cfg.variant != cls.VARIANT:
            raise DartError(
                f"{path} holds a {cfg.variant!r} drafter, not a {cls.VARIANT!r} one: load it with "
                "dartcore.models.hub.load_drafter"
            )
        model = cls(cfg, target_model.get_input_embeddings())
        state = load_file(str(path / WEIGHTS_NAME))
        if "draft_to_target" in state:
            model.register_buffer("draft_to_target", model.draft_to_target, persistent=True)
        missing, unexpected = model.load_state_dict(
            {k: v.float() if v.is_floating_point() else v for k, v in state.items()}, strict=False
        )
        if missing or unexpected:
            raise DartError(
                f"drafter weights at {path} do not match its config: missing {missing}, unexpected {unexpected}"
            )
        return model.eval()

    # -- shared pieces -----------------------------------------------------------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # frozen, shared with the target
            return self.target_embedding(ids).to(self.fc.weight.dtype)

    def real_rows(self, taps: torch.Tensor, next_tokens: torch.Tensor):
        """Input rows [.., 2H] and residual streams [.., H] of real positions."""
        g = self.fc(taps.to(self.fc.weight.dtype))
        rows = torch.cat((self.emb_norm(self.embed(next_tokens)), self.hidden_norm(g)), dim=-1)
        return rows, g

    def mask_rows(self):
        rows = torch.cat((self.emb_norm(self.mask_emb), self.hidden_norm(self.mask_hidden)), dim=-1)
        return rows, self.mask_hidden

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    # -- inference ---------------------------------------------------------------------

    def new_state(self, max_len: int) -> DrafterState:
        p = self.fc.weight
        return DrafterState(
            self.config.num_key_value_heads, self.config.head_dim, max_len, p.dtype, p.device
        )

    def check_draft(self, taps: torch.Tensor, next_tokens: torch.Tensor, rows: int | None) -> int:
        """The arguments of :meth:`draft` checked; the number of rows to draft."""
        nq = self.d if rows is None else int(rows)
        if not 1 <= nq <= self.d:
            raise DartError(f"rows must be in [1, {self.d}], got {rows}")
        if taps.dim() != 2 or taps.shape[-1] != 3 * self.config.hidden_size:
            raise DartError(
                f"taps must be [n, {3 * self.config.hidden_size}], got {tuple(taps.shape)}"
            )
        n = taps.shape[0]
        if next_tokens.shape != (n,):
            raise DartError(f"next_tokens must be [{n}], got {tuple(next_tokens.shape)}")
        if n == 0:
            raise DartError("draft needs at least one new real position (the bonus token's row)")
        return nq

    @torch.no_grad()
    def absorb(
        self, states: list[DrafterState], taps: list[torch.Tensor], next_tokens: list[torch.Tensor]
    ) -> None:
        """Append real rows to each state without drafting: ``taps[i]`` / ``next_tokens[i]``
        as :meth:`draft` takes them, their keys and values only (a real row's key and value
        depend on that row alone). One pass over every sequence's rows: a catch-up on many
        positions costs the input projections, not a draft, and leaves the draft itself the
        few rows of a steady one."""
        if not states:
            return
        dev = self.fc.weight.device
        rows, _ = self.real_rows(torch.cat(taps).to(dev), torch.cat(next_tokens).to(dev))
        ns = [int(t.shape[0]) for t in taps]
        pos = torch.cat(
            [torch.arange(s.length, s.length + n, device=dev) for s, n in zip(states, ns)]
        )
        cos, sin = self.rope(pos)
        k, v = self.layer.kv(rows, cos, sin)
        off = 0
        for state, n in zip(states, ns):
            state.append(k[:, off : off + n], v[:, off : off + n])
            off += n

    @torch.no_grad()
    def draft(
        self,
        state: DrafterState,
        taps: torch.Tensor,
        next_tokens: torch.Tensor,
        *,
        return_hidden: bool = False,
        rows: int | None = None,
    ):
        """Append ``n`` real rows to ``state`` and draft ``d`` positions after the last one.

        taps: [n, 3H]; next_tokens: [n] (x_{i+1} of each new position i). Returns logits
        [d, V_draft] (and the final hidden states [d, H] with ``return_hidden``).
        ``rows`` (1..d, default d): draft only the first ``rows`` positions. Row j attends
        to the real positions and MASK 1..j only, so the rows computed are exactly those of
        the full draft (a tree of B nodes is never deeper than B: the decoder asks for
        ``min(d, B)`` rows and saves the rest of the work). On a CPU with dartcore's native
        kernels the decoder drafts through :class:`dartcore.kernels.native_draft.NativeDraft`
        instead (same drafts up to float32 rounding)."""
        nq = self.check_draft(taps, next_tokens, rows)
        dev = self.fc.weight.device
        n = taps.shape[0]
        start = state.length
        rows, g = self.real_rows(taps.to(dev), next_tokens.to(dev))
        pos = torch.arange(start, start + n, device=dev)
        cos, sin = self.rope(pos)
        k, v = self.layer.kv(rows, cos, sin)
        state.append(k, v)
        last_row, last_g = rows[-1:], g[-1:]
        p = state.length - 1
        m_rows, m_res = self.mask_rows()
        m_rows, m_res = m_rows[: nq - 1], m_res[: nq - 1]
        q_rows = torch.cat((last_row, m_rows), dim=0)  # [nq, 2H]
        resid = torch.cat((last_g, m_res), dim=0)
        qpos = torch.arange(p, p + nq, device=dev)
        cos, sin = self.rope(qpos)
        q = self.layer.q(q_rows, cos, sin)  # [nh, nq, hd]
        mk, mv = self.layer.kv(m_rows, cos[1:], sin[1:])
        k = torch.cat((state.k[:, : state.length], mk), dim=1)
        v = torch.cat((state.v[:, : state.length], mv), dim=1)
        # row 0 sees every real position; MASK j additionally sees MASK 1..j
        mask = torch.ones(nq, state.length + nq - 1, dtype=torch.bool, device=dev)
        mask[:, state.length :] = torch.tril(
            torch.ones(nq, nq - 1, dtype=torch.bool, device=dev), diagonal=-1
        )
        h = resid + self.layer.attend(q, k, v, mask)
        h = self.layer.mlp_block(h)
        logits = self.head(h)
        return (logits, h) if return_hidden else logits

    @torch.no_grad()
    def draft_batch(
        self,
        states: list[DrafterState],
        taps: list[torch.Tensor],
        next_tokens: list[torch.Tensor],
        rows: list[int],
        *,
        return_hidden: bool = False,
    ) -> list:
        """:meth:`draft` for several sequences in one pass: sequence i appends
        ``taps[i]`` / ``next_tokens[i]`` to ``states[i]`` and drafts ``rows[i]`` positions.
        The projections, MLP and LM head run once over every sequence's rows; the attention
        runs per sequence over its own state. Returns one :meth:`draft` result per sequence."""
        nqs = [self.check_draft(t, x, r) for t, x, r in zip(taps, next_tokens, rows)]
        dev = self.fc.weight.device
        ns = [int(t.shape[0]) for t in taps]
        real, g = self.real_rows(torch.cat(taps).to(dev), torch.cat(next_tokens).to(dev))
        pos = torch.cat(
            [torch.arange(s.length, s.length + n, device=dev) for s, n in zip(states, ns)]
        )
        cos, sin = self.rope(pos)
        k, v = self.layer.kv(real, cos, sin)
        m_rows, m_res = self.mask_rows()
        q_rows, resid, qpos = [], [], []
        off = 0
        for state, n, nq in zip(states, ns, nqs):
            state.append(k[:, off : off + n], v[:, off : off + n])
            off += n
            q_rows += [real[off - 1 : off], m_rows[: nq - 1]]
            resid += [g[off - 1 : off], m_res[: nq - 1]]
            qpos.append(torch.arange(state.length - 1, state.length - 1 + nq, device=dev))
        q_rows, resid = torch.cat(q_rows), torch.cat(resid)
        cos, sin = self.rope(torch.cat(qpos))
        q = self.layer.q(q_rows, cos, sin)  # [nh, M, hd]
        mk, mv = self.layer.kv(q_rows, cos, sin)  # the MASK rows' keys (each block's rows 1..nq-1)
        outs = []
        off = 0
        for state, nq in zip(states, nqs):
            kk = torch.cat((state.k[:, : state.length], mk[:, off + 1 : off + nq]), dim=1)
            vv = torch.cat((state.v[:, : state.length], mv[:, off + 1 : off + nq]), dim=1)
            mask = torch.ones(nq, state.length + nq - 1, dtype=torch.bool, device=dev)
            mask[:, state.length :] = torch.tril(
                torch.ones(nq, nq - 1, dtype=torch.bool, device=dev), diagonal=-1
            )
            outs.append(self.layer.heads_attention(q[:, off : off + nq], kk, vv, mask))
            off += nq
        h = resid + self.layer.o_proj(torch.cat(outs))
        h = self.layer.mlp_block(h)
        logits = self.head(h)
        out = []
        off = 0
        for nq in nqs:
            out.append(
                (logits[off : off + nq], h[off : off + nq])
                if return_hidden
                else logits[off : off + nq]
            )
            off += nq
        return out


def _check_target(cfg: DrafterConfig, target_model, tokenizer, path) -> None:
    tc = target_model.config
    problems = []
    fam = getattr(tc, "model_type", None)
    if fam != cfg.family:
        problems.append(f"family {cfg.family!r} vs target {fam!r}")
    for what, mine, theirs in (
        ("layer count", cfg.num_target_layers, tc.num_hidden_layers),
        ("hidden size", cfg.hidden_size, tc.hidden_size),
        ("vocabulary size", cfg.vocab_size, tc.vocab_size),
    ):
        if mine != theirs:
            problems.append(f"{what} {mine} vs target {theirs}")
    recorded = cfg.tokenizer_fingerprint
    if tokenizer is not None and recorded is not None:
        try:  # in the form the drafter recorded (dartcore.tokenizers.fingerprint)
            fp = tokenizer_fingerprint(tokenizer, like=recorded)
        except TokenizerError:  # a tokenizer dartcore cannot fingerprint: the caller vouches
            fp = recorded
        if fp != recorded:
            problems.append(f"tokenizer fingerprint {recorded} vs target {fp}")
    if problems:
        raise DrafterMismatchError(
            f"drafter at {path} was trained for target {cfg.target_name!r} and does not fit this target: "
            + "; ".join(problems)
            + ". Train a drafter for this target with dart-train."
        )
