"""Where the decoder's device and CPU specifics live: one backend object, chosen once when a
:class:`~dartcore.DartDecoder` is made (``backend_for``), so the decode loop only calls
its methods.

* :class:`TorchBackend` -- CUDA, or a CPU target without dartcore's native kernels: the
  drafter's weights column-major on the CPU (MKL's fast small-M GEMM), the LM head over
  all of a tree's rows at once on CUDA (a batched product is essentially free there),
  lazily on the CPU (see :class:`LazyLogits`).
* :class:`NativeCpuBackend` -- a float32 CPU target whose products and layer ops run through
  the native kernels (:class:`~dartcore.models.transformer.TargetModel` decides that when it
  adopts the model): the drafter drafts through the same kernels
  (:class:`~dartcore.kernels.native_draft.NativeDraft`), a round's small torch ops
  run on one thread next to the kernel's spinning helpers, and the LM head takes all of a
  tree's rows (the kernel computes a few rows for about the price of one).

``draft_numerics`` (:func:`resolve_draft_numerics`) chooses the drafter's products on the
native CPU backend: ``"exact"`` (its fp16-exact weights) or ``"int8"`` (its layers as Q4_0
blocks on the integer kernels, as a GGUF target's blocks, its LM head screened:
:data:`~dartcore.kernels.native_draft.DRAFT_BLOCK`, ``HEAD_SCREEN``); by default the target's
numerics.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import torch

from dartcore.drafter import DartDrafter
from dartcore.errors import DartError
from dartcore.kernels.linear import NUMERICS, int8_kernel, native_linears_, torch_threads
from dartcore.kernels.native_draft import NativeDraft
from dartcore.models.transformer import ForwardOutput, TargetModel, column_major_linears_

__all__ = [
    "TorchBackend",
    "NativeCpuBackend",
    "LazyLogits",
    "backend_for",
    "resolve_draft_numerics",
]


def resolve_draft_numerics(target: TargetModel, asked: str | None = None) -> str:
    """The drafter's numerics on the native CPU backend: ``asked`` (one of
    :data:`~dartcore.kernels.linear.NUMERICS`), by default the target's (``"int8"`` for a GGUF
    target on the integer path). ``"int8"`` off the native CPU backend or where the integer
    kernels do not run is ``"exact"``, with a one-line warning. Outputs are the target's
    either way; only the drafts (and their cost) differ."""
    if asked is None:
        int8 = getattr(target, "numerics", "exact") == "int8" and target.native_linear
        return "int8" if int8 else "exact"
    if asked not in NUMERICS:
        raise DartError(f"draft_numerics={asked!r}: expected one of {NUMERICS}")
    if asked == "int8" and (not target.native_linear or int8_kernel() is None):
        warnings.warn(
            "draft_numerics='int8' needs the native CPU backend and the integer kernels: "
            "drafting with draft_numerics='exact'",
            stacklevel=3,
        )
        return "exact"
    return asked


class LazyLogits:
    """Row i of the tree's logits, computed on first use, together with the row
    of i's first child (the builders' best guess for the next accepted node).

    On CPU the LM head dominates a small forward (SmolLM2: a 49152 x 576 fp32
    matrix, ~15-20 ms per matrix-vector product on the dev box) and MKL's
    row-major GEMM costs about the same for 1 and 2 rows (1.00 / 1.08 / 1.33 /
    2.35x for 1 / 2 / 3 / 4 rows, measured on one core), so the acceptance walk
    computes only the rows it visits, two at a time: ``accepted + 1`` rows in
    about ``(accepted + 2) // 2`` products, where the whole tree would cost
    several."""

    def __init__(
        self, target: TargetModel, hidden: torch.Tensor, parents: np.ndarray | None = None
    ):
        self.target = target
        self.hidden = hidden
        self.rows: dict[int, torch.Tensor] = {}
        self.first_child: dict[int, int] = {}
        if parents is not None:
            for i in range(len(parents) - 1, 0, -1):  # reversed: the lowest index wins
                self.first_child[int(parents[i])] = i

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self.rows.get(i)
        if row is None:
            c = self.first_child.get(i)
            if c is not None and c not in self.rows:
                both = self.target.logits(self.hidden[[i, c]])
                row, self.rows[c] = both[0], both[1]
            else:
                row = self.target.logits(self.hidden[i : i + 1])[0]
            self.rows[i] = row
        return row


class TorchBackend:
    """CUDA, or a CPU target on torch's own kernels (see the module docs). ``lazy_logits``
    (default: on for the CPU, off for CUDA) computes the LM head only for the tree nodes the
    acceptance walk visits."""

    name = "torch"

    def __init__(
        self,
        target: TargetModel,
        lazy_logits: bool | None = None,
        draft_numerics: str | None = None,
    ):
        self.target = target
        self.device = target.device
        self.lazy_logits = self.device.type != "cuda" if lazy_logits is None else bool(lazy_logits)
        self.draft_numerics = resolve_draft_numerics(target, draft_numerics)

    def prepare_drafter(self, drafter):
        """Move ``drafter`` to the target's device and lay its weights out for this backend."""
        if isinstance(drafter, torch.nn.Module):
            drafter.to(self.device)  # the drafter runs where the target runs
            if self.device.type == "cpu":
                column_major_linears_(drafter)  # 2x faster d-row drafting with MKL
        return drafter

    def draft(
        self,
        drafter,
        state,
        taps: torch.Tensor,
        next_tokens: torch.Tensor,
        *,
        rows: int,
        return_hidden: bool,
    ):
        """``drafter.draft(...)`` on this backend."""
        return drafter.draft(state, taps, next_tokens, return_hidden=return_hidden, rows=rows)

    def draft_batch(self, drafter, states, taps, next_tokens, *, rows, return_hidden: bool) -> list:
        """One drafter pass for several sequences (``drafter.draft_batch``); one sequence
        takes :meth:`draft`."""
        if len(states) == 1:
            return [
                self.draft(
                    drafter,
                    states[0],
                    taps[0],
                    next_tokens[0],
                    rows=rows[0],
                    return_hidden=return_hidden,
                )
            ]
        if not hasattr(drafter, "draft_batch"):  # a custom drafter: one call per sequence
            return [
                self.draft(drafter, s, t, x, rows=r, return_hidden=return_hidden)
                for s, t, x, r in zip(states, taps, next_tokens, rows)
            ]
        return drafter.draft_batch(states, taps, next_tokens, rows, return_hidden=return_hidden)

    def round_scope(self):
        """Context of one decoding round (draft, search, verify, accept)."""
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        """Wait for the device, so a stage's kernels count in its clock lap."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def verify_logits_rows(self):
        """Which rows the verify forward computes logits for (``logits_rows``)."""
        return slice(0, 0) if self.lazy_logits else None

    def tree_logits(self, out: ForwardOutput, parents: np.ndarray):
        """Row i = the target's logits after tree node i (indexable by node)."""
        return LazyLogits(self.target, out.hidden, parents) if self.lazy_logits else out.logits

    def tree_logits_batch(self, outs: list[ForwardOutput], trees: list) -> list:
        """:meth:`tree_logits` for every sequence of a packed verify. Lazily, the rows every
        walk reads first -- each tree's root and its first child -- come from one LM-head
        product over all sequences (B one-row products cost B times one; a 2B-row GEMM much
        less), the rest on demand as for one sequence."""
        if not self.lazy_logits or len(outs) == 1:
            return [self.tree_logits(o, t.parents) for o, t in zip(outs, trees)]
        lazies = [LazyLogits(self.target, o.hidden, t.parents) for o, t in zip(outs, trees)]
        where = [
            (k, i)
            for k, lz in enumerate(lazies)
            for i in ([0, lz.first_child[0]] if 0 in lz.first_child else [0])
        ]
        logits = self.target.logits(torch.stack([lazies[k].hidden[i] for k, i in where]))
        for (k, i), row in zip(where, logits):
            lazies[k].rows[i] = row
        return lazies


class NativeCpuBackend(TorchBackend):
    """A CPU target on dartcore's native kernels (see the module docs)."""

    name = "native-cpu"

    def __init__(
        self,
        target: TargetModel,
        lazy_logits: bool | None = None,
        draft_numerics: str | None = None,
    ):
        super().__init__(
            target,
            lazy_logits=False if lazy_logits is None else lazy_logits,
            draft_numerics=draft_numerics,
        )
        self.native_drafts: dict[int, NativeDraft] = {}  # id(drafter) -> its native draft step

    def prepare_drafter(self, drafter):
        if isinstance(drafter, torch.nn.Module):
            drafter.to(self.device)
            # weights streamed once for the d rows: fp16 where they are fp16-exact (the shipped
            # drafters are stored in fp16: same drafts, half the bytes), or Q4_0 blocks on the
            # integer path (draft_numerics "int8"); a DartDrafter's layer ops native too
            threads, numerics = self.target.threads, self.draft_numerics
            native = (
                NativeDraft.adopt(drafter, threads=threads, numerics=numerics)
                if isinstance(drafter, DartDrafter)
                else None
            )
            if native is not None:
                self.native_drafts[id(drafter)] = native
            else:
                native_linears_(drafter, narrow=True, threads=threads, numerics=numerics)
        return drafter

    def draft(
        self,
        drafter,
        state,
        taps: torch.Tensor,
        next_tokens: torch.Tensor,
        *,
        rows: int,
        return_hidden: bool,
    ):
        native = self.native_drafts.get(id(drafter))
        if native is None or native.drafter is not drafter:
            return super().draft(
                drafter, state, taps, next_tokens, rows=rows, return_hidden=return_hidden
            )
        return native.draft(state, taps, next_tokens, return_hidden=return_hidden, rows=rows)

    def draft_batch(self, drafter, states, taps, next_tokens, *, rows, return_hidden: bool) -> list:
        native = self.native_drafts.get(id(drafter))
        if len(states) == 1 or native is None or native.drafter is not drafter:
            return super().draft_batch(
                drafter, states, taps, next_tokens, rows=rows, return_hidden=return_hidden
            )
        return native.draft_batch(states, taps, next_tokens, rows, return_hidden=return_hidden)

    def round_scope(self):
        """A round's small torch ops (drafting, search, acceptance) on one torch thread: an
        OpenMP worker woken by, e.g., the argmax over a tree's logits spins next to the native
        kernel's helpers (see dartcore.kernels.linear.torch_threads). The prefill keeps
        torch's threads."""
        return torch_threads(1)


def backend_for(
    target: TargetModel, lazy_logits: bool | None = None, draft_numerics: str | None = None
) -> TorchBackend:
    """The backend of ``target``: native CPU where its products run natively, else torch.
    ``draft_numerics``: see :func:`resolve_draft_numerics`."""
    cls = NativeCpuBackend if target.native_linear else TorchBackend
    return cls(target, lazy_logits=lazy_logits, draft_numerics=draft_numerics)
