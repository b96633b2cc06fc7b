"""The MoE group sizes reach the grouped kernels as host ints, turned into device tensors once per
MoE layer (one pinned non-blocking copy) and shared by fc1, fc2 and their backward.

Regression (issue 16 item 3, BENCHMARKS.md run 9: the NVFP4 learner step left the GPU idle ~28% of
the step): every grouped GEMM re-derived its device offsets from the host list -- 10 host-to-device
copies per MoE layer and step, 4 of them blocking (``pad_index``'s ``torch.tensor(sizes).to(dev)``
for the wgrad operands of fc1 and fc2, forward and backward) -- and every expert's wgrad went to
``main_grad`` in its own kernel.
"""

import random

import pytest
import torch

from minite_megatron.nvfp4.group_sizes import GroupSizes
from minite_megatron.nvfp4.stochastic import fmix32
from minite_megatron.ops.grouped_linear import nvfp4_grouped_linear, shared_group_sizes
from minite_megatron.ops.linear import LinearContext
from minite_megatron.ops.weight_cache import QuantizedWeightCache
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

SIZES = [
    [5, 0, 16, 33, 0, 1],  # empty groups inside, a multiple of 16, one of size 1
    [0, 0, 7],  # leading empty groups
    [7, 0, 0],  # trailing empty groups
    [16, 32],  # nothing to pad
    [23],  # one group (a dense linear's tokens)
    [0],
    [],
]


def _expected_columns(sizes):
    cols, start = [], 0
    for s in sizes:
        cols += list(range(start, start + s)) + [-1] * (-(-s // 16) * 16 - s)
        start += s
    return cols


@pytest.mark.parametrize("sizes", SIZES)
def test_offsets_and_column_index_are_the_padded_layout(sizes):
    gs = GroupSizes(sizes)
    offsets, padded = [0], [0]
    for s in sizes:
        offsets.append(offsets[-1] + s)
        padded.append(padded[-1] + -(-s // 16) * 16)
    assert gs.offsets("cpu").dtype == torch.int32 and gs.offsets("cpu").tolist() == offsets
    assert gs.padded_offsets("cpu").tolist() == padded
    assert gs.padded().offsets("cpu").tolist() == padded and gs.padded().total == padded[-1]
    col = gs.column_index("cpu")
    assert col.dtype == torch.int32 and col.tolist() == _expected_columns(sizes)


def test_random_layouts_equal_the_device_size_path():
    """The host-sized index equals the one made from device sizes (``pad_index`` of a tensor,
    the path without host sizes) on its exact width."""
    from minite_kernels.triton.nvfp4.grouped_wgrad import pad_index

    rng = random.Random(3)
    for _ in range(20):
        sizes = [rng.choice([0, 0, 1, 15, 16, 17, rng.randrange(64)]) for _ in range(rng.randrange(1, 12))]
        col, poffs, t_pad = pad_index(sizes, sum(sizes), torch.device("cpu"))
        dcol, dpoffs, _ = pad_index(torch.tensor(sizes), sum(sizes), torch.device("cpu"))
        assert t_pad == GroupSizes(sizes).padded().total
        assert col.tolist() == dcol[:t_pad].tolist() and poffs.tolist() == dpoffs.tolist()
        assert (dcol[t_pad:] == -1).all()


def test_device_tensors_are_made_once_and_padded_sizes_share_them():
    gs = GroupSizes([3, 20, 0])
    assert gs.offsets("cpu") is gs.offsets("cpu") and gs.column_index("cpu") is gs.column_index("cpu")
    assert gs.padded() is gs.padded()
    assert gs.padded().offsets("cpu") is gs.padded_offsets("cpu")
    aligned = GroupSizes([16, 0, 32])
    assert aligned.padded() is aligned


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="negative group size -1"):
        GroupSizes([3, -1])


def test_shared_group_sizes_reuses_only_the_same_list_with_the_same_values():
    sizes = [4, 0, 12]
    first = shared_group_sizes(sizes)
    assert shared_group_sizes(sizes) is first  # fc2 after fc1
    assert shared_group_sizes([4, 0, 12]) is not first  # the next layer / step: a new list
    again = [4, 0, 12]
    shared_group_sizes(again)
    again[0] = 5  # changed in place: not the same sizes any more
    assert tuple(shared_group_sizes(again)) == (5, 0, 12)


def _grouped_pair(seed: int = 0, groups: int = 4, hidden: int = 32, ffn: int = 16):
    g = torch.Generator().manual_seed(seed)
    w1 = [torch.randn(2 * ffn, hidden, generator=g).requires_grad_() for _ in range(groups)]
    w2 = [torch.randn(hidden, ffn, generator=g).requires_grad_() for _ in range(groups)]
    return w1, w2


def _moe_experts(x, sizes, w1, w2, recipe):
    """fc1 -> SwiGLU -> fc2 as Megatron's grouped MLP calls them: one host list for both."""
    h = nvfp4_grouped_linear(x, sizes, w1, None, LinearContext(recipe, None), QuantizedWeightCache())
    a, b = h.chunk(2, dim=-1)
    return nvfp4_grouped_linear(torch.nn.functional.silu(a) * b, sizes, w2, None, LinearContext(recipe, None),
                                QuantizedWeightCache())


def test_fc1_fc2_and_backward_read_one_set_of_device_offsets(monkeypatch):
    """The Triton backend's kernels (interpreted) get the same offsets tensors in fc1's and fc2's
    forward and backward, and the column index of both wgrad operands is built once: one
    host-to-device copy per MoE layer and step (a no-op copy on this CPU)."""
    import minite_kernels.triton.backend as triton_backend
    import minite_kernels.triton.nvfp4.grouped_wgrad as grouped_wgrad

    seen = {"gemm": [], "wgrad": [], "columns": []}
    gemm_op, wgrad_op, quantize_padded = (triton_backend.grouped_gemm_op, triton_backend.grouped_wgrad_op,
                                          grouped_wgrad._quantize_padded_t)

    def spy_gemm(a, b, offsets, *rest):
        seen["gemm"].append(offsets)
        return gemm_op(a, b, offsets, *rest)

    def spy_wgrad(a, b, poffs, *rest):
        seen["wgrad"].append(poffs)
        return wgrad_op(a, b, poffs, *rest)

    def spy_columns(x, col_index, *rest, **kw):
        seen["columns"].append(col_index)
        return quantize_padded(x, col_index, *rest, **kw)

    import minite_kernels.triton.nvfp4.grouped_gemm as grouped_gemm

    monkeypatch.setattr(grouped_gemm, "grouped_gemm_op", spy_gemm)
    monkeypatch.setattr(triton_backend, "grouped_wgrad_op", spy_wgrad)
    monkeypatch.setattr(grouped_wgrad, "_quantize_padded_t", spy_columns)
    copies = []
    make = GroupSizes._device_offsets

    def counted(self, device):
        if self._base is None and torch.device(device) not in self._on:
            copies.append(tuple(self))
        return make(self, device)

    monkeypatch.setattr(GroupSizes, "_device_offsets", counted)

    sizes = [5, 0, 17, 2]
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w1, w2 = _grouped_pair()
    _moe_experts(x, sizes, w1, w2, Recipe(backend="triton")).sum().backward()

    assert copies == [tuple(sizes)], f"device offsets made {len(copies)} times for one MoE layer"
    assert len(seen["gemm"]) == 4 and all(t is seen["gemm"][0] for t in seen["gemm"])  # 2 fprop + 2 dgrad
    assert len(seen["wgrad"]) == 2 and all(t is seen["wgrad"][0] for t in seen["wgrad"])
    assert len(seen["columns"]) == 4 and all(t is seen["columns"][0] for t in seen["columns"])  # x and dy, fc1 and fc2
    assert seen["gemm"][0].tolist() == [0, 5, 5, 22, 24] and seen["wgrad"][0].tolist() == [0, 16, 16, 48, 64]
    assert x.grad is not None and all(w.grad is not None for w in w1 + w2)


def test_grouped_wgrad_into_main_grad_is_one_multi_tensor_add_of_the_same_bits(monkeypatch):
    """With Megatron's fp32 ``main_grad`` on every expert the wgrads are added by one
    ``torch._foreach_add_`` (was one ``add_`` per expert): the same bits as the plain gradients."""
    sizes = [6, 0, 9, 1]
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(2))
    recipe = Recipe(backend="reference")
    plain, _ = _grouped_pair(seed=5)
    torch.manual_seed(11)  # the SR seeds
    nvfp4_grouped_linear(x, sizes, plain, None, LinearContext(recipe, None), QuantizedWeightCache()).square().sum().backward()

    into_main, _ = _grouped_pair(seed=5)
    for w in into_main:
        w.main_grad = torch.full(w.shape, -0.0)  # -0 + v == v bit for bit, v = -0 included
        w.grad_added_to_main_grad = False
    foreach_calls = []
    real = torch._foreach_add_
    monkeypatch.setattr(torch, "_foreach_add_", lambda *a, **k: (foreach_calls.append(len(a[0])), real(*a, **k))[1])
    torch.manual_seed(11)
    nvfp4_grouped_linear(x, sizes, into_main, None, LinearContext(recipe, None), QuantizedWeightCache()).square().sum().backward()
    assert foreach_calls == [len(into_main)]
    for g, (w, ref) in enumerate(zip(into_main, plain)):
        assert w.grad_added_to_main_grad
        assert_bitwise_equal(w.main_grad, ref.grad, f"expert {g} main_grad")


def test_host_int_seed_mixing_equals_the_tensor_formulation():
    """SR keys and Megatron-iteration seeds are mixed in Python ints now (no torch op per
    quantization): the values of the int64-tensor formulation, edges included."""
    from minite_kernels.triton.nvfp4.quantize import sr_key
    from minite_megatron.ops import seeds

    rng = random.Random(7)
    values = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + [rng.randrange(1 << 32) for _ in range(200)]
    for v in values:
        assert fmix32(v) == int(fmix32(torch.tensor(v, dtype=torch.int64))), v
    for seed in values[:40]:
        key = int(fmix32(torch.tensor(seed & 0xFFFFFFFF, dtype=torch.int64)))
        assert sr_key(seed) == (key - (1 << 32) if key >= (1 << 31) else key)

    def mix_tensor(*words):
        h = torch.tensor(0, dtype=torch.int64)
        for w in words:
            h = fmix32((h + (w & 0xFFFFFFFF) + 0x9E3779B9) & 0xFFFFFFFF)
        return int(h) & 0x7FFFFFFF

    for words in [(0, 0, 0, 0), (1234, 7, 3, 1), (2**31 - 1, 10**6, 2**20, 63)]:
        assert seeds._mix(*words) == mix_tensor(*words)
