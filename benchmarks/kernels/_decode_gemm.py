"""Decode GEMMs on packed FP4 weights vs BF16 cuBLAS: tables and launch sweeps.

    python -m benchmarks.kernels --sections decode_dense,decode_grouped --out $OUT
    python -m benchmarks.kernels --sections decode_sweep,decode_dense --decode-m 1,4,16 --no-act-quant
    python -m benchmarks.kernels --sections decode_dense --warm-only --shard 3/8   # compile only (parallel)

Sections (one JSON line per run in ``benchmarks/results/decode_gemm.jsonl`` and ``--out``):

* ``decode_sweep``: default-configuration sweep (BLOCK_N, BLOCK_K, warps, stages, programs per SM)
  on qkv / o / fc2 at M = 1, 16; each configuration's output within
  ``nvfp4.fp32_accumulation_bound``; the best per padded M is also timed by ``decode_dense``.
* ``decode_dense``: every Qwen3 shape x M = 1..64: BF16 ``torch.mm`` vs NVFP4 decode (default,
  strict, and default with the activation's quantization), CUDA-graph replays, weights rotated
  through more than 4x the L2 so HBM is measured; effective weight GB/s and % of copy bandwidth.
* ``decode_grouped``: MoE decode, batch 1 / 8 / 64 tokens x top-8 of 128 experts, fc1 and fc2:
  BF16 ``torch._grouped_mm`` on the selected experts (rows already sorted: its permutation is
  not timed) vs NVFP4 ``decode_grouped_gemm`` (unsorted rows, routing included).
* ``decode_grouped_sweep``: the grouped decode kernel's launch parameters (tile, warps, K steps in
  flight, K steps per program) at the same shapes and routings, each against the strict result.
* ``decode_idot_sweep`` / ``decode_idot_dense``: the integer-dot kernels (grouped and dense).

The strict decode kernels' bits (equal to the learner's strict GEMMs) are checked by
``tests/kernels/test_decode_strict_bitwise_gpu.py``, not here.
``--smoke``: tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

from . import RESULTS, command
from .._timing import bench, copy_bandwidth_gbps, ensure_minite_kernels, environment, print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

from minite_megatron import nvfp4  # noqa: E402
from minite_kernels.triton.decode import decode_gemm as td  # noqa: E402
from minite_kernels.triton.decode import decode_grouped_gemm as tg  # noqa: E402
from minite_kernels.triton.decode import decode_grouped_idot as ti  # noqa: E402
from minite_kernels.triton.nvfp4.gemm import gemm_forward  # noqa: E402
from minite_kernels.triton.nvfp4.grouped_gemm import grouped_gemm_forward  # noqa: E402
from minite_kernels.triton.nvfp4.quantize import quantize_forward  # noqa: E402

#: Qwen3 (30B-A3B / qwen3-moe preset) decode GEMMs as (K, N).
SHAPES = {"qkv": (2048, 5120), "o": (4096, 2048), "expert_fc1": (2048, 1536), "expert_fc2": (768, 2048),
          "lm_head_32k": (2048, 32768), "lm_head_152k": (2048, 151936)}
EXPERTS, TOPK = 128, 8
BF16 = torch.bfloat16
L2_BYTES = 60 * 2**20
SMOKE = False
WARM_ONLY = False
ACT_QUANT = True
IMAGE_GEMM = True
DENSE = list(SHAPES)
STRICT_MAX_K = 0  # dense table: time strict only where K <= this (0: every K)
SHARD = (0, 1)
DEADLINE = float("inf")
GROUPED_TOKENS = (1, 8, 64)
IDOT_ENTRIES = None  # idot_sweep: the first this many entries (None: all)
DEV = torch.device("cuda")

#: default-configuration sweep: tile, warps, K steps in flight (DEPTH), most steps per program
#: (MAX_CHUNKS), programs per SM the K split aims for (cfg0 = decode_gemm.GPU_DECODE)
def _d(bn, bk, warps, depth, max_chunks, per_sm, min_m_pad=16):
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, DEPTH=depth, MAX_CHUNKS=max_chunks, per_sm=per_sm,
                min_m_pad=min_m_pad)


SWEEP = [dict(td.GPU_DECODE), _d(64, 128, 4, 8, 8, 1), _d(64, 128, 4, 2, 2, 4), _d(64, 128, 4, 4, 8, 1),
         _d(64, 64, 4, 8, 8, 2), _d(128, 128, 8, 4, 4, 2)]

_counter = itertools.count()


def _name(cfg) -> str:
    short = {"BLOCK_N": "bn", "BLOCK_K": "bk", "num_warps": "w", "DEPTH": "d", "MAX_CHUNKS": "mc", "per_sm": "psm",
             "M_PAD": "mpad", "min_m_pad": "minpad", "NCHUNK": "nch", "SPLIT": "split"}
    return " ".join(f"{short.get(k, k)}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def mine() -> bool:
    """In a sharded warm-up, is the next measurement this shard's?"""
    return next(_counter) % SHARD[1] == SHARD[0]


def timed(fn) -> float:
    """Milliseconds of ``fn`` as CUDA-graph replays (NaN in a warm-up: compile only)."""
    if WARM_ONLY or SMOKE:
        t = time.perf_counter()
        try:
            fn()
        except ConfigFailed:
            return float("nan")
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return float("nan") if WARM_ONLY else (time.perf_counter() - t) * 1e3
    if time.monotonic() > DEADLINE:
        return float("nan")
    try:
        return bench(fn, graph=True, rep_ms=60)
    except ConfigFailed:
        return float("nan")
    except Exception as e:  # say so and go on
        print(f"graph timing failed ({type(e).__name__}: {str(e)[:120]})", flush=True)
        torch.cuda.synchronize()
        return float("nan")


def rnd(*shape, scale=1.0):
    return torch.randn(*shape, device=DEV) * scale


def adversarial(*shape):
    """Normal values times 2^U(-12, 12) per element: wide magnitudes within every row and block."""
    return torch.randn(*shape, device=DEV) * torch.exp2(torch.randint(-12, 13, shape, device=DEV).float())


def weights(n, k, copies, data=rnd):
    return [quantize_forward(data(n, k) * 0.02, global_scale="tensor", tile=(16, 16)) for _ in range(copies)]


def copies_for(nbytes: int) -> int:
    return 1 if SMOKE else max(2, -(-4 * L2_BYTES // nbytes))


def default_cfg(entry, m, n, k, sms):
    return td.default_config(m, n, k, sms, entry)


class ConfigFailed(Exception):
    """A configuration that does not compile or launch here (resources): recorded, not fatal."""


def run_decode(qx, q, cfg, out_dtype=BF16, out=None):
    out = torch.empty(qx.rows, q.rows, dtype=out_dtype, device=qx.codes.device) if out is None else out
    try:
        td.launch_decode_gemm(qx.image, q.codes, q.block_scales.view(torch.uint8), qx.global_decode.reshape(-1),
                              q.global_decode.reshape(-1), None, out, cfg)
    except Exception as e:  # compile / resource errors of one variant must not end the run
        print(f"config {_name(cfg)} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        raise ConfigFailed(_name(cfg)) from e
    return out


def try_decode(*args, **kw):
    """:func:`run_decode`, or None where the configuration failed (already reported)."""
    try:
        return run_decode(*args, **kw)
    except ConfigFailed:
        return None


def sms() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else 1


# ---- helpers -------------------------------------------------------------------------------------
def _bits_differ(a, b) -> int:
    return int((a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int16)
                != b.contiguous().view(torch.int32 if b.dtype == torch.float32 else torch.int16)).sum())


def within_bound(got, qa, qw):
    """(every element within ``fp32_accumulation_bound`` + one rounding to ``got``'s dtype, max
    error / tolerance)."""
    exact, bound = nvfp4.fp32_accumulation_bound(qa, qw)
    err = (got.double() - exact).abs()
    half_ulp = 2.0**-24 if got.dtype == torch.float32 else 2.0**-8
    tol = bound * (1 + 2 * half_ulp) + half_ulp * (exact.abs() + bound)
    return bool((err <= tol).all()), float((err / (tol + 1e-300)).max())



# ---- sweep ----------------------------------------------------------------------------------------
def sec_sweep(res):
    """Time every SWEEP entry on qkv / o / fc2 at M = 1 and 16; each timed configuration's
    output is checked on the same data (within the fp32 accumulation bound), and only valid ones
    can be chosen (the strict configuration's bits are a test's:
    ``tests/kernels/test_decode_strict_bitwise_gpu.py``)."""
    rows = []
    times = {}
    for name in ("qkv", "o", "expert_fc2"):
        k, n = (64, 32) if SMOKE else SHAPES[name]
        qws = weights(n, k, copies_for(n * k // 2))
        ref_img = quantize_forward(rnd(n, k) * 0.02, global_scale="tensor", tile=(16, 16), with_image=True)
        for m in (1, 16):
            qx = quantize_forward(rnd(m, k), with_image=True)
            outs = torch.empty(m, n, dtype=BF16, device=DEV)
            row = {"shape": name, "M": m}
            for i, entry in enumerate(SWEEP[:2] if SMOKE else SWEEP):
                if not mine():
                    continue
                cfg = default_cfg(entry, m, n, k, sms())
                t = timed(lambda: [run_decode(qx, q, cfg, out=outs) for q in qws]) / len(qws)
                try:
                    got = run_decode(qx, ref_img, cfg)
                except ConfigFailed:
                    got = None
                if not WARM_ONLY:
                    ok = got is not None and within_bound(got, qx, ref_img)[0]
                    row[f"cfg{i}_ok"] = ok
                    t = t if ok else float("nan")
                row[f"cfg{i}_us"] = 1e3 * t
                times.setdefault(i, []).append(t)
            rows.append(row)
    scores = {i: torch.tensor(ts).log().mean().item() for i, ts in times.items() if ts and all(t == t for t in ts)}
    chosen = SWEEP[min(scores, key=scores.get)] if scores else None
    res["sweep"] = {"configs": SWEEP, "rows": rows, "chosen": chosen}
    print("sweep configs:", {f"cfg{i}": _name(c) for i, c in enumerate(SWEEP)})
    print_table("default decode config sweep (us per GEMM; NaN: outside the bound or not timed)", rows,
                ["shape", "M"] + [f"cfg{i}_us" for i in range(len(SWEEP))])
    print("chosen:", _name(chosen) if chosen else None)
    return chosen


# ---- dense table ----------------------------------------------------------------------------------
def sec_dense(res, ms, chosen, copy_gbps):
    """Every Qwen3 shape: BF16 torch.mm vs the decode kernel in the code's configurations
    (``select_config``: what the backend runs) and, where the sweep chose another, that one too.
    The first weight copy's outputs are checked (default: the bound; strict: the learner's bits)."""
    rows = []
    for name in DENSE:
        k, n = (64, 32) if SMOKE else SHAPES[name]
        nb = copies_for(n * k * 2)
        ws = [rnd(n, k, scale=0.02).to(BF16) for _ in range(nb)]
        qws = weights(n, k, copies_for(n * k // 2))
        wbytes = n * k // 2 + n * k // 16
        check_w = quantize_forward(rnd(n, k) * 0.02, global_scale="tensor", tile=(16, 16), with_image=True)
        qws_img = ([quantize_forward(rnd(n, k) * 0.02, global_scale="tensor", tile=(16, 16), with_image=True)
                    for _ in range(copies_for(n * k * 2))] if IMAGE_GEMM else [])
        img_scales = [q.global_decode.reshape(-1) for q in qws_img]
        for m in ms:
            x = rnd(m, k).to(BF16)
            qx = quantize_forward(x, with_image=True)
            cfg = td.select_config(m, n, k, sms(), False)
            scfg = td.select_config(m, n, k, sms(), True)
            alt = default_cfg(chosen, m, n, k, sms()) if chosen else None
            out = torch.empty(m, n, dtype=BF16, device=DEV)
            row = {"shape": name, "K": k, "N": n, "M": m, "config": _name(cfg), "strict_config": _name(scfg)}
            if mine():
                row["bf16_us"] = 1e3 * timed(lambda: [torch.mm(x, w.t()) for w in ws]) / len(ws)
            if mine():
                row["nvfp4_us"] = 1e3 * timed(lambda: [run_decode(qx, q, cfg, out=out) for q in qws]) / len(qws)
                got = try_decode(qx, check_w, cfg)
                if not WARM_ONLY and got is not None:
                    row["within_bound"] = within_bound(got, qx, check_w)[0]
            if mine() and (not STRICT_MAX_K or k <= STRICT_MAX_K):
                row["strict_us"] = 1e3 * timed(lambda: [run_decode(qx, q, scfg, out=out) for q in qws]) / len(qws)
                got = try_decode(qx, check_w, scfg)
                if not WARM_ONLY and got is not None:
                    learner = gemm_forward(qx.image, check_w.image, qx.global_decode, check_w.global_decode, None, BF16,
                                           batch_invariant=True)
                    row["strict_bits_differ"] = _bits_differ(got, learner)
            if mine() and IMAGE_GEMM:
                # the backend's path without the decode kernel: the image GEMM on bf16 weight images
                imgs = [q.image for q in qws_img]
                row["image_gemm_us"] = 1e3 * timed(lambda: [gemm_forward(qx.image, im, qx.global_decode, sb, None, BF16)
                                                           for im, sb in zip(imgs, img_scales)]) / len(imgs)
                row["image_strict_us"] = 1e3 * timed(lambda: [gemm_forward(qx.image, im, qx.global_decode, sb, None, BF16,
                                                                           batch_invariant=True)
                                                              for im, sb in zip(imgs, img_scales)]) / len(imgs)
            if alt is not None and _name(alt) != _name(cfg) and mine():
                row["chosen_config"] = _name(alt)
                row["chosen_us"] = 1e3 * timed(lambda: [run_decode(qx, q, alt, out=out) for q in qws]) / len(qws)
            if mine() and ACT_QUANT:
                def with_quant():
                    for q in qws:
                        qa = quantize_forward(x, with_image=True)
                        run_decode(qa, q, cfg, out=out)
                row["with_act_quant_us"] = 1e3 * timed(with_quant) / len(qws)
            if not WARM_ONLY and "nvfp4_us" in row and "bf16_us" in row:
                row["speedup"] = row["bf16_us"] / row["nvfp4_us"]
                row["strict_speedup"] = row["bf16_us"] / row.get("strict_us", float("nan"))
                row["strict_over_default"] = row.get("strict_us", float("nan")) / row["nvfp4_us"]
                row["nvfp4_weight_GBps"] = wbytes / row["nvfp4_us"] / 1e3
                row["pct_of_copy_bw"] = 100 * row["nvfp4_weight_GBps"] / copy_gbps if copy_gbps else None
                row["bf16_weight_GBps"] = n * k * 2 / row["bf16_us"] / 1e3
                if "image_gemm_us" in row:
                    row["decode_vs_image_gemm"] = row["image_gemm_us"] / row["nvfp4_us"]
                    row["strict_vs_image_strict"] = row["image_strict_us"] / row.get("strict_us", float("nan"))
            rows.append(row)
        del ws, qws, qws_img
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    res["dense"] = rows
    print_table("decode GEMM per call (CUDA-graph replays; weights rotated through > 4x L2)", rows,
                ["shape", "M", "bf16_us", "nvfp4_us", "speedup", "within_bound", "strict_us", "strict_over_default",
                 "strict_bits_differ", "image_gemm_us", "image_strict_us", "chosen_us", "nvfp4_weight_GBps",
                 "pct_of_copy_bw", "bf16_weight_GBps"])


IDOT_DENSE_SHAPES = ("qkv", "o", "expert_fc1", "lm_head_32k")


def sec_idot_dense(res, ms):
    """Dense decode GEMMs on the integer-dot kernel (``decode_idot_gemm_forward``) vs the
    tensor-core decode kernel's default configuration and BF16 ``torch.mm`` (weights rotated
    through > 4x the L2, CUDA-graph replays) at the Qwen3 shapes and M rows; per case the fp32
    output's max error against the strict result (relative to its largest value) and whether
    every row equals that row alone (row invariance)."""
    rows = []
    for name in IDOT_DENSE_SHAPES:
        k, n = (64, 32) if SMOKE else SHAPES[name]
        ws = [rnd(n, k, scale=0.02).to(BF16) for _ in range(copies_for(n * k * 2))]
        qws = weights(n, k, copies_for(n * k // 2))
        wbytes = n * k // 2 + n * k // 16
        for m in ms:
            if not mine():
                continue
            x = rnd(m, k).to(BF16)
            qx = quantize_forward(x, with_image=True)
            xc, xs, xg = qx.codes, qx.linear_scales().contiguous().view(torch.uint8), qx.global_decode.reshape(-1)
            cfg = td.select_config(m, n, k, sms(), False)
            out = torch.empty(m, n, dtype=BF16, device=DEV)
            row = {"shape": name, "K": k, "N": n, "M": m}

            def idot(q):
                return ti.decode_idot_gemm_forward(xc, xs, xg, q.codes, q.block_scales.view(torch.uint8),
                                                   q.global_decode.reshape(-1))
            q0 = qws[0]
            strict = td.decode_gemm_forward(qx.image, q0.codes, q0.block_scales.view(torch.uint8), xg,
                                            q0.global_decode.reshape(-1), None, torch.float32, True)
            got32 = ti.decode_idot_gemm_forward(xc, xs, xg, q0.codes, q0.block_scales.view(torch.uint8),
                                                q0.global_decode.reshape(-1), out_dtype=torch.float32)
            row["max_err_fp32"] = float((got32 - strict).abs().max() / strict.abs().max().clamp_min(1e-30))
            got = idot(q0)
            alone = torch.cat([ti.decode_idot_gemm_forward(xc[r: r + 1], xs[r: r + 1], xg[r: r + 1], q0.codes,
                                                           q0.block_scales.view(torch.uint8), q0.global_decode.reshape(-1))
                               for r in range(m)])
            row["rows_alone_bits_differ"] = _bits_differ(got, alone)
            if DEV.type == "cuda" and not WARM_ONLY:
                row["bf16_us"] = 1e3 * timed(lambda: [torch.mm(x, w.t()) for w in ws]) / len(ws)
                row["tc_decode_us"] = 1e3 * timed(lambda: [run_decode(qx, q, cfg, out=out) for q in qws]) / len(qws)
                row["idot_us"] = 1e3 * timed(lambda: [idot(q) for q in qws]) / len(qws)
                row["idot_speedup_vs_bf16"] = row["bf16_us"] / row["idot_us"]
                row["tc_speedup_vs_bf16"] = row["bf16_us"] / row["tc_decode_us"]
                row["idot_weight_GBps"] = wbytes / row["idot_us"] / 1e3
            rows.append(row)
        del ws, qws
    res["idot_dense"] = rows
    print_table("dense decode GEMMs: integer-dot vs tensor-core decode vs BF16 torch.mm (CUDA-graph replays)", rows,
                ["shape", "M", "bf16_us", "tc_decode_us", "idot_us", "idot_speedup_vs_bf16", "tc_speedup_vs_bf16",
                 "idot_weight_GBps", "max_err_fp32", "rows_alone_bits_differ"])


# ---- grouped --------------------------------------------------------------------------------------
def grouped_cases():
    """The MoE decode cases of both grouped sections: per expert shape (fc1, fc2 of 128 experts) and
    decode tokens (``--decode-tokens``), the quantized weights, 8 random top-8 routings, a quantized
    activation, its BF16 twin and the sorted offsets ``torch._grouped_mm`` reads."""
    for name, (k, n) in (("expert_fc1", SHAPES["expert_fc1"]), ("expert_fc2", SHAPES["expert_fc2"])):
        e = EXPERTS
        if SMOKE:
            k, n, e = 64, 32, 6
        w = rnd(e, n, k, scale=0.02)
        wb = w.to(BF16)
        qw = quantize_forward(w, global_scale="group", tile=(16, 16))
        wm = qw.matrix()
        del w
        for tokens in GROUPED_TOKENS:
            topk = 2 if SMOKE else TOPK
            r = tokens * topk
            routings = [torch.stack([torch.randperm(e, device=DEV)[:topk] for _ in range(tokens)]).reshape(-1).int()
                        for _ in range(1 if SMOKE else 8)]
            qa = quantize_forward(rnd(r, k), with_image=True)
            xb = rnd(r, k).to(BF16)
            offs = [torch.cumsum(torch.bincount(ids.long(), minlength=e), 0).to(torch.int32) for ids in routings]
            distinct = sum(int(torch.unique(ids).numel()) for ids in routings) / len(routings)
            yield dict(name=name, k=k, n=n, e=e, wb=wb, qw=qw, wm=wm, tokens=tokens, r=r, routings=routings, qa=qa,
                       xb=xb, offs=offs, distinct=distinct)
        del wb, qw, wm


def sec_grouped(res):
    rows = []
    for c in grouped_cases():
        name, k, n, e, tokens, r = c["name"], c["k"], c["n"], c["e"], c["tokens"], c["r"]
        wb, qw, wm, qa, xb, routings, sorted_offs = c["wb"], c["qw"], c["wm"], c["qa"], c["xb"], c["routings"], c["offs"]
        row = {"shape": name, "tokens": tokens, "rows": r, "distinct_experts": float(c["distinct"])}
        if mine() and hasattr(torch, "_grouped_mm") and DEV.type == "cuda":
            row["bf16_grouped_mm_us"] = 1e3 * timed(
                lambda: [torch._grouped_mm(xb, wb.transpose(-2, -1), offs=o) for o in sorted_offs]) / len(routings)
        for strict in (False, True):
            if not mine():
                continue
            row["strict_us" if strict else "nvfp4_us"] = 1e3 * timed(
                lambda: [tg.decode_grouped_gemm_forward(qa.image, wm.codes, wm.block_scales, qw.global_decode, ids,
                                                        qa.global_decode, e, BF16, strict)
                         for ids in routings]) / len(routings)
        if not WARM_ONLY and "nvfp4_us" in row and "bf16_grouped_mm_us" in row:
            row["speedup"] = row["bf16_grouped_mm_us"] / row["nvfp4_us"]
            sel_bytes = row["distinct_experts"] * (n * k // 2 + n * k // 16)
            row["nvfp4_weight_GBps"] = sel_bytes / row["nvfp4_us"] / 1e3
            row["bf16_weight_GBps"] = row["distinct_experts"] * n * k * 2 / row["bf16_grouped_mm_us"] / 1e3
        rows.append(row)
    res["grouped"] = rows
    print_table("MoE decode (top-8 of 128 experts; 8 routings rotated; CUDA-graph replays)", rows,
                ["shape", "tokens", "rows", "distinct_experts", "bf16_grouped_mm_us", "nvfp4_us", "speedup",
                 "strict_us", "nvfp4_weight_GBps", "bf16_weight_GBps"])


#: grouped decode launch sweep: ``decode_grouped_gemm.GPU_GROUPED_DECODE``-style entries (BLOCK_N,
#: BLOCK_K, warps, DEPTH, MAX_CHUNKS); the first is what the kernel ran before the sweep (the dense
#: kernel's 2 K steps per program).
GROUPED_SWEEP = [(64, 128, 4, 2, 2), (64, 128, 4, 4, 8), (64, 128, 4, 4, 16), (32, 128, 4, 4, 16), (128, 128, 8, 4, 16),
                 (64, 64, 4, 8, 32)]


def grouped_entry(t) -> dict:
    bn, bk, warps, depth, most = t
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, DEPTH=depth, MAX_CHUNKS=most)


def sec_grouped_sweep(res):
    """The grouped decode kernel's launch parameters at the real MoE shapes (fc1, fc2 of 128
    experts, top-8; ``--decode-tokens``), CUDA-graph replays over 8 routings, vs BF16
    ``torch._grouped_mm`` on the same experts; each configuration's bf16 output compared with the
    strict fp32 result (max relative error: bf16 rounding, <= 2^-8, unless the configuration is
    wrong)."""
    rows = []
    for c in grouped_cases():
        name, k, n, e, tokens, r, distinct = c["name"], c["k"], c["n"], c["e"], c["tokens"], c["r"], c["distinct"]
        wb, qw, wm, qa, xb, routings, offs = c["wb"], c["qw"], c["wm"], c["qa"], c["xb"], c["routings"], c["offs"]
        sel_bytes = distinct * (n * k // 2 + n * k // 16)
        bf16_us = float("nan")
        if DEV.type == "cuda" and hasattr(torch, "_grouped_mm") and not WARM_ONLY:
            bf16_us = 1e3 * timed(lambda: [torch._grouped_mm(xb, wb.transpose(-2, -1), offs=o) for o in offs]) / len(offs)
        want = tg.decode_grouped_gemm_forward(qa.image, wm.codes, wm.block_scales, qw.global_decode, routings[0],
                                              qa.global_decode, e, torch.float32, True)
        entries = [(16, 32, 4, 1, 1), (16, 32, 4, 2, 2)] if SMOKE else GROUPED_SWEEP  # interpreter: small tiles
        for entry in entries:
            if not mine():
                continue
            cfg = tg.grouped_config(r, k, e, grouped_entry(entry))
            out = torch.empty(r, n, dtype=BF16, device=DEV)

            w_sc, w_gs = wm.block_scales.contiguous().view(torch.uint8), qw.global_decode.float().reshape(-1)
            a_gs = qa.global_decode.float().reshape(-1)

            def run(ids, o=out, cfg=cfg):
                tg.launch_decode_grouped(qa.image, wm.codes, w_sc, w_gs, ids, a_gs, o, e, cfg)
            try:
                run(routings[0])  # bf16 output vs the strict fp32 result: <= 2^-8 relative is the rounding
                err = float((out.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))
                us = 1e3 * timed(lambda: [run(ids) for ids in routings]) / len(routings)
            except Exception as ex:  # a configuration that does not compile here: recorded
                print(f"grouped {name} {entry} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                err, us = float("nan"), float("nan")
            rows.append({"shape": name, "tokens": tokens, "distinct_experts": distinct, "config": str(entry),
                         "split": cfg["SPLIT"], "programs": max(1, min(r, e)) * -(-n // cfg["BLOCK_N"]) * cfg["SPLIT"],
                         "nvfp4_us": us, "bf16_grouped_mm_us": bf16_us, "speedup": bf16_us / us,
                         "nvfp4_weight_GBps": sel_bytes / us / 1e3, "max_rel_err_vs_strict": err})
    res["grouped_sweep"] = rows
    print_table("grouped decode launch sweep (top-8 of 128 experts; 8 routings; CUDA-graph replays)", rows,
                ["shape", "tokens", "distinct_experts", "config", "split", "programs", "nvfp4_us", "bf16_grouped_mm_us",
                 "speedup", "nvfp4_weight_GBps", "max_rel_err_vs_strict"])


#: integer-dot grouped decode entries (``decode_grouped_idot.GPU_IDOT`` form: BLOCK_N, BLOCK_KB,
#: PAIRS, UNROLL, warps); the first is the module's entry.
IDOT_SWEEP = [tuple(ti.GPU_IDOT[k] for k in ("BLOCK_N", "BLOCK_KB", "PAIRS", "UNROLL", "num_warps")),
              (64, 16, False, 2, 4), (32, 16, True, 2, 4), (64, 16, True, 4, 4), (64, 32, True, 1, 4),
              (64, 8, True, 4, 4), (128, 16, False, 2, 4), (32, 16, True, 4, 2)]


def idot_entry(t) -> dict:
    bn, bkb, pairs, unroll, warps = t
    return dict(BLOCK_N=bn, BLOCK_KB=bkb, PAIRS=bool(pairs), UNROLL=unroll, num_warps=warps)


def sec_idot_sweep(res):
    """The integer-dot grouped decode kernel (``decode_grouped_idot``) at the real MoE shapes, rows
    by expert ids (unsorted) and by group offsets (rows sorted, as the fused decode step gives
    them), side by side with the tensor-core default entry and BF16 ``torch._grouped_mm`` on the
    same experts; per entry the fp32 output's max error against the strict fp32 result (relative to
    its largest value: accumulation-order noise, ~1e-6, unless the kernel is wrong), the bf16
    output's, and whether the sorted and unsorted rows are the same bits (row invariance)."""
    rows = []
    for c in grouped_cases():
        name, k, n, e, tokens, r, distinct = c["name"], c["k"], c["n"], c["e"], c["tokens"], c["r"], c["distinct"]
        wb, qw, wm, qa, xb, routings, offs = c["wb"], c["qw"], c["wm"], c["qa"], c["xb"], c["routings"], c["offs"]
        sel_bytes = distinct * (n * k // 2 + n * k // 16)
        w_sc, w_gs = wm.block_scales.contiguous().view(torch.uint8), qw.global_decode.float().reshape(-1)
        a_gs = qa.global_decode.float().reshape(-1)
        a_sc = qa.linear_scales().contiguous().view(torch.uint8)
        bf16_us = tc_us = float("nan")
        if DEV.type == "cuda" and not WARM_ONLY:
            if hasattr(torch, "_grouped_mm"):
                bf16_us = 1e3 * timed(lambda: [torch._grouped_mm(xb, wb.transpose(-2, -1), offs=o) for o in offs]) / len(offs)
            tc_cfg = tg.grouped_config(r, k, e, tg.GPU_GROUPED_DECODE)
            tc_out = torch.empty(r, n, dtype=BF16, device=DEV)
            tc_us = 1e3 * timed(lambda: [tg.launch_decode_grouped(qa.image, wm.codes, w_sc, w_gs, ids, a_gs, tc_out, e, tc_cfg)
                                         for ids in routings]) / len(routings)
        # the rows of each routing in expert-major order (what the fused step's routing produces)
        sorted_inputs = []
        for ids in routings:
            order = torch.argsort(ids.long(), stable=True)
            o1 = torch.zeros(e + 1, dtype=torch.int32, device=DEV)
            o1[1:] = torch.cumsum(torch.bincount(ids.long(), minlength=e), 0)
            sorted_inputs.append((order, qa.codes[order].contiguous(), a_sc[order].contiguous(), a_gs[order].contiguous(), o1))
        want = tg.decode_grouped_gemm_forward(qa.image, wm.codes, wm.block_scales, qw.global_decode, routings[0],
                                              qa.global_decode, e, torch.float32, True)
        scale = want.abs().max().clamp_min(1e-30)
        strict_us = {}
        if not SMOKE and mine():  # the strict engine's GEMM (its one configuration), for scale
            strict_us["strict_us"] = 1e3 * timed(
                lambda: [tg.decode_grouped_gemm_forward(qa.image, wm.codes, wm.block_scales, qw.global_decode, ids,
                                                        qa.global_decode, e, BF16, True) for ids in routings]) / len(routings)
        entries = [(16, 2, True, 1, 4), (16, 2, False, 2, 4)] if SMOKE else IDOT_SWEEP[:IDOT_ENTRIES]
        for entry in entries:
            if not mine():
                continue
            cfg = ti.idot_config(k, idot_entry(entry))
            out_ids = torch.empty(r, n, dtype=BF16, device=DEV)
            out_sorted = torch.empty(r, n, dtype=BF16, device=DEV)

            def by_ids(ids, o=out_ids, cfg=cfg):
                ti.launch_decode_grouped_idot(qa.codes, a_sc, a_gs, wm.codes, w_sc, w_gs, e, o, expert_ids=ids, cfg=cfg)

            def by_offsets(si, o=out_sorted, cfg=cfg):
                _, codes, sc, gs, o1 = si
                ti.launch_decode_grouped_idot(codes, sc, gs, wm.codes, w_sc, w_gs, e, o, offsets=o1, cfg=cfg)
            try:
                out32 = torch.empty(r, n, dtype=torch.float32, device=DEV)
                ti.launch_decode_grouped_idot(qa.codes, a_sc, a_gs, wm.codes, w_sc, w_gs, e, out32,
                                              expert_ids=routings[0], cfg=cfg)
                err32 = float((out32 - want).abs().max() / scale)
                by_ids(routings[0])
                err16 = float((out_ids.float() - want).abs().max() / scale)
                by_offsets(sorted_inputs[0])
                differ = _bits_differ(out_ids[sorted_inputs[0][0]], out_sorted)
                us_ids = 1e3 * timed(lambda: [by_ids(ids) for ids in routings]) / len(routings)
                us_sorted = 1e3 * timed(lambda: [by_offsets(si) for si in sorted_inputs]) / len(sorted_inputs)
            except Exception as ex:  # a configuration that does not compile here: recorded
                print(f"idot {name} {entry} failed: {type(ex).__name__}: {str(ex)[:160]}", flush=True)
                err32 = err16 = us_ids = us_sorted = float("nan")
                differ = None
            rows.append({"shape": name, "tokens": tokens, "distinct_experts": distinct, "config": str(entry),
                         **strict_us, "idot_ids_us": us_ids, "idot_sorted_us": us_sorted, "tc_default_us": tc_us,
                         "bf16_grouped_mm_us": bf16_us, "speedup_vs_bf16": bf16_us / us_sorted,
                         "idot_weight_GBps": sel_bytes / us_sorted / 1e3, "max_err_fp32": err32, "max_err_bf16": err16,
                         "sorted_vs_ids_bits_differ": differ})
    res["idot_sweep"] = rows
    print_table("integer-dot grouped decode (top-8 of 128 experts; 8 routings; CUDA-graph replays)", rows,
                ["shape", "tokens", "distinct_experts", "config", "idot_ids_us", "idot_sorted_us", "tc_default_us",
                 "strict_us",
                 "bf16_grouped_mm_us", "speedup_vs_bf16", "idot_weight_GBps", "max_err_fp32", "max_err_bf16",
                 "sorted_vs_ids_bits_differ"])


SECTIONS = ("decode_sweep", "decode_dense", "decode_grouped", "decode_grouped_sweep", "decode_idot_sweep",
            "decode_idot_dense")


def parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(description=__doc__.split("\n")[0], add_help=False)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--decode-m", default="1,2,4,8,16,32,64", help="rows of the dense decode sections")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--warm-only", action="store_true", help="compile and run once, time nothing")
    p.add_argument("--shard", default="0/1", help="I/N: with --warm-only, only every N-th measurement")
    p.add_argument("--no-act-quant", action="store_true", help="skip the with-activation-quantize column")
    p.add_argument("--no-image-gemm", action="store_true", help="skip the image-GEMM columns (the backend's "
                   "path without the decode kernel)")
    p.add_argument("--decode-shapes", default=",".join(SHAPES), help="dense shapes to time")
    p.add_argument("--strict-max-k", type=int, default=0,
                   help="dense table: strict decode only where K <= this (the K = 4096 kernel compiles ~1 min)")
    p.add_argument("--deadline-s", type=float, default=float("inf"),
                   help="stop timing (NaN, saved as null) this many seconds after the start")
    p.add_argument("--decode-tokens", default="1,8,64", help="decode tokens of the grouped sections")
    p.add_argument("--idot-entries", type=int, default=None, help="decode_idot_sweep: time only the first this many")
    return p


def main(argv=None):
    global SMOKE, DEV, WARM_ONLY, SHARD, DEADLINE, ACT_QUANT, IMAGE_GEMM, DENSE, STRICT_MAX_K, GROUPED_TOKENS, IDOT_ENTRIES
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    IDOT_ENTRIES = args.idot_entries
    GROUPED_TOKENS = tuple(int(t) for t in args.decode_tokens.split(","))
    SMOKE, WARM_ONLY, ACT_QUANT, IMAGE_GEMM = args.smoke, args.warm_only, not args.no_act_quant, not args.no_image_gemm
    DENSE = args.decode_shapes.split(",")
    STRICT_MAX_K = args.strict_max_k
    DEADLINE = time.monotonic() + args.deadline_s
    try:
        SHARD = tuple(int(v) for v in args.shard.split("/"))
        assert len(SHARD) == 2 and 0 <= SHARD[0] < SHARD[1]
    except (ValueError, AssertionError):
        raise SystemExit(f"benchmarks.kernels --shard: expected I/N with 0 <= I < N, got {args.shard!r}") from None
    if SMOKE:
        DEV = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("benchmarks.kernels (decode sections): needs a CUDA GPU (or --smoke on the CPU)")
    torch.manual_seed(0)
    sections = args.sections.split(",")
    ms = [int(v) for v in args.decode_m.split(",")]
    res = {"benchmark": "decode_gemm", "command": command(argv), **environment()}
    copy_gbps = None if (SMOKE or WARM_ONLY) else copy_bandwidth_gbps(DEV)
    res["copy_GBps"] = copy_gbps
    if copy_gbps:
        print(f"device copy bandwidth (read + write): {copy_gbps:.0f} GB/s")

    def partial():
        """The record so far in ``--out`` (a run cut off by its device call's limit keeps its numbers)."""
        if args.out and not WARM_ONLY and not SMOKE:
            import json

            with open(os.path.join(args.out, "decode_gemm.partial.json"), "w") as f:
                json.dump(res, f, default=str)

    chosen = None
    for sec in sections:
        if sec == "decode_sweep":
            chosen = sec_sweep(res)
        elif sec == "decode_dense":
            sec_dense(res, ms, chosen, copy_gbps)
        elif sec == "decode_grouped":
            sec_grouped(res)
        elif sec == "decode_grouped_sweep":
            sec_grouped_sweep(res)
        elif sec == "decode_idot_sweep":
            sec_idot_sweep(res)
        elif sec == "decode_idot_dense":
            sec_idot_dense(res, ms)
        partial()
    if not WARM_ONLY and not SMOKE:
        print("saved:", ", ".join(save(res, "decode_gemm", [RESULTS, args.out])))
    return res


if __name__ == "__main__":
    main()
