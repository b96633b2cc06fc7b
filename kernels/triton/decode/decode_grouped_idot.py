"""MoE decode GEMM on the packed FP4 codes of *both* operands, with integer dot products (dp4a):
the default-mode decode path at a few rows per expert.

In W4A4 both operands of a decode GEMM are NVFP4: ``a = e2m1(ca) * sa_blk * sa`` and
``w = e2m1(cw) * sw_blk * sw``. Twice an E2M1 value is an integer (0, 1, 2, 3, 4, 6, 8, 12 and
their negatives), so the product of a 16-element block of a row with a block of a weight row is

    sum_k e2m1(ca_k) e2m1(cw_k) = (1/4) sum_k (2 e2m1(ca_k)) (2 e2m1(cw_k)),

a sum of 16 int8 products (``|sum| <= 2304``): four ``dp4a`` per block per row, exact. Times the
two block scales (E4M3, 4 significant bits each) a block's contribution is exact in fp32 (at
most 20 significant bits; an FMA gives the same value as a multiply and an add); only the sum
over the K blocks rounds (fp32, a fixed order per configuration). The output is
``round(fp32(sa * sw) * (acc / 4))``, the contract's last step (``acc / 4`` is exact).

No tensor cores and no layout changes: every thread holds whole 16-element blocks of its weight
rows (one int64 of codes per block) and turns each 32-bit code word (8 weights) into four words
of int8 magnitudes -- the positive codes' and the negative codes' apart -- in 7 PTX instructions
(:data:`_W_ASM`: two ``prmt`` table lookups per 4 codes; flipping the sign bit turns a lookup
into ``prmt``'s sign-replicate mode, which gives 0 on a table of non-negative bytes). The
activation's codes become signed int8 words and their negation the same way (:data:`_X_ASM`,
once per thread and step, shared by the thread's weight rows), and ``dp4a.s32.s32`` adds
``P . x + N . (-x)`` (:data:`_DOT_ASM`). What a decode step needs at batch <= 16, where an expert
sees 1-3 rows: a tensor-core tile of 16 rows is mostly padding, and the image path pays a
dequantization and a shared-memory layout change per weight (``decode_grouped_gemm``'s sweep:
~400 GB/s of packed bytes).

Numerics: within ``fp32_accumulation_bound`` of the exact product, deterministic, and row
invariant -- a row's output depends only on the row, its expert's weights and the launch
configuration, never on the other rows or their number. It is not the learner's strict chain
(tensor-core accumulation), so strict mode keeps :mod:`.decode_grouped_gemm`'s batch-invariant
configuration.

Reference: ``nvfp4.grouped.decode_grouped_gemm_reference`` (the dense form:
``nvfp4.gemm_reference``); ``tests/kernels/triton/decode/test_decode_idot.py`` holds every row within the
reference's ``fp32_accumulation_bound`` and runs the PTX on a CPU interpreter of its instructions.

Rows: given group offsets (``SORTED``: rows already in expert-major order, expert ``g``'s rows
at ``offsets[g]:offsets[g+1]``; the fused decode step's routing gives them) the grid is
``(E, N tiles)`` and a program reads two offsets; sorted rows may name their activation rows
(``GATHER``: output row ``r`` multiplies activation row ``a_rows[r]`` of ``T`` rows -- the decode step
hands over its T tokens' quantization once and the kernel reads each token's row for each of its
experts, instead of a gather and a quantization of the ``T * k`` rows; a row outside ``[0, T)``
gets NaN); otherwise ``(min(R, E) expert slots, N tiles)``
and every program finds its slot's expert from the R ids (:func:`.decode_grouped_gemm._slot_expert`;
rows of ids outside ``[0, E)`` get NaN). A program runs its expert's rows two at a time (``PAIRS``) and the odd one alone,
over the whole K (weights re-read from L2 for the next chunk). No host sync: CUDA graphs capture it.

Inputs: ``a_codes`` uint8 ``[R, K/2]``, ``a_scales`` uint8 (E4M3 bits) ``[R, K/16]`` linear,
``a_scale`` fp32 ``[R]``/``[1]`` (with ``a_rows`` int32 ``[R]``: ``[T, ...]`` of each); ``w_codes`` uint8 ``[E*N, K/2]``, ``w_scales`` ``[E*N, K/16]``,
``w_scale`` fp32 ``[E]`` or ``[E*N]``; ``expert_ids`` int32 ``[R]`` or ``offsets`` int32 ``[E+1]``. The dense form
(:func:`decode_idot_gemm_forward`, ``DENSE``: one weight matrix, a program per row pair, fp32 bias)
is the same kernel; on the H200 it beats the tensor-core decode kernel only at one or two rows
(BENCHMARKS.md run 11), so the backend takes it only below ``TritonOptions.idot_dense_max_m`` (0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minite_kernels.triton.decode._decode_common import check_expert_weights, device_words
from minite_kernels.triton.nvfp4._nvfp4_math import e2m1_value, e4m3_value, interpreting, round_to
from minite_kernels.triton.decode.decode_grouped_gemm import _chunk_rows, _slot_expert
from minite_kernels.triton.nvfp4.gemm import OUT_DTYPES
from minite_kernels.custom_op import custom_op
from minite_kernels.triton._build._host import cdiv, next_pow2

# $0, $1: int8 magnitudes (2 * |e2m1|) of nibbles 0-3 / 4-7 of the code word $4 where the code is
# positive, else 0; $2, $3: the same where the code is negative. $5, $6: IDOT_TABLES. A selector
# nibble's bit 3 (the code's sign) selects prmt's sign-replicate mode, which returns 0x00 on this
# table (all bytes < 0x80): the xor with 0x88888888 swaps which codes are looked up.
_W_ASM = tl.constexpr("""
{
.reg .b32 f, ch, fh;
xor.b32 f, $4, 0x88888888;
shr.u32 ch, $4, 16;
shr.u32 fh, f, 16;
prmt.b32 $0, $5, $6, $4;
prmt.b32 $1, $5, $6, ch;
prmt.b32 $2, $5, $6, f;
prmt.b32 $3, $5, $6, fh;
}
""")
# $0, $1: signed int8 values 2 * e2m1 of nibbles 0-3 / 4-7 of $4; $2, $3: their negation. Per
# byte p - n with p, n the magnitudes above (one of them 0): (p | 0x80) - n stays in [0x74, 0x8c],
# so the 32-bit subtraction borrows across no byte, and the xor with 0x80 makes it two's complement.
_X_ASM = tl.constexpr("""
{
.reg .b32 f, ch, fh, p0, p1, n0, n1, t0, t1, t2, t3;
xor.b32 f, $4, 0x88888888;
shr.u32 ch, $4, 16;
shr.u32 fh, f, 16;
prmt.b32 p0, $5, $6, $4;
prmt.b32 p1, $5, $6, ch;
prmt.b32 n0, $5, $6, f;
prmt.b32 n1, $5, $6, fh;
or.b32 t0, p0, 0x80808080;
or.b32 t1, p1, 0x80808080;
or.b32 t2, n0, 0x80808080;
or.b32 t3, n1, 0x80808080;
sub.u32 t0, t0, n0;
sub.u32 t1, t1, n1;
sub.u32 t2, t2, p0;
sub.u32 t3, t3, p1;
xor.b32 $0, t0, 0x80808080;
xor.b32 $1, t1, 0x80808080;
xor.b32 $2, t2, 0x80808080;
xor.b32 $3, t3, 0x80808080;
}
""")
# $0 = sum over the block's 4 words of dp4a(P_j, X_j) + dp4a(N_j, Y_j): the block's integer dot
# product (P $1-$4, N $5-$8: weight magnitudes; X $9-$12: signed activation values; Y $13-$16: -X).
_DOT_ASM = tl.constexpr("""
{
.reg .s32 s;
dp4a.s32.s32 s, $1, $9, 0;
dp4a.s32.s32 s, $2, $10, s;
dp4a.s32.s32 s, $3, $11, s;
dp4a.s32.s32 s, $4, $12, s;
dp4a.s32.s32 s, $5, $13, s;
dp4a.s32.s32 s, $6, $14, s;
dp4a.s32.s32 s, $7, $15, s;
dp4a.s32.s32 $0, $8, $16, s;
}
""")
#: The lookup table of the asm (bytes 0..7 = 2 * e2m1 magnitude 0, 0.5, 1, 1.5, 2, 3, 4, 6).
IDOT_TABLES = (0x03020100, 0x0C080604)


@triton.jit
def _words(v):
    """int64 blocks -> their two 32-bit code words (elements 0-7, 8-15)."""
    return (v & 0xFFFFFFFF).to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def _w_split(word, t0, t1):
    return tl.inline_asm_elementwise(_W_ASM, "=r,=r,=r,=r,r,r,r", [word, t0, t1],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _x_split(word, t0, t1):
    return tl.inline_asm_elementwise(_X_ASM, "=r,=r,=r,=r,r,r,r", [word, t0, t1],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _block_dots(wv, xv, luts, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, ASM: tl.constexpr):
    """int32 ``[BN, BKB]``: each weight block's integer dot product (times 4) with the row's block.
    ``wv`` int64 ``[BN, BKB]`` weight code blocks; ``xv`` int64 ``[BKB]`` the row's code blocks;
    ``luts``: the table words as ``[BN]`` and ``[BKB]`` tensors (:func:`_tables`)."""
    if ASM:
        t0, t1, tx0, tx1 = luts
        z = tl.zeros((BLOCK_N, BLOCK_KB), tl.int32)
        w0, w1 = _words(wv)
        p0, p1, n0, n1 = _w_split(w0, z + t0[:, None], z + t1[:, None])
        p2, p3, n2, n3 = _w_split(w1, z + t0[:, None], z + t1[:, None])
        x0, x1 = _words(xv)
        a0, a1, b0, b1 = _x_split(x0, tx0, tx1)
        a2, a3, b2, b3 = _x_split(x1, tx0, tx1)
        return tl.inline_asm_elementwise(
            _DOT_ASM, "=r," + "r," * 15 + "r",
            [p0, p1, p2, p3, n0, n1, n2, n3, z + a0[None, :], z + a1[None, :], z + a2[None, :], z + a3[None, :],
             z + b0[None, :], z + b1[None, :], z + b2[None, :], z + b3[None, :]],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        sh = 4 * tl.arange(0, 16)  # twice the E2M1 values are integers: exact in fp32 and int32
        wn = (2 * e2m1_value(((wv[:, :, None] >> sh[None, None, :]) & 15).to(tl.int32))).to(tl.int32)
        xn = (2 * e2m1_value(((xv[:, None] >> sh[None, :]) & 15).to(tl.int32))).to(tl.int32)
        return tl.sum(wn * xn[None, :, :], axis=2)


@triton.jit
def _tables(lut_ptr, rn, KB, BLOCK_KB: tl.constexpr):
    """The two table words as per-thread ``[BN]`` (weight rows ``rn``) and ``[BKB]`` tensors: each
    gets a run-time zero added (``>> 30`` of values below 2**30), so ptxas keeps them in ordinary
    registers -- scalar table words sit in uniform registers and are copied before every ``prmt``
    (``_decode_common.load_tables``)."""
    t0 = tl.load(lut_ptr)
    t1 = tl.load(lut_ptr + 1)
    zn = rn >> 30
    zk = (tl.arange(0, BLOCK_KB) + KB) >> 30
    return t0 + zn, t1 + zn, t0 + zk, t1 + zk


@triton.jit
def _scale_value(code, ASM: tl.constexpr):
    """uint8 E4M3 bits -> fp32 (NaN for 0x7F / 0xFF)."""
    if ASM:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_value(code.to(tl.int32))


@triton.jit
def _row_ids(rows_vec, m: tl.constexpr, MC: tl.constexpr):
    """Element ``m`` of an ``[MC]`` vector as a scalar."""
    return tl.sum(tl.where(tl.arange(0, MC) == m, rows_vec, 0), axis=0)


@triton.jit
def _load_step(wc_rows, ws_rows, kk, KB, MASK_K: tl.constexpr):
    """The int64 code blocks and the scale bytes ``[BN, BKB]`` of one K step (blocks ``kk``)."""
    if MASK_K:
        k_ok = (kk < KB)[None, :]
        return (tl.load(wc_rows[:, None] + kk[None, :], mask=k_ok, other=0),
                tl.load(ws_rows[:, None] + kk[None, :], mask=k_ok, other=0))
    else:
        return tl.load(wc_rows[:, None] + kk[None, :]), tl.load(ws_rows[:, None] + kk[None, :])


@triton.jit
def _rows_accumulate(wc_rows, ws_rows, xc_ptr, xs_ptr, rows, oks, s_xc, s_xs, KB, luts,
                     BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, MC: tl.constexpr, NSTEPS: tl.constexpr,
                     UNROLL: tl.constexpr, MASK_K: tl.constexpr, ASM: tl.constexpr):
    """``MC`` fp32 ``[BN]`` sums over the whole K of the rows ``rows`` (int64 scalars; ``oks``:
    real rows) with the weight rows at ``wc_rows`` / ``ws_rows`` (int64 code blocks / scale bytes
    at k = 0). The K steps run as a loop of ``NSTEPS // UNROLL`` iterations; an iteration issues
    its ``UNROLL`` steps' weight loads before computing any (bytes in flight, registers bounded:
    the whole K unrolled at K = 2048 needs 255 registers and spills, CPU-AOT sm_90a)."""
    # K blocks of a step, written so that Triton's analysis sees runs of 2 contiguous blocks (16
    # bytes of codes) only: a thread then takes 2 blocks of several weight rows (the rest of a
    # warp goes along K, the rows repeat) instead of 8 blocks of one row, so the activation's
    # conversion (per thread and K block) is shared by the thread's rows.
    kk0 = (tl.arange(0, BLOCK_KB) // 2) * 2 + tl.arange(0, BLOCK_KB) % 2
    accs = ()
    for m in tl.static_range(MC):
        accs = accs + (tl.zeros((BLOCK_N, BLOCK_KB), tl.float32),)
    for it in range(0, NSTEPS // UNROLL):
        base = it * (UNROLL * BLOCK_KB)
        steps = ()
        for u in tl.static_range(UNROLL):
            steps = steps + (_load_step(wc_rows, ws_rows, base + u * BLOCK_KB + kk0, KB, MASK_K),)
        for u in tl.static_range(UNROLL):
            kk = base + u * BLOCK_KB + kk0
            k_ok = kk < KB
            wv, wsc = steps[u]
            sw = _scale_value(wsc, ASM)
            new = ()
            for m in tl.static_range(MC):
                xv = tl.load(xc_ptr + rows[m] * s_xc + kk, mask=oks[m] & k_ok, other=0)
                sx = _scale_value(tl.load(xs_ptr + rows[m] * s_xs + kk, mask=oks[m] & k_ok, other=0), ASM)
                dots = _block_dots(wv, xv, luts, BLOCK_N, BLOCK_KB, ASM)
                new = new + (accs[m] + (dots.to(tl.float32) * sw) * sx[None, :],)
            accs = new
    sums = ()
    for m in tl.static_range(MC):
        sums = sums + (tl.sum(accs[m], axis=1),)
    return sums


@triton.jit
def _run_rows(wc_rows, ws_rows, xc_ptr, xs_ptr, out_ptr, sa_ptr, swg, bias, rn, n_ok, mine, pos, start, c0, n_rows,
              s_xc, s_xs, s_om, KB, luts, xrows_ptr, T, MC: tl.constexpr, SORTED: tl.constexpr, SA_ROWS: tl.constexpr,
              HAS_BIAS: tl.constexpr, GATHER: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, NSTEPS: tl.constexpr, UNROLL: tl.constexpr,
              MASK_K: tl.constexpr, R_POW2: tl.constexpr, ASM: tl.constexpr, BITWISE_BF16: tl.constexpr):
    """Rows ``c0 .. c0 + MC - 1`` of this program's expert (those below ``n_rows``): outputs stored
    (``GATHER``: each reads activation row ``xrows_ptr[row]`` of ``T``; NaN for one outside ``[0, T)``)."""
    rows = ()
    arows = ()
    oks = ()
    if not SORTED:
        chunk = _chunk_rows(mine, pos, c0, R_POW2, MC)
    for m in tl.static_range(MC):
        if SORTED:
            row = (start + c0 + m).to(tl.int64)
        else:
            row = _row_ids(chunk, m, MC).to(tl.int64)
        ok = c0 + m < n_rows
        rows = rows + (row,)
        oks = oks + (ok,)
        if GATHER:  # clamped into [0, T) for the loads; the index is read again for the NaN below
            arow = tl.load(xrows_ptr + row, mask=ok, other=0)
            arows = arows + (tl.where((arow >= 0) & (arow < T), arow, 0).to(tl.int64),)
        else:
            arows = arows + (row,)
    sums = _rows_accumulate(wc_rows, ws_rows, xc_ptr, xs_ptr, arows, oks, s_xc, s_xs, KB, luts,
                            BLOCK_N, BLOCK_KB, MC, NSTEPS, UNROLL, MASK_K, ASM)
    for m in tl.static_range(MC):
        if SA_ROWS:
            sa = tl.load(sa_ptr + arows[m], mask=oks[m], other=1.0)
        else:
            sa = tl.load(sa_ptr)
        out = (sums[m] * 0.25) * (sa * swg)
        if HAS_BIAS:
            out = out + bias
        if GATHER:  # an activation row outside [0, T): NaN, never a silent value
            arow = tl.load(xrows_ptr + rows[m], mask=oks[m], other=0)
            out = tl.where((arow >= 0) & (arow < T), out, float("nan"))
        tl.store(out_ptr + rows[m] * s_om + rn, round_to(out, out_ptr.dtype.element_ty, BITWISE_BF16),
                 mask=n_ok & oks[m])


@triton.jit
def _decode_grouped_idot_kernel(
    xc_ptr, xs_ptr, wc_ptr, ws_ptr, ids_ptr, offs_ptr, out_ptr, sa_ptr, sw_ptr, lut_ptr, bias_ptr, xrows_ptr,
    R, N, KB, E, s_xc, s_xs, s_wc, s_ws, s_om, T,
    SORTED: tl.constexpr, DENSE: tl.constexpr, HAS_BIAS: tl.constexpr, SA_ROWS: tl.constexpr, SW_ROWS: tl.constexpr,
    MASK_K: tl.constexpr, GATHER: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr, PAIRS: tl.constexpr, NSTEPS: tl.constexpr,
    UNROLL: tl.constexpr, R_POW2: tl.constexpr, E_POW2: tl.constexpr, ASM: tl.constexpr,
    BITWISE_BF16: tl.constexpr,
):
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = rn % N
    n_ok = rn < N
    if DENSE:  # one weight matrix (expert 0); program g takes rows 2g, 2g + 1 (PAIRS) or g
        start = g * (2 if PAIRS else 1)
        n_rows = tl.minimum(R - start, 2 if PAIRS else 1)
        expert = 0
        mine = n_ok  # (unused)
        pos = rn
    elif SORTED:
        start = tl.load(offs_ptr + g)
        n_rows = tl.load(offs_ptr + g + 1) - start
        expert = g
        mine = n_ok  # (unused)
        pos = rn
    else:
        ids, valid, expert, n_rows = _slot_expert(ids_ptr, g, R, E, R_POW2, E_POW2)
        if g == 0:
            # rows routed to no valid expert: NaN, never a silent value
            rr = tl.arange(0, R_POW2)
            bad = ~valid & (rr < R)
            if tl.sum(bad.to(tl.int32), axis=0) > 0:
                tl.store(out_ptr + rr[:, None] * s_om + rn[None, :],
                         tl.full((R_POW2, BLOCK_N), float("nan"), tl.float32).to(out_ptr.dtype.element_ty),
                         mask=bad[:, None] & n_ok[None, :])
        mine = valid & (ids == expert)
        pos = tl.cumsum(mine.to(tl.int32), axis=0) - 1
        start = 0
    if n_rows > 0:
        wrow = expert.to(tl.int64) * N + rn_safe
        wc_rows = wc_ptr + wrow * s_wc
        ws_rows = ws_ptr + wrow * s_ws
        luts = _tables(lut_ptr, rn_safe, KB, BLOCK_KB)
        if SW_ROWS:
            swg = tl.load(sw_ptr + wrow)
        else:
            swg = tl.full((BLOCK_N,), tl.load(sw_ptr + expert), tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + wrow).to(tl.float32)
        else:
            bias = swg  # (unused)
        singles = 0
        if PAIRS:  # rows two at a time (the weights read once per pair), then the odd one alone
            for c0 in range(0, n_rows - 1, 2):
                _run_rows(wc_rows, ws_rows, xc_ptr, xs_ptr, out_ptr, sa_ptr, swg, bias, rn, n_ok, mine, pos, start, c0,
                          n_rows, s_xc, s_xs, s_om, KB, luts, xrows_ptr, T, 2, SORTED or DENSE, SA_ROWS, HAS_BIAS, GATHER,
                          BLOCK_N, BLOCK_KB, NSTEPS, UNROLL,
                          MASK_K, R_POW2, ASM, BITWISE_BF16)
            singles = n_rows - n_rows % 2
        for c0 in range(singles, n_rows):
            _run_rows(wc_rows, ws_rows, xc_ptr, xs_ptr, out_ptr, sa_ptr, swg, bias, rn, n_ok, mine, pos, start, c0,
                      n_rows, s_xc, s_xs, s_om, KB, luts, xrows_ptr, T, 1, SORTED or DENSE, SA_ROWS, HAS_BIAS, GATHER,
                      BLOCK_N, BLOCK_KB, NSTEPS, UNROLL,
                      MASK_K, R_POW2, ASM, BITWISE_BF16)


#: GPU launch: weight rows per program, 16-element blocks per K step (one int64 of codes each),
#: rows two at a time (``PAIRS``) or one, K steps per loop iteration (``UNROLL``: their loads in
#: flight together), warps. First entry; see the sweep (``benchmarks/decode_gemm.py --sections
#: idot_sweep``).
GPU_IDOT = dict(BLOCK_N=64, BLOCK_KB=16, PAIRS=True, UNROLL=2, num_warps=4)
#: The interpreter's launch (small tiles: tails, several steps and loop iterations on the test shapes).
INTERPRETER_IDOT = dict(BLOCK_N=16, BLOCK_KB=2, PAIRS=True, UNROLL=1, num_warps=4)


def idot_config(k: int, entry: dict | None = None) -> dict:
    """A launch from an entry (:data:`GPU_IDOT` on the GPU, :data:`INTERPRETER_IDOT` under the
    interpreter): the whole K per program, ``NSTEPS`` steps of ``BLOCK_KB`` blocks, ``UNROLL`` the
    largest divisor of ``NSTEPS`` not above the entry's."""
    if entry is None:
        entry = INTERPRETER_IDOT if interpreting() else GPU_IDOT
    kb = k // 16
    bkb = min(entry["BLOCK_KB"], next_pow2(kb))
    nsteps = cdiv(kb, bkb)
    unroll = max(1, min(entry["UNROLL"], nsteps))
    while nsteps % unroll:
        unroll -= 1
    return dict(entry, BLOCK_KB=bkb, NSTEPS=nsteps, UNROLL=unroll)


def _int64_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, K/2]`` codes as int64 ``[rows, K/16]`` (one 16-element block each; a copy only
    where the rows are not 8-byte aligned)."""
    if codes.stride(1) != 1 or codes.data_ptr() % 8 or codes.stride(0) % 8:
        codes = codes.contiguous().clone()
    return codes.view(torch.int64)


def launch_decode_grouped_idot(a_codes, a_scales, a_scale, w_codes, w_scales, w_scale, experts: int, out,
                               expert_ids=None, offsets=None, cfg: dict | None = None, asm: bool | None = None,
                               dense: bool = False, bias=None, a_rows=None) -> None:
    """Run the kernel (rows by ``offsets`` when given, else by ``expert_ids``; ``dense``: every row
    times the one weight matrix, ``experts == 1``, optional fp32-added ``bias [N]``; ``a_rows``
    int32 ``[R]``: output row ``r`` reads activation row ``a_rows[r]``) into ``out``."""
    t, k = a_codes.shape[0], a_codes.shape[1] * 2
    r = out.shape[0]
    n = out.shape[1]
    cfg = idot_config(k) if cfg is None else cfg
    sorted_rows = offsets is not None or dense
    if dense:
        grid = (cdiv(r, 2 if cfg["PAIRS"] else 1), cdiv(n, cfg["BLOCK_N"]))
    else:
        grid = (experts if sorted_rows else min(r, experts), cdiv(n, cfg["BLOCK_N"]))
    # the kernel reads ids (unsorted) or offsets (sorted), never both, nothing in dense mode
    rows = expert_ids if expert_ids is not None else offsets if offsets is not None else out
    xc = _int64_rows(a_codes)
    wc = _int64_rows(w_codes)
    _decode_grouped_idot_kernel[grid](
        xc, a_scales, wc, w_scales, rows, rows, out, a_scale, w_scale, device_words(IDOT_TABLES, a_codes.device),
        bias if bias is not None else w_scale, a_rows if a_rows is not None else rows,
        r, n, k // 16, experts, xc.stride(0), a_scales.stride(0), wc.stride(0), w_scales.stride(0), out.stride(0), t,
        SORTED=sorted_rows and not dense, DENSE=dense, HAS_BIAS=bias is not None, SA_ROWS=a_scale.numel() != 1 or t == 1,
        SW_ROWS=w_scale.numel() != experts or (n == 1 and experts == 1), MASK_K=(k // 16) % cfg["BLOCK_KB"] != 0,
        GATHER=a_rows is not None, BLOCK_N=cfg["BLOCK_N"], BLOCK_KB=cfg["BLOCK_KB"], PAIRS=cfg["PAIRS"], NSTEPS=cfg["NSTEPS"], UNROLL=cfg["UNROLL"],
        R_POW2=1 if sorted_rows else next_pow2(max(r, 1)),  # (sorted: unused; one compile for any R)
        E_POW2=1 if sorted_rows else next_pow2(experts),
        ASM=(not interpreting()) if asm is None else asm, BITWISE_BF16=interpreting(),
        num_warps=cfg["num_warps"], num_stages=1,
    )


def decode_grouped_idot_forward(a_codes, a_scales, a_scale, w_codes, w_scales, w_scale, experts: int,
                                expert_ids=None, offsets=None, out_dtype=torch.bfloat16, a_rows=None) -> torch.Tensor:
    """Checked entry point: rows ``a`` (codes ``[R, K/2]``, E4M3 block scales ``[R, K/16]``, global
    ``[R]``/``[1]``) times their experts' weights (``[E*N, K/2]`` / ``[E*N, K/16]`` / ``[E]`` or
    ``[E*N]``) -> ``[R, N]`` ``out_dtype``; by ``expert_ids`` int ``[R]`` or sorted rows'
    ``offsets`` int ``[E+1]`` (exactly one). ``a_rows`` int ``[R]``: ``a`` holds ``T`` rows
    (``[T, K/2]``, ``[T, K/16]``, ``[T]``/``[1]``) and output row ``r`` multiplies row ``a_rows[r]``
    (NaN for one outside ``[0, T)``). Raises ValueError / TypeError naming the operand."""
    if (expert_ids is None) == (offsets is None):
        raise ValueError("decode_grouped_idot: give exactly one of expert_ids and offsets")
    if a_codes.dim() != 2 or a_codes.dtype != torch.uint8:
        raise ValueError(f"decode_grouped_idot: activation codes must be uint8 [R, K/2], got {a_codes.dtype} "
                         f"{tuple(a_codes.shape)}")
    t, k = a_codes.shape[0], a_codes.shape[1] * 2
    if k % 16:
        raise ValueError(f"decode_grouped_idot: K must be a multiple of 16, got {k}")
    if tuple(a_scales.shape) != (t, k // 16):
        raise ValueError(f"decode_grouped_idot: activation scales {tuple(a_scales.shape)} are not {(t, k // 16)}")
    check_expert_weights("decode_grouped_idot", k, w_codes, w_scales, w_scale, experts, a_scale, t, out_dtype,
                         OUT_DTYPES)
    if a_rows is not None:
        if a_rows.dim() != 1 or a_rows.dtype not in (torch.int32, torch.int64) or a_rows.device != a_codes.device:
            raise ValueError(f"decode_grouped_idot: a_rows must be int32/int64 [R] on {a_codes.device}, got "
                             f"{a_rows.dtype} {tuple(a_rows.shape)} on {a_rows.device}")
        a_rows = a_rows.to(torch.int32).contiguous()
        if expert_ids is not None and expert_ids.numel() != a_rows.numel():
            raise ValueError(f"decode_grouped_idot: {expert_ids.numel()} expert ids for {a_rows.numel()} rows (a_rows)")
    if offsets is not None and offsets.numel() != experts + 1:
        raise ValueError(f"decode_grouped_idot: offsets must be [E + 1] = [{experts + 1}], got {offsets.numel()}")
    rows = (expert_ids if offsets is None else offsets).to(torch.int32).reshape(-1).contiguous()
    return decode_idot_op(
        a_codes.contiguous(), a_scales.contiguous().view(torch.uint8), a_scale.float().reshape(-1).contiguous(),
        w_codes.contiguous(), w_scales.contiguous().view(torch.uint8), w_scale.float().reshape(-1).contiguous(),
        rows, None, experts, "ids" if offsets is None else "offsets", out_dtype, a_rows)


@custom_op("minite::decode_idot", mutates_args=())
def decode_idot_op(
    a_codes: torch.Tensor,
    a_scales: torch.Tensor,
    a_scale: torch.Tensor,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_scale: torch.Tensor,
    rows: torch.Tensor | None,
    bias: torch.Tensor | None,
    experts: int,
    mode: str,
    out_dtype: torch.dtype,
    a_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel as one op: ``mode`` ``"ids"`` (``rows``: the expert ids), ``"offsets"``
    (``rows``: the sorted rows' group offsets ``[E + 1]``) or ``"dense"`` (one weight matrix,
    ``bias`` optional) -> ``[R, N]``; ``a_rows``: output row ``r``'s activation row (see
    :func:`decode_grouped_idot_forward`, :func:`decode_idot_gemm_forward`)."""
    r = a_codes.shape[0] if a_rows is None else a_rows.numel()
    n = w_codes.shape[0] // experts
    out = torch.empty(r, n, dtype=out_dtype, device=a_codes.device)
    if r == 0 or n == 0:
        return out
    cfg = None
    if mode == "dense":
        cfg = idot_config(a_codes.shape[1] * 2, INTERPRETER_IDOT if interpreting() else GPU_IDOT_DENSE)
    launch_decode_grouped_idot(a_codes, a_scales, a_scale, w_codes, w_scales, w_scale, experts, out,
                               expert_ids=rows if mode == "ids" else None, offsets=rows if mode == "offsets" else None,
                               cfg=cfg, dense=mode == "dense", bias=bias, a_rows=a_rows)
    return out


@decode_idot_op.register_fake
def _(a_codes, a_scales, a_scale, w_codes, w_scales, w_scale, rows, bias, experts, mode, out_dtype, a_rows=None):
    r = a_codes.shape[0] if a_rows is None else a_rows.shape[0]
    return a_codes.new_empty((r, w_codes.shape[0] // experts), dtype=out_dtype)


#: The dense launch (one weight matrix, rows two at a time): fewer weight rows per program than the
#: grouped entry, since a dense GEMM's grid is only its N tiles times the row pairs.
GPU_IDOT_DENSE = dict(BLOCK_N=32, BLOCK_KB=16, PAIRS=True, UNROLL=2, num_warps=4)


def decode_idot_gemm_forward(a_codes, a_scales, a_scale, w_codes, w_scales, w_scale, bias=None,
                             out_dtype=torch.bfloat16) -> torch.Tensor:
    """Dense decode on the integer-dot kernel: rows ``a`` (codes ``[M, K/2]``, E4M3 scales ``[M, K/16]``,
    global ``[M]``/``[1]``) times the weight ``[N, K]`` (codes ``[N, K/2]``, scales ``[N, K/16]``,
    global ``[1]`` or ``[N]``), plus ``bias [N]`` in fp32 -> ``[M, N]`` (the contract's epilogue).
    Each row's bits depend only on that row (row invariant). Raises ValueError naming the operand."""
    m, k = a_codes.shape[0], a_codes.shape[1] * 2
    n = w_codes.shape[0]
    if a_codes.dim() != 2 or k % 16 or tuple(a_scales.shape) != (m, k // 16):
        raise ValueError(f"decode_idot_gemm: activation codes {tuple(a_codes.shape)} / scales {tuple(a_scales.shape)} "
                         f"are not [M, K/2] / [M, K/16] with K % 16 == 0")
    check_expert_weights("decode_idot_gemm", k, w_codes, w_scales, w_scale, 1, a_scale, m, out_dtype, OUT_DTYPES)
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"decode_idot_gemm: bias must have shape ({n},), got {tuple(bias.shape)}")
    return decode_idot_op(a_codes.contiguous(), a_scales.contiguous().view(torch.uint8),
                          a_scale.float().reshape(-1).contiguous(), w_codes.contiguous(),
                          w_scales.contiguous().view(torch.uint8), w_scale.float().reshape(-1).contiguous(), None,
                          None if bias is None else bias.float().contiguous(), 1, "dense", out_dtype)
