"""``examples/pretrain_gpt.py`` with one injected fault, for ``tests/parallel/test_faults.py``.

    python -m minite_megatron.launch tests/parallel/fault_script.py --fault nan-grad:3 [pretrain_gpt flags]
    python -m minite_megatron.launch tests/parallel/fault_script.py --fault kill-in-save:4 [...]

* ``nan-grad:K``: in iteration K the backward starts from a NaN gradient of the loss (the loss
  itself stays finite), so NaN flows through every NVFP4 backward GEMM into the gradients.
* ``kill-in-save:K``: the checkpoint save of iteration K dies (``os._exit``, like a SIGKILL)
  after the tensors are written and before the checkpoint's ``metadata.json`` and Megatron's
  ``latest_checkpointed_iteration.txt`` are: a checkpoint cut half-way.

Everything else is the real script on the real ``megatron.training`` loop.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"
KILLED_STATUS = 137


def _take_fault(argv: list[str]) -> tuple[str, int]:
    i = argv.index("--fault")
    kind, _, iteration = argv[i + 1].partition(":")
    del argv[i:i + 2]
    if kind not in ("nan-grad", "kill-in-save") or not iteration.isdigit():
        raise SystemExit(f"error: --fault must be nan-grad:K or kill-in-save:K, got {kind}:{iteration}")
    return kind, int(iteration)


def _load_example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nan_grad_at(example, iteration: int) -> None:
    import torch
    from megatron.training import get_args

    forward_step = example.forward_step

    def faulty_forward_step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        if get_args().curr_iteration == iteration - 1 and output.requires_grad:
            output.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return output, loss_func

    example.forward_step = faulty_forward_step


def _kill_in_save_at(iteration: int) -> None:
    from megatron.core.dist_checkpointing import serialization

    save_config = serialization.save_config

    def dying_save_config(config, checkpoint_dir):
        if Path(checkpoint_dir).name == f"iter_{iteration:07d}":
            import psutil

            children = psutil.Process().children(recursive=True)
            sys.stdout.flush()
            sys.stderr.write(f"fault_script: killed while saving {checkpoint_dir} "
                             f"(and {len(children)} helper process(es) of this run)\n")
            sys.stderr.flush()
            for child in children:  # a kill of the job takes its helpers along
                child.kill()
            os._exit(KILLED_STATUS)
        return save_config(config, checkpoint_dir)

    serialization.save_config = dying_save_config


def main() -> None:
    kind, iteration = _take_fault(sys.argv)
    example = _load_example()
    if kind == "nan-grad":
        _nan_grad_at(example, iteration)
    else:
        _kill_in_save_at(iteration)
    example.main()


if __name__ == "__main__":
    main()
