"""``torch.library.custom_op`` for the kernels, without the dispatcher round trip in eager mode.

Every kernel is a ``torch.library`` custom op with a fake implementation, so ``torch.compile``
and Megatron's graph tools can trace it. Called eagerly, though, a custom op goes through the
C++ dispatcher and back into Python three times (the autograd key, the backend key, a
``torch._dynamo`` disable wrapper) and checks its outputs for aliasing: measured ~33 us per call
on the CI CPU against 1.5 us for calling the function itself, and an NVFP4 training step of the
qwen3-moe preset makes ~250 such calls (issue 16: the 4096-token step waits on the host).

:func:`custom_op` registers the op exactly as ``torch.library.custom_op`` does and returns a
:class:`FastCustomOp`: in eager mode (not compiling, no ``TorchDispatchMode`` such as
``FakeTensorMode`` active) it calls the function directly -- the same code, the same results --
and otherwise the registered op. The ops here never take part in autograd themselves (autograd
functions around them do), so skipping the op's autograd key changes nothing. What is lost
eagerly is only the op's own entry in a ``torch.profiler`` CPU table (kernels keep their names)
and torch's debug check that an output does not alias an input.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _eager() -> bool:
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


class FastCustomOp:
    """A registered custom op (``.op``) that calls its Python implementation directly when eager."""

    def __init__(self, op):
        self.op = op
        self._impl: Callable[..., Any] | None = getattr(op, "_init_fn", None)

    def __call__(self, *args, **kwargs):
        if self._impl is not None and _eager():
            return self._impl(*args, **kwargs)
        return self.op(*args, **kwargs)

    def register_fake(self, fn):
        return self.op.register_fake(fn)

    def __getattr__(self, name):
        return getattr(self.op, name)


def custom_op(name: str, **kwargs) -> Callable[[Callable[..., Any]], FastCustomOp]:
    """``torch.library.custom_op(name, **kwargs)`` returning a :class:`FastCustomOp`."""

    def wrap(fn):
        return FastCustomOp(torch.library.custom_op(name, **kwargs)(fn))

    return wrap
