"""The kernel benchmark: every NVFP4 / MoE / decode kernel against its BF16 or unfused baseline,
one command with named sections.

    python -m benchmarks.kernels                                   # the default sections
    python -m benchmarks.kernels --sections linear,grouped --tokens 16384 --out $OUT
    python -m benchmarks.kernels --sections decode_dense,decode_grouped --decode-m 1,8,64
    python -m benchmarks.kernels --list                            # every section, one line each
    python -m benchmarks.kernels --help                            # and every option, by family
    python -m benchmarks.kernels --sections producers --smoke      # a CPU: the code path (Triton interpreter)

Sections, by family (each family is a private module of this package; each appends one JSON line
with device, versions and command to its file in ``benchmarks/results/``):

=======================  =================================================================  ====================
family (JSON file)       sections                                                           what
=======================  =================================================================  ====================
nvfp4_kernels            ceilings quantize bitwise gemm gemm_sweep linear grouped memory    GEMMs, Linear and
                                                                                            MoE fwd+bwd vs BF16
quantize_kernels         quantize_paths quantize_tiles                                      every quantize path
producers                producers                                                          norm/SwiGLU -> NVFP4
moe_activation           moe_activation                                                     SwiGLU x probability
moe_combine              moe_combine                                                        ordered combine
attention_backward       attention_backward                                                 aligned attention
decode_gemm              decode_sweep decode_dense decode_grouped decode_grouped_sweep      decode GEMMs vs BF16
                         decode_idot_sweep decode_idot_dense
learner_sweep            sweep_tile_quantize sweep_wgrad sweep_grouped sweep_rows           learner kernels'
                         sweep_cols sweep_parts                                             launch configs
decode_profile           decode_profile                                                     a decode step's GPU
                                                                                            time by kernel
(none: prints)           decode_count                                                       kernels per decode
                                                                                            step (CPU count)
(none: ncu measures)     ncu_cases                                                          single kernels for
                                                                                            Nsight Compute
refit_bytes              refit_bytes                                                        bytes per refit
                                                                                            (computed)
=======================  =================================================================  ====================

An option goes to every family of the run that takes it (``--tokens`` is the token counts of
each section that has them); an option no section of the run takes is refused. The bitwise
checks of the decode kernels are tests (``tests/kernels/test_decode_strict_bitwise_gpu.py``), not
sections: a benchmark measures, a test decides.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from minite_megatron.training.cli import OneLineArgumentParser

#: where every family appends its JSON line (and where the recorded history lives)
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
#: a file beside ``RESULTS`` (``_timing.add_output_args`` puts ``--json-dir`` in ``results/`` beside the file it is given)
RESULTS_ANCHOR = os.path.join(os.path.dirname(RESULTS), "_timing.py")

#: family module -> its sections, in the order they run
FAMILIES = {
    "_nvfp4": ("ceilings", "quantize", "bitwise", "gemm", "gemm_sweep", "linear", "grouped", "memory"),
    "_quantize": ("quantize_paths", "quantize_tiles"),
    "_producers": ("producers",),
    "_moe_activation": ("moe_activation",),
    "_moe_combine": ("moe_combine",),
    "_attention_backward": ("attention_backward",),
    "_decode_gemm": ("decode_sweep", "decode_dense", "decode_grouped", "decode_grouped_sweep", "decode_idot_sweep",
                     "decode_idot_dense"),
    "_learner_sweep": ("sweep_tile_quantize", "sweep_wgrad", "sweep_grouped", "sweep_rows", "sweep_cols",
                       "sweep_parts"),
    "_decode_profile": ("decode_profile",),
    "_decode_count": ("decode_count",),
    "_ncu_cases": ("ncu_cases",),
    "_refit_bytes": ("refit_bytes",),
}
FAMILY_OF = {s: fam for fam, secs in FAMILIES.items() for s in secs}
#: the tables BENCHMARKS.md quotes (a GPU run of a few minutes); the sweeps and tools run when named
DEFAULT = ("ceilings", "quantize", "linear", "grouped", "quantize_paths", "producers", "moe_activation", "moe_combine",
           "attention_backward", "decode_dense", "decode_grouped")


def _family(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def _option_tokens(tokens: list[str]) -> set[str]:
    return {t.split("=", 1)[0] for t in tokens if t.startswith("--")}


def plan(sections: list[str]) -> list[tuple[str, list[str]]]:
    """``[(family, its sections)]`` in the order the families first appear in ``sections``."""
    unknown = [s for s in sections if s not in FAMILY_OF]
    if unknown:
        print(f"python -m benchmarks.kernels: error: --sections: unknown {', '.join(unknown)} "
              f"(known: {', '.join(FAMILY_OF)})", file=sys.stderr)
        raise SystemExit(2)
    out: dict[str, list[str]] = {}
    for s in sections:
        out.setdefault(FAMILY_OF[s], [])
        if s not in out[FAMILY_OF[s]]:
            out[FAMILY_OF[s]].append(s)
    return list(out.items())


def main(argv=None) -> dict:
    """Run the sections; returns ``{family: its record}`` (the JSON line each family saved)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = OneLineArgumentParser(prog="python -m benchmarks.kernels", add_help=False)
    top.add_argument("--sections", default=",".join(DEFAULT))
    top.add_argument("--list", action="store_true")
    top.add_argument("-h", "--help", action="store_true")
    args, rest = top.parse_known_args(argv)
    if args.help:
        print(__doc__)
        for fam in FAMILIES:
            print(_family(fam).parser().format_help().replace("usage: ", f"[{', '.join(FAMILIES[fam])}] ", 1))
        return {}
    if args.list:
        for fam, secs in FAMILIES.items():
            print(f"{' '.join(secs)}: {(_family(fam).__doc__ or '').strip().splitlines()[0]}")
        return {}
    families = plan([s for s in args.sections.split(",") if s])
    parsed = {fam: _family(fam).parser().parse_known_args(rest)[1] for fam, _ in families}
    nobody = set.intersection(*(_option_tokens(u) for u in parsed.values())) if parsed else set()
    if nobody:
        top.error(f"{', '.join(sorted(nobody))}: no option of the sections {args.sections} "
                  f"(python -m benchmarks.kernels --help lists each family's)")
    records = {}
    for fam, secs in families:
        module = _family(fam)
        fam_argv = (["--sections", ",".join(secs)] if len(FAMILIES[fam]) > 1 else []) + rest
        print(f"=== benchmarks.kernels: {', '.join(secs)}", flush=True)
        records[fam.lstrip("_")] = module.main(fam_argv)
    return records


def command(argv: list[str]) -> str:
    """The command line that reruns a family's sections (recorded in its JSON line)."""
    return " ".join(["python -m benchmarks.kernels", *argv])
