"""What the rollout benchmarks share: prompts, timing of the engine, kernels per decode step, the
learner/sampler gap and the baseline models (:mod:`benchmarks.rollout` and
:mod:`benchmarks.rollout_full` import them; neither imports the other's measurements)."""

from __future__ import annotations

import statistics
import time

import torch


def prompts_for(batch: int, lo: int, hi: int, vocab: int, seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(lo, hi, batch).round().int().tolist() if batch > 1 else [hi]
    return [torch.randint(1, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn, warmup: int = 2, reps: int = 5) -> float:
    """Median of ``reps`` timed calls of ``fn`` (CUDA events) after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return statistics.median(ts)


# ---- models ---------------------------------------------------------------------------------------
def local_bf16_gpt(preset: dict, max_seq: int, device, dtype, seed: int = 0):
    """Megatron's local spec (SequentialMLP experts, Megatron's norms and attention) in ``dtype``."""
    from minite_megatron.training.presets import build_local_gpt

    return build_local_gpt(preset, max_seq=max_seq, device=device, dtype=dtype, seed=seed).eval()


def minite_gpt(preset: dict, strict: bool, max_seq: int, device, dtype, seed: int = 0):
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import build_gpt

    return build_gpt(preset, Recipe(strict=strict), max_seq=max_seq, device=device, dtype=dtype, seed=seed).eval()


# ---- bytes a decode step reads ----------------------------------------------------------------------
def decode_bytes(preset: dict, batch: int, packed: bool, cache_len: int) -> dict:
    """Weight bytes of one decode step (routed experts: the expected distinct experts) and KV bytes."""
    p = preset
    h, hd, heads, groups = p["hidden"], p["head_dim"], p["heads"], p["groups"]
    per_w = 0.5 + 1 / 16 if packed else 2.0
    attn = h * (heads + 2 * groups) * hd + heads * hd * h
    expert = 3 * h * p["moe_ffn"]
    e, k = p["experts"], p["topk"]
    distinct = e * (1 - (1 - k / e) ** batch)
    layer = attn * per_w + distinct * expert * per_w + e * h * 2  # + the bf16 router
    weights = p["layers"] * layer + p["vocab"] * h * 2  # + the bf16 LM head weight
    kv = p["layers"] * 2 * cache_len * batch * groups * hd * 2
    return {"weight_bytes": weights, "kv_bytes": kv, "experts_read_per_layer": distinct}


# ---- measurements -----------------------------------------------------------------------------------
def gap_of(model, engine, prompts, new: int, seed: int = 3) -> dict:
    from minite_megatron.diagnostics import gap_metrics
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    rollouts = engine.generate(prompts, new, temperature=1.0, seed=seed, stop_at_eod=False)
    with torch.no_grad():
        learner = teacher_forced_logprobs(model, [r.tokens for r in rollouts])
    pad = torch.nn.utils.rnn.pad_sequence
    lrn = pad([lp[len(r.prompt_tokens) - 1 :].float().cpu() for lp, r in zip(learner, rollouts)], batch_first=True)
    rol = pad([r.generated_log_probs.float().cpu() for r in rollouts], batch_first=True)
    mask = pad([torch.ones(len(r.generated_tokens), dtype=torch.bool) for r in rollouts], batch_first=True)
    m = gap_metrics(lrn, rol, mask)
    return {"gap_mean_abs": m["rollout_corr/logprob_abs_diff_mean"], "gap_max_abs": m["rollout_corr/logprob_abs_diff_max"],
            "k3_kl": m["rollout_corr/k3_kl"], "gap_tokens": int(mask.sum()),
            "gap_tokens_equal": int(((lrn == rol) & mask).sum())}


def time_engine(engine, prompts, new: int, repeats: int) -> dict:
    """Median decode-step ms and prefill ms of ``generate`` (GPU: the engine's CUDA events)."""
    engine.generate(prompts, new, temperature=1.0, seed=1, stop_at_eod=False)  # warm-up: compile, capture
    if repeats < 1:  # a warm-up run (fills Triton's cache): nothing timed
        return {"decode_step_ms": float("nan"), "prefill_ms": None, "generate_ms": None}
    steps, prefill, walls = [], [], []
    for r in range(repeats):
        sync()
        t = time.perf_counter()
        engine.generate(prompts, new, temperature=1.0, seed=2 + r, stop_at_eod=False)
        sync()
        walls.append(time.perf_counter() - t)
        tm = getattr(engine._fast, "last_timing", None) if engine._fast is not None else None
        if tm:
            steps.append(tm["decode_ms"] / max(tm["decode_steps"], 1))
            prefill.append(tm["prefill_ms"])
    wall = statistics.median(walls)
    if not steps:  # CPU or Megatron's path: wall clock over the steps (prefill included)
        return {"decode_step_ms": wall * 1e3 / new, "prefill_ms": None, "generate_ms": wall * 1e3}
    return {"decode_step_ms": statistics.median(steps), "prefill_ms": statistics.median(prefill),
            "generate_ms": wall * 1e3}


def cuda_kernels(fn) -> int:
    """CUDA kernels ``fn()`` runs on the GPU (torch.profiler / CUPTI: every kernel record,
    those inside CUDA-graph replays included; memcpy / memset excluded)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    n = 0
    for e in prof.profiler.kineto_results.events():
        if e.device_type() == torch.autograd.DeviceType.CUDA and not e.name().startswith(("Memcpy", "Memset")):
            n += 1
    return n


def kernels_per_step(engine, prompts, a: int = 2, b: int = 6) -> float:
    """Kernels one decode step launches on the GPU: ``generate(b)`` minus ``generate(a)`` tokens
    (the same prefill and sampling calls), per extra step. With CUDA graphs these are the replays'
    kernels; eager steps also launch the host-side checks a capture skips."""
    def run(n):
        return cuda_kernels(lambda: engine.generate(prompts, n, temperature=1.0, seed=7, stop_at_eod=False))

    return (run(b) - run(a)) / (b - a)
