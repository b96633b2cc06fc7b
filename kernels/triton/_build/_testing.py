"""Helpers of the Triton kernel tests (pure torch): the device under test and input factories.

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it);
with a GPU they run on it. References always run on the CPU, so NaN bit patterns are the
CPU's (the kernels write those same patterns).
"""

from __future__ import annotations

import torch

from minite_megatron.nvfp4.backends import triton_interpreting as interpreting
from minite_megatron.settings import environment

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if HAS_CUDA else torch.device("cpu")
INTERPRETING = interpreting()


def kernels_runnable() -> bool:
    return HAS_CUDA or INTERPRETING


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int = 0, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """Fresh normal data (CPU), cast to ``dtype``."""
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(dtype)


def heavy_tailed(*shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Student-t-like data with outliers: normal / sqrt(chi2_1 / 1), clipped to stay finite."""
    g = gen(seed)
    z = torch.randn(*shape, generator=g)
    w = torch.randn(*shape, generator=g).abs().clamp_min(1e-3)
    return (z / w).clamp(-1e4, 1e4).to(dtype)


def tie_matrix(rows: int = 4) -> torch.Tensor:
    """fp32 [rows, 64]: each row's amax is 2688 (S_enc = S_dec = 1), so a block with amax 6 has
    scale 1 and every E2M1 bin edge, its neighbours one fp32 ulp away and the saturating
    values show their rounding directly; a tiny block gets a subnormal E4M3 scale, another one
    a scale that rounds to zero (encode scale FLT_MAX)."""
    edges = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    up = [torch.nextafter(torch.tensor(e), torch.tensor(10.0)).item() for e in edges]
    dn = [torch.nextafter(torch.tensor(e), torch.tensor(0.0)).item() for e in edges]
    block0 = [6.0] + edges + [-e for e in edges] + [-0.0]
    block1 = [6.0] + up + [-e for e in dn] + [6.5]
    block2 = [2688.0] + [0.0] * 14 + [-2688.0]
    block3 = [0.01, -0.003, 0.0071, 1e-4] + [0.0] * 12  # subnormal e4m3 scale
    out = torch.zeros(rows, 64)
    for r in range(rows):
        blocks = [block0, block1, block2, block3]
        row = sum(blocks[r % 4:] + blocks[: r % 4], [])
        out[r] = torch.tensor(row)
    out[-1, -16:] = torch.tensor([1e-30, -2e-30] + [0.0] * 14)  # scale rounds to 0 -> enc = FLT_MAX
    return out


def assert_same_bits_or_both_nan(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Bitwise equality, except that any NaN equals any NaN.

    NaN payloads are not part of the contract and torch's own fp32 -> bf16 conversion does not
    fix them (its vectorized CPU path writes 0xFFFF, the scalar path 0x7FC0).
    """
    from minite_megatron.testing import assert_bitwise_equal

    actual, expected = actual.cpu(), expected.cpu()
    nan_a, nan_e = torch.isnan(actual.float()), torch.isnan(expected.float())
    assert_bitwise_equal(nan_a, nan_e, f"{name} (NaN positions)")
    assert_bitwise_equal(torch.where(nan_a, 0, actual), torch.where(nan_e, 0, expected), name)


def assert_quantized_equal(actual, expected, name: str = "q") -> None:
    """``assert_nvfp4_equal`` on codes, scales and global scales; the image with NaN-aware bits."""
    from minite_megatron.testing import assert_nvfp4_equal

    assert_nvfp4_equal(actual, expected, name, image=False)
    if actual.image is not None:
        assert_same_bits_or_both_nan(actual.bf16_image(), expected.image_fp32().to(torch.bfloat16), f"{name}.image")


def run_aot_script(script: str) -> dict:
    """Run ``script`` (sm_90a AOT compiles through :mod:`._aot`) in a fresh Python without
    ``TRITON_INTERPRET`` (the interpreter replaces ``triton.jit``) and return the JSON it prints
    on its last ``JSON...`` line; a failed compile fails the calling test with its stderr."""
    import json
    import subprocess
    import sys

    import pytest

    env = environment(without=("TRITON_INTERPRET",))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"AOT compile for sm_90a failed:\n{proc.stderr[-4000:]}")
    return json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("JSON")][-1][4:])



# ---- a small interpreter of the PTX the decode kernels' inline asm uses (CPU tests of its logic) ----
M32 = 0xFFFFFFFF


def _prmt(a, b, c):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    d = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = src[sel & 7]
        if sel & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0x00
        d |= byte << (8 * i)
    return d


def _lop3(a, b, c, lut):
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def _bf16x2_mul(a, b):
    def halves(x):
        return torch.tensor([x & 0xFFFF, x >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    prod = (halves(a).float() * halves(b).float()).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    return int(prod[0]) | (int(prod[1]) << 16)


def _s8(x, i):
    v = (x >> (8 * i)) & 0xFF
    return v - 256 if v & 0x80 else v


def _dp4a_s32(a, b, c):
    c = c - (1 << 32) if c & 0x80000000 else c
    return c + sum(_s8(a, i) * _s8(b, i) for i in range(4))


PTX_OPS = {
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "shr.u32": lambda a, b: a >> b,
    "shl.b32": lambda a, b: a << b,
    "sub.u32": lambda a, b: a - b,
    "prmt.b32": _prmt,
    "lop3.b32": _lop3,
    "mul.rn.bf16x2": _bf16x2_mul,
    "dp4a.s32.s32": _dp4a_s32,
}


def ptx_body(asm) -> str:
    return asm.value if hasattr(asm, "value") else asm


def ptx_opcodes(asm) -> set:
    """The instructions an asm block uses."""
    import re

    return {m.group(1) for m in re.finditer(r"^\s*([a-z][\w.]*)\s", ptx_body(asm), re.M)} - {".reg"}


def run_ptx(asm, operands: dict) -> dict:
    """Interpret an inline-asm block (straight-line, the :data:`PTX_OPS` instructions, 32-bit
    registers): ``operands`` maps ``$i`` to unsigned 32-bit inputs; returns every register."""
    regs = dict(operands)
    for line in ptx_body(asm).splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [x.strip() for x in args.split(",")]
        if op not in PTX_OPS:
            raise AssertionError(f"the PTX test interpreter does not know {op!r}: teach it (_testing.PTX_OPS)")
        val = [int(x, 0) if x[0].isdigit() else regs[x] for x in args[1:]]
        regs[args[0]] = PTX_OPS[op](*val) & M32
    return regs


# ---- the fused weighted-SwiGLU backward (minite_kernels.triton.moe.weighted_swiglu) ------------------
EPS32 = 2.0**-24  # fp32 unit roundoff


def _half_ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half a 16-bit ulp at |x| (fp64): ``2^(e - mantissa bits - 1)``, floored at the subnormal step."""
    mant, emin = (7, -126) if dtype == torch.bfloat16 else (10, -14)
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**emin)))
    return torch.exp2(e - mant - 1)


def weighted_swiglu_backward_bounds(dy: torch.Tensor, h: torch.Tensor, probs: torch.Tensor):
    """``(exact dh, exact dp, bound dh, bound dp)`` in fp64 for the fused backward's formula.

    Rule (one rounding to h's dtype of an fp32 evaluation): ``|dh - exact| <= half an ulp of
    h's dtype at max(|dh|, |exact|) + (16 + 2|gate|) eps32 S``, with S the magnitude of the
    formula's factors (``|da * up| * sig * (1 + |gate| (1 - sig))`` for d gate, ``|da * silu|``
    for d up): the product chain costs a few fp32 roundings, ``exp(-gate)`` up to ``|gate|``
    ulps (argument reduction; 1 + that from the fast ``ex2``), and ``1 + gate * (1 - sig)``
    cancels near gate = -1.28, which the absolute term S covers; plus ``(|da| + |da * up|)
    (1 + |gate|) 2^-126`` where a GPU flushes an fp32 subnormal ``sig`` (gate < -87) to zero. ``dp`` (fp32, never rounded to
    16 bits): ``(F + 16 + 2 max|gate|) eps32 sum|dy * silu * up|`` (any summation order of F
    terms: ``(F - 1) eps32 sum|t|``, plus each term's own error)."""
    f = h.shape[1] // 2
    g, u = (t.double() for t in torch.chunk(h, 2, -1))  # on h's device (the GPU test's full shapes)
    dyd, p = dy.to(h.device).double(), probs.to(h.device).double().unsqueeze(-1)
    sig = 1.0 / (1.0 + torch.exp(-g))
    silu, da = g * sig, dyd * p
    exact_dh = torch.cat([da * u * sig * (1.0 + g * (1.0 - sig)), da * silu], -1)
    exact_dp = (dyd * silu * u).sum(-1)
    slack = (16.0 + 2.0 * g.abs()) * EPS32
    s = torch.cat([(da * u).abs() * sig * (1.0 + g.abs() * (1.0 - sig)) * slack, (da * silu).abs() * slack], -1)
    # a GPU's fast exp / division may flush fp32 subnormals: sig below 2^-126 (gate < -87) reads as 0
    flush = ((da * u).abs() + da.abs()) * (1.0 + g.abs()) * 2.0**-126
    bound_dh = s + torch.cat([flush, flush], -1)
    bound_dp = (f + 16.0 + 2.0 * g.abs().amax(-1)) * EPS32 * (dyd * silu * u).abs().sum(-1)
    bound_dp = bound_dp + ((dyd * u).abs() * (1.0 + g.abs())).sum(-1) * 2.0**-126
    return exact_dh, exact_dp, bound_dh, bound_dp


def assert_weighted_swiglu_backward(dh: torch.Tensor, dp: torch.Tensor, dy, h, probs, name: str) -> None:
    """``dh`` / ``dp`` within :func:`weighted_swiglu_backward_bounds`' rule of the exact gradient
    (finite inputs), with a report of how many elements miss it and the first one."""
    h = h.to(dh.device)
    exact_dh, exact_dp, bound_dh, bound_dp = weighted_swiglu_backward_bounds(dy, h, probs)
    dhd, dpd = dh.double(), dp.double()
    tol = _half_ulp(torch.maximum(dhd.abs(), exact_dh.abs()), h.dtype) + bound_dh
    err = (dhd - exact_dh).abs()
    bad = ~(err <= tol)
    if bool(bad.any()):
        i = tuple(int(v) for v in bad.nonzero()[0])
        raise AssertionError(f"{name}.dh: {int(bad.sum())} of {bad.numel()} beyond the bound; first {i}: got "
                             f"{dhd[i].item()!r}, exact {exact_dh[i].item()!r}, tolerance {tol[i].item()!r}")
    bad = ~((dpd - exact_dp).abs() <= bound_dp)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise AssertionError(f"{name}.dp: {int(bad.sum())} of {bad.numel()} rows beyond the bound; first {i}: got "
                             f"{dpd[i].item()!r}, exact {exact_dp[i].item()!r}, tolerance {bound_dp[i].item()!r}")
