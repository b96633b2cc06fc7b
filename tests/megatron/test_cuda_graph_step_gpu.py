"""A learner forward + backward captured as a CUDA graph computes the eager step's loss and every
gradient bit for bit, replay after replay on fresh data and after the weights change (GPU).

Failures pinned: a graph that froze the quantized weights (the weight caches must re-quantize in
every replay: the weights are changed in place between replays here), stale static inputs, a
gradient accumulated instead of written, an eager step on the default stream before the capture
(Megatron's dispatchers kept its routing probabilities, and with them gradient accumulators bound to
the legacy stream: ``cudaErrorStreamCaptureImplicit``; ``release_step_tensors``), stochastic
rounding that replays the captured seeds (the default recipe: each replay must round with the
seeds the eager step draws from the same generator state), strict mode (device token counts into
its batch-invariant experts; its router's NaN check, a host wait eagerly, a device flag the step
reads: a replay that routes NaN raises).
"""

import pytest
import torch

from minite_megatron.recipe import Recipe
from minite_megatron.testing import assert_bitwise_equal

pytestmark = pytest.mark.gpu

PRESET = dict(layers=2, hidden=256, heads=4, groups=2, head_dim=64, experts=8, topk=2, moe_ffn=128, vocab=512)
SEQ, BATCH = 128, 2

RECIPES = {
    "bf16_twin": Recipe(precision="bf16"),
    "nvfp4_rne": Recipe(grad_stochastic_rounding=False),
    "nvfp4_sr": Recipe(),  # the default: stochastic rounding of the gradients
    "strict": Recipe(strict=True),
}


def _build(recipe):
    from minite_megatron.training.presets import build_gpt, init_single_process

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = init_single_process(seed=0)
    model = build_gpt(PRESET, recipe, max_seq=SEQ, device=device, dtype=torch.bfloat16)
    model.train()
    pos = torch.arange(SEQ, device=device).unsqueeze(0).expand(BATCH, -1)

    def loss_fn(tokens, labels):
        return model(tokens, pos, None, labels=labels).float().mean()

    return model, loss_fn, device


def _data(seed, device):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, PRESET["vocab"], (BATCH, SEQ), generator=g).to(device) for _ in range(2))


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_graphed_step_is_the_eager_steps_bits(name):
    from minite_megatron.ops.weight_cache import invalidate_weight_caches
    from minite_megatron.training.cuda_graphs import GraphedStep, why_not_graphable

    model, loss_fn, device = _build(RECIPES[name])
    assert why_not_graphable(model, RECIPES[name], device) is None
    params = dict(model.named_parameters())

    def eager(tokens, labels):
        for p in params.values():
            p.grad = None
        invalidate_weight_caches()
        loss = loss_fn(tokens, labels)
        loss.backward()
        out = loss.detach().clone(), {n: p.grad.detach().clone() for n, p in params.items()}
        for p in params.values():
            p.grad = None
        return out

    eager(*_data(0, device))  # warm-up
    graphed = GraphedStep(model, loss_fn, *_data(0, device), recipe=RECIPES[name])
    for i in range(3):
        data = _data(100 + i, device)
        rng = torch.get_rng_state()  # the seeds' generator: the eager step below draws the same seeds
        loss = graphed.step(*data).clone()
        got = {n: p.grad.detach().clone() for n, p in params.items()}
        saved = [p.grad for p in params.values()]
        for p in params.values():
            p.grad = None
        after_replay = torch.get_rng_state()
        torch.set_rng_state(rng)
        want_loss, want = eager(*data)
        assert torch.equal(torch.get_rng_state(), after_replay), "a replay draws as many seeds as the eager step"
        for p, g in zip(params.values(), saved):
            p.grad = g  # the graph's static gradients back in place
        assert_bitwise_equal(loss, want_loss, f"loss, replay {i}")
        for n in want:
            assert_bitwise_equal(got[n], want[n], f"{n}, replay {i}")
        with torch.no_grad():  # an optimizer-like in-place update: the next replay must see it
            for p in params.values():
                p.mul_(0.99)


def test_a_strict_replay_that_routes_nan_raises():
    """Strict mode refuses to route NaN scores: eagerly its router raises; in a graph the check is
    a device flag read after the replay, so the replay after a router weight turned NaN raises."""
    from minite_megatron.training.cuda_graphs import GraphedStep

    recipe = Recipe(strict=True)
    model, loss_fn, device = _build(recipe)
    graphed = GraphedStep(model, loss_fn, *_data(0, device), recipe=recipe)
    assert torch.isfinite(graphed.step(*_data(1, device)))
    router = next(m for n, m in model.named_modules() if n.endswith("router"))
    with torch.no_grad():
        router.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN in the routing scores of replay 2"):
        graphed.step(*_data(2, device))
