"""Tooling of the Triton kernels, no ops: ahead-of-time compilation (:mod:`._aot`,
:mod:`._aot_kernels`, :mod:`._aot_quantize`), the launch decorator (:mod:`._launch`), host-side
integer helpers (:mod:`._host`), the interpreter fix (:mod:`._interpreter_compat`) and the kernel
tests' helpers (:mod:`._testing`).
"""
