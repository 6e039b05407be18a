"""A preallocated, batch-1 key/value cache with explicit slots.

Layout: ``k`` and ``v`` are ``[layers, kv_heads, capacity, head_dim]``. Slots
``[0, length)`` hold the committed prefix, in position order (slot == position).
A forward writes its block of ``n`` new rows to slots ``[length, length + n)``
and leaves ``length`` alone; the caller then either commits the whole block
(prefill, plain autoregressive steps) or keeps only an accepted tree path,
which :meth:`KVCache.compact` moves in place to contiguous slots.

The cache never grows and nothing is ever written past ``capacity``:
:meth:`check_block` raises :class:`~dartcore.errors.ContextLengthError` before
a forward that would not fit (the decoder sizes its trees so it never does).
"""

from __future__ import annotations

import torch

from dartcore.errors import ContextLengthError

__all__ = ["KVCache"]


class KVCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        shape = (layers, kv_heads, capacity, head_dim)
        # Every read covers slots a forward wrote first, so on the CPU the storage is left as
        # allocated: zeroing a fresh cache (~20 MB for SmolLM2 and a 128-token output) cost
        # ~18 ms a generate call, mostly page faults the writes then never pay again.
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0  # committed slots

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache on existing storage ``[layers, kv_heads, capacity, head_dim]`` (contiguous),
        empty: a slot of a :class:`~dartcore.models.kv_pool.KVPool`. Nothing is allocated."""
        if k.shape != v.shape or k.dim() != 4 or not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError(
                f"KV storage must be two contiguous [layers, kv_heads, capacity, head_dim] tensors, "
                f"got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        cache.capacity = int(k.shape[2])
        cache.length = 0
        return cache

    def check_block(self, n: int) -> None:
        """Raise unless a block of ``n`` rows fits after the committed prefix."""
        if n <= 0:
            raise ValueError("a forward needs at least one token")
        if self.length + n > self.capacity:
            raise ContextLengthError(
                f"{n} new rows after {self.length} cached tokens exceed the KV cache "
                f"capacity of {self.capacity}"
            )

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a block ``[kv_heads, n, head_dim]`` at slots ``[length, length + n)``."""
        n = k.shape[1]
        end = self.length + n
        if end > self.capacity:  # check_block ran first; this is the last line of defence
            raise ContextLengthError(f"KV write to slot {end - 1} past capacity {self.capacity}")
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v

    def view(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the committed prefix plus the current block of ``n``."""
        end = self.length + n
        return self.k[layer, :, :end], self.v[layer, :, :end]

    def commit(self, n: int) -> None:
        """Keep the whole block of ``n`` rows just written."""
        if self.length + n > self.capacity:
            raise ContextLengthError(f"commit of {n} rows past capacity {self.capacity}")
        self.length += n

    def compact(self, block_rows: torch.Tensor | list[int]) -> None:
        """Keep only rows ``block_rows`` (indices into the block just written,
        strictly increasing, e.g. an accepted tree path), moved to contiguous
        slots right after the prefix; everything after them is garbage."""
        if isinstance(block_rows, (list, tuple)) and list(block_rows) == list(
            range(len(block_rows))
        ):
            self.commit(len(block_rows))  # rows 0..m-1 are already in place (a plain step, a chain)
            return
        rows = torch.as_tensor(block_rows, dtype=torch.long, device=self.k.device)
        m = int(rows.numel())
        if m == 0:
            return
        src = rows + self.length
        if bool((src >= self.capacity).any()):
            raise ContextLengthError("compaction source past the cache capacity")
        # Rows are increasing and start at >= 0, so src >= dst slot by slot; the
        # gather on the right-hand side copies before the scatter, so overlapping
        # ranges are safe.
        dst = slice(self.length, self.length + m)
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]
        self.length += m

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length
