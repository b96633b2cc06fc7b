"""``training.cuda_graphs.CaptureGuards``, the protocol both CUDA-graph paths (``GraphedStep`` and
``--cuda-graph-impl full_iteration``) run around a capture, checked on a CPU with the captured
body run eagerly (the GPU side: ``test_cuda_graph_step_gpu.py``, ``test_full_iteration_graph_gpu.py``):
the weight caches are emptied before and after the capture, the body's stochastic quantizations
take the device seed slots the warm-up listed, a body that draws other seeds is refused naming
its caller, each replay gets the eager step's seeds, and a replay that routed NaN raises one line."""

import pytest
import torch

from minite_megatron import nvfp4


def test_capture_guards_around_a_captured_body(monkeypatch):
    from minite_megatron.ops import seeds, weight_cache
    from minite_megatron.training.cuda_graphs import CaptureGuards

    monkeypatch.setattr(seeds, "_STATE", {"iteration": None, "n": 0, "slots": None, "record": None})
    emptied = []
    monkeypatch.setattr(weight_cache, "invalidate_weight_caches", lambda: emptied.append(1))
    torch.manual_seed(5)
    with seeds.recording() as drawn:  # the last warm-up step
        eager = [seeds.next_sr_seed(s) for s in (3, 8)]
    guards = CaptureGuards(drawn, "cpu", "a test graph")
    assert len(emptied) == 1 and guards.nan is None
    taken = guards.captured(lambda: [seeds.next_sr_seed(s) for s in (3, 8)])()
    assert all(isinstance(t, nvfp4.DeviceSeed) for t in taken)
    assert seeds._STATE["slots"] is None  # the capture's slots are no longer drawn from after the body
    guards.after_capture()
    assert len(emptied) == 2

    torch.manual_seed(5)
    guards.before_replay()  # the seeds the eager step drew, from the same generator state
    assert guards.slots.keys.tolist() == [nvfp4.sr_key(s) for s in eager]
    guards.check_routing("replay 1", "do not apply it")  # no router flagged: nothing raised
    guards.nan = torch.tensor(True)
    with pytest.raises(ValueError) as err:
        guards.check_routing("replay 2", "do not apply it")
    assert str(err.value) == ("a test graph: NaN in the routing scores of replay 2 (strict mode refuses to route them; "
                              "do not apply it)")

    short = CaptureGuards(drawn, "cpu", "a short graph")
    short.captured(lambda: seeds.next_sr_seed(3))()
    with pytest.raises(RuntimeError, match="a short graph: the captured step drew 1 stochastic-rounding seeds, its "
                                           "warm-up step 2"):
        short.after_capture()
