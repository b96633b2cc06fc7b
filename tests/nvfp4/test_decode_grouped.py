"""The MoE decode GEMM's contract (``nvfp4.grouped.decode_grouped_gemm_reference``) and
``stack_expert_weights``: every row equals the dense contract GEMM of that row with its
expert's weights, bit for bit, for any routing (unsorted rows, repeated experts, experts
chosen by no row, R = 0 and 1), and bad operands fail with one clear line."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.grouped import decode_grouped_gemm_reference, stack_expert_weights
from minite_megatron.testing import assert_bitwise_equal

E, N, K = 5, 32, 64


def _experts(seed=0, e=E, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g) * torch.logspace(-2, 2, e).view(e, 1, 1)
    return w, [nvfp4.quantize_reference(w[i], global_scale="tensor", tile=(16, 16)) for i in range(e)]


def _rows(r, seed=1, k=K):
    g = torch.Generator().manual_seed(seed)
    return nvfp4.quantize_reference(torch.randn(r, k, generator=g) * 3, global_scale="row")


def _row(a, r):
    from minite_megatron.nvfp4.grouped import _take_rows

    return _take_rows(a, torch.tensor([r]))


def test_stack_keeps_each_experts_bytes_and_scale():
    w, qs = _experts()
    st = stack_expert_weights(qs)
    assert tuple(st.shape) == (E, N, K) and st.global_scale == "group" and st.tile == (16, 16)
    for i, q in enumerate(qs):
        assert_bitwise_equal(st.group(i).codes, q.codes, f"codes {i}")
        assert_bitwise_equal(st.group(i).linear_scales(), q.linear_scales(), f"scales {i}")
        assert_bitwise_equal(st.group(i).global_decode, q.global_decode, f"scale {i}")
    # the [E*N, K] matrix view has each expert's scale repeated over its rows
    assert_bitwise_equal(st.matrix().global_decode, torch.cat([q.global_decode.expand(N) for q in qs]), "rows")
    # the learner's "group" quantization of the same [E, N, K] weights is the same tensor
    grp = nvfp4.quantize_reference(w, global_scale="group", tile=(16, 16))
    assert_bitwise_equal(grp.codes, st.codes, "group codes")
    assert_bitwise_equal(grp.global_decode, st.global_decode, "group scales")


@pytest.mark.parametrize("ids", [[3, 3, 0, 4, 3, 1, 0], [2], [4, 4, 4, 4], []])
def test_each_row_is_the_dense_gemm_with_its_expert(ids):
    _, qs = _experts()
    st = stack_expert_weights(qs)
    a = _rows(len(ids))
    expert_ids = torch.tensor(ids, dtype=torch.int32)
    out = decode_grouped_gemm_reference(a, st, expert_ids)
    assert out.shape == (len(ids), N) and out.dtype == torch.bfloat16
    for r, e in enumerate(ids):
        assert_bitwise_equal(out[r : r + 1], nvfp4.gemm_reference(_row(a, r), qs[e]), f"row {r} expert {e}")
    # the [E*N, K] matrix form with num_experts, the learner's "group" form and fp32 output agree
    assert_bitwise_equal(decode_grouped_gemm_reference(a, st.matrix(), expert_ids, num_experts=E), out, "2d")
    out32 = decode_grouped_gemm_reference(a, st, expert_ids.long(), torch.float32)
    assert_bitwise_equal(out32.to(torch.bfloat16), out, "fp32 then bf16 is one rounding of the same sum")


def test_reference_and_dispatcher_agree():
    _, qs = _experts(seed=3)
    a = _rows(6, seed=4)
    ids = torch.tensor([1, 0, 1, 4, 2, 2], dtype=torch.int32)
    st = stack_expert_weights(qs)
    assert_bitwise_equal(nvfp4.decode_grouped_gemm(a, st, ids, backend="reference", batch_invariant=True),
                         decode_grouped_gemm_reference(a, st, ids), "dispatch")


def test_nonfinite_weights_propagate_to_their_experts_rows_only():
    w, _ = _experts(seed=5)
    w[2, 3, 7] = float("nan")
    qs = [nvfp4.quantize_reference(w[i], global_scale="tensor", tile=(16, 16)) for i in range(E)]
    a = _rows(3, seed=6)
    out = decode_grouped_gemm_reference(a, stack_expert_weights(qs), torch.tensor([2, 1, 2]))
    assert torch.isnan(out[0]).any() and torch.isnan(out[2]).any() and not torch.isnan(out[1]).any()


def test_bad_operands_fail_with_one_clear_line():
    _, qs = _experts()
    st = stack_expert_weights(qs)
    a = _rows(2)
    with pytest.raises(ValueError, match=r"expert_ids\[1\] = 5 is outside \[0, 5\)"):
        decode_grouped_gemm_reference(a, st, torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="expert_ids must be a 1-D tensor of 2"):
        decode_grouped_gemm_reference(a, st, torch.tensor([0]))
    with pytest.raises(TypeError, match="int32 or int64"):
        decode_grouped_gemm_reference(a, st, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="need num_experts"):
        decode_grouped_gemm_reference(a, st.matrix(), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"a must be \[R, K=64\]"):
        decode_grouped_gemm_reference(_rows(2, k=32), st, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="every expert must be"):
        stack_expert_weights([qs[0], nvfp4.quantize_reference(torch.randn(16, K), global_scale="tensor")])
    with pytest.raises(ValueError, match="one tensor scale"):
        stack_expert_weights([nvfp4.quantize_reference(torch.randn(N, K), global_scale="row")])
    with pytest.raises(ValueError, match="no expert weights"):
        stack_expert_weights([])
