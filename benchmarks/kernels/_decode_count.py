"""How many kernels one decode step of the rollout engine launches (CPU, Triton interpreter).

    python -m benchmarks.kernels --sections decode_count             # default mode, qwen3-moe's structure, small dims
    python -m benchmarks.kernels --sections decode_count --strict
    python -m benchmarks.kernels --sections decode_count --unfused   # the decode step on the learner's modules only

The decode step is launch-bound on the H200 (``benchmarks/results/runs.md`` run 7), so its kernel count is the
number to shrink. This counts, for one eager decode step of the fast path on a model with the
qwen3-moe preset's structure (4 layers, GQA 32/4 -> 8/2 heads, 16 experts top-8, qk-layernorm)
but tiny dimensions, every ATen op dispatched that is not a view or an allocation and every
Triton kernel launch (ops inside a kernel's interpreter run are not counted). To count what the
GPU launches, the model is bf16 (the GPU's dtype: the fused norm -> NVFP4 producers run), the
batch-invariant ops take their Triton kernels (``settings.overridden(strict_backend="triton")``, the GPU's
choice), the decode step's fused kernels run (``RolloutEngine(kernels_on_cpu=True)``; ``--unfused``:
``fused_kernels=False``), and the
backend dispatches the decode GEMMs as a GPU does with its packed decode kernels on or off
(``--gpu-decode``, default ``kernels``: the packed decode kernels, as a GPU dispatches them;
``image-gemm``: the image GEMM and the learner's grouped GEMM on sorted rows instead).
It runs in its own process under ``TRITON_INTERPRET=1`` (started from here when the calling
process is not interpreting: the interpreter must be chosen before the kernels are defined).
The eager-only host checks a graph capture skips are left out: expert ids in range (the backend's
``check_expert_ids=False``) and whether the attention mask hides a key the causal rule shows (the
ops dispatched inside :func:`minite_megatron.invariant.attention.effective_mask`, which keeps the
mask as given under a capture, are counted apart). Prints the total and the most frequent ops.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import subprocess

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from minite_megatron.training.cli import OneLineArgumentParser

NOT_KERNELS = {
    "view", "_unsafe_view", "reshape", "_reshape_alias", "slice", "select", "permute", "transpose", "t", "expand",
    "as_strided", "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach",
    "empty", "empty_like", "empty_strided", "lift_fresh", "narrow", "view_as", "unflatten", "flatten",
    "is_nonzero", "item", "_local_scalar_dense", "new_empty", "set_", "resize_",
    # the custom-op wrappers of the Triton kernels (the launch itself is counted)
    "quantize", "decode_gemm", "decode_grouped_gemm", "gemm", "grouped_gemm", "image",
}


def parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--unfused", action="store_true", help="no fused decode kernels (the learner's modules only)")
    ap.add_argument("--gpu-decode", choices=("kernels", "image-gemm"), default="kernels",
                    help="decode GEMMs on the packed decode kernels (a GPU's dispatch) or on the image GEMMs")
    ap.add_argument("--top", type=int, default=40, help="how many of the most frequent ops to list")
    ap.add_argument("--fp32", action="store_true", help="an fp32 model (the CPU tests' dtype) instead of bf16")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    if os.environ.get("TRITON_INTERPRET") != "1":
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        return subprocess.run([sys.executable, "-m", "benchmarks.kernels._decode_count", *argv], env=env,
                              check=False).returncode
    from .._timing import ensure_minite_kernels

    ensure_minite_kernels()
    torch.set_num_threads(1)
    from minite_kernels.triton._build._interpreter_compat import install

    install()
    import triton.runtime.interpreter as interp

    import minite_kernels.triton.backend as triton_backend

    from minite_megatron.recipe import Recipe
    from minite_megatron.invariant.attention import effective_mask
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.sampling import SamplingConfig
    from minite_megatron.settings import overridden
    from minite_megatron.training.presets import build_gpt, init_single_process

    init_single_process(1)
    kernels = args.gpu_decode == "kernels"
    from minite_megatron.nvfp4 import register_backend

    # check_expert_ids off: a CUDA graph's capture skips that eager host-side check
    register_backend(triton_backend.TritonBackend(triton_backend.TritonOptions(
        decode_kernels=kernels, strict_decode=kernels, check_expert_ids=False)))
    counts: collections.Counter = collections.Counter()
    host_checks: collections.Counter = collections.Counter()  # the eager-only ops a capture skips
    depth = [0]

    def in_host_check() -> bool:
        """Is the op being dispatched called from the attention mask's host check?"""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is effective_mask.__code__:
                return True
            frame = frame.f_back
        return False

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            # miniTE's custom ops (``minite::``) are counted by their Triton launches
            if not depth[0] and name not in NOT_KERNELS and getattr(func, "namespace", "") != "minite":
                (host_checks if in_host_check() else counts)["aten::" + name] += 1
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
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    model = build_gpt(preset, Recipe(strict=args.strict, backend="triton"), max_seq=32, device="cpu",
                      dtype=dtype, seed=3).eval()
    engine = RolloutEngine(model, eod_id=0, fused_kernels=not args.unfused, kernels_on_cpu=True)
    prompts = [[5, 17, 33, 2], [64, 7, 8], [11, 22, 33, 1], [9, 9]][: args.batch]
    with torch.no_grad(), overridden(strict_backend="triton"):
        engine.generate(prompts, 2, temperature=1.0, seed=1, stop_at_eod=False)  # warm: weights, prefill, cache
        body = engine._fast._body(len(prompts), SamplingConfig(1.0, 0, 0.0, 1.0, True))
        counts.clear()
        with Count():
            body()
    mode = "strict" if args.strict else "default"
    how = (f"{'unfused' if args.unfused else 'fused'}, {'fp32' if args.fp32 else 'bf16'}, "
           f"decode GEMMs on the {'packed decode kernels' if kernels else 'image GEMMs'}")
    print(f"{mode}: {sum(counts.values())} kernels in one decode step ({preset['layers']} layers; {how})")
    print(f"  (left out: {sum(host_checks.values())} ops of the attention mask's eager host check, "
          f"{dict(host_checks)})")
    for name, n in counts.most_common(args.top):
        print(f"  {n:4d}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
