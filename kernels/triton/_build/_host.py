"""Host-side integer helpers for the launchers (grids, block sizes), as plain Python.

Triton 3.6 makes ``triton.cdiv`` and ``triton.next_power_of_2`` ``constexpr_function`` objects, so a
call from host code goes through ``ConstexprFunction.__call__`` (argument unwrapping, ~3-5 us each);
a learner step of the qwen3-moe preset made ~690 such calls (H200 host profile, 2026-12-01). These
compute the same values (``tests/kernels/triton/_build/test_host_helpers.py``). Inside ``@triton.jit`` code
keep ``tl.cdiv`` / ``triton.next_power_of_2``.
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints, ``triton.cdiv``'s ``(x + y - 1) // y``."""
    return (x + y - 1) // y


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for ``n <= 0``), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
