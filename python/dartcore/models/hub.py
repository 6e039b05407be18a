"""Load targets and their drafters: the one loading path of every entry point
(``DartDecoder.from_pretrained``, dart-generate, dart-serve, dart-bench, the benchmark runner,
dart-train), and the owner of its defaults.

Names and paths resolve to local files as :mod:`dartcore.models.targets` says (nothing is
downloaded; a GGUF is converted once to a cached float32 directory, which gives the config and
tokenizer). A GGUF target on the CPU in float32 loads its Q4_0 / Q4_1 / Q8_0 tensors as the
file's blocks where the native kernels run (:mod:`dartcore.models.gguf`): the float32 model's
values from about the file's size in memory, multiplied on the integer path where its kernels
run. :func:`target_weights` decides this once; :func:`load_drafter` loads the drafter that goes
with a loaded target, whatever its format.
"""

from __future__ import annotations

import os

from dartcore.errors import DartError

# Where targets are (re-exported: callers load and resolve through this one module).
from dartcore.models.targets import (
    BUILTIN_TARGETS,
    cache_dir,
    converted_dir,
    gguf_source,
    load_hf_tokenizer,
    resolve_target,
)

__all__ = [
    "BUILTIN_TARGETS",
    "cache_dir",
    "converted_dir",
    "gguf_source",
    "load_drafter",
    "load_hf_tokenizer",
    "load_target",
    "resolve_target",
    "target_weights",
]


def target_weights(
    name_or_path: str | os.PathLike[str],
    *,
    device: str = "cpu",
    dtype=None,
    quantized: bool | None = None,
    numerics: str | None = None,
) -> tuple[bool, str]:
    """The ``(quantized, numerics)`` a target loads with, the defaults filled in and the
    choice checked (without loading anything, so a CLI can refuse a bad one first).

    ``quantized`` (default: on for a GGUF target on the CPU in float32 where the native kernels
    run): keep the GGUF's block tensors as blocks. ``numerics`` (default: ``"int8"`` for block
    weights where the integer kernels run, else ``"exact"``): ``"exact"`` gives the dequantised
    float32 model's products (Hugging Face ``generate``'s tokens), ``"int8"`` the integer path
    (:mod:`dartcore.kernels.linear`), which only block weights have."""
    import torch

    from dartcore.kernels.linear import NUMERICS, int8_kernel, native_linear_available

    if numerics is not None and numerics not in NUMERICS:
        raise DartError(f"numerics={numerics!r}: expected one of {NUMERICS}")
    source = gguf_source(name_or_path)
    on_cpu = str(device) == "cpu" and dtype in (None, torch.float32)
    if quantized is None:
        quantized = source is not None and on_cpu and native_linear_available()
    if quantized and source is None:
        raise DartError(
            f"quantized=True needs a GGUF target (a .gguf file or {sorted(BUILTIN_TARGETS)}), "
            f"not {str(name_or_path)!r}"
        )
    if quantized and not on_cpu:
        raise DartError("quantized=True runs on the CPU in float32: pass device='cpu' and no dtype")
    if numerics is None:
        numerics = "int8" if quantized and int8_kernel() is not None else "exact"
    if numerics == "int8" and not quantized:
        fix = (
            "drop quantized=False (--no-quantized)"
            if source is not None
            else f"give a GGUF target (a .gguf file or {sorted(BUILTIN_TARGETS)})"
        )
        raise DartError(
            f"numerics='int8' is the integer path of a GGUF target's block weights, and "
            f"{str(name_or_path)!r} loads as floats: pass numerics='exact' (--numerics exact) "
            f"or {fix}"
        )
    return bool(quantized), numerics


def load_target(
    name_or_path: str | os.PathLike[str],
    *,
    dtype=None,
    device: str = "cpu",
    quantized: bool | None = None,
    numerics: str | None = None,
):
    """Load (model, tokenizer) as Hugging Face objects, in eval mode. ``quantized`` and
    ``numerics`` (defaults and checks: :func:`target_weights`): a GGUF target's block tensors
    kept as blocks (float32 CPU only; see the module docs) and their arithmetic. Pass
    ``quantized=False`` for the float32 model (training, Hugging Face references)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized, numerics = target_weights(
        name_or_path, device=device, dtype=dtype, quantized=quantized, numerics=numerics
    )
    path = resolve_target(name_or_path)
    if quantized:
        from dartcore.models.gguf import load_gguf_model

        source = gguf_source(name_or_path)
        assert source is not None  # target_weights refuses blocks without a GGUF
        return load_gguf_model(source, path, numerics=numerics), AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def load_drafter(name_or_path: str | os.PathLike[str], target, tokenizer=None):
    """The drafter at a directory or built-in name (:data:`dartcore.drafter.BUILTIN_DRAFTERS`)
    for ``target`` (a loaded Hugging Face model; the drafter shares its embedding): dartcore's
    format, either variant (:class:`~dartcore.drafter.DartDrafter`, or a converted release,
    :class:`~dartcore.models.official_drafter.OfficialDartDrafter`), or a released DART
    checkpoint, converted at load. ``tokenizer``: the target's, checked against the
    fingerprint the drafter records."""
    from dartcore.drafter import DartDrafter, drafter_config, drafter_path
    from dartcore.models.official_drafter import (
        OfficialDartDrafter,
        is_official_checkpoint,
        load_official_drafter,
    )

    path = drafter_path(name_or_path)
    if is_official_checkpoint(path):
        return load_official_drafter(path, target)
    classes = {cls.VARIANT: cls for cls in (DartDrafter, OfficialDartDrafter)}
    variant = drafter_config(path).variant
    if variant not in classes:
        raise DartError(
            f"{path}: unknown drafter variant {variant!r} (this build reads {sorted(classes)})"
        )
    return classes[variant].from_pretrained(path, target, tokenizer=tokenizer)
