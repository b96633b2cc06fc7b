"""The launchers' host helpers (:mod:`minite_kernels.triton._build._host`) equal Triton's own, value for value."""

import triton

from minite_kernels.triton._build._host import cdiv, next_pow2


def test_cdiv_and_next_pow2_equal_tritons():
    values = list(range(-40, 300)) + [2**k + d for k in range(9, 40) for d in (-1, 0, 1)]
    for n in values:
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 2, 3, 16, 64, 128, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
