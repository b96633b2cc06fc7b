"""Megatron ``torch_dist`` checkpoints in the layout ``megatron.training`` (0.19.2) loads.

``megatron/training/checkpointing.py`` reads ``DIR/latest_checkpointed_iteration.txt``; ``release``
there means the directory ``DIR/release/`` (else ``DIR/iter_XXXXXXX/``), which holds one
``dist_checkpointing`` checkpoint (``metadata.json``, ``*.distcp`` and the common state). The
common state carries ``checkpoint_version`` (3.0), ``iteration`` and ``args`` (an
``argparse.Namespace``: ``--load`` compares ``num_layers``, ``hidden_size``,
``num_attention_heads`` and ``add_position_embedding`` with the run's flags, and
``--use-checkpoint-args`` takes the architecture from it); the sharded part is ``{"model":
model.sharded_state_dict()}``, matched at load time by global keys, so Megatron re-shards it into
any TP / EP / PP layout (the embedding and output layer may be vocab-padded differently: Megatron
fills the extra rows with zeros). A *release* checkpoint has no optimizer, scheduler or RNG state:
``--load`` skips them and starts at iteration 0, as ``--pretrained-checkpoint DIR --finetune``
does. The HF ``config.json`` is stored too (``hf_config``), for the way back.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .errors import ConvertError
from .hf_config import hf_dims, moe_layer_freq

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
CHECKPOINT_VERSION = 3.0


def megatron_args(hf_config: dict, *, padded_vocab_size: int, make_vocab_size_divisible_by: int,
                  parallel: dict[str, int]) -> argparse.Namespace:
    """The ``args`` a ``megatron.training`` run of this architecture would have saved (Megatron's
    flag names, so ``--use-checkpoint-args`` rebuilds the model)."""
    d = hf_dims(hf_config)
    moe = d.experts > 0
    return argparse.Namespace(
        num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn, num_attention_heads=d.heads,
        num_query_groups=d.groups, group_query_attention=d.groups != d.heads, kv_channels=d.head_dim,
        max_position_embeddings=d.max_positions, position_embedding_type="rope", add_position_embedding=True,
        rotary_base=d.rope_theta, rotary_percent=1.0, rotary_interleaved=False, normalization="RMSNorm",
        norm_epsilon=d.rms_eps, qk_layernorm=True, swiglu=True, add_bias_linear=False, add_qkv_bias=False,
        untie_embeddings_and_output_weights=not d.tie_embeddings, attention_dropout=d.attention_dropout,
        hidden_dropout=0.0, init_method_std=d.init_std,
        num_experts=d.experts if moe else None, moe_router_topk=d.topk if moe else 2,
        moe_ffn_hidden_size=d.moe_ffn if moe else None,
        moe_layer_freq=moe_layer_freq(d) if moe else 1,
        moe_router_pre_softmax=not d.norm_topk_prob if moe else False, moe_router_score_function="softmax",
        moe_router_enable_expert_bias=False, moe_router_topk_scaling_factor=None, moe_shared_expert_intermediate_size=None,
        moe_grouped_gemm=False, moe_aux_loss_coeff=d.aux_loss_coef, moe_router_dtype="fp32" if moe else None,
        moe_token_dispatcher_type="alltoall",
        vocab_size=d.vocab, padded_vocab_size=padded_vocab_size, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tokenizer_type="HuggingFaceTokenizer", ckpt_format="torch_dist", no_save_optim=True, no_save_rng=True,
        consumed_train_samples=0, consumed_valid_samples=0, skipped_train_samples=0, **parallel,
    )


def save_torch_dist(model, out_dir: str | os.PathLike, hf_config: dict, *, make_vocab_size_divisible_by: int = 128) -> Path:
    """Write ``model`` (every rank its shard; collective) as a release checkpoint under ``out_dir``.

    Raises ConvertError if ``out_dir/release`` exists and is not empty. Returns the checkpoint path.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from .load import unwrap_gpt

    gpt = unwrap_gpt(model)
    out = Path(out_dir)
    ckpt = out / RELEASE
    if ckpt.exists() and any(ckpt.iterdir()):
        raise ConvertError(f"convert: {ckpt} exists and is not empty; choose another --out")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    parallel = dict(
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        world_size=world, data_parallel_size=ps.get_data_parallel_world_size(),
    )
    if rank == 0:
        ckpt.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    state = {
        "model": gpt.sharded_state_dict(),
        "args": megatron_args(hf_config, padded_vocab_size=gpt.vocab_size,
                              make_vocab_size_divisible_by=make_vocab_size_divisible_by, parallel=parallel),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0,
        "hf_config": dict(hf_config),
    }
    dist_checkpointing.save(state, str(ckpt))
    if rank == 0:
        (out / TRACKER).write_text(RELEASE)
    if dist.is_initialized():
        dist.barrier()
    return ckpt


def find_torch_dist(load_dir: str | os.PathLike, iteration: str | int | None = None) -> Path:
    """The checkpoint directory of a ``--save`` / ``--load`` directory (its tracker file, or
    ``iteration``: a number or ``"release"``), or ``load_dir`` itself if it is one. ConvertError if none."""
    root = Path(load_dir)
    if not root.is_dir():
        raise ConvertError(f"convert: {root} is not a directory")
    if iteration is None and (root / "metadata.json").is_file():
        return root
    if iteration is None:
        tracker = root / TRACKER
        if not tracker.is_file():
            raise ConvertError(f"convert: {root} has no {TRACKER} and is not a torch_dist checkpoint itself")
        iteration = tracker.read_text().strip()
    name = RELEASE if str(iteration) == RELEASE else f"iter_{int(iteration):07d}"
    ckpt = root / name
    if not (ckpt / "metadata.json").is_file():
        raise ConvertError(f"convert: {ckpt} is not a torch_dist checkpoint (no metadata.json)")
    return ckpt


def stored_hf_config(ckpt_dir: str | os.PathLike) -> dict | None:
    """The HF config that ``minite-convert hf-to-megatron`` stored in the checkpoint (None if absent)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    cfg = common.get("hf_config") if isinstance(common, dict) else None
    return dict(cfg) if isinstance(cfg, dict) else None


__all__ = ["CHECKPOINT_VERSION", "RELEASE", "TRACKER", "find_torch_dist", "megatron_args", "save_torch_dist",
           "stored_hf_config"]
