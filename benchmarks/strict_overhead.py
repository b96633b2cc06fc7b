"""Measure what strict mode costs the learner (and the rollout engine), and the default mode's gap.

``python -m benchmarks.strict_overhead [--device cpu|cuda] [--dtype bf16|fp32] [--json PATH]``

Builds one small Megatron MoE GPT twice with the same weights -- Megatron's local spec
(default mode) and the strict spec with the FP32 strict LM head -- and times, on the device:

- learner step: teacher-forced forward + backward of ``batch x seq`` tokens (train mode);
- learner forward: teacher-forced log-probs without autograd;
- rollout: :class:`~minite_megatron.rollout.engine.RolloutEngine` generation of the same batch;
then reports the learner-vs-rollout log-prob gap of each mode (max and mean ``|dlogp|`` on the
same tokens). On CPU the strict ops use the fixed-order torch formulation, on CUDA the ``bi_*``
Triton kernels. Runs single-process (world size 1); on a CPU-only machine the CPU
compatibility layer is activated.
"""

from __future__ import annotations

from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import json
import os
import platform
import socket
import time

import torch


def _init(device: str) -> None:
    from minite_megatron import cpu_compat

    cpu_compat.activate()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)


def build(strict: bool, dtype: torch.dtype, device: str, *, layers: int, hidden: int, experts: int, vocab: int,
          seq: int, seed: int = 0):
    """A small Qwen3-MoE-shaped GPT: Megatron's local spec, or the strict spec + strict LM head."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec
    from minite_megatron.strict_config import strict_config_overrides

    heads = max(2, hidden // 32)
    kw = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=max(1, heads // 2),
        kv_channels=hidden // heads, ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=hidden // 2,
        num_moe_experts=experts, moe_router_topk=2, normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        moe_token_dispatcher_type="alltoall", bias_activation_fusion=False, hidden_dropout=0.0,
        attention_dropout=0.0, moe_router_dtype="fp32", moe_aux_loss_coeff=0.0, init_method_std=0.05,
    )
    if strict:
        kw.update(strict_config_overrides())
    config = TransformerConfig(**kw)
    strict_recipe = Recipe(precision="bf16", strict=True)
    spec = (get_gpt_decoder_block_minite_spec(config, strict_recipe, moe_grouped_gemm=False) if strict else
            get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=True, normalization="RMSNorm"))
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="rope")
    if strict:
        from minite_megatron.model import finalize_gpt_model

        finalize_gpt_model(model, Recipe(strict=True))
    return model.to(dtype).to(device)


def _time(fn, device: str, repeats: int) -> float:
    """Best of ``repeats``: GPU wall time, or on a CPU the process's CPU time (all threads), which
    a machine shared with other jobs perturbs far less than wall time."""
    fn()  # warm-up
    clock = time.perf_counter if device == "cuda" else time.process_time
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(clock() - t0)
    return min(times)


def measure(device: str = "cpu", dtype: torch.dtype = torch.float32, *, layers: int = 2, hidden: int = 128,
            experts: int = 8, vocab: int = 512, batch: int = 4, prompt: int = 16, new: int = 16,
            repeats: int = 3) -> dict:
    """Time both modes on the same weights and tokens; returns a dict of seconds and gaps."""
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    _init(device)
    seq = prompt + new + 1
    strict = build(True, dtype, device, layers=layers, hidden=hidden, experts=experts, vocab=vocab, seq=seq)
    default = build(False, dtype, device, layers=layers, hidden=hidden, experts=experts, vocab=vocab, seq=seq)
    with torch.no_grad():
        default_params = dict(default.named_parameters())
        for name, p in strict.named_parameters():
            default_params[name].copy_(p)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (prompt - (i % 3),), generator=g).tolist() for i in range(batch)]
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
              "dtype": str(dtype), "torch": torch.__version__, "layers": layers, "hidden": hidden,
              "experts": experts, "vocab": vocab, "batch": batch, "prompt": prompt, "new": new}
    for name, model in (("default", default), ("strict", strict)):
        engine = RolloutEngine(model, eod_id=0, max_batch_size=batch, max_sequence_length=seq)
        rollouts = engine.generate(prompts, new, seed=5, stop_at_eod=False)
        seqs = [r.tokens for r in rollouts]
        model.eval()
        with torch.no_grad():
            learner = teacher_forced_logprobs(model, seqs)
        gaps = torch.cat([(r.log_probs - lp).abs() for r, lp in zip(rollouts, learner)])
        result[f"{name}_gap_max"] = float(gaps.max())
        result[f"{name}_gap_mean"] = float(gaps.mean())

        def step(model=model, seqs=seqs):
            model.train()
            loss = -torch.cat(teacher_forced_logprobs(model, seqs)).sum()
            loss.backward()
            model.zero_grad(set_to_none=True)

        def forward(model=model, seqs=seqs):
            model.eval()
            with torch.no_grad():
                teacher_forced_logprobs(model, seqs)

        result[f"{name}_learner_step_s"] = _time(step, device, repeats)
        result[f"{name}_learner_forward_s"] = _time(forward, device, repeats)
        result[f"{name}_rollout_s"] = _time(lambda e=engine: e.generate(prompts, new, seed=5, stop_at_eod=False),
                                            device, max(1, repeats - 1))
    for key in ("learner_step_s", "learner_forward_s", "rollout_s"):
        result[f"overhead_{key[:-2]}"] = result[f"strict_{key}"] / result[f"default_{key}"]
    return result


def main(argv=None) -> None:
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="fp32")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--json", help="append the result as one JSON line to this file")
    args = ap.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(args.device, dtype, layers=args.layers, hidden=args.hidden, experts=args.experts,
                  vocab=args.vocab, batch=args.batch, prompt=args.prompt, new=args.new, repeats=args.repeats)
    print(f"device {res['device']}, {res['dtype']}, {args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts, vocab {args.vocab}, batch {args.batch} x ({args.prompt} + {args.new}) tokens")
    print(f"{'':24}{'default':>12}{'strict':>12}{'strict/default':>16}   ({'GPU wall' if args.device == 'cuda' else 'CPU process'} seconds, best of {args.repeats})")
    for key, label in (("learner_step", "learner fwd+bwd [s]"), ("learner_forward", "learner forward [s]"),
                       ("rollout", "rollout [s]")):
        print(f"{label:24}{res[f'default_{key}_s']:12.4f}{res[f'strict_{key}_s']:12.4f}{res[f'overhead_{key}']:16.2f}")
    print(f"{'gap max |dlogp|':24}{res['default_gap_max']:12.3e}{res['strict_gap_max']:12.3e}")
    print(f"{'gap mean |dlogp|':24}{res['default_gap_mean']:12.3e}{res['strict_gap_mean']:12.3e}")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
