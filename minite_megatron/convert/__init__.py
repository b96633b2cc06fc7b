"""Hugging Face <-> Megatron conversion for Qwen3 and Qwen3-MoE (``docs/convert.md``).

- :func:`~.hf.build_gpt_from_hf`: an HF checkpoint -> a Megatron ``GPTModel`` on the minite or the
  local spec, each rank reading only its shard (TP, EP, expert-TP, PP).
- :func:`~.load.load_hf_weights`: the same into a model you built.
- :func:`~.hf_stream.build_resident_gpt_from_hf`: an HF checkpoint -> the resident NVFP4 rollout model,
  streamed layer by layer (never a BF16 copy of the whole model).
- :func:`~.save.save_hf_checkpoint`: a model (any layout) -> HF BF16 safetensors, rank 0 writes.
- :func:`~.hf_config.transformer_config_from_hf`: ``config.json`` -> ``TransformerConfig`` + kwargs.
- ``minite-convert hf-to-megatron`` / ``megatron-to-hf`` (:mod:`.cli`): ``torch_dist`` checkpoints
  that ``megatron.training``'s ``--load`` / ``--pretrained-checkpoint`` accept, and back.

Every refusal is a :class:`~.errors.ConvertError` with one line naming the field, file or tensor.
"""

from .errors import ConvertError
from .hf import build_gpt_from_hf, load_hf_weights, save_hf_checkpoint, transformer_config_from_hf
from .hf_stream import build_resident_gpt_from_hf

__all__ = ["ConvertError", "build_gpt_from_hf", "build_resident_gpt_from_hf", "load_hf_weights", "save_hf_checkpoint",
           "transformer_config_from_hf"]
