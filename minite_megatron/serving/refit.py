"""Weight refit for the RL loop: the learner's NVFP4 bytes into a running vLLM model, in place.

The ``minite_nvfp4`` methods keep the parameters in the export's layout (:mod:`.vllm.methods`), so
a refit is vLLM's own weight loading again: each tensor is copied (``param.data.copy_``) into the
storage the model already has, no re-quantization, no new allocation, and the NVFP4 views the
forward uses see the new bytes. Per refit the learner sends, per quantized weight element, half a
byte of codes plus one e4m3 scale per 16 elements (0.5625 bytes) instead of BF16's 2 bytes:
:class:`RefitStats` reports the bytes moved and the BF16 equivalent.

Learner side: :func:`minite_megatron.export.gather.learner_weights` (TP = EP = 1) or
:func:`minite_megatron.export.gather.gather_learner_weights` (a TP / EP / expert-TP sharded
learner: the shards' packed bytes gathered on the rank that feeds the sampler, bitwise the
unsharded weights) and :func:`minite_megatron.export.modelopt.export_tensors` (Megatron names ->
the HF-named tensors vLLM loads). :func:`refit_traffic` computes both legs' bytes from the
model's shapes (the gather's and the refit's, and a BF16 learner's for comparison).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RefitStats:
    """What one refit moved: ``bytes_moved`` (the tensors sent), ``bf16_bytes`` (the same weights
    as BF16: 2 bytes per logical weight element, scales not counted), ``tensors`` (count)."""

    bytes_moved: int
    bf16_bytes: int
    tensors: int

    @property
    def ratio_vs_bf16(self) -> float:
        return self.bytes_moved / self.bf16_bytes if self.bf16_bytes else float("nan")


def refit_stats(tensors: Mapping[str, torch.Tensor]) -> RefitStats:
    """Bytes moved vs BF16 for HF-named export tensors (quantized ``weight`` = uint8 codes, 2 per byte)."""
    moved = bf16 = 0
    for name, t in tensors.items():
        moved += t.numel() * t.element_size()
        if name.endswith(".weight"):
            bf16 += 2 * t.numel() * (2 if t.dtype == torch.uint8 else 1)
    return RefitStats(moved, bf16, len(tensors))


def refit_vllm_model(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     *, load_weights: Callable | None = None) -> RefitStats:
    """Update a running vLLM model's parameters in place with the learner's new weights.

    Args:
        model: the vLLM model (``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``
            or the worker's ``model``), built with ``quantization="minite_nvfp4"``.
        tensors: HF name -> tensor, as :func:`~minite_megatron.export.modelopt.export_tensors` returns
            (or the export directory's tensors).
        load_weights: the loader to run (default ``model.load_weights``, vLLM's own name mapping).
    Returns:
        :class:`RefitStats`.
    Raises:
        ValueError if a tensor would change a parameter's shape or dtype (the refit never allocates),
        RuntimeError if a parameter moved to new storage (a loader that replaced instead of copying).
    """
    items = dict(tensors)
    before = {n: (p.data_ptr(), p.dtype, tuple(p.shape)) for n, p in model.named_parameters()}
    (load_weights or model.load_weights)(iter(items.items()))
    for n, p in model.named_parameters():
        if n in before and before[n] != (p.data_ptr(), p.dtype, tuple(p.shape)):
            raise RuntimeError(f"refit: parameter {n} was replaced, not updated in place ({before[n]} -> "
                               f"{(p.data_ptr(), p.dtype, tuple(p.shape))})")
    for module in model.modules():  # scales may have changed: rebuild the NVFP4 views and checks
        method = getattr(module, "quant_method", None)
        if hasattr(method, "refresh"):
            method.refresh(module)
    return refit_stats(items)


@dataclass(frozen=True)
class RefitTraffic:
    """Bytes per refit of a sharded learner, and of a BF16 learner in the same layout.

    ``gather_bytes``: into the destination rank (:func:`~minite_megatron.export.gather.gather_learner_weights`,
    headers and global scales included); ``refit_bytes``: destination -> sampler (the export
    tensors, :func:`refit_stats`). ``*_bf16``: the same with every quantized weight in BF16."""

    gather_bytes: int
    gather_bf16_bytes: int
    refit_bytes: int
    refit_bf16_bytes: int

    @property
    def total(self) -> int:
        return self.gather_bytes + self.refit_bytes

    @property
    def total_bf16(self) -> int:
        return self.gather_bf16_bytes + self.refit_bf16_bytes


def refit_traffic(config, *, vocab: int, tp: int = 1, ep: int = 1, etp: int | None = None,
                  moe_layers: list[int] | None = None, tied_embeddings: bool = False, hp_bytes: int = 2) -> RefitTraffic:
    """:class:`RefitTraffic` from shapes (nothing built or moved).

    Args:
        config: a Megatron ``TransformerConfig`` (or dict with its field names): layers, hidden,
            heads, query groups, kv channels, ffn / moe ffn sizes, experts, qk-layernorm.
        vocab: vocabulary rows (embedding, LM head); ``tied_embeddings``: no separate LM head.
        tp, ep, etp: the learner's tensor / expert / expert-tensor parallel sizes (``etp`` default ``tp``,
            Megatron's default); moe_layers: indices of MoE layers (default: all when experts > 0).
        hp_bytes: bytes per element of the high-precision tensors (2 for a BF16 model).
    All quantized linears are assumed NVFP4 (no BF16 first/last layers); router, norms,
    embedding and LM head high precision, as the minite recipe keeps them.
    """
    from ..export.hf_config import cfg_get, dims

    d = dims(config)
    etp = tp if etp is None else etp
    moe = set(range(d["layers"]) if d["experts"] else []) if moe_layers is None else set(moe_layers)
    qk = bool(cfg_get(config, "qk_layernorm", False))
    h, hd = d["hidden"], d["head_dim"]

    def q(n: int, k: int) -> int:  # packed codes + e4m3 block scales of an [n, k] NVFP4 weight
        return n * k // 2 + n * k // 16

    header, gscale = 8, 4
    gather = gather16 = refit = 0
    qkv_n, proj_k = (d["heads"] + 2 * d["groups"]) * hd, d["heads"] * hd
    embed_rows = vocab * (1 if tied_embeddings else 2)
    if tp > 1:  # the vocab-parallel embedding / LM head bucket
        gather += (tp - 1) * (header + embed_rows // tp * h * hp_bytes)
        gather16 += (tp - 1) * (embed_rows // tp * h * hp_bytes)
    refit += embed_rows * h * hp_bytes + h * hp_bytes  # + final norm
    params = embed_rows * h + h
    for i in range(d["layers"]):
        dense = [(qkv_n, h, 0), (h, proj_k, 1)] + ([] if i in moe else [(2 * d["ffn"], h, 0), (h, d["ffn"], 1)])
        if tp > 1:
            shard = sum(q(n // tp, k) if dim == 0 else q(n, k // tp) for n, k, dim in dense) + gscale * len(dense)
            gather += (tp - 1) * (header + shard)
            gather16 += (tp - 1) * sum(2 * n * k // tp for n, k, _ in dense)
        pieces = 3 + 1 + (0 if i in moe else 3)  # q/k/v, o, gate/up/down
        refit += sum(q(n, k) for n, k, _ in dense) + gscale * pieces
        hp = 2 * h + (2 * hd if qk else 0) + (d["experts"] * h if i in moe else 0)  # norms, q/k norms, router
        refit += hp * hp_bytes
        params += hp + sum(n * k for n, k, _ in dense)
        if i in moe:
            e, f, world = d["experts"], d["moe_ffn"], ep * etp
            local = e // ep
            if world > 1:
                shard = local * (q(2 * f // etp, h) + q(h, f // etp)) + 2 * gscale * local
                gather += (world - 1) * (header + shard)
                gather16 += (world - 1) * local * 2 * (2 * f * h + h * f) // etp
            refit += e * (q(2 * f, h) + q(h, f) + 3 * gscale)
            params += e * 3 * f * h
    return RefitTraffic(gather, gather16, refit, 2 * params)


__all__ = ["RefitStats", "RefitTraffic", "refit_stats", "refit_traffic", "refit_vllm_model"]
