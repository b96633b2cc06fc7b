"""Learner-vs-rollout log-prob gap of miniTE's NVFP4 model in default and strict mode, and what
strict mode costs the learner.

    python -m benchmarks.alignment                       # the GPU's Qwen3-MoE-shaped preset
    python -m benchmarks.alignment --preset tiny         # a CPU-sized model
    python -m benchmarks.alignment --json benchmarks/results/alignment.jsonl

One process. The same random weights are loaded into two models built from
``get_gpt_decoder_block_minite_spec`` -- ``Recipe()`` (default) and ``Recipe(strict=True)`` --
both on the machine's default NVFP4 backend (Triton on a GPU, the reference on CPU). For each
mode: the rollout engine (Megatron-Core's static engine, KV cache, temperature 1) samples
continuations of a batch of prompts of mixed lengths; the learner scores the same sequences
teacher-forced; ``gap_metrics`` compares the two log-probs on the generated tokens. Timing: the
learner's teacher-forced forward + backward (median of ``--repeats``), default vs strict.
Prints a table and appends one JSON line (device, versions, config, results).
"""

from __future__ import annotations

from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SAMPLING = {
    # batch of mixed prompt lengths, new tokens per rollout, learner timing batch
    "qwen3-moe": dict(batch=8, prompt_min=16, prompt_max=96, new=64, learner_batch=8),
    "tiny": dict(batch=6, prompt_min=3, prompt_max=12, new=10, learner_batch=6),
}


def prompts(p: dict, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = torch.linspace(p["prompt_min"], p["prompt_max"], p["batch"]).round().int().tolist()
    return [torch.randint(1, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def learner_step_time(model, seqs, device: str, repeats: int) -> float:
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    model.train()
    times = []
    for i in range(repeats + 1):
        sync(device)
        t = time.perf_counter()
        lps = teacher_forced_logprobs(model, seqs, device=device)
        torch.stack([lp.sum() for lp in lps]).sum().backward()
        sync(device)
        if i:  # the first is warm-up (compilation, weight quantization)
            times.append(time.perf_counter() - t)
        model.zero_grad(set_to_none=True)
    model.eval()
    return statistics.median(times)


def run_mode(preset, p, strict, device, dtype, backend, repeats, state=None):
    from minite_megatron.diagnostics import gap_metrics
    from minite_megatron.recipe import Recipe
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.training.presets import build_gpt
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    recipe = Recipe(strict=strict, backend=backend)
    model = build_gpt(preset, recipe, max_seq=p["prompt_max"] + p["new"], device=device, dtype=dtype).eval()
    if state is not None:
        model.load_state_dict(state, strict=False)
    engine = RolloutEngine(model, eod_id=0, max_batch_size=p["batch"], max_sequence_length=p["prompt_max"] + p["new"])
    t = time.perf_counter()
    with torch.no_grad():
        rollouts = engine.generate(prompts(p, model.vocab_size), p["new"], temperature=1.0, seed=3, stop_at_eod=False)
    sync(device)
    rollout_s = time.perf_counter() - t
    seqs = [r.prompt_tokens + r.generated_tokens for r in rollouts]
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, seqs, device=device)
    gen = [lp[len(r.prompt_tokens) - 1 :] for lp, r in zip(learner, rollouts)]
    pad = torch.nn.utils.rnn.pad_sequence
    lrn = pad([g.float().cpu() for g in gen], batch_first=True)
    rol = pad([r.generated_log_probs.float().cpu() for r in rollouts], batch_first=True)
    mask = pad([torch.ones(len(r.generated_tokens), dtype=torch.bool) for r in rollouts], batch_first=True)
    metrics = gap_metrics(lrn, rol, mask)
    step_s = learner_step_time(model, seqs[: p["learner_batch"]], device, repeats)
    state_out = {k: v for k, v in model.state_dict().items() if "_extra_state" not in k}
    return {
        "mode": "strict" if strict else "default",
        "backend": recipe.backend or "auto",
        "gap_mean_abs": metrics["rollout_corr/logprob_abs_diff_mean"],
        "gap_max_abs": metrics["rollout_corr/logprob_abs_diff_max"],
        "k3_kl": metrics["rollout_corr/k3_kl"],
        "token_mult_prob_error": metrics["rollout_corr/token_mult_prob_error"],
        "tokens": int(mask.sum()),
        "rollout_s": rollout_s,
        "learner_step_s": step_s,
    }, state_out


def main(argv=None):
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(SAMPLING), default="qwen3-moe" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16" if torch.cuda.is_available() else "fp32")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    p = SAMPLING[args.preset]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    from minite_megatron import nvfp4
    from minite_megatron.training.presets import PRESETS, init_single_process

    init_single_process()
    default, state = run_mode(args.preset, p, False, args.device, dtype, args.backend, args.repeats)
    strict, _ = run_mode(args.preset, p, True, args.device, dtype, args.backend, args.repeats, state=state)
    overhead = strict["learner_step_s"] / default["learner_step_s"] - 1
    rows = [default, strict]
    print(f"{'mode':8} {'mean|dlogp|':>12} {'max|dlogp|':>12} {'k3_kl':>10} {'tokens':>7} {'learner step':>13} {'rollout':>9}")
    for r in rows:
        print(f"{r['mode']:8} {r['gap_mean_abs']:12.3e} {r['gap_max_abs']:12.3e} {r['k3_kl']:10.2e} {r['tokens']:7d} "
              f"{r['learner_step_s'] * 1e3:11.1f}ms {r['rollout_s']:8.2f}s")
    print(f"strict-mode learner overhead: {100 * overhead:+.1f}%")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "backend": nvfp4.get_backend(args.backend, args.device).name,
        "preset": args.preset, "config": {**PRESETS[args.preset], **p}, "dtype": args.dtype, "results": rows, "strict_overhead": overhead,
        "command": "python -m benchmarks.alignment " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
