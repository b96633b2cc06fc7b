"""``minite_kernels.custom_op``: a registered ``torch.library`` op that eager calls reach directly.

Regression (issue 16, H200 profile): each of the ~250 custom-op calls of an NVFP4 learner step
went through the dispatcher and back into Python (~33 us per call on the CI CPU, 1.5 us called
directly), on a step that waits on the host at 4096 tokens.
"""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minite_kernels.custom_op import FastCustomOp, custom_op

CALLS = []


@custom_op("minite_test::scaled_copy", mutates_args=())
def _scaled_copy(x: torch.Tensor, factor: float) -> torch.Tensor:
    CALLS.append(float(x.reshape(-1)[0]))  # a host read: impossible on a fake tensor
    return x * factor


@_scaled_copy.register_fake
def _(x, factor):
    return torch.empty_like(x)


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_run_the_function_and_modes_see_the_registered_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert isinstance(_scaled_copy, FastCustomOp) and hasattr(torch.ops.minite_test, "scaled_copy")
    x = torch.arange(4.0)
    CALLS.clear()
    assert torch.equal(_scaled_copy(x, 2.0), x * 2) and CALLS == [0.0]
    with _Recorder() as rec:  # a dispatch mode is active: the call goes through the op
        assert torch.equal(_scaled_copy(x, 3.0), x * 3)
    assert any("minite_test.scaled_copy" in op for op in rec.ops)
    with FakeTensorMode() as mode:  # tracing-style fake tensors get the fake implementation
        out = _scaled_copy(mode.from_tensor(x), 2.0)
    assert out.shape == x.shape and len(CALLS) == 2
