"""Tree verification for hybrid targets: Gated DeltaNet + full-attention layers (``qwen3_next``,
``qwen3_5_text``: ``Qwen3_5ForCausalLM``).

A Gated DeltaNet layer carries no per-token keys: each sequence has one short-convolution
state (the last ``K`` inputs of the layer's causal depthwise conv) and one recurrent state
(``[heads, key_dim, value_dim]``, the gated delta rule's memory). In a draft tree node i's
states are its parent's updated with i's token. :class:`HybridTarget` verifies a whole tree in
one forward: the projections, norms, MLPs and the full-attention layers (tree mask over the KV
cache, as :class:`~dartcore.models.transformer.TargetModel`) run over every node at once, and
each Gated DeltaNet layer runs the tree in one of two forms (``tree_form``):

* ``"parallel"`` (default): every node at once, in the chunked form of the delta rule with the
  tree's ancestor mask in place of the causal one (each node's conv window gathered along its
  root path). No node's recurrent state is formed; the committed node's is computed on commit.
* ``"recurrent"``: level by level (all nodes of a depth together, each from its parent's states,
  the root from the committed ones) through Hugging Face's own one-token functions
  (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``, what its decoding steps
  run); every node's states are formed. The reference form. On CUDA (or forced with
  :func:`~dartcore.kernels.tree_attention.force_backend`) the same per-node recurrence runs as
  two Triton launches per layer (:mod:`dartcore.kernels.triton_delta`).

:class:`HybridCache` holds the block's states until acceptance commits the accepted path's last
node (``compact``) or the block's last row (``commit``); the other nodes' are dropped. A causal
block (the prompt) goes through HF's ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
as its prefill does (those dispatch to ``flash-linear-attention`` and ``causal-conv1d`` where
installed, as they do in HF's own forward). Greedy outputs equal ``generate(do_sample=False)``'s in both forms
(tests/test_models_hybrid.py). The HF modules (embedding, norms, projections, gated RMSNorm,
MLP or MoE block, LM head) are called as they are: nothing is copied.

Cost (tools/bench_hybrid_verify.py): the parallel form's DeltaNet work grows with the tree's
rows like attention's, the recurrent form's with its node count times the state size (each
node's ``heads x key_dim x value_dim`` state is formed and copied). The products of 1-16 rows
(a step's, a tree's) run through dartcore's native small-batch kernel on a float32 CPU
(``native_products``), everything else on torch's kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from dartcore.errors import ContextLengthError, DartError, TreeError
from dartcore.kernels.linear import linear_threads, native_linear_available, native_linears_
from dartcore.kernels.tree_attention import backend_for, tree_attention
from dartcore.models.cache import KVCache
from dartcore.models.transformer import ForwardOutput, TargetModel, check_batch

__all__ = [
    "HybridTarget",
    "HybridCache",
    "HYBRID_FAMILIES",
    "make_target",
    "state_bytes_per_node",
    "tree_parents",
]

# model_type -> the transformers module whose conv / delta-rule functions the family runs
_HF_MODULES = {
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "qwen3_5_text": "transformers.models.qwen3_5.modeling_qwen3_5",
}
HYBRID_FAMILIES = tuple(_HF_MODULES)
# How a Gated DeltaNet layer verifies a tree (HybridTarget's ``tree_form``).
TREE_FORMS = ("parallel", "recurrent")


def make_target(hf_model, **kwargs):
    """The lean target of ``hf_model``: :class:`HybridTarget` for a hybrid family
    (:data:`HYBRID_FAMILIES`), else :class:`~dartcore.models.transformer.TargetModel`."""
    if getattr(hf_model.config, "model_type", None) in HYBRID_FAMILIES:
        return HybridTarget(hf_model)
    return TargetModel(hf_model, **kwargs)


def tree_parents(block_mask: torch.Tensor | None, n: int) -> np.ndarray:
    """Each row's parent in a block (-1: the committed prefix) from its ancestor mask
    (``mask[i, j]``: row i sees row j; None = causal, a chain). A row's parent is the last row
    it sees before itself, and it must see exactly its parent's rows and itself: anything
    else is not a tree a recurrent layer can verify."""
    if block_mask is None:
        return np.arange(-1, n - 1, dtype=np.int64)
    m = block_mask.detach().to("cpu", torch.bool).numpy()
    if m.shape != (n, n) or not m.diagonal().all() or np.triu(m, 1).any():
        raise TreeError("a recurrent layer needs a tree mask: rows see themselves and earlier rows")
    parents = np.full(n, -1, dtype=np.int64)
    for i in range(1, n):
        seen = np.flatnonzero(m[i, :i])
        if seen.size:
            p = int(seen[-1])
            parents[i] = p
            want = m[p, :i].copy()
            want[p] = True
            if not np.array_equal(m[i, :i], want):
                raise TreeError(f"row {i} of the block mask does not see exactly its ancestors")
        elif m[i, :i].any():
            raise TreeError(f"row {i} of the block mask is not a tree row")
    return parents


def state_bytes_per_node(
    config: Mapping[str, Any], *, conv_bytes: int = 2, state_bytes: int = 4, kv_bytes: int = 2
) -> dict[str, int]:
    """What one tree node's staged states cost during verification, from a model's config
    (``config.json``'s text config as a dict): per Gated DeltaNet layer the conv window
    (``conv_dim x kernel`` in the model's dtype, ``conv_bytes``) and the recurrent state
    (``value_heads x key_dim x value_dim``, float32 as :class:`HybridCache` holds it), those
    times the hybrid layers for the model, and for comparison the node's keys and values in the
    full-attention layers (``kv_bytes`` per element). A tree of n nodes stages n of each."""
    try:
        hk, hv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
        dk, dv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
        kernel = int(config["linear_conv_kernel_dim"])
        layers = int(config["num_hidden_layers"])
        kinds = config.get("layer_types")
        if kinds is None:  # HF's default pattern: every interval-th layer is full attention
            interval = int(config.get("full_attention_interval", 4))
            kinds = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(layers)
            ]
        kv_heads = int(config["num_key_value_heads"])
        head_dim = int(
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        )
    except KeyError as e:
        raise DartError(f"a hybrid config needs {e.args[0]!r}") from None
    if len(kinds) != layers:
        raise DartError(f"layer_types has {len(kinds)} entries for {layers} layers")
    linear = sum(k == "linear_attention" for k in kinds)
    full = sum(k == "full_attention" for k in kinds)
    conv = (2 * hk * dk + hv * dv) * kernel * conv_bytes
    rec = hv * dk * dv * state_bytes
    return {
        "linear_layers": linear,
        "full_attention_layers": full,
        "conv_bytes_per_layer": conv,
        "recurrent_bytes_per_layer": rec,
        "state_bytes_per_layer": conv + rec,
        "state_bytes_per_node": linear * (conv + rec),
        "kv_bytes_per_node": full * 2 * kv_heads * head_dim * kv_bytes,
    }


class _TreePlan:
    """One block's tree structure, worked out once per forward and shared by every Gated
    DeltaNet layer: ``parents``, and (on first use) each row's ancestors-or-self ``anc``
    ``[m, m]`` and its conv window's source columns ``windows(K)`` ``[m, K]`` (of
    [committed conv state | block inputs]: its K last inputs along its root path, the
    committed state's newest columns above the root)."""

    def __init__(self, parents: np.ndarray, device: torch.device):
        self.parents = parents
        self.device = device
        self._anc: torch.Tensor | None = None
        self._cols: dict[int, torch.Tensor] = {}

    @property
    def anc(self) -> torch.Tensor:
        if self._anc is None:
            m = len(self.parents)
            anc = np.zeros((m, m), dtype=bool)
            for i, p in enumerate(self.parents):
                if p >= 0:
                    anc[i] = anc[p]
                anc[i, i] = True
            self._anc = torch.from_numpy(anc).to(self.device)
        return self._anc

    def windows(self, kernel: int) -> torch.Tensor:
        if kernel not in self._cols:
            m = len(self.parents)
            cols = np.empty((m, kernel), dtype=np.int64)
            for i in range(m):
                j, back = i, 0
                for t in range(kernel - 1, -1, -1):
                    if j >= 0:
                        cols[i, t], j = kernel + j, int(self.parents[j])
                    else:
                        cols[i, t], back = kernel - 1 - back, back + 1
            self._cols[kernel] = torch.from_numpy(cols).to(self.device)
        return self._cols[kernel]


class HybridCache:
    """One sequence's state on a hybrid target: a :class:`~dartcore.models.cache.KVCache` over
    the full-attention layers (``kv``), and per Gated DeltaNet layer the committed conv state
    ``conv[j]`` (``[conv_dim, K]``, Hugging Face's layout: the last K inputs) and recurrent
    state ``rec[j]`` (``[heads, key_dim, value_dim]`` float32), after every committed token.

    A forward stages the states of its block's rows; :meth:`commit` (a causal block: prefill,
    plain steps) keeps the last row's, :meth:`compact` (an accepted tree path) the path's last
    node's, and drops the rest. Same interface as ``KVCache`` where the decoding round uses it.

    Rewinding: a KV cache forgets a suffix by shortening its length, a recurrent state cannot
    (it folds every token in). :meth:`checkpoint` keeps a copy of the states at the current
    length; :meth:`truncate` goes back to a kept length (or to 0: zero states) and raises
    :class:`~dartcore.errors.DartError` for any other. Speculative rounds need no rewind: a
    rejected draft's states are never committed.
    """

    def __init__(
        self,
        kv: KVCache,
        linear_layers: int,
        conv_dim: int,
        kernel: int,
        heads: int,
        key_dim: int,
        value_dim: int,
        *,
        dtype: torch.dtype,
    ):
        dev = kv.k.device
        self.kv = kv
        self.conv = torch.zeros(linear_layers, conv_dim, kernel, dtype=dtype, device=dev)
        self.rec = torch.zeros(linear_layers, heads, key_dim, value_dim, device=dev)
        # the last block's staged states: row -> index, and per layer (conv [m, ...], rec [m, ...])
        self._rows: dict[int, int] = {}
        self._staged: dict[int, tuple[torch.Tensor, Any]] = {}
        # committed length -> copies of (conv, rec) at that length (checkpoint / truncate)
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def capacity(self) -> int:
        return self.kv.capacity

    def check_block(self, n: int) -> None:
        self.kv.check_block(n)

    def stage(self, layer: int, rows: Sequence[int], conv: torch.Tensor, rec):
        """Hold ``rows``' states (``conv [m, conv_dim, K]``; ``rec [m, heads, dk, dv]``, or a
        function of the row's index that computes its state on commit) of Gated DeltaNet layer
        ``layer`` until the block is committed."""
        index = {int(r): i for i, r in enumerate(rows)}
        if self._staged and index != self._rows:
            raise DartError("every Gated DeltaNet layer stages the same rows of a block")
        self._rows = index
        self._staged[layer] = (conv, rec)

    def begin(self) -> None:
        """Drop whatever an earlier forward staged (a new block starts)."""
        self._rows, self._staged = {}, {}

    def _keep(self, row: int) -> None:
        if not self.conv.shape[0]:  # no Gated DeltaNet layer
            return
        if len(self._staged) != self.conv.shape[0] or row not in self._rows:
            raise DartError(f"no staged recurrent state for block row {row}")
        i = self._rows[row]
        for layer, (conv, rec) in self._staged.items():
            self.conv[layer].copy_(conv[i])
            self.rec[layer].copy_(rec(i) if callable(rec) else rec[i])
        self.begin()

    def commit(self, n: int) -> None:
        """Keep the whole causal block of ``n`` rows: its keys, and its last row's states."""
        if self.length + n > self.capacity:
            raise ContextLengthError(f"commit of {n} rows past capacity {self.capacity}")
        self._keep(n - 1)
        self.kv.commit(n)

    def compact(self, block_rows) -> None:
        """Keep rows ``block_rows`` of the block (an accepted path, root first): their keys,
        and the last one's states."""
        rows = [int(r) for r in block_rows]
        if not rows:
            self.begin()
            return
        self._keep(rows[-1])
        self.kv.compact(rows)

    def checkpoint(self) -> int:
        """Keep a copy of the committed states at the current length (``conv`` and ``rec``:
        per Gated DeltaNet layer, what one tree node costs, see :func:`state_bytes_per_node`),
        so that :meth:`truncate` can come back to it. Returns that length."""
        self._kept[self.length] = (self.conv.clone(), self.rec.clone())
        return self.length

    @property
    def kept_lengths(self) -> list[int]:
        """The lengths :meth:`truncate` can go back to (0 and the checkpoints)."""
        return sorted({0, *self._kept})

    def truncate(self, length: int) -> None:
        """Forget every committed token from ``length`` on: the KV cache shortens, the
        recurrent and conv states come back from the checkpoint at ``length`` (zero states at
        0). Checkpoints past ``length`` are dropped; a length without one raises."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if length == self.length:
            return
        if length == 0:
            self.conv.zero_()
            self.rec.zero_()
        elif length in self._kept:
            conv, rec = self._kept[length]
            self.conv.copy_(conv)
            self.rec.copy_(rec)
        else:
            raise DartError(
                f"no recurrent state kept at length {length} (kept: {self.kept_lengths}): "
                "a Gated DeltaNet state cannot be rewound; checkpoint() at that length first"
            )
        self.begin()
        self.kv.truncate(length)
        self._kept = {n: st for n, st in self._kept.items() if n <= length}


class HybridTarget:
    """The lean forward of a Hugging Face ``Qwen3NextForCausalLM`` or ``Qwen3_5ForCausalLM``
    (Gated DeltaNet and full-attention layers, dense MLP or MoE; text positions: Qwen3.5's
    multimodal RoPE sections then all rotate by the one position), in the interface of
    :class:`~dartcore.models.transformer.TargetModel` that the decoding round uses
    (``new_cache``, ``forward``, ``forward_batch``, ``logits``).

    ``tree_form``: how the DeltaNet layers verify a tree (module docs; ``"parallel"`` or
    ``"recurrent"``). ``native_products`` (default: on for float32 CPU weights where the kernel
    runs): the decoder layers' and LM head's ``nn.Linear`` modules run 2-D inputs of 1-16 rows
    through dartcore's native small-batch kernel, in place
    (:func:`~dartcore.kernels.linear.native_linears_`; HF's own forward passes them 3-D inputs,
    which keep ``F.linear``, except in its MoE block). The rest runs on torch's kernels, and
    the decoder takes the torch backend (``native_linear`` False: no native layer stack)."""

    native_linear = False
    blocks = False
    numerics = "exact"

    def __init__(
        self, hf_model, *, tree_form: str = "parallel", native_products: bool | None = None
    ):
        if tree_form not in TREE_FORMS:
            raise DartError(f"tree_form={tree_form!r}: expected one of {TREE_FORMS}")
        self.tree_form = tree_form
        config = hf_model.config
        family = getattr(config, "model_type", None)
        if family not in HYBRID_FAMILIES:
            raise DartError(f"HybridTarget supports {HYBRID_FAMILIES}, got {family!r}")
        import importlib

        self._hf_ops = importlib.import_module(_HF_MODULES[family])
        self.hf = hf_model
        self.config = config
        self.family = family
        inner = hf_model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        self.num_layers = len(self.layers)
        self.hidden_size = config.hidden_size
        self.vocab_size = self.lm_head.weight.shape[0]
        self.max_positions = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        self.kinds = list(config.layer_types)
        if len(self.kinds) != self.num_layers or set(self.kinds) - {
            "linear_attention",
            "full_attention",
        }:
            raise DartError(f"unsupported layer types {sorted(set(self.kinds))}")
        # index of each layer among its kind (KV cache layer / recurrent state layer)
        self.slot = []
        counts = {"linear_attention": 0, "full_attention": 0}
        for kind in self.kinds:
            self.slot.append(counts[kind])
            counts[kind] += 1
        self.num_linear = counts["linear_attention"]
        self.num_full = counts["full_attention"]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        rotary = inner.rotary_emb
        if getattr(rotary, "rope_type", "default") != "default":
            raise DartError(f"RoPE type {rotary.rope_type!r} is not supported by HybridTarget")
        self._inv_freq = rotary.inv_freq.detach().float()
        self._rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._rope_table = None  # TargetModel._rope's
        lin = next(
            (layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")), None
        )
        self.conv_dim = lin.conv_dim if lin is not None else 0
        self.conv_kernel = lin.conv_kernel_size if lin is not None else 1
        self.lin_heads = lin.num_v_heads if lin is not None else 0
        self.lin_key_dim = lin.head_k_dim if lin is not None else 0
        self.lin_value_dim = lin.head_v_dim if lin is not None else 0
        self.threads = linear_threads()
        if native_products is None:
            native_products = (
                self.dtype == torch.float32
                and self.device.type == "cpu"
                and native_linear_available()
            )
        self.native_products = bool(native_products)
        if self.native_products:
            # 1-16 row products (a step's, a tree's) through the native small-batch kernel, in
            # place on the HF modules (other inputs, and HF's own 3-D calls, keep F.linear)
            for layer in self.layers:
                native_linears_(layer, threads=self.threads)
            native_linears_(self.lm_head, threads=self.threads)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def kv_layers(self) -> int:
        """Layers with a KV cache (the full-attention ones; at least one slot)."""
        return max(1, self.num_full)

    def new_cache(self, capacity: int) -> HybridCache:
        if self.max_positions is not None:
            capacity = min(capacity, self.max_positions)
        kv = KVCache(
            self.kv_layers,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            dtype=self.dtype,
            device=self.device,
        )
        return self.pool_cache(kv)

    def pool_cache(self, kv: KVCache) -> HybridCache:
        """A sequence's cache over ``kv`` (a fresh one, or a slot of the batched engine's
        :class:`~dartcore.models.kv_pool.KVPool`) with zero recurrent states (allocated here:
        the pool holds the full-attention layers' KV only)."""
        return HybridCache(
            kv,
            self.num_linear,
            self.conv_dim,
            self.conv_kernel,
            self.lin_heads,
            self.lin_key_dim,
            self.lin_value_dim,
            dtype=self.dtype,
        )

    # One tree forward over the cache, the same entry as the transformer's (its forward_batch
    # does the hybrid work); plain greedy decoding and the RoPE table likewise.
    forward = TargetModel.forward
    greedy_generate = TargetModel.greedy_generate
    _rope = TargetModel._rope
    _rope_values = TargetModel._rope_values

    @torch.inference_mode()
    def forward_batch(
        self,
        caches: Sequence[HybridCache],
        sizes: Sequence[int],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_masks: Sequence[torch.Tensor | None],
        *,
        taps: Sequence[int] = (),
        logits_rows: torch.Tensor | slice | None = None,
    ) -> ForwardOutput:
        """Several sequences' blocks packed in one pass (see ``TargetModel.forward_batch``)."""
        tap_set = check_batch(self, caches, sizes, tokens, positions, block_masks, taps)
        dev = self.device
        tokens, positions = tokens.to(dev), positions.to(dev)
        segments, a = [], 0
        for cache, size, m in zip(caches, sizes, block_masks):
            cache.begin()
            size = int(size)
            plan = _TreePlan(tree_parents(m, size), dev)
            segments.append((cache, a, a + size, None if m is None else m.to(dev), plan))
            a += size
        cos, sin = self._rope(positions)
        captured: dict[int, torch.Tensor] = {}
        h = self.embed(tokens)
        for i, layer in enumerate(self.layers):
            if i in tap_set:
                captured[i] = h
            x = layer.input_layernorm(h)
            if self.kinds[i] == "linear_attention":
                h = h + self._delta_net(layer.linear_attn, self.slot[i], x, segments)
            else:
                h = h + self._attention(layer.self_attn, self.slot[i], x, cos, sin, segments)
            x = layer.post_attention_layernorm(h)
            if hasattr(layer.mlp, "experts"):  # the MoE block takes [batch, rows, H]
                out = layer.mlp(x[None])
                h = h + (out[0] if isinstance(out, tuple) else out)[0]
            else:
                h = h + layer.mlp(x)
        h = self.norm(h)
        if self.num_layers in tap_set:
            captured[self.num_layers] = h
        rows = h if logits_rows is None else h[logits_rows]
        tap_out = torch.cat([captured[int(t)] for t in taps], dim=-1) if len(taps) else None
        return ForwardOutput(logits=self.logits(rows), taps=tap_out, hidden=h)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on final normed hidden states ``[m, H]`` -> float32 ``[m, V]``."""
        if hidden.shape[0] == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=hidden.device)
        return self.lm_head(hidden).float()

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [heads, n, head_dim]; partial rotary (HF's apply_rotary_pos_emb): the first
        # rotary_dim dimensions rotate, the rest pass through.
        r = cos.shape[-1]
        rot, keep = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, keep), dim=-1)

    def _attention(self, attn, slot: int, x, cos, sin, segments) -> torch.Tensor:
        """A gated full-attention layer (q|gate projection, q/k norms, partial RoPE, output
        gate) over each sequence's KV cache under its block mask."""
        n, hd = x.shape[0], self.head_dim
        q, gate = torch.chunk(attn.q_proj(x).view(n, -1, hd * 2), 2, dim=-1)
        gate = gate.reshape(n, -1)
        q = attn.q_norm(q.reshape(n, -1, hd)).transpose(0, 1)
        k = attn.k_norm(attn.k_proj(x).view(n, -1, hd)).transpose(0, 1)
        v = attn.v_proj(x).view(n, -1, hd).transpose(0, 1)
        q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        outs = []
        for cache, a, b, mask, _ in segments:
            kv = cache.kv
            kv.write(slot, k[:, a:b], v[:, a:b])
            keys, values = kv.view(slot, b - a)
            outs.append(tree_attention(q[:, a:b], keys, values, kv.length, mask, scale=self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        out = out.transpose(0, 1).reshape(n, -1)
        return attn.o_proj(out * torch.sigmoid(gate))

    def _delta_net(self, net, slot: int, x, segments) -> torch.Tensor:
        """A Gated DeltaNet layer: each sequence's causal block (a prompt) in HF's chunked
        form, a tree (or one step) node by node from its parent's states, level by level."""
        hf = self._hf_ops
        if hasattr(net, "in_proj_qkvz"):  # qwen3_next: q|k|v|z and b|a grouped per key head
            q, k, v, z, b, a = net.fix_query_key_value_ordering(
                net.in_proj_qkvz(x)[None], net.in_proj_ba(x)[None]
            )
            mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (q, k, v)], dim=-1)[0]
        else:  # qwen3_5: one projection each
            mixed = net.in_proj_qkv(x)  # [n, C]
            z = net.in_proj_z(x).reshape(1, x.shape[0], -1, net.head_v_dim)
            b, a = net.in_proj_b(x)[None], net.in_proj_a(x)[None]
        beta = b[0].sigmoid()  # [n, Hv]
        g = -net.A_log.float().exp() * torch.nn.functional.softplus(a[0].float() + net.dt_bias)
        weight = net.conv1d.weight.squeeze(1)
        core = []
        for cache, r0, r1, mask, plan in segments:
            m = r1 - r0
            if mask is None and m > 1:
                core.append(
                    self._delta_block(net, slot, cache, mixed[r0:r1], g[r0:r1], beta[r0:r1])
                )
            elif self.tree_form == "parallel":
                core.append(
                    self._delta_parallel(
                        net, slot, cache, mixed[r0:r1], g[r0:r1], beta[r0:r1], plan, weight
                    )
                )
            else:
                core.append(
                    self._delta_tree(
                        net,
                        slot,
                        cache,
                        mixed[r0:r1],
                        g[r0:r1],
                        beta[r0:r1],
                        plan.parents,
                        weight,
                        hf,
                    )
                )
        out = core[0] if len(core) == 1 else torch.cat(core)  # [n, Hv, Dv]
        zf = z[0].reshape(-1, z.shape[-1])
        out = net.norm(out.reshape(-1, out.shape[-1]), zf).reshape(x.shape[0], -1)
        return net.out_proj(out)

    def _split_heads(self, net, mixed):
        """Conv outputs ``[rows, C]`` -> query, key ``[rows, Hk, Dk]``, value ``[rows, Hv, Dv]``."""
        qq, kk, vv = torch.split(mixed, [net.key_dim, net.key_dim, net.value_dim], dim=-1)
        rows = mixed.shape[0]
        return (
            qq.reshape(rows, -1, net.head_k_dim),
            kk.reshape(rows, -1, net.head_k_dim),
            vv.reshape(rows, -1, net.head_v_dim),
        )

    def _delta_block(self, net, slot, cache: HybridCache, mixed, g, beta) -> torch.Tensor:
        """A causal block after the committed states, as HF's prefill runs it: the causal conv
        over (committed conv state +) the block, the chunked delta rule; stages the block's
        last row's states."""
        hf = self._hf_ops
        m, kernel = mixed.shape[0], net.conv_kernel_size
        x = mixed.t()[None]  # [1, C, m]
        fresh = cache.length == 0
        full = x if fresh else torch.cat([cache.conv[slot][None], x], dim=-1)
        conv_out = hf.causal_conv1d_fn(
            full, net.conv1d.weight.squeeze(1), net.conv1d.bias, activation=net.activation
        )[:, :, -m:]
        if full.shape[-1] < kernel:
            full = torch.nn.functional.pad(full, (kernel - full.shape[-1], 0), value=0)
        conv_state = full[0, :, -kernel:].clone()
        q, k, v = self._split_heads(net, conv_out[0].t())
        out, state = hf.torch_chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g=g[None],
            beta=beta[None],
            initial_state=None if fresh else cache.rec[slot][None].clone(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        cache.stage(slot, [m - 1], conv_state[None], state.float())
        return out[0]

    def _delta_tree(
        self, net, slot, cache: HybridCache, mixed, g, beta, parents, weight, hf
    ) -> torch.Tensor:
        """Tree rows (or one step): level by level, every node of a depth from its parent's
        conv and recurrent states (the root's parent: the committed ones), through HF's
        one-token ``causal_conv1d_update`` and ``torch_recurrent_gated_delta_rule``; stages
        every node's states."""
        m = mixed.shape[0]
        if backend_for(mixed.device) == "triton":
            return self._delta_tree_triton(net, slot, cache, mixed, g, beta, parents, weight)
        depth = np.zeros(m, dtype=np.int64)
        for i in range(m):
            depth[i] = 0 if parents[i] < 0 else depth[parents[i]] + 1
        conv_states = torch.empty(
            (m, *cache.conv.shape[1:]), dtype=cache.conv.dtype, device=mixed.device
        )
        rec_states = torch.empty(
            (m, *cache.rec.shape[1:]), dtype=cache.rec.dtype, device=mixed.device
        )
        out = torch.empty(
            m, net.num_v_heads, net.head_v_dim, dtype=mixed.dtype, device=mixed.device
        )
        for d in range(int(depth.max()) + 1):
            rows = np.flatnonzero(depth == d)
            par = parents[rows]
            idx = torch.from_numpy(rows).to(mixed.device)
            if d == 0:
                conv0 = cache.conv[slot][None].expand(len(rows), -1, -1).clone()
                rec0 = cache.rec[slot][None].expand(len(rows), -1, -1, -1)
            else:
                pidx = torch.from_numpy(par).to(mixed.device)
                conv0 = conv_states[pidx].clone()
                rec0 = rec_states[pidx]
            # conv0 is updated in place to the rows' own conv states
            conv_out = hf.causal_conv1d_update(
                mixed[idx][:, :, None], conv0, weight, net.conv1d.bias, net.activation
            )
            q, k, v = self._split_heads(net, conv_out[:, :, 0])
            o, state = hf.torch_recurrent_gated_delta_rule(
                q[:, None],
                k[:, None],
                v[:, None],
                g=g[idx][:, None],
                beta=beta[idx][:, None],
                initial_state=rec0,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            conv_states[idx] = conv0
            rec_states[idx] = state.float()
            out[idx] = o[:, 0]
        cache.stage(slot, range(m), conv_states, rec_states)
        return out

    def _delta_tree_triton(self, net, slot, cache: HybridCache, mixed, g, beta, parents, weight):
        """:meth:`_delta_tree` in two Triton launches (CUDA, or the interpreter): the tree's
        conv windows, then the delta rule node by node from the parent's state
        (:mod:`dartcore.kernels.triton_delta`); stages every node's states."""
        from dartcore.kernels.triton_delta import tree_conv_triton, tree_delta_rule_triton

        conv_out, conv_states = tree_conv_triton(
            mixed, parents, cache.conv[slot], weight, net.conv1d.bias, net.activation
        )
        q, k, v = self._split_heads(net, conv_out)
        out, rec_states = tree_delta_rule_triton(q, k, v, g, beta, parents, cache.rec[slot])
        cache.stage(slot, range(mixed.shape[0]), conv_states, rec_states)
        return out

    def _delta_parallel(self, net, slot, cache: HybridCache, mixed, g, beta, plan, weight):
        """Tree rows (or one step) at once, in the chunked form of the delta rule with the
        tree's ancestor mask in place of the causal one: along each root path the gated
        decays are the path's cumulative sums and the (I + A)^-1 of the chunked form is the
        path's own (A is nonzero only between a node and its ancestors, a set closed under
        taking ancestors, so each path's block of the inverse is its chain's inverse). No node's
        recurrent state is formed: a committed node's is computed on commit from the block's
        keys and corrected values, O(n) rows instead of n states. Same arithmetic as HF's
        chunked prefill on a chain."""
        hf = self._hf_ops
        m, kernel = mixed.shape[0], net.conv_kernel_size
        dev = mixed.device
        # conv windows: each node's K last inputs along its root path (the committed state's
        # columns above the root), the columns of [committed state | block inputs]
        src = torch.cat([cache.conv[slot].t(), mixed])  # [K + m, C]
        cols = plan.windows(kernel)
        windows = src.index_select(0, cols.reshape(-1)).view(m, kernel, -1).transpose(1, 2)
        conv_out = (windows * weight).sum(-1)  # [m, C]: the depthwise conv's last output
        if net.conv1d.bias is not None:
            conv_out = conv_out + net.conv1d.bias
        conv_out = hf.ACT2FN[net.activation](conv_out).to(mixed.dtype)
        q, k, v = self._split_heads(net, conv_out)
        rep = net.num_v_heads // net.num_k_heads
        if rep > 1:
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        # [heads, m, d] float32; q and k l2-normed, q scaled, as the HF kernels do
        q, k, v = (t.transpose(0, 1).float() for t in (q, k, v))
        q = hf.l2norm(q, dim=-1, eps=1e-6) / (q.shape[-1] ** 0.5)
        k = hf.l2norm(k, dim=-1, eps=1e-6)
        beta = beta.t().float()[..., None]
        anc = plan.anc
        G = g.t() @ anc.t().float()  # [heads, m]: the decays' sums along each root path
        decay = torch.where(anc, G[:, :, None] - G[:, None, :], float("-inf")).exp()
        kb, vb = k * beta, v * beta
        strict = anc & ~torch.eye(m, dtype=torch.bool, device=dev)
        A = torch.where(strict, (kb @ k.transpose(-1, -2)) * decay, 0.0)
        eye = torch.eye(m, device=dev).expand_as(A)
        T = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
        S0 = cache.rec[slot]  # [heads, dk, dv]
        v_new = T @ vb - (T @ (kb * G.exp()[..., None])) @ S0  # [heads, m, dv]
        out = (q * G.exp()[..., None]) @ S0 + ((q @ k.transpose(-1, -2)) * decay) @ v_new

        def state(i: int) -> torch.Tensor:
            return (
                S0 * G[:, i].exp()[:, None, None]
                + (k * decay[:, i, :, None]).transpose(-1, -2) @ v_new
            )

        cache.stage(slot, range(m), windows, state)
        return out.transpose(0, 1).to(mixed.dtype)
