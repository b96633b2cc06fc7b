"""Where a decode step's GPU time goes: the rollout engine's kernels per step, by name.

    python -m benchmarks.decode_profile                          # GPU: qwen3-moe, batch 8
    python -m benchmarks.decode_profile --engines nvfp4,bf16 --batch 8 --top 25
    python -m benchmarks.decode_profile --preset tiny --batch 2  # CPU: the code path (no CUDA records)

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

from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import ensure_minite_kernels, environment, print_table, save  # noqa: E402

ensure_minite_kernels()

from benchmarks.rollout import local_bf16_gpt, minite_gpt, prompts_for, sync  # noqa: E402


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


def main(argv=None):
    gpu = torch.cuda.is_available()
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-moe" if gpu else "tiny")
    ap.add_argument("--engines", default="nvfp4,bf16")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--short", type=int, default=4, help="new tokens of the first profiled generate")
    ap.add_argument("--long", type=int, default=20, help="new tokens of the second")
    ap.add_argument("--prompt-min", type=int, default=16 if gpu else 3)
    ap.add_argument("--prompt-max", type=int, default=96 if gpu else 12)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--grouped-config", default=None, metavar="BN,BK,WARPS,DEPTH,MAX_CHUNKS",
                    help="the grouped decode kernel's default launch entry (decode_grouped_gemm.GPU_GROUPED_DECODE) "
                         "for this run, e.g. a benchmarks/decode_gemm.py grouped_sweep winner")
    ap.add_argument("--rolled-dense-strict", action="store_true",
                    help="the dense strict decode with its K loop rolled (decode_gemm.GPU_STRICT_DECODE_ROLLED) for this "
                         "run, before ROLLED_DENSE_STRICT_VERIFIED records a GPU check")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON line")
    ap.add_argument("--json-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    if args.long <= args.short:
        ap.error(f"--long ({args.long}) must exceed --short ({args.short})")
    from minite_kernels.triton import decode_grouped_gemm as tg

    if args.grouped_config:
        try:
            bn, bk, warps, depth, most = (int(v) for v in args.grouped_config.split(","))
        except ValueError:
            ap.error(f"--grouped-config: five integers BN,BK,WARPS,DEPTH,MAX_CHUNKS, got {args.grouped_config!r}")
        tg.GPU_GROUPED_DECODE = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, DEPTH=depth, MAX_CHUNKS=most)
    from minite_kernels.triton import decode_grouped_idot as ti
    from minite_kernels.triton import decode_gemm as td

    if args.rolled_dense_strict:
        td.ROLLED_DENSE_STRICT_VERIFIED = True
    from minite_megatron.training.presets import PRESETS, init_single_process

    preset = PRESETS[args.preset]
    device = init_single_process(0)
    dtype = torch.bfloat16 if gpu else torch.float32
    os.environ["TEARDOWN_CUPTI"] = "0"  # torch's workaround for CUPTI re-init around CUDA graphs
    results = {"benchmark": "decode_profile", "preset": args.preset, "batch": args.batch, "short": args.short,
               "long": args.long, "grouped_decode_entry": dict(tg.GPU_GROUPED_DECODE),
               "strict_grouped_entry": tg.strict_grouped_entry(), "idot": ti.IDOT_GPU_VERIFIED, "strict_dense_entry": td.strict_dense_entry(), "idot_entry": dict(ti.GPU_IDOT),
               "engines": [], **environment(), "command": " ".join(sys.argv)}
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
