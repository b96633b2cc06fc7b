"""vLLM's engine with minite-vllm against the learner, token by token (issue 28). One fresh process:
``python -m tests.serving._engine_job OUT.pt MODE [compile]``.

A learner with sharp weights (init std 0.3: peaked next-token distributions, as a trained model's)
is exported and served by ``vllm.LLM`` (``logprobs_mode="raw_logits"``, small ``max_num_batched_tokens``
so long prompts are prefilled in chunks; 16-token KV blocks, so a request's keys span several
blocks of the paged cache). Through ``LLMEngine.add_request`` / ``step``: three
prompts of different lengths submitted together, a fourth added while they decode; half greedy,
half sampled (temperature 1; no per-request seed: vLLM 0.26 on CPU fails on a seeded request whose prefill is chunked, "CPU Generator does not use offset"). Every generated token's vLLM log-prob is saved with the
learner's teacher-forced log-prob of the same sequence (the RL learner's computation).
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tests.serving._whole_model_job import EXPERTS, FFN, GROUPS, HEAD_DIM, HEADS, HIDDEN, MOE_FFN, TOPK, VOCAB  # noqa: E402

PROMPTS = (5, 23, 11)
LATE = 17
NEW = 6


def build(recipe, seed: int = 0, std: float = 0.3):
    from minite_megatron.training.presets import build_gpt

    shape = dict(layers=2, hidden=HIDDEN, heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM, experts=EXPERTS, topk=TOPK,
                 moe_ffn=MOE_FFN, vocab=VOCAB)
    model = build_gpt(shape, recipe, max_seq=64, device="cpu", dtype=torch.bfloat16, seed=seed, ffn_hidden_size=FFN,
                      moe_layer_freq=[0, 1], init_method_std=std)
    return model.config, model.eval()


def make_llm(path: str, strict: bool, enforce_eager: bool = True):
    from vllm import LLM

    return LLM(model=path, dtype="bfloat16", enforce_eager=enforce_eager, skip_tokenizer_init=True, max_model_len=64,
               max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True, kv_cache_memory_bytes=32 << 20,
               seed=0, logprobs_mode="raw_logits", enable_prefix_caching=False, block_size=16)


def run(out_path: str, mode: str, compile_: bool = False) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from minite_megatron.export import export_modelopt
    from minite_megatron.export.gather import learner_weights
    from minite_megatron.recipe import Recipe
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs
    from minite_megatron.training.presets import init_single_process

    init_single_process(seed=None)
    recipe = Recipe(strict=mode == "strict")
    cfg, model = build(recipe)
    d = tempfile.mkdtemp(prefix=f"minite-engine-{mode}-")
    export_modelopt(d, learner_weights(model), cfg, recipe, rope_theta=1e6, max_position_embeddings=64)
    try:
        llm = make_llm(d, mode == "strict", enforce_eager=not compile_)
    except ValueError as e:
        torch.save({"refused": str(e)}, out_path)
        return
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPTS + (LATE,)]

    def params(i):
        if i % 2 == 0:
            return SamplingParams(max_tokens=NEW, temperature=0.0, logprobs=0, detokenize=False, ignore_eos=True)
        return SamplingParams(max_tokens=NEW, temperature=1.0, logprobs=0, detokenize=False,
                              ignore_eos=True)

    for i in range(len(PROMPTS)):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompts[i]), params(i))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
        steps += 1
        if steps == 4:  # the others are decoding (or still in chunked prefill): one joins
            engine.add_request("late", TokensPrompt(prompt_token_ids=prompts[-1]), params(3))
    results = {"steps": steps}
    for key, prompt in zip(["0", "1", "2", "late"], prompts):
        out = done[key]
        gen = list(out.token_ids)
        vllm_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, gen)], dtype=torch.float32)
        with torch.enable_grad():
            learner_lp = teacher_forced_logprobs(model, [prompt + gen])[0].detach()[len(prompt) - 1:]
        results[key] = {"prompt": prompt, "generated": gen, "vllm": vllm_lp, "learner": learner_lp}
    torch.save(results, out_path)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], len(sys.argv) > 3 and sys.argv[3] == "compile")
