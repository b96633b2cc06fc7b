"""One-pass row-wise + column-wise NVFP4 quantize against the two separate quantize calls.

    python -m benchmarks.quantize_dual                  # cases + tile sweep, table + JSON
    python -m benchmarks.quantize_dual --sections cases
    TRITON_INTERPRET=1 python -m benchmarks.quantize_dual --smoke   # the script itself, on a CPU

Cases (the Linear's GEMM operands, H200 shapes): the gradient ``dy`` [16384, N] for dgrad
(row-wise, tensor scale, SR) and wgrad (``dy.t()``, tensor scale, SR, RHT), N in {2048, 5120,
6144}; the activation ``x`` [16384, 2048] (row-wise per-token scale, nearest; ``x.t()`` tensor
scale, RHT). Per case:

* ``separate_us``: ``quantize_forward(dy, ...)`` + ``quantize_forward(dy.t(), ...)`` as the
  Linear calls them today, each with its own amax pass (4 reads of dy; 3 of x);
* ``dual_us``: ``quantize_row_col_forward`` (the ``amax_row_col`` pass + the dual pass: 2 reads);
* ``dual_given_us``: the dual pass alone, amaxes given (the tensor-parallel path after the
  all-reduce); ``amax_us``: the amax pass alone;
* ``floor_us``: the byte floor at the measured copy bandwidth (read x once; write both codes,
  scales and images); ``pct_floor`` = floor / dual_given.

``same_bits``: the dual outputs equal the separate calls' bit for bit (checked in the run).
Times are medians of CUDA-graph replays (kernel time, no host overhead). The sweep times
other ``GPU_TILE`` / ``GPU_GROUPS_PER_PROG`` settings of the dual kernel (bits checked again).
Results: one JSON line appended to ``benchmarks/results/quantize_dual.jsonl`` (and ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ._timing import bench, copy_bandwidth_gbps, ensure_minite_kernels, environment, print_table, save

ensure_minite_kernels()

from minite_kernels.triton import quantize_dual as qd  # noqa: E402
from minite_kernels.triton.quantize import quantize_forward  # noqa: E402
from minite_kernels.triton.quantize_dual import amax_row_col_forward, quantize_row_col_forward  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
T = 16384
SMOKE = False

DY = dict(row_scale="tensor", row_rounding="stochastic", row_seed=7, col_scale="tensor",
          col_rounding="stochastic", col_seed=8, col_rht_seed=0)
X = dict(row_scale="row", col_scale="tensor", col_rht_seed=0)

#: (name, (T, N), dual kwargs)
CASES = [
    ("dy dgrad+wgrad (SR, RHT)", (T, 2048), DY),
    ("dy dgrad+wgrad (SR, RHT)", (T, 5120), DY),
    ("dy dgrad+wgrad (SR, RHT)", (T, 6144), DY),
    ("x fprop+wgrad (row scale, RHT)", (T, 2048), X),
]

TILE_SWEEP = [((8, 1, 1), 8), ((8, 1, 1), 4), ((8, 1, 1), 16), ((8, 2, 2), 8), ((16, 1, 2), 8), ((8, 4, 4), 8),
              ((32, 1, 4), 8)]
"""(GPU_TILE, GPU_GROUPS_PER_PROG) of the dual kernel; the first is the default."""


def timed(fn) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (one timed call with --smoke)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return bench(fn, graph=True, rep_ms=60)


def source(shape, seed=0):
    if SMOKE:  # tiny stand-ins with the same structure
        shape = (64, 64)
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * 3.0).to(BF16)


def separate(x, kw):
    """The two quantize_forward calls the Linear makes without the dual op."""
    q_row = quantize_forward(x, global_scale=kw["row_scale"], rounding=kw.get("row_rounding", "nearest"),
                             seed=kw.get("row_seed"), with_image=True)
    q_col = quantize_forward(x.t(), global_scale=kw["col_scale"], rounding=kw.get("col_rounding", "nearest"),
                             seed=kw.get("col_seed"), rht_seed=kw.get("col_rht_seed"), with_image=True)
    return q_row, q_col


def same_bits(a, b) -> bool:
    return all(
        torch.equal(p.codes, q.codes) and torch.equal(p.block_scales.view(torch.uint8), q.block_scales.view(torch.uint8))
        and torch.equal(p.global_decode, q.global_decode) and torch.equal(p.image.view(torch.int16), q.image.view(torch.int16))
        for p, q in zip(a, b)
    )


def floor_bytes(t: int, n: int) -> int:
    """Read x once; write, for each side, codes + scales + bf16 image (global scales ignored)."""
    return 2 * t * n + 2 * (t * n // 2 + t * n // 16 + 2 * t * n)


def sec_cases(res, copy_gbps):
    rows = []
    cols = ["case", "T", "N", "separate_us", "dual_us", "speedup", "dual_given_us", "amax_us", "floor_us",
            "pct_floor", "same_bits"]
    for name, shape, kw in CASES:
        x = source(shape)
        t, n = x.shape
        row = {"case": name, "T": t, "N": n}
        try:
            row["same_bits"] = same_bits(quantize_row_col_forward(x, **kw), separate(x, kw))
            row["separate_us"] = 1e3 * timed(lambda: separate(x, kw))
            row["dual_us"] = 1e3 * timed(lambda: quantize_row_col_forward(x, **kw))
            ra, ca = amax_row_col_forward(x, row_scale=kw["row_scale"], col_scale=kw["col_scale"],
                                          col_rht_seed=kw.get("col_rht_seed"))
            row["dual_given_us"] = 1e3 * timed(lambda: quantize_row_col_forward(x, row_amax=ra, col_amax=ca, **kw))
            row["amax_us"] = 1e3 * timed(lambda: amax_row_col_forward(
                x, row_scale=kw["row_scale"], col_scale=kw["col_scale"], col_rht_seed=kw.get("col_rht_seed")))
            row["speedup"] = row["separate_us"] / row["dual_us"]
            row["floor_us"] = floor_bytes(t, n) / copy_gbps / 1e3
            row["pct_floor"] = 100 * row["floor_us"] / row["dual_given_us"]
        except Exception as e:  # report, keep going
            row["case"] = f"{name} FAILED {type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(row, flush=True)
        del x
    res["cases"] = rows
    print_table("dual row+col quantize vs two quantize_forward calls (CUDA-graph replay, us)", rows, cols)


def sec_sweep(res, copy_gbps):
    rows = []
    base = (qd.GPU_TILE, qd.GPU_GROUPS_PER_PROG)
    cases = [(name, source(shape, 1), kw) for name, shape, kw in CASES[1:]]
    refs = [quantize_row_col_forward(x, **kw) for _, x, kw in cases]
    for tile, per in TILE_SWEEP:
        qd.GPU_TILE, qd.GPU_GROUPS_PER_PROG = tile, per
        try:
            for (name, x, kw), ref in zip(cases, refs):
                t, n = x.shape
                ra, ca = amax_row_col_forward(x, row_scale=kw["row_scale"], col_scale=kw["col_scale"],
                                              col_rht_seed=kw.get("col_rht_seed"))
                us = 1e3 * timed(lambda: quantize_row_col_forward(x, row_amax=ra, col_amax=ca, **kw))
                rows.append({"config": f"{tile} x{per}", "case": f"{name} {t}x{n}", "dual_given_us": us,
                             "pct_floor": 100 * floor_bytes(t, n) / copy_gbps / 1e3 / us,
                             "same_bits": same_bits(quantize_row_col_forward(x, **kw), ref)})
        except Exception as e:  # a config that does not compile: report, keep going
            rows.append({"config": f"{tile} x{per}", "case": f"FAILED {type(e).__name__}: {str(e)[:80]}"})
        finally:
            qd.GPU_TILE, qd.GPU_GROUPS_PER_PROG = base
    res["sweep"] = rows
    print_table("dual kernel tiles (first = default; amaxes given)", rows,
                ["config", "case", "dual_given_us", "pct_floor", "same_bits"])


def main(argv=None):
    global SMOKE, DEV
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default="cases,sweep")
    p.add_argument("--copy-gbps", type=float, default=None, help="copy bandwidth ceiling (default: measure)")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = p.parse_args(argv)
    SMOKE = args.smoke
    if SMOKE:
        DEV = torch.device("cpu")
        args.copy_gbps = args.copy_gbps or 1.0
        globals()["CASES"] = [CASES[0], CASES[-1]]
        globals()["TILE_SWEEP"] = TILE_SWEEP[:1]
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.quantize_dual needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    res = {"env": environment(), "argv": sys.argv[1:]}
    copy = args.copy_gbps
    if copy is None:
        copy = copy_bandwidth_gbps(DEV)
    res["copy_GBps"] = copy
    print(f"copy bandwidth (read + write): {copy} GB/s", flush=True)
    for sec in args.sections.split(","):
        t0 = time.time()
        {"cases": sec_cases, "sweep": sec_sweep}[sec](res, copy)
        print(f"[{sec}: {time.time() - t0:.1f} s]", flush=True)
    if not SMOKE:
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        print("saved:", save(res, "quantize_dual", [here, args.out]))


if __name__ == "__main__":
    main()
