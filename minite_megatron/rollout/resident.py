"""A learner model whose NVFP4 linears hold only their quantized weights: built layer by layer.

Why: the rollout engine and the learner's teacher-forced forward read a NVFP4 linear's weight
only through its quantized form (``module.quantized_weight()``, the weight cache of
:mod:`~minite_megatron.ops.weight_cache`, 4.5 bits a weight). Qwen3-30B-A3B's BF16 master weights
are 61 GB; its quantized weights 17 GB. A sampler (or a gap check) that never trains needs only
the latter, so :func:`build_resident_gpt` builds the learner's own ``GPTModel`` on the minite
specs with its parameters unallocated on the host, then for each layer in turn:

1. moves the layer to the GPU (BF16, ~1.3 GB for one Qwen3-30B-A3B layer) and fills its
   parameters from the layer's own seed (:func:`init_layer`, a generator seeded with
   ``(seed, layer index)``: the same values whatever else is built) -- or, with ``fill``, from
   elsewhere: :func:`minite_megatron.convert.hf_stream.build_resident_gpt_from_hf` reads the
   layer's tensors from a Hugging Face checkpoint;
2. quantizes every NVFP4 linear with the module's own ``quantized_weight()`` (the learner's
   quantizer, the bits a learner holding these BF16 weights would use);
3. replaces the linear's BF16 parameters by a zero-stride NaN placeholder of the same shape and
   pins the quantized weight in the module's cache for that placeholder (the cache's public
   ``get``): the BF16 layer is freed before the next one is made.

What stays in BF16: the embedding, the LM head, the norms and the router (0.6 + 0.6 GB and a
few MB at this size). The result is the learner's modules, running the learner's forward, so
``teacher_forced_logprobs`` on it is the learner side of the gap check at full depth, and the
rollout engine runs it unchanged (the decode step aliases the pinned weights instead of cloning
them: :attr:`RESIDENT_ATTR`).

The weights are frozen: nothing may quantize them again. An optimizer step or
``invalidate_weight_caches()`` would make the caches re-quantize the NaN placeholders, which
gives NaN logits, which the engine reports (never a silent wrong answer);
``RolloutEngine.sync_weights`` refuses such a model with one line.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

log = logging.getLogger(__name__)

RESIDENT_ATTR = "minite_resident_nvfp4"
"""Attribute set (True) on a ``GPTModel`` built by :func:`build_resident_gpt`."""


def is_resident(gpt) -> bool:
    """Was ``gpt`` built by :func:`build_resident_gpt` (frozen quantized weights)?"""
    return bool(getattr(gpt, RESIDENT_ATTR, False))


def layer_generator(seed: int, index: int, device) -> torch.Generator:
    """The generator of layer ``index``'s weights (negative: the parts outside the layers,
    :func:`outer_parts`)."""
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) * 1_000_003 + int(index) + 1) % (1 << 62))
    return g


@torch.no_grad()
def init_layer(module: torch.nn.Module, seed: int, index: int, std: float) -> None:
    """Fill ``module``'s parameters from layer ``index``'s own generator, in the order of
    ``named_parameters``: matrices N(0, std), vector weights (the norms') 1, biases 0."""
    params = list(module.named_parameters())
    if not params:
        return
    g = layer_generator(seed, index, params[0][1].device)
    for name, p in params:
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=g)
        elif name.endswith("weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def outer_parts(gpt) -> list[tuple[int, torch.nn.Module]]:
    """``(index, module)`` of a ``GPTModel``'s parts outside its layers (embedding, final norm,
    LM head, ...), indices -1, -2, ... in module order: each seeds :func:`init_layer`."""
    parts = [c for n, c in gpt.named_children() if n != "decoder"]
    parts += [c for n, c in gpt.decoder.named_children() if n != "layers"]
    return [(-(i + 1), c) for i, c in enumerate(parts)]


def _materialize(module: torch.nn.Module, device: torch.device) -> None:
    """Give ``module``'s parameters fresh (uninitialized) storage on ``device`` -- the host
    copies were never written, so nothing is copied -- and move its buffers there."""
    for p in module.parameters():
        p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
    module.to(device)


def _placeholder(like: torch.Tensor) -> torch.Tensor:
    """A ``like``-shaped tensor of one NaN element (stride 0): 2 bytes instead of the weight."""
    return torch.full((), float("nan"), dtype=like.dtype, device=like.device).expand(like.shape)


@torch.no_grad()
def freeze_nvfp4(module: torch.nn.Module, keep_expert_images: bool = False) -> int:
    """Quantize every NVFP4 linear inside ``module`` and drop its BF16 weights (the module
    docstring's steps 2-3); returns the bytes of BF16 weights freed. Dense linears keep the
    BF16 image of their quantized weight (the decode GEMMs on Hopper read it); experts keep
    codes only unless ``keep_expert_images``."""
    from ..modules.grouped_linear import NVFP4GroupedLinear
    from ..ops.linear import backend_for
    from .support import is_nvfp4_linear

    freed = 0
    for m in list(module.modules()):
        if isinstance(m, NVFP4GroupedLinear) and m.precision == "nvfp4":
            q = m.quantized_weight()
            if not keep_expert_images and q.image is not None:
                q = replace(q, image=None)
            backend = backend_for(m.recipe, q.codes.device)
            for i in range(m.num_gemms):
                p = m._parameters[f"weight{i}"]
                freed += p.numel() * p.element_size()
                p.data = _placeholder(p)
            m._weight_buffer = None
            m._weights_cache.clear()
            m._weights_cache.get(m.weights, lambda _w, _image, q=q: q, extra=backend.name, with_image=True)
        elif is_nvfp4_linear(m):
            q = m.quantized_weight()
            if q.image is None:
                q = replace(q, image=q.bf16_image().reshape(q.shape))
            backend = backend_for(m.recipe, q.codes.device)
            p = m.weight
            freed += p.numel() * p.element_size()
            p.data = _placeholder(p)
            m.minite_ctx.cache.clear()
            m.minite_ctx.cache.get(m.weight, lambda _w, _image, q=q: q, extra=backend.name, with_image=True)
    return freed


def build_resident_gpt(gpt, *, device, seed: int = 0, keep_expert_images: bool = False, std: float | None = None,
                       progress: bool = False, fill=None):
    """Make ``gpt`` -- a minite-spec ``GPTModel`` whose parameters were never allocated
    (:func:`minite_megatron.training.presets.unallocated_gpt`; its recipe quantizes the linears)
    -- resident on ``device``: weights layer by layer, NVFP4 linears in their quantized form only
    (see the module docstring). ``std``: the weights' N(0, std) (default the config's
    ``init_method_std``). ``fill(index, module)``: where the weights come from instead of the
    seeds -- called on each part of :func:`outer_parts` (negative ``index``), then on each layer,
    with the part's parameters allocated on ``device`` and unwritten; it must write every one
    (:func:`minite_megatron.convert.stream.build_resident_gpt_from_hf`: a Hugging Face
    checkpoint's, read layer by layer). Returns it in eval mode."""
    device = torch.device(device)
    config = gpt.config
    std = config.init_method_std if std is None else float(std)
    if fill is None:
        def fill(index, module):
            init_layer(module, seed, index, std)
    # everything outside the layers (embedding, final norm, head) in BF16 on the device
    for index, child in outer_parts(gpt):
        _materialize(child, device)
        fill(index, child)
    freed = 0
    for i, layer in enumerate(gpt.decoder.layers):
        _materialize(layer, device)
        fill(i, layer)
        freed += freeze_nvfp4(layer, keep_expert_images)
        if progress and device.type == "cuda":
            log.info("resident model: layer %d/%d built (%.1f GiB allocated)", i + 1, len(gpt.decoder.layers),
                     torch.cuda.memory_allocated(device) / 2**30)
    gpt.to(device)  # buffers and anything left on the host (RoPE inv_freq)
    setattr(gpt, RESIDENT_ATTR, True)
    gpt.minite_resident_freed_bytes = freed
    return gpt.eval()


def nvfp4_bytes(numel: int, keep_image: bool = False) -> int:
    """Bytes of one quantized weight of ``numel`` elements: 4-bit codes, one FP8 scale per 16,
    (BF16 image)."""
    return numel // 2 + numel // 16 + (2 * numel if keep_image else 0)


def resident_bytes(preset: dict) -> dict:
    """Bytes of :func:`build_resident_gpt`'s weights on the device for ``preset`` (a dict), by
    part: ``experts`` (codes + scales), ``dense`` (attention linears: codes + scales + image),
    ``bf16`` (embedding, head, norms, router), ``total``; and ``bf16_model``: the same model's
    BF16 weights (what a BF16 engine holds)."""
    p = preset
    h, layers = p["hidden"], p["layers"]
    q_out = p["heads"] * p["head_dim"]
    kv_out = p["groups"] * p["head_dim"]
    qkv = (q_out + 2 * kv_out) * h
    proj = h * q_out
    expert = p["experts"] * 3 * h * p["moe_ffn"]
    norms = 2 * h + 2 * p["head_dim"]
    router = p["experts"] * h
    outer = 2 * p["vocab"] * h + h
    out = {
        "experts": layers * nvfp4_bytes(expert),
        "dense": layers * (nvfp4_bytes(qkv, True) + nvfp4_bytes(proj, True)),
        "bf16": 2 * (layers * (norms + router) + outer),
    }
    out["total"] = sum(out.values())
    out["bf16_model"] = 2 * (layers * (qkv + proj + expert + norms + router) + outer)
    out["parameters"] = layers * (qkv + proj + expert + norms + router) + outer
    return out


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


__all__ = ["RESIDENT_ATTR", "build_resident_gpt", "freeze_nvfp4", "init_layer", "is_resident", "layer_generator",
           "nvfp4_bytes", "outer_parts", "resident_bytes"]
