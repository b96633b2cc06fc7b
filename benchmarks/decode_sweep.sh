#!/usr/bin/env bash
# The decode-GEMM work of one device call (issue 15): compile every kernel variant in parallel
# processes (Triton's on-disk cache), run the decode GPU tests beside them, then the timed
# benchmark alone on the GPU (strict bitwise checks, config sweep, dense and MoE tables), and
# one Nsight Compute report of the decode kernel if time is left.
#
#   benchmarks/decode_sweep.sh            (from the repository root; logs and JSON in $OUT)
#
# Env: SHARDS (parallel compile processes, default 12), BENCH_ARGS (extra benchmark arguments,
# e.g. "--m 1,2,4,8,16 --no-act-quant"), BENCH_DEADLINE_S (the benchmark stops timing after this
# many seconds, default 150), NCU_IF_BEFORE_S (profile only if the script has run less than
# this, default 200), NCU_CASES (benchmarks/profile_kernels.py cases, default decode_qkv_m1).
# TESTS=0: no GPU tests beside the compile (default: the decode GPU tests, in 4 processes).
# A second call reuses nothing (a fresh machine): the compile phase is most of the first minute.
# The final benchmark of issue 15 item 3 (the coordinator's combined call, ~75-85 s):
#   SHARDS=12 COMPILE_CAP_S=55 TEST_CAP_S=55 BENCH_DEADLINE_S=25 NCU_IF_BEFORE_S=0 \
#     BENCH_ARGS="--sections dense,grouped --m 1,4,16 --no-act-quant --strict-max-k 2048" benchmarks/decode_sweep.sh
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
echo "=== compile ($SHARDS processes) + GPU tests (4 processes), in parallel"
for i in $(seq 0 $((SHARDS - 1))); do
  timeout "${COMPILE_CAP_S:-85}" python3 -m benchmarks.decode_gemm --warm-only --shard "$i" --shards "$SHARDS" $BENCH_ARGS \
    > "/tmp/warm_$i.log" 2>&1 &
done
PT="timeout ${TEST_CAP_S:-95} python3 -m pytest -q -p no:cacheprovider -rA"
D=tests/kernels/triton/decode/test_triton_decode.py
if [ "${TESTS:-1}" != 0 ]; then
  $PT $D -k "strict and dense" > /tmp/pytest_1.log 2>&1 &
  $PT $D -k "not strict and not grouped" "tests/kernels/triton/test_triton_gpu.py::test_decode_gemm_within_bound_at_real_shape" \
    > /tmp/pytest_2.log 2>&1 &
  $PT $D -k "grouped and strict" > /tmp/pytest_3.log 2>&1 &
  $PT $D -k "grouped and not strict" tests/nvfp4/test_decode_grouped.py > /tmp/pytest_4.log 2>&1 &
fi
wait
for i in 1 2 3 4; do echo "--- pytest $i"; cat "/tmp/pytest_$i.log" 2>/dev/null; done > "$OUT/pytest.log"
for i in $(seq 0 $((SHARDS - 1))); do echo "--- shard $i"; tail -n 5 "/tmp/warm_$i.log"; done > "$OUT/warm.log"
cat /tmp/warm_*.log | grep -i "failed\|error\|Traceback" | sort | uniq -c | head -20
grep -hE "passed|failed|FAILED|error" /tmp/pytest_*.log 2>/dev/null
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
