"""Run single NVFP4 kernels at H200 shapes, eagerly, for Nsight Compute (``ncu``).

    ncu --clock-control none --kernel-name regex:'decode|quantize' --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats python -m benchmarks.kernels --sections ncu_cases --ncu-cases decode_qkv_m1

Each case launches its kernel ``--reps`` times (default 4: the first ones compile and warm up,
``--launch-skip`` skips them); without ``--ncu-cases`` it prints the cases. Nothing is timed
here: ncu's counters are the measurement (``benchmarks/device.sh profile`` runs it and keeps the
reports).
"""

from __future__ import annotations

import argparse

import torch

from .._timing import ensure_minite_kernels
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

from minite_kernels.triton.decode.decode_gemm import decode_gemm_op  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402

BF16 = torch.bfloat16
T = 16384


def _rnd(*shape, scale=1.0):
    return torch.randn(*shape, device="cuda", dtype=BF16) * scale


def _decode(m, k, n):
    qw = quantize_forward(_rnd(n, k, scale=0.02), global_scale="tensor", tile=(16, 16))
    qx = quantize_forward(_rnd(m, k), with_image=True)
    return lambda: decode_gemm_op(qx.image, qw.codes, qw.block_scales.view(torch.uint8), qx.global_decode,
                                  qw.global_decode, None, BF16)


def _cols_sr_rht(k, n):
    dy = _rnd(k, n)
    return lambda: quantize_forward(dy.t(), global_scale="tensor", with_image=True, rounding="stochastic", seed=1,
                                    rht_seed=0)


def _rows(k, n):
    x = _rnd(k, n)
    return lambda: quantize_forward(x, with_image=True)


CASES = {
    "decode_qkv_m1": lambda: _decode(1, 2048, 5120),
    "decode_qkv_m16": lambda: _decode(16, 2048, 5120),
    "decode_fc2_m1": lambda: _decode(1, 6144, 2048),
    "rows_x": lambda: _rows(T, 2048),
    "cols_dy_sr_rht": lambda: _cols_sr_rht(T, 5120),
}


def parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--ncu-cases", default="", help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--reps", type=int, default=4)
    return p


def main(argv=None):
    args = parser().parse_known_args(argv)[0]
    cases = [c for c in args.ncu_cases.split(",") if c]
    if not cases:
        print("\n".join(CASES))
        return {}
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"benchmarks.kernels --ncu-cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.kernels --sections ncu_cases needs a CUDA GPU (it runs kernels for ncu)")
    for name in cases:
        fn = CASES[name]()
        for _ in range(args.reps):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: ran {args.reps} times")
    return {"ncu_cases": cases, "reps": args.reps}


if __name__ == "__main__":
    main()
