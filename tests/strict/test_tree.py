"""The aligned pairwise tree sum: fixed order, zero-padding invariance, chunking."""

import pytest
import torch

from minite_megatron.nvfp4.tree import tree_sum, tree_sum_chunked, tree_sum_raw
from minite_megatron.testing import assert_bitwise_equal


def _reference_tree(values: list[float]) -> torch.Tensor:
    """The tree written out with Python floats rounded to fp32 after every addition."""
    level = [torch.tensor(v, dtype=torch.float32) for v in values]
    while len(level) > 1:
        if len(level) % 2:
            level.append(torch.tensor(0.0))
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0] + 0.0


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 64, 100])
def test_matches_the_written_out_tree(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n)
    assert_bitwise_equal(tree_sum(x), _reference_tree(x.tolist()))


def test_order_is_fixed_and_not_sequential():
    """Pins the order: (1 + 1e8) + (-1e8 + 1) in fp32 is 0 + 0 ... per pair, unlike a left fold."""
    x = torch.tensor([1.0, 1e8, -1e8, 1.0])
    pairwise = (torch.tensor(1.0) + 1e8) + (torch.tensor(-1e8) + 1.0)
    sequential = ((torch.tensor(1.0) + 1e8) + -1e8) + 1.0
    assert tree_sum(x).item() == pairwise.item()
    assert pairwise.item() != sequential.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_trailing_zeros_do_not_change_any_bit(dtype):
    """The property prefill == decode rests on: keys padded with +0.0 to any length."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 37, generator=g) * 100).to(dtype)
    ref = tree_sum(x, dim=1)
    for extra in [1, 2, 27, 91, 219]:
        padded = torch.cat([x, torch.zeros(7, extra, dtype=dtype)], dim=1)
        assert_bitwise_equal(tree_sum(padded, dim=1), ref, f"pad {extra}")


def test_negative_zero_is_normalized():
    assert torch.signbit(tree_sum(torch.tensor([-0.0]))).item() is False
    assert torch.signbit(tree_sum(torch.tensor([-0.0, -0.0, -0.0]))).item() is False
    assert tree_sum(torch.zeros(0)).item() == 0.0


def test_rows_are_independent_of_the_batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, 333, generator=g)
    full = tree_sum(x, dim=-1)
    for rows in [slice(0, 1), slice(3, 4), slice(10, 47)]:
        assert_bitwise_equal(tree_sum(x[rows], dim=-1), full[rows])


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dimension_and_keepdim(dim):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 6, 7, generator=g, dtype=torch.float64)
    out = tree_sum(x, dim=dim, keepdim=True)
    torch.testing.assert_close(out, x.sum(dim=dim, keepdim=True), rtol=1e-12, atol=1e-12)
    assert_bitwise_equal(out.squeeze(dim), tree_sum(x, dim=dim))


@pytest.mark.parametrize("n,chunk", [(1, 4), (100, 8), (100, 32), (129, 64), (64, 64)])
def test_chunked_equals_unchunked(n, chunk):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, generator=g) * 1e3
    got = tree_sum_chunked(lambda a, b: x[:, a:b], n, chunk, dim=1)
    assert_bitwise_equal(got, tree_sum(x, dim=1))


def test_nonfinite_propagates_and_bad_input_raises():
    assert torch.isnan(tree_sum(torch.tensor([1.0, float("nan"), 2.0]))).item()
    assert tree_sum(torch.tensor([1.0, float("inf")])).item() == float("inf")
    with pytest.raises(TypeError):
        tree_sum(torch.arange(4))
    with pytest.raises(ValueError):
        tree_sum_chunked(lambda a, b: torch.ones(b - a), 10, 3)
    assert tree_sum_raw(torch.tensor([-0.0])).item() == 0.0
