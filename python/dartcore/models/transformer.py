"""A lean forward for Hugging Face Llama- and Qwen3-family causal LMs.

gpt-fast style: one flat function per step, a preallocated
:class:`~dartcore.models.cache.KVCache` per sequence (``forward_batch`` packs the blocks of
several sequences into one pass, each over its own cache), explicit positions and an explicit
attention mask over (cached prefix + new block), so the same forward serves
prefill, plain autoregressive steps and tree verification. It also returns the
"tap" hidden states the DART drafter reads.

Nothing is copied: :class:`TargetModel` holds the Hugging Face model and calls
its own submodules (embedding, projections, RMSNorms, MLPs, LM head), so the
parameters are shared with it. What is ours: RoPE from explicit positions, the
KV cache, the mask, and the attention call (see ``dartcore.kernels``).

Tested against the Hugging Face forward (logits within 1e-4 in fp32) and
against ``generate(do_sample=False)`` (identical tokens), see
tests/test_models_transformer.py.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dartcore.errors import DartError
from dartcore.kernels.linear import (
    MAX_ROWS,
    NUMERICS,
    BlockWeight,
    NativeWeight,
    int8_kernel,
    linear_threads,
    native_linear_available,
    share_huge_pages,
    torch_threads,
)
from dartcore.kernels.tree_attention import backend_for, pack_block_mask, tree_attention
from dartcore.models.cache import KVCache
from dartcore.models.gguf import BlockEmbedding

__all__ = ["TargetModel", "ForwardOutput", "SUPPORTED_FAMILIES", "column_major_linears_"]

# model_type -> uses per-head q/k RMSNorm (Qwen3)
SUPPORTED_FAMILIES = {"llama": False, "qwen3": True, "mistral": False, "qwen2": False}
# RoPE types whose frequencies do not depend on the sequence length (we read
# inv_freq once from the HF rotary module; "dynamic" rescales it at run time).
_STATIC_ROPE = {"default", "linear", "llama3", "yarn", "longrope"}


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [rows, V] float32 (rows chosen by ``logits_rows``)
    taps: torch.Tensor | None  # [n, len(taps) * H] in the model dtype, or None
    hidden: torch.Tensor  # [n, H] final normed hidden states (the LM head's input)


def check_batch(model, caches, sizes, tokens, positions, block_masks, taps) -> set[int]:
    """The checks every target's ``forward_batch`` makes before it runs (one block per cache,
    the rows' count, each cache's room, positions within ``model.max_positions``, tap indices
    within ``model.num_layers``); returns the tap indices as a set."""
    n = int(tokens.shape[0])
    if len(caches) != len(sizes) or len(caches) != len(block_masks) or sum(sizes) != n:
        raise ValueError(
            f"forward_batch: {len(caches)} caches, {len(sizes)} sizes summing to {sum(sizes)}, "
            f"{len(block_masks)} masks for {n} rows"
        )
    for cache, size in zip(caches, sizes):
        cache.check_block(int(size))
    if model.max_positions is not None and int(positions.max()) >= model.max_positions:
        raise DartError(
            f"position {int(positions.max())} is past the model's context of {model.max_positions}"
        )
    tap_set = {int(t) for t in taps}
    for t in tap_set:
        if not 0 <= t <= model.num_layers:
            raise ValueError(f"tap index {t} out of range for a {model.num_layers}-layer model")
    return tap_set


class TargetModel:
    """The target LM behind a lean forward (batch 1, explicit cache and mask).

    ``hf_model`` is a loaded ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` (or
    Mistral / Qwen2, which share the layout). Its dtype and device are used as
    they are.

    ``fuse_cpu_weights`` (default: on when the model is on the CPU) re-lays the
    decoder layers' projection weights out IN PLACE as fused matrices (q|k|v and
    gate|up) and points the Hugging Face parameters at views of them: no extra
    memory, the HF forward keeps working (same results), and our forward runs one
    product per fused group.

    ``native_linear`` keeps them row-major (``[out, in]``) and runs the products of
    1-16 rows -- a decoding step's and a tree verification's projections and LM head, the
    drafter's rows -- through dartcore's native small-batch kernel, and the rest of each layer
    (residual + RMSNorm, q/k norm, RoPE, KV write, tree attention) through native layer ops
    (:mod:`dartcore.kernels.linear`, :class:`NativeLayerOps`). Default: on wherever the kernel
    runs (float32 CPU weights, AVX-512F or AVX2 + FMA + F16C). The kernel runs on as many threads as torch has when
    the model is adopted (the calling thread plus helpers that spin between calls; or
    ``DARTCORE_LINEAR_THREADS``), and a small forward runs torch's own ops on one thread (its
    OpenMP workers spinning next to the helpers cost 4-5x). Measured on the 2-vCPU dev box
    (SmolLM2, 6 eval prompts x 64 tokens, tok/s AR / dart): one thread, MKL 18.4 / 21.7, native
    products 18.2 / 23.8, with the native layer ops 21.3 / 28.9; two threads, MKL 24-31 / 26-34,
    native 31-35 / 38-42 (the machine's noise). A prefill longer than 16 rows keeps torch's
    threads and ops (GEMM-bound).

    A model whose projections are GGML blocks (:func:`dartcore.models.gguf.load_gguf_model`:
    ``BlockLinear`` / ``BlockEmbedding`` modules) keeps them as blocks: q|k|v and gate|up are
    fused as stacked block rows, the products of 1-16 rows stream the blocks (bit for bit the
    dequantised float32 weight's products), a causal prefill runs through the same kernels
    16 rows at a time, and any other block of more than 16 rows multiplies by a temporary
    float32 copy of each weight (:class:`dartcore.kernels.linear.BlockWeight`).
    ``numerics`` names the block weights' arithmetic: ``"exact"`` (the above: the dequantised
    float32 model's products) or ``"int8"`` (the integer path: activations quantised to int8 per
    32-value block, integer block dot products -- each row the same bits whatever the other
    rows, so a tree's verify equals plain steps; extra rows cost a fraction). Default: what
    :func:`dartcore.models.gguf.load_gguf_model` asked for the model, else ``"exact"``. A
    product whose tensor type has no integer kernel (its GGUF type was dequantised to float32)
    runs exact, with a one-line warning; without the integer kernels everything runs exact.
    Off (or unavailable), the fused weights are column-major (``[in, out]``) for
    MKL: with a row-major weight its GEMM falls off a cliff from 4 rows on (a 576 x
    4608 product: 0.44 ms for 1-3 rows, 0.84 ms for 4, 1.3 ms for 8 on one core of
    the dev box; ``[in, out]``: 0.45 / 0.54 / 0.59 ms). See
    tools/bench_verify_layout.py.
    """

    def __init__(
        self,
        hf_model,
        *,
        fuse_cpu_weights: bool | None = None,
        native_linear: bool | None = None,
        numerics: str | None = None,
    ):
        config = hf_model.config
        family = getattr(config, "model_type", None)
        if family not in SUPPORTED_FAMILIES:
            raise DartError(
                f"unsupported target family {family!r}: dartcore's forward supports "
                f"{sorted(SUPPORTED_FAMILIES)}"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(
            config, "use_sliding_window", False
        ):
            raise DartError(
                "sliding-window attention layers are not supported by dartcore's forward"
            )
        self.hf = hf_model
        self.config = config
        self.family = family
        self.qk_norm = SUPPORTED_FAMILIES[family]
        inner = hf_model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        rotary = inner.rotary_emb
        rope_type = getattr(rotary, "rope_type", "default")
        if rope_type not in _STATIC_ROPE:
            raise DartError(
                f"RoPE type {rope_type!r} is not supported (position-dependent rescaling)"
            )
        self._inv_freq = rotary.inv_freq.detach().float()
        self._rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # see _rope
        self._fused: list[_FusedLayer] | None = None
        # The native kernel's threads: torch's now (or DARTCORE_LINEAR_THREADS).
        self.threads = linear_threads()
        self.blocks = any(
            isinstance(getattr(m, "block", None), BlockWeight) for m in hf_model.modules()
        )
        if self.blocks:
            if self.device.type != "cpu" or self.dtype != torch.float32:
                raise DartError(
                    "a model with GGML block weights runs on the CPU in float32 (load the float32 "
                    "conversion for another device or dtype)"
                )
            numerics = _block_numerics(
                numerics or getattr(hf_model, "dartcore_numerics", None) or "exact"
            )
            self._fused = [
                _FusedLayer.adopt_blocks(layer, threads=self.threads, numerics=numerics)
                for layer in self.layers
            ]
            head = getattr(self.lm_head, "block", None)
            if isinstance(head, BlockWeight) and head.numerics != numerics:
                # re-laid out in place (a tied embedding reads either layout), unless a model
                # adopted it with the other numerics: then this model's own copy
                head = head.with_numerics(numerics, copy=head.adopted)
            if isinstance(head, BlockWeight):
                head.adopted = True
            if numerics == "int8":
                exact = sum(
                    not isinstance(p, BlockWeight)
                    for f in self._fused
                    for p in (f.qkv, f.o, f.gu, f.down)
                )
                exact += not isinstance(head, BlockWeight)
                if exact:
                    warnings.warn(
                        f"numerics='int8': {exact} products have no integer kernel (their GGUF tensor "
                        "types are read as float32) and run exact",
                        stacklevel=2,
                    )
            self.numerics = numerics
            self._head = (
                head
                if isinstance(head, BlockWeight)
                else NativeWeight(self.lm_head.weight, self.lm_head.bias, threads=self.threads)
            )
            # the layers' blocks in stream order, then the head's, on huge pages (the
            # projections' own blocks are rows of the fused groups': they move along)
            share_huge_pages(
                [p for f in self._fused for p in (f.qkv, f.o, f.gu, f.down)] + [self._head],
                views=[
                    m.block
                    for layer in self.layers
                    for m in layer.modules()
                    if isinstance(getattr(m, "block", None), BlockWeight)
                ],
            )
            self._ops = NativeLayerOps.adopt(self) if native_linear_available() else None
            _return_freed_heap()
            return
        if numerics not in (None, "exact"):
            raise DartError(
                f"numerics={numerics!r} is for a model with GGML block weights (load_target(..., "
                "quantized=True)); this model's weights are floats: numerics='exact'"
            )
        self.numerics = "exact"
        if fuse_cpu_weights if fuse_cpu_weights is not None else self.device.type == "cpu":
            # Row-major ([out, in]) for the native small-batch kernel, column-major for MKL.
            # Default: native wherever it runs (see the class docs for the measurements).
            want = True if native_linear is None else bool(native_linear)
            rows = self.dtype == torch.float32 and native_linear_available() and want
            self._fused = [
                _FusedLayer.adopt(layer, row_major=rows, threads=self.threads)
                for layer in self.layers
            ]
        self._head = (
            NativeWeight(self.lm_head.weight, self.lm_head.bias, threads=self.threads)
            if self._fused is not None and self._fused[0].row_major
            else None
        )
        # With the native products, the rest of each layer runs natively too (NativeLayerOps).
        self._ops = NativeLayerOps.adopt(self) if self._head is not None else None

    @property
    def native_linear(self) -> bool:
        """Whether decoding-size products run through the native small-batch kernel."""
        return self._head is not None and (not self.blocks or native_linear_available())

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, capacity: int) -> KVCache:
        if self.max_positions is not None:
            capacity = min(capacity, self.max_positions)
        return KVCache(
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            dtype=self.dtype,
            device=self.device,
        )

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[n, head_dim]`` of ``positions``. On the CPU: rows of a table of
        positions 0.. (grown by doubling to the largest one asked; each row the values
        :meth:`_rope_values` gives that position), one gather a forward instead of ~8 small
        ops."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return self._rope_values(positions)
        top = int(positions.max())
        table = self._rope_table
        if table is None or table[0].shape[0] <= top:
            table = self._rope_table = self._rope_values(torch.arange(max(256, 2 * (top + 1))))
        return table[0][positions], table[1][positions]

    def _rope_values(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self._inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self._rope_scale).to(self.dtype)
        sin = (emb.sin() * self._rope_scale).to(self.dtype)
        return cos, sin  # [n, head_dim]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [heads, n, head_dim]; rotate_half convention of the HF Llama code.
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        cache: KVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_mask: torch.Tensor | None = None,
        *,
        taps: Sequence[int] = (),
        logits_rows: torch.Tensor | slice | None = None,
    ) -> ForwardOutput:
        """Run ``n`` new tokens after the ``cache.length`` cached ones.

        tokens, positions: int64 ``[n]``. block_mask: bool ``[n, n]``, row i may
        see new token j (the cached prefix is always visible); None = causal.
        The block's keys/values are written to cache slots
        ``[cache.length, cache.length + n)`` and ``cache.length`` is NOT
        advanced (call ``cache.commit`` or ``cache.compact``).
        taps: HF ``hidden_states`` indices to return (index i < L is the input
        of layer i, L is the final normed state). logits_rows: which rows get
        logits (default all; prefill passes ``slice(-1, None)``, lazy
        verification ``slice(0, 0)`` and calls :meth:`logits` per row later).
        """
        return self.forward_batch(
            [cache],
            [int(tokens.shape[0])],
            tokens,
            positions,
            [block_mask],
            taps=taps,
            logits_rows=logits_rows,
        )

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: Sequence[KVCache],
        sizes: Sequence[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_masks: Sequence[torch.Tensor | None],
        *,
        taps: Sequence[int] = (),
        logits_rows: torch.Tensor | slice | None = None,
    ) -> ForwardOutput:
        """:meth:`forward` for several sequences in one pass: ``tokens`` / ``positions`` are
        the sequences' blocks packed one after the other (``sizes[i]`` rows for ``caches[i]``),
        ``block_masks[i]`` the ``[sizes[i], sizes[i]]`` mask of block i (None = causal).
        Every row has its own position and sees only its own sequence's cached prefix and
        the rows its mask allows: the products run once over all rows, the attention once
        per sequence on its own cache. Outputs are packed the same way."""
        n = int(tokens.shape[0])
        tap_set = check_batch(self, caches, sizes, tokens, positions, block_masks, taps)
        dev = self.device
        tokens = tokens.to(dev)
        positions = positions.to(dev)
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + int(size))
        segments = [
            (cache, starts[i], starts[i + 1], None if m is None else m.to(dev))
            for i, (cache, m) in enumerate(zip(caches, block_masks))
        ]
        # The native layer stack takes at most MAX_ROWS rows per call (the products' register
        # blocking): a bigger packed block goes through it in groups of whole sequences (a
        # prefill of block weights: in causal chunks); a sequence's block of more than
        # MAX_ROWS rows under a mask takes the torch path for this forward.
        native = self._ops is not None and (
            n <= MAX_ROWS
            or all(end - start <= MAX_ROWS for _, start, end, _ in segments)
            or (self.blocks and len(segments) == 1 and segments[0][3] is None)
        )
        if not native:
            return self._forward_rows(
                segments, tokens, positions, tap_set, taps, logits_rows, False
            )
        # The kernel's helpers spin between its calls (the head follows the layers, the next
        # forward the decoder's bookkeeping): torch's small ops here (RoPE tables, embedding
        # rows, slicing) run on one thread so they never wait for a core the helpers hold.
        with torch_threads(1):
            return self._forward_rows(segments, tokens, positions, tap_set, taps, logits_rows, True)

    def _forward_rows(
        self, segments, tokens, positions, tap_set, taps, logits_rows, native: bool
    ) -> ForwardOutput:
        n = int(tokens.shape[0])
        cos, sin = self._rope(positions)
        captured: dict[int, torch.Tensor] = {}
        if native and n <= MAX_ROWS:
            h = self._ops.layers(self, segments, tokens, cos, sin, tap_set, captured)
        elif native and all(end - start <= MAX_ROWS for _, start, end, _ in segments):
            h = self._segment_groups(segments, tokens, cos, sin, tap_set, captured)
        elif native:
            h = self._causal_chunks(segments[0][0], tokens, cos, sin, tap_set, captured)
        else:
            packed = self._packed_attention(segments)
            h = self.embed(tokens)  # [n, H]
            for i, layer in enumerate(self.layers):
                if i in tap_set:
                    captured[i] = h
                h = h + self._attention(
                    layer.self_attn, i, layer.input_layernorm(h), cos, sin, segments, packed
                )
                h = h + self._mlp(i, layer.mlp, layer.post_attention_layernorm(h))
            h = self.norm(h)
        if self.num_layers in tap_set:
            captured[self.num_layers] = h
        rows = h if logits_rows is None else h[logits_rows]
        logits = self.logits(rows)
        tap_out = torch.cat([captured[int(t)] for t in taps], dim=-1) if len(taps) else None
        return ForwardOutput(logits=logits, taps=tap_out, hidden=h)

    def _segment_groups(self, segments, tokens, cos, sin, tap_set, captured) -> torch.Tensor:
        """A packed batch of more than MAX_ROWS rows, no sequence's block more than MAX_ROWS,
        through the native layers in groups of whole sequences of at most MAX_ROWS rows.
        Each row sees only its own sequence, so a group's rows are what they would be in one
        pass -- and on the integer path bit for bit what they are with any other rows, the
        contract that makes a batched verify equal each sequence's own decoding."""
        groups: list[list] = [[]]
        for seg in segments:
            if groups[-1] and seg[2] - groups[-1][0][1] > MAX_ROWS:
                groups.append([])
            groups[-1].append(seg)
        pieces = []
        for group in groups:
            a, b = group[0][1], group[-1][2]
            rebased = [(cache, s0 - a, s1 - a, m) for cache, s0, s1, m in group]
            pieces.append((rebased, a, b, None))
        return self._native_pieces(pieces, tokens, cos, sin, tap_set, captured)

    def _causal_chunks(self, cache: KVCache, tokens, cos, sin, tap_set, captured) -> torch.Tensor:
        """A causal block of more than MAX_ROWS rows (a prefill) through the native layers,
        MAX_ROWS rows at a time: chunk c sees the cached prefix and chunks < c as its prefix
        (their keys are in the cache by then), and itself causally -- the same attention as
        the whole block's. Block weights then never need a float32 copy."""
        n, pieces = tokens.shape[0], []
        for c0 in range(0, n, MAX_ROWS):
            c1 = min(n, c0 + MAX_ROWS)
            pieces.append(([(cache, 0, c1 - c0, None)], c0, c1, cache.length + c0))
        return self._native_pieces(pieces, tokens, cos, sin, tap_set, captured)

    def _native_pieces(self, pieces, tokens, cos, sin, tap_set, captured) -> torch.Tensor:
        """The native layers once per piece -- ``(segments, a, b, prefix)``: rows ``a:b``, its
        segments' rows counted from ``a``, ``prefix`` as in :meth:`NativeLayerOps.layers` --
        the pieces' final states and taps joined in row order."""
        hs, parts = [], {}
        for segs, a, b, prefix in pieces:
            got: dict[int, torch.Tensor] = {}
            hs.append(
                self._ops.layers(
                    self, segs, tokens[a:b], cos[a:b], sin[a:b], tap_set, got, prefix=prefix
                )
            )
            for t, v in got.items():
                parts.setdefault(t, []).append(v)
        captured.update({t: torch.cat(v) for t, v in parts.items()})
        return torch.cat(hs)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final normed hidden states ``[m, H]`` -> float32 ``[m, V]``."""
        if hidden.shape[0] == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=hidden.device)
        if self._head is None:
            return self.lm_head(hidden).float()
        # The native kernel takes MAX_ROWS rows at a time (each pass streams the head once).
        parts = [self._head(hidden[i : i + MAX_ROWS]) for i in range(0, hidden.shape[0], MAX_ROWS)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _packed_attention(self, segments):
        """The Triton kernel's one-launch-per-layer plan for a packed batch of several
        sequences whose caches are views of one pool (the batched engine's), else None
        (one attention call per sequence)."""
        if len(segments) < 2 or backend_for(self.device) != "triton":
            return None
        from dartcore.kernels.triton_tree import PackedAttention

        caches = [c for c, _, _, _ in segments]
        if not PackedAttention.supports(caches):
            return None
        bits = []
        for _, a, b, m in segments:
            if m is None:
                m = torch.ones(b - a, b - a, dtype=torch.bool, device=self.device).tril_()
            bits.append(pack_block_mask(m))
        return PackedAttention(caches, [b - a for _, a, b, _ in segments], bits)

    def _attention(
        self, attn, layer_idx: int, x: torch.Tensor, cos, sin, segments, packed=None
    ) -> torch.Tensor:
        n = x.shape[0]
        fused = self._fused[layer_idx] if self._fused is not None else None
        if fused is not None:
            q, k, v = fused.qkv_proj(x)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            v = v.view(n, self.num_kv_heads, self.head_dim)
        else:
            q = attn.q_proj(x).view(n, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = attn.q_norm(q)
            k = attn.k_norm(k)
        q = self._rotate(q.transpose(0, 1), cos, sin)  # [heads, n, D]
        k = self._rotate(k.transpose(0, 1), cos, sin)
        v = v.transpose(0, 1)
        if packed is not None:  # every sequence in one launch, over its own slot of the pool
            for cache, a, b, _ in segments:
                cache.write(layer_idx, k[:, a:b], v[:, a:b])
            out = packed(q, layer_idx, scale=self.scale)
        else:
            outs = []
            for cache, a, b, block_mask in segments:  # each sequence's rows over its own cache
                cache.write(layer_idx, k[:, a:b], v[:, a:b])
                keys, values = cache.view(layer_idx, b - a)
                outs.append(
                    tree_attention(
                        q[:, a:b], keys, values, cache.length, block_mask, scale=self.scale
                    )
                )
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        out = out.transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
        return fused.o(out) if fused is not None else attn.o_proj(out)

    def _mlp(self, layer_idx: int, mlp, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused[layer_idx] if self._fused is not None else None
        return fused.mlp(x) if fused is not None else mlp(x)

    # -- conveniences used by tests and the plain AR path ------------------------------

    def greedy_generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Plain greedy autoregressive loop on this forward (no EOS handling)."""
        ids = torch.as_tensor(list(prompt), dtype=torch.long)
        cache = self.new_cache(len(ids) + max_new_tokens)
        out = self.forward(cache, ids, torch.arange(len(ids)), logits_rows=slice(-1, None))
        cache.commit(len(ids))
        result: list[int] = []
        for _ in range(max_new_tokens):
            tok = int(out.logits[-1].argmax())
            result.append(tok)
            if len(result) == max_new_tokens:
                break
            out = self.forward(cache, torch.tensor([tok]), torch.tensor([cache.length]))
            cache.commit(1)
        return result


class _FusedLayer:
    """One decoder layer's projections as fused matrices (q|k|v and gate|up), see
    ``TargetModel(fuse_cpu_weights=...)``. ``adopt`` moves the HF Linear weights into the
    fused storage and leaves the modules holding views of it, so both forwards share one
    copy. Row-major (``[out, in]``, groups stacked by rows) for the native small-batch kernel
    (:class:`dartcore.kernels.linear.NativeWeight`; ``F.linear`` for more rows); column-major
    (``[in, out]``) where that kernel does not run (MKL's small-M fast path)."""

    def __init__(
        self, qkv, qkv_b, splits, o, o_b, gu, inter, down, down_b, act, row_major, threads=None
    ):
        # One product per fused matrix, chosen once for its layout.
        product = functools.partial(NativeWeight, threads=threads) if row_major else _ColumnMajor
        self.qkv, self.o, self.gu, self.down = (
            product(w, b) for w, b in ((qkv, qkv_b), (o, o_b), (gu, None), (down, down_b))
        )
        self.splits, self.inter, self.act = splits, inter, act
        self.row_major = row_major

    @staticmethod
    def _fuse(linears, row_major: bool):
        """The fused weight ([sum(out), in] or [in, sum(out)] contiguous); each module's
        weight becomes a view of its rows (columns)."""
        with torch.no_grad():
            fused = torch.cat([m.weight.detach() for m in linears], dim=0)
            fused = fused.contiguous() if row_major else fused.t().contiguous()
            start = 0
            for m in linears:
                out = m.weight.shape[0]
                m.weight.data = (
                    fused[start : start + out] if row_major else fused[:, start : start + out].t()
                )
                start += out
        biases = [m.bias for m in linears]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach()
                    if b is not None
                    else torch.zeros(m.weight.shape[0], dtype=fused.dtype, device=fused.device)
                    for b, m in zip(biases, linears)
                ]
            )
        )
        return fused, bias

    @staticmethod
    def _fuse_blocks(linears, threads, numerics: str = "exact"):
        """The group's block rows stacked ([sum(out), row bytes]) as one BlockWeight of
        ``numerics``; each module's blocks become a view of its rows (one copy; an int8 view
        where its rows are whole groups of eight, else the module keeps its own rows)."""
        blocks = [m.block for m in linears]
        if len({(b.format, b.shape[1]) for b in blocks}) != 1:
            raise DartError(
                f"fused projections of formats {[b.format for b in blocks]}: one format per group"
            )
        packed = all(b.numerics == "exact" for b in blocks)
        data = np.concatenate([b.data if packed else b.file_rows() for b in blocks])
        biases = [m.bias for m in linears]
        bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    b.detach() if b is not None else torch.zeros(m.out_features)
                    for b, m in zip(biases, linears)
                ]
            )
        )
        fused = BlockWeight(
            data,
            blocks[0].shape[1],
            blocks[0].format,
            bias,
            threads=threads,
            packed=packed,
            numerics=numerics,
        )
        start = 0
        for m, b in zip(linears, blocks):
            n = b.shape[0]
            if numerics == "exact" or (start % 8 == 0 and n % 8 == 0):
                m.block = BlockWeight.rows_of(fused, start, n)
            start += n
        return fused

    @classmethod
    def adopt_blocks(
        cls, layer, *, threads: int | None = None, numerics: str = "exact"
    ) -> _FusedLayer:
        """:meth:`adopt` for a layer whose projections are GGML blocks (``BlockLinear``):
        each fused group stacked as block rows; a group of float32 ``nn.Linear`` fused as
        :meth:`adopt` fuses it (row-major)."""
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise DartError(
                f"unsupported MLP layout {type(mlp).__name__}: expected gate/up/down projections"
            )

        def group(linears):
            if all(isinstance(getattr(m, "block", None), BlockWeight) for m in linears):
                return cls._fuse_blocks(linears, threads, numerics)
            w, b = cls._fuse(linears, True)
            return NativeWeight(w, b, threads=threads)

        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        self = cls.__new__(cls)
        self.qkv, self.o = group(projs), group((attn.o_proj,))
        self.gu, self.down = group((mlp.gate_proj, mlp.up_proj)), group((mlp.down_proj,))
        self.splits = [p.weight.shape[0] for p in projs]
        self.inter, self.act, self.row_major = mlp.gate_proj.weight.shape[0], mlp.act_fn, True
        return self

    @classmethod
    def adopt(cls, layer, *, row_major: bool = False, threads: int | None = None) -> _FusedLayer:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            raise DartError(
                f"unsupported MLP layout {type(mlp).__name__}: expected gate/up/down projections"
            )
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv, qkv_b = cls._fuse(projs, row_major)
        o, o_b = cls._fuse((attn.o_proj,), row_major)
        gu, _ = cls._fuse((mlp.gate_proj, mlp.up_proj), row_major)
        if mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None:
            raise DartError("MLP projections with biases are not supported")
        down, down_b = cls._fuse((mlp.down_proj,), row_major)
        return cls(
            qkv,
            qkv_b,
            [p.weight.shape[0] for p in projs],
            o,
            o_b,
            gu,
            mlp.gate_proj.weight.shape[0],
            down,
            down_b,
            mlp.act_fn,
            row_major,
            threads,
        )

    def qkv_proj(self, x):
        return self.qkv(x).split(self.splits, dim=-1)

    def mlp(self, x):
        gate, up = self.gu(x).split(self.inter, dim=-1)
        return self.down(self.act(gate) * up)


class NativeLayerOps:
    """The native path's layers for a block of at most MAX_ROWS rows: the embedded rows go
    through every decoder layer and the final norm in one native call
    (``dart_linear::stack`` through ``_native.LayerStack``): per layer the residual add +
    RMSNorm, the fused products, the block attention of each sequence over its own cache (q/k
    norm, RoPE, cache write, attention under the block mask; heads split between the products'
    threads) and SiLU · up -- instead of ~60 small torch ops a layer (whose dispatch cost ~17 ms
    of a 49 ms SmolLM2 step on one core of the dev box), or ~7 native calls and a few torch
    ops a layer from Python (~3-4 ms of a ~10 ms quantized step). Same arithmetic as the torch
    path up to float32 rounding of the reductions and of e^x (tests/test_models_transformer.py
    compares both with the Hugging Face forward). ``adopt`` returns None where a layer is not
    what the stack implements (plain RMSNorms of one epsilon, a SiLU-gated MLP, native
    products); then the torch path runs."""

    def __init__(self, stack):
        self.stack = stack

    @classmethod
    def adopt(cls, model: TargetModel) -> NativeLayerOps | None:
        try:
            from dartcore import _native

            _native.LayerStack  # noqa: B018 -- an older build lacks the stack
        except (ImportError, AttributeError):
            return None
        norms = [
            m
            for layer in model.layers
            for m in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        norms.append(model.norm)
        if model.qk_norm:
            norms += [
                m
                for layer in model.layers
                for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)
            ]
        if (
            not all(_plain_rms_norm(m) for m in norms)
            or len({float(m.variance_epsilon) for m in norms}) != 1
        ):
            return None
        if not all(type(layer.mlp.act_fn).__name__ in _SILU for layer in model.layers):
            return None
        # the products as the native kernel reads them (a column-major one has none)
        parts = [
            [getattr(p, "native_parts", lambda: None)() for p in (f.qkv, f.o, f.gu, f.down)]
            for f in model._fused or ()
        ]
        if not parts or any(p is None for layer in parts for p in layer):
            return None

        def view(m):
            return m.weight.detach().numpy()

        layers = []
        for layer, products in zip(model.layers, parts):
            attn = layer.self_attn
            qn, kn = (view(attn.q_norm), view(attn.k_norm)) if model.qk_norm else (None, None)
            layers.append(
                (
                    view(layer.input_layernorm),
                    view(layer.post_attention_layernorm),
                    qn,
                    kn,
                    *products,
                )
            )
        inter = model._fused[0].inter
        stack = _native.LayerStack(
            layers,
            view(model.norm),
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
            inter,
            float(model.norm.variance_epsilon),
            float(model.scale),
            model.threads,
        )
        return cls(stack)

    def layers(
        self,
        model: TargetModel,
        segments,
        tokens,
        cos,
        sin,
        tap_set,
        captured,
        prefix: int | None = None,
    ):
        """Embedding -> every layer -> final norm for n <= MAX_ROWS packed rows (``segments``:
        ``(cache, start, end, block_mask)`` per sequence, see ``TargetModel.forward_batch``);
        the final normed states ``[n, H]``, taps in ``captured``. ``prefix``: the cached rows
        the block follows (one sequence; default its cache's length)."""
        n = tokens.shape[0]
        table = model.embed
        if type(table) is BlockEmbedding and tokens.device.type == "cpu":
            try:  # the rows it looks up, without the module call and its checks
                h = table.block.dequantize_rows(tokens.numpy())
            except ValueError:  # an id out of range: the module's own error
                h = table(tokens)
        else:
            h = model.embed(tokens).contiguous()
        out = torch.empty_like(h)
        taps = sorted(t for t in tap_set if t < model.num_layers)
        tap_out = torch.empty(len(taps), n, h.shape[1]) if taps else None
        segs = [
            (
                cache.k.numpy(),
                cache.v.numpy(),
                cache.length if prefix is None else prefix,
                a,
                b,
                None if m is None else m.contiguous().numpy(),
            )
            for cache, a, b, m in segments
        ]
        self.stack.forward(
            h.numpy(),
            cos.contiguous().numpy(),
            sin.contiguous().numpy(),
            segs,
            taps,
            None if tap_out is None else tap_out.numpy(),
            out.numpy(),
        )
        for j, t in enumerate(taps):
            captured[t] = tap_out[j]
        return out


def _block_numerics(numerics: str) -> str:
    """The numerics a block model runs: ``numerics`` checked, "int8" only where its kernels run
    (else "exact", with a one-line warning)."""
    if numerics not in NUMERICS:
        raise DartError(f"numerics={numerics!r}: expected one of {NUMERICS}")
    if numerics == "int8" and int8_kernel() is None:
        warnings.warn(
            "numerics='int8' needs the integer kernels (AVX2 + FMA + F16C, the native kernels on): "
            "running numerics='exact'",
            stacklevel=3,
        )
        return "exact"
    return numerics


def _return_freed_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; elsewhere
    nothing). Loading a GGUF target frees its temporaries (the file's blocks as read, the
    unfused per-projection blocks) in pieces glibc keeps mapped: SmolLM2's Q4_1 decoder added
    145-185 MB to the process's resident memory without the trim, 82-88 MB with it (against
    the resident memory after the imports and the tokenizer, which the trim shrinks too; its
    blocks are 92 MiB). Garbage in reference cycles goes first: blocks only a cycle still held
    (~60 MB of SmolLM2's, the model's modules among them) would otherwise stay mapped until
    the collector happened to run."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


# The activation modules of a SiLU-gated MLP (transformers' and torch's).
_SILU = ("SiLUActivation", "SiLU")


def _plain_rms_norm(module) -> bool:
    """Whether ``module`` is a Hugging Face Llama-style RMSNorm (x · rsqrt(mean(x²) + eps) ·
    weight, float32 CPU weight), the one the native ops implement."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ in ("LlamaRMSNorm", "Qwen3RMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")
        and hasattr(module, "variance_epsilon")
        and w is not None
        and w.dtype == torch.float32
        and w.device.type == "cpu"
        and w.dim() == 1
        and w.is_contiguous()
    )


class _ColumnMajor:
    """``x @ w_t + b`` for a column-major (``[in, out]`` contiguous) weight: MKL's small-M
    fast path (see ``TargetModel``)."""

    __slots__ = ("w_t", "b")

    def __init__(self, w_t: torch.Tensor, b: torch.Tensor | None):
        self.w_t, self.b = w_t, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.b, x, self.w_t) if self.b is not None else torch.mm(x, self.w_t)


def column_major_linears_(module: torch.nn.Module) -> torch.nn.Module:
    """Store every ``nn.Linear`` weight of ``module`` column-major (``[in, out]``
    contiguous, the parameter a transposed view of it), in place: same values,
    same memory, and ``F.linear`` then runs MKL's fast small-M kernel (see
    :class:`TargetModel`). The DART drafter forwards d = 8 rows per round: its
    draft step took 24 ms row-major and 10.5 ms column-major on one core of the
    dev box. Autograd and ``state_dict`` keep working (save_pretrained copies
    to contiguous tensors)."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear) and m.weight.is_contiguous() and m.weight.dim() == 2:
                m.weight.data = m.weight.data.t().contiguous().t()
    return module
