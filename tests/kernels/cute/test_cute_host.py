"""Host side of the Blackwell backend, checked on a CPU: argument validation (clear errors
before any device work), the scale layouts the kernels read (bitwise against the contract's
``swizzle_scales`` and against CUTLASS's own block-scaled layout), group offsets, and the
backend's availability reasons and quantize delegation."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4 import BackendUnavailable
from minite_megatron.settings import settings
from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal
from minite_kernels.cute import _host
from minite_kernels.cute.backend import BACKEND
from minite_kernels.cute.gemm import nvfp4_gemm, validate_gemm_operands
from minite_kernels.cute.grouped_gemm import group_offsets, nvfp4_grouped_gemm, validate_grouped_operands
from minite_kernels.cute.scales import check_swizzled, grouped_weight_scales, operand_scales, per_group_swizzle
from minite_kernels.cute.tiles import K96_SCHEDULE, GemmConfig, check_k, choose_mma_k, choose_tile_n


def _random_scales(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 0x7F, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _raw_operands(m=64, n=96, k=128, *, dense=True):
    """Valid raw operands of the dense op (CPU tensors)."""
    return dict(
        a_codes=torch.zeros(m, k // 2, dtype=torch.uint8),
        a_scales=nvfp4.swizzle_scales(_random_scales(m, k // 16)),
        a_global=torch.ones(m),
        b_codes=torch.zeros(n, k // 2, dtype=torch.uint8),
        b_scales=nvfp4.swizzle_scales(_random_scales(n, k // 16, seed=1)),
        b_global=torch.ones(n),
        bias=None,
        out_dtype=torch.bfloat16,
    )


# ---- tiles and K ---------------------------------------------------------------------------
@pytest.mark.parametrize("k", [16, 32, 48, 96, 160, 0, -64])
def test_k_not_a_multiple_of_the_mma_k_is_rejected(k):
    with pytest.raises(ValueError, match="multiple of 64"):
        check_k(k)


@pytest.mark.parametrize("k", [64, 128, 192, 256, 320, 4096])
def test_k_multiple_of_64_is_accepted(k):
    check_k(k)


@pytest.mark.parametrize("k", [32, 96, 160, 864, 2048, 4096])
def test_k96_kernel_takes_multiples_of_32(k):
    """sm_103a's K = 96 kernel: 16-byte rows for TMA are all it needs (the last 768-wide
    k-tile's tail is zero-filled and its MMAs past K are skipped): no multiple of 96 or 768."""
    check_k(k, 96)


@pytest.mark.parametrize("k", [16, 48, 80, 0, -32])
def test_k96_kernel_rejects_other_k_in_one_line(k):
    with pytest.raises(ValueError, match=f"K={k} must be a positive multiple of 32 .*K = 96 kernel") as info:
        check_k(k, 96)
    assert "\n" not in str(info.value)


def test_mma_k_is_chosen_by_the_gpu_never_by_m(monkeypatch):
    """96 on sm_103a for the dense and row-grouped GEMMs, 64 for the wgrad there, 64 on sm_100a
    and off Blackwell; ``MINITE_BLACKWELL_MMA_K`` overrides (64 anywhere, 96 on sm_103a only),
    anything else is one clear error naming the variable."""
    monkeypatch.delenv("MINITE_BLACKWELL_MMA_K", raising=False)
    settings.cache_clear()  # (read once per process: the variable changed)
    assert [choose_mma_k(a) for a in ("sm_103a", "sm_100a", None)] == [96, 64, 64]
    assert choose_mma_k("sm_103a", k_grouped=True) == 64
    monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", "64")
    settings.cache_clear()  # (read once per process: the variable changed)
    assert choose_mma_k("sm_103a") == 64
    monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", "96")
    settings.cache_clear()  # (read once per process: the variable changed)
    assert choose_mma_k("sm_103a") == 96 and choose_mma_k(None) == 64
    with pytest.raises(ValueError, match="sm_103a"):
        choose_mma_k("sm_100a")
    monkeypatch.setenv("MINITE_BLACKWELL_MMA_K", "128")
    settings.cache_clear()  # (read once per process: the variable changed)
    with pytest.raises(ValueError, match="MINITE_BLACKWELL_MMA_K='128'"):
        choose_mma_k("sm_103a")


def test_k96_config_validates():
    assert GemmConfig(mma_k=96, grouped=True).name == "n128_bfloat16_grouped_k96"
    assert GemmConfig(mma_k=96).tile_k == 768 and GemmConfig().tile_k == 256
    with pytest.raises(ValueError, match="mma_k"):
        GemmConfig(mma_k=128)
    with pytest.raises(ValueError, match="K-grouped"):
        GemmConfig(mma_k=96, k_grouped=True)


def test_k96_schedule_reads_each_byte_and_scale_once_in_order():
    """The static plan of a 768-wide k-tile, from first principles: MMA j covers K elements
    [96 j, 96 j + 96), i.e. the 16-byte chunks 3 j .. 3 j + 2 of the tile's 24 (8 per 256-wide
    buffer) and scale columns 6 j .. 6 j + 5 of its 48 (12 per 192-wide scale stage). So the
    descriptors start at chunks 0, 3, 6, 1, 4, 7, 2, 5; MMAs 2 and 5 run into the next buffer
    (circular descriptors); every buffer is waited for before its first reader and released
    after its last, every scale stage is copied before its first MMA."""
    plan = K96_SCHEDULE
    assert [s.chunk for s in plan] == [0, 3, 6, 1, 4, 7, 2, 5]
    assert [s.buffer for s in plan] == [0, 0, 0, 1, 1, 1, 2, 2]
    assert [s.next_buffer for s in plan] == [0, 0, 1, 1, 1, 2, 2, 2]
    covered = []
    for s in plan:
        chunks = [8 * s.buffer + s.chunk + i for i in range(3)]
        assert all(c // 8 in (s.buffer, s.next_buffer) for c in chunks) and chunks[-1] // 8 == s.next_buffer
        covered += chunks
        assert s.k_start == 32 * chunks[0]
        assert 12 * s.sf_stage + s.sf_column == s.k_start // 16 and s.sf_column in (0, 6)
    assert covered == list(range(24))
    waited, released = [], []
    for s in plan:
        waited += s.waits
        assert {s.buffer, s.next_buffer} <= set(waited) and not ({s.buffer, s.next_buffer} & set(released))
        released += s.releases
        assert s.loads_scales == (s.sf_column == 0)
    assert waited == released == [0, 1, 2]


if _host.dsl_import_error() is None:
    import cutlass
    import cutlass.cute as cute

    from minite_kernels.cute._blockscaled_gemm_impl import k96_issues, k96_tiles

    @cute.jit
    def _k96_k_loop(issued: cute.Tensor, tiles: cute.Tensor, k: cutlass.Int32):
        tiles[0] = k96_tiles(k)
        for kt in cutlass.range(cute.size(issued, mode=[0])):
            for j in cutlass.range_constexpr(8):
                issued[kt, j] = cutlass.Int32(0)
                if k96_issues(kt, 96 * j, k):
                    issued[kt, j] = cutlass.Int32(1)


@pytest.mark.parametrize("k", [32, 96, 128, 192, 736, 768, 800, 864, 1536, 2048, 2304])
def test_k96_k_loop_covers_k_and_skips_only_the_zero_tail(k):
    """The K = 96 kernel's K loop (its device functions ``k96_tiles`` / ``k96_issues``, run on
    the host by the DSL): ceil(K / 768) k-tiles, and the issued MMAs are exactly those that
    start before K, so they cover [0, K) (plus at most 95 zero-filled elements) and every
    k-tile's first MMA runs (the accumulate flag's reset is never skipped)."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    from cutlass.cute.runtime import from_dlpack

    issued = torch.full((4, 8), -1, dtype=torch.int32)
    tiles = torch.zeros(1, dtype=torch.int32)
    _k96_k_loop(from_dlpack(issued), from_dlpack(tiles), k)
    n_tiles = tiles.item()
    assert n_tiles == -(-k // 768)
    starts = [768 * kt + 96 * j for kt in range(n_tiles) for j in range(8) if issued[kt, j]]
    assert starts == list(range(0, k, 96))
    assert all(issued[kt, 0] == 1 for kt in range(n_tiles))


def test_tile_choice_depends_on_n_only_and_configs_validate():
    """Strict mode: the tile (hence the accumulation) never depends on M."""
    assert [choose_tile_n(n) for n in (1, 128, 511, 512, 4096)] == [128, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="tile_n"):
        GemmConfig(tile_n=64)
    with pytest.raises(ValueError, match="out_dtype"):
        GemmConfig(out_dtype="float8")
    assert GemmConfig(tile_n=256, has_bias=True, grouped=True).name == "n256_bfloat16_bias_grouped"


# ---- raw-operand validation ------------------------------------------------------------------
def test_valid_raw_operands_pass_validation():
    assert validate_gemm_operands(**_raw_operands(64, 96, 128)) == (64, 96, 128)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (dict(a_codes=torch.zeros(64, 64, dtype=torch.int8)), TypeError, "uint8"),
        (dict(b_codes=torch.zeros(96, 32, dtype=torch.uint8)), ValueError, "K mismatch"),
        (dict(a_codes=torch.zeros(64, 40, dtype=torch.uint8), b_codes=torch.zeros(96, 40, dtype=torch.uint8)), ValueError, "multiple of 64"),
        (dict(a_scales=_random_scales(64, 8)), ValueError, "swizzled"),  # linear [M, K/16]
        (dict(a_scales=nvfp4.swizzle_scales(_random_scales(64, 8)).view(torch.uint8)), TypeError, "float8_e4m3fn"),
        (dict(b_scales=nvfp4.swizzle_scales(_random_scales(200, 8))), ValueError, "swizzled"),
        (dict(a_global=torch.ones(64, dtype=torch.float16)), TypeError, "float32"),
        (dict(a_global=torch.ones(63)), ValueError, "64"),
        (dict(b_global=torch.ones(2)), ValueError, "b_global"),
        (dict(bias=torch.ones(95)), ValueError, "bias"),
        (dict(bias=torch.ones(96, dtype=torch.int32)), TypeError, "bias"),
        (dict(out_dtype=torch.int32), TypeError, "out_dtype"),
        (dict(a_global=torch.ones(64, device="meta")), ValueError, "several devices"),
    ],
)
def test_bad_raw_operands_raise_clear_errors(change, error, match):
    args = _raw_operands(64, 96, 128)
    args.update(change)
    with pytest.raises(error, match=match):
        validate_gemm_operands(**args)


def test_raw_validation_applies_the_kernels_k_rule():
    """K = 96 passes the checks of sm_103a's K = 96 kernel and fails the K = 64 kernel's with a
    line that names both rules."""
    assert validate_gemm_operands(**_raw_operands(64, 96, 96), mma_k=96) == (64, 96, 96)
    with pytest.raises(ValueError, match="multiple of 64 .*multiples of 32"):
        validate_gemm_operands(**_raw_operands(64, 96, 96))


def test_per_tensor_weight_scale_is_accepted():
    args = _raw_operands(64, 96, 128)
    args["b_global"] = torch.ones(1)
    assert validate_gemm_operands(**args) == (64, 96, 128)


def _quantized(m=64, n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = nvfp4.quantize_reference(torch.randn(m, k, generator=g), global_scale="row")
    b = nvfp4.quantize_reference(torch.randn(n, k, generator=g), global_scale="tensor", tile=(16, 16))
    return a, b


def test_linear_scales_are_rejected_by_the_kernel_op():
    a, b = _quantized()
    with pytest.raises(ValueError, match=r"a\.swizzled\(\)"):
        nvfp4_gemm(a, b.swizzled())
    with pytest.raises(ValueError, match=r"b\.swizzled\(\)"):
        nvfp4_gemm(a.swizzled(), b)


def test_valid_operands_off_blackwell_raise_backend_unavailable_with_the_reason():
    a, b = _quantized()
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        nvfp4_gemm(a.swizzled(), b.swizzled())


def test_gemm_rejects_k_not_multiple_of_64_on_quantized_operands():
    a, b = _quantized(k=96)
    with pytest.raises(ValueError, match="multiple of 64"):
        nvfp4_gemm(a.swizzled(), b.swizzled())


# ---- grouped validation and offsets ----------------------------------------------------------------
def _grouped_quantized(sizes=(5, 0, 130, 1), n=80, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = nvfp4.quantize_reference(torch.randn(sum(sizes), k, generator=g), global_scale="row")
    b = nvfp4.quantize_reference(torch.randn(len(sizes), n, k, generator=g), global_scale="group", tile=(16, 16))
    return a, b


def test_group_offsets_are_running_sums_checked_against_rows():
    assert group_offsets([5, 0, 130, 1], 136, torch.device("cpu")).tolist() == [0, 5, 5, 135, 136]
    assert group_offsets(torch.tensor([3, 4]), 7, torch.device("cpu")).dtype == torch.int32
    with pytest.raises(ValueError, match="sum to 6"):
        group_offsets([3, 3], 7, torch.device("cpu"))
    with pytest.raises(ValueError, match="negative"):
        group_offsets([8, -1], 7, torch.device("cpu"))
    with pytest.raises(ValueError, match="at least one group"):
        group_offsets([], 0, torch.device("cpu"))


def test_grouped_gemm_validation():
    a, b = _grouped_quantized()
    with pytest.raises(ValueError, match="3 group sizes for 4 groups"):
        nvfp4_grouped_gemm(a.swizzled(), b.swizzled(), [5, 0, 131])
    with pytest.raises(ValueError, match="sum to 137"):
        nvfp4_grouped_gemm(a.swizzled(), b.swizzled(), [5, 0, 131, 1])
    with pytest.raises(ValueError, match=r"b\.swizzled\(\)"):
        nvfp4_grouped_gemm(a.swizzled(), b, [5, 0, 130, 1])
    with pytest.raises(ValueError, match="global_scale='group'"):
        nvfp4_grouped_gemm(a.swizzled(), nvfp4.quantize_reference(torch.randn(80, 128)).swizzled(), [136])
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        nvfp4_grouped_gemm(a.swizzled(), b.swizzled(), [5, 0, 130, 1])


def test_grouped_raw_operand_validation():
    a, b = _grouped_quantized()
    args = dict(
        a_codes=a.codes,
        a_scales=operand_scales(a),
        a_global=a.row_global_decode(),
        b_codes=b.codes,
        b_scales=grouped_weight_scales(b),
        b_global=b.global_decode,
        offsets=torch.tensor([0, 5, 5, 135, 136], dtype=torch.int32),
        bias=None,
        out_dtype=torch.bfloat16,
    )
    assert validate_grouped_operands(**args) == (136, 80, 128, 4)
    bad = dict(args, offsets=torch.tensor([0, 5, 5, 135, 136]))
    with pytest.raises(ValueError, match="int32"):
        validate_grouped_operands(**bad)
    whole = dict(args, b_scales=nvfp4.swizzle_scales(b.linear_scales()))  # one matrix, 80 % 128 != 0
    with pytest.raises(ValueError, match="swizzled"):
        validate_grouped_operands(**whole)
    with pytest.raises(ValueError, match="bias"):
        validate_grouped_operands(**dict(args, bias=torch.ones(80)))


@pytest.mark.parametrize(
    "offsets,match",
    [
        ([1, 5, 5, 135, 136], r"start at 0, got offsets\[0\] = 1"),
        ([0, 5, 4, 135, 136], r"must not decrease, got offsets\[1\] = 5 > offsets\[2\] = 4"),
        ([0, 5, 5, 135, 137], r"end at M = 136 .*offsets\[4\] = 137"),
        ([0, 5, 5, 135, 100], r"must not decrease"),
        ([0, 5, 5, 135, 135], r"end at M = 136"),
    ],
)
def test_grouped_raw_op_rejects_bad_offset_values(offsets, match):
    """Regression (issue 13): the raw op checked only the offsets' dtype and shape, so offsets
    that decrease or do not end at M wrote past the output or left rows unwritten. One line
    naming the offsets, before any launch."""
    a, b = _grouped_quantized()
    args = dict(
        a_codes=a.codes, a_scales=operand_scales(a), a_global=a.row_global_decode(), b_codes=b.codes,
        b_scales=grouped_weight_scales(b), b_global=b.global_decode, bias=None, out_dtype=torch.bfloat16,
        offsets=torch.tensor(offsets, dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=match) as info:
        validate_grouped_operands(**args)
    assert "\n" not in str(info.value) and "offsets" in str(info.value)


def test_device_group_sizes_are_summed_on_the_device_and_checked_by_the_raw_op():
    """Sizes given as a tensor on the operands' device are turned into offsets there (no host
    sync); a wrong sum or a negative size is then caught by the raw op's offset check."""
    meta = torch.device("meta")
    offs = group_offsets(torch.tensor([3, 0, 4], device=meta), 7, meta)
    assert offs.device == meta and offs.dtype == torch.int32 and offs.shape == (4,)
    from minite_kernels.cute.grouped_gemm import check_row_offsets

    for sizes in ([3, 0, 5], [8, -1, 0]):
        bad = torch.cat([torch.zeros(1, dtype=torch.int64), torch.tensor(sizes).cumsum(0)]).to(torch.int32)
        with pytest.raises(ValueError, match="offsets"):
            check_row_offsets(bad, 7, 3)
    with pytest.raises(ValueError, match="1D integer"):
        group_offsets(torch.ones(3, device=meta), 3, meta)


def test_grouped_op_validates_offsets_before_needing_blackwell():
    a, b = _grouped_quantized()
    from minite_kernels.cute.grouped_gemm import nvfp4_grouped_gemm_op

    with pytest.raises(ValueError, match="end at M"):
        nvfp4_grouped_gemm_op(
            a.codes, operand_scales(a), a.row_global_decode(), b.codes, grouped_weight_scales(b), b.global_decode,
            torch.tensor([0, 5, 5, 135, 140], dtype=torch.int32), None, torch.bfloat16,
        )


def test_wgrad_raw_op_rejects_bad_k_offsets():
    from minite_kernels.cute.grouped_wgrad_gemm import validate_wgrad_operands

    raw = dict(
        a_codes=torch.zeros(24, 64, dtype=torch.uint8), a_scales=nvfp4.swizzle_scales(_random_scales(24, 8)),
        a_global=torch.ones(24), b_codes=torch.zeros(40, 64, dtype=torch.uint8),
        b_scales=nvfp4.swizzle_scales(_random_scales(40, 8)), b_global=torch.ones(1), out_dtype=torch.float32,
    )
    for bad in ([1, 1, 2], [0, 2, 1, 2], [0, 1, 3]):
        with pytest.raises(ValueError, match="k_offsets must rise from 0 to T / 64 = 2"):
            validate_wgrad_operands(**raw, k_offsets=torch.tensor(bad, dtype=torch.int32))


# ---- per-device executors and the launch device ----------------------------------------------
class _FakeCompiled:
    """Stands in for a compiled CuTe DSL function: records which device each executor is for
    and which device is current when it is called."""

    def __init__(self, current):
        self.current = current
        self.bound = []
        self.calls = []

    def to(self, index):
        self.bound.append(index)
        compiled = self

        def run(*args):
            compiled.calls.append((index, compiled.current[-1] if compiled.current else None, args))

        return run


@pytest.fixture
def fake_two_gpus(monkeypatch):
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    import contextlib

    from minite_kernels.cute import _blockscaled_gemm_impl as impl

    current = []

    @contextlib.contextmanager
    def device(d):
        current.append(torch.device(d).index)
        try:
            yield
        finally:
            current.pop()

    class _Stream:
        cuda_stream = 0

    fake = _FakeCompiled(current)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream())
    monkeypatch.setattr(impl, "compile_gemm", lambda config, arch: fake)
    impl.executor.cache_clear()
    yield impl, fake
    impl.executor.cache_clear()


def test_kernel_is_loaded_and_launched_per_device(fake_two_gpus):
    """Regression (issue 13): the compiled kernel was cached once per process and bound to the
    GPU current at the first call, so tensors on another GPU launched in the wrong context.
    Now one executor per device (the compilation is shared), called with the output's device
    current, whatever device the caller had current."""
    impl, fake = fake_two_gpus
    config = GemmConfig()

    class _On:
        """A tensor stand-in on cuda:<index> (data_ptr only; the launch reads nothing else)."""

        def __init__(self, index):
            self.device = torch.device("cuda", index)

        def data_ptr(self):
            return 4096

    for index in (1, 0, 1):
        t = _On(index)
        impl.launch(config, t, t, t, t, t, t, t, None, None, m=1, n=1, k=64, groups=1, sb_strides=(0, 0), arch="sm_100a")
    assert fake.bound == [1, 0]  # one executor per device, reused
    assert [(bound, current) for bound, current, _ in fake.calls] == [(1, 1), (0, 0), (1, 1)]
    assert impl.executor(config, "sm_100a", 1) is impl.executor(config, "sm_100a", 1)
    with pytest.raises(ValueError, match="pair schedule"):
        impl.launch(GemmConfig(grouped=True), t, t, t, t, t, t, t, None, t, m=1, n=1, k=64, groups=1,
                    sb_strides=(0, 1), arch="sm_100a")


# ---- scale layouts ---------------------------------------------------------------------------
@pytest.mark.parametrize("groups,rows,cols", [(1, 128, 4), (3, 80, 8), (2, 256, 12), (4, 130, 5), (5, 1, 1)])
def test_per_group_swizzle_equals_swizzle_of_each_group(groups, rows, cols):
    s = _random_scales(groups, rows, cols, seed=groups * rows)
    expected = torch.cat([nvfp4.swizzle_scales(s[i]) for i in range(groups)])
    assert_bitwise_equal(per_group_swizzle(s), expected, "per-group swizzle")


def test_grouped_weight_scales_reuse_the_swizzled_tensor_when_n_is_a_multiple_of_128():
    """With N % 128 == 0 the whole-matrix swizzle is already per group: no copy is made."""
    a, b = _grouped_quantized(sizes=(3, 4), n=128)
    bs = b.swizzled()
    got = grouped_weight_scales(bs)
    assert got.data_ptr() == bs.block_scales.data_ptr()
    expected = per_group_swizzle(b.linear_scales().reshape(2, 128, 8))
    assert_bitwise_equal(got, expected, "grouped scales")


@pytest.mark.parametrize("layout", ["linear", "swizzled"])
def test_grouped_weight_scales_convert_when_n_is_not_a_multiple_of_128(layout):
    _, b = _grouped_quantized(n=80)
    q = b if layout == "linear" else b.swizzled()
    expected = torch.cat([nvfp4.swizzle_scales(b.group(i).linear_scales()) for i in range(4)])
    assert_bitwise_equal(grouped_weight_scales(q), expected, "grouped scales")


def test_operand_scales_equal_the_contract_swizzle():
    a, _ = _quantized(m=200, k=192)
    assert_bitwise_equal(operand_scales(a), nvfp4.swizzle_scales(a.linear_scales()), "linear -> swizzled")
    assert_bitwise_equal(operand_scales(a.swizzled()), nvfp4.swizzle_scales(a.linear_scales()), "swizzled")


def test_check_swizzled_names_the_expected_size():
    with pytest.raises(ValueError, match="2 x \\[80, 8\\]"):
        check_swizzled(_random_scales(10), 80, 128, 2, "b_scales")


@pytest.mark.parametrize("k", [192, 96])
def test_contract_swizzle_is_cutlass_block_scaled_layout(k):
    """The bytes the kernel reads are where CUTLASS's ``tile_atom_to_shape_SF`` says: for every
    (row, K block, group), CUTLASS's layout of an (M, K, G) operand maps to the offset at which
    ``per_group_swizzle`` (== ``nvfp4.swizzle_scales`` per group) stored that scale. Pins the
    layout agreement between the contract and the kernel without a GPU. Both kernels (K = 64 and
    sm_103a's K = 96) address the scales with this one layout; K = 96 (6 scale columns,
    not a multiple of 4, which only the K = 96 kernel takes) ends in the swizzle's zero padding."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    import cutlass.cute as cute
    import cutlass.utils.blockscaled_layout as blockscaled_utils

    groups, rows = 2, 160
    cols = k // 16
    found = {}

    @cute.jit
    def offsets_of_every_scale():
        layout = blockscaled_utils.tile_atom_to_shape_SF((rows, k, groups), 16)
        found["offsets"] = [layout((r, c * 16, g)) for g in range(groups) for r in range(rows) for c in range(cols)]

    offsets_of_every_scale()
    ids = torch.arange(groups * rows * cols, dtype=torch.int32).reshape(groups, rows, cols) + 1
    swizzled = per_group_swizzle(ids)
    got = swizzled[torch.tensor(found["offsets"])].reshape(groups, rows, cols)
    assert_bitwise_equal(got, ids, "scale at CUTLASS's offset")


# ---- the kernel's group bookkeeping, run on the host ---------------------------------------------
# Host-executed DSL functions calling the kernel's own device helpers (defined at module level:
# the DSL re-reads their source and resolves annotations in this module's globals).
if _host.dsl_import_error() is None:
    import cutlass
    import cutlass.cute as cute

    from minite_kernels.cute._blockscaled_gemm_impl import pair_of_cta, pass_extent, stores_element

    @cute.jit
    def _row_group_bookkeeping(
        mSched: cute.Tensor, mOffs: cute.Tensor, pairs: cute.Tensor, extents: cute.Tensor, groups: cutlass.Int32,
        m: cutlass.Int32, ctas: cutlass.Int32
    ):
        for p in cutlass.range(ctas):
            g, m_tile, has_pair = pair_of_cta(mSched, mOffs, groups, p)
            pairs[p, 0] = g
            pairs[p, 1] = m_tile
            pairs[p, 2] = has_pair
        for g in cutlass.range(groups):
            rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, g, m, 7, True, False)
            extents[g, 0] = rows_lo
            extents[g, 1] = rows_hi
            extents[g, 2] = kt_lo
            extents[g, 3] = kt_hi

    @cute.jit
    def _store_mask(mask: cute.Tensor, rows_lo: cutlass.Int32, rows_hi: cutlass.Int32, m: cutlass.Int32, n: cutlass.Int32):
        for r in cutlass.range(cute.size(mask, mode=[0])):
            for c in cutlass.range(cute.size(mask, mode=[1])):
                mask[r, c] = cutlass.Int32(0)
                if stores_element(r, c, rows_lo, rows_hi, m, n):
                    mask[r, c] = cutlass.Int32(1)

    @cute.jit
    def _k_group_extents(mOffs: cute.Tensor, extents: cute.Tensor, groups: cutlass.Int32, m: cutlass.Int32):
        for g in cutlass.range(groups):
            rows_lo, rows_hi, kt_lo, kt_hi = pass_extent(mOffs, g, m, 99, False, True)
            extents[g, 0] = rows_lo
            extents[g, 1] = rows_hi
            extents[g, 2] = kt_lo
            extents[g, 3] = kt_hi


    @cute.jit
    def _sm103_facts(found: cutlass.Constexpr):
        import cutlass.utils.blackwell_helpers as sm100_utils
        import cutlass.utils.blockscaled_layout as blockscaled_utils
        from cutlass.cute.nvgpu import tcgen05

        mma = sm100_utils.sm103_make_blockscaled_trivial_tiled_mma(cutlass.Float8E4M3FN, 16, tcgen05.CtaGroup.ONE, (128, 256))
        found["op"] = type(mma.op).__name__
        found["mnk"] = tuple(cute.size(mma.shape_mnk, mode=[i]) for i in range(3))
        chunk = blockscaled_utils.Sm103BlockScaledBasicChunk(16).layout
        tiled = cute.tile_to_shape(chunk, (256, 192), (2, 1))
        found["offsets"] = [tiled((r, c * 16)) for r in range(256) for c in range(12)]

    @cute.jit
    def _epilogue_coordinates(out: cute.Tensor, tile_n: cutlass.Constexpr, threads: cutlass.Constexpr):
        from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
        import cutlass.utils.blackwell_helpers as sm100_utils

        from minite_kernels.cute._blockscaled_gemm_impl import epilogue_partition

        tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float8E4M3FN, 16, tcgen05.CtaGroup.ONE, (128, tile_n),
        )
        acc_layout = tiled_mma.make_fragment_C(cute.append(tiled_mma.partition_shape_C((128, tile_n)), 1)).layout
        acc = cute.make_tensor(cute.make_ptr(cutlass.Float32, 0, cute.AddressSpace.tmem, assumed_align=16), acc_layout)
        for j in cutlass.range_constexpr(len(threads)):
            _, _, tTR_cC = epilogue_partition(tiled_mma, acc, (300, 700), (128, tile_n), 1, 2, threads[j])
            for sub in cutlass.range_constexpr(tile_n // 32):
                for i in cutlass.range_constexpr(32):
                    row, col = tTR_cC[(None, None, None, 0, sub)][i]
                    out[j, sub, i, 0] = row
                    out[j, sub, i, 1] = col
_BOOKKEEPING_CASES = [
    [300],
    [0, 1, 127, 0, 129, 5, 300, 0],
    [1] * 40,
    [0, 0, 64, 0],
    [128, 128, 0, 1],
    [3, 250, 0, 0, 0, 7, 128, 129],
]


def reference_pairs(sizes: list[int]) -> list[tuple[int, int]]:
    """The (128-row tile, expert) pairs a grouped GEMM must run, in the kernel's order
    (expert by expert, tile by tile): every tile that holds at least one row of a non-empty
    expert, once per such expert. Plain Python, independent of the kernel's formula."""
    pairs, start = [], 0
    for g, size in enumerate(sizes):
        tiles = sorted({row // 128 for row in range(start, start + size)})
        pairs += [(t, g) for t in tiles]
        start += size
    return pairs


@pytest.mark.parametrize("sizes", _BOOKKEEPING_CASES)
def test_pair_schedule_equals_the_reference_pairs(sizes):
    """The host half of the schedule (``pair_schedule``, torch ops on the offsets' device):
    expert g's first pair and the total count match the reference enumeration, and the
    count stays within the grid bound ceil(M / 128) + G - 1."""
    from minite_kernels.cute.grouped_gemm import pair_schedule

    offs = group_offsets(sizes, sum(sizes), torch.device("cpu"))
    sched = pair_schedule(offs)
    pairs = reference_pairs(sizes)
    assert sched.dtype == torch.int32 and sched.shape == (len(sizes) + 1,)
    assert sched[-1].item() == len(pairs) <= -(-sum(sizes) // 128) + len(sizes) - 1
    for g in range(len(sizes)):
        assert sched[g].item() == sum(1 for _, h in pairs if h < g)


@pytest.mark.parametrize("sizes", _BOOKKEEPING_CASES)
def test_grouped_ctas_run_each_tile_expert_pair_once(sizes):
    """The device functions of the grouped kernel (``pair_of_cta``: which (tile, expert)
    pair a CTA runs; ``pass_extent``: the rows it stores), executed on the host by the DSL
    over the whole launch grid: the CTAs run exactly the reference pairs, each once (no CTA
    runs a second full-K pass for another expert of its tile), CTAs past the count run
    nothing, and every row is stored exactly once, by a pass of its own expert."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    from cutlass.cute.runtime import from_dlpack

    from minite_kernels.cute.grouped_gemm import pair_schedule

    offs = group_offsets(sizes, sum(sizes), torch.device("cpu"))
    sched = pair_schedule(offs)
    m, groups = sum(sizes), len(sizes)
    ctas = -(-m // 128) + groups - 1  # the kernel's grid
    pairs = torch.full((ctas, 3), -1, dtype=torch.int32)
    extents = torch.full((groups, 4), -1, dtype=torch.int32)
    _row_group_bookkeeping(from_dlpack(sched), from_dlpack(offs), from_dlpack(pairs), from_dlpack(extents), groups, m, ctas)

    assert extents[:, 0].tolist() == offs[:-1].tolist() and extents[:, 1].tolist() == offs[1:].tolist()
    assert extents[:, 2].tolist() == [0] * groups and extents[:, 3].tolist() == [7] * groups
    run = [(t, g) for g, t, has in pairs.tolist() if has]
    assert run == reference_pairs(sizes)
    assert all(not has for _, _, has in pairs.tolist()[len(run):])
    owner = torch.repeat_interleave(torch.arange(groups), torch.tensor(sizes))
    stored = torch.zeros(m, dtype=torch.int64)
    for t, g in run:
        lo, hi = extents[g, 0].item(), extents[g, 1].item()
        for r in range(t * 128, min(t * 128 + 128, m)):
            if lo <= r < hi:
                assert owner[r] == g
                stored[r] += 1
    assert torch.equal(stored, torch.ones(m, dtype=torch.int64)), stored


def test_epilogue_never_stores_at_or_past_m():
    """Regression (issue 13): the grouped store was predicated on the pass's rows only, so
    offsets claiming more than M rows wrote past the output. ``stores_element`` (the store
    predicate, run on the host by the DSL) also requires row < M and col < N."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    from cutlass.cute.runtime import from_dlpack

    mask = torch.full((12, 6), -1, dtype=torch.int32)
    _store_mask(from_dlpack(mask), 3, 40, 9, 5)  # the pass claims rows 3..39; M = 9, N = 5
    expected = torch.zeros(12, 6, dtype=torch.int32)
    expected[3:9, :5] = 1
    assert torch.equal(mask, expected)


def test_k_grouped_pass_extent_reduces_over_the_experts_k_tiles():
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    from cutlass.cute.runtime import from_dlpack

    offs = torch.tensor([0, 1, 1, 4, 20], dtype=torch.int32)  # in 64-wide k-tiles
    extents = torch.full((4, 4), -1, dtype=torch.int32)
    _k_group_extents(from_dlpack(offs), from_dlpack(extents), 4, 300)
    assert extents.tolist() == [[0, 300, 0, 1], [0, 300, 1, 1], [0, 300, 1, 4], [0, 300, 4, 20]]


@pytest.mark.parametrize("tile_n", [128, 256])
def test_epilogue_thread_owns_one_row_and_consecutive_columns(tile_n):
    """The kernel's epilogue partition (``epilogue_partition``, run on the host by the DSL):
    thread t of the tile holds row 128 * m_tile + t, and register i of subtile s holds column
    tile_n * n_tile + 32 * s + i. The shared-memory transpose of the epilogue indexes its
    per-warp 32 x 32 staging tile with exactly these offsets; any other mapping would write
    outside it."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    from cutlass.cute.runtime import from_dlpack

    threads = (0, 1, 31, 32, 77, 127)
    out = torch.full((len(threads), tile_n // 32, 32, 2), -1, dtype=torch.int32)
    _epilogue_coordinates(from_dlpack(out), tile_n, threads)
    rows = 128 + torch.tensor(threads).view(-1, 1, 1).expand(-1, tile_n // 32, 32)
    cols = 2 * tile_n + torch.arange(tile_n).view(1, tile_n // 32, 32).expand(len(threads), -1, -1)
    assert torch.equal(out[..., 0], rows.to(torch.int32))
    assert torch.equal(out[..., 1], cols.to(torch.int32))


if _host.dsl_import_error() is None:

    @cute.jit
    def _ring_views(rows: cutlass.Constexpr, found: cutlass.Constexpr):
        import cutlass.utils.blackwell_helpers as sm100_utils
        from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

        from minite_kernels.cute._blockscaled_gemm_impl import k96_byte_view_layout

        mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
            cutlass.Float4E2M1FN, cutlass.Float4E2M1FN, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float8E4M3FN, 16, tcgen05.CtaGroup.ONE, (128, rows),
        )
        fp4 = sm100_utils.make_smem_layout_b(mma, (128, rows, 256), cutlass.Float4E2M1FN, 3)
        byte = k96_byte_view_layout(rows, 3)
        found["swizzles"] = (str(fp4.inner), str(byte.inner))
        found["offsets"] = [
            (fp4.outer(((r, e % 64), 0, e // 64, st)), byte.outer(((r, (e // 2) % 16), 0, e // 32, st)))
            for st in range(3) for r in (0, 1, 7, 8, 31, rows - 1) for e in (0, 2, 30, 32, 62, 64, 126, 128, 200, 254)
        ]


@pytest.mark.parametrize("rows", [128, 256])
def test_k96_byte_view_is_the_memory_tma_fills(rows):
    """The K = 96 MMAs read the A/B ring through a byte view (16-byte chunks of 128-byte rows)
    of buffers that TMA fills through the K = 64 kernel's FP4 layout: both views carry the same
    128B swizzle (applied to the byte address) and map every (stage, row, K element) to the
    same byte, so chunk c of a row is K elements 32 c .. 32 c + 31 of that buffer."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    found: dict = {}
    _ring_views(rows, found)
    assert found["swizzles"] == ("S<3,4,3>", "S<3,4,3>")
    assert all(fp4 == 2 * byte for fp4, byte in found["offsets"]), found["offsets"][:8]


def test_cutlass_dsl_offers_the_sm103_k96_nvf4_mma_on_the_same_scale_layout():
    """What a B300 (sm_103a) K = 96 variant would build on, pinned against the installed DSL
    (4.8.1): ``SM103MmaMXF4NVF4Op`` is a K = 96 ``kind::mxf4nvf4`` MMA with 16-element UE4M3
    scales (NVFP4), and its scale-factor atom (``Sm103BlockScaledBasicChunk``) addresses every
    (row, K block) at the byte where the contract's 128x4 swizzle stores it: the host-side
    scale layout does not change (the K = 96 kernel, selected on sm_103a, reads the same
    swizzled scales)."""
    if _host.dsl_import_error() is not None:
        pytest.skip(_host.dsl_import_error())
    found: dict = {}
    _sm103_facts(found)
    assert found["op"] == "SM103MmaMXF4NVF4Op" and found["mnk"] == (128, 256, 96)
    ids = torch.arange(256 * 12, dtype=torch.int32).reshape(256, 12) + 1
    swizzled = per_group_swizzle(ids.unsqueeze(0))
    assert_bitwise_equal(swizzled[torch.tensor(found["offsets"])].reshape(256, 12), ids, "sm103 scale chunk")


# ---- backend ---------------------------------------------------------------------------------
def test_backend_is_unavailable_on_cpu_with_reason():
    assert BACKEND.name == "blackwell"
    assert not BACKEND.available(torch.device("cpu"))
    assert "CUDA device" in BACKEND.why_not(torch.device("cpu"))
    assert "CUDA device" in BACKEND.why_not(None)
    reasons = nvfp4.available_backends("cpu")
    assert reasons["blackwell"] and "CUDA" in reasons["blackwell"]
    with pytest.raises(BackendUnavailable, match="blackwell"):
        nvfp4.get_backend("blackwell", "cpu")


@pytest.mark.parametrize(
    "capability,expected",
    [((9, 0), "is 9.0"), ((12, 0), "is 12.0"), ((10, 1), "is 10.1"), ((10, 0), None), ((10, 3), None)],
)
def test_backend_availability_by_compute_capability(monkeypatch, capability, expected):
    """Only 10.0 (sm_100a) and 10.3 (sm_103a) qualify; Hopper and consumer Blackwell are named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "FakeGPU")
    monkeypatch.setattr(_host, "dsl_import_error", lambda: None)
    reason = BACKEND.why_not(torch.device("cuda", 0))
    if expected is None:
        assert reason is None and BACKEND.available(torch.device("cuda", 0))
        assert _host.device_arch("cuda:0") == {(10, 0): "sm_100a", (10, 3): "sm_103a"}[capability]
    else:
        assert expected in reason and "FakeGPU" in reason
        with pytest.raises(BackendUnavailable, match="compute capability"):
            _host.device_arch("cuda:0")


def test_backend_reports_a_missing_dsl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(_host, "dsl_import_error", lambda: "the CUTLASS Python DSL is not importable (x)")
    assert "CUTLASS Python DSL" in BACKEND.why_not(torch.device("cuda", 0))


@pytest.mark.parametrize("tile", [(1, 16), (16, 16)])
def test_backend_quantize_is_the_contract_with_swizzled_scales(tile):
    """Quantization delegates (Triton when available, else the reference) and hands back the
    scales in the layout the GEMMs read; codes, scales and global scales stay bitwise."""
    x = torch.randn(48, 128, generator=torch.Generator().manual_seed(7)) * 3
    x[0, :16] = 0.0
    x[1, 5] = 1e30
    gs = "row" if tile == (1, 16) else "tensor"
    q = BACKEND.quantize(x, global_scale=gs, tile=tile)
    assert q.layout == "swizzled"
    assert_nvfp4_equal(q, nvfp4.quantize_reference(x, global_scale=gs, tile=tile), "blackwell.quantize")


def test_backend_grouped_wgrad_validates_then_needs_blackwell():
    g = torch.Generator().manual_seed(3)
    dy, x = torch.randn(40, 32, generator=g), torch.randn(40, 64, generator=g)
    with pytest.raises(ValueError, match="disagree"):
        BACKEND.grouped_wgrad(dy, x, [7, 0, 30])
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        BACKEND.grouped_wgrad(dy, x, [7, 0, 33])


# ---- wgrad (K-grouped) host side ---------------------------------------------------------------
def _wgrad_operands(sizes, n=24, k=40, seed=0, rounding="nearest"):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(sum(sizes), n, generator=g)
    x = torch.randn(sum(sizes), k, generator=g) * 4
    qa = nvfp4.quantize_wgrad_operand(dy, sizes, rounding=rounding, seed=5 if rounding == "stochastic" else None)
    qb = nvfp4.quantize_wgrad_operand(x, sizes, global_scale="row")
    return qa, qb, nvfp4.padded_group_sizes(sizes)


@pytest.mark.parametrize("sizes", [[1, 0, 33, 16, 100], [0, 0, 5], [64, 128], [17]])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_align_groups_keeps_the_contract_product_bitwise(sizes, rounding):
    """Moving experts to 64-aligned token columns (what the wgrad kernel needs) adds only zero
    blocks: the reference product of the aligned operands is bitwise the original one."""
    from minite_kernels.cute.grouped_wgrad_gemm import _aligned_sizes, align_groups

    qa, qb, padded = _wgrad_operands(sizes, rounding=rounding)
    aligned = _aligned_sizes(padded)
    a2, b2 = align_groups(qa, padded), align_groups(qb, padded)
    assert a2.k == b2.k == sum(aligned) and all(s % 64 == 0 for s in aligned)
    expected = nvfp4.grouped_wgrad_gemm_reference(qa, qb, padded)
    assert_bitwise_equal(nvfp4.grouped_wgrad_gemm_reference(a2, b2, aligned), expected, "aligned wgrad")
    # every expert's columns are moved verbatim, the gaps are zero codes and zero scales
    src = dst = 0
    for p, q in zip(padded, aligned):
        assert_bitwise_equal(a2.image_fp32()[:, dst : dst + p], qa.image_fp32()[:, src : src + p], "moved")
        assert not a2.codes[:, (dst + p) // 2 : (dst + q) // 2].any()
        assert not a2.linear_scales()[:, (dst + p) // 16 : (dst + q) // 16].view(torch.uint8).any()
        src, dst = src + p, dst + q


def test_align_groups_is_a_no_op_when_aligned():
    from minite_kernels.cute.grouped_wgrad_gemm import align_groups

    qa, _, padded = _wgrad_operands([64, 0, 128])
    assert align_groups(qa, padded) is qa


def test_wgrad_gemm_validation():
    from minite_kernels.cute.grouped_wgrad_gemm import nvfp4_grouped_wgrad_gemm, validate_wgrad_operands

    qa, qb, padded = _wgrad_operands([1, 0, 33])
    with pytest.raises(ValueError, match="sum to"):
        nvfp4_grouped_wgrad_gemm(qa, qb, [16, 0, 32])
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_grouped_wgrad_gemm(qa, qb, [8, 8, 48])
    with pytest.raises(TypeError, match="NVFP4Tensor"):
        nvfp4_grouped_wgrad_gemm(qa.codes, qb, padded)
    with pytest.raises(BackendUnavailable, match="CUDA device"):
        nvfp4_grouped_wgrad_gemm(qa, qb, padded)
    raw = dict(
        a_codes=torch.zeros(24, 64, dtype=torch.uint8),
        a_scales=nvfp4.swizzle_scales(_random_scales(24, 8)),
        a_global=torch.ones(24),
        b_codes=torch.zeros(40, 64, dtype=torch.uint8),
        b_scales=nvfp4.swizzle_scales(_random_scales(40, 8)),
        b_global=torch.ones(1),
        k_offsets=torch.tensor([0, 1, 1, 2], dtype=torch.int32),
        out_dtype=torch.float32,
    )
    assert validate_wgrad_operands(**raw) == (24, 40, 128, 3)
    with pytest.raises(ValueError, match="int32"):
        validate_wgrad_operands(**dict(raw, k_offsets=torch.tensor([0, 2])))
    with pytest.raises(ValueError, match="multiple of 64"):
        validate_wgrad_operands(
            **dict(raw, a_codes=torch.zeros(24, 48, dtype=torch.uint8), b_codes=torch.zeros(40, 48, dtype=torch.uint8))
        )
    with pytest.raises(ValueError, match="2\\^31"):
        validate_wgrad_operands(**dict(raw, k_offsets=torch.zeros(2**22 + 1, dtype=torch.int32)))


# ---- the premise of the GPU bitwise tests ------------------------------------------------------
@pytest.mark.parametrize("m,n,k", [(5, 7, 64), (33, 20, 320), (9, 3, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_exact_data_makes_any_accumulation_order_bitwise(exact_operand, m, n, k, with_bias):
    """test_cute_gpu.py expects the tensor cores to match the reference bit for bit on
    exact data whatever their accumulation order. Checked here: the canonical-order reference
    equals the exact (fp64) sum pushed through the same epilogue, and a reversed-K-order fp32
    accumulation gives the same accumulator."""
    from minite_megatron.nvfp4.gemm import block_partials_accumulate, epilogue

    gen = torch.Generator().manual_seed(m * n + k)
    a, b = exact_operand(m, k, gen), exact_operand(n, k, gen)
    bias = torch.randn(n, generator=gen) if with_bias else None
    ref = nvfp4.gemm_reference(a, b, bias)
    ia, ib = a.image_fp32(), b.image_fp32()
    exact_acc = (ia.double() @ ib.double().t()).float()
    assert torch.equal(exact_acc.double(), ia.double() @ ib.double().t())  # exact in fp32
    reversed_acc = block_partials_accumulate(ia.flip(1), ib.flip(1))
    assert_bitwise_equal(reversed_acc, exact_acc, "reversed-order accumulator")
    via_exact = epilogue(exact_acc, a.row_global_decode(), b.row_global_decode(), bias, torch.bfloat16)
    assert_bitwise_equal(ref, via_exact, "reference vs exact sum")


def test_exact_grouped_operands_match_the_grouped_reference_structure(exact_operand):
    gen = torch.Generator().manual_seed(1)
    b = exact_operand(24, 128, gen, lead=(3,))
    assert b.global_scale == "group" and tuple(b.shape) == (3, 24, 128) and b.global_decode.shape == (3,)
    a = exact_operand(10, 128, gen)
    out = nvfp4.grouped_gemm_reference(a, b, [4, 0, 6])
    assert out.shape == (10, 24) and torch.isfinite(out.float()).all()


def test_host_offsets_are_accepted_beside_device_operands():
    """The public function passes host offsets for host group sizes: the raw op checks them
    without a device read-back and copies them over (no sync); device offsets must sit on the
    operands' device."""
    a, b = _grouped_quantized()
    meta = torch.device("meta")
    args = dict(
        a_codes=a.codes.to(meta), a_scales=operand_scales(a).to(meta), a_global=a.row_global_decode().to(meta),
        b_codes=b.codes.to(meta), b_scales=grouped_weight_scales(b).to(meta), b_global=b.global_decode.to(meta),
        bias=None, out_dtype=torch.bfloat16,
    )
    good = torch.tensor([0, 5, 5, 135, 136], dtype=torch.int32)
    assert validate_grouped_operands(**args, offsets=good) == (136, 80, 128, 4)
    with pytest.raises(ValueError, match="end at M"):
        validate_grouped_operands(**args, offsets=torch.tensor([0, 5, 5, 135, 137], dtype=torch.int32))
    cpu_args = dict(args, a_codes=a.codes)
    with pytest.raises(ValueError, match="several devices"):
        validate_grouped_operands(**cpu_args, offsets=good.to(meta))
    assert group_offsets([5, 0, 130, 1], 136, meta).device.type == "cpu"  # host sizes stay on the host


@pytest.mark.parametrize("op", nvfp4.backends.INVARIANT_OPS)
def test_batch_invariant_ops_are_the_fallbacks_kernels(op):
    """Strict mode on Blackwell keeps the Triton ``bi_*`` kernels (no CuTe DSL formulation): the
    backend answers ``supports`` as its fallback does, and runs the fallback's method. On a CPU the
    fallback is Triton where it is interpreted, else the reference (which refuses with the reason
    that sends the caller to the torch formulation)."""
    from minite_kernels.cute.backend import _fallback_backend

    fallback = _fallback_backend(torch.device("cpu"))
    assert BACKEND.supports(op, device=torch.device("cpu")) == fallback.supports(op)
    assert type(BACKEND).__dict__[op] is not nvfp4.backends.Backend.__dict__[op]
    if op == "bi_log_softmax":  # the call itself goes to the fallback: its bits, or its refusal
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        if fallback.supports(op) is None:
            assert_bitwise_equal(BACKEND.bi_log_softmax(x), fallback.bi_log_softmax(x), "bi_log_softmax")
        else:
            with pytest.raises(nvfp4.OpNotSupported):
                BACKEND.bi_log_softmax(x)


def test_output_fill_is_a_backend_option():
    """The bring-up's NaN-filled outputs are an option of a backend instance, not a module global:
    the shared backend allocates uninitialised outputs, one built with ``output_fill`` fills them."""
    from minite_kernels.cute.backend import BlackwellBackend

    assert BACKEND.output_fill is None and BlackwellBackend(output_fill=float("nan")).output_fill != 0
    assert torch.isnan(_host.new_output(3, 5, dtype=torch.bfloat16, device=torch.device("cpu"), fill=float("nan"))).all()
    assert _host.new_output(3, 5, dtype=torch.bfloat16, device=torch.device("cpu")).shape == (3, 5)
    assert not hasattr(_host, "OUTPUT_FILL")
