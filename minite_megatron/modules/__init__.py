"""Megatron-Core modules: NVFP4 tensor-parallel linears and the grouped expert linear."""
