"""``--transformer-impl minite`` for Megatron's command line (megatron.training 0.19.2).

Three pieces, each usable on its own:

* :func:`add_minite_arguments` (an ``extra_args_provider``): adds ``minite`` to the choices of
  Megatron's ``--transformer-impl`` (the flag is generated from
  ``TransformerConfig.transformer_impl``, a ``Literal`` turned into argparse ``choices``) and the
  recipe's ``--minite-*`` flags; on a CPU-only machine it makes ``gloo`` the default
  ``--distributed-backend``.
* :func:`validate_minite_args`: fails fast, naming the flag, on configurations minite cannot run
  (sizes not multiples of 16, TE-only flags, ``--spec``/MLA with minite, an invalid recipe or
  recipe file, BF16 first/last layers the model does not have, a ``--minite-backend`` this
  machine cannot run) before the model is built, and
  turns off Megatron's default ``gradient_accumulation_fusion`` when apex's CUDA extension is
  absent and ``apply_rope_fusion`` without TE (Megatron's local modules raise otherwise).
* :func:`apply_minite_to_model_config`: puts the minite layer specs into a
  ``GPTModelConfig.transformer_layer_spec`` (the public hook ``GPTModelBuilder.build_model``
  reads; a callable of ``(config, vp_stage)``) and appends :func:`finalize_gpt_model` to its
  ``pre_wrap_hooks`` (run on the built model chunks before DDP wrapping).

:func:`install` wires all three into ``megatron.training`` at run time (see
:mod:`minite_megatron.launch`): it wraps ``arguments.add_megatron_arguments`` and
``arguments.validate_args`` (every Megatron parser is built and validated through them) and
``argument_utils.gpt_config_from_args`` (how 0.19's ``pretrain_gpt.py`` turns args into the
model config). Scripts that build their own GPT model instead (a ``model_provider`` calling
``GPTModel(...)``) pass ``minite_layer_spec(config, recipe=...)`` as the layer spec themselves.

Where ``transformer_impl == "minite"`` meets Megatron's own comparisons: every
``== "transformer_engine"`` / ``== "inference_optimized"`` test is false, so Megatron takes its
local paths (local ``DotProductAttention`` fallback, torch norms, local ``MoELayer`` and
token dispatchers, no TE RNG tracker, no TE fp8/fp4 autocast); ``models.backends.get_backend``
(used only by multi-latent attention) raises for unknown names, hence MLA is rejected here. The
two ``== "local"`` tests are not taken: torch-FSDP2's (it then also wraps plain
``ColumnParallelLinear`` units, as for TE; FSDP with minite is untested) and none other in 0.19.2.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)

MINITE = "minite"
NVFP4_BLOCK = 16


class MiniteArgumentError(ValueError):
    """A configuration ``--transformer-impl minite`` cannot run; the message names the flag."""


# ----------------------------------------------------------------------------------- parsing
def _find_action(parser: argparse.ArgumentParser, option: str) -> argparse.Action:
    for action in parser._actions:  # argparse has no public lookup by option string
        if option in action.option_strings:
            return action
    raise MiniteArgumentError(f"this Megatron parser has no {option} flag (megatron-core 0.19.x expected)")


def add_minite_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: ``--transformer-impl minite`` and the ``--minite-*`` flags.

    Idempotent (a parser that already has them is returned unchanged).
    """
    from . import cpu_compat
    from .recipe import add_recipe_args

    parser.error = _one_line_error  # argparse would print Megatron's whole usage (~740 lines) first
    impl = _find_action(parser, "--transformer-impl")
    if impl.choices is not None and MINITE not in impl.choices:
        impl.choices = [*impl.choices, MINITE]
    if not any("--minite-recipe" in a.option_strings for a in parser._actions):
        add_recipe_args(parser)
    if cpu_compat.is_active():
        parser.set_defaults(distributed_backend="gloo")
    if importlib.util.find_spec("one_logger") is None:
        # megatron/training/global_vars.py prints "WARNING: one_logger package is required ..." on every
        # run when the package (not on the public registry) is missing; Megatron's --no-one-logger
        parser.set_defaults(enable_one_logger=False)
    return parser


def _one_line_error(message: str):
    """``ArgumentParser.error`` without the usage text: one line, status 2 (argparse's status)."""
    import sys

    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ----------------------------------------------------------------------------------- validation
def _transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _apex_fused_wgrad_available() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def _check_multiple(errors: list[str], value: int | None, flag: str, divisor: int = 1, divisor_flag: str = "") -> None:
    if value is None:
        return
    local = value // divisor if divisor else value
    if value % max(divisor, 1) or local % NVFP4_BLOCK:
        where = f"{flag} {value}" + (f" / {divisor_flag} {divisor} = {local}" if divisor > 1 else "")
        errors.append(f"{where} is not a multiple of {NVFP4_BLOCK} (NVFP4 scales one block of 16 elements)")


def check_transformer_engine_request(args: argparse.Namespace) -> None:
    """Reject ``--transformer-impl transformer_engine`` (Megatron's default) when TE is not installed."""
    if getattr(args, "transformer_impl", None) == "transformer_engine" and not _transformer_engine_available():
        raise MiniteArgumentError(
            "--transformer-impl transformer_engine (Megatron's default) needs Transformer Engine, which is "
            "not installed: pass --transformer-impl minite (NVFP4) or --transformer-impl local"
        )


def check_minite_flags(args: argparse.Namespace) -> None:
    """The checks that need no derived sizes (run before Megatron's own ``validate_args``, whose
    messages would ask for TE): conflicting and TE-only flags, ``--spec``, MLA, the recipe."""
    check_transformer_engine_request(args)
    if getattr(args, "transformer_impl", None) != MINITE:
        return
    from .recipe import recipe_from_args

    recipe_from_args(args)  # RecipeError names the field / flag
    errors: list[str] = []
    te_flags = {
        "fp4": "--fp4-format",
        "fp8": "--fp8-format",
        "te_rng_tracker": "--te-rng-tracker",
        "tp_comm_overlap": "--tp-comm-overlap",
        "delay_wgrad_compute": "--delay-wgrad-compute",
        "moe_grouped_gemm": "--moe-grouped-gemm",
    }
    for dest, flag in te_flags.items():
        if getattr(args, dest, None):
            hint = (
                "minite quantizes with its own recipe: use the --minite-* flags"
                if dest in ("fp4", "fp8")
                else "it selects a Transformer Engine code path; minite always groups the experts"
                if dest == "moe_grouped_gemm"
                else "it selects a Transformer Engine code path"
            )
            errors.append(f"{flag} cannot be combined with --transformer-impl minite ({hint})")
    graphs = getattr(args, "cuda_graph_impl", "none")
    if graphs in ("local", "transformer_engine"):
        errors.append(
            f"--cuda-graph-impl {graphs} cannot be combined with --transformer-impl minite: it graphs layer by layer "
            "through Megatron's graph managers, which are not wired to the minite layers; use --cuda-graph-impl "
            "full_iteration (one graph of the whole forward + backward, every recipe)")
    elif graphs == "full_iteration" and (getattr(args, "expert_model_parallel_size", 1) or 1) > 1:
        errors.append(
            "--cuda-graph-impl full_iteration cannot be combined with --expert-model-parallel-size "
            f"{args.expert_model_parallel_size} under --transformer-impl minite: the expert all-to-all takes its split "
            "sizes on the host")
    if getattr(args, "multi_latent_attention", False):
        errors.append("--multi-latent-attention cannot be combined with --transformer-impl minite (not supported yet)")
    if getattr(args, "spec", None) is not None:
        errors.append(
            "--spec cannot be combined with --transformer-impl minite (the minite layer specs are chosen "
            "from the recipe); drop --spec, or use --transformer-impl local with your own spec"
        )
    if errors:
        raise MiniteArgumentError("; ".join(errors))


def validate_minite_args(args: argparse.Namespace) -> None:
    """Fail fast on configurations minite cannot run; only acts when ``--transformer-impl minite``
    (except the TE check below). Call it after Megatron's ``validate_args`` (derived sizes).

    Raises :class:`MiniteArgumentError` (every problem found, each naming its flag) and lets the
    recipe's own ``RecipeError`` (which names the ``--minite-*`` flag or recipe field) through.
    Also: without a Transformer Engine install, ``--transformer-impl transformer_engine`` (Megatron's
    default) is rejected with a pointer to ``minite``/``local``.
    """
    check_minite_flags(args)
    if getattr(args, "transformer_impl", None) != MINITE:
        return
    from .recipe import recipe_from_args

    recipe = recipe_from_args(args)
    errors: list[str] = []
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    _check_multiple(errors, getattr(args, "hidden_size", None), "--hidden-size", tp, "--tensor-model-parallel-size")
    if recipe.quantize_dense_mlp:
        _check_multiple(
            errors, getattr(args, "ffn_hidden_size", None), "--ffn-hidden-size", tp, "--tensor-model-parallel-size"
        )
    if recipe.quantize_experts and getattr(args, "num_experts", None):
        _check_multiple(
            errors,
            getattr(args, "moe_ffn_hidden_size", None) or getattr(args, "ffn_hidden_size", None),
            "--moe-ffn-hidden-size",
            etp,
            "--expert-tensor-parallel-size",
        )
    if recipe.quantize_attention:
        _check_multiple(errors, getattr(args, "kv_channels", None), "--kv-channels")
    _check_bf16_layers(errors, recipe, getattr(args, "num_layers", None))
    _check_backend(errors, recipe)
    if errors:
        raise MiniteArgumentError("; ".join(errors))
    _turn_off_missing_extensions(args)
    _use_minite_activation(args)


def _check_bf16_layers(errors: list[str], recipe, num_layers: int | None) -> None:
    """The recipe's BF16 first/last layers must exist in the model (checked before it is built)."""
    if num_layers is None:
        return
    for name in ("bf16_first_layers", "bf16_last_layers"):
        n = getattr(recipe, name)
        if n > num_layers:
            errors.append(f"--minite-{name.replace('_', '-')} {n} exceeds --num-layers {num_layers}")
    total = recipe.bf16_first_layers + recipe.bf16_last_layers
    if total > num_layers and max(recipe.bf16_first_layers, recipe.bf16_last_layers) <= num_layers:
        errors.append(f"--minite-bf16-first-layers {recipe.bf16_first_layers} + --minite-bf16-last-layers "
                      f"{recipe.bf16_last_layers} exceeds --num-layers {num_layers}")


def _check_backend(errors: list[str], recipe) -> None:
    """``--minite-backend`` must run on this machine's device (else it fails in the first forward)."""
    if recipe.backend is None:
        return
    import torch

    from .nvfp4 import BackendUnavailable, get_backend

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        get_backend(recipe.backend, device)
    except BackendUnavailable as e:
        errors.append(f"--minite-backend {recipe.backend}: {e}")


def _use_minite_activation(args: argparse.Namespace) -> None:
    """SwiGLU through the minite activation module (``modules.activation``: Megatron's formula,
    fused with the NVFP4 quantization of ``linear_fc2``'s input on the GPU): Megatron builds it
    only under ``use_te_activation_func``, which excludes its own bias-SwiGLU fusion."""
    if not getattr(args, "swiglu", False) or getattr(args, "use_te_activation_func", False):
        return
    if getattr(args, "bias_swiglu_fusion", False):
        logger.info("minite: SwiGLU runs in the minite activation module (fused with fc2's NVFP4 quantization); "
                    "Megatron's bias-SwiGLU fusion is turned off")
        args.bias_swiglu_fusion = False
    args.use_te_activation_func = True


# Megatron defaults that need an extension minite does not require: (dest, flag, available?).
_EXTENSION_DEFAULTS = (
    ("gradient_accumulation_fusion", "--no-gradient-accumulation-fusion", "apex's fused_weight_gradient_mlp_cuda"),
    ("apply_rope_fusion", "--no-rope-fusion", "Transformer Engine"),
    ("masked_softmax_fusion", "--no-masked-softmax-fusion", "Megatron's scaled_masked_softmax_cuda (apex-built)"),
)


def _fused_softmax_available() -> bool:
    try:
        import scaled_masked_softmax_cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _turn_off_missing_extensions(args: argparse.Namespace) -> None:
    available = {
        "gradient_accumulation_fusion": _apex_fused_wgrad_available,
        "apply_rope_fusion": _transformer_engine_available,
        "masked_softmax_fusion": _fused_softmax_available,
    }
    for dest, flag, needs in _EXTENSION_DEFAULTS:
        if getattr(args, dest, False) and not available[dest]():
            logger.info("minite: %s is not installed; turning off %s (same as %s)", needs, dest, flag)
            setattr(args, dest, False)


# ----------------------------------------------------------------------------------- specs
def _resolve_recipe(recipe: Any = None):
    from .recipe import Recipe, recipe_from_args

    if recipe is None:
        from megatron.training import get_args

        return recipe_from_args(get_args())
    if isinstance(recipe, dict):
        return Recipe.from_dict(recipe)
    return recipe


def minite_layer_spec(config: Any, vp_stage: int | None = None, *, recipe: Any = None, moe_grouped_gemm: bool = True):
    """The minite decoder-block spec for ``config`` (a ``TransformerConfig`` or a megatron.training
    ``GPTModelConfig``, whose ``.transformer`` is used): :func:`minite_megatron.specs.
    get_gpt_decoder_block_minite_spec` for this (virtual) pipeline stage.

    ``recipe``: a ``Recipe``, a dict of recipe fields, or None (built from Megatron's global args).
    ``moe_grouped_gemm=False``: Megatron's sequential experts of NVFP4 linears.
    """
    from .specs import get_gpt_decoder_block_minite_spec

    transformer_config = getattr(config, "transformer", config)
    return get_gpt_decoder_block_minite_spec(transformer_config, recipe=_resolve_recipe(recipe), vp_stage=vp_stage,
                                             moe_grouped_gemm=moe_grouped_gemm)


def finalize_gpt_model(model: Any, recipe: Any):
    """:func:`minite_megatron.model.finalize_gpt_model` (the recipe's LM head) on a built model."""
    from .model import finalize_gpt_model as finalize

    return finalize(model, _resolve_recipe(recipe))


def describe_minite_modules(model: Any) -> str:
    """One line counting the miniTE modules of a built model (logged by the launcher's hook)."""
    from collections import Counter

    counts = Counter()
    for module in model.modules():
        precision = getattr(module, "precision", None)
        if getattr(module, "minite_ctx", None) is not None or type(module).__module__.startswith("minite_megatron."):
            counts[f"{type(module).__name__}" + (f"[{precision}]" if precision else "")] += 1
    return ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no miniTE modules"


def _finalize_chunks(models: list, recipe: Any) -> list:
    models = [finalize_gpt_model(m, recipe) or m for m in models]
    logger.info("minite: model chunk(s) built with %s", "; ".join(describe_minite_modules(m) for m in models))
    return models


def apply_minite_to_model_config(model_config: Any, recipe: Any) -> Any:
    """Route a ``GPTModelConfig`` to the minite specs; returns it (modified in place).

    Sets ``transformer_layer_spec`` to ``minite_layer_spec`` bound to ``recipe`` and appends
    :func:`finalize_gpt_model` to ``pre_wrap_hooks``. Raises :class:`MiniteArgumentError` if the
    config already carries another layer spec (``--spec``) or its transformer config is not minite.
    """
    if getattr(model_config, "transformer_impl", None) != MINITE:
        raise MiniteArgumentError(
            f"model config has transformer_impl={getattr(model_config, 'transformer_impl', None)!r}; "
            "pass --transformer-impl minite"
        )
    if model_config.transformer_layer_spec is not None:
        raise MiniteArgumentError("--spec cannot be combined with --transformer-impl minite")
    model_config.transformer_layer_spec = functools.partial(minite_layer_spec, recipe=recipe)
    model_config.pre_wrap_hooks.append(functools.partial(_finalize_chunks, recipe=recipe))
    return model_config


# ----------------------------------------------------------------------------------- install
_installed: dict[tuple[Any, str], Any] = {}


def _wrap(module: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    if (module, name) in _installed:
        return
    original = getattr(module, name)
    wrapper = make(original)
    wrapper.__wrapped__ = original
    _installed[(module, name)] = original
    setattr(module, name, wrapper)


def install() -> None:
    """Hook ``--transformer-impl minite`` into ``megatron.training`` (idempotent; CPU and GPU).

    After this, any script that parses Megatron's arguments accepts ``--transformer-impl minite``
    and the ``--minite-*`` flags, validates them, and (through ``gpt_config_from_args``) builds the
    minite specs.
    """
    from megatron.training import argument_utils, arguments

    def add_megatron_arguments(original):
        @functools.wraps(original)
        def wrapper(parser):
            return add_minite_arguments(original(parser))

        return wrapper

    def validate_args(original):
        @functools.wraps(original)
        def wrapper(args, defaults={}):  # noqa: B006 - Megatron's signature
            check_minite_flags(args)
            result = original(args, defaults)  # fills derived sizes (ffn, kv_channels, ...)
            validate_minite_args(args)
            return result

        return wrapper

    def gpt_config_from_args(original):
        @functools.wraps(original)
        def wrapper(args, *a, **kw):
            model_config = original(args, *a, **kw)
            if getattr(args, "transformer_impl", None) == MINITE:
                from .recipe import recipe_from_args

                apply_minite_to_model_config(model_config, recipe_from_args(args))
            return model_config

        return wrapper

    _wrap(arguments, "add_megatron_arguments", add_megatron_arguments)
    _wrap(arguments, "validate_args", validate_args)
    _wrap(argument_utils, "gpt_config_from_args", gpt_config_from_args)


def uninstall() -> None:
    """Undo :func:`install` (for tests)."""
    for (module, name), original in list(_installed.items()):
        setattr(module, name, original)
    _installed.clear()
