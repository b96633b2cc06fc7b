"""The pieces of one GRPO step: rollouts, the old / reference log-probs, the PPO mini-batch
updates through Megatron's forward-backward schedule, the held-out evaluation and the SFT warm-up.

Loss scaling. Megatron's no-pipelining schedule divides each micro-batch loss by the number of
micro-batches and DDP averages gradients over data-parallel ranks; a micro-batch therefore returns
``sum_tokens(loss) / N * (num_microbatches * dp_size)`` with ``N`` the valid-token count of the
whole mini-batch over all ranks (all-reduced first), so the applied gradient is exactly the
gradient of the mini-batch's token-mean (``token-mean``; ``N`` = the sequence count for
``seq-mean-token-mean``). The MoE auxiliary loss keeps Megatron's own scaling.
"""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import torch

from minite_megatron.rl import (
    MetricSums,
    aggregate,
    entropy_from_logits,
    group_advantages,
    k3_kl,
    masked_sum,
    ppo_clip_token_loss,
    tis_weights,
    zero_variance_groups,
)
from minite_megatron.rl.policy import forward_logits, logprobs_from_logits, scatter_response_values, sequence_logprobs
from minite_megatron.rl.policy import token_grid


def mix_seed(*words: int) -> int:
    """A 31-bit seed from integers (prompts, rollout seeds and shuffles of step ``s``)."""
    h = 0x12345678
    for w in words:
        h = (h ^ (int(w) & 0xFFFFFFFF)) * 0x01000193 & 0xFFFFFFFF
        h ^= h >> 13
    return h & 0x7FFFFFFF


def dp_info():
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), ps.get_data_parallel_group()


def all_reduce_sum(values: list[float], group) -> list[float]:
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, group=group)
    return t.cpu().tolist()


def gather_objects(obj, group):
    dist = torch.distributed
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def generate(engine, *args, **kwargs):
    """``engine.generate`` that leaves the model's sequence parallelism as it found it.

    Megatron's static generation loop (``TextGenerationController``) switches sequence parallelism
    off in every non-MoE module of a TP + EP model and never switches it back, after which the
    learner's MoE layers refuse to train (megatron-core 0.19.2); this restores it through the same
    Megatron helper and module cache."""
    from megatron.core.transformer.utils import set_model_to_sequence_parallel
    from megatron.core.utils import get_attr_wrapped_model

    config = get_attr_wrapped_model(engine.model, "config")
    sequence_parallel = config.sequence_parallel
    try:
        return engine.generate(*args, **kwargs)
    finally:
        if sequence_parallel and not config.sequence_parallel:
            set_model_to_sequence_parallel(engine.model, True)


@dataclasses.dataclass
class RolloutBatch:
    """This rank's share of a rollout batch (CPU tensors; ``[N, L - 1]`` per token, see
    :mod:`minite_megatron.rl.policy`)."""

    tokens: torch.Tensor
    response_mask: torch.Tensor  # every response token
    loss_mask: torch.Tensor  # the tokens that enter the loss (after dynamic sampling / overlong filter)
    rollout_logp: torch.Tensor
    rewards: torch.Tensor
    correct: torch.Tensor
    advantages: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    zero_variance: torch.Tensor
    generated_tokens: int
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None


def generate_rollouts(engine, task, pairs, args, *, seed: int, stop_at_eod: bool) -> RolloutBatch:
    """``args.group`` samples of every pair's prompt at ``args.temperature`` with the log-probs of
    the sampled distribution; rewards, group advantages and the loss mask."""
    prompts = [task.prompt(a, b) for a, b in pairs for _ in range(args.group)]
    rollouts = generate(engine, prompts, args.max_new_tokens, temperature=args.temperature, seed=seed,
                               stop_at_eod=stop_at_eod, logprobs="sampled")
    responses, lps, rewards, correct, truncated = [], [], [], [], []
    generated = 0
    for (a, b), r in zip([p for p in pairs for _ in range(args.group)], rollouts):
        generated += len(r.generated_tokens)
        resp = task.until_eod(r.generated_tokens, task.eod)
        responses.append(resp)
        lps.append(r.generated_log_probs[: len(resp)])
        rewards.append(task.reward(a, b, resp))
        correct.append(task.correct(a, b, resp))
        truncated.append(resp[-1] != task.eod)
    tokens, response_mask = token_grid(prompts, responses, pad_id=task.eod)
    rewards_t = torch.tensor(rewards, dtype=torch.float32)
    adv = group_advantages(rewards_t, args.group, normalize_std=not args.no_std_normalization)
    zero_var = zero_variance_groups(rewards_t, args.group)
    truncated_t = torch.tensor(truncated)
    keep = torch.ones(len(prompts), dtype=torch.bool)
    if args.dynamic_sampling:
        keep &= ~zero_var
    if args.overlong_filter:
        keep &= ~truncated_t
    return RolloutBatch(
        tokens=tokens, response_mask=response_mask, loss_mask=response_mask & keep.unsqueeze(1),
        rollout_logp=scatter_response_values(lps, response_mask), rewards=rewards_t, correct=torch.tensor(correct),
        advantages=adv, response_lengths=torch.tensor([len(r) for r in responses]), truncated=truncated_t,
        zero_variance=zero_var, generated_tokens=generated,
    )


def _micro_batches(batch: RolloutBatch, idx: torch.Tensor, size: int, device, width: int | None = None,
                   pad_id: int = 0) -> list[dict]:
    """Micro-batches of the sequences ``idx``, each trimmed to its own longest sequence, or with
    ``width`` padded to that many tokens (``pad_id``, masked out): the fixed shapes a CUDA graph
    replays."""
    fit = _padded if width is not None else (lambda x, n, value=0: x[:, :n])
    out = []
    for start in range(0, idx.numel(), size):
        sel = idx[start : start + size]
        # trimmed: the last response entry + 1 token
        w = width if width is not None else int(batch.response_mask[sel].any(0).nonzero().max()) + 2
        mb = {"tokens": fit(batch.tokens[sel], w, pad_id), "mask": fit(batch.loss_mask[sel], w - 1),
              "old": fit(batch.old_logp[sel], w - 1), "rollout": fit(batch.rollout_logp[sel], w - 1),
              "adv": batch.advantages[sel]}
        if batch.ref_logp is not None:
            mb["ref"] = fit(batch.ref_logp[sel], w - 1)
        out.append({k: v.to(device, non_blocking=True) for k, v in mb.items()})
    return out


def _padded(x: torch.Tensor, width: int, value=0) -> torch.Tensor:
    """``x`` ``[B, L]`` right-padded with ``value`` to ``[B, width]`` (``L <= width``)."""
    if x.shape[1] > width:
        raise ValueError(f"a rollout of {x.shape[1]} positions does not fit the graphed width {width}")
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


def compute_old_logprobs(model, batch: RolloutBatch, args, device, ref_model=None) -> None:
    """The learner's (and the reference's) log-probs of the rollouts, once, before the updates
    (eval mode, no grad): ``old_logp`` is what the PPO ratio and TIS divide by."""
    tokens = batch.tokens.to(device)
    model.eval()
    batch.old_logp = sequence_logprobs(model, tokens, temperature=args.temperature,
                                       micro_batch_size=args.micro_batch_size).cpu()
    if ref_model is not None:
        ref_model.eval()
        batch.ref_logp = sequence_logprobs(ref_model, tokens, temperature=args.temperature,
                                           micro_batch_size=args.micro_batch_size).cpu()


def tis_metrics(batch: RolloutBatch, cap: float, sums: MetricSums) -> None:
    if cap <= 0 or not bool(batch.loss_mask.any()):
        return
    w = torch.exp(batch.old_logp - batch.rollout_logp)
    m = batch.loss_mask
    sums.add("rollout_corr/rollout_is_mean", masked_sum(w.clamp(max=cap), m), m.sum())
    sums.add("rollout_corr/rollout_is_clip_frac", masked_sum((w > cap).double(), m), m.sum())


def _ppo_loss(mb: dict, logits: torch.Tensor, *, args, strict: bool, scale: float):
    """The PPO loss of one micro-batch (times ``scale``) and its metrics as Megatron's reduced-loss
    dict: ``name -> [sum, count]`` tensors, read on the host after the schedule (no host wait
    inside the step, so a CUDA graph can capture it). ``mb["denom"]``: the mini-batch's token or
    sequence count over all micro-batches and ranks (a device scalar)."""
    need_entropy_grad = args.entropy_coef > 0
    # (the token ids were checked when compute_old_logprobs scored them: no host wait in the step)
    logp, entropy = logprobs_from_logits(logits, mb["tokens"], strict=strict, temperature=args.temperature,
                                         with_entropy=need_entropy_grad, check=False)
    if entropy is None:  # a metric only
        with torch.no_grad():
            entropy = entropy_from_logits(logits.detach()[:, :-1], args.temperature)
    mask, denom = mb["mask"], mb["denom"]
    token_loss, clipped, lower = ppo_clip_token_loss(logp, mb["old"], mb["adv"], eps_low=args.eps_clip,
                                                     eps_high=args.eps_clip_high, dual_clip=args.dual_clip)
    if args.tis_cap > 0:
        token_loss = token_loss * tis_weights(mb["old"], mb["rollout"], args.tis_cap)
    pg = aggregate(token_loss, mask, args.loss_agg_mode, denominator=denom)
    loss = pg
    n = mask.sum()
    metrics = {}

    def metric(name, total, count):
        total = total.detach().double()
        count = count.double() if isinstance(count, torch.Tensor) else torch.zeros_like(total)  # (no host copy)
        metrics[name] = torch.stack([total, count])

    if "ref" in mb:
        kl = k3_kl(logp, mb["ref"])
        loss = loss + args.kl_coef * aggregate(kl, mask, args.loss_agg_mode, denominator=denom)
        metric("actor/kl_loss", masked_sum(kl.detach(), mask), n)
    if need_entropy_grad:
        loss = loss - args.entropy_coef * aggregate(entropy, mask, args.loss_agg_mode, denominator=denom)
    with torch.no_grad():
        metric("actor/pg_loss", pg, 0)  # summed over micro-batches and ranks: the update's loss
        metric("actor/entropy", masked_sum(entropy.detach(), mask), n)
        metric("actor/pg_clipfrac", masked_sum(clipped.double(), mask), n)
        metric("actor/pg_clipfrac_lower", masked_sum(lower.double(), mask), n)
        metric("actor/ppo_kl", masked_sum((mb["old"] - logp.detach()).double(), mask), n)
    return loss * scale, metrics


def ppo_graph(args):
    """``--cuda-graph-impl full_iteration``: Megatron's forward-backward schedule inside the minite
    full-iteration graph (warm-up updates eager, then one capture, then a replay per update); None
    without the flag."""
    if args.cuda_graph_impl != "full_iteration":
        return None
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from minite_megatron.training.full_iteration_graph import MiniteFullIterationGraph

    graph = MiniteFullIterationGraph(get_forward_backward_func(), cuda_graph_warmup_steps=args.cuda_graph_warmup_steps,
                                     use_single_mempool=True)
    graph.reset_cuda_graph()  # Megatron keeps one graph per process: this run's is captured afresh
    return graph


def ppo_update(ddp_model, optimizer, scheduler, batch: RolloutBatch, args, *, step: int, strict: bool,
               device, sums: MetricSums, graph=None, width: int | None = None, pad_id: int = 0) -> dict:
    """``--ppo-epochs`` passes over the batch in mini-batches of ``--mini-batch-size`` prompts (whole
    groups, shuffled per epoch), one optimizer step each. Returns the per-update values that are not
    token means (grad norms, losses, lr). ``graph``: :func:`ppo_graph`'s schedule, micro-batches
    padded to ``width`` tokens (``pad_id``)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank, dp_size, dp_group = dp_info()
    n = batch.tokens.shape[0]
    num_mini = args.rollout_batch_size // args.mini_batch_size
    groups = n // args.group
    per_mini = groups // num_mini  # whole groups (prompts) per mini-batch
    forward_backward = graph if graph is not None else get_forward_backward_func()
    grad_norms, pg_losses, skipped = [], [], 0
    ddp_model.train()
    for epoch in range(args.ppo_epochs):
        g = torch.Generator().manual_seed(mix_seed(args.seed, 3, step, epoch, dp_rank))
        perm = torch.randperm(groups, generator=g)
        for u in range(num_mini):
            chosen = perm[u * per_mini : (u + 1) * per_mini]
            idx = (chosen.unsqueeze(1) * args.group + torch.arange(args.group)).reshape(-1)
            m = batch.loss_mask[idx]
            local = [float(m.sum()), float((m.sum(1) > 0).sum())]
            tokens_all, seqs_all = all_reduce_sum(local, dp_group)
            denom = tokens_all if args.loss_agg_mode == "token-mean" else seqs_all
            micro = _micro_batches(batch, idx, args.micro_batch_size, device, width, pad_id)
            update_sums = MetricSums()
            if denom == 0:  # every sample of this mini-batch was filtered out: nothing to learn from
                skipped += 1
                continue
            scale = len(micro) * dp_size
            denom_t = torch.tensor(float(denom), dtype=torch.float32, device=device)
            for mb in micro:
                mb["denom"] = denom_t

            def forward_step(data_iterator, model):
                mb = next(data_iterator)
                logits = forward_logits(model, mb["tokens"])
                return logits, partial(_ppo_loss, mb, args=args, strict=strict, scale=scale)

            ddp_model.zero_grad_buffer()
            optimizer.zero_grad()
            reduced = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp_model],
                                       num_microbatches=len(micro), seq_length=int(micro[0]["tokens"].shape[1]),
                                       micro_batch_size=args.micro_batch_size, forward_only=False)
            for metrics in reduced:  # per micro-batch, in order (a graph's static outputs after its replay)
                for name, pair in metrics.items():
                    update_sums.add(name, pair[0], pair[1])
            ok, grad_norm, _ = optimizer.step()
            scheduler.step(increment=1)
            if not ok:
                skipped += 1
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            pg_losses.append(update_sums.total("actor/pg_loss"))
            sums.merge(update_sums, skip=("actor/pg_loss",))
    pg_total = all_reduce_sum(pg_losses, dp_group) if pg_losses else []
    return {
        "actor/pg_loss": sum(pg_total) / len(pg_total) if pg_total else float("nan"),
        "actor/grad_norm": sum(grad_norms) / len(grad_norms) if grad_norms else float("nan"),
        "actor/lr": optimizer.param_groups[0]["lr"],
        "actor/num_updates": float(len(grad_norms)),
        "actor/skipped_updates": float(skipped),
    }


@torch.no_grad()
def evaluate(engine, task, args, pairs=None) -> float:
    """Greedy exact-match accuracy on the held-out pairs (or ``pairs``), split over data-parallel
    ranks."""
    dp_rank, dp_size, dp_group = dp_info()
    pairs = (task.eval_pairs if pairs is None else pairs)[dp_rank::dp_size]
    correct = 0
    if pairs:
        outs = generate(engine, [task.prompt(a, b) for a, b in pairs], args.max_new_tokens, temperature=0.0, seed=0,
                               stop_at_eod=not args.lockstep_rollouts)
        correct = sum(task.correct(a, b, o.generated_tokens) for (a, b), o in zip(pairs, outs))
    total_correct, total = all_reduce_sum([float(correct), float(len(pairs))], dp_group)
    return total_correct / total


def _sft_loss(mb: dict, logits: torch.Tensor, *, strict: bool, denom: float, scale: float, sums: MetricSums):
    logp, _ = logprobs_from_logits(logits, mb["tokens"], strict=strict)
    mask = mb["mask"]
    loss = -masked_sum(logp, mask) / denom
    sums.add("sft/loss", loss.detach(), 0)
    return loss * scale, {}


def sft_warmup(ddp_model, optimizer, task, args, *, device, strict: bool, log, engine=None,
               deadline: float | None = None, scheduler=None) -> list[dict]:
    """Up to ``--sft-steps`` of supervised training on correct answers (cross-entropy on the answer
    tokens, token mean over the global batch) through the same schedule and optimizer machinery.

    With ``--sft-target-accuracy`` (and ``engine``), every ``--sft-eval-interval`` steps the greedy
    accuracy on a fixed sample of *training* pairs (never the held-out ones) is measured, and the
    warm-up stops once it reaches the target: RL then starts from a policy that is neither hopeless
    nor saturated whatever the seed (a small model escapes addition's loss plateau after a number of
    steps that varies with the seed). ``deadline`` (a ``time.perf_counter()`` value) ends it early
    too (``--time-budget-s`` gives the warm-up at most half of the budget). ``scheduler``: Megatron's
    ``OptimizerParamScheduler`` (``--sft-lr-warmup-steps``), stepped once per optimizer step. Each
    record carries the step's wall time (``sft/step_s``, the accuracy check excluded)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp_rank, dp_size, dp_group = dp_info()
    forward_backward = get_forward_backward_func()
    per_rank = args.sft_batch_size // dp_size
    records = []
    target = args.sft_target_accuracy if engine is not None else 0.0
    probe = task.sample_pairs(len(task.eval_pairs), torch.Generator().manual_seed(mix_seed(args.seed, 5))) if target else None
    ddp_model.train()
    for step in range(1, args.sft_steps + 1):
        t_step = time.perf_counter()
        g = torch.Generator().manual_seed(mix_seed(args.seed, 1, step, dp_rank))
        pairs = task.sample_pairs(per_rank, g)
        tokens, mask = token_grid([task.prompt(a, b) for a, b in pairs], [task.answer(a, b) for a, b in pairs],
                                  pad_id=task.eod)
        (denom,) = all_reduce_sum([float(mask.sum())], dp_group)
        micro = []
        for start in range(0, per_rank, args.micro_batch_size):
            micro.append({"tokens": tokens[start : start + args.micro_batch_size].to(device),
                          "mask": mask[start : start + args.micro_batch_size].to(device)})
        sums = MetricSums()
        scale = len(micro) * dp_size

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return forward_logits(model, mb["tokens"]), partial(_sft_loss, mb, strict=strict, denom=denom,
                                                                 scale=scale, sums=sums)

        ddp_model.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=[ddp_model],
                         num_microbatches=len(micro), seq_length=int(tokens.shape[1]),
                         micro_batch_size=args.micro_batch_size, forward_only=False)
        lr = optimizer.param_groups[0]["lr"]  # the step's own
        _, grad_norm, _ = optimizer.step()
        if scheduler is not None:
            scheduler.step(increment=1)
        (loss,) = all_reduce_sum([sums.total("sft/loss")], dp_group)
        rec = {"step": step, "phase": "sft", "sft/loss": loss, "sft/grad_norm": float(grad_norm), "sft/lr": lr,
               "sft/step_s": time.perf_counter() - t_step}
        stop = False
        if target and (step % args.sft_eval_interval == 0 or step == args.sft_steps):
            rec["sft/train_accuracy"] = evaluate(engine, task, args, pairs=probe)
            ddp_model.train()
            stop = rec["sft/train_accuracy"] >= target
        if deadline is not None and time.perf_counter() > deadline:
            rec["sft/stopped_by_deadline"] = 1.0
            stop = True
        records.append(rec)
        log(rec)
        if stop:
            break
    return records


def timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0
