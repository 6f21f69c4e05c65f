#!/usr/bin/env bash
# The main job on the embedded default: precompute the reference cache over data/, then train DPO on it.
# Outputs go to $OUT (default runs/demo). Re-running reuses the caches and trains again over the demo's own policy
# folder (--overwrite-output-dir: that folder is this script's output; train-dpo refuses a used one otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/demo}
for split in train test; do  # eval.jsonl is split "test", as in datasets
  .venv/bin/precompute-ref --model data/sft-model --data data/prefs --split "$split" --out "$OUT/ref-cache-$split"
done
.venv/bin/train-dpo --model data/sft-model --data data/prefs --ref-cache "$OUT/ref-cache-train" \
  --eval-data data/prefs --eval-split test --eval-ref-cache "$OUT/ref-cache-test" --eval-on-start \
  --output-dir "$OUT/policy" --overwrite-output-dir --beta 0.1 --learning-rate 2e-4 --warmup-steps 0.1 --num-train-epochs 2 \
  --per-device-train-batch-size 16 --logging-steps 5 --eval-steps 10 --save-steps 50 --save-total-limit 1 "$@"
