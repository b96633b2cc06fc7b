#!/usr/bin/env bash
# The rollout engine's GPU session in one device call, <= 100 s of wall time (issue 15, round 2):
#
#   1. in parallel, capped at $T1 s (compile-bound, the GPU mostly idle): the GPU tests (CUDA graphs
#      == eager steps and strict gap 0; the fused decode kernels == the unfused step on the learner's
#      modules, default and strict; the fused kernels' own tests on the GPU: residual add + RMSNorm ->
#      NVFP4, q/k norm + RoPE + cache, routing, the norm -> NVFP4 producer, weighted SwiGLU) and three
#      warm-up runs of benchmarks/rollout.py with the benchmark's own shapes (nothing timed) that
#      fill Triton's on-disk cache: the NVFP4 and strict engines at batch 1/8/64, the unfused step;
#   2. benchmarks/rollout.py alone on the GPU with the time left: BF16 (local spec, torch._grouped_mm
#      experts, SDPA, the same CUDA graphs), NVFP4 default and strict engines at batch 8 (decode ms,
#      tokens/s, prefill, bytes, learner/sampler gap with the graphs on, kernels per decode step),
#      then the default step with vs without the fused decode kernels (gap, ms, kernels), then
#      batch 1 and 64 of each engine.
#
# Writes into $OUT: summary.txt (this script's output), rollout.jsonl (the benchmark's record) and
# logs.tgz (every log). From the repository root of a staged tree, after device_env.sh:
#
#   OUT=$OUT BUDGET=98 bash benchmarks/rollout_session.sh
#   SMALL=1 BUDGET=600 OUT=/tmp/o bash benchmarks/rollout_session.sh    (CPU dry run: tiny preset, fp32, eager)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-98}
T1=${T1:-52}
T0=$SECONDS
LOGS=$(mktemp -d)
exec > >(tee "$OUT/summary.txt") 2>&1
finish() {
  tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2> /dev/null
  echo "=== total: $((SECONDS - T0)) s"
}
trap finish EXIT
if command -v nvidia-smi > /dev/null; then nvidia-smi -L; fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)'
date -u +"start %FT%TZ"
if [ "${SMALL:-0}" = 1 ]; then
  SHAPES="--preset tiny --batches 1,2 --gap-batch 2 --new 3 --prompt-min 3 --prompt-max 6"
  T1=${SMALL_T1:-600}
else
  SHAPES="--batches 1,8,64 --gap-batch 8"
fi
# the benchmark's sections: every engine, the fused-vs-unfused pair only, no GEMM-order / learner-cost sections
BENCH="$SHAPES --variant-set fused --no-gemm-order --no-learner-costs"
WARM="$BENCH --repeats 0 --variant-repeats 0 --no-kernel-count --json $LOGS/warm.jsonl"
# ---- 1. tests and Triton-cache warm-ups, in parallel (waited for by pid: a bare `wait` would also
#      wait for the `tee` of this script's output)
PIDS=()
timeout "$T1" python3 -m benchmarks.rollout $WARM --engines nvfp4 --no-variants > "$LOGS/warm_nvfp4.log" 2>&1 & PIDS+=($!)
timeout "$T1" python3 -m benchmarks.rollout $WARM --engines strict --no-variants > "$LOGS/warm_strict.log" 2>&1 & PIDS+=($!)
timeout "$T1" python3 -m benchmarks.rollout $WARM --engines "" > "$LOGS/warm_variants.log" 2>&1 & PIDS+=($!)
PYTEST="python3 -m pytest -q -p no:cacheprovider -ra"
G1=tests/rollout/test_fast_path.py::test_cuda_graphs_equal_eager_steps_and_strict_gap_is_zero
G2=tests/rollout/test_fused_decode.py::test_gpu_fused_graphs_equal_the_unfused_eager_steps
for t in "$G1[strict]" "$G1[default]" "$G2[strict]" "$G2[default]"; do  # one process per GPU test
  f=$(basename "${t%%::*}" .py)_${t##*[}
  timeout "$T1" $PYTEST "$t" > "$LOGS/gpu_${f%]}.log" 2>&1 & PIDS+=($!)
done
timeout "$T1" $PYTEST tests/kernels/triton/nvfp4/test_residual_norm.py tests/kernels/triton/decode/test_qk_norm_rope.py \
  tests/kernels/triton/moe/test_moe_route.py -k "not sm90" > "$LOGS/kernel_tests.log" 2>&1 & PIDS+=($!)
timeout "$T1" $PYTEST tests/kernels/triton/nvfp4/test_triton_producers.py -k "test_norm_ or weighted_swiglu or gpu_norm" \
  > "$LOGS/producer_tests.log" 2>&1 & PIDS+=($!)
RCS=()
for p in "${PIDS[@]}"; do wait "$p"; RCS+=($?); done
echo "rc: warm nvfp4/strict/variants, 4 gpu tests, kernel tests, producer tests = ${RCS[*]}"
echo "=== tests + warm-up: $((SECONDS - T0)) s (cap $T1 s; rc 124 = cut by the cap)"
for f in "$LOGS"/gpu_test_*.log "$LOGS"/kernel_tests.log "$LOGS"/producer_tests.log; do
  echo "--- $(basename "$f")"
  grep -E "passed|failed|FAILED|ERROR|SKIPPED|deselected" "$f" | grep -v "warnings.warn\|UserWarning" | tail -n 8
done
for f in "$LOGS"/warm_*.log; do
  echo "--- $(basename "$f"): $(grep -c "ms/step\|variant " "$f") sections done"
  grep -h "Error\|error" "$f" | grep -v "UserWarning\|warnings.warn" | head -n 3
done
# ---- 2. the benchmark alone on the GPU
LEFT=$((BUDGET - (SECONDS - T0)))
if [ "$LEFT" -lt 30 ]; then LEFT=30; fi
date -u +"benchmark %FT%TZ"
timeout -k 10 "$LEFT" python3 -m benchmarks.rollout $BENCH --json "$OUT/rollout.jsonl" --time-budget $((LEFT - 20)) \
  ${BENCH_ARGS:-} > "$LOGS/rollout.log" 2>&1
echo "=== benchmarks.rollout: rc=$?, $((SECONDS - T0)) s"
grep -v "UserWarning\|warnings.warn\|DeprecationWarning\|tp_group\|GPTModel IS DEPRECATED\|^  warn\|Apex\|INFO:\|^WARNING:megatron" \
  "$LOGS/rollout.log" | tail -n 40
