"""What a CUDA-graphed learner step needs from the eager steps before it, checked on a CPU: the
modules keep no tensor with autograd history after a step once ``release_step_tensors`` ran, so
the gradient accumulators of that step die with it and the next forward makes new ones on its own
stream. (Before: Megatron's token dispatchers kept the routing probabilities of the last forward,
the accumulators of every parameter below them lived on with the stream of the first eager step,
and capturing the backward failed with ``cudaErrorStreamCaptureImplicit``; the GPU side is
``test_cuda_graph_step_gpu.py``.)"""

import gc

import torch

from minite_megatron.recipe import Recipe


def _accumulator(p):
    """The live gradient accumulator of leaf ``p`` (made afresh if none is alive)."""
    return p.view_as(p).grad_fn.next_functions[0][0]


def test_a_step_leaves_no_autograd_history_in_the_modules_once_released():
    from tests.megatron.minite_tiny import build_gpt, init_single_process, tiny_config

    from minite_megatron.specs import get_gpt_decoder_block_minite_spec
    from minite_megatron.training.cuda_graphs import release_step_tensors

    init_single_process()
    cfg = tiny_config(num_layers=2)
    recipe = Recipe(precision="bf16")
    model = build_gpt(cfg, get_gpt_decoder_block_minite_spec(cfg, recipe), finalize_recipe=recipe)
    model.train()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg_vocab(model), (2, 16), generator=g)
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    model(tokens, pos, None, labels=tokens).float().mean().backward()
    embedding = model.embedding.word_embeddings.weight
    _accumulator(embedding).metadata["step"] = 1  # a mark on the C++ node, seen while it lives
    gc.collect()
    assert _accumulator(embedding).metadata.get("step") == 1, "nothing kept the step's graph: the case this test pins is gone"
    released = release_step_tensors(model)
    assert any("token_dispatcher" in name for name in released), released
    gc.collect()
    assert "step" not in _accumulator(embedding).metadata, "a module still holds the step's autograd graph"
    assert release_step_tensors(model) == []
    held = [f"{n}.{a}" for n, m in model.named_modules() for a, v in vars(m).items()
            if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    assert held == []


def cfg_vocab(model) -> int:
    return model.embedding.word_embeddings.weight.shape[0]
