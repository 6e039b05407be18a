#!/usr/bin/env bash
# The main job, end to end, on a fresh machine with no arguments: install, build a trigram
# index with the SmolLM2 tokenizer (local text + the Dolma sample), load the shipped drafter,
# and answer a handful of prompts with DartDecoder and with plain AR decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
exec python3 tools/demo.py "$@"
