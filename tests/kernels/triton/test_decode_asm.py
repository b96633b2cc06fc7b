"""The decode kernels' dequantization PTX (``_decode_common._DEQUANT_ASM``), run on the CPU by a
small interpreter of the instructions it uses, against the contract's image values.

The interpreter runs no GPU code, so this pins the asm's *logic*: the two-level byte-permute
lookup (``DEQUANT_TABLES``: selector bytes, then the distinct bf16 bytes), the sign handling,
the pairing of the two nibbles of a byte into one bf16x2 register, for every code byte in every
slot of the 4-byte word and scales from subnormal to 448 and NaN -- and that each output
depends only on its own byte and scale (Triton hands an asm block 4 elements of its choosing).
Regression: a first version decoded 4 packed bytes into 8 separately placed outputs and assumed
they were consecutive along K; on the H200 it gave wrong values for some layouts.
"""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

pytest.importorskip("triton")

from minite_kernels.triton._decode_common import DEQUANT_TABLES, _DEQUANT_ASM  # noqa: E402
from minite_megatron.nvfp4.formats import e2m1_decode  # noqa: E402

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


def run_asm(operands: dict) -> dict:
    """Interpret the asm block: ``operands`` maps ``$i`` to 32-bit inputs; returns all registers."""
    regs = dict(operands)
    body = _DEQUANT_ASM.value if hasattr(_DEQUANT_ASM, "value") else _DEQUANT_ASM
    for line in body.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [x.strip() for x in args.split(",")]
        val = [int(x, 0) if x[0].isdigit() else regs[x] for x in args[1:]]
        if op == "and.b32":
            r = val[0] & val[1]
        elif op == "or.b32":
            r = val[0] | val[1]
        elif op == "shr.u32":
            r = val[0] >> val[1]
        elif op == "shl.b32":
            r = (val[0] << val[1]) & M32
        elif op == "prmt.b32":
            r = _prmt(*val)
        elif op == "lop3.b32":
            r = _lop3(*val)
        elif op == "mul.rn.bf16x2":
            r = _bf16x2_mul(*val)
        else:
            raise AssertionError(f"the test's interpreter does not know {op!r}: teach it")
        regs[args[0]] = r & M32
    return regs


def _operands(bytes4, scales4):
    """The asm's inputs (see its comment): $4 the 4 packed bytes, $5..$8 each byte's bf16x2
    (s, s) scale, $9 / $13 / $17 / $21 / $25 the tables."""
    word = sum(b << (8 * i) for i, b in enumerate(bytes4))
    sb = torch.tensor(scales4, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    ops = {"$4": word}
    for j in range(4):
        ops[f"${5 + j}"] = int(sb[j]) | int(sb[j]) << 16
    for reg, t in zip(("$9", "$13", "$17", "$21", "$25"), DEQUANT_TABLES):
        ops[reg] = t
    return ops


def _outputs(regs):
    """(low-nibble value, high-nibble value) bits of each of the 4 bytes."""
    return [(regs[f"${j}"] & 0xFFFF, regs[f"${j}"] >> 16) for j in range(4)]


def _expected_bits(code, scale):
    v = (e2m1_decode(torch.tensor([code], dtype=torch.uint8)).float() * scale).to(torch.bfloat16)
    return int(v.view(torch.int16).int() & 0xFFFF)


SCALES = [float.fromhex("0x1p-9"), float.fromhex("0x1.cp-7"), 0.0, 1.0, 1.125, 3.5, 448.0]


def test_every_code_byte_in_every_slot_and_scale():
    rng = random.Random(0)
    for slot in range(4):
        for byte in range(256):
            others = [rng.randrange(256) for _ in range(4)]
            others[slot] = byte
            scales = [rng.choice(SCALES) for _ in range(4)]
            lo, hi = _outputs(run_asm(_operands(others, scales)))[slot]
            assert lo == _expected_bits(byte & 15, scales[slot]), (slot, byte, scales[slot], hex(lo))
            assert hi == _expected_bits(byte >> 4, scales[slot]), (slot, byte, scales[slot], hex(hi))


def test_each_output_depends_only_on_its_own_byte():
    """Changing the other 3 bytes and scales never changes a slot's output."""
    rng = random.Random(1)
    for _ in range(300):
        base = ([rng.randrange(256) for _ in range(4)], [rng.choice(SCALES) for _ in range(4)])
        ref = _outputs(run_asm(_operands(*base)))
        slot = rng.randrange(4)
        other = [list(x) for x in base]
        for j in range(4):
            if j != slot:
                other[0][j], other[1][j] = rng.randrange(256), rng.choice(SCALES)
        assert _outputs(run_asm(_operands(*other)))[slot] == ref[slot]


def test_nan_scale_gives_nan_and_negative_zero_code():
    (lo, hi), *_ = _outputs(run_asm(_operands([0x21, 0x21, 0x21, 0x21], [float("nan"), 1.0, 1.0, 1.0])))
    assert (lo & 0x7F80) == 0x7F80 and (lo & 0x7F) != 0 and (hi & 0x7F80) == 0x7F80  # bf16 NaNs
    (lo, hi), *_ = _outputs(run_asm(_operands([0x08, 0, 0, 0], [2.0] * 4)))
    assert (lo, hi) == (0x8000, 0x0000)  # code 8 is -0.0, as formats.e2m1_decode


def test_asm_uses_only_interpreted_instructions():
    body = _DEQUANT_ASM.value if hasattr(_DEQUANT_ASM, "value") else _DEQUANT_ASM
    ops = {m.group(1) for m in re.finditer(r"^\s*([a-z][\w.]*)\s", body, re.M)} - {".reg"}
    assert ops <= {"and.b32", "or.b32", "shr.u32", "shl.b32", "prmt.b32", "lop3.b32", "mul.rn.bf16x2"}, ops
