"""The RL example's old entry point; it now runs ``examples/rl/train_grpo.py`` (see there).

    python examples/rl_grpo.py [--strict] [train_grpo.py flags]

The first version of this script trained a toy counting task with one optimizer step per rollout
batch and its reward fell (0.80 -> 0.32 in 20 steps, with or without quantization); why, and what
replaced it, is in ``examples/rl/README.md``. Its flags map onto the trainer's:
``--pretrain-steps`` -> ``--sft-steps``, ``--prompts`` -> ``--rollout-batch-size`` (and
``--mini-batch-size``), ``--clip`` -> ``--eps-clip``, ``--tensorboard DIR`` -> ``--log-dir DIR``;
``--prompt-len``, ``--new-tokens`` and ``--vocab`` belonged to the counting task and are refused.
"""

from __future__ import annotations

import os
import sys

RENAMED = {"--pretrain-steps": "--sft-steps", "--clip": "--eps-clip", "--tensorboard": "--log-dir"}
REMOVED = ("--prompt-len", "--new-tokens", "--vocab")


def translate(argv: list[str]) -> list[str]:
    """The old flags in ``argv`` as ``train_grpo.py`` flags; raises SystemExit naming a removed one."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in REMOVED:
            raise SystemExit(f"rl_grpo.py: {name} belonged to the old counting task; see examples/rl/README.md")
        if name == "--prompts":
            n = value if eq else next(it)
            out += ["--rollout-batch-size", n, "--mini-batch-size", n]
            continue
        out.append(RENAMED.get(name, name) + (eq + value if eq else ""))
    return out


def main(argv=None) -> dict:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rl"))
    import train_grpo

    return train_grpo.main(translate(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
