"""CuTe DSL (CUTLASS Python DSL) NVFP4 kernels for Blackwell (sm_100a / sm_103a)."""
