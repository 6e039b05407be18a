#!/usr/bin/env bash
# The SmolLM2 drafter for general conversation: self-distillation on general requests, with the
# math/code responses kept in the mix so those tasks do not regress. Each step resumes (or is
# skipped) when its output is already there; tools/reports/drafter_smollm2.md has the shipped run.
#   1. tools/make_general_prompts.py: requests the target writes (self-instruct) + instructions
#      over local documents; 5 % held out (-> dartcore/assets/eval/general_heldout.jsonl).
#   2. tools/generate_target_responses.py: the target's greedy responses to the training prompts.
#   3. general_responses.jsonl.gz (the responses with each prompt's provenance; shipped as
#      assets/corpus/smollm2_general_responses.jsonl.gz, which the demo index reads) and the
#      mix: every general conversation + MATHCODE of the shipped math/code responses
#      (assets/corpus/smollm2_responses.jsonl.gz), seeded shuffle.
#   4. dart-train --init $INIT (default the shipped drafter) on the mix; its draft vocabulary is
#      kept unless --draft-vocab N is passed.
# Usage: tools/finetune_general_drafter.sh [extra dart-train args, e.g. --resume]
#   env: OUT (data dir), RUN (run dir, default $OUT/run), INIT (drafter to start from), LR,
#   MAX_MINUTES, THREADS, MATHCODE, GEN_MORE=1 (generate responses for the prompts still without one)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-artifacts/general}
INIT=${INIT:-smollm2}
RUN=${RUN:-$OUT/run}
THREADS=${THREADS:-2}
mkdir -p "$OUT"
if [ ! -s "$OUT/train.jsonl" ]; then
  python3 tools/make_general_prompts.py --out "$OUT" --self-instruct "${SELF_INSTRUCT:-1400}" \
    --documents "${DOCUMENTS:-500}" --batch-size 48 --threads "$THREADS" --max-minutes "${PROMPT_MINUTES:-16}"
fi
if [ ! -s "$OUT/responses/generated.jsonl" ] || [ -n "${GEN_MORE:-}" ]; then
  python3 tools/generate_target_responses.py --data "$OUT/train.jsonl" --holdout 0 --seed 0 \
    --out "$OUT/responses" --batch-size 32 --max-new-tokens 192 --max-prompt-tokens 320 \
    --max-minutes "${GEN_MINUTES:-30}" --threads "$THREADS"
fi
python3 - "$OUT" "${MATHCODE:-1500}" <<'EOF'
import gzip, json, random, sys
from pathlib import Path
out, n = Path(sys.argv[1]), int(sys.argv[2])
# the responses with each prompt's provenance (source, task, origin) from train.jsonl
meta = {}
for line in open(out / "train.jsonl", encoding="utf-8"):
    rec = json.loads(line)
    meta[rec["messages"][-1]["content"]] = {k: v for k, v in rec.items() if k != "messages"}
general = []
for line in open(out / "responses" / "generated.jsonl", encoding="utf-8"):
    if line.strip():
        rec = json.loads(line)
        rec.update(meta.get(rec["messages"][-2]["content"], {}))
        general.append(json.dumps(rec) + "\n")
with gzip.open(out / "general_responses.jsonl.gz.tmp", "wt", encoding="utf-8") as f:
    f.writelines(general)
(out / "general_responses.jsonl.gz.tmp").replace(out / "general_responses.jsonl.gz")
shipped = Path("python/dartcore/assets/corpus/smollm2_responses.jsonl.gz")
mathcode = [l for l in gzip.open(shipped, "rt", encoding="utf-8") if l.strip()]
random.Random(0).shuffle(mathcode)
mix = general + mathcode[:n]
random.Random(1).shuffle(mix)
tmp = out / "mix.jsonl.tmp"
tmp.write_text("".join(l if l.endswith("\n") else l + "\n" for l in mix), encoding="utf-8")
tmp.replace(out / "mix.jsonl")
print(f"mix: {len(general)} general + {min(n, len(mathcode))} math/code conversations -> {out / 'mix.jsonl'}",
      file=sys.stderr)
EOF
exec python3 -m dartcore.cli.dart_train \
  --target smollm2 --init "$INIT" \
  --data "$OUT/mix.jsonl" --holdout 24 --eval-docs 24 --eval-every "${EVAL_EVERY:-400}" \
  --out "$RUN" --ctx-len 512 --batch-size 2 --anchors 256 --gamma 0.6 \
  --lr "${LR:-3e-4}" --beta1 0.9 --beta2 0.999 --grad-clip 0.5 --warmup 10 \
  --max-steps 100000 --max-minutes "${MAX_MINUTES:-40}" --checkpoint-minutes 5 \
  --threads "$THREADS" --seed 0 --no-progress \
  --export "$RUN/export_fp16" --export-dtype fp16 \
  "$@"
