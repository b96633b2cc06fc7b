"""A learner step of an NVFP4 MoE model waits for the GPU only where the design needs it (GPU).

The design's host synchronizations of one forward + backward on one GPU (TP = EP = 1):

* **none in the MoE layers** with the minite experts (``modules.moe.DeviceTokenCounts``): the
  token counts stay on the device, the experts get a ``DeviceGroupSizes`` (offsets summed on the
  device, the wgrad operands ``ceil16(T + 15 G)`` wide): no device-to-host copy, no wait, and no
  host-to-device copy either (the default). The synced path below (``device_counts=False``, what
  EP > 1 runs) is pinned too:
* **Megatron's routing counts, once per MoE layer** (forward, the synced path): its all-to-all
  dispatcher copies ``tokens_per_expert`` to the host on a side stream and waits for that copy
  (``d2h_event.synchronize()`` in ``_maybe_dtoh_and_synchronize``, at ``before_permutation_2``),
  for ``TEGroupedMLP.forward``'s host list; then **one pinned, non-blocking host-to-device copy
  per MoE layer**: the group offsets made from those counts
  (:class:`~minite_megatron.nvfp4.group_sizes.GroupSizes`), shared by fc1, fc2 and the backward.
  No other copy, no pageable copy, nothing torch's sync debug mode reports.

Regression (issue 16 item 3; BENCHMARKS.md run 9: the NVFP4 step at 16384 tokens took 235 ms of
wall time for 169.6 ms of GPU time): each grouped GEMM re-derived its offsets from the host list,
10 host-to-device copies per MoE layer and step, 4 of them blocking (the wgrad operands' padding
index, forward and backward); and (2026-12-01: 127.1 ms for 122.1 ms of GPU time) the one wait per
MoE layer kept the host from running more than one layer ahead.
"""

import pytest
import torch

from minite_megatron.recipe import Recipe
from minite_megatron.testing import HostSyncCounter

pytestmark = pytest.mark.gpu

PRESET = dict(layers=2, hidden=256, heads=4, groups=2, head_dim=64, experts=8, topk=2, moe_ffn=128, vocab=512)

RECIPES = {
    "nvfp4": Recipe(),  # the default recipe
    "bf16_twin": Recipe(precision="bf16", aligned_ops=False, aligned_attention=False),
}


@pytest.mark.parametrize("device_counts", [True, False], ids=["device_counts", "synced"])
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_learner_step_syncs_the_host_only_where_the_design_says(name, device_counts, monkeypatch):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from minite_megatron.modules import moe
    from minite_megatron.ops.weight_cache import invalidate_weight_caches
    from minite_megatron.training.presets import build_gpt, init_single_process

    device = init_single_process(seed=0)
    model = build_gpt(PRESET, RECIPES[name], max_seq=128, device=device, dtype=torch.bfloat16)
    model.train()
    moe_layers = sum(isinstance(m, MoELayer) for m in model.modules())
    assert moe_layers == PRESET["layers"]
    dispatchers = [m.token_dispatcher for m in model.modules() if isinstance(m, MoELayer)]
    for d in dispatchers:
        d.counts_on_device = device_counts
        why = d.why_host_counts(torch.bfloat16, device)
        assert (why is None) == device_counts, why
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, PRESET["vocab"], (2, 128), generator=g).to(device)
    labels = torch.randint(0, PRESET["vocab"], (2, 128), generator=g).to(device)
    pos = torch.arange(128, device=device).unsqueeze(0).expand(2, -1)

    def step():
        invalidate_weight_caches()  # new weights, as after an optimizer step: quantized again
        model(tokens, pos, None, labels=labels).mean().backward()
        for p in model.parameters():
            p.grad = None

    step()  # warm-up: Triton compiles, the caching allocators fill, Megatron's lazy state
    torch.cuda.synchronize()
    with HostSyncCounter() as counted:
        step()
    torch.cuda.synchronize()
    report = counted.report()
    assert all((d._why_host is None) == device_counts for d in dispatchers), [d._why_host for d in dispatchers]
    assert not counted.debug_mode_warnings, report
    assert not counted.pageable_h2d, report
    if device_counts:  # no wait, and no copy at all: the offsets are summed on the device
        assert not counted.syncs, report
        assert not counted.h2d, report
        return
    megatron_waits = [s for s in counted.syncs if s[0] == "Event.synchronize" and "token_dispatcher" in s[1]]
    assert len(megatron_waits) == moe_layers, report
    assert len(counted.syncs) == moe_layers, report  # nothing but Megatron's routing-count waits
    assert len(counted.h2d) <= moe_layers, report


def test_the_counter_sees_each_kind_of_host_wait():
    """:class:`HostSyncCounter` itself: each kind it claims to see, and the copy it must not flag."""
    x = torch.arange(64, device="cuda", dtype=torch.float32)
    pinned = torch.arange(8, dtype=torch.int32).pin_memory()
    with HostSyncCounter() as counted:
        x.sum().item()  # _local_scalar_dense
        x[x > 3]  # boolean mask
        torch.repeat_interleave(torch.arange(3, device="cuda"), torch.tensor([1, 2, 3], device="cuda"))
        torch.arange(4).to("cuda")  # pageable, blocking
        torch.arange(4).to("cuda", non_blocking=True)  # pageable
        pinned.to("cuda", non_blocking=True)  # the one copy that never waits
        e = torch.cuda.Event()
        e.record()
        e.synchronize()
    kinds = [what for what, _ in counted.syncs]
    assert "_local_scalar_dense" in kinds and "Event.synchronize" in kinds, counted.report()
    assert any("boolean mask" in k for k in kinds) and any("repeat_interleave" in k for k in kinds), counted.report()
    assert sum("blocking host-to-device" in k for k in kinds) >= 1, counted.report()
    assert len(counted.pageable_h2d) >= 2 and len(counted.h2d) == len(counted.pageable_h2d) + 1, counted.report()
    assert counted.debug_mode_warnings, counted.report()
    assert all("test_host_syncs_gpu.py" in where for _, where in counted.syncs), counted.report()


def test_the_counter_does_not_flag_a_masked_fill():
    """``t[mask] = 0`` (Megatron's cross entropy does it twice) runs as ``masked_fill_``: no sync."""
    t = torch.arange(64, device="cuda")
    with HostSyncCounter() as counted:
        t[t > 3] = 0
        t.masked_fill_(t > 1, 5)
    assert not counted.syncs and not counted.debug_mode_warnings, counted.report()
