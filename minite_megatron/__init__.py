"""miniTE-Megatron: native NVFP4 (W4A4) Mixture-of-Experts training for RL on Megatron-Core.

The learner (Megatron) and the rollout engine run one numerical contract
(:mod:`minite_megatron.nvfp4`), so they compute the same policy.
"""

__version__ = "0.1.0"
