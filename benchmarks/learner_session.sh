#!/usr/bin/env bash
# The learner helper's GPU session (issue 16) in one device call: GPU tests of the learner-step
# code (in parallel with a warm-up that fills Triton's cache), the learner-step benchmark at 4096
# and 16384 tokens, then -- with the time left under BUDGET_S -- the memory-design A/B runs and
# the kernel-config sweep. Logs and JSON in $OUT, bundled into one archive at the end.
#
#   BUDGET_S=200 benchmarks/learner_session.sh          (from the repository root, after device_env.sh)
set -uo pipefail
OUT=${OUT:-/tmp/minite_out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-200}
T0=$SECONDS
left() { echo $((BUDGET_S - (SECONDS - T0))); }
nvidia-smi -L > "$OUT/devices.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/devices.txt"
python3 -m benchmarks.learner_step --tokens 4096 --variants nvfp4 --iters 1 --warmup 1 --json-dir /tmp/w > "$OUT/warm_nvfp4.log" 2>&1 &
python3 -m benchmarks.learner_step --tokens 4096 --variants strict --iters 1 --warmup 1 --json-dir /tmp/w > "$OUT/warm_strict.log" 2>&1 &
timeout 90 python3 -m pytest -q -p no:cacheprovider -ra \
  tests/ops/test_weight_cache_memory.py tests/kernels/triton/test_bi_kernels.py \
  "tests/kernels/triton/test_triton_quantize_rows.py::test_weight_tiles_tensor_and_group_scales" \
  "tests/kernels/triton/test_triton_quantize_rows.py::test_weight_tiles_hard_cases" \
  "tests/strict/test_strict_alignment.py::test_gpu_strict_gap_is_exactly_zero_with_triton_kernels" \
  > "$OUT/tests.log" 2>&1 &
timeout 90 python3 -m pytest -q -p no:cacheprovider -ra -m gpu tests/megatron/test_minite_attention.py \
  tests/ops/test_bf16_grouped_linear.py tests/megatron/test_minite_gpu.py > "$OUT/tests_gpu.log" 2>&1 &
wait
echo "warm-up + tests: $((SECONDS - T0)) s"; tail -n 4 "$OUT/tests.log" "$OUT/tests_gpu.log"
mkdir -p "$OUT/p"
timeout $(( $(left) - 5 )) python3 -m benchmarks.learner_step --tokens 4096,16384 --variants anchor,bf16,nvfp4,strict \
  --iters 5 --warmup 2 --profile 1 --cached-too --top 25 --out "$OUT/p" 2>&1 | grep -v -i warn | tee "$OUT/bench.log"
echo "benchmark done at $((SECONDS - T0)) s"
if [ "$(left)" -gt 25 ]; then
  python3 -m benchmarks.learner_step --tokens 4096 --variants nvfp4+keep_codes,nvfp4+keep_images --iters 5 --warmup 2 \
    --out "$OUT/ab" --json-dir /tmp/w 2>&1 | grep -v -i warn | tail -n 8
fi
if [ "$(left)" -gt 30 ]; then
  timeout $(( $(left) - 8 )) python3 -m benchmarks.learner_sweep --sections tile_quantize,wgrad --out "$OUT" 2>&1 | tail -n 30
fi
echo "total: $((SECONDS - T0)) s"
cd "$OUT" && tar czf /tmp/learner_session.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/learner_session.tgz "$OUT/learner_session.tgz"
