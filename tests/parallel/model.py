"""The tiny MoE every layout trains, its data, and the model variants ("specs") it is built with.

A Qwen3-MoE-shaped GPT small enough for CPU processes: 4 layers (dense, MoE, dense, MoE, so every
pipeline stage and virtual stage holds layers), hidden 64, 4 heads / 2 query groups of 16,
qk-layernorm, RMSNorm, SwiGLU, RoPE, 4 experts top-2 with FFN 32, untied embeddings (tied ones
would add the input and output embedding gradients in another order under pipeline
parallelism), no dropout. Sizes are multiples of 16 at every split the layouts make.

Specs (``SPECS``):

* ``nvfp4``: the minite spec, W4A4 with the RHT, nearest rounding of gradients (deterministic:
  lets the layouts show where they are bitwise on the product path);
* ``nvfp4_sr``: the minite spec with the default recipe (stochastic rounding of gradients, a
  stream per rank: no layout can be bitwise, only within the rule);
* ``exact``: the minite spec with every part in high precision (fp32 GEMMs): the "exact"
  model the 2x rule measures errors against;
* ``exact_strict``: ``exact`` in strict mode: every fp32 GEMM, the experts' included, is the
  batch-invariant one (``minite_megatron.invariant.matmul``), so expert parallelism (which changes
  how many tokens share an expert's GEMM) cannot change a bit of the forward;
* ``local``: Megatron's own local spec (with a sequence-parallel-capable norm), fp32.

Data: step ``s`` trains on ``GLOBAL_BATCH`` sequences (more when many data-parallel ranks need it) of a learnable toy language (each sequence
counts up modulo the vocabulary from a random start); Megatron's data sampler order: micro-batch
``i`` of data-parallel rank ``r`` holds samples ``[(i * dp + r) * mbs, +mbs)``.
"""

from __future__ import annotations

from typing import Any

import torch

TINY_MOE = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1, 0, 1],
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
    init_method_std=0.02,
)
VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH, SEED = 128, 32, 4, 1, 1234
N_MAX = max(GLOBAL_BATCH * SEQ, TINY_MOE["ffn_hidden_size"], TINY_MOE["hidden_size"], VOCAB)
"""The longest fp32 reduction in the model (the 128 tokens of a wgrad, K = 128, the vocab)."""

EXACT_RECIPE = dict(quantize_attention=False, quantize_dense_mlp=False, quantize_experts=False,
                    quantize_shared_experts=False)
SPECS: dict[str, dict[str, Any]] = {
    "nvfp4": {"builder": "minite", "recipe": {"grad_stochastic_rounding": False}},
    "nvfp4_sr": {"builder": "minite", "recipe": {}},
    "exact": {"builder": "minite", "recipe": EXACT_RECIPE},
    "exact_strict": {"builder": "minite", "recipe": {**EXACT_RECIPE, "strict": True}},
    "local": {"builder": "local", "recipe": None},
}
EXACT_OF = {"nvfp4": "exact", "nvfp4_sr": "exact", "exact": "exact", "exact_strict": "exact_strict", "local": "local"}
"""The high-precision model each spec's 2x rule is measured against (itself for fp32 specs)."""

INVARIANT_EXPERTS = {"nvfp4": True, "nvfp4_sr": True, "exact": False, "exact_strict": True, "local": False}
"""Whether a spec's expert GEMMs give a row the same bits whatever number of rows shares the
call. NVFP4: yes, the contract's GEMM adds exact 16-element block partials in K order
(``nvfp4.gemm``). Strict mode: yes, the batch-invariant GEMM. Default mode's high-precision
experts (``exact``: ``torch._grouped_mm``) and Megatron's (``local``): no, they are the BLAS
GEMM, whose rows depend on M (on this project's CPU, torch 2.11's GEMM computes a group of 1 to
3 rows with another kernel: other bits than the same rows in a larger group). Under expert parallelism an
expert's group holds the tokens of every EP rank, so such a forward is not bitwise across EP
sizes (``layouts.expectations``)."""


def local_spec(config, vp_stage: int | None = None):
    """Megatron's local decoder-block spec with ``MiniteNorm`` in every layout (single process
    included, so every run of the ``local`` spec has the same norm module)."""
    from minite_megatron.convert.hf import local_block_spec

    return local_block_spec(config, vp_stage=vp_stage, minite_norms=True)


def transformer_config(layout, *, params_dtype=torch.float32, **overrides):
    """The tiny MoE's ``TransformerConfig`` under ``layout`` (a :class:`layouts.Layout`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron.training's pipeline defaults (argument_utils.core_transformer_config_from_args):
    # outputs deallocated after they are sent, and for the interleaved schedule overlapped p2p
    # (not batched: with pp=2 a batch would hold two sends between the same two ranks)
    interleaved = layout.vp is not None
    kw = dict(TINY_MOE, activation_func=torch.nn.functional.silu, params_dtype=params_dtype,
              pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
              fp16=params_dtype == torch.float16, deallocate_pipeline_outputs=True,
              overlap_p2p_comm=interleaved, batch_p2p_comm=not interleaved)
    kw.update(overrides)
    return TransformerConfig(
        **kw,
        tensor_model_parallel_size=layout.tp,
        sequence_parallel=layout.sp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
    )


def layer_spec(spec: str, config, vp_stage: int | None):
    info = SPECS[spec]
    if info["builder"] == "local":
        return local_spec(config, vp_stage)
    from minite_megatron.megatron_args import minite_layer_spec

    return minite_layer_spec(config, vp_stage, recipe=info["recipe"])


def build_chunks(spec: str, config) -> list:
    """This rank's model chunks (one per virtual pipeline stage), weights from ``SEED``."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(SEED)
    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    vp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vp or 1):
        vp_stage = stage if vp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(spec, config, vp_stage),
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp_stage,
        )
        if SPECS[spec]["builder"] == "minite":
            from minite_megatron.megatron_args import finalize_gpt_model

            finalize_gpt_model(model, SPECS[spec]["recipe"])
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def check_layout(layout, world: int, global_batch: int = GLOBAL_BATCH) -> None:
    """:meth:`layouts.Layout.check` for this model (raises ``LayoutError``)."""
    layout.check(world, num_layers=TINY_MOE["num_layers"], num_experts=TINY_MOE["num_moe_experts"],
                 global_batch=global_batch, micro_batch=MICRO_BATCH, num_query_groups=TINY_MOE["num_query_groups"],
                 moe_ffn_hidden_size=TINY_MOE["moe_ffn_hidden_size"])


def global_batch_for(layouts, world: int) -> int:
    """The smallest global batch (>= ``GLOBAL_BATCH``, a multiple of it) every layout can split."""
    from .layouts import LayoutError

    size = GLOBAL_BATCH
    while True:
        try:
            for layout in layouts:
                check_layout(layout, world, size)
            return size
        except LayoutError as e:
            if "global batch" not in str(e) and "micro-batches" not in str(e) or size >= 64 * GLOBAL_BATCH:
                raise
            size += GLOBAL_BATCH


def global_batch(step: int, size: int = GLOBAL_BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, labels)`` ``[size, SEQ]`` of training step ``step`` (1-based)."""
    g = torch.Generator().manual_seed(SEED * 1000 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    seqs = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def micro_batches(step: int, dp: int, dp_rank: int, size: int = GLOBAL_BATCH) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's micro-batches of ``step``: ``(first sample index, tokens, labels)``."""
    tokens, labels = global_batch(step, size)
    n = size // (MICRO_BATCH * dp)
    out = []
    for i in range(n):
        first = (i * dp + dp_rank) * MICRO_BATCH
        out.append((first, tokens[first:first + MICRO_BATCH], labels[first:first + MICRO_BATCH]))
    return out
