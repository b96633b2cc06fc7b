"""Rollout engine speed and learner/sampler gap: the BF16 engine, the NVFP4 engine and strict mode.

    python -m benchmarks.rollout                                  # GPU: the qwen3-moe preset
    python -m benchmarks.rollout --preset tiny --batches 1,4      # CPU-sized (eager steps)
    python -m benchmarks.rollout --json benchmarks/results/rollout.jsonl --out $OUT

One process, the same prompts (mixed lengths ``--prompt-min`` .. ``--prompt-max``) for every
engine, all through :class:`~minite_megatron.rollout.engine.RolloutEngine`'s fast path (prefill on
the learner's forward, the decode step in CUDA graphs per batch bucket):

* ``bf16``: Megatron's *local* spec in BF16 with the best BF16 kernels torch has in the same
  harness -- ``torch._grouped_mm`` experts, SDPA decode attention, the same CUDA graphs;
* ``nvfp4``: miniTE's spec, default mode (``Recipe()``);
* ``strict``: miniTE's spec, ``Recipe(strict=True)``.

Per engine and batch size: ms per decode step (CUDA events around the graph replays of one
``generate``, median of ``--repeats`` after a warm-up that captures the graphs), tokens/s,
prefill ms, the weight bytes a decode step must read (packed FP4 codes + E4M3 scales for NVFP4,
2 bytes per weight in BF16; routed experts: the expected number of distinct experts ``B`` tokens
select, ``E (1 - (1 - k/E)^B)``, which uniform routing gives), the effective weight bandwidth
(those bytes / step time) and the byte floor (those bytes plus the KV cache read, at the measured
copy bandwidth), ``speedup_vs_bf16``, and the learner/sampler gap on the generated tokens
(temperature 1, :func:`~minite_megatron.diagnostics.gap_metrics`). Then, at ``--gap-batch``, the
default-mode variants (gap and decode ms): the decode step on the learner's modules without the
fused decode kernels (``RolloutEngine(fused_kernels=False)``), torch SDPA attention in the learner and the
decode step (``recipe.aligned_attention`` off), round 1's default (SDPA and no aligned norms /
routing either), the split-K decode GEMMs instead of the learner's order, Megatron's atomic
combine in the learner (``--variant-set fused``: the default and the first of these only);
Megatron's own static engine (``--megatron``, slow); on the GPU, the kernels one decode step
launches at ``--gap-batch`` (``kernels_per_step``: torch.profiler's CUDA kernel records of
``generate`` at 6 minus 2 new tokens, per extra step: the graph replays;
``kernels_per_step_eager``: the same model's eager steps, host-side checks included), for every
engine and variant; whether the decode GEMMs' invariant configuration equals the learner's
full-batch GEMM bits; what the deterministic combine costs the learner (one MoE layer's forward
+ backward at ``--learner-tokens``) and what the aligned ops and attention cost it (the whole
model's forward + backward at ``--learner-tokens``, aligned vs round 1's default). Order: every engine at ``--gap-batch``, the
variants, the kernel counts, the other batch sizes (``timed_after_profiler``), the learner's
costs; sections past ``--time-budget`` are skipped (listed under ``skipped``). Prints tables,
appends one JSON line.
"""

from __future__ import annotations

import argparse
from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import (  # noqa: E402
    copy_bandwidth_gbps, ensure_minite_kernels, environment, print_table, save,
)

from benchmarks._engine_timing import (  # noqa: E402
    decode_bytes, gap_of, kernels_per_step, local_bf16_gpt, median_ms, minite_gpt, prompts_for, time_engine,
)

ensure_minite_kernels()


def kernel_counts(jobs: list[dict]) -> None:
    """Fill ``kernels_per_step`` (the engine's CUDA-graph replays) and, where a job names its
    ``model``, ``kernels_per_step_eager`` (the same model's eager steps) into each job's ``row``.
    Run after every timing: CUPTI stays initialized once the profiler ran (torch keeps it around
    CUDA graphs: ``TEARDOWN_CUPTI=0``, its workaround for re-init crashes)."""
    from minite_megatron.rollout.engine import RolloutEngine

    os.environ["TEARDOWN_CUPTI"] = "0"
    for job in jobs:
        row, prompts = job["row"], job["prompts"]
        try:
            row["kernels_per_step"] = kernels_per_step(job["engine"], prompts)
            if job.get("model") is not None:
                eager = RolloutEngine(job["model"], eod_id=0, max_batch_size=len(prompts),
                                      max_sequence_length=job["max_seq"], attention=job["attention"], cuda_graphs=False)
                eager.generate(prompts, 2, temperature=1.0, seed=7, stop_at_eod=False)  # weights, warm-up
                row["kernels_per_step_eager"] = kernels_per_step(eager, prompts)
                del eager
        except Exception as e:  # the profiler is a measurement aid: keep the timings
            row["kernel_count_error"] = f"{type(e).__name__}: {e}"
        print(f"  kernels per decode step, {row.get('engine', row.get('variant'))}: {row.get('kernels_per_step')} "
              f"(eager {row.get('kernels_per_step_eager')})", flush=True)


def run_engine(name, model, preset, args, batches, copy_gbps, attention) -> list[dict]:
    from minite_megatron.rollout.engine import RolloutEngine

    max_seq = args.prompt_max + args.new
    engine = RolloutEngine(model, eod_id=0, max_batch_size=max(batches), max_sequence_length=max_seq,
                           attention=attention)
    rows = []
    for b in batches:
        prompts = prompts_for(b, args.prompt_min, args.prompt_max, preset["vocab"])
        row = {"engine": name, "batch": b, "path": engine.path,
               "graphs": bool(engine._fast is not None and engine._fast.use_graphs)}
        row.update(time_engine(engine, prompts, args.new, args.repeats))
        row["tokens_per_s"] = b * 1e3 / row["decode_step_ms"]
        nbytes = decode_bytes(preset, b, packed=name != "bf16", cache_len=max_seq)
        row.update(nbytes)
        row["effective_weight_gbps"] = nbytes["weight_bytes"] / row["decode_step_ms"] / 1e6
        if copy_gbps:
            row["byte_floor_ms"] = (nbytes["weight_bytes"] + nbytes["kv_bytes"]) / copy_gbps / 1e6
        if b == args.gap_batch or args.gap_all:
            row.update(gap_of(model, engine, prompts, args.new))
        if b == args.gap_batch and args.kernel_count and engine.path == "fast" and torch.cuda.is_available():
            args._count_jobs.append(dict(row=row, engine=engine, prompts=prompts, model=model, max_seq=max_seq,
                                         attention=attention))
        rows.append(row)
        print(f"  {name} batch {b}: {row['decode_step_ms']:.3f} ms/step", flush=True)
    return rows


def default_mode_variants(model, preset, args) -> list[dict]:
    """The default-mode gap (and decode ms) under the alternatives round 1 and 2 chose between."""
    from minite_megatron.rollout.engine import RolloutEngine

    max_seq = args.prompt_max + args.new
    prompts = prompts_for(args.gap_batch, args.prompt_min, args.prompt_max, preset["vocab"])
    out = []

    def variant(label, **kw):
        if time.perf_counter() - args._t0 > args.time_budget:
            out.append({"variant": label, "skipped": "time budget"})
            return
        engine = RolloutEngine(model, eod_id=0, max_batch_size=args.gap_batch, max_sequence_length=max_seq, **kw)
        row = {"variant": label, **gap_of(model, engine, prompts, args.new)}
        if engine.path == "fast":
            row.update(time_engine(engine, prompts, args.new, args.variant_repeats))
            if args.kernel_count and torch.cuda.is_available():  # the graph replays (captured with this variant)
                args._count_jobs.append(dict(row=row, engine=engine, prompts=prompts))
        out.append(row)
        print(f"  variant {label}: gap {row['gap_mean_abs']:.3g}, {row.get('decode_step_ms', 0):.3f} ms/step", flush=True)

    variant("default (aligned ops + attention, fused decode kernels)")
    variant("batch-invariant decode GEMMs (invariant_gemm=True: strict's kernels; the default until run 11)",
            invariant_gemm=True)
    variant("decode step on the learner's modules (no fused decode kernels)", fused_kernels=False)
    if args.variant_set == "fused":
        return out
    with sdpa_attention(model):
        variant("SDPA attention in learner and decode (aligned_attention off)")
        with unaligned_ops(model):
            variant("round 1's default (SDPA, torch RMSNorm, Megatron's router)")
    with megatron_combine(model):
        variant("Megatron's atomic combine in the learner")
    if args.megatron:
        variant("Megatron's static engine", fast=False)
    return out


class sdpa_attention:
    """Every aligned core attention of ``model`` computes torch SDPA instead (``aligned_attention`` off)."""

    def __init__(self, model):
        from minite_megatron.modules.core_attention import AlignedDotProductAttention

        self.mods = [layer.self_attention.core_attention for layer in model.decoder.layers
                     if type(layer.self_attention.core_attention) is AlignedDotProductAttention]

    def __enter__(self):
        from minite_megatron.modules.attention import MiniteDotProductAttention

        for m in self.mods:
            m.__class__ = MiniteDotProductAttention

    def __exit__(self, *exc):
        from minite_megatron.modules.core_attention import AlignedDotProductAttention

        for m in self.mods:
            m.__class__ = AlignedDotProductAttention


class unaligned_ops:
    """Default mode's norms and routers as before ``aligned_ops``: torch's RMSNorm (the fused
    norm -> NVFP4 producers keep their batch-invariant arithmetic), Megatron's TopKRouter."""

    def __init__(self, model):
        from minite_megatron.modules.norm import MiniteNorm
        from minite_megatron.modules.router import AlignedTopKRouter

        self.norms = [m for m in model.modules() if isinstance(m, MiniteNorm) and not m.batch_invariant]
        self.routers = [m for m in model.modules() if type(m) is AlignedTopKRouter and m.aligned]

    def __enter__(self):
        for m in self.norms:
            m.invariant_rms = False
        for r in self.routers:
            r.aligned = False

    def __exit__(self, *exc):
        for m in self.norms:
            m.invariant_rms = True
        for r in self.routers:
            r.aligned = True


class megatron_combine:
    """Swap every deterministic MoE layer's dispatcher for Megatron's own (atomic combine)."""

    def __init__(self, model):
        self.swaps = [(layer.mlp, layer.mlp.token_dispatcher, layer.mlp.megatron_token_dispatcher)
                      for layer in model.decoder.layers if getattr(layer.mlp, "deterministic_combine", False)]

    def __enter__(self):
        for moe, _, theirs in self.swaps:
            moe.token_dispatcher = theirs

    def __exit__(self, *exc):
        for moe, mine, _ in self.swaps:
            moe.token_dispatcher = mine


def combine_cost(model, tokens: int) -> dict:
    """One MoE layer's forward + backward with the deterministic vs Megatron's combine (ms)."""
    moe = model.decoder.layers[0].mlp
    x = torch.randn(tokens, 1, model.config.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    model.train()

    def once():
        out, _ = moe(x)
        out.backward(g)

    det = median_ms(once)
    with megatron_combine(model):
        meg = median_ms(once)
    model.eval()
    model.zero_grad(set_to_none=True)
    return {"tokens": tokens, "deterministic_ms": det, "megatron_ms": meg, "overhead": det / meg - 1}


def alignment_cost(model, tokens: int) -> dict:
    """The learner's forward + backward of the whole model over one sequence of ``tokens``, with
    the aligned ops and attention (today's default mode) vs round 1's default (ms, median of 5)."""
    from minite_megatron.rollout.logprobs import causal_mask

    ids = torch.randint(1, model.vocab_size, (1, tokens), device="cuda")
    pos = torch.arange(tokens, device="cuda").unsqueeze(0)
    mask = causal_mask(tokens, device="cuda")
    model.train()

    def once():
        logits = model(ids, pos, mask)
        logits.float().mean().backward()

    try:
        aligned = median_ms(once)
        with sdpa_attention(model):
            sdpa = median_ms(once)
            with unaligned_ops(model):
                round1 = median_ms(once)
    finally:
        model.eval()
        model.zero_grad(set_to_none=True)
    return {"tokens": tokens, "aligned_ms": aligned, "sdpa_attention_ms": sdpa, "round1_default_ms": round1,
            "overhead_vs_round1": aligned / round1 - 1}


def gemm_order_checks(model) -> dict:
    """Which decode GEMMs give the learner's bits, on the model's own weights (first layer).

    ``learner_default`` / ``learner_strict``: the learner's GEMM over 4096 rows (grouped: 64 rows
    per expert) without / with ``batch_invariant``; the decode kernels on 8 of those rows: the
    split-K default, strict mode on the image GEMM (a backend with ``TritonOptions(strict_decode=False)``)
    and the decode kernels' strict configuration (the default backend's: ``strict_decode=True``)."""
    from minite_kernels.triton.backend import TritonBackend, TritonOptions

    layer = model.decoder.layers[0]
    with torch.no_grad():
        return _gemm_order_checks(layer, TritonBackend(TritonOptions(strict_decode=False)),
                                  TritonBackend(TritonOptions()), {})


def _gemm_order_checks(layer, image_strict, decode_strict, out):
    from minite_megatron.rollout.decode_step import _gather_rows

    for name in ("linear_qkv", "linear_proj"):
        lin = getattr(layer.self_attention, name)
        backend = image_strict
        qw = lin.quantized_weight()
        x = torch.randn(4096, qw.k, device="cuda", dtype=torch.bfloat16)
        qx = backend.quantize(x, global_scale="row", with_image=True)
        small = backend.quantize(x[:8], global_scale="row", with_image=True)
        ld = backend.gemm(qx, qw, None, torch.bfloat16, False)[:8]
        ls = backend.gemm(qx, qw, None, torch.bfloat16, True)[:8]
        inv = backend.gemm(small, qw, None, torch.bfloat16, True)
        fast = backend.gemm(small, qw, None, torch.bfloat16, False)
        strict_kernel = decode_strict.gemm(small, qw, None, torch.bfloat16, True)
        out[name] = {"learner_default_equals_strict": bool(torch.equal(ld, ls)),
                     "image_invariant_equals_learner": bool(torch.equal(inv, ls)),
                     "decode_splitk_equals_learner": bool(torch.equal(fast, ld)),
                     "decode_strict_kernel_equals_learner": bool(torch.equal(strict_kernel, ls))}
    experts = getattr(layer.mlp, "experts", None)
    if experts is not None and hasattr(experts, "linear_fc1"):
        fc1 = experts.linear_fc1
        backend = image_strict
        qw = fc1.quantized_weight()
        e = qw.shape[0]
        x = torch.randn(64 * e, qw.k, device="cuda", dtype=torch.bfloat16)
        qx = backend.quantize(x, global_scale="row", with_image=True)
        ld = backend.grouped_gemm(qx, qw, [64] * e, None, torch.bfloat16, False)
        ls = backend.grouped_gemm(qx, qw, [64] * e, None, torch.bfloat16, True)
        rows = torch.arange(0, 64 * e, 64 * e // 16, device="cuda")
        ids = (rows // 64).to(torch.int32)
        qr = _gather_rows(qx, rows)
        res = {"learner_default_equals_strict": bool(torch.equal(ld, ls))}
        for label, inv, b in (("decode_fast", False, image_strict), ("decode_invariant_fallback", True, image_strict),
                              ("decode_strict_kernel", True, decode_strict)):
            got = b.decode_grouped_gemm(qr, qw, ids, out_dtype=torch.bfloat16, batch_invariant=inv)
            res[f"{label}_equals_learner"] = bool(torch.equal(got, (ls if inv else ld)[rows]))
        out["experts_fc1"] = res
    return out


class Cut(BaseException):
    """SIGTERM (a caller's timeout): unwinds past the sections' ``except Exception`` to the report."""


FULL_SIZE_PRESETS = ("qwen3-30b-a3b",)
"""Presets too large for a BF16 learner model on one GPU: measured by :mod:`benchmarks.rollout_full`
(resident NVFP4 models built layer by layer)."""


def main(argv=None):
    """The benchmark (:func:`_main`); ``--preset qwen3-30b-a3b`` runs :mod:`benchmarks.rollout_full`
    (its own flags)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, a in enumerate(args):
        name = a.split("=", 1)[1] if a.startswith("--preset=") else (args[i + 1] if a == "--preset" and i + 1 < len(args) else None)
        if name in FULL_SIZE_PRESETS:
            from benchmarks.rollout_full import main as full_main

            return full_main(args)
    return _main(argv)


def _main(argv=None):
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    gpu = torch.cuda.is_available()
    ap.add_argument("--preset", default="qwen3-moe" if gpu else "tiny")
    ap.add_argument("--engines", default="bf16,nvfp4,strict",
                    help="bf16, nvfp4, strict; or vllm alone: vllm.LLM with minite-vllm vs this engine, default and "
                         "strict (benchmarks/_vllm_engine.py, in .venv-vllm)")
    ap.add_argument("--batches", default="1,8,64" if gpu else "1,4")
    ap.add_argument("--new", type=int, default=64 if gpu else 8)
    ap.add_argument("--prompt-min", type=int, default=16 if gpu else 3)
    ap.add_argument("--prompt-max", type=int, default=96 if gpu else 12)
    ap.add_argument("--repeats", type=int, default=3 if gpu else 1)
    ap.add_argument("--gap-batch", type=int, default=8 if gpu else 4)
    ap.add_argument("--gap-all", action="store_true", help="the gap at every batch size")
    ap.add_argument("--variants", action=argparse.BooleanOptionalAction, default=True,
                    help="default-mode gap variants, GEMM order checks and the learner's combine cost")
    ap.add_argument("--variant-set", choices=("all", "fused"), default="all",
                    help="fused: only the default decode step with and without the fused decode kernels")
    ap.add_argument("--variant-repeats", type=int, default=1, help="timed generate calls per variant (median)")
    ap.add_argument("--gemm-order", action=argparse.BooleanOptionalAction, default=True,
                    help="with --variants: the GEMM-order checks (first layer's weights)")
    ap.add_argument("--learner-costs", action=argparse.BooleanOptionalAction, default=True,
                    help="with --variants: the deterministic combine's and the aligned ops' cost in the learner")
    ap.add_argument("--kernel-count", action=argparse.BooleanOptionalAction, default=True,
                    help="GPU: kernels per decode step at --gap-batch (torch.profiler), graphs and eager")
    ap.add_argument("--megatron", action=argparse.BooleanOptionalAction, default=False,
                    help="Megatron's static engine as a variant (slow)")
    ap.add_argument("--learner-tokens", type=int, default=4096)
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later sections are skipped past it")
    ap.add_argument("--idot-dense-max-m", type=int, default=0,
                    help="default-mode dense decode GEMMs with at most this many rows on the integer-dot kernel "
                         "(TritonOptions.idot_dense_max_m) for this run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.engines == "vllm":
        from ._vllm_engine import main as vllm_engine_main

        return vllm_engine_main(["--new", str(args.new)] + (["--json", args.json] if args.json else []))
    if args.idot_dense_max_m:
        from minite_kernels.triton.backend import TritonBackend, TritonOptions
        from minite_megatron.nvfp4 import register_backend

        register_backend(TritonBackend(TritonOptions(idot_dense_max_m=args.idot_dense_max_m)))
    args._t0 = time.perf_counter()
    args._count_jobs = []

    from minite_megatron.training.presets import PRESETS, init_single_process

    device = init_single_process(0)
    preset = PRESETS[args.preset]
    dtype = torch.bfloat16 if gpu else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    if args.gap_batch not in batches:
        batches = sorted(set(batches) | {args.gap_batch})
    max_seq = args.prompt_max + args.new
    copy_gbps = copy_bandwidth_gbps(device) if gpu else None
    results = {"benchmark": "rollout", "command": "python -m benchmarks.rollout " + " ".join(argv or sys.argv[1:]),
               "preset": args.preset, "new_tokens": args.new, "prompt_lengths": [args.prompt_min, args.prompt_max],
               "copy_gbps": copy_gbps, "rows": [], **environment()}
    t0 = time.perf_counter()

    def left() -> bool:
        return time.perf_counter() - t0 < args.time_budget

    def guarded(label, fn):
        if not left():
            results.setdefault("skipped", []).append(f"{label} (time budget)")
            return None
        try:
            return fn()
        except Exception as e:  # keep the other sections' numbers
            import traceback

            traceback.print_exc()
            results.setdefault("errors", []).append(f"{label}: {type(e).__name__}: {e}")
            return None

    models = {}

    def sections():
        if "nvfp4" in args.engines or args.variants:
            models["nvfp4"] = minite_gpt(preset, False, max_seq, device, dtype)
        if gpu and args.variants and args.gemm_order:
            # first: do the decode kernels' strict configurations give the learner's bits here?
            checks = guarded("gemm_order", lambda: gemm_order_checks(models["nvfp4"]))
            if checks:
                results["gemm_order"] = checks
                print("gemm_order:", checks, flush=True)
        names = [n for n in args.engines.split(",") if n]

        def model_for(name):
            if name not in models:
                models[name] = (local_bf16_gpt(preset, max_seq, device, dtype) if name == "bf16"
                                else minite_gpt(preset, name == "strict", max_seq, device, dtype))
            return models[name]

        def engine_pass(sizes, label):
            for name in names:
                print(f"# {name} batch {','.join(map(str, sizes))}", flush=True)
                attention = "sdpa" if name == "bf16" else "module"
                results["rows"] += guarded(f"{name} {label}", lambda name=name: run_engine(
                    name, model_for(name), preset, args, sizes, copy_gbps, attention)) or []

        # the numbers that matter first (every engine at --gap-batch, then the default-mode variants),
        # the other batch sizes and the learner's costs with the time left
        engine_pass([args.gap_batch], "gap batch")
        if args.variants:
            results["default_mode_variants"] = guarded(
                "variants", lambda: default_mode_variants(models["nvfp4"], preset, args))
        profiled = bool(args._count_jobs)
        if profiled:  # after the gap-batch timings: the profiler leaves CUPTI initialized (kernel_counts)
            guarded("kernel counts", lambda: kernel_counts(args._count_jobs))
        args._count_jobs.clear()
        rest = [b for b in batches if b != args.gap_batch]
        if rest:
            n = len(results["rows"])
            engine_pass(rest, "other batches")
            for r in results["rows"][n:]:
                r["timed_after_profiler"] = profiled
        results["rows"].sort(key=lambda r: (names.index(r["engine"]), r["batch"]))
        if args.variants and gpu and args.learner_costs:
            results["combine_cost"] = guarded("combine_cost", lambda: combine_cost(models["nvfp4"], args.learner_tokens))
            results["alignment_cost"] = guarded("alignment_cost",
                                                lambda: alignment_cost(models["nvfp4"], args.learner_tokens))

    import signal

    def cut(signum, frame):  # the caller's timeout: keep what was measured
        raise Cut()

    signal.signal(signal.SIGTERM, cut)
    try:
        sections()
    except Cut:
        results.setdefault("errors", []).append(f"cut by SIGTERM after {time.perf_counter() - t0:.0f} s")
        print("rollout: SIGTERM, reporting what was measured", flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    models.clear()
    bf16 = {r["batch"]: r["decode_step_ms"] for r in results["rows"] if r["engine"] == "bf16"}
    default = {r["batch"]: r["decode_step_ms"] for r in results["rows"] if r["engine"] == "nvfp4"}
    for r in results["rows"]:
        if r["batch"] in bf16:
            r["speedup_vs_bf16"] = bf16[r["batch"]] / r["decode_step_ms"]
        if r["engine"] == "strict" and r["batch"] in default:
            r["strict_over_default"] = r["decode_step_ms"] / default[r["batch"]]
    head = next((r for r in results["rows"] if r["engine"] == "nvfp4" and r["batch"] == args.gap_batch), None)
    if head:
        results["decode_step_ms"] = head["decode_step_ms"]
        results["speedup_vs_bf16"] = head.get("speedup_vs_bf16")
    results["wall_s"] = time.perf_counter() - t0
    print_table(f"rollout decode ({args.preset}, {args.new} new tokens, {results['device']})", results["rows"],
                ["engine", "batch", "decode_step_ms", "tokens_per_s", "prefill_ms", "speedup_vs_bf16",
                 "strict_over_default", "effective_weight_gbps", "byte_floor_ms", "gap_mean_abs", "gap_max_abs",
                 "gap_tokens_equal", "kernels_per_step", "kernels_per_step_eager"])
    if results.get("default_mode_variants"):
        print_table("default-mode gap variants", results["default_mode_variants"],
                    ["variant", "gap_mean_abs", "gap_max_abs", "k3_kl", "gap_tokens_equal", "gap_tokens", "decode_step_ms",
                     "kernels_per_step"])
    for key in ("gemm_order", "combine_cost", "alignment_cost", "errors", "skipped"):
        if key in results:
            print(f"{key}: {results[key]}")
    for path in save(results, "rollout", [args.out, os.path.dirname(args.json) if args.json else None]):
        print("appended", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
