"""The ``triton`` backend object: where it runs, why not elsewhere, and the dispatcher."""

from __future__ import annotations

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.nvfp4 import BackendUnavailable
from minite_megatron.testing import assert_nvfp4_equal

from minite_kernels.triton._build._testing import DEVICE, HAS_CUDA, INTERPRETING, kernels_runnable, randn


def test_backend_base_class_and_registry_entry():
    """The Triton backend runs every op of the base class (a dropped kernel would silently send
    callers to the slower composition) and states its kernels' operand limits."""
    backend = nvfp4.backends._load("triton")
    assert backend.name == "triton" and isinstance(backend, nvfp4.Backend)
    assert {op: backend.supports(op) for op in nvfp4.backends.OPS} == {op: None for op in nvfp4.backends.OPS}
    assert "16x16 tiles" in backend.supports("gemm_nt", tile=(1, 16))
    assert backend.supports("grouped_gemm_nt", tile=(16, 16)) is None
    row = dict(dtype=torch.bfloat16, global_scale="row")
    assert backend.supports("rmsnorm_quantize", width=48, **row) is None
    assert "multiple of 16" in backend.supports("rmsnorm_quantize", width=40, **row)
    assert "multiple of 32" in backend.supports("swiglu_quantize", width=48, **row)
    assert "per-token" in backend.supports("swiglu_quantize", width=64, dtype=torch.bfloat16, global_scale="tensor")
    assert "bf16 / fp16" in backend.supports("rmsnorm_quantize", width=64, dtype=torch.float32, global_scale="row")


def test_cpu_availability_follows_the_interpreter(monkeypatch):
    from minite_kernels.triton.backend import BACKEND

    from minite_megatron.settings import settings

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    settings.cache_clear()
    assert not BACKEND.available("cpu")
    assert "TRITON_INTERPRET=1" in BACKEND.why_not("cpu")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET"):
        BACKEND.quantize(randn(4, 16))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    settings.cache_clear()
    assert BACKEND.available("cpu") and BACKEND.why_not("cpu") is None
    assert "unsupported device type" in BACKEND.why_not("meta")


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on a machine without CUDA")
def test_cuda_unavailable_says_why():
    from minite_kernels.triton.backend import BACKEND

    assert "no CUDA device" in BACKEND.why_not("cuda")


@pytest.mark.skipif(not kernels_runnable(), reason="needs a GPU or TRITON_INTERPRET=1")
def test_dispatcher_by_name_runs_the_kernels():
    x = randn(16, 64, seed=1, dtype=torch.bfloat16).to(DEVICE)
    got = nvfp4.quantize(x, backend="triton", rounding="stochastic", seed=3, with_image=True)
    ref = nvfp4.quantize_reference(x.cpu(), rounding="stochastic", seed=3, with_image=True)
    from dataclasses import replace

    assert_nvfp4_equal(replace(got, codes=got.codes.cpu(), block_scales=got.block_scales.cpu(),
                               global_decode=got.global_decode.cpu(), image=got.image.cpu()), ref)


@pytest.mark.skipif(not (INTERPRETING and not HAS_CUDA), reason="CPU dispatcher default")
def test_cpu_default_stays_the_reference():
    assert nvfp4.get_backend(None, "cpu").name == "reference"


def test_kernel_switches_are_backend_options_not_module_globals():
    """Benchmarks compared settings by flipping module globals with setattr (issue 11); now each
    setting is a backend object, registered for a block with ``nvfp4.backends.registered``."""
    from minite_kernels.triton.backend import BACKEND, TritonBackend, TritonOptions

    cpu = torch.device("cpu")
    assert BACKEND.options == TritonOptions()
    # the defaults are what runs: the decode kernels, their strict configuration, the integer-dot MoE decode
    assert BACKEND.decode_ok(cpu) and BACKEND.strict_decode_ok(64, cpu) and BACKEND.idot_decode_ok(cpu)
    off = TritonBackend(TritonOptions(decode_kernels=False))
    assert not off.decode_ok(cpu) and not off.strict_decode_ok(64, cpu)
    no_strict = TritonBackend(TritonOptions(strict_decode=False))
    assert no_strict.decode_ok(cpu) and not no_strict.strict_decode_ok(64, cpu)
    with nvfp4.backends.registered(off):
        assert nvfp4.get_backend("triton", DEVICE) is off
    assert nvfp4.backends._load("triton") is BACKEND


def test_gemm_tiles_are_backend_options(monkeypatch):
    """The GEMM kernels' default-mode launches were module globals (``DEFAULT_CONFIG``) that the sweeps
    flipped (issue 25); now ``TritonOptions.gemm_tile`` / ``grouped_gemm_tile`` / ``grouped_wgrad_tile``:
    a configured backend hands its tile to the custom op (a flat list, also through the registered
    op's schema; None for the default), the launch takes it where the default would run, and the
    results are the default backend's bits (the tiles change only the pipeline depth: the same MMAs in
    the same K order)."""
    from minite_kernels.triton.backend import BACKEND, TritonBackend, TritonOptions
    from minite_kernels.triton.nvfp4 import gemm, grouped_gemm, grouped_wgrad

    tiles = dict(gemm_tile=(128, 128, 64, 8, 8, 2), grouped_gemm_tile=(128, 256, 64, 8, 2),
                 grouped_wgrad_tile=(128, 256, 64, 8, 2))
    seen = []
    for mod, name in ((gemm, "gemm_op"), (grouped_gemm, "grouped_gemm_op"), (grouped_wgrad, "grouped_wgrad_op")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    sizes = [20, 0, 12]
    x = randn(32, 64, seed=1).to(DEVICE)
    w = randn(48, 64, seed=2).to(DEVICE)
    wg = randn(3, 32, 64, seed=3).to(DEVICE)
    dy = randn(32, 48, seed=4).to(DEVICE)

    def run(backend):
        seen.clear()
        qx = backend.quantize(x, with_image=True)
        qw = backend.quantize(w, global_scale="tensor", tile=(16, 16), with_image=True)
        qg = backend.quantize(wg, global_scale="group", tile=(16, 16), with_image=True)
        outs = [backend.gemm(qx, qw), backend.grouped_gemm(qx, qg, sizes), backend.grouped_wgrad(dy, x, sizes)]
        return outs, list(seen)

    got, got_cfg = run(TritonBackend(TritonOptions(**tiles)))
    want, want_cfg = run(BACKEND)
    assert got_cfg == [list(tiles["gemm_tile"]), list(tiles["grouped_gemm_tile"]), list(tiles["grouped_wgrad_tile"])]
    assert want_cfg == [None, None, None]
    for g, e, name in zip(got, want, ("gemm", "grouped_gemm", "grouped_wgrad")):
        assert g.dtype == e.dtype and torch.equal(g.view(torch.int16), e.view(torch.int16)), name
    img = randn(128, 64, seed=6).to(torch.bfloat16).to(DEVICE)
    one = torch.ones(1, device=DEVICE)
    registered = torch.ops.minite.gemm
    out = registered(img, img, one, one, None, torch.bfloat16, False, False, list(tiles["gemm_tile"]))
    assert torch.equal(out.view(torch.int16), registered(img, img, one, one, None, torch.bfloat16, False, False)
                       .view(torch.int16))
    assert gemm.select_config(128, 128, 64, False, False, gpu=True, default=tiles["gemm_tile"]) == tiles["gemm_tile"]
    assert gemm.select_config(128, 128, 64, False, False, gpu=True) == gemm.DEFAULT_CONFIG
    assert grouped_gemm.select_config(4096, 64, 64, 4, False, False, gpu=True,
                                      default=tiles["grouped_gemm_tile"]) == tiles["grouped_gemm_tile"]
    assert grouped_wgrad.select_config(False, gpu=True, default=tiles["grouped_wgrad_tile"]) == tiles["grouped_wgrad_tile"]


def test_quantize_tiles_are_a_backend_option(monkeypatch):
    """The quantize kernels' GPU launch tiles were module globals that benchmarks flipped (issue 11);
    now ``TritonOptions.quantize_tiles``: a configured backend hands its record to the launchers
    (through the custom op as a flat list) and writes the same bits as the default one."""
    import dataclasses

    from minite_kernels.triton.nvfp4 import quantize
    from minite_kernels.triton.nvfp4 import quantize_cols
    from minite_kernels.triton.nvfp4 import quantize_rows
    from minite_kernels.triton.backend import BACKEND, TritonBackend, TritonOptions
    from minite_kernels.triton.nvfp4.quantize_tiles import DEFAULT, QuantizeTiles

    tiles = QuantizeTiles(loop_tile=(8, 128, 4), rows=(16, 2, 2), rows_stochastic=(8, 1, 2), weight_tile=(4, 2), cols_tile=(32, 8, 4),
                          cols_grid=(4, 64), transposed_tile=(32, 64, 8), single_pass_k=512)
    assert QuantizeTiles.from_list(tiles.as_list()) == tiles and QuantizeTiles.from_list(DEFAULT.as_list()) == DEFAULT
    assert BACKEND.options.quantize_tiles is DEFAULT
    seen = []
    real_op = quantize.quantize_op
    monkeypatch.setattr(quantize, "quantize_op", lambda *a: (seen.append(a[-2]), real_op(*a))[1])
    x = randn(32, 64).to(DEVICE)
    be = TritonBackend(TritonOptions(quantize_tiles=tiles))
    assert_nvfp4_equal(be.quantize(x, with_image=True), BACKEND.quantize(x, with_image=True))
    assert seen == [tiles.as_list(), None]  # the tiles argument (the last but one: then key_tensor)
    for mod in (quantize_rows, quantize_cols, quantize):  # the GPU configs the launchers pick from the record
        monkeypatch.setattr(mod, "interpreting", lambda: False)
    assert quantize_rows.config(64, 2048, tiles=tiles) == (16, 4, 2, 0)  # 128 blocks: 16 threads, 8 chunks > 2
    assert quantize_rows.config(64, 2048, tiles=tiles, stochastic=True) == (8, 4, 1, 0)  # SR: its own tile
    assert quantize_rows.config(64, 2048, True, tiles) == (4, 16, 2, 0)
    assert quantize_cols._grid(128, 16384, tiles) == ((32, 4), 4, 32, 8, 4)  # 128 groups x 4: 8 per 64 programs, capped at 4
    assert quantize._config(4096, 2048, False, False, tiles) == (8, 128, 4, False)  # K > 512: the K loop
    assert quantize._config(4096, 2048, False, False) == (16, 256, 8, False)
    assert dataclasses.replace(DEFAULT, single_pass_k=4096).single_pass_k == 4096
