"""The rollout engine at Qwen3-30B-A3B's whole size (48 layers, 151,936 tokens) on one GPU.

Run through ``python -m benchmarks.rollout --preset qwen3-30b-a3b`` (or directly,
``python -m benchmarks.rollout_full``). Models are :func:`minite_megatron.rollout.resident.build_resident_gpt`'s
(random weights made layer by layer, NVFP4 weights only: ~20 GB on the device; with ``--hf-checkpoint DIR``
the weights of a Hugging Face Qwen3-30B-A3B checkpoint, read layer by layer from its safetensors shards
and quantized as they come: :func:`minite_megatron.convert.hf_stream.build_resident_gpt_from_hf`), one
at a time:

1. **nvfp4** (default mode): the engine with a ``256 x 2048`` KV cache (peak memory of the target),
   then decode ms/step and tokens/s at batch 1, 8, 64, 256 (mixed prompt lengths, CUDA graphs),
   prefill ms; the learner/rollout gap on ``--gap-batch x --new`` sampled tokens (the learner:
   ``teacher_forced_logprobs`` on the same resident model, i.e. the learner's modules and bits);
   the RL-shaped run: ``--rl-prompts x --rl-samples`` sequences, up to ``--rl-new`` new tokens,
   rollout tokens/s (wall clock, prefill included).
2. **strict**: the same timings at batch 1 and 8 and the gap (must be exactly 0).
3. **bf16** (the project's BF16 engine: Megatron's local spec, 61 GB of weights, plus the decode
   step's stacked copy of the experts, 58 GB): at 48 layers where free memory holds it, else at
   the deepest cut that fits, with the NVFP4 engine at the same cut (``nvfp4_cut``) for the
   ratio; a row says how many layers fit. With ``--hf-checkpoint`` the BF16 engine loads the
   checkpoint where the whole model fits; a cut has random weights (both engines; ``weights``).
4. **lean** (the lean plain-torch BF16 anchor, :class:`LeanDecode`): one decode step of
   :class:`benchmarks.lean_moe.LeanMoE`'s model (random weights; experts stacked ``[E, N, K]``
   through ``torch._grouped_mm``, SDPA over a static KV cache, sampling over the whole vocabulary)
   in one CUDA graph, at the preset's depth where its BF16 weights fit (no stacked copy: 57 GB at
   48 layers), else at the deepest cut that fits (a row says how many layers fit).

One JSON line per run (``benchmarks/results/rollout_full.jsonl`` and ``--json``), also after an
error in a section (a row names it, the next section runs), ``--budget-s`` (later sections are
skipped, a row says so) or SIGTERM / SIGINT (``"interrupted"``); ``<json>.partial`` holds the
results so far after every row. Batch 1 also reports the kernels one decode step launches
(``kernels_per_step``, CUPTI over graph replays) and the decode time per kernel (``us_per_kernel``).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks._timing import environment, print_table, save  # noqa: E402
from minite_megatron.training.cli import OneLineArgumentParser  # noqa: E402


class Interrupted(Exception):
    """SIGTERM / SIGINT (the step's timeout): stop, then write the JSON line of what ran."""


def _free_all():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


def _allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def _free() -> int:
    """Free device memory (a CPU run -- the tiny preset, a check of this script -- has no limit)."""
    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 1 << 50


def _gib(n) -> float:
    return round(n / 2**30, 2)


def engine_rows(name, model, preset, args, batches, gap: bool, rl: bool, rows: list | None = None,
                flush=lambda: None, kernels: bool = False) -> list[dict]:
    """Rows of one engine, appended to ``rows`` as they come (``flush()`` after each one); with
    ``kernels``, last (the profiler stays initialized after it), the kernels one decode step
    launches at batch 1 and the time per kernel."""
    from benchmarks._engine_timing import gap_of, kernels_per_step, prompts_for, time_engine
    from minite_megatron.rollout.engine import RolloutEngine

    rows = [] if rows is None else rows
    max_seq = max(args.prompt_max + args.new, args.prompt_max + args.rl_new)
    eng = RolloutEngine(model, eod_id=0, max_batch_size=max(batches), max_sequence_length=max_seq,
                        attention="sdpa" if name == "bf16" else "module")
    for b in batches:
        prompts = prompts_for(b, args.prompt_min, args.prompt_max, preset["vocab"])
        t = time_engine(eng, prompts, args.new, args.repeats)
        row = {"engine": name, "batch": b, **t, "graphed": eng._fast.last_timing.get("graphed"),
               "tokens_per_s": b * 1e3 / t["decode_step_ms"],
               "peak_gib": _gib(_peak())}
        if gap and b == args.gap_batch:
            row.update(gap_of(model, eng, prompts, args.new))
        rows.append(row)
        print(row, flush=True)
        flush()
    if rl:
        g = torch.Generator().manual_seed(11)
        base = [torch.randint(1, preset["vocab"] - 1, (int(n),), generator=g).tolist()
                for n in torch.linspace(args.prompt_min, args.prompt_max, args.rl_prompts).round().int()]
        prompts = [p for p in base for _ in range(args.rl_samples)]
        _sync()
        t0 = time.perf_counter()
        out = eng.generate(prompts, args.rl_new, temperature=1.0, seed=7)
        _sync()
        wall = time.perf_counter() - t0
        toks = sum(len(r.generated_tokens) for r in out)
        rows.append({"engine": name, "rl": f"{args.rl_prompts}x{args.rl_samples}x{args.rl_new}", "batch": len(prompts),
                     "rollout_tokens": toks, "wall_s": round(wall, 3), "rollout_tokens_per_s": toks / wall,
                     "peak_gib": _gib(_peak())})
        print(rows[-1], flush=True)
        flush()
    if kernels and torch.cuda.is_available():
        one = next((r for r in rows if r.get("engine") == name and r.get("batch") == 1 and "decode_step_ms" in r), None)
        if one is not None:
            k = kernels_per_step(eng, prompts_for(1, args.prompt_min, args.prompt_max, preset["vocab"]))
            one.update(kernels_per_step=k, kernels_per_layer_upper=k / preset["layers"],
                       us_per_kernel=one["decode_step_ms"] * 1e3 / k if k else None)
            print({"engine": name, "batch": 1, "kernels_per_step": k, "us_per_kernel": one["us_per_kernel"]}, flush=True)
            flush()
    del eng
    return rows


def kv_peak_row(model, preset, args) -> dict:
    """The engine with a ``--kv-batch x --kv-len`` cache: its bytes, and the peak of one batch."""
    from benchmarks._engine_timing import prompts_for
    from minite_megatron.rollout.engine import RolloutEngine

    _free_all()
    eng = RolloutEngine(model, eod_id=0, max_batch_size=args.kv_batch, max_sequence_length=args.kv_len)
    # short prompts: the prefill's [B, L, V] logits are not what this row measures
    prompts = prompts_for(args.kv_batch, 8, 24, preset["vocab"])
    eng.generate(prompts, 4, temperature=1.0, seed=1, stop_at_eod=False)
    _sync()
    row = {"engine": "nvfp4", "kv_cache": f"{args.kv_batch}x{args.kv_len}",
           "kv_gib": _gib(sum(t.numel() * t.element_size() for t in eng._fast.cache.k + eng._fast.cache.v)),
           "peak_gib": _gib(_peak())}
    del eng
    _free_all()
    print(row, flush=True)
    return row


def bf16_layers_that_fit(preset: dict, free: int, slack: int = 8 << 30) -> int:
    """Layers of ``preset`` whose BF16 engine fits ``free`` bytes: its weights, plus the decode
    step's stacked copy of the experts (Megatron's local ``SequentialMLP`` holds one tensor per
    expert; the grouped GEMM reads them stacked), plus ``slack``."""
    from minite_megatron.rollout.resident import resident_bytes

    one = dict(preset, layers=1)
    zero = dict(preset, layers=0)
    outer = resident_bytes(zero)["bf16_model"]
    per_layer = resident_bytes(one)["bf16_model"] - outer
    per_layer_experts = 2 * preset["experts"] * 3 * preset["hidden"] * preset["moe_ffn"]
    return max(0, min(preset["layers"], int((free - slack - outer) // (per_layer + per_layer_experts))))


def resident_model(preset: dict, strict: bool, max_seq: int, device, hf_checkpoint: str | None = None):
    """The resident NVFP4 model of ``preset``: the checkpoint's weights streamed layer by layer
    (``hf_checkpoint``), else random weights from seed 0."""
    from minite_megatron.recipe import Recipe

    if hf_checkpoint:
        from minite_megatron.convert.hf_stream import build_resident_gpt_from_hf

        return build_resident_gpt_from_hf(hf_checkpoint, Recipe(strict=strict), device=device, preset=preset,
                                          max_seq=max_seq)
    from minite_megatron.rollout.resident import build_resident_gpt
    from minite_megatron.training.presets import unallocated_gpt

    return build_resident_gpt(unallocated_gpt(preset, Recipe(strict=strict), max_seq=max_seq), device=device, seed=0)


def bf16_rows(preset: dict, args, device) -> list[dict]:
    """The project's BF16 engine at the preset's depth where it fits, else at the deepest cut
    that fits, with the NVFP4 engine at that cut in the same run (the ratio of the two)."""
    from benchmarks._engine_timing import local_bf16_gpt
    from minite_megatron.rollout.resident import resident_bytes

    _free_all()
    free = _free()
    layers = bf16_layers_that_fit(preset, free)
    rows = [{"engine": "bf16", "fits_layers": layers, "of_layers": preset["layers"], "free_gib": _gib(free),
             "bf16_weights_gib": _gib(resident_bytes(preset)["bf16_model"])}]
    print("bf16 engine:", rows[0], flush=True)
    if layers < 1:
        return rows
    cut = dict(preset, layers=layers)
    sizes = [int(b) for b in args.strict_batches.split(",")]
    real = bool(args.hf_checkpoint) and layers == preset["layers"]  # a checkpoint cannot be cut
    if real:
        from minite_megatron.convert import build_gpt_from_hf

        model = build_gpt_from_hf(args.hf_checkpoint, impl="local", device=device, dtype=torch.bfloat16,
                                  max_sequence_length=args.prompt_max + args.new).eval()
    else:
        model = local_bf16_gpt(cut, args.prompt_max + args.new, device, torch.bfloat16)
    weights = {"weights": "hf" if real else "random"}
    rows += [dict(r, layers=layers, **weights) for r in engine_rows("bf16", model, cut, args, sizes, gap=False, rl=False)]
    del model
    if layers < preset["layers"]:  # the NVFP4 engine at the same depth, for the ratio
        _free_all()
        model = resident_model(cut, False, 1024, device)
        rows += [dict(r, engine="nvfp4_cut", layers=layers, **weights)
                 for r in engine_rows("nvfp4", model, cut, args, sizes, gap=False, rl=False)]
        del model
    _free_all()
    return rows


class LeanDecode:
    """The lean plain-torch BF16 anchor of one decode step: :class:`benchmarks.lean_moe.LeanMoE`'s
    weights and math (RMSNorm, fused qkv, qk-RMSNorm, RoPE, GQA, fp32 softmax top-k router, experts
    through ``torch._grouped_mm`` with device-side offsets, SwiGLU, untied head) for one new token
    of each of ``batch`` sequences, attending over a static ``[layers, batch, groups, max_seq,
    head_dim]`` KV cache, then one sample per sequence over the whole vocabulary (temperature 1,
    the exponential race: no host sync). :meth:`step` works in place on ``tokens`` / ``pos``, so it
    can be captured in one CUDA graph and replayed."""

    def __init__(self, model, batch: int, max_seq: int):
        self.m, self.batch, self.max_seq = model, batch, max_seq
        dev, dt = model.embed.device, model.embed.dtype
        shape = (len(model.layers), batch, model.ng, max_seq, model.d)
        self.k = torch.zeros(shape, device=dev, dtype=dt)
        self.v = torch.zeros(shape, device=dev, dtype=dt)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(batch, dtype=torch.long, device=dev)
        self.rows = torch.arange(batch, device=dev)
        self.slots = torch.arange(max_seq, device=dev)

    def logits(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``[batch, vocab]`` logits of ``tokens`` at positions ``pos`` (their K / V written into
        the cache at ``pos``; earlier positions read from it)."""
        import torch.nn.functional as F

        from benchmarks.lean_moe import _rope

        m = self.m
        b = tokens.shape[0]
        cos, sin = m.cos[pos][:, None], m.sin[pos][:, None]
        mask = (self.slots[None, :] <= pos[:, None])[:, None, None, :]  # [b, 1, 1, S]
        x = F.embedding(tokens, m.embed)
        for i, layer in enumerate(m.layers):
            h = F.rms_norm(x, (m.h,), layer.n1, 1e-6)
            q, k, v = F.linear(h, layer.qkv).view(b, m.nh + 2 * m.ng, m.d).split([m.nh, m.ng, m.ng], dim=1)
            q = _rope(F.rms_norm(q, (m.d,), layer.qn, 1e-6), cos, sin)
            k = _rope(F.rms_norm(k, (m.d,), layer.kn, 1e-6), cos, sin)
            self.k[i][self.rows, :, pos] = k
            self.v[i][self.rows, :, pos] = v
            o = F.scaled_dot_product_attention(q[:, :, None], self.k[i], self.v[i], attn_mask=mask,
                                               scale=m.d ** -0.5, enable_gqa=True)
            x = x + F.linear(o.reshape(b, m.nh * m.d), layer.o)
            x = x + m._moe(layer, F.rms_norm(x, (m.h,), layer.n2, 1e-6))
        return F.linear(F.rms_norm(x, (m.h,), m.norm, 1e-6), m.head)

    def step(self) -> None:
        probs = torch.softmax(self.logits(self.tokens, self.pos).float(), dim=-1)
        self.tokens.copy_((probs / torch.empty_like(probs).exponential_()).argmax(dim=-1))
        self.pos.add_(1)


def lean_layers_that_fit(preset: dict, free: int, kv_per_layer: int, slack: int = 6 << 30) -> int:
    """Layers of ``preset`` whose lean anchor fits ``free`` bytes: BF16 weights (experts stacked
    once, no copy), ``kv_per_layer`` bytes of KV cache a layer, plus ``slack``."""
    from minite_megatron.rollout.resident import resident_bytes

    outer = resident_bytes(dict(preset, layers=0))["bf16_model"]
    per_layer = resident_bytes(dict(preset, layers=1))["bf16_model"] - outer + kv_per_layer
    return max(0, min(preset["layers"], int((free - slack - outer) // per_layer)))


def time_lean(dec: LeanDecode, start: int, steps: int) -> dict:
    """ms per decode step of ``dec`` from position ``start`` (the cache before it random):
    ``steps`` replays of one captured CUDA graph (eager where there is no GPU or the capture fails)."""
    g = torch.Generator(device=dec.k.device).manual_seed(3)
    dec.k.normal_(generator=g)
    dec.v.normal_(generator=g)
    dec.tokens.random_(1, dec.m.embed.shape[0] - 1, generator=g)

    def reset():
        dec.pos.fill_(start)

    reset()
    for _ in range(3):  # warm-up (and the kernels' first calls) outside the graph
        dec.step()
    graph, why = None, None
    if dec.k.is_cuda:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                reset()
                dec.step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                dec.step()
        except Exception as e:  # noqa: BLE001 -- reported in the row, timed eagerly
            graph, why = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    run = graph.replay if graph is not None else dec.step
    reset()
    run()
    _sync()
    reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    _sync()
    out = {"decode_step_ms": (time.perf_counter() - t0) * 1e3 / steps, "graphed": graph is not None}
    if why:
        out["graph_error"] = why
    return out


def lean_rows(preset: dict, args) -> list[dict]:
    """The lean anchor at ``--strict-batches`` (the BF16 engine's batches), at the preset's depth
    where it fits, else at the deepest cut that fits."""
    from benchmarks.lean_moe import LeanMoE

    _free_all()
    sizes = [int(b) for b in args.strict_batches.split(",")]
    max_seq = args.prompt_max + args.new
    kv_per_layer = 2 * max(sizes) * preset["groups"] * max_seq * preset["head_dim"] * 2
    free = _free()
    layers = lean_layers_that_fit(preset, free, kv_per_layer)
    rows = [{"engine": "lean_bf16", "fits_layers": layers, "of_layers": preset["layers"], "free_gib": _gib(free)}]
    print("lean anchor:", rows[0], flush=True)
    if layers < 1:
        return rows
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    dims = {k: preset[k] for k in ("hidden", "heads", "groups", "head_dim", "experts", "topk", "moe_ffn", "vocab")}
    model = LeanMoE(layers=layers, **dims, max_seq=max_seq, device=device, dtype=torch.bfloat16).requires_grad_(False)
    with torch.no_grad():
        for b in sizes:
            dec = LeanDecode(model, b, max_seq)
            row = {"engine": "lean_bf16", "layers": layers, "batch": b, "weights": "random",
                   **time_lean(dec, args.prompt_max, args.new), "peak_gib": _gib(_peak())}
            row["tokens_per_s"] = b * 1e3 / row["decode_step_ms"]
            rows.append(row)
            print(row, flush=True)
            del dec
    del model
    _free_all()
    return rows


def main(argv=None):
    ap = OneLineArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="a cut of the preset's first layers")
    ap.add_argument("--engines", default="nvfp4,strict,bf16,lean")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--strict-batches", default="1,8")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=1, help="timed generate calls per row (after one warm-up)")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="seconds after which the remaining sections are skipped (a row says so)")
    ap.add_argument("--gap-batch", type=int, default=8, help="gap on gap-batch x new sampled tokens (8 x 64 = 512)")
    ap.add_argument("--rl-prompts", type=int, default=32)
    ap.add_argument("--rl-samples", type=int, default=8)
    ap.add_argument("--rl-new", type=int, default=512)
    ap.add_argument("--kv-batch", type=int, default=256)
    ap.add_argument("--kv-len", type=int, default=2048)
    ap.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                    help="a Hugging Face Qwen3-30B-A3B directory (config.json + safetensors shards): the engines run "
                         "on its weights, streamed into NVFP4 layer by layer (default: random weights)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() and args.preset != "tiny":
        raise SystemExit("benchmarks.rollout_full: needs a GPU (the whole model's NVFP4 weights are ~20 GB); "
                         "on a CPU only --preset tiny (a check of this script)")

    from minite_megatron.rollout.resident import resident_bytes
    from minite_megatron.training.presets import PRESETS, init_single_process

    if args.preset not in PRESETS:
        ap.error(f"--preset {args.preset!r} is not one of {sorted(PRESETS)}")
    preset = dict(PRESETS[args.preset])
    if args.layers:
        if args.hf_checkpoint:
            ap.error("--layers cuts a random-weight model; --hf-checkpoint loads the whole checkpoint (drop --layers)")
        preset["layers"] = args.layers
    if args.hf_checkpoint:  # refused before anything is built: the directory, config.json vs the preset, the shards
        from minite_megatron.convert import ConvertError
        from minite_megatron.convert.hf_stream import check_hf_checkpoint

        try:
            check_hf_checkpoint(args.hf_checkpoint, args.preset)
        except ConvertError as e:
            ap.error(f"--hf-checkpoint {args.hf_checkpoint}: {str(e).removeprefix('convert: ')}")
    device = init_single_process(0)
    engines = args.engines.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    accounting = {k: _gib(v) for k, v in resident_bytes(preset).items() if k != "parameters"}
    results = {"benchmark": "rollout_full", "command": "python -m benchmarks.rollout " + " ".join(argv or sys.argv[1:]),
               "preset": args.preset, "layers": preset["layers"], "new_tokens": args.new,
               "weights": os.path.abspath(args.hf_checkpoint) if args.hf_checkpoint else "random (seed 0)",
               "prompt_lengths": [args.prompt_min, args.prompt_max], "accounting_gib": accounting,
               "parameters": resident_bytes(preset)["parameters"], "rows": [], **environment()}
    print("weights (GiB, computed):", accounting, flush=True)
    partial = (args.json or os.path.join(os.path.dirname(__file__), "results", "rollout_full.jsonl")) + ".partial"
    t_start = time.perf_counter()

    def flush():  # the results so far, overwritten after every section (a kill still leaves them)
        os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
        with open(partial, "w") as f:
            f.write(json.dumps(results) + "\n")

    def section(name, fn):
        """Run one section unless the time budget is spent; an error is one row, the rest still runs."""
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            results["rows"].append({"section": name, "skipped": f"time budget {args.budget_s:.0f} s spent ({elapsed:.0f} s)"})
            print(results["rows"][-1], flush=True)
            return
        try:
            fn()
        except (Interrupted, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 -- reported as a row, the next section still runs
            results["rows"].append({"section": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"})
            print(results["rows"][-1], flush=True)
        _free_all()
        flush()

    def engine_section(name):
        def run():
            t0 = time.perf_counter()
            model = resident_model(preset, name == "strict", max(args.kv_len, 1024), device, args.hf_checkpoint)
            _sync()
            build = {"engine": name, "build_s": round(time.perf_counter() - t0, 1),
                     "weights_gib": _gib(_allocated()), "build_peak_gib": _gib(_peak())}
            print(build, flush=True)
            results["rows"].append(build)
            if name == "nvfp4" and args.kv_batch:
                results["rows"].append(kv_peak_row(model, preset, args))
                flush()
            sizes = batches if name == "nvfp4" else [int(b) for b in args.strict_batches.split(",")]
            engine_rows(name, model, preset, args, sizes, gap=True, rl=name == "nvfp4",
                        rows=results["rows"], flush=flush, kernels=name == "nvfp4")
            del model
        return run

    def on_signal(signum, _frame):
        raise Interrupted(signal.Signals(signum).name)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    results["complete"] = False
    try:
        for name in ("nvfp4", "strict"):
            if name in engines:
                _free_all()
                section(name, engine_section(name))
        if "bf16" in engines:
            section("bf16", lambda: results["rows"].extend(bf16_rows(preset, args, device)))
        if "lean" in engines:
            section("lean", lambda: results["rows"].extend(lean_rows(preset, args)))
        results["complete"] = True
    except (Interrupted, KeyboardInterrupt) as e:
        results["interrupted"] = str(e) or type(e).__name__
        print("interrupted:", results["interrupted"], "-- writing the results so far", flush=True)
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)
        results["wall_s"] = round(time.perf_counter() - t_start, 1)
        finish(results, preset, args)
    return results


def finish(results, preset, args):
    """The ratios, the table and the JSON line (also after an interruption: what ran so far)."""
    _free_all()
    by = {(r.get("engine"), r.get("batch")): r for r in results["rows"] if "decode_step_ms" in r}
    ratios = {}
    for b in (1, 8):
        n, s, f = by.get(("nvfp4", b)), by.get(("strict", b)), by.get(("bf16", b))
        if n and s:  # both at the preset's depth
            ratios[f"strict_over_default_b{b}"] = s["decode_step_ms"] / n["decode_step_ms"]
        if f and f.get("layers", preset["layers"]) != preset["layers"]:
            n = by.get(("nvfp4_cut", b))  # the BF16 engine ran at a cut: compare at that depth
        if n and f:
            ratios[f"bf16_over_nvfp4_b{b}"] = f["decode_step_ms"] / n["decode_step_ms"]
        lean = by.get(("lean_bf16", b))
        if lean:  # at the NVFP4 row of the same depth: the preset's, or the BF16 engine's cut
            same = [r for r in (by.get(("nvfp4", b)), by.get(("nvfp4_cut", b)))
                    if r and r.get("layers", preset["layers"]) == lean["layers"]]
            if same:
                ratios[f"lean_bf16_over_nvfp4_b{b}"] = lean["decode_step_ms"] / same[0]["decode_step_ms"]
    results["ratios"] = ratios
    print_table(f"rollout at {args.preset} ({preset['layers']} layers)", [r for r in results["rows"] if "decode_step_ms" in r],
                ["engine", "layers", "batch", "decode_step_ms", "tokens_per_s", "prefill_ms", "peak_gib", "gap_mean_abs",
                 "kernels_per_step", "us_per_kernel"])
    print("ratios:", ratios, flush=True)
    out = save(results, "rollout_full", [os.path.join(os.path.dirname(__file__), "results"),
                                          os.path.dirname(args.json) if args.json else None])
    if args.json and os.path.abspath(args.json) not in {os.path.abspath(o) for o in out}:
        with open(args.json, "a") as f:  # also the file --json names
            f.write(json.dumps(results) + "\n")
        out.append(args.json)
    print("saved", out, flush=True)


if __name__ == "__main__":
    main()
