"""The batch-invariant ops through the Backend (issue 25: ``invariant/backend.py`` was a third way to
a kernel -- a name string, an environment variable, a process-wide override).

Pins: ``bi_matmul``, ``bi_rmsnorm``, ``bi_rmsnorm_backward``, ``bi_log_softmax`` and ``bi_attention``
are ``Backend`` ops with ``supports``; a backend without them says why and refuses; the Triton
backend's methods are its ``bi_*`` kernels bit for bit; ``invariant_backend`` is the device's
default backend unless ``MINITE_STRICT_BACKEND`` names one; the strict functions run the chosen
backend's kernel (the same bits as calling the kernel) and the torch formulation where
``supports`` says no (the one-pass RMSNorm backward beyond its widest row).
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron.nvfp4.backends import (INVARIANT_OPS, OpNotSupported, ReferenceBackend, get_backend,
                                            invariant_backend)
from minite_megatron.settings import overridden
from minite_megatron.testing import assert_bitwise_equal

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def test_a_backend_without_the_kernels_says_why_and_refuses():
    ref = ReferenceBackend()
    for op in INVARIANT_OPS:
        assert "torch formulation" in ref.supports(op)
    with pytest.raises(OpNotSupported, match="reference does not support bi_matmul: .*torch formulation"):
        ref.bi_matmul(torch.zeros(1, 16), torch.zeros(2, 16), None, torch.float32)


def test_the_triton_backend_runs_them_with_its_limits():
    triton = get_backend("triton", DEV)
    assert all(triton.supports(op) is None for op in INVARIANT_OPS)
    assert triton.supports("bi_rmsnorm_backward", width=4096) is None
    assert "at most 4096, got 4097" in triton.supports("bi_rmsnorm_backward", width=4097)
    x, w = _rand(3, 4097), _rand(4097, seed=1)
    with pytest.raises(OpNotSupported, match="triton does not support bi_rmsnorm_backward: .*4097"):
        triton.bi_rmsnorm_backward(x, x, w, 1e-5, False)


def test_invariant_backend_is_the_devices_unless_named():
    assert invariant_backend(DEV).name == ("triton" if DEV == "cuda" else "reference")
    with overridden(strict_backend="triton"):
        assert invariant_backend(DEV) is get_backend("triton", DEV)
    with overridden(strict_backend="reference"):
        assert invariant_backend(DEV).name == "reference"


def test_the_strict_ops_run_the_chosen_backends_kernels_bit_for_bit():
    """What ``invariant/backend.py``'s ``kernel(name)`` called, now the backend's methods: the same bits."""
    from minite_kernels.triton.invariant.bi_attention import bi_attention
    from minite_kernels.triton.invariant.bi_log_softmax import bi_log_softmax
    from minite_kernels.triton.invariant.bi_matmul import bi_matmul
    from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm

    from minite_megatron.invariant.attention import attention
    from minite_megatron.invariant.matmul import linear
    from minite_megatron.invariant.rmsnorm import rms_norm
    from minite_megatron.invariant.softmax import log_softmax

    x, w, b = _rand(5, 32), _rand(24, 32, seed=2), _rand(24, seed=3)
    q, k, v = _rand(1, 2, 6, 16, seed=4), _rand(1, 1, 6, 16, seed=5), _rand(1, 1, 6, 16, seed=6)
    with overridden(strict_backend="triton"):
        assert_bitwise_equal(linear(x, w, b), bi_matmul(x, w, b, x.dtype), "bi_matmul")
        assert_bitwise_equal(rms_norm(x, w[0], 1e-6), bi_rmsnorm(x, w[0], 1e-6, False), "bi_rmsnorm")
        assert_bitwise_equal(log_softmax(x), bi_log_softmax(x), "bi_log_softmax")
        assert_bitwise_equal(attention(q, k, v), bi_attention(q, k, v, None, 0.25, True).to(q.dtype), "bi_attention")


def test_the_torch_formulation_runs_where_supports_says_no():
    """Rows wider than the one-pass backward's ``MAX_H``: the torch backward, bitwise."""
    from minite_megatron.invariant.rmsnorm import rms_norm_backward, rms_norm_backward_torch

    x, g, w = _rand(2, 4100).float(), _rand(2, 4100, seed=1).float(), _rand(4100, seed=2).float()
    with overridden(strict_backend="triton"):
        got = rms_norm_backward(g, x, w, 1e-5, False)
    want = rms_norm_backward_torch(g, x, w, 1e-5, False)
    assert_bitwise_equal(got[0], want[0], "dx")
    assert_bitwise_equal(got[1], want[1], "dw")
