"""Run single NVFP4 kernels at H200 shapes, eagerly, for Nsight Compute (``ncu``).

    ncu --clock-control none --kernel-name regex:'decode|quantize' --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats python -m benchmarks.profile_kernels decode_qkv_m1

Each case launches its kernel ``--reps`` times (default 4: the first ones compile and warm up,
``--launch-skip`` skips them). ``--list`` prints the cases. Nothing is timed here: ncu's
counters are the measurement (``benchmarks/device_session.sh profile`` runs it and keeps the
reports).
"""

from __future__ import annotations

import argparse
from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2

import torch

from ._timing import ensure_minite_kernels

ensure_minite_kernels()

from minite_kernels.triton.decode_gemm import decode_gemm_op  # noqa: E402
from minite_kernels.triton.quantize import quantize_forward  # noqa: E402

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


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="*")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--list", action="store_true")
    args = p.parse_args(argv)
    if args.list or not args.cases:
        print("\n".join(CASES))
        return
    for name in args.cases:
        fn = CASES[name]()
        for _ in range(args.reps):
            fn()
        torch.cuda.synchronize()
        print(f"{name}: ran {args.reps} times")


if __name__ == "__main__":
    main()
