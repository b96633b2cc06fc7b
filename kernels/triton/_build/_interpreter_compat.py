"""Compatibility fix for the Triton 3.6 interpreter under NumPy >= 2.5.

The interpreter wraps every scalar kernel argument in a one-element 1-D array and converts it
with ``int(array)`` when kernel code calls ``range(0, K, BLOCK)`` (``tensor.__index__``).
NumPy 2.5 removed ``int()`` of 1-D arrays ("only 0-dimensional arrays can be converted to
Python scalars"), so any loop bounded by a runtime argument fails under ``TRITON_INTERPRET=1``.
:func:`install` wraps the interpreter's tensor patching so ``__index__`` takes the single
element instead. It changes nothing when the interpreter is not used, and nothing on a GPU.
"""

from __future__ import annotations

_INSTALLED = False


def install() -> None:
    """Idempotently patch ``triton.runtime.interpreter`` (a no-op if already compatible)."""
    global _INSTALLED
    if _INSTALLED:
        return
    import numpy as np
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def _index(self):
        return int(np.asarray(self.handle.data).reshape(-1)[0])

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)

    interp._patch_lang_tensor = _patch_lang_tensor
    _INSTALLED = True
