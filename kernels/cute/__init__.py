"""CuTe DSL (CUTLASS Python DSL) NVFP4 kernels for Blackwell (sm_100a / sm_103a).

* :func:`nvfp4_gemm` (:mod:`.gemm`): dense ``a @ b.T`` on FP4 tensor cores.
* :func:`nvfp4_grouped_gemm` (:mod:`.grouped_gemm`): MoE GEMM, one launch for all experts.
* :func:`nvfp4_grouped_wgrad_gemm` (:mod:`.grouped_wgrad_gemm`): MoE wgrad, experts split K.
* :data:`.backend.BACKEND`: the ``blackwell`` backend of :mod:`minite_megatron.nvfp4`.

Importing this package needs torch only; CUTLASS is imported when a kernel is compiled
(:mod:`._blockscaled_gemm_impl`). See ``docs/blackwell.md`` for what was checked and how.
"""

from .gemm import nvfp4_gemm
from .grouped_gemm import nvfp4_grouped_gemm
from .grouped_wgrad_gemm import nvfp4_grouped_wgrad_gemm

__all__ = ["nvfp4_gemm", "nvfp4_grouped_gemm", "nvfp4_grouped_wgrad_gemm"]
