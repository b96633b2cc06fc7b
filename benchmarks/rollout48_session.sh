#!/usr/bin/env bash
# Issue 26 in one device call: the rollout engine at Qwen3-30B-A3B's whole size on one GPU.
#
#   OUT=$OUT bash benchmarks/rollout48_session.sh
#
# 1. the rollout tests (GPU parts included) that tie the decode step to the learner, and the
#    resident-model tests; 2. benchmarks.rollout --preset qwen3-30b-a3b (benchmarks/rollout_full.py):
#    nvfp4 (256x2048 KV peak; batch 1/8/64/256; gap on 8x64 tokens; RL 32x8x512), strict (batch
#    1/8, gap), the BF16 engine at the depth that fits (+ nvfp4 at that cut). Logs and the JSON
#    line go to $OUT. The benchmark is killed at BENCH_S seconds (default 420).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "rollout48_session: megatron-core wheel missing in .whl/" >&2; exit 1; }
ln -sfn "$PWD/kernels" /tmp/site/minite_kernels
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi -L | tee "$OUT/devices.txt"
t0=$SECONDS
timeout 120 python3 -m pytest -q -x tests/rollout/test_resident.py tests/rollout/test_fast_path.py \
  tests/rollout/test_fused_decode.py > "$OUT/tests.log" 2>&1
echo "=== tests: rc=$?, $((SECONDS - t0)) s"; tail -n 3 "$OUT/tests.log"
t0=$SECONDS
timeout -s INT "${BENCH_S:-420}" python3 -m benchmarks.rollout --preset qwen3-30b-a3b \
  --json "$OUT/rollout_full.jsonl" > "$OUT/rollout_full.log" 2>&1
echo "=== rollout_full: rc=$?, $((SECONDS - t0)) s"
grep -v "^INFO\|^WARNING" "$OUT/rollout_full.log" | tail -n 40
