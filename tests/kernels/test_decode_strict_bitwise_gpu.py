"""The strict decode GEMMs give the learner's bits at the real model's shapes, on the GPU.

Strict mode's promise (learner log-probs == sampler log-probs) rests on one fact only the GPU can
answer: the rollout's decode kernels in their strict configuration (packed FP4 weights, a few
rows) produce, bit for bit, the rows the learner's strict image GEMM produces for the same rows
inside a 4096-row GEMM. The interpreter tests (``tests/kernels/triton/decode/test_triton_decode.py``)
pin it at small shapes, where the K loop is short; these pin it where a wrong accumulation order
would show: Qwen3-30B-A3B's K (qkv 2048, o 4096, expert fc1 2048 / fc2 768), rows taken at several
offsets, fp32 and bf16 outputs, fresh random data and adversarial rows (magnitudes spread over
2^+-12 inside every row and block, so any reordering of the fp32 sums changes bits). Also: the
default (split-K) decode stays within the contract's fp32 accumulation bound there, and the decode
ops replay in a CUDA graph with the eager bits.

Everything goes through the backend (``get_backend("triton", "cuda")``) with its options forcing
the decode kernels on (``decode_kernels``, ``strict_decode``; ``decode_max_m`` raised to 64 to
cover the rows a decode batch can have), against the same backend with them off.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
BIG = 4096  # the learner's rows: a 4096-token micro-batch
#: Qwen3-30B-A3B's dense decode GEMMs as (K, N): attention qkv and o
DENSE = {"qkv": (2048, 5120), "o": (4096, 2048)}
#: its experts as (K, N): fc1 (gate + up) and fc2, 128 experts, top-8
EXPERTS, TOPK = 128, 8
GROUPED = {"fc1": (2048, 1536), "fc2": (768, 2048)}


def _random(*shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g)


def _adversarial(*shape, seed):
    """Normal values times 2^U(-12, 12) per element: wide magnitudes within every row and block."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g) * torch.exp2(
        torch.randint(-12, 13, shape, device="cuda", generator=g).float())


DATA = {"random": _random, "adversarial": _adversarial}


@pytest.fixture(scope="module")
def backends():
    """(decode kernels forced on, decode kernels off): the same Triton backend, two option sets."""
    base = nvfp4.get_backend("triton", "cuda")
    on = type(base)(replace(base.options, decode_kernels=True, strict_decode=True, decode_max_m=64))
    off = type(base)(replace(base.options, decode_kernels=False))
    return on, off


def rows_of(q: nvfp4.NVFP4Tensor, start: int, m: int) -> nvfp4.NVFP4Tensor:
    """Rows ``start:start+m`` of a row-scaled activation (what quantizing those rows alone gives)."""
    assert q.global_scale == "row"
    return replace(q, codes=q.codes[start:start + m], block_scales=q.block_scales[start:start + m],
                   global_decode=q.global_decode[start:start + m], shape=torch.Size([m, q.k]),
                   image=None if q.image is None else q.image[start:start + m])


def _weights(n, k, data, seed):
    return nvfp4.quantize(data(n, k, seed=seed) * 0.02, global_scale="tensor", tile=(16, 16), backend="triton",
                          with_image=True)


@functools.lru_cache(maxsize=4)
def _dense_case(shape, data):
    """A 4096-row activation and the weight of ``shape``, quantized (shared by a worker's M cases)."""
    k, n = DENSE[shape]
    gen = DATA[data]
    return nvfp4.quantize(gen(BIG, k, seed=1), backend="triton", with_image=True), _weights(n, k, gen, seed=2)


#: The row counts M, grouped by the kernel a launch compiles: Triton specializes an int argument
#: on == 1 and on multiples of 16, and M_PAD is 16 up to 16 rows, 64 above 32. M = 3 and 8 share
#: one compiled kernel, so they share a test.
M_BY_KERNEL = [(1,), (3, 8), (16,), (33,), (64,)]


# One test per (shape, compiled kernel, dtype): each compiles its own kernel specialization (the
# strict chain runs the whole K unrolled), and xdist spreads them over the workers; both data kinds
# and the row counts of one specialization run in the same test, so they reuse its compiled kernel
# instead of compiling it again on another worker.
@pytest.mark.parametrize("dt", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ms", M_BY_KERNEL, ids=["+".join(map(str, ms)) for ms in M_BY_KERNEL])
@pytest.mark.parametrize("shape", sorted(DENSE))
def test_dense_strict_decode_rows_equal_the_learners_strict_gemm(backends, shape, ms, dt):
    """Strict dense decode of M rows at offsets 0, 29 and the end of a 4096-row batch == those rows
    of the learner's strict GEMM of the whole batch, random and adversarial data (a different K
    order in the decode kernel's strict chain shows as differing bits)."""
    on, off = backends
    for data in sorted(DATA):
        qx, qw = _dense_case(shape, data)
        learner = off.gemm(qx, qw, out_dtype=dt, batch_invariant=True)
        for m, start in ((m, start) for m in ms for start in sorted({0, 29, BIG - m})):
            part = rows_of(qx, start, m)
            where = f"{shape} {data} M={m} rows {start}: {dt}"
            assert_bitwise_equal(on.gemm(part, qw, out_dtype=dt, batch_invariant=True),
                                 learner[start:start + m], f"strict decode, {where}")
            assert_bitwise_equal(off.gemm(part, qw, out_dtype=dt, batch_invariant=True),
                                 learner[start:start + m], f"the learner's strict GEMM alone, {where}")


@pytest.mark.parametrize("shape", sorted(DENSE))
def test_dense_default_decode_within_the_accumulation_bound(backends, shape):
    """The default (split-K) dense decode at the real K: within ``fp32_accumulation_bound`` plus
    one output rounding of the exact product, M = 1 / 3 / 16 / 64, adversarial rows."""
    on, _ = backends
    k, n = DENSE[shape]
    qw = _weights(n, k, _adversarial, seed=3)
    for m in (1, 3, 16, 64):
        qa = nvfp4.quantize(_adversarial(m, k, seed=10 + m), backend="triton", with_image=True)
        for dt in (torch.float32, BF16):
            got = on.gemm(qa, qw, out_dtype=dt)
            exact, bound = nvfp4.fp32_accumulation_bound(qa, qw)
            assert_within(got, exact, gemm_output_bound(exact, bound, dt), f"default decode {shape} M={m} {dt}")


def _routing(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(tokens)]).reshape(-1).to(
        torch.int32).cuda()


@pytest.mark.parametrize("data", sorted(DATA))
@pytest.mark.parametrize("shape", sorted(GROUPED))
def test_grouped_strict_decode_rows_equal_the_learners_strict_grouped_gemm(backends, shape, data):
    """Strict MoE decode of 1 / 8 / 64 tokens x top-8 of 128 experts (rows unsorted) == the
    learner's strict grouped GEMM on the same rows sorted by expert, fp32 and bf16."""
    on, off = backends
    k, n = GROUPED[shape]
    gen = DATA[data]
    qw = nvfp4.quantize(gen(EXPERTS, n, k, seed=4) * 0.02, global_scale="group", tile=(16, 16), backend="triton",
                        with_image=True)
    for tokens in (1, 8, 64):
        ids = _routing(tokens, seed=tokens)
        qa = nvfp4.quantize(gen(tokens * TOPK, k, seed=5 + tokens), backend="triton", with_image=True)
        order = torch.argsort(ids.long(), stable=True)
        sizes = torch.bincount(ids.long(), minlength=EXPERTS).tolist()
        sorted_rows = replace(qa, codes=qa.codes[order], block_scales=qa.block_scales[order],
                              global_decode=qa.global_decode[order], image=qa.image[order])
        for dt in (torch.float32, BF16):
            learner = off.grouped_gemm(sorted_rows, qw, sizes, out_dtype=dt, batch_invariant=True)
            expect = torch.empty_like(learner)
            expect[order] = learner
            got = on.decode_grouped_gemm(qa, qw, ids, dt, batch_invariant=True)
            assert_bitwise_equal(got, expect, f"strict grouped decode {shape} {data} {tokens} tokens {dt}")


@pytest.mark.parametrize("shape", sorted(GROUPED))
def test_grouped_default_decode_within_the_accumulation_bound(backends, shape):
    """The default-mode MoE decode (the integer-dot kernel, ``TritonOptions.idot_decode``) of 8 / 64
    tokens x top-8 of 128 experts at the real K, adversarial rows: every row within
    ``fp32_accumulation_bound`` plus one output rounding of its expert's exact product, fp32 and bf16;
    rows given sorted by expert (``group_offsets``) give the unsorted call's bits."""
    on, _ = backends
    assert on.idot_decode_ok(torch.device("cuda"))
    k, n = GROUPED[shape]
    qs = [_weights(n, k, _adversarial, seed=40 + e) for e in range(EXPERTS)]
    st = nvfp4.grouped.stack_expert_weights(qs)
    for tokens in (8, 64):
        ids = _routing(tokens, seed=50 + tokens)
        qa = nvfp4.quantize(_adversarial(tokens * TOPK, k, seed=60 + tokens), backend="triton", with_image=True)
        for dt in (torch.float32, BF16):
            got = on.decode_grouped_gemm(qa, st, ids, dt)
            for e in torch.unique(ids).tolist():
                rows = (ids == e).nonzero().reshape(-1)
                exact, bound = nvfp4.fp32_accumulation_bound(nvfp4.grouped._take_rows(qa, rows), qs[e])
                assert_within(got[rows], exact, gemm_output_bound(exact, bound, dt),
                              f"default grouped decode {shape} {tokens} tokens expert {e} {dt}")
            order = torch.argsort(ids.long(), stable=True)
            offsets = torch.zeros(EXPERTS + 1, dtype=torch.int32, device="cuda")
            offsets[1:] = torch.cumsum(torch.bincount(ids.long(), minlength=EXPERTS), 0)
            by_offsets = on.decode_grouped_gemm(nvfp4.grouped._take_rows(qa, order), st, ids[order], dt,
                                                group_offsets=offsets)
            assert_bitwise_equal(by_offsets, got[order], f"sorted rows by offsets {shape} {tokens} tokens {dt}")


def test_decode_ops_replay_in_a_cuda_graph_with_the_eager_bits(backends):
    """Dense and grouped decode, default and strict, at fc1's shape (K 2048, N 1536, 128 experts,
    64 rows) captured in one CUDA graph: replays on fresh inputs copied into the captured buffers
    equal eager calls bit for bit (a host sync or a shape-dependent launch inside would fail)."""
    on, _ = backends
    k, n = GROUPED["fc1"]
    qw = nvfp4.quantize(_random(EXPERTS, n, k, seed=6) * 0.02, global_scale="group", tile=(16, 16), backend="triton")
    qd = _weights(n, k, _random, seed=7)
    a = nvfp4.quantize(_random(64, k, seed=8), backend="triton", with_image=True)
    ids = _routing(8, seed=9)

    def step():
        return ([on.gemm(rows_of(a, 0, 16), qd, batch_invariant=s) for s in (False, True)]
                + [on.decode_grouped_gemm(a, qw, ids, BF16, batch_invariant=s) for s in (False, True)])

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for trial in range(3):
        fresh = nvfp4.quantize(_random(64, k, seed=20 + trial), backend="triton", with_image=True)
        a.codes.copy_(fresh.codes)
        a.block_scales.copy_(fresh.block_scales)
        a.global_decode.copy_(fresh.global_decode)
        a.image.copy_(fresh.image)
        ids.copy_(_routing(8, seed=30 + trial))
        graph.replay()
        torch.cuda.synchronize()
        for i, (o, e) in enumerate(zip(outs, step())):
            assert_bitwise_equal(o, e, f"graph replay {trial}, output {i}")
