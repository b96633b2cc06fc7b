"""First run of the Blackwell NVFP4 kernels on a B200 / B300: one command, one readable report.

    python -m benchmarks.blackwell_bringup                 # the whole plan on cuda:0
    python -m benchmarks.blackwell_bringup --quick         # a sample of every stage (~1 min)
    python -m benchmarks.blackwell_bringup --dry-run       # list the probes; needs no GPU
    python -m benchmarks.blackwell_bringup --sanitizer     # also rerun the probes under compute-sanitizer

The kernels in ``kernels/cute/`` were compiled and inspected but never executed (no Blackwell
GPU was available). This script is the plan for their first execution, ordered so that the
first failing stage points at one part of the kernel:

==========  ==========================================================================
stage       what it pins (each probe compares raw bits with the contract's reference)
==========  ==========================================================================
tile        one 128 x 128 tile, K = 64, all ones: launch, TMA, one MMA, epilogue, store
k           K = 64 / 256 / 320 / 512 on exact data: k-tile loop, accumulate flag, K tail
k96         (sm_103a only) the K = 96 kernel B300 selects: K = 96 ... 2304 (one MMA, one and
            two 768-wide k-tiles, tails past K skipped), one-hot scales and K positions at
            its MMA / scale-stage / buffer / k-tile boundaries, tile_n = 256, NaN-filled
            epilogue and grouped probes at K = 864
scale_a     one-hot block scale per (row, K block) of A: the SFA layout and its TMEM copy
scale_b     the same for B at N = 256 (columns 128-255: second N tile) and N = 512
            (tile_n = 256): the SFB layout
nibble      low vs high nibble, and one-hot K positions: element order within bytes / rows
epilogue    distinct row / column global scales and bias, tails (M = 300, N = 200 / 640),
            outputs pre-filled with NaN so that an unwritten cell shows
grouped     MoE grouped GEMM (experts of 0 / 1 rows, straddling tiles) and wgrad, NaN-filled
suite       ``tests/kernels/cute/test_cute_gpu.py``: bitwise, fp32 bound, batch invariance,
            NaN rows, empty inputs (pytest, in a subprocess)
repeat      1000 launches of one realistic GEMM give identical bits
sanitizer   (``--sanitizer``) the quick probes again under ``compute-sanitizer --tool memcheck``
==========  ==========================================================================

It prints a pass/fail table per stage, writes the full report as JSON (``--json``, default
``blackwell_bringup_report.json``) and appends it as one line (device, versions, command) to
``benchmarks/results/blackwell_bringup.jsonl``. Exit status: 0 all passed, 1 a probe failed,
2 refused (the device cannot run the kernels: the reason is printed, nothing is run).

Expected values are computed by the pure-torch contract (``minite_megatron.nvfp4``), on the
same device by default (exact data: any accumulation order gives the same bits).
``--backend reference --device cpu`` runs the harness against the contract itself (its
self-test on a CPU).
"""

from __future__ import annotations

import argparse
from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from benchmarks._timing import ensure_minite_kernels, environment, print_table, save

STAGES = ("tile", "k", "k96", "scale_a", "scale_b", "nibble", "epilogue", "grouped", "suite", "repeat", "sanitizer")
PROBE_STAGES = STAGES[:8]
K96_KS = (96, 192, 672, 768, 864, 1536, 2048, 2304)
"""K of the k96 stage: one MMA; two; seven; one full 768-wide k-tile; a second k-tile of one MMA;
two k-tiles; a tail of 512 (six of eight MMAs); three k-tiles."""
ONE = 0x2  # E2M1 code of 1.0
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # values of the positive codes 0..7
REPORT_DEFAULT = "blackwell_bringup_report.json"


# ---------------------------------------------------------------------------------------------
# Operands (CPU tensors; moved to the run's device when a probe runs)
# ---------------------------------------------------------------------------------------------
def make_operand(codes: torch.Tensor, scales: torch.Tensor, global_decode: torch.Tensor, *, lead: int | None = None):
    """An NVFP4Tensor from packed codes ``[.., rows, K/2]``, linear block scales (fp32 values,
    cast to UE4M3) ``[.., rows, K/16]`` and global decode scales (``[rows]``, or ``[G]`` with
    ``lead=G`` for a grouped weight)."""
    from minite_megatron.nvfp4 import NVFP4Tensor

    k = codes.shape[-1] * 2
    return NVFP4Tensor(
        codes=codes.contiguous(),
        block_scales=scales.to(torch.float8_e4m3fn),
        global_decode=global_decode.to(torch.float32),
        shape=torch.Size([*codes.shape[:-1], k]),
        global_scale="group" if lead else "row",
    )


def filled(rows: int, k: int, byte: int = (ONE << 4) | ONE, scale: float = 1.0, *, lead: int | None = None):
    """Every byte ``byte`` (default: both nibbles 1.0), every block scale ``scale``, global 1."""
    shape = (lead, rows) if lead else (rows,)
    return make_operand(
        torch.full((*shape, k // 2), byte, dtype=torch.uint8),
        torch.full((*shape, k // 16), scale),
        torch.ones(lead or rows),
        lead=lead,
    )


def one_hot_scale(rows: int, k: int, row: int, kblock: int, value: float = 2.0):
    """All ones except the block scale of (``row``, ``kblock``), which is ``value``."""
    q = filled(rows, k)
    scales = torch.ones(rows, k // 16)
    scales[row, kblock] = value
    return make_operand(q.codes, scales, q.global_decode)


def position_probe(rows: int, k: int, position: int):
    """Zero codes except element ``position`` of every row, which is 1.0."""
    codes = torch.zeros(rows, k // 2, dtype=torch.uint8)
    codes[:, position // 2] = ONE << (4 * (position % 2))
    return make_operand(codes, torch.ones(rows, k // 16), torch.ones(rows))


def k_ramp(rows: int, k: int):
    """Element k of every row holds E2M1 code ``1 + k % 7`` (values 0.5, 1, 1.5, 2, 3, 4, 6):
    a value that tells the K position (mod 7) it came from."""
    codes = (1 + torch.arange(k) % 7).to(torch.uint8)
    packed = codes[0::2] | (codes[1::2] << 4)
    return make_operand(packed.expand(rows, -1).clone(), torch.ones(rows, k // 16), torch.ones(rows))


def exact_random(rows: int, k: int, seed: int, *, lead: int | None = None, global_spread: bool = True):
    """Random codes, block scales in {0.5, 1, 2}, random positive global scales: every GEMM
    partial sum is exact in fp32 in any order (a multiple of 2^-4 below 144 K < 2^20 for
    K <= 7281), so results are bitwise whatever the tensor cores' order."""
    gen = torch.Generator().manual_seed(seed)
    shape = (lead, rows) if lead else (rows,)
    codes = torch.randint(0, 256, (*shape, k // 2), generator=gen, dtype=torch.uint8)
    scales = torch.tensor([0.5, 1.0, 2.0])[torch.randint(0, 3, (*shape, k // 16), generator=gen)]
    n_global = lead or rows
    glob = torch.rand(n_global, generator=gen) * 1e-2 + 1e-4 if global_spread else torch.ones(n_global)
    return make_operand(codes, scales, glob, lead=lead)


def to_device(q, device):
    from dataclasses import replace

    return replace(q, codes=q.codes.to(device), block_scales=q.block_scales.to(device), global_decode=q.global_decode.to(device))


# ---------------------------------------------------------------------------------------------
# Probes
# ---------------------------------------------------------------------------------------------
@dataclass
class Probe:
    """One launch and its reference. ``make()`` returns the op's arguments (CPU tensors):
    ``a``, ``b`` and optionally ``bias``, ``out_dtype``, ``group_sizes`` (grouped),
    ``padded`` (wgrad). ``expect`` is what a reader should see (e.g. "row 37 = K + 16")."""

    name: str
    stage: str
    what: str
    make: Callable[[], dict]
    op: str = "gemm"  # gemm | grouped | wgrad
    expect: str = ""
    arch: str | None = None  # the probe needs this GPU (the k96 stage: sm_103a)


def _gemm_probe(name, stage, what, make, expect=""):
    return Probe(name, stage, what, make, "gemm", expect)


def build_plan(quick: bool = False) -> list[Probe]:
    """The probes of stages tile .. grouped, in order (``quick``: a sample of each stage)."""
    plan: list[Probe] = []
    plan.append(
        _gemm_probe(
            "tile_all_ones", "tile", "M = N = 128, K = 64, every value 1.0", lambda: dict(a=filled(128, 64), b=filled(128, 64)),
            "every output 64",
        )
    )
    for k in (64, 256, 320, 512):
        plan.append(
            _gemm_probe(
                f"k{k}", "k", f"M = N = 128, K = {k}, exact random data",
                lambda k=k: dict(a=exact_random(128, k, 10 + k), b=exact_random(128, k, 20 + k)),
            )
        )
    plan += k96_probes(quick)
    k = 256
    a_rows = (0, 1, 31, 32, 63, 64, 127) if quick else range(128)
    kblocks = (0, 3, 4, 15) if quick else range(k // 16)
    for r in a_rows:
        for j in kblocks:
            plan.append(
                _gemm_probe(
                    f"scale_a[r={r},kb={j}]", "scale_a", f"A block scale ({r}, {j}) = 2, all else 1 (M = N = 128, K = 256)",
                    lambda r=r, j=j: dict(a=one_hot_scale(128, k, r, j), b=filled(128, k)),
                    f"row {r} = {k + 16}, every other row {k}",
                )
            )
    for n, rows, blocks in (
        (256, (0, 127, 128, 129, 200, 255) if quick else range(256), (0, 15) if quick else range(k // 16)),
        (512, (0, 256, 511) if quick else range(512), (0, 15) if quick else (0, 7, 15)),
    ):
        for r in rows:
            for j in blocks:
                plan.append(
                    _gemm_probe(
                        f"scale_b[n={n},r={r},kb={j}]", "scale_b",
                        f"B block scale ({r}, {j}) = 2, all else 1 (M = 128, N = {n}, K = 256)",
                        lambda n=n, r=r, j=j: dict(a=filled(128, k), b=one_hot_scale(n, k, r, j)),
                        f"column {r} = {k + 16}, every other column {k}",
                    )
                )
    low, high = ONE, ONE << 4
    for an, bn, result in (("low", "low", k // 2), ("high", "low", 0), ("high", "high", k // 2), ("low", "high", 0)):
        plan.append(
            _gemm_probe(
                f"nibble[a={an},b={bn}]", "nibble", f"A codes in the {an} nibbles only, B in the {bn} (K = 256)",
                lambda an=an, bn=bn: dict(
                    a=filled(128, k, low if an == "low" else high), b=filled(128, k, low if bn == "low" else high)
                ),
                f"every output {result}",
            )
        )
    for pos in (0, 1, 15, 16, 17, 63, 64, 127, 128, 255):
        plan.append(
            _gemm_probe(
                f"position[k={pos}]", "nibble", f"A one-hot at K position {pos}, B a K ramp (K = 256)",
                lambda pos=pos: dict(a=position_probe(128, k, pos), b=k_ramp(128, k)),
                f"every output {E2M1[1 + pos % 7]}",
            )
        )
    for m, n, out_dtype in ((300, 200, torch.bfloat16), (300, 200, torch.float32), (129, 640, torch.bfloat16), (1, 1, torch.bfloat16)):
        plan.append(
            _gemm_probe(
                f"epilogue[m={m},n={n},{str(out_dtype)[6:]}]", "epilogue",
                f"distinct row / column global scales and bias, M = {m}, N = {n}, K = 256, NaN-filled output",
                lambda m=m, n=n, out_dtype=out_dtype: dict(
                    a=exact_random(m, k, m), b=exact_random(n, k, n + 1),
                    bias=torch.randn(n, generator=torch.Generator().manual_seed(n)), out_dtype=out_dtype,
                ),
            )
        )
    for sizes, n in (([0, 1, 127, 0, 129, 5, 300, 0], 96), ([1] * 40, 512), ([300], 200)):
        plan.append(
            Probe(
                f"grouped[G={len(sizes)},n={n}]", "grouped",
                f"grouped GEMM, experts {sizes[:8]}{'...' if len(sizes) > 8 else ''}, N = {n}, K = 256, bias, NaN-filled",
                lambda sizes=sizes, n=n: dict(
                    a=exact_random(sum(sizes), k, len(sizes)), b=exact_random(n, k, n, lead=len(sizes)),
                    bias=torch.randn(len(sizes), n, generator=torch.Generator().manual_seed(3)), group_sizes=sizes,
                ),
                "grouped",
            )
        )
    for padded, n, kk in (([16, 0, 48, 64, 112], 96, 200), ([0, 64, 0], 300, 640)):
        plan.append(
            Probe(
                f"wgrad[{'-'.join(map(str, padded))}]", "grouped",
                f"MoE wgrad GEMM, experts of {padded} tokens, N = {n}, K = {kk}, NaN-filled",
                lambda padded=padded, n=n, kk=kk: dict(
                    a=exact_random(n, sum(padded), 7), b=exact_random(kk, sum(padded), 8), padded=padded
                ),
                "wgrad",
            )
        )
    return plan


def k96_probes(quick: bool = False) -> list[Probe]:
    """The k96 stage (sm_103a's K = 96 kernel; ``arch="sm_103a"``). Its 768-wide k-tile is
    eight MMAs of 96 over three 256-wide buffers, scales in 192-wide stages of two MMAs; the
    probes sit on those boundaries: K blocks 5 | 6 (an MMA's scales start at column 0 or 6),
    11 | 12 (scale stage), 15 | 16 (buffer), 47 | 48 (k-tile), and K positions 95 | 96 (MMA),
    255 | 256 (buffer: MMA 2 reads across it), 767 | 768 (k-tile)."""
    plan = []
    for k in K96_KS:
        plan.append(Probe(
            f"k96[k={k}]", "k96", f"M = N = 128, K = {k}, exact random data (the K = 96 kernel)",
            lambda k=k: dict(a=exact_random(128, k, 30 + k), b=exact_random(128, k, 40 + k)), arch="sm_103a",
        ))
    k = 864
    for n in (512,) if quick else (256, 512):
        plan.append(Probe(
            f"k96[k={k},n={n}]", "k96", f"M = 128, N = {n} (tile_n {256 if n >= 512 else 128}), K = {k}, exact random data",
            lambda n=n: dict(a=exact_random(128, k, 7), b=exact_random(n, k, n)), arch="sm_103a",
        ))
    kblocks = (5, 6, 12, 48) if quick else (0, 5, 6, 11, 12, 15, 16, 47, 48, 53)
    for r in ((37,) if quick else (0, 37, 127)):
        for j in kblocks:
            plan.append(Probe(
                f"k96_scale_a[r={r},kb={j}]", "k96", f"A block scale ({r}, {j}) = 2, all else 1 (M = N = 128, K = {k})",
                lambda r=r, j=j: dict(a=one_hot_scale(128, k, r, j), b=filled(128, k)),
                "gemm", f"row {r} = {k + 16}, every other row {k}", arch="sm_103a",
            ))
    for r in ((200,) if quick else (0, 127, 128, 255)):
        for j in ((6, 48) if quick else kblocks):
            plan.append(Probe(
                f"k96_scale_b[r={r},kb={j}]", "k96", f"B block scale ({r}, {j}) = 2, all else 1 (M = 128, N = 256, K = {k})",
                lambda r=r, j=j: dict(a=filled(128, k), b=one_hot_scale(256, k, r, j)),
                "gemm", f"column {r} = {k + 16}, every other column {k}", arch="sm_103a",
            ))
    for pos in ((95, 256, 768) if quick else (0, 95, 96, 255, 256, 383, 384, 767, 768, 863)):
        plan.append(Probe(
            f"k96_position[k={pos}]", "k96", f"A one-hot at K position {pos}, B a K ramp (K = {k})",
            lambda pos=pos: dict(a=position_probe(128, k, pos), b=k_ramp(128, k)),
            "gemm", f"every output {E2M1[1 + pos % 7]}", arch="sm_103a",
        ))
    plan.append(Probe(
        "k96_epilogue[m=300,n=200]", "k96", f"distinct global scales and bias, M = 300, N = 200, K = {k}, NaN-filled",
        lambda: dict(a=exact_random(300, k, 3), b=exact_random(200, k, 4),
                     bias=torch.randn(200, generator=torch.Generator().manual_seed(5))), arch="sm_103a",
    ))
    sizes = [0, 1, 127, 0, 129, 5, 300, 0]
    plan.append(Probe(
        "k96_grouped[G=8,n=96]", "k96", f"grouped GEMM, experts {sizes}, N = 96, K = {k}, bias, NaN-filled",
        lambda: dict(a=exact_random(sum(sizes), k, 8), b=exact_random(96, k, 9, lead=len(sizes)),
                     bias=torch.randn(len(sizes), 96, generator=torch.Generator().manual_seed(6)), group_sizes=sizes),
        "grouped", arch="sm_103a",
    ))
    return plan


def k96_skip_reason(backend_name: str, device) -> str | None:
    """Why the k96 stage does not apply to this run (None: it does): it tests the kernel that
    sm_103a selects, so it needs a B300 that selects it."""
    if backend_name != "blackwell":
        return None  # another backend (the harness's self-test) runs every probe
    from minite_kernels.cute._host import blackwell_arch
    from minite_kernels.cute.tiles import MMA_K_ENV, choose_mma_k

    arch = blackwell_arch(device)
    if arch != "sm_103a":
        return f"{arch or device} has no K = 96 MMA (sm_103a / B300 only)"
    if choose_mma_k(arch) != 96:
        return f"{MMA_K_ENV}=64 forces the K = 64 kernel"
    return None


# ---------------------------------------------------------------------------------------------
# Running and comparing
# ---------------------------------------------------------------------------------------------
def reference(probe: Probe, args: dict) -> torch.Tensor:
    from minite_megatron import nvfp4

    if probe.op == "grouped":
        return nvfp4.grouped_gemm_reference(args["a"], args["b"], args["group_sizes"], args.get("bias"))
    if probe.op == "wgrad":
        return nvfp4.grouped_wgrad_gemm_reference(args["a"], args["b"], args["padded"])
    return nvfp4.gemm_reference(args["a"], args["b"], args.get("bias"), args.get("out_dtype", torch.bfloat16))


def run_backend(backend, probe: Probe, args: dict) -> torch.Tensor:
    if probe.op == "grouped":
        return backend.grouped_gemm(args["a"], args["b"], args["group_sizes"], args.get("bias"))
    if probe.op == "wgrad":
        return backend.grouped_wgrad_gemm(args["a"], args["b"], args["padded"])
    return backend.gemm(args["a"], args["b"], args.get("bias"), args.get("out_dtype", torch.bfloat16))


def _on(args: dict, device) -> dict:
    from minite_megatron.nvfp4 import NVFP4Tensor

    return {
        key: to_device(v, device) if isinstance(v, NVFP4Tensor) else v.to(device) if isinstance(v, torch.Tensor) else v
        for key, v in args.items()
    }


def compare(got: torch.Tensor, expected: torch.Tensor) -> dict:
    """Bitwise comparison: ``{"ok", "mismatches", "nan", "first", "rows", "cols"}`` (rows /
    cols: where the mismatches are, at most 8 each, so a layout error reads as "row 37
    expected, row 5 got")."""
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return {"ok": False, "error": f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(expected.shape)} {expected.dtype}"}
    g, e = got.detach().cpu(), expected.detach().cpu()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[g.element_size()]
    diff = g.contiguous().view(bits) != e.contiguous().view(bits)
    out = {"ok": not bool(diff.any()), "mismatches": int(diff.sum()), "nan": int(torch.isnan(g.float()).sum())}
    if not out["ok"]:
        idx = diff.nonzero()
        first = tuple(int(i) for i in idx[0])
        out["first"] = {"index": first, "got": float(g[first]), "expected": float(e[first])}
        flat = diff.reshape(-1, diff.shape[-1]) if diff.dim() > 1 else diff.reshape(1, -1)
        out["rows"] = flat.any(1).nonzero().flatten()[:8].tolist()
        out["cols"] = flat.any(0).nonzero().flatten()[:8].tolist()
    return out


@dataclass
class Outcome:
    name: str
    stage: str
    ok: bool
    detail: dict = field(default_factory=dict)


def run_probes(plan: list[Probe], backend, device, reference_device=None) -> list[Outcome]:
    """Run every probe on ``backend`` (tensors on ``device``) and compare with the reference
    (computed on ``reference_device``, default ``device``). A probe that raises fails with the
    exception's one line; later probes still run."""
    ref_device = reference_device or device
    outcomes = []
    for probe in plan:
        try:
            args = probe.make()
            expected = reference(probe, _on(args, ref_device))
            got = run_backend(backend, probe, _on(args, device))
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            detail = compare(got, expected)
        except Exception as e:  # a crash is a result: record it and go on
            detail = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        outcomes.append(Outcome(probe.name, probe.stage, detail.pop("ok"), detail))
    return outcomes


def run_suite(device) -> Outcome:
    """``tests/kernels/cute/test_cute_gpu.py`` in a subprocess: its pass/fail counts."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/cute/test_cute_gpu.py"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(torch.device(device).index or 0))
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    summary = next((line for line in reversed(tail) if " passed" in line or " failed" in line or " error" in line), "")
    ok = proc.returncode == 0 and " passed" in summary and "skipped" not in summary  # a skip: something did not run
    return Outcome("test_cute_gpu.py", "suite", ok, {"summary": summary, "returncode": proc.returncode,
                                                    "seconds": round(time.time() - t0, 1), "tail": tail})


def run_repeat(backend, device, repeats: int) -> Outcome:
    """``repeats`` launches of one realistic GEMM (quantized heavy-tailed data, M = 1000,
    N = 512, K = 1024, bias): every result bitwise equal to the first."""
    from minite_megatron import nvfp4

    gen = torch.Generator().manual_seed(1000)
    x = torch.randn(1000, 1024, generator=gen) * torch.exp(torch.randn(1000, 1024, generator=gen))
    w = torch.randn(512, 1024, generator=gen)
    a = to_device(nvfp4.quantize_reference(x, global_scale="row"), device)
    b = to_device(nvfp4.quantize_reference(w, global_scale="tensor", tile=(16, 16)), device)
    bias = torch.randn(512, generator=gen).to(device)
    first = backend.gemm(a, b, bias, torch.bfloat16)
    bits = first.view(torch.int16).clone()
    differing = []
    for i in range(1, repeats):
        again = backend.gemm(a, b, bias, torch.bfloat16)
        if not torch.equal(again.view(torch.int16), bits):
            differing.append(i)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return Outcome(f"repeat x{repeats}", "repeat", not differing, {"launches": repeats, "differing": differing[:16],
                                                                     "n_differing": len(differing)})


def run_sanitizer(argv_device: str) -> Outcome:
    """The quick probes again under ``compute-sanitizer --tool memcheck`` (out-of-bounds and
    misaligned accesses, errors the bitwise checks cannot see)."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return Outcome("compute-sanitizer", "sanitizer", False, {"error": "compute-sanitizer is not on PATH (CUDA toolkit)"})
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-m", "benchmarks.blackwell_bringup",
           "--quick", "--stages", ",".join(PROBE_STAGES), "--device", argv_device, "--no-save", "--json", os.devnull]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-12:]
    return Outcome("compute-sanitizer memcheck", "sanitizer", proc.returncode == 0,
                   {"returncode": proc.returncode, "tail": tail})


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------
def stage_table(outcomes: list[Outcome]) -> list[dict]:
    rows = []
    for stage in STAGES:
        mine = [o for o in outcomes if o.stage == stage]
        if not mine:
            continue
        failed = [o for o in mine if not o.ok]
        first = failed[0] if failed else None
        rows.append({
            "stage": stage,
            "probes": len(mine),
            "passed": len(mine) - len(failed),
            "failed": len(failed),
            "result": "PASS" if not failed else "FAIL",
            "first failure": "" if first is None else f"{first.name}: {_short(first.detail)}",
        })
    return rows


def _short(detail: dict) -> str:
    if "error" in detail:
        return detail["error"][:120]
    if "summary" in detail:
        return detail["summary"]
    if "n_differing" in detail:
        return f"{detail['n_differing']} of {detail['launches']} launches differ"
    parts = [f"{detail.get('mismatches')} cells differ", f"{detail.get('nan')} NaN"]
    if "first" in detail:
        f = detail["first"]
        parts.append(f"first {f['index']}: got {f['got']:g}, expected {f['expected']:g}")
    if detail.get("rows"):
        parts.append(f"rows {detail['rows']}")
    if detail.get("cols"):
        parts.append(f"cols {detail['cols']}")
    return "; ".join(parts)


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m benchmarks.blackwell_bringup", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="the device to run on (default cuda:0)")
    p.add_argument("--backend", default="blackwell", help="NVFP4 backend under test (default blackwell; "
                   "'reference' with --device cpu is the harness's self-test)")
    p.add_argument("--quick", action="store_true", help="a sample of the one-hot probes (about 60 probes instead of ~7800)")
    p.add_argument("--stages", default=",".join(s for s in STAGES if s != "sanitizer"),
                   help=f"comma-separated stages to run, from {','.join(STAGES)}")
    p.add_argument("--repeats", type=int, default=1000, help="launches of the repeat stage (default 1000)")
    p.add_argument("--sanitizer", action="store_true", help="add the sanitizer stage (compute-sanitizer memcheck)")
    p.add_argument("--reference-device", default=None, help="where the reference runs (default: --device)")
    p.add_argument("--dry-run", action="store_true", help="list the probes and exit (no device needed)")
    p.add_argument("--json", default=REPORT_DEFAULT, help=f"full report (default {REPORT_DEFAULT})")
    p.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results/blackwell_bringup.jsonl")
    args = p.parse_args(argv)
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"--stages: unknown stage(s) {unknown}; choose from {','.join(STAGES)}")
    if args.repeats < 2:
        p.error(f"--repeats must be at least 2, got {args.repeats}")
    if args.sanitizer and "sanitizer" not in stages:
        stages.append("sanitizer")
    args.stage_list = stages
    return args


def refusal(backend_name: str, device: str) -> str | None:
    """Why this machine cannot run the plan (one line), or None."""
    ensure_minite_kernels()
    from minite_megatron import nvfp4

    try:
        backend = nvfp4.get_backend(backend_name, device)
    except Exception as e:
        return str(e).splitlines()[0]
    reason = backend.why_not(torch.device(device))
    return reason


def main(argv=None) -> int:
    args = parse_args(argv)
    ensure_minite_kernels()
    plan = [p for p in build_plan(args.quick) if p.stage in args.stage_list]
    if args.dry_run:
        print(f"blackwell_bringup plan ({'quick' if args.quick else 'full'}): {len(plan)} probes, stages {','.join(args.stage_list)}")
        for probe in plan:
            needs = f"  [{probe.arch} only]" if probe.arch else ""
            print(f"  {probe.stage:9s} {probe.name:34s} {probe.what}" + (f"  -> {probe.expect}" if probe.expect and probe.op == "gemm" else "") + needs)
        extra = [s for s in ("suite", "repeat", "sanitizer") if s in args.stage_list]
        for s in extra:
            print(f"  {s:9s} " + {"suite": "pytest tests/kernels/cute/test_cute_gpu.py",
                                   "repeat": f"{args.repeats} launches of one GEMM, identical bits",
                                   "sanitizer": "compute-sanitizer --tool memcheck on the quick probes"}[s])
        return 0

    reason = refusal(args.backend, args.device)
    if reason is not None:
        print(f"blackwell_bringup: refused: the {args.backend!r} backend cannot run on {args.device}: {reason}")
        return 2

    from minite_megatron import nvfp4

    backend = nvfp4.get_backend(args.backend, args.device)
    if args.backend == "blackwell":  # outputs NaN-filled: a cell a kernel fails to write shows up
        backend = type(backend)(output_fill=float("nan"))
    skipped = {}
    k96_reason = k96_skip_reason(args.backend, args.device) if any(p.arch for p in plan) else None
    if k96_reason is not None:
        plan = [p for p in plan if p.arch is None]
        skipped["k96"] = k96_reason
        print(f"blackwell_bringup: stage k96 skipped: {k96_reason}")
    t0 = time.time()
    outcomes = run_probes(plan, backend, args.device, args.reference_device)
    if "suite" in args.stage_list and args.backend == "blackwell":
        outcomes.append(run_suite(args.device))
    if "repeat" in args.stage_list:
        outcomes.append(run_repeat(backend, args.device, args.repeats))
    if "sanitizer" in args.stage_list:
        outcomes.append(run_sanitizer(args.device))
    rows = stage_table(outcomes)
    print_table(f"Blackwell bring-up on {args.device} ({args.backend})", rows,
                ["stage", "probes", "passed", "failed", "result", "first failure"])
    ok = all(o.ok for o in outcomes)
    print(f"\n{'ALL PASSED' if ok else 'FAILED'}: {sum(o.ok for o in outcomes)} of {len(outcomes)} checks in {time.time() - t0:.0f} s")

    report = {
        "benchmark": "blackwell_bringup",
        "command": "python -m benchmarks.blackwell_bringup " + " ".join(argv if argv is not None else sys.argv[1:]),
        "backend": args.backend,
        "quick": args.quick,
        "environment": environment(),
        "passed": ok,
        "stages": rows,
        "skipped_stages": skipped,
        "failures": [{"name": o.name, "stage": o.stage, **o.detail} for o in outcomes if not o.ok],
        "passed_checks": [o.name for o in outcomes if o.ok],
    }
    if torch.device(args.device).type == "cuda":
        report["environment"]["capability"] = ".".join(map(str, torch.cuda.get_device_capability(args.device)))
        try:
            import cutlass

            report["environment"]["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
        except ImportError:
            pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"report: {args.json}")
    if not args.no_save:
        for path in save(report, "blackwell_bringup", [os.path.join(os.path.dirname(__file__), "results")]):
            print(f"appended: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
