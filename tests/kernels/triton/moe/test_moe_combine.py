"""The one-pass deterministic MoE combine (``minite_kernels.triton.moe.moe_combine``) against its torch
reference (``deterministic_moe.deterministic_unpermute_reference`` / ``ordered_sum_reference``), bitwise:
forward and gradients, on order-sensitive data (rows of very different magnitudes, so any other
order of the adds gives other bits), signed zeros, infinities, NaN, tokens with no row or fewer
rows, several column blocks and a masked column tail. On a CPU the kernels run under the Triton
interpreter (the bf16 rounding written out on the bits); the ``gpu`` test runs them at model size.
"""

import pytest
import torch

from minite_megatron.testing import assert_bitwise_equal

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _routing(tokens, experts, k, seed, drop=()):
    g = torch.Generator().manual_seed(seed)
    routing = torch.zeros(tokens, experts, dtype=torch.bool)
    for t in range(tokens):
        routing[t, torch.randperm(experts, generator=g)[:k]] = True
    for t, keep in drop:  # token t keeps only `keep` of its experts (0: routed nowhere)
        routing[t, routing[t].nonzero()[keep:, 0]] = False
    return routing


def _sorted_indices(routing):
    """Megatron's permutation: expert-major, tokens ascending within an expert."""
    from megatron.core.transformer.moe.moe_utils import permute

    tokens = routing.shape[0]
    _, _, idx, _, _ = permute(torch.zeros(tokens, 1), routing, num_out_tokens=int(routing.sum()))
    return idx


def _order_sensitive(rows, hidden, dtype, seed):
    """Rows whose sum depends on the order of the adds; with -0.0, +-inf and a NaN."""
    g = torch.Generator().manual_seed(seed)
    mag = 2.0 ** torch.randint(-12, 12, (rows, 1), generator=g).float()
    x = torch.randn(rows, hidden, generator=g) * mag
    x[0, :3] = -0.0
    x[1, 0], x[2, 1], x[3, 2] = float("inf"), float("-inf"), float("nan")
    return x.to(dtype)


def _grads(fn, x, g):
    x = x.detach().clone().requires_grad_(True)
    out = fn(x)
    out.backward(g)
    return out.detach(), x.grad


@pytest.fixture
def small_blocks(monkeypatch):
    """Column blocks of 16 so a 40-wide row takes three programs, the last one masked."""
    from minite_kernels.triton.moe import moe_combine

    monkeypatch.setattr(moe_combine, "MAX_BLOCK_H", 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpermute_kernel_bitwise_equals_the_reference(dtype, small_blocks):
    from minite_kernels.triton.moe.moe_combine import deterministic_unpermute
    from minite_megatron.modules.deterministic_moe import deterministic_unpermute_reference

    tokens, hidden = 24, 40
    routing = _routing(tokens, 8, 3, seed=1, drop=[(4, 0), (9, 1), (17, 2)])
    idx = _sorted_indices(routing)
    x = _order_sensitive(idx.numel(), hidden, dtype, seed=2)
    g = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    g[5, :4] = -0.0
    ref, ref_grad = _grads(lambda v: deterministic_unpermute_reference(v, idx, tokens), x, g)
    got, got_grad = _grads(lambda v: deterministic_unpermute(v, idx.to(DEV), tokens), x.to(DEV), g.to(DEV))
    assert_bitwise_equal(got, ref, "combine", nan_equal=True)
    assert_bitwise_equal(got_grad, ref_grad, "grad")
    assert bool((got[4] == 0).all()) and not bool(torch.signbit(got[4]).any())
    # the data is order sensitive: the same rows added in decreasing position give other bits
    rev = deterministic_unpermute_reference(x.flip(0), idx.flip(0), tokens)
    assert not torch.equal(rev.nan_to_num(0.0).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           ref.nan_to_num(0.0).view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("k", [1, 3])
def test_ordered_sum_kernel_bitwise_equals_the_reference(k, small_blocks):
    from minite_kernels.triton.moe.moe_combine import ordered_sum
    from minite_megatron.modules.deterministic_moe import ordered_sum_reference

    tokens, hidden = 7, 40
    base = _order_sensitive(tokens * k, hidden, torch.bfloat16, seed=4).view(k, tokens, hidden)
    rows = base.transpose(0, 1)  # [T, k, H], not contiguous
    g = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    g[1, :5] = -0.0
    ref, ref_grad = _grads(ordered_sum_reference, rows, g)
    got, got_grad = _grads(ordered_sum, rows.to(DEV), g.to(DEV))
    assert_bitwise_equal(got, ref, "ordered_sum", nan_equal=True)
    assert_bitwise_equal(got_grad, ref_grad, "grad")


def test_combine_kernel_refuses_bad_input():
    from minite_kernels.triton.moe.moe_combine import deterministic_unpermute, ordered_sum

    x, idx = torch.randn(6, 8, device=DEV), torch.tensor([0, 1, 2, 0, 1, 2], device=DEV)
    with pytest.raises(ValueError, match="permuted"):
        deterministic_unpermute(x, idx[:5], 3)
    with pytest.raises(TypeError, match="float64"):
        deterministic_unpermute(x.double(), idx, 3)
    with pytest.raises(ValueError, match="rows must be"):
        ordered_sum(x)
    assert deterministic_unpermute(x[:0], idx[:0], 3).shape == (3, 8)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="outside"):
            deterministic_unpermute(x, idx + 1, 3)


@pytest.mark.gpu
def test_gpu_combine_kernel_at_model_size():
    """qwen3-moe's combine (4096 tokens, 128 experts, top-8, hidden 2048): the kernel's forward and
    gradient equal the torch reference's on the CPU and on the GPU, bit for bit."""
    from minite_kernels.triton.moe.moe_combine import deterministic_unpermute, ordered_sum
    from minite_megatron.modules.deterministic_moe import deterministic_unpermute_reference, ordered_sum_reference

    tokens, hidden = 4096, 2048
    routing = _routing(tokens, 128, 8, seed=6, drop=[(11, 0), (12, 5)])
    idx = _sorted_indices(routing)
    x = _order_sensitive(idx.numel(), hidden, torch.bfloat16, seed=7)
    g = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    ref, ref_grad = _grads(lambda v: deterministic_unpermute_reference(v, idx, tokens), x, g)
    got, got_grad = _grads(lambda v: deterministic_unpermute(v, idx.cuda(), tokens), x.cuda(), g.cuda())
    assert_bitwise_equal(got, ref, "combine vs CPU reference", nan_equal=True)
    assert_bitwise_equal(got_grad, ref_grad, "grad vs CPU reference")
    gpu_ref = deterministic_unpermute_reference(x.cuda(), idx.cuda(), tokens)
    assert_bitwise_equal(got, gpu_ref, "combine vs GPU reference", nan_equal=True)
    rows = x[: 64 * 8].view(64, 8, hidden).cuda()
    assert_bitwise_equal(ordered_sum(rows), ordered_sum_reference(rows), "ordered_sum", nan_equal=True)
