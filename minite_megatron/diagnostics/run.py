"""``minite-diagnose run``: run a sampler and a learner on the same weights, trace both, and
report the gap and the first point where they diverge.

    minite-diagnose run --out runs/diag                                  # default mode, CPU-sized model
    minite-diagnose run --strict --out runs/diag_strict                  # expect: no divergence, gap 0
    minite-diagnose run --rollout-recipe '{"activation_scale": "tensor"}' --out runs/diag_planted
    minite-diagnose run --preset qwen3-moe --rollout-backend reference   # on a GPU: Triton learner vs reference sampler

The sampler is :class:`~minite_megatron.rollout.engine.RolloutEngine` (Megatron-Core's static
engine: prefill, then one token per step with a KV cache); the learner scores the sampled
sequences teacher-forced in one forward. Both are models of ``--preset`` with the same weights,
built from the minite specs under the recipe (``--strict``), each optionally overriding recipe
fields (``--learner-recipe`` / ``--rollout-recipe``, JSON) or the NVFP4 backend. Writes, into
``--out``: ``learner.pt`` / ``rollout.pt`` (traces), ``report.md`` / ``report.json`` /
``report.png`` (the comparison) and ``gap.json`` (the gap metrics on the generated tokens).
Exit status 0, or 1 with ``--fail-on-divergence`` when a point diverged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .cli import format_metrics, register_subcommand


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.add_argument("--preset", default=None, help="model preset (minite_megatron.training.presets; default: tiny on CPU)")
    p.add_argument("--strict", action="store_true", help="Recipe(strict=True) for both engines")
    p.add_argument("--learner-recipe", default="{}", help="JSON recipe fields for the learner only")
    p.add_argument("--rollout-recipe", default="{}", help="JSON recipe fields for the sampler only")
    p.add_argument("--learner-backend", default=None)
    p.add_argument("--rollout-backend", default=None)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=None, help="points within atol + rtol*|ref| count as equal (default: bitwise)")
    p.add_argument("--rtol", type=float, default=None)
    p.add_argument("--fail-on-divergence", action="store_true")


def _run(args: argparse.Namespace) -> int:
    from ..recipe import Recipe
    from ..rollout.engine import RolloutEngine
    from ..rollout.logprobs import teacher_forced_logprobs
    from ..training.presets import PRESETS, build_gpt, init_single_process
    from .capture import Tracer
    from .compare import compare_traces
    from .metrics import gap_metrics
    from .report import write_report

    device = init_single_process(args.seed)
    preset = args.preset or ("qwen3-moe" if device.type == "cuda" else "tiny")
    vocab = PRESETS[preset]["vocab"]
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.linspace(3, 12, args.prompts).round().int().tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    max_seq = max(lengths) + args.new_tokens
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def model_for(overrides: str, backend: str | None):
        fields = {"strict": args.strict, "backend": backend, **json.loads(overrides)}
        return build_gpt(preset, Recipe.from_dict(fields), max_seq=max_seq, device=device, dtype=dtype, seed=args.seed).eval()

    sampler = model_for(args.rollout_recipe, args.rollout_backend)
    learner = model_for(args.learner_recipe, args.learner_backend)
    args.out.mkdir(parents=True, exist_ok=True)

    with Tracer(engine="rollout") as tr_roll:
        tr_roll.attach(sampler)
        with torch.no_grad():
            rollouts = RolloutEngine(sampler, eod_id=0, max_batch_size=len(prompts), max_sequence_length=max_seq).generate(
                prompts, args.new_tokens, temperature=1.0, seed=args.seed, stop_at_eod=False
            )
    seqs = [r.prompt_tokens + r.generated_tokens for r in rollouts]
    with Tracer(engine="learner") as tr_learn:
        tr_learn.attach(learner)
        t = max(len(s) for s in seqs)
        tr_learn.set_tokens(torch.arange(len(seqs)).view(1, -1), torch.arange(t).view(-1, 1))
        with torch.no_grad():
            lps = teacher_forced_logprobs(learner, seqs, device=device)
    # compare the real tokens only: not the learner's padding, nor what the static engine ran
    # past a sequence's end
    from .trace import pack_keys

    real = torch.cat([pack_keys(torch.full((len(s),), i), torch.arange(len(s))) for i, s in enumerate(seqs)])
    learner_trace, rollout_trace = tr_learn.trace().restrict(real), tr_roll.trace().restrict(real)
    learner_trace.save(args.out / "learner.pt")
    rollout_trace.save(args.out / "rollout.pt")

    pad = torch.nn.utils.rnn.pad_sequence
    lrn = pad([lp[len(r.prompt_tokens) - 1 :].float().cpu() for lp, r in zip(lps, rollouts)], batch_first=True)
    rol = pad([r.generated_log_probs.float().cpu() for r in rollouts], batch_first=True)
    mask = pad([torch.ones(len(r.generated_tokens), dtype=torch.bool) for r in rollouts], batch_first=True)
    metrics = gap_metrics(lrn, rol, mask)
    (args.out / "gap.json").write_text(json.dumps(metrics, indent=2))
    comparison = compare_traces(learner_trace, rollout_trace, atol=args.atol, rtol=args.rtol)
    write_report(comparison, args.out)
    print(format_metrics({k: v for k, v in metrics.items() if "frac_gt" not in k}))
    first = comparison.first_divergence
    print(f"first divergence: {first.name if first is not None else 'none'}  (report: {args.out / 'report.md'})")
    fc = comparison.first_consequential
    if first is not None:
        print(f"first consequential divergence: {fc.name + ' (flips ' + fc.consequence + ')' if fc else 'none'}")
    return 1 if (first is not None and args.fail_on_divergence) else 0


register_subcommand("run", "run a sampler and a learner on the same weights, trace both, report the first divergence",
                    _add_arguments, _run)
