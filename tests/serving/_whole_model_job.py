"""A whole tiny ``Qwen3MoeForCausalLM`` through vLLM (its engine, model class, loader, CPU
attention, sampler) with the minite-vllm plugin, against the learner. One fresh process
(``python -m tests.serving._whole_model_job OUT.pt``) for ``test_vllm_model``.

Per recipe (default, strict): a learner GPT (minite spec, BF16, a dense layer then an MoE layer,
head_dim 64: vLLM's CPU attention has no kernel for 16) is exported; ``vllm.LLM`` loads the
export; one prefill scores a prompt (``prompt_logprobs``). Hooks record, in vLLM's forward, each
stage's input and output; the learner records the same stages teacher-forced. Then each module
the plugin serves is re-run *as the learner's module on vLLM's own input* (so vLLM's attention
does not enter the comparison), the learner's weights are changed, refitted into the running
engine in place, and the prompt is scored again. Everything is saved for the test to judge.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: hooks and refit reach the model
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

HIDDEN, HEADS, GROUPS, HEAD_DIM, FFN, EXPERTS, TOPK, MOE_FFN, VOCAB = 128, 4, 2, 64, 256, 8, 4, 64, 256
PROMPT_LEN = 20


def learner(recipe, seed: int):
    from minite_megatron.training.presets import build_gpt

    shape = dict(layers=2, hidden=HIDDEN, heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM, experts=EXPERTS, topk=TOPK,
                 moe_ffn=MOE_FFN, vocab=VOCAB)
    model = build_gpt(shape, recipe, max_seq=64, device="cpu", dtype=torch.bfloat16, seed=seed, ffn_hidden_size=FFN,
                      moe_layer_freq=[0, 1], init_method_std=0.05)
    return model.config, model.eval()


def _first(o):
    return o[0] if isinstance(o, (tuple, list)) else o


def _record(store: dict, key: str, inputs: bool = True):
    """A forward hook keeping a module's first input and first output (detached, on the CPU)."""
    def hook(mod, args, out):
        if inputs:
            store[key + ".in"] = args[0].detach().clone()
        store[key + ".out"] = _first(out).detach().clone()
    return hook


def vllm_stages(model, store: dict) -> list[str]:
    """Hooks on vLLM's model (runs inside the engine); returns each layer's MLP / attention methods."""
    mm = model.model
    mm.embed_tokens.register_forward_hook(_record(store, "emb", inputs=False))
    names = []
    for i, layer in enumerate(mm.layers):
        att = layer.self_attn
        layer.input_layernorm.register_forward_hook(_record(store, f"{i}.in_norm", inputs=False))
        att.qkv_proj.register_forward_hook(_record(store, f"{i}.qkv"))
        att.q_norm.register_forward_hook(_record(store, f"{i}.q_norm", inputs=False))
        att.attn.register_forward_pre_hook(lambda mod, args, i=i: store.update({f"{i}.q_rot": args[0].detach().clone()}))
        att.attn.register_forward_hook(_record(store, f"{i}.attn", inputs=False))
        att.o_proj.register_forward_hook(_record(store, f"{i}.o_proj"))
        layer.mlp.register_forward_hook(_record(store, f"{i}.mlp"))
        mlp = layer.mlp
        method = mlp.experts.routed_experts.quant_method if hasattr(mlp, "experts") else mlp.gate_up_proj.quant_method
        names.append(type(att.qkv_proj.quant_method).__name__)
        names.append(type(method).__name__)
    names.append(type(model.lm_head.quant_method).__name__)
    return names


def learner_stages(model, tokens: list[int]) -> dict:
    """The learner's stages on the prompt (teacher-forced, grad enabled: the training forward)."""
    from minite_megatron.export.rows import qkv_row_ranges
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    store: dict = {}
    hooks = [model.embedding.register_forward_hook(lambda m, a, o: store.update(emb=o[:, 0].detach().clone()))]
    r = qkv_row_ranges(HEADS, GROUPS, HEAD_DIM)
    for i, layer in enumerate(model.decoder.layers):
        att = layer.self_attention
        hooks += [
            layer.input_layernorm.register_forward_hook(
                lambda m, a, o, i=i: store.update({f"{i}.in_norm": o[:, 0].detach().clone()})),
            att.linear_qkv.register_forward_hook(lambda m, a, o, i=i: store.update(
                {f"{i}.qkv": torch.cat([o[0][:, 0][:, x:y] for p in "qkv" for x, y in r[p]], 1).detach().clone()})),
            att.q_layernorm.register_forward_hook(
                lambda m, a, o, i=i: store.update({f"{i}.q_norm": o[:, 0].reshape(o.shape[0], -1).detach().clone()})),
            att.core_attention.register_forward_pre_hook(lambda m, a, i=i: store.update(
                {f"{i}.q_rot": a[0][:, 0].reshape(a[0].shape[0], -1).detach().clone()})),
            att.core_attention.register_forward_hook(
                lambda m, a, o, i=i: store.update({f"{i}.attn": o[:, 0].detach().clone()})),
        ]
    with torch.enable_grad():
        store["logprobs"] = teacher_forced_logprobs(model, [tokens])[0].detach()
    for h in hooks:
        h.remove()
    return store


def replay(model, seen: dict) -> dict:
    """The learner's modules on vLLM's recorded inputs: what each plugin-served module must give."""
    from minite_megatron.export.rows import qkv_row_ranges

    out = {}
    r = qkv_row_ranges(HEADS, GROUPS, HEAD_DIM)
    seen = {k: v.clone() for k, v in seen.items()}  # vLLM's inference tensors -> ordinary ones
    with torch.enable_grad():
        for i, layer in enumerate(model.decoder.layers):
            att = layer.self_attention
            q = att.linear_qkv(seen[f"{i}.qkv.in"][:, None])[0][:, 0]
            out[f"{i}.qkv"] = torch.cat([q[:, a:b] for p in "qkv" for a, b in r[p]], 1).detach()
            out[f"{i}.o_proj"] = att.linear_proj(seen[f"{i}.o_proj.in"][:, None])[0][:, 0].detach()
            out[f"{i}.mlp"] = layer.mlp(seen[f"{i}.mlp.in"][:, None])[0][:, 0].detach()
    return out


def run(out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minite_megatron.export import export_modelopt
    from minite_megatron.export.gather import learner_weights
    from minite_megatron.export.modelopt import export_tensors
    from minite_megatron.recipe import Recipe
    from minite_megatron.serving.refit import refit_vllm_model
    from minite_megatron.training.presets import init_single_process
    import tempfile

    init_single_process(seed=None)
    tokens = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=torch.Generator().manual_seed(3)).tolist()
    sp = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    results = {"tokens": tokens}
    for mode in ("default", "strict"):
        recipe = Recipe(strict=mode == "strict")
        cfg, model = learner(recipe, seed=0)
        d = tempfile.mkdtemp(prefix=f"minite-whole-{mode}-")
        export_modelopt(d, learner_weights(model), cfg, recipe, rope_theta=1e6, max_position_embeddings=64)
        llm = LLM(model=d, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
                  max_num_seqs=2, max_num_batched_tokens=64, kv_cache_memory_bytes=32 << 20, seed=0,
                  logprobs_mode="raw_logits")
        seen: dict = {}
        methods = llm.apply_model(lambda m: vllm_stages(m, seen))[0]

        def score():
            seen.clear()
            o = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
            return torch.tensor([pl[t].logprob for pl, t in zip(o.prompt_logprobs[1:], tokens[1:])]), dict(seen)

        vllm_lp, vllm_seen = score()
        res = {"methods": methods, "vllm_logprobs": vllm_lp, "vllm": vllm_seen, "learner": learner_stages(model, tokens),
               "replay": replay(model, vllm_seen)}
        # refit: another learner (other weights), its bytes into the running engine, in place
        cfg2, model2 = learner(recipe, seed=1)
        tensors = export_tensors(learner_weights(model2), cfg2, recipe)
        stats = llm.apply_model(lambda m: refit_vllm_model(m, tensors))[0]
        refit_lp, refit_seen = score()
        res.update(refit_stats=stats, refit_logprobs=refit_lp, refit_vllm=refit_seen,
                   refit_learner=learner_stages(model2, tokens), refit_replay=replay(model2, refit_seen))
        results[mode] = res
        del llm
    torch.save(results, out_path)


if __name__ == "__main__":
    run(sys.argv[1])
