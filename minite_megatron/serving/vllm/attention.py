"""``MINITE_ATTN``: a vLLM attention backend that computes the learner's attention on vLLM's paged KV cache.

vLLM's scheduler decides the batch (prefills, prefill chunks, decodes, requests joining mid-decode);
its block manager hands out the cache blocks and its model runner builds, per step, the common
metadata: each request's query tokens (``query_start_loc``), its length so far (``seq_lens``), its
blocks (``block_table``) and where each new token's K / V go (``slot_mapping``). This backend keeps
all of that and supplies two things:

- the cache layout ``[num_blocks, 2, block_size, num_kv_heads, head_size]`` (K, V of a block side by
  side; the block index first, as vLLM's CPU runner zeroes blocks with ``kv[block]``), written by
  :meth:`MiniteAttentionImpl.do_kv_cache_update` with plain indexing (the bits of K and V as
  computed, no conversion: the cache dtype must be the model's, ``kv_cache_dtype="auto"``);
- the attention of each request on its own keys, gathered from its blocks:
  :func:`minite_megatron.serving.numerics.request_attention`, the learner's batch- and
  prefill/decode-invariant attention (strict mode, or the recipe's ``aligned_attention``), with the
  learner's softmax scale. Its queries are the last ``Sq`` of the request's ``Sk`` positions, which
  is what a prefill chunk or a decode step is, so a token gets the bits of the learner's
  full-sequence forward whatever batch vLLM formed.

The backend is given to each ``Attention`` layer by :mod:`.model` (the model class of a
``minite_nvfp4`` export), not selected by vLLM's platform (its CPU platform always picks
``CPU_ATTN``). Pure torch plus the learner's attention (its Triton kernel on a GPU), so the CUDA
wheel takes the same path. Refused at construction, naming the setting: a quantized KV cache,
sliding windows, ALiBi, logit soft-capping, attention sinks, KV sharing, non-decoder attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from .. import numerics

NAME = "CUSTOM"  # vLLM's slot for an out-of-tree backend (AttentionBackendEnum.CUSTOM)


@dataclass
class MiniteAttentionMetadata:
    """Per step: tokens to compute, each request's query range and length (host lists), its blocks."""

    num_actual_tokens: int
    query_start_loc: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class MiniteAttentionMetadataBuilder(AttentionMetadataBuilder[MiniteAttentionMetadata]):
    """vLLM's common metadata as the request loop reads it (one host copy of the two int vectors)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MiniteAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError("minite-vllm attention: causal decoder attention only (got a non-causal batch)")
        n = m.num_reqs
        return MiniteAttentionMetadata(
            num_actual_tokens=m.num_actual_tokens,
            query_start_loc=m.query_start_loc_cpu[: n + 1].tolist(),
            seq_lens=m.seq_lens_cpu[:n].tolist(),
            block_table=m.block_table_tensor[:n],
            slot_mapping=m.slot_mapping,
        )


class MiniteAttentionImpl(AttentionImpl):
    """The learner's attention on vLLM's paged KV cache (module docstring).

    ``invariant`` is set by the model class from the export's recipe (strict or ``aligned_attention``)."""

    invariant: bool = True

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto", logits_soft_cap=None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: str | None = None, **extra):
        refusals = {
            "a quantized KV cache (kv_cache_dtype must be 'auto': the cache holds the learner's K / V bits)":
                kv_cache_dtype != "auto",
            "sliding-window attention": sliding_window not in (None, -1),
            "ALiBi": alibi_slopes is not None,
            "logit soft-capping": logits_soft_cap not in (None, 0, 0.0),
            "non-decoder attention": attn_type != AttentionType.DECODER,
            "KV-cache sharing between layers": kv_sharing_target_layer_name is not None,
            "attention sinks": extra.get("sinks") is not None,
        }
        bad = [what for what, refused in refusals.items() if refused]
        if bad:
            raise NotImplementedError(f"minite-vllm attention does not support {bad[0]}")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads or num_heads
        self.learner_scale = 1.0 / math.sqrt(head_size)  # VanillaCoreAttention.net_scale (vLLM: head_size ** -0.5)
        if not math.isclose(scale, self.learner_scale, rel_tol=1e-6):
            raise ValueError(f"minite-vllm attention: softmax scale {scale} is not the learner's 1/sqrt({head_size})")
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = None

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """K / V of the step's tokens into their slots (``slot = block * block_size + offset``; -1: padding)."""
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
        block_size = kv_cache.shape[2]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, 0, offsets] = key[: slots.shape[0]].to(kv_cache.dtype)
        kv_cache[blocks, 1, offsets] = value[: slots.shape[0]].to(kv_cache.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: MiniteAttentionMetadata | None, output: torch.Tensor, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        """``query`` ``[T, Hq, D]`` -> ``output`` ``[T, Hq, D]``, each request on its cached keys."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("minite-vllm attention: no fused output quantization")
        if attn_metadata is None:  # vLLM's profiling / warm-up forward: no cache, no requests
            return output.zero_()
        block_size = kv_cache.shape[2]
        qsl, seq_lens = attn_metadata.query_start_loc, attn_metadata.seq_lens
        for r, sk in enumerate(seq_lens):
            a, b = qsl[r], qsl[r + 1]
            if b == a:
                continue
            blocks = attn_metadata.block_table[r, : -(-sk // block_size)].long()
            kv = kv_cache[blocks]  # [nb, 2, bs, Hkv, D]
            k = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_size)[:sk]
            v = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_size)[:sk]
            output[a:b] = numerics.request_attention(query[a:b], k, v, self.learner_scale, self.invariant)
        n = attn_metadata.num_actual_tokens
        if output.shape[0] > n:
            output[n:].zero_()
        return output


class MiniteAttentionBackend(AttentionBackend):
    """The backend vLLM's runner sees for the plugin's attention layers (cache layout, builder, impl)."""

    forward_includes_kv_cache_update: bool = False  # vLLM calls do_kv_cache_update before forward
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[MiniteAttentionImpl]:
        return MiniteAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[MiniteAttentionMetadataBuilder]:
        return MiniteAttentionMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return num_blocks, 2, block_size, num_kv_heads, head_size

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def use_cascade_attention(*args, **kwargs) -> bool:
        return False


__all__ = ["MiniteAttentionBackend", "MiniteAttentionImpl", "MiniteAttentionMetadata", "MiniteAttentionMetadataBuilder"]
