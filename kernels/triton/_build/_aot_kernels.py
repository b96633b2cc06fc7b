"""The kernels of this package as they are compiled for the H200, for ahead-of-time checks.

Each entry compiles one kernel at the config the ops launch on sm_90a (see the ops'
``select_config``), so tests and ``python -m minite_kernels.triton._build._aot_kernels`` inspect the code
that runs. Requires a process without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from minite_kernels.triton._build._aot import compile_for, report
from minite_kernels.triton.nvfp4._nvfp4_math import EXACT_LAUNCH


def _gemm(config, canonical=False, b_kmajor=False):
    from minite_kernels.triton.nvfp4.gemm import _gemm_tma_kernel

    bm, bn, bk, gm, warps, stages = config
    sig = {
        "a_desc": f"tensordesc<bf16[{bm},{bk}]>",
        "b_desc": f"tensordesc<bf16[{bk},{bn}]>" if b_kmajor else f"tensordesc<bf16[{bn},{bk}]>",
        "c_desc": f"tensordesc<bf16[{bm},{bn}]>",
        "sa_ptr": "*fp32", "sb_ptr": "*fp32", "bias_ptr": "*fp32", "M": "i32", "N": "i32", "K": "i32",
    }
    ce = dict(SA_ROWS=True, SB_ROWS=False, HAS_BIAS=True, B_KMAJOR=b_kmajor, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
              GROUP_M=gm, DOT_FP32=False, CANONICAL=canonical)
    return compile_for(_gemm_tma_kernel, sig, ce, num_warps=warps, num_stages=stages, **EXACT_LAUNCH)


def _grouped(config):
    from minite_kernels.triton.nvfp4.grouped_gemm import _grouped_gemm_kernel

    bm, bn, bk, warps, stages = config
    sig = {
        "a_desc": f"tensordesc<bf16[{bm},{bk}]>", "b_desc": f"tensordesc<bf16[1,{bn},{bk}]>", "c_ptr": "*bf16",
        "offs_ptr": "*i32", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "bias_ptr": "*fp32",
        "M": "i32", "N": "i32", "K": "i32", "G": "i32", "s_cm": "i32",
    }
    ce = dict(SA_ROWS=True, HAS_BIAS=False, B_KMAJOR=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, G_POW2=128,
              DOT_FP32=False, CANONICAL=False)
    return compile_for(_grouped_gemm_kernel, sig, ce, num_warps=warps, num_stages=stages, **EXACT_LAUNCH)


def _wgrad(config):
    from minite_kernels.triton.nvfp4.grouped_wgrad import _grouped_wgrad_kernel

    bm, bn, bt, warps, stages = config
    sig = {
        "a_desc": f"tensordesc<bf16[{bm},{bt}]>", "b_desc": f"tensordesc<bf16[{bn},{bt}]>",
        "a_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*fp32", "poffs_ptr": "*i32", "sa_ptr": "*fp32",
        "sb_ptr": "*fp32", "N": "i32", "KX": "i32", "T_PAD": "i32",
    }
    ce = dict(SA_ROWS=False, SB_ROWS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_T=bt, DOT_FP32=False, CANONICAL=False)
    return compile_for(_grouped_wgrad_kernel, sig, ce, num_warps=warps, num_stages=stages, **EXACT_LAUNCH)


def _decode(m_pad=16, block_n=64, block_k=128, warps=4, nchunk=4, depth=4, split_max=4, asm=True):
    """The dense decode kernel (default configuration shape: split K, ``nchunk`` steps per program)."""
    from minite_kernels.triton.decode.decode_gemm import _decode_gemm_kernel

    sig = {
        "a_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*bf16", "part_ptr": "*fp32",
        "cnt_ptr": "*i32", "sa_ptr": "*fp32", "sb_ptr": "*fp32", "bias_ptr": "*fp32", "lut_ptr": "*i32",
        "M": "i32", "N": "i32", "K": "i32", "s_cn": "i32", "s_sn": "i32", "s_am": "i32", "s_om": "i32",
        "SPLIT": "i32",
    }
    ce = dict(SA_ROWS=True, SB_ROWS=False, HAS_BIAS=False, MASK_K=False, EVEN_N=True, BLOCK_N=block_n, BLOCK_K=block_k,
              M_PAD=m_pad, NCHUNK=nchunk, DEPTH=depth, SPLIT_MAX=split_max, ASM=asm, DOT_FP32=False)
    return compile_for(_decode_gemm_kernel, sig, ce, num_warps=warps, num_stages=1,
                       divisible=("K", "s_cn", "s_sn", "s_am", "N"), **EXACT_LAUNCH)


def _decode_grouped(config: dict, k: int = 2048, r_pow2: int = 64, experts: int = 128):
    """The MoE decode kernel at one launch configuration (``decode_grouped_gemm.select_config``
    form: BLOCK_N, BLOCK_K, M_PAD, NCHUNK, DEPTH, SPLIT, num_warps, optionally GROUP), 8 tokens x
    top-8 of ``experts`` (``r_pow2`` rows), K = ``k``."""
    from minite_kernels.triton.decode.decode_grouped_gemm import _decode_grouped_kernel, rolled_group

    sig = {
        "a_ptr": "*bf16", "codes_ptr": "*u8", "scales_ptr": "*u8", "ids_ptr": "*i32", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "cnt_ptr": "*i32", "sa_ptr": "*fp32", "sw_ptr": "*fp32", "lut_ptr": "*i32",
        "R": "i32", "N": "i32", "K": "i32", "E": "i32", "s_cn": "i32", "s_sn": "i32", "s_am": "i32", "s_om": "i32",
        "SPLIT": "i32",
    }
    nchunk = config["NCHUNK"]
    split = -(-k // (nchunk * config["BLOCK_K"]))
    ce = dict(SA_ROWS=True, SW_ROWS=False, MASK_K=k % (nchunk * config["BLOCK_K"]) != 0, BLOCK_N=config["BLOCK_N"],
              BLOCK_K=config["BLOCK_K"], M_PAD=config["M_PAD"], NCHUNK=nchunk, DEPTH=config["DEPTH"],
              SPLIT_MAX=1 << max(0, (split - 1).bit_length()), R_POW2=r_pow2, E_POW2=experts, ASM=True, DOT_FP32=False,
              GROUP=rolled_group(nchunk, config.get("GROUP", 0)),
              ONE_SPLIT=split == 1 and bool(config.get("ONE_SPLIT", False)))
    return compile_for(_decode_grouped_kernel, sig, ce, num_warps=config["num_warps"], num_stages=1,
                       divisible=("K", "s_cn", "s_sn", "s_am", "N"), **EXACT_LAUNCH)


def _decode_grouped_idot(config: dict, k: int = 2048, sorted_rows: bool = True, r_pow2: int = 64,
                         experts: int = 128, gather: bool = False):
    """The integer-dot MoE decode kernel at one launch entry (``decode_grouped_idot.GPU_IDOT`` form),
    K = ``k``, rows by group offsets (``sorted_rows``) or by expert ids (8 tokens x top-8: ``r_pow2``);
    ``gather``: activation rows by index (``GATHER``)."""
    from minite_kernels.triton.decode.decode_grouped_idot import _decode_grouped_idot_kernel, idot_config

    cfg = idot_config(k, config)
    sig = {
        "xc_ptr": "*i64", "xs_ptr": "*u8", "wc_ptr": "*i64", "ws_ptr": "*u8", "ids_ptr": "*i32", "offs_ptr": "*i32",
        "out_ptr": "*bf16", "sa_ptr": "*fp32", "sw_ptr": "*fp32", "lut_ptr": "*i32", "bias_ptr": "*fp32",
        "xrows_ptr": "*i32", "R": "i32", "N": "i32", "KB": "i32", "E": "i32", "s_xc": "i32", "s_xs": "i32",
        "s_wc": "i32", "s_ws": "i32", "s_om": "i32", "T": "i32",
    }
    ce = dict(SORTED=sorted_rows, DENSE=False, HAS_BIAS=False, SA_ROWS=True, SW_ROWS=False,
              MASK_K=(k // 16) % cfg["BLOCK_KB"] != 0, GATHER=gather,
              BLOCK_N=cfg["BLOCK_N"], BLOCK_KB=cfg["BLOCK_KB"], PAIRS=cfg["PAIRS"], NSTEPS=cfg["NSTEPS"], UNROLL=cfg["UNROLL"],
              R_POW2=r_pow2, E_POW2=experts, ASM=True, BITWISE_BF16=False)
    return compile_for(_decode_grouped_idot_kernel, sig, ce, num_warps=config["num_warps"], num_stages=1,
                       divisible=("KB", "s_xc", "s_xs", "s_wc", "s_ws", "s_om", "N"))


def _quantize(block_r=32, block_k=128, warps=4, single=False, stochastic=False, row_amax=True, stride_k_one=True):
    from minite_kernels.triton.nvfp4.quantize import _quantize_kernel

    sig = {
        "x_ptr": "*bf16", "col_ptr": "*i32", "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8",
        "sdec_ptr": "*fp32", "image_ptr": "*i16", "R": "i32", "K": "i32", "stride_r": "i32", "stride_k": "i32",
        "rows_per_group": "i32", "key": "i32", "scale_cols_padded": "i32",
    }
    ce = dict(HAS_COL_INDEX=False, ROW_AMAX=row_amax, TILE16=False, STOCHASTIC=stochastic, WITH_IMAGE=True,
              SWIZZLED=False, BLOCK_R=block_r, BLOCK_K=block_k, SINGLE_PASS=single)
    if stride_k_one:
        ce["stride_k"] = 1
        del sig["stride_k"]
    return compile_for(_quantize_kernel, sig, ce, num_warps=warps, divisible=("K", "stride_r", "scale_cols_padded"),
                       **EXACT_LAUNCH)


def _quantize_t(block_t=64, block_h=64, warps=4, stochastic=False, col_index=False):
    from minite_kernels.triton.nvfp4.quantize import _quantize_t_kernel

    sig = {
        "s_ptr": "*bf16", "col_ptr": "*i32", "amax_ptr": "*fp32", "codes_ptr": "*u8", "scales_ptr": "*u8",
        "sdec_ptr": "*fp32", "image_ptr": "*i16", "R": "i32", "K": "i32", "stride_s": "i32", "T_SRC": "i32",
        "rows_per_group": "i32", "key": "i32", "scale_cols_padded": "i32",
    }
    ce = dict(HAS_COL_INDEX=col_index, STOCHASTIC=stochastic, WITH_IMAGE=True, SWIZZLED=False,
              BLOCK_T=block_t, BLOCK_H=block_h)
    return compile_for(_quantize_t_kernel, sig, ce, num_warps=warps,
                       divisible=("R", "K", "stride_s", "T_SRC", "scale_cols_padded"), **EXACT_LAUNCH)


def _bi_matmul(config):
    """Strict mode's LM head / router tile on bf16 operands (unit inner strides, as launched)."""
    from minite_kernels.triton.invariant.bi_matmul import _bi_matmul_kernel

    bm, bn, bk, warps, stages = config
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*fp32", "out_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "sxm": "i32", "swn": "i32", "som": "i32"}
    ce = dict(sxk=1, swk=1, son=1, HAS_BIAS=False, CAST_FP32=False, PRECISION="tf32", AS_SUM=False, BM=bm, BN=bn, BK=bk)
    return compile_for(_bi_matmul_kernel, sig, ce, divisible=("K", "sxm", "swn", "som"), num_warps=warps, num_stages=stages)


def _bi_attention(config, head_dim=128, with_lse=True):
    """Strict attention (causal, bf16, the [S, B, H, D] layout Megatron passes: unit D stride); with
    ``with_lse`` the learner's variant (also stores the log-sum-exp for the fused backward), else the
    rollout engine's."""
    from minite_kernels.triton.invariant.bi_attention import _bi_attention_kernel

    bm, bn, warps, stages = config
    ints = ("Hq", "Sq", "Sk", "D", "Dv", "GROUP", "sqb", "sqh", "sqs", "skb", "skh", "sks", "svb", "svh", "svs",
            "smb", "smh", "sms", "smk", "sob", "soh", "sos", "slb", "slh")
    sig = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "m_ptr": "*fp32", "out_ptr": "*fp32",
           "lse_ptr": "*fp32", **{n: "i32" for n in ints}, "qk_scale": "fp32"}
    sig = {n: sig[n] for n in _bi_attention_kernel.arg_names if n in sig}
    ce = dict(sqd=1, skd=1, svd=1, sod=1, sls=1, CAUSAL=True, HAS_MASK=False, CAST_FP32=False, PRECISION="tf32",
              AS_SUM=False, WITH_LSE=with_lse, BM=bm, BN=bn, BD=head_dim, BDV=head_dim)
    div = [n for n in ints if n.startswith(("sq", "sk", "sv", "so", "sl")) or n in ("D", "Dv")]
    return compile_for(_bi_attention_kernel, sig, ce, divisible=div, num_warps=warps, num_stages=stages)


def _moe_combine(k=0, hidden=2048, gather=False):
    """The MoE combine (``k=0``: indexed rows, else ``[T, k, H]`` slots) or its backward gather, bf16."""
    import triton.language as tl

    from minite_kernels.triton.moe import moe_combine as mc

    block, warps = mc._config(hidden)
    if gather:
        sig = {"src_ptr": "*bf16", "index_ptr": "*i64", "out_ptr": "*bf16", "H": "i32", "s_src": "i32", "s_out": "i32"}
        ce = dict(s_col=1, K=k, CANONICAL=True, BLOCK_H=block, DTYPE=tl.bfloat16)
        return compile_for(mc._moe_gather_rows_kernel, sig, ce, divisible=("H", "s_src", "s_out"), num_warps=warps)
    sig = {"src_ptr": "*bf16", "order_ptr": "*i64", "bounds_ptr": "*i32", "out_ptr": "*bf16", "H": "i32",
           "s_row": "i32", "s_slot": "i32", "s_out": "i32"}
    ce = dict(s_col=1, K=k, BLOCK_H=block, DTYPE=tl.bfloat16, EMULATE_BF16=False)
    return compile_for(mc._moe_sum_rows_kernel, sig, ce, divisible=("H", "s_row", "s_slot", "s_out"), num_warps=warps)


def _group_zero(dtype="bf16"):
    """The empty-expert zeroing of the BF16 twin's wgrad (``group_zero``), int64 counts."""
    from minite_kernels.triton.nvfp4 import group_zero as gz

    sig = {"out_ptr": f"*{dtype}", "counts_ptr": "*i64", "slice_numel": "i32"}
    return compile_for(gz._zero_empty_groups_kernel, sig, dict(BLOCK=gz.BLOCK, CHUNKS=gz.CHUNKS),
                       divisible=("slice_numel",), num_warps=4)


def all_kernels():
    """(name, compiled kernel) of every kernel at its H200 launch config."""
    from minite_kernels.triton.nvfp4 import gemm
    from minite_kernels.triton.nvfp4 import grouped_gemm
    from minite_kernels.triton.nvfp4 import grouped_wgrad
    from minite_kernels.triton.nvfp4 import quantize

    yield "gemm default", _gemm(gemm.select_config(4096, 4096, 4096, False, False, gpu=True))
    yield "gemm strict", _gemm(gemm.STRICT_CONFIG)
    yield "gemm canonical", _gemm(gemm.CANONICAL_CONFIG, canonical=True)
    yield "gemm dgrad (B k-major)", _gemm(gemm.select_config(4096, 4096, 4096, False, False, gpu=True), b_kmajor=True)
    yield "grouped gemm", _grouped(grouped_gemm.select_config(65536, 1536, 2048, 128, False, False, gpu=True))
    yield "grouped wgrad", _wgrad(grouped_wgrad.select_config(False, gpu=True))
    yield "decode gemm", _decode()
    yield "quantize K=2048 (one pass)", _quantize(*quantize._config(1 << 20, 2048, False, False))
    yield "quantize K=16384 (loop)", _quantize(*quantize._config(1 << 20, 16384, False, False))
    yield "quantize SR K=2048", _quantize(*quantize._config(1 << 20, 2048, False, True), stochastic=True)
    bt, bh, warps = quantize.DEFAULT.transposed_tile
    yield "quantize x.t()", _quantize_t(bt, bh, warps)
    yield "quantize x.t() SR gather", _quantize_t(bt, bh, warps, stochastic=True, col_index=True)
    from minite_kernels.triton.invariant import bi_attention
    from minite_kernels.triton.invariant import bi_matmul

    yield "bi_matmul (tensor cores)", _bi_matmul(bi_matmul.MMA_CONFIG)
    yield "bi_attention (learner: + LSE)", _bi_attention(bi_attention.GPU_CONFIG)
    yield "bi_attention (rollout)", _bi_attention(bi_attention.GPU_CONFIG, with_lse=False)
    yield "moe combine", _moe_combine()
    yield "moe combine [T, 8, H]", _moe_combine(8)
    yield "moe combine backward", _moe_combine(gather=True)
    yield "group zero (empty experts' dW)", _group_zero()
    from minite_kernels.triton._build import _aot_quantize

    yield from _aot_quantize.all_kernels()  # the fast row/column kernels the dispatch prefers


if __name__ == "__main__":  # pragma: no cover - a developer tool: python -m minite_kernels.triton._build._aot_kernels
    for name, kernel in all_kernels():
        print(f"{name:40s} {report(kernel)}")
