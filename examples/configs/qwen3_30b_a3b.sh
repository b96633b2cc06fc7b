#!/usr/bin/env bash
# Qwen3-30B-A3B with --transformer-impl minite (NVFP4 W4A4) on one 8-GPU node.
#
#   NEEDS GPUs: NOT RUN on the CPU development machines (only its flags are checked there, by
#   tests/megatron/test_launch_args.py, against Megatron's real argument parser and minite's checks).
#
# Architecture (Hugging Face Qwen/Qwen3-30B-A3B config.json): 48 layers, hidden 2048, 32 query heads
# and 4 KV heads of dimension 128, every layer MoE with 128 experts (top-8, expert FFN 768; Qwen3's
# softmax router with renormalized top-k probabilities is Megatron's default top-k-then-softmax),
# qk-layernorm, SwiGLU, RMSNorm (eps 1e-6), RoPE theta 1e6, no biases, untied embeddings,
# vocabulary 151936.
# Parallelism: EP=8 (16 experts per GPU), TP=1, PP=1, data parallel 8 for the dense part,
# distributed optimizer; BF16 master params for the non-quantized parts.
#
# Use (source it, then add data/tokenizer/training flags):
#   source examples/configs/qwen3_30b_a3b.sh
#   torchrun --nproc-per-node 8 -m minite_megatron.launch examples/pretrain_gpt.py \
#       "${QWEN3_30B_A3B_ARGS[@]}" \
#       --tokenizer-type HuggingFaceTokenizer --tokenizer-model Qwen/Qwen3-30B-A3B \
#       --data-path /path/to/tokenized_text_document --split 99,1,0 \
#       --micro-batch-size 1 --global-batch-size 256 --train-iters 1000 \
#       --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 50 \
#       --save /path/to/checkpoints --save-interval 200 --load /path/to/checkpoints
QWEN3_30B_A3B_MODEL_ARGS=(
  --transformer-impl minite
  --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144
  --num-attention-heads 32 --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
  --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 768
  --moe-router-score-function softmax
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 --moe-router-dtype fp32
  --moe-token-dispatcher-type alltoall
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights
  --seq-length 4096 --max-position-embeddings 40960 --vocab-size 151936 --make-vocab-size-divisible-by 128
  --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
)
QWEN3_30B_A3B_PARALLEL_ARGS=(
  --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
  --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
  --use-distributed-optimizer --bf16 --distributed-backend nccl
)
QWEN3_30B_A3B_ARGS=("${QWEN3_30B_A3B_MODEL_ARGS[@]}" "${QWEN3_30B_A3B_PARALLEL_ARGS[@]}")
