#!/usr/bin/env bash
# Stage 1 of the shipped drafter's recipe (python/dartcore/assets/drafters/smollm2/; stages 2-4:
# tools/finetune_smollm2_drafter.sh and tools/reports/drafter_smollm2.md): SmolLM2-135M-Instruct,
# CPU, fp32, ~80 minutes on a shared 2-core machine.
# Usage: tools/train_smollm2_drafter.sh [extra dart-train args, e.g. --resume]
# The shipped run: started with EVAL_EVERY=60; stopped after the step-70 checkpoint (each
# held-out eval cost ~90 s of the time budget) and continued with
# `tools/train_smollm2_drafter.sh --resume` (EVAL_EVERY=200); the log, the optimizer state,
# the data cursor and the elapsed time (which drives the cosine) carry over. It was started
# with MAX_MINUTES=65 and, after the step-169 checkpoint (29 min), resumed with the default
# MAX_MINUTES=80 (the cosine then stretched over 80 minutes: lr 6.3e-4 -> 7.4e-4 at the switch).
# Steps 1-186 sampled ANCHORS=128 anchors per 512-token sequence; from the step-186 checkpoint
# (33 min) on, 256 (= every valid anchor: a sequence has ~241 on average), after measuring
# that all anchors cost only ~20 % more time per step than 128 (the teacher dominates).
# The curve: dartcore.training.curve.plot_curve(OUT/log.jsonl, ...), which each checkpoint runs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/train_smollm2}
mkdir -p "$OUT"
# One intra-op thread: on the shared 2-core machine (load 6-8 from other jobs) a SmolLM2
# forward of 512 tokens took 4.3 s with 1 thread and 16-19 s with 2 (OpenMP threads
# spin-waiting for a busy core).
exec python3 -m dartcore.cli.dart_train \
  --target smollm2 \
  --data $DARTCORE_DATA/train/gsm8k_train.jsonl $DARTCORE_DATA/train/new_codealpaca.json \
  --out "$OUT" \
  --holdout 200 --eval-docs 24 --eval-every "${EVAL_EVERY:-200}" \
  --ctx-len 512 --batch-size 2 --anchors "${ANCHORS:-256}" --d 8 --gamma 0.6 \
  --draft-vocab 8192 \
  --lr 1e-3 --beta1 0.9 --beta2 0.999 --grad-clip 0.5 --warmup 20 \
  --max-steps 100000 --max-minutes "${MAX_MINUTES:-80}" --checkpoint-minutes 4 \
  --threads 1 --seed 0 --no-progress \
  --export "$OUT/export_fp16" --export-dtype fp16 \
  "$@"
