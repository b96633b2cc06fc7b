"""Launch configs of the kernels the learner step leans on, at the qwen3-moe shapes (one GPU).

    python -m benchmarks.kernels --sections sweep_tile_quantize,sweep_wgrad,sweep_grouped,sweep_rows,sweep_cols --out $OUT
    python -m benchmarks.kernels --sections sweep_wgrad,sweep_grouped --rows 32768

* ``sweep_tile_quantize``: the 16x16 weight-tile quantize of the experts' stacked weights (fc1
  ``[128 * 1536, 2048]``, fc2 ``[128 * 2048, 768]``, per-expert scales, codes and scales only, the
  amax pass included) on the row kernel at each ``QuantizeTiles.weight_tile`` (a ``TritonBackend`` per setting), and the
  generic kernel it replaced; GB/s counts the bytes read twice (amax pass + quantize) and the
  codes and scales written once.
* ``sweep_wgrad``: the NVFP4 grouped wgrad GEMM (``backend.grouped_wgrad_gemm``, default mode) at
  each ``TritonOptions.grouped_wgrad_tile`` ``(BLOCK_M, BLOCK_N, BLOCK_T, warps, stages)``, ``--rows``
  routed rows over 128 experts (skewed; 131072 = the 16384-token step at top-8), fc1 and fc2, against
  ``torch._grouped_mm``'s BF16 wgrad on the same shapes.
* ``sweep_grouped``: the NVFP4 grouped fprop and dgrad GEMMs (``backend.grouped_gemm`` / ``grouped_gemm_nt``:
  dgrad reads the weight image transposed) at each ``TritonOptions.grouped_gemm_tile`` ``(BLOCK_M, BLOCK_N,
  BLOCK_K, warps, stages)`` against ``torch._grouped_mm``'s BF16 fprop / dgrad.
* ``sweep_rows``: the dgrad operand quantize of the experts' ``dy`` (tensor scale with its amax pass, SR,
  codes and scales) at each ``QuantizeTiles.rows_stochastic``.
* ``sweep_parts``: each pass of those two quantizations alone (amaxes given), with SR / the RHT / the
  image on and off: what each feature of the recipe costs.
* ``sweep_cols``: the wgrad operand quantize of the experts' ``dy`` (tensor scale, SR, RHT, each expert's
  tokens padded to 16; the column kernel's gather) at each ``QuantizeTiles.cols_tile``.

Times are medians of CUDA events (``triton.testing.do_bench``). One JSON line per run in
``benchmarks/results/learner_sweep.jsonl`` (and ``--out``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from . import RESULTS, command
from .._timing import bench, ensure_minite_kernels, environment, print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

ensure_minite_kernels()

EXPERTS, HIDDEN, FFN = 128, 2048, 768
ROWS = 131072  # routed rows (--rows)


def _skewed_sizes(g: torch.Generator) -> list[int]:
    w = torch.rand(EXPERTS, generator=g) ** 2 + 0.05
    sizes = (w / w.sum() * ROWS).floor().long()
    sizes[0] += ROWS - int(sizes.sum())
    return sizes.tolist()


def _same_bits(q, ref) -> bool:
    """Codes, block scales, global scales (and images) of two NVFP4 tensors equal bit for bit."""
    pairs = [(q.codes, ref.codes), (q.block_scales.view(torch.uint8), ref.block_scales.view(torch.uint8)),
             (q.global_decode.view(torch.int32), ref.global_decode.view(torch.int32))]
    if q.image is not None and ref.image is not None:
        pairs.append((q.image.view(torch.int16), ref.image.view(torch.int16)))
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


def sec_tile_quantize(res: dict) -> None:
    from minite_kernels.triton.backend import TritonBackend, TritonOptions
    from minite_kernels.triton.nvfp4.quantize_tiles import QuantizeTiles

    rows = []
    for name, (n, k) in {"fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}.items():
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        nbytes = 2 * w.numel() * 2 + w.numel() // 2 + w.numel() // 16
        ref = None
        for cfg in [(2, 1), (1, 1), (4, 2), (4, 4), (8, 4)]:  # QuantizeTiles.weight_tile: (threads per row, warps)
            be = TritonBackend(TritonOptions(quantize_tiles=QuantizeTiles(weight_tile=cfg)))
            q = be.quantize(w, global_scale="group", tile=(16, 16))
            ref = ref if ref is not None else q
            ms = bench(lambda: be.quantize(w, global_scale="group", tile=(16, 16)))
            rows.append({"weights": name, "config": f"nb={cfg[0]} warps={cfg[1]}", "ms": ms, "GBps": nbytes / ms / 1e6,
                         "same_bits": _same_bits(q, ref)})
        del w
    res["tile_quantize"] = rows
    print_table("16x16 weight-tile quantize (group scales, codes + scales, amax pass included)", rows,
                ["weights", "config", "ms", "GBps", "same_bits"])


def sec_wgrad(res: dict) -> None:
    """The grouped wgrad GEMM (``backend.grouped_wgrad_gemm`` on operands quantized along padded tokens)
    at each launch, a backend per setting (``TritonOptions.grouped_wgrad_tile``)."""
    from minite_kernels.triton.backend import TritonBackend, TritonOptions
    from minite_kernels.triton.nvfp4.grouped_wgrad import DEFAULT_CONFIG
    from minite_kernels.triton.nvfp4.quantize import quantize_forward
    from minite_megatron.nvfp4.group_sizes import GroupSizes

    g = torch.Generator().manual_seed(0)
    sizes = _skewed_sizes(g)
    padded = GroupSizes.of(sizes).padded()  # (its device offsets made once, shared by every call)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).int()
    rows = []
    for name, (n, k) in {"fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}.items():
        qa = quantize_forward(torch.randn(n, padded.total, device="cuda", dtype=torch.bfloat16), global_scale="tensor",
                              with_image=True)
        qb = quantize_forward(torch.randn(k, padded.total, device="cuda", dtype=torch.bfloat16), global_scale="tensor",
                              with_image=True)
        flops = 2 * ROWS * n * k
        dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        ms = bench(lambda: torch._grouped_mm(dy.t(), x, offs=offs))
        rows.append({"gemm": name, "config": "torch._grouped_mm bf16", "ms": ms, "TFLOPs": flops / ms / 1e9})
        for cfg in [DEFAULT_CONFIG, (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 4, 4),
                    (128, 128, 32, 4, 6)]:
            backend = TritonBackend(TritonOptions(grouped_wgrad_tile=cfg))
            try:
                ms = bench(lambda b=backend: b.grouped_wgrad_gemm(qa, qb, padded, out_dtype=torch.bfloat16))
                rows.append({"gemm": name, "config": str(cfg), "ms": ms, "TFLOPs": flops / ms / 1e9})
            except Exception as e:  # a config that does not compile or fit: say so, keep sweeping
                rows.append({"gemm": name, "config": str(cfg), "error": f"{type(e).__name__}: {str(e)[:80]}"})
        del qa, qb, dy, x
    res["wgrad"] = rows
    print_table(f"NVFP4 grouped wgrad GEMM configs (bf16 out, {ROWS} routed rows, 128 experts)", rows,
                ["gemm", "config", "ms", "TFLOPs", "error"])


def sec_grouped(res: dict) -> None:
    """The grouped fprop and dgrad GEMMs (``backend.grouped_gemm`` / ``grouped_gemm_nt``, the learner's
    calls) at each launch, a backend per setting (``TritonOptions.grouped_gemm_tile``)."""
    from minite_kernels.triton.backend import TritonBackend, TritonOptions
    from minite_kernels.triton.nvfp4.grouped_gemm import DEFAULT_CONFIG
    from minite_kernels.triton.nvfp4.quantize import quantize_forward
    from minite_megatron.nvfp4.group_sizes import GroupSizes

    g = torch.Generator().manual_seed(0)
    sizes = _skewed_sizes(g)
    host_sizes = GroupSizes.of(sizes)  # (its device offsets made once, shared by every call)
    offs = torch.tensor(sizes, device="cuda").cumsum(0).int()
    rows = []
    for name, (n, k) in {"fc1": (2 * FFN, HIDDEN), "fc2": (HIDDEN, FFN)}.items():
        w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
        qw = quantize_forward(w, global_scale="group", tile=(16, 16), with_image=True)
        qx = quantize_forward(x, global_scale="row", with_image=True)  # per-token x, per-tensor dy
        qdy = quantize_forward(dy, global_scale="tensor", with_image=True)
        flops = 2 * ROWS * n * k
        cases = {"fprop": (lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
                           lambda b: b.grouped_gemm(qx, qw, host_sizes)),
                 "dgrad": (lambda: torch._grouped_mm(dy, w, offs=offs),
                           lambda b: b.grouped_gemm_nt(qdy, qw, host_sizes))}
        for gemm, (bf16, nvfp4) in cases.items():
            ms = bench(bf16)
            rows.append({"gemm": f"{name} {gemm}", "config": "torch._grouped_mm bf16", "ms": ms, "TFLOPs": flops / ms / 1e9})
            for cfg in [DEFAULT_CONFIG, (128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 64, 4, 4)]:
                backend = TritonBackend(TritonOptions(grouped_gemm_tile=cfg))
                try:
                    ms = bench(lambda f=nvfp4, b=backend: f(b))
                    rows.append({"gemm": f"{name} {gemm}", "config": str(cfg), "ms": ms, "TFLOPs": flops / ms / 1e9})
                except Exception as e:  # a config that does not compile or fit: say so, keep sweeping
                    rows.append({"gemm": f"{name} {gemm}", "config": str(cfg), "error": f"{type(e).__name__}: {str(e)[:80]}"})
        del w, x, dy, qw, qx, qdy
    res["grouped"] = rows
    print_table(f"NVFP4 grouped fprop / dgrad GEMM configs (images, bf16 out, {ROWS} routed rows)", rows,
                ["gemm", "config", "ms", "TFLOPs", "error"])


def _sweep_dy_quantize(field: str, cfgs, quantize, passes: int) -> list[dict]:
    """Time ``quantize(backend, dy)`` on the experts' ``dy`` of fc1 and fc2 at each ``QuantizeTiles``
    setting of ``field``, bits compared with the first setting's; ``passes``: full bf16 reads or writes
    of ``dy`` the operation makes (GB/s counts them and the codes and scales written)."""
    from minite_kernels.triton.backend import TritonBackend, TritonOptions
    from minite_kernels.triton.nvfp4.quantize_tiles import QuantizeTiles

    rows = []
    for name, n in {"fc1 dy": 2 * FFN, "fc2 dy": HIDDEN}.items():
        dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
        nbytes = dy.numel() * 2 * passes + dy.numel() // 2 + dy.numel() // 16
        ref = None
        for cfg in cfgs:
            be = TritonBackend(TritonOptions(quantize_tiles=QuantizeTiles(**{field: cfg})))
            row = {"operand": name, field: str(cfg)}
            try:
                q = quantize(be, dy)
                ref = ref if ref is not None else q
                ms = bench(lambda: quantize(be, dy))
                row.update(ms=ms, GBps=nbytes / ms / 1e6, same_bits=_same_bits(q, ref))
            except Exception as e:  # a setting that does not compile or fit: say so, keep sweeping
                row["error"] = f"{type(e).__name__}: {str(e)[:80]}"
            rows.append(row)
        del dy
    return rows


def sec_rows(res: dict) -> None:
    res["rows_quantize"] = rows = _sweep_dy_quantize(
        "rows_stochastic", [(32, 1, 4), (16, 1, 4), (32, 2, 4), (8, 1, 4), (16, 2, 4)],
        lambda be, dy: be.quantize(dy, global_scale="tensor", rounding="stochastic", seed=5, with_image=True),
        passes=3)  # amax + quantize reads, the image written
    print_table(f"dgrad operand quantize of dy (tensor scale, SR, codes + scales + image; {ROWS} routed rows)", rows,
                ["operand", "rows_stochastic", "ms", "GBps", "same_bits", "error"])


def sec_cols(res: dict) -> None:
    sizes = _skewed_sizes(torch.Generator().manual_seed(0))
    res["cols"] = rows = _sweep_dy_quantize(
        "cols_tile", [(64, 4, 4), (32, 8, 4), (128, 4, 4), (64, 2, 2), (32, 4, 2)],
        lambda be, dy: be.quantize_wgrad_operand(dy, sizes, global_scale="tensor", rounding="stochastic", seed=5,
                                                 rht_seed=7),
        passes=2)  # the RHT amax pass and the quantize read
    print_table(f"wgrad operand quantize of dy (tensor, SR, RHT, padded groups; {ROWS} routed rows)", rows,
                ["operand", "cols_tile", "ms", "GBps", "same_bits", "error"])


def sec_parts(res: dict) -> None:
    """The passes of the experts' ``dy`` quantizations, each alone (amaxes given): the dgrad operand's
    plain amax and row quantize (SR or not), the wgrad operand's RHT amax and column quantize with SR
    and / or the RHT on or off, image or not -- what each feature of the recipe costs."""
    from minite_kernels.triton.nvfp4 import quantize_cols
    from minite_kernels.triton.nvfp4.amax import amax_forward
    from minite_kernels.triton.nvfp4.grouped_wgrad import pad_index
    from minite_kernels.triton.nvfp4.quantize import quantize_op, rht_mask_of, sr_key

    sizes = _skewed_sizes(torch.Generator().manual_seed(0))
    key, rht = sr_key(5), rht_mask_of(7)
    rows = []
    for name, n in {"fc2 dy": HIDDEN}.items():  # the larger operand (fc1's: 3/4 of it)
        dy = torch.randn(ROWS, n, device="cuda", dtype=torch.bfloat16)
        col_index, _, _ = pad_index(sizes, ROWS, torch.device("cuda"))
        src = dy.t()
        plain = amax_forward(dy, ROWS)
        rht_amax = quantize_cols.amax_launch(src, col_index, n, rht)
        cases = {
            "amax, plain (dgrad operand)": lambda: amax_forward(dy, ROWS),
            "amax, RHT along tokens (wgrad operand)": lambda: quantize_cols.amax_launch(src, col_index, n, rht),
            "rows: nearest, image": lambda: quantize_op(dy, plain, None, ROWS, False, False, 0, True, False),
            "rows: SR, image (dgrad operand)": lambda: quantize_op(dy, plain, None, ROWS, False, True, key, True, False),
        }
        for sr in (False, True):
            for use_rht in (False, True):
                a = rht_amax if use_rht else plain
                m = rht if use_rht else -1
                cases[f"cols: {'SR' if sr else 'nearest'}, {'RHT' if use_rht else 'no RHT'}, no image"] = (
                    lambda a=a, m=m, sr=sr: quantize_op(src, a, col_index, n, False, sr, key if sr else 0, False, False, m))
        cases["cols: SR, RHT, image (wgrad operand)"] = lambda: quantize_op(src, rht_amax, col_index, n, False, True, key,
                                                                          True, False, rht)
        read = dy.numel() * 2
        for what, fn in cases.items():
            ms = bench(fn)
            rows.append({"operand": name, "pass": what, "ms": ms, "read GBps": read / ms / 1e6})
        del dy
    res["parts"] = rows
    print_table(f"the dy quantize passes alone ({ROWS} routed rows; GB/s of dy read)", rows,
                ["operand", "pass", "ms", "read GBps"])


SECTIONS = ("sweep_tile_quantize", "sweep_wgrad", "sweep_grouped", "sweep_rows", "sweep_cols", "sweep_parts")


def parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--sections", default="sweep_tile_quantize,sweep_wgrad,sweep_grouped,sweep_rows,sweep_cols")
    ap.add_argument("--rows", type=int, default=ROWS, help="routed rows (tokens x top-k)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    return ap


def main(argv=None):
    global ROWS
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    if not torch.cuda.is_available():
        sys.exit("benchmarks.kernels (sweep_* sections) needs a CUDA GPU")
    res = {"bench": "learner_sweep", **environment(), "command": command(argv)}
    ROWS = res["rows"] = args.rows
    for sec in args.sections.split(","):
        {"sweep_tile_quantize": sec_tile_quantize, "sweep_wgrad": sec_wgrad, "sweep_grouped": sec_grouped,
         "sweep_rows": sec_rows, "sweep_parts": sec_parts, "sweep_cols": sec_cols}[sec](res)
    save(res, "learner_sweep", [args.out, RESULTS])
    return res


if __name__ == "__main__":
    main()
