"""Core attention of the minite specs (default mode and the BF16 twin): torch's SDPA.

Megatron's local ``DotProductAttention`` materializes the ``[b, np, sq, sk]`` scores, masks them
with ``masked_fill`` and runs a separate softmax (on the H200 that was ~35% of a minite training
step at 4096 tokens). :class:`MiniteDotProductAttention` keeps Megatron's constructor and call
(``SelfAttention``'s ``core_attention`` submodule) and computes the same function through
``torch.nn.functional.scaled_dot_product_attention``, which picks flash / cuDNN / memory-efficient
kernels on a GPU (and its math backend on a CPU): causal, GQA without repeating the keys,
O(s) memory.

Visibility, the rule of the strict attention (:mod:`minite_megatron.invariant.attention`): the
queries are the *last* ``sq`` of the ``sk`` key positions (a training / teacher-forced forward
has ``sq == sk``; a static KV-cache prefill or decode step has ``sq`` new tokens after
``sk - sq`` cached ones); with a causal ``attn_mask_type`` a query at position ``t`` sees keys
``0..t``; ``attention_mask`` (bool, True = hidden, broadcastable to ``[b, np, sq, sk]``, Megatron's
convention) hides more. A query with no visible key returns zeros.

Megatron callers pass the causal mask explicitly (the data loader's, ``teacher_forced_logprobs``'s,
the static engine's rows of it). A mask that hides nothing the causal rule does not already hide
is dropped (:func:`~minite_megatron.invariant.attention.effective_mask`: one reduction, checked once per mask object and version), so
the call takes SDPA's fused causal path; any other mask becomes SDPA's boolean mask (memory-
efficient / math backends).

Not supported (raise at construction or call, naming the setting): packed sequences (THD),
attention bias, sliding windows, softmax types other than ``vanilla``, context parallelism.
"""

from __future__ import annotations

import math

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from ..invariant.attention import effective_mask, sdpa_attention

__all__ = ["MiniteDotProductAttention", "VanillaCoreAttention", "effective_mask", "sdpa_attention", "sdpa_core_attention"]

class VanillaCoreAttention(DotProductAttention):
    """What minite's core attentions share: Megatron's constructor and builder protocol, the
    settings they do not compute refused at construction (naming the flag), the net scale of q.k
    (``net_scale``: Megatron divides by the layer number for fp16 and multiplies back) and whether
    the mask type is causal. ``what`` names the module in its errors."""

    what = "minite core attention"

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        if config.softmax_type != "vanilla":
            raise NotImplementedError(
                f"{self.what} supports softmax_type='vanilla' only, got {config.softmax_type!r} (--softmax-type)"
            )
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            raise NotImplementedError(f"{self.what} does not support sliding-window attention (--window-size)")
        super().__init__(config, layer_number, attn_mask_type, attention_type, attention_dropout=attention_dropout,
                         softmax_scale=softmax_scale, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.net_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.hidden_size_per_attention_head)
        self.causal = attn_mask_type == AttnMaskType.causal


class MiniteDotProductAttention(VanillaCoreAttention):
    """Megatron's ``DotProductAttention`` computed by torch SDPA (see the module docstring)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        """``query`` [sq, b, np, hn], ``key``/``value`` [sk, b, ng, hn] -> [sq, b, np * hn]."""
        return sdpa_core_attention(self, query, key, value, attention_mask, attention_bias, packed_seq_params, self.net_scale)


def sdpa_core_attention(attn: DotProductAttention, query, key, value, attention_mask, attention_bias, packed_seq_params,
                        scale: float):
    """The core attention of ``attn`` (its dropout, causality and config) by torch SDPA: ``query``
    [sq, b, np, hn], ``key``/``value`` [sk, b, ng, hn] -> [sq, b, np * hn]. Raises
    NotImplementedError for packed sequences or an attention bias, ValueError for a mask that is
    not 4-D."""
    if packed_seq_params is not None:
        raise NotImplementedError("minite core attention does not support packed sequences (THD)")
    if attention_bias is not None:
        raise NotImplementedError("minite core attention does not support attention_bias")
    if attention_mask is not None and attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be [b|1, 1|np, sq, sk], got {tuple(attention_mask.shape)}")
    q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
    k = key.permute(1, 2, 0, 3)
    v = value.permute(1, 2, 0, 3)
    p = attn.attention_dropout.p if attn.training else 0.0
    if p > 0 and not attn.config.sequence_parallel:
        with tensor_parallel.get_cuda_rng_tracker().fork():
            ctx = sdpa_attention(q, k, v, scale=scale, causal=attn.causal, mask=attention_mask, dropout_p=p)
    else:
        ctx = sdpa_attention(q, k, v, scale=scale, causal=attn.causal, mask=attention_mask, dropout_p=p)
    sq, b = query.shape[0], query.shape[1]
    return ctx.permute(2, 0, 1, 3).reshape(sq, b, -1)
