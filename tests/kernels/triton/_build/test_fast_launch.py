"""``@fast_jit`` (:mod:`minite_kernels.triton._build._launch`): the launch table's key is at least as fine as
Triton's specialization (CPU: the key itself), and a launch through the table gives the bits of a launch
through Triton's own path (GPU)."""

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from minite_kernels.triton._build import _launch
from minite_kernels.triton._build._launch import FastJITFunction


def _probe(x_ptr, y_ptr, n, seed, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = 0):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(y_ptr + offs, v * scale + seed + MODE, mask=offs < n)


def _fast(fn, **kw):
    k = JITFunction(fn, **kw)  # (not triton.jit: under the interpreter that returns an InterpretedFunction)
    k.__class__ = FastJITFunction
    k._fast_setup()
    return k


def _key(k, *args, **kwargs):
    vals, opts = k._fast_bind(args, kwargs)
    return k._fast_key(vals, opts, 0)


def test_no_launch_hook_by_default():
    """Triton 3.6 keeps an empty ``HookChain`` where no launch hook is set: that is not a hook (the table
    was never used on the GPU while ``is not None`` was the test)."""
    from triton import knobs

    assert not _launch._hooked(knobs.runtime.launch_enter_hook) and not _launch._hooked(knobs.runtime.launch_exit_hook)
    assert _launch._hooked(lambda *a: None) and not _launch._hooked(None)


def test_key_separates_what_triton_specializes_on():
    k = _fast(_probe, do_not_specialize=["seed"])
    x = torch.zeros(64)
    base = _key(k, x, x, 32, 5, 1.5, True, BLOCK=16)
    assert _key(k, x, x, 48, 5, 1.5, True, BLOCK=16) == base  # both multiples of 16
    assert _key(k, x, x, 33, 5, 1.5, True, BLOCK=16) != base  # n % 16
    assert _key(k, x, x, 1, 5, 1.5, True, BLOCK=16) != _key(k, x, x, 3, 5, 1.5, True, BLOCK=16)  # n == 1
    assert _key(k, x, x, 2**31, 5, 1.5, True, BLOCK=16) != base  # i64
    assert _key(k, x, x, 32, 16, 1.5, True, BLOCK=16) == base  # seed: do_not_specialize
    assert _key(k, x, x, 32, 2**40, 1.5, True, BLOCK=16) != base  # ... but its integer class counts
    assert _key(k, x, x, 32, 5, 2.5, True, BLOCK=16) == base  # floats: by type
    assert _key(k, x, x, 32, 5, 1.5, False, BLOCK=16) != base  # bools: by value
    assert _key(k, x[1:], x, 32, 5, 1.5, True, BLOCK=16) != base  # address not 16-byte aligned
    assert _key(k, x.half(), x, 32, 5, 1.5, True, BLOCK=16) != base  # dtype
    assert _key(k, x, x, 32, 5, 1.5, True, BLOCK=32) != base  # constexpr value
    assert _key(k, x, x, 32, 5, 1.5, True, BLOCK=16, MODE=0) == base  # a default given explicitly
    assert _key(k, x, x, 32, 5, 1.5, True, BLOCK=16, MODE=1) != base
    assert _key(k, x, x, 32, 5, 1.5, True, BLOCK=16, num_warps=8) != base  # launch options
    assert _key(k, x, x, 32, 5, "s", True, BLOCK=16) is None  # another argument type: Triton's path
    assert k._fast_bind((x, x, 32), {}) is None  # missing arguments: Triton's path (and its error)


def test_a_hit_launches_the_compiled_kernel_with_tritons_argument_order(monkeypatch):
    """CPU simulation (Triton's own path and the device stubbed): the first launch of a key goes through
    ``JITFunction.run`` and is recorded; the next with the same key calls the compiled kernel's ``run``
    with every parameter in signature order (constexprs and defaults included), as ``JITFunction.run``
    does; a key Triton would compile apart (here ``n % 16``) takes Triton's path again."""
    calls = []

    class Compiled:
        function, packed_metadata = "fn", "meta"

        def run(self, *a):
            calls.append(("direct", a))

    def triton_run(self, *args, grid, warmup, **kwargs):
        calls.append(("triton", args, tuple(sorted(kwargs))))
        return Compiled()

    monkeypatch.setattr(JITFunction, "run", triton_run)
    monkeypatch.setattr(_launch, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    k = _fast(_probe)
    x = torch.zeros(64)
    k[(3,)](x, x, 32, 5, 1.5, True, BLOCK=16, num_warps=2)
    k[(3, 2)](x, x, 48, 6, 2.5, True, BLOCK=16, num_warps=2)
    k[(3,)](x, x, 33, 5, 1.5, True, BLOCK=16, num_warps=2)
    assert [c[0] for c in calls] == ["triton", "direct", "triton"]
    grid_and_stream, args = calls[1][1][:7], calls[1][1][7:]
    assert grid_and_stream == (3, 2, 1, 1234, "fn", "meta", None)
    assert args[:2] == (None, None)  # no launch hooks
    assert args[2:] == (x, x, 48, 6, 2.5, True, 16, 0)  # every parameter in order, MODE's default included


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_table_launch_gives_the_bits_of_tritons_path(monkeypatch):
    """Real kernels of the learner step (row / column / tensor-scale quantize, image) launched twice
    through the table (the second a hit) and once with the table off: the same bits."""
    from minite_kernels.triton.nvfp4.quantize import quantize_forward
    from minite_kernels.triton.nvfp4.quantize_rows import _quantize_rows_kernel

    assert isinstance(_quantize_rows_kernel, FastJITFunction)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1008, 512, device="cuda", generator=g).to(torch.bfloat16)  # rows: a multiple of 16 (16x16 tiles), not of 64
    cases = [dict(global_scale="row"), dict(global_scale="tensor"), dict(global_scale="tensor", tile=(16, 16)),
             dict(global_scale="tensor", rounding="stochastic", seed=11, rht_seed=3)]

    def run_all(src):
        outs = []
        for kw in cases:
            q = quantize_forward(src.t() if "rht_seed" in kw else src, with_image=True, **kw)
            outs.append([q.codes, q.block_scales.view(torch.uint8), q.global_decode, q.image])
        torch.cuda.synchronize()
        return outs

    monkeypatch.setattr(_launch, "ENABLED", True)
    first, hit = run_all(x), run_all(x)
    assert len(_quantize_rows_kernel._fast_table) > 0
    monkeypatch.setattr(_launch, "ENABLED", False)
    slow = run_all(x)
    for a_case, b_case, c_case in zip(first, hit, slow):
        for a, b, c in zip(a_case, b_case, c_case):
            assert torch.equal(a.view(torch.uint8), c.view(torch.uint8)) and torch.equal(b.view(torch.uint8), c.view(torch.uint8))
