"""The integer-dot MoE decode kernel (:mod:`minite_kernels.triton.decode.decode_grouped_idot`).

Its PTX (the code-word splits and the dp4a block dot) runs here on a small interpreter of its
instructions against the E2M1 values, for every code in every nibble. The kernel (interpreter on
the CPU, compiled on a GPU) against the contract: every row within ``fp32_accumulation_bound`` +
one output rounding of the exact product, for rows by expert ids (unsorted, repeated, more rows
than a pair, experts chosen by no row) and by group offsets (sorted), K and N tails, per-row weight
scales, every output dtype; *row invariance*: a row's bits do not depend on the other rows (their
number, order or experts) -- the same bits by ids and by offsets; bad ids give NaN rows;
non-finite weights reach only their experts' rows; the backend's default mode dispatches to it.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4.formats import e2m1_decode
from minite_megatron.nvfp4.grouped import _take_rows, stack_expert_weights
from minite_megatron.testing import assert_bitwise_equal, assert_within, gemm_output_bound

from minite_kernels.triton._build._testing import DEVICE, heavy_tailed, kernels_runnable, ptx_opcodes, randn, run_ptx
from minite_kernels.triton.decode.decode_grouped_idot import (
    IDOT_TABLES, _DOT_ASM, _W_ASM, _X_ASM, decode_grouped_idot_forward,
)

TWICE = [int(v) for v in (2 * e2m1_decode(torch.arange(16, dtype=torch.uint8)).float()).tolist()]


def _bytes(word):
    return [((word >> (8 * i)) & 0xFF) for i in range(4)]


def _signed(word):
    return [b - 256 if b & 0x80 else b for b in _bytes(word)]


def _split(asm, word):
    regs = run_ptx(asm, {"$4": word, "$5": IDOT_TABLES[0], "$6": IDOT_TABLES[1]})
    return [regs[f"${j}"] for j in range(4)]


# ---- the PTX, interpreted ---------------------------------------------------------------------
def _every_code_in_every_nibble(seed):
    """(nibbles, 32-bit word) for each code 0..15 at each of the 8 nibbles, the others random."""
    rng = random.Random(seed)
    for pos in range(8):
        for code in range(16):
            nibbles = [rng.randrange(16) for _ in range(8)]
            nibbles[pos] = code
            yield nibbles, sum(c << (4 * j) for j, c in enumerate(nibbles))


def test_weight_split_gives_the_magnitudes_of_positive_and_negative_codes():
    """Every code in every nibble of the word: P bytes = 2|e2m1| where the code is positive (0
    where negative), N bytes the other way round; nibble j of the word is element j."""
    for nibbles, word in _every_code_in_every_nibble(0):
        p_lo, p_hi, n_lo, n_hi = _split(_W_ASM, word)
        p, n = _bytes(p_lo) + _bytes(p_hi), _bytes(n_lo) + _bytes(n_hi)
        want = [(TWICE[c], 0) if TWICE[c] > 0 else (0, -TWICE[c]) for c in nibbles]
        assert list(zip(p, n)) == want, (nibbles, p, n)


def test_activation_split_gives_signed_values_and_their_negation():
    for nibbles, word in _every_code_in_every_nibble(1):
        x_lo, x_hi, y_lo, y_hi = _split(_X_ASM, word)
        x, y = _signed(x_lo) + _signed(x_hi), _signed(y_lo) + _signed(y_hi)
        assert x == [TWICE[c] for c in nibbles] and y == [-TWICE[c] for c in nibbles], (nibbles, x, y)


def test_block_dot_is_the_exact_integer_dot_product_of_the_block():
    """The three blocks together on random and extreme 16-element blocks: 4x the E2M1 dot."""
    rng = random.Random(2)
    cases = [([7] * 16, [7] * 16), ([15] * 16, [7] * 16), ([8] * 16, [15] * 16)]
    cases += [([rng.randrange(16) for _ in range(16)], [rng.randrange(16) for _ in range(16)]) for _ in range(300)]
    for wc, xc in cases:
        words_w = [sum(c << (4 * j) for j, c in enumerate(wc[8 * h: 8 * h + 8])) for h in range(2)]
        words_x = [sum(c << (4 * j) for j, c in enumerate(xc[8 * h: 8 * h + 8])) for h in range(2)]
        w0, w1 = (_split(_W_ASM, w) for w in words_w)
        x0, x1 = (_split(_X_ASM, x) for x in words_x)
        ops = {"$1": w0[0], "$2": w0[1], "$3": w1[0], "$4": w1[1], "$5": w0[2], "$6": w0[3], "$7": w1[2], "$8": w1[3],
               "$9": x0[0], "$10": x0[1], "$11": x1[0], "$12": x1[1], "$13": x0[2], "$14": x0[3], "$15": x1[2],
               "$16": x1[3]}
        got = run_ptx(_DOT_ASM, ops)["$0"]
        got = got - (1 << 32) if got & 0x80000000 else got
        assert got == sum(TWICE[a] * TWICE[b] for a, b in zip(wc, xc)), (wc, xc, got)


def test_asm_uses_only_interpreted_instructions():
    for asm in (_W_ASM, _X_ASM, _DOT_ASM):
        assert ptx_opcodes(asm) <= {"xor.b32", "shr.u32", "prmt.b32", "or.b32", "sub.u32", "dp4a.s32.s32"}, \
            ptx_opcodes(asm)


# ---- the kernel ---------------------------------------------------------------------------------
needs_kernels = pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")
E, N, K = 6, 40, 80  # N = 40 against 16-row tiles (1x16 blocks); K = 80: 5 blocks, a masked last step of 2-block steps


@pytest.fixture(scope="module")
def experts():
    w = heavy_tailed(E, N, K, seed=40) * torch.logspace(-1, 1, E).view(E, 1, 1)
    qs = [nvfp4.quantize_reference(w[e], global_scale="tensor") for e in range(E)]
    return w, qs, stack_expert_weights(qs)


def _dev(t):
    return t.to(DEVICE)


def cpu_q(q):
    return replace(q, codes=q.codes.cpu(), block_scales=q.block_scales.cpu(), global_decode=q.global_decode.cpu(),
                   image=None if q.image is None else q.image.cpu())


def _dev_q(q):
    return replace(q, codes=_dev(q.codes), block_scales=_dev(q.block_scales), global_decode=_dev(q.global_decode),
                   image=None if q.image is None else _dev(q.image))


def idot(a, st, ids=None, offsets=None, out_dtype=torch.bfloat16, matrix=False, a_rows=None):
    """The kernel on ``a``'s rows (by ids, or by the sorted rows' offsets; ``a_rows``: by index)."""
    wm = st.matrix()
    w_scale = wm.global_decode if matrix else st.global_decode
    out = decode_grouped_idot_forward(
        _dev(a.codes), _dev(a.linear_scales().view(torch.uint8)), _dev(a.row_global_decode()), _dev(wm.codes),
        _dev(wm.block_scales.view(torch.uint8)), _dev(w_scale), E,
        expert_ids=None if ids is None else _dev(ids), offsets=None if offsets is None else _dev(offsets),
        out_dtype=out_dtype, a_rows=None if a_rows is None else _dev(a_rows))
    return out.cpu()


def sorted_rows(a, ids):
    order = torch.argsort(ids.long(), stable=True)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.bincount(ids.long(), minlength=E), 0)
    return order, _take_rows(a, order), offsets


def rows_within_bound(out, a, qs, ids, out_dtype=torch.bfloat16):
    for r, e in enumerate(ids.tolist()):
        row = _take_rows(a, torch.tensor([r]))
        exact, bound = nvfp4.fp32_accumulation_bound(row, qs[e], None)
        assert_within(out[r: r + 1], exact, gemm_output_bound(exact, bound, out_dtype), f"row {r} expert {e}")


@needs_kernels
@pytest.mark.parametrize("ids", [[4, 0, 4, 2, 4, 0, 5], [3], [1] * 5 + [0] * 2])
def test_rows_within_bound_by_ids_and_by_offsets_with_the_same_bits(experts, ids):
    """Unsorted rows, repeated experts, experts chosen by no row, one row, an expert with an odd
    number of rows (pairs + one); sorted by offsets: the same bits row for row."""
    _, qs, st = experts
    ids = torch.tensor(ids, dtype=torch.int32)
    a = nvfp4.quantize_reference(randn(len(ids), K, seed=len(ids), scale=2.0))
    out = idot(a, st, ids=ids)
    assert out.shape == (len(ids), N)
    rows_within_bound(out, a, qs, ids)
    order, a_sorted, offsets = sorted_rows(a, ids)
    assert_bitwise_equal(idot(a_sorted, st, offsets=offsets), out[order], "sorted rows by offsets")


@needs_kernels
@pytest.mark.parametrize("by_offsets", [True, False], ids=["by offsets", "by ids"])
def test_activation_rows_by_index_give_the_gathered_rows_bits(experts, by_offsets):
    """``a_rows``: 3 token rows, each read by several (token, expert) rows (the decode step's k
    experts per token, the route's token index) == the kernel on the gathered rows, bit for bit; an
    index outside ``[0, T)`` gives its row NaN and leaves the others' bits."""
    _, _, st = experts
    a = nvfp4.quantize_reference(randn(3, K, seed=55, scale=2.0))
    tok = torch.tensor([0, 0, 1, 2, 1, 2, 0, 1], dtype=torch.int32)
    ids = torch.tensor([4, 1, 4, 0, 2, 5, 3, 4], dtype=torch.int32)
    offsets = None
    if by_offsets:  # expert-major, as the routing kernel orders them
        order = torch.argsort(ids.long(), stable=True)
        tok, ids = tok[order], ids[order]
        offsets = torch.zeros(E + 1, dtype=torch.int32)
        offsets[1:] = torch.cumsum(torch.bincount(ids.long(), minlength=E), 0)
    by = dict(offsets=offsets) if by_offsets else dict(ids=ids)
    expect = idot(_take_rows(a, tok.long()), st, **by)
    got = idot(a, st, a_rows=tok, **by)
    assert got.shape == (len(tok), N)
    assert_bitwise_equal(got, expect, "rows by index vs the gathered rows")
    bad = tok.clone()
    bad[1], bad[5] = 3, -1
    got = idot(a, st, a_rows=bad, **by)
    assert torch.isnan(got[[1, 5]]).all()
    keep = [r for r in range(len(tok)) if r not in (1, 5)]
    assert_bitwise_equal(got[keep], expect[keep], "the other rows beside out-of-range indices")


@needs_kernels
def test_a_rows_bits_do_not_depend_on_the_other_rows(experts):
    """Row invariance: one row alone, in a batch with other experts' rows, with more rows of its
    own expert (before and after it): the same bits."""
    _, _, st = experts
    a = nvfp4.quantize_reference(randn(9, K, seed=50, scale=3.0))
    alone = idot(_take_rows(a, torch.tensor([4])), st, ids=torch.tensor([2], dtype=torch.int32))
    ids = torch.tensor([2, 5, 2, 0, 2, 2, 1, 2, 3], dtype=torch.int32)  # row 4: the 3rd of 5 rows of expert 2
    batch = idot(a, st, ids=ids)
    assert_bitwise_equal(batch[4:5], alone, "row 4 in a batch vs alone")
    flipped = idot(_take_rows(a, torch.arange(8, -1, -1)), st, ids=ids.flip(0))
    assert_bitwise_equal(flipped.flip(0), batch, "rows reversed")


@needs_kernels
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_output_dtypes_and_per_row_weight_scales(experts, out_dtype):
    """fp32 / fp16 outputs; the weights' ``[E*N]`` per-row global scales (the matrix form)."""
    _, qs, st = experts
    ids = torch.tensor([1, 3, 1, 5], dtype=torch.int32)
    a = nvfp4.quantize_reference(randn(4, K, seed=51))
    out = idot(a, st, ids=ids, out_dtype=out_dtype)
    rows_within_bound(out, a, qs, ids, out_dtype)
    assert_bitwise_equal(idot(a, st, ids=ids, out_dtype=out_dtype, matrix=True), out, "per-row weight scales")


@needs_kernels
def test_bad_ids_give_nan_rows_and_nonfinite_weights_reach_only_their_rows(experts):
    w, _, st = experts
    a = nvfp4.quantize_reference(randn(3, K, seed=52))
    out = idot(a, st, ids=torch.tensor([0, -1, 6], dtype=torch.int32))  # the kernel itself: no check
    assert not torch.isnan(out[0]).any() and torch.isnan(out[1:]).all()
    w = w.clone()
    w[2, 0, 3] = float("inf")
    qs = [nvfp4.quantize_reference(w[e], global_scale="tensor") for e in range(E)]
    out = idot(a, stack_expert_weights(qs), ids=torch.tensor([2, 3, 2], dtype=torch.int32))
    assert torch.isnan(out[0]).any() and torch.isnan(out[2]).any() and not torch.isnan(out[1]).any()
    assert idot(nvfp4.quantize_reference(randn(0, K)), st, ids=torch.zeros(0, dtype=torch.int32)).shape == (0, N)


def test_bad_operands_name_what_is_wrong(experts):
    _, _, st = experts
    wm = st.matrix()
    a = nvfp4.quantize_reference(randn(2, K, seed=53))
    args = (a.codes, a.linear_scales().view(torch.uint8), a.global_decode, wm.codes, wm.block_scales.view(torch.uint8),
            st.global_decode, E)
    with pytest.raises(ValueError, match="exactly one of expert_ids and offsets"):
        decode_grouped_idot_forward(*args)
    with pytest.raises(ValueError, match=r"offsets must be \[E \+ 1\]"):
        decode_grouped_idot_forward(*args, offsets=torch.zeros(E, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation scales"):
        decode_grouped_idot_forward(a.codes, a.linear_scales()[:, :2].view(torch.uint8), *args[2:],
                                    expert_ids=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="a_rows must be int32/int64"):
        decode_grouped_idot_forward(*args, expert_ids=torch.zeros(2, dtype=torch.int32), a_rows=torch.zeros(2))
    with pytest.raises(ValueError, match=r"3 expert ids for 2 rows \(a_rows\)"):
        decode_grouped_idot_forward(*args, expert_ids=torch.zeros(3, dtype=torch.int32),
                                    a_rows=torch.zeros(2, dtype=torch.int32))


@needs_kernels
def test_backend_default_mode_dispatches_to_it_and_can_be_switched_off(experts):
    """``decode_grouped_gemm(batch_invariant=False)`` runs the integer-dot kernel (the default
    backend's choice), by offsets when told the rows are sorted; ``TritonOptions(idot_decode=False)``
    gives the tensor-core kernel's (other) bits."""
    from minite_kernels.triton.backend import TritonBackend, TritonOptions

    _, qs, st = experts
    ids = torch.tensor([4, 0, 4, 2], dtype=torch.int32)
    a = nvfp4.quantize_reference(randn(4, K, seed=54, scale=2.0))
    on = TritonBackend()
    assert on.idot_decode_ok(torch.device(DEVICE))
    got = on.decode_grouped_gemm(_dev_q(a), _dev_q(st), _dev(ids))
    assert_bitwise_equal(got.cpu(), idot(a, st, ids=ids), "backend = the kernel")
    order, a_sorted, offsets = sorted_rows(a, ids)
    got_sorted = on.decode_grouped_gemm(_dev_q(a_sorted), _dev_q(st), _dev(ids[order]), group_offsets=_dev(offsets))
    assert_bitwise_equal(got_sorted.cpu(), got.cpu()[order], "sorted through the backend")
    off = TritonBackend(TritonOptions(idot_decode=False)).decode_grouped_gemm(_dev_q(a), _dev_q(st), _dev(ids))
    rows_within_bound(off.cpu(), a, qs, ids)


@needs_kernels
def test_backend_rows_by_index_on_every_path_give_the_gathered_rows_bits(experts):
    """``decode_grouped_gemm(..., a_rows=)`` through the backends: default mode (the integer-dot kernel
    reads the rows by index), strict mode and the tensor-core kernel (rows gathered first), the
    reference: each gives its own path's bits for the gathered rows; ``supports`` says which path
    reads by index; an index outside ``a``'s rows raises one line eagerly."""
    from minite_kernels.triton.backend import TritonBackend, TritonOptions

    from minite_megatron.nvfp4.backends import ReferenceBackend

    _, _, st = experts
    a = nvfp4.quantize_reference(randn(3, K, seed=56, scale=2.0))
    tok = torch.tensor([0, 2, 1, 0, 2, 1], dtype=torch.int32)
    ids = torch.tensor([0, 0, 1, 3, 3, 5], dtype=torch.int32)  # expert-major
    offsets = torch.tensor([0, 2, 3, 3, 5, 5, 6], dtype=torch.int32)
    gathered = _take_rows(a, tok.long())
    dev = torch.device(DEVICE)
    on, tc = TritonBackend(), TritonBackend(TritonOptions(idot_decode=False))
    assert on.supports("decode_grouped_gemm", a_rows=True, batch_invariant=False, device=dev) is None
    assert "in order" in on.supports("decode_grouped_gemm", a_rows=True, batch_invariant=True, device=dev)
    assert "integer-dot" in tc.supports("decode_grouped_gemm", a_rows=True, batch_invariant=False, device=dev)
    for backend in (on, tc):
        for strict in (False, True):
            for by in (dict(group_offsets=_dev(offsets)), {}):
                expect = backend.decode_grouped_gemm(_dev_q(gathered), _dev_q(st), _dev(ids), batch_invariant=strict, **by)
                got = backend.decode_grouped_gemm(_dev_q(a), _dev_q(st), _dev(ids), batch_invariant=strict,
                                                  a_rows=_dev(tok), **by)
                assert_bitwise_equal(got.cpu(), expect.cpu(), f"{backend.options.idot_decode} strict={strict} {sorted(by)}")
    ref = ReferenceBackend()
    assert_bitwise_equal(ref.decode_grouped_gemm(a, st, ids, a_rows=tok), ref.decode_grouped_gemm(gathered, st, ids),
                         "reference")
    with pytest.raises(ValueError, match=r"a_rows\[4\] = 3 is outside the 3 rows of a"):
        on.decode_grouped_gemm(_dev_q(a), _dev_q(st), _dev(ids), a_rows=_dev(torch.tensor([0, 2, 1, 0, 3, 1])))
    with pytest.raises(ValueError, match="expert_ids must be a 1-D tensor of 5 expert indices"):
        ref.decode_grouped_gemm(a, st, ids, a_rows=tok[:5])


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8])
def test_dense_rows_within_bound_with_bias_and_row_invariant(m):
    """Dense (one weight matrix, rows two at a time and an odd one): within the bound with bias
    (tensor and per-row weight scales); each row's bits equal that row alone."""
    from minite_kernels.triton.decode.decode_grouped_idot import decode_idot_gemm_forward

    qw = nvfp4.quantize_reference(heavy_tailed(N, K, seed=60), global_scale="tensor")
    a = nvfp4.quantize_reference(randn(m, K, seed=61 + m, scale=2.0))
    bias = randn(N, seed=62)

    def dense(x, w_scale):
        return decode_idot_gemm_forward(_dev(x.codes), _dev(x.linear_scales().view(torch.uint8)), _dev(x.global_decode),
                                        _dev(qw.codes), _dev(qw.block_scales.view(torch.uint8)), _dev(w_scale),
                                        _dev(bias)).cpu()

    out = dense(a, qw.global_decode)
    exact, bound = nvfp4.fp32_accumulation_bound(a, qw, bias)
    assert_within(out, exact, gemm_output_bound(exact, bound, torch.bfloat16), f"dense M={m}")
    assert_bitwise_equal(dense(a, qw.global_decode.expand(N).contiguous()), out, "per-row weight scales")
    for r in range(m):
        assert_bitwise_equal(dense(_take_rows(a, torch.tensor([r])), qw.global_decode), out[r: r + 1], f"row {r} alone")


@needs_kernels
def test_backend_dense_default_mode_dispatch_by_rows(monkeypatch):
    """``idot_dense_max_m``: default-mode GEMMs with at most that many rows take the integer-dot
    kernel, more rows and strict mode the tensor-core decode kernel; results within the bound."""
    from minite_kernels.triton import backend as tb
    from minite_kernels.triton.backend import TritonBackend, TritonOptions

    calls = []
    real = tb.decode_idot_gemm_forward
    monkeypatch.setattr(tb, "decode_idot_gemm_forward", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    qw = _dev_q(nvfp4.quantize_reference(randn(N, K, seed=63), global_scale="tensor"))
    be = TritonBackend(TritonOptions(idot_decode=True, idot_dense_max_m=4))
    for m in (2, 6):
        a = _dev_q(nvfp4.quantize_reference(randn(m, K, seed=64 + m)))
        got = be.gemm(a, qw)
        be.gemm(a, qw, batch_invariant=True)
        exact, bound = nvfp4.fp32_accumulation_bound(cpu_q(a), cpu_q(qw), None)
        assert_within(got.cpu(), exact, gemm_output_bound(exact, bound, torch.bfloat16), f"M={m}")
    assert calls == [2], calls
