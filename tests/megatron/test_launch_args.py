"""``--transformer-impl minite`` on Megatron's real argument parser (in process): it parses, routes
the model config to the minite specs, and bad configurations fail fast naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minite_megatron import megatron_args
from minite_megatron.megatron_args import MiniteArgumentError
from minite_megatron.recipe import Recipe, RecipeError

BASE = [
    "--transformer-impl", "minite", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
]


@pytest.fixture(autouse=True)
def installed():
    """The launcher's hooks (and, without a GPU, the CPU layer: Megatron's TP argument checks ask
    for the GPU architecture), removed afterwards."""
    from minite_megatron import cpu_compat

    with cpu_compat.activated():
        megatron_args.install()
        try:
            yield
        finally:
            megatron_args.uninstall()


def _parse(argv, monkeypatch):
    from megatron.training import arguments

    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *map(str, argv)])
    args = arguments.parse_args()
    arguments.validate_args(args, {})
    return args


def _replace(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = str(value)
    return argv


def test_minite_parses_and_routes_the_model_config_to_the_minite_specs(monkeypatch):
    from megatron.training import argument_utils

    args = _parse(BASE + ["--minite-strict", "--minite-bf16-first-layers", "1"], monkeypatch)
    assert args.transformer_impl == "minite"
    assert megatron_args.validate_minite_args(args) is None
    assert args.apply_rope_fusion is False  # needs TE
    model_config = argument_utils.gpt_config_from_args(args)
    spec = model_config.transformer_layer_spec
    assert spec.func is megatron_args.minite_layer_spec
    assert spec.keywords["recipe"] == Recipe(strict=True, bf16_first_layers=1)
    assert len(model_config.pre_wrap_hooks) == 1


def test_local_and_other_scripts_are_untouched(monkeypatch):
    from megatron.training import argument_utils

    args = _parse(_replace(BASE, "--transformer-impl", "local"), monkeypatch)
    assert argument_utils.gpt_config_from_args(args).transformer_layer_spec is None


def _has_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.parametrize("change, flag", [(("--hidden-size", 72), "--hidden-size 72"), (("--ffn-hidden-size", 200), "--ffn-hidden-size 200")])
def test_sizes_that_are_not_multiples_of_16_fail_naming_the_flag(monkeypatch, change, flag):
    with pytest.raises(MiniteArgumentError, match=flag):
        _parse(_replace(BASE, *change), monkeypatch)


@pytest.mark.skipif(_has_te(), reason="Transformer Engine is installed here")
def test_te_path_without_te_fails_naming_the_flag(monkeypatch):
    """Pins: Megatron's default --transformer-impl transformer_engine without TE used to fail deep
    inside model construction; the launcher stops at argument validation instead."""
    argv = [a for a in BASE if a not in ("--transformer-impl", "minite")]  # Megatron's default impl
    with pytest.raises(MiniteArgumentError, match="--transformer-impl transformer_engine"):
        _parse(argv, monkeypatch)


def test_tensor_parallel_shard_must_stay_a_multiple_of_16(monkeypatch):
    argv = _replace(BASE, "--ffn-hidden-size", 80) + ["--tensor-model-parallel-size", "2"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MiniteArgumentError, match=r"--ffn-hidden-size 80 / --tensor-model-parallel-size 2 = 40"):
        _parse(argv, monkeypatch)


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--fp4-format", "e2m1"], "--fp4-format"),
        (["--spec", "my.module", "my_spec"], "--spec"),
        (["--multi-latent-attention"], "--multi-latent-attention"),
        (["--cuda-graph-impl", "local"], "--cuda-graph-impl local"),
    ],
)
def test_te_and_conflicting_flags_fail_naming_the_flag(monkeypatch, extra, flag):
    """Pins: these are rejected before Megatron's own checks (which would ask for TE instead)."""
    with pytest.raises(MiniteArgumentError, match=f"{flag} cannot be combined with --transformer-impl minite"):
        _parse(BASE + extra, monkeypatch)


def test_cuda_graph_impl_names_what_is_supported(monkeypatch):
    """Pins: Megatron's per-layer graph flags with minite layers get one line naming the supported
    graph (full_iteration), not a traceback from a graph manager the minite layers are not wired to;
    full_iteration is refused only with expert parallelism, and otherwise parses."""
    with pytest.raises(MiniteArgumentError, match="use --cuda-graph-impl full_iteration"):
        _parse(BASE + ["--cuda-graph-impl", "transformer_engine"], monkeypatch)
    graphed = ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
    with pytest.raises(MiniteArgumentError, match="full_iteration cannot be combined with --expert-model-parallel-size 2"):
        _parse(BASE + graphed + ["--expert-model-parallel-size", "2"], monkeypatch)
    assert _parse(BASE + graphed, monkeypatch).cuda_graph_impl == "full_iteration"


def test_full_iteration_graph_is_the_wrapper_megatron_uses():
    """``install`` (``launch.prepare`` step 5) puts the minite wrapper where ``megatron.training.training`` looks
    ``FullCudaGraphWrapper`` up (its ``--cuda-graph-impl full_iteration`` branch); uninstall restores it."""
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.training import training

    from minite_megatron.training import full_iteration_graph

    full_iteration_graph.install()
    assert training.FullCudaGraphWrapper is full_iteration_graph.MiniteFullIterationGraph
    assert issubclass(full_iteration_graph.MiniteFullIterationGraph, FullCudaGraphWrapper)
    full_iteration_graph.uninstall()
    assert training.FullCudaGraphWrapper is FullCudaGraphWrapper


def test_unknown_recipe_field_in_a_recipe_file_names_the_field(monkeypatch, tmp_path):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"strict": True, "stochastic_rounding_typo": True}))
    with pytest.raises(RecipeError, match="stochastic_rounding_typo"):
        _parse(BASE + ["--minite-recipe", recipe], monkeypatch)


def test_unknown_minite_flag_is_an_argparse_error_naming_it(monkeypatch, capsys):
    with pytest.raises(SystemExit) as info:
        _parse(BASE + ["--minite-stochastic-rounding", "1"], monkeypatch)
    assert info.value.code == 2
    assert "--minite-stochastic-rounding" in capsys.readouterr().err


def test_invalid_recipe_value_names_the_flag(monkeypatch):
    with pytest.raises(RecipeError, match="--minite-fp32-router"):
        _parse(BASE + ["--minite-strict", "--no-minite-fp32-router"], monkeypatch)


def test_qwen3_30b_a3b_config_parses_and_validates(monkeypatch):
    """examples/configs/qwen3_30b_a3b.sh (needs 8 GPUs to run) against the real parser and checks."""
    config = Path(__file__).resolve().parents[2] / "examples" / "configs" / "qwen3_30b_a3b.sh"
    out = subprocess.run(
        ["bash", "-c", f'source "{config}"; printf "%s\\0" "${{QWEN3_30B_A3B_ARGS[@]}}"'],
        capture_output=True, text=True, check=True,
    ).stdout
    flags = [f for f in out.split("\0") if f]
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = _parse(flags + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--micro-batch-size", "1",
                           "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-5"], monkeypatch)
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups) == (48, 2048, 32, 4)
    assert (args.kv_channels, args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size) == (128, 128, 8, 768)
    assert (args.expert_model_parallel_size, args.vocab_size, args.vocab_size % 128) == (8, 151936, 0)
    assert args.qk_layernorm and args.rotary_base == 1000000 and args.transformer_impl == "minite"


def test_swiglu_runs_in_the_minite_activation_module(monkeypatch):
    """``--swiglu`` under minite: the MLP activation is the minite module (Megatron builds it only
    under ``use_te_activation_func``, which excludes Megatron's bias-SwiGLU fusion)."""
    from megatron.training import argument_utils

    args = _parse(BASE + ["--swiglu"], monkeypatch)
    assert args.use_te_activation_func is True and args.bias_swiglu_fusion is False
    config = argument_utils.core_transformer_config_from_args(args)
    assert config.use_te_activation_func and not config.bias_activation_fusion and config.gated_linear_unit
    plain = _parse(BASE, monkeypatch)  # no GLU: Megatron's own activation path, untouched
    assert not getattr(plain, "use_te_activation_func", False)
