"""The batched engine's key/value memory: one preallocated pool of ragged slots.

Layout: target keys/values ``[slots, layers, kv_heads, capacity, head_dim]`` and, with a
drafter, its keys/values ``[slots, nkv, capacity, head_dim]``, allocated once when the
engine is made. A running sequence owns one slot; :meth:`KVPool.acquire` hands out a
:class:`~dartcore.models.cache.KVCache` (and a drafter state) that are views of that slot,
so every step function written for one sequence (the forward's cache write, the tree
attention, compaction) works on it unchanged. Nothing is allocated per step or per request.

Why slots, not pages: every attention implementation here -- the torch reference, the
native ``block_attention`` and the Triton kernel -- reads a sequence's prefix as one
contiguous ``[kv_heads, length, head_dim]`` range. Pages would need a gather per layer per
step (or three new kernels) to serve that; a slot is one strided view. The cost is memory
for ``capacity`` tokens per slot whether a sequence uses them or not: SmolLM2-135M keeps
46 KiB per token (30 layers x 3 KV heads x 64 x 2 x fp32), so 16 slots of 1,024 tokens are
0.75 GiB. Callers size ``capacity`` to their requests (``generate_batch`` does).
"""

from __future__ import annotations

import torch

from dartcore.errors import DartError
from dartcore.models.cache import KVCache

__all__ = ["KVPool", "PoolFullError"]


class PoolFullError(DartError):
    """Every slot of the pool is taken (the engine queues requests instead of raising)."""


class KVPool:
    """``slots`` sequences of up to ``capacity`` tokens each (see the module docs).
    ``drafter_shape``: ``(nkv, head_dim, dtype)`` of the drafter's KV, or None."""

    def __init__(
        self,
        *,
        slots: int,
        capacity: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        drafter_shape: tuple | None = None,
    ):
        if slots < 1 or capacity < 2:
            raise ValueError(
                f"a KV pool needs at least one slot of two tokens, got {slots} x {capacity}"
            )
        self.slots, self.capacity = int(slots), int(capacity)
        shape = (slots, layers, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.dk = self.dv = None
        if drafter_shape is not None:
            nkv, dhd, ddtype = drafter_shape
            self.dk = torch.zeros(slots, nkv, capacity, dhd, dtype=ddtype, device=device)
            self.dv = torch.zeros_like(self.dk)
        self._free = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        # the target's cache around a slot's KV (a hybrid target's adds its recurrent states)
        self.wrap = None

    @classmethod
    def for_target(cls, target, drafter, *, slots: int, capacity: int) -> KVPool:
        """A pool for ``target`` (a :class:`~dartcore.models.transformer.TargetModel`) and
        ``drafter`` (or None)."""
        if target.max_positions is not None:
            capacity = min(capacity, target.max_positions)
        dshape = None
        if drafter is not None:
            p = drafter.fc.weight
            dshape = (drafter.config.num_key_value_heads, drafter.config.head_dim, p.dtype)
        pool = cls(
            slots=slots,
            capacity=capacity,
            layers=getattr(target, "kv_layers", target.num_layers),
            kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            dtype=target.dtype,
            device=target.device,
            drafter_shape=dshape,
        )
        pool.wrap = getattr(target, "pool_cache", None)
        return pool

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size()
            for t in (self.k, self.v, self.dk, self.dv)
            if t is not None
        )

    def acquire(self) -> tuple[int, KVCache, object]:
        """(slot, target cache, drafter state or None), both empty views of a free slot."""
        if not self._free:
            raise PoolFullError(f"all {self.slots} KV slots are in use: release one first")
        slot = self._free.pop()
        cache = KVCache.over(self.k[slot], self.v[slot])
        if self.wrap is not None:
            cache = self.wrap(cache)
        dstate = None
        if self.dk is not None:
            from dartcore.drafter import DrafterState

            dstate = DrafterState.over(self.dk[slot], self.dv[slot])
        return slot, cache, dstate

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.slots or slot in self._free:
            raise DartError(f"KV slot {slot} is not in use")
        self._free.append(slot)
