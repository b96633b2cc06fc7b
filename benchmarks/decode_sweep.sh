#!/usr/bin/env bash
# The decode-GEMM work of one device call (issue 15): compile every kernel variant in parallel
# processes (Triton's on-disk cache), run the decode GPU tests beside them, then the timed
# benchmark alone on the GPU (strict bitwise checks, config sweep, dense and MoE tables), and
# one Nsight Compute report of the decode kernel if time is left.
#
#   benchmarks/decode_sweep.sh            (from the repository root; logs and JSON in $OUT)
#
# Env: SHARDS (parallel compile processes, default 12), BENCH_ARGS (extra benchmark arguments,
# e.g. "--m 1,4,16,64 --no-act-quant"), BENCH_DEADLINE_S (the benchmark stops timing after this
# many seconds, default 150), NCU_IF_BEFORE_S (profile only if the script has run less than
# this, default 200), NCU_CASES (benchmarks/profile_kernels.py cases, default decode_qkv_m1).
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

BENCH_ARGS=${BENCH_ARGS:-}
echo "=== compile ($SHARDS processes) + GPU tests (3 processes), in parallel"
for i in $(seq 0 $((SHARDS - 1))); do
  python3 -m benchmarks.decode_gemm --warm-only --shard "$i" --shards "$SHARDS" $BENCH_ARGS > "/tmp/warm_$i.log" 2>&1 &
done
PT="python3 -m pytest -q -p no:cacheprovider -ra"
$PT tests/kernels/triton/test_triton_decode.py -k strict > /tmp/pytest_1.log 2>&1 &
$PT tests/kernels/triton/test_triton_decode.py -k "not strict" > /tmp/pytest_2.log 2>&1 &
$PT tests/nvfp4/test_decode_grouped.py "tests/kernels/triton/test_triton_gpu.py::test_decode_gemm_within_bound_at_real_shape" \
  > /tmp/pytest_3.log 2>&1 &
wait
for i in 1 2 3; do echo "--- pytest $i"; tail -n 30 "/tmp/pytest_$i.log"; done > "$OUT/pytest.log"
for i in $(seq 0 $((SHARDS - 1))); do echo "--- shard $i"; tail -n 5 "/tmp/warm_$i.log"; done > "$OUT/warm.log"
grep -l -i "error\|Traceback" /tmp/warm_*.log && echo "(a warm-up shard failed: see warm.log)"
grep -hE "passed|failed|FAILED|error" /tmp/pytest_*.log
echo "=== compile + tests: $((SECONDS - T0)) s"

echo "=== benchmark"
python3 -m benchmarks.decode_gemm --out "$OUT" --deadline-s "${BENCH_DEADLINE_S:-150}" $BENCH_ARGS 2>&1 \
  | tee "$OUT/bench.log"
echo "=== benchmark done: $((SECONDS - T0)) s"

if [ $((SECONDS - T0)) -lt "${NCU_IF_BEFORE_S:-200}" ] && command -v ncu > /dev/null; then
  echo "=== ncu: decode kernel, ${NCU_CASES:-decode_qkv_m1}"
  for c in ${NCU_CASES:-decode_qkv_m1}; do
    ncu --clock-control none --kernel-name regex:'decode' --launch-skip 4 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --section SchedulerStats python3 -m benchmarks.profile_kernels "$c" --reps 6 \
      > "/tmp/ncu_$c.log" 2>&1
    echo "--- $c"; grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Issued Ipc|No Eligible|Grid Size|Block Size|Compute \(SM\)" "/tmp/ncu_$c.log"
  done | tee "$OUT/ncu.txt"
fi
echo "=== total: $((SECONDS - T0)) s"
