"""Decode GEMMs on packed FP4 weights (dense :mod:`decode_gemm`, MoE :mod:`decode_grouped_gemm`)
against the contract.

Rules: default configurations lie within ``fp32_accumulation_bound`` + one output rounding of
the exact product (``gemm_output_bound``); strict configurations are bitwise equal, row by
row, to the learner's strict GEMMs (``gemm_forward`` / ``grouped_gemm`` with
``batch_invariant=True``) -- under the interpreter both are the contract's canonical order, so
they also equal the reference. Covers M = 1 / odd / 16 / 64, N and K tails, bias, every output
dtype, expert groups of size 0, 1 and more than one row chunk, unsorted and repeated experts,
non-finite scales and bad expert ids.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.grouped import stack_expert_weights
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound

from minite_kernels.triton._build._testing import DEVICE, INTERPRETING, heavy_tailed, kernels_runnable, randn

pytestmark = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")

from minite_kernels.triton.backend import BACKEND  # noqa: E402
from minite_kernels.triton.decode.decode_gemm import decode_gemm_forward  # noqa: E402
from minite_kernels.triton.decode.decode_grouped_gemm import decode_grouped_gemm_forward  # noqa: E402
from minite_kernels.triton.nvfp4.gemm import gemm_forward  # noqa: E402


def q(x, **kw):
    return nvfp4.quantize_reference(x, **kw)


def dev(t):
    return replace(t, codes=t.codes.to(DEVICE), block_scales=t.block_scales.to(DEVICE),
                   global_decode=t.global_decode.to(DEVICE), image=None if t.image is None else t.image.to(DEVICE))


def cpu(t):
    return replace(t, codes=t.codes.cpu(), block_scales=t.block_scales.cpu(), global_decode=t.global_decode.cpu(),
                   image=None if t.image is None else t.image.cpu())


def decode(qa, qb, bias=None, out_dtype=torch.bfloat16, strict=False):
    return decode_gemm_forward(qa.image.to(DEVICE), qb.codes.to(DEVICE), qb.block_scales.to(DEVICE),
                               qa.global_decode.to(DEVICE), qb.global_decode.to(DEVICE),
                               None if bias is None else bias.to(DEVICE), out_dtype, strict).cpu()


def learner_strict(qa, qb, bias=None, out_dtype=torch.bfloat16):
    img_b = qb.image if qb.image is not None else qb.image_fp32().to(torch.bfloat16)
    return gemm_forward(qa.image.to(DEVICE), img_b.to(DEVICE), qa.global_decode.to(DEVICE),
                        qb.global_decode.to(DEVICE), None if bias is None else bias.to(DEVICE), out_dtype,
                        batch_invariant=True).cpu()


def within_bound(out, qa, qb, bias=None, out_dtype=torch.bfloat16, name="decode"):
    exact, bound = nvfp4.fp32_accumulation_bound(qa, qb, bias)
    assert_within(out, exact, gemm_output_bound(exact, bound, out_dtype), name)


# ---- dense ------------------------------------------------------------------------------------
@pytest.mark.parametrize("m, n, k, out_dtype", [(1, 48, 128, torch.bfloat16), (3, 40, 96, torch.float32),
                                                (16, 64, 64, torch.float16), (64, 24, 48, torch.bfloat16)])
def test_dense_default_within_bound(m, n, k, out_dtype):
    """N tails (40, 24 against 16-row tiles), K tails (96, 48 against 32-wide steps), bias."""
    qa = q(randn(m, k, seed=m, scale=3.0), with_image=True)
    qb = q(heavy_tailed(n, k, seed=n), global_scale="tensor")
    bias = randn(n, seed=9)
    within_bound(decode(qa, qb, bias, out_dtype), qa, qb, bias, out_dtype)


@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_dense_strict_rows_equal_the_learners_strict_gemm(m):
    """Strict decode = the learner's strict image GEMM, bit for bit (and, under the interpreter,
    the contract's reference); fresh random rows and heavy-tailed weights."""
    qa = q(randn(m, 128, seed=100 + m, scale=2.0), with_image=True)
    qb = q(heavy_tailed(48, 128, seed=101), global_scale="tensor", tile=(16, 16), with_image=True)
    bias = randn(48, seed=102)
    out = decode(qa, qb, bias, strict=True)
    assert_bitwise_equal(out, learner_strict(qa, qb, bias), f"strict decode M={m}")
    if INTERPRETING:
        assert_bitwise_equal(out, nvfp4.gemm_reference(qa, qb, bias), "strict decode vs reference")


def test_dense_strict_is_batch_invariant():
    """Row r of strict decode at M = 1 / 7 / 64 equals row r inside the learner's larger GEMM."""
    big_m = 4096 if not INTERPRETING else 96
    qa = q(randn(big_m, 64, seed=7), with_image=True)
    qb = q(randn(32, 64, seed=8), global_scale="tensor", tile=(16, 16), with_image=True)
    full = learner_strict(qa, qb)
    for m in (1, 7, 64):
        for start in (0, 29):
            rows = nvfp4.grouped._take_rows(qa, torch.arange(start, start + m))
            assert_bitwise_equal(decode(rows, qb, strict=True), full[start : start + m], f"M={m} at row {start}")


def test_dense_nonfinite_scale_propagates_and_zero_rows():
    """A NaN weight gives its block a NaN scale (per-row global scales keep the other rows
    finite): exactly the reference's NaN outputs are NaN."""
    w = randn(32, 64, seed=3)
    w[5, 17] = float("nan")
    qb = q(w, global_scale="row")
    qa = q(randn(2, 64, seed=4), with_image=True)
    nan = torch.isnan(decode(qa, qb))
    assert torch.equal(nan, torch.isnan(nvfp4.gemm_reference(qa, qb))) and nan[:, 5].all() and nan.sum() == 2
    assert decode(q(randn(0, 64), with_image=True), qb).shape == (0, 32)
    with pytest.raises(ValueError, match="multiple of 16"):
        decode_gemm_forward(torch.zeros(1, 40, dtype=torch.bfloat16), torch.zeros(8, 20, dtype=torch.uint8),
                            torch.zeros(8, 2, dtype=torch.uint8), torch.ones(1), torch.ones(1))


def test_backend_gemm_dispatches_small_m_to_decode():
    """``backend.gemm`` at M <= DECODE_MAX_M takes the decode kernel (default and, where allowed,
    strict) and stays within the bound / equal to the learner's strict GEMM."""
    qa = q(randn(2, 3, 64, seed=20), with_image=True)
    qb = q(randn(40, 64, seed=21), global_scale="tensor", with_image=True)
    out = BACKEND.gemm(dev(qa), dev(qb)).cpu()
    assert out.shape == (2, 3, 40)
    within_bound(out.reshape(6, 40), qa.matrix(), qb)
    strict = BACKEND.gemm(dev(qa), dev(qb), batch_invariant=True).cpu()
    assert_bitwise_equal(strict.reshape(6, 40), learner_strict(qa.matrix(), qb), "strict dispatch")


# ---- grouped (MoE) ----------------------------------------------------------------------------
E, N, K = 6, 40, 64


@pytest.fixture(scope="module")
def experts():
    w = heavy_tailed(E, N, K, seed=30) * torch.logspace(-1, 1, E).view(E, 1, 1)
    return w, [q(w[e], global_scale="tensor") for e in range(E)]  # N = 40: 1x16 blocks


def grouped(a, st, ids, strict=False, out_dtype=torch.bfloat16):
    return BACKEND.decode_grouped_gemm(dev(a), dev(st), ids.to(DEVICE), out_dtype, strict).cpu()


def rows_within_bound(out, a, qs, ids):
    for r, e in enumerate(ids.tolist()):
        within_bound(out[r : r + 1], nvfp4.grouped._take_rows(a, torch.tensor([r])), qs[e], name=f"row {r}")


@pytest.mark.parametrize("ids", [[4, 0, 4, 2, 4, 0, 5], [3], [1] * 20 + [0] * 3])
def test_grouped_default_rows_within_bound(experts, ids):
    """Unsorted rows, repeated experts, experts chosen by no row, one row, an expert with more
    rows than one row chunk (20 > M_PAD)."""
    _, qs = experts
    ids = torch.tensor(ids, dtype=torch.int32)
    a = q(randn(len(ids), K, seed=len(ids), scale=2.0))
    out = grouped(a, stack_expert_weights(qs), ids)
    assert out.shape == (len(ids), N)
    rows_within_bound(out, a, qs, ids)


@pytest.mark.parametrize("ids", [[4, 0, 4, 2, 4, 0, 5], [1] * 20 + [0] * 3])
def test_grouped_strict_rows_equal_the_learners_strict_grouped_gemm(experts, ids):
    """Strict decode = the learner's strict grouped GEMM (rows sorted by expert), bit for bit,
    and, under the interpreter, the contract's reference; fp32 output too."""
    w, qs = experts
    ids = torch.tensor(ids, dtype=torch.int32)
    a = q(randn(len(ids), K, seed=40 + len(ids), scale=2.0), with_image=True)
    st = stack_expert_weights(qs)
    out = grouped(a, st, ids, strict=True)
    order = torch.argsort(ids.long(), stable=True)
    sizes = torch.bincount(ids.long(), minlength=E).tolist()
    qw = q(w, global_scale="group", with_image=True)
    learner = BACKEND.grouped_gemm(dev(nvfp4.grouped._take_rows(a, order)), dev(qw), sizes, batch_invariant=True).cpu()
    expect = torch.empty_like(learner)
    expect[order] = learner
    assert_bitwise_equal(out, expect, "strict grouped decode")
    if INTERPRETING:
        assert_bitwise_equal(out, nvfp4.decode_grouped_gemm_reference(a, st, ids), "vs reference")
        out32 = grouped(a, st, ids, strict=True, out_dtype=torch.float32)
        assert_bitwise_equal(out32, nvfp4.decode_grouped_gemm_reference(a, st, ids, torch.float32), "fp32")


@pytest.mark.parametrize("group", [1, 2, 3])
def test_grouped_strict_rolled_k_loop_gives_the_same_bits(experts, group):
    """The strict grouped decode with its K steps rolled into a loop of ``group``-step iterations
    (``GROUP``; 3 does not divide the 4 steps here: the launch takes 2) equals the unrolled chain
    bit for bit, fp32 and bf16 outputs: the same MMA steps in the same order."""
    from minite_kernels.triton.decode import decode_grouped_gemm as tg

    _, qs = experts
    ids = torch.tensor([4, 0, 4, 2, 4, 0, 5] * 3, dtype=torch.int32)
    a = q(randn(len(ids), K, seed=77, scale=2.0), with_image=True)
    st = stack_expert_weights(qs)
    m = st.matrix()
    cfg = tg.select_config(len(ids), N, K, E, 1, batch_invariant=True)
    for dt in (torch.float32, torch.bfloat16):
        outs = []
        for g in (0, group):
            out = torch.empty(len(ids), N, dtype=dt, device=DEVICE)
            tg.launch_decode_grouped(a.image.to(DEVICE), m.codes.to(DEVICE), m.block_scales.view(torch.uint8).to(DEVICE),
                                     st.global_decode.float().reshape(-1).to(DEVICE), ids.to(DEVICE),
                                     a.global_decode.float().reshape(-1).to(DEVICE), out, E, dict(cfg, GROUP=g))
            outs.append(out.cpu())
        assert_bitwise_equal(outs[1], outs[0], f"GROUP {group} vs unrolled ({dt})")
        assert_bitwise_equal(outs[0], grouped(a, st, ids, strict=True, out_dtype=dt), f"unrolled vs the op ({dt})")


def test_grouped_strict_launch_gives_the_learners_bits(experts):
    """The strict grouped launch (``GPU_STRICT_GROUPED_DECODE``: K steps rolled into 2-step
    iterations, the split-K code compiled out) equals the learner's strict grouped GEMM bit for bit,
    fp32 and bf16, with an expert of more rows than one row chunk and experts chosen by no row. On
    the GPU the launch is the op's own; under the interpreter its K-loop form (GROUP / ONE_SPLIT) on
    the interpreter's strict tile (16-wide K steps: the canonical order, so also the reference)."""
    from minite_kernels.triton.decode import decode_grouped_gemm as tg

    w, qs = experts
    ids = torch.tensor([1] * 20 + [4, 0, 4, 2, 4, 0, 5], dtype=torch.int32)
    a = q(randn(len(ids), K, seed=78, scale=2.0), with_image=True)
    st = stack_expert_weights(qs)
    m = st.matrix()
    cfg = tg.select_config(len(ids), N, K, E, 1, batch_invariant=True)
    if INTERPRETING:
        cfg = dict(cfg, GROUP=tg.GPU_STRICT_GROUPED_DECODE["GROUP"], ONE_SPLIT=tg.GPU_STRICT_GROUPED_DECODE["ONE_SPLIT"])
    order = torch.argsort(ids.long(), stable=True)
    sizes = torch.bincount(ids.long(), minlength=E).tolist()
    qw = q(w, global_scale="group", with_image=True)
    for dt in (torch.float32, torch.bfloat16):
        out = torch.empty(len(ids), N, dtype=dt, device=DEVICE)
        tg.launch_decode_grouped(a.image.to(DEVICE), m.codes.to(DEVICE), m.block_scales.view(torch.uint8).to(DEVICE),
                                 st.global_decode.float().reshape(-1).to(DEVICE), ids.to(DEVICE),
                                 a.global_decode.float().reshape(-1).to(DEVICE), out, E, cfg)
        learner = BACKEND.grouped_gemm(dev(nvfp4.grouped._take_rows(a, order)), dev(qw), sizes, out_dtype=dt,
                                       batch_invariant=True).cpu()
        expect = torch.empty_like(learner)
        expect[order] = learner
        assert_bitwise_equal(out.cpu(), expect, f"strict grouped launch vs the learner ({dt})")
        if INTERPRETING:
            assert_bitwise_equal(out.cpu(), nvfp4.decode_grouped_gemm_reference(a, st, ids, dt), f"vs reference ({dt})")


def test_rolled_group_divides_the_steps():
    from minite_kernels.triton.decode.decode_grouped_gemm import rolled_group

    assert [rolled_group(16, g) for g in (0, 1, 2, 3, 4, 16, 32)] == [0, 1, 2, 2, 4, 0, 0]
    assert [rolled_group(6, g) for g in (2, 3, 4, 5)] == [2, 3, 3, 3]


def test_grouped_learner_group_weights_and_matrix_form(experts):
    """The learner's ``"group"`` [E, N, K] weights (with their image) and the ``[E*N, K]`` matrix
    form with ``num_experts`` give the same bits as the stacked experts."""
    w, qs = experts
    ids = torch.tensor([5, 1, 1, 0], dtype=torch.int32)
    a = q(randn(4, K, seed=50))
    st = stack_expert_weights(qs)
    base = grouped(a, st, ids)
    qw = q(w, global_scale="group", with_image=True)
    assert_bitwise_equal(grouped(a, qw, ids), base, "group weights")
    mat = BACKEND.decode_grouped_gemm(dev(a), dev(st.matrix()), ids.to(DEVICE), num_experts=E).cpu()
    assert_bitwise_equal(mat, base, "matrix form")


@pytest.mark.parametrize("strict", [False, True])
def test_grouped_fallback_through_the_learners_grouped_gemm(experts, strict):
    """Where the decode kernels are not verified on a device, the backend sorts the rows on the
    device and runs the learner's grouped GEMM: same contract (bitwise in strict mode under the
    interpreter, where the learner's strict GEMM is the canonical order; the bound otherwise)."""
    _, qs = experts
    st = dev(stack_expert_weights(qs))
    ids = torch.tensor([4, 0, 4, 2, 4, 0, 5], dtype=torch.int32)
    a = q(randn(len(ids), K, seed=45), with_image=True)
    out = BACKEND._sorted_grouped_decode(dev(a), st, ids.to(DEVICE), E, N, K, torch.bfloat16, strict).cpu()
    rows_within_bound(out, a, qs, ids)
    if strict and INTERPRETING:
        assert_bitwise_equal(out, nvfp4.decode_grouped_gemm_reference(a, stack_expert_weights(qs), ids), "fallback")


def test_grouped_zero_rows_bad_ids_and_nan_rows(experts):
    _, qs = experts
    st = stack_expert_weights(qs)
    assert grouped(q(randn(0, K)), st, torch.zeros(0, dtype=torch.int32)).shape == (0, N)
    a = q(randn(3, K, seed=60))
    with pytest.raises(ValueError, match=r"expert_ids\[2\] = 6 is outside \[0, 6\)"):
        grouped(a, st, torch.tensor([0, 1, 6], dtype=torch.int32))
    # the kernel itself (what a CUDA graph runs, no check): rows of bad ids become NaN
    stm = dev(st).matrix()
    out = decode_grouped_gemm_forward(a.image_fp32().to(torch.bfloat16).to(DEVICE), stm.codes,
                                      stm.block_scales.view(torch.uint8), dev(st).global_decode,
                                      torch.tensor([0, -1, 6], dtype=torch.int32, device=DEVICE),
                                      a.global_decode.to(DEVICE), E).cpu()
    assert not torch.isnan(out[0]).any() and torch.isnan(out[1:]).all()
    # a backend told to skip the eager check (TritonOptions.check_expert_ids) runs that kernel as is
    from minite_kernels.triton.backend import TritonBackend, TritonOptions

    bad_ids = torch.tensor([0, -1, 6], dtype=torch.int32, device=DEVICE)
    unchecked = TritonBackend(TritonOptions(check_expert_ids=False))
    out = unchecked.decode_grouped_gemm(dev(a), dev(st), bad_ids, batch_invariant=True).cpu()
    assert not torch.isnan(out[0]).any() and torch.isnan(out[1:]).all()
    # and so does the fallback through the learner's grouped GEMM (sorted rows): no out-of-range
    # index (on a GPU a device-side assert that poisons the process), the good row's bits unchanged
    sorted_path = TritonBackend(TritonOptions(check_expert_ids=False, decode_kernels=False))
    for strict in (True, False):
        out = sorted_path.decode_grouped_gemm(dev(a), dev(st), bad_ids, batch_invariant=strict).cpu()
        good = sorted_path.decode_grouped_gemm(dev(a), dev(st), torch.zeros_like(bad_ids), batch_invariant=strict).cpu()
        assert torch.isnan(out[1:]).all()
        assert torch.equal(out[0].view(torch.int16), good[0].view(torch.int16))


def test_grouped_nonfinite_expert_weights_reach_only_their_rows(experts):
    w, _ = experts
    w = w.clone()
    w[2, 0, 3] = float("inf")
    qs = [q(w[e], global_scale="tensor") for e in range(E)]
    a = q(randn(3, K, seed=70))
    out = grouped(a, stack_expert_weights(qs), torch.tensor([2, 3, 2], dtype=torch.int32))
    assert torch.isnan(out[0]).any() and torch.isnan(out[2]).any() and not torch.isnan(out[1]).any()


# ---- GPU only ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_decode_ops_capture_and_replay_in_a_cuda_graph():
    """Dense and grouped decode (default and strict) in one CUDA graph: replays on fresh inputs
    written into the captured buffers give the eager results bit for bit (no host sync inside:
    capture would fail on one)."""
    qw = q(heavy_tailed(E, N, K, seed=80), global_scale="group", with_image=True)
    st = dev(qw)
    wm = st.matrix()
    qd = dev(q(randn(N, K, seed=81), global_scale="tensor"))
    a = dev(q(randn(24, K, seed=82), with_image=True))
    ids = torch.randint(0, E, (24,), dtype=torch.int32, device=DEVICE)

    def step():
        return [decode_gemm_forward(a.image[:16], qd.codes, qd.block_scales, a.global_decode[:16], qd.global_decode,
                                    None, torch.bfloat16, s) for s in (False, True)] + \
               [decode_grouped_gemm_forward(a.image, wm.codes, wm.block_scales, st.global_decode, ids, a.global_decode,
                                            E, torch.bfloat16, s) for s in (False, True)]

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (83, 84):
        fresh = dev(q(randn(24, K, seed=seed), with_image=True))
        a.image.copy_(fresh.image)
        a.global_decode.copy_(fresh.global_decode)
        ids.copy_(torch.randint(0, E, (24,), dtype=torch.int32, device=DEVICE))
        graph.replay()
        for o, e in zip(outs, step()):
            assert_bitwise_equal(o, e, "graph replay")


@pytest.mark.gpu
def test_grouped_within_bound_at_a_qwen3_expert_shape():
    """fc1 of Qwen3-30B-A3B experts (2048 -> 1536), 128 experts, 8 tokens x top-8."""
    e, n, k = 128, 1536, 2048
    w = randn(e, n, k, seed=90, scale=0.02).to(DEVICE)
    qs = [cpu(BACKEND.quantize(w[i], global_scale="tensor", tile=(16, 16))) for i in range(e)]  # = the reference
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(s))[:8] for s in range(8)])
    ids = ids.reshape(-1).to(torch.int32)
    a = q(randn(64, k, seed=91, scale=3.0))
    out = grouped(a, stack_expert_weights(qs), ids)
    rows_within_bound(out, a, qs, ids)
