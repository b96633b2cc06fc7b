"""benchmarks.kernel_sites: kernels joined to the Python frames open at their launch."""

from benchmarks.kernel_sites import format_table, kernel_sites


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_kernels_are_summed_per_innermost_plugin_frames():
    events = [
        _x("python_function", "/x/benchmarks/learner_step.py(10): main", 0, 1000),
        _x("python_function", "/x/minite_megatron/ops/linear.py(170): backward", 10, 400),
        _x("python_function", "/x/minite_megatron/ops/roles.py(120): quantize_role", 20, 100),
        _x("python_function", "/tmp/shim/minite_kernels/triton/nvfp4/quantize.py(50): quantize_forward", 30, 50),
        _x("cuda_driver", "cuLaunchKernelEx", 40, 5, correlation=1),
        _x("python_function", "/x/minite_megatron/ops/roles.py(120): quantize_role", 200, 100),
        _x("cuda_driver", "cuLaunchKernelEx", 250, 5, correlation=2),
        _x("python_function", "/x/megatron/core/transformer/moe/router.py(5): forward", 500, 100),
        _x("cuda_runtime", "cudaLaunchKernel", 550, 5, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 700, 5, correlation=4),  # after every frame but main closed
        _x("kernel", "_quantize_rows_kernel", 60, 30.0, tid=7, correlation=1, grid=[128, 1, 1]),
        _x("kernel", "_quantize_rows_kernel", 300, 10.0, tid=7, correlation=2, grid=[64, 1, 1]),
        _x("kernel", "elementwise", 600, 4.0, tid=7, correlation=3, grid=[8, 1, 1]),
        _x("kernel", "elementwise", 710, 2.0, tid=7, correlation=4, grid=[8, 1, 1]),
        _x("kernel", "orphan", 800, 1.0, tid=7, correlation=99),
    ]
    rows = {(r["kernel"], r["site"]): r for r in kernel_sites(events, depth=2)}
    quant = rows[("_quantize_rows_kernel", "ops/roles.quantize_role < ops/linear.backward")]
    assert quant["calls"] == 2 and abs(quant["ms_per_step"] - 0.040) < 1e-12 and quant["mean_us"] == 20.0
    assert quant["grid"] in ("128x1x1", "64x1x1")
    assert rows[("elementwise", "mcore/transformer/moe/router.forward")]["calls"] == 1
    assert rows[("elementwise", "(no Python frame)")]["calls"] == 1  # only a benchmarks frame was open
    assert rows[("orphan", "(launch not in trace)")]["calls"] == 1
    first = kernel_sites(events, depth=2)[0]
    assert first["kernel"] == "_quantize_rows_kernel"  # sorted by GPU time
    assert "ops/roles.quantize_role" in format_table(kernel_sites(events), 5)
