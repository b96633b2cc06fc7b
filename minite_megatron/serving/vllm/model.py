"""``Qwen3MoeForCausalLM`` for vLLM with the learner's own ops wherever an export is ``minite_nvfp4``.

Registered with ``ModelRegistry.register_model`` by :func:`minite_megatron.serving.vllm.register` under
the architecture the export writes. For any other checkpoint the class *is* vLLM's (nothing is
replaced). For a ``minite_nvfp4`` export it keeps vLLM's model, loader, scheduler, paged KV cache,
sampler and API, and puts the learner's computation into the ops whose bits vLLM would otherwise
compute its own way (issue 28):

==========================  ===============================================  ===========================================
vLLM op                     vLLM computes                                    the plugin computes (``serving.numerics``)
==========================  ===============================================  ===========================================
residual add + ``RMSNorm``  ``fused_add_rms_norm``: the fp32 sum normalised  ``residual + x`` rounded to BF16 (Megatron's
                                                                             bias-dropout-add), then ``MiniteNorm``'s norm
``RMSNorm`` (q/k-norm too)  vLLM's kernel / ``ir.ops.rms_norm``              ``MiniteNorm``: batch invariant in strict mode
                                                                             and with ``aligned_ops``
``get_rope`` rotary         its ``cos_sin_cache`` and kernel                 Megatron's RoPE table and unfused apply
``Attention`` backend       ``CPU_ATTN`` / FlashAttention on the paged       :mod:`.attention`: the learner's invariant
                            cache                                            attention on the same paged cache
``compute_logits``          the LM head's logits                             the learner's log-probs of them (a shift of
                                                                             the logits: the same distribution)
==========================  ===============================================  ===========================================

The linears, router and experts are the quantization method's (:mod:`.methods`). With
``logprobs_mode="raw_logits"`` the log-probs vLLM reports are then the learner's own, bit for bit
in strict mode; strict mode refuses any other ``logprobs_mode``, and both modes refuse vLLM's
compilation (``enforce_eager=False``, :func:`check_engine_settings`), each with one line naming the setting. Sampling is vLLM's sampler on those log-probs (softmax is
shift invariant); note that vLLM's ``repetition_penalty`` scales logits by sign, so on log-probs (all
<= 0) it acts as on negative logits.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

from .. import numerics

ARCHITECTURE = "Qwen3MoeForCausalLM"


class MiniteRMSNorm(RMSNorm):
    """vLLM's ``RMSNorm`` (same weight, same loading) computing the learner's norm, and, given a
    residual, the learner's residual add first: ``(norm(residual + x), residual + x)``."""

    invariant: bool = True

    @classmethod
    def replacing(cls, norm: RMSNorm, invariant: bool) -> "MiniteRMSNorm":
        new = cls(norm.weight.shape[0], eps=norm.variance_epsilon, dtype=norm.weight.dtype)
        new.weight = norm.weight
        new.invariant = invariant
        return new

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return numerics.rms_norm(x, self.weight, self.variance_epsilon, self.invariant)
        return numerics.add_rms_norm(x, residual, self.weight, self.variance_epsilon, self.invariant)


class MiniteRotaryEmbedding(torch.nn.Module):
    """vLLM's rotary interface ``(positions, q, k) -> (q, k)`` (``q`` ``[T, Hq * D]``) with Megatron's
    RoPE (:func:`~minite_megatron.serving.numerics.apply_rope` on the learner's table)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int):
        super().__init__()
        self.head_dim = head_dim
        self.register_buffer("freqs", numerics.rope_freqs(head_dim, theta, max_positions), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        t, d = q.shape[0], self.head_dim
        q = numerics.apply_rope(q.view(t, -1, d), self.freqs, positions).reshape(t, -1)
        k = numerics.apply_rope(k.view(t, -1, d), self.freqs, positions).reshape(t, -1)
        return q, k


def _rope_theta(config) -> float:
    """The export's plain RoPE base; raises for any scaling the learner's ``RotaryEmbedding`` lacks."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    kind = params.get("rope_type", "default")
    if kind != "default" or params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError(f"minite-vllm: rope_parameters {params} (rope_type {kind!r}): only the learner's plain "
                                  "RoPE (rope_type 'default', full rotary dim) is served")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("minite-vllm: config.json has no rope_theta")
    return float(theta)


def check_engine_settings(vllm_config, strict: bool) -> None:
    """Refuse, with one line naming the setting, what would compute other bits or cannot run.

    vLLM's compilation (``enforce_eager=False``, its default): vLLM traces the whole model with
    Dynamo in one graph, which stops at the plugin's NVFP4 tensors (``torch._dynamo.exc.Unsupported:
    super().unflatten()``), and Inductor would fuse the learner's elementwise ops without their BF16
    roundings; refused in both modes. Strict mode also needs ``logprobs_mode="raw_logits"``."""
    from vllm.config import CompilationMode

    mode = vllm_config.compilation_config.mode
    if mode != CompilationMode.NONE:
        raise ValueError(f"minite-vllm: vLLM compilation mode {mode.name} (enforce_eager=False) is not supported: Dynamo "
                         "cannot trace the plugin's NVFP4 ops and Inductor would drop the learner's BF16 roundings; "
                         "pass enforce_eager=True")
    lp_mode = vllm_config.model_config.logprobs_mode
    if strict and lp_mode != "raw_logits":
        raise ValueError(f"minite-vllm strict mode: logprobs_mode={lp_mode!r} would report vLLM's log_softmax of the "
                         "learner's log-probs (other last bits); pass logprobs_mode='raw_logits' (the model's logits are "
                         "the learner's log-probs)")


class MiniteQwen3MoeForCausalLM(Qwen3MoeForCausalLM):
    """vLLM's ``Qwen3MoeForCausalLM``; with a ``minite_nvfp4`` export, the learner's ops (module docstring)."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        from .config import MiniteNvfp4Config

        quant = vllm_config.quant_config
        self.minite = isinstance(quant, MiniteNvfp4Config)
        if not self.minite:
            return
        check_engine_settings(vllm_config, quant.strict)
        self.minite_strict = quant.strict
        install_learner_ops(self.model, vllm_config, norm_invariant=quant.invariant_norm,
                            attention_invariant=quant.invariant_attention)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden_states)
        if not self.minite or logits is None:
            return logits
        return numerics.logprobs_of_logits(logits, self.minite_strict)


def install_learner_ops(model, vllm_config, *, norm_invariant: bool, attention_invariant: bool) -> None:
    """Put the learner's norms, RoPE and attention backend into vLLM's ``Qwen3MoeModel`` ``model``."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .attention import MiniteAttentionBackend, MiniteAttentionImpl

    config = vllm_config.model_config.hf_text_config
    theta = _rope_theta(config)
    max_pos = int(getattr(config, "max_position_embeddings", vllm_config.model_config.max_model_len))
    rope = None
    for layer in model.layers:
        if not hasattr(layer, "self_attn"):
            continue  # a pipeline stage's missing layer
        for name in ("input_layernorm", "post_attention_layernorm"):
            setattr(layer, name, MiniteRMSNorm.replacing(getattr(layer, name), norm_invariant))
        att = layer.self_attn
        att.q_norm = MiniteRMSNorm.replacing(att.q_norm, norm_invariant)
        att.k_norm = MiniteRMSNorm.replacing(att.k_norm, norm_invariant)
        if rope is None:
            rope = MiniteRotaryEmbedding(att.head_dim, theta, max_pos)
        att.rotary_emb = rope
        attn = att.attn
        impl = MiniteAttentionImpl(attn.num_heads, attn.head_size, att.scaling, attn.num_kv_heads,
                                   sliding_window=attn.sliding_window, kv_cache_dtype=attn.kv_cache_dtype,
                                   kv_sharing_target_layer_name=attn.kv_sharing_target_layer_name)
        impl.invariant = attention_invariant
        attn.impl, attn.attn_backend, attn.backend = impl, MiniteAttentionBackend, AttentionBackendEnum.CUSTOM
    model.norm = MiniteRMSNorm.replacing(model.norm, norm_invariant)


__all__ = ["ARCHITECTURE", "MiniteQwen3MoeForCausalLM", "MiniteRMSNorm", "MiniteRotaryEmbedding", "check_engine_settings",
           "install_learner_ops"]
