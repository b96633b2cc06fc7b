"""``minite-export``: a Megatron checkpoint -> the NVFP4 export for vLLM / SGLang (ModelOpt layout).

.. code-block:: bash

    minite-export --load runs/tiny_moe/checkpoints --out export/tiny_moe                 # the learner's policy
    minite-export --load runs/tiny_moe/checkpoints --out export/tiny_w4a16 --variant modelopt-w4a16
    minite-export --load ckpt/qwen3-30b-a3b --out export/qwen3 --hf-config-out hf-config/qwen3

``--load``: any checkpoint the converter reads (a ``--save`` directory with its tracker file, or
one ``iter_*`` / ``release`` directory; any TP / EP / PP layout, re-sharded at load): one that
``megatron.training`` wrote (the model and the recipe from its stored args) or one that
``minite-convert hf-to-megatron`` wrote (the model from its stored HF config; the recipe from
``--recipe`` or the default). The weights are quantized by the learner's own modules under that
recipe and written as they are (:func:`minite_megatron.export.export_modelopt`; ``docs/export.md``):

* ``--variant minite`` (default): the learner's exact policy; the ``minite-vllm`` plugin serves it.
* ``--variant modelopt-w4a16``: stock ModelOpt NVFP4 weight-only (a different model, marked so).
* ``modelopt-w4a4-static`` needs calibrated activation amaxes: Python only (``export_modelopt``).

``--hf-config-out DIR`` also writes the plain HF ``config.json`` of the model (a
``megatron.training`` checkpoint of a preset has none of its own), which ``minite-convert
megatron-to-hf --hf-config DIR`` takes. Bad input prints one line, ``minite-export: error: ...``,
and exits with status 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..training import upstream_warnings

upstream_warnings.install()  # at import: also in the worker processes that multiprocessing spawns

from ..training.cli import OneLineArgumentParser  # noqa: E402
from .errors import ConvertError  # noqa: E402

CLI_VARIANTS = ("minite", "modelopt-w4a16")


def _parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="minite-export", description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="a --save directory (its tracker file) or a checkpoint directory")
    p.add_argument("--iteration", default=None, help="an iteration number or 'release' (default: the tracker's)")
    p.add_argument("--out", required=True, help="the export directory (must be empty or absent)")
    p.add_argument("--variant", default="minite", choices=CLI_VARIANTS + ("modelopt-w4a4-static",),
                   help="minite: the learner's policy; modelopt-w4a16: stock weight-only NVFP4")
    p.add_argument("--recipe", default=None, help="JSON file of recipe fields (default: the checkpoint's, else Recipe())")
    p.add_argument("--hf-config", default=None, help="HF config.json or directory: overrides what the checkpoint says")
    p.add_argument("--hf-config-out", default=None, help="also write the model's plain HF config.json into this directory")
    return p


def _recipe(path: str | None):
    if path is None:
        return None
    from ..recipe import Recipe, RecipeError, check_fields, read_recipe_file

    try:
        values = read_recipe_file(path)
        check_fields(values)
        return Recipe.from_dict(values)
    except RecipeError as e:
        raise ConvertError(str(e).replace("--minite-recipe", "--recipe")) from None


def export(args) -> Path:
    import torch

    from ..export import export_modelopt
    from ..export.gather import learner_weights
    from ..training.presets import init_single_process
    from .megatron_model import model_from_checkpoint

    if args.variant not in CLI_VARIANTS:
        raise ConvertError(f"--variant {args.variant} needs calibrated activation amaxes (static input scales): "
                           "use minite_megatron.export.export_modelopt(..., activation_amax=...) from Python")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out} exists and is not an empty directory")
    recipe = _recipe(args.recipe)
    from .megatron_checkpoint import find_torch_dist

    try:
        find_torch_dist(args.load, args.iteration)  # before any process group
    except ConvertError as e:
        raise ConvertError(f"--load {args.load}: {str(e).removeprefix('convert: ')}") from None
    init_single_process(seed=None)
    model, hf_config, recipe, ckpt = model_from_checkpoint(args.load, iteration=args.iteration, recipe=recipe,
                                                           hf_config=args.hf_config, dtype=torch.bfloat16)
    if recipe.precision != "nvfp4" or not (recipe.quantize_attention or recipe.quantize_experts):
        raise ConvertError(f"{ckpt}: its recipe quantizes nothing to export (precision {recipe.precision!r})")
    if recipe.activation_scale != "row" and args.variant == "minite":
        raise ConvertError(f"{ckpt}: the minite export serves per-token activation scales; the recipe has "
                           f"activation_scale {recipe.activation_scale!r} (export --variant modelopt-w4a16)")
    model.eval()
    with torch.no_grad():
        weights = learner_weights(model)
    try:
        result = export_modelopt(out, weights, model.config, recipe, rope_theta=float(model.rotary_base),
                                 max_position_embeddings=int(hf_config.get("max_position_embeddings",
                                                                           model.max_sequence_length)),
                                 variant=args.variant)
    except (ValueError, TypeError) as e:
        raise ConvertError(str(e).removeprefix("export: ")) from None
    if args.hf_config_out:
        cfg_dir = Path(args.hf_config_out)
        cfg_dir.mkdir(parents=True, exist_ok=True)
        (cfg_dir / "config.json").write_text(json.dumps(hf_config, indent=1, sort_keys=True) + "\n")
    files = getattr(result, "files", None)
    print(f"minite-export: wrote {out} ({args.variant}{f', {len(files)} file(s)' if files else ''}) from {ckpt}"
          + (f"; HF config in {args.hf_config_out}/config.json" if args.hf_config_out else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        export(args)
    except ConvertError as e:
        print(f"minite-export: error: {str(e).removeprefix('convert: ')}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["main"]
