#!/usr/bin/env bash
# Stage 2 of the shipped SmolLM2 drafter: self-distillation. The stage-1 drafter
# (tools/train_smollm2_drafter.sh, trained on the datasets' reference responses) is fine-tuned
# on the target's OWN greedy responses to the training prompts - the text the decoder drafts
# against at inference (stage 1 reached hit@1 46 % on reference responses but 36 % on the
# target's own). Held-out documents: the same 200 as stage 1 (same --holdout / --seed split).
#   1. tools/generate_target_responses.py: batched greedy generation (fp32, CPU), stopped after
#      GEN_MINUTES; writes $OUT/generated.jsonl and $OUT/heldout.jsonl.
#   2. dart-train --init <stage-1 drafter> on generated.jsonl, evaluated on heldout.jsonl.
# Usage: tools/finetune_smollm2_drafter.sh [extra dart-train args, e.g. --resume]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/selfdistill}
INIT=${INIT:-smollm2}
DATA=${DARTCORE_DATA:?set DARTCORE_DATA to the data directory holding train/}/train
mkdir -p "$OUT"
if [ ! -s "$OUT/generated.jsonl" ] || [ -n "${GEN_MORE:-}" ]; then
  python3 tools/generate_target_responses.py --data "$DATA/gsm8k_train.jsonl" "$DATA/new_codealpaca.json" \
    --holdout 200 --seed 0 --out "$OUT" --batch-size 48 --max-new-tokens 192 \
    --max-minutes "${GEN_MINUTES:-28}" --threads 1
fi
exec python3 -m dartcore.cli.dart_train \
  --target smollm2 --init "$INIT" \
  --data "$OUT/generated.jsonl" --eval-data "$OUT/heldout.jsonl" --holdout 0 \
  --out "$OUT/run" --eval-docs 24 --eval-every "${EVAL_EVERY:-150}" \
  --ctx-len 512 --batch-size 2 --anchors 256 --gamma 0.6 \
  --lr "${LR:-3e-4}" --beta1 0.9 --beta2 0.999 --grad-clip 0.5 --warmup 10 \
  --max-steps 100000 --max-minutes "${MAX_MINUTES:-45}" --checkpoint-minutes 4 \
  --threads "${THREADS:-1}" --seed 0 --no-progress \
  --export "$OUT/run/export_fp16" --export-dtype fp16 \
  "$@"
