"""NVFP4 Triton kernels against BF16 (cuBLAS / torch) on one GPU, side by side in one run.

    python -m benchmarks.kernels --sections ceilings,quantize,bitwise,gemm,linear,grouped,memory
    python -m benchmarks.kernels --sections linear,grouped --tokens 16384 --no-naive --out $OUT

Sections (each prints a table; all results are appended as one JSON line to
``benchmarks/results/nvfp4_kernels.jsonl`` and to ``--out``):

* ``ceilings``: device copy bandwidth (bytes read + written) and a BF16 8192^3 GEMM.
* ``quantize``: GB/s of the quantize kernels (minimum bytes: input once, outputs once).
* ``bitwise``: how often the tensor-core GEMM equals the contract's canonical accumulation.
* ``gemm``: fprop image GEMM (default, strict, canonical) vs ``torch.mm`` in BF16.
* ``linear``: Linear fwd+bwd (weight + 4 activation quantizations, 3 GEMMs) vs BF16 and vs
  plain-torch emulation (quantize_reference -> dequantize -> matmul).
* ``grouped``: MoE grouped fwd+bwd at Qwen3-30B-A3B shapes vs ``torch._grouped_mm`` (BF16)
  and vs a per-expert loop.
* ``memory``: bytes a Linear saves for backward, NVFP4 vs BF16.

``--smoke`` runs every section at tiny shapes on the CPU under TRITON_INTERPRET=1 (a check
that the script itself works; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

from . import RESULTS, command
from .._timing import Rotating, bench, ensure_minite_kernels, environment, print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

from minite_megatron import nvfp4  # noqa: E402
from minite_kernels.triton.backend import TritonBackend, TritonOptions  # noqa: E402
from minite_kernels.triton.nvfp4.quantize_tiles import QuantizeTiles  # noqa: E402
from minite_kernels.triton.nvfp4.gemm import gemm_op  # noqa: E402
from minite_kernels.triton.nvfp4.grouped_gemm import group_offsets, grouped_gemm_op  # noqa: E402
from minite_kernels.triton.nvfp4.grouped_wgrad import grouped_wgrad_forward  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402

#: Qwen3-30B-A3B linears as (K, N): attention qkv / o, and the dense-MLP shapes of its config
#: (intermediate 6144; gate+up fused).
DENSE = {"qkv": (2048, 5120), "o": (4096, 2048), "fc1": (2048, 12288), "fc2": (6144, 2048)}
EXPERTS, HIDDEN, EXPERT_FFN, TOPK = 128, 2048, 768, 8

BF16 = torch.bfloat16
SMOKE = False
WARM_ONLY = False
NAIVE = True
DEV = torch.device("cuda")


def timed(fn, graph=False, rep_ms=100):
    if WARM_ONLY:  # compile and run once (parallel warm-up of Triton's cache), time nothing
        fn()
        torch.cuda.synchronize()
        return float("nan")
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return bench(fn, graph=graph, rep_ms=rep_ms)


def timed_graph(fn, rep_ms=100):
    """GPU time of ``fn`` as CUDA-graph replays (no host overhead); NaN (reported) if it cannot be captured."""
    if WARM_ONLY or SMOKE:
        return timed(fn, rep_ms=rep_ms)
    try:
        return timed(fn, graph=True, rep_ms=rep_ms)
    except Exception as e:  # e.g. a host-to-device copy inside: say so, keep going
        print(f"graph capture failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def rnd(*shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ---- ceilings -------------------------------------------------------------------------------
def sec_ceilings(res):
    n = (1 << 16) if SMOKE else (1 << 29)  # 2 GiB fp32
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    copy_gbs = 2 * src.numel() * 4 / t / 1e6
    s = 64 if SMOKE else 8192
    a, b = rnd(s, s), rnd(s, s)
    t2 = timed(lambda: torch.mm(a, b))
    tflops = 2 * s**3 / t2 / 1e9
    res["ceilings"] = {"copy_GBps": copy_gbs, "bf16_gemm_TFLOPs": tflops, "gemm_size": s}
    print_table("ceilings", [res["ceilings"]], ["copy_GBps", "bf16_gemm_TFLOPs", "gemm_size"])
    del src, dst, a, b


# ---- quantize -------------------------------------------------------------------------------
def _qbytes(r, k, image, read_bytes=2):
    return r * k * read_bytes + r * k // 2 + r * k // 16 + (2 * r * k if image else 0) + 4 * r


def sec_quantize(res, sweep):
    copy = res.get("ceilings", {}).get("copy_GBps")
    rows = []
    t_tok = 32 if SMOKE else 16384
    cases = [
        ("act row+image", (t_tok, 2048), dict(with_image=True), False),
        ("act row+image", (t_tok, 5120), dict(with_image=True), False),
        ("act row, codes only", (t_tok, 2048), dict(), False),
        ("act tensor+image (amax pass)", (t_tok, 2048), dict(global_scale="tensor", with_image=True), False),
        ("x.t() tensor+image (wgrad)", (t_tok, 2048), dict(global_scale="tensor", with_image=True), True),
        ("dy.t() tensor+image+SR", (t_tok, 5120), dict(global_scale="tensor", with_image=True,
                                                        rounding="stochastic", seed=7), True),
        ("weight 16x16 tensor+image", (12288 if not SMOKE else 64, 2048 if not SMOKE else 64),
         dict(global_scale="tensor", tile=(16, 16), with_image=True), False),
        ("act row+image RHT", (t_tok, 2048), dict(with_image=True, rht_seed=1), False),
    ]
    for name, (r, k), kw, transposed in cases:
        if SMOKE:
            r, k = 32, 64
        x = rnd(r, k, scale=3.0)
        xin = x.t() if transposed else x
        rr, kk = (k, r) if transposed else (r, k)
        t = timed(lambda: quantize_forward(xin, **kw))
        nbytes = _qbytes(rr, kk, kw.get("with_image", False))
        gbs = nbytes / t / 1e6
        rows.append({"case": name, "rows": rr, "K": kk, "ms": t, "GBps": gbs,
                     "pct_copy": 100 * gbs / copy if copy else None})
    x1 = rnd(1, 64 if SMOKE else 2048)
    t = timed(lambda: quantize_forward(x1, with_image=True), graph=True)
    rows.append({"case": "act row+image, one token (decode)", "rows": 1, "K": 2048, "ms": t})
    if sweep and not SMOKE:
        x = rnd(t_tok, 2048, scale=3.0)
        trials = [("single-pass elems", "single_pass_elems", v, x, {}) for v in (2048, 4096, 16384)]
        trials += [("loop tile (K=2048)", "single_pass_k", 1024, x, {})]
        trials += [("t-kernel tile", "transposed_tile", v, x.t(), dict(global_scale="tensor"))
                   for v in ((32, 64, 4), (64, 64, 8), (32, 128, 4), (64, 128, 8), (128, 64, 8), (16, 128, 4))]
        for label, field, value, xin, kw in trials:  # a backend per setting (TritonOptions.quantize_tiles)
            be = TritonBackend(TritonOptions(quantize_tiles=dataclasses.replace(QuantizeTiles(), **{field: value})))
            try:
                t = timed(lambda: be.quantize(xin, with_image=True, **kw))
                gbs = _qbytes(t_tok, 2048, True) / t / 1e6
                rows.append({"case": f"sweep {label} = {value}", "rows": xin.shape[0], "K": xin.shape[1], "ms": t,
                             "GBps": gbs, "pct_copy": 100 * gbs / copy if copy else None})
            except Exception as e:  # a config that does not compile: report, keep going
                rows.append({"case": f"sweep {label} = {value} FAILED {type(e).__name__}: {str(e)[:60]}"})
    res["quantize"] = rows
    print_table("quantize (minimum bytes / time)", rows, ["case", "rows", "K", "ms", "GBps", "pct_copy"])


# ---- GEMM bitwise statistics ----------------------------------------------------------------
def _ordered(bits: torch.Tensor, width: int) -> torch.Tensor:
    b = bits.to(torch.int64)
    sign = 1 << (width - 1)
    b = torch.where(b < 0, b + (1 << width), b)
    return torch.where(b >= sign, sign - b, b)  # monotone integer line over the floats


def ulp_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    width = out.element_size() * 8
    it = {16: torch.int16, 32: torch.int32}[width]
    d = (_ordered(out.view(it), width) - _ordered(ref.view(it), width)).abs()
    return {"bitwise_frac": float((d == 0).float().mean()), "max_ulp": int(d.max()), "mean_ulp": float(d.float().mean())}


def sec_bitwise(res):
    rows = []
    m = 64 if SMOKE else 4096
    cases = [(name, k, n, "normal") for name, (k, n) in list(DENSE.items())[:2]] + [("qkv", 2048, 5120, "adversarial")]
    for name, k, n, data in cases:
        if SMOKE:
            k, n = 64, 32
        if data == "normal":
            a, b = rnd(m, k, scale=2.0), rnd(n, k)
        else:
            # heavy tails, rows scaled over 2^-20..2^20, and a cancelling +big/-big pair per row
            a = (torch.randn(m, k, device=DEV) / torch.randn(m, k, device=DEV).abs().clamp_min(1e-2))
            a = a * torch.exp2(torch.randint(-20, 21, (m, 1), device=DEV).float())
            a[:, 0] = 1e4 * a[:, 0].sign()
            a[:, 16] = -a[:, 0]
            b = torch.randn(n, k, device=DEV) / torch.randn(n, k, device=DEV).abs().clamp_min(1e-2)
            a, b = a.to(BF16), b.to(BF16)
            name = name + " adversarial"
        qa = quantize_forward(a, with_image=True)
        qb = quantize_forward(b, global_scale="tensor", tile=(16, 16), with_image=True)
        for out_dtype in (torch.float32, BF16):
            ref = nvfp4.gemm_reference(qa, qb, None, out_dtype)
            for mode, bi, can in (("default", False, False), ("strict", True, False), ("canonical", True, True)):
                out = gemm_op(qa.image, qb.image, qa.global_decode, qb.global_decode, None, out_dtype, bi, can)
                rows.append({"shape": f"{name} M={m}", "out": str(out_dtype).split(".")[-1], "mode": mode,
                             **ulp_stats(out, ref)})
    res["bitwise"] = rows
    print_table("tensor-core GEMM vs the contract's canonical accumulation", rows,
                ["shape", "out", "mode", "bitwise_frac", "max_ulp", "mean_ulp"])


# ---- dense GEMM ------------------------------------------------------------------------------
GEMM_SWEEP = [(128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
              (128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 8, 3), (128, 128, 64, 16, 8, 4)]


def sec_gemm_sweep(res, t_tok):
    """The default-mode image GEMM at each launch of :data:`GEMM_SWEEP` (a backend per setting:
    ``TritonOptions.gemm_tile``)."""
    rows = []
    for name, (k, n) in DENSE.items():
        if SMOKE:
            k, n, t_tok = 64, 32, 64
        x, w = rnd(t_tok, k), rnd(n, k)
        qa = quantize_forward(x, with_image=True)
        qb = quantize_forward(w, global_scale="tensor", tile=(16, 16), with_image=True)
        t_bf16 = timed(lambda: torch.mm(x, w.t()))
        row = {"shape": name, "T": t_tok}
        for cfg in GEMM_SWEEP[: 1 if SMOKE else None]:
            backend = TritonBackend(TritonOptions(gemm_tile=cfg))
            try:
                row[str(cfg)] = timed(lambda b=backend: b.gemm(qa, qb)) / t_bf16
            except Exception as e:
                row[str(cfg)] = f"FAILED {type(e).__name__}"
        rows.append(row)
    res["gemm_sweep"] = rows
    print_table("fprop GEMM config sweep, time / BF16 (BM, BN, BK, GROUP_M, warps, stages)", rows,
                ["shape", "T"] + [str(c) for c in GEMM_SWEEP])


def sec_gemm(res, tokens):
    rows = []
    for t_tok in tokens:
        for name, (k, n) in DENSE.items():
            if SMOKE:
                k, n, t_tok = 64, 32, 64
            x, w = rnd(t_tok, k), rnd(n, k)
            qa = quantize_forward(x, with_image=True)
            qb = quantize_forward(w, global_scale="tensor", tile=(16, 16), with_image=True)
            t_bf16 = timed(lambda: torch.mm(x, w.t()))
            row = {"shape": name, "T": t_tok, "bf16_ms": t_bf16,
                   "bf16_TFLOPs": 2 * t_tok * n * k / t_bf16 / 1e9}
            for mode, bi, can in (("default", False, False), ("strict", True, False), ("canonical", True, True)):
                if can and t_tok != tokens[0]:
                    continue
                t = timed(lambda: gemm_op(qa.image, qb.image, qa.global_decode, qb.global_decode, None, BF16, bi, can))
                row[f"{mode}_x"] = t / t_bf16
            rows.append(row)
    res["gemm"] = rows
    print_table("fprop image GEMM, time / BF16 torch.mm time", rows,
                ["shape", "T", "bf16_ms", "bf16_TFLOPs", "default_x", "strict_x", "canonical_x"])


# ---- Linear fwd+bwd ---------------------------------------------------------------------------
def nvfp4_linear_fwd_bwd(x, w, dy, strict=False):
    """The NVFP4 full-update Linear on the Triton ops (what ops.linear does, without autograd):
    x row scale, dy row scale, x.t() tensor scale, dy.t() tensor scale + SR (runs 1-3's step)."""
    qw = quantize_forward(w, global_scale="tensor", tile=(16, 16), with_image=True)
    qx = quantize_forward(x, with_image=True)
    y = gemm_op(qx.image, qw.image, qx.global_decode, qw.global_decode, None, BF16, strict, False)
    qx_t = quantize_forward(x.t(), global_scale="tensor", with_image=True)
    qdy = quantize_forward(dy, with_image=True)
    dx = gemm_op(qdy.image, qw.image.t(), qdy.global_decode, qw.global_decode, None, BF16, strict, False)
    qdy_t = quantize_forward(dy.t(), global_scale="tensor", with_image=True, rounding="stochastic", seed=1)
    dw = gemm_op(qdy_t.image, qx_t.image, qdy_t.global_decode, qx_t.global_decode, None, torch.float32, strict, False)
    return y, dx, dw


def recipe_linear_fwd_bwd(x, w, dy):
    """The default recipe's step (minite_megatron.recipe.Recipe()): x row scale; dy tensor
    scale + SR (dgrad); x.t() and dy.t() tensor scale + the RHT (wgrad; dy.t() with SR)."""
    qw = quantize_forward(w, global_scale="tensor", tile=(16, 16), with_image=True)
    qx = quantize_forward(x, with_image=True)
    y = gemm_op(qx.image, qw.image, qx.global_decode, qw.global_decode, None, BF16, False, False)
    qx_t = quantize_forward(x.t(), global_scale="tensor", with_image=True, rht_seed=0)
    qdy = quantize_forward(dy, global_scale="tensor", with_image=True, rounding="stochastic", seed=2)
    dx = gemm_op(qdy.image, qw.image.t(), qdy.global_decode, qw.global_decode, None, BF16, False, False)
    qdy_t = quantize_forward(dy.t(), global_scale="tensor", with_image=True, rounding="stochastic", seed=1, rht_seed=0)
    dw = gemm_op(qdy_t.image, qx_t.image, qdy_t.global_decode, qx_t.global_decode, None, torch.float32, False, False)
    return y, dx, dw


def ops_linear_step():
    """The real op (``minite_megatron.ops.linear``, default recipe, autograd) as a closure
    ``(x, w, dy) -> (dx, dw)``; the weight's quantization is cached as in training."""
    from minite_megatron.ops.linear import LinearContext, nvfp4_linear
    from minite_megatron.ops.weight_cache import QuantizedWeightCache
    from minite_megatron.recipe import Recipe

    lctx = LinearContext(Recipe(), QuantizedWeightCache())

    def step(x, w, dy):
        y = nvfp4_linear(x, w, None, lctx)
        return torch.autograd.grad(y, (x, w), dy)
    return step


def linear_floor_bytes(t, k, n):
    """The fewest HBM bytes the quantize passes of the default recipe's step can move with
    image GEMMs: x read twice (the x.t() RHT amax, then one pass writing row codes + scales +
    image and column codes + scales), dy likewise (amax, then both operands with images)."""
    return t * k * (2 + 2 + 2.5625 + 0.5625) + t * n * (2 + 2 + 2 * 2.5625)


def naive_linear_fwd_bwd(x, w, dy):
    """Plain-torch emulation: quantize_reference -> dequantize -> bf16 matmul, per GEMM."""
    deq = lambda t, **kw: nvfp4.quantize_reference(t, **kw).dequantize(BF16)  # noqa: E731
    wq = deq(w, global_scale="tensor", tile=(16, 16))
    y = deq(x) @ wq.t()
    dx = deq(dy) @ wq
    dw = deq(dy.t(), global_scale="tensor", rounding="stochastic", seed=1) @ deq(x.t(), global_scale="tensor").t()
    return y, dx, dw


def sec_linear(res, tokens):
    rows = []
    for t_tok in tokens:
        for name, (k, n) in DENSE.items():
            if SMOKE:
                k, n, t_tok = 64, 32, 64
            x, w, dy = rnd(t_tok, k), rnd(n, k, scale=0.02), rnd(t_tok, n)
            bf16 = lambda: (torch.mm(x, w.t()), torch.mm(dy, w), torch.mm(dy.t(), x))  # noqa: E731
            fp4 = lambda: nvfp4_linear_fwd_bwd(x, w, dy)  # noqa: E731
            rec = lambda: recipe_linear_fwd_bwd(x, w, dy)  # noqa: E731
            # GPU time (graph replays) first; eager (host overhead included) as the earlier runs
            t_bf16, t_fp4, t_rec = timed_graph(bf16), timed_graph(fp4), timed_graph(rec)
            row = {"shape": name, "T": t_tok, "bf16_ms": t_bf16, "nvfp4_ms": t_fp4, "nvfp4_over_bf16": t_fp4 / t_bf16,
                   "recipe_ms": t_rec, "recipe_over_bf16": t_rec / t_bf16}
            xg = x.detach().clone().requires_grad_(True)
            wg = torch.nn.Parameter(w.detach().clone())
            op = ops_linear_step()
            t_ops = timed_graph(lambda: op(xg, wg, dy))
            copy = res.get("ceilings", {}).get("copy_GBps", float("nan"))
            row.update({"ops_ms": t_ops, "ops_over_bf16": t_ops / t_bf16,
                        "quantize_floor_ms": linear_floor_bytes(t_tok, k, n) / copy / 1e6})
            e_bf16, e_fp4, e_rec = timed(bf16), timed(fp4), timed(rec)
            row.update({"eager_bf16_ms": e_bf16, "eager_nvfp4_over_bf16": e_fp4 / e_bf16,
                        "eager_recipe_over_bf16": e_rec / e_bf16})
            if t_tok == tokens[0]:
                if NAIVE:
                    t_naive = timed(lambda: naive_linear_fwd_bwd(x, w, dy), rep_ms=200)
                    row["naive_ms"] = t_naive
                    row["speedup_vs_naive"] = t_naive / t_fp4
                # where the time goes: the quantize passes vs the three GEMMs
                qx = quantize_forward(x, with_image=True)
                qw = quantize_forward(w, global_scale="tensor", tile=(16, 16), with_image=True)
                qdy = quantize_forward(dy, with_image=True)
                qdy_t = quantize_forward(dy.t(), global_scale="tensor", with_image=True)
                qx_t = quantize_forward(x.t(), global_scale="tensor", with_image=True)
                row["q_x"] = timed_graph(lambda: quantize_forward(x, with_image=True))
                row["q_xt"] = timed_graph(lambda: quantize_forward(x.t(), global_scale="tensor", with_image=True))
                row["q_dy"] = timed_graph(lambda: quantize_forward(dy, with_image=True))
                row["q_dyt_sr"] = timed_graph(lambda: quantize_forward(dy.t(), global_scale="tensor", with_image=True,
                                                                 rounding="stochastic", seed=1))
                row["q_w"] = timed_graph(lambda: quantize_forward(w, global_scale="tensor", tile=(16, 16), with_image=True))
                row["q_xt_rht"] = timed_graph(lambda: quantize_forward(x.t(), global_scale="tensor", with_image=True,
                                                                 rht_seed=0))
                row["q_dy_tensor_sr"] = timed_graph(lambda: quantize_forward(dy, global_scale="tensor", with_image=True,
                                                                       rounding="stochastic", seed=2))
                row["q_dyt_sr_rht"] = timed_graph(lambda: quantize_forward(dy.t(), global_scale="tensor", with_image=True,
                                                                     rounding="stochastic", seed=1, rht_seed=0))
                row["gemms_only_ms"] = timed_graph(lambda: (
                    gemm_op(qx.image, qw.image, qx.global_decode, qw.global_decode, None, BF16, False, False),
                    gemm_op(qdy.image, qw.image.t(), qdy.global_decode, qw.global_decode, None, BF16, False, False),
                    gemm_op(qdy_t.image, qx_t.image, qdy_t.global_decode, qx_t.global_decode, None,
                            torch.float32, False, False)))
                row["floor_over_bf16"] = (row["gemms_only_ms"] + row["quantize_floor_ms"]) / t_bf16
            rows.append(row)
    res["linear"] = rows
    print_table("Linear fwd+bwd, GPU time (graph replays; weight + 4 activation quantizations "
                "+ 3 GEMMs)", rows, ["shape", "T", "bf16_ms", "nvfp4_ms", "nvfp4_over_bf16",
                                     "gemms_only_ms", "eager_bf16_ms", "eager_nvfp4_over_bf16", "naive_ms",
                                     "speedup_vs_naive"])
    print_table("Linear fwd+bwd, the default recipe (dy tensor+SR, wgrad operands RHT), GPU time", rows,
                ["shape", "T", "bf16_ms", "recipe_ms", "recipe_over_bf16",
                 "eager_recipe_over_bf16"])
    print_table("Linear fwd+bwd through the real op (ops.linear, default recipe, autograd, weight cached), GPU time; "
                "floor = 3 GEMMs + the quantize bytes at copy bandwidth", rows,
                ["shape", "T", "bf16_ms", "ops_ms", "ops_over_bf16",
                 "quantize_floor_ms", "floor_over_bf16"])
    print_table("Linear: the quantize passes and the 3 GEMMs alone (ms, graph replays)", [r for r in rows if "q_x" in r],
                ["shape", "T", "q_x", "q_xt", "q_dy", "q_dyt_sr", "q_w", "q_xt_rht", "q_dy_tensor_sr", "q_dyt_sr_rht",
                 "gemms_only_ms"])


# ---- grouped (MoE) ---------------------------------------------------------------------------
def routing(tokens, experts, topk, skew, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(experts, generator=g) * skew
    probs = torch.softmax(logits, 0)
    choice = torch.multinomial(probs.expand(tokens, experts), topk, replacement=False, generator=g)
    return torch.bincount(choice.reshape(-1), minlength=experts).tolist()


def sec_grouped(res, tokens_list):
    rows = []
    for tokens in tokens_list:
        for name, (k, n) in {"fc1": (HIDDEN, 2 * EXPERT_FFN), "fc2": (EXPERT_FFN, HIDDEN)}.items():
            e = 8 if SMOKE else EXPERTS
            if SMOKE:
                k, n, tokens = 64, 32, 16
            sizes = routing(tokens, e, min(TOPK, e), skew=1.0)
            m = sum(sizes)
            offs = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
            x, dy = rnd(m, k), rnd(m, n)
            w = rnd(e, n, k, scale=0.02)
            offsets = group_offsets(sizes, DEV)
            w_kn = w.transpose(1, 2)

            def bf16_grouped():
                y = torch._grouped_mm(x, w_kn, offs=offs)
                dx = torch._grouped_mm(dy, w, offs=offs)
                dw = torch._grouped_mm(dy.t(), x, offs=offs)
                return y, dx, dw

            def bf16_loop():
                outs = []
                for xs, dys, wg in zip(torch.split(x, sizes), torch.split(dy, sizes), w):
                    outs += [xs @ wg.t(), dys @ wg, dys.t() @ xs]
                return outs

            def fp4_grouped():
                qw = quantize_forward(w, global_scale="group", tile=(16, 16), with_image=True)
                qx = quantize_forward(x, with_image=True)
                y = grouped_gemm_op(qx.image, qw.image, offsets, qx.global_decode, qw.global_decode, None, BF16, False, False)
                qdy = quantize_forward(dy, with_image=True)
                dx = grouped_gemm_op(qdy.image, qw.image.transpose(1, 2), offsets, qdy.global_decode, qw.global_decode,
                                     None, BF16, False, False)
                dw = grouped_wgrad_forward(dy, x, sizes, grad_rounding="stochastic", grad_seed=3)
                return y, dx, dw

            row = {"shape": name, "routed": m, "max_group": max(sizes), "empty": sizes.count(0)}
            flops = 3 * 2 * m * n * k
            qw0 = quantize_forward(w, global_scale="group", tile=(16, 16), with_image=True)
            qx0 = quantize_forward(x, with_image=True)
            qdy0 = quantize_forward(dy, with_image=True)
            row["t_wquant"] = timed(lambda: quantize_forward(w, global_scale="group", tile=(16, 16), with_image=True))
            row["t_xquant"] = timed(lambda: quantize_forward(x, with_image=True))
            row["t_fprop"] = timed(lambda: grouped_gemm_op(qx0.image, qw0.image, offsets, qx0.global_decode,
                                                           qw0.global_decode, None, BF16, False, False))
            row["t_dgrad"] = timed(lambda: grouped_gemm_op(qdy0.image, qw0.image.transpose(1, 2), offsets,
                                                           qdy0.global_decode, qw0.global_decode, None, BF16, False, False))
            row["t_wgrad_all"] = timed(lambda: grouped_wgrad_forward(dy, x, sizes, grad_rounding="stochastic", grad_seed=3))
            # the default recipe's wgrad: the RHT fused into the gather-quantize of both operands
            row["t_wgrad_all_rht"] = timed(lambda: grouped_wgrad_forward(dy, x, sizes, grad_rounding="stochastic",
                                                                         grad_seed=3, rht_seed=0))
            try:
                t_g = timed(bf16_grouped)
                row["bf16_grouped_ms"] = t_g
                row["bf16_grouped_TFLOPs"] = flops / t_g / 1e9
            except Exception as ex:  # torch._grouped_mm not available for this layout: say so
                row["bf16_grouped_ms"] = f"n/a ({type(ex).__name__})"
                t_g = None
            t_l = timed(bf16_loop)
            t_f = timed(fp4_grouped)
            row.update({"bf16_loop_ms": t_l, "nvfp4_ms": t_f, "nvfp4_TFLOPs": flops / t_f / 1e9,
                        "throughput_vs_grouped_mm": (t_g / t_f) if t_g else None, "speedup_vs_loop": t_l / t_f})
            rows.append(row)
    res["grouped"] = rows
    print_table("MoE grouped fwd+bwd (NVFP4 includes every quantization)", rows,
                ["shape", "routed", "max_group", "empty", "bf16_grouped_ms", "bf16_loop_ms", "nvfp4_ms",
                 "throughput_vs_grouped_mm", "speedup_vs_loop", "nvfp4_TFLOPs"])
    print_table("MoE grouped: where the NVFP4 time goes (ms)", rows,
                ["shape", "t_wquant", "t_xquant", "t_fprop", "t_dgrad", "t_wgrad_all", "t_wgrad_all_rht"])


# ---- memory ---------------------------------------------------------------------------------------
def sec_memory(res):
    rows = []
    for t_tok in (8192, 32768) if not SMOKE else (64,):
        for name, (k, n) in DENSE.items():
            if SMOKE:
                k, n = 64, 32
            x = rnd(t_tok, k)
            qx_t = quantize_forward(x.t(), global_scale="tensor")  # what the NVFP4 Linear saves
            saved = qx_t.codes.nbytes + qx_t.block_scales.nbytes + qx_t.global_decode.nbytes
            rows.append({"shape": name, "T": t_tok, "bf16_MB": x.nbytes / 2**20, "nvfp4_MB": saved / 2**20,
                         "saved_MB": (x.nbytes - saved) / 2**20, "ratio": x.nbytes / saved})
    res["memory"] = rows
    print_table("activation bytes saved for backward per Linear (x: BF16 copy vs NVFP4 column-wise codes+scales)",
                rows, ["shape", "T", "bf16_MB", "nvfp4_MB", "saved_MB", "ratio"])


SECTIONS = ("ceilings", "quantize", "bitwise", "gemm_sweep", "gemm", "linear", "grouped", "memory")
# the decode GEMMs (dense and MoE, default and strict) have their own script: benchmarks/decode_gemm.py


def parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--tokens", default="8192,16384,32768", help="token counts of the gemm/linear sections")
    p.add_argument("--grouped-tokens", default="8192", help="tokens before top-8 routing")
    p.add_argument("--sweep", action="store_true", help="also sweep quantize tile configs")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--warm-only", action="store_true", help="run every timed function once (fill Triton's cache)")
    p.add_argument("--no-naive", action="store_true", help="skip the plain-torch emulation in the linear section")
    return p


def main(argv=None):
    global SMOKE, DEV, WARM_ONLY, NAIVE
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    SMOKE = args.smoke
    WARM_ONLY = args.warm_only
    NAIVE = not args.no_naive
    if SMOKE:
        DEV = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.kernels (nvfp4 sections) needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    torch.manual_seed(0)
    res = {"env": environment(), "command": command(argv), "smoke": SMOKE}
    tokens = [int(t) for t in args.tokens.split(",")]
    for sec in args.sections.split(","):
        t0 = time.time()
        if sec == "ceilings":
            sec_ceilings(res)
        elif sec == "quantize":
            sec_quantize(res, args.sweep)
        elif sec == "bitwise":
            sec_bitwise(res)
        elif sec == "gemm":
            sec_gemm(res, tokens)
        elif sec == "gemm_sweep":
            sec_gemm_sweep(res, tokens[0])
        elif sec == "linear":
            sec_linear(res, tokens)
        elif sec == "grouped":
            sec_grouped(res, [int(t) for t in args.grouped_tokens.split(",")])
        elif sec == "memory":
            sec_memory(res)
        else:
            raise SystemExit(f"unknown section {sec!r}; known: {', '.join(SECTIONS)}")
        print(f"[{sec}: {time.time() - t0:.1f} s]", flush=True)
    if not SMOKE and not WARM_ONLY:
        print("saved:", save(res, "nvfp4_kernels", [RESULTS, args.out]))
    return res


if __name__ == "__main__":
    main()
