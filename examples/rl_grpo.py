"""GRPO on a toy task with NVFP4 learner and NVFP4 rollout engine on the same kernels.

    python examples/rl_grpo.py                     # default (non-strict) alignment
    python examples/rl_grpo.py --strict            # strict mode: learner == sampler, bitwise
    python examples/rl_grpo.py --steps 50 --tensorboard runs/rl

One process, real Megatron-Core modules (miniTE's NVFP4 specs: per-token activation scales,
16x16 weights, NVFP4 fprop/dgrad/wgrad), Megatron-Core's static inference engine for rollouts
(:class:`minite_megatron.rollout.RolloutEngine`), and the training-time gap monitor
(:class:`minite_megatron.diagnostics.GapMonitor`) logging ``train_rollout_logprob_abs_diff``,
``rollout_corr/k3_kl``, ... next to the reward.

The task: a prompt is a few tokens counting up modulo the vocabulary from a random start (with
a random stride); the reward of a continuation is the fraction of its tokens that continue the
count. Each step samples ``--group`` continuations per prompt, normalizes rewards within each
group (GRPO advantages), and takes one policy-gradient step with the PPO-clipped ratio
``exp(logp_learner - logp_rollout)``: the learner's teacher-forced log-probs of the rollouts
against the sampler's. In strict mode that ratio is exactly 1 and the gap exactly 0.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--strict", action="store_true", help="strict alignment mode (Recipe.strict)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="samples per prompt (GRPO group)")
    p.add_argument("--prompt-len", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--pretrain-steps", type=int, default=60, help="supervised warm-up steps on the task")
    p.add_argument("--backend", type=str, default=None, help="NVFP4 backend (default: best for the device)")
    p.add_argument("--gap-threshold", type=float, default=1e-2, help="alert above this mean |dlogp|")
    p.add_argument("--tensorboard", type=str, default=None, help="tensorboard log dir")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build_policy(args, device):
    """A tiny Qwen3-MoE-shaped GPT on miniTE's NVFP4 specs (``minite_megatron.training.presets``)."""
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import PRESETS, build_gpt

    recipe = Recipe(strict=args.strict, backend=args.backend)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_gpt(dict(PRESETS["tiny"], vocab=args.vocab), recipe, max_seq=args.prompt_len + args.new_tokens,
                      device=device, dtype=dtype, seed=args.seed)
    return model, recipe


def task_prompts(step: int, n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(10_000 + step)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 3, (n, 1), generator=g)
    return ((start + stride * torch.arange(length)) % vocab).tolist()


def reward(prompt: list[int], generated: list[int], vocab: int) -> float:
    """Fraction of generated tokens that continue the prompt's count (same stride)."""
    stride = (prompt[1] - prompt[0]) % vocab
    prev, good = prompt[-1], 0
    for tok in generated:
        good += tok == (prev + stride) % vocab
        prev = tok
    return good / max(len(generated), 1)


def warm_up(model, args, device):
    """A few supervised steps so that the policy starts from something better than uniform."""
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    model.train()
    for step in range(args.pretrain_steps):
        seqs = task_prompts(-1 - step, 16, args.prompt_len + args.new_tokens, args.vocab)
        lps = teacher_forced_logprobs(model, seqs, device=device)
        loss = -torch.stack([lp.mean() for lp in lps]).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return opt


def main(argv=None) -> dict:
    args = parse_args(argv)
    from minite_megatron.training.presets import init_single_process

    device = init_single_process(args.seed)
    from tqdm import tqdm

    from minite_megatron.diagnostics import GapMonitor
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    model, recipe = build_policy(args, device)
    opt = warm_up(model, args, device)
    engine = RolloutEngine(model, eod_id=args.vocab - 1, max_batch_size=args.prompts * args.group,
                           max_sequence_length=args.prompt_len + args.new_tokens)
    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard)
    monitor = GapMonitor(threshold=args.gap_threshold, writer=writer)
    bar = tqdm(range(args.steps), desc=f"GRPO ({'strict' if args.strict else 'default'})", disable=args.no_progress)
    history = []
    for step in bar:
        prompts = [p for p in task_prompts(step, args.prompts, args.prompt_len, args.vocab) for _ in range(args.group)]
        model.eval()
        with torch.no_grad():
            rollouts = engine.generate(prompts, args.new_tokens, temperature=args.temperature, seed=args.seed + step,
                                       stop_at_eod=False)
        rewards = torch.tensor([reward(r.prompt_tokens, r.generated_tokens, args.vocab) for r in rollouts])
        grouped = rewards.view(args.prompts, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)

        # learner: teacher-forced log-probs of the sampled tokens (with gradients)
        model.train()
        seqs = [r.prompt_tokens + r.generated_tokens for r in rollouts]
        lps = teacher_forced_logprobs(model, seqs, device=device)
        n_prompt = [len(r.prompt_tokens) - 1 for r in rollouts]
        learner = torch.nn.utils.rnn.pad_sequence([lp[n:] for lp, n in zip(lps, n_prompt)], batch_first=True)
        sampler = torch.nn.utils.rnn.pad_sequence([r.generated_log_probs.to(device) for r in rollouts], batch_first=True)
        mask = torch.nn.utils.rnn.pad_sequence(
            [torch.ones(len(r.generated_tokens), device=device) for r in rollouts], batch_first=True
        )
        ratio = torch.exp(learner - sampler)
        a = adv.to(device).unsqueeze(1)
        pg = -torch.minimum(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a)
        loss = (pg * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

        metrics = monitor.update(step, learner.detach(), sampler, mask.bool(), loss=loss.item(), reward=rewards.mean().item())
        gap = metrics["rollout_corr/train_rollout_logprob_abs_diff"]
        history.append({"step": step, "reward": rewards.mean().item(), "loss": loss.item(), **metrics})
        bar.set_postfix(reward=f"{rewards.mean().item():.3f}", gap=f"{gap:.2e}")
    if writer is not None:
        writer.close()
    first, last = history[0], history[-1]
    print(
        f"rl_grpo ({'strict' if args.strict else 'default'}, backend {recipe.backend or 'auto'}): reward "
        f"{first['reward']:.3f} -> {last['reward']:.3f}; learner-vs-rollout mean |dlogp| max over steps "
        f"{max(h["rollout_corr/train_rollout_logprob_abs_diff"] for h in history):.3e}"
    )
    return {"history": history}


if __name__ == "__main__":
    main()
