"""Megatron-Core parameter names -> Hugging Face Qwen3 / Qwen3-MoE module names.

Recognised Megatron names (``module.`` wrapper prefixes are stripped), local and TE specs:

=====================================================================  ==========================================
Megatron                                                                HF (Qwen3-MoE)
=====================================================================  ==========================================
``embedding.word_embeddings.weight``                                    ``model.embed_tokens.weight``
``decoder.final_layernorm.weight``                                      ``model.norm.weight``
``output_layer.weight``                                                 ``lm_head`` (linear)
``decoder.layers.{i}.input_layernorm.weight`` /
``decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight``      ``model.layers.{i}.input_layernorm.weight``
``decoder.layers.{i}.pre_mlp_layernorm.weight`` /
``decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight``                 ``model.layers.{i}.post_attention_layernorm.weight``
``decoder.layers.{i}.self_attention.{q,k}_layernorm.weight``            ``model.layers.{i}.self_attn.{q,k}_norm.weight``
``decoder.layers.{i}.self_attention.linear_qkv.weight``                 ``model.layers.{i}.self_attn.{q,k,v}_proj`` (split)
``decoder.layers.{i}.self_attention.linear_proj.weight``                ``model.layers.{i}.self_attn.o_proj``
``decoder.layers.{i}.mlp.linear_fc1.weight``                            ``model.layers.{i}.mlp.{gate,up}_proj`` (split)
``decoder.layers.{i}.mlp.linear_fc2.weight``                            ``model.layers.{i}.mlp.down_proj``
``decoder.layers.{i}.mlp.router.weight``                                ``model.layers.{i}.mlp.gate.weight``
``decoder.layers.{i}.mlp.experts.linear_fc1.weight{e}`` /
``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``  ``model.layers.{i}.mlp.experts.{e}.{gate,up}_proj``
``decoder.layers.{i}.mlp.experts.linear_fc1.weight`` (``[E, 2F, H]``)   (same, all experts at once)
``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight``            (same: the *checkpoint key* that both
                                                                        expert modules' sharded state dicts give)
``...experts...linear_fc2...``                                          ``model.layers.{i}.mlp.experts.{e}.down_proj``
=====================================================================  ==========================================

Anything else (biases, shared experts, expert bias, MTP layers) raises: the Qwen3 layout has no
place for it, and dropping a tensor silently would serve another model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_L = r"decoder\.layers\.(?P<layer>\d+)\."


@dataclass(frozen=True)
class Target:
    """Where a Megatron tensor goes.

    ``role``: ``"tensor"`` (copied as is to ``hf``, a full tensor name), ``"qkv"`` / ``"fc1"``
    (a fused linear split into ``hf`` + ``.q_proj`` ...), ``"linear"`` (one linear: ``hf`` is the
    module prefix), ``"router"`` (kept in high precision). ``expert``: the expert id, ``-1`` for a
    ``[E, N, K]`` tensor holding every expert, None when not an expert.
    """

    role: str
    hf: str
    layer: int | None = None
    expert: int | None = None


_RULES: list[tuple[re.Pattern, str, str]] = [
    (re.compile(r"^embedding\.word_embeddings\.weight$"), "tensor", "model.embed_tokens.weight"),
    (re.compile(r"^decoder\.final_layernorm\.weight$"), "tensor", "model.norm.weight"),
    (re.compile(r"^output_layer\.weight$"), "linear", "lm_head"),
    (re.compile(_L + r"(input_layernorm\.weight|self_attention\.linear_qkv\.layer_norm_weight)$"), "tensor",
     "model.layers.{layer}.input_layernorm.weight"),
    (re.compile(_L + r"(pre_mlp_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight)$"), "tensor",
     "model.layers.{layer}.post_attention_layernorm.weight"),
    (re.compile(_L + r"self_attention\.q_layernorm\.weight$"), "tensor", "model.layers.{layer}.self_attn.q_norm.weight"),
    (re.compile(_L + r"self_attention\.k_layernorm\.weight$"), "tensor", "model.layers.{layer}.self_attn.k_norm.weight"),
    (re.compile(_L + r"self_attention\.linear_qkv\.weight$"), "qkv", "model.layers.{layer}.self_attn"),
    (re.compile(_L + r"self_attention\.linear_proj\.weight$"), "linear", "model.layers.{layer}.self_attn.o_proj"),
    (re.compile(_L + r"mlp\.linear_fc1\.weight$"), "fc1", "model.layers.{layer}.mlp"),
    (re.compile(_L + r"mlp\.linear_fc2\.weight$"), "linear", "model.layers.{layer}.mlp.down_proj"),
    (re.compile(_L + r"mlp\.router\.weight$"), "router", "model.layers.{layer}.mlp.gate.weight"),
    (re.compile(_L + r"mlp\.experts\.linear_fc1\.weight(?P<expert>\d*)$"), "fc1", "model.layers.{layer}.mlp.experts.{expert}"),
    (re.compile(_L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc1\.weight$"), "fc1",
     "model.layers.{layer}.mlp.experts.{expert}"),
    # the global key of the sharded state dict (``TEGroupedMLP`` and ``SequentialMLP`` alike): [E, N, K]
    (re.compile(_L + r"mlp\.experts\.experts\.linear_fc1\.weight(?P<expert>)$"), "fc1",
     "model.layers.{layer}.mlp.experts.{expert}"),
    (re.compile(_L + r"mlp\.experts\.experts\.linear_fc2\.weight(?P<expert>)$"), "linear",
     "model.layers.{layer}.mlp.experts.{expert}.down_proj"),
    (re.compile(_L + r"mlp\.experts\.linear_fc2\.weight(?P<expert>\d*)$"), "linear",
     "model.layers.{layer}.mlp.experts.{expert}.down_proj"),
    (re.compile(_L + r"mlp\.experts\.local_experts\.(?P<expert>\d+)\.linear_fc2\.weight$"), "linear",
     "model.layers.{layer}.mlp.experts.{expert}.down_proj"),
]


def strip_wrappers(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def megatron_target(name: str) -> Target:
    """The :class:`Target` of a Megatron parameter name. Raises ValueError if it has none."""
    n = strip_wrappers(name)
    for pat, role, hf in _RULES:
        m = pat.match(n)
        if m is None:
            continue
        g = m.groupdict()
        layer = int(g["layer"]) if g.get("layer") is not None else None
        expert = None
        if "expert" in g:
            expert = int(g["expert"]) if g["expert"] != "" else -1
        return Target(role, hf.format(layer=layer, expert="{expert}" if expert == -1 else expert), layer, expert)
    raise ValueError(
        f"export: no Qwen3/Qwen3-MoE place for Megatron parameter {name!r} (biases, shared experts, expert "
        "bias and MTP layers are not supported); refusing to drop it silently"
    )


__all__ = ["Target", "megatron_target", "strip_wrappers"]
