"""``minite_kernels.triton.nvfp4.group_zero.zero_empty_groups`` against its reference, bitwise: the empty
groups' slices become +0.0 whatever they held (NaN, -0.0, inf), every other element keeps its bits,
for slices that end inside a block, span several programs, and counts of several integer dtypes;
and the BF16 twin's weight gradient with device counts equals the one with host counts. On a CPU
the kernel runs under the Triton interpreter; the ``gpu`` test runs it at the MoE layer's size."""

import pytest
import torch

from minite_kernels.triton.nvfp4.group_zero import BLOCK, CHUNKS, zero_empty_groups, zero_empty_groups_reference
from minite_megatron.testing import assert_bitwise_equal

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _garbage(shape, dtype, seed):
    """What an unwritten output may hold: random values, NaN, infinities and -0.0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1e4
    flat = x.view(-1)
    n = flat.numel()
    for value in (float("nan"), float("inf"), float("-inf"), -0.0):
        flat[torch.randint(0, n, (max(1, n // 50),), generator=g)] = value
    return x.to(dtype)


@pytest.mark.parametrize("groups, slice_shape, dtype, counts_dtype", [
    (7, (3, 5), torch.float32, torch.int64),  # a slice smaller than a block
    (5, (BLOCK + 3,), torch.bfloat16, torch.int32),  # a tail past one block
    (3, (2, CHUNKS * BLOCK // 2 + 7), torch.float32, torch.int32),  # several programs per group
])
def test_zero_empty_groups_equals_reference_bitwise(groups, slice_shape, dtype, counts_dtype):
    for seed in range(2):
        g = torch.Generator().manual_seed(100 + seed)
        counts = torch.randint(0, 3, (groups,), generator=g).to(counts_dtype)
        counts[seed % groups] = 0  # at least one empty group
        counts[(seed + 1) % groups] = 5  # and one that is not
        out = _garbage((groups, *slice_shape), dtype, seed).to(DEV)
        want = zero_empty_groups_reference(out.clone(), counts.to(DEV))
        got = zero_empty_groups(out.clone(), counts.to(DEV))
        assert_bitwise_equal(got, want)
        empty = (counts == 0).nonzero().flatten().tolist()
        assert (got[empty].view(torch.int16 if dtype == torch.bfloat16 else torch.int32) == 0).all()  # +0.0 bits
        keep = [i for i in range(groups) if i not in empty]
        assert_bitwise_equal(got[keep], out[keep])


def test_zero_empty_groups_refuses_what_it_cannot_write():
    out = torch.zeros(4, 6, 8, device=DEV)
    with pytest.raises(ValueError, match="contiguous"):
        zero_empty_groups(out.transpose(1, 2), torch.zeros(4, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match=r"\[G\] counts"):
        zero_empty_groups(out, torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="integers"):
        zero_empty_groups(out, torch.zeros(4, device=DEV))


def test_bf16_twin_wgrad_with_device_counts_equals_host_counts():
    """``BF16GroupedLinearFunction``: the same dW (empty experts +0) from host and device counts."""
    from minite_megatron.nvfp4.group_sizes import DeviceGroupSizes
    from minite_megatron.ops.grouped_linear import bf16_grouped_linear

    g = torch.Generator().manual_seed(3)
    sizes = [5, 0, 3, 0, 8]
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    x = torch.randn(sum(sizes), 32, generator=g).to(DEV, dtype)
    dy = torch.randn(sum(sizes), 16, generator=g).to(DEV, dtype)
    base = [torch.randn(16, 32, generator=g).to(DEV, dtype) for _ in sizes]
    grads = []
    for counts in (sizes, DeviceGroupSizes(torch.tensor(sizes, device=DEV), sum(sizes))):
        weights = [w.clone().requires_grad_() for w in base]
        bf16_grouped_linear(x, counts, weights).backward(dy)
        grads.append([w.grad for w in weights])
    for host, device in zip(*grads):
        assert_bitwise_equal(device, host)
    assert all((grads[1][i] == 0).all() for i in (1, 3))


@pytest.mark.aot  # compile-only (sm_90a on any machine): CI runs it; the GPU set leaves it out
def test_group_zero_compiles_for_the_h200_with_wide_stores():
    """sm_90a, ahead of time on this machine: no spills, 16-byte stores (8 bf16 per thread)."""
    from minite_kernels.triton._build._testing import run_aot_script

    rep = run_aot_script(r"""
import json, re
from minite_kernels.triton._build._aot import report, sass
from minite_kernels.triton._build import _aot_kernels as K
k = K._group_zero()
print("JSON" + json.dumps(dict(report(k), stg128=len(re.findall(r"STG\.E\.128", sass(k))))))
""")
    assert rep["spill_bytes"] == 0 and rep["stg128"] >= 1, rep


@pytest.mark.gpu
def test_zero_empty_groups_at_moe_size_gpu():
    """128 experts' fc1 dW (1536 x 2048, bf16), a quarter of the experts empty."""
    counts = torch.randint(1, 9, (128,), device="cuda", dtype=torch.int32)
    counts[::4] = 0
    out = torch.randn(128, 1536, 2048, device="cuda", dtype=torch.bfloat16)
    want = zero_empty_groups_reference(out.clone(), counts)
    assert_bitwise_equal(zero_empty_groups(out, counts), want)
