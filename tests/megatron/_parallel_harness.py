"""Parallel-equivalence harness: does a GPT/MoE model give the single-process loss and gradients
under tensor (+ sequence) and expert parallelism? Real megatron-core on CPU with gloo.

``run_equivalence(spec_builder, ...)`` runs, inside one job of ``world_size`` gloo processes,
every parallel layout in ``layouts`` on the same batch and the same weights:

1. the reference layout (``"ref"``: TP=1, EP=1) builds the model with ``spec_builder(config,
   **spec_kwargs)`` (a dotted path, so the lead can pass the minite spec later), and saves its
   weights with Megatron's distributed checkpointing;
2. each layout re-initializes Megatron's model-parallel state, builds the model, loads those
   weights (Megatron re-shards them: TP splits, the SwiGLU fc1 interleave, the expert split),
   wraps it in Megatron's DDP, runs forward + backward on the (replicated) batch and
   ``finalize_model_grads`` (data-parallel all-reduce and the sequence-parallel norm-grad
   all-reduce, as the training loop does);
3. each layout's gradients are written back into the parameters and saved with distributed
   checkpointing, then loaded into a reference-layout model, so every layout's gradients come
   back in the single-process layout, parameter by parameter.

The reference runs on the same ranks with TP=EP=1, i.e. data parallelism over identical
batches: every collective of the model is on a group of size 1 and DDP averages identical
gradients (``g/2 + g/2 == g`` exactly), so it computes what a single process computes.

Returns ``{layout: {"loss": [b, s] per-token loss, "grads": {name: tensor}}}`` from rank 0.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

LAYOUTS: dict[str, dict[str, Any]] = {
    "ref": dict(tp=1, ep=1, etp=1, sp=False),
    "tp2_sp": dict(tp=2, ep=1, etp=1, sp=True),
    "ep2": dict(tp=1, ep=2, etp=1, sp=False),
    "tp2_ep2": dict(tp=2, ep=2, etp=1, sp=True),
}
"""Layouts that fit two processes. TP2+EP2 uses expert-TP 1 (MoE parallel folding: the two
ranks are one TP group for the dense part and one EP group for the experts)."""

TINY_MOE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1],  # a dense layer, then an MoE layer
    normalization="RMSNorm",
    qk_layernorm=True,
    gated_linear_unit=True,
    add_bias_linear=False,
    bias_activation_fusion=False,
    moe_token_dispatcher_type="alltoall",
    moe_router_load_balancing_type="aux_loss",
    moe_aux_loss_coeff=1e-2,
    moe_router_dtype="fp32",
    hidden_dropout=0.0,
    attention_dropout=0.0,
    use_cpu_initialization=True,
)
"""A Qwen3-MoE-shaped model small enough for two CPU processes (all sizes multiples of 16)."""

VOCAB, SEQ, BATCH, SEED = 128, 32, 2, 1234


def local_spec(config):
    """Megatron's local decoder-block spec, with a sequence-parallel-capable norm.

    Megatron's torch fallback norm refuses sequence parallelism without apex; minite's
    ``MiniteNorm`` is a plain (non-batch-invariant) RMSNorm that marks its weights
    ``sequence_parallel`` so ``finalize_model_grads`` all-reduces them, as apex/TE norms do.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    from minite_megatron.modules.norm import MiniteNorm

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization)
    for layer in spec.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = MiniteNorm
        sub.pre_mlp_layernorm = MiniteNorm
        attn = sub.self_attention.submodules
        if attn.q_layernorm is not IdentityOp:
            attn.q_layernorm = MiniteNorm
            attn.k_layernorm = MiniteNorm
    spec.layer_norm = MiniteNorm
    return spec


def _set_parallel(tp: int, ep: int, etp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )


def _build(layout: dict, spec_builder: str, spec_kwargs: dict, overrides: dict):
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ._dist import resolve

    _set_parallel(layout["tp"], layout["ep"], layout["etp"])
    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    kw = dict(TINY_MOE, activation_func=torch.nn.functional.silu, params_dtype=torch.float32)
    kw.update(overrides)
    config = TransformerConfig(
        **kw,
        tensor_model_parallel_size=layout["tp"],
        sequence_parallel=layout["sp"],
        expert_model_parallel_size=layout["ep"],
        expert_tensor_parallel_size=layout["etp"],
    )
    spec = resolve(spec_builder)(config, **spec_kwargs)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
        position_embedding_type="rope",
    )
    return config, model


def _save(model, directory: str) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def _load(model, directory: str) -> None:
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), directory)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise AssertionError(f"weights missing after re-sharding: {missing}")


def _batch():
    import torch

    g = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), position_ids, mask


def equivalence_worker(rank: int, world_size: int, *, spec_builder: str, spec_kwargs: dict, layouts: list[str],
                       overrides: dict, work_dir: str) -> dict | None:
    """Runs in every rank (see the module docstring); rank 0 returns the results."""
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    weights_dir = os.path.join(work_dir, "weights")
    _, ref_model = _build(LAYOUTS["ref"], spec_builder, spec_kwargs, overrides)
    _save(ref_model, weights_dir)
    del ref_model
    tokens, labels, position_ids, mask = _batch()
    results: dict[str, dict] = {}
    for name in layouts:
        config, model = _build(LAYOUTS[name], spec_builder, spec_kwargs, overrides)
        _load(model, weights_dir)
        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
            module=model,
        )
        ddp.zero_grad_buffer()
        loss = ddp(tokens, position_ids, mask, labels=labels)
        loss.float().mean().backward()
        finalize_model_grads([ddp])
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.main_grad)
        grads_dir = os.path.join(work_dir, f"grads_{name}")
        _save(model, grads_dir)
        del ddp, model
        _, ref_layout = _build(LAYOUTS["ref"], spec_builder, spec_kwargs, overrides)
        _load(ref_layout, grads_dir)
        grads = {k: v.detach().clone() for k, v in ref_layout.state_dict().items() if not k.endswith("_extra_state")}
        results[name] = {"loss": loss.detach().clone(), "grads": grads}
        dist.barrier()
    return results if rank == 0 else None


def run_equivalence(spec_builder: str = "tests.megatron._parallel_harness:local_spec", *, spec_kwargs: dict | None = None,
                    layouts: list[str] | None = None, overrides: dict | None = None, world_size: int = 2) -> dict:
    """Loss and reference-layout gradients of each layout (see the module docstring)."""
    from ._dist import run_distributed

    layouts = list(layouts or LAYOUTS)
    if layouts[0] != "ref":
        layouts = ["ref", *[x for x in layouts if x != "ref"]]
    with tempfile.TemporaryDirectory(prefix="minite_equiv_") as work_dir:
        out = run_distributed(
            "tests.megatron._parallel_harness:equivalence_worker", world_size,
            spec_builder=spec_builder, spec_kwargs=spec_kwargs or {}, layouts=layouts,
            overrides=overrides or {}, work_dir=work_dir,
        )
    return out[0]


def max_ulp_distance(a, b) -> int:
    """Largest distance in units in the last place between two fp32 tensors (0 == bitwise)."""
    import torch

    ia = a.float().contiguous().view(torch.int32).to(torch.int64)
    ib = b.float().contiguous().view(torch.int32).to(torch.int64)
    # map the sign-magnitude bit patterns onto a monotonic integer line
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


def relative_error(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (0 when both are zero)."""
    a64, b64 = a.double(), b.double()
    den = b64.norm().item()
    num = (a64 - b64).norm().item()
    return num / den if den else num
