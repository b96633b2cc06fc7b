"""Group sizes left on the device (:class:`DeviceGroupSizes`): the grouped linears compute the
bits of the host-sized path without the counts ever reaching the host.

Regression (issue 16 item 3; H200, qwen3-moe at 16384 tokens: the NVFP4 step 127.1 ms of wall time
for 122.1 ms of GPU time): every MoE layer made the host wait for its token counts (Megatron's
dispatcher, for ``TEGroupedMLP.forward``'s host list and the wgrad operands' exact padded width),
so the host could never run more than one layer ahead. With device counts the offsets are summed
on the device and the wgrad operands are ``ceil16(T + 15 G)`` columns wide: the extra columns are
zeros, which change no amax, no code and no wgrad sum -- these tests pin that, bit for bit.
"""

import pytest
import torch

from minite_megatron.nvfp4.group_sizes import DeviceGroupSizes, GroupSizes
from minite_megatron.ops.grouped_linear import bf16_grouped_linear, nvfp4_grouped_linear
from minite_megatron.ops.linear import LinearContext
from minite_megatron.ops.weight_cache import QuantizedWeightCache
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

SIZES = [
    [5, 0, 16, 33, 0, 1],  # empty groups inside, a multiple of 16, one of size 1
    [0, 0, 7],
    [7, 0, 0],
    [16, 32],  # nothing to pad
    [23],
    [0],
]


def _device(sizes):
    return DeviceGroupSizes(torch.tensor(sizes, dtype=torch.int64), sum(sizes))


@pytest.mark.parametrize("sizes", SIZES)
def test_index_tensors_are_the_host_ones_on_the_bound_width(sizes):
    host, dev = GroupSizes(sizes), _device(sizes)
    t, g = sum(sizes), len(sizes)
    assert len(dev) == g and dev.total == t and dev.width == -(-(t + 15 * g) // 16) * 16
    assert dev.offsets("cpu").dtype == torch.int32 and dev.offsets("cpu").tolist() == host.offsets("cpu").tolist()
    assert dev.padded_offsets("cpu").tolist() == host.padded_offsets("cpu").tolist()
    padded = dev.padded()
    assert padded is dev.padded() and padded.padded() is padded and padded.total == dev.width
    assert padded.offsets("cpu") is dev.padded_offsets("cpu")  # made once, shared
    exact = host.padded().total
    col = dev.column_index("cpu")
    assert col.dtype == torch.int32 and col.shape == (dev.width,)
    assert col[:exact].tolist() == host.column_index("cpu").tolist() and bool((col[exact:] == -1).all())
    assert dev.tolist() == list(sizes) and padded.tolist() == list(host.padded())
    assert GroupSizes.of(dev) is dev


def test_no_host_iteration_and_bad_counts_are_refused():
    dev = _device([3, 4])
    with pytest.raises(TypeError, match="tolist"):
        list(dev)
    with pytest.raises(RuntimeError, match="sum to 8 rows"):
        DeviceGroupSizes(torch.tensor([3, 4]), 8)
    with pytest.raises(RuntimeError, match=">= 0"):
        DeviceGroupSizes(torch.tensor([9, -2]), 7)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        DeviceGroupSizes(torch.tensor([3.0, 4.0]), 7)
    with pytest.raises(ValueError, match="1-D integer tensor"):
        DeviceGroupSizes(torch.tensor([[3, 4]]), 7)


#: routed rows per expert (4 experts): an expert with no rows, one with nearly all, counts that are not
#: multiples of 16; all multiples of 16 (the host path's copy-free quantization, no gather); one expert
#: with every row
HARD = [[0, 21, 3, 9], [16, 0, 16, 0], [0, 29, 0, 0]]


HIDDEN = 16


def _experts(seed, groups=4, hidden=HIDDEN, ffn=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(groups, 2 * ffn, hidden, generator=g).to(dtype)
    w2 = torch.randn(groups, hidden, ffn, generator=g).to(dtype)
    return [torch.nn.Parameter(w) for w in w1], [torch.nn.Parameter(w) for w in w2]


def _fc1_fc2(linear, x, sizes, w1, w2):
    """fc1 -> SwiGLU -> fc2, one sizes object for both (as the grouped MLP passes it)."""
    a, b = linear(x, sizes, w1).chunk(2, dim=-1)
    return linear(torch.nn.functional.silu(a) * b, sizes, w2)


def _step(linear, sizes, x, dy, seed, main_grad, dtype=torch.float32):
    w1, w2 = _experts(seed, dtype=dtype)
    if main_grad:
        for w in w1 + w2:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
            w.grad_added_to_main_grad = False
    xx = x.clone().requires_grad_()
    torch.manual_seed(17)  # the stochastic-rounding seeds: the same draws on both paths
    y = _fc1_fc2(linear, xx, sizes, w1, w2)
    y.backward(dy)
    grads = [w.main_grad if main_grad else w.grad for w in w1 + w2]
    return y.detach(), xx.grad, grads


def _compare(linear, counts, seed, main_grad, dtype=torch.float32):
    t = sum(counts)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, HIDDEN, generator=g).to(dtype)
    dy = torch.randn(t, HIDDEN, generator=g).to(dtype)
    want = _step(linear, list(counts), x, dy, seed, main_grad, dtype)
    got = _step(linear, DeviceGroupSizes(torch.tensor(counts), t), x, dy, seed, main_grad, dtype)
    assert_bitwise_equal(got[0], want[0], "y")
    assert_bitwise_equal(got[1], want[1], "dx")
    for i, (a, b) in enumerate(zip(got[2], want[2])):
        assert_bitwise_equal(a, b, f"{'fc1' if i < 4 else 'fc2'} dW[{i % 4}]")


def _nvfp4(recipe):
    def linear(x, sizes, weights):
        return nvfp4_grouped_linear(x, sizes, weights, None, LinearContext(recipe, None), QuantizedWeightCache())

    return linear


@pytest.mark.parametrize("counts", HARD)
def test_nvfp4_experts_on_device_counts_are_the_host_paths_bits(counts):
    """The default recipe (per-token forward scales, SR + RHT on the gradients) on the Triton
    kernels (interpreted): fc1 and fc2 outputs, dx and every expert's dW, bitwise."""
    _compare(_nvfp4(Recipe(backend="triton")), counts, seed=len(counts) + counts[1], main_grad=False)


def test_nvfp4_experts_on_device_counts_into_main_grad():
    """Megatron's fp32 ``main_grad`` (the wgrad kernel's fp32 output, one multi-tensor add), fresh random counts."""
    g = torch.Generator().manual_seed(8)
    counts = torch.multinomial(torch.ones(4), 30, replacement=True, generator=g).bincount(minlength=4).tolist()
    _compare(_nvfp4(Recipe(backend="triton")), counts, seed=9, main_grad=True)


@pytest.mark.parametrize("main_grad", [False, True])
def test_bf16_experts_on_device_counts_are_the_host_paths_bits(main_grad):
    """The BF16 twin's ``torch._grouped_mm`` (offsets from the device counts; an expert without
    rows gets +0 gradients as with host sizes)."""
    for counts in HARD:
        _compare(bf16_grouped_linear, counts, seed=3, main_grad=main_grad, dtype=torch.bfloat16)


def test_device_counts_are_refused_where_host_sizes_are_needed():
    """One clear line where the ops cannot take device counts (the callers ask first:
    ``nvfp4_why_host_sizes`` / ``bf16_why_host_sizes``)."""
    from minite_megatron.ops.grouped_linear import bf16_why_host_sizes, nvfp4_why_host_sizes

    counts = DeviceGroupSizes(torch.tensor([3, 0, 5, 2]), 10)
    x = torch.randn(10, HIDDEN)
    w1, _ = _experts(0)
    assert "host group sizes" in nvfp4_why_host_sizes(Recipe(backend="reference"), "cpu")
    assert "full_update" in nvfp4_why_host_sizes(Recipe(backend="triton", full_update=False, grad_stochastic_rounding=False, wgrad_rht=False), "cpu")
    assert nvfp4_why_host_sizes(Recipe(backend="triton"), "cpu") is None
    with pytest.raises(ValueError, match="reference backend's grouped_gemm takes host group sizes"):
        _nvfp4(Recipe(backend="reference"))(x, counts, w1)
    assert "weights are torch.float32" in bf16_why_host_sizes(torch.bfloat16, "cpu", torch.float32)
    with pytest.raises(ValueError, match="cannot be used: the expert weights"):
        bf16_grouped_linear(x.bfloat16(), counts, w1)
    with pytest.raises(ValueError, match="4 token counts for 3 experts"):
        bf16_grouped_linear(x, counts, w1[:3])
