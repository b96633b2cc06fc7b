"""The model a Megatron ``torch_dist`` checkpoint holds, built from the checkpoint alone.

Two kinds of checkpoint say what they hold:

* one that ``minite-convert hf-to-megatron`` wrote stores the HF ``config.json`` (``hf_config``);
* one that ``megatron.training`` wrote (``examples/pretrain_gpt.py``, ``examples/train_tiny_moe.sh``)
  stores its run's ``args``: the architecture flags, and with ``--transformer-impl minite`` the
  ``--minite-*`` recipe.

:func:`model_from_checkpoint` builds that model on the minite specs (one process), loads its
weights (``dist_checkpointing`` re-shards any saved TP / EP / PP layout) and returns it with the
HF config that describes it (:func:`minite_megatron.convert.save.hf_config_of_model` for a
``megatron.training`` checkpoint, which has none). Refusals are :class:`ConvertError`, one line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .errors import ConvertError
from .megatron_checkpoint import find_torch_dist


def checkpoint_common(ckpt: Path) -> dict:
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt))
    return common if isinstance(common, dict) else {}


def recipe_of_checkpoint(common: dict, recipe: Any = None):
    """``recipe`` if given, else the ``--minite-*`` flags a megatron.training run stored, else ``Recipe()``."""
    from ..recipe import Recipe, RecipeError, recipe_from_args

    if recipe is not None:
        return recipe
    args = common.get("args")
    if args is not None and getattr(args, "transformer_impl", None) == "minite":
        try:
            return recipe_from_args(args)
        except RecipeError as e:
            raise ConvertError(f"convert: the checkpoint's stored recipe is invalid: {e}") from None
    return Recipe()


def _model_of_hf_config(hf_config: dict, recipe, *, vocab_divisible_by: int, dtype: torch.dtype):
    from megatron.core.models.gpt.gpt_model import GPTModel

    from ..model import finalize_gpt_model
    from ..specs import get_gpt_decoder_block_minite_spec
    from .hf_config import transformer_config_from_hf

    config, kwargs = transformer_config_from_hf(hf_config, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                                use_cpu_initialization=True, perform_initialization=False,
                                                make_vocab_size_divisible_by=vocab_divisible_by)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe), **kwargs)
    finalize_gpt_model(model, recipe)
    return model


def _model_of_megatron_args(args, recipe, *, dtype: torch.dtype):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.training.argument_utils import core_transformer_config_from_args

    from ..model import finalize_gpt_model
    from ..specs import get_gpt_decoder_block_minite_spec

    if getattr(args, "padded_vocab_size", None) is None:
        raise ConvertError("convert: the checkpoint's args have no padded_vocab_size (not a megatron.training run)")
    args.params_dtype, args.bf16, args.fp16 = dtype, dtype == torch.bfloat16, False
    args.use_cpu_initialization, args.perform_initialization = True, False
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "context_parallel_size"):
        setattr(args, name, 1)  # this process builds the unsharded model; dist_checkpointing re-shards
    args.sequence_parallel = False
    config = core_transformer_config_from_args(args)
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe),
        vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )
    finalize_gpt_model(model, recipe)
    return model


def model_from_checkpoint(load_dir: str | os.PathLike, *, iteration: str | int | None = None, recipe: Any = None,
                          hf_config: Any = None, dtype: torch.dtype = torch.bfloat16):
    """``(model, hf_config, recipe, ckpt_path)`` of the checkpoint under ``load_dir`` (module docstring).

    ``hf_config`` (a dict, ``config.json`` path or HF directory) overrides what the checkpoint
    says. Needs Megatron's parallel state (one process: ``presets.init_single_process``)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    from .hf_config import read_hf_config
    from .save import hf_config_of_model

    ckpt = find_torch_dist(load_dir, iteration)
    common = checkpoint_common(ckpt)
    recipe = recipe_of_checkpoint(common, recipe)
    stored_args = common.get("args")
    cfg = read_hf_config(hf_config) if hf_config is not None else common.get("hf_config")
    if cfg is not None:
        divisible = int(getattr(stored_args, "make_vocab_size_divisible_by", 1) or 1)
        model = _model_of_hf_config(dict(cfg), recipe, vocab_divisible_by=divisible, dtype=dtype)
    elif stored_args is not None:
        model = _model_of_megatron_args(stored_args, recipe, dtype=dtype)
        cfg = hf_config_of_model(model)
    else:
        raise ConvertError(f"convert: {ckpt} says neither which HF model (hf_config) nor which Megatron run (args) it "
                           "holds; pass --hf-config")
    try:
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(ckpt))
    except CheckpointingException as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise ConvertError(f"convert: {ckpt} does not fit the model it describes: {first[:300]}") from None
    missing, _ = model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise ConvertError(f"convert: {ckpt} lacks {len(missing)} weight(s) of its model, e.g. {missing[:3]}")
    return model, dict(cfg), recipe, ckpt


__all__ = ["checkpoint_common", "model_from_checkpoint", "recipe_of_checkpoint"]
