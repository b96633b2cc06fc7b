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

import random

import pytest
import torch

pytest.importorskip("triton")

from minite_kernels.triton.decode._decode_common import DEQUANT_TABLES, _DEQUANT_ASM  # noqa: E402
from minite_kernels.triton._build._testing import ptx_opcodes, run_ptx  # noqa: E402
from minite_megatron.nvfp4.formats import e2m1_decode  # noqa: E402

def run_asm(operands: dict) -> dict:
    return run_ptx(_DEQUANT_ASM, operands)


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
    assert ptx_opcodes(_DEQUANT_ASM) <= {"and.b32", "or.b32", "shr.u32", "shl.b32", "prmt.b32", "lop3.b32",
                                         "mul.rn.bf16x2"}, ptx_opcodes(_DEQUANT_ASM)
