"""The Hugging Face import API: build a Megatron ``GPTModel`` from a Qwen3 / Qwen3-MoE checkpoint
(this rank's shard only, under the current Megatron parallel state), and write one back.

.. code-block:: python

    from minite_megatron.convert.hf import build_gpt_from_hf, save_hf_checkpoint

    model = build_gpt_from_hf("Qwen3-30B-A3B/", impl="minite", dtype=torch.bfloat16)   # NVFP4 learner
    ...                                                                                 # train
    save_hf_checkpoint(model, "out/", "Qwen3-30B-A3B/")                                  # BF16, rank 0 writes

* :func:`transformer_config_from_hf` (:mod:`.hf_config`): the config mapping and its refusals.
* :func:`load_hf_weights` (:mod:`.load`): how each rank reads only its slices.
* :func:`save_hf_checkpoint` (:mod:`.save`): the gather and the sharded BF16 writer.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .errors import ConvertError
from .hf_config import transformer_config_from_hf
from .load import load_hf_weights
from .save import save_hf_checkpoint

IMPLS = ("minite", "local")


def local_block_spec(config, *, vp_stage: int | None = None, minite_norms: bool | None = None):
    """Megatron's local decoder-block spec (``SequentialMLP`` experts, torch norms). With
    ``minite_norms`` (default: under sequence parallelism, where the torch norm refuses to run
    without apex) the norms become ``MiniteNorm`` (a plain, non-quantizing RMSNorm that marks its
    weights ``sequence_parallel``, so ``finalize_model_grads`` all-reduces them as apex/TE norms do)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.identity_op import IdentityOp

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=config.normalization,
                                      vp_stage=vp_stage)
    if not (config.sequence_parallel if minite_norms is None else minite_norms):
        return spec
    from ..modules.norm import MiniteNorm

    for layer in spec.layer_specs:
        sub = layer.submodules
        sub.input_layernorm = MiniteNorm
        sub.pre_mlp_layernorm = MiniteNorm
        attn = sub.self_attention.submodules
        if attn.q_layernorm is not IdentityOp:
            attn.q_layernorm = MiniteNorm
            attn.k_layernorm = MiniteNorm
    spec.layer_norm = MiniteNorm
    return spec


def _ensure_parallel_state(seed: int | None) -> None:
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        from ..training.presets import init_single_process

        init_single_process(seed=None)  # world of 1, or pure data parallel over an existing world
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if seed is not None or not tracker.is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(  # keeps a graph-safe tracker graph-safe
            1234 if seed is None else seed, force_reset_rng=True,
            use_cudagraphable_rng=bool(getattr(tracker, "use_cudagraphable_rng", False)))


def build_gpt_from_hf(hf_dir: str | os.PathLike, *, recipe=None, impl: str = "minite", device=None,
                      dtype: torch.dtype = torch.bfloat16, max_sequence_length: int | None = None,
                      make_vocab_size_divisible_by: int = 1, config_overrides: dict[str, Any] | None = None,
                      seed: int | None = None, progress: bool | None = None):
    """A ``GPTModel`` with the weights of the HF checkpoint ``hf_dir`` (this rank's shard).

    Args:
        hf_dir: a Qwen3 / Qwen3-MoE directory: ``config.json`` + safetensors (sharded with the index).
        recipe: the miniTE :class:`~minite_megatron.recipe.Recipe` for ``impl="minite"`` (default
            ``Recipe()``); must be None for ``impl="local"``.
        impl: ``"minite"`` (miniTE's NVFP4 specs + ``finalize_gpt_model``) or ``"local"``
            (Megatron's local spec, unquantized).
        device: default: the current CUDA device, else the CPU.
        dtype: the parameters' dtype (``torch.bfloat16`` or ``torch.float32``).
        max_sequence_length: default the config's ``max_position_embeddings``.
        make_vocab_size_divisible_by: pad the vocabulary to a multiple of this times TP (zero rows).
        config_overrides: extra ``TransformerConfig`` fields (e.g. ``{"moe_aux_loss_coeff": 0}``).
        seed: re-seed Megatron's RNG tracker (dropout); by default it is seeded only if unset.
        progress: a progress bar over the tensors read (None: only on a terminal).

    Megatron's parallel state is used as it is (TP, EP, expert-TP, PP from ``parallel_state``);
    when it is not initialized, a single process (or pure data parallelism) is set up.

    Returns:
        the model (in training mode, as Megatron builds it). Raises ConvertError (one line) for
        an unsupported config or checkpoint, a bad ``impl`` or ``dtype``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_model import GPTModel

    if impl not in IMPLS:
        raise ConvertError(f"convert: impl={impl!r} is not one of {IMPLS}")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConvertError(f"convert: dtype={dtype} is not supported (torch.bfloat16 or torch.float32)")
    if impl == "local" and recipe is not None:
        raise ConvertError("convert: a recipe applies to impl='minite' only")
    _ensure_parallel_state(seed)
    device = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    overrides = dict(params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=device.type == "cpu",
                     perform_initialization=False, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    overrides.update(config_overrides or {})
    if max_sequence_length is not None:
        overrides["max_sequence_length"] = int(max_sequence_length)
    config, model_kwargs = transformer_config_from_hf(hf_dir, **overrides)
    if impl == "minite":
        from ..model import finalize_gpt_model
        from ..recipe import Recipe
        from ..specs import get_gpt_decoder_block_minite_spec

        recipe = recipe if recipe is not None else Recipe()
        spec = get_gpt_decoder_block_minite_spec(config, recipe)
    else:
        spec = local_block_spec(config)
    model = GPTModel(config=config, transformer_layer_spec=spec, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), **model_kwargs)
    if impl == "minite":
        finalize_gpt_model(model, recipe)
    model = model.to(device=device)
    load_hf_weights(model, hf_dir, progress=progress)
    return model


__all__ = ["build_gpt_from_hf", "load_hf_weights", "local_block_spec", "save_hf_checkpoint",
           "transformer_config_from_hf"]
