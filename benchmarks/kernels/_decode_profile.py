"""Where a decode step's GPU time goes: the rollout engine's kernels per step, by name.

    python -m benchmarks.kernels --sections decode_profile                          # GPU: qwen3-moe, batch 8
    python -m benchmarks.kernels --sections decode_profile --engines nvfp4,bf16 --batch 8 --top 25
    python -m benchmarks.kernels --sections decode_profile --preset tiny --batch 2  # CPU: the code path

For each engine (``bf16``: Megatron's local spec with SDPA decode and ``torch._grouped_mm``
experts; ``nvfp4``: the default recipe (the engine's default decode GEMMs); ``nvfp4_invariant``: the same
with ``RolloutEngine(invariant_gemm=True)``, strict's decode kernels; ``strict``) the same prompts are generated twice under
torch.profiler, with ``--short`` and ``--long`` new tokens; every CUDA kernel record (those inside
the CUDA-graph replays included, CUPTI) is summed by kernel name, and the difference of the two
runs divided by the extra steps is the per-decode-step cost: the prefill, sampling set-up and the
first step cancel. Printed per engine: the decode step's GPU time (the sum), its kernels, and the
top kernels by time (us per step, launches per step, share). One JSON line per run in
``benchmarks/results/decode_profile.jsonl``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

from . import RESULTS, command
from .._timing import ensure_minite_kernels, environment, print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

from benchmarks._engine_timing import local_bf16_gpt, minite_gpt, prompts_for, sync  # noqa: E402


def kernel_times(fn) -> tuple[dict[str, float], dict[str, int]]:
    """{kernel name: total device us}, {kernel name: launches} of the CUDA kernel records of ``fn()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    times, counts = collections.defaultdict(float), collections.defaultdict(int)
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.name().startswith(("Memcpy", "Memset")):
            continue
        times[e.name()] += e.duration_ns() / 1e3
        counts[e.name()] += 1
    return times, counts


def short_name(name: str, width: int = 90) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_engine(name, model, preset, args) -> dict:
    from minite_megatron.rollout.engine import RolloutEngine

    max_seq = args.prompt_max + args.long
    kw = dict(invariant_gemm=True) if name == "nvfp4_invariant" else {}
    engine = RolloutEngine(model, eod_id=0, max_batch_size=args.batch, max_sequence_length=max_seq,
                           attention="sdpa" if name == "bf16" else "module", **kw)
    prompts = prompts_for(args.batch, args.prompt_min, args.prompt_max, preset["vocab"])

    def gen(n):
        return lambda: engine.generate(prompts, n, temperature=1.0, seed=7, stop_at_eod=False)

    gen(args.long)()  # compile, capture the graphs
    t_short, c_short = kernel_times(gen(args.short))
    t_long, c_long = kernel_times(gen(args.long))
    steps = args.long - args.short
    per = {k: (t_long.get(k, 0.0) - t_short.get(k, 0.0)) / steps for k in t_long}
    launches = {k: (c_long.get(k, 0) - c_short.get(k, 0)) / steps for k in c_long}
    total = sum(v for v in per.values() if v > 0)
    top = sorted(((k, v) for k, v in per.items() if launches.get(k, 0) > 0), key=lambda kv: -kv[1])[: args.top]
    rows = [{"kernel": short_name(k), "us_per_step": round(v, 2), "launches_per_step": round(launches[k], 2),
             "share": f"{100 * v / total:.1f}%" if total else ""} for k, v in top]
    print_table(f"{name}, batch {args.batch}: decode step GPU time {total / 1e3:.3f} ms, "
                f"{sum(max(v, 0) for v in launches.values()):.0f} kernels", rows,
                ["kernel", "us_per_step", "launches_per_step", "share"])
    del engine
    return {"engine": name, "batch": args.batch, "gpu_ms_per_step": total / 1e3,
            "kernels_per_step": sum(max(v, 0) for v in launches.values()), "top": rows}


def parser() -> argparse.ArgumentParser:
    gpu = torch.cuda.is_available()
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--preset", default="qwen3-moe" if gpu else "tiny")
    ap.add_argument("--engines", default="nvfp4,bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--short", type=int, default=4, help="new tokens of the first profiled generate")
    ap.add_argument("--long", type=int, default=20, help="new tokens of the second")
    ap.add_argument("--prompt-min", type=int, default=16 if gpu else 3)
    ap.add_argument("--prompt-max", type=int, default=96 if gpu else 12)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON line")
    ap.add_argument("--json-dir", default=RESULTS)
    return ap


def main(argv=None):
    gpu = torch.cuda.is_available()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    if args.long <= args.short:
        raise SystemExit(f"benchmarks.kernels --sections decode_profile: --long ({args.long}) must exceed "
                         f"--short ({args.short})")
    from minite_megatron.training.presets import PRESETS, init_single_process

    preset = PRESETS[args.preset]
    device = init_single_process(0)
    dtype = torch.bfloat16 if gpu else torch.float32
    os.environ["TEARDOWN_CUPTI"] = "0"  # torch's workaround for CUPTI re-init around CUDA graphs
    results = {"benchmark": "decode_profile", "preset": args.preset, "batch": args.batch, "short": args.short,
               "long": args.long, "engines": [], **environment(), "command": command(argv)}
    max_seq = args.prompt_max + args.long
    for name in [n for n in args.engines.split(",") if n]:
        model = (local_bf16_gpt(preset, max_seq, device, dtype) if name == "bf16"
                 else minite_gpt(preset, name == "strict", max_seq, device, dtype))
        results["engines"].append(profile_engine(name, model, preset, args))
        del model
        if gpu:
            torch.cuda.empty_cache()
    for path in save(results, "decode_profile", [args.json_dir, args.out]):
        print("appended", path)
    return results


if __name__ == "__main__":
    main()
