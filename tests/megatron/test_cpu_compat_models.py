"""Real megatron-core models on CPU through the CPU compatibility layer (one process, gloo world 1):
tiny GPT and MoE forward/backward, the model-parallel RNG tracker driving attention dropout, and
the static inference engine (``legacy=True``) generating with a KV cache."""

from __future__ import annotations

import pytest
import torch

from tests.parallel.model import TINY_MOE as _TINY_MOE
from tests.parallel.model import local_spec
from tests.parallel.spawn import init_single_process

TINY_MOE = dict(_TINY_MOE, num_layers=2, moe_layer_freq=[0, 1])  # a dense layer, then an MoE layer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only tests of the CPU layer")
VOCAB, SEQ = 128, 32


def _model(moe: bool, seed: int = 7, parallel_output: bool = True, **overrides):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    init_single_process()
    kw = dict(TINY_MOE, activation_func=torch.nn.functional.silu, params_dtype=torch.float32)
    if not moe:
        for k in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq"):
            kw.pop(k)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return GPTModel(config=config, transformer_layer_spec=local_spec(config), vocab_size=VOCAB,
                    max_sequence_length=SEQ, position_embedding_type="rope", parallel_output=parallel_output)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    return tokens[:, :-1], tokens[:, 1:], pos, mask


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tiny_gpt_forward_backward(moe):
    model = _model(moe)
    tokens, labels, pos, mask = _batch()
    loss = model(tokens, pos, mask, labels=labels)
    assert loss.shape == (2, SEQ) and torch.isfinite(loss).all()
    assert abs(loss.mean().item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.5  # near-uniform at init
    loss.mean().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert no_grad == [], f"parameters without gradient: {no_grad}"
    if moe:
        experts = [n for n, _ in model.named_parameters() if ".experts." in n]
        assert len(experts) == 2 * TINY_MOE["num_moe_experts"]


def test_attention_dropout_follows_the_model_parallel_rng_tracker():
    """Pins: attention dropout runs inside the tracker's fork; on CPU the same tracker seed must
    give the same mask (bitwise-equal loss), another seed another mask, and no dropout (eval) must
    ignore the tracker altogether."""
    from megatron.core import tensor_parallel

    tokens, labels, pos, mask = _batch()
    model = _model(False, attention_dropout=0.5)

    def loss_with_tracker_seed(seed):
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return model(tokens, pos, mask, labels=labels).detach()

    a, b, c = loss_with_tracker_seed(11), loss_with_tracker_seed(11), loss_with_tracker_seed(12)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    model.eval()
    assert torch.equal(loss_with_tracker_seed(11), loss_with_tracker_seed(12))


def test_static_inference_engine_generates_with_a_kv_cache_on_cpu():
    """Greedy generation through StaticInferenceEngine(legacy=True) (KV cache, one token per step)
    must pick the argmax of a full teacher-forced forward over the generated sequence, and its
    log-probs must match that forward's log-softmax."""
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.inference.engines import StaticInferenceEngine
    from megatron.core.inference.inference_request import InferenceRequest
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper
    from megatron.core.inference.sampling_params import SamplingParams
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    class Tokenizer:  # prompts are token ids
        eod, bos, vocab_size = VOCAB - 1, None, VOCAB

        def tokenize(self, text):
            return [int(t) for t in text.split()]

        def detokenize(self, ids, **_):
            return " ".join(str(int(i)) for i in ids)

    model = _model(True, parallel_output=False).eval()  # inference gathers the TP logits
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(2, SEQ))
    engine = StaticInferenceEngine(TextGenerationController(wrapper, Tokenizer()), max_batch_size=2, legacy=True)
    prompt = [5, 17, 3, 99, 42, 8]
    params = SamplingParams(top_k=1, return_log_probs=True, num_tokens_to_generate=6)
    params.add_attributes({"no_early_termination": True})
    request = InferenceRequest(request_id=engine.get_new_request_id(), prompt="", prompt_tokens=prompt,
                               sampling_params=params)
    from megatron.core.inference.utils import InferenceMode

    try:
        (done,) = engine.generate(inference_requests=[request])
    finally:
        InferenceMode.unset_active()  # the engine leaves Megatron's global inference flag set
    generated = [int(t) for t in torch.as_tensor(done.generated_tokens).tolist()]
    assert len(generated) == 6
    seq = torch.tensor([prompt + generated])
    n = seq.shape[1]
    with torch.no_grad():
        logits = model(seq, torch.arange(n)[None], torch.triu(torch.ones(n, n, dtype=torch.bool), 1)[None, None])
    logp = torch.log_softmax(logits[0].float(), dim=-1)
    steps = range(len(prompt) - 1, n - 1)
    assert [int(logp[t].argmax()) for t in steps] == generated
    expected = torch.stack([logp[t, seq[0, t + 1]] for t in steps])
    got = torch.as_tensor(done.generated_log_probs, dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
