"""The routed experts' SwiGLU x routing probability: fused vs Megatron's unfused ops, on one GPU.

    python -m benchmarks.kernels --sections moe_activation          # table + JSON (benchmarks/results/moe_activation.jsonl, --out)
    python -m benchmarks.kernels --sections moe_activation --smoke  # the script itself, tiny shapes on a CPU

Rows = routed rows of fc1 output ``h`` [R, 2F] (the qwen3-moe learner: 4096 / 16384 tokens x
top-8, F = 768), bf16, ``p`` [R] fp32. Per case:

* ``fwd_bf16``: Megatron's ``(F.silu(gate) * up * p[:, None]).to(bf16)`` (``unfused``) against
  :func:`minite_kernels.triton.moe.weighted_swiglu.weighted_swiglu` (``fused``, the BF16 twin's);
* ``fwd_nvfp4``: the same unfused ops plus fc2's input quantize (``quantize_forward(y, "row",
  image)``) against ``swiglu_quantize(h, probs=p)`` (one kernel, the handoff's);
* ``fwd_bwd``: forward and backward (``d h``, ``d p``) through autograd's chain against
  :func:`minite_megatron.ops.moe_activation.weighted_swiglu` (fused forward + one backward kernel).

Forward times: medians of CUDA-graph replays (kernel time); fwd_bwd: CUDA events around eager
calls (autograd; at these sizes the kernels dominate). GB/s: the fused kernel's minimum bytes
(h read, y written; + codes, scales, image, global scales for nvfp4; + dy read, dh written for
the backward). same_bits: the fused forward equals the unfused one bit for bit (y; codes,
scales, global scales for nvfp4).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import RESULTS_ANCHOR, command
from .._timing import add_output_args, bench, ensure_minite_kernels, environment, print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402
from minite_kernels.triton.nvfp4.swiglu_quantize import swiglu_quantize  # noqa: E402
from minite_kernels.triton.moe.weighted_swiglu import weighted_swiglu  # noqa: E402

from minite_megatron.ops import moe_activation  # noqa: E402

DEV = torch.device("cuda")
SMOKE = False
CASES = [("4096 tokens x top-8", 32768, 768), ("16384 tokens x top-8", 131072, 768)]


def timed(fn, graph: bool = True) -> float:
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return bench(fn, graph=graph, rep_ms=100)


def unfused(h, p):
    gate, up = torch.chunk(h, 2, -1)
    return ((torch.nn.functional.silu(gate) * up) * p.unsqueeze(-1)).to(h.dtype)


def run_case(name, rows, f):
    if SMOKE:
        rows, f = 8, 32
    g = torch.Generator(device=DEV).manual_seed(rows)
    h = (torch.randn(rows, 2 * f, device=DEV, generator=g) * 3).to(torch.bfloat16)
    p = torch.rand(rows, device=DEV, generator=g)
    dy = torch.randn(rows, f, device=DEV, generator=g).to(torch.bfloat16)
    out = []
    y_u, y_f = unfused(h, p), weighted_swiglu(h, p)
    row = {"case": f"{name} fwd_bf16", "rows": rows, "F": f, "same_bits": torch.equal(y_u.view(torch.int16), y_f.view(torch.int16))}
    row["unfused_us"] = 1e3 * timed(lambda: unfused(h, p))
    row["fused_us"] = 1e3 * timed(lambda: weighted_swiglu(h, p))
    row["GBps"] = rows * f * 6 / row["fused_us"] / 1e3
    out.append(row)

    q_u = quantize_forward(y_u, global_scale="row", with_image=True)
    a_f, q_f = swiglu_quantize(h, probs=p)
    same = (torch.equal(a_f.view(torch.int16), y_u.view(torch.int16)) and torch.equal(q_f.codes, q_u.codes)
            and torch.equal(q_f.block_scales.view(torch.uint8), q_u.block_scales.view(torch.uint8))
            and torch.equal(q_f.global_decode.view(torch.int32), q_u.global_decode.view(torch.int32)))
    row = {"case": f"{name} fwd_nvfp4", "rows": rows, "F": f, "same_bits": same}
    row["unfused_us"] = 1e3 * timed(lambda: quantize_forward(unfused(h, p), global_scale="row", with_image=True))
    row["fused_us"] = 1e3 * timed(lambda: swiglu_quantize(h, probs=p))
    row["GBps"] = (rows * f * 6 + rows * f * (2 + 1 / 2 + 1 / 16) + 4 * rows) / row["fused_us"] / 1e3
    out.append(row)

    hg, pg = h.clone().requires_grad_(), p.clone().requires_grad_()

    def chain():
        return torch.autograd.grad(unfused(hg, pg), (hg, pg), dy)

    def fused():
        return torch.autograd.grad(moe_activation.weighted_swiglu(hg, pg, kernels_on_cpu=SMOKE), (hg, pg), dy)

    row = {"case": f"{name} fwd_bwd", "rows": rows, "F": f, "same_bits": None}
    row["unfused_us"] = 1e3 * timed(chain, graph=False)
    row["fused_us"] = 1e3 * timed(fused, graph=False)
    row["GBps"] = rows * f * 16 / row["fused_us"] / 1e3
    out.append(row)
    for r in out:
        r["ratio"] = r["unfused_us"] / r["fused_us"]
    return out


def parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    add_output_args(ap, RESULTS_ANCHOR)
    return ap


def main(argv=None):
    global SMOKE, DEV
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    SMOKE = args.smoke
    if SMOKE:
        DEV = torch.device("cpu")  # (the fused backward's kernel interpreted: kernels_on_cpu=SMOKE)
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.kernels --sections moe_activation needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    res = {"env": environment(), "command": command(argv)}
    rows = []
    for name, r, f in CASES:
        rows += run_case(name, r, f)
        if SMOKE:
            break
    cols = ["case", "rows", "F", "unfused_us", "fused_us", "ratio", "GBps", "same_bits"]
    res["moe_activation"] = rows
    print_table("MoE activation x routing probability: Megatron's unfused ops vs fused (us)", rows, cols)
    if SMOKE:  # under the interpreter the forward's exp is numpy's: same_bits is a GPU claim
        if args.out:
            print("saved:", save(res, "moe_activation_smoke", [args.out]))
        return res
    print("saved:", save(res, "moe_activation", [args.json_dir, args.out]))
    return res


if __name__ == "__main__":
    main()
