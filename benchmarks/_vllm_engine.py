"""Tokens/s of ``vllm.LLM`` with the minite-vllm plugin vs the project's own rollout engine, on one model.

    VLLM_LOGGING_LEVEL=ERROR .venv-vllm/bin/python -m benchmarks._vllm_engine --json benchmarks/results/vllm_engine.jsonl

(vLLM runs only in ``.venv-vllm``: its CPU build here; the GPU image has no vLLM.) For the default
and the strict recipe: a learner (hidden 128, 4 heads of 64, a dense then an 8-expert top-4 MoE
layer, vocab 256, BF16) is exported and served by ``vllm.LLM`` (eager, ``logprobs_mode="raw_logits"``)
and by :class:`~minite_megatron.rollout.RolloutEngine` on the learner itself; both generate
``--new`` tokens for ``--batch`` prompts of 8..24 tokens (sampled, no early stop). Reported: the
median wall clock of ``--repeats`` generates after a warm-up, generated tokens per second, and the
mean / max |log-prob gap| of vLLM's generated tokens vs the learner's teacher-forced log-probs.
Prints a table and appends one JSON line (device, versions, command).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

SHAPE = dict(layers=2, hidden=128, heads=4, groups=2, head_dim=64, experts=8, topk=4, moe_ffn=64, vocab=256)


def build(recipe, max_seq: int):
    from minite_megatron.training.presets import build_gpt

    return build_gpt(SHAPE, recipe, max_seq=max_seq, device="cpu", dtype=torch.bfloat16, seed=0, ffn_hidden_size=256,
                     moe_layer_freq=[0, 1], init_method_std=0.3).eval()


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def run_mode(mode: str, args) -> list[dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from minite_megatron.export import export_modelopt
    from minite_megatron.export.gather import learner_weights
    from minite_megatron.recipe import Recipe
    from minite_megatron.rollout.engine import RolloutEngine
    from minite_megatron.rollout.logprobs import teacher_forced_logprobs

    recipe = Recipe(strict=mode == "strict")
    max_seq = 24 + args.new
    model = build(recipe, max_seq)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, SHAPE["vocab"], (int(n),), generator=g).tolist()
               for n in torch.randint(8, 25, (args.batch,), generator=g)]
    d = tempfile.mkdtemp(prefix=f"minite-bench-vllm-{mode}-")
    export_modelopt(d, learner_weights(model), model.config, recipe, rope_theta=1e6, max_position_embeddings=max_seq)
    llm = LLM(model=d, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=max_seq,
              max_num_seqs=args.batch, seed=0, logprobs_mode="raw_logits", kv_cache_memory_bytes=64 << 20,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=args.new, temperature=1.0, logprobs=0, detokenize=False, ignore_eos=True)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = []
    wall_vllm = timed(lambda: outs.append(llm.generate(batch, sp, use_tqdm=False)), args.repeats)
    gaps = []
    for p, o in zip(prompts, outs[-1]):
        gen = list(o.outputs[0].token_ids)
        v = torch.tensor([lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, gen)])
        with torch.enable_grad():
            ref = teacher_forced_logprobs(model, [p + gen])[0].detach()[len(p) - 1:]
        gaps.append((v - ref).abs())
    gap = torch.cat(gaps)
    del llm
    engine = RolloutEngine(model, eod_id=0, max_batch_size=args.batch, max_sequence_length=max_seq)
    wall_own = timed(lambda: engine.generate(prompts, args.new, temperature=1.0, seed=1, stop_at_eod=False),
                     args.repeats)
    tokens = args.batch * args.new
    return [
        {"engine": "vllm.LLM + minite-vllm", "mode": mode, "wall_s": wall_vllm, "tokens_per_s": tokens / wall_vllm,
         "gap_mean": float(gap.mean()), "gap_max": float(gap.max())},
        {"engine": "RolloutEngine", "mode": mode, "wall_s": wall_own, "tokens_per_s": tokens / wall_own},
    ]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="default,strict")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from minite_megatron.training.presets import init_single_process

    init_single_process(seed=None)
    rows = [r for mode in args.modes.split(",") for r in run_mode(mode, args)]
    print(f"{'engine':<24} {'mode':<8} {'tokens/s':>9} {'wall s':>7} {'gap mean / max':>16}")
    for r in rows:
        gap = f"{r['gap_mean']:.1e} / {r['gap_max']:.1e}" if "gap_mean" in r else "-"
        print(f"{r['engine']:<24} {r['mode']:<8} {r['tokens_per_s']:>9.1f} {r['wall_s']:>7.2f} {gap:>16}")
    if args.json:
        import vllm

        line = {"bench": "vllm_engine", "device": f"cpu ({platform.processor() or platform.machine()}, "
                f"{torch.get_num_threads()} threads)", "torch": torch.__version__, "vllm": vllm.__version__,
                "batch": args.batch, "new_tokens": args.new, "rows": rows,
                "command": "python -m benchmarks._vllm_engine " + " ".join(argv if argv is not None else sys.argv[1:]),
                "date": time.strftime("%Y-%m-%d")}
        with open(args.json, "a") as f:
            f.write(json.dumps(line) + "\n")
    return rows


if __name__ == "__main__":
    main()
