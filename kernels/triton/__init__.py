"""Triton kernels (any CUDA GPU; run on CPU under TRITON_INTERPRET=1 for tests), by family.

Each op is a ``torch.library`` custom op (namespace ``minite::``) equal to its reference in the
contract layer (:mod:`minite_megatron.nvfp4`, :mod:`minite_megatron.invariant`):

- :mod:`.nvfp4`: quantize, amax, image, GEMMs, grouped GEMMs, wgrad, group_zero, fused producers
- :mod:`.decode`: the rollout decode GEMMs and qk-norm + rope + cache write
- :mod:`.invariant`: the batch-invariant ``bi_*`` ops of the strict path
- :mod:`.moe`: routing, the deterministic combine, the weighted SwiGLU
- :mod:`._build`: AOT compilation, launch and test tooling (no ops)

The only way in is the backend object :data:`.backend.BACKEND` (its ``OPS`` table says which kernel
runs for each op and why); nothing above the backend layer imports these modules.
"""

from minite_megatron.nvfp4.backends import triton_interpreting as _interpreting

if _interpreting():
    from minite_kernels.triton._build._interpreter_compat import install as _install

    _install()
