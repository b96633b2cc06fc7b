#!/usr/bin/env bash
# The decode-GEMM work of one device call (issue 15): compile every kernel variant in parallel
# processes (Triton's on-disk cache), run the decode GPU tests beside them, then the timed
# benchmark alone on the GPU (strict bitwise checks, config sweep, dense and MoE tables), and
# one Nsight Compute report of the decode kernel if time is left.
#
#   benchmarks/decode_sweep.sh            (from the repository root; logs and JSON in $OUT)
#
# Env: SHARDS (parallel compile processes, default 12), BENCH_DEADLINE_S (the benchmark stops
# timing after this many seconds, default 150), NCU_IF_BEFORE_S (profile only if the script has
# run less than this, default 200).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/decode_out}
mkdir -p "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton_cache}
SHARDS=${SHARDS:-12}
T0=$SECONDS

{ nvidia-smi --query-gpu=name,uuid,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
} > "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"

echo "=== compile ($SHARDS processes) + GPU tests, in parallel"
for i in $(seq 0 $((SHARDS - 1))); do
  python3 -m benchmarks.decode_gemm --warm-only --shard "$i" --shards "$SHARDS" > "/tmp/warm_$i.log" 2>&1 &
done
python3 -m pytest -q -p no:cacheprovider -ra tests/kernels/triton/test_triton_decode.py tests/nvfp4/test_decode_grouped.py \
  "tests/kernels/triton/test_triton_gpu.py::test_decode_gemm_within_bound_at_real_shape" > "$OUT/pytest.log" 2>&1 &
wait
for i in $(seq 0 $((SHARDS - 1))); do echo "--- shard $i"; tail -n 5 "/tmp/warm_$i.log"; done > "$OUT/warm.log"
grep -l -i "error\|Traceback" /tmp/warm_*.log && echo "(a warm-up shard failed: see warm.log)"
tail -n 15 "$OUT/pytest.log"
echo "=== compile + tests: $((SECONDS - T0)) s"

echo "=== benchmark"
python3 -m benchmarks.decode_gemm --out "$OUT" --deadline-s "${BENCH_DEADLINE_S:-150}" 2>&1 | tee "$OUT/bench.log"
echo "=== benchmark done: $((SECONDS - T0)) s"

if [ $((SECONDS - T0)) -lt "${NCU_IF_BEFORE_S:-200}" ] && command -v ncu > /dev/null; then
  echo "=== ncu: decode kernel, qkv M = 1 and 16"
  for c in decode_qkv_m1 decode_qkv_m16; do
    ncu --clock-control none --kernel-name regex:'decode' --launch-skip 4 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --section SchedulerStats python3 -m benchmarks.profile_kernels "$c" --reps 6 \
      > "/tmp/ncu_$c.log" 2>&1
    echo "--- $c"; grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issued Ipc|No Eligible|Grid Size|Block Size|Compute \(SM\)" "/tmp/ncu_$c.log"
  done | tee "$OUT/ncu.txt"
fi
echo "=== total: $((SECONDS - T0)) s"
