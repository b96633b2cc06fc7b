"""GRPO / DAPO on Megatron-Core: the NVFP4 learner and the rollout engine on the same weights.

    python examples/rl/train_grpo.py                              # tiny Qwen3-MoE-shaped model, CPU or GPU
    python examples/rl/train_grpo.py --strict                     # learner == rollout log-probs, bitwise
    python examples/rl/train_grpo.py --hf-checkpoint DIR          # start from a Hugging Face Qwen3(-MoE)
    python examples/rl/train_grpo.py --save ckpt --save-interval 5   # a rerun resumes from ckpt, exactly
    python examples/rl/train_grpo.py --load ckpt --steps 40 --override-opt-param-scheduler  # train on
    python examples/rl/train_grpo.py --load ckpt/converted           # a minite-convert checkpoint: its model
    torchrun --nproc-per-node 2 examples/rl/train_grpo.py --ep 2  # data + expert parallel (gloo on CPU)

What one step does (verl / slime vocabulary):

1. *rollout*: ``--rollout-batch-size`` training prompts (``a+b=``, :mod:`rl_task`), ``--group``
   samples each from :class:`~minite_megatron.rollout.RolloutEngine` on the learner's own
   weights, with the log-probs of the distribution sampled (``logprobs="sampled"``: at
   ``--temperature``); exact-match rewards;
2. *advantages*: group-relative (GRPO; ``--no-std-normalization``, ``--dynamic-sampling``,
   ``--overlong-filter`` for the DAPO variants);
3. *old_log_prob* (and *ref* with ``--kl-coef``): the learner's log-probs of the rollouts at the
   same temperature, once, before the updates; the learner/rollout gap (``rollout_corr/*``) is
   measured on them by :class:`~minite_megatron.diagnostics.GapMonitor`;
4. *update_actor*: ``--ppo-epochs`` x (rollout / mini-batch) optimizer steps of the PPO clipped
   loss (clip-higher ``--eps-clip-high``), token-mean over each mini-batch, TIS-weighted by
   ``min(exp(old - rollout), --tis-cap)``, plus the k3 KL and entropy terms, through Megatron's
   forward-backward schedule, ``DistributedDataParallel`` and ``get_megatron_optimizer`` (Adam,
   ``--clip-grad``);
5. held-out greedy accuracy every ``--eval-interval`` steps; metrics to the console, TensorBoard
   and ``metrics.jsonl``; a checkpoint every ``--save-interval`` steps; ``curves.png`` at the end.

A supervised warm-up (``--sft-steps``) on correct answers first brings the fresh model to a
policy that is neither hopeless nor saturated, so RL has something to improve.

Bad input (a flag, a ``--recipe`` file, a ``--load`` directory) prints one line,
``train_grpo.py: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "..", ".."))

from minite_megatron.training import upstream_warnings  # noqa: E402

# before torch and megatron are imported; here (not in main) so that the worker processes
# multiprocessing spawns, which import this file, filter them too
upstream_warnings.install()

import torch  # noqa: E402

import rl_args  # noqa: E402


def _is_logging_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def main(argv=None) -> dict:
    t_start = time.perf_counter()
    args = rl_args.parse_args(argv)
    import rl_checkpoint
    import rl_logging
    import rl_loop
    import rl_model
    from rl_task import AdditionTask

    # every check of the flags and files before any process group, model or log line
    try:
        task = AdditionTask(args.digits, reverse=not args.no_reverse, partial_credit=args.partial_credit,
                            eval_size=args.eval_size)
    except ValueError as e:  # names the flag (--digits)
        raise rl_args.UsageError(str(e)) from None
    if args.max_new_tokens is None:
        args.max_new_tokens = task.answer_length
    recipe = rl_args.build_recipe(args)
    max_seq = task.prompt_length + args.max_new_tokens
    vocab = max(16, -(-task.tokenizer.vocab_size // 16) * 16)  # a multiple of 16 (TP splits of the LM head)
    if args.load is None and args.save and rl_checkpoint.checkpoint_dir(args.save) is not None:
        args.load = args.save  # Megatron's resume: a rerun with the same --save continues from its latest checkpoint
    loaded = rl_checkpoint.inspect(args.load) if args.load else None
    arch = rl_model.model_architecture(args, vocab, max_seq, loaded)
    if arch.get("max_seq") != max_seq:
        raise rl_args.UsageError(f"--load {args.load}: the checkpoint's run has sequences of {arch.get('max_seq')} "
                                 f"tokens, this run's task needs {max_seq} (--digits / --max-new-tokens differ)")

    device = rl_model.init_distributed(args.tp, args.ep, args.seed, cuda_graphs=args.cuda_graph_impl != "none")
    from megatron.core import parallel_state as ps
    from tqdm import tqdm

    from minite_megatron.training import megatron_wheel

    megatron_wheel.apply()  # a checkpoint's LR schedule that differs from the flags' names the flag

    from minite_megatron.diagnostics import GapMonitor
    from minite_megatron.rl import MetricSums, rollout_metrics
    from minite_megatron.rollout.engine import RolloutEngine

    dp_rank, dp_size, dp_group = rl_loop.dp_info()
    for name, n in (("--rollout-batch-size", args.rollout_batch_size), ("--mini-batch-size", args.mini_batch_size),
                    ("--sft-batch-size", args.sft_batch_size)):
        if n % dp_size:
            raise rl_args.UsageError(f"{name} {n} is not a multiple of the data-parallel size {dp_size}")
    args.lockstep_rollouts = args.ep > 1  # EP ranks all-to-all in every forward: same step count everywhere
    if args.eval_size % dp_size and args.lockstep_rollouts:
        raise rl_args.UsageError(f"--eval-size {args.eval_size} must be a multiple of the data-parallel size with --ep > 1")
    dtype = rl_model.params_dtype(args.params_dtype, device)

    logging_rank = _is_logging_rank()
    log = rl_logging.RunLog(args.log_dir, enabled=logging_rank, tensorboard=not args.no_tensorboard, console=None)
    bar_disabled = args.no_progress or not logging_rank
    say = (lambda s: tqdm.write(s)) if logging_rank else (lambda s: None)
    logging.getLogger("minite_megatron.diagnostics.monitor").setLevel(logging.WARNING)  # our line, not its
    if not args.verbose:
        logging.getLogger("megatron").setLevel(logging.WARNING)

    model = rl_model.build_policy_model(args, arch, recipe, device, dtype, args.seed)
    rl_model.check_rollout_layout(model, args.tp, args.ep)
    model_info = {**arch, "parameters_per_rank": sum(p.numel() for p in model.parameters()),
                  "params_dtype": str(dtype).replace("torch.", ""), "backend": recipe.backend or "auto"}
    ddp = rl_model.wrap_ddp(model, graphed=args.cuda_graph_impl != "none")
    ppo_graph = rl_loop.ppo_graph(args)  # None: eager updates
    strict = recipe.strict
    say(f"train_grpo: {'strict' if strict else 'default'} recipe{' (no quantization)' if args.no_quant else ''}, "
        f"backend {recipe.backend or 'auto'}, {sum(p.numel() for p in model.parameters()):,} parameters on this rank, "
        f"TP {args.tp} EP {args.ep} DP {dp_size}, device {device}")

    rl_state = None
    if args.load:
        rl_state = loaded["rl_state"]
        if rl_state is None or args.finetune:
            rl_checkpoint.load_weights(args.load, model)
            why = "--finetune" if rl_state is not None else "not an RL checkpoint of this script"
            say(f"loaded the weights of {args.load} ({why}: a new run starts from them)")
            rl_state = None

    sft_records = []

    def log_record(rec):
        sft_records.append(rec)
        log.write(rec)
        if "sft/train_accuracy" in rec:
            say(f"sft step {rec['step']} | loss {rec['sft/loss']:.4f} | accuracy on training prompts "
                f"{rec['sft/train_accuracy']:.3f}")
        elif rec["step"] % max(1, args.sft_steps // 5) == 0 or rec["step"] == args.sft_steps:
            say(f"sft step {rec['step']} | loss {rec['sft/loss']:.4f}")

    engine_cls = RolloutEngine
    engine_kwargs = {}
    if args.rollout_engine == "vllm":
        from rl_vllm import VllmRolloutEngine as engine_cls  # noqa: N813

        engine_kwargs = {"recipe": recipe}
    engine = engine_cls(model, eod_id=task.eod,
                        max_batch_size=max(args.rollout_batch_size // dp_size * args.group, len(task.eval_pairs)),
                        max_sequence_length=max_seq, **engine_kwargs)

    timings = {"build_s": time.perf_counter() - t_start}  # imports, process groups, model, engine
    interrupted = False
    if rl_state is None and args.sft_steps:
        t_sft = time.perf_counter()
        sft_opt = rl_model.build_optimizer(ddp, lr=args.sft_lr, weight_decay=0.0, clip_grad=args.clip_grad,
                                           beta1=args.adam_beta1, beta2=args.adam_beta2)
        sft_sched = (rl_model.build_scheduler(sft_opt, lr=args.sft_lr, min_lr=args.sft_lr, warmup=args.sft_lr_warmup_steps,
                                              total=args.sft_steps, style="constant")
                     if args.sft_lr_warmup_steps else None)
        try:
            rl_loop.sft_warmup(ddp, sft_opt, task, args, device=device, strict=strict, log=log_record, engine=engine,
                               scheduler=sft_sched,
                               deadline=t_start + args.time_budget_s / 2 if args.time_budget_s else None)
        except KeyboardInterrupt:  # see the RL loop: finish with what there is, no RL
            interrupted = True
            say("interrupted during the warm-up: no RL steps")
        del sft_opt, sft_sched
        timings["sft_s"] = time.perf_counter() - t_sft

    ref_model = None
    if args.kl_coef > 0:
        ref_model = rl_model.build_policy_model(args, arch, recipe, device, dtype, args.seed)
        missing, _ = ref_model.load_state_dict(model.state_dict(), strict=False)
        ref_model.requires_grad_(False)

    optimizer = rl_model.build_optimizer(ddp, lr=args.lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                                         beta1=args.adam_beta1, beta2=args.adam_beta2)
    updates_per_step = args.ppo_epochs * (args.rollout_batch_size // args.mini_batch_size)
    scheduler = rl_model.build_scheduler(optimizer, lr=args.lr, min_lr=args.min_lr, warmup=args.lr_warmup_steps,
                                         total=args.steps * updates_per_step, style=args.lr_decay_style,
                                         weight_decay=args.weight_decay)
    expect = {"arch": arch, "recipe": recipe.to_dict(), "seed": args.seed}
    start = 0
    if rl_state is not None:
        rl_state = rl_checkpoint.load(args.load, model=model, optimizer=optimizer, scheduler=scheduler,
                                      ref_model=ref_model, expect=expect,
                                      override_scheduler=args.override_opt_param_scheduler)
        start = int(rl_state["step"])
        say(f"resumed {args.load} at RL step {start}")
    if args.load:
        engine.sync_weights()  # documented for weights set from outside the optimizer (it also sees in-place copies)

    t_rl = time.perf_counter()
    monitor = GapMonitor(threshold=args.gap_threshold, writer=None)
    history = []
    if start == 0 and args.eval_interval and not interrupted:
        acc = rl_loop.evaluate(engine, task, args)
        rec = {"step": 0, "phase": "eval", "val/accuracy": acc}
        log.write(rec)
        history.append(rec)
        say(f"held-out accuracy before RL: {acc:.3f} ({len(task.eval_pairs)} prompts, greedy)")

    bar = tqdm(range(start + 1, args.steps + 1), desc=f"GRPO ({'strict' if strict else 'default'})",
               disable=bar_disabled, initial=start, total=args.steps, dynamic_ncols=True)
    try:
        for step in bar:
            if interrupted:
                break
            t_step = time.perf_counter()
            g = torch.Generator().manual_seed(rl_loop.mix_seed(args.seed, 2, step, dp_rank))
            pairs = task.sample_pairs(args.rollout_batch_size // dp_size, g)
            batch, t_gen = rl_loop.timed(rl_loop.generate_rollouts, engine, task, pairs, args,
                                         seed=rl_loop.mix_seed(args.seed, 4, step, dp_rank),
                                         stop_at_eod=not args.lockstep_rollouts)
            _, t_old = rl_loop.timed(rl_loop.compute_old_logprobs, model, batch, args, device, ref_model)
            sums = MetricSums()
            rl_loop.tis_metrics(batch, args.tis_cap, sums)
            update, t_upd = rl_loop.timed(rl_loop.ppo_update, ddp, optimizer, scheduler, batch, args, step=step,
                                          strict=strict, device=device, sums=sums, graph=ppo_graph,
                                          width=max_seq if ppo_graph is not None else None, pad_id=task.eod)
            sums.all_reduce(dp_group)

            # gather the rollout batch's summaries (and the gap inputs) on every rank, log on rank 0
            per_seq = [(batch.old_logp[i][batch.response_mask[i]], batch.rollout_logp[i][batch.response_mask[i]])
                       for i in range(batch.tokens.shape[0])]
            shards = rl_loop.gather_objects(
                dict(per_seq=per_seq, rewards=batch.rewards, adv=batch.advantages, lengths=batch.response_lengths,
                     truncated=batch.truncated, correct=batch.correct, keep=batch.loss_mask.any(1),
                     zero_var=batch.zero_variance, gen=batch.generated_tokens, tokens=int(batch.tokens.numel())),
                dp_group)
            cat = lambda k: torch.cat([s[k] for s in shards])  # noqa: E731
            rec = {"step": step, "phase": "rl"}
            rec.update(rollout_metrics(cat("rewards"), cat("adv"), cat("lengths"), cat("truncated"), cat("keep")))
            rec["train/accuracy"] = float(cat("correct").double().mean())
            rec["batch/zero_variance_group_frac"] = float(cat("zero_var").double().mean())
            rec["batch/kept_sample_frac"] = float(cat("keep").double().mean())
            rec.update(sums.means())
            rec.update(update)
            from minite_megatron.diagnostics import pad_sequences

            learner, _ = pad_sequences([o for s in shards for o, _ in s["per_seq"]])
            rollout, mask = pad_sequences([r for s in shards for _, r in s["per_seq"]])
            rec.update(monitor.update(step, learner, rollout, mask))
            gen_tokens = sum(s["gen"] for s in shards)
            train_tokens = sum(s["tokens"] for s in shards) * args.ppo_epochs
            rec["timing_s/gen"], rec["timing_s/old_log_prob"], rec["timing_s/update_actor"] = t_gen, t_old, t_upd
            rec["perf/rollout_tokens_per_s"] = gen_tokens / t_gen
            rec["perf/train_tokens_per_s"] = train_tokens / t_upd
            out_of_time = bool(args.time_budget_s) and time.perf_counter() - t_start > args.time_budget_s
            if args.eval_interval and (step % args.eval_interval == 0 or step == args.steps or out_of_time):
                rec["val/accuracy"] = rl_loop.evaluate(engine, task, args)
            rec["timing_s/step"] = time.perf_counter() - t_step
            history.append(rec)
            log.write(rec)
            say(log.line(rec))
            bar.set_postfix(reward=f"{rec['critic/rewards/mean']:.3f}",
                            gap=f"{rec['rollout_corr/train_rollout_logprob_abs_diff']:.1e}")
            if args.save and ((args.save_interval and step % args.save_interval == 0) or step == args.steps
                              or out_of_time):
                rl_checkpoint.save(args.save, step, model=model, optimizer=optimizer, scheduler=scheduler,
                                   ref_model=ref_model, rl_state={**expect, "has_ref_model": ref_model is not None})
                say(f"saved {args.save} at RL step {step}")
            if out_of_time:
                say(f"--time-budget-s {args.time_budget_s:g} reached after RL step {step}: stopping")
                break
    except KeyboardInterrupt:  # Ctrl-C, or the SIGINT of a wall-clock watchdog (examples/rl/h200_run.sh)
        interrupted = True
        say("interrupted: finishing with the steps done so far (metrics.jsonl is complete up to them)")
        last = history[-1] if history else None
        if last is not None and last.get("phase") == "rl" and "val/accuracy" not in last and args.eval_interval:
            try:  # the held-out accuracy after the last finished step
                acc = rl_loop.evaluate(engine, task, args)
                rec = {"step": last["step"], "phase": "eval", "val/accuracy": acc}
                log.write(rec)
                history.append(rec)
            except (KeyboardInterrupt, Exception) as e:  # noqa: BLE001 - the summary matters more
                say(f"no final held-out evaluation ({type(e).__name__})")
    bar.close()
    if start and args.steps <= start:
        say(f"{args.load} is at RL step {start} of --steps {args.steps}: nothing to train (more --steps with "
            "--override-opt-param-scheduler trains on)")
    elif args.save and args.steps == start:  # nothing trained in the loop (e.g. --steps 0 after an SFT warm-up)
        rl_checkpoint.save(args.save, start, model=model, optimizer=optimizer, scheduler=scheduler,
                           ref_model=ref_model, rl_state={**expect, "has_ref_model": ref_model is not None})
        say(f"saved {args.save} at RL step {start}")
    log.close()
    if logging_rank:
        _finish(args, history, sft_records, model_info=model_info, strict=strict, device=device, argv=argv,
                t_start=t_start, timings={**timings, "rl_s": time.perf_counter() - t_rl}, interrupted=interrupted,
                log_path=log.path, say=say)
    return {"history": history, "log_dir": args.log_dir}


def _finish(args, history, sft_records, *, model_info, strict, device, argv, t_start, timings, interrupted,
            log_path, say):
    """The closing line, ``summary.json`` (what a results table needs: held-out accuracy before /
    after, rewards, gap, throughput, device, date, command) and ``curves.png`` (logging rank)."""
    import rl_logging

    rl = [h for h in history if h.get("phase") == "rl"]
    evals = [[h["step"], h["val/accuracy"]] for h in history if "val/accuracy" in h]
    gaps = [h["rollout_corr/train_rollout_logprob_abs_diff"] for h in rl]
    sft_acc = [r["sft/train_accuracy"] for r in sft_records if "sft/train_accuracy" in r]
    mode = "strict" if strict else "default"
    msg = f"train_grpo ({mode}): {len(rl)} RL steps"
    if rl:
        msg += f", reward {rl[0]['critic/rewards/mean']:.3f} -> {rl[-1]['critic/rewards/mean']:.3f}"
    if evals:
        msg += f"; held-out accuracy {evals[0][1]:.3f} -> {evals[-1][1]:.3f}"
    if gaps:
        msg += f"; max learner/rollout gap {max(gaps):.3e}"
    say(msg)
    summary = {
        "command": " ".join(["python examples/rl/train_grpo.py", *(sys.argv[1:] if argv is None else map(str, argv))]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": rl_logging.device_name(device),
        "versions": rl_logging.versions(), "mode": mode, "quantized": not args.no_quant,
        "model": model_info, "status": "interrupted" if interrupted else "completed",
        "sft_steps": len(sft_records), "sft_train_accuracy_last": sft_acc[-1] if sft_acc else None,
        "rl_steps": len(rl), "rollouts_per_step": args.rollout_batch_size * args.group,
        "reward_first": rl[0]["critic/rewards/mean"] if rl else None,
        "reward_last": rl[-1]["critic/rewards/mean"] if rl else None,
        "train_accuracy_first": rl[0]["train/accuracy"] if rl else None,
        "train_accuracy_last": rl[-1]["train/accuracy"] if rl else None,
        "held_out_accuracy_before": evals[0][1] if evals and evals[0][0] == 0 else None,
        "held_out_accuracy_after": evals[-1][1] if evals and evals[-1][0] > 0 else None,
        "held_out_accuracy": evals, "held_out_prompts": args.eval_size,
        "max_gap": max(gaps) if gaps else None, "mean_gap": sum(gaps) / len(gaps) if gaps else None,
        "rollout_tokens_per_s_median": rl_logging.median(h["perf/rollout_tokens_per_s"] for h in rl),
        "train_tokens_per_s_median": rl_logging.median(h["perf/train_tokens_per_s"] for h in rl),
        "step_s_median": rl_logging.median(h["timing_s/step"] for h in rl),
        "timing_s": timings, "wall_s": time.perf_counter() - t_start,
    }
    if log_path:
        with open(os.path.join(args.log_dir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
        if not args.no_plot and rl:
            png = rl_logging.plot_curves(log_path, os.path.join(args.log_dir, "curves.png"),
                                         f"GRPO on {args.digits}-digit addition ({mode})")
            say(f"curves: {png}")


def _run_cli(argv=None) -> None:
    """``main()``, with this script's refusals (and the converter's, the recipe's) as one line, status 2."""
    from minite_megatron.convert.errors import ConvertError

    try:
        main(argv)
    except (rl_args.UsageError, ConvertError) as e:
        print(f"{rl_args.PROG}: error: {str(e).removeprefix('convert: ')}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    try:
        _run_cli()
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
