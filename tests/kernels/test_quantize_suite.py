"""The standard quantize cases, once, run on every kernel backend and every dispatch path.

Each case is a logical matrix ``x [R, K]`` and quantize options; every backend's
``quantize`` must equal ``nvfp4.quantize_reference`` bit for bit (codes, block scales, global
scales, image with NaN-aware bits). The paths present ``x`` as the kernels meet it:

* ``rows``: row-major ``x`` (bf16 / fp16: the row kernel; fp32: the generic kernel);
* ``cols``: ``x`` as the transpose of a row-major ``[K, R]`` source, read in place (the wgrad
  operands ``x.t()`` / ``dy.t()``: the column kernel).

Backends are parameters that skip with the backend's own ``why_not`` (``blackwell`` needs an
sm_100a / sm_103a GPU; its result is compared with its scales unswizzled). These cases used to
be re-written in the reference, Triton, row-kernel and column-kernel test files (issue 11).
Kernel-specific cases (chunking, gathers, fallbacks, AOT facts) stay in those files.
"""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal

from minite_kernels.triton._build._testing import DEVICE, assert_quantized_equal, heavy_tailed, randn, tie_matrix

BACKENDS = ["triton", "blackwell"]
PATHS = ["rows", "cols"]
HALF = [torch.bfloat16, torch.float16]
ALL = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(params=BACKENDS)
def backend(request):
    b = nvfp4.backends._load(request.param)
    reason = b.why_not(DEVICE)
    if reason is not None:
        pytest.skip(f"{request.param}: {reason}")
    return b


def _cpu(q):
    from dataclasses import replace

    q = q.linear()
    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
                   image=None if q.image is None else q.image.cpu())


def _present(x: torch.Tensor, path: str) -> torch.Tensor:
    x = x.to(DEVICE)
    return x.t().contiguous().t() if path == "cols" else x


def check(backend, x: torch.Tensor, path: str = "rows", name: str = "q", **kwargs) -> None:
    """``backend.quantize`` of ``x`` as ``path`` presents it vs the reference on the CPU; for the
    Triton backend also that the input takes the path's kernel."""
    kwargs.setdefault("with_image", True)
    xin = _present(x, path)
    if backend.name == "triton" and x.dim() == 2 and "rht_seed" not in kwargs:
        from minite_kernels.triton.nvfp4 import quantize_cols
        from minite_kernels.triton.nvfp4 import quantize_rows

        tile16 = tuple(kwargs.get("tile", (1, 16))) == (16, 16)
        has_amax = kwargs.get("global_scale", "row") != "row" or kwargs.get("amax") is not None
        if path == "cols":
            assert quantize_cols.supported(xin, tile16), name
        else:
            assert quantize_rows.supported(xin, tile16, False, has_amax) == (x.dtype in HALF), name
    got = backend.quantize(xin, **kwargs)
    ref = nvfp4.quantize_reference(x.cpu(), **kwargs)
    assert_quantized_equal(_cpu(got), ref, name)
    assert got.global_decode.shape == ref.global_decode.shape, name


def half_tie_matrix(dtype: torch.dtype, rows: int = 8) -> torch.Tensor:
    """``tie_matrix`` in ``dtype``, plus a block per row of each E2M1 bin edge's 16-bit neighbours
    (one ulp above and below, exactly on the other side of the edge)."""
    base = tie_matrix(rows).to(dtype)
    if dtype == torch.float32:
        return base
    edges = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=dtype)
    bits = edges.view(torch.int16)
    up, dn = (bits + 1).view(dtype), (bits - 1).view(dtype)
    block = torch.cat([torch.tensor([6.0], dtype=dtype), up, -dn, torch.tensor([-6.5], dtype=dtype)])
    big = torch.tensor([2688.0] + [0.0] * 15, dtype=dtype)  # keeps S_enc = 1 if the row had none
    return torch.cat([base, torch.stack([torch.cat([block, big]) for _ in range(rows)])], dim=1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("global_scale", ["row", "tensor"])
def test_random_normal_and_heavy_tailed(backend, path, dtype, global_scale):
    """Row and token counts that leave tails in both tile dimensions."""
    check(backend, randn(37, 96, seed=1, scale=3.0, dtype=dtype), path, global_scale=global_scale)
    check(backend, heavy_tailed(19, 160, seed=2, dtype=dtype), path, global_scale=global_scale)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL)
def test_every_bin_edge_tie_neighbour_and_saturation(backend, path, dtype):
    """Ties to the even code at every E2M1 edge, the neighbours on either side (fp32 and 16-bit
    ulps), 6.5 -> 6, -0.0 (code 8), subnormal E4M3 scales and a scale that rounds to zero."""
    x = half_tie_matrix(dtype)
    check(backend, x, path)
    check(backend, x, path, global_scale="tensor")
    check(backend, x, path, name="SR", rounding="stochastic", seed=3)


@pytest.mark.parametrize("path", PATHS)
def test_zeros_subnormal_inputs_and_extrema(backend, path):
    x = torch.zeros(6, 64, dtype=torch.bfloat16)
    x[1, 3] = 1.0
    x[2] = torch.tensor(9.2e-41).to(torch.bfloat16)  # bf16 subnormals (a whole row)
    x[3, 5] = torch.tensor(-3.3895e38).to(torch.bfloat16)  # bf16 max magnitude
    x[3, 40] = torch.tensor(1e-38).to(torch.bfloat16)
    check(backend, x, path)
    check(backend, x, path, global_scale="tensor")
    check(backend, torch.zeros(5, 32), path, global_scale="tensor")
    h = randn(4, 64, seed=3, dtype=torch.float16)
    h[0, 0], h[1, 1], h[2, 2] = 65504.0, -65504.0, 6e-8  # fp16 max and a subnormal
    check(backend, h, path)
    f = randn(16, 64, seed=3)
    f[0, 0], f[1, 5] = 3.3895e38, 1e-38  # fp32: finite extremes
    check(backend, f, path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL)
def test_amax_override_below_the_data_saturates(backend, path, dtype):
    """E4M3 scales saturate at 448 and codes at 6."""
    x = randn(16, 64, seed=4, dtype=dtype)
    check(backend, x, path, amax=torch.full((16,), 0.5))
    check(backend, x, path, global_scale="tensor", amax=torch.tensor([0.25]))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_marks_its_scale_domain(backend, path, dtype, bad):
    x = randn(6, 160, seed=5, dtype=dtype)
    x[2, 17] = bad
    check(backend, x, path)  # row scale: only row 2
    check(backend, x, path, global_scale="tensor")  # the whole tensor
    if path == "cols":
        check(backend, x, path, rht_seed=5)  # the transform spreads it over the block; the domain is NaN
    else:
        g = randn(3, 16, 32, seed=6, dtype=dtype)
        g[1, 3, 4] = bad
        check(backend, g, path, global_scale="group")  # only group 1
        check(backend, g, path, global_scale="group", tile=(16, 16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL)
def test_nonfinite_with_amax_override_marks_blocks(backend, path, dtype):
    """Finite amax given, NaN / inf inside: the NaN block gets a NaN scale and zero codes, the
    inf block saturates (scale 448, code 7), the rest of the row is quantized normally."""
    x = randn(4, 64, seed=7, dtype=dtype)
    x[1, 20] = float("nan")
    x[3, 40] = float("-inf")
    x[2, 50] = float("inf")
    check(backend, x, path, amax=torch.full((4,), 3.0))
    check(backend, x, path, global_scale="tensor", amax=torch.tensor([3.0]))


def test_nonfinite_raise_names_the_element(backend):
    x = randn(4, 32, seed=7)
    x[2, 9] = float("nan")
    with pytest.raises(ValueError, match=r"first at index \(2, 9\)"):
        backend.quantize(x.to(DEVICE), nonfinite="raise")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", [0, 12345, 2**31 + 7, 2**32 - 1])
@pytest.mark.parametrize("k", [64, 320])
def test_stochastic_rounding_draws_the_reference_bits(backend, path, seed, k):
    x = randn(21, k, seed=8, scale=4.0, dtype=torch.bfloat16)
    check(backend, x, path, rounding="stochastic", seed=seed)
    check(backend, x, path, rounding="stochastic", seed=seed, global_scale="tensor")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("rht_seed", [None, 3])
def test_a_device_seed_draws_the_bits_of_its_int_seed(backend, path, dtype, rht_seed):
    """The key read from device memory when the kernel runs (``DeviceSeed``: what a CUDA-graph
    replay rounds with) gives the int seed's reference bits, on every kernel path; a seed on
    another device, or of another type, is refused in one line."""
    x = randn(21, 320, seed=9, scale=4.0, dtype=dtype)
    for seed, gs in ((0, "row"), (2**32 - 1, "tensor"), (12345, "tensor")):
        kw = dict(rounding="stochastic", global_scale=gs, with_image=True)
        if rht_seed is not None:
            kw["rht_seed"] = rht_seed
        got = backend.quantize(_present(x, path), seed=nvfp4.DeviceSeed.of(seed, DEVICE), **kw)
        assert_quantized_equal(_cpu(got), nvfp4.quantize_reference(x.cpu(), seed=seed, **kw), f"seed {seed} {gs}")
    with pytest.raises(TypeError, match="seed must be an int or a DeviceSeed"):
        backend.quantize(_present(x, path), rounding="stochastic", seed=1.5)
    if torch.device(DEVICE).type == "cuda":
        with pytest.raises(ValueError, match="DeviceSeed is on cpu"):
            backend.quantize(_present(x, path), rounding="stochastic", seed=nvfp4.DeviceSeed.of(1, "cpu"))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rht_seed", [-1, 0, 3])
def test_random_hadamard_transform(backend, path, rht_seed):
    x = randn(12, 64, seed=10, dtype=torch.bfloat16)
    check(backend, x, path, rht_seed=rht_seed)
    check(backend, x, path, rht_seed=rht_seed, rounding="stochastic", seed=99, global_scale="tensor")


@pytest.mark.parametrize("path", PATHS)
def test_swizzled_scales(backend, path):
    x = randn(130, 80, seed=9, dtype=torch.bfloat16)
    got = backend.quantize(_present(x, path), scale_layout="swizzled", with_image=True)
    ref = nvfp4.quantize_reference(x, with_image=True)
    assert_bitwise_equal(got.block_scales.cpu(), nvfp4.swizzle_scales(ref.block_scales.reshape(130, 5)), "swizzled")
    assert_bitwise_equal(got.codes.cpu(), ref.codes, "codes")
    assert_bitwise_equal(got.image.cpu(), ref.image, "image")


@pytest.mark.parametrize("path", PATHS)
def test_without_image_leading_dims_and_empty(backend, path):
    check(backend, randn(5, 32, seed=15, dtype=torch.bfloat16), path, with_image=False)
    check(backend, randn(2, 3, 32, seed=13), "rows")
    check(backend, torch.zeros(0, 32), "rows", global_scale="row")
    got = backend.quantize(torch.zeros(0, 32, dtype=torch.bfloat16, device=DEVICE), with_image=True)
    assert got.codes.shape == (0, 16) and got.image.shape == (0, 32)
