#!/usr/bin/env bash
# The rollout engine's GPU session, one command (BENCHMARKS.md "Run 7"): benchmarks/rollout.py
# (BF16 / NVFP4 / strict engines at batch 1, 8, 64 on the qwen3-moe preset: decode ms, tokens/s,
# prefill, bytes, gaps, the default-mode variants, GEMM-order checks, the combine's learner cost),
# then, with the time left, the rollout GPU tests (CUDA graphs == eager steps, strict gap 0).
#
#   OUT=/tmp/out BUDGET=150 benchmarks/rollout_session.sh      (after device_env.sh / the wheel install)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-150}
T0=$SECONDS
nvidia-smi -L | tee "$OUT/devices.txt"
python3 -c 'import torch, triton, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__)' | tee -a "$OUT/devices.txt"
timeout $((BUDGET + 40)) python3 -m benchmarks.rollout --json "$OUT/rollout.jsonl" --time-budget "$BUDGET" ${BENCH_ARGS:-} \
  > "$OUT/rollout.log" 2>&1
echo "=== benchmarks.rollout: rc=$?, $((SECONDS - T0)) s"
grep -v "UserWarning\|warnings.warn\|DeprecationWarning\|tp_group\|GPTModel IS DEPRECATED" "$OUT/rollout.log" | tail -n 60
LEFT=$((BUDGET + 60 - (SECONDS - T0)))
if [ "$LEFT" -gt 20 ]; then
  timeout "$LEFT" python3 -m pytest -q -p no:cacheprovider -m gpu -ra tests/rollout -x > "$OUT/gpu_tests.log" 2>&1
  echo "=== rollout GPU tests: rc=$?, $((SECONDS - T0)) s"
  tail -n 15 "$OUT/gpu_tests.log"
else
  echo "=== rollout GPU tests: skipped (no time left)"
fi
