"""Compile a Triton kernel for a GPU that is not here (ahead of time) and read its machine code.

CI machines have no GPU, but Triton's wheel carries ``ptxas`` and ``cuobjdump``, so a kernel
can be compiled for sm_90a (H200) on a CPU and its SASS inspected: that the image GEMMs use
wgmma (``HGMMA``), that no FMA merges two roundings in the quantize kernel, registers and
spills. Must run in a process without ``TRITON_INTERPRET=1`` (the interpreter replaces
``triton.jit`` functions). Used by tests (in a subprocess) and by ``python -m
minite_kernels.triton._build._aot_kernels`` (a resource report of every kernel).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_for(fn, signature: dict, constexprs: dict, arch: int = 90, divisible=None, **options):
    """``triton.compile`` of JIT function ``fn`` for ``sm_<arch>``; ``signature`` maps every
    non-constexpr argument to a Triton type string (``"*bf16"``, ``"i32"``, ``"fp32"``).

    Like a launch, pointers are marked 16-byte aligned; ``divisible`` names the int arguments a
    launch would see as multiples of 16 (Triton specializes on that), default: every int whose
    name is not in ``("M", "N", "R")``-like row counts is left unmarked unless listed.
    """
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    names = fn.arg_names
    attrs = {}
    for name, ty in signature.items():
        if ty.startswith("*") or (divisible and name in divisible):
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def sass(kernel) -> str:
    """The SASS of a compiled kernel (cuobjdump from Triton's wheel)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
        path = f.name
    try:
        return subprocess.run([tool, "-sass", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)


def opcode_counts(text: str, names=("HGMMA", "HMMA", "FFMA", "FADD", "FMUL", "LDL", "STL", "MUFU")) -> dict:
    """How many times each SASS opcode appears (``HGMMA`` counts ``HGMMA.*`` variants)."""
    return {n: len(re.findall(rf"\b{n}\b", text)) for n in names}


def loop_opcode_counts(text: str) -> dict:
    """Opcode counts of the largest loop in the SASS (the body between a backward branch and its
    target): e.g. SASS instructions per weight of a K loop = sum / weights per thread."""
    import collections

    lines = [ln for ln in text.splitlines() if re.search(r"/\*([0-9a-f]{4,})\*/\s+\S", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    best = []
    for ln, here in zip(lines, addr):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < here:
            body = [x for x, a in zip(lines, addr) if int(m.group(1), 16) <= a <= here]
            best = body if len(body) > len(best) else best
    counts = collections.Counter()
    for ln in best:
        m = re.search(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if m:
            counts[m.group(1)] += 1
    return dict(counts)


def kernel_opcodes(text: str) -> list[str]:
    """The opcodes of a kernel's SASS in program order, up to its last unpredicated ``EXIT``."""
    ops = []
    for ln in text.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", ln)
        if not m:
            continue
        ops.append(m.group(2))
        if m.group(2) == "EXIT" and not m.group(1):
            break
    return ops


def issue_report(text: str, weights_per_thread: int) -> dict:
    """Straight-line kernels (unrolled K loops): SASS instructions per weight of the whole kernel,
    tensor-core ops, and how many global loads are issued before the first MMA."""
    ops = kernel_opcodes(text)
    mma = [i for i, o in enumerate(ops) if o in ("HGMMA", "HMMA")]
    first = mma[0] if mma else len(ops)
    bar = ops.index("BAR") if "BAR" in ops else len(ops)
    wide = [m.group(1) for m in re.finditer(r"\bLDG\.E(\.64|\.128)?\b", text)]
    return {"instructions": len(ops), "per_weight": len(ops) / weights_per_thread,
            "HGMMA": ops.count("HGMMA"), "HMMA": ops.count("HMMA"), "LDG": ops.count("LDG"),
            "LDG_before_first_mma": ops[:first].count("LDG"), "LDG_before_first_BAR": ops[:bar].count("LDG"),
            "vector_loads": sum(1 for w in wide if w)}


def ptxas_resources(kernel, arch: str = "sm_90a") -> dict:
    """Registers and spill bytes as ``ptxas -v`` reports them for the kernel's PTX."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([tool, f"-arch={arch}", "-v", ptx, "-o", os.path.join(d, "k.cubin")],
                             check=True, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spill = re.search(r"(\d+) bytes spill stores", out)
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": int(spill.group(1)) if spill else None}


def report(kernel) -> dict:
    """Registers, spills, shared memory and opcode counts of a compiled kernel."""
    return {**ptxas_resources(kernel), "shared": kernel.metadata.shared, **opcode_counts(sass(kernel))}
