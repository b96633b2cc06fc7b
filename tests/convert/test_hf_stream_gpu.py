"""The streamed Hugging Face build of the resident NVFP4 model on a GPU (``device="cuda"``): bit
for bit the importer's full load on the same GPU followed by the same quantization (the GPU
backend's quantizer; the engine's rollouts equal, strict mode's gap 0), and a device peak below the BF16 model's bytes. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from minite_megatron.convert.hf_stream import build_resident_gpt_from_hf
from minite_megatron.recipe import Recipe

from .hf_stream_cases import TINY, assert_same_rollouts, assert_same_resident, importer_resident, save_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("single_process"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("strict", [False, True])
def test_streamed_build_on_cuda_is_the_importer_bit_for_bit(tmp_path, strict):
    path = save_tiny(tmp_path / "hf")
    recipe = Recipe(strict=strict)
    res = build_resident_gpt_from_hf(path, recipe, device="cuda", preset=TINY)
    ref = importer_resident(path, recipe, "cuda")
    assert res.decoder.layers[0].mlp.router.weight.is_cuda
    assert assert_same_resident(res, ref) == 2 * 4
    assert_same_rollouts(res, ref, strict)


def test_streamed_build_never_holds_the_bf16_model_on_the_device(tmp_path):
    """24 layers: the device's peak during the build stays below the model's BF16 bytes (what a
    full load holds), i.e. the resident weights plus one layer's BF16 weights and their
    quantization's working set."""
    layers = 24
    path = save_tiny(tmp_path / "hf", layers=layers)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    res = build_resident_gpt_from_hf(path, device="cuda", preset=dict(TINY, layers=layers))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    bf16_model = res.minite_hf_stream.bytes_read
    assert peak < bf16_model, f"device peak {peak} B >= the BF16 model's {bf16_model} B"
