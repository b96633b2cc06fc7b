"""``minite-diagnose``: the diagnostics command line.

Subcommands::

    minite-diagnose gap LEARNER ROLLOUT [--json OUT.json] [--curves OUT.png] [--thresholds T ...]
        Gap metrics of two per-token log-prob files (formats: :mod:`.logprob_io`) on the same
        tokens; the mask is the intersection of the files' masks. Prints a table.

    minite-diagnose compare REF OTHER --out DIR [--atol A] [--rtol R] [--fail-on-divergence]
        Compare two saved traces (:mod:`.trace`: ``.pt`` or ``.safetensors``) and write
        ``report.md``, ``report.json`` and ``report.png`` into DIR. Prints the verdict.
        Exit status 1 with ``--fail-on-divergence`` when a point diverged.

    minite-diagnose run --out DIR [--strict] ...          (:mod:`.run`)
        Run the project's rollout engine and the learner on the same weights and compare.

    minite-diagnose vllm --model EXPORT [--prompts FILE] [--out DIR] ...   (:mod:`.vllm_run`)
        Serve an export with ``vllm.LLM`` (minite-vllm plugin) and name the first op where it
        differs from the learner rebuilt from the same export.

More subcommands plug in through :func:`register_subcommand` from a module listed in
``PLUGIN_MODULES``.

Exit status: 0 on success, 1 for a divergence with ``--fail-on-divergence``, 2 for bad input
(missing file, unreadable format, inconsistent shapes), with the reason on stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..training import upstream_warnings
from ..training.cli import OneLineArgumentParser

upstream_warnings.install()  # megatron-core's import-time notes (named there); before torch and megatron

import torch  # noqa: E402

from .metrics import DEFAULT_THRESHOLDS, gap_metrics, position_curves

PLUGIN_MODULES: tuple[str, ...] = ("minite_megatron.diagnostics.run", "minite_megatron.diagnostics.vllm_run")
"""Modules imported before the parser is built; each may call :func:`register_subcommand`."""

_SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {}


def register_subcommand(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    handler: Callable[[argparse.Namespace], int],
) -> None:
    """Add ``minite-diagnose NAME``: ``add_arguments(parser)`` declares its options and
    ``handler(args) -> exit status`` runs it. Raises ValueError if the name is taken."""
    if name in _SUBCOMMANDS:
        raise ValueError(f"minite-diagnose subcommand {name!r} is already registered")
    _SUBCOMMANDS[name] = (help, add_arguments, handler)


# ---- gap ----------------------------------------------------------------------------------
def _gap_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("learner", help="learner (trainer) log-prob file")
    p.add_argument("rollout", help="rollout (sampler) log-prob file")
    p.add_argument("--json", type=Path, help="also write the metrics to this JSON file")
    p.add_argument("--curves", type=Path, help="write a PNG of the gap by position")
    p.add_argument("--thresholds", type=float, nargs="+", default=list(DEFAULT_THRESHOLDS), help="|dlogp| thresholds")


def format_metrics(metrics: dict[str, float]) -> str:
    """An aligned two-column table of the metrics."""
    width = max(len(k) for k in metrics)
    lines = []
    for k, v in metrics.items():
        if k.endswith(("num_tokens", "num_seqs")):
            val = f"{int(v)}"
        elif v == 0:
            val = "0"
        else:
            val = f"{v:.6g}"
        lines.append(f"{k:<{width}}  {val}")
    return "\n".join(lines)


def _run_gap(args: argparse.Namespace) -> int:
    from .logprob_io import load_logprobs

    a, b = load_logprobs(args.learner), load_logprobs(args.rollout)
    if a.logprobs.shape != b.logprobs.shape:
        raise ValueError(
            f"the files hold different token layouts: {tuple(a.logprobs.shape)} vs {tuple(b.logprobs.shape)}"
        )
    ones = torch.ones(a.logprobs.shape, dtype=torch.bool)
    ma = a.mask if a.mask is not None else ones
    mb = b.mask if b.mask is not None else ones
    mask = ma & mb
    if not torch.equal(ma, mb):
        print(
            f"note: the masks differ ({int(ma.sum())} vs {int(mb.sum())} tokens); using their "
            f"intersection ({int(mask.sum())} tokens)",
            file=sys.stderr,
        )
    topk_a, topk_b = a.topk, b.topk
    if (topk_a is None) != (topk_b is None):
        print("note: only one file has router top-k; router flip rates skipped", file=sys.stderr)
        topk_a = topk_b = None
    tmask = a.topk_mask if a.topk_mask is not None else b.topk_mask
    metrics = gap_metrics(
        a.logprobs, b.logprobs, mask, thresholds=args.thresholds, learner_topk=topk_a, rollout_topk=topk_b, topk_mask=tmask
    )
    print(f"learner: {args.learner}\nrollout: {args.rollout}\n")
    print(format_metrics(metrics))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({k: (v if math.isfinite(v) else repr(v)) for k, v in metrics.items()}, indent=1))
    if args.curves:
        from .report import plot_position_curves

        plot_position_curves(position_curves(a.logprobs, b.logprobs, mask), args.curves)
    return 0


# ---- compare ------------------------------------------------------------------------------
def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("ref", help="reference trace (.pt or .safetensors), e.g. the learner's")
    p.add_argument("other", help="the other engine's trace")
    p.add_argument("--out", type=Path, required=True, help="folder for report.md / report.json / report.png")
    p.add_argument("--atol", type=float, default=None, help="absolute tolerance (default: bitwise)")
    p.add_argument("--rtol", type=float, default=None, help="relative tolerance (default: bitwise)")
    p.add_argument("--fail-on-divergence", action="store_true", help="exit with status 1 if a point diverged")


def _run_compare(args: argparse.Namespace) -> int:
    from .compare import compare_traces
    from .report import write_report
    from .trace import load_trace

    ref, other = load_trace(args.ref), load_trace(args.other)
    cmp = compare_traces(ref, other, atol=args.atol, rtol=args.rtol)
    paths = write_report(cmp, args.out)
    fd = cmp.first_divergence
    counts = ", ".join(f"{k} {v}" for k, v in cmp.counts().items() if v)
    print(f"{cmp.ref_engine} vs {cmp.other_engine} ({cmp.mode}): {counts}")
    if fd is None:
        print("no divergence")
    else:
        print(f"first divergence: {fd.name} (point #{fd.index}, {fd.mismatched} of {fd.elements} elements differ)")
        fc = cmp.first_consequential
        print(f"first consequential divergence: {fc.name + ' (flips ' + fc.consequence + ')' if fc else 'none'}")
    for kind, p in paths.items():
        print(f"{kind}: {p}")
    return 1 if (fd is not None and args.fail_on_divergence) else 0


register_subcommand("gap", "gap metrics of two per-token log-prob files", _gap_args, _run_gap)
register_subcommand("compare", "compare two traces and write a divergence report", _compare_args, _run_compare)


def build_parser() -> argparse.ArgumentParser:
    for mod in PLUGIN_MODULES:
        importlib.import_module(mod)
    parser = OneLineArgumentParser(
        prog="minite-diagnose", description="miniTE learner/rollout diagnostics: gap metrics and divergence tracing."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, handler) in _SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``minite-diagnose``; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._handler(args))
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"minite-diagnose {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    # `python -m ...cli`: run the importable module's main, the registry plugins register into
    from minite_megatron.diagnostics.cli import main as _main

    sys.exit(_main())
