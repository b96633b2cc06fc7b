"""What the quantized-weight caches hold (issue 16): codes and scales in training, no BF16 image
and no transposed copy; the image only for forward-only use (rollout); the dgrad GEMM on the
transposed image is the same bits as on the relayout; the wgrad rounded in the kernel is the
same bits as an fp32 wgrad rounded after."""

import pytest
import torch

from minite_megatron import nvfp4
from minite_megatron.ops.linear import LinearContext, nvfp4_linear
from minite_megatron.ops.weight_cache import QuantizedWeightCache, cached_bytes
from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

RECIPE = Recipe(backend="triton", grad_stochastic_rounding=False, wgrad_rht=False)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: compiled, or interpreted


def _linear(dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g).to(DEV, dtype).requires_grad_()
    w = torch.randn(48, 64, generator=g).to(DEV, dtype).requires_grad_()
    return x, w


def test_training_cache_holds_codes_only_and_inference_keeps_the_image():
    x, w = _linear()
    cache = QuantizedWeightCache(keep_codes=True)
    ctx = LinearContext(RECIPE, cache)
    nvfp4_linear(x, w, None, ctx).float().sum().backward()
    assert cache._q is not None and cache._q.image is None and cache._qt is None
    with torch.no_grad():
        cache.clear()
        nvfp4_linear(x, w, None, ctx)
    assert cache._q.image is not None  # rollout / decode reuse the image
    assert cached_bytes()["images"] >= cache._q.image.nbytes


def test_release_after_backward_leaves_no_quantized_weight():
    """By default (no ``keep_codes``) the entry is gone after the layer's backward, and the
    next micro-batch re-quantizes to the same bits."""
    x, w = _linear()
    cache = QuantizedWeightCache()
    ctx = LinearContext(RECIPE, cache)
    y1 = nvfp4_linear(x, w, None, ctx)
    codes = cache._q.codes.clone()
    y1.float().sum().backward()
    assert cache._q is None and cache._key is None
    g1 = w.grad.clone()
    w.grad = None
    y2 = nvfp4_linear(x, w, None, ctx)
    assert_bitwise_equal(cache._q.codes, codes)
    y2.float().sum().backward()
    assert_bitwise_equal(y2, y1)
    assert_bitwise_equal(w.grad, g1)


def test_keep_images_keeps_the_image_in_training_with_the_same_bits():
    """``keep_images`` (the design before issue 16) keeps the BF16 image in the training entry;
    outputs and gradients are the same bits as the default's."""
    runs = []
    for cache in (QuantizedWeightCache(), QuantizedWeightCache(keep_images=True, keep_codes=True)):
        x, w = _linear()
        y = nvfp4_linear(x, w, None, LinearContext(RECIPE, cache))
        assert (cache._q.image is not None) == cache.keep_images_in_training
        y.float().sum().backward()
        runs.append((y, x.grad, w.grad))
    assert cache._q is not None and cache._q.image is not None  # keep_codes: kept after the backward
    for a, b in zip(*runs):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("grouped", [False, True])
def test_forward_gemm_takes_the_image_of_a_fresh_quantization_and_the_cache_drops_it(grouped):
    """A weight quantized by the forward comes with its BF16 image from the quantize pass itself
    (no separate image pass); the cache keeps codes only; the forward on a cache hit (codes: the GEMM
    builds the image) gives the same bits."""
    from minite_megatron.ops.grouped_linear import nvfp4_grouped_linear

    sizes = [5, 0, 11, 16]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(sizes) if grouped else 32, 64, generator=g).to(DEV, torch.bfloat16)
    ws = [torch.randn(48, 64, generator=g).to(DEV, torch.bfloat16).requires_grad_() for _ in (sizes if grouped else [0])]
    cache = QuantizedWeightCache(keep_codes=True)
    ctx = LinearContext(RECIPE, cache if not grouped else QuantizedWeightCache())
    quantized = []
    real = cache.get

    def spy(weights, quantize, extra=None, **kw):
        def q(w, image):
            out = quantize(w, image)
            quantized.append(out.image is not None)
            return out
        return real(weights, q, extra, **kw)

    cache.get = spy
    run = (lambda: nvfp4_grouped_linear(x, sizes, ws, None, ctx, cache)) if grouped else (lambda: nvfp4_linear(x, ws[0], None, ctx))
    fresh = run()
    assert quantized == [True]  # the quantize pass wrote the image for the forward GEMM
    assert cache._q is not None and cache._q.image is None  # the entry: codes and scales only
    hit = run()
    assert quantized == [True]  # a cache hit: no new quantization
    assert_bitwise_equal(hit, fresh)


def test_layers_build_their_caches_from_the_recipe_options():
    """The recipe fields ``keep_weight_images`` / ``keep_weight_codes`` (``--minite-keep-weight-*``)
    reach every weight cache a layer builds (dense linears and grouped experts), not a module global."""
    from tests.megatron.minite_tiny import build_gpt, init_single_process, tiny_config

    from minite_megatron.specs import get_gpt_decoder_block_minite_spec

    init_single_process()
    cfg = tiny_config(num_layers=1)
    for recipe in (Recipe(), Recipe(keep_weight_images=True, keep_weight_codes=True)):
        model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe)
        caches = [c for m in model.modules() for c in (getattr(getattr(m, "minite_ctx", None), "cache", None),
                                                      getattr(m, "_weights_cache", None)) if c is not None]
        assert len(caches) >= 3  # qkv, proj, the experts
        assert {(c.keep_images_in_training, c.keep_codes) for c in caches} == {(recipe.keep_weight_images,
                                                                                recipe.keep_weight_codes)}


def test_dgrad_on_the_transposed_image_equals_the_relayout():
    """gemm_nt(dy, W) == gemm(dy, W.transpose()) and the grouped twin, bitwise (Triton kernels;
    M above the decode-kernel rows)."""
    from minite_megatron.nvfp4.backends import get_backend

    be = get_backend("triton", DEV)
    dev = DEV
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 64, generator=g).to(dev)
    dy = torch.randn(40, 48, generator=g).to(dev).bfloat16()
    qw = be.quantize(w, global_scale="tensor", tile=(16, 16))
    qdy = be.quantize(dy, global_scale="tensor", with_image=True)
    assert qw.image is None
    assert_bitwise_equal(be.gemm_nt(qdy, qw), be.gemm(qdy, qw.transpose()), "dense dgrad")
    ws = torch.randn(3, 32, 64, generator=g).to(dev)
    qws = be.quantize(ws, global_scale="group", tile=(16, 16))
    sizes = [20, 0, 21]
    dys = torch.randn(41, 32, generator=g).to(dev).bfloat16()
    qdys = be.quantize(dys, global_scale="row", with_image=True)
    assert_bitwise_equal(be.grouped_gemm_nt(qdys, qws, sizes), be.grouped_gemm(qdys, qws.transpose(), sizes),
                         "grouped dgrad")
    with pytest.raises(ValueError):
        be.gemm_nt(qdy, be.quantize(w, global_scale="tensor"))  # 1x16 blocks: no exact transpose


def test_wgrad_rounded_in_the_kernel_equals_fp32_rounded_after():
    x, w = _linear(seed=5)
    dy = torch.randn(32, 48, generator=torch.Generator().manual_seed(6)).to(DEV).bfloat16()
    nvfp4_linear(x, w, None, LinearContext(RECIPE, QuantizedWeightCache())).backward(dy)
    be = nvfp4.get_backend("triton", x.device)
    want = be.gemm(be.quantize(dy.t(), global_scale="tensor"), be.quantize(x.detach().t(), global_scale="tensor"),
                   out_dtype=torch.float32).to(torch.bfloat16)
    assert w.grad.dtype == torch.bfloat16
    assert_bitwise_equal(w.grad, want, "bf16 wgrad")
