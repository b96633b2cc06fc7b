"""Export of the learner's quantized weights (ModelOpt NVFP4 layout) for vLLM/SGLang, and its loader."""
