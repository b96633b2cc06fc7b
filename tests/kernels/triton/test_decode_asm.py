"""The decode kernels' dequantization PTX (``_decode_common._DEQUANT_ASM``), run on the CPU by a
small interpreter of the instructions it uses, against the contract's image values.

The interpreter runs no GPU code, so this pins the asm's *logic*: the byte-permute lookup
tables (``DEQUANT_TABLES``), the sign handling, the nibble selection and the pairing of
outputs, for every code byte, both nibbles and scales from subnormal to 448 and NaN -- and that
each output depends only on its own element (Triton hands an asm block 4 elements of its
choosing). Regression: a first version decoded 4 packed bytes per block and assumed they were
consecutive along K; on the H200 it gave wrong values for some layouts.
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


def _operands(bytes4, flags4, scales4):
    """The asm's inputs (see its comment): $2 bytes, $3 nibble flags, $4 / $5 bf16x2 scales,
    $6 / $10 / $14 / $18 / $22 the tables."""
    word = sum(b << (8 * i) for i, b in enumerate(bytes4))
    flags = sum((0xFF if f else 0) << (8 * i) for i, f in enumerate(flags4))
    sb = torch.tensor(scales4, dtype=torch.float32).to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    ops = {"$2": word, "$3": flags, "$4": int(sb[0]) | int(sb[1]) << 16, "$5": int(sb[2]) | int(sb[3]) << 16}
    for reg, t in zip(("$6", "$10", "$14", "$18", "$22"), DEQUANT_TABLES):
        ops[reg] = t
    return ops


def _expected_bits(code, scale):
    v = (e2m1_decode(torch.tensor([code], dtype=torch.uint8)).float() * scale).to(torch.bfloat16)
    return int(v.view(torch.int16).int() & 0xFFFF)


SCALES = [float.fromhex("0x1p-9"), float.fromhex("0x1.cp-7"), 0.0, 1.0, 1.125, 3.5, 448.0]


def test_every_code_nibble_and_scale():
    rng = random.Random(0)
    cases = list(itertools.product(range(256), (False, True)))
    rng.shuffle(cases)
    for i in range(0, len(cases), 4):
        chunk = cases[i : i + 4]
        scales = [rng.choice(SCALES) for _ in chunk]
        regs = run_asm(_operands([b for b, _ in chunk], [f for _, f in chunk], scales))
        got = [regs["$0"] & 0xFFFF, regs["$0"] >> 16, regs["$1"] & 0xFFFF, regs["$1"] >> 16]
        for (byte, high), s, g in zip(chunk, scales, got):
            code = byte >> 4 if high else byte & 15
            assert g == _expected_bits(code, s), (byte, high, s, hex(g))


def test_each_output_depends_only_on_its_own_element():
    """Changing elements 1..3 never changes output 0 (and so on for every slot)."""
    rng = random.Random(1)
    for _ in range(200):
        base = ([rng.randrange(256) for _ in range(4)], [rng.random() < 0.5 for _ in range(4)],
                [rng.choice(SCALES) for _ in range(4)])
        ref = run_asm(_operands(*base))
        ref_out = [ref["$0"] & 0xFFFF, ref["$0"] >> 16, ref["$1"] & 0xFFFF, ref["$1"] >> 16]
        slot = rng.randrange(4)
        other = [list(x) for x in base]
        for j in range(4):
            if j != slot:
                other[0][j], other[1][j], other[2][j] = rng.randrange(256), rng.random() < 0.5, rng.choice(SCALES)
        new = run_asm(_operands(*other))
        new_out = [new["$0"] & 0xFFFF, new["$0"] >> 16, new["$1"] & 0xFFFF, new["$1"] >> 16]
        assert new_out[slot] == ref_out[slot]


def test_nan_scale_gives_nan():
    regs = run_asm(_operands([0x21, 0x21, 0x21, 0x21], [False] * 4, [float("nan"), 1.0, 1.0, 1.0]))
    assert (regs["$0"] & 0x7F80) == 0x7F80 and (regs["$0"] & 0x7F) != 0  # a bf16 NaN


def test_asm_uses_only_interpreted_instructions():
    body = _DEQUANT_ASM.value if hasattr(_DEQUANT_ASM, "value") else _DEQUANT_ASM
    ops = {m.group(1) for m in re.finditer(r"^\s*([a-z][\w.]*)\s", body, re.M)} - {".reg"}
    assert ops <= {"and.b32", "or.b32", "shr.u32", "shl.b32", "prmt.b32", "lop3.b32", "mul.rn.bf16x2"}, ops
