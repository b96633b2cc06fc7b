"""Decode GEMMs on packed FP4 weights vs BF16 cuBLAS, and their strict (batch-invariant) bits.

    python -m benchmarks.decode_gemm                       # every section
    python -m benchmarks.decode_gemm --sections check,dense --out $OUT
    python -m benchmarks.decode_gemm --warm-only --shard 3 --shards 8   # compile only (parallel)

Sections (one JSON line per run in ``benchmarks/results/decode_gemm.jsonl`` and ``--out``):

* ``check``: strict decode configurations against the learner's strict image GEMMs, bit for
  bit (fp32 and bf16 outputs), on random and adversarial rows (magnitudes spread over 2^+-12
  inside each row, so any change of accumulation order shows), M = 1, 3, 8, 64 at several row
  offsets of an M = 4096 learner GEMM; dense and grouped; the default configurations within
  ``nvfp4.fp32_accumulation_bound``.
* ``sweep``: default-configuration sweep (BLOCK_N, BLOCK_K, warps, stages, programs per SM) on
  qkv / o / fc2 at M = 1, 16, 64; the best per padded M is used by the next sections.
* ``dense``: every Qwen3 shape x M = 1..64: BF16 ``torch.mm`` vs NVFP4 decode (default, strict,
  and default with the activation's quantization), CUDA-graph replays, weights rotated through
  more than 4x the L2 so HBM is measured; effective weight GB/s and % of copy bandwidth.
* ``grouped``: MoE decode, batch 1 / 8 / 64 tokens x top-8 of 128 experts, fc1 and fc2:
  BF16 ``torch._grouped_mm`` on the selected experts (rows already sorted: its permutation is
  not timed) vs NVFP4 ``decode_grouped_gemm`` (unsorted rows, routing included).

``--smoke``: tiny shapes on the CPU under TRITON_INTERPRET=1 (checks the script, not speed).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

from ._timing import bench, copy_bandwidth_gbps, ensure_minite_kernels, environment, print_table, save

ensure_minite_kernels()

from minite_megatron import nvfp4  # noqa: E402
from minite_kernels.triton import decode_gemm as td  # noqa: E402
from minite_kernels.triton import decode_grouped_gemm as tg  # noqa: E402
from minite_kernels.triton.gemm import gemm_forward  # noqa: E402
from minite_kernels.triton.grouped_gemm import grouped_gemm_forward  # noqa: E402
from minite_kernels.triton.quantize import quantize_forward  # noqa: E402

#: Qwen3 (30B-A3B / qwen3-moe preset) decode GEMMs as (K, N).
SHAPES = {"qkv": (2048, 5120), "o": (4096, 2048), "expert_fc1": (2048, 1536), "expert_fc2": (768, 2048),
          "lm_head_32k": (2048, 32768), "lm_head_152k": (2048, 151936)}
EXPERTS, TOPK = 128, 8
BF16 = torch.bfloat16
L2_BYTES = 60 * 2**20
SMOKE = False
WARM_ONLY = False
ACT_QUANT = True
SHARD = (0, 1)
DEADLINE = float("inf")
DEV = torch.device("cuda")

#: default-configuration sweep: tile, warps, stages, register prefetch, programs per SM
def _d(bn, bk, warps, stages, per_sm, prefetch, min_m_pad=8):
    return dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, per_sm=per_sm, PREFETCH=prefetch,
                min_m_pad=min_m_pad)


# M_PAD 8 compiles to mma.sync (HMMA), 16 and up to wgmma (HGMMA)
SWEEP = [_d(64, 128, 4, 1, 8, False), _d(64, 128, 4, 1, 4, False), _d(64, 128, 4, 1, 8, False, 16),
         _d(64, 128, 4, 1, 4, False, 16), _d(64, 128, 4, 1, 16, False, 16), _d(64, 128, 4, 1, 8, True, 16),
         _d(64, 128, 4, 2, 8, False, 16), _d(128, 128, 4, 1, 4, False, 16), _d(64, 64, 4, 1, 16, False, 16)]
#: strict configurations checked bitwise (M_PAD None: the natural padding, 8 / 16 / 32 / 64)
STRICT_VARIANTS = [dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, M_PAD=64),
                   dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=False, M_PAD=None),
                   dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=1, PREFETCH=True, M_PAD=64)]
CHECK_M = (1, 3, 8, 16, 33, 64)

_counter = itertools.count()


def _name(cfg) -> str:
    short = {"BLOCK_N": "bn", "BLOCK_K": "bk", "num_warps": "w", "num_stages": "st", "per_sm": "psm",
             "PREFETCH": "pf", "M_PAD": "mpad"}
    return " ".join(f"{short.get(k, k)}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())


def mine() -> bool:
    """In a sharded warm-up, is the next measurement this shard's?"""
    return next(_counter) % SHARD[1] == SHARD[0]


def timed(fn) -> float:
    """Milliseconds of ``fn`` as CUDA-graph replays (NaN in a warm-up: compile only)."""
    if WARM_ONLY or SMOKE:
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return float("nan") if WARM_ONLY else (time.perf_counter() - t) * 1e3
    if time.monotonic() > DEADLINE:
        return float("nan")
    try:
        return bench(fn, graph=True, rep_ms=60)
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


def strict_cfg(variant, m):
    cfg = dict(variant, SPLIT=1)
    if cfg["M_PAD"] is None:
        cfg["M_PAD"] = max(8, 1 << (m - 1).bit_length())
    return cfg


def default_cfg(entry, m, n, k, sms):
    return td.default_config(m, n, k, sms, entry)


def run_decode(qx, q, cfg, out_dtype=BF16, out=None):
    out = torch.empty(qx.rows, q.rows, dtype=out_dtype, device=qx.codes.device) if out is None else out
    td.launch_decode_gemm(qx.image, q.codes, q.block_scales.view(torch.uint8), qx.global_decode.reshape(-1),
                          q.global_decode.reshape(-1), None, out, cfg)
    return out


def sms() -> int:
    return torch.cuda.get_device_properties(DEV).multi_processor_count if DEV.type == "cuda" else 1


# ---- check ----------------------------------------------------------------------------------------
def _bits_differ(a, b) -> int:
    return int((a.contiguous().view(torch.int32 if a.dtype == torch.float32 else torch.int16)
                != b.contiguous().view(torch.int32 if b.dtype == torch.float32 else torch.int16)).sum())


def sec_check(res):
    k, n = (64, 48) if SMOKE else (2048, 1024)
    big = 96 if SMOKE else 4096
    rows = []
    for data_name, data in (("random", rnd), ("adversarial", adversarial)):
        qx = quantize_forward(data(big, k), with_image=True)
        qw = quantize_forward(data(n, k) * 0.02, global_scale="tensor", tile=(16, 16), with_image=True)
        full = {dt: gemm_forward(qx.image, qw.image, qx.global_decode, qw.global_decode, None, dt, batch_invariant=True)
                for dt in (torch.float32, BF16)}
        for variant in STRICT_VARIANTS[:1] if SMOKE else STRICT_VARIANTS:
            row = {"data": data_name, "strict_config": _name(variant), "mismatched_fp32": 0, "mismatched_bf16": 0,
                   "learner_small_m_mismatched": 0, "compared": 0}
            for m in CHECK_M:
                for start in sorted({0, big - m}):
                    part = nvfp4.grouped._take_rows(qx, torch.arange(start, start + m, device=DEV))
                    for dt in (torch.float32, BF16) if variant == STRICT_VARIANTS[0] else (torch.float32,):
                        if not mine():
                            continue
                        got = run_decode(part, qw, strict_cfg(variant, m), dt)
                        if WARM_ONLY:
                            continue
                        key = "mismatched_fp32" if dt == torch.float32 else "mismatched_bf16"
                        row[key] += _bits_differ(got, full[dt][start : start + m])
                        row["compared"] += got.numel()
                        if variant == STRICT_VARIANTS[0]:  # the learner's own batch invariance
                            own = gemm_forward(part.image, qw.image, part.global_decode, qw.global_decode, None, dt,
                                               batch_invariant=True)
                            row["learner_small_m_mismatched"] += _bits_differ(own, full[dt][start : start + m])
            rows.append(row)
        # default configuration: within the fp32 accumulation bound of the exact product
        for m in (1, 16, 64):
            if not mine():
                continue
            part = nvfp4.grouped._take_rows(qx, torch.arange(m, device=DEV))
            got = td.decode_gemm_forward(part.image, qw.codes, qw.block_scales, part.global_decode, qw.global_decode,
                                         None, torch.float32)
            if WARM_ONLY:
                continue
            exact, bound = nvfp4.fp32_accumulation_bound(part, qw)
            err = (got.double() - exact).abs()
            ok = bool((err <= bound + 2.0**-24 * exact.abs()).all())
            rows.append({"data": data_name, "strict_config": f"default M={m}", "within_bound": ok,
                         "max_err_over_bound": float((err / (bound + 1e-300)).max())})
    rows.append(graph_replay_check())
    res["check_dense"] = rows
    verified = []
    for variant in STRICT_VARIANTS:
        mine_rows = [r for r in rows if r.get("strict_config") == _name(variant)]
        if mine_rows and all(r["compared"] > 0 and r["mismatched_fp32"] == 0 and r["mismatched_bf16"] == 0
                             for r in mine_rows):
            verified.append(variant)
    res["strict_verified"] = [_name(v) for v in verified]
    print_table("strict decode vs the learner's strict GEMM (bits that differ; 0 = bitwise equal)", rows,
                ["data", "strict_config", "mismatched_fp32", "mismatched_bf16", "learner_small_m_mismatched",
                 "compared", "within_bound", "max_err_over_bound", "graph_replay_equal"])
    sec_check_grouped(res)
    print("strict configurations bitwise equal to the learner's strict GEMM:", verified)
    return verified


def graph_replay_check() -> dict:
    """Capture the dense and grouped decode ops (default and strict) in one CUDA graph; replay
    on new inputs copied into the captured buffers; outputs must equal eager runs bit for bit."""
    if SMOKE or WARM_ONLY or not mine():
        return {"data": "graph", "strict_config": "capture+replay"}
    k, n, e, r = 2048, 1536, EXPERTS, 64
    qw = quantize_forward(rnd(e, n, k) * 0.02, global_scale="group", tile=(16, 16))
    wm = qw.matrix()
    qd = quantize_forward(rnd(n, k) * 0.02, global_scale="tensor", tile=(16, 16))
    a = quantize_forward(rnd(r, k), with_image=True)
    ids = torch.randint(0, e, (r,), device=DEV, dtype=torch.int32)

    def step():
        return [td.decode_gemm_forward(a.image[:16], qd.codes, qd.block_scales, a.global_decode[:16], qd.global_decode,
                                       None, BF16, strict) for strict in (False, True)] + \
               [tg.decode_grouped_gemm_forward(a.image, wm.codes, wm.block_scales, qw.global_decode, ids,
                                               a.global_decode, e, BF16, strict) for strict in (False, True)]

    step()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = step()
    equal = True
    for trial in range(3):
        fresh = quantize_forward(rnd(r, k), with_image=True)
        a.image.copy_(fresh.image)
        a.global_decode.copy_(fresh.global_decode)
        ids.copy_(torch.randint(0, e, (r,), device=DEV, dtype=torch.int32))
        g.replay()
        torch.cuda.synchronize()
        eager = step()
        equal &= all(_bits_differ(o, x) == 0 for o, x in zip(outs, eager))
    return {"data": "graph", "strict_config": "capture+replay (3 fresh inputs)", "graph_replay_equal": equal}


def sec_check_grouped(res):
    k, n, e = (64, 48, 6) if SMOKE else (2048, 1536, EXPERTS)
    rows = []
    for data_name, data in (("random", rnd), ("adversarial", adversarial)):
        w = data(e, n, k) * 0.02
        qw = quantize_forward(w, global_scale="group", tile=(16, 16), with_image=True)
        for tokens in (1, 8, 64):
            if not mine():
                continue
            r = tokens * (2 if SMOKE else TOPK)
            ids = torch.stack([torch.randperm(e, device=DEV)[: r // tokens] for _ in range(tokens)]).reshape(-1)
            ids = ids.to(torch.int32)
            qa = quantize_forward(data(r, k), with_image=True)
            wm = qw.matrix()
            got = {}
            for dt in (torch.float32, BF16):
                got[dt] = tg.decode_grouped_gemm_forward(qa.image, wm.codes, wm.block_scales, qw.global_decode, ids,
                                                        qa.global_decode, e, dt, batch_invariant=True)
            if WARM_ONLY:
                continue
            order = torch.argsort(ids.long(), stable=True)
            sizes = torch.bincount(ids.long(), minlength=e).to(torch.int32)
            row = {"data": data_name, "tokens": tokens, "rows": r}
            for dt in (torch.float32, BF16):
                learner = grouped_gemm_forward(qa.image[order], qw.image, sizes, qa.global_decode[order],
                                               qw.global_decode, None, dt, batch_invariant=True)
                expect = torch.empty_like(learner)
                expect[order] = learner
                row["mismatched_fp32" if dt == torch.float32 else "mismatched_bf16"] = _bits_differ(got[dt], expect)
            default = tg.decode_grouped_gemm_forward(qa.image, wm.codes, wm.block_scales, qw.global_decode, ids,
                                                     qa.global_decode, e, torch.float32)
            row["default_vs_strict_max_rel"] = float(((default - got[torch.float32]).abs()
                                                      / got[torch.float32].abs().clamp_min(1e-30)).max())
            rows.append(row)
    res["check_grouped"] = rows
    print_table("strict grouped decode vs the learner's strict grouped GEMM (bits that differ)", rows,
                ["data", "tokens", "rows", "mismatched_fp32", "mismatched_bf16", "default_vs_strict_max_rel"])


# ---- sweep ----------------------------------------------------------------------------------------
def sec_sweep(res, verified):
    rows = []
    best = {}
    strict_times = {}
    for name in ("qkv", "o"):
        k, n = (64, 32) if SMOKE else SHAPES[name]
        qws = weights(n, k, copies_for(n * k // 2))
        for m in (1, 16):
            qx = quantize_forward(rnd(m, k), with_image=True)
            outs = torch.empty(m, n, dtype=BF16, device=DEV)
            row = {"shape": name, "M": m}
            for i, entry in enumerate(SWEEP[:2] if SMOKE else SWEEP):
                if not mine():
                    continue
                cfg = default_cfg(entry, m, n, k, sms())
                t = timed(lambda: [run_decode(qx, q, cfg, out=outs) for q in qws]) / len(qws)
                row[f"cfg{i}_us"] = 1e3 * t
                best.setdefault(max(8, 1 << (m - 1).bit_length()), {}).setdefault(i, []).append(t)
            for j, variant in enumerate(STRICT_VARIANTS):
                if not mine():
                    continue
                scfg = strict_cfg(variant, m)
                t = timed(lambda: [run_decode(qx, q, scfg, out=outs) for q in qws]) / len(qws)
                row[f"strict{j}_us"] = 1e3 * t
                strict_times.setdefault(j, []).append(t)
            rows.append(row)
    # best entry per padded M: smallest geometric-mean time over the shapes
    chosen = {}
    for m_pad, per_cfg in best.items():
        scores = {i: torch.tensor(ts).log().mean().item() for i, ts in per_cfg.items() if ts and all(t == t for t in ts)}
        if scores:
            chosen[m_pad] = SWEEP[min(scores, key=scores.get)]
    scores = {j: torch.tensor(ts).log().mean().item() for j, ts in strict_times.items()
              if STRICT_VARIANTS[j] in verified and all(t == t for t in ts)}
    chosen_strict = STRICT_VARIANTS[min(scores, key=scores.get)] if scores else None
    res["sweep"] = {"configs": SWEEP, "strict_configs": STRICT_VARIANTS, "rows": rows,
                    "chosen": {str(k): v for k, v in chosen.items()}, "chosen_strict": chosen_strict}
    print("sweep configs:", {f"cfg{i}": _name(c) for i, c in enumerate(SWEEP)})
    print_table("default decode config sweep (us per GEMM)", rows,
                ["shape", "M"] + [f"cfg{i}_us" for i in range(len(SWEEP))])
    print("strict configs:", {f"strict{j}": _name(c) for j, c in enumerate(STRICT_VARIANTS)})
    print_table("strict decode config sweep (us per GEMM)", rows,
                ["shape", "M"] + [f"strict{j}_us" for j in range(len(STRICT_VARIANTS))])
    print("chosen per padded M:", {k: _name(v) for k, v in chosen.items()}, "; strict:",
          _name(chosen_strict) if chosen_strict else None)
    return chosen, chosen_strict


# ---- dense table ----------------------------------------------------------------------------------
def sec_dense(res, ms, chosen, chosen_strict, copy_gbps):
    rows = []
    for name, (k, n) in SHAPES.items():
        if SMOKE:
            k, n = 64, 32
        nb = copies_for(n * k * 2)
        ws = [rnd(n, k, scale=0.02).to(BF16) for _ in range(nb)]
        qws = weights(n, k, copies_for(n * k // 2))
        wbytes = n * k // 2 + n * k // 16
        for m in ms:
            x = rnd(m, k).to(BF16)
            qx = quantize_forward(x, with_image=True)
            m_pad = max(8, 1 << (m - 1).bit_length())
            entry = chosen.get(m_pad)
            cfg = default_cfg(entry, m, n, k, sms()) if entry else td.select_config(m, n, k, sms(), False)
            scfg = strict_cfg(chosen_strict, m) if chosen_strict else td.select_config(m, n, k, sms(), True)
            out = torch.empty(m, n, dtype=BF16, device=DEV)
            row = {"shape": name, "K": k, "N": n, "M": m, "config": _name(cfg), "strict_config": _name(scfg),
                   "strict_verified": chosen_strict is not None}
            if mine():
                row["bf16_us"] = 1e3 * timed(lambda: [torch.mm(x, w.t()) for w in ws]) / len(ws)
            if mine():
                row["nvfp4_us"] = 1e3 * timed(lambda: [run_decode(qx, q, cfg, out=out) for q in qws]) / len(qws)
            if mine():
                row["strict_us"] = 1e3 * timed(lambda: [run_decode(qx, q, scfg, out=out) for q in qws]) / len(qws)
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
            rows.append(row)
        del ws, qws
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    res["dense"] = rows
    print_table("decode GEMM per call (CUDA-graph replays; weights rotated through > 4x L2)", rows,
                ["shape", "M", "bf16_us", "nvfp4_us", "speedup", "strict_us", "strict_over_default",
                 "with_act_quant_us", "nvfp4_weight_GBps", "pct_of_copy_bw", "bf16_weight_GBps"])


# ---- grouped --------------------------------------------------------------------------------------
def sec_grouped(res):
    rows = []
    for name, (k, n) in (("expert_fc1", SHAPES["expert_fc1"]), ("expert_fc2", SHAPES["expert_fc2"])):
        e = EXPERTS
        if SMOKE:
            k, n, e = 64, 32, 6
        w = rnd(e, n, k, scale=0.02)
        wb = w.to(BF16)
        qw = quantize_forward(w, global_scale="group", tile=(16, 16))
        wm = qw.matrix()
        del w
        for tokens in (1, 8, 64):
            topk = 2 if SMOKE else TOPK
            r = tokens * topk
            routings = [torch.stack([torch.randperm(e, device=DEV)[:topk] for _ in range(tokens)]).reshape(-1).int()
                        for _ in range(1 if SMOKE else 8)]
            qa = quantize_forward(rnd(r, k), with_image=True)
            xb = rnd(r, k).to(BF16)
            sorted_offs = [torch.cumsum(torch.bincount(ids.long(), minlength=e), 0).to(torch.int32) for ids in routings]
            row = {"shape": name, "tokens": tokens, "rows": r, "distinct_experts": float(sum(
                int(torch.unique(ids).numel()) for ids in routings) / len(routings))}
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
        del wb, qw, wm
    res["grouped"] = rows
    print_table("MoE decode (top-8 of 128 experts; 8 routings rotated; CUDA-graph replays)", rows,
                ["shape", "tokens", "rows", "distinct_experts", "bf16_grouped_mm_us", "nvfp4_us", "speedup",
                 "strict_us", "nvfp4_weight_GBps", "bf16_weight_GBps"])


SECTIONS = ("check", "sweep", "dense", "grouped")


def main(argv=None):
    global SMOKE, DEV, WARM_ONLY, SHARD, DEADLINE, ACT_QUANT
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--m", default="1,2,4,8,16,32,64")
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON results")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    p.add_argument("--warm-only", action="store_true", help="compile and run once, time nothing")
    p.add_argument("--shard", type=int, default=0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--no-act-quant", action="store_true", help="skip the with-activation-quantize column")
    p.add_argument("--deadline-s", type=float, default=float("inf"),
                   help="stop timing (NaN, saved as null) this many seconds after the start")
    args = p.parse_args(argv)
    SMOKE, WARM_ONLY, ACT_QUANT = args.smoke, args.warm_only, not args.no_act_quant
    DEADLINE = time.monotonic() + args.deadline_s
    SHARD = (args.shard, args.shards)
    if SMOKE:
        DEV = torch.device("cpu")
    elif not torch.cuda.is_available():
        sys.exit("decode_gemm: needs a CUDA GPU (or --smoke on the CPU)")
    torch.manual_seed(0)
    sections = args.sections.split(",")
    res = {"benchmark": "decode_gemm", "command": " ".join(["python -m benchmarks.decode_gemm"] + (argv or sys.argv[1:])),
           **environment()}
    copy_gbps = None if (SMOKE or WARM_ONLY) else copy_bandwidth_gbps(DEV)
    res["copy_GBps"] = copy_gbps
    if copy_gbps:
        print(f"device copy bandwidth (read + write): {copy_gbps:.0f} GB/s")
    chosen, chosen_strict, verified = {}, None, []
    if "check" in sections:
        verified = sec_check(res)
    if "sweep" in sections:
        chosen, chosen_strict = sec_sweep(res, verified)
    if "dense" in sections:
        sec_dense(res, [int(v) for v in args.m.split(",")], chosen, chosen_strict, copy_gbps)
    if "grouped" in sections:
        sec_grouped(res)
    if not WARM_ONLY and not SMOKE:
        paths = save(res, "decode_gemm", [os.path.join(os.path.dirname(__file__), "results"), args.out])
        print("saved:", ", ".join(paths))


if __name__ == "__main__":
    main()
