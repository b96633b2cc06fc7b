"""TP=2 (+SP), EP=2 and PP=2 imports on two gloo processes equal the single-process import:
every rank reads only its slices, the gathered parameters are bitwise the single-process ones,
the logits equal HF's (the minite spec's: its single-process logits), and the distributed export
writes the original BF16 bits."""

from __future__ import annotations

import pytest
import torch

from minite_megatron.convert import build_gpt_from_hf, load_hf_weights
from minite_megatron.convert.save import iter_model_tensors, iter_torch_dist_tensors
from minite_megatron.testing import assert_bitwise_equal
from tests.megatron._dist import run_distributed

from ._workers import LAYOUTS
from .conftest import load_hf, megatron_logits, relative_error, tokens
from .test_import import FP32_TOL, _hf_tensors

pytestmark = [pytest.mark.multiproc, pytest.mark.usefixtures("single_process")]


@pytest.fixture(scope="module")
def parallel_runs(hf_moe_dir, hf_dense_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("parallel")
    (res,) = run_distributed("tests.convert._workers:import_worker", 2,
                             hf_dirs={"moe": str(hf_moe_dir), "dense": str(hf_dense_dir)},
                             layouts=list(LAYOUTS), out_dir=str(out))[:1]
    return out, res


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_import_equals_single_process(layout, parallel_runs, hf_moe_dir, hf_dense_dir):
    out, res = parallel_runs
    impl = LAYOUTS[layout].get("impl", "local")
    hf_dir = hf_dense_dir if LAYOUTS[layout].get("model") == "dense" else hf_moe_dir
    single = build_gpt_from_hf(hf_dir, impl=impl, dtype=torch.float32).eval()
    full_bytes = load_hf_weights(single, hf_dir).bytes_read
    ref = {k: v for g in iter_model_tensors(single) for k, v in g.items()}
    # each rank reads only its shard: no rank reads the whole model; PP stages read disjoint parts,
    # EP ranks split the experts and both read the rest
    read = res[layout]["bytes_read"]
    assert all(b < full_bytes for b in read), (read, full_bytes)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in single.named_parameters() if ".experts." in n)
    if layout == "pp2":
        assert sum(read) == full_bytes
    if layout == "pp2_dense":  # the tied head: the last stage reads the embedding too
        emb = single.embedding.word_embeddings.weight
        assert sum(read) == full_bytes + emb.numel() * emb.element_size()
    if layout == "ep2":
        assert sum(read) == 2 * full_bytes - expert_bytes
    # the parameters, gathered by Megatron's distributed checkpointing, are the single-process ones
    got = {k: v for g in iter_torch_dist_tensors(out / layout / "release") for k, v in g.items()}
    assert sorted(got) == sorted(ref)
    for key in ref:
        assert_bitwise_equal(got[key], ref[key], name=f"{layout}: {key}")
    # the distributed export (rank 0 gathers, writes) gives back the original BF16 bits
    src, back = _hf_tensors(hf_dir), _hf_tensors(out / f"{layout}_hf")
    assert sorted(back) == sorted(src)
    for name in src:
        assert_bitwise_equal(back[name], src[name], name=f"{layout} export: {name}")
    if res[layout]["logits"] is not None:
        with torch.no_grad():
            ref_logits = load_hf(hf_dir)(tokens()).logits if impl == "local" else megatron_logits(single, tokens())
        # minite under TP: the same NVFP4 bytes (TP-synced amaxes), K split in two partial sums
        assert relative_error(res[layout]["logits"], ref_logits) < FP32_TOL
