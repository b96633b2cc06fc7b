"""The learner's quantized weights from a Megatron GPT model, local or gathered over TP / EP.

:func:`learner_weights` lists this rank's weights as the export takes them: each NVFP4 module's
``quantized_weight()`` (the codes, block scales and global scale its forward uses, from the
module's weight cache: never re-quantized here) and every other parameter as it is (norms,
router, embeddings, LM head, linears the recipe keeps in BF16). At TP = EP = 1 that is the whole
model: ``export_tensors(learner_weights(model), config, recipe)``.

:func:`gather_learner_weights` puts a TP / EP / expert-TP sharded model's weights together on
one rank (the one that feeds the sampler), as the unsharded model's :func:`learner_weights`,
**bitwise**. That works without a re-quantization because the learner max-reduces the amaxes
of split scale domains across its TP group (:mod:`minite_megatron.ops.amax_sync`) and shard
sizes are whole 16x16 tiles: every rank's codes and scales are a slice of the unsharded
quantization, and the ranks' global scales are bitwise the same (checked; a mismatch raises).

Reassembly (Megatron's own sharding, the inverse of its distributed-checkpoint resharding):

- column-parallel weights (``partition_dim`` 0: ``linear_qkv``, ``linear_fc1``, the vocab-parallel
  embedding and output layer): shards stacked by rows in TP-rank order. ``linear_qkv`` is
  interleaved per query group and TP splits by groups, so stacking gives the unsharded layout.
  A gated ``linear_fc1`` shard holds ``[gate_r; up_r]``: the gates are stacked, then the ups.
- row-parallel weights (``partition_dim`` 1: ``linear_proj``, ``linear_fc2``): shards side by side
  along K (packed codes and block scales alike).
- experts: each EP rank holds ``num_local_experts`` consecutive global experts (grouped
  ``[G, N, K]`` weights, or per-expert names renumbered ``local + ep_rank * G``); with expert
  tensor parallelism each expert is first reassembled over the expert-TP ranks as above.
- replicated tensors (norms, router, q/k norms): the destination's own copy; nothing moves.

Traffic: one ``torch.distributed.gather`` per decoder layer and kind (dense over the TP group,
experts over the expert-TP x EP group) plus one for the rest; each rank sends only its shards'
packed bytes (0.5 + 1/16 byte per weight element, 4 bytes per global scale; BF16 images are
never sent) and an 8-byte coordinate header per tensor kind; ranks outside the destination's
groups (data-parallel replicas) send nothing. :class:`GatherStats` counts it, and
:func:`minite_megatron.serving.refit.refit_traffic` computes the same numbers from shapes.
Pipeline parallelism is not supported (each stage would gather its own layers).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..nvfp4 import BLOCK, NVFP4Tensor
from ..testing import raw_bits

_LAYER = re.compile(r"(?:^|\.)decoder\.layers\.(\d+)\.")
_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.(?:local_experts\.)?)(\d+)(\.)|(\.weight)(\d+)$")


def _covered_params(module: torch.nn.Module) -> list[torch.Tensor]:
    if hasattr(module, "num_gemms"):
        return [getattr(module, f"weight{i}") for i in range(module.num_gemms)]
    return [module.weight]


def learner_weights(model: torch.nn.Module) -> dict[str, NVFP4Tensor | torch.Tensor]:
    """This rank's weights under Megatron names (local expert indices), as the export takes them.

    Quantized linears: ``<module>.weight`` -> the module's ``quantized_weight()`` (``[N, K]``
    tensor-scaled, or ``[G, N, K]`` group-scaled for grouped experts). Everything else:
    ``named_parameters()`` detached. Collective under TP: a stale weight cache re-quantizes with
    an amax all-reduce, so every rank of the model calls this in the same order.
    """
    out: dict[str, NVFP4Tensor | torch.Tensor] = {}
    covered: set[int] = set()
    for name, module in model.named_modules():
        get = getattr(module, "quantized_weight", None)
        if get is None or getattr(module, "precision", "nvfp4") != "nvfp4":
            continue
        q = get()
        if q is None:
            continue
        out[f"{name}.weight" if name else "weight"] = q
        covered.update(id(p) for p in _covered_params(module))
    for name, p in model.named_parameters():
        if id(p) not in covered:
            out[name] = p.detach()
    return out


# ---- what is sharded how ---------------------------------------------------------------------
@dataclass
class _Item:
    """One weight of :func:`learner_weights` and how Megatron sharded it."""

    name: str
    value: NVFP4Tensor | torch.Tensor
    expert: bool = False  # an expert weight (gathered over expert-TP x EP)
    tp_dim: int | None = None  # dim of the logical [.., N, K] weight sharded over (expert-)TP: -2 rows, -1 K
    glu: bool = False  # a gated fc1: each row shard holds [gate_r; up_r]
    grouped: bool = False  # [G_local, N, K], experts along dim 0
    local_expert: int | None = None  # per-expert names: the local index in ``name``
    num_local: int = 0
    bucket: int = -1  # decoder layer index (-1: embeddings, final norm, LM head)


def _param_of(model_params: dict[str, torch.Tensor], modules: dict[str, torch.nn.Module], name: str):
    if name in model_params:
        return model_params[name]
    module = modules.get(name.rsplit(".", 1)[0])
    return _covered_params(module)[0] if module is not None else None


def _num_local_experts(modules: dict[str, torch.nn.Module], name: str) -> int:
    head = name.split(".mlp.experts.")[0] + ".mlp"
    moe = modules.get(head)
    n = getattr(moe, "num_local_experts", None)
    if n is None:
        raise ValueError(f"gather: cannot find the MoE layer of {name} (no num_local_experts on {head})")
    return int(n)


def _items(model, weights, gated: bool, tp: int, etp: int) -> list[_Item]:
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    items = []
    for name, value in weights.items():
        p = _param_of(params, modules, name)
        it = _Item(name, value)
        m = _LAYER.search(name)
        it.bucket = int(m.group(1)) if m else -1
        it.expert = ".mlp.experts." in name
        size = etp if it.expert else tp
        if p is not None and getattr(p, "tensor_model_parallel", False) and size > 1:
            dim = int(getattr(p, "partition_dim", 0))
            if dim not in (0, 1):
                raise ValueError(f"gather: {name} is sharded along dim {dim}; only 0 (rows) and 1 (columns) exist")
            it.tp_dim = -2 if dim == 0 else -1
            it.glu = gated and it.tp_dim == -2 and re.search(r"linear_fc1\.weight\d*$", name) is not None
        if it.expert:
            it.num_local = _num_local_experts(modules, name)
            if isinstance(value, NVFP4Tensor) and len(value.shape) == 3:
                it.grouped = True
            else:
                lm = _LOCAL_EXPERT.search(name)
                if lm is None:
                    raise ValueError(f"gather: no local expert index in {name}")
                it.local_expert = int(lm.group(2) if lm.group(2) is not None else lm.group(5))
        items.append(it)
    return items


def _global_expert_name(name: str, index: int) -> str:
    m = _LOCAL_EXPERT.search(name)
    if m.group(2) is not None:
        return name[: m.start(2)] + str(index) + name[m.end(2):]
    return name[: m.start(5)] + str(index)


# ---- bytes on the wire -----------------------------------------------------------------------
def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _parts(value) -> list[torch.Tensor]:
    """The bytes of one local weight: codes, linear block scales, global scales (no image)."""
    if isinstance(value, NVFP4Tensor):
        lin = value.linear()
        return [_u8(lin.codes), _u8(lin.block_scales), _u8(lin.global_decode.to(torch.float32))]
    return [_u8(value)]


def _unparts(like, chunk: torch.Tensor):
    """Inverse of :func:`_parts` for a rank's chunk, shaped as the destination's local ``like``."""
    if not isinstance(like, NVFP4Tensor):
        return chunk.view(like.dtype).reshape(like.shape)
    lead, k = tuple(like.shape[:-1]), like.shape[-1]
    g = like.global_decode.numel()
    c, s, gd = torch.split(chunk, [like.codes.numel(), like.codes.numel() // (BLOCK // 2), 4 * g])
    return NVFP4Tensor(c.reshape(*lead, k // 2), s.view(torch.float8_e4m3fn).reshape(*lead, k // BLOCK),
                       gd.view(torch.float32).reshape(g), like.shape, like.global_scale, like.tile)


def _nbytes(value) -> int:
    return sum(t.numel() for t in _parts(value))


def _bf16_nbytes(value) -> int:
    if isinstance(value, NVFP4Tensor):
        return 2 * value.codes.numel() * 2
    return value.numel() * value.element_size()


# ---- reassembly ------------------------------------------------------------------------------
def _cat(parts: list, dim: int, glu: bool, name: str):
    """Stack shards of one weight (TP order) along ``dim`` of the logical shape; gated fc1 shards
    ``[gate_r; up_r]`` become ``[gate_0 .. gate_n; up_0 .. up_n]``."""
    if len(parts) == 1:
        return parts[0]
    if glu:
        halves = [_split_rows(p) for p in parts]
        return _cat([h[0] for h in halves] + [h[1] for h in halves], dim, False, name)
    if not isinstance(parts[0], NVFP4Tensor):
        return torch.cat(parts, dim=dim)
    p0 = parts[0]
    for i, p in enumerate(parts[1:], 1):
        if not torch.equal(raw_bits(p.global_decode), raw_bits(p0.global_decode)):
            raise ValueError(
                f"gather: the tensor-parallel shards of {name} have different global scales (shard {i} vs 0): "
                "they were quantized without the TP amax sync, so no unsharded quantization holds them")
    k = sum(p.shape[-1] for p in parts) if dim == -1 else p0.shape[-1]
    rows = sum(p.shape[-2] for p in parts) if dim == -2 else p0.shape[-2]
    shape = torch.Size([*p0.shape[:-2], rows, k])
    return NVFP4Tensor(torch.cat([p.codes for p in parts], dim=dim),
                       torch.cat([p.block_scales.view(torch.uint8) for p in parts], dim=dim).view(torch.float8_e4m3fn),
                       p0.global_decode.clone(), shape, p0.global_scale, p0.tile)


def _split_rows(v):
    """``[.., 2R, K]`` -> the halves ``[.., :R, :]``, ``[.., R:, :]`` (whole 16-row tiles)."""
    n = v.shape[-2]
    if n % 2 or (isinstance(v, NVFP4Tensor) and (n // 2) % v.tile[0]):
        raise ValueError(f"gather: a gated fc1 shard of {n} rows does not split into gate and up on whole tiles")
    h = n // 2
    if not isinstance(v, NVFP4Tensor):
        return v[..., :h, :], v[..., h:, :]
    lo = NVFP4Tensor(v.codes[..., :h, :], v.block_scales[..., :h, :], v.global_decode, torch.Size([*v.shape[:-2], h, v.shape[-1]]),
                     v.global_scale, v.tile)
    hi = NVFP4Tensor(v.codes[..., h:, :], v.block_scales[..., h:, :], v.global_decode, lo.shape, v.global_scale, v.tile)
    return lo, hi


def _stack_experts(parts: list[NVFP4Tensor]) -> NVFP4Tensor:
    """``[G_l, N, K]`` group tensors of the EP ranks in order -> ``[G, N, K]``."""
    if len(parts) == 1:
        return parts[0]
    p0 = parts[0]
    return NVFP4Tensor(torch.cat([p.codes for p in parts]),
                       torch.cat([p.block_scales.view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn),
                       torch.cat([p.global_decode for p in parts]),
                       torch.Size([sum(p.shape[0] for p in parts), *p0.shape[1:]]), "group", p0.tile)


@dataclass
class GatherStats:
    """What :func:`gather_learner_weights` moved: ``bytes_received`` on the destination,
    ``bytes_sent`` by this rank, ``bf16_bytes_received`` (the same gather of a BF16 learner:
    2 bytes per quantized weight element, high-precision tensors as they are), ``collectives``."""

    bytes_received: int = 0
    bytes_sent: int = 0
    bf16_bytes_received: int = 0
    collectives: int = 0
    per_kind: dict = field(default_factory=dict)

    @property
    def ratio_vs_bf16(self) -> float:
        return self.bytes_received / self.bf16_bytes_received if self.bf16_bytes_received else float("nan")


def _groups():
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        raise NotImplementedError(
            "gather_learner_weights: pipeline parallel size > 1 is not supported (gather each stage's layers); "
            "run the refit gather at pipeline parallel size 1")
    tp_group = ps.get_tensor_model_parallel_group()
    exp_group = ps.get_expert_tensor_and_model_parallel_group(check_initialized=False)
    coords = {
        "dense": (tp_group, [ps.get_tensor_model_parallel_rank()]),
        "expert": (exp_group, [ps.get_expert_model_parallel_rank(), ps.get_expert_tensor_parallel_rank()]),
    }
    sizes = (dist.get_world_size(tp_group), ps.get_expert_model_parallel_world_size(),
             ps.get_expert_tensor_parallel_world_size())
    return coords, sizes


def _buckets(items: list[_Item]) -> Iterator[tuple[str, int, list[_Item]]]:
    by: dict[tuple[str, int], list[_Item]] = {}
    for it in items:
        if it.expert or it.tp_dim is not None:
            by.setdefault(("expert" if it.expert else "dense", it.bucket), []).append(it)
    for key in sorted(by):
        yield key[0], key[1], by[key]


def gather_learner_weights(model: torch.nn.Module, *, dst: int = 0) -> tuple[dict | None, GatherStats]:
    """The unsharded model's :func:`learner_weights` on global rank ``dst`` (module docstring).

    Collective: every rank of the model calls it (ranks outside ``dst``'s TP and expert groups
    only list their weights). Returns ``(weights, stats)`` on ``dst`` and ``(None, stats)``
    elsewhere; ``weights`` goes straight into
    :func:`~minite_megatron.export.modelopt.export_tensors` (bitwise the single-process export).

    Raises:
        NotImplementedError for pipeline parallelism; ValueError when the shards' global scales
        differ (quantized without the TP amax sync) or a gated fc1 shard cuts a tile.
    """
    coords, (tp, ep, etp) = _groups()
    me = dist.get_rank()
    weights = learner_weights(model)
    cfg = getattr(model, "config", None)
    items = _items(model, weights, bool(getattr(cfg, "gated_linear_unit", False)), tp, etp)
    stats = GatherStats()
    out: dict | None = {} if me == dst else None
    if out is not None:
        for it in items:
            if not it.expert and it.tp_dim is None:
                out[it.name] = it.value  # replicated: the destination's own copy
    for kind, bucket, members in _buckets(items):
        group, coord = coords[kind]
        size = dist.get_world_size(group) if group is not None else 1
        ranks = dist.get_process_group_ranks(group) if size > 1 else [me]
        if dst not in ranks:
            continue  # a data-parallel replica: the destination's groups hold its copy
        header = torch.tensor(coord + [0] * (2 - len(coord)), dtype=torch.int32).view(torch.uint8)
        buf = torch.cat([header.to(_device_of(members))] + [c for it in members for c in _parts(it.value)])
        received = [buf]  # a group of one: this rank holds everything
        if size > 1:
            received = [torch.empty_like(buf) for _ in range(size)] if me == dst else None
            dist.gather(buf, received, dst=dst, group=group)  # stays on the device
            stats.collectives += 1
            if me != dst:
                stats.bytes_sent += buf.numel()
            else:
                moved = (size - 1) * buf.numel()
                stats.bytes_received += moved
                stats.bf16_bytes_received += (size - 1) * sum(_bf16_nbytes(it.value) for it in members)
                stats.per_kind[kind] = stats.per_kind.get(kind, 0) + moved
        if out is None:
            continue
        _assemble(out, kind, members, received, tp if kind == "dense" else etp)
    return out, stats


def _device_of(members: list[_Item]) -> torch.device:
    v = members[0].value
    return v.codes.device if isinstance(v, NVFP4Tensor) else v.device


def _assemble(out: dict, kind: str, members: list[_Item], received: list[torch.Tensor], tp_size: int) -> None:
    """Unpack each rank's buffer (coordinates first) and put every weight of the bucket together."""
    per_rank: dict[tuple, list] = {}
    for buf in received:
        coord = tuple(int(c) for c in buf[:8].cpu().view(torch.int32))
        sizes = [_nbytes(it.value) for it in members]
        chunks = torch.split(buf[8:], sizes)
        per_rank[coord if kind == "expert" else (coord[0],)] = [_unparts(it.value, ch) for it, ch in zip(members, chunks)]
    if kind == "dense":
        order = sorted(per_rank)
        for i, it in enumerate(members):
            out[it.name] = _cat([per_rank[r][i] for r in order], it.tp_dim, it.glu, it.name)
        return
    eps = sorted({c[0] for c in per_rank})
    tps = sorted({c[1] for c in per_rank})
    for i, it in enumerate(members):
        def one_ep(e):
            shards = [per_rank[(e, t)][i] for t in tps]
            return _cat(shards, it.tp_dim, it.glu, it.name) if it.tp_dim is not None else shards[0]
        if it.grouped:
            out[it.name] = _stack_experts([one_ep(e) for e in eps])
        else:
            for e in eps:
                out[_global_expert_name(it.name, e * it.num_local + it.local_expert)] = one_ep(e)


__all__ = ["GatherStats", "gather_learner_weights", "learner_weights"]
