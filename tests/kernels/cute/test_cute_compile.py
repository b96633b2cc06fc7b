"""The Blackwell kernels compile for sm_100a / sm_103a here (no GPU), and their PTX / SASS
hold what the contract needs: the block-scaled FP4 MMA, the scale copies into tensor memory,
and an epilogue computing ``cvt.rn(add.rn(mul.rn(acc, mul.rn(sa, sb)), bias))`` from loaded
vectors, with no FMA anywhere (a contracted ``acc * alpha + bias`` would round once, not twice).

These tests prove the kernels *build* with the right instructions; they do not run them
(``test_cute_gpu.py`` does, on a Blackwell GPU only).
"""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from minite_kernels.cute.tiles import GemmConfig

MMA = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"

VARIANTS = [
    # (config, arch)
    (GemmConfig(tile_n=128, out_dtype="bfloat16", has_bias=True), "sm_100a"),
    (GemmConfig(tile_n=256, out_dtype="float32"), "sm_100a"),
    (GemmConfig(tile_n=128, out_dtype="bfloat16", has_bias=True, grouped=True), "sm_100a"),
    (GemmConfig(tile_n=256, out_dtype="float16", grouped=True), "sm_103a"),
    (GemmConfig(tile_n=128, out_dtype="float32", k_grouped=True), "sm_100a"),
]
IDS = [f"{c.name}-{a}" for c, a in VARIANTS]
CVT = {"bfloat16": "cvt.rn.bf16.f32", "float16": "cvt.rn.f16.f32", "float32": None}

_INSTR = re.compile(r"^\s*(?:@%p\d+\s+)?([a-z][\w.:]*)\s+(.*?);", re.M)


def _instructions(ptx: str) -> list[tuple[str, list[str]]]:
    """(opcode, operands) of every PTX instruction (operands split at top-level commas)."""
    out = []
    for op, args in _INSTR.findall(ptx):
        out.append((op, [a.strip() for a in re.split(r",(?![^{]*})", args)]))
    return out


def _definitions(ptx: str) -> dict[str, set[str]]:
    """register -> opcodes that write it (PTX registers may be written more than once)."""
    defs: dict[str, set[str]] = defaultdict(set)
    for op, args in _instructions(ptx):
        if not args or op.startswith(("st.", "bra", "mbarrier", "tcgen05.mma", "tcgen05.cp", "cp.")):
            continue
        for reg in re.findall(r"%\w+", args[0]):  # {%r1, %r2} vectors or a single register
            defs[reg].add(op)
    return defs


@pytest.mark.parametrize("config,arch", VARIANTS, ids=IDS)
def test_block_scaled_fp4_mma_and_scale_path(kernel_artifacts, config, arch):
    """The main loop uses the NVFP4 block-scaled MMA (K=64 instructions: four per 256-wide k
    tile, one per 64-wide k tile of the K-grouped variant), fed by TMA loads and by
    ``tcgen05.cp`` copies of the scales into tensor memory."""
    ptx, _ = kernel_artifacts(config, arch)
    assert f".target {arch}" in ptx
    mmas = re.findall(r"tcgen05\.mma\.[\w:.]+", ptx)
    assert mmas and all(m.startswith(MMA) for m in mmas), sorted(set(mmas))
    assert len(mmas) == config.tile_k // 64
    assert "tcgen05.cp.cta_group::1" in ptx
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == 4  # A, B, SFA, SFB
    assert "tcgen05.alloc" in ptx and "tcgen05.dealloc" in ptx


@pytest.mark.parametrize("config,arch", VARIANTS, ids=IDS)
def test_epilogue_dataflow_matches_the_contract(kernel_artifacts, config, arch):
    """Every stored value is ``round_out(add.rn(mul.rn(acc, mul.rn(ld sa, ld sb)), ld bias))``:
    alpha is one fp32 product of two *loaded* scales, the accumulator (read from tensor memory
    by ``tcgen05.ld`` and waited for) is scaled by it, then the loaded bias is added, then one
    conversion. Pins the epilogue order and the loads of the alpha vectors."""
    ptx, _ = kernel_artifacts(config, arch)
    defs = _definitions(ptx)
    ins = _instructions(ptx)
    muls = [args for op, args in ins if op == "mul.rn.f32"]
    adds = [args for op, args in ins if op == "add.rn.f32"]
    assert len(muls) == 2 * 32  # 32 columns per subtile: alpha and scale for each
    assert len(adds) == (32 if config.has_bias else 0)
    assert not re.search(r"\bfma\.[\w.]*f32\b", ptx), "an fp32 FMA would merge the scale and the bias roundings"

    def written_by(reg: str, prefix: str) -> bool:
        return any(op.startswith(prefix) for op in defs.get(reg, ()))

    alphas = {d for d, a, b in muls if written_by(a, "ld.global") and written_by(b, "ld.global")}
    scaled = {d for d, a, b in muls if b in alphas or a in alphas}
    assert len(alphas) == 32 and len(scaled) == 32
    for d, a, b in muls:
        if d in scaled:
            acc = a if b in alphas else b
            assert written_by(acc, "mov.b64") or written_by(acc, "tcgen05.ld"), (d, acc, defs.get(acc))
    final = scaled
    if config.has_bias:
        assert all((a in scaled and written_by(b, "ld.global")) for _, a, b in adds), adds[:3]
        final = {d for d, _, _ in adds}
    cvt = CVT[config.out_dtype]
    if cvt is not None:
        converted = [args for op, args in ins if op == cvt]
        assert len(converted) == 32 and all(src in final for _, src in converted)
        final = {dst for dst, _ in converted}
    # each result goes through the warp's shared-memory staging tile (the transpose that makes
    # the global stores coalesced), and every global store writes a value read back from it
    staged = [args[1] for op, args in ins if op.startswith("st.shared")]
    assert len(staged) == 32 and set(staged) <= final
    stored = [args[1] for op, args in ins if op.startswith("st.global")]
    from_staging = [v for v in stored if written_by(v, "ld.shared")]
    assert len(from_staging) == 32
    assert len(re.findall(r"bar\.warp\.sync", ptx)) >= 2  # staging written, then read, per warp
    # tcgen05.ld is asynchronous: a wait::ld must separate it from the first use.
    ld = ptx.index("tcgen05.ld.sync.aligned.32x32b")
    assert "tcgen05.wait::ld" in ptx[ld : ptx.index("mul.rn.f32", ld)]


@pytest.mark.parametrize("config,arch", [v for v in VARIANTS if v[1] == "sm_100a"], ids=[i for i, v in zip(IDS, VARIANTS) if v[1] == "sm_100a"])
def test_sass_keeps_the_epilogue_roundings_apart(kernel_artifacts, config, arch):
    """In the final machine code (ptxas output) the MMA is the tensor-core UTCOMMA and the
    epilogue is separate FMUL / FADD: ptxas did not contract them into FFMA."""
    _, sass = kernel_artifacts(config, arch)
    if sass is None:
        pytest.skip("no nvdisasm that decodes sm_100a on this machine")
    assert len(re.findall(r"\bUTCOMMA\b", sass)) == config.tile_k // 64
    assert re.search(r"\bUTCCP\b", sass)
    assert not re.search(r"\bFFMA\b", sass)
    assert len(re.findall(r"\bFMUL\b", sass)) == 64
    assert len(re.findall(r"\bFADD\b", sass)) == (32 if config.has_bias else 0)


def test_grouped_variant_reads_the_group_offsets(kernel_artifacts):
    """The grouped kernel searches the device offsets (loop on ld.global of int32), the dense
    one reads none: one launch serves all experts without a host loop."""
    grouped, _ = kernel_artifacts(VARIANTS[2][0], "sm_100a")
    dense, _ = kernel_artifacts(VARIANTS[0][0], "sm_100a")
    # the dense kernel loads sb and bias per element and sa per row (32 + 32 + at least one);
    # the grouped one also reads the offsets (binary search, scan, pass extents)
    count = lambda ptx: len(re.findall(r"ld\.global\.b32", ptx))  # noqa: E731
    assert 2 * 32 + 1 <= count(dense) <= 3 * 32
    assert count(grouped) >= count(dense) + 4


def test_k_grouped_variant_writes_zeros_for_experts_without_tokens(kernel_artifacts):
    """The wgrad kernel has a second store path (no accumulator read) that writes +0.0 for an
    expert whose token range is empty, besides the 32 epilogue stores per subtile."""
    ptx, _ = kernel_artifacts(VARIANTS[4][0], "sm_100a")
    values = [v.strip() for v in re.findall(r"st\.global\.b32\s+\[[^\]]+\],\s*([^;]+);", ptx)]
    assert len(values) == 64
    assert values.count("0") == 32  # immediate zero bits: +0.0
    defs = _definitions(ptx)
    assert all(any(op.startswith("ld.shared") for op in defs[v]) for v in values if v != "0")
