"""Triton NVFP4 kernels (any CUDA GPU; run on CPU under TRITON_INTERPRET=1 for tests).

One op per module, each a ``torch.library`` custom op (namespace ``minite::``) equal to its
reference in :mod:`minite_megatron.nvfp4`: :mod:`.quantize`, :mod:`.amax`, :mod:`.image`,
:mod:`.gemm`, :mod:`.grouped_gemm`, :mod:`.grouped_wgrad`, :mod:`.decode_gemm`,
:mod:`.decode_grouped_gemm`, :mod:`.decode_grouped_idot`. The backend
object the dispatcher loads is :data:`.backend.BACKEND`.
"""

from minite_megatron.nvfp4.backends import triton_interpreting as _interpreting

if _interpreting():
    from ._interpreter_compat import install as _install

    _install()
