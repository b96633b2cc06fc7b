"""miniTE's aligned scaling scheme: the recipe that replaces TE's ``NVFP4BlockScaling``.

The defaults are chosen for learner/rollout alignment (DESIGN.md section 2):

* forward activations: 1x16 blocks with a **per-token (per-row) global scale**: a token is
  quantized the same way whether it sits in a learner batch of whole sequences or in a
  sampler's one-token decode step (a per-tensor amax would depend on the batch);
* weights: 16x16 tiles with one global scale per tensor (per expert for grouped experts): the
  forward and backward see the same quantized weight, and those exact bytes are what the
  rollout engine receives (export, never re-quantize);
* backward ("full update"): dgrad and wgrad in NVFP4 too; gradients 1x16, stochastic rounding,
  a 16x16 random Hadamard transform on both wgrad operands;
* precision knobs: BF16 first/last layers, FP32 router, optional FP32 LM head;
* ``precision="bf16"``: the fair BF16 twin -- the same model, modules and kernels around the
  GEMMs, with every linear in BF16 (Megatron's GEMM; experts through ``torch._grouped_mm``),
  so NVFP4 is compared against the best BF16 this machine runs with everything else equal;
* ``strict``: batch-invariant kernels and ops end to end, so teacher-forced learner log-probs
  equal the sampler's bit for bit;
* default mode keeps the fast NVFP4 GEMM kernels but, with ``aligned_ops`` / ``aligned_attention``
  (on by default), computes the cheap reductions -- RMSNorm, MoE routing -- and the attention
  forward with strict mode's batch-invariant formulations, so that the sampler's decode steps
  compute them in the learner's order (issue 15: the learner/sampler gap of default mode).

Built from Python (``Recipe(...)``, ``Recipe.from_dict``) or from ``--minite-*`` command-line
flags (:func:`add_recipe_args`, :func:`recipe_from_args`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .nvfp4.backends import backend_names


class RecipeError(ValueError):
    """An invalid recipe; the message names the field (and its --minite-* flag)."""


def flag(name: str) -> str:
    return "--minite-" + name.replace("_", "-")


@dataclass(frozen=True)
class Recipe:
    # ---- forward: what the rollout engine reproduces ------------------------------------------
    activation_scale: Literal["row", "tensor"] = field(
        default="row", metadata={"help": "global scale of forward activations: per token (row) or per tensor"}
    )
    weight_tile: Literal["2d", "1d"] = field(
        default="2d", metadata={"help": "weight blocks: 16x16 tiles (2d, exact transpose) or 1x16 (1d)"}
    )
    # ---- backward -----------------------------------------------------------------------------
    full_update: bool = field(
        default=True, metadata={"help": "dgrad and wgrad in NVFP4 too (else BF16 backward through the quantized weight)"}
    )
    grad_scale: Literal["tensor", "row"] = field(
        default="tensor", metadata={"help": "global scale of gradients and wgrad operands"}
    )
    grad_stochastic_rounding: bool = field(
        default=True, metadata={"help": "stochastic rounding for gradients (dgrad and wgrad operands)"}
    )
    wgrad_rht: bool = field(
        default=True, metadata={"help": "16x16 random Hadamard transform on both wgrad operands"}
    )
    rht_seed: int = field(default=0, metadata={"help": "seed of the RHT sign vector (-1: fixed all-ones signs)"})
    # ---- precision knobs ----------------------------------------------------------------------
    precision: Literal["nvfp4", "bf16"] = field(
        default="nvfp4",
        metadata={"help": "nvfp4, or bf16: the fair BF16 twin (every linear in BF16, experts through torch._grouped_mm)"},
    )
    bf16_first_layers: int = field(default=0, metadata={"help": "keep the first N transformer layers in BF16"})
    bf16_last_layers: int = field(default=0, metadata={"help": "keep the last N transformer layers in BF16"})
    quantize_attention: bool = field(default=True, metadata={"help": "attention qkv/proj linears in NVFP4"})
    quantize_dense_mlp: bool = field(default=True, metadata={"help": "dense MLP fc1/fc2 in NVFP4"})
    quantize_experts: bool = field(default=True, metadata={"help": "routed experts in NVFP4"})
    quantize_shared_experts: bool = field(default=True, metadata={"help": "shared experts in NVFP4"})
    fp32_router: bool | None = field(default=None, metadata={"help": "FP32 router logits (default: on)"})
    fp32_lm_head: bool | None = field(default=None, metadata={"help": "FP32 LM head (default: on in strict mode)"})
    # ---- alignment ----------------------------------------------------------------------------
    strict: bool = field(
        default=False, metadata={"help": "batch-invariant kernels and ops: learner log-probs == sampler's, bitwise"}
    )
    aligned_ops: bool = field(
        default=True,
        metadata={"help": "default mode too: RMSNorm and MoE routing (FP32 gating, stable top-k, softmax) in strict "
                          "mode's batch-invariant formulation, so prefill and decode compute them in the same order"},
    )
    aligned_attention: bool = field(
        default=True,
        metadata={"help": "default mode too: the batch-invariant attention forward (strict mode's), so a query gets the "
                          "same bits in the learner's forward and in a decode step (else torch SDPA)"},
    )
    # ---- execution ----------------------------------------------------------------------------
    backend: str | None = field(default=None, metadata={"help": "NVFP4 backend (reference, triton, blackwell); default: best for the device"})
    seed: int = field(default=0, metadata={"help": "base seed of the stochastic-rounding streams"})
    nonfinite: Literal["propagate", "raise"] = field(
        default="propagate", metadata={"help": "non-finite activations/gradients: propagate NaN or raise"}
    )
    keep_weight_images: bool = field(default=False, metadata={"help": "weight caches keep BF16 images in training too (before issue 16)"})
    keep_weight_codes: bool = field(default=False, metadata={"help": "keep quantized weights after the backward (once per optimizer step)"})
    fused_moe_activation: bool = field(
        default=True,
        metadata={"help": "routed experts: SwiGLU times the routing probability in one kernel (NVFP4: also fc2's "
                          "input quantization), fused backward; off: Megatron's unfused ops (A/B runs)"},
    )

    def __post_init__(self):
        for f in fields(self):  # types first: "auto" fields are resolved from others below
            check_field_type(f.name, getattr(self, f.name))
        # resolve the "auto" fields
        if self.fp32_router is None:
            object.__setattr__(self, "fp32_router", True)
        if self.fp32_lm_head is None:
            object.__setattr__(self, "fp32_lm_head", self.strict)
        self.validate()

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`RecipeError` (naming the field and its flag) for a value of the wrong
        type (checked generically from the type hints: :func:`check_field_type`) or an invalid
        combination of settings."""
        for f in fields(self):
            check_field_type(f.name, getattr(self, f.name))
        for name in ("bf16_first_layers", "bf16_last_layers"):
            if getattr(self, name) < 0:
                raise RecipeError(f"recipe field {name} ({flag(name)}) must be >= 0")
        if not self.full_update:
            for name in ("grad_stochastic_rounding", "wgrad_rht"):
                if getattr(self, name):
                    raise RecipeError(
                        f"recipe field {name} ({flag(name)}) applies to the NVFP4 backward only; "
                        f"it needs full_update ({flag('full_update')}) or --no-minite-{name.replace('_', '-')}"
                    )
        if self.strict:
            if self.activation_scale != "row":
                raise RecipeError(
                    f"strict mode needs per-token activation scales ({flag('activation_scale')} row): "
                    "a per-tensor amax depends on which tokens share the batch"
                )
            if not self.fp32_router:
                raise RecipeError(f"strict mode needs the FP32 router ({flag('fp32_router')})")
            if not self.fp32_lm_head:
                raise RecipeError(f"strict mode needs the FP32 LM head ({flag('fp32_lm_head')})")
        if self.backend is not None and self.backend not in backend_names():
            raise RecipeError(
                f"recipe field backend ({flag('backend')}) must be one of {backend_names()}, got {self.backend!r}"
            )

    # ---- derived settings used by the modules -------------------------------------------------
    @property
    def quantized(self) -> bool:
        """Does this recipe run any linear in NVFP4 (False for the BF16 twin)?"""
        return self.precision == "nvfp4"

    @property
    def weight_tile_shape(self) -> tuple[int, int]:
        return (16, 16) if self.weight_tile == "2d" else (1, 16)

    @property
    def grad_rounding(self) -> str:
        return "stochastic" if self.grad_stochastic_rounding else "nearest"

    @property
    def wgrad_rht_seed(self) -> int | None:
        return self.rht_seed if self.wgrad_rht else None

    def layer_in_bf16(self, layer_number: int, num_layers: int) -> bool:
        """Is transformer layer ``layer_number`` (1-based, global) kept in BF16?"""
        return layer_number <= self.bf16_first_layers or layer_number > num_layers - self.bf16_last_layers

    # ---- (de)serialisation --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Recipe":
        check_fields(d)
        return cls(**d)

    def replace(self, **changes) -> "Recipe":
        return Recipe.from_dict({**self.to_dict(), **changes})


def _literal_choices(f: dataclasses.Field) -> tuple | None:
    hint = typing.get_type_hints(Recipe)[f.name]
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    return None


_JSON_NAMES = {bool: "a boolean (true/false)", int: "an integer", str: "a string", float: "a number"}


def _type_error(hint) -> str | None:
    """What a value of ``hint`` must be, in words, for an error message."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Literal:
        return f"one of {list(args)}"
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_type_error(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null (None)" if type(None) in args else "")
    return _JSON_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


def _matches(value: Any, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, hint)


def check_fields(d: Any) -> None:
    """Raise :class:`RecipeError` for anything but a mapping of known field names to values of
    the right types (:func:`check_field_type`)."""
    if not isinstance(d, dict):
        raise RecipeError(f"a recipe is a mapping of field names to values, got {type(d).__name__}")
    known = [f.name for f in fields(Recipe)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise RecipeError(f"unknown recipe field(s) {unknown}; known fields: {sorted(known)}")
    for name, value in d.items():
        check_field_type(name, value)


def check_field_type(name: str, value: Any) -> None:
    """Raise :class:`RecipeError` unless ``value`` has the type of field ``name``'s hint.

    Generic over the dataclass hints, so new fields are covered: ``bool`` accepts only
    ``True``/``False`` (JSON booleans; not ``"false"``, ``0`` or ``1``), ``int`` only integers
    (not booleans, floats or strings), ``None`` only where the hint is Optional, a ``Literal``
    only its choices (of the same type).
    """
    hint = typing.get_type_hints(Recipe)[name]
    if not _matches(value, hint):
        raise RecipeError(
            f"recipe field {name} ({flag(name)}) must be {_type_error(hint)}, got {value!r} ({type(value).__name__})"
        )


# ---- command line ---------------------------------------------------------------------------------
def add_recipe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--minite-*`` flags (one per recipe field, plus ``--minite-recipe FILE.json``).

    Usable as (part of) a Megatron ``extra_args_provider``. Every flag defaults to None so that
    only what the user sets overrides the recipe file and the dataclass defaults.
    """
    group = parser.add_argument_group("miniTE NVFP4 recipe")
    group.add_argument("--minite-recipe", type=str, default=None, help="JSON file with recipe fields (flags override it)")
    hints = typing.get_type_hints(Recipe)
    for f in fields(Recipe):
        hint = hints[f.name]
        kwargs: dict[str, Any] = {"default": None, "dest": f"minite_{f.name}", "help": f.metadata.get("help", "")}
        choices = _literal_choices(f)
        base = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        if choices:
            kwargs["choices"] = choices
        elif bool in base:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif int in base:
            kwargs["type"] = int
        else:
            kwargs["type"] = str
        group.add_argument(flag(f.name), **kwargs)
    return parser


def recipe_from_args(args: argparse.Namespace) -> Recipe:
    """Build the recipe from parsed ``--minite-*`` flags (and ``--minite-recipe``)."""
    values: dict[str, Any] = {}
    path = getattr(args, "minite_recipe", None)
    if path:
        values.update(read_recipe_file(path))
        try:
            check_fields(values)
        except RecipeError as e:
            raise RecipeError(f"--minite-recipe {path}: {e}") from None
    for f in fields(Recipe):
        v = getattr(args, f"minite_{f.name}", None)
        if v is not None:
            values[f.name] = v
    return Recipe.from_dict(values)


def read_recipe_file(path: str) -> dict[str, Any]:
    """The fields of a ``--minite-recipe`` JSON file; :class:`RecipeError` (one line naming the
    file) if it is missing, unreadable, empty, not JSON or not a JSON object."""
    where = f"--minite-recipe {path}"
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError as e:
        raise RecipeError(f"{where}: cannot read the recipe file ({e.strerror or e})") from None
    if not text.strip():
        raise RecipeError(f"{where}: the recipe file is empty (expected a JSON object of recipe fields)")
    try:
        values = json.loads(text)
    except json.JSONDecodeError as e:
        raise RecipeError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(values, dict):
        raise RecipeError(f"{where}: expected a JSON object of recipe fields, got a JSON {type(values).__name__}")
    return values
