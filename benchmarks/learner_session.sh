#!/usr/bin/env bash
# The learner GPU session (issue 16, round 2) in one device call, ~150 s with compiles:
#   1. the learner GPU tests (combine kernels, bi_* kernels incl. the new tiles, the strict gap,
#      the minite model on the GPU) in parallel with a warm-up that fills Triton's cache;
#   2. the learner-step benchmark: anchor, BF16 twin, NVFP4, strict at 4096 and 16384 tokens
#      (one profiled step each: top kernels by GPU time);
#   3. with the time left, the MoE-combine benchmark (torch vs kernel vs Megatron's atomics).
# Logs and JSON in $OUT, bundled into $OUT/learner_session.tgz at the end.
#
#   BUDGET_S=150 benchmarks/learner_session.sh     (repository root, after device_env.sh)
#   SMOKE=1 benchmarks/learner_session.sh          (a CPU: tiny model, checks the script runs)
set -uo pipefail
OUT=${OUT:-/tmp/minite_out}; mkdir -p "$OUT"
SMOKE=${SMOKE:-0}
BUDGET_S=${BUDGET_S:-$([ "$SMOKE" = 1 ] && echo 1200 || echo 150)}
T0=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - T0))); }
if [ "$SMOKE" = 1 ]; then
  SIZE=(--smoke); WARM=(--smoke); TESTS_TIMEOUT=300; BENCH=(--smoke --iters 1 --warmup 1 --profile 1 --top 10)
else
  SIZE=(); WARM=(--tokens 4096); TESTS_TIMEOUT=60; BENCH=(--tokens 4096,16384 --iters 5 --warmup 2 --profile 1 --top 40)
  nvidia-smi -L > "$OUT/devices.txt"
fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/devices.txt"

# 1. tests || warm-up (the warm-up only compiles: its numbers go nowhere)
W=$(mktemp -d)
python3 -m benchmarks.learner_step "${WARM[@]}" --variants nvfp4 --iters 1 --warmup 1 --out "" --json-dir "$W" > "$OUT/warm_nvfp4.log" 2>&1 &
python3 -m benchmarks.learner_step "${WARM[@]}" --variants strict --iters 1 --warmup 1 --out "" --json-dir "$W" > "$OUT/warm_strict.log" 2>&1 &
timeout $TESTS_TIMEOUT python3 -m pytest -q -p no:cacheprovider -ra \
  tests/kernels/triton/moe/test_moe_combine.py tests/kernels/triton/invariant/test_bi_kernels.py tests/kernels/test_custom_op.py \
  "tests/strict/test_strict_alignment.py::test_gpu_strict_gap_is_exactly_zero_with_triton_kernels" \
  > "$OUT/tests.log" 2>&1 &
timeout $TESTS_TIMEOUT python3 -m pytest -q -p no:cacheprovider -ra -m gpu tests/megatron/test_minite_gpu.py \
  tests/megatron/test_minite_attention.py tests/ops/test_bf16_grouped_linear.py tests/ops/test_weight_cache_memory.py \
  > "$OUT/tests_gpu.log" 2>&1 &
wait
echo "warm-up + tests: $((SECONDS - T0)) s"; tail -n 3 "$OUT/tests.log" "$OUT/tests_gpu.log"
grep -h -E "^(FAILED|ERROR)" "$OUT/tests.log" "$OUT/tests_gpu.log" | head -n 20

# 2. the learner step (one JSON line per token count, written as each finishes)
mkdir -p "$OUT/p"
timeout $(( $(left) > 40 ? $(left) - 15 : 30 )) python3 -m benchmarks.learner_step "${BENCH[@]}" \
  --variants anchor,bf16,nvfp4,strict --out "$OUT/p" 2>&1 | grep -v -i warn | tee "$OUT/bench.log"
echo "learner step done at $((SECONDS - T0)) s"

# 3. the combine kernels alone, with the time left
if [ "$(left)" -gt 8 ] || [ "$SMOKE" = 1 ]; then
  timeout $(( $(left) > 8 ? $(left) : 60 )) python3 -m benchmarks.moe_combine "${SIZE[@]}" --out "$OUT" 2>&1 \
    | grep -v -i warn | tail -n 18
fi
echo "total: $((SECONDS - T0)) s"
rm -rf "$W"
cd "$OUT" && tar czf /tmp/learner_session.tgz --exclude=learner_session.tgz . \
  && find . -mindepth 1 -maxdepth 1 ! -name learner_session.tgz -exec rm -rf {} + && mv /tmp/learner_session.tgz "$OUT/"
