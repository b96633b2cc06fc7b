"""Run-time fixes for running ``megatron.training`` from the megatron-core *wheel* (0.19.2).

The wheel ships ``megatron/training`` but not everything a Megatron-LM checkout has. What breaks,
and what :func:`apply` does about it (CPU and GPU alike; idempotent):

* ``initialize._compile_dependencies`` runs ``make -C megatron/core/datasets`` on rank 0 to build
  the dataset index helpers; the wheel has no Makefile there (``make`` fails and Megatron calls
  ``sys.exit(1)``) but already ships the compiled ``helpers_cpp`` extension. ``apply`` replaces
  ``megatron.core.datasets.utils.compile_helpers`` by a version that returns when ``helpers_cpp``
  imports and otherwise runs the original (so a source checkout still compiles).
* ``OptimizerParamScheduler.load_state_dict`` (``megatron/core/optimizer_param_scheduler.py``)
  asserts that every schedule value of the run equals the checkpoint's: continuing a run with
  more ``--train-iters`` stops with ``AssertionError: OptimizerParamScheduler: class input value
  1760 and checkpointvalue 1600 for total number of iterations do not match``, which names
  neither the flag that changed nor the two flags that resolve it. ``apply`` makes that check
  raise :class:`ScheduleMismatch` instead (the launcher prints it as one line); with
  ``--override-opt_param-scheduler`` or ``--use-checkpoint-opt_param-scheduler`` nothing changes.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

_original = None
_original_check = None

# Megatron's names of the schedule values (OptimizerParamScheduler.load_state_dict) -> the flags that set them
SCHEDULE_FLAGS = {
    "learning rate": "--lr",
    "minimum learning rate": "--min-lr",
    "warmup iterations": "--lr-warmup-iters",
    "total number of iterations": "--train-iters (or --lr-decay-iters)",
    "learning rate decay style": "--lr-decay-style",
    "start weight decay": "--start-weight-decay (or --weight-decay)",
    "end weight decay": "--end-weight-decay (or --weight-decay)",
    "total number of weight decay iterations": "--train-iters",
    "weight decay incr style": "--weight-decay-incr-style",
}


class ScheduleMismatch(ValueError):
    """The run's LR / weight-decay schedule differs from the checkpoint's (``--load``)."""

    def __init__(self, name: str, run_value, checkpoint_value):
        self.name, self.run_value, self.checkpoint_value = name, run_value, checkpoint_value
        unit = " (in samples: iterations x --global-batch-size)" if "iterations" in name else ""
        super().__init__(
            f"--load: the checkpoint's schedule has {name} {checkpoint_value}, this run's "
            f"{SCHEDULE_FLAGS.get(name, 'flags')} give {run_value}{unit}; add --override-opt_param-scheduler to "
            "continue with this run's schedule, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's"
        )


def _check_and_set_naming_the_flag(self, cls_value, sd_value, name):
    """Megatron's ``_check_and_set``, raising :class:`ScheduleMismatch` where it would assert."""
    if not (self.override_opt_param_scheduler or self.use_checkpoint_opt_param_scheduler) and cls_value != sd_value:
        raise ScheduleMismatch(name, cls_value, sd_value)
    return _original_check(self, cls_value, sd_value, name)


def _compile_helpers_if_missing() -> None:
    """Megatron's ``compile_helpers``, skipped when the prebuilt ``helpers_cpp`` imports."""
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
        return
    except ImportError:
        pass
    _original()


def apply() -> None:
    """Install the fixes listed in the module docstring (idempotent)."""
    global _original, _original_check
    from megatron.core.datasets import utils
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if _original is None:
        _original = utils.compile_helpers
        utils.compile_helpers = _compile_helpers_if_missing
    if _original_check is None:
        _original_check = OptimizerParamScheduler._check_and_set
        OptimizerParamScheduler._check_and_set = _check_and_set_naming_the_flag


def revert() -> None:
    """Undo :func:`apply` (for tests)."""
    global _original, _original_check
    from megatron.core.datasets import utils
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if _original is not None:
        utils.compile_helpers = _original
        _original = None
    if _original_check is not None:
        OptimizerParamScheduler._check_and_set = _original_check
        _original_check = None
