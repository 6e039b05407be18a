#!/usr/bin/env bash
# The test suite: Rust unit/property tests of the core crates, then pytest (Python side,
# including the few SmolLM2 integration tests marked `slow`). CPU only.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
# llama.cpp's llama-quantize, with which the K-quant test makes its Q4_K_M file from the shipped
# GGUF (a few minutes the first time; cached, and a rerun returns at once)
bash tools/build_llama_cpp.sh >/dev/null
# The bindings crate is a cdylib linked against the Python that loads it; it is tested through
# pytest, not `cargo test`.
cargo test --release --workspace --exclude dartcore-py
status=0
python3 -m pytest -q -m "not benchmark and not gpu" tests "$@" || status=$?
# pytest exits 5 when it collected nothing: that is a failure of the suite, not a pass.
exit $status
