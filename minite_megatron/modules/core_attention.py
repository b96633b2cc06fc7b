"""Megatron core attention for strict mode: the ``core_attention`` submodule of ``SelfAttention``.

:class:`StrictDotProductAttention` subclasses Megatron's ``DotProductAttention`` (through
:class:`~minite_megatron.modules.attention.VanillaCoreAttention`; same constructor and builder
protocol, so it drops into any ``SelfAttentionSubmodules``) and computes
:func:`minite_megatron.invariant.attention.attention`: a query's output does not depend on the
batch, on the other queries in the call, or on whether its keys come from the whole sequence
(training, teacher forcing, prefill) or from Megatron's static KV cache (decode).

How Megatron calls it (megatron-core 0.19, ``SelfAttention.forward``): ``query`` ``[sq, b, np,
hn]``, ``key``/``value`` ``[sk, b, ng, hn]`` after RoPE; in static inference the keys are the
cache ``[:sequence_end]`` and the queries the new tokens, i.e. the *last* ``sq`` positions,
which is the rule the strict attention uses for causal visibility. During decode Megatron
passes ``attn_mask_type=no_mask`` (and the rows of the causal mask for the new positions); the
module keeps the causal rule of its constructor's ``attn_mask_type`` (which gives the same
visibility for the last positions) and additionally honours ``attention_mask`` (bool, True =
hidden). Output ``[sq, b, np * hn]`` in the query dtype.

:class:`AlignedDotProductAttention` is the same forward for default mode (``recipe.aligned_attention``),
not flagged strict, falling back to torch SDPA in training with attention dropout.

Not supported (raise): packed sequences (THD), attention bias, sliding windows, softmax types
other than ``vanilla``, context parallelism, and attention dropout in training mode (set
``attention_dropout=0``: RL learners run without dropout, and dropout would break alignment).
"""

from __future__ import annotations

from ..invariant.attention import attention as batch_invariant_attention
from .attention import VanillaCoreAttention, sdpa_core_attention


class StrictDotProductAttention(VanillaCoreAttention):
    """Batch- and prefill/decode-invariant ``DotProductAttention`` (see the module docstring)."""

    minite_strict = True
    what = "strict attention"

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        """``query`` [sq, b, np, hn], ``key``/``value`` [sk, b, ng, hn] -> [sq, b, np * hn]."""
        if packed_seq_params is not None:
            raise NotImplementedError("strict attention does not support packed sequences (THD)")
        if attention_bias is not None:
            raise NotImplementedError("strict attention does not support attention_bias")
        if self.training and self.attention_dropout.p > 0:
            raise ValueError("strict attention needs attention_dropout=0 in training mode")
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        mask = attention_mask
        if mask is not None and mask.dim() != 4:
            raise ValueError(f"strict attention: attention_mask must be [b|1, 1|np, sq, sk], got {tuple(mask.shape)}")
        ctx = batch_invariant_attention(q, k, v, scale=self.net_scale, causal=self.causal, mask=mask)
        sq, b = query.shape[0], query.shape[1]
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, -1)


class AlignedDotProductAttention(StrictDotProductAttention):
    """Default mode's core attention with ``recipe.aligned_attention``: the forward of
    :class:`StrictDotProductAttention` (a query gets the same bits in the learner's forward and in
    the rollout engine's decode step), not flagged strict; in training mode with attention
    dropout it is torch SDPA (:func:`~minite_megatron.modules.attention.sdpa_core_attention`, the
    computation of ``MiniteDotProductAttention``), since dropout draws per call anyway."""

    minite_strict = False

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if self.training and self.attention_dropout.p > 0:
            return sdpa_core_attention(self, query, key, value, attention_mask, attention_bias, packed_seq_params,
                                       self.net_scale)
        return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
