#!/usr/bin/env bash
# GRPO on a Qwen3-MoE-shaped model (the qwen3-moe preset: hidden 2048, 32 heads / 4 KV groups of 128,
# 128 experts top-8 with FFN 768, qk-layernorm) on one H200, NVFP4 learner + rollout engine.
# Short SFT warm-up (stops at 30% accuracy on training prompts), then RL until the time budget;
# metrics.jsonl, curves.png, summary.json under OUT (default runs/rl_h200).
#   examples/rl/h200_run.sh [extra train_grpo.py flags]
set -euo pipefail
OUT=${OUT:-runs/rl_h200}
cd "$(dirname "$0")/../.."
mkdir -p "$OUT"
python examples/rl/train_grpo.py \
    --preset qwen3-moe --num-layers 2 --digits 2 \
    --sft-steps 200 --sft-batch-size 128 --sft-lr 3e-4 --sft-target-accuracy 0.3 --sft-eval-interval 10 \
    --steps 40 --rollout-batch-size 32 --group 8 --mini-batch-size 16 --ppo-epochs 2 --micro-batch-size 256 \
    --lr 2e-5 --eps-clip 0.2 --eps-clip-high 0.28 --tis-cap 2.0 --clip-grad 1.0 \
    --eval-interval 5 --eval-size 256 --time-budget-s "${TIME_BUDGET_S:-95}" \
    --no-progress --log-dir "$OUT" "$@" 2>&1 | grep --line-buffered -v "static requests" | tee "$OUT/console.log"
