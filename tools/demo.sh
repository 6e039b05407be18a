#!/usr/bin/env bash
# The main job, end to end, on a fresh machine with no arguments: install, build a trigram
# index with the SmolLM2 tokenizer (local text + the Dolma sample), load the shipped drafter,
# and answer a handful of prompts with DartDecoder and with plain AR decoding, both on the
# default path of DartDecoder.from_pretrained (the GGUF's blocks on a CPU; --fp32 for the float32
# conversion). Exits non-zero unless every DART answer equals AR's token for token.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
exec python3 tools/demo.py "$@"
