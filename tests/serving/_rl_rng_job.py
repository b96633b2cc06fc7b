"""The RL trainer's vLLM rollout engine and the caller's global RNGs (issue 28). One fresh process:
``python -m tests.serving._rl_rng_job OUT.pt``.

Builds the tiny strict learner (BF16), seeds torch / numpy / python, then constructs
``rl_vllm.VllmRolloutEngine`` (export + ``vllm.LLM(seed=0)``) and samples with it; records whether
each global RNG state is unchanged after each. Then once more with ``rl_vllm``'s guard replaced by a
no-op, to record that vLLM itself reseeds them (what the guard is for)."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import sys
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "rl"))

import numpy as np  # noqa: E402
import torch  # noqa: E402


def states() -> tuple:
    return torch.get_rng_state().clone(), pickle.dumps(np.random.get_state()), pickle.dumps(random.getstate())


def same(a: tuple, b: tuple) -> dict[str, bool]:
    return {"torch": torch.equal(a[0], b[0]), "numpy": a[1] == b[1], "python": a[2] == b[2]}


def run(out_path: str) -> None:
    import rl_vllm

    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import build_gpt, init_single_process

    init_single_process(seed=None)
    recipe = Recipe(strict=True)
    model = build_gpt("tiny", recipe, max_seq=16, device="cpu", dtype=torch.bfloat16, seed=0).eval()

    def engine():
        return rl_vllm.VllmRolloutEngine(model, recipe, eod_id=0, max_batch_size=4, max_sequence_length=16)

    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    s0 = states()
    eng = engine()
    s1 = states()
    rollouts = eng.generate([[1, 2, 3], [4, 5, 6, 7]], 5, temperature=1.0, seed=7, stop_at_eod=False, logprobs="sampled")
    s2 = states()
    result = {"construct": same(s0, s1), "generate": same(s1, s2),
              "generated": [len(r.generated_tokens) for r in rollouts]}
    del eng
    rl_vllm._caller_rng_preserved = contextlib.nullcontext  # what vLLM does to an unguarded caller
    engine()
    result["unguarded_construct"] = same(s2, states())
    torch.save(result, out_path)


if __name__ == "__main__":
    run(sys.argv[1])
