"""Where each Megatron checkpoint tensor comes from in a Hugging Face Qwen3 / Qwen3-MoE checkpoint.

The inverse of the exporter's mapping: the names come from :func:`~..export.names.megatron_target`
and the fused row orders from :mod:`~..export.rows` (``interleave_qkv_order``,
``fc1_row_ranges``). A Megatron tensor is described by its *global checkpoint key* (the
``ShardedTensor.key`` of ``sharded_state_dict()``, the same for the local and the minite specs)
as a :class:`Layout`: its rows, in order, as row ranges of HF tensors (:class:`Rows`); columns
are never permuted. Stacked experts (``...mlp.experts.experts.linear_fc1.weight``, ``[E, N, K]``)
have one row list per expert.

==============================================================  ===============================================
Megatron key                                                    HF rows, in Megatron's order
==============================================================  ===============================================
``embedding.word_embeddings.weight``                            ``model.embed_tokens.weight`` (+ zero pad rows)
``output_layer.weight``                                         ``lm_head.weight`` (``model.embed_tokens.weight``
                                                                if ``tie_word_embeddings``; + zero pad rows)
``decoder.final_layernorm.weight``                              ``model.norm.weight``
``decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight``  ``model.layers.{i}.input_layernorm.weight``
``decoder.layers.{i}.self_attention.linear_qkv.weight``         per query group g: ``q_proj`` rows of its
                                                                ``heads/groups`` heads, ``k_proj`` head g,
                                                                ``v_proj`` head g (``head_dim`` rows each)
``decoder.layers.{i}.self_attention.{q,k}_layernorm.weight``    ``...self_attn.{q,k}_norm.weight``
``decoder.layers.{i}.self_attention.linear_proj.weight``        ``...self_attn.o_proj.weight``
``decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight``         ``...post_attention_layernorm.weight``
``decoder.layers.{i}.mlp.linear_fc1.weight``                    ``...mlp.gate_proj.weight``, ``...mlp.up_proj.weight``
``decoder.layers.{i}.mlp.linear_fc2.weight``                    ``...mlp.down_proj.weight``
``decoder.layers.{i}.mlp.router.weight``                        ``...mlp.gate.weight``
``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight``    expert e: ``...mlp.experts.{e}.gate_proj.weight``,
                                                                ``...mlp.experts.{e}.up_proj.weight``
                                                                (fused files: ``...mlp.experts.gate_up_proj[e]``)
``decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight``    expert e: ``...mlp.experts.{e}.down_proj.weight``
                                                                (fused files: ``...mlp.experts.down_proj[e]``)
==============================================================  ===============================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..export.names import megatron_target
from ..export.rows import fc1_row_ranges, interleave_qkv_order
from .errors import ConvertError
from .hf_config import HFModelDims


@dataclass(frozen=True)
class Rows:
    """Rows ``[start, stop)`` of the HF tensor ``name`` (of its slice ``index`` along the first
    axis for a fused ``[E, N, K]`` expert tensor)."""

    name: str
    start: int
    stop: int
    index: int | None = None

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Layout:
    """A Megatron tensor as HF rows (module docstring). ``experts`` is None for a 1-D / 2-D
    tensor (``rows`` its row pieces), else one row list per expert (``rows`` empty).
    ``vocab_padded``: Megatron may hold more rows than HF (vocabulary padding: zeros)."""

    key: str
    rows: tuple[Rows, ...] = ()
    experts: tuple[tuple[Rows, ...], ...] | None = None
    vocab_padded: bool = False

    @property
    def hf_rows(self) -> int:
        pieces = self.experts[0] if self.experts is not None else self.rows
        return sum(p.count for p in pieces)

    def pieces(self, expert: int | None) -> tuple[Rows, ...]:
        if self.experts is None:
            return self.rows
        return self.experts[expert]


_LAYER_KEY = re.compile(r"^decoder\.layers\.\d+\.")
_STACKED_PREFIX = "decoder.layers."


def is_layer_stacked(key: str) -> bool:
    """Megatron's *homogeneous* key format: ``decoder.layers.<name>`` with a leading layer axis of
    size ``num_layers`` (``TransformerBlock.sharded_state_dict`` uses it unless the layers differ,
    e.g. a ``moe_layer_freq`` list); else keys are per layer, ``decoder.layers.{i}.<name>``."""
    return key.startswith(_STACKED_PREFIX) and not _LAYER_KEY.match(key)


def per_layer(key: str, shape: tuple, sl: tuple) -> tuple[str, tuple, tuple]:
    """``(key, global shape, global slice)`` with a stacked layer axis taken out: the per-layer key
    ``decoder.layers.{i}.<name>`` and the shape / slice of that layer's tensor. Other keys pass."""
    if not is_layer_stacked(key):
        return key, tuple(shape), tuple(sl)
    layer = sl[0]
    if not isinstance(layer, int):
        raise ConvertError(f"convert: {key}: a piece spans several layers ({layer}); expected one layer per piece")
    return f"{_STACKED_PREFIX}{layer}.{key[len(_STACKED_PREFIX):]}", tuple(shape[1:]), tuple(sl[1:])


def fused_expert_names(layer: int) -> tuple[str, str]:
    """transformers' in-memory fused expert tensors ``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``."""
    return f"model.layers.{layer}.mlp.experts.gate_up_proj", f"model.layers.{layer}.mlp.experts.down_proj"


def layout(key: str, d: HFModelDims, *, fused_experts: bool = False) -> Layout:
    """The :class:`Layout` of the Megatron checkpoint key ``key`` for a model of dims ``d``.

    ``fused_experts``: the checkpoint stores experts as ``mlp.experts.gate_up_proj`` /
    ``down_proj`` 3-D tensors (what ``transformers`` 5 holds in memory) instead of per-expert
    linears (what the hub and ``save_pretrained`` write).
    Raises ConvertError for a key with no Qwen3 place (biases, shared experts, MTP layers...).
    """
    try:
        t = megatron_target(key)
    except ValueError:
        raise ConvertError(f"convert: Megatron tensor {key} has no place in a {d.model_type} checkpoint "
                           "(biases, shared experts, expert bias and MTP layers are not supported)") from None
    if t.layer is not None and not 0 <= t.layer < d.layers:
        raise ConvertError(f"convert: Megatron tensor {key} names layer {t.layer}; the config has {d.layers} layers")
    moe = t.layer is not None and d.is_moe_layer(t.layer)
    if t.role == "tensor":
        n = d.vocab if t.hf == "model.embed_tokens.weight" else _norm_size(t.hf, d)
        return Layout(key, (Rows(t.hf, 0, n),), vocab_padded=t.hf == "model.embed_tokens.weight")
    if t.role == "linear" and t.hf == "lm_head":
        name = "model.embed_tokens.weight" if d.tie_embeddings else "lm_head.weight"
        return Layout(key, (Rows(name, 0, d.vocab),), vocab_padded=True)
    if t.role == "qkv":
        return Layout(key, tuple(Rows(f"{t.hf}.{part}_proj.weight", a, b)
                                 for part, a, b in interleave_qkv_order(d.heads, d.groups, d.head_dim)))
    if t.role == "router":
        _need(moe, key, t.layer)
        return Layout(key, (Rows(t.hf, 0, d.experts),))
    if t.expert is None:  # dense MLP or attention output
        if t.role == "fc1":
            _need(not moe, key, t.layer)
            return Layout(key, _fc1_rows(t.hf, d.ffn))
        if ".mlp." in t.hf:
            _need(not moe, key, t.layer)
            return Layout(key, (Rows(f"{t.hf}.weight", 0, d.hidden),))
        return Layout(key, (Rows(f"{t.hf}.weight", 0, d.hidden),))  # o_proj
    _need(moe, key, t.layer)
    if t.expert != -1:
        raise ConvertError(f"convert: {key} is a parameter name, not a checkpoint key (expected "
                           "...mlp.experts.experts.linear_fc1.weight)")
    gate_up, down = fused_expert_names(t.layer)
    per_expert = []
    for e in range(d.experts):
        if t.role == "fc1":
            rows = (Rows(gate_up, 0, 2 * d.moe_ffn, e),) if fused_experts else _fc1_rows(t.hf.format(expert=e), d.moe_ffn)
        else:
            rows = (Rows(down, 0, d.hidden, e),) if fused_experts else (Rows(f"{t.hf.format(expert=e)}.weight", 0, d.hidden),)
        per_expert.append(rows)
    return Layout(key, experts=tuple(per_expert))


def _fc1_rows(prefix: str, ffn: int) -> tuple[Rows, ...]:
    """Megatron's gated fc1 is ``[gate; up]`` (:func:`~..export.rows.fc1_row_ranges`)."""
    ranges = fc1_row_ranges(ffn)
    return tuple(Rows(f"{prefix}.{part}_proj.weight", 0, b - a) for part in ("gate", "up") for a, b in ranges[part])


def _norm_size(hf: str, d: HFModelDims) -> int:
    return d.head_dim if hf.endswith(("q_norm.weight", "k_norm.weight")) else d.hidden


def _need(ok: bool, key: str, layer: int | None) -> None:
    if not ok:
        raise ConvertError(f"convert: Megatron tensor {key} does not fit the config: layer {layer}'s MLP is "
                           "dense in one and MoE in the other (mlp_only_layers / decoder_sparse_step)")


def hf_tensor_shapes(d: HFModelDims, *, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the HF checkpoint of dims ``d`` and its shape (what a complete
    checkpoint holds; ``lm_head.weight`` only when the embeddings are untied)."""
    h, hd = d.hidden, d.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d.vocab, h), "model.norm.weight": (h,)}
    if not d.tie_embeddings:
        out["lm_head.weight"] = (d.vocab, h)
    for i in range(d.layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (d.heads * hd, h), p + "self_attn.k_proj.weight": (d.groups * hd, h),
            p + "self_attn.v_proj.weight": (d.groups * hd, h), p + "self_attn.o_proj.weight": (h, d.heads * hd),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
        })
        if not d.is_moe_layer(i):
            out.update({p + "mlp.gate_proj.weight": (d.ffn, h), p + "mlp.up_proj.weight": (d.ffn, h),
                        p + "mlp.down_proj.weight": (h, d.ffn)})
            continue
        out[p + "mlp.gate.weight"] = (d.experts, h)
        if fused_experts:
            gate_up, down = fused_expert_names(i)
            out[gate_up] = (d.experts, 2 * d.moe_ffn, h)
            out[down] = (d.experts, h, d.moe_ffn)
            continue
        for e in range(d.experts):
            q = f"{p}mlp.experts.{e}."
            out.update({q + "gate_proj.weight": (d.moe_ffn, h), q + "up_proj.weight": (d.moe_ffn, h),
                        q + "down_proj.weight": (h, d.moe_ffn)})
    return out


__all__ = ["Layout", "Rows", "fused_expert_names", "hf_tensor_shapes", "is_layer_stacked", "layout", "per_layer"]
