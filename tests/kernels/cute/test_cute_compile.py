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

from minite_kernels.cute.tiles import K96_SCHEDULE, GemmConfig

MMA = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"
MMA_K96 = MMA + ".collector::a::discard"
"""The exact PTX of B300's K = 96 MMA as the DSL emits it: the same mnemonic as the K = 64 one
(K is bit 31 of the instruction descriptor, checked by decoding it), with operand A's
collector buffer discarded after use."""

VARIANTS = [
    # (config, arch)
    (GemmConfig(tile_n=128, out_dtype="bfloat16", has_bias=True), "sm_100a"),
    (GemmConfig(tile_n=256, out_dtype="float32"), "sm_100a"),
    (GemmConfig(tile_n=128, out_dtype="bfloat16", has_bias=True, grouped=True), "sm_100a"),
    (GemmConfig(tile_n=256, out_dtype="float16", grouped=True), "sm_103a"),
    (GemmConfig(tile_n=128, out_dtype="float32", k_grouped=True), "sm_100a"),
]
IDS = [f"{c.name}-{a}" for c, a in VARIANTS]
K96_VARIANTS = [
    # the sm_103a kernel (selected there automatically): dense with bias, and grouped at
    # tile_n = 256 (the 256-row scale layout of B)
    (GemmConfig(tile_n=128, out_dtype="bfloat16", has_bias=True, mma_k=96), "sm_103a"),
    (GemmConfig(tile_n=256, out_dtype="float16", has_bias=True, grouped=True, mma_k=96), "sm_103a"),
]
K96_IDS = [f"{c.name}-{a}" for c, a in K96_VARIANTS]
ALL_VARIANTS, ALL_IDS = VARIANTS + K96_VARIANTS, IDS + K96_IDS
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


@pytest.mark.parametrize("config,arch", ALL_VARIANTS, ids=ALL_IDS)
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


# ---- which index each epilogue vector is read at ------------------------------------------------
# Kernel parameters in the PTX follow the kernel's argument order (layouts are static):
# 0 tiled_mma, 1-8 the TMA atoms and tensors of A, B, SFA, SFB, 9 C, 10 row scales S_dec_a,
# 11 column scales S_dec_b, 12 bias, 13 group offsets, 14 pair schedule. Each tensor parameter
# holds its pointer first, then its runtime shape / strides: ``param_N`` below names the
# pointer (offset 0), ``param_N+8`` etc. the other fields.
_PARAM = re.compile(r"_param_(\d+)(\+\d+)?")
_ROLE = {"10": "row_scale", "11": "col_scale", "12": "bias", "13": "offsets", "14": "schedule"}
_SPECIAL = re.compile(r"%(?:tid|ctaid)\.[xyz]")


def _data_sources(ptx: str):
    """``sources(reg) -> set``: the kernel parameters (``param_N``) and special registers
    (``%tid.x``, ``%ctaid.y``, ...) that register's value is computed from, following data
    dependences through every definition of every register (loop-carried ones included),
    through loads into their addresses, but not through predicates (``selp``'s condition,
    branches): control flow is no index."""
    defs: dict[str, list[list[str]]] = defaultdict(list)
    for op, args in _instructions(ptx):
        if not args or op.startswith(("st.", "bra", "setp", "mbarrier", "tcgen05.mma", "tcgen05.cp", "cp.", "bar.")):
            continue
        srcs = args[1:3] if op.startswith("selp") else args[1:]
        for reg in re.findall(r"%\w+", args[0]):
            defs[reg].append(srcs)
    memo: dict[str, set[str]] = {}

    def sources(reg: str) -> set[str]:
        if reg in memo:
            return memo[reg]
        memo[reg] = set()  # cycles through loop-carried registers add nothing new
        found: set[str] = set()
        for srcs in defs.get(reg, ()):
            for src in srcs:
                found |= {f"param_{p}{off}" for p, off in _PARAM.findall(src)} | set(_SPECIAL.findall(src))
                for r in re.findall(r"%\w+", _SPECIAL.sub("", src)):
                    found |= sources(r)
        memo[reg] = found
        return found

    return sources


def _epilogue_loads(ptx: str) -> dict[str, list[tuple[str, set[str]]]]:
    """role -> [(loaded register, sources of its address)] for every 32-bit global load: the
    role is the epilogue vector the address is based on (``row_scale``, ``col_scale``,
    ``bias``), else the group array (``schedule``, ``offsets``). An address built from two
    vectors would be a bug: it raises."""
    sources = _data_sources(ptx)
    loads: dict[str, list[tuple[str, set[str]]]] = defaultdict(list)
    for op, args in _instructions(ptx):
        if op != "ld.global.b32":
            continue
        addr = sources(re.findall(r"%\w+", args[1])[0])
        roles = {_ROLE[p[6:]] for p in addr if p[6:] in _ROLE}
        vectors = roles & {"row_scale", "col_scale", "bias"}
        assert len(vectors) <= 1, (args, roles)
        key = vectors.pop() if vectors else ("schedule" if "schedule" in roles else "+".join(sorted(roles)) or "other")
        loads[key].append((args[0], addr))
    return loads


@pytest.mark.parametrize("config,arch", VARIANTS[:4] + K96_VARIANTS, ids=IDS[:4] + K96_IDS)
def test_epilogue_reads_row_scale_by_row_and_column_scale_and_bias_by_column(kernel_artifacts, config, arch):
    """The epilogue's index mapping, read in the generated PTX (issue 13): the address of the
    row scale S_dec_a is computed from the thread index (thread t owns row t of the tile) and
    never from the N tile index; the addresses of the column scale S_dec_b and of the bias are
    computed from the N tile index and never from the thread index, and there are 32 of each
    (one per column of the 32-column subtile). The alpha product multiplies exactly one load
    of each scale, and the bias add adds a bias load. A swapped index (``sa[col]``,
    ``sb[row]``, the bias read by row) changes these dependences and fails here."""
    ptx, _ = kernel_artifacts(config, arch)
    loads = _epilogue_loads(ptx)
    by_reg = {reg: role for role, items in loads.items() for reg, _ in items}
    (row_reg, row_src), = loads["row_scale"]  # one per thread: its own row
    assert "%tid.x" in row_src and "%ctaid.y" not in row_src, row_src
    col_loads = loads["col_scale"]
    assert len(col_loads) == 32, {k: len(v) for k, v in loads.items()}
    for _, src in col_loads:
        assert "%ctaid.y" in src and "%tid.x" not in src, src
    if config.has_bias:
        assert len(loads["bias"]) == 32
        for _, src in loads["bias"]:
            assert "%ctaid.y" in src and "%tid.x" not in src, src
    else:
        assert "bias" not in loads
    ins = _instructions(ptx)
    alphas = [(a, b) for op, (d, a, b) in ((op, args) for op, args in ins if op == "mul.rn.f32") if a in by_reg and b in by_reg]
    assert len(alphas) == 32
    assert all(sorted(by_reg[r] for r in pair) == ["col_scale", "row_scale"] for pair in alphas)
    if config.has_bias:
        adds = [args for op, args in ins if op == "add.rn.f32"]
        assert len(adds) == 32 and all(by_reg.get(b) == "bias" for _, _, b in adds)


def test_grouped_column_scales_and_bias_are_the_experts(kernel_artifacts):
    """In the grouped variant the column-scale and bias loads are indexed by (column, expert):
    their addresses take the expert's stride from the S_dec_b / bias tensor shapes; the CTA's
    expert itself comes from the pair schedule, which the grouped kernel reads (and the dense
    one does not)."""
    grouped, _ = kernel_artifacts(VARIANTS[2][0], "sm_100a")
    dense, _ = kernel_artifacts(VARIANTS[0][0], "sm_100a")
    g_loads, d_loads = _epilogue_loads(grouped), _epilogue_loads(dense)
    assert "schedule" in g_loads and "schedule" not in d_loads and "offsets" not in d_loads
    # the pair's expert (binary search in the schedule) feeds the row scale's tile row too
    (_, row_src), = g_loads["row_scale"]
    assert {"param_10", "param_13", "param_14", "%tid.x", "%ctaid.x"} <= row_src


@pytest.mark.parametrize(
    "config,stages",
    [
        (GemmConfig(tile_n=128, out_dtype="bfloat16"), 6),
        (GemmConfig(tile_n=128, out_dtype="float32"), 5),
        (GemmConfig(tile_n=256, out_dtype="bfloat16"), 4),
        (GemmConfig(tile_n=256, out_dtype="float32"), 3),
        (GemmConfig(tile_n=128, out_dtype="float32", k_grouped=True), 16),
    ],
    ids=lambda v: v.name if isinstance(v, GemmConfig) else str(v),
)
def test_shared_memory_stage_counts(kernel_plan, config, stages):
    """The smem ring depth the kernel picks (what docs/blackwell.md states): the fp32 output's
    larger staging tiles cost one stage at each tile_n (the doc used to claim bf16's counts
    for every output dtype)."""
    plan = kernel_plan(config, "sm_100a")
    assert plan["ab_stages"] == stages and plan["mma_k"] == 64
    assert plan["acc_stages"] == (2 if config.tile_n == 128 else 1)
    assert plan["tmem_cols"] <= 512


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


# ---- the sm_103a K = 96 kernel ---------------------------------------------------------------
def _int_values(ptx: str):
    """``values(operand) -> set of ints or None``: the 32-bit values a register can hold, from a
    constant walk over straight-line integer code (``mov``, ``add``, ``or``, ``and``, ``xor``,
    ``shl``, ``shr``, ``selp``: both alternatives). The one shared-memory load on these chains
    is the tensor-memory base the allocator stored; it is taken as 0 (the kernel allocates all
    512 columns, so the base is column 0 of lane 0) and every offset below is relative to it.
    None: something else (a loop-carried or loaded value)."""
    defs: dict[str, list] = defaultdict(list)
    for op, args in _instructions(ptx):
        if args and re.fullmatch(r"%r\d+", args[0]):
            defs[args[0]].append((op, args[1:]))
    binary = {"add.s32": lambda a, b: a + b, "or.b32": lambda a, b: a | b, "and.b32": lambda a, b: a & b,
              "xor.b32": lambda a, b: a ^ b, "shl.b32": lambda a, b: a << b, "shr.u32": lambda a, b: a >> b}

    def values(x: str):
        x = x.strip("[] ")
        if re.fullmatch(r"-?\d+", x):
            return {int(x) & 0xFFFFFFFF}
        if len(defs.get(x, ())) != 1:
            return None
        op, srcs = defs[x][0]
        if op == "ld.shared.b32":
            return {0}
        if op == "mov.b32":
            return values(srcs[0])
        if op == "selp.b32":
            a, b = values(srcs[0]), values(srcs[1])
            return None if a is None or b is None else a | b
        if op in binary:
            a, b = values(srcs[0]), values(srcs[1])
            if a is None or b is None:
                return None
            return {binary[op](u, v) & 0xFFFFFFFF for u in a for v in b}
        return None

    return values


def _idesc_fields(desc: int) -> dict:
    """The block-scaled tcgen05 instruction descriptor (PTX ISA; CUTLASS's
    ``UMMA::InstrDescriptorBlockScaled``): bit 31 is the K size (1 = K96, dense)."""
    return {
        "b_sf_id": (desc >> 4) & 3, "a_format": (desc >> 7) & 7, "b_format": (desc >> 10) & 7,
        "a_major": (desc >> 15) & 1, "b_major": (desc >> 16) & 1, "n": ((desc >> 17) & 63) << 3,
        "sf_format": (desc >> 23) & 1, "m": ((desc >> 24) & 31) << 4, "a_sf_id": (desc >> 29) & 3,
        "k96": desc >> 31, "sparse": (desc >> 2) & 1,
    }


def _mmas(ptx: str) -> list[list[str]]:
    return [args for op, args in _instructions(ptx) if op.startswith("tcgen05.mma")]


@pytest.mark.parametrize("config,arch", VARIANTS + K96_VARIANTS, ids=IDS + K96_IDS)
def test_instruction_descriptor_selects_k96_exactly_on_the_sm103_kernel(kernel_artifacts, config, arch):
    """Every MMA's instruction descriptor, decoded from the PTX: 128 x tile_n, E2M1 x E2M1,
    K-major, UE4M3 scales, dense, and the K-size bit set (K = 96) in the sm_103a kernel and
    clear (K = 64) in every other variant, including the K = 64 kernel compiled for sm_103a
    (the MINITE_BLACKWELL_MMA_K=64 fallback). The scale-factor IDs (the byte of the 32-bit
    tensor-memory column where an MMA's scales start) are 0 for K = 64."""
    ptx, _ = kernel_artifacts(config, arch)
    values = _int_values(ptx)
    mmas = _mmas(ptx)
    assert len(mmas) == (len(K96_SCHEDULE) if config.mma_k == 96 else config.tile_k // 64)
    for args in mmas:
        descs = values(args[3])
        assert descs, args
        for desc in descs:
            f = _idesc_fields(desc)
            assert f["k96"] == (config.mma_k == 96), (hex(desc), f)
            assert (f["m"], f["n"], f["a_format"], f["b_format"], f["a_major"], f["b_major"]) == (
                128, config.tile_n, 1, 1, 0, 0), f
            assert f["sf_format"] == 0 and f["sparse"] == 0, f  # UE4M3 scales, dense
            if config.mma_k == 64:
                assert f["a_sf_id"] == f["b_sf_id"] == 0, f


@pytest.mark.parametrize("config,arch", K96_VARIANTS, ids=K96_IDS)
def test_k96_kernel_issues_the_schedule(kernel_artifacts, kernel_plan, config, arch):
    """The sm_103a kernel's main loop, read in its PTX, is :data:`K96_SCHEDULE`: per 768-wide
    k-tile, eight K = 96 MMAs (exact instruction text ``MMA_K96``); MMA j's A and B
    descriptors start at chunk ``(3 j) % 8`` (16-byte units) of their buffer (0, 3, 6, 1, 4, 7,
    2, 5: 48 bytes per MMA); its scales are read at tensor-memory column ``acc + (c // 4) *
    rows / 32`` and byte ``c % 4`` of the staged 192-wide scale slice, c = 0 or 6, and that
    byte is the scale-factor ID in its instruction descriptor. Loads: 3 A + 3 B buffer TMAs
    and 4 x (SFA + SFB) scale TMAs per k-tile; 4 scale stages of 3 (A) and 3 x tile_n / 128
    (B) ``tcgen05.cp`` copies. Plan: 7 warps, a scale ring of its own."""
    ptx, _ = kernel_artifacts(config, arch)
    plan = kernel_plan(config, arch)
    assert f".target {arch}" in ptx
    mmas = re.findall(r"tcgen05\.mma\.[\w:.]+", ptx)
    assert mmas == [MMA_K96] * len(K96_SCHEDULE), sorted(set(mmas))
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == 3 * 2 + 4 * 2
    cps = re.findall(r"tcgen05\.cp\.[\w:.]+", ptx)
    assert cps == ["tcgen05.cp.cta_group::1.32x128b.warpx4"] * (4 * (3 + 3 * config.tile_n // 128))
    assert plan["mma_k"] == 96 and plan["threads"] == 7 * 32 and plan["sf_stages"] >= 2 and plan["ab_stages"] >= 2
    assert plan["tmem_cols"] <= 512

    defs = {args[0]: (op, args[1:]) for op, args in _instructions(ptx) if args}
    values = _int_values(ptx)
    acc_cols = config.tile_n * plan["acc_stages"]
    sfa_cols = 4 * 3
    for args, step in zip(_mmas(ptx), K96_SCHEDULE):
        for desc in args[1:3]:  # A, B
            op, srcs = defs[desc]
            chunk = int(srcs[1]) if op == "add.s64" else 0
            assert chunk == step.chunk, (step, op, srcs)
        (idesc,), (sfa,), (sfb,) = values(args[3]) & {max(values(args[3]))}, values(args[4]), values(args[5])
        c = step.sf_column
        assert (sfa & 0xFFFF, sfa >> 30) == (acc_cols + (c // 4) * 4, c % 4), (step, hex(sfa))
        assert (sfb & 0xFFFF, sfb >> 30) == (acc_cols + sfa_cols + (c // 4) * config.tile_n // 32, c % 4), (step, hex(sfb))
        f = _idesc_fields(idesc)
        assert f["a_sf_id"] == f["b_sf_id"] == c % 4, (step, f)


def test_k96_kernel_is_refused_for_sm100a():
    """Only sm_103a has the K = 96 MMA: compiling that variant for sm_100a is one clear error."""
    from minite_kernels.cute._host import dsl_import_error

    if dsl_import_error() is not None:
        pytest.skip(dsl_import_error())
    from minite_kernels.cute._blockscaled_gemm_impl import compile_artifacts, compile_gemm

    config = K96_VARIANTS[0][0]
    for compile_fn in (compile_gemm, compile_artifacts):
        with pytest.raises(ValueError, match="sm_103a only"):
            compile_fn(config, "sm_100a")
