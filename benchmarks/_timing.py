"""Shared timing and reporting helpers of the benchmark scripts.

Timing: ``triton.testing.do_bench`` (CUDA events, warm-up first, median of repeats), or the
CUDA-graph variant for launch-bound cases (decode). Inputs that fit in L2 are rotated among
several copies so that repeated runs measure HBM, not the cache.
"""

from __future__ import annotations

import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import sys

import torch


def ensure_minite_kernels() -> None:
    """Make ``minite_kernels`` importable from a source checkout that was not pip-installed
    (the package lives in ``kernels/``, installed under another name)."""
    try:
        importlib.import_module("minite_kernels")
        return
    except ImportError:
        pass
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(
        "minite_kernels", os.path.join(root, "kernels", "__init__.py"),
        submodule_search_locations=[os.path.join(root, "kernels")],
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["minite_kernels"] = module
    spec.loader.exec_module(module)


def add_output_args(ap, bench_file: str) -> None:
    """A benchmark's usual ``--out`` (extra JSON directory, default ``$OUT``), ``--json-dir`` (default
    ``benchmarks/results`` beside ``bench_file``) and ``--smoke`` (CPU, tiny shapes, the interpreter)."""
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON line")
    ap.add_argument("--json-dir", default=os.path.join(os.path.dirname(os.path.abspath(bench_file)), "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter")


def smoke_on_the_interpreter() -> None:
    """A ``--smoke`` run on the CPU: Triton's interpreter (``TRITON_INTERPRET=1`` unless set) with the
    repository's interpreter fixes (:mod:`minite_kernels.triton._build._interpreter_compat`)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from minite_kernels.triton._build._interpreter_compat import install
    from minite_megatron.nvfp4.backends import triton_interpreting

    triton_interpreting.cache_clear()

    install()


def bench(fn, *, rep_ms: int = 100, warmup_ms: int = 25, graph: bool = False) -> float:
    """Median milliseconds of ``fn()`` (events; with ``graph=True`` a CUDA-graph replay)."""
    import triton.testing as tt

    if graph:
        return float(tt.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    return float(tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbps(device, numel: int = 1 << 29) -> float:
    """The device's copy bandwidth in GB/s, bytes read + written (``numel`` fp32: 2 GiB)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    gbps = 2 * src.numel() * 4 / bench(lambda: dst.copy_(src)) / 1e6
    del src, dst
    return gbps


class Rotating:
    """Call ``make()`` ``n`` times and hand the results out in turn (defeats L2 reuse)."""

    def __init__(self, make, n: int):
        self.items = [make() for _ in range(n)]
        self.i = 0

    def next(self):
        item = self.items[self.i]
        self.i = (self.i + 1) % len(self.items)
        return item


def environment() -> dict:
    import triton

    dev = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": dev.name if dev else "cpu",
        "sm_count": dev.multi_processor_count if dev else 0,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    print(f"\n## {title}")
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) if rows else len(c) for c in columns}
    print(" | ".join(c.ljust(widths[c]) for c in columns))
    print("-|-".join("-" * widths[c] for c in columns))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))
    sys.stdout.flush()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def save(results: dict, name: str, out_dirs: list[str]) -> list[str]:
    """Append ``results`` (with the environment) as one JSON line to ``<dir>/<name>.jsonl``."""
    paths = []
    for d in out_dirs:
        if not d:
            continue
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"{name}.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(results) + "\n")
        paths.append(path)
    return paths
