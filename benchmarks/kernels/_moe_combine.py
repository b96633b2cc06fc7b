"""The MoE combine and the dispatch permutation's backward: the Triton kernels vs torch.

    python -m benchmarks.kernels --sections moe_combine           # qwen3-moe shapes: 4096 and 16384 tokens
    python -m benchmarks.kernels --sections moe_combine --smoke   # CPU, tiny shapes (interpreter): the script works

Per token count (hidden 2048, 128 experts, top-8, bf16, Megatron's expert-major permutation):

* ``combine fwd``: ``[T*k, H]`` expert rows -> ``[T, H]``: the torch formulation
  (``deterministic_moe.deterministic_unpermute_reference``: k gathers, ``where``s and adds), the one-pass
  kernel (``minite_kernels.triton.moe.moe_combine``), and Megatron's non-deterministic ``scatter_add_``
  (``moe_utils.unpermute``) as the speed it replaces;
* ``combine fwd+bwd``: the same with the gradient of the rows (torch: ``index_add_`` per slot;
  kernel: one gather);
* ``permute bwd``: the gradient of the dispatch ``index_select`` (Megatron: ``index_add_`` with
  atomics; minite: the ordered-sum kernel).

Times are ``triton.testing.do_bench`` medians (CUDA events). ``GB/s`` counts the kernel's minimum
bytes (rows read once, output written once). Every kernel result is checked bitwise against the
torch formulation before it is timed. One JSON line per run in ``benchmarks/results/moe_combine.jsonl``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from . import RESULTS_ANCHOR, command
from .._timing import bench, ensure_minite_kernels, environment, add_output_args, print_table, save, smoke_on_the_interpreter
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()


def _case(tokens: int, experts: int, topk: int, hidden: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    routing = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, scores.topk(topk, 1).indices, True).to(device)
    flat = routing.t().reshape(-1).argsort(descending=True, stable=True)[: tokens * topk]
    idx = flat % tokens  # Megatron's permute: expert-major, tokens ascending
    rows = (torch.randn(tokens * topk, hidden, generator=g) * 4).to(torch.bfloat16).to(device)
    grad = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)
    return routing, idx, rows, grad


def run(tokens: int, experts: int, topk: int, hidden: int, device) -> list[dict]:
    from megatron.core.transformer.moe.moe_utils import unpermute

    from minite_kernels.triton.moe.moe_combine import deterministic_unpermute
    from minite_megatron.modules.deterministic_moe import deterministic_unpermute_reference
    from minite_megatron.testing import assert_bitwise_equal

    routing, idx, rows, grad = _case(tokens, experts, topk, hidden, device)
    shape = torch.Size((tokens, hidden))
    assert_bitwise_equal(deterministic_unpermute(rows, idx, tokens),
                         deterministic_unpermute_reference(rows, idx, tokens), "combine")
    leaf = rows.detach().requires_grad_(True)

    def fwd_bwd(fn):
        def go():
            leaf.grad = None
            fn(leaf, idx, tokens).backward(grad)
        return go

    fwd_bwd(deterministic_unpermute)()
    kernel_grad = leaf.grad.clone()
    fwd_bwd(deterministic_unpermute_reference)()
    assert_bitwise_equal(kernel_grad, leaf.grad, "combine grad")
    rows_grad = rows  # the permutation backward: d(tokens) = the sum of each token's d(rows)

    def permute_bwd_megatron():  # IndexSelectBackward
        torch.zeros(tokens, hidden, dtype=rows.dtype, device=device).index_add_(0, idx, rows_grad)

    nbytes = rows.numel() * rows.element_size() + tokens * hidden * rows.element_size()
    cases = [
        ("combine fwd", "torch (reference)", lambda: deterministic_unpermute_reference(rows, idx, tokens)),
        ("combine fwd", "triton kernel", lambda: deterministic_unpermute(rows, idx, tokens)),
        ("combine fwd", "megatron scatter_add_ (atomic)", lambda: unpermute(rows, idx, shape)),
        ("combine fwd+bwd", "torch (reference)", fwd_bwd(deterministic_unpermute_reference)),
        ("combine fwd+bwd", "triton kernel", fwd_bwd(deterministic_unpermute)),
        ("permute bwd", "megatron index_add_ (atomic)", permute_bwd_megatron),
        ("permute bwd", "triton kernel (ordered sum)", lambda: deterministic_unpermute(rows_grad, idx, tokens)),
    ]
    out = []
    for what, impl, fn in cases:
        if device.type == "cuda":
            ms = bench(fn)
        else:  # smoke: one timed call
            import time

            fn()
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        row = {"tokens": tokens, "op": what, "impl": impl, "ms": ms}
        if what != "combine fwd+bwd":
            row["GB/s"] = nbytes / ms / 1e6
        out.append(row)
    return out


def parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    add_output_args(ap, RESULTS_ANCHOR)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    if args.smoke:
        smoke_on_the_interpreter()
        args.tokens, args.experts, args.topk, args.hidden = "24", 8, 2, 32
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("benchmarks.kernels --sections moe_combine needs a CUDA GPU (or --smoke on a CPU)")
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        rows += run(t, args.experts, args.topk, args.hidden, device)
    env = environment()
    print_table(f"MoE combine, {args.experts} experts top-{args.topk}, hidden {args.hidden}, bf16, {env['device']}",
                rows, ["tokens", "op", "impl", "ms", "GB/s"])
    record = {"bench": "moe_combine", **env, "experts": args.experts, "topk": args.topk, "hidden": args.hidden,
              "smoke": args.smoke, "rows": rows,
              "command": command(argv)}
    save(record, "moe_combine", [args.out] + ([] if args.smoke else [args.json_dir]))
    return record


if __name__ == "__main__":
    main()
