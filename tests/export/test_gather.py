"""The shard reassembly of ``export.gather`` on the contract alone (no processes; the two-process
TP / EP gather against the unsharded learner runs in ``tests/serving/test_refit_sharded.py``).

Pinned failures: a gated fc1's shards stacked as ``[gate_0; up_0; gate_1; up_1]`` instead of
``[gate; up]``; row-parallel shards joined along the wrong axis of the packed codes; shards
quantized with their own amax (different global scales) merged silently; learner_weights on a
single process giving anything but the modules' cached quantized weights.
"""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.export.gather import _cat, learner_weights
from minite_megatron.export.rows import take_rows
from minite_megatron.testing import assert_nvfp4_equal


def _q(w):
    return nvfp4.quantize(w, "tensor", (16, 16), backend="reference")


def _shard_rows(q, ranges):
    return take_rows(q, ranges)


def test_gated_fc1_and_row_parallel_shards_reassemble_to_the_unsharded_quantization():
    g = torch.Generator().manual_seed(0)
    ffn, hidden, tp = 64, 48, 2
    w = torch.randn(2 * ffn, hidden, generator=g)
    w[5] *= 40.0  # the amax lives on one rank's rows
    full = _q(w)
    # rank r holds [gate_r; up_r], quantized with the synced (global) amax: slices of `full`
    f = ffn // tp
    shards = [_shard_rows(full, [(r * f, (r + 1) * f), (ffn + r * f, ffn + (r + 1) * f)]) for r in range(tp)]
    assert_nvfp4_equal(_cat(shards, -2, True, "fc1"), full.linear(), "fc1", image=False)
    with pytest.raises(AssertionError):  # a plain stack is another weight
        assert_nvfp4_equal(_cat(shards, -2, False, "fc1"), full.linear(), "fc1", image=False)

    w2 = torch.randn(hidden, 2 * ffn, generator=g)
    full2 = _q(w2)
    k = 2 * ffn // tp
    cols = [nvfp4.quantize(w2[:, r * k:(r + 1) * k], "tensor", (16, 16), amax=w2.abs().amax().reshape(1),
                           backend="reference") for r in range(tp)]
    assert_nvfp4_equal(_cat(cols, -1, False, "fc2"), full2.linear(), "fc2", image=False)


def test_shards_with_their_own_global_scales_are_refused():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 32, generator=g)
    w[40:] *= 10.0
    unsynced = [_q(w[:32]), _q(w[32:])]  # each rank's own amax: not slices of one quantization
    with pytest.raises(ValueError, match="without the TP amax sync"):
        _cat(unsynced, -2, False, "decoder.layers.0.self_attention.linear_qkv.weight")


def test_learner_weights_are_the_modules_cached_quantized_weights():
    from tests.megatron.minite_tiny import build_gpt, init_single_process, tiny_config

    from minite_megatron.recipe import Recipe
    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    init_single_process()
    cfg = tiny_config(moe_layer_freq=[0, 1])
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, Recipe()))
    w = learner_weights(model)
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    experts = model.decoder.layers[1].mlp.experts.linear_fc1
    assert w["decoder.layers.0.self_attention.linear_qkv.weight"] is qkv.quantized_weight()  # the cache, no copy
    assert w["decoder.layers.1.mlp.experts.linear_fc1.weight"] is experts.quantized_weight()
    assert w["decoder.layers.1.mlp.experts.linear_fc1.weight"].shape == (4, 64, 64)
    assert not any(k.startswith("decoder.layers.1.mlp.experts.linear_fc1.weight") and k[-1].isdigit() for k in w)
    assert w["decoder.layers.1.mlp.router.weight"].dtype == torch.float32  # high precision, as is
    names = {n for n, _ in model.named_parameters()}
    quantized = {k for k, v in w.items() if isinstance(v, nvfp4.NVFP4Tensor)}
    assert set(w) - quantized <= names
