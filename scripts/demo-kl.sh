#!/usr/bin/env bash
# The demo with the reference's distribution: precompute a top-k reference cache over data/ (precompute-ref
# --top-k, K=${TOP_K:-32}), then train DPO on it; metrics.png then has a KL panel (the per-token KL(policy||reference)
# and KL(reference||policy) lower bounds, README "KL metrics and token-level losses with a top-k cache").
# Outputs go to $OUT (default runs/demo-kl), the caches apart from scripts/demo.sh's (another K is another cache).
# Extra options go to train-dpo, e.g. `bash scripts/demo-kl.sh --loss-type tdpo2` or `--kl-coef 0.1`.
# By default the run is KL-controlled (README "Controlling KL"): a band controller keeps the per-token KL bound in
# $KL_CONTROL's band, checked every 5 steps (β x/÷ 1.2), with an alarm at 0.5 nats per token; metrics.png then shows
# β and the KL with the band shaded. KL_CONTROL= bash scripts/demo-kl.sh runs with a fixed β.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/demo-kl}
TOP_K=${TOP_K:-32}
KL_CONTROL=${KL_CONTROL-"--kl-target 0.0005:0.002 --kl-adapt-every 5 --kl-alarm 0.5:warn"}
for split in train test; do  # eval.jsonl is split "test", as in datasets
  .venv/bin/precompute-ref --model data/sft-model --data data/prefs --split "$split" --top-k "$TOP_K" \
    --out "$OUT/ref-cache-$split-top$TOP_K"
done
.venv/bin/train-dpo --model data/sft-model --data data/prefs --ref-cache "$OUT/ref-cache-train-top$TOP_K" \
  --eval-data data/prefs --eval-split test --eval-ref-cache "$OUT/ref-cache-test-top$TOP_K" \
  --output-dir "$OUT/policy" --overwrite-output-dir --beta 0.1 --learning-rate 2e-4 --warmup-steps 0.1 --num-train-epochs 2 \
  --per-device-train-batch-size 16 --logging-steps 5 --eval-steps 10 --save-steps 50 --save-total-limit 1 $KL_CONTROL "$@"
