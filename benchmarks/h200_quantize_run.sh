#!/usr/bin/env bash
# One batched device call for the quantize kernels (repository root, $OUT set by the caller):
#   1. in parallel: Triton's cache warmed by every variant the timing runs use (8 processes),
#      and the GPU bitwise tests of the quantize kernels (pytest -n 8);
#   2. then, one after another on the idle GPU: benchmarks.quantize_kernels (new vs previous
#      kernels, tile sweeps) and benchmarks.nvfp4_kernels linear + grouped sections.
# Logs and JSON land in $OUT; the last lines printed are the tables.
set -u
OUT=${OUT:-/tmp/quantize_run}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
# minite_kernels is kernels/ installed under another name: without the editable install, a link
$PY -c "import minite_kernels" 2>/dev/null || { ln -sfn kernels minite_kernels; export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv >"$OUT/smi.txt" 2>&1
t0=$(date +%s)
for i in 0 1 2 3 4 5; do
  timeout "${WARM_TIMEOUT:-100}" $PY -m benchmarks.quantize_kernels --warm-only --shard "$i/6" >"$OUT/warm_q$i.log" 2>&1 &
done
timeout "${WARM_TIMEOUT:-100}" $PY -m benchmarks.nvfp4_kernels --warm-only --sections linear --tokens 16384 --no-naive \
  >"$OUT/warm_lin.log" 2>&1 &
timeout "${WARM_TIMEOUT:-100}" $PY -m benchmarks.nvfp4_kernels --warm-only --sections grouped >"$OUT/warm_grp.log" 2>&1 &
T=tests/kernels/triton
timeout "${TEST_TIMEOUT:-100}" $PY -m pytest -q -n 8 -p no:cacheprovider \
  $T/test_triton_quantize.py $T/test_triton_quantize_rows.py $T/test_triton_quantize_cols.py \
  $T/test_triton_quantize_amax.py "$T/test_triton_gpu.py::test_quantize_bitwise_at_real_shapes" \
  "$T/test_triton_gpu.py::test_quantize_weights_16x16_at_real_shape" \
  "$T/test_triton_gpu.py::test_grouped_wgrad_at_real_shape" >"$OUT/tests.log" 2>&1
echo "tests rc=$? after $(($(date +%s) - t0)) s: $(tail -1 "$OUT/tests.log")"
wait
echo "warm-up done after $(($(date +%s) - t0)) s"; grep -h -i "error\|FAILED" "$OUT"/warm_*.log | head -5
$PY -m benchmarks.quantize_kernels --out "$OUT" >"$OUT/bench_quantize.log" 2>&1
echo "quantize bench rc=$? after $(($(date +%s) - t0)) s"
$PY -m benchmarks.nvfp4_kernels --sections linear,grouped --tokens 16384 --no-naive --out "$OUT" \
  >"$OUT/bench_linear.log" 2>&1
echo "linear/grouped bench rc=$? after $(($(date +%s) - t0)) s"
grep -v "^\[" "$OUT/bench_quantize.log" | tail -60
tail -32 "$OUT/bench_linear.log"
grep -E "passed|failed" "$OUT/tests.log" | tail -3; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10
