"""``minite-vllm``: vLLM serves the learner's exact NVFP4 policy (export variant ``"minite"``).

Installed with this package; vLLM finds it through the ``vllm.general_plugins`` entry point
(``setup.cfg``: ``minite = minite_megatron.serving.vllm:register``) in every process it starts,
and :func:`register` adds the quantization method ``minite_nvfp4``
(:class:`~.config.MiniteNvfp4Config`) that an export's ``config.json`` declares, the model class
:class:`~.model.MiniteQwen3MoeForCausalLM` for the export's architecture (the learner's norms,
RoPE and attention: :mod:`.model`, :mod:`.attention`) and the attention backend as vLLM's
``CUSTOM`` slot. Tested with vLLM
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
    # the learner's norms, RoPE and attention for a minite_nvfp4 export (vLLM's own class otherwise)
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    ModelRegistry.register_model("Qwen3MoeForCausalLM", "minite_megatron.serving.vllm.model:MiniteQwen3MoeForCausalLM")
    register_backend(AttentionBackendEnum.CUSTOM, "minite_megatron.serving.vllm.attention.MiniteAttentionBackend")
    _REGISTERED = True


__all__ = ["register"]
