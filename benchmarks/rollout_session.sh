#!/usr/bin/env bash
# The rollout engine's GPU session in one device call (issue 15, round 2; BENCHMARKS.md "Run 7/8"):
#
#   1. in parallel (compile-bound, the GPU mostly idle): the rollout GPU tests (CUDA graphs ==
#      eager steps, fused decode kernels == the learner's modules, strict gap 0, the fused
#      kernels' own GPU checks) and four warm-up runs of benchmarks/rollout.py that fill Triton's
#      on-disk cache with every kernel the benchmark compiles (the three engines at batch 1/8/64,
#      and the default-mode variants, GEMM-order checks and learner-cost sections);
#   2. benchmarks/rollout.py alone on the GPU: BF16 / NVFP4 / strict engines at batch 1, 8, 64
#      (decode ms, tokens/s, prefill, bytes, the gaps), the default-mode variants (fused vs unfused
#      decode step, SDPA vs aligned attention, round 1's default, split-K GEMMs, atomic combine),
#      the GEMM-order checks, the combine's and the aligned ops' cost in the learner.
#
#   OUT=/tmp/out BUDGET=150 benchmarks/rollout_session.sh       (after device_env.sh / the wheel install)
#   SMALL=1 BUDGET=600 benchmarks/rollout_session.sh            (CPU dry run: tiny preset, fp32, eager)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-150}
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
if command -v nvidia-smi > /dev/null; then nvidia-smi -L > "$OUT/devices.txt"; fi
python3 -c 'import torch, triton, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__)' >> "$OUT/devices.txt"
cat "$OUT/devices.txt"
if [ "${SMALL:-0}" = 1 ]; then
  SHAPES="--preset tiny --batches 1,2 --gap-batch 2 --new 3 --prompt-min 3 --prompt-max 6 --learner-tokens 64"
else
  SHAPES=""
fi
WARM_DIR=$(mktemp -d)
WARM="$SHAPES --new 2 --repeats 0 --json $WARM_DIR/warm.jsonl"
# ---- 1. tests and Triton-cache warm-ups, in parallel
for e in bf16 nvfp4 strict; do
  timeout 120 python3 -m benchmarks.rollout --engines "$e" --no-variants $WARM > "$OUT/warm_$e.log" 2>&1 &
done
timeout 120 python3 -m benchmarks.rollout --engines nvfp4 --batches 8 --variants $WARM > "$OUT/warm_variants.log" 2>&1 &
timeout 120 python3 -m pytest -q -p no:cacheprovider -ra -m gpu tests/rollout tests/kernels/triton/test_qk_norm_rope.py \
  tests/kernels/triton/test_moe_route.py > "$OUT/gpu_tests.log" 2>&1 &
timeout 120 python3 -m pytest -q -p no:cacheprovider -ra tests/kernels/triton/test_qk_norm_rope.py \
  tests/kernels/triton/test_moe_route.py "tests/kernels/triton/test_triton_producers.py::test_weighted_swiglu_is_megatrons_grouped_expert_activation" \
  > "$OUT/kernel_tests.log" 2>&1 &
wait
echo "=== tests + warm-up: $((SECONDS - T0)) s"
tail -n 6 "$OUT/gpu_tests.log" "$OUT/kernel_tests.log"
grep -h "Error\|error" "$OUT"/warm_*.log | grep -v "UserWarning\|warnings.warn" | head -n 5
rm -rf "$WARM_DIR"
# ---- 2. the benchmark alone on the GPU
LEFT=$(left)
if [ "$LEFT" -lt 40 ]; then LEFT=40; fi
timeout "$LEFT" python3 -m benchmarks.rollout $SHAPES --json "$OUT/rollout.jsonl" --time-budget $((LEFT - 25)) ${BENCH_ARGS:-} \
  > "$OUT/rollout.log" 2>&1
echo "=== benchmarks.rollout: rc=$?, $((SECONDS - T0)) s"
grep -v "UserWarning\|warnings.warn\|DeprecationWarning\|tp_group\|GPTModel IS DEPRECATED\|^  warn\|Apex\|INFO:" "$OUT/rollout.log" | tail -n 45
echo "=== total: $((SECONDS - T0)) s"
