#!/usr/bin/env bash
# Everything this repository runs on a lent GPU machine, as named steps, in one command:
#
#   benchmarks/device.sh [STEP ...]          (from any directory; default: gpu_tests kernel_tests learner
#                                             rollout alignment kernels)
#   benchmarks/device.sh --list              the steps and what each runs
#
# Steps:
#   gpu_tests     every `-m gpu` test of the suite (strict mode, the minite model, the rollout engine on CUDA)
#   kernel_tests  the other Triton kernel tests, compiled for the GPU (tests/kernels; on a CPU they run
#                 interpreted); PYTEST_WORKERS xdist workers, default 12
#   gpu_set       the whole GPU set, gpu_tests and kernel_tests as one pytest run (-m "(gpu or kernels) and not
#                 aot"): one worker pool; the compile-only `aot` tests (sm_90a SASS, the same on any machine) run in CI
#   graphs        the CUDA-graph checks (GraphedStep, --cuda-graph-impl full_iteration, the RL trainer): graphed == eager, bit for bit
#   learner       benchmarks.learner_step: anchor, BF16 twin, NVFP4, NVFP4 RNE, strict at 4096 and 16384 tokens,
#                 eager and CUDA-graphed
#   rollout       benchmarks.rollout on the qwen3-moe preset: engines x batch 1 / 8 / 64
#   rollout48     benchmarks.rollout --preset qwen3-30b-a3b: the whole 48-layer model
#   alignment     benchmarks.alignment: learner-vs-rollout gaps, default and strict (ALIGNMENT.md)
#   kernels       benchmarks.kernels: the default sections (the tables BENCHMARKS.md quotes)
#   profile       Nsight Compute counters of single kernels (benchmarks.kernels --sections ncu_cases)
#   multigpu      the launcher on 2 GPUs: TP=2 + SP, and EP=2 (NCCL); skipped with one GPU
#   blackwell     benchmarks.blackwell_bringup --quick (refuses with the reason on a non-Blackwell GPU)
#   rl            the RL example (GRPO, qwen3-moe preset, ~6 min): examples/rl/h200_run.sh
#
# The machine has torch, triton and CUDA but no megatron-core: its wheel travels in .whl/ and is
# installed into /tmp/site; kernels/ is linked there as minite_kernels. NVLink multicast is off
# (NCCL NVLS, symmetric memory, NVSHMEM). Each step's full log goes to $OUT/<step>.log (the JSON
# lines to $OUT and benchmarks/results/), its tail is printed. Env: OUT (default /tmp/minite_out),
# BUNDLE=1 (pack $OUT into one results.tgz), KERNEL_TESTS_K (a -k filter for kernel_tests),
# STEP_TIMEOUT_S (each step's cap, default 570).
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS="gpu_set gpu_tests kernel_tests graphs learner rollout rollout48 alignment kernels profile multigpu blackwell rl"
if [ "${1:-}" = --list ]; then
  sed -n '/^# Steps:/,/^#$/p' "$0" | sed '1d;$d;s/^#   //'
  exit 0
fi
for s in "$@"; do
  case " $STEPS " in *" $s "*) ;; *) echo "benchmarks/device.sh: unknown step '$s' (steps: $STEPS)" >&2; exit 2 ;; esac
done
RUN=${*:-gpu_tests kernel_tests learner rollout alignment kernels}
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "benchmarks/device.sh: the megatron-core wheel is missing in .whl/" >&2; exit 1; }
ln -sfn "$PWD/kernels" /tmp/site/minite_kernels   # the package name kernels/ is installed under
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron requires it with tensor parallelism
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
{ nvidia-smi -L; date -u +"start %FT%TZ"
  python3 -c 'import torch, triton, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__)'
} | tee "$OUT/devices.txt"

step() {  # step NAME CMD...: run under the step cap, keep the full log, show its tail
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout -k 10 "${STEP_TIMEOUT_S:-570}" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v "UserWarning\|warnings.warn\|DeprecationWarning" "$OUT/$name.log" | tail -n 25
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
}

PYTEST=(python3 -m pytest -q -p no:cacheprovider -ra)
WORKERS=${PYTEST_WORKERS:-16}  # pytest-xdist workers of the test steps (the GPU is shared; 16 CPU cores)
# work stealing (pytest-xdist >= 3.2): an idle worker takes queued tests from a busy one, so a few
# minute-long tests do not leave the set waiting on one worker's queue
STEAL=$(python3 -c 'import xdist; print("--dist=worksteal" if tuple(map(int, xdist.__version__.split(".")[:2])) >= (3, 2) else "")' 2>/dev/null)
for s in $RUN; do
  case $s in
    gpu_tests) step gpu_tests "${PYTEST[@]}" -n "$WORKERS" -m gpu tests ;;
    gpu_set) step gpu_set "${PYTEST[@]}" -n "$WORKERS" $STEAL --durations=30 -m "(gpu or kernels) and not aot" tests ;;
    kernel_tests) step kernel_tests "${PYTEST[@]}" -n "$WORKERS" -m "not gpu and not aot" tests/kernels ${KERNEL_TESTS_K:+-k "$KERNEL_TESTS_K"} ;;
    graphs) step graphs "${PYTEST[@]}" -n 4 -m gpu tests/megatron tests/examples -k graph ;;
    learner) step learner python3 -m benchmarks.learner_step --tokens 4096,16384 --variants anchor,bf16,nvfp4,nvfp4_rne,strict \
      --graphs eager,graphed --iters 6 --warmup 2 --out "$OUT" ;;
    rollout) step rollout python3 -m benchmarks.rollout --batches 1,8,64 --gap-batch 8 --json "$OUT/rollout.jsonl" ;;
    rollout48) step rollout48 python3 -m benchmarks.rollout --preset qwen3-30b-a3b --json "$OUT/rollout48.jsonl" ;;
    alignment) step alignment python3 -m benchmarks.alignment --preset qwen3-moe --json "$OUT/alignment.jsonl" ;;
    kernels) step kernels python3 -m benchmarks.kernels --tokens 16384 --no-naive --out "$OUT" ;;
    profile)
      for c in decode_qkv_m1 decode_fc2_m1 cols_dy_sr_rht; do
        step "ncu_$c" ncu --clock-control none --kernel-name regex:'decode|quantize|amax' --launch-skip 4 \
          --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
          --section WarpStateStats --section LaunchStats --section SchedulerStats \
          python3 -m benchmarks.kernels --sections ncu_cases --ncu-cases "$c" --reps 6
      done ;;
    multigpu)
      if [ "$NGPU" -lt 2 ]; then echo "=== multigpu: skipped ($NGPU GPU)"; continue; fi
      COMMON=(--transformer-impl minite --num-layers 4 --hidden-size 256 --ffn-hidden-size 768
        --num-attention-heads 8 --kv-channels 32 --group-query-attention --num-query-groups 4 --qk-layernorm
        --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256 --moe-token-dispatcher-type alltoall
        --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --normalization RMSNorm --swiglu
        --disable-bias-linear --position-embedding-type rope --untie-embeddings-and-output-weights
        --hidden-dropout 0 --attention-dropout 0 --seq-length 256 --max-position-embeddings 256
        --micro-batch-size 4 --global-batch-size 8 --train-iters 30 --lr 3e-3 --lr-warmup-iters 5 --bf16
        --mock-data --tokenizer-type NullTokenizer --vocab-size 4096 --eval-iters 0 --eval-interval 1000
        --log-interval 10 --no-gradient-accumulation-fusion --attention-backend unfused)
      step multigpu_tp2_sp torchrun --nproc-per-node 2 -m minite_megatron.launch examples/pretrain_gpt.py "${COMMON[@]}" \
        --tensor-model-parallel-size 2 --sequence-parallel --loss-log "$OUT/loss_tp2.jsonl"
      step multigpu_ep2 torchrun --nproc-per-node 2 -m minite_megatron.launch examples/pretrain_gpt.py "${COMMON[@]}" \
        --expert-model-parallel-size 2 --loss-log "$OUT/loss_ep2.jsonl" ;;
    blackwell) step blackwell python3 -m benchmarks.blackwell_bringup --quick --json "$OUT/blackwell_bringup_report.json" ;;
    rl) step rl env OUT="$OUT/rl" TIME_BUDGET_S=360 HARD_LIMIT_S=400 bash examples/rl/h200_run.sh ;;
  esac
done
date -u +"end %FT%TZ"

# The device tool returns a limited number of files: with BUNDLE=1 everything is packed into one archive.
if [ "${BUNDLE:-0}" = 1 ]; then
  tar czf /tmp/minite_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/minite_results.tgz "$OUT/results.tgz"
fi
