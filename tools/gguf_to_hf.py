#!/usr/bin/env python3
"""De-quantise a Llama-family GGUF into a float32 Hugging Face directory with the
``gguf`` package and numpy alone (no transformers GGUF integration).

Used where the transformers GGUF loader is not available (the GPU machine's image
has transformers but not ``gguf``; ``tools/device_check.sh`` carries the ``gguf``
wheel and this script). The config, tokenizer and chat-template files come from
an existing converted directory (``--meta``, e.g. ``~/.cache/dartcore/SmolLM2-135M-Instruct``
minus its weights); only ``model.safetensors`` is written, into a temp directory
renamed into place.

    python tools/gguf_to_hf.py model.gguf --meta meta_dir --out out_dir
    python tools/gguf_to_hf.py model.gguf --meta dir --check dir/model.safetensors   # bitwise check

llama.cpp stores q_proj / k_proj rows permuted for its rotary layout; they are
permuted back here, as transformers does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

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


def _hf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in _LAYER:
            raise ValueError(f"unknown GGUF tensor {name}")
        return f"model.layers.{layer}.{_LAYER[part]}.{kind}"
    if stem not in _TOP:
        raise ValueError(f"unknown GGUF tensor {name}")
    return f"{_TOP[stem]}.{kind}"


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of q/k rows."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert(gguf_path: Path, config: dict) -> dict[str, np.ndarray]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf_path))
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    tensors = {}
    for t in reader.tensors:
        # GGUF lists the fastest dim first
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        name = _hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = _unpermute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = _unpermute(w, kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    if "lm_head.weight" not in tensors and not config.get("tie_word_embeddings", False):
        raise ValueError("GGUF has no output.weight and the config does not tie embeddings")
    return tensors


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("gguf", type=Path)
    p.add_argument(
        "--meta", type=Path, required=True, help="directory with config.json and tokenizer files"
    )
    p.add_argument("--out", type=Path, help="output Hugging Face directory")
    p.add_argument("--check", type=Path, help="compare with this model.safetensors bit for bit")
    args = p.parse_args(argv)
    from safetensors.numpy import load_file, save_file

    config = json.loads((args.meta / "config.json").read_text())
    tensors = convert(args.gguf, config)
    if args.check:
        want = load_file(str(args.check))
        bad = [k for k in want if k not in tensors or not np.array_equal(want[k], tensors[k])]
        extra = sorted(set(tensors) - set(want))
        print(
            f"{len(want)} tensors compared, {len(bad)} differ, {len(extra)} extra: {bad[:5]} {extra[:5]}"
        )
        return 1 if bad or extra else 0
    if not args.out:
        p.error("--out or --check is required")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=args.out.name + ".tmp-", dir=args.out.parent))
    try:
        for f in args.meta.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, tmp / f.name)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        os.replace(tmp, args.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {args.out} ({len(tensors)} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
