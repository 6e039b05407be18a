"""The DART drafter's draft step through dartcore's native CPU kernels.

:class:`NativeDraft` drafts for a :class:`~dartcore.drafter.DartDrafter` (float32, CPU):
the products through the native small-batch kernel (fp16-exact weights, as shipped, stream
as fp16: same products) and, for a block of at most :data:`~dartcore.kernels.linear.MAX_ROWS`
rows, the layer's norms, RoPE, KV write and attention through the native layer ops -- ~15
calls instead of ~80 small torch ops. Same drafts as :meth:`DartDrafter.draft` up to float32
rounding (tests/test_drafter.py). Longer blocks (the prompt), autograd and a full state take
the drafter's own torch path. The decoder's native CPU backend
(:mod:`dartcore.models.backend`) makes one per drafter; training is unaffected.

``numerics="int8"`` (the decoder's ``draft_numerics``; by default a target on the integer path
drafts on it too): every product of the drafter -- fc, the fused projections, o / down and its
LM head -- runs on its weights quantised once to GGML blocks through the integer kernels
(:func:`~dartcore.kernels.linear.native_product`), torch path included: Q4_0 blocks by default
(:data:`DRAFT_BLOCK`), 3.6x fewer bytes a draft than fp16 (Q8_0: 1.9x), and the integer
kernels' cheap extra rows. A draft streams every weight of the drafter once, from memory
shared with the target's forwards, so its cost follows its bytes. The drafts are those of the
blocks' values, close to but not always the fp16 weights' (a draft only proposes: the target's
verification decides every output token).
"""

from __future__ import annotations

import functools
import operator
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from dartcore.kernels.linear import (
    MAX_ROWS,
    NUMERICS,
    QUANTISED_FORMATS,
    int8_kernel,
    linear_threads,
    native_linear_available,
    native_linears_,
    native_product,
)
from dartcore.models.gguf import BlockEmbedding

__all__ = ["DRAFT_BLOCK", "HEAD_SCREEN", "NativeDraft"]

# The block format of the drafter's layer weights on the integer path, and the outputs per row
# its LM head recomputes from the float weights after a Q4_0 pass (HEAD_SCREEN; 0: the head on
# blocks of the layers' format alone). Top-1 agreement with the fp16 drafter's drafts on
# held-out text (SmolLM2, tests/test_draft_int8.py): Q8_0 0.99 / 0.97 (first row / all 8),
# Q4_0 layers with the screened head 0.95 / 0.92 (screening 32 or 64 outputs alike) for about
# half the bytes; a plain Q4_0 head 0.75.
DRAFT_BLOCK = "q4_0"
HEAD_SCREEN = 32


class NativeDraft:
    """Native drafting for ``drafter`` (see the module docs). ``product``: the factory of a
    fused projection's product, ``product(weight, bias)`` (default the native kernel's
    :func:`~dartcore.kernels.linear.native_product` of ``numerics``: fp16-exact
    ``"exact"`` or ``"int8"`` on blocks of ``block``); tests pass a torch one to run the layer
    ops on any CPU."""

    def __init__(
        self,
        drafter,
        *,
        threads: int | None = None,
        product=None,
        numerics: str = "exact",
        block: str = DRAFT_BLOCK,
    ):
        from dartcore.errors import DartError

        if numerics not in NUMERICS:
            raise DartError(f"numerics={numerics!r}: expected one of {NUMERICS}")
        if block not in QUANTISED_FORMATS:
            raise DartError(f"block={block!r}: expected one of {QUANTISED_FORMATS}")
        self.drafter = drafter
        self.threads = threads or linear_threads()
        self.numerics = numerics
        self.block_format = block
        self.product = product or functools.partial(
            native_product, numerics=numerics, narrow=True, threads=self.threads, block=block
        )
        self._derived: dict[str, tuple] = {}
        self._rope_table: tuple | None = None
        self._watch: _Watch | None = None

    @classmethod
    def adopt(
        cls,
        drafter,
        *,
        threads: int | None = None,
        numerics: str = "exact",
        block: str = DRAFT_BLOCK,
        screen: int = HEAD_SCREEN,
    ) -> NativeDraft | None:
        """A NativeDraft for ``drafter`` with its ``nn.Linear`` layers on the native kernel
        (:func:`~dartcore.kernels.linear.native_linears_`, ``numerics``; ``"int8"`` on blocks of
        ``block``, ``"q4_0"`` or ``"q8_0"``, the LM head with ``screen`` > 0 a Q4_0
        :class:`~dartcore.kernels.linear.ScreenedWeight`), or None where the
        kernel does not run (neither AVX-512F nor AVX2 + FMA + F16C, not float32, not on the
        CPU). ``"int8"`` for a drafter with a weight whose in-features are not whole 32-value
        blocks (or without the integer kernels) is ``"exact"`` for all its weights, with a
        one-line warning. The weights' native copies are made here, not in the first round."""
        if block not in QUANTISED_FORMATS:
            from dartcore.errors import DartError

            raise DartError(f"block={block!r}: expected one of {QUANTISED_FORMATS}")
        w = drafter.fc.weight
        if not native_linear_available() or w.device.type != "cpu" or w.dtype != torch.float32:
            return None
        if numerics == "int8":
            odd = sorted(
                {
                    m.in_features
                    for m in drafter.modules()
                    if isinstance(m, torch.nn.Linear) and m.in_features % 32
                }
            )
            if odd or int8_kernel() is None:
                why = (
                    f"in-features {odd} are not whole 32-value blocks"
                    if odd
                    else "the integer kernels do not run here"
                )
                warnings.warn(
                    f"draft numerics 'int8': the drafter drafts with its exact weights ({why})",
                    stacklevel=2,
                )
                numerics = "exact"
        native_linears_(drafter, narrow=True, threads=threads, numerics=numerics, block=block)
        if numerics == "int8" and screen > 0:
            drafter.lm_head.__dict__.update(_block="q4_0", _screen=int(screen))
        self = cls(drafter, threads=threads, numerics=numerics, block=block)
        self.prepare()
        return self

    def prepare(self) -> None:
        """Make the weights' native copies now (SmolLM2's drafter: ~0.5 s), not in the first
        draft."""
        dr, layer = self.drafter, self.drafter.layer
        self._fused("qkv", (layer.q_proj, layer.k_proj, layer.v_proj))
        self._fused("gate_up", (layer.gate_proj, layer.up_proj))
        with torch.no_grad():  # every layer's, the torch path's (the prompt) too
            for m in dr.modules():
                if isinstance(m, torch.nn.Linear):
                    m(torch.zeros(1, m.in_features))

    def draft(
        self,
        state,
        taps: torch.Tensor,
        next_tokens: torch.Tensor,
        *,
        return_hidden: bool = False,
        rows: int | None = None,
    ):
        """:meth:`DartDrafter.draft`, natively where the block fits (without autograd)."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.draft(state, taps, next_tokens, return_hidden=return_hidden, rows=rows)
        nq = self.drafter.check_draft(taps, next_tokens, rows)
        out = self.block(state, taps, next_tokens, nq)
        if out is None:
            return self.drafter.draft(
                state, taps, next_tokens, return_hidden=return_hidden, rows=nq
            )
        logits, h = out
        return (logits, h) if return_hidden else logits

    # -- derived copies of the drafter's weights ---------------------------------------

    def _cached(self, name: str, sources, build):
        """``build()`` made once and remade when any tensor of ``sources`` is replaced or
        changed in place (fused weights, normed MASK rows)."""
        key = tuple((t.data_ptr(), t._version) for t in sources)
        cached = self._derived.get(name)
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = self._derived[name] = (key, build())
        return cached[1]

    def _fused(self, name: str, projs):
        """Projections reading the same input as one product (q | k | v, gate | up)."""

        def build():
            w = torch.cat([p.weight.detach() for p in projs]).contiguous()
            b = None if projs[0].bias is None else torch.cat([p.bias.detach() for p in projs])
            return self.product(w, b)

        return self._cached(
            name, [t for p in projs for t in (p.weight, p.bias) if t is not None], build
        )

    def _mask_inputs(self) -> torch.Tensor:
        """The MASK rows' layer inputs ``[d - 1, 2H]`` (constant between weight updates)."""
        dr = self.drafter
        return self._cached(
            "mask_x",
            (dr.mask_emb, dr.mask_hidden, dr.emb_norm.weight, dr.hidden_norm.weight),
            lambda: dr.mask_rows()[0].detach().float().contiguous(),
        )

    def _lean(self) -> _Lean | None:
        """The draft step's products as the native kernel reads them, its norm weights and
        MASK rows as arrays: made once, remade when a parameter or module of the drafter is
        replaced or a parameter changed in place; None where a product has no native form (a
        ``product`` of the caller's) or a projection the tensor path calls as a module has a
        forward hook. One check a draft (:class:`_Watch`, a few microseconds) instead of one
        per product and norm."""
        dr = self.drafter
        watch = self._watch
        if watch is None or not watch.current():
            watch = self._watch = _Watch.of(dr)
        key = watch.key()
        cached = self._derived.get("lean")
        if cached is not None and cached[0] == key:
            return cached[1]
        layer = dr.layer
        products = []
        for source in (
            dr.fc,
            self._fused("qkv", (layer.q_proj, layer.k_proj, layer.v_proj)),
            layer.o_proj,
            self._fused("gate_up", (layer.gate_proj, layer.up_proj)),
            layer.down_proj,
            dr.lm_head,
        ):
            if isinstance(source, torch.nn.Linear):
                if source._forward_pre_hooks or source._forward_hooks:
                    # a hook of the drafter's (the official head's input norm): module calls
                    self._derived["lean"] = (key, None)
                    return None
                with torch.no_grad():
                    source(torch.zeros(1, source.in_features))  # its native copy, current
                source = source.__dict__.get("_native_weight", (None,))[0]
            parts = getattr(source, "native_parts", lambda: None)()
            if parts is None:
                self._derived["lean"] = (key, None)
                return None
            w, fmt, b = parts
            shape = source.shape if hasattr(source, "shape") else source.weight.shape
            products.append(_LeanProduct(w, fmt, b, shape[0], getattr(source, "refine", None)))

        def arr(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.detach().float().numpy())

        qk = (arr(layer.q_norm.weight), arr(layer.k_norm.weight)) if layer.qk_norm else None
        lean = _Lean(
            *products,
            emb_norm=arr(dr.emb_norm.weight),
            hidden_norm=arr(dr.hidden_norm.weight),
            post_norm=arr(layer.post_attention_layernorm.weight),
            final_norm=arr(dr.norm.weight),
            qk_norm=qk,
            mask_x=arr(dr.mask_rows()[0]),
            mask_hidden=arr(dr.mask_hidden),
        )
        self._derived["lean"] = (key, lean)
        return lean

    def _rope_rows(self, start: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin ``[rows, head_dim]`` of positions ``start..start + rows`` from a table of
        every position so far (grown by doubling): one slice instead of ~7 small ops a draft."""
        table = self._rope_table
        if (
            table is None
            or table[0] is not self.drafter.inv_freq
            or table[1].shape[0] < start + rows
        ):
            n = max(256, 2 * (start + rows))
            cos, sin = self.drafter.rope(torch.arange(n))
            table = self._rope_table = (
                self.drafter.inv_freq,
                cos.float().contiguous().numpy(),
                sin.float().contiguous().numpy(),
            )
        return table[1][start : start + rows], table[2][start : start + rows]

    # -- the block ---------------------------------------------------------------------

    def block(self, state, taps: torch.Tensor, next_tokens: torch.Tensor, nq: int):
        """(logits, final hidden) of a draft through the native layer ops, or None where they
        do not apply (autograd, more than MAX_ROWS rows, a full state, a non-float32 state).
        The block is the n new real rows then the nq - 1 MASK rows at consecutive positions
        under a causal mask: the last real row sees the real rows, MASK j the real rows and
        MASK 1..j, as in :meth:`DartDrafter.draft`; the MASK rows' keys land past
        ``state.length`` (scratch)."""
        if torch.is_grad_enabled():
            return None
        n = taps.shape[0]
        rows = n + nq - 1
        if rows > MAX_ROWS or state.length + rows > state.max_len or state.k.dtype != torch.float32:
            return None
        lean = self._lean()
        if lean is not None:
            return self._lean_block(lean, state, taps, next_tokens, n, nq)
        from dartcore import _native

        dr = self.drafter
        layer, eps = dr.layer, dr.config.rms_norm_eps

        def norm(x: torch.Tensor, module, delta: torch.Tensor | None = None) -> torch.Tensor:
            out = torch.empty_like(x)
            _native.add_rms_norm(
                x.numpy(),
                None if delta is None else delta.numpy(),
                module.weight.detach().numpy(),
                eps,
                out.numpy(),
            )
            return out

        g = dr.fc(taps.to(torch.float32).contiguous())
        emb = dr.embed(next_tokens).contiguous()
        x = torch.cat(
            (
                torch.cat((norm(emb, dr.emb_norm), norm(g, dr.hidden_norm)), dim=-1),
                self._mask_inputs()[: nq - 1],
            )
        )
        start = state.length
        cos, sin = self._rope_rows(start, rows)
        att = torch.empty(rows, layer.nh * layer.hd)
        qn = kn = None
        if layer.qk_norm:
            qn, kn = layer.q_norm.weight.detach().numpy(), layer.k_norm.weight.detach().numpy()
        qkv = self._fused("qkv", (layer.q_proj, layer.k_proj, layer.v_proj))(x)
        _native.block_attention(
            qkv.numpy(),
            layer.nh,
            layer.nkv,
            cos,
            sin,
            state.k.numpy(),
            state.v.numpy(),
            start,
            None,
            layer.hd**-0.5,
            att.numpy(),
            qn,
            kn,
            eps,
            self.threads,
        )
        state.length += n  # the real rows' keys and values are in place
        h = torch.cat((g[-1:], dr.mask_hidden.detach()[: nq - 1]))  # the residual streams
        x = norm(h, layer.post_attention_layernorm, layer.o_proj(att[n - 1 :]))  # h += attention
        gate, up = self._fused("gate_up", (layer.gate_proj, layer.up_proj))(x).split(
            layer.gate_proj.out_features, -1
        )
        mlp = layer.down_proj(F.silu(gate) * up)
        return dr.lm_head(norm(h, dr.norm, mlp)), h  # h += mlp; logits of norm(h)

    def _lean_block(self, lean: _Lean, state, taps, next_tokens, n: int, nq: int):
        """:meth:`block` on numpy arrays and the native calls alone (see :meth:`_lean`): the
        same calls and values as the tensor path, without its per-op overhead."""
        from dartcore import _native

        dr, layer, threads = self.drafter, self.drafter.layer, self.threads
        eps = dr.config.rms_norm_eps
        hidden = dr.config.hidden_size
        rows = n + nq - 1

        def product(p: _LeanProduct, x: np.ndarray) -> np.ndarray:
            out = np.empty((x.shape[0], p.n), dtype=np.float32)
            _native.linear_rows(x, p.w, p.b, out, threads, p.fmt)
            if p.refine is not None:
                p.refine(out, x)
            return out

        def norm(x: np.ndarray, weight: np.ndarray, delta: np.ndarray | None = None):
            out = np.empty_like(x)
            _native.add_rms_norm(x, delta, weight, eps, out)
            return out

        g = product(lean.fc, np.ascontiguousarray(taps.detach().numpy(), dtype=np.float32))
        table = dr.target_embedding
        if type(table) is BlockEmbedding:  # the rows it looks up, without the module call
            emb = table.block.dequantize_rows(next_tokens.numpy()).numpy()
        else:
            emb = np.ascontiguousarray(dr.embed(next_tokens).numpy(), dtype=np.float32)
        x = np.empty((rows, 2 * hidden), dtype=np.float32)
        x[:n, :hidden] = norm(emb, lean.emb_norm)
        x[:n, hidden:] = norm(g, lean.hidden_norm)
        x[n:] = lean.mask_x[: nq - 1]
        start = state.length
        cos, sin = self._rope_rows(start, rows)
        att = np.empty((rows, layer.nh * layer.hd), dtype=np.float32)
        qn, kn = lean.qk_norm or (None, None)
        _native.block_attention(
            product(lean.qkv, x),
            layer.nh,
            layer.nkv,
            cos,
            sin,
            state.k.numpy(),
            state.v.numpy(),
            start,
            None,
            layer.hd**-0.5,
            att,
            qn,
            kn,
            eps,
            threads,
        )
        state.length += n  # the real rows' keys and values are in place
        h = np.empty((nq, hidden), dtype=np.float32)  # the residual streams
        h[0], h[1:] = g[-1], lean.mask_hidden[: nq - 1]
        x = norm(h, lean.post_norm, product(lean.o, att[n - 1 :]))  # h += attention
        gate_up, inter = product(lean.gate_up, x), dr.config.intermediate_size
        act = F.silu(torch.from_numpy(gate_up[:, :inter])).mul_(
            torch.from_numpy(gate_up[:, inter:])
        )
        mlp = product(lean.down, act.numpy())  # torch's silu(gate) * up
        logits = product(lean.head, norm(h, lean.final_norm, mlp))  # h += mlp; norm(h)'s logits
        return torch.from_numpy(logits), torch.from_numpy(h)

    @torch.no_grad()
    def draft_batch(self, states, taps, next_tokens, rows, *, return_hidden: bool = False) -> list:
        """:meth:`DartDrafter.draft_batch` natively: the products once over every sequence's
        rows, the layer ops' attention once per sequence (its block of real + MASK rows,
        at most MAX_ROWS, over its own state). Where a block does not fit it is the
        drafter's torch batch."""
        dr = self.drafter
        nqs = [dr.check_draft(t, x, r) for t, x, r in zip(taps, next_tokens, rows)]
        ns = [int(t.shape[0]) for t in taps]
        if torch.is_grad_enabled() or any(
            n + nq - 1 > MAX_ROWS or s.length + n + nq - 1 > s.max_len or s.k.dtype != torch.float32
            for s, n, nq in zip(states, ns, nqs)
        ):
            return dr.draft_batch(states, taps, next_tokens, rows, return_hidden=return_hidden)
        from dartcore import _native

        layer, eps = dr.layer, dr.config.rms_norm_eps

        def norm(x: torch.Tensor, module, delta: torch.Tensor | None = None) -> torch.Tensor:
            out = torch.empty_like(x)
            _native.add_rms_norm(
                x.numpy(),
                None if delta is None else delta.numpy(),
                module.weight.detach().numpy(),
                eps,
                out.numpy(),
            )
            return out

        g = dr.fc(torch.cat(taps).to(torch.float32).contiguous())
        emb = dr.embed(torch.cat(next_tokens)).contiguous()
        real = torch.cat((norm(emb, dr.emb_norm), norm(g, dr.hidden_norm)), dim=-1)
        masks = self._mask_inputs()
        blocks, resid, outs = [], [], []
        off = 0
        for n, nq in zip(ns, nqs):
            blocks += [real[off : off + n], masks[: nq - 1]]
            resid += [g[off + n - 1 : off + n], dr.mask_hidden.detach()[: nq - 1]]
            off += n
        x = torch.cat(blocks)
        qkv = self._fused("qkv", (layer.q_proj, layer.k_proj, layer.v_proj))(x).contiguous().numpy()
        att = torch.empty(x.shape[0], layer.nh * layer.hd)
        an = att.numpy()
        qn = kn = None
        if layer.qk_norm:
            qn, kn = layer.q_norm.weight.detach().numpy(), layer.k_norm.weight.detach().numpy()
        off = 0
        for state, n, nq in zip(states, ns, nqs):
            m = n + nq - 1
            start = state.length
            cos, sin = self._rope_rows(start, m)
            _native.block_attention(
                qkv[off : off + m],
                layer.nh,
                layer.nkv,
                cos,
                sin,
                state.k.numpy(),
                state.v.numpy(),
                start,
                None,
                layer.hd**-0.5,
                an[off : off + m],
                qn,
                kn,
                eps,
                self.threads,
            )
            state.length += n  # the real rows' keys and values are in place
            outs.append(att[off + n - 1 : off + m])  # the last real row and the MASK rows
            off += m
        h = torch.cat(resid)
        x = norm(h, layer.post_attention_layernorm, layer.o_proj(torch.cat(outs)))  # h += attention
        gate, up = self._fused("gate_up", (layer.gate_proj, layer.up_proj))(x).split(
            layer.gate_proj.out_features, -1
        )
        mlp = layer.down_proj(F.silu(gate) * up)
        logits = dr.lm_head(norm(h, dr.norm, mlp))
        result, off = [], 0
        for nq in nqs:
            result.append(
                (logits[off : off + nq], h[off : off + nq])
                if return_hidden
                else logits[off : off + nq]
            )
            off += nq
        return result


class _Watch(NamedTuple):
    """What :meth:`NativeDraft._lean`'s arrays are derived from, checked in one pass of a few
    microseconds a draft (``dr.parameters()`` walks the module tree): the drafter's modules,
    each one's parameters and submodules (as objects, held), its parameters, and the modules
    its tensor path calls (whose hooks turn the lean path off)."""

    modules: tuple[torch.nn.Module, ...]
    members: tuple
    params: tuple[torch.Tensor, ...]
    called: tuple[torch.nn.Module, ...]

    @staticmethod
    def _members(modules) -> tuple:
        return tuple([v for m in modules for d in (m._parameters, m._modules) for v in d.values()])

    @classmethod
    def of(cls, dr) -> _Watch:
        modules = tuple(dr.modules())
        called = (dr.fc, dr.layer.o_proj, dr.layer.down_proj, dr.lm_head)
        return cls(modules, cls._members(modules), tuple(dr.parameters()), called)

    def current(self) -> bool:
        """Whether the same modules still hold the same parameters and submodules (none
        replaced, added or removed)."""
        now = self._members(self.modules)
        return len(now) == len(self.members) and all(map(operator.is_, now, self.members))

    def key(self) -> tuple:
        """Every parameter's storage and in-place version, and the called modules' hook
        counts: a change of either remakes the arrays."""
        return (
            tuple([(p.data_ptr(), p._version) for p in self.params]),
            tuple([len(m._forward_pre_hooks) + len(m._forward_hooks) for m in self.called]),
        )


class _LeanProduct(NamedTuple):
    """A product as :meth:`NativeDraft._lean_block` calls it: ``linear_rows``'s weight,
    format and bias, its output columns, and the head's ``refine`` (or None)."""

    w: np.ndarray
    fmt: str
    b: np.ndarray | None
    n: int
    refine: Callable[[np.ndarray, np.ndarray], None] | None


class _Lean(NamedTuple):
    """What :meth:`NativeDraft._lean_block` reads (see :meth:`NativeDraft._lean`)."""

    fc: _LeanProduct
    qkv: _LeanProduct
    o: _LeanProduct
    gate_up: _LeanProduct
    down: _LeanProduct
    head: _LeanProduct
    emb_norm: np.ndarray
    hidden_norm: np.ndarray
    post_norm: np.ndarray
    final_norm: np.ndarray
    qk_norm: tuple[np.ndarray, np.ndarray] | None
    mask_x: np.ndarray
    mask_hidden: np.ndarray
