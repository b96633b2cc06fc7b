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

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PRESETS = {
    # Qwen3-30B-A3B's layer shapes (hidden 2048, 32 heads / 4 KV groups of 128, 128 experts
    # top-8 with FFN 768, qk-layernorm, RMSNorm, SwiGLU, RoPE 1e6), fewer layers and a smaller
    # vocabulary so that one GPU holds it with room for both modes
    "qwen3-moe": dict(layers=4, hidden=2048, heads=32, groups=4, head_dim=128, experts=128, topk=8, moe_ffn=768,
                      vocab=32768, batch=8, prompt_min=16, prompt_max=96, new=64, learner_batch=8),
    "tiny": dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, experts=8, topk=2, moe_ffn=32,
                 vocab=256, batch=6, prompt_min=3, prompt_max=12, new=10, learner_batch=6),
}


def init(device: str) -> None:
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


def build(p: dict, strict: bool, device: str, dtype: torch.dtype, backend: str | None):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from minite_megatron.model import finalize_gpt_model
    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    recipe = Recipe(strict=strict, backend=backend)
    config = TransformerConfig(
        num_layers=p["layers"], hidden_size=p["hidden"], num_attention_heads=p["heads"], num_query_groups=p["groups"],
        kv_channels=p["head_dim"], ffn_hidden_size=4 * p["hidden"], moe_ffn_hidden_size=p["moe_ffn"],
        num_moe_experts=p["experts"], moe_router_topk=p["topk"], normalization="RMSNorm", qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-3, bias_activation_fusion=False,
        use_cpu_initialization=device == "cpu", params_dtype=dtype, bf16=dtype == torch.bfloat16, init_method_std=0.02,
    )
    torch.manual_seed(0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_minite_spec(config, recipe),
                     vocab_size=p["vocab"], max_sequence_length=p["prompt_max"] + p["new"],
                     position_embedding_type="rope", rotary_base=1_000_000)
    finalize_gpt_model(model, recipe)
    return model.to(device=device).eval(), recipe


def prompts(p: dict) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    lengths = torch.linspace(p["prompt_min"], p["prompt_max"], p["batch"]).round().int().tolist()
    return [torch.randint(1, p["vocab"] - 1, (n,), generator=g).tolist() for n in lengths]


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


def run_mode(p, strict, device, dtype, backend, repeats, state=None):
    from minite_megatron.diagnostics import gap_metrics
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    model, recipe = build(p, strict, device, dtype, backend)
    if state is not None:
        model.load_state_dict(state, strict=False)
    engine = RolloutEngine(model, eod_id=0, max_batch_size=p["batch"], max_sequence_length=p["prompt_max"] + p["new"])
    t = time.perf_counter()
    with torch.no_grad():
        rollouts = engine.generate(prompts(p), p["new"], temperature=1.0, seed=3, stop_at_eod=False)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-moe" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16" if torch.cuda.is_available() else "fp32")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    p = PRESETS[args.preset]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    init(args.device)
    from minite_megatron import nvfp4

    default, state = run_mode(p, False, args.device, dtype, args.backend, args.repeats)
    strict, _ = run_mode(p, True, args.device, dtype, args.backend, args.repeats, state=state)
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
        "preset": args.preset, "config": p, "dtype": args.dtype, "results": rows, "strict_overhead": overhead,
        "command": "python -m benchmarks.alignment " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "a") as fh:
            fh.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
