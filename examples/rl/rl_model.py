"""Process groups, the policy model, Megatron's DDP wrapper, optimizer and LR schedule.

One process (``python examples/rl/train_grpo.py``) or ``torchrun --nproc-per-node N``: NCCL on a
GPU, gloo on the CPU (where :mod:`minite_megatron.cpu_compat` stands in for CUDA). Megatron's
parallel state holds TP (``--tp``), EP (``--ep``, expert-TP 1: MoE parallel folding) and the data
parallelism that is left (``N / TP``).
"""

from __future__ import annotations

import os
import socket

import torch
from rl_args import UsageError


def init_distributed(tp: int, ep: int, seed: int, *, cuda_graphs: bool = False) -> torch.device:
    """torch.distributed + Megatron's parallel state; returns this rank's device.

    Raises ValueError when the world size does not fit ``--tp`` / ``--ep``."""
    from minite_megatron import cpu_compat

    cpu_compat.activate()  # a no-op with a GPU
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:  # torchrun
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                    world_size=1)
    world = dist.get_world_size()
    if world % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the world size {world}")
    if world % ep:
        raise UsageError(f"--expert-model-parallel-size {ep} does not divide the world size {world}")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
    )
    torch.manual_seed(seed)
    # a captured step registers the tracker's generators with its graph (Megatron's graph-safe RNG)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs and cuda,
                                                    force_reset_rng=True)
    return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")


def parallel_overrides(tp: int, ep: int) -> dict:
    """TransformerConfig fields of the layout (sequence parallelism with TP: Megatron requires it
    for MoE layers)."""
    return dict(tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                expert_tensor_parallel_size=1)


def params_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def model_architecture(args, vocab_size: int, max_seq: int, loaded: dict | None = None) -> dict:
    """What identifies the model's shapes (stored in checkpoints and checked on ``--load``).

    ``loaded``: :func:`rl_checkpoint.inspect` of ``--load``, used when no flag names the model: an
    RL run's own architecture, or the HF config that ``minite-convert hf-to-megatron`` stores."""
    explicit = args.hf_checkpoint or args.preset or any(
        getattr(args, f) for f in ("num_layers", "hidden_size", "num_experts", "moe_ffn_hidden_size"))
    if loaded is not None and not explicit:
        if loaded.get("rl_state") is not None:
            return dict(loaded["rl_state"]["arch"])
        if loaded.get("hf_config") is not None:
            return {"hf_config": loaded["hf_config"], "vocab_divisible_by": loaded["vocab_divisible_by"],
                    "max_seq": max_seq}
        # any other checkpoint (e.g. pretrain_gpt.py's) names no model this script builds: the preset's
        # shapes, checked against the checkpoint's when its weights load
    if args.hf_checkpoint:
        from minite_megatron.convert import ConvertError
        from minite_megatron.convert.hf_config import check_hf_config, read_hf_config

        try:  # its config.json, before any process group or model exists
            check_hf_config(read_hf_config(args.hf_checkpoint))
        except ConvertError as e:
            raise UsageError(f"--hf-checkpoint {args.hf_checkpoint}: {str(e).removeprefix('convert: ')}") from None
        return {"hf_checkpoint": os.path.abspath(args.hf_checkpoint), "max_seq": max_seq}
    from minite_megatron.training.presets import PRESETS

    args.preset = args.preset or "tiny"
    if args.preset not in PRESETS:
        raise UsageError(f"--preset {args.preset!r}: choose one of {sorted(PRESETS)}")
    arch = dict(PRESETS[args.preset], vocab=vocab_size)
    if args.num_layers:
        arch["layers"] = int(args.num_layers)
    if args.hidden_size:
        if args.hidden_size % (16 * arch["heads"]):
            raise UsageError(f"--hidden-size {args.hidden_size}: must be a multiple of 16 x {arch['heads']} heads")
        arch["hidden"], arch["head_dim"] = int(args.hidden_size), int(args.hidden_size) // arch["heads"]
    if args.num_experts:
        if args.num_experts < arch["topk"]:
            raise UsageError(f"--num-experts {args.num_experts}: fewer than the router's top-{arch['topk']}")
        arch["experts"] = int(args.num_experts)
    if args.moe_ffn_hidden_size:
        arch["moe_ffn"] = int(args.moe_ffn_hidden_size)
    return {"preset": args.preset, **arch, "max_seq": max_seq}


def build_policy_model(args, arch: dict, recipe, device: torch.device, dtype: torch.dtype, seed: int):
    """A ``GPTModel`` on the minite specs: from ``--hf-checkpoint`` (weights loaded, this rank's
    shard), of the HF config a converted checkpoint holds, or a fresh model of ``--preset`` or of
    a Megatron checkpoint's shapes (weights from ``seed``; ``--load`` then loads them)."""
    if "hf_config" in arch:
        return _gpt_of_hf_config(arch, recipe, device, dtype, args.tp, args.ep)
    if "hf_checkpoint" in arch:
        try:
            from minite_megatron.convert.hf import build_gpt_from_hf
        except ImportError as e:
            raise RuntimeError(f"--hf-checkpoint needs minite_megatron.convert.hf (the HF importer): {e}") from e
        from minite_megatron.model import finalize_gpt_model

        model = build_gpt_from_hf(arch["hf_checkpoint"], recipe=recipe, impl="minite", device=device, dtype=dtype,
                                  max_sequence_length=arch["max_seq"])
        return finalize_gpt_model(model, recipe)
    from minite_megatron.training.presets import build_gpt

    preset = {k: v for k, v in arch.items() if k not in ("preset", "max_seq")}
    return build_gpt(preset, recipe, max_seq=arch["max_seq"], device=device, dtype=dtype, seed=seed,
                     **parallel_overrides(args.tp, args.ep))


def _gpt_of_hf_config(arch: dict, recipe, device, dtype, tp: int, ep: int):
    """The model of a converted checkpoint's HF config, on the minite specs, without its weights
    (``--load`` reads them): the shapes ``minite-convert hf-to-megatron`` wrote, vocab padding included."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from minite_megatron.convert.hf_config import transformer_config_from_hf
    from minite_megatron.model import finalize_gpt_model
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    config, model_kwargs = transformer_config_from_hf(
        arch["hf_config"], params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
        make_vocab_size_divisible_by=arch["vocab_divisible_by"], max_sequence_length=arch["max_seq"],
        **parallel_overrides(tp, ep))
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe),
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(), **model_kwargs)
    finalize_gpt_model(model, recipe)
    return model.to(device=device)


def check_rollout_layout(model, tp: int, ep: int) -> None:
    """Megatron's static inference engine refuses sequence parallelism unless both TP and EP are > 1
    (``TextGenerationController``); say so before any work is done."""
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(model, "config")
    if tp > 1 and ep == 1 and config.num_moe_experts:
        raise UsageError(
            f"--tensor-model-parallel-size {tp} with --expert-model-parallel-size 1 on an MoE model: Megatron's "
            "static inference engine (the rollouts) supports sequence parallelism only with EP > 1 too; add --ep"
        )


def wrap_ddp(model, *, graphed: bool = False):
    """Megatron's ``DistributedDataParallel`` (grads reduced in FP32, no overlap, no distributed
    optimizer). ``graphed``: built on Megatron's full-iteration capture stream, as its training loop
    does, so the gradient accumulators DDP keeps run on the stream that captures the backward."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    if not graphed:
        return DistributedDataParallel(model.config, ddp_config, module=model)
    from megatron.core.full_cuda_graph import get_shared_capture_stream

    stream = get_shared_capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ddp = DistributedDataParallel(model.config, ddp_config, module=model)
    torch.cuda.current_stream().wait_stream(stream)
    return ddp


def build_optimizer(ddp_model, *, lr: float, weight_decay: float, clip_grad: float, beta1: float, beta2: float):
    """``get_megatron_optimizer`` (Adam; FP32 master weights for BF16 params; gradient clipping
    through ``OptimizerConfig.clip_grad``), wired into the model config the way Megatron's
    training loop wires it (``finalize_model_grads``, loss scaling)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = ddp_model.config
    opt_config = OptimizerConfig(
        optimizer="adam", lr=lr, min_lr=0.0, weight_decay=weight_decay, clip_grad=clip_grad, adam_beta1=beta1,
        adam_beta2=beta2, bf16=config.bf16, params_dtype=config.params_dtype, use_distributed_optimizer=False,
    )
    optimizer = get_megatron_optimizer(opt_config, [ddp_model])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = ddp_model.no_sync
    return optimizer


def build_scheduler(optimizer, *, lr: float, min_lr: float, warmup: int, total: int, style: str,
                    weight_decay: float = 0.0):
    """Megatron's ``OptimizerParamScheduler`` (counted in optimizer steps)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    total = max(total, warmup + 1, 1)
    return OptimizerParamScheduler(
        optimizer, init_lr=0.0 if warmup else lr, max_lr=lr, min_lr=min_lr if style != "constant" else lr,
        lr_warmup_steps=warmup, lr_decay_steps=total, lr_decay_style=style, start_wd=weight_decay, end_wd=weight_decay,
        wd_incr_steps=total, wd_incr_style="constant",
    )
