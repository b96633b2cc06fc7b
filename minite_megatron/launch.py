"""``python -m minite_megatron.launch SCRIPT [ARGS...]``: run any Megatron training script with
``--transformer-impl minite``, without editing it.

Before running ``SCRIPT`` as ``__main__`` (``runpy``, ``sys.argv = [SCRIPT, *ARGS]``) it

1. activates :mod:`minite_megatron.cpu_compat` when the machine has no GPU (logged; GPU runs are
   untouched);
2. applies :mod:`minite_megatron.training.megatron_wheel` (run-time fixes for megatron.training
   from the megatron-core wheel);
3. installs :func:`minite_megatron.megatron_args.install`: ``--transformer-impl minite`` and the
   ``--minite-*`` flags parse, bad configurations fail fast naming the flag, and the model config
   built by ``gpt_config_from_args`` uses the minite specs;
4. applies the megatron-core fixes kept in ``patches/`` (:mod:`minite_megatron.training.
   upstream_patches`; in memory, no installed file is edited);
5. makes ``--cuda-graph-impl full_iteration`` capture the minite layers' step
   (:mod:`minite_megatron.training.full_iteration_graph`).

Before any of that it silences the upstream warnings a user cannot act on
(:mod:`minite_megatron.training.upstream_warnings`, each named there).

A bad configuration exits with status 2 and one ``error:`` line (like argparse, without the usage
text): a bad flag value, an invalid recipe, a checkpoint whose LR schedule differs from the run's
flags (it names the flag to add). Works with
``torchrun``: ``torchrun --nproc-per-node N -m minite_megatron.launch SCRIPT ARGS``.
"""

from __future__ import annotations

import os
import runpy
import sys

from .training import upstream_warnings

# Also at import: a worker process that multiprocessing *spawns* (megatron's checkpoint writer)
# re-imports this module, not main(), before it imports megatron.
upstream_warnings.install()

USAGE = "usage: python -m minite_megatron.launch SCRIPT [ARGS...]  (e.g. examples/pretrain_gpt.py --transformer-impl minite ...)"


def prepare() -> bool:
    """Steps 1-5 above, without running a script (training scripts may call it themselves).

    Idempotent. Returns whether the CPU compatibility layer is active.
    """
    from . import cpu_compat, megatron_args
    from .training import full_iteration_graph, megatron_wheel, upstream_patches

    active = cpu_compat.activate()
    megatron_wheel.apply()
    megatron_args.install()
    upstream_patches.apply()
    full_iteration_graph.install()
    return active


ARCHITECTURE_FLAGS = ("--num-layers", "--hidden-size", "--num-attention-heads")


def checkpoint_args_flags(script_args: list[str]) -> list[str]:
    """The flags that make ``--load DIR`` of a ``minite-convert hf-to-megatron`` checkpoint build the
    model it holds, when the command names no architecture: Megatron's ``--use-checkpoint-args``
    (the architecture from the ``args`` the converter stores) and, the converter storing no
    tokenizer files, ``--no-use-tokenizer-model-from-checkpoint-args`` (the run's own tokenizer)."""
    if "--load" not in script_args or "--use-checkpoint-args" in script_args:
        return []
    if any(a.split("=")[0] in ARCHITECTURE_FLAGS for a in script_args):
        return []
    i = script_args.index("--load")
    load = script_args[i + 1] if i + 1 < len(script_args) else None
    if load is None:
        return []
    tracker = os.path.join(load, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return []  # Megatron says what is wrong with --load
    with open(tracker) as fh:
        it = fh.read().strip()
    ckpt = os.path.join(load, "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it)
    try:
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(ckpt)
    except Exception:  # noqa: BLE001 - not ours to judge: Megatron's load reports it
        return []
    converted = isinstance(common, dict) and isinstance(common.get("hf_config"), dict)
    if not converted:
        return []
    flags = ["--use-checkpoint-args"]
    if "--use-tokenizer-model-from-checkpoint-args" not in script_args:
        flags.append("--no-use-tokenizer-model-from-checkpoint-args")
    return flags


def main(argv: list[str] | None = None) -> None:
    upstream_warnings.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not argv else sys.stdout)
        raise SystemExit(0 if argv else 2)
    script, script_args = argv[0], argv[1:]
    if not os.path.isfile(script):
        print(f"error: no such training script: {script}\n{USAGE}", file=sys.stderr)
        raise SystemExit(2)
    from .megatron_args import MiniteArgumentError
    from .recipe import RecipeError
    from .training.megatron_wheel import ScheduleMismatch

    prepare()
    extra = checkpoint_args_flags(script_args)
    if extra:
        print(f"minite launch: --load {script_args[script_args.index('--load') + 1]} holds a minite-convert checkpoint "
              f"and no architecture flag is given: adding {' '.join(extra)}", file=sys.stderr)
    sys.argv = [script, *script_args, *extra]
    script_dir = os.path.dirname(os.path.abspath(script))
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # as `python SCRIPT` would (root scripts import siblings)
    try:
        runpy.run_path(script, run_name="__main__")
    except (MiniteArgumentError, RecipeError, ScheduleMismatch) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
