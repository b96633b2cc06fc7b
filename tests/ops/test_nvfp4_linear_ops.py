"""The NVFP4 linear and grouped-expert autograd ops equal the contract composed by hand, bitwise."""

import os

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.backends import ReferenceBackend, register_backend
from minite_megatron.ops.grouped_linear import nvfp4_grouped_linear
from minite_megatron.ops.linear import LinearContext, nvfp4_linear
from minite_megatron.ops.weight_cache import QuantizedWeightCache
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal


class SpyBackend(ReferenceBackend):
    """The reference backend, recording every quantize call's role-defining arguments."""

    name = "spy"

    def __init__(self):
        self.calls = []

    def quantize(self, x, **kw):
        self.calls.append((tuple(x.shape), kw.get("global_scale"), kw.get("tile"), kw.get("rounding"), kw.get("rht_seed")))
        return super().quantize(x, **kw)


@pytest.fixture
def spy():
    b = SpyBackend()
    register_backend(b)
    return b


def make(m=48, k=64, n=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).requires_grad_()
    w = torch.randn(n, k, generator=g).to(dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(dtype).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("rht", [True, False])
@pytest.mark.parametrize("sr", [True, False])
def test_linear_fprop_dgrad_wgrad_equal_the_contract(rht, sr):
    recipe = Recipe(grad_stochastic_rounding=sr, wgrad_rht=rht, rht_seed=5)
    x, w, b = make()
    dy = torch.randn(48, 32)
    torch.manual_seed(77)
    y = nvfp4_linear(x, w, b, LinearContext(recipe, QuantizedWeightCache()))
    y.backward(dy)

    qw = nvfp4.quantize(w.detach(), "tensor", (16, 16))
    assert_bitwise_equal(y, nvfp4.gemm(nvfp4.quantize(x.detach()), qw, bias=b.detach(), out_dtype=torch.float32), "y")
    torch.manual_seed(77)
    s1 = nvfp4.draw_seed() if sr else None
    s2 = nvfp4.draw_seed() if sr else None
    rounding = "stochastic" if sr else "nearest"
    dx = nvfp4.gemm(nvfp4.quantize(dy, "tensor", rounding=rounding, seed=s1), qw.transpose(), out_dtype=torch.float32)
    rs = 5 if rht else None
    dw = nvfp4.gemm(
        nvfp4.quantize(dy.t(), "tensor", rounding=rounding, seed=s2, rht_seed=rs),
        nvfp4.quantize(x.detach().t(), "tensor", rht_seed=rs),
        out_dtype=torch.float32,
    )
    assert_bitwise_equal(x.grad, dx, "dgrad")
    assert_bitwise_equal(w.grad, dw, "wgrad")
    assert_bitwise_equal(b.grad, dy.sum(0), "dbias")


def test_quantization_runs_in_fprop_dgrad_and_wgrad(spy):
    recipe = Recipe(backend="spy", rht_seed=3)
    x, w, _ = make(m=32, k=64, n=48)
    y = nvfp4_linear(x, w, None, LinearContext(recipe, QuantizedWeightCache()))
    y.sum().backward()
    roles = [(c[1], c[2], c[3], c[4]) for c in spy.calls]
    shapes = [c[0] for c in spy.calls]
    assert any(s == (48, 64) and r[:2] == ("tensor", (16, 16)) for s, r in zip(shapes, roles)), "weight: 16x16 tiles"
    assert any(s == (32, 64) and r[0] == "row" for s, r in zip(shapes, roles)), "fprop: x per row"
    assert any(s == (64, 32) and r[3] == 3 for s, r in zip(shapes, roles)), "wgrad: x^T with RHT"
    assert any(s == (32, 48) and r[2] == "stochastic" for s, r in zip(shapes, roles)), "dgrad: dy with SR"
    assert any(s == (48, 32) and r[2] == "stochastic" and r[3] == 3 for s, r in zip(shapes, roles)), "wgrad: dy^T SR+RHT"


def test_weight_is_quantized_once_per_optimizer_step(spy):
    """With the codes kept between micro-batches (``QuantizedWeightCache(keep_codes=True)``)."""
    recipe = Recipe(backend="spy", grad_stochastic_rounding=False, wgrad_rht=False)
    x, w, _ = make()
    ctx = LinearContext(recipe, QuantizedWeightCache(keep_codes=True))
    opt = torch.optim.SGD([w], lr=0.1)

    def weight_quantizations():
        return sum(1 for c in spy.calls if c[2] == (16, 16))

    for _ in range(3):  # three micro-batches
        nvfp4_linear(x, w, None, ctx).sum().backward()
    assert weight_quantizations() == 1
    opt.step()
    nvfp4_linear(x, w, None, ctx).sum().backward()
    assert weight_quantizations() == 2


def test_weight_is_quantized_once_per_micro_batch_by_default(spy):
    """The default releases the quantized weight after the layer's backward (memory at the end
    of the backward); a forward without backward (rollout) keeps it."""
    recipe = Recipe(backend="spy", grad_stochastic_rounding=False, wgrad_rht=False)
    x, w, _ = make()
    ctx = LinearContext(recipe, QuantizedWeightCache())

    def weight_quantizations():
        return sum(1 for c in spy.calls if c[2] == (16, 16))

    for _ in range(3):
        nvfp4_linear(x, w, None, ctx).sum().backward()
    assert weight_quantizations() == 3
    with torch.no_grad():
        for _ in range(3):
            nvfp4_linear(x, w, None, ctx)
    assert weight_quantizations() == 4


def test_wgrad_goes_to_main_grad_in_fp32():
    recipe = Recipe(grad_stochastic_rounding=False, wgrad_rht=False)
    x, w, _ = make(dtype=torch.bfloat16)
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    w.grad_added_to_main_grad = False
    ctx = LinearContext(recipe, QuantizedWeightCache())
    dy = torch.randn(48, 32).bfloat16()
    nvfp4_linear(x, w, None, ctx).backward(dy)
    want = nvfp4.gemm(nvfp4.quantize(dy.t(), "tensor"), nvfp4.quantize(x.detach().t(), "tensor"), out_dtype=torch.float32)
    assert w.grad_added_to_main_grad
    assert_bitwise_equal(w.main_grad, want, "main_grad")


def test_bf16_backward_without_full_update():
    recipe = Recipe(full_update=False, grad_stochastic_rounding=False, wgrad_rht=False)
    x, w, _ = make()
    dy = torch.randn(48, 32)
    nvfp4_linear(x, w, None, LinearContext(recipe, QuantizedWeightCache())).backward(dy)
    w_hat = nvfp4.quantize(w.detach(), "tensor", (16, 16)).dequantize()
    assert_bitwise_equal(x.grad, dy @ w_hat)
    assert_bitwise_equal(w.grad, dy.t() @ x.detach())


def test_linear_rejects_feature_mismatch():
    x, w, _ = make()
    with pytest.raises(ValueError, match="features"):
        nvfp4_linear(x[:, :32], w, None, LinearContext(Recipe(), QuantizedWeightCache()))


# ---- grouped experts -----------------------------------------------------------------------------
@pytest.mark.parametrize("sizes", [[5, 0, 17, 1], [0, 0, 0, 8], [16, 16, 16, 16]])
def test_grouped_linear_equals_the_contract(sizes):
    recipe = Recipe(grad_stochastic_rounding=True, wgrad_rht=True, rht_seed=2)
    g = torch.Generator().manual_seed(1)
    t, k, n = sum(sizes), 64, 32
    x = torch.randn(t, k, generator=g).requires_grad_()
    ws = [torch.randn(n, k, generator=g).requires_grad_() for _ in sizes]
    dy = torch.randn(t, n, generator=g)
    torch.manual_seed(5)
    y = nvfp4_grouped_linear(x, sizes, ws, None, LinearContext(recipe, None), QuantizedWeightCache())
    y.backward(dy)

    qw = nvfp4.quantize(torch.stack([w.detach() for w in ws]), "group", (16, 16))
    assert_bitwise_equal(y, nvfp4.grouped_gemm(nvfp4.quantize(x.detach()), qw, sizes, out_dtype=torch.float32), "y")
    torch.manual_seed(5)
    s1, s2 = nvfp4.draw_seed(), nvfp4.draw_seed()
    dx = nvfp4.grouped_gemm(nvfp4.quantize(dy, "tensor", rounding="stochastic", seed=s1), qw.transpose(), sizes, out_dtype=torch.float32)
    dw = nvfp4.grouped_wgrad(dy, x.detach(), sizes, grad_rounding="stochastic", grad_seed=s2, rht_seed=2)
    assert_bitwise_equal(x.grad, dx, "dgrad")
    for e, w in enumerate(ws):
        assert_bitwise_equal(w.grad, dw[e], f"wgrad expert {e}")


def test_grouped_linear_checks_sizes():
    x = torch.randn(10, 32)
    ws = [torch.randn(16, 32) for _ in range(2)]
    with pytest.raises(ValueError, match="sums to"):
        nvfp4_grouped_linear(x, [3, 3], ws, None, LinearContext(Recipe(), None), QuantizedWeightCache())
    with pytest.raises(ValueError, match="token counts"):
        nvfp4_grouped_linear(x, [10], ws, None, LinearContext(Recipe(), None), QuantizedWeightCache())


def test_token_count_not_a_multiple_of_16():
    """Pins: wgrad quantizes along tokens, so 24 tokens used to raise 'K=24 must be a multiple
    of 16'; the token axis is zero-padded (dW unchanged) instead."""
    recipe = Recipe(grad_stochastic_rounding=False, wgrad_rht=False)
    x, w, _ = make(m=24)
    dy = torch.randn(24, 32)
    nvfp4_linear(x, w, None, LinearContext(recipe, QuantizedWeightCache())).backward(dy)
    pad = lambda t: torch.cat([t, t.new_zeros(8, t.shape[1])])  # noqa: E731
    want = nvfp4.gemm(nvfp4.quantize(pad(dy).t(), "tensor"), nvfp4.quantize(pad(x.detach()).t(), "tensor"), out_dtype=torch.float32)
    assert_bitwise_equal(w.grad, want, "wgrad")


def test_sr_seeds_follow_the_megatron_iteration(monkeypatch):
    """Pins: seeds drawn from torch's default generator shifted in a resumed run (building the
    data loader after the checkpoint load consumed a draw); under megatron.training they are a
    function of (iteration, call, rank) only."""
    from types import SimpleNamespace

    from megatron.training import global_vars

    from minite_megatron.ops import seeds

    args = SimpleNamespace(curr_iteration=7)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(seeds, "_STATE", {"iteration": None, "n": 0, "slots": None, "record": None})
    first = [seeds.next_sr_seed(0) for _ in range(3)]
    torch.rand(5)  # unrelated draws from the default generator change nothing
    monkeypatch.setattr(seeds, "_STATE", {"iteration": None, "n": 0, "slots": None, "record": None})
    assert [seeds.next_sr_seed(0) for _ in range(3)] == first
    assert len(set(first)) == 3
    args.curr_iteration = 8
    assert seeds.next_sr_seed(0) not in first


@pytest.mark.parametrize("megatron_iteration", [None, 7])
def test_device_seed_slots_hold_the_seeds_an_eager_step_draws(monkeypatch, megatron_iteration):
    """While a step is captured every draw is the next slot of the capture's buffer (a DeviceSeed
    view, no host value); refill() then writes the keys of exactly the seeds the eager step would
    draw there, in its order (torch's generator, or the Megatron iteration hash), and advances the
    draws as the eager step does. More draws than slots, or a nested capture, is refused."""
    from types import SimpleNamespace

    from megatron.training import global_vars

    from minite_megatron.ops import seeds

    args = SimpleNamespace(curr_iteration=megatron_iteration) if megatron_iteration is not None else None
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    fresh = {"iteration": None, "n": 0, "slots": None, "record": None}
    monkeypatch.setattr(seeds, "_STATE", dict(fresh))
    torch.manual_seed(3)
    with seeds.recording() as drawn:
        eager = [seeds.next_sr_seed(s) for s in (0, 5, 0)]
        with pytest.raises(RuntimeError, match="already recording"):
            with seeds.recording():
                pass
    after_eager = torch.rand(2)
    assert drawn == [0, 5, 0] and all(isinstance(s, int) for s in eager)

    monkeypatch.setattr(seeds, "_STATE", dict(fresh))
    slots = seeds.DeviceSeedSlots(drawn, "cpu")
    with seeds.device_seeds(slots):
        taken = [seeds.next_sr_seed(s) for s in (0, 5)]
        with pytest.raises(RuntimeError, match="quantization 2 has recipe seed 5, its warm-up step's 0"):
            seeds.next_sr_seed(5)
        taken.append(seeds.next_sr_seed(0))
        with pytest.raises(RuntimeError, match="already recording"):
            with seeds.device_seeds(slots):
                pass
        with pytest.raises(RuntimeError, match="more than the 3"):
            seeds.next_sr_seed(0)
    slots.check_taken("test")
    with pytest.raises(RuntimeError, match="test: the captured step drew 0 stochastic-rounding seeds, its warm-up step 3"):
        seeds.DeviceSeedSlots(drawn, "cpu").check_taken("test")
    assert all(isinstance(t, nvfp4.DeviceSeed) for t in taken)
    assert seeds._STATE["n"] == 0  # no host draw while captured
    assert [t.key.data_ptr() for t in taken] == [slots.keys[i:].data_ptr() for i in range(3)]
    torch.manual_seed(3)
    slots.refill()
    assert [int(t.key) for t in taken] == [nvfp4.sr_key(s) for s in eager]
    assert_bitwise_equal(torch.rand(2), after_eager, "the generator after refill, as after the eager draws")
    assert isinstance(seeds.next_sr_seed(0), int)  # outside the capture: host seeds again


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("grouped", [False, True])
def test_backward_reads_dy_once_for_both_amaxes(grouped, device, monkeypatch):
    # the dgrad operand's tensor amax and the wgrad operand's (padded, RHT) amax from one read of dy
    # (backend.dy_amaxes): the gradients bitwise those of the two separate amax passes
    import minite_megatron.ops.grouped_linear as grouped_ops
    import minite_megatron.ops.linear as linear_ops

    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU tensors runs under TRITON_INTERPRET=1 only")

    recipe = Recipe(backend="triton", grad_stochastic_rounding=True, wgrad_rht=True, rht_seed=3)
    sizes = [5, 0, 17, 10]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(sizes), 64, generator=g).to(device, torch.bfloat16)
    ws = [torch.randn(32, 64, generator=g).to(device, torch.bfloat16) for _ in sizes]
    dy = torch.randn(sum(sizes), 32, generator=g).to(device, torch.bfloat16)
    backend = nvfp4.get_backend("triton", torch.device(device))
    calls = []
    real = type(backend).dy_amaxes
    monkeypatch.setattr(type(backend), "dy_amaxes", lambda self, *a: (calls.append(a[1]), real(self, *a))[1])

    def grads():
        xx = x.clone().requires_grad_()
        ww = [w.clone().requires_grad_() for w in ws]
        torch.manual_seed(9)
        lctx = LinearContext(recipe, QuantizedWeightCache())
        if grouped:
            y = nvfp4_grouped_linear(xx, sizes, ww, None, lctx, QuantizedWeightCache())
        else:
            y = nvfp4_linear(xx, ww[0], None, lctx)
        y.backward(dy)
        return [xx.grad] + [w.grad for w in (ww if grouped else ww[:1])]

    shared = grads()
    assert len(calls) == 1
    monkeypatch.setattr(linear_ops, "shared_dy_amaxes", lambda *a: (None, None))
    monkeypatch.setattr(grouped_ops, "shared_dy_amaxes", lambda *a: (None, None))
    separate = grads()
    assert len(calls) == 1  # the separate passes ran instead
    for i, (a, b) in enumerate(zip(shared, separate)):
        assert_bitwise_equal(a, b, f"gradient {i}")
