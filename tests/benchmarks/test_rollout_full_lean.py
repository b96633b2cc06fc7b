"""The lean BF16 anchor of ``benchmarks/rollout_full.py`` (:class:`benchmarks.rollout_full.LeanDecode`)
computes the model it stands for: token by token over its KV cache, the logits of
:class:`benchmarks.lean_moe.LeanMoE`'s full causal forward, in FP32 on the CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.lean_moe import LeanMoE
from benchmarks.rollout_full import LeanDecode, lean_layers_that_fit, time_lean

DIMS = dict(layers=2, hidden=64, heads=4, groups=2, head_dim=16, experts=8, topk=2, moe_ffn=32, vocab=96)
FP32_TOL = 1e-5
"""Relative error of the decode logits vs the full forward, both FP32: the same math in another
order (one query against the cache vs a causal SDPA over the sequence); measured 1.0e-6, and 0.91
with the cache mask off."""


def _full_logits(m: LeanMoE, tokens: torch.Tensor) -> torch.Tensor:
    x = F.embedding(tokens, m.embed)
    for layer in m.layers:
        x = x + m._attention(layer, F.rms_norm(x, (m.h,), layer.n1, 1e-6))
        x = x + m._moe(layer, F.rms_norm(x, (m.h,), layer.n2, 1e-6))
    return F.linear(F.rms_norm(x, (m.h,), m.norm, 1e-6), m.head)


def test_decode_over_the_cache_is_the_full_forward():
    torch.manual_seed(0)
    m = LeanMoE(**DIMS, max_seq=16, device="cpu", dtype=torch.float32, std=0.3).requires_grad_(False)
    tokens = torch.randint(0, DIMS["vocab"], (2, 10), generator=torch.Generator().manual_seed(1))
    ref = _full_logits(m, tokens)
    dec = LeanDecode(m, batch=2, max_seq=16)
    out = torch.stack([dec.logits(tokens[:, t], torch.full((2,), t)) for t in range(tokens.shape[1])], dim=1)
    assert ref.std() > 0.1
    err = ((out - ref).double().norm() / ref.double().norm()).item()
    assert err < FP32_TOL, err
    # the sequences differ in length: the second one two steps behind attends only to its own past
    dec2 = LeanDecode(m, batch=2, max_seq=16)
    for t in range(6):
        pos = torch.tensor([t, max(t - 2, 0)])
        toks = torch.stack([tokens[0, t], tokens[1, max(t - 2, 0)]])
        last = dec2.logits(toks, pos)
    assert ((last[1] - ref[1, 3]).norm() / ref[1, 3].norm()).item() < FP32_TOL


def test_step_samples_in_place_and_timing_runs_eagerly_on_the_cpu():
    torch.manual_seed(0)
    m = LeanMoE(**DIMS, max_seq=12, device="cpu", dtype=torch.bfloat16).requires_grad_(False)
    dec = LeanDecode(m, batch=3, max_seq=12)
    with torch.no_grad():
        row = time_lean(dec, start=4, steps=8)
    assert row["graphed"] is False and row["decode_step_ms"] > 0
    assert dec.pos.tolist() == [12, 12, 12]
    assert ((dec.tokens >= 0) & (dec.tokens < DIMS["vocab"])).all()


def test_fit_counts_weights_and_cache():
    """The full model: 48 layers of BF16 weights (55.8 GiB) and a small cache fit 80 GB; a
    40 GiB card holds a cut."""
    from minite_megatron.training.presets import PRESETS

    full = PRESETS["qwen3-30b-a3b"]
    kv = 2 * 8 * 4 * 160 * 128 * 2
    assert lean_layers_that_fit(full, 79 * 2**30, kv) == 48
    cut = lean_layers_that_fit(full, 40 * 2**30, kv)
    assert 20 < cut < 48


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_is_captured_in_one_cuda_graph_gpu():
    """On a GPU the step (``torch._grouped_mm`` with most experts empty at batch 1, the cache
    writes, the sampling) is captured and replayed: the row says ``graphed`` and the replays move
    the positions as eager steps do."""
    torch.manual_seed(0)
    m = LeanMoE(**DIMS, max_seq=24, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
    for b in (1, 8):
        dec = LeanDecode(m, batch=b, max_seq=24)
        with torch.no_grad():
            row = time_lean(dec, start=8, steps=16)
        assert row["graphed"] is True, row.get("graph_error")
        assert dec.pos.tolist() == [24] * b
        assert ((dec.tokens >= 0) & (dec.tokens < DIMS["vocab"])).all()
