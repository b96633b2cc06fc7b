"""``minite-vllm``: vLLM serves the learner's exact NVFP4 policy (export variant ``"minite"``).

Installed with this package; vLLM finds it through the ``vllm.general_plugins`` entry point
(``setup.cfg``: ``minite = minite_megatron.serving.vllm:register``) in every process it starts,
and :func:`register` adds the quantization method ``minite_nvfp4``
(:class:`~.config.MiniteNvfp4Config`) that an export's ``config.json`` declares. Tested with vLLM
0.26.0 (the newest release on torch 2.11, the project's torch). Docs: ``docs/serving.md``.
"""

from __future__ import annotations

_REGISTERED = False


def register() -> None:
    """Register ``minite_nvfp4`` with vLLM (idempotent: vLLM loads plugins in each process)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from vllm.model_executor.layers.quantization import register_quantization_config

    from ...export.modelopt import QUANT_METHOD
    from .config import MiniteNvfp4Config

    register_quantization_config(QUANT_METHOD)(MiniteNvfp4Config)
    _REGISTERED = True


__all__ = ["register"]
