"""Fused producers (RMSNorm -> NVFP4, SwiGLU -> NVFP4) against the unfused pair, on one GPU.

    python -m benchmarks.kernels --sections producers          # table + JSON (benchmarks/results/producers.jsonl, --out)
    python -m benchmarks.kernels --sections producers --smoke  # the script itself, tiny shapes on a CPU

fused_us: :func:`minite_kernels.triton.nvfp4.norm_quantize.rmsnorm_quantize` /
:func:`minite_kernels.triton.nvfp4.swiglu_quantize.swiglu_quantize` (one kernel). unfused_us: the op
(``bi_rmsnorm``; torch's eager ``F.silu(gate) * up`` as Megatron runs it without fusion) followed
by ``quantize_forward(out, global_scale="row", with_image=True)``; op_us / quant_us time the two
alone. Times are medians of CUDA-graph replays (kernel time, no host overhead). GB/s counts the
fused kernel's minimum bytes: input read once, output + codes + scales + image + global scales
written once; pct_copy is that against a measured device copy (read + write). same_bits: the
fused outputs equal the unfused ones bit for bit (the op output, codes, scales, global scales,
image).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from . import RESULTS, command
from .._timing import bench, copy_bandwidth_gbps, ensure_minite_kernels, environment, print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

from minite_kernels.triton.invariant.bi_rmsnorm import bi_rmsnorm  # noqa: E402
from minite_kernels.triton.nvfp4.norm_quantize import rmsnorm_quantize  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402
from minite_kernels.triton.nvfp4.swiglu_quantize import swiglu_quantize  # noqa: E402

DEV = torch.device("cuda")
SMOKE = False

#: (name, kind, rows, width): norm width = H; swiglu width = F (input [rows, 2F]).
CASES = [
    ("rmsnorm 16384x2048 (Qwen3-30B-A3B hidden)", "norm", 16384, 2048),
    ("rmsnorm 16384x4096", "norm", 16384, 4096),
    ("rmsnorm 16384x5120 (y read back)", "norm", 16384, 5120),
    ("swiglu MoE 65536x1536 -> 768", "swiglu", 65536, 768),
    ("swiglu dense 16384x12288 -> 6144", "swiglu", 16384, 6144),
]


def timed(fn) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (one timed call with --smoke)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return bench(fn, graph=True, rep_ms=100)


def out_bytes(rows: int, width: int) -> int:
    """Output (16-bit) + codes + scales + image + per-row global scales."""
    return rows * width * 2 + rows * width // 2 + rows * width // 16 + rows * width * 2 + 4 * rows


def _swiglu_eager(h):
    gate, up = torch.chunk(h, 2, -1)
    return torch.nn.functional.silu(gate) * up


def _same(out_a, q_a, out_b, q_b) -> bool:
    return (torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
            and torch.equal(q_a.codes, q_b.codes)
            and torch.equal(q_a.block_scales.view(torch.uint8), q_b.block_scales.view(torch.uint8))
            and torch.equal(q_a.global_decode.view(torch.int32), q_b.global_decode.view(torch.int32))
            and torch.equal(q_a.image.view(torch.int16), q_b.image.view(torch.int16)))


def run_case(name, kind, rows, width, copy_gbps):
    if SMOKE:
        rows, width = min(rows, 8), min(width, 64)
    g = torch.Generator(device=DEV).manual_seed(width)
    row = {"case": name, "rows": rows, "width": width}
    if kind == "norm":
        x = (torch.randn(rows, width, device=DEV, generator=g) * 3).to(torch.bfloat16)
        w = (torch.rand(width, device=DEV, generator=g) + 0.5).to(torch.bfloat16)
        in_bytes = rows * width * 2 + width * 2

        def fused():
            return rmsnorm_quantize(x, w)

        def op():
            return bi_rmsnorm(x, w)
    else:
        x = (torch.randn(rows, 2 * width, device=DEV, generator=g) * 3).to(torch.bfloat16)
        in_bytes = rows * width * 4

        def fused():
            return swiglu_quantize(x)

        def op():
            return _swiglu_eager(x)
    y = op()

    def quant():
        return quantize_forward(y, global_scale="row", with_image=True)

    def unfused():
        out = op()
        return out, quantize_forward(out, global_scale="row", with_image=True)

    fy, fq = fused()
    uy, uq = unfused()
    row["same_bits"] = _same(fy, fq, uy, uq)
    row["fused_us"] = 1e3 * timed(fused)
    row["unfused_us"] = 1e3 * timed(unfused)
    row["op_us"] = 1e3 * timed(op)
    row["quant_us"] = 1e3 * timed(quant)
    row["ratio"] = row["unfused_us"] / row["fused_us"]
    gbs = (in_bytes + out_bytes(rows, width)) / row["fused_us"] / 1e3
    row["GBps"] = gbs
    row["pct_copy"] = 100 * gbs / copy_gbps if copy_gbps else None
    return row


def parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--copy-gbps", type=float, default=None, help="copy bandwidth ceiling (default: measure)")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--producer-cases", default="", help="comma-separated substrings: run only matching cases")
    return p


def main(argv=None):
    global SMOKE, DEV
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    SMOKE = args.smoke
    if SMOKE:
        DEV = torch.device("cpu")
        args.copy_gbps = args.copy_gbps or 1.0
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.kernels --sections producers needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    res = {"env": environment(), "command": command(argv)}
    copy = args.copy_gbps
    if copy is None:
        copy = copy_bandwidth_gbps(DEV)
    res["copy_GBps"] = copy
    print(f"copy bandwidth (read + write): {copy:.1f} GB/s", flush=True)
    cols = ["case", "rows", "width", "fused_us", "unfused_us", "ratio", "op_us", "quant_us", "GBps", "pct_copy",
            "same_bits"]
    rows = []
    wanted = [s for s in args.producer_cases.split(",") if s]
    for name, kind, r, w in CASES:
        if wanted and not any(s in name for s in wanted):
            continue
        try:
            row = run_case(name, kind, r, w, copy)
        except Exception as e:  # report, keep going
            row = {"case": f"{name} FAILED {type(e).__name__}: {str(e)[:100]}"}
        rows.append(row)
        print(" | ".join(f"{row.get(c):.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols),
              flush=True)
        if not SMOKE:
            torch.cuda.empty_cache()
    res["producers"] = rows
    print_table("fused producers vs op + quantize_forward (CUDA-graph replay, us)", rows, cols)
    if SMOKE:
        # swiglu's op output may differ under the interpreter (numpy's exp vs torch's CPU silu)
        bad = [r["case"] for r in rows if not r.get("same_bits") and not r["case"].startswith("swiglu")]
        if bad:
            sys.exit(f"smoke: fused != unfused for {bad}")
        if args.out:
            print("saved:", save(res, "producers_smoke", [args.out]))
        return res
    print("saved:", save(res, "producers", [RESULTS, args.out]))
    return res


if __name__ == "__main__":
    main()
