"""The seeds' experiment on one 8-GPU node: Qwen3-30B-A3B learner steps, miniTE NVFP4 against
Transformer Engine BF16 and TE's own NVFP4 recipe, in the same parallel layout.

    python -m benchmarks.seeds_comparison --dry-run            # the commands and what each row needs
    python -m benchmarks.seeds_comparison                      # all rows this machine can run
    python -m benchmarks.seeds_comparison --layers 8 --iters 20 --rows minite,te_bf16

The headline it reproduces (DESIGN.md; 8xB300, never measured here): the miniTE learner 1.39x
faster than BF16 and 1.47x faster than naive TE NVFP4, and a strict-mode learner-vs-rollout
gap near 1e-8. Rows:

=================  =======================================================================
row                what runs
=================  =======================================================================
minite             ``--transformer-impl minite`` (default recipe, the Blackwell backend)
minite_strict      the same with ``--minite-strict`` (batch-invariant kernels): the cost
te_bf16            ``--transformer-impl transformer_engine`` in BF16
te_nvfp4           TE with ``--fp4-format e2m1 --fp4-recipe nvfp4`` (TE's NVFP4BlockScaling)
strict_gap         ``minite-diagnose run --strict --preset qwen3-moe`` on one GPU: the
                   learner-vs-rollout log-prob gap of 4 Qwen3-30B-A3B-shaped layers
=================  =======================================================================

Every training row is ``torchrun --nproc-per-node 8 -m minite_megatron.launch
examples/pretrain_gpt.py`` with the architecture and layout of
``examples/configs/qwen3_30b_a3b.sh`` (EP=8, TP=1, PP=1, distributed optimizer, BF16; only
the implementation flags differ), mock data, ``--iters`` steps; the first ``--warmup``
are dropped. From Megatron's own log lines: the median step time, tokens/s per GPU
(global batch x sequence length / step time / GPUs), Megatron's TFLOP/s per GPU and rank 0's
peak allocated memory (``--log-memory-interval 1``). Each row says what it needs (GPUs, their
architecture, the TE version) and is refused with that reason where the machine lacks it:
nothing is estimated, a refused row has no numbers. The table is printed and one JSON line
(device, versions, commands, logs' paths) is appended to
``benchmarks/results/seeds_comparison.jsonl``. Exit status 0 if every requested row ran,
1 if a run failed, 2 if every row was refused.
"""

from __future__ import annotations

import argparse
from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "configs" / "qwen3_30b_a3b.sh"
ROWS = ("minite", "minite_strict", "te_bf16", "te_nvfp4", "strict_gap")
TE_FP4_MIN = "2.7.0"  # Megatron-Core 0.19.2's floor for --fp4-recipe (megatron/core/fp4_utils.py)
BLACKWELL_CAPABILITIES = ((10, 0), (10, 3))


# ---------------------------------------------------------------------------------------------
# Arguments of each row
# ---------------------------------------------------------------------------------------------
def config_args(config: Path = CONFIG) -> list[str]:
    """``QWEN3_30B_A3B_ARGS`` of the config script, as bash expands it."""
    out = subprocess.run(
        ["bash", "-c", f'source "{config}"; printf "%s\\0" "${{QWEN3_30B_A3B_ARGS[@]}}"'],
        check=True, capture_output=True, text=True,
    ).stdout
    return [a for a in out.split("\0") if a]


def _set(argv: list[str], flag: str, value) -> list[str]:
    argv = list(argv)
    if flag in argv:
        argv[argv.index(flag) + 1] = str(value)
    else:
        argv += [flag, str(value)]
    return argv


def training_args(row: str, base: list[str], *, layers: int, iters: int, micro_batch: int, global_batch: int,
                  seq_length: int) -> list[str]:
    """Megatron arguments of one training row: the config's model and layout, this row's
    implementation flags, mock data and the logging the metrics are read from."""
    argv = _set(base, "--num-layers", layers)
    argv = _set(argv, "--seq-length", seq_length)
    if row in ("te_bf16", "te_nvfp4"):
        argv = _set(argv, "--transformer-impl", "transformer_engine")
    if row == "te_nvfp4":
        argv += ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]
    if row == "minite_strict":
        argv += ["--minite-strict"]
    argv += [
        "--mock-data", "--tokenizer-type", "NullTokenizer",  # the config sets --vocab-size
        "--micro-batch-size", str(micro_batch), "--global-batch-size", str(global_batch),
        "--train-iters", str(iters), "--lr", "1e-5", "--min-lr", "1e-6", "--lr-decay-style", "constant",
        "--eval-iters", "0", "--eval-interval", str(iters + 1), "--log-interval", "1",
        "--log-throughput", "--log-memory-interval", "1",
    ]
    return argv


def row_command(row: str, args: argparse.Namespace, base: list[str]) -> list[str]:
    if row == "strict_gap":
        return [sys.executable, "-m", "minite_megatron.diagnostics.cli", "run", "--strict", "--preset", "qwen3-moe",
                "--prompts", "8", "--new-tokens", "32", "--out", str(Path(args.log_dir) / "strict_gap")]
    return [
        "torchrun", "--standalone", f"--nproc-per-node={args.nproc}", "-m", "minite_megatron.launch",
        str(ROOT / "examples" / "pretrain_gpt.py"),
        *training_args(row, base, layers=args.layers, iters=args.iters, micro_batch=args.micro_batch,
                       global_batch=args.global_batch, seq_length=args.seq_length),
    ]


# ---------------------------------------------------------------------------------------------
# What each row needs
# ---------------------------------------------------------------------------------------------
@dataclass
class Machine:
    """What the requirements are checked against (probed by :func:`probe_machine`)."""

    gpus: int = 0
    capabilities: list[tuple[int, int]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    te_version: str | None = None
    te_error: str | None = None
    torchrun: bool = False


def probe_machine() -> Machine:
    import shutil

    import torch

    m = Machine(torchrun=shutil.which("torchrun") is not None)
    if torch.cuda.is_available():
        m.gpus = torch.cuda.device_count()
        m.capabilities = [torch.cuda.get_device_capability(i) for i in range(m.gpus)]
        m.names = [torch.cuda.get_device_name(i) for i in range(m.gpus)]
    try:
        import transformer_engine

        m.te_version = getattr(transformer_engine, "__version__", "unknown")
    except Exception as e:  # not installed, or a broken install: say which
        m.te_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return m


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def needs(row: str, nproc: int) -> str:
    """What ``row`` needs, in words (printed in the table)."""
    gpus = "1 Blackwell GPU (sm_100a/sm_103a)" if row == "strict_gap" else f"{nproc} Blackwell GPUs (sm_100a/sm_103a)"
    if row == "te_bf16":
        return f"{nproc} CUDA GPUs, Transformer Engine (any version Megatron-Core 0.19.2 accepts)"
    if row == "te_nvfp4":
        return f"{gpus}, Transformer Engine >= {TE_FP4_MIN}"
    return gpus + ", the CUTLASS DSL"


def refusal(row: str, machine: Machine, nproc: int) -> str | None:
    """Why ``row`` cannot run on ``machine`` (one line), or None."""
    want = 1 if row == "strict_gap" else nproc
    if row != "strict_gap" and not machine.torchrun:
        return "needs torchrun on PATH"
    if machine.gpus < want:
        return f"needs {want} CUDA GPU{'s' if want > 1 else ''}, this machine has {machine.gpus}"
    if row in ("te_bf16", "te_nvfp4") and machine.te_version is None:
        return f"needs Transformer Engine, which does not import here ({machine.te_error})"
    if row == "te_nvfp4" and _version_tuple(machine.te_version) < _version_tuple(TE_FP4_MIN):
        return f"needs Transformer Engine >= {TE_FP4_MIN} for --fp4-recipe nvfp4, found {machine.te_version}"
    if row != "te_bf16":
        bad = [f"{n} ({c[0]}.{c[1]})" for n, c in zip(machine.names, machine.capabilities) if c not in BLACKWELL_CAPABILITIES][:1]
        if any(c not in BLACKWELL_CAPABILITIES for c in machine.capabilities[:want]):
            return f"needs FP4 tensor cores (compute capability 10.0 or 10.3); GPU 0..{want - 1} include {bad[0]}"
    if row in ("minite", "minite_strict", "strict_gap"):
        from importlib.util import find_spec

        if find_spec("cutlass") is None:
            return "needs the CUTLASS DSL (pip install -c constraints.txt 'nvidia-cutlass-dsl>=4.8')"
    return None


# ---------------------------------------------------------------------------------------------
# Reading Megatron's logs
# ---------------------------------------------------------------------------------------------
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([\d.]+) \|(.*)")
_TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")
_BATCH = re.compile(r"global batch size:\s+(\d+)")
_LOSS = re.compile(r"lm loss: ([\d.Ee+-]+)")
_MEMORY = re.compile(r"\(after (\d+) iterations\) memory \(MB\) \| allocated: [\d.]+ \| max allocated: ([\d.]+)")


def parse_training_log(text: str, *, warmup: int, seq_length: int, world_size: int) -> dict:
    """Metrics of one run from Megatron's stdout: iterations after ``warmup`` only.

    Returns ``{"iterations", "step_ms", "tokens_per_s_per_gpu", "tflops_per_gpu",
    "peak_allocated_gib", "last_loss"}`` (step_ms / TFLOP/s: medians). Raises ``ValueError``
    naming what is missing when the log holds no measured iteration.
    """
    steps, tflops, batches, loss = [], [], [], None
    for it, ms, rest in _ITER.findall(text):
        if int(it) <= warmup:
            continue
        steps.append(float(ms))
        if (m := _TFLOPS.search(rest)) is not None:
            tflops.append(float(m.group(1)))
        if (m := _BATCH.search(rest)) is not None:
            batches.append(int(m.group(1)))
        if (m := _LOSS.search(rest)) is not None:
            loss = float(m.group(1))
    if not steps:
        raise ValueError(f"no 'elapsed time per iteration' log line after the first {warmup} iterations")
    peaks = [float(mb) for _, mb in _MEMORY.findall(text)]
    step_ms = statistics.median(steps)
    batch = batches[-1] if batches else None
    return {
        "iterations": len(steps),
        "step_ms": step_ms,
        "tokens_per_s_per_gpu": None if batch is None else batch * seq_length / (step_ms / 1e3) / world_size,
        "tflops_per_gpu": statistics.median(tflops) if tflops else None,
        "peak_allocated_gib": max(peaks) / 1024 if peaks else None,
        "last_loss": loss,
    }


def parse_gap(out_dir: Path) -> dict:
    import json

    gap = json.loads((out_dir / "gap.json").read_text())
    keys = ("rollout_corr/train_rollout_logprob_abs_diff", "rollout_corr/k3_kl", "rollout_corr/logprob_abs_diff_max")
    return {k.split("/")[-1]: gap[k] for k in keys if k in gap}


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineArgumentParser(prog="python -m benchmarks.seeds_comparison", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated rows, from {','.join(ROWS)}")
    p.add_argument("--nproc", type=int, default=8, help="GPUs per training run (default 8: EP=8 in the config)")
    p.add_argument("--layers", type=int, default=48, help="transformer layers (default 48, the full model)")
    p.add_argument("--iters", type=int, default=20, help="training steps per run (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of the metrics (default 5)")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=64, help="sequences per step (default 64)")
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--log-dir", default="runs/seeds_comparison", help="each run's full log goes here")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run before it counts as failed")
    p.add_argument("--dry-run", action="store_true", help="print the commands and requirements; run nothing")
    p.add_argument("--no-save", action="store_true", help="do not append to benchmarks/results/seeds_comparison.jsonl")
    args = p.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if unknown := [r for r in rows if r not in ROWS]:
        p.error(f"--rows: unknown row(s) {unknown}; choose from {','.join(ROWS)}")
    if args.nproc < 1 or 8 % args.nproc and args.nproc % 8:
        p.error(f"--nproc must divide or be a multiple of 8 (the config's EP=8 layout), got {args.nproc}")
    if not 0 <= args.warmup < args.iters:
        p.error(f"--warmup must be in [0, --iters), got --warmup {args.warmup} --iters {args.iters}")
    if args.layers < 1 or args.global_batch % (args.micro_batch * args.nproc):
        p.error(f"--layers must be >= 1 and --global-batch a multiple of --micro-batch x --nproc "
                f"(got {args.layers}, {args.global_batch}, {args.micro_batch} x {args.nproc})")
    args.row_list = rows
    return args


def _run(cmd: list[str], log: Path, timeout: int) -> tuple[int, str]:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        text, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, code = f"{e.stdout or ''}{e.stderr or ''}\n[timed out after {timeout} s]", 124
    log.write_text(text if isinstance(text, str) else text.decode(errors="replace"))
    return code, text


def main(argv=None, machine: Machine | None = None) -> int:
    args = parse_args(argv)
    base = config_args()
    commands = {row: row_command(row, args, base) for row in args.row_list}
    if args.dry_run:
        for row in args.row_list:
            print(f"# {row}: needs {needs(row, args.nproc)}")
            print(shlex.join(commands[row]) + "\n")
        return 0

    machine = machine or probe_machine()
    from benchmarks._timing import environment, print_table, save

    results = []
    for row in args.row_list:
        entry = {"row": row, "needs": needs(row, args.nproc), "command": shlex.join(commands[row])}
        reason = refusal(row, machine, args.nproc)
        if reason is not None:
            entry.update(status=f"refused: {reason}")
            results.append(entry)
            continue
        log = Path(args.log_dir) / f"{row}.log"
        t0 = time.time()
        code, text = _run(commands[row], log, args.timeout)
        entry.update(log=str(log), seconds=round(time.time() - t0, 1))
        if code != 0:
            entry.update(status=f"failed (exit {code}; see {log})")
        else:
            try:
                if row == "strict_gap":
                    entry.update(parse_gap(Path(args.log_dir) / "strict_gap"), status="ok")
                else:
                    entry.update(parse_training_log(text, warmup=args.warmup, seq_length=args.seq_length,
                                                    world_size=args.nproc), status="ok")
            except (ValueError, OSError, KeyError) as e:
                entry.update(status=f"failed: {e} (see {log})")
        results.append(entry)

    ran = {r["row"]: r for r in results if r["status"] == "ok"}
    for r in results:
        for other in ("te_bf16", "te_nvfp4"):
            mine, theirs = r.get("tokens_per_s_per_gpu"), ran.get(other, {}).get("tokens_per_s_per_gpu")
            if mine and theirs and r["row"].startswith("minite"):
                r[f"speedup_vs_{other}"] = mine / theirs
        if r["row"] == "minite_strict" and "minite" in ran and r.get("step_ms"):
            r["strict_overhead"] = r["step_ms"] / ran["minite"]["step_ms"]
    print_table(
        f"Qwen3-30B-A3B learner, {args.layers} layers, {args.nproc} GPUs (EP={min(args.nproc, 8)}), "
        f"global batch {args.global_batch} x {args.seq_length}",
        results,
        ["row", "status", "tokens_per_s_per_gpu", "peak_allocated_gib", "tflops_per_gpu", "step_ms",
         "speedup_vs_te_bf16", "speedup_vs_te_nvfp4", "strict_overhead", "train_rollout_logprob_abs_diff", "k3_kl"],
    )
    for r in results:
        if r["status"] != "ok":
            print(f"  {r['row']}: needs {r['needs']}")
    record = {
        "benchmark": "seeds_comparison",
        "command": "python -m benchmarks.seeds_comparison " + " ".join(argv if argv is not None else sys.argv[1:]),
        "environment": {**environment(), "gpus": machine.gpus, "gpu_names": machine.names,
                        "transformer_engine": machine.te_version},
        "settings": {k: getattr(args, k) for k in ("nproc", "layers", "iters", "warmup", "micro_batch", "global_batch",
                                                   "seq_length")},
        "rows": results,
    }
    if not args.no_save and ran:
        for path in save(record, "seeds_comparison", [str(ROOT / "benchmarks" / "results")]):
            print(f"appended: {path}")
    if not ran:
        return 2 if all(r["status"].startswith("refused") for r in results) else 1
    return 0 if len(ran) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
