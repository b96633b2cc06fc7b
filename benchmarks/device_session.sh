#!/usr/bin/env bash
# Everything this repository runs on a lent GPU machine, in one command (the machine has torch,
# triton and CUDA but not megatron-core: its wheel travels in .whl/, see BENCHMARKS.md).
#
#   benchmarks/device_session.sh [STEP ...]      steps: tests alignment kernels fused profile multigpu
#                                                (also: pending kernel_tests decode producers)
#                                                (default: all)
#
# Logs and JSON go to $OUT (the device tool's output folder) or /tmp/minite_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/minite_out}
mkdir -p "$OUT"
STEPS=${*:-tests alignment kernels fused profile multigpu}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "device_session: megatron-core wheel missing in .whl/" >&2; exit 1; }
ln -sfn "$PWD/kernels" /tmp/site/minite_kernels   # the package name kernels/ is installed under
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron requires it with tensor parallelism
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi -L | tee "$OUT/devices.txt"
python3 -c 'import torch, triton, megatron.core as m; print("torch", torch.__version__, "triton", triton.__version__, "megatron-core", m.__version__)' | tee -a "$OUT/devices.txt"

step() {  # step NAME CMD...: run, keep the full log, show its tail
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
}

for s in $STEPS; do
  case $s in
    pending)  # the GPU checks that would switch on what is written and gated off (BENCHMARKS.md, "pending"):
      # the launch table (MINITE_FAST_LAUNCH), the strict dense decode candidates (STRICT_DENSE_NEXT_VERIFIED),
      # each A/B in one process or one call (the MoE layer without its host wait is the default now)
      step fast_launch_test timeout 120 python3 -m pytest -q -p no:cacheprovider -ra tests/kernels/triton/test_fast_launch.py
      for m in 1 0 1 0; do
        step "learner_fast_launch_$m" env MINITE_FAST_LAUNCH=$m timeout 120 python3 -m benchmarks.learner_step \
          --tokens 4096,16384 --variants nvfp4 --iters 8 --warmup 2 --out "$OUT/fast_launch_$m"
      done
      step dense_strict_check timeout 150 python3 -m benchmarks.decode_gemm --sections check_dense_strict --out "$OUT"
      step rollout_dense_next timeout 150 python3 -m benchmarks.rollout --engines nvfp4,strict --batches 8 --no-variants \
        --no-kernel-count --gate minite_kernels.triton.decode_gemm.STRICT_DENSE_NEXT_VERIFIED=true --out "$OUT" ;;
    kernel_tests)  # the Triton kernel tests on CUDA (they run under the interpreter on CPU; not marked gpu)
      step kernel_tests python3 -m pytest -q -p no:cacheprovider -ra tests/kernels/triton ${KERNEL_TESTS_K:+-k "$KERNEL_TESTS_K"} ;;
    decode)  # the decode GEMMs: strict bitwise checks, config sweep, dense + MoE tables against BF16
      step decode python3 -m benchmarks.decode_gemm --out "$OUT" ;;
    tests)  # every GPU test of the suite (Triton kernels, strict mode, minite model, reference on CUDA)
      step gpu_tests python3 -m pytest -q -p no:cacheprovider -m gpu -ra tests ;;
    alignment)  # ALIGNMENT.md: gaps and strict-mode overhead on a Qwen3-MoE-shaped model
      step alignment python3 -m benchmarks.alignment --preset qwen3-moe --json "$OUT/alignment.jsonl" ;;
    kernels)  # BENCHMARKS.md: the kernel benchmark (quantize, linear, grouped sections)
      step kernels python3 -m benchmarks.nvfp4_kernels --sections ceilings,quantize,linear,grouped --tokens 16384 \
        --out "$OUT" ;;
    fused)  # the fused producers (norm/SwiGLU -> quantize)
      step producers python3 -m benchmarks.producers --out "$OUT" ;;
    producers) step producers python3 -m benchmarks.producers --out "$OUT" ;;
    profile)  # Nsight Compute counters of single kernels (benchmarks/profile_kernels.py), reports kept
      for c in decode_qkv_m1 decode_fc2_m1 cols_dy_sr_rht; do
        step "ncu_$c" ncu --clock-control none --kernel-name regex:'decode|quantize|amax' --launch-skip 4 \
          --launch-count 2 --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
          --section WarpStateStats --section LaunchStats --section SchedulerStats \
          python3 -m benchmarks.profile_kernels "$c" --reps 6
      done ;;
    multigpu)  # the main job's model on 2 GPUs: TP=2 + SP, and EP=2 (NCCL), through the launcher
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
        --expert-model-parallel-size 2 --loss-log "$OUT/loss_ep2.jsonl"
      ;;
    *) echo "unknown step $s" >&2 ;;
  esac
done

# The device tool returns at most 8 files: with BUNDLE=1 everything is packed into one archive.
if [ "${BUNDLE:-0}" = 1 ]; then
  tar czf /tmp/minite_results.tgz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/minite_results.tgz "$OUT/results.tgz"
fi
