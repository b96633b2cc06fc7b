"""A Hugging Face Qwen3-MoE checkpoint streamed into the resident NVFP4 rollout model, layer by layer.

:func:`build_resident_gpt_from_hf` is :func:`~minite_megatron.rollout.resident.build_resident_gpt`
with the checkpoint's weights instead of seeded random ones. Nothing holds a BF16 copy of the
whole model, on the host or on the device:

1. the model is built from the checkpoint's ``config.json`` by the importer's own config mapping
   (:func:`~.hf_config.transformer_config_from_hf`, minite specs, BF16), its parameters allocated
   on the host and never written (no memory), and checked against a preset's shapes
   (:func:`check_preset`: one line naming the field, e.g. ``num_hidden_layers 24 != 48``);
2. the importer's plan (:func:`~.load.plan_hf_load`) checks the checkpoint against the model
   before anything is read: the index, its shards, every tensor the config implies (a missing one
   is named), their shapes;
3. for each part of the model in turn -- the embedding, the final norm, the LM head, then layer
   0, 1, ... -- the part is allocated on the device, exactly its tensors are read from the
   safetensors shards (``safe_open``; the importer's name map, qkv interleave, gate/up fusion and
   per-expert pieces: :mod:`.mapping`, :func:`~.load.read_hf_tensors`) and copied in
   (:func:`~.load.load_read_tensors`), then the layer's NVFP4 linears are quantized by the module's
   own quantizer and its BF16 weights dropped (:func:`~minite_megatron.rollout.resident.freeze_nvfp4`).
   The host tensors of a part are freed before the next part is read.

So the result is, bit for bit, what the importer's full load (:func:`~.hf.build_gpt_from_hf`)
followed by the same quantization gives, and at most one part's BF16 weights (one layer's, or the
embedding / head: 0.6 GB each at Qwen3-30B-A3B's size) are held at once on the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import ConvertError
from .hf_config import HFModelDims, hf_dims, transformer_config_from_hf
from .load import load_read_tensors, plan_hf_load, read_hf_tensors

PRESET_FIELDS = (("layers", "num_hidden_layers"), ("hidden", "hidden_size"), ("heads", "num_attention_heads"),
                 ("groups", "num_key_value_heads"), ("head_dim", "head_dim"), ("experts", "num_experts"),
                 ("topk", "num_experts_per_tok"), ("moe_ffn", "moe_intermediate_size"), ("vocab", "vocab_size"))
"""``(preset key, config.json field)`` of the shapes a checkpoint must share with a preset."""


def check_preset(d: HFModelDims, preset: str | dict, where: str) -> None:
    """Raise ConvertError (one line naming the ``config.json`` field) unless the checkpoint of
    dims ``d`` has ``preset``'s shapes (a name of
    :data:`~minite_megatron.training.presets.PRESETS` or a dict of its keys): every layer MoE,
    an untied LM head, and :data:`PRESET_FIELDS` equal."""
    from ..training.presets import PRESETS

    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ConvertError(f"convert: preset {preset!r} is not one of {sorted(PRESETS)}")
        name, p = preset, PRESETS[preset]
    else:
        name, p = "given", preset
    have = dict(layers=d.layers, hidden=d.hidden, heads=d.heads, groups=d.groups, head_dim=d.head_dim,
                experts=d.experts, topk=d.topk, moe_ffn=d.moe_ffn, vocab=d.vocab)
    for key, hf_field in PRESET_FIELDS:
        if have[key] != p[key]:
            raise ConvertError(f"convert: {where}: {hf_field} {have[key]} != {p[key]} (the {name} preset)")
    dense = [i for i in range(d.layers) if not d.is_moe_layer(i)]
    if dense:
        raise ConvertError(f"convert: {where}: mlp_only_layers / decoder_sparse_step make layers {dense[:8]} dense; "
                           f"the {name} preset's layers are all MoE")
    if d.tie_embeddings:
        raise ConvertError(f"convert: {where}: tie_word_embeddings true != false (the {name} preset's LM head is untied)")


def check_hf_checkpoint(hf_dir: str | os.PathLike, preset: str | dict | None = None) -> HFModelDims:
    """Every check :func:`build_resident_gpt_from_hf` makes before it reads a weight, without
    building anything (a tool's early refusal): the directory, ``config.json``, the preset's
    shapes, the index, its shards and the tensor set. Returns the checkpoint's dims."""
    from .load import open_checkpoint

    root = _checkpoint_dir(hf_dir)
    d = hf_dims(root)
    if preset is not None:
        check_preset(d, preset, str(root / "config.json"))
    ckpt, _, _ = open_checkpoint(root)
    ckpt.close()
    return d


def _checkpoint_dir(hf_dir: str | os.PathLike) -> Path:
    root = Path(hf_dir)
    if not root.is_dir():
        raise ConvertError(f"convert: {root} is not a directory (a Hugging Face checkpoint: config.json + safetensors)")
    return root


def unallocated_gpt_from_hf(hf_dir: str | os.PathLike, recipe=None, *, preset: str | dict | None = None,
                            max_seq: int | None = None):
    """The ``GPTModel`` of the checkpoint ``hf_dir``'s ``config.json`` on the minite specs under
    ``recipe`` (default ``Recipe()``), BF16, parameters on the host and never written -- the input
    of :func:`build_resident_gpt_from_hf`. ``preset``: refuse a config of other shapes
    (:func:`check_preset`). ``max_seq``: the RoPE table's length (default the config's
    ``max_position_embeddings``)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    from ..model import finalize_gpt_model
    from ..recipe import Recipe
    from ..specs import get_gpt_decoder_block_minite_spec
    from .hf import _ensure_parallel_state

    root = _checkpoint_dir(hf_dir)
    d = hf_dims(root)
    if preset is not None:
        check_preset(d, preset, str(root / "config.json"))
    _ensure_parallel_state(None)
    recipe = recipe if recipe is not None else Recipe()
    overrides = dict(params_dtype=torch.bfloat16, bf16=True, use_cpu_initialization=True, perform_initialization=False)
    if max_seq is not None:
        overrides["max_sequence_length"] = int(max_seq)
    config, model_kwargs = transformer_config_from_hf(root, **overrides)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe),
                   pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(), **model_kwargs)
    return finalize_gpt_model(gpt, recipe)


@dataclass
class StreamReport:
    """What :func:`build_resident_gpt_from_hf` read: ``parts``, in order, as ``(state-dict
    prefix, bytes read)``; a part's tensors are freed before the next part is read."""

    parts: list[tuple[str, int]] = field(default_factory=list)

    @property
    def bytes_read(self) -> int:
        return sum(n for _, n in self.parts)

    @property
    def largest_part_bytes(self) -> int:
        return max((n for _, n in self.parts), default=0)


class _CheckpointFill:
    """``fill(index, module)`` of :func:`~minite_megatron.rollout.resident.build_resident_gpt`:
    reads the part's tensors from the plan, copies them in, lets them go."""

    def __init__(self, gpt, plan, report: StreamReport, on_tensor=None):
        self.prefix = {id(m): f"{n}." for n, m in gpt.named_modules() if n}
        self.plan, self.report, self.on_tensor = plan, report, on_tensor

    def __call__(self, index: int, module: torch.nn.Module) -> None:
        prefix = self.prefix[id(module)]
        tensors, factories = self.plan.take(prefix)
        nbytes = read_hf_tensors(self.plan, tensors, self.on_tensor)
        load_read_tensors(module, tensors, factories, prefix)
        self.report.parts.append((prefix, nbytes))


def build_resident_gpt_from_hf(hf_dir: str | os.PathLike, recipe=None, *, device, preset: str | dict | None = None,
                               max_seq: int | None = None, keep_expert_images: bool = False, progress: bool = False,
                               on_tensor=None):
    """The resident NVFP4 model (:func:`~minite_megatron.rollout.resident.build_resident_gpt`)
    with the weights of the Hugging Face Qwen3-MoE checkpoint ``hf_dir`` (``config.json`` +
    safetensors, sharded with ``model.safetensors.index.json`` or one ``model.safetensors``), read
    part by part (module docstring) onto ``device``.

    Args:
        recipe: the :class:`~minite_megatron.recipe.Recipe` (default ``Recipe()``; strict mode:
            ``Recipe(strict=True)``).
        preset: refuse a checkpoint whose shapes are not the preset's (:func:`check_preset`).
        max_seq: the RoPE table's length (default the config's ``max_position_embeddings``).
        keep_expert_images, progress: as :func:`~minite_megatron.rollout.resident.build_resident_gpt`'s.
        on_tensor: called with each host tensor read (a measure of what is held, in tests).

    Returns:
        the model, in eval mode; ``model.minite_hf_stream`` is the :class:`StreamReport`.
        Raises ConvertError (one line naming the directory, file, field or tensor) before any
        weight is read when the checkpoint does not fit.
    """
    from ..rollout.resident import build_resident_gpt

    gpt = unallocated_gpt_from_hf(hf_dir, recipe, preset=preset, max_seq=max_seq)
    plan = plan_hf_load(gpt, hf_dir)
    report = StreamReport()
    try:
        build_resident_gpt(gpt, device=device, keep_expert_images=keep_expert_images, progress=progress,
                           fill=_CheckpointFill(gpt, plan, report, on_tensor))
    finally:
        plan.ckpt.close()
    if plan.tensors:
        raise ConvertError(f"convert: the model's tensors {sorted(plan.tensors)[:3]} belong to no part that was loaded")
    gpt.minite_hf_stream = report
    return gpt


__all__ = ["PRESET_FIELDS", "StreamReport", "build_resident_gpt_from_hf", "check_hf_checkpoint", "check_preset",
           "unallocated_gpt_from_hf"]
