"""Where each GPU kernel of a profiled step was launched from: GPU time by (kernel, call site).

A kernel table (``torch.profiler``'s ``key_averages``) says *that* ``_quantize_rows_kernel`` takes
12 ms over 44 calls, not *which* 44 operands they were. This reads a Chrome trace written with
``with_stack=True`` (``python -m benchmarks.learner_step --trace``), joins every kernel to its
launch (the runtime/driver event with the same ``correlation``) and the launch to the Python frames
open at that moment on the launching thread, and sums GPU time per kernel and call site: the
innermost ``depth`` frames inside the project (``minite_megatron/``, ``kernels/``) or, where no
project frame is open, Megatron's (``megatron/``)::

    python -m benchmarks.kernel_sites trace.json.gz [--top 40] [--depth 3]

Prints one table (ms per step, calls, mean us, mean grid) and returns the rows as dicts.
"""

from __future__ import annotations

from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import collections
import gzip
import json
import re

#: path fragments of frames that name a call site, in order of preference: the plugin, its kernels
#: (``kernels/triton/`` in a checkout, ``minite_kernels/triton/`` through the import shim), Megatron
PROJECT = ("minite_megatron/", "kernels/triton/", "minite_kernels/triton/")
FALLBACK = ("megatron/core/", "megatron/training/")
_FRAME = re.compile(r"^(?P<path>.*?)\((?P<line>\d+)\): (?P<func>.*)$")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def _short(name: str) -> str | None:
    """``minite_megatron/ops/linear.py(170): backward`` -> ``ops/linear.backward``; None for a frame
    outside the project and Megatron."""
    m = _FRAME.match(name)
    if not m:
        return None
    path = m["path"]
    for frag in PROJECT + FALLBACK:
        i = path.rfind(frag)
        if i >= 0:
            rel = path[i + len(frag):] if frag == PROJECT[0] else path[i:]
            rel = rel.removesuffix(".py").replace("megatron/core/", "mcore/").replace("minite_kernels/", "kernels/")
            return f"{rel}.{m['func']}"
    return None


def _rank(short: str) -> int:
    """0: a plugin frame, 1: a kernel module's, 2: Megatron's."""
    return 1 if short.startswith("kernels/") else 2 if short.startswith(("mcore/", "megatron/")) else 0


def kernel_sites(events: list[dict], depth: int = 3, steps: int = 1) -> list[dict]:
    """Rows ``{kernel, site, calls, ms_per_step, mean_us, grid}`` sorted by GPU time (see module)."""
    launches: dict[int, tuple[float, int]] = {}
    frames: dict[int, list[tuple[float, float, str]]] = collections.defaultdict(list)
    kernels = []
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") != "X":
            continue
        if cat in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = (e["ts"], e["tid"])
        elif cat == "python_function":
            short = _short(e.get("name", ""))
            if short is not None:
                frames[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), short))
        elif cat == "kernel":
            args = e.get("args", {})
            kernels.append((e.get("name", "?"), e.get("dur", 0.0), args.get("correlation"), tuple(args.get("grid", ()))))

    # the open frames at each launch: a sweep over nested intervals per thread
    site_of: dict[int, str] = {}
    queries: dict[int, list[tuple[float, int]]] = collections.defaultdict(list)
    for corr, (ts, tid) in launches.items():
        queries[tid].append((ts, corr))
    for tid, qs in queries.items():
        qs.sort()
        fr = sorted(frames.get(tid, ()), key=lambda f: (f[0], -f[1]))
        stack: list[tuple[float, float, str]] = []
        i = 0
        for ts, corr in qs:
            while i < len(fr) and fr[i][0] <= ts:
                while stack and stack[-1][1] < fr[i][0]:
                    stack.pop()
                stack.append(fr[i])
                i += 1
            while stack and stack[-1][1] < ts:
                stack.pop()
            open_frames = [f[2] for f in stack if f[1] >= ts]
            best = min((_rank(f) for f in open_frames), default=0)
            chosen = [f for f in open_frames if _rank(f) == best]  # the plugin's frames, else ...
            chain = list(dict.fromkeys(reversed(chosen)))[:depth]  # innermost first, no repeats
            site_of[corr] = " < ".join(chain) if chain else "(no Python frame)"

    acc: dict[tuple[str, str], list] = {}
    for name, dur, corr, grid in kernels:
        key = (name[:60], site_of.get(corr, "(launch not in trace)"))
        a = acc.setdefault(key, [0, 0.0, collections.Counter()])
        a[0] += 1
        a[1] += dur
        a[2][grid] += 1
    rows = [{"kernel": k, "site": s, "calls": round(n / steps, 2), "ms_per_step": us / 1e3 / steps,
             "mean_us": us / n, "grid": "x".join(map(str, g.most_common(1)[0][0])) if g else ""}
            for (k, s), (n, us, g) in acc.items()]
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows


def format_table(rows: list[dict], top: int) -> str:
    total = sum(r["ms_per_step"] for r in rows) or 1.0
    lines = [f"GPU {total:.2f} ms per step in {len(rows)} (kernel, site) pairs; top {top}:",
             f"{'ms/step':>8} {'%':>5} {'calls':>6} {'mean us':>8}  {'kernel':<42} site  [grid]"]
    for r in rows[:top]:
        lines.append(f"{r['ms_per_step']:8.3f} {100 * r['ms_per_step'] / total:5.1f} {r['calls']:6g} {r['mean_us']:8.1f}  "
                     f"{r['kernel'][:42]:<42} {r['site']}  [{r['grid']}]")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="Chrome trace (.json or .json.gz) written with with_stack=True")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--depth", type=int, default=3, help="project frames per site, innermost first")
    ap.add_argument("--steps", type=int, default=1, help="steps the trace holds (per-step numbers)")
    args = ap.parse_args(argv)
    rows = kernel_sites(_load(args.trace), args.depth, args.steps)
    print(format_table(rows, args.top))
    return rows


if __name__ == "__main__":
    main()
