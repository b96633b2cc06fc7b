"""``fast_jit``: ``triton.jit`` itself, for the kernels of :mod:`minite_kernels.triton.invariant` that
still import this name (the launch-table path it used to switch on changed nothing on the H100 and
was deleted). Kernels use ``@triton.jit``; this module goes once ``kernels/triton/invariant`` does too.
"""

from __future__ import annotations

import triton

fast_jit = triton.jit
