"""Export of the learner's quantized weights (ModelOpt NVFP4 layout) for vLLM/SGLang, and its loader.

- :func:`export_modelopt` (:mod:`.modelopt`): Megatron names + NVFP4Tensors -> safetensors shards,
  HF ``config.json`` (Qwen3 / Qwen3-MoE), ``hf_quant_config.json`` and miniTE's exact scales.
- :func:`load_modelopt` (:mod:`.loader`): back to NVFP4Tensors, a dequantized HF state dict, or
  the Megatron tensors, bit for bit.
- :mod:`.gather`: the learner's weights from a Megatron model (``learner_weights``), and a TP / EP
  sharded model's gathered on one rank bitwise (``gather_learner_weights``), for export or refit.
- :mod:`.rows`: the exact row split / merge of fused linears; :mod:`.names`: the name mapping.

Format: ``docs/export.md``.
"""

from .loader import ModelOptCheckpoint, load_modelopt
from .modelopt import ExportResult, export_modelopt
from .names import megatron_target

__all__ = ["ExportResult", "ModelOptCheckpoint", "export_modelopt", "load_modelopt", "megatron_target"]
