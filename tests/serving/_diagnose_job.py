"""Export the sharp test learner of ``_engine_job`` for ``minite-diagnose vllm`` (issue 28). One fresh process:
``python -m tests.serving._diagnose_job OUT_DIR MODE`` (MODE: ``strict`` or ``default``)."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")


def run(out_dir: str, mode: str) -> None:
    from minite_megatron.export import export_modelopt
    from minite_megatron.export.gather import learner_weights
    from minite_megatron.recipe import Recipe
    from minite_megatron.training.presets import init_single_process
    from tests.serving._engine_job import build

    init_single_process(seed=None)
    recipe = Recipe(strict=mode == "strict")
    cfg, model = build(recipe)
    export_modelopt(out_dir, learner_weights(model), cfg, recipe, rope_theta=1e6, max_position_embeddings=64)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
