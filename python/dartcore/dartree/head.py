"""The DARTree correction head: a small Markov head that re-scores the drafter's top-K
candidates of one depth given the parent token on the path.

The drafter emits all ``d`` rows of logits in one forward, so row ``t`` cannot know which
token a tree branch put at depth ``t``. The head restores that one step of dependence:

    x      = [RMSNorm(H_t); RMSNorm(emb(parent))]                 (H + E)
    u      = W_down · silu(W_up · x)                               (E, W_up: H+E -> r)
    ℓ(c)   = a · z_t(c) + u · emb(c)           for c in top-K(z_t)
    ln q̃_t(· | H_t, parent) = log_softmax over the K candidates

``H_t`` is the drafter's hidden state of row ``t``, ``z_t`` its base logits, ``emb`` the
target's (frozen, shared) input embedding. ``W_down`` starts at zero and ``a`` at one, so
an untrained head is exactly the drafter's marginal renormalised inside its top-K; training
learns a residual on top of it. The head is Markov (first order): the only path state it
carries is the parent token, which is what makes the depth-wise batched construction exact
(see :mod:`dartcore.dartree.supertree`).

Size for SmolLM2-135M (H = E = 576) at the default rank r = 256:
(1152·256 + 256·576) + 1152 (norm gains) + 1 = 443,521 parameters, 1.77 MB in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dartcore.errors import DartError, DrafterMismatchError

__all__ = ["CorrectionHead", "ASSET_DIR", "resolve_head_path"]

ASSET_DIR = Path(__file__).resolve().parents[1] / "assets" / "correction"
_WEIGHTS = "model.safetensors"
_CONFIG = "config.json"
_FORMAT = "dartcore-correction-head"
_FORMAT_VERSION = 1


class CorrectionHead(nn.Module):
    """Markov correction head ``(H_t, emb(parent)) -> log q̃ over K candidates``.

    hidden_size: width of the drafter's hidden state H_t; embed_dim: width of the target's
    token embedding; rank: bottleneck width r. ``meta`` is free-form provenance saved with
    the weights (target name, drafter fingerprint, training set-up).
    """

    def __init__(
        self,
        hidden_size: int,
        embed_dim: int,
        rank: int = 256,
        eps: float = 1e-6,
        meta: dict[str, Any] | None = None,
    ):
        super().__init__()
        if min(hidden_size, embed_dim, rank) <= 0:
            raise ValueError("hidden_size, embed_dim and rank must be positive")
        self.hidden_size = int(hidden_size)
        self.embed_dim = int(embed_dim)
        self.rank = int(rank)
        self.eps = float(eps)
        self.meta = dict(meta or {})
        self.hidden_gain = nn.Parameter(torch.ones(hidden_size))
        self.parent_gain = nn.Parameter(torch.ones(embed_dim))
        self.up = nn.Linear(hidden_size + embed_dim, rank, bias=False)
        self.down = nn.Linear(rank, embed_dim, bias=False)
        self.base_scale = nn.Parameter(torch.ones(()))
        nn.init.normal_(self.up.weight, std=(hidden_size + embed_dim) ** -0.5)
        nn.init.zeros_(self.down.weight)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def _rms(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * gain

    # The up projection is linear, so W_up·[a; b] = W_h·a + W_p·b: the hidden part is
    # computed once per depth and the parent part once per candidate token, which is what
    # lets the supertree score a whole depth with one small matmul (see supertree.py).

    def hidden_features(self, hidden: torch.Tensor) -> torch.Tensor:
        """``W_h · RMSNorm(H)`` for hidden ``[..., H]`` -> ``[..., r]``."""
        if hidden.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden must be [..., {self.hidden_size}], got {tuple(hidden.shape)}")
        return self._rms(hidden, self.hidden_gain) @ self.up.weight[:, : self.hidden_size].T

    def parent_features(self, parent_emb: torch.Tensor) -> torch.Tensor:
        """``W_p · RMSNorm(emb(parent))`` for embeddings ``[..., E]`` -> ``[..., r]``."""
        if parent_emb.shape[-1] != self.embed_dim:
            raise ValueError(
                f"parent_emb must be [..., {self.embed_dim}], got {tuple(parent_emb.shape)}"
            )
        return self._rms(parent_emb, self.parent_gain) @ self.up.weight[:, self.hidden_size :].T

    def score(
        self,
        hidden_feat: torch.Tensor,
        parent_feat: torch.Tensor,
        cand_emb: torch.Tensor,
        base_logits: torch.Tensor,
    ) -> torch.Tensor:
        """``ln q̃`` ``[n, K]`` from precomputed features: hidden_feat ``[n or 1, r]``,
        parent_feat ``[n, r]``, cand_emb ``[n or 1, K, E]`` or ``[K, E]``, base ``[n or 1, K]`` or ``[K]``."""
        u = self.down(F.silu(hidden_feat + parent_feat))  # [n, E]
        cand_emb = cand_emb.float()
        if cand_emb.dim() == 2:
            resid = u @ cand_emb.T  # [n, K]
        else:
            resid = torch.einsum("ne,nke->nk", u, cand_emb.expand(u.shape[0], -1, -1))
        logits = self.base_scale * base_logits.float() + resid
        return torch.log_softmax(logits, dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,
        parent_emb: torch.Tensor,
        cand_emb: torch.Tensor,
        base_logits: torch.Tensor,
    ) -> torch.Tensor:
        """Log-probabilities ``ln q̃`` over the candidates, fp32 ``[n, K]``.

        hidden ``[n, H]`` (or ``[H]``, shared by all rows), parent_emb ``[n, E]``,
        cand_emb ``[n, K, E]`` or ``[K, E]`` (shared), base_logits ``[n, K]`` or ``[K]``.
        """
        if parent_emb.dim() != 2 or parent_emb.shape[-1] != self.embed_dim:
            raise ValueError(
                f"parent_emb must be [n, {self.embed_dim}], got {tuple(parent_emb.shape)}"
            )
        n = parent_emb.shape[0]
        if hidden.dim() == 1:
            hidden = hidden.unsqueeze(0)
        if (
            hidden.dim() != 2
            or hidden.shape[0] not in (1, n)
            or hidden.shape[1] != self.hidden_size
        ):
            raise ValueError(f"hidden must be [{n}, {self.hidden_size}], got {tuple(hidden.shape)}")
        return self.score(
            self.hidden_features(hidden), self.parent_features(parent_emb), cand_emb, base_logits
        )

    # -- persistence -------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "format_version": _FORMAT_VERSION,
            "hidden_size": self.hidden_size,
            "embed_dim": self.embed_dim,
            "rank": self.rank,
            "eps": self.eps,
            "num_parameters": self.num_parameters(),
            "meta": self.meta,
        }

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (fp32) into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = directory / (_WEIGHTS + ".tmp")
        save_file(state, str(tmp), metadata={"format": _FORMAT})
        tmp.replace(directory / _WEIGHTS)
        (directory / _CONFIG).write_text(
            json.dumps(self.config_dict(), indent=2, sort_keys=True) + "\n"
        )
        return directory

    @classmethod
    def from_pretrained(cls, name_or_path: str | Path) -> CorrectionHead:
        """Load a saved head: a directory, or a built-in name (``"smollm2"``)."""
        from safetensors.torch import load_file

        directory = resolve_head_path(name_or_path)
        try:
            config = json.loads((directory / _CONFIG).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DartError(f"cannot read correction head config in {directory}: {exc}") from exc
        if config.get("format") != _FORMAT or config.get("format_version") != _FORMAT_VERSION:
            raise DartError(
                f"{directory} is not a dartcore correction head (format "
                f"{config.get('format')!r} v{config.get('format_version')}); retrain it "
                "with `dart-train --correction-head`"
            )
        head = cls(
            config["hidden_size"],
            config["embed_dim"],
            config["rank"],
            config.get("eps", 1e-6),
            meta=config.get("meta"),
        )
        state = load_file(str(directory / _WEIGHTS))
        missing, unexpected = head.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DartError(
                f"correction head weights in {directory} do not match its config "
                f"(missing {missing}, unexpected {unexpected})"
            )
        return head.eval()

    def check_compatible(
        self, hidden_size: int, embed_dim: int, fingerprint: str | None = None
    ) -> None:
        """Raise :class:`DrafterMismatchError` unless the head fits this drafter/target."""
        if (hidden_size, embed_dim) != (self.hidden_size, self.embed_dim):
            raise DrafterMismatchError(
                f"correction head expects drafter hidden {self.hidden_size} and embeddings "
                f"{self.embed_dim}, got {hidden_size} and {embed_dim}: train a head for this drafter "
                "with `dart-train --correction-head`"
            )
        want = self.meta.get("drafter_fingerprint")
        if fingerprint is not None and want is not None and want != fingerprint:
            raise DrafterMismatchError(
                f"correction head was trained on drafter {want}, this drafter is {fingerprint}: "
                "retrain it with `dart-train --correction-head`"
            )


def resolve_head_path(name_or_path: str | Path) -> Path:
    """A built-in head name (a directory under ``dartcore/assets/correction``) or a path."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    builtin = ASSET_DIR / str(name_or_path)
    if isinstance(name_or_path, str) and "/" not in name_or_path and builtin.is_dir():
        return builtin
    raise FileNotFoundError(
        f"no correction head at {name_or_path!r} (built-in heads: "
        f"{sorted(p.name for p in ASSET_DIR.iterdir()) if ASSET_DIR.is_dir() else []})"
    )
