"""Run-time fixes for running ``megatron.training`` from the megatron-core *wheel* (0.19.2).

The wheel ships ``megatron/training`` but not everything a Megatron-LM checkout has. What breaks,
and what :func:`apply` does about it (CPU and GPU alike; idempotent):

* ``initialize._compile_dependencies`` runs ``make -C megatron/core/datasets`` on rank 0 to build
  the dataset index helpers; the wheel has no Makefile there (``make`` fails and Megatron calls
  ``sys.exit(1)``) but already ships the compiled ``helpers_cpp`` extension. ``apply`` replaces
  ``megatron.core.datasets.utils.compile_helpers`` by a version that returns when ``helpers_cpp``
  imports and otherwise runs the original (so a source checkout still compiles).
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

_original = None


def _compile_helpers_if_missing() -> None:
    """Megatron's ``compile_helpers``, skipped when the prebuilt ``helpers_cpp`` imports."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError:
        pass
    _original()


def apply() -> None:
    """Install the fixes listed in the module docstring (idempotent)."""
    global _original
    from megatron.core.datasets import utils

    if _original is None:
        _original = utils.compile_helpers
        utils.compile_helpers = _compile_helpers_if_missing


def revert() -> None:
    """Undo :func:`apply` (for tests)."""
    global _original
    from megatron.core.datasets import utils

    if _original is not None:
        utils.compile_helpers = _original
        _original = None
