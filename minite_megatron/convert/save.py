"""Megatron ``GPTModel`` (any TP / EP / PP layout) or Megatron checkpoint -> Hugging Face BF16
safetensors (Qwen3 / Qwen3-MoE names, per-expert linears as on the hub), loadable by ``transformers``.

How it works: every rank expands its ``sharded_state_dict()`` (Megatron's ``load_preprocess``)
and keeps the main replica of each ``ShardedTensor``; one layer at a time, rank 0 gathers the
pieces (``gather_object``), puts each global tensor together from the pieces' offsets (every
element must be covered), and splits it into HF tensors with the inverse of the import
:class:`~.mapping.Layout` (q/k/v out of the per-group interleave, gate/up out of fc1, experts
out of the ``[E, N, K]`` stack, vocabulary padding dropped). Rank 0 writes shards of at most
``max_shard_size`` as they fill, then the index and ``config.json``. Memory on rank 0: one layer
plus one shard.

``write_hf_from_torch_dist`` does the same from a ``torch_dist`` checkpoint on disk (the CLI's
``megatron-to-hf``), loading one layer of tensors at a time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import ConvertError
from .hf_config import HFModelDims, hf_dims, read_hf_config
from .hf_files import HFShardWriter
from .mapping import hf_tensor_shapes, is_layer_stacked, layout, per_layer

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _group(key: str) -> int:
    """Write order: embedding, layers in order, final norm and output layer."""
    m = _LAYER.match(key)
    if m:
        return int(m.group(1))
    return -1 if key.startswith("embedding.") else 1 << 30


def hf_tensors_from_megatron(key: str, tensor: torch.Tensor, d: HFModelDims) -> dict[str, torch.Tensor]:
    """The HF tensors that the global Megatron tensor ``key`` holds (its whole content).

    Raises ConvertError if its shape does not fit the config ``d``."""
    lay = layout(key, d)
    shapes = hf_tensor_shapes(d)
    want = lay.hf_rows
    rows = tensor.shape[1] if lay.experts is not None else tensor.shape[0]
    bad = rows < want if lay.vocab_padded else rows != want
    if bad or (lay.experts is not None and tensor.shape[0] != d.experts):
        raise ConvertError(f"convert: Megatron tensor {key} has shape {list(tensor.shape)}, which does not fit the "
                           f"HF config ({want} rows{f' per expert, {d.experts} experts' if lay.experts else ''})")
    out: dict[str, torch.Tensor] = {}
    for expert in range(d.experts) if lay.experts is not None else [None]:
        src = tensor if expert is None else tensor[expert]
        pos = 0
        for p in lay.pieces(expert):
            if p.name not in out:
                if tuple(src.shape[1:]) != shapes[p.name][1:]:
                    raise ConvertError(f"convert: Megatron tensor {key} has shape {list(tensor.shape)}; HF {p.name} "
                                       f"needs {list(shapes[p.name])}")
                out[p.name] = torch.empty(shapes[p.name], dtype=src.dtype)
            out[p.name][p.start : p.stop] = src[pos : pos + p.count]
            pos += p.count
    return out


def _model_shards(gpt) -> dict[int, list[tuple[str, tuple, tuple, torch.Tensor]]]:
    """This rank's main-replica pieces, by write group: (key, global shape, global slice, data)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    sharded, _, _ = load_preprocess(gpt.sharded_state_dict())
    groups: dict[int, list] = {}

    def take(x):
        if isinstance(x, ShardedTensor) and is_main_replica(x.replica_id):
            key, shape, sl = per_layer(x.key, x.global_shape, x.global_slice())
            sl = tuple((s.start, s.stop) if isinstance(s, slice) else s for s in sl)
            groups.setdefault(_group(key), []).append((key, shape, sl, x.data.detach().cpu()))
        return x

    dict_list_map_inplace(take, sharded)
    return groups


def _assemble(pieces: Iterable[tuple[str, tuple, tuple, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Global tensors from their pieces; ConvertError if a piece is missing."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for key, shape, sl, data in pieces:
        if key not in full:
            full[key] = torch.zeros(shape, dtype=data.dtype)
            covered[key] = 0
        idx = tuple(slice(*s) if isinstance(s, tuple) else s for s in sl)
        full[key][idx] = data.reshape(full[key][idx].shape)
        covered[key] += data.numel()
    for key, t in full.items():
        if covered[key] != t.numel():
            raise ConvertError(f"convert: Megatron tensor {key}: the ranks hold {covered[key]} of its {t.numel()} "
                               "elements (a shard is missing)")
    return full


def iter_model_tensors(model) -> Iterator[dict[str, torch.Tensor]]:
    """On rank 0: the model's global tensors, one layer's dict at a time (other ranks: nothing;
    every rank must iterate, the gathers are collective)."""
    import torch.distributed as dist

    from .load import unwrap_gpt

    local = _model_shards(unwrap_gpt(model))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        for g in sorted(local):
            yield _assemble(local[g])
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    all_groups: list = [None] * world
    dist.all_gather_object(all_groups, sorted(local))
    for g in sorted(set().union(*all_groups)):
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(local.get(g, []), gathered, dst=0)
        if rank == 0:
            yield _assemble(p for part in gathered for p in part)


def _output_config(hf_config: dict, dtype: torch.dtype) -> dict:
    cfg = dict(hf_config)
    name = str(dtype).removeprefix("torch.")
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = name
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = name
    return cfg


def write_hf(groups: Iterable[dict[str, torch.Tensor]], out_dir: str | os.PathLike, hf_config: dict, *,
             dtype: torch.dtype = torch.bfloat16, max_shard_size: int | str = "5GB",
             progress: bool | None = None) -> list[str]:
    """Write the HF checkpoint of the global Megatron tensors in ``groups`` (dicts key -> tensor).
    Checks that every tensor the config implies was written. Returns the shard file names."""
    from tqdm import tqdm

    d = hf_dims(hf_config)
    expected = hf_tensor_shapes(d)
    writer = HFShardWriter(out_dir, max_shard_size)
    written: set[str] = set()
    bar = tqdm(total=len(expected), desc="convert: Megatron -> HF", unit="tensor",
               disable=None if progress is None else not progress)
    for group in groups:
        for key in sorted(group):
            for name, t in hf_tensors_from_megatron(key, group[key], d).items():
                writer.add(name, t.to(dtype))
                written.add(name)
                bar.update(1)
    bar.close()
    missing = sorted(set(expected) - written)
    if missing:
        raise ConvertError(f"convert: the Megatron tensors give no {missing[0]} ({len(missing)} HF tensors missing)")
    return writer.finish(_output_config(hf_config, dtype))


def hf_config_of_model(gpt) -> dict:
    """An HF config for a GPTModel built from scratch (the exporter's config builder)."""
    from ..export.hf_config import build_hf_config
    from ..specs import moe_layer_pattern

    cfg = gpt.config
    pattern = moe_layer_pattern(cfg)
    return build_hf_config(
        cfg, vocab_size=gpt.vocab_size, rope_theta=float(gpt.rotary_base), max_position_embeddings=gpt.max_sequence_length,
        tie_word_embeddings=bool(gpt.share_embeddings_and_output_weights),
        moe_layers=[i for i, m in enumerate(pattern) if m], torch_dtype=torch.bfloat16,
    ) | {"rms_norm_eps": float(cfg.layernorm_epsilon), "initializer_range": float(cfg.init_method_std)}


def save_hf_checkpoint(model, out_dir: str | os.PathLike, hf_config: Any = None, *, dtype: torch.dtype = torch.bfloat16,
                       max_shard_size: int | str = "5GB", progress: bool | None = None) -> list[str] | None:
    """Write ``model`` (this rank's shard; every rank must call) as an HF checkpoint on rank 0.

    Args:
        model: a ``GPTModel`` (wrappers looked through) under the current parallel state.
        out_dir: the output directory (created).
        hf_config: the HF config to write (a dict, a ``config.json`` path or HF directory, or a
            ``transformers`` config); None builds one from the model's ``TransformerConfig``.
            Its vocabulary size decides how many embedding rows are kept (padding dropped).
        dtype: of the written tensors (BF16 by default, like the hub's checkpoints).
        max_shard_size: bytes or ``"5GB"``-style; ``model.safetensors`` alone if it fits.

    Returns:
        the shard names on rank 0, None elsewhere. Raises ConvertError on a model that does
        not fit the config.
    """
    import torch.distributed as dist

    from .load import unwrap_gpt

    gpt = unwrap_gpt(model)
    cfg = read_hf_config(hf_config) if hf_config is not None else hf_config_of_model(gpt)
    hf_dims(cfg)
    groups = iter_model_tensors(gpt)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if not rank0:
        for _ in groups:
            pass
        return None
    return write_hf(groups, out_dir, cfg, dtype=dtype, max_shard_size=max_shard_size, progress=progress)


def iter_torch_dist_tensors(ckpt_dir: str | os.PathLike) -> Iterator[dict[str, torch.Tensor]]:
    """The model tensors of a ``torch_dist`` checkpoint directory, one layer at a time (optimizer
    state and ``_extra_state`` objects skipped). Needs ``torch.distributed`` (a world of 1 works)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    by_group: dict[int, dict] = {}
    stacked: set[str] = set()  # per-layer names read out of a layer-stacked tensor, as [1, ...]
    for key, st in meta.items():
        if not isinstance(st, ShardedTensor) or key.startswith("optimizer.") or key.endswith("_extra_state"):
            continue
        if not is_layer_stacked(key):
            by_group.setdefault(_group(key), {})[key] = st
            continue
        layers = st.global_shape[0]
        for i in range(layers):  # read one layer of the stacked tensor: the [1, ...] piece at offset i of axis 0
            piece = ShardedTensor.from_rank_offsets(key, torch.empty((1, *st.global_shape[1:]), dtype=st.dtype),
                                                    (0, i, layers), replica_id=0)
            name, _, _ = per_layer(key, st.global_shape, (i,))
            by_group.setdefault(i, {})[name] = piece
            stacked.add(name)
    for g in sorted(by_group):
        loaded = dist_checkpointing.load(by_group[g], str(ckpt_dir), validate_access_integrity=False)
        # load() also returns the common state
        yield {k: loaded[k].cpu()[0] if k in stacked else loaded[k].cpu() for k in by_group[g]}


def write_hf_from_torch_dist(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, hf_config: Any, **kw) -> list[str]:
    """``torch_dist`` checkpoint directory -> HF checkpoint (see :func:`write_hf`)."""
    if not Path(ckpt_dir, "metadata.json").is_file():
        raise ConvertError(f"convert: {ckpt_dir} is not a torch_dist checkpoint (no metadata.json)")
    return write_hf(iter_torch_dist_tensors(ckpt_dir), out_dir, read_hf_config(hf_config), **kw)


__all__ = ["hf_config_of_model", "hf_tensors_from_megatron", "iter_model_tensors", "iter_torch_dist_tensors",
           "save_hf_checkpoint", "write_hf", "write_hf_from_torch_dist"]
