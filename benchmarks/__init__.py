"""The benchmarks (BENCHMARKS.md): ``python -m benchmarks.learner_step``, ``benchmarks.rollout``,
``benchmarks.kernels --sections ...``, ``benchmarks.alignment``, ``benchmarks.blackwell_bringup``
(+ ``benchmarks.seeds_comparison``, its 8-GPU half); ``benchmarks/device.sh STEP ...`` runs them on a
lent GPU machine; each appends one JSON line to ``benchmarks/results/``. Private modules
(``_timing``, ``kernels/_*``) hold what they share."""
