"""The benchmarks (BENCHMARKS.md): ``python -m benchmarks.learner_step``, ``benchmarks.rollout``,
``benchmarks.kernels --sections ...``, ``benchmarks.alignment``, ``benchmarks.blackwell_bringup``
(+ ``benchmarks.seeds_comparison``, its 8-GPU half); ``benchmarks/device.sh STEP ...`` runs them on a
lent GPU machine; each appends one JSON line to ``benchmarks/results/``. Private modules
(``_timing``, ``kernels/_*``) hold what they share."""

from minite_megatron.training import upstream_warnings as _upstream_warnings

_upstream_warnings.install()  # as the CLIs do: no upstream notes a user cannot act on, megatron-core's own version
