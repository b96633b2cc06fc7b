"""Command line of ``examples/rl/train_grpo.py`` (flag names follow Megatron / verl / slime where
they have one) and the recipe it selects."""

from __future__ import annotations

import argparse
import dataclasses
import re

PROG = "train_grpo.py"


class UsageError(ValueError):
    """A flag, file or value this script refuses; ``train_grpo.py`` prints the message as one line
    (``train_grpo.py: error: ...``) and exits with status 2."""


def build_parser() -> argparse.ArgumentParser:
    from minite_megatron.training.cli import OneLineArgumentParser  # one line, status 2, no usage text

    p = OneLineArgumentParser(
        prog=PROG, description="GRPO / DAPO on Megatron-Core with the NVFP4 learner and rollout engine",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--preset", default=None,
                   help="fresh model of minite_megatron.training.presets (tiny, qwen3-moe); default tiny, or with "
                        "--load the model the checkpoint holds")
    m.add_argument("--num-layers", type=int, default=None, help="override the preset's layer count")
    m.add_argument("--hidden-size", type=int, default=None, help="override the preset's hidden size (head dim follows)")
    m.add_argument("--num-experts", type=int, default=None, help="override the preset's routed expert count")
    m.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="override the preset's expert FFN size")
    m.add_argument("--hf-checkpoint", default=None, help="start from a Hugging Face Qwen3 / Qwen3-MoE directory")
    m.add_argument("--load", default=None, help="Megatron checkpoint: an RL run of this script resumes exactly; "
                   "any other torch_dist checkpoint (minite-convert hf-to-megatron, pretrain_gpt.py) gives the model "
                   "(its shapes read from the checkpoint) and its starting weights")
    m.add_argument("--finetune", action="store_true",
                   help="with --load: take the weights only and start a new run (Megatron's --finetune)")
    m.add_argument("--save", default=None, help="checkpoint directory (Megatron dist_checkpointing, torch_dist); a "
                   "rerun with the same --save (and no --load) resumes from its latest checkpoint")
    m.add_argument("--override-opt-param-scheduler", "--override-opt_param-scheduler", action="store_true",
                   help="with --load: the LR schedule of this run's flags (e.g. more --steps), not the checkpoint's "
                        "(Megatron's --override-opt_param-scheduler)")
    m.add_argument("--save-interval", type=int, default=0, help="save every N RL steps (0: only at the end)")
    m.add_argument("--params-dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="auto: BF16 on a GPU, FP32 on the CPU")
    par = p.add_argument_group("parallelism (torchrun --nproc-per-node N; data parallel = N / (TP))")
    par.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    par.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, default=1)
    r = p.add_argument_group("precision recipe")
    r.add_argument("--recipe", default=None, help="JSON file of minite_megatron.recipe.Recipe fields")
    r.add_argument("--strict", action="store_true", help="Recipe.strict: learner log-probs == rollout's, bitwise")
    r.add_argument("--no-quant", action="store_true", help="quantization off: the BF16 precision of the same specs")
    r.add_argument("--backend", default=None, help="NVFP4 backend (reference, triton); default: best for the device")
    t = p.add_argument_group("task (multi-digit addition, examples/rl/rl_task.py)")
    t.add_argument("--digits", type=int, default=2)
    t.add_argument("--no-reverse", action="store_true", help="answers most significant digit first")
    t.add_argument("--partial-credit", action="store_true", help="half credit for the fraction of digits right")
    t.add_argument("--eval-size", type=int, default=128, help="held-out prompts, at most (never trained on)")
    t.add_argument("--eval-interval", type=int, default=5, help="greedy held-out accuracy every N steps (0: off)")
    s = p.add_argument_group("supervised warm-up (SFT on correct answers)")
    s.add_argument("--sft-steps", type=int, default=600, help="at most this many steps (0: no warm-up)")
    s.add_argument("--sft-batch-size", type=int, default=64)
    s.add_argument("--sft-lr", type=float, default=3e-3)
    s.add_argument("--sft-lr-warmup-steps", type=int, default=0,
                   help="steps of linear LR warm-up from 0 (large models: Adam's first steps move every weight by "
                        "about the LR, a loss spike without it)")
    s.add_argument("--sft-target-accuracy", type=float, default=0.5,
                   help="stop the warm-up once the greedy accuracy on training prompts reaches this (0: off)")
    s.add_argument("--sft-eval-interval", type=int, default=20, help="steps between those checks")
    g = p.add_argument_group("GRPO / PPO")
    g.add_argument("--steps", "--num-rollout", dest="steps", type=int, default=20, help="RL steps (rollout batches)")
    g.add_argument("--rollout-batch-size", type=int, default=16, help="prompts per step (all ranks)")
    g.add_argument("--group", "--n-samples-per-prompt", dest="group", type=int, default=8, help="samples per prompt")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (log-probs at the same)")
    g.add_argument("--rollout-engine", choices=("builtin", "vllm"), default="builtin",
                   help="builtin: the project's engine on the learner's modules; vllm: an in-process vllm.LLM with the "
                        "minite-vllm plugin, refitted every step (examples/rl/rl_vllm.py; needs .venv-vllm)")
    g.add_argument("--max-new-tokens", type=int, default=None, help="default: the answer length")
    g.add_argument("--ppo-epochs", type=int, default=2, help="passes over each rollout batch")
    g.add_argument("--cuda-graph-impl", choices=("none", "full_iteration"), default="none",
                   help="full_iteration: each PPO update's forward + backward (every micro-batch) replays one CUDA "
                        "graph, Megatron's full-iteration graph with the minite step's seeds (micro-batches padded "
                        "to the longest possible sequence; GPU, --ep 1)")
    g.add_argument("--cuda-graph-warmup-steps", type=int, default=2,
                   help="eager PPO updates before the capture (--cuda-graph-impl full_iteration)")
    g.add_argument("--mini-batch-size", type=int, default=8, help="prompts per optimizer step (all ranks)")
    g.add_argument("--micro-batch-size", type=int, default=64, help="sequences per forward, per rank")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-steps", type=int, default=0, help="optimizer steps of linear warm-up")
    g.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="constant")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (OptimizerConfig.clip_grad)")
    g.add_argument("--eps-clip", type=float, default=0.2, help="PPO ratio clip, lower (1 - eps)")
    g.add_argument("--eps-clip-high", type=float, default=None, help="upper clip (DAPO clip-higher); default: --eps-clip")
    g.add_argument("--dual-clip", type=float, default=None, help="cap the loss of negative-advantage tokens at -A*c")
    g.add_argument("--loss-agg-mode", choices=("token-mean", "seq-mean-token-mean"), default="token-mean")
    g.add_argument("--kl-coef", type=float, default=0.0, help="k3 KL to the frozen reference (the post-SFT policy)")
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--tis-cap", type=float, default=2.0, help="truncated importance sampling cap C (0: off)")
    g.add_argument("--no-std-normalization", action="store_true", help="A = r - mean (Dr. GRPO), no / std")
    g.add_argument("--dynamic-sampling", action="store_true",
                   help="DAPO: drop groups whose rewards are all equal from the loss (no refill)")
    g.add_argument("--overlong-filter", action="store_true", help="DAPO: drop responses cut at --max-new-tokens")
    o = p.add_argument_group("logging")
    o.add_argument("--log-dir", default="runs/rl_grpo", help="metrics.jsonl, TensorBoard events, curves.png")
    o.add_argument("--no-tensorboard", action="store_true")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--verbose", action="store_true", help="Megatron's INFO logs too")
    o.add_argument("--gap-threshold", type=float, default=1e-2, help="alert above this mean |dlogp|")
    o.add_argument("--seed", type=int, default=1234)
    o.add_argument("--time-budget-s", type=float, default=0.0,
                   help="stop the RL loop (then evaluate, save, plot) once this much wall time has passed (0: off)")
    return p


def _fail(parser: argparse.ArgumentParser, msg: str):
    parser.error(msg)


def _this_scripts_flags(message: str) -> str:
    """A recipe error in this script's terms: ``--minite-strict`` is ``--strict`` here, every other
    field is a key of the ``--recipe`` file."""
    message = re.sub(r"recipe field (\w+) \(--minite-[\w-]+\)", r'recipe field "\1"', message)
    own = {"strict": "--strict", "backend": "--backend"}

    def flag(m):
        name = m.group(1).replace("-", "_")
        return own.get(name, f'"{name}"')

    return re.sub(r"--minite-([\w-]+)", flag, message)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and check the flags; a bad combination exits with one line naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.group < 2:
        _fail(parser, f"--group {args.group}: group-relative advantages (GRPO) need at least 2 samples per prompt "
                      "(a group of one has no baseline: its advantage is 0/0)")
    overrides = [f for f in ("num_layers", "hidden_size", "num_experts", "moe_ffn_hidden_size") if getattr(args, f)]
    if args.hf_checkpoint and overrides:
        _fail(parser, f"--{overrides[0].replace('_', '-')} applies to --preset models, not to --hf-checkpoint")
    if args.hf_checkpoint and args.preset:
        _fail(parser, "--preset and --hf-checkpoint both name the model: pass one")
    for name in ("steps", "rollout_batch_size", "ppo_epochs", "mini_batch_size", "micro_batch_size", "sft_batch_size"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            _fail(parser, f"--{name.replace('_', '-')} must be >= {0 if name == 'steps' else 1}")
    if not 0 <= args.sft_target_accuracy <= 1 or args.sft_eval_interval < 1:
        _fail(parser, "--sft-target-accuracy must lie in [0, 1] and --sft-eval-interval be >= 1")
    if args.sft_steps < 0 or args.save_interval < 0 or args.eval_interval < 0:
        _fail(parser, "--sft-steps, --save-interval and --eval-interval must be >= 0")
    if args.sft_lr_warmup_steps < 0 or args.lr_warmup_steps < 0:
        _fail(parser, "--sft-lr-warmup-steps and --lr-warmup-steps must be >= 0")
    if args.rollout_batch_size % args.mini_batch_size:
        _fail(parser, f"--rollout-batch-size {args.rollout_batch_size} is not a multiple of --mini-batch-size "
                      f"{args.mini_batch_size}")
    if not args.temperature > 0:
        _fail(parser, f"--temperature {args.temperature}: must be > 0 (the learner's log-probs divide by it)")
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if not (0 <= args.eps_clip < 1 and args.eps_clip_high >= 0):
        _fail(parser, "--eps-clip must lie in [0, 1) and --eps-clip-high be >= 0")
    if args.dual_clip is not None and not args.dual_clip > 1:
        _fail(parser, f"--dual-clip {args.dual_clip}: must be > 1")
    if args.tis_cap < 0:
        _fail(parser, f"--tis-cap {args.tis_cap}: must be >= 0 (0 turns TIS off)")
    if args.kl_coef < 0 or args.entropy_coef < 0:
        _fail(parser, "--kl-coef and --entropy-coef must be >= 0")
    if args.cuda_graph_impl == "full_iteration":
        if args.ep > 1:
            _fail(parser, f"--cuda-graph-impl full_iteration with --ep {args.ep}: the expert all-to-all takes its split "
                          "sizes on the host")
        if args.cuda_graph_warmup_steps < 1:
            _fail(parser, f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps}: must be >= 1")
        import torch

        if not torch.cuda.is_available():
            _fail(parser, "--cuda-graph-impl full_iteration needs a CUDA GPU (this machine has none)")
    if args.load and args.save and args.load == args.save:
        pass  # resume in place: allowed (Megatron does the same)
    return args


def build_recipe(args):
    """The :class:`~minite_megatron.recipe.Recipe` of ``--recipe`` / ``--strict`` / ``--backend`` /
    ``--no-quant``; raises :class:`UsageError` naming the file, the field and this script's flag
    (a missing, empty or corrupt file, a wrongly typed field, an invalid combination)."""
    from minite_megatron.recipe import Recipe, RecipeError, check_fields, read_recipe_file

    values = {}
    try:
        if args.recipe:
            values = read_recipe_file(args.recipe)
            check_fields(values)
    except RecipeError as e:
        raise UsageError(_this_scripts_flags(str(e).replace(f"--minite-recipe {args.recipe}", f"--recipe {args.recipe}")
                                             if str(e).startswith("--minite-recipe") else
                                             f"--recipe {args.recipe}: {_this_scripts_flags(str(e))}")) from None
    if args.strict:
        values["strict"] = True
    if args.backend:
        values["backend"] = args.backend
    try:
        recipe = Recipe.from_dict(values)
    except RecipeError as e:
        where = f"--recipe {args.recipe}" if args.recipe else "recipe"
        raise UsageError(f"{where}: {_this_scripts_flags(str(e))}") from None
    return bf16_recipe(recipe) if args.no_quant else recipe


def bf16_recipe(recipe):
    """The recipe with quantization off. With the recipe's ``precision`` field (the BF16 twin) that
    is ``precision="bf16"``; before that field exists, every ``quantize_*`` switch off (BF16 linears on
    the same specs) and the NVFP4-backward options off."""
    names = {f.name for f in dataclasses.fields(recipe)}
    if "precision" in names:
        return recipe.replace(precision="bf16")
    return recipe.replace(quantize_attention=False, quantize_dense_mlp=False, quantize_experts=False,
                          quantize_shared_experts=False, full_update=False, grad_stochastic_rounding=False,
                          wgrad_rht=False)
