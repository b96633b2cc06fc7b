"""The rollout engine at Qwen3-30B-A3B's whole size (48 layers, 151,936 tokens) on one GPU.

Run through ``python -m benchmarks.rollout --preset qwen3-30b-a3b`` (or directly,
``python -m benchmarks.rollout_full``). Models are :func:`minite_megatron.rollout.resident.build_resident_gpt`'s
(random weights made layer by layer, NVFP4 weights only: ~20 GB on the device), one at a time:

1. **nvfp4** (default mode): the engine with a ``256 x 2048`` KV cache (peak memory of the target),
   then decode ms/step and tokens/s at batch 1, 8, 64, 256 (mixed prompt lengths, CUDA graphs),
   prefill ms; the learner/rollout gap on ``--gap-batch x --new`` sampled tokens (the learner:
   ``teacher_forced_logprobs`` on the same resident model, i.e. the learner's modules and bits);
   the RL-shaped run: ``--rl-prompts x --rl-samples`` sequences, up to ``--rl-new`` new tokens,
   rollout tokens/s (wall clock, prefill included).
2. **strict**: the same timings at batch 1 and 8 and the gap (must be exactly 0).
3. **bf16** (the project's BF16 engine: Megatron's local spec, 61 GB of weights): only where
   free memory holds it (else a row saying it does not fit).

One JSON line per model (``benchmarks/results/rollout_full.jsonl`` and ``--json``).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import environment, print_table, save  # noqa: E402


def _free_all():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _gib(n) -> float:
    return round(n / 2**30, 2)


def engine_rows(name, model, preset, args, batches, gap: bool, rl: bool) -> list[dict]:
    from benchmarks.rollout import gap_of, prompts_for, time_engine
    from minite_megatron.rollout.engine import RolloutEngine

    rows = []
    max_seq = max(args.prompt_max + args.new, args.prompt_max + args.rl_new)
    eng = RolloutEngine(model, eod_id=0, max_batch_size=max(batches), max_sequence_length=max_seq,
                        attention="sdpa" if name == "bf16" else "module")
    for b in batches:
        prompts = prompts_for(b, args.prompt_min, args.prompt_max, preset["vocab"])
        t = time_engine(eng, prompts, args.new, args.repeats)
        row = {"engine": name, "batch": b, **t, "graphed": eng._fast.last_timing.get("graphed"),
               "tokens_per_s": b * 1e3 / t["decode_step_ms"],
               "peak_gib": _gib(torch.cuda.max_memory_allocated())}
        if gap and b == args.gap_batch:
            row.update(gap_of(model, eng, prompts, args.new))
        rows.append(row)
        print(row, flush=True)
    if rl:
        g = torch.Generator().manual_seed(11)
        base = [torch.randint(1, preset["vocab"] - 1, (int(n),), generator=g).tolist()
                for n in torch.linspace(args.prompt_min, args.prompt_max, args.rl_prompts).round().int()]
        prompts = [p for p in base for _ in range(args.rl_samples)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.generate(prompts, args.rl_new, temperature=1.0, seed=7)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        toks = sum(len(r.generated_tokens) for r in out)
        rows.append({"engine": name, "rl": f"{args.rl_prompts}x{args.rl_samples}x{args.rl_new}", "batch": len(prompts),
                     "rollout_tokens": toks, "wall_s": round(wall, 3), "rollout_tokens_per_s": toks / wall,
                     "peak_gib": _gib(torch.cuda.max_memory_allocated())})
        print(rows[-1], flush=True)
    del eng
    return rows


def kv_peak_row(model, preset, args) -> dict:
    """The engine with a ``--kv-batch x --kv-len`` cache: its bytes, and the peak of one batch."""
    from benchmarks.rollout import prompts_for
    from minite_megatron.rollout.engine import RolloutEngine

    _free_all()
    eng = RolloutEngine(model, eod_id=0, max_batch_size=args.kv_batch, max_sequence_length=args.kv_len)
    prompts = prompts_for(args.kv_batch, args.prompt_min, args.prompt_max, preset["vocab"])
    eng.generate(prompts, 4, temperature=1.0, seed=1, stop_at_eod=False)
    torch.cuda.synchronize()
    row = {"engine": "nvfp4", "kv_cache": f"{args.kv_batch}x{args.kv_len}",
           "kv_gib": _gib(sum(t.numel() * t.element_size() for t in eng._fast.cache.k + eng._fast.cache.v)),
           "peak_gib": _gib(torch.cuda.max_memory_allocated())}
    del eng
    _free_all()
    print(row, flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="a cut of the preset's first layers")
    ap.add_argument("--engines", default="nvfp4,strict,bf16")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--strict-batches", default="1,8")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gap-batch", type=int, default=8, help="gap on gap-batch x new sampled tokens (8 x 64 = 512)")
    ap.add_argument("--rl-prompts", type=int, default=32)
    ap.add_argument("--rl-samples", type=int, default=8)
    ap.add_argument("--rl-new", type=int, default=512)
    ap.add_argument("--kv-batch", type=int, default=256)
    ap.add_argument("--kv-len", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.rollout_full: needs a GPU (the whole model's NVFP4 weights are ~20 GB)")

    from minite_megatron.recipe import Recipe
    from minite_megatron.rollout.resident import build_resident_gpt, resident_bytes
    from minite_megatron.training.presets import PRESETS, init_single_process

    device = init_single_process(0)
    preset = dict(PRESETS[args.preset])
    if args.layers:
        preset["layers"] = args.layers
    engines = args.engines.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    accounting = {k: _gib(v) for k, v in resident_bytes(preset).items() if k != "parameters"}
    results = {"benchmark": "rollout_full", "command": "python -m benchmarks.rollout " + " ".join(argv or sys.argv[1:]),
               "preset": args.preset, "layers": preset["layers"], "new_tokens": args.new,
               "prompt_lengths": [args.prompt_min, args.prompt_max], "accounting_gib": accounting,
               "parameters": resident_bytes(preset)["parameters"], "rows": [], **environment()}
    print("weights (GiB, computed):", accounting, flush=True)
    for name in ("nvfp4", "strict"):
        if name not in engines:
            continue
        _free_all()
        t0 = time.perf_counter()
        model = build_resident_gpt(preset, Recipe(strict=name == "strict"), max_seq=max(args.kv_len, 1024),
                                   device=device, seed=0)
        torch.cuda.synchronize()
        build = {"engine": name, "build_s": round(time.perf_counter() - t0, 1),
                 "weights_gib": _gib(torch.cuda.memory_allocated()), "build_peak_gib": _gib(torch.cuda.max_memory_allocated())}
        print(build, flush=True)
        results["rows"].append(build)
        if name == "nvfp4" and args.kv_batch:
            results["rows"].append(kv_peak_row(model, preset, args))
        sizes = batches if name == "nvfp4" else [int(b) for b in args.strict_batches.split(",")]
        results["rows"] += engine_rows(name, model, preset, args, sizes, gap=True, rl=name == "nvfp4")
        del model
    if "bf16" in engines:
        _free_all()
        need = resident_bytes(preset)["bf16_model"]
        free, _ = torch.cuda.mem_get_info()
        if need + (4 << 30) > free:
            row = {"engine": "bf16", "fits": False, "bf16_weights_gib": _gib(need), "free_gib": _gib(free)}
            print("bf16 engine: does not fit:", row, flush=True)
            results["rows"].append(row)
        else:
            from benchmarks.rollout import local_bf16_gpt

            model = local_bf16_gpt(preset, args.prompt_max + args.rl_new, device, torch.bfloat16)
            results["rows"] += engine_rows("bf16", model, preset, args, [1, 8], gap=False, rl=False)
            del model
    _free_all()
    by = {(r.get("engine"), r.get("batch")): r for r in results["rows"] if "decode_step_ms" in r}
    ratios = {}
    for b in (1, 8):
        n, s, f = by.get(("nvfp4", b)), by.get(("strict", b)), by.get(("bf16", b))
        if n and s:
            ratios[f"strict_over_default_b{b}"] = s["decode_step_ms"] / n["decode_step_ms"]
        if n and f:
            ratios[f"bf16_over_nvfp4_b{b}"] = f["decode_step_ms"] / n["decode_step_ms"]
    results["ratios"] = ratios
    print_table(f"rollout at {args.preset} ({preset['layers']} layers)", [r for r in results["rows"] if "decode_step_ms" in r],
                ["engine", "batch", "decode_step_ms", "tokens_per_s", "prefill_ms", "peak_gib", "gap_mean_abs"])
    print("ratios:", ratios, flush=True)
    out = save(results, "rollout_full", [os.path.join(os.path.dirname(__file__), "results"),
                                          os.path.dirname(args.json) if args.json else None])
    print("saved", out)
    return results


if __name__ == "__main__":
    main()
