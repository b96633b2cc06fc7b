"""How many kernels one decode step of the rollout engine launches (CPU, Triton interpreter).

    python -m benchmarks.decode_kernel_count             # default mode, qwen3-moe's structure, small dims
    python -m benchmarks.decode_kernel_count --strict

The decode step is launch-bound on the H200 (BENCHMARKS.md run 7), so its kernel count is the
number to shrink. This counts, for one eager decode step of the fast path on a model with the
qwen3-moe preset's structure (4 layers, GQA 32/4 -> 8/2 heads, 16 experts top-8, qk-layernorm)
but tiny dimensions, every ATen op dispatched that is not a view or an allocation and every
Triton kernel launch (ops inside a kernel's interpreter run are not counted). The CPU path is
not the GPU's in every detail: torch's norms decompose into several ops here, and in strict mode
the strict ops run their torch formulations (many more ops) instead of one ``bi_*`` kernel each.
Prints the total and the most frequent ops.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks._timing import ensure_minite_kernels  # noqa: E402

ensure_minite_kernels()

NOT_KERNELS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select", "permute", "transpose", "t", "expand",
    "as_strided", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach",
    "empty", "empty_like", "empty_strided", "lift_fresh", "narrow", "view_as", "unflatten", "flatten",
    "is_nonzero", "item", "_local_scalar_dense", "new_empty", "set_", "resize_",
    # the custom-op wrappers of the Triton kernels (the launch itself is counted)
    "quantize", "decode_gemm", "decode_grouped_gemm", "gemm", "grouped_gemm", "image",
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--batch", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from minite_kernels.triton._interpreter_compat import install

    install()
    import triton.runtime.interpreter as interp

    from minite_megatron.recipe import Recipe
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.sampling import SamplingConfig
    from minite_megatron.training.presets import build_gpt, init_single_process

    init_single_process(1)
    counts: collections.Counter = collections.Counter()
    depth = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not depth[0] and name not in NOT_KERNELS:
                counts["aten::" + name] += 1
            return func(*args, **(kwargs or {}))

    run = interp.InterpretedFunction.run

    def counted(self, *a, **k):
        counts["triton::" + getattr(self.fn, "__name__", "?")] += 1
        depth[0] += 1
        try:
            return run(self, *a, **k)
        finally:
            depth[0] -= 1

    interp.InterpretedFunction.run = counted
    preset = dict(layers=4, hidden=128, heads=8, groups=2, head_dim=16, experts=16, topk=8, moe_ffn=32, vocab=256)
    model = build_gpt(preset, Recipe(strict=args.strict, backend="triton"), max_seq=32, device="cpu",
                      dtype=torch.float32, seed=3).eval()
    engine = RolloutEngine(model, eod_id=0)
    prompts = [[5, 17, 33, 2], [64, 7, 8], [11, 22, 33, 1], [9, 9]][: args.batch]
    with torch.no_grad():
        engine.generate(prompts, 2, temperature=1.0, seed=1, stop_at_eod=False)  # warm: weights, prefill, cache
        body = engine._fast._body(len(prompts), SamplingConfig(1.0, 0, 0.0, 1.0, True))
        counts.clear()
        with Count():
            body()
    mode = "strict" if args.strict else "default"
    print(f"{mode}: {sum(counts.values())} kernels in one decode step ({preset['layers']} layers)")
    for name, n in counts.most_common(30):
        print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
