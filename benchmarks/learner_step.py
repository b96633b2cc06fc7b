"""The learner step at model scale: the BF16 twin vs NVFP4 vs strict vs a lean plain-torch anchor.

    python -m benchmarks.learner_step                                  # qwen3-moe, 4096 and 16384 tokens
    python -m benchmarks.learner_step --tokens 4096 --profile 2 --out $OUT
    python -m benchmarks.learner_step --smoke                          # CPU, tiny model: the script works

One process, one GPU. Every variant is the same model -- the ``qwen3-moe`` preset of
:mod:`minite_megatron.training.presets` (4 layers, hidden 2048, 32 / 4 heads of 128, 128
experts top-8 with FFN 768, 32k vocabulary), BF16 parameters, built from the minite specs by
``build_gpt`` -- except the anchor:

* ``anchor``: :class:`benchmarks.lean_moe.LeanMoE`, plain torch (SDPA, ``torch._grouped_mm``):
  the best BF16 this machine runs, no framework;
* ``bf16``: the fair BF16 twin, ``Recipe(precision="bf16", aligned_ops=False,
  aligned_attention=False)``: the minite modules with every linear in BF16 (Megatron's GEMM,
  experts through ``torch._grouped_mm``), torch SDPA attention and torch norms (the best BF16
  the minite modules run: the aligned ops only serve the learner/sampler gap);
* ``nvfp4``: ``Recipe()``, the default NVFP4 recipe (W4A4, full update, SR, RHT, aligned ops and
  attention);
* ``nvfp4_sdpa`` (not in the default list): the default recipe with ``aligned_ops`` and
  ``aligned_attention`` off (what the aligned ops cost the learner);
* ``nvfp4_rne``: the default recipe with ``grad_stochastic_rounding=False`` (round to nearest: what
  stochastic rounding costs);
* ``strict``: ``Recipe(strict=True)`` (batch-invariant kernels, FP32 LM head);
* ``local`` (not in the default list): Megatron's local spec (experts looped, unfused attention).

A variant may carry design switches after a ``+`` (A/B runs of the memory design), e.g.
``nvfp4+keep_images`` (the weight caches keep BF16 images in training, the design before
issue 16; recipe field ``keep_weight_images``), ``nvfp4+keep_codes`` (``keep_weight_codes``: the
quantized weights stay after the backward, for the next micro-batch) or ``bf16+unfused_moe_act``
/ ``nvfp4+unfused_moe_act`` (``fused_moe_activation=False``: Megatron's unfused expert activation
x routing probability, the design before the fused kernel).

A step is one forward (``model(tokens, position_ids, None, labels=labels)``, mean token loss)
and its backward, ``tokens`` tokens as ``tokens / seq_length`` sequences. With
``--weight-refresh step`` (default) every step starts from new weights (the weight caches are
invalidated, as an optimizer step does), so the NVFP4 steps include quantizing every weight;
``cached`` reuses them (the second and later micro-batches of an optimizer step).

Reported per variant: the step time (CUDA events, after ``--warmup`` steps, median of
``--iters``), tokens/s, model TFLOP/s and MFU, peak memory (``max_memory_allocated``) by phase
(parameters; forward; backward; what the weight caches hold), the host time of a step (until
the backward call returns: launches, Python, and any host synchronization inside; ``host_forward_ms``
until the forward returns; every step's ``step_ms_all`` / ``host_ms_all``), the caching allocator's
``cudaMalloc`` / ``cudaFree`` calls per timed step (``allocator_per_step``), with
``--profile N`` the top kernels by GPU time over N profiled steps (torch.profiler; full tables,
by GPU and by CPU time, under ``--out``), and with ``--count-ops`` what one more step asks of the
host: ``aten_ops_per_step`` (aten and ``minite::`` ops dispatched, forward and backward:
:class:`minite_megatron.testing.AtenOpCounter`, a host-cost proxy a CPU can measure; ``aten_ops_top``
the most frequent; ``triton_launches_per_step``) and on a GPU the host synchronizations and host-to-device copies of a step
(:class:`minite_megatron.testing.HostSyncCounter`: ``host_syncs_per_step``, ``h2d_copies_per_step``,
``pageable_h2d_per_step``, ``sync_sites``). Host cost on a CPU, e.g. before / after a change::

    MINITE_BACKEND=triton MINITE_STRICT_BACKEND=triton TRITON_INTERPRET=1 python -m benchmarks.learner_step \\
        --smoke --preset moe16 --variants nvfp4,bf16 --iters 1 --warmup 1 --count-ops

runs the GPU's code path under the interpreter (the Triton NVFP4 backend, the ``bi_*`` kernels of
the aligned ops, the MoE combine kernel; about a minute per NVFP4 step of ``moe16``).

With ``--graphs eager,graphed`` every variant also runs as one captured CUDA graph
(``training.cuda_graphs.GraphedStep``: row ``VARIANT@graphed``) where ``why_not_graphable`` allows,
else the row carries its reason (``graph_refused``). On a GPU every row has ``gpu_kernel_ms``,
``gemm_kernel_ms`` and ``kernels_per_step`` (one profiled step, :func:`kernel_stats`) and a
B200 / B300 ``projection_not_a_measurement`` (:func:`projection`, printed under "PROJECTION (not
a measurement)").

FLOPs (:func:`step_flops`): the model's matmuls only -- qkv / o projections, router, experts
(top-k rows each), LM head, and attention's ``QK^T`` and ``PV`` with the causal half counted
(``2 * S^2 * D`` per head and sequence for both together) -- times 3 for forward + backward
(backward = 2 x forward). Embedding, norms, RoPE, softmax and elementwise work are not
counted. MFU = FLOPs / step time / the GPU's dense BF16 peak (``--peak-tflops``; default the
H200 datasheet's 989.4; another GPU: pass its own). Ratios written to the JSON line:
``nvfp4_over_bf16_time``, ``nvfp4_over_bf16_peak_memory``, ``strict_over_default_time``
(strict / nvfp4), ``bf16_over_anchor_time``, and with ``--profile`` ``nvfp4_over_bf16_gpu_time`` (the
profiled step's kernel time: what the ratio is where the step waits on the host, as the NVFP4 step
does on slow host CPUs). Runs unchanged on Blackwell (the default NVFP4
backend is chosen for the device).
"""

from __future__ import annotations

from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import collections
import gc
import json
import os
import statistics
import sys
import time

import torch

from ._timing import ensure_minite_kernels, environment, print_table, save

ensure_minite_kernels()

VARIANTS = ("anchor", "bf16", "nvfp4", "nvfp4_rne", "strict")
#: Presets of this script beside ``training.presets.PRESETS``: ``moe16``, a qwen3-moe-shaped model
#: small enough for a CPU (16 experts top-4) whose per-step op counts scale like the real one's.
LOCAL_PRESETS = {
    "moe16": dict(layers=2, hidden=128, heads=8, groups=2, head_dim=16, experts=16, topk=4, moe_ffn=32, vocab=256),
}
H200_BF16_DENSE_TFLOPS = 989.4
GIB = 1 << 30


# ---- FLOPs ------------------------------------------------------------------------------------
def step_flops(p: dict, batch: int, seq: int) -> float:
    """Model matmul FLOPs of one forward + backward (module docstring)."""
    t = batch * seq
    h, nh, ng, d = p["hidden"], p["heads"], p["groups"], p["head_dim"]
    proj = 2 * t * h * (nh + 2 * ng) * d + 2 * t * nh * d * h
    core = 2 * batch * nh * seq * seq * d  # QK^T + PV (2 * 2 * S^2 * D each), causal half
    router = 2 * t * h * p["experts"]
    experts = 2 * t * p["topk"] * (h * 2 * p["moe_ffn"] + p["moe_ffn"] * h)
    head = 2 * t * h * p["vocab"]
    return 3.0 * (p["layers"] * (proj + core + router + experts) + head)


# ---- models -------------------------------------------------------------------------------------
def build(variant: str, preset: dict, seq: int, device, dtype, changes: dict | None = None):
    """(callable(tokens, labels) -> loss, module) of one variant, weights from seed 0;
    ``changes``: recipe fields set on top of the variant's recipe (the ``+switch`` options)."""
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import build_gpt

    if variant == "anchor":
        from .lean_moe import LeanMoE

        torch.manual_seed(0)
        model = LeanMoE(**preset, max_seq=seq, device=device, dtype=dtype)
        return (lambda tokens, labels: model(tokens, labels)), model
    if variant == "local":
        model = _build_local(preset, seq, device, dtype)
    else:
        recipe = recipe_of(variant, changes)
        model = build_gpt(preset, recipe, max_seq=seq, device=device, dtype=dtype)
        if torch.device(device).type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            from minite_megatron.modules.deterministic_moe import use_kernels_on_cpu

            use_kernels_on_cpu(model)  # the GPU's MoE combine kernel (interpreted), as the GPU runs it
    model.train()

    def run(tokens, labels):
        pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        return model(tokens, pos, None, labels=labels).mean()

    return run, model


def recipe_of(variant: str, changes: dict | None = None):
    """The minite recipe of a variant (None: ``anchor`` and ``local`` have no minite layers)."""
    from minite_megatron.recipe import Recipe

    if variant in ("anchor", "local"):
        return None
    unaligned = dict(aligned_ops=False, aligned_attention=False)
    return {"bf16": Recipe(precision="bf16", **unaligned), "nvfp4": Recipe(), "nvfp4_sdpa": Recipe(**unaligned),
            "nvfp4_rne": Recipe(grad_stochastic_rounding=False),
            "strict": Recipe(strict=True)}[variant].replace(**(changes or {}))


def _build_local(p: dict, seq: int, device, dtype):
    """Megatron's local spec (``SequentialMLP`` experts, unfused attention) on the same config."""
    from minite_megatron.training.presets import build_local_gpt

    return build_local_gpt(p, max_seq=seq, device=device, dtype=dtype, seed=0)


# ---- measuring ------------------------------------------------------------------------------------
class Clock:
    """CUDA events on a GPU, the host clock on a CPU (smoke runs)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, start) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        return (time.perf_counter() - start) * 1e3


def _zero_grads(model) -> None:
    for prm in model.parameters():
        prm.grad = None


def _refresh(mode: str) -> None:
    if mode == "step":
        from minite_megatron.ops.weight_cache import invalidate_weight_caches

        invalidate_weight_caches()


def _allocator_counts(cuda: bool) -> dict:
    """The caching allocator's device calls so far (``cudaMalloc`` / ``cudaFree``; a free waits for
    the device) and its out-of-memory retries; empty on a CPU."""
    if not cuda:
        return {}
    st = torch.cuda.memory_stats()
    return {"cuda_mallocs": st.get("num_device_alloc", 0), "cuda_frees": st.get("num_device_free", 0),
            "alloc_retries": st.get("num_alloc_retries", 0)}


def _alloc(cuda: bool) -> float:
    return torch.cuda.memory_allocated() / GIB if cuda else 0.0


def _peak(cuda: bool) -> float:
    return torch.cuda.max_memory_allocated() / GIB if cuda else 0.0


def _reset_peak(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def memory_by_phase(run, model, data, cuda: bool, refresh: str) -> dict:
    """GiB: parameters (+ anything held before the step), after / peak of the forward, peak of the
    backward, what the weight caches hold after each; one step from grads set to None."""
    from minite_megatron.ops.weight_cache import cached_bytes

    _zero_grads(model)
    _refresh(refresh)
    gc.collect()
    _reset_peak(cuda)
    base = _alloc(cuda)
    loss = run(*data)
    after_fwd = _alloc(cuda)
    peak_fwd = _peak(cuda)
    cache_fwd = cached_bytes()
    _reset_peak(cuda)
    loss.backward()
    del loss
    peak_bwd = _peak(cuda)
    after_bwd = _alloc(cuda)
    cache_bwd = cached_bytes()
    _zero_grads(model)
    return {
        "held_before_step_gib": base,
        "saved_for_backward_gib": after_fwd - base,
        "peak_forward_gib": peak_fwd,
        "peak_backward_gib": peak_bwd,
        "after_backward_gib": after_bwd,
        "peak_gib": max(peak_fwd, peak_bwd),
        "weight_cache_after_forward_gib": {k: v / GIB for k, v in cache_fwd.items() if k != "entries"},
        "weight_cache_after_backward_gib": {k: v / GIB for k, v in cache_bwd.items() if k != "entries"},
    }


_CATEGORIES = (
    ("attention", ("flash", "fmha", "attention", "softmax", "cudnn")),
    ("gemm bf16", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "ampere", "hopper", "wgmma", "matmul")),
    ("nvfp4 gemm", ("_gemm", "grouped_gemm", "grouped_wgrad", "bi_matmul")),
    ("quantize", ("quantize", "amax", "_image", "rht", "row_col")),
    ("copy / cast", ("copy", "cast", "convert", "to_copy")),
    ("norm", ("norm",)),
)


def _category(name: str) -> str:
    n = name.lower()
    if n.startswith("_") or "triton" in n or "minite" in n:
        for cat, keys in (_CATEGORIES[2], _CATEGORIES[3]):
            if any(k in n for k in keys):
                return cat
    for cat, keys in _CATEGORIES:
        if any(k in n for k in keys):
            return cat
    return "other"


def profile(run, model, data, steps: int, refresh: str, path: str | None, top: int, trace: bool = False) -> dict:
    """Top kernels by GPU time over ``steps`` steps (torch.profiler), and GPU time by category;
    ``trace``: Python stacks too, the Chrome trace written beside ``path`` (gzipped) and GPU time by
    kernel and call site (:mod:`.kernel_sites`) in the result and in ``*_sites.txt``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with torch_profile(activities=activities, with_stack=trace) as prof:
        for _ in range(steps):
            _refresh(refresh)
            run(*data).backward()
            _zero_grads(model)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    events = prof.key_averages()
    attr = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    kernels = [e for e in events if getattr(e, attr, 0) > 0 and (not torch.cuda.is_available() or e.device_type.name == "CUDA")]
    total = sum(getattr(e, attr) for e in kernels) or 1.0
    kernels.sort(key=lambda e: -getattr(e, attr))
    rows = [{"kernel": e.key[:90], "calls": e.count // steps, "ms_per_step": getattr(e, attr) / 1e3 / steps,
             "pct": 100.0 * getattr(e, attr) / total} for e in kernels]
    cats: dict[str, float] = {}
    for r in rows:
        c = _category(r["kernel"])
        cats[c] = cats.get(c, 0.0) + r["pct"]
    if path:
        with open(path, "w") as fh:
            fh.write(prof.key_averages().table(sort_by=attr, row_limit=80))
        with open(path.replace(".txt", "_cpu.txt"), "w") as fh:
            fh.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=80))
    result = {"top_kernels": rows[:top], "gpu_ms_per_step": total / 1e3 / steps,
              "pct_by_category": dict(sorted(cats.items(), key=lambda kv: -kv[1]))}
    if trace and path:
        from .kernel_sites import _load, format_table, kernel_sites

        trace_path = path.replace(".txt", "_trace.json.gz")
        prof.export_chrome_trace(trace_path)  # gzipped by torch (the suffix)
        sites = kernel_sites(_load(trace_path), depth=3, steps=steps)
        with open(path.replace(".txt", "_sites.txt"), "w") as fh:
            fh.write(format_table(sites, 200) + "\n")
        result["top_sites"] = sites[:top]
    return result


def host_profile(run, model, data, steps: int, refresh: str, path: str | None, top: int, cuda: bool) -> dict:
    """Where a step's host (Python) time goes: ``cProfile`` over ``steps`` steps; the functions with the
    most own time (``tottime``) and the step's host ms under the profiler (the GPU waits included).
    The backward runs on the calling thread here (``set_multithreading_enabled(False)``; autograd's
    device thread is invisible to ``cProfile``), so its Python is counted too."""
    import cProfile
    import io
    import pstats

    if cuda:
        torch.cuda.synchronize()
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):
        # one step first on this thread: per-thread caches (cuDNN's attention graphs are thread-local)
        # are built here, not under the profiler (they showed as ~94 ms of "host" in the first profile)
        _refresh(refresh)
        run(*data).backward()
        _zero_grads(model)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(steps):
            _refresh(refresh)
            run(*data).backward()
            _zero_grads(model)
        prof.disable()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps
    if cuda:
        torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    rows = sorted(((fn, st[1], st[2], st[3]) for fn, st in stats.stats.items()), key=lambda r: -r[2])
    top_rows = [{"function": f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}({fn[2]})", "calls": n // steps,
                 "tottime_ms": tt * 1e3 / steps, "cumtime_ms": ct * 1e3 / steps} for fn, n, tt, ct in rows[:top]]
    if path:
        prof.dump_stats(path.replace(".txt", ".prof"))  # for callers / callees (pstats) later
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(60)
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(60)
        with open(path, "w") as fh:
            fh.write(buf.getvalue())
    return {"host_ms_under_cprofile": host_ms, "top_tottime": top_rows}


#: ``+switch`` -> the recipe fields it sets (the weight caches' options, read where a layer builds its cache)
SWITCHES = {
    "keep_images": {"keep_weight_images": True},
    "keep_codes": {"keep_weight_codes": True},
    "unfused_moe_act": {"fused_moe_activation": False},
}


def run_variant(variant, preset, batch, seq, args, device, dtype, out_dir) -> dict:
    base, *switches = variant.split("+")
    changes = {k: v for sw in switches for k, v in SWITCHES[sw].items()}
    return _run_variant(base, preset, batch, seq, args, device, dtype, out_dir, variant, changes)


def count_host_work(run, model, data, refresh: str, cuda: bool, top: int = 12) -> dict:
    """One step under :class:`~minite_megatron.testing.AtenOpCounter` and, on a GPU, one under
    :class:`~minite_megatron.testing.HostSyncCounter` (module docstring)."""
    from minite_megatron.testing import AtenOpCounter, HostSyncCounter

    _refresh(refresh)
    with AtenOpCounter() as ops:
        run(*data).backward()
    _zero_grads(model)
    row = {"aten_ops_per_step": ops.aten, "triton_launches_per_step": ops.total - ops.aten,
           "aten_ops_top": dict(ops.by_op.most_common(top))}
    if cuda:
        torch.cuda.synchronize()
        _refresh(refresh)
        with HostSyncCounter() as syncs:
            run(*data).backward()
        _zero_grads(model)
        torch.cuda.synchronize()
        sites = collections.Counter(f"{what} at {where}" for what, where in syncs.syncs + syncs.pageable_h2d)
        row.update(host_syncs_per_step=len(syncs.syncs), sync_debug_mode_warnings=len(syncs.debug_mode_warnings),
                   h2d_copies_per_step=len(syncs.h2d), pageable_h2d_per_step=len(syncs.pageable_h2d),
                   sync_sites=[f"{n} x {site}" for site, n in sites.most_common(top)])
    return row


def _run_variant(variant, preset, batch, seq, args, device, dtype, out_dir, label, changes=None) -> dict:
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    run, model = build(variant, preset, seq, device, dtype, changes)
    build_s = time.perf_counter() - t0
    g = torch.Generator(device="cpu").manual_seed(7)
    tokens = torch.randint(0, preset["vocab"], (batch, seq), generator=g).to(device)
    labels = torch.randint(0, preset["vocab"], (batch, seq), generator=g).to(device)
    data = (tokens, labels)
    params_gib = _alloc(cuda)
    clock = Clock(cuda)

    t0 = time.perf_counter()
    _refresh(args.weight_refresh)
    loss = run(*data)
    loss.backward()
    first_loss = float(loss.detach())
    del loss
    _zero_grads(model)
    if cuda:
        torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(max(0, args.warmup - 1)):
        _refresh(args.weight_refresh)
        run(*data).backward()
        _zero_grads(model)
    times, host = [], []
    gc_runs = [0, 0, 0]
    gc_ms = [0.0]

    def _gc_cb(phase, info, _t0=[0.0]):  # collections (and their time) during the timed steps, per generation
        if phase == "start":
            _t0[0] = time.perf_counter()
        else:
            gc_runs[info["generation"]] += 1
            gc_ms[0] += (time.perf_counter() - _t0[0]) * 1e3

    host_fwd = []
    allocs0 = _allocator_counts(cuda)
    gc.callbacks.append(_gc_cb)
    for _ in range(args.iters):
        _refresh(args.weight_refresh)
        start = clock.start()
        t_host = time.perf_counter()
        loss = run(*data)
        host_fwd.append((time.perf_counter() - t_host) * 1e3)
        loss.backward()
        host.append((time.perf_counter() - t_host) * 1e3)
        times.append(clock.ms(start))
        del loss
        _zero_grads(model)
    gc.callbacks.remove(_gc_cb)
    allocs = {k: (v - allocs0[k]) / max(1, args.iters) for k, v in _allocator_counts(cuda).items()}
    step_ms = statistics.median(times)
    row = {
        "variant": label, "step_ms": step_ms, "step_ms_min": min(times), "step_ms_max": max(times),
        "step_ms_all": times, "host_ms_all": host, "host_forward_ms": statistics.median(host_fwd),
        "allocator_per_step": allocs,
        "tokens_per_s": batch * seq / step_ms * 1e3, "host_ms": statistics.median(host),
        "first_step_s": first_s, "build_s": build_s,
        "gc_collections_per_step": [n / max(1, args.iters) for n in gc_runs], "gc_ms_per_step": gc_ms[0] / max(1, args.iters),
        "loss_first_step": first_loss, "params_gib": params_gib,
    }
    if variant == "nvfp4" and args.weight_refresh == "step" and args.cached_too:
        cached = []
        for _ in range(args.iters):
            start = clock.start()
            run(*data).backward()
            cached.append(clock.ms(start))
            _zero_grads(model)
        row["step_ms_weights_cached"] = statistics.median(cached)
    row.update(memory_by_phase(run, model, data, cuda, args.weight_refresh))
    if cuda:
        def one_step():
            _refresh(args.weight_refresh)
            run(*data).backward()
            _zero_grads(model)

        row.update(kernel_stats(one_step))
    if args.count_ops:
        row.update(count_host_work(run, model, data, args.weight_refresh, cuda))
    if args.profile:
        path = os.path.join(out_dir, f"profile_{label.replace('+', '_')}_{batch * seq}.txt") if out_dir else None
        row["profile"] = profile(run, model, data, args.profile, args.weight_refresh, path, args.top, args.trace)
    if args.host_profile:
        path = os.path.join(out_dir, f"host_profile_{label.replace('+', '_')}_{batch * seq}.txt") if out_dir else None
        row["host_profile"] = host_profile(run, model, data, args.host_profile, args.weight_refresh, path, args.top, cuda)
    del run, model, data
    gc.collect()
    return row


#: Substrings of the names of GEMM kernels (cuBLAS / CUTLASS / nvjet / torch grouped mm / Triton dot kernels).
GEMM_KERNEL_MARKS = ("gemm", "matmul", "nvjet", "cutlass", "_mm", "sm90_xmma", "wgmma", "dot")
#: The projection's rates (dense, PFLOPS), datasheet values: NVIDIA Blackwell datasheet / HGX B200 and
#: B300 pages (B200: FP4 9, BF16 2.25; B300: FP4 13.5 -- 15 is the sparse-free headline of some
#: pages; BF16 2.25) and the H100 SXM datasheet (BF16 0.989).
DATASHEET_PFLOPS = {"H100": {"bf16": 0.989}, "B200": {"fp4": 9.0, "bf16": 2.25}, "B300": {"fp4": 13.5, "bf16": 2.25}}


def kernel_stats(step, steps: int = 1) -> dict:
    """GPU kernels of ``steps`` calls of ``step`` (torch.profiler, CUDA activity): kernel time and
    kernel count per step, and the time per step of GEMM kernels (:data:`GEMM_KERNEL_MARKS`)."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    total = gemm = 0.0
    count = 0
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy" in name or "memset" in name:
            continue
        t = e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
        total += t
        count += 1
        if any(m in name for m in GEMM_KERNEL_MARKS):
            gemm += t
    return {"gpu_kernel_ms": total / steps, "gemm_kernel_ms": gemm / steps, "kernels_per_step": count / steps}


def projection(row: dict, fp4: bool) -> dict:
    """The B200 / B300 projection of a measured row (module docstring; NOT a measurement): every
    kernel's H100 time divided by the BF16 dense-rate ratio (Blackwell / H100, 2.25 / 0.989), the GEMM
    kernels of an NVFP4 variant further by the FP4 / BF16 dense-rate ratio (H100 runs them at BF16
    rate); the step = max(measured host time, projected GPU time) (host and GPU overlap; the host
    time is taken as measured: the same host CPU)."""
    out = {}
    for gpu in ("B200", "B300"):
        r = DATASHEET_PFLOPS[gpu]
        bf16 = r["bf16"] / DATASHEET_PFLOPS["H100"]["bf16"]
        gemm = row["gemm_kernel_ms"] / bf16 / (r["fp4"] / r["bf16"] if fp4 else 1.0)
        gpu_ms = (row["gpu_kernel_ms"] - row["gemm_kernel_ms"]) / bf16 + gemm
        out[gpu] = {"projected_gpu_ms": gpu_ms, "projected_step_ms": max(row["host_ms"], gpu_ms)}
    return out


def _run_graphed(variant, preset, batch, seq, args, device, dtype, label, changes=None) -> dict:
    """The variant's step captured as one CUDA graph (``training.cuda_graphs.GraphedStep``) and replayed
    on fresh weights each step (an in-place update, as an optimizer's); a row with the refusal's reason
    where ``why_not_graphable`` says no."""
    from minite_megatron.training.cuda_graphs import GraphedStep, why_not_graphable

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run, model = build(variant, preset, seq, device, dtype, changes)
    recipe = recipe_of(variant, changes)
    why = ("plain torch (not the minite layers): run eager only here (a failed capture would leave the "
           "device for the variants after it)") if recipe is None else why_not_graphable(model, recipe, device)
    if why is not None:
        del run, model
        return {"variant": label, "graph_refused": why}
    g = torch.Generator(device="cpu").manual_seed(7)
    tokens = torch.randint(0, preset["vocab"], (batch, seq), generator=g).to(device)
    labels = torch.randint(0, preset["vocab"], (batch, seq), generator=g).to(device)
    t0 = time.perf_counter()
    graphed = GraphedStep(model, run, tokens, labels, recipe=recipe, warmup=max(1, args.warmup))
    capture_s = time.perf_counter() - t0
    clock = Clock(True)
    for _ in range(args.warmup):
        graphed.step(tokens, labels)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, host = [], []
    for _ in range(args.iters):
        start = clock.start()
        t_host = time.perf_counter()
        graphed.step(tokens, labels)
        host.append((time.perf_counter() - t_host) * 1e3)
        times.append(clock.ms(start))
    row = {"variant": label, "step_ms": statistics.median(times), "step_ms_all": times, "host_ms": statistics.median(host),
           "host_ms_all": host, "tokens_per_s": batch * seq / statistics.median(times) * 1e3, "capture_s": capture_s,
           "peak_gib": _peak(True), "loss_first_step": float(graphed.static_loss)}
    row.update(kernel_stats(lambda: graphed.step(tokens, labels)))
    del graphed, run, model
    gc.collect()
    return row


def main(argv=None):
    """The benchmark (:func:`_main`)."""
    return _main(argv)


def _main(argv=None):
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default=None,
                    help="a training.presets name or moe16 (default: qwen3-moe; tiny with --smoke)")
    ap.add_argument("--tokens", default="4096,16384", help="tokens per step, comma-separated")
    ap.add_argument("--seq-length", type=int, default=4096, help="sequence length (sequences = tokens / this)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {VARIANTS + ('local', 'nvfp4_sdpa')}")
    ap.add_argument("--graphs", default="eager",
                    help="comma-separated of eager,graphed: graphed rows (VARIANT@graphed) capture the step as one "
                         "CUDA graph where training.cuda_graphs.why_not_graphable allows, else carry its reason")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--weight-refresh", choices=("step", "cached"), default="step")
    ap.add_argument("--cached-too", action="store_true", help="nvfp4: also time steps with the weights cached")
    ap.add_argument("--profile", type=int, default=0, help="profile N steps per variant (0: no profile)")
    ap.add_argument("--top", type=int, default=12, help="kernels to list per variant")
    ap.add_argument("--trace", action="store_true",
                    help="with --profile: Python stacks, the Chrome trace and GPU time by call site (benchmarks.kernel_sites)")
    ap.add_argument("--host-profile", type=int, default=0,
                    help="cProfile N steps per variant: the Python functions with the most host time")
    ap.add_argument("--count-ops", action="store_true",
                    help="count aten ops (and on a GPU host syncs, H2D copies) of one more step per variant")
    ap.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="dense BF16 peak for MFU")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for JSON and profiles")
    ap.add_argument("--json-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU: a check that the script works")
    args = ap.parse_args(argv)

    from minite_megatron.training.presets import PRESETS, init_single_process

    if args.smoke:
        args.preset = args.preset or "tiny"
        if args.tokens == "4096,16384":
            args.tokens, args.seq_length = "64", 32
    preset_name = args.preset or "qwen3-moe"
    presets = {**PRESETS, **LOCAL_PRESETS}
    if preset_name not in presets:
        sys.exit(f"--preset {preset_name!r}: choose one of {sorted(presets)}")
    preset = presets[preset_name]
    device = init_single_process(seed=0)
    if device.type != "cuda" and not args.smoke:
        sys.exit("benchmarks.learner_step needs a CUDA GPU (or --smoke on a CPU)")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    env = environment()
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:
        base, *switches = v.split("+")
        if base not in VARIANTS + ("local", "nvfp4_sdpa") or any(sw not in SWITCHES for sw in switches):
            sys.exit(f"--variants: unknown variant {v!r} (variants {VARIANTS + ('local', 'nvfp4_sdpa')}, switches {tuple(SWITCHES)})")
        if switches and base in ("anchor", "local"):
            sys.exit(f"--variants: {v!r}: the +switches set minite recipe fields; {base!r} has no minite layers")
    graphs = [m for m in args.graphs.split(",") if m]
    if not graphs or any(m not in ("eager", "graphed") for m in graphs):
        sys.exit(f"--graphs {args.graphs!r}: a comma-separated list of eager,graphed")
    if "graphed" in graphs and device.type != "cuda":
        sys.exit("--graphs graphed needs a CUDA GPU")
    records = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        if tokens % args.seq_length:
            sys.exit(f"--tokens {tokens} is not a multiple of --seq-length {args.seq_length}")
        batch, seq = tokens // args.seq_length, args.seq_length
        flops = step_flops(preset, batch, seq)
        rows = []
        for v, mode in [(v, m) for v in variants for m in graphs]:
            label = v if mode == "eager" else f"{v}@graphed"
            print(f"... {label} at {tokens} tokens", flush=True)
            try:
                if mode == "eager":
                    row = run_variant(v, preset, batch, seq, args, device, dtype, args.out)
                else:
                    base, *sw = v.split("+")
                    changes = {k: val for x in sw for k, val in SWITCHES[x].items()}
                    row = _run_graphed(base, preset, batch, seq, args, device, dtype, label, changes)
                    if "graph_refused" in row:
                        print(f"    not graphed: {row['graph_refused']}", flush=True)
                        rows.append(row)
                        continue
            except Exception as e:  # one broken variant must not cost the others' numbers: report it
                import traceback

                traceback.print_exc()
                rows.append({"variant": label, "error": f"{type(e).__name__}: {e}"[:300]})
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            row["model_tflops_per_s"] = flops / row["step_ms"] / 1e9
            row["mfu"] = row["model_tflops_per_s"] / args.peak_tflops
            rows.append(row)
            print(f"    {row['step_ms']:.2f} ms, host {row['host_ms']:.2f} ms, peak {row['peak_gib']:.2f} GiB, "
                  f"kernels/step {row.get('kernels_per_step')}",
                  flush=True)
        by = {r["variant"]: r for r in rows if "error" not in r and "graph_refused" not in r}
        for r in by.values():
            if "gpu_kernel_ms" in r:
                r["projection_not_a_measurement"] = projection(r, fp4=r["variant"].split("+")[0].split("@")[0]
                                                               in ("nvfp4", "nvfp4_rne", "nvfp4_sdpa", "strict"))
        ratios = {}
        if "nvfp4" in by and "bf16" in by:
            ratios["nvfp4_over_bf16_time"] = by["nvfp4"]["step_ms"] / by["bf16"]["step_ms"]
            ratios["nvfp4_over_bf16_peak_memory"] = by["nvfp4"]["peak_gib"] / by["bf16"]["peak_gib"] if by["bf16"]["peak_gib"] else None
            gpu = {v: by[v].get("profile", {}).get("gpu_ms_per_step") for v in ("nvfp4", "bf16")}
            if gpu["nvfp4"] and gpu["bf16"]:  # with --profile: the kernels' time alone (no host waits)
                ratios["nvfp4_over_bf16_gpu_time"] = gpu["nvfp4"] / gpu["bf16"]
        if "nvfp4@graphed" in by and "bf16@graphed" in by:
            ratios["nvfp4_graphed_over_bf16_graphed_time"] = by["nvfp4@graphed"]["step_ms"] / by["bf16@graphed"]["step_ms"]
        if "nvfp4_rne@graphed" in by and "bf16@graphed" in by:
            ratios["nvfp4_rne_graphed_over_bf16_graphed_time"] = by["nvfp4_rne@graphed"]["step_ms"] / by["bf16@graphed"]["step_ms"]
        if "nvfp4_rne@graphed" in by and "bf16" in by:
            ratios["nvfp4_rne_graphed_over_bf16_eager_time"] = by["nvfp4_rne@graphed"]["step_ms"] / by["bf16"]["step_ms"]
        if "strict" in by and "nvfp4" in by:
            ratios["strict_over_default_time"] = by["strict"]["step_ms"] / by["nvfp4"]["step_ms"]
        if "strict@graphed" in by and "nvfp4@graphed" in by:
            ratios["strict_graphed_over_default_graphed_time"] = (by["strict@graphed"]["step_ms"]
                                                                  / by["nvfp4@graphed"]["step_ms"])
        if "nvfp4" in by and "nvfp4_sdpa" in by:
            ratios["aligned_over_sdpa_time"] = by["nvfp4"]["step_ms"] / by["nvfp4_sdpa"]["step_ms"]
        if "bf16" in by and "anchor" in by:
            ratios["bf16_over_anchor_time"] = by["bf16"]["step_ms"] / by["anchor"]["step_ms"]
        print_table(f"learner step, {preset_name}, {tokens} tokens ({batch} x {seq}), {env['device']}",
                    list(by.values()),
                    ["variant", "step_ms", "host_ms", "gpu_kernel_ms", "gemm_kernel_ms", "kernels_per_step", "tokens_per_s", "model_tflops_per_s", "mfu", "peak_gib", "peak_forward_gib",
                     "peak_backward_gib", "saved_for_backward_gib", "params_gib", "loss_first_step", "first_step_s"])
        print("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items() if v is not None))
        for r in rows:
            if "error" in r:
                print(f"FAILED {r['variant']}: {r['error']}")
            if "graph_refused" in r:
                print(f"NOT GRAPHED {r['variant']}: {r['graph_refused']}")
        proj = [r for r in by.values() if "projection_not_a_measurement" in r]
        if proj:
            print("\nPROJECTION (not a measurement): B200 / B300 from this run's host time and per-kernel GPU times; "
                  "every kernel / (2.25 / 0.989, the BF16 dense-rate ratio), an NVFP4 variant's GEMM kernels further / "
                  "(FP4 / BF16 dense rate: B200 9 / 2.25 = 4x, B300 13.5 / 2.25 = 6x); datasheet values (NVIDIA "
                  "Blackwell datasheet, HGX B200 / B300 pages; H100 SXM datasheet); step = max(host, projected GPU)")
            for r in proj:
                pj = r["projection_not_a_measurement"]
                print(f"    {r['variant']:<22} host {r['host_ms']:8.2f} ms | " + " | ".join(
                    f"{gpu}: GPU {pj[gpu]['projected_gpu_ms']:8.2f} ms, step {pj[gpu]['projected_step_ms']:8.2f} ms"
                    for gpu in ("B200", "B300")))
        for r in rows:
            if "aten_ops_per_step" in r:
                line = (f"{r['variant']}: {r['aten_ops_per_step']} aten ops per step "
                        f"(+ {r['triton_launches_per_step']} Triton launches)")
                if "host_syncs_per_step" in r:
                    line += (f", {r['host_syncs_per_step']} host syncs ({r['sync_debug_mode_warnings']} by torch's sync "
                             f"debug mode), {r['h2d_copies_per_step']} H2D copies ({r['pageable_h2d_per_step']} pageable)")
                print(line)
                for site in r.get("sync_sites", []):
                    print(f"    {site}")
        for r in rows:
            if "profile" in r:
                pr = r["profile"]
                print(f"\n{r['variant']}: GPU {pr['gpu_ms_per_step']:.2f} ms/step; by category: "
                      + ", ".join(f"{k} {v:.1f}%" for k, v in pr["pct_by_category"].items()))
                for k in pr["top_kernels"][:8]:
                    print(f"    {k['pct']:5.1f}%  {k['ms_per_step']:8.3f} ms  x{k['calls']:<5} {k['kernel']}")
        record = {
            "bench": "learner_step", **env, "preset": preset_name, "config": preset, "tokens": tokens, "batch": batch,
            "seq_length": seq, "dtype": str(dtype).replace("torch.", ""), "weight_refresh": args.weight_refresh,
            "flops_per_step": flops, "peak_tflops": args.peak_tflops, "smoke": args.smoke, **ratios,
            "variants": rows, "command": "python -m benchmarks.learner_step " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        records.append(record)
        save(record, "learner_step", [args.out] + ([] if args.smoke else [args.json_dir]))
    return records


if __name__ == "__main__":
    main()
