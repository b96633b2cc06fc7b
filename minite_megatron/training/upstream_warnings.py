"""The upstream warnings a user of miniTE cannot act on, silenced where they arise.

megatron-core 0.19.2 and torch 2.11 warn at import time (and when a config or model is built)
about optional pieces this project never uses: apex, Transformer Engine, CUDA on a CPU machine,
APIs of theirs that are deprecated or experimental. Each entry below names the upstream file
that emits it and matches that message only (a Python warning by its category and message, a
log record by its logger and message), so every other warning, ours above all, still shows.
No blanket ``PYTHONWARNINGS=ignore``.

:func:`install` (idempotent) is called first thing by every entry point (the launcher, the
CLIs, the example scripts); ``setup.cfg`` ``[tool:pytest] filterwarnings`` holds the same Python
warnings (``tests/test_cli_errors.py`` checks the two lists agree, and that a smoke run of the
launcher and of the RL trainer prints no warning at all).

It also sets ``NO_VCS_VERSION=1`` unless the environment says otherwise: megatron-core's
``package_info.py`` runs ``git rev-parse --short HEAD`` in its own folder and appends the result
to ``megatron.core.__version__``; inside this repository's ``.venv`` that is *our* commit, which
turned the version into ``0.19.2+<our sha>``, as if Megatron were a fork.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass

from ..settings import export_default


@dataclass(frozen=True)
class UpstreamWarning:
    """One Python warning: ``category`` whose message starts with ``message`` (a regex without
    ``:``, the field separator of pytest's and Python's ``-W`` filter syntax)."""

    category: type[Warning]
    message: str
    source: str  # the upstream file(s) that emit it


@dataclass(frozen=True)
class UpstreamLogRecord:
    """One log record of ``logger`` whose message starts with ``message`` (a regex)."""

    logger: str
    message: str
    source: str


PYTHON_WARNINGS = (
    # apex and Transformer Engine are not on the package registry; Megatron falls back to torch.
    UpstreamWarning(UserWarning, r"Transformer Engine and Apex are not installed",
                    "megatron/core/optimizer/__init__.py, optimizer/optimizer.py, optimizer/clip_grads.py, "
                    "distributed/fsdp/src/megatron_fsdp/mixed_precision.py, training/utils/common_utils.py"),
    UpstreamWarning(UserWarning, r"Apex is not installed\. Falling back to Torch Norm",
                    "megatron/core/models/backends.py, models/gpt/gpt_layer_specs.py, "
                    "models/gpt/heterogeneous/heterogeneous_layer_specs.py"),
    # importing the TE spec provider without TE reads its version as 0.0.0
    UpstreamWarning(UserWarning, r"Only transformer-engine>=1\.7\.0 supports MoE experts",
                    "megatron/core/extensions/transformer_engine_spec_provider.py"),
    # a class definition at import time of megatron.core.models.mimo (imported by megatron.training)
    UpstreamWarning(UserWarning, r"MimoModelConfig is experimental",
                    "megatron/core/models/mimo/config/base_configs.py"),
    # TransformerConfig's own default cuda_graph_modules normalizes to "full" and warns about it
    UpstreamWarning(UserWarning, r"full scope is deprecated",
                    "megatron/core/transformer/transformer_config.py (__post_init__)"),
    # Megatron's training data loader always asks for pinned memory, also on a CPU-only machine
    UpstreamWarning(UserWarning, r"'pin_memory' argument is set as true but no accelerator is found",
                    "torch/utils/data/dataloader.py, called by megatron/training/datasets/data_samplers.py"),
    # dist_checkpointing's torch_dist load goes through torch.distributed.checkpoint's old entry points
    UpstreamWarning(UserWarning, r"torch\.distributed is disabled, unavailable or uninitialized",
                    "torch/distributed/checkpoint/utils.py, called by megatron/core/dist_checkpointing/strategies/torch.py"),
    UpstreamWarning(UserWarning, r"The argument order of load has been changed",
                    "torch/distributed/checkpoint/logger.py, called by megatron/core/dist_checkpointing/strategies/torch.py"),
    UpstreamWarning(FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor",
                    "torch/distributed/_shard/sharded_tensor, built by megatron/core/dist_checkpointing/strategies/torch.py"),
    # importing megatron.core.inference (the rollout engine's fallback, Megatron's own engine)
    UpstreamWarning(DeprecationWarning, r"The following imports from `dynamic_context\.py` will be removed",
                    "megatron/core/inference/contexts/__init__.py"),
    # log_single_rank outside torch.distributed (a tool of one process, e.g. a scheduler built in a test)
    UpstreamWarning(UserWarning, r"Could not determine rank from torch\.distributed",
                    "megatron/core/_rank_utils.py"),
    # building Megatron's parser: its --rl-* flags pass type=bool to argparse.BooleanOptionalAction,
    # which Python 3.12's argparse.py deprecates
    UpstreamWarning(DeprecationWarning, r"'type' is deprecated as of Python 3\.12",
                    "megatron/training/arguments.py (_add_rl_args)"),
    # megatron-core's own spec builders (get_gpt_layer_local_spec, the MoE shared experts) build MLPs
    # through ModuleSpec without ffn_hidden_size, and the parallel linears without tp_group
    UpstreamWarning(DeprecationWarning, r"MLP requires ffn_hidden_size, but it was not provided",
                    "megatron/core/transformer/mlp.py"),
    UpstreamWarning(DeprecationWarning, r"Warning. tp_group is None, using default tp group",
                    "megatron/core/tensor_parallel/layers.py"),
    # megatron-core's fused kernels are still torch.jit.script'ed
    UpstreamWarning(DeprecationWarning, r"`torch\.jit\.script",
                    "torch/jit/_script.py, called by megatron/core/fusions/*.py"),
)

LOG_RECORDS = (
    # torch.utils.cpp_extension at import (megatron-core imports it) on a machine without CUDA
    UpstreamLogRecord("torch.utils.cpp_extension", r"No CUDA runtime is found", "torch/utils/cpp_extension.py"),
    # every GPTModel construction; miniTE plugs into GPTModel (HybridModel has no minite specs)
    UpstreamLogRecord("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED",
                      "megatron/core/models/gpt/gpt_model.py"),
    # logged at WARNING for the default mode, once per run of megatron.training
    UpstreamLogRecord("megatron.core.rerun_state_machine", r"RerunStateMachine initialized in mode",
                      "megatron/core/rerun_state_machine.py"),
    UpstreamLogRecord("megatron.core.rerun_state_machine", r"Result validation enabled",
                      "megatron/core/rerun_state_machine.py"),
    # --mock-data has no index cache to write
    UpstreamLogRecord("megatron.core.datasets.gpt_dataset", r"Unable to save MockGPTDataset indexes because path_to_cache is None",
                      "megatron/core/datasets/gpt_dataset.py"),
    # logged by dist_checkpointing's torch_dist save strategy on the first (synchronous) save too
    UpstreamLogRecord("megatron.core.dist_checkpointing.strategies.torch", r"MCore's async save is deprecated",
                      "megatron/core/dist_checkpointing/strategies/torch.py"),
)


class _DropRecords(logging.Filter):
    def __init__(self, patterns: list[re.Pattern]):
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


_installed = False


def install() -> None:
    """Silence exactly the entries above (idempotent); call before megatron or torch's
    ``cpp_extension`` is imported."""
    global _installed
    if _installed:
        return
    _installed = True
    export_default("NO_VCS_VERSION", "1")
    for w in PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=w.message, category=w.category)
    by_logger: dict[str, list[re.Pattern]] = {}
    for r in LOG_RECORDS:
        by_logger.setdefault(r.logger, []).append(re.compile(r.message))
    for name, patterns in by_logger.items():
        logging.getLogger(name).addFilter(_DropRecords(patterns))


def pytest_filterwarnings() -> list[str]:
    """The ``[tool:pytest] filterwarnings`` lines of :data:`PYTHON_WARNINGS`."""
    return [f"ignore:{w.message}:{w.category.__name__}" for w in PYTHON_WARNINGS]


__all__ = ["LOG_RECORDS", "PYTHON_WARNINGS", "install", "pytest_filterwarnings"]
