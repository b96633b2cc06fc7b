"""Train the tiny MoE in several parallel layouts and compare each with one process.

    python -m tests.parallel.run --nproc 2 --backend gloo --layouts tp2_sp,ep2,pp2_vp2,dp_do
    python -m tests.parallel.run --nproc 8 --backend nccl --layouts multi-gpu --specs nvfp4,exact
    torchrun --nproc-per-node 8 -m tests.parallel.run --backend nccl --layouts multi-gpu

Two jobs: the single-process references (every spec asked, and the exact model the 2x rule
needs) on one rank, then every layout on ``--nproc`` ranks, on the same initial weights and
data. Prints one row per layout and quantity (bitwise or the 2x rule, what was measured) and
exits with status 1 if any row fails. Under ``torchrun`` the references run on rank 0's device
in a spawned single-rank job first. ``--layouts ci`` (default) is what CI runs on 2 ranks,
``multi-gpu`` a set for 8 GPUs (issue 12). Layout names: :mod:`tests.parallel.layouts`.
``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from .layouts import CI_LAYOUTS, MULTI_GPU_LAYOUTS, LayoutError, parse
from .model import EXACT_OF, SPECS, global_batch_for
from .train import Run

WORKER = "tests.parallel.train:worker"


def _global_batch(layouts: list[str], world: int) -> int:
    """The global batch every layout (and one process) trains on; raises LayoutError."""
    return global_batch_for([parse(name) for name in layouts], world)


def reference_runs(specs: list[str], steps: int, global_batch: int) -> list[Run]:
    needed = list(dict.fromkeys([*specs, *(EXACT_OF[s] for s in specs)]))
    return [Run(spec, "ref", steps=steps, global_batch=global_batch) for spec in needed]


def layout_runs(specs: list[str], layouts: list[str], steps: int, init: str, global_batch: int,
                also: list[tuple[str, str]] = ()) -> list[Run]:
    pairs = [(spec, name) for spec in specs for name in layouts] + [p for p in also if p not in
                                                                    [(s, n) for s in specs for n in layouts]]
    return [Run(spec, name, steps=steps, init=init, global_batch=global_batch) for spec, name in pairs]


def run_references(specs: list[str], steps: int, work_dir: str, backend: str = "gloo", global_batch: int = 4) -> dict:
    from .spawn import run_distributed

    return run_distributed(WORKER, 1, backend, runs=reference_runs(specs, steps, global_batch), work_dir=work_dir)[0]


def run_layouts(layouts: list[str], *, world: int = 2, backend: str = "gloo", specs: list[str] | None = None,
                steps: int = 3, work_dir: str | None = None, also: list[tuple[str, str]] = ()) -> dict:
    """References + layouts; ``{"spec:layout": result}`` (see :mod:`tests.parallel.train`).

    Every layout runs with every spec of ``specs``; ``also`` adds single ``(spec, layout)`` runs.
    """
    from .spawn import run_distributed

    specs = list(specs or ["nvfp4"])
    size = _global_batch(layouts + [name for _, name in also], world)
    with tempfile.TemporaryDirectory(prefix="minite_parallel_") as tmp:
        work_dir = work_dir or tmp
        results = run_references(list(dict.fromkeys([*specs, *(s for s, _ in also)])), steps, work_dir, backend, size)
        init = os.path.join(work_dir, "init")
        results |= run_distributed(WORKER, world, backend, runs=layout_runs(specs, layouts, steps, init, size, also),
                                   work_dir=work_dir)[0]
    return results


def _expand(names: str) -> list[str]:
    out = []
    for name in names.split(","):
        out += list(CI_LAYOUTS if name == "ci" else MULTI_GPU_LAYOUTS if name == "multi-gpu" else [name])
    return list(dict.fromkeys(n for n in out if n))


def main(argv: list[str] | None = None) -> int:
    from .rules import compare
    from .spawn import launched_by_torchrun, run_in_this_process

    p = argparse.ArgumentParser(prog="python -m tests.parallel.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=int(os.environ.get("WORLD_SIZE", 2)), help="ranks (default 2)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    p.add_argument("--layouts", default="ci", help="comma-separated layout names, or 'ci' / 'multi-gpu'")
    p.add_argument("--specs", default="nvfp4", help=f"comma-separated, of {sorted(SPECS)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = p.parse_args(argv)
    layouts, specs = _expand(args.layouts), [s for s in args.specs.split(",") if s]
    unknown = [s for s in specs if s not in SPECS]
    if unknown:
        print(f"error: unknown spec(s) {unknown}; known: {sorted(SPECS)}", file=sys.stderr)
        return 2
    try:
        size = _global_batch(layouts, args.nproc)
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    if launched_by_torchrun():
        work_dir = os.environ.get("MINITE_PARALLEL_WORK_DIR") or os.path.join(tempfile.gettempdir(), "minite_parallel_"
                                                                             + os.environ.get("TORCHELASTIC_RUN_ID", "x"))
        rank = int(os.environ["RANK"])
        if rank == 0:
            os.makedirs(work_dir, exist_ok=True)
            refs = run_references(specs, args.steps, work_dir, args.backend, size)
        results = run_in_this_process(WORKER, args.backend, runs=layout_runs(specs, layouts, args.steps,
                                      os.path.join(work_dir, "init"), size), work_dir=work_dir)
        if rank != 0:
            return 0
        results |= refs
        world = int(os.environ["WORLD_SIZE"])
    else:
        results = run_layouts(layouts, world=args.nproc, backend=args.backend, specs=specs, steps=args.steps)
        world = args.nproc
    import torch

    rows = [r for spec in specs for r in compare(results, spec, layouts, world,
                                                 bitwise_capable=not torch.cuda.is_available())]
    for row in rows:
        print(row)
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed; {len(layouts)} layouts x {len(specs)} spec(s) "
          f"on {world} ranks ({args.backend}) in {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.__dict__ for r in rows], fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
