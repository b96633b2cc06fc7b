"""Module names in errors: a non-finite activation under ``nonfinite="raise"`` names the layer.

:func:`finalize_gpt_model` (``minite_megatron.model``) calls :func:`name_modules`, which gives
every miniTE module of a built model its qualified name with the *global* layer number (under
pipeline parallelism a chunk's ``decoder.layers.0`` may be global layer 3), e.g.
``decoder.layers.3.self_attention.linear_qkv``. Forward methods decorated with
:func:`names_nonfinite` re-raise a :class:`~minite_megatron.nvfp4.NonFiniteError` with that name
and the module's class in front, once (the innermost miniTE module names itself).
"""

from __future__ import annotations

import functools
import re

import torch

from ..nvfp4 import NonFiniteError

_LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


def module_name(module: torch.nn.Module) -> str:
    name = getattr(module, "minite_name", None)
    kind = type(module).__name__
    return f"{name} ({kind})" if name else f"a {kind} (unnamed: build the model through finalize_gpt_model)"


def name_modules(model: torch.nn.Module) -> None:
    """Set ``minite_name`` on every miniTE module of ``model`` (global layer numbers)."""
    layers = {}
    for name, module in model.named_modules():
        number = getattr(module, "layer_number", None)
        if re.fullmatch(r"(.*\.)?layers\.\d+", name) and isinstance(number, int):
            layers[name] = number - 1  # Megatron's layer_number is global and 1-based
    for name, module in model.named_modules():
        if not type(module).__module__.startswith("minite_megatron."):
            continue
        m = _LAYER.search(name)
        if m:
            local = name[: m.end() - 1]
            if local in layers:
                name = f"{name[: m.start(2)]}{layers[local]}{name[m.end(2):]}"
        module.minite_name = name


def names_nonfinite(forward):
    """Decorate a module method: a NonFiniteError raised inside gets the module's name."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        try:
            return forward(self, *args, **kwargs)
        except NonFiniteError as e:
            if getattr(e, "minite_module", None) is not None:
                raise
            named = NonFiniteError(f"{module_name(self)}: {e}")
            named.minite_module = getattr(self, "minite_name", type(self).__name__)
            raise named from None

    return wrapper
