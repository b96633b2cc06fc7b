"""Grouped NVFP4 experts and sequential experts: the same model, interchangeable checkpoints.

Pins (issue 14): a ``torch_dist`` checkpoint of the minite grouped experts (``NVFP4GroupedLinear``)
did not load into Megatron's ``SequentialMLP`` (``Missing key in checkpoint state_dict:
...experts.linear_fc1._extra_state/shard_0_4``: the sequential linears write one ``_extra_state``
object per expert, the grouped linear wrote none), and the minite spec ignored
``moe_grouped_gemm=False`` (sequential experts were asked for, grouped ones built).
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel import checkpoint
from tests.parallel import model as tiny
from tests.parallel.layouts import parse
from tests.parallel.rules import max_ulp_distance
from tests.parallel.spawn import init_single_process


def _build(kind: str, seed: int):
    """``grouped`` / ``sequential``: the minite spec (NVFP4); ``local``: Megatron's local spec."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    from minite_megatron.megatron_args import finalize_gpt_model, minite_layer_spec

    init_single_process()
    config = tiny.transformer_config(parse("ref"))
    if kind == "local":
        spec = tiny.local_spec(config)
    else:
        spec = minite_layer_spec(config, recipe={}, moe_grouped_gemm=kind == "grouped")
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=tiny.VOCAB, max_sequence_length=tiny.SEQ,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    return finalize_gpt_model(model, {}) if kind != "local" else model


def _weights(model) -> dict[str, torch.Tensor]:
    """Every weight by a layout-independent name (a grouped ``weight{i}`` as ``local_experts.i``)."""
    out = {}
    for name, p in model.named_parameters():
        if ".experts.linear_fc" in name:  # grouped: experts.linear_fc1.weight3
            head, fc, w = name.rsplit(".", 2)
            name = f"{head}.local_experts.{w.removeprefix('weight')}.{fc}.weight"
        else:  # sequential: experts.local_experts.3.linear_fc1.weight
            name = name.replace(".experts.local_experts.", ".experts.local_experts.")
        out[name] = p.detach().clone()
    return out


def test_the_minite_spec_honours_moe_grouped_gemm_false():
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from minite_megatron.modules.grouped_linear import NVFP4GroupedLinear
    from minite_megatron.modules.linear import NVFP4ColumnParallelLinear, NVFP4RowParallelLinear

    grouped, sequential = _build("grouped", 1), _build("sequential", 1)
    assert isinstance(grouped.decoder.layers[1].mlp.experts, TEGroupedMLP)
    assert isinstance(grouped.decoder.layers[1].mlp.experts.linear_fc1, NVFP4GroupedLinear)
    experts = sequential.decoder.layers[1].mlp.experts
    assert isinstance(experts, SequentialMLP) and len(experts.local_experts) == tiny.TINY_MOE["num_moe_experts"]
    for mlp in experts.local_experts:
        assert isinstance(mlp.linear_fc1, NVFP4ColumnParallelLinear) and mlp.linear_fc1.precision == "nvfp4"
        assert isinstance(mlp.linear_fc2, NVFP4RowParallelLinear) and mlp.linear_fc2.precision == "nvfp4"


@pytest.mark.parametrize("saved, loaded", [("grouped", "local"), ("local", "grouped"), ("grouped", "sequential"),
                                           ("sequential", "grouped")])
def test_checkpoints_interchange_between_grouped_and_sequential_experts(tmp_path, saved, loaded):
    source, target = _build(saved, seed=1), _build(loaded, seed=2)
    before = _weights(target)
    checkpoint.save(str(tmp_path / "ckpt"), [source])
    checkpoint.load(str(tmp_path / "ckpt"), [target])  # raises naming any missing key
    want, got = _weights(source), _weights(target)
    assert set(want) == set(got)
    diff = {k: max_ulp_distance(got[k], want[k]) for k in want}
    assert not any(diff.values()), {k: v for k, v in diff.items() if v}
    assert any(not torch.equal(before[k], got[k]) for k in got)  # it really loaded something


def test_grouped_and_sequential_nvfp4_experts_compute_the_same_forward(tmp_path):
    """Same weights: the grouped op equals one NVFP4 linear per expert, bitwise (per-expert
    weight scales, per-token activation scales, exact block partials in K order)."""
    grouped, sequential = _build("grouped", seed=1), _build("sequential", seed=2)
    checkpoint.save(str(tmp_path / "ckpt"), [grouped])
    checkpoint.load(str(tmp_path / "ckpt"), [sequential])
    tokens, labels = tiny.global_batch(1)
    pos = torch.arange(tiny.SEQ).expand(tiny.GLOBAL_BATCH, -1)
    mask = torch.ones(tiny.SEQ, tiny.SEQ, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        a = grouped(tokens, pos, mask, labels=labels)
        b = sequential(tokens, pos, mask, labels=labels)
    assert torch.isfinite(a).all() and max_ulp_distance(a, b) == 0
