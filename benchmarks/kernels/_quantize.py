"""NVFP4 quantize kernels on one GPU: every dispatch path of the quantizer, one run.

    python -m benchmarks.kernels --sections quantize_paths,quantize_tiles            # table + JSON
    python -m benchmarks.kernels --sections quantize_paths,quantize_tiles --warm-only   # compile only
    python -m benchmarks.kernels --sections quantize_paths --smoke   # the script itself, on a CPU

Every case runs the dispatch of :mod:`minite_kernels.triton.nvfp4.quantize` (row kernel, column
kernel with the RHT fused, flat amax pass); the generic kernels it replaced (``old_us`` in
the earlier records of the JSON file, ``benchmarks/results/runs.md`` runs 5-6) were deleted. Times are medians of CUDA-graph replays (kernel time, no host overhead). GB/s
counts the minimum bytes: input read once, codes + scales + image + global scales written
once; cases with a tensor scale also pay an amax read (at most 4.56 / 6.56 = 70% of copy).

``quantize_tiles`` times other tile configs of the two fast kernels and check that every config writes
exactly the bits of the default one (``same_bits``). Results: one JSON line appended to
``benchmarks/results/quantize_kernels.jsonl`` (and ``--out``).
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

from minite_kernels.triton.nvfp4 import quantize as tq  # noqa: E402
from minite_kernels.triton.nvfp4 import quantize_cols as tc  # noqa: E402
from minite_kernels.triton.backend import TritonBackend, TritonOptions  # noqa: E402
from minite_kernels.triton.nvfp4.amax import amax_forward  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402
from minite_kernels.triton.nvfp4.quantize_tiles import QuantizeTiles  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
T = 16384
WARM_ONLY = False
SMOKE = False

SR = dict(rounding="stochastic", seed=7)
IMG = dict(with_image=True)
TENSOR = dict(global_scale="tensor")

#: (name, (rows, K) of the source tensor, kwargs, transposed: quantize source.t())
CASES = [
    ("act row+image", (T, 2048), IMG, False),
    ("act row+image", (T, 5120), IMG, False),
    ("act row, codes only", (T, 2048), {}, False),
    ("act row+image, SR", (T, 2048), {**IMG, **SR}, False),
    ("act tensor+image (amax pass)", (T, 2048), {**IMG, **TENSOR}, False),
    ("dy tensor+image+SR (dgrad, recipe)", (T, 5120), {**IMG, **TENSOR, **SR}, False),
    ("x.t() tensor+image", (T, 2048), {**IMG, **TENSOR}, True),
    ("x.t() tensor+image+RHT (wgrad, recipe)", (T, 2048), {**IMG, **TENSOR, "rht_seed": 0}, True),
    ("dy.t() tensor+image+SR", (T, 5120), {**IMG, **TENSOR, **SR}, True),
    ("dy.t() tensor+image+SR+RHT (wgrad, recipe)", (T, 5120), {**IMG, **TENSOR, **SR, "rht_seed": 0}, True),
    ("weight 16x16 tensor+image", (12288, 2048), {**IMG, **TENSOR, "tile": (16, 16)}, False),
    ("act row+image RHT (row-major: rht16 first)", (T, 2048), {**IMG, "rht_seed": 1}, False),
]

ROWS_SWEEP = [(32, 1, 4), (32, 2, 4), (32, 4, 4), (32, 8, 4), (32, 4, 2), (32, 4, 0), (16, 4, 4), (32, 1, 0)]
"""``QuantizeTiles.rows`` (threads per row, warps, max chunks) of the row kernel; the first is the default."""
COLS_SWEEP = [((64, 4, 4), 8), ((64, 8, 8), 8), ((32, 16, 4), 8), ((32, 8, 4), 8), ((64, 4, 4), 4),
              ((64, 4, 4), 16), ((64, 2, 2), 8), ((128, 4, 4), 8)]
"""(``QuantizeTiles.cols_tile``, groups per program) of the column kernel; the first is the default."""


def timed(fn) -> float:
    """Median ms of CUDA-graph replays of ``fn`` (or one call with --warm-only / --smoke)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    if WARM_ONLY:
        fn()
        torch.cuda.synchronize()
        return float("nan")
    return bench(fn, graph=True, rep_ms=60)


def qbytes(r: int, k: int, image: bool) -> int:
    return r * k * 2 + r * k // 2 + r * k // 16 + (2 * r * k if image else 0) + 4 * r


def source(shape, seed=0):
    if SMOKE:  # tiny stand-ins with the same structure
        shape = (min(shape[0], 64), min(shape[1], 96) if shape[1] % 96 == 0 or shape[1] < 96 else 64)
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=g) * 3.0).to(BF16)


def sec_cases(res, copy_gbps):
    rows = []
    cols = ["case", "rows", "K", "new_us", "GBps", "pct_copy"]
    print("case | rows | K | new_us | GBps | pct_copy", flush=True)

    def done(row):
        rows.append(row)
        print(" | ".join(f"{row.get(c):.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols),
              flush=True)

    for name, shape, kw, transposed in CASES:
        x = source(shape)
        xin = x.t() if transposed else x
        rr, kk = xin.shape
        row = {"case": name, "rows": rr, "K": kk}
        try:
            row["new_us"] = 1e3 * timed(lambda: quantize_forward(xin, **kw))
            gbs = qbytes(rr, kk, kw.get("with_image", False)) / row["new_us"] / 1e3
            row.update({"GBps": gbs,
                        "pct_copy": 100 * gbs / copy_gbps if copy_gbps else None})
        except Exception as e:  # report, keep going
            row["case"] = f"{name} FAILED {type(e).__name__}: {str(e)[:80]}"
        done(row)
        del x, xin
    x1 = source((1, 2048))
    done({"case": "act row+image, one token (decode)", "rows": 1, "K": 2048,
          "new_us": 1e3 * timed(lambda: quantize_forward(x1, with_image=True))})
    x = source((T, 2048))
    r, k = x.shape
    t = timed(lambda: amax_forward(x, r))
    done({"case": "amax pass alone (flat kernel)", "rows": r, "K": k, "new_us": 1e3 * t, "GBps": r * k * 2 / t / 1e6,
          "pct_copy": 100 * r * k * 2 / t / 1e6 / copy_gbps if copy_gbps else None})
    mask = tq.rht_mask_of(0)
    t = timed(lambda: tc.amax_launch(x.t(), None, k, mask))
    done({"case": "x.t() RHT amax pass alone (column kernel)", "rows": k, "K": r, "new_us": 1e3 * t,
          "GBps": r * k * 2 / t / 1e6, "pct_copy": 100 * r * k * 2 / t / 1e6 / copy_gbps if copy_gbps else None})
    amax = amax_forward(x, r)
    for name, kw in (("x.t() image, amax given (column kernel alone)", {}),
                     ("x.t() image+SR+RHT, amax given (column kernel alone)", {**SR, "rht_seed": 0})):
        t = timed(lambda: quantize_forward(x.t(), global_scale="tensor", amax=amax, with_image=True, **kw))
        gbs = qbytes(k, r, True) / t / 1e6
        done({"case": name, "rows": k, "K": r, "new_us": 1e3 * t, "GBps": gbs,
              "pct_copy": 100 * gbs / copy_gbps if copy_gbps else None})
    for name, kw in (("act row image, amax given (row kernel alone)", {}),):
        t = timed(lambda: quantize_forward(x, global_scale="tensor", amax=amax, with_image=True, **kw))
        gbs = qbytes(r, k, True) / t / 1e6
        done({"case": name, "rows": r, "K": k, "new_us": 1e3 * t, "GBps": gbs,
              "pct_copy": 100 * gbs / copy_gbps if copy_gbps else None})
    res["quantize"] = rows
    print_table("quantize: new dispatch vs the generic kernels (CUDA-graph replay, us)", rows, cols)


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("codes", "block_scales", "global_decode")) and (
        a.image is None or torch.equal(a.image.view(torch.int16), b.image.view(torch.int16)))


def sec_sweeps(res, copy_gbps):
    """Each config is a ``TritonBackend(TritonOptions(quantize_tiles=...))`` of its own."""
    rows = []

    def sweep(kernel, label, tiles, cases, refs):
        be = TritonBackend(TritonOptions(quantize_tiles=tiles))
        try:
            for (name, x, kw), ref in zip(cases, refs):
                r, k = x.shape
                t = timed(lambda: be.quantize(x, **kw))
                gbs = qbytes(r, k, True) / t / 1e6
                rows.append({"kernel": kernel, "config": label, "case": f"{name} {r}x{k}", "us": 1e3 * t,
                             "GBps": gbs, "pct_copy": 100 * gbs / copy_gbps if copy_gbps else None,
                             "same_bits": _same(be.quantize(x, **kw), ref)})
        except Exception as e:  # a config that does not compile: report, keep going
            rows.append({"kernel": kernel, "config": label, "case": f"FAILED {type(e).__name__}: {str(e)[:80]}"})

    cases = [("act row+image", source((T, 2048)), IMG), ("act row+image", source((T, 5120), 1), IMG),
             ("dy tensor+image+SR", source((T, 5120), 2), {**IMG, **TENSOR, **SR})]
    refs = [quantize_forward(x, **kw) for _, x, kw in cases]
    for cfg in ROWS_SWEEP:
        sweep("rows", str(cfg), QuantizeTiles(rows=cfg), cases, refs)
    del cases, refs
    cases = [("x.t() tensor+image", source((T, 2048), 3).t(), {**IMG, **TENSOR}),
             ("dy.t() tensor+image+SR+RHT", source((T, 5120), 4).t(), {**IMG, **TENSOR, **SR, "rht_seed": 0})]
    refs = [quantize_forward(x, **kw) for _, x, kw in cases]
    for tile, per in COLS_SWEEP:
        sweep("cols", f"{tile} x{per}", QuantizeTiles(cols_tile=tile, cols_grid=(per, QuantizeTiles().cols_grid[1])),
              cases, refs)
    res["sweeps"] = rows
    print_table("tile sweeps (first config = default; same_bits: equal to the default's output)", rows,
                ["kernel", "config", "case", "us", "GBps", "pct_copy", "same_bits"])


SECTIONS = ("quantize_paths", "quantize_tiles")


def parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--copy-gbps", type=float, default=None, help="copy bandwidth ceiling (default: measure)")
    p.add_argument("--warm-only", action="store_true", help="compile and run every variant once, time nothing")
    p.add_argument("--shard", default="0/1", help="i/N: with --warm-only, only every N-th case and config")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    return p


def main(argv=None):
    global WARM_ONLY, SMOKE, DEV
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    SMOKE = args.smoke
    if SMOKE:
        DEV = torch.device("cpu")
        args.copy_gbps = args.copy_gbps or 1.0
        globals()["ROWS_SWEEP"] = ROWS_SWEEP[:2]
        globals()["COLS_SWEEP"] = COLS_SWEEP[:2]
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.kernels (quantize sections) needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    WARM_ONLY = args.warm_only
    if WARM_ONLY:  # parallel compile: N processes, each takes every N-th case and sweep config
        i, n = (int(v) for v in args.shard.split("/"))
        for name in ("CASES", "ROWS_SWEEP", "COLS_SWEEP"):
            globals()[name] = globals()[name][i::n]
    torch.manual_seed(0)
    res = {"env": environment(), "command": command(argv)}
    copy = args.copy_gbps
    if copy is None and not WARM_ONLY:
        copy = copy_bandwidth_gbps(DEV)
    res["copy_GBps"] = copy
    print(f"copy bandwidth (read + write): {copy} GB/s", flush=True)
    for sec in args.sections.split(","):
        t0 = time.time()
        {"quantize_paths": sec_cases, "quantize_tiles": sec_sweeps}[sec](res, copy)
        print(f"[{sec}: {time.time() - t0:.1f} s]", flush=True)
    if not WARM_ONLY and not SMOKE:
        print("saved:", save(res, "quantize_kernels", [RESULTS, args.out]))
    return res


if __name__ == "__main__":
    main()
