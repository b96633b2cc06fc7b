"""The aligned attention's backward: recompute (before issue 16) vs the direct fused backward.

    python -m benchmarks.kernels --sections attention_backward          # qwen3-moe attention: 4096 and 16384 tokens
    python -m benchmarks.kernels --sections attention_backward --smoke  # CPU, tiny shapes (interpreter): the script works

Per token count (sequences of ``--seq`` tokens; 32 query heads, 4 kv heads, head dim 128, bf16,
causal, Megatron's ``[S, B, H, D]`` layout) for one layer's core attention
(:func:`minite_megatron.invariant.attention.attention`, the default mode's aligned attention and
strict's):

* ``fwd``: ``bi_attention`` without the LSE (the rollout's call) and with it (the learner's);
* ``bwd recompute``: the previous backward (``MINITE_ATTENTION_BACKWARD=recompute``): SDPA's forward again,
  then its backward;
* ``bwd direct``: torch's fused backward on (q, k, v, O, LSE) -- the op SDPA picks (cuDNN on the
  H200), and flash's with SDPA held to flash;
* ``sdpa fwd`` / ``sdpa bwd``: torch SDPA itself (the fair BF16 twin's attention), the anchor.

Times are ``triton.testing.do_bench`` medians (CUDA events); backward times replay
``torch.autograd.grad`` on a kept graph. Gradients are checked in
``tests/strict/test_gpu_attention_backward.py``, not here. One JSON line per run in
``benchmarks/results/attention_backward.jsonl`` with ``direct_over_recompute_bwd`` and
``aligned_over_sdpa_fwd_bwd`` per token count.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from . import RESULTS_ANCHOR, command
from .._timing import bench, ensure_minite_kernels, environment, add_output_args, print_table, save, smoke_on_the_interpreter
from minite_megatron.settings import overridden
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()


def _time(fn, device) -> float:
    if device.type == "cuda":
        return bench(fn)
    fn()  # smoke: one timed call after a warm-up
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run(tokens: int, seq: int, hq: int, hkv: int, d: int, device) -> tuple[list[dict], dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from minite_megatron.invariant import attention as attention_module
    from minite_megatron.nvfp4.backends import get_backend

    b = max(1, tokens // seq)
    g = torch.Generator(device=device).manual_seed(0)

    def make(h):  # views of [S, B, H, D], as Megatron's core attention passes them
        return torch.randn(seq, b, h, d, generator=g, device=device).to(torch.bfloat16).permute(1, 2, 0, 3)

    q, k, v, go = make(hq), make(hkv), make(hkv), make(hq)
    scale = d**-0.5
    kernel = get_backend("triton", device).bi_attention
    used = []
    real = attention_module.fused_attention_backward

    def spy(op, *args):
        used.append(op)
        return real(op, *args)

    attention_module.fused_attention_backward = spy

    def graph(direct: bool):
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        with overridden(attention_backward="direct" if direct else "recompute"):  # read by the forward
            return attention_module.attention(*leaves, scale=scale), leaves

    def bwd(out, leaves):
        return lambda: torch.autograd.grad(out, leaves, go, retain_graph=True)

    rows = []

    def add(what, impl, fn):
        rows.append({"tokens": b * seq, "op": what, "impl": impl, "ms": _time(fn, device)})

    try:
        add("fwd", "bi_attention (rollout: no LSE)", lambda: kernel(q, k, v, None, scale, True))
        add("fwd", "bi_attention + LSE (learner)", lambda: kernel(q, k, v, None, scale, True, return_lse=True))
        add("bwd", "recompute: SDPA fwd + bwd (old)", bwd(*graph(False)))
        out, leaves = graph(True)
        used.clear()
        bwd(out, leaves)()
        picked = used[0] if used else "none (recompute)"
        add("bwd", f"direct: {picked} (new)", bwd(out, leaves))
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out, leaves = graph(True)
            used.clear()
            bwd(out, leaves)()
            if used and used[0] != picked:
                add("bwd", f"direct: {used[0]}", bwd(out, leaves))
        sq, sk, sv = (t.detach().requires_grad_() for t in (q, k, v))
        add("fwd", "sdpa (BF16 twin)", lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True))
        ref = torch.nn.functional.scaled_dot_product_attention(sq, sk, sv, is_causal=True, scale=scale, enable_gqa=True)
        add("bwd", "sdpa (BF16 twin)", bwd(ref, (sq, sk, sv)))
    finally:
        attention_module.fused_attention_backward = real
    ms = {(r["op"], r["impl"]): r["ms"] for r in rows}
    fwd_lse = ms[("fwd", "bi_attention + LSE (learner)")]
    old = ms[("bwd", "recompute: SDPA fwd + bwd (old)")]
    new = ms[("bwd", f"direct: {picked} (new)")]
    sdpa = ms[("fwd", "sdpa (BF16 twin)")] + ms[("bwd", "sdpa (BF16 twin)")]
    summary = {"tokens": b * seq, "direct_op": picked, "direct_over_recompute_bwd": new / old,
               "aligned_fwd_bwd_ms_old": ms[("fwd", "bi_attention (rollout: no LSE)")] + old,
               "aligned_fwd_bwd_ms_new": fwd_lse + new, "sdpa_fwd_bwd_ms": sdpa,
               "aligned_over_sdpa_fwd_bwd": (fwd_lse + new) / sdpa}
    return rows, summary


def parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    add_output_args(ap, RESULTS_ANCHOR)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    if args.smoke:
        smoke_on_the_interpreter()
        args.tokens, args.seq, args.heads, args.kv_heads, args.head_dim = "40", 40, 4, 2, 16
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.smoke:
        sys.exit("benchmarks.kernels --sections attention_backward needs a CUDA GPU (or --smoke on a CPU)")
    rows, summaries = [], []
    with overridden(strict_backend="triton"):
        for t in (int(x) for x in args.tokens.split(",")):
            r, s = run(t, args.seq, args.heads, args.kv_heads, args.head_dim, device)
            rows += r
            summaries.append(s)
    env = environment()
    print_table(f"attention backward, {args.heads} / {args.kv_heads} heads, head dim {args.head_dim}, sequences of "
                f"{args.seq}, bf16, causal, {env['device']}", rows, ["tokens", "op", "impl", "ms"])
    print_table("summary", summaries, ["tokens", "direct_op", "direct_over_recompute_bwd", "aligned_fwd_bwd_ms_old",
                                       "aligned_fwd_bwd_ms_new", "sdpa_fwd_bwd_ms", "aligned_over_sdpa_fwd_bwd"])
    record = {"bench": "attention_backward", **env, "seq": args.seq, "heads": args.heads, "kv_heads": args.kv_heads,
              "head_dim": args.head_dim, "smoke": args.smoke, "rows": rows, "summary": summaries,
              "command": command(argv)}
    save(record, "attention_backward", [args.out] + ([] if args.smoke else [args.json_dir]))
    return record


if __name__ == "__main__":
    main()
