"""Load a Hugging Face Qwen3 / Qwen3-MoE checkpoint into a built Megatron ``GPTModel``, each rank
reading only its shard.

How it works: the model's own ``sharded_state_dict()`` says, for every tensor this rank holds,
its global checkpoint key, global shape and where the local piece sits in it (offsets and
fragmentation, with TP, EP, expert-TP and PP already applied by Megatron; factories such as the
SwiGLU fc1 split are expanded first with Megatron's ``load_preprocess``). For each such
``ShardedTensor`` the key's :class:`~.mapping.Layout` gives the HF rows that make up the global
tensor, and exactly the rows and columns of the local piece are read from the safetensors files
through ``safe_open(...).get_slice(...)`` (``model.safetensors.index.json`` names the file of
each tensor). Megatron's factory merges then rebuild the local parameters and
``load_state_dict`` copies them in place (parameter version counters move, so weight caches see
the change). No rank materialises a tensor it does not hold. The three steps are separate
functions (:func:`plan_hf_load`, :func:`read_hf_tensors`, :func:`load_read_tensors`) so that a
part of the model can be read and loaded at a time (:mod:`.hf_stream`).

Checks before anything is read, each one line (:class:`~.errors.ConvertError`): the config is a
supported Qwen3 / Qwen3-MoE config; the checkpoint holds exactly the tensors that config implies
(a missing tensor, a stray one -- a bias, an MTP layer -- or a wrong shape is named); the model's
global shapes agree with the config (a model built for another config is refused). Afterwards,
every parameter of the model must have been loaded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import ConvertError
from .hf_config import HFModelDims, hf_dims
from .hf_files import INDEX_FILE, SINGLE_FILE, HFCheckpoint
from .mapping import Layout, fused_expert_names, hf_tensor_shapes, layout, per_layer


def unwrap_gpt(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (or a one-element list of them)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ConvertError("convert: virtual pipeline stages (several model chunks) are not supported")
        model = model[0]
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "sharded_state_dict") or not hasattr(model, "decoder"):
        raise ConvertError(f"convert: expected a Megatron GPTModel, got {type(model).__name__}")
    return model


def open_checkpoint(hf_dir: str | os.PathLike) -> tuple[HFCheckpoint, HFModelDims, bool]:
    """Open ``hf_dir``, check its config and tensor set (module docstring). Returns the reader,
    the dims and whether the experts are stored fused."""
    ckpt = HFCheckpoint(hf_dir)
    d = hf_dims(ckpt.config)
    fused = d.experts > 0 and fused_expert_names(d.moe_layers[0])[0] in ckpt if d.moe_layers else False
    expected = hf_tensor_shapes(d, fused_experts=fused)
    for name, shape in expected.items():
        if name not in ckpt:
            where = (f"{INDEX_FILE} names no shard for it" if ckpt.indexed else f"{SINGLE_FILE} does not hold it")
            raise ConvertError(f"convert: the checkpoint in {ckpt.root} lacks tensor {name} (its config.json implies it; "
                               f"{where})")
        if ckpt.shapes[name] != shape:
            raise ConvertError(f"convert: tensor {name} in {ckpt.weight_map[name]} has shape {list(ckpt.shapes[name])}; "
                               f"config.json implies {list(shape)}")
    for name in ckpt.weight_map:
        if name in expected or name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and d.tie_embeddings:
            continue  # transformers ties it to the embedding and ignores the stored copy
        raise ConvertError(f"convert: tensor {name} in {ckpt.weight_map[name]} has no place in a {d.model_type} model "
                           "of this config (biases, shared experts and MTP layers are not supported)")
    return ckpt, d, fused


def _piece_rows(ckpt: HFCheckpoint, lay: Layout, expert: int | None, rows: slice, cols: slice | None,
                dtype: torch.dtype) -> torch.Tensor:
    """Rows ``rows`` (columns ``cols``) of the Megatron tensor ``lay`` (of expert ``expert``)."""
    pieces = lay.pieces(expert)
    width = None if cols is None else cols.stop - cols.start
    out = torch.zeros((rows.stop - rows.start,) if width is None else (rows.stop - rows.start, width), dtype=dtype)
    pos = 0
    for p in pieces:
        lo, hi = max(rows.start, pos), min(rows.stop, pos + p.count)
        if lo < hi:
            part = ckpt.read(p.name, p.index, (p.start + lo - pos, p.start + hi - pos),
                             None if cols is None else (cols.start, cols.stop))
            out[lo - rows.start : hi - rows.start] = part.to(dtype)
        pos += p.count
    return out


@dataclass
class LoadReport:
    """What :func:`load_hf_weights` did on this rank."""

    tensors: int
    bytes_read: int
    fused_experts: bool


def _check_global_shape(key: str, shape: tuple, lay: Layout, ckpt: HFCheckpoint, d: HFModelDims) -> None:
    pieces = lay.pieces(0 if lay.experts is not None else None)
    hf_cols = ckpt.shapes[pieces[0].name][1:] if pieces[0].index is None else ckpt.shapes[pieces[0].name][2:]
    want_rows = lay.hf_rows
    if lay.experts is not None:
        ok = len(shape) == 3 and shape[0] == d.experts and shape[1] == want_rows and shape[2:] == hf_cols
        want = (d.experts, want_rows, *hf_cols)
    else:
        rows_ok = shape[0] >= want_rows if lay.vocab_padded else shape[0] == want_rows
        ok = len(shape) == 1 + len(hf_cols) and rows_ok and shape[1:] == hf_cols
        want = (want_rows, *hf_cols)
    if not ok:
        raise ConvertError(f"convert: the model's {key} has global shape {list(shape)}; the HF config implies "
                           f"{list(want)} (the model was built for another config)")


@dataclass
class HFLoadPlan:
    """What :func:`load_hf_weights` reads for one model, before anything is read: the opened
    checkpoint, its dims, the model's ``ShardedTensor`` s (``tensors``: ``load_preprocess``'ed,
    keyed by the model's state-dict names, e.g. ``decoder.layers.3.mlp.router.weight``), the
    factories that merge them back (``factories``, same keys) and each checkpoint key's
    :class:`~.mapping.Layout`."""

    ckpt: HFCheckpoint
    dims: HFModelDims
    fused_experts: bool
    tensors: dict
    factories: dict
    layouts: dict[str, Layout]
    count: int

    def take(self, prefix: str) -> tuple[dict, dict]:
        """Remove and return the tensors and factories of the state-dict names under ``prefix``
        (a module's, ending in ``.``): what one part of the model loads."""
        keys = [k for k in self.tensors if k.startswith(prefix)]
        return ({k: self.tensors.pop(k) for k in keys},
                {k: self.factories.pop(k) for k in keys if k in self.factories})


def plan_hf_load(model, hf_dir: str | os.PathLike) -> HFLoadPlan:
    """Open ``hf_dir`` and check it against ``model`` (the module docstring's checks; nothing is read)."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess

    gpt = unwrap_gpt(model)
    ckpt, d, fused = open_checkpoint(hf_dir)
    sharded, _, factories = load_preprocess(gpt.sharded_state_dict())
    tensors, _ = extract_matching_values(sharded, lambda x: isinstance(x, ShardedTensor))
    todo: list[ShardedTensor] = []
    dict_list_map_inplace(lambda x: todo.append(x) or x, tensors)
    layouts: dict[str, Layout] = {}
    for st in todo:
        key, shape, _ = per_layer(st.key, st.global_shape, st.global_slice())
        if key not in layouts:
            layouts[key] = layout(key, d, fused_experts=fused)
            _check_global_shape(key, shape, layouts[key], ckpt, d)
    return HFLoadPlan(ckpt, d, fused, tensors, factories, layouts, len(todo))


def read_hf_tensors(plan: HFLoadPlan, tensors: dict, on_tensor=None) -> int:
    """Replace, in place, every ``ShardedTensor`` of ``tensors`` (all of ``plan.tensors`` or a
    :meth:`HFLoadPlan.take`) by its local piece read from the checkpoint; ``on_tensor(t)`` is
    called with each piece read. Returns the bytes read."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    bytes_read = 0

    def read(st: ShardedTensor) -> torch.Tensor:
        nonlocal bytes_read
        key, _, sl = per_layer(st.key, st.global_shape, st.global_slice())
        lay = plan.layouts[key]
        if lay.experts is not None:
            experts = [sl[0]] if isinstance(sl[0], int) else list(range(sl[0].start, sl[0].stop))
            parts = [_piece_rows(plan.ckpt, lay, e, sl[1], sl[2], st.dtype) for e in experts]
            out = parts[0] if isinstance(sl[0], int) else torch.stack(parts)
        else:
            out = _piece_rows(plan.ckpt, lay, None, sl[0], sl[1] if len(sl) > 1 else None, st.dtype)
        out = out.reshape(st.local_shape)
        bytes_read += out.numel() * out.element_size()
        if on_tensor is not None:
            on_tensor(out)
        return out

    dict_list_map_inplace(lambda x: read(x) if isinstance(x, ShardedTensor) else x, tensors)
    return bytes_read


def load_read_tensors(module: torch.nn.Module, tensors: dict, factories: dict, prefix: str = "") -> None:
    """Merge the read ``tensors`` (:func:`read_hf_tensors`) with their ``factories`` and copy them
    into ``module`` (whose state-dict names are the keys less ``prefix``); every parameter of
    ``module`` must be among them."""
    from megatron.core.dist_checkpointing.mapping import apply_factory_merges

    state = apply_factory_merges(tensors, factories)
    state = {k[len(prefix):]: v for k, v in state.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [prefix + k for k in missing if not k.endswith("_extra_state")]
    unexpected = [prefix + k for k in unexpected]
    if missing or unexpected:
        raise ConvertError(f"convert: after loading, the model lacks {missing[:3]} / has unexpected {unexpected[:3]}")


def load_hf_weights(model, hf_dir: str | os.PathLike, *, progress: bool | None = None, on_tensor=None) -> LoadReport:
    """Load the HF checkpoint ``hf_dir`` into ``model`` (this rank's shard only; module docstring).

    Args:
        model: a built ``GPTModel`` (local or minite spec; DDP / Float16Module wrappers are
            looked through) under the current Megatron parallel state.
        hf_dir: a directory with ``config.json`` and ``model.safetensors`` or the sharded files
            plus ``model.safetensors.index.json``.
        progress: a tqdm bar over the tensors on rank 0 (None: only on a terminal).
        on_tensor: called with each tensor piece read (a measure of what is held, in tests).

    Returns:
        a :class:`LoadReport`. Raises ConvertError (one line) on any mismatch (module docstring).
    """
    from tqdm import tqdm

    gpt = unwrap_gpt(model)
    plan = plan_hf_load(gpt, hf_dir)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    bar = tqdm(total=plan.count, desc="convert: HF -> Megatron", unit="tensor", disable=(not rank0) or
               (None if progress is None else not progress))

    def counted(t: torch.Tensor) -> None:
        bar.update(1)
        if on_tensor is not None:
            on_tensor(t)

    bytes_read = read_hf_tensors(plan, plan.tensors, counted)
    bar.close()
    plan.ckpt.close()
    load_read_tensors(gpt, plan.tensors, plan.factories)
    return LoadReport(tensors=plan.count, bytes_read=bytes_read, fused_experts=plan.fused_experts)


__all__ = ["HFLoadPlan", "LoadReport", "load_hf_weights", "load_read_tensors", "open_checkpoint", "plan_hf_load",
           "read_hf_tensors", "unwrap_gpt"]
