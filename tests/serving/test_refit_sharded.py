"""Refit from a TP / EP-sharded learner: gathered shards == the unsharded learner, bitwise.

Two gloo processes (``_sharded_job``) build the minite-spec tiny Qwen3-MoE GPT at TP = EP = 1,
then re-shard it through Megatron's distributed checkpoint at TP=2 (experts TP=2 too), EP=2 and
TP=2 x EP=2 (expert TP 1), and gather the learner's quantized weights on rank 0
(:func:`~minite_megatron.export.gather.gather_learner_weights`). Pinned failures: shards
concatenated in the wrong order (the gated fc1's ``[gate_r; up_r]``, row-parallel K halves,
experts of the other EP rank), local expert indices left in the names, a re-quantization (it
would show in the bytes), BF16 images on the wire (the byte count). Then vLLM layers are
refitted from the gathered tensors in place.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: scripts/test_vllm.sh runs this in .venv-vllm")

from minite_megatron.nvfp4 import NVFP4Tensor  # noqa: E402
from minite_megatron.serving.refit import refit_stats, refit_traffic, refit_vllm_model  # noqa: E402
from minite_megatron.testing import assert_bitwise_equal, assert_nvfp4_equal  # noqa: E402

from . import _vllm_layers as V  # noqa: E402
from ._sharded_job import LAYOUTS  # noqa: E402

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Rank 0's and rank 1's results of the job (one job for every layout)."""
    from tests.megatron._dist import run_distributed

    d = tmp_path_factory.mktemp("sharded")
    paths = run_distributed("tests.serving._sharded_job:gather_job", 2, work_dir=str(d), layouts=list(LAYOUTS))
    return [torch.load(p, weights_only=False) for p in paths]


def _another(t: torch.Tensor) -> torch.Tensor:
    """Another model's tensor of the same dtype and shape (codes flipped, scales halved)."""
    if t.dtype == torch.uint8:
        return t ^ 0x77
    return (t.float() / 2).to(t.dtype)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gathered_weights_equal_the_unsharded_learner_bitwise(sharded, layout):
    ref, got = sharded[0]["ref"], sharded[0][layout]
    assert set(got["weights"]) == set(ref["weights"])
    for name, want in ref["weights"].items():
        if isinstance(want, NVFP4Tensor):
            assert_nvfp4_equal(got["weights"][name], want, f"{layout}: {name}", image=False)
        else:
            assert_bitwise_equal(got["weights"][name], want, f"{layout}: {name}")
    assert set(got["tensors"]) == set(ref["tensors"])
    for name, want in ref["tensors"].items():  # what the plugin loads
        assert_bitwise_equal(got["tensors"][name], want, f"{layout}: export {name}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gather_moves_only_the_packed_shards(sharded, layout):
    """Bytes into rank 0 (== rank 1's bytes sent: one peer) equal :func:`refit_traffic`'s count
    from the shapes: packed codes + e4m3 scales + one fp32 global scale per shard + an 8-byte
    header per collective; the refit leg equals the export tensors' bytes."""
    from tests.megatron._parallel_harness import TINY_MOE, VOCAB

    s0, s1 = sharded[0][layout]["stats"], sharded[1][layout]["stats"]
    lay = LAYOUTS[layout]
    want = refit_traffic(TINY_MOE, vocab=VOCAB, tp=lay["tp"], ep=lay["ep"], etp=lay["etp"], moe_layers=[1], hp_bytes=4)
    assert (s0.bytes_received, s1.bytes_sent, s0.bf16_bytes_received) == (want.gather_bytes, want.gather_bytes,
                                                                          want.gather_bf16_bytes)
    stats = refit_stats(sharded[0][layout]["tensors"])
    assert (stats.bytes_moved, stats.bf16_bytes) == (want.refit_bytes, want.refit_bf16_bytes)


def test_refit_of_vllm_layers_from_the_gathered_tensors(vllm_env, sharded):
    """vLLM's own blocks, loaded with another model first, refitted in place from each layout's
    gathered tensors: parameters bitwise the unsharded export's, storage unchanged, and the
    forward the reference layers' forward."""
    from safetensors.torch import load_file

    r0 = sharded[0]
    ref = r0["ref"]["tensors"]
    vc = V.vllm_config(r0["export_dir"])
    want_root = V.build(vc)
    flat = {}
    for f in sorted(Path(r0["export_dir"]).glob("model-*.safetensors")):
        flat.update(load_file(str(f)))
    V.load(want_root, flat.items())
    V.finish_loading(want_root)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    with V.running(vc):
        want_qkv, want_moe = want_root.model.layers["1"].self_attn.qkv_proj(x)[0], want_root.moe(x)

    vc2 = V.vllm_config(r0["export_dir"])  # its own config: vLLM finds an MoE layer by name in the config
    root = V.build(vc2)
    other = {n: _another(t) for n, t in ref.items()}
    V.load(root, other.items())
    V.finish_loading(root)
    with V.running(vc2):
        assert not torch.equal(root.moe(x), want_moe), "the other model must compute something else"
    params = dict(root.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    for layout in LAYOUTS:
        stats = refit_vllm_model(root, r0[layout]["tensors"], load_weights=lambda it: V.load(root, it))
        assert {n: p.data_ptr() for n, p in root.named_parameters()} == ptrs
        for n, p in want_root.named_parameters():
            assert_bitwise_equal(params[n].data, p.data, f"{layout}: {n}")
        with V.running(vc2):
            assert_bitwise_equal(root.model.layers["1"].self_attn.qkv_proj(x)[0], want_qkv, f"{layout}: qkv")
            assert_bitwise_equal(root.moe(x), want_moe, f"{layout}: moe")
        assert stats.tensors == len(ref)
        V.load(root, other.items())  # back to the other model before the next layout's refit
