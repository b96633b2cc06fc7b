"""Serving the learner's exact policy in an inference engine.

- :mod:`.numerics`: the learner's forward pieces as plain functions of exported tensors (no engine
  imported): the NVFP4 linear (per-token activation quantization, the contract's GEMM), the FP32
  router / LM head, and the MoE block (deterministic top-k, expert GEMMs, fixed-order combine).
- :mod:`.vllm`: the ``minite-vllm`` plugin (``vllm.general_plugins`` entry point): a vLLM
  quantization method ``minite_nvfp4`` that runs :mod:`.numerics` on the export's bytes.
- :mod:`.refit`: the RL loop's weight sync: the learner's NVFP4 bytes into a running vLLM model,
  in place, never re-quantized, with the bytes moved per refit.

Docs: ``docs/serving.md``.
"""
