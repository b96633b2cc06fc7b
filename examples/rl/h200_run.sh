#!/usr/bin/env bash
# GRPO on a Qwen3-MoE-shaped model on one H200, NVFP4 learner + rollout engine on the same weights:
# the qwen3-moe preset (Qwen3-30B-A3B's layer shapes: hidden 2048, 32 heads / 4 KV groups of 128,
# 128 experts top-8 with FFN 768, qk-layernorm; NUM_LAYERS of them, the preset's 4 by default),
# 2-digit addition. A supervised warm-up (lr 2e-4 after a 20-step linear warm-up; stops at 30% greedy
# accuracy on training prompts, or at half the time budget), then 120 GRPO steps (lr 1e-5, 8 updates
# of warm-up, cosine to 0) or until the budget; held-out accuracy before, every 5 steps and after.
# Writes metrics.jsonl, curves.png, summary.json, console.log under OUT. Measured (H200, 2026-12-01,
# examples/rl/results/h200_qwen3moe_run3_lr1e-5_cosine): warm-up 75 steps, held-out 0.273 -> 0.414.
#
#   OUT=DIR [TIME_BUDGET_S=360] [HARD_LIMIT_S=400] [PRESET=qwen3-moe] [NUM_LAYERS=4] \
#       examples/rl/h200_run.sh [extra train_grpo.py flags, which override these]
#
# Wall time: TIME_BUDGET_S counts from the start of train_grpo.main (after `import torch`); the
# run then finishes its step, evaluates, plots and writes the summary (a few seconds). HARD_LIMIT_S
# is a watchdog: SIGINT (the trainer then writes summary.json from the steps done), SIGKILL 10 s later.
# On a CPU (the code path, checked in tests/examples/test_train_grpo.py):
#   OUT=/tmp/rl PRESET=tiny NUM_LAYERS=2 TIME_BUDGET_S=60 examples/rl/h200_run.sh --sft-steps 20 --steps 2
set -euo pipefail
OUT=${OUT:-runs/rl_h200}
PRESET=${PRESET:-qwen3-moe}
NUM_LAYERS=${NUM_LAYERS:-4}
TIME_BUDGET_S=${TIME_BUDGET_S:-360}
HARD_LIMIT_S=${HARD_LIMIT_S:-400}
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
{ date -u +"h200_run.sh: %Y-%m-%d %H:%M:%S UTC"; command -v nvidia-smi >/dev/null && nvidia-smi -L || true; } \
    | tee "$OUT/console.log"
set +e
timeout -s INT -k 10 "$HARD_LIMIT_S" "$PYTHON" examples/rl/train_grpo.py \
    --preset "$PRESET" --num-layers "$NUM_LAYERS" --digits 2 \
    --sft-steps 1500 --sft-batch-size 256 --sft-lr 2e-4 --sft-lr-warmup-steps 20 --sft-target-accuracy 0.3 \
    --sft-eval-interval 25 \
    --steps 120 --rollout-batch-size 32 --group 8 --mini-batch-size 16 --ppo-epochs 2 --micro-batch-size 256 \
    --lr 1e-5 --lr-warmup-steps 8 --lr-decay-style cosine --eps-clip 0.2 --eps-clip-high 0.28 --tis-cap 2.0 --clip-grad 1.0 \
    --eval-interval 5 --eval-size 256 --time-budget-s "$TIME_BUDGET_S" \
    --no-progress --log-dir "$OUT" "$@" 2>&1 | grep --line-buffered -v "static requests" | tee -a "$OUT/console.log"
rc=${PIPESTATUS[0]}
set -e
echo "h200_run.sh: train_grpo.py exit status $rc; $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/console.log"
if [ -f "$OUT/summary.json" ]; then cat "$OUT/summary.json"; fi
exit "$rc"
