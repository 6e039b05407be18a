#!/usr/bin/env bash
# Style and interface checks run by CI before the tests: rustfmt, clippy (warnings are errors),
# ruff (lint + format) on the Python trees, and mypy's stubtest comparing python/dartcore/_native.pyi
# with the built extension (run tools/install.sh first: stubtest imports dartcore._native).
# Installs the pinned linters if they are missing. Exits non-zero on the first failing check.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
PY=${PYTHON:-python3}
RUFF_VERSION=0.17.6
MYPY_VERSION=2.4.1
say() { printf '\n== lint: %s\n' "$*"; }
installed() { $PY -m pip show "$1" 2>/dev/null | grep -qx "Version: $2"; }
installed ruff "$RUFF_VERSION" || $PY -m pip install -q "ruff==$RUFF_VERSION"
installed mypy "$MYPY_VERSION" || $PY -m pip install -q "mypy==$MYPY_VERSION"
say "cargo fmt --all --check"
cargo fmt --all --check
say "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
say "ruff check"
$PY -m ruff check python tools tests
say "ruff format --check"
$PY -m ruff format --check python tools tests
say "stubtest dartcore._native"
$PY -m mypy.stubtest dartcore._native
say "all checks passed"
