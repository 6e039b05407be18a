"""A GGUF target with its quantised weights kept as the file's blocks.

:func:`load_gguf_model` builds the Hugging Face model of a Llama-family GGUF (the config and
tokenizer of its converted directory, :func:`dartcore.models.targets.resolve_target`) without a
float32 copy of the block weights: each projection whose tensor is Q4_0, Q4_1 or Q8_0 becomes
a :class:`BlockLinear`, the token embedding a :class:`BlockEmbedding` (the LM head, when tied,
reads the same blocks), so the resident weights are about the file's size (SmolLM2-135M
Q4_1: 98 MB instead of 540 MB). Float tensors (the RMSNorm weights) load as float32.

The values are the float32 model's: every block weight is formed exactly as the ``gguf``
package's numpy dequantiser forms it (which the float32 conversion uses), natively for 1-16
rows (:class:`dartcore.kernels.linear.BlockWeight`) and through a temporary float32 matrix
for more -- or, with ``numerics="int8"``, on the integer path (activations quantised to int8 per
32-value block; see :mod:`dartcore.kernels.linear`). :class:`dartcore.models.transformer.TargetModel` fuses q|k|v and gate|up as block
rows and decodes through the native kernels; the Hugging Face forward of the model keeps
working (slowly: it dequantises each weight per call).

Quantised types the kernels do not read (a Q4_K_M file's Q4_K / Q6_K / Q5_K super-blocks,
dequantised here by :func:`dequantize_kquant`; Q5_0, Q5_1 and others by the ``gguf`` package)
run by numerics: ``"exact"`` dequantises them once to float32 (the file's weights exactly, the
products of the float32 conversion); ``"int8"`` requantises each such row to Q8_0 blocks
(:func:`dartcore.kernels.linear.quantize_q8_0`) so it runs on the integer kernels at about a
quarter of float32's bytes. That path approximates the file's weights (one more rounding, to
8 bits per 32 values): its tokens may differ from the exact path's, and DART stays lossless
with respect to that path's own AR. Measured on a Q4_K_M SmolLM2-135M made by llama-quantize
(Q4_K, Q6_K and Q5_0 matrices), 6 chat prompts (HumanEval, GSM8K, CodeAlpaca): the
requantised weights are 0.52-0.56% off the file's (relative Frobenius norm per type, at most
0.57% for one matrix); the last prompt position's logits 0.9-2.2% off the exact path's (the
shipped Q4_1 file's int8 path, which needs no requantisation: 0.8-1.9%), the same argmax on 6
of 6; 3 of 6 greedy 64-token outputs equal the exact path's. A type neither path can read raises
:class:`~dartcore.errors.WeightFormatError` naming it.

llama.cpp stores q_proj / k_proj rows permuted for its rotary layout; they are permuted back
here as whole rows of blocks, as transformers does with the float rows.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from dartcore.errors import DartError, WeightFormatError
from dartcore.kernels.linear import BlockWeight, dequantize_blocks, quantize_q8_0

__all__ = [
    "BlockEmbedding",
    "BlockLinear",
    "block_bytes",
    "check_gguf",
    "dequantize_kquant",
    "load_gguf_model",
    "read_gguf",
]

_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGML types the native kernel reads as blocks.
_BLOCKS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}
# GGML float types: read as floats under either numerics (never requantised).
_FLOATS = {"F32", "F16", "BF16", "F64"}
# GGML super-block ("K-quant") types: bytes per 256 weights.
QK_K = 256
_KQUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes per super-block ``[n, 12]`` as its eight 6-bit scales and
    eight 6-bit mins (uint8 ``[n, 8]`` each): sub-blocks 0-3 keep theirs in the low six bits
    of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take four low bits from bytes 8-11
    (scale: low nibble, min: high nibble) and two high bits from the top of bytes 0-3 / 4-7."""
    lo, hi, mix = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    mins = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, mins


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row ``[n, 2]`` as one float32 per row ``[n, 1]`` (little-endian fp16)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def dequantize_kquant(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """The float32 values (flat) of GGML super-blocks ``raw`` (uint8, whole super-blocks of
    256 weights) of ``ggml_type`` "Q4_K", "Q5_K" or "Q6_K", computed as GGML's reference
    dequantiser does (the float32 products in the same order, so bit for bit the ``gguf``
    package's values).

    Q4_K (144 bytes): fp16 ``d``, fp16 ``dmin``, 12 bytes of 6-bit scales and mins for eight
    sub-blocks of 32 (:func:`_k_scales`), 128 bytes of 4-bit values (each 32 bytes: the low
    nibbles one sub-block, the high nibbles the next); ``w = d * sc * q - dmin * m``.
    Q5_K (176): the same, with 32 bytes of fifth bits between the scales and the nibbles
    (bit ``j`` of byte ``l``: value ``l`` of sub-block ``j``). Q6_K (210): 128 bytes of low
    nibbles, 64 bytes of two high bits, 16 int8 scales (one per 16 values), fp16 ``d``;
    ``w = d * scale * (q - 32)``, each half of 128 values from 64 low-nibble bytes (low then
    high nibbles) and 32 high-bit bytes (bit pairs 0, 2, 4, 6 for its four 32-value runs)."""
    if ggml_type not in _KQUANT_BYTES:
        raise WeightFormatError(
            f"{ggml_type} is not a K-quant type dartcore dequantises ({sorted(_KQUANT_BYTES)})"
        )
    size = _KQUANT_BYTES[ggml_type]
    raw = np.asarray(raw, dtype=np.uint8).reshape(-1)
    if raw.size % size:
        raise WeightFormatError(
            f"{ggml_type}: {raw.size} bytes are not whole super-blocks of {size} bytes"
        )
    b = raw.reshape(-1, size)
    n = b.shape[0]
    if ggml_type == "Q6_K":
        ql, qh = b[:, :128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 1, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=2)  # [n, half, 128]
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # [n, half, 4, 32]
        q = (low | (high.reshape(n, 2, 128) << 4)).astype(np.int8) - np.int8(32)
        scale = _f16(b[:, 208:210]) * b[:, 192:208].view(np.int8).astype(np.float32)
        return (scale[:, :, None] * q.reshape(n, 16, 16).astype(np.float32)).reshape(-1)
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mins = _k_scales(b[:, 4:16])
    qs = b[:, size - 128 :].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 15, qs >> 4], axis=2).reshape(n, 8, 32)
    if ggml_type == "Q5_K":
        qh = b[:, 16:48]
        q = q | (((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
    scale = d * sc.astype(np.float32)
    shift = dmin * mins.astype(np.float32)
    return (scale[:, :, None] * q.astype(np.float32) - shift[:, :, None]).reshape(-1)


def _hf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _LAYER:
            raise DartError(f"unknown GGUF tensor {name}: dartcore reads Llama-family GGUF files")
        return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
    if stem not in _TOP:
        raise DartError(f"unknown GGUF tensor {name}: dartcore reads Llama-family GGUF files")
    return f"{_TOP[stem]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows (rows of floats or of blocks)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


class _Blocks:
    """One tensor's blocks as read: uint8 ``[n, row bytes]``, its format, ``k``."""

    __slots__ = ("data", "format", "k")

    def __init__(self, data: np.ndarray, fmt: str, k: int):
        self.data, self.format, self.k = data, fmt, k


# GGUF metadata value types: fixed sizes (8 = string, 9 = array are read apart).
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_VERSIONS = (2, 3)


class _Header:
    """The tensor table of a GGUF file (the metadata is skipped, but ``general.alignment``):
    per tensor its name, GGML type number, dims (fastest first) and absolute data offset.
    The ``gguf`` package's reader parses every metadata value into Python objects (a
    tokenizer's 49k-entry vocabulary and merges: ~14 s and ~200 MB for SmolLM2); the tensors
    need none of it."""

    def __init__(self, path: Path):
        import struct

        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            buf = f.read(1 << 20)
            pos = 0

            def need(n):
                nonlocal buf
                if pos + n > self.size:  # also a hostile length, before any read of it
                    raise WeightFormatError(f"{path}: truncated GGUF header")
                while pos + n > len(buf):
                    more = f.read(max(1 << 20, n))
                    if not more:
                        raise WeightFormatError(f"{path}: truncated GGUF header")
                    buf += more

            def take(fmt):
                nonlocal pos
                size = struct.calcsize(fmt)
                need(size)
                out = struct.unpack_from(fmt, buf, pos)
                pos += size
                return out[0] if len(out) == 1 else out

            def string():
                nonlocal pos
                n = take("<Q")
                need(n)
                text = bytes(buf[pos : pos + n])
                pos += n
                return text.decode("utf-8", "replace")

            def skip(vtype):
                nonlocal pos
                if vtype == 8:
                    string()
                elif vtype == 9:
                    itype, count = take("<IQ")
                    if itype in _SCALAR:
                        need(count * _SCALAR[itype])
                        pos += count * _SCALAR[itype]
                    else:
                        for _ in range(count):
                            skip(itype)
                elif vtype in _SCALAR:
                    need(_SCALAR[vtype])
                    pos += _SCALAR[vtype]
                else:
                    raise WeightFormatError(f"{path}: unknown GGUF metadata type {vtype}")

            need(24)
            if buf[:4] != b"GGUF":
                raise WeightFormatError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
            pos = 4
            version = take("<I")
            if version not in _GGUF_VERSIONS:
                raise WeightFormatError(
                    f"{path}: GGUF version {version}, dartcore reads {_GGUF_VERSIONS}"
                )
            n_tensors, n_kv = take("<QQ")
            alignment = 32
            for _ in range(n_kv):
                key, vtype = string(), take("<I")
                if key == "general.alignment" and vtype == 4:
                    alignment = take("<I")
                else:
                    skip(vtype)
            self.tensors = []
            for _ in range(n_tensors):
                name = string()
                n_dims = take("<I")
                dims = [take("<Q") for _ in range(n_dims)]
                ggml_type, offset = take("<IQ")
                self.tensors.append((name, ggml_type, dims, offset))
            if alignment <= 0:
                raise WeightFormatError(f"{path}: GGUF alignment {alignment}")
            data_start = -(-pos // alignment) * alignment
            self.tensors = [(n, t, d, data_start + o) for n, t, d, o in self.tensors]

    def check_data(self) -> None:
        """Raise :class:`WeightFormatError` unless every tensor has a known GGML type, rows of
        whole blocks and its bytes inside the file (a truncated download, a foreign file
        with a GGUF header)."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        for name, ggml_type, dims, offset in self.tensors:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (ValueError, KeyError):
                raise WeightFormatError(
                    f"{self.path}: tensor {name} has GGML type {ggml_type}, which dartcore "
                    f"does not read"
                ) from None
            count = int(np.prod([int(x) for x in dims], dtype=object)) if dims else 1
            if dims and int(dims[0]) % block:
                raise WeightFormatError(
                    f"{self.path}: tensor {name} has rows of {dims[0]} elements, not whole "
                    f"blocks of {block}"
                )
            end = offset + count // block * type_size
            if end > self.size:
                raise WeightFormatError(
                    f"{self.path}: tensor {name} is truncated: its data ends at byte {end}, "
                    f"the file has {self.size}"
                )


def check_gguf(path: str | Path) -> None:
    """Raise :class:`WeightFormatError` unless ``path`` is a whole GGUF file: its header,
    tensor table and every tensor's data (see :meth:`_Header.check_data`)."""
    _Header(Path(path)).check_data()


def read_gguf(
    path: str | Path, config, *, numerics: str = "exact"
) -> dict[str, np.ndarray | _Blocks]:
    """The tensors of a Llama-family GGUF under their Hugging Face names: Q4_0 / Q4_1 / Q8_0 as
    their blocks (read from the file, not mapped; q/k rows un-permuted), every other type as
    float32 arrays (K-quants by :func:`dequantize_kquant`, the rest by the ``gguf`` package's
    dequantiser) -- but with ``numerics="int8"`` a matrix of another quantised type is
    requantised to Q8_0 blocks (see the module docs)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    header = _Header(Path(path))
    header.check_data()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    out: dict[str, np.ndarray | _Blocks] = {}
    with open(path, "rb") as f:
        for gguf_name, ggml_type, dims, offset in header.tensors:
            name = _hf_name(gguf_name)
            qtype = GGMLQuantizationType(ggml_type)
            shape = tuple(int(x) for x in reversed(dims))  # GGUF lists the fastest dim first
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(shape)) // block * type_size
            f.seek(offset)
            raw = np.fromfile(f, dtype=np.uint8, count=count)
            if raw.size != count:
                raise WeightFormatError(
                    f"{path}: tensor {gguf_name} is truncated ({raw.size} of {count} bytes)"
                )
            fmt = _BLOCKS.get(qtype.name)
            if fmt is not None and len(shape) == 2:
                w = raw.reshape(shape[0], -1)
            else:
                fmt = None
                w = _dequantize(raw, qtype, gguf_name, path).reshape(shape)
            if name.endswith("q_proj.weight"):
                w = _unpermute(w, heads)
            elif name.endswith("k_proj.weight"):
                w = _unpermute(w, kv_heads)
            if (
                fmt is None
                and numerics == "int8"
                and qtype.name not in _FLOATS
                and len(shape) == 2
                and shape[1] % 32 == 0
            ):
                w, fmt = quantize_q8_0(w), "q8_0"
            out[name] = _Blocks(w, fmt, shape[1]) if fmt is not None else w
    return out


def _dequantize(raw: np.ndarray, qtype, name: str, path) -> np.ndarray:
    """One tensor's bytes as float32 (flat), or a :class:`WeightFormatError` naming its type."""
    from gguf.quants import dequantize

    if qtype.name in _KQUANT_BYTES:
        return dequantize_kquant(raw, qtype.name)
    try:
        return np.asarray(dequantize(raw, qtype), dtype=np.float32).reshape(-1)
    except NotImplementedError:
        raise WeightFormatError(
            f"{path}: tensor {name} has GGML type {qtype.name}, which dartcore does not read"
        ) from None


def _placeholder(n: int, k: int) -> nn.Parameter:
    """A ``[n, k]`` float32 parameter with one element of storage (shape, dtype and device for
    code that asks; the values live in the blocks)."""
    return nn.Parameter(torch.zeros(()).expand(n, k), requires_grad=False)


class BlockLinear(nn.Module):
    """``nn.Linear``'s forward over a weight kept as GGML blocks (``block``, a
    :class:`~dartcore.kernels.linear.BlockWeight`). ``weight`` is a one-element placeholder
    of the weight's shape; the values are :meth:`dequantize`'s."""

    def __init__(self, block: BlockWeight):
        super().__init__()
        self.out_features, self.in_features = block.shape
        self.block = block
        self.weight = _placeholder(*block.shape)
        self.bias = None

    def dequantize(self) -> torch.Tensor:
        return self.block.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class BlockEmbedding(nn.Module):
    """``nn.Embedding`` over a table kept as GGML blocks: the looked-up rows are dequantised
    (exactly the float32 table's rows)."""

    def __init__(self, block: BlockWeight):
        super().__init__()
        self.num_embeddings, self.embedding_dim = block.shape
        self.block = block
        self.weight = _placeholder(*block.shape)

    def dequantize(self) -> torch.Tensor:
        return self.block.dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(
                f"token id out of range for an embedding of {self.num_embeddings} rows"
            )
        rows = self.block.dequantize_rows(flat)
        return rows.reshape(*ids.shape, self.embedding_dim).to(ids.device)


def block_bytes(model: nn.Module) -> int:
    """Bytes of the block weights a model holds (each table once)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        if isinstance(m, (BlockLinear, BlockEmbedding)):
            seen[id(m.block.data)] = m.block.nbytes
    return sum(seen.values())


# Projections fused by TargetModel: a group's block rows are stacked, so they need one format.
_GROUPS = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
)


def load_gguf_model(gguf_path: str | Path, hf_dir: str | Path, *, numerics: str = "exact"):
    """The Hugging Face model of ``gguf_path`` (config from ``hf_dir``, its converted
    directory) with the block weights kept as blocks (see the module docs), in eval mode.
    ``numerics`` ("exact" or "int8", :data:`dartcore.kernels.linear.NUMERICS`): the arithmetic
    :class:`~dartcore.models.transformer.TargetModel` runs the blocks with (recorded on the
    model as ``dartcore_numerics``); with "int8" the quantised matrices the kernels do not read
    are loaded as their Q8_0 requantisation (see the module docs), so the model's weights are
    those, not the file's. The Hugging Face forward of the model is exact on its weights until a
    TargetModel adopts it with "int8": its projections then share the fused int8 rows (where
    they are whole groups of eight) and run that numerics too."""
    from dartcore.kernels.linear import NUMERICS

    if numerics not in NUMERICS:
        raise DartError(f"numerics={numerics!r}: expected one of {NUMERICS}")
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(hf_dir)
    if getattr(config, "model_type", None) not in ("llama", "mistral", "qwen2"):
        raise DartError(
            f"{gguf_path}: block weights are read for Llama-family GGUF files, not "
            f"{getattr(config, 'model_type', None)!r}"
        )
    tensors = read_gguf(gguf_path, config, numerics=numerics)
    # A fused group of mixed formats is dequantised (one format per stacked matrix).
    for i in range(config.num_hidden_layers):
        for group in _GROUPS:
            names = [f"model.layers.{i}.{g}.weight" for g in group]
            parts = [tensors.get(n) for n in names]
            fmts = {p.format if isinstance(p, _Blocks) else None for p in parts}
            if len(fmts) > 1:
                for n, p in zip(names, parts):
                    if isinstance(p, _Blocks):
                        tensors[n] = dequantize_blocks(p.data, p.k, p.format).numpy()
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    blocks = {}
    for name, value in tensors.items():
        if isinstance(value, _Blocks):
            blocks[name] = BlockWeight(value.data, value.k, value.format)
    with torch.no_grad():
        # The block modules first, then the float parameters (a bias lands on its block module).
        for name, block in blocks.items():
            module = (
                BlockEmbedding(block) if name == "model.embed_tokens.weight" else BlockLinear(block)
            )
            _replace(model, name.rsplit(".", 1)[0], module)
        for name, value in tensors.items():
            if not isinstance(value, _Blocks):
                owner, attr = _owner(model, name)
                setattr(owner, attr, nn.Parameter(torch.from_numpy(value), requires_grad=False))
        if "lm_head.weight" not in tensors:
            if not getattr(config, "tie_word_embeddings", False):
                raise DartError(
                    f"{gguf_path} has no output weight and the config does not tie it to the embedding"
                )
            emb = tensors["model.embed_tokens.weight"]
            model.lm_head = (
                BlockLinear(blocks["model.embed_tokens.weight"])
                if isinstance(emb, _Blocks)
                else _tied_linear(model.model.embed_tokens.weight)
            )
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise DartError(
            f"{gguf_path} lacks tensors for {left[:4]}{' ...' if len(left) > 4 else ''}"
        )
    model.config.tie_word_embeddings = False  # the head holds its own reference to the blocks
    model.dartcore_numerics = numerics
    return model.eval()


def _owner(model: nn.Module, name: str):
    path, attr = name.rsplit(".", 1)
    return model.get_submodule(path), attr


def _replace(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _tied_linear(weight: nn.Parameter) -> nn.Linear:
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = weight
    return head
