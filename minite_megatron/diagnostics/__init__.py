"""Diagnostics: learner/rollout gap metrics, the divergence tracer, reports, CLI and training monitor.

- :mod:`.metrics`: gap metrics on the same tokens (``rollout_corr/...`` keys as verl, slime
  and NeMo-RL name them), per-sequence and per-position curves, router top-k flip rates.
- :mod:`.capture` / :mod:`.trace`: named capture points (:func:`capture`, no-op unless a
  :class:`Tracer` is active), traces keyed by (sequence, position[, expert]), saved as ``.pt``
  or ``.safetensors``.
- :mod:`.compare` / :mod:`.report`: point-by-point comparison of two traces, the first
  divergence, and markdown / JSON / PNG reports.
- :mod:`.monitor`: :class:`GapMonitor`, the gap logged each training step with alerts.
- :mod:`.op_trace` / :mod:`.export_learner`: the same ops named alike in the learner's and vLLM's
  forward, and the learner rebuilt from an export (its bytes checked bitwise).
- :mod:`.cli`: ``minite-diagnose gap | compare | run | vllm``.

Formulas and file formats: ``docs/diagnostics.md``.
"""

from .capture import MEGATRON_PATTERNS, Tracer, active_tracer, capture, capture_routed, capture_static
from .compare import Comparison, PointResult, compare_traces
from .logprob_io import load_logprobs, save_logprobs
from .metrics import gap_metrics, pad_sequences, per_sequence_metrics, position_curves, router_flip_rates
from .monitor import GapAlert, GapMonitor
from .report import markdown_report, plot_report, write_report
from .trace import Trace, TracePoint, load_trace, pack_keys, unpack_keys

__all__ = [
    "MEGATRON_PATTERNS",
    "Comparison",
    "GapAlert",
    "GapMonitor",
    "PointResult",
    "Trace",
    "TracePoint",
    "Tracer",
    "active_tracer",
    "capture",
    "capture_routed",
    "capture_static",
    "compare_traces",
    "gap_metrics",
    "load_logprobs",
    "load_trace",
    "markdown_report",
    "pack_keys",
    "pad_sequences",
    "per_sequence_metrics",
    "plot_report",
    "position_curves",
    "router_flip_rates",
    "save_logprobs",
    "unpack_keys",
    "write_report",
]
