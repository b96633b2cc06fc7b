"""Position-invariant activations for strict mode.

On CPU, ``torch.nn.functional.silu`` and ``torch.sigmoid`` compute an element differently when
it falls in a vectorized block than in the scalar tail of a loop (measured on this project's
AVX2 machines: ~28% of elements of a 100k tensor change bits when the same values are split into
calls of 7 elements), so a token's MLP output would depend on how many tokens share the call.
:func:`silu` is built from ``exp`` and correctly rounded IEEE operations instead, in fp32, with
one rounding to the input dtype. Use it as ``TransformerConfig.activation_func`` (with
``bias_activation_fusion=False``) in strict mode; :func:`minite_megatron.strict_config.strict_config_errors`
checks it.
"""

from __future__ import annotations

import torch


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` = ``x / (1 + exp(-x))`` computed in fp32, returned in ``x.dtype``.

    Differentiable. Non-finite values behave like torch's ``silu``: ``+inf -> +inf``,
    ``-inf -> NaN``, NaN -> NaN. Raises TypeError for a
    non-floating ``x``.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"silu needs a floating tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    return (xf / (1.0 + torch.exp(-xf))).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """Tanh-approximated GELU in fp32 from ``tanh`` and IEEE operations, returned in ``x.dtype``."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"gelu_tanh needs a floating tensor, got {x.dtype}")
    xf = x.to(torch.float32)
    inner = 0.7978845608028654 * (xf + 0.044715 * (xf * xf * xf))
    return (0.5 * xf * (1.0 + torch.tanh(inner))).to(x.dtype)
