#!/usr/bin/env bash
# The main job: train a tiny Qwen3-MoE-shaped model (4 layers, 8 experts top-2, GQA, qk-layernorm,
# SwiGLU, RoPE, RMSNorm) with --transformer-impl minite (NVFP4 W4A4, miniTE's recipe) on the
# machine's default backend (the CPU reference when there is no GPU), with a progress bar and the
# loss. A few minutes on 2 CPU cores. Extra arguments go to Megatron / the recipe, e.g.
#     examples/train_tiny_moe.sh --train-iters 50 --minite-strict
# Runs resume as Megatron's do (--save and --load are the same directory): a rerun continues from
# the latest checkpoint; ITERS=400 examples/train_tiny_moe.sh --override-opt_param-scheduler trains
# on to 400 iterations with the schedule of 400 (without that flag Megatron's scheduler check
# stops the run, and the one line printed names the flag).
# Environment: ITERS (default 200), RUN_DIR (default runs/tiny_moe), PYTHON (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUN_DIR=${RUN_DIR:-runs/tiny_moe}
DATA=${DATA:-runs/data/tiny_corpus/tiny}
ITERS=${ITERS:-200}
CKPT="$RUN_DIR/checkpoints"
mkdir -p "$RUN_DIR"
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$RUN_DIR/.inductor}
if [ ! -f "$DATA.bin" ]; then
  "$PY" examples/make_tiny_corpus.py --output "$DATA" >/dev/null
fi
LOAD=()
if [ -f "$CKPT/latest_checkpointed_iteration.txt" ]; then
  DONE=$(cat "$CKPT/latest_checkpointed_iteration.txt")
  LOAD=(--load "$CKPT")
  echo "train_tiny_moe: resuming from $CKPT (iteration $DONE); ITERS=$ITERS; a new RUN_DIR starts over" >&2
  if [ "$DONE" != release ] && [ "$DONE" -ge "$ITERS" ]; then
    echo "train_tiny_moe: $CKPT already holds iteration $DONE >= ITERS=$ITERS: nothing to train (ITERS=$((DONE + 200)) ... --override-opt_param-scheduler trains on)" >&2
    exit 0
  fi
fi
PORT=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
echo "train_tiny_moe: $ITERS iterations; Megatron's log: $RUN_DIR/train.log; losses: $RUN_DIR/loss.jsonl" >&2
rm -f "$RUN_DIR/loss.jsonl"
MASTER_ADDR=127.0.0.1 MASTER_PORT=$PORT RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \
"$PY" -m minite_megatron.launch examples/pretrain_gpt.py \
  --transformer-impl minite \
  --num-layers 4 --hidden-size 64 --ffn-hidden-size 192 \
  --num-attention-heads 4 --kv-channels 16 --group-query-attention --num-query-groups 2 --qk-layernorm \
  --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 64 --moe-token-dispatcher-type alltoall \
  --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3 \
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear \
  --position-embedding-type rope --rotary-base 1000000 --untie-embeddings-and-output-weights \
  --attention-backend unfused --hidden-dropout 0 --attention-dropout 0 \
  --seq-length 64 --max-position-embeddings 64 --micro-batch-size 8 --global-batch-size 8 \
  --train-iters "$ITERS" --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 \
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta2 0.95 --seed 1234 \
  --data-path "$DATA" --split 99,1,0 --vocab-size 256 --num-workers 0 \
  --eval-iters 0 --eval-interval "$ITERS" --log-interval 10 \
  --save "$CKPT" --save-interval "$ITERS" "${LOAD[@]}" \
  --progress-bar --loss-log "$RUN_DIR/loss.jsonl" \
  "$@" > "$RUN_DIR/train.log"
"$PY" - "$RUN_DIR/loss.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
if not rows:
    sys.exit(f"train_tiny_moe: no iteration ran (see {sys.argv[1].rsplit('/', 1)[0]}/train.log)")
first, last = rows[0], rows[-1]
tail = rows[-10:]
print(f"train_tiny_moe: loss {first['lm loss']:.3f} (iteration {first['iteration']}) -> "
      f"{sum(r['lm loss'] for r in tail) / len(tail):.3f} (mean of the last {len(tail)} iterations to {last['iteration']}, "
      f"uniform would be 5.545); checkpoint in {sys.argv[1].rsplit('/', 1)[0]}/checkpoints")
PYEOF
