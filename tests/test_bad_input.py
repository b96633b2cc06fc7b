"""Bad input never passes: one clear line naming the field, flag or file, as early as possible.

Pins (issue 14): a recipe file ``{"strict": "false"}`` trained in strict mode; strings, floats
and null passed for bool/int fields; a missing, empty or corrupt ``--minite-recipe`` gave a raw
traceback; ``--minite-backend triton`` on a CPU and ``--minite-bf16-first-layers 10`` on a
4-layer model failed late (first forward / model build); ``nvfp4.quantize`` clipped values
with a negative ``amax`` and gave an AttributeError for a list; ``minite-diagnose`` gave
tracebacks (exit 1) for a corrupt ``.pt`` and an unknown preset.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from minite_megatron import nvfp4
from tests.parallel.spawn import free_port
from minite_megatron.recipe import Recipe, RecipeError, flag

ROOT = Path(__file__).resolve().parents[1]
HINTS = typing.get_type_hints(Recipe)


# ---- recipe values, type-checked generically from the dataclass hints ---------------------------
def _wrong_values(hint) -> list:
    """Values of the wrong type for ``hint`` (derived from the hint, so new fields are covered)."""
    args, origin = typing.get_args(hint), typing.get_origin(hint)
    optional = type(None) in args
    base = [a for a in args if a is not type(None)] if origin in (typing.Union, __import__("types").UnionType) else [hint]
    wrong = [] if optional else [None]
    if origin is typing.Literal:
        return [None, f"{args[0]}_typo", 1, True]
    if bool in base:
        wrong += ["false", "true", 0, 1, 1.0]
    elif int in base:
        wrong += [True, 1.5, "2"]
    elif str in base:
        wrong += [3, True]
    return wrong


CASES = [(f.name, v) for f in fields(Recipe) for v in _wrong_values(HINTS[f.name])]


@pytest.mark.parametrize("name, value", CASES, ids=[f"{n}={v!r}" for n, v in CASES])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(name, value):
    with pytest.raises(RecipeError, match=rf"recipe field {name} \({flag(name)}\) must be .*got {value!r}") as info:
        Recipe.from_dict({name: value})
    assert "\n" not in str(info.value)


def test_every_field_is_covered_and_the_defaults_pass():
    assert {n for n, _ in CASES} == {f.name for f in fields(Recipe)}
    Recipe.from_dict(Recipe().to_dict())  # the resolved defaults round-trip
    Recipe.from_dict({"strict": True, "seed": 3, "fp32_router": None, "backend": None, "rht_seed": -1})


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read the recipe file"),
        ("", "the recipe file is empty"),
        ("{strict: true", "not valid JSON"),
        ("[1, 2]", "expected a JSON object of recipe fields, got a JSON list"),
        ('{"strict": "false"}', r"recipe field strict \(--minite-strict\) must be a boolean .*got 'false'"),
        ('{"stochastic_rounding": true}', r"unknown recipe field\(s\) \['stochastic_rounding'\]"),
    ],
    ids=["missing", "empty", "corrupt", "not-an-object", "string-for-bool", "unknown-field"],
)
def test_a_bad_recipe_file_is_one_line_naming_the_file(tmp_path, content, message):
    import argparse

    from minite_megatron.recipe import add_recipe_args, recipe_from_args

    path = str(tmp_path / "missing.json") if content is None else _write(tmp_path, "r.json", content)
    args = add_recipe_args(argparse.ArgumentParser()).parse_args(["--minite-recipe", path])
    with pytest.raises(RecipeError, match=rf"^--minite-recipe {path}: .*{message}") as info:
        recipe_from_args(args)
    assert "\n" not in str(info.value)


def test_the_launcher_refuses_a_string_for_a_bool_in_one_line(tmp_path):
    """End to end: ``{"strict": "false"}`` stops the launcher at argument time, exit status 2."""
    recipe = _write(tmp_path, "recipe.json", json.dumps({"strict": "false"}))
    env = dict(os.environ, PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0")
    proc = subprocess.run(
        [sys.executable, "-m", "minite_megatron.launch", "examples/pretrain_gpt.py", "--transformer-impl", "minite",
         "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--minite-recipe", recipe],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --minite-recipe {recipe}: recipe field strict (--minite-strict) must be a boolean "
                      f"(true/false), got 'false' (str)"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ---- flags checked at argument time (before the model is built) ----------------------------------
@pytest.fixture
def parse(monkeypatch):
    """Megatron's real parser and validation with the launcher's hooks (in process)."""
    from minite_megatron import cpu_compat, megatron_args

    base = ["--transformer-impl", "minite", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--ffn-hidden-size", "128", "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size",
            "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "256"]

    def run(*extra):
        from megatron.training import arguments

        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *base, *map(str, extra)])
        args = arguments.parse_args()
        arguments.validate_args(args, {})
        return args

    with cpu_compat.activated():
        megatron_args.install()
        try:
            yield run
        finally:
            megatron_args.uninstall()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_a_gpu_backend_on_a_cpu_is_refused_at_argument_time(parse, monkeypatch):
    from minite_megatron.megatron_args import MiniteArgumentError

    # Import the kernels first: Triton picks interpreted or compiled kernels when a module is
    # imported, so importing them with the variable unset would leave compiled (CPU-unusable)
    # kernels in sys.modules for every later test (regression: "0 active drivers" in tests/ops).
    import minite_kernels.triton.backend  # noqa: F401

    from minite_megatron.settings import settings

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the test suite's interpreter is not a GPU)
    settings.cache_clear()  # (read once per process: the variable changed)
    try:
        with pytest.raises(MiniteArgumentError, match=r"--minite-backend triton: NVFP4 backend 'triton' unavailable on cpu"):
            parse("--minite-backend", "triton")
        with pytest.raises(MiniteArgumentError, match=r"--minite-backend blackwell: .*needs a CUDA device"):
            parse("--minite-backend", "blackwell")
        assert parse("--minite-backend", "reference").minite_backend == "reference"
    finally:
        monkeypatch.undo()  # the variable back, then the cached answer with it
        settings.cache_clear()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--minite-bf16-first-layers", 10], r"--minite-bf16-first-layers 10 exceeds --num-layers 4"),
        (["--minite-bf16-last-layers", 5], r"--minite-bf16-last-layers 5 exceeds --num-layers 4"),
        (["--minite-bf16-first-layers", 3, "--minite-bf16-last-layers", 2],
         r"--minite-bf16-first-layers 3 \+ --minite-bf16-last-layers 2 exceeds --num-layers 4"),
    ],
)
def test_bf16_layers_the_model_does_not_have_are_refused_at_argument_time(parse, extra, message):
    from minite_megatron.megatron_args import MiniteArgumentError

    with pytest.raises(MiniteArgumentError, match=message):
        parse(*extra)
    assert parse("--minite-bf16-first-layers", 2, "--minite-bf16-last-layers", 2).minite_bf16_first_layers == 2


# ---- nvfp4.quantize --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "amax, error, message",
    [
        (torch.tensor([-1.0]), ValueError, r"amax must be finite and >= 0, got 1 bad value\(s\), first -1.0"),
        (torch.tensor([float("nan")]), ValueError, r"amax must be finite and >= 0, .* first nan"),
        (torch.tensor([float("inf")]), ValueError, r"amax must be finite and >= 0, .* first inf"),
        (2.0, TypeError, r"amax must be a torch.Tensor .* got float"),
        (torch.ones(3), ValueError, r"amax has 3 value\(s\), global_scale='tensor' on shape \(4, 32\) needs 1"),
    ],
    ids=["negative", "nan", "inf", "float", "wrong-size"],
)
def test_quantize_refuses_a_bad_amax_override(amax, error, message):
    """Pins: a negative amax used to give negative scales and silently clipped values."""
    with pytest.raises(error, match=f"^nvfp4.quantize: {message}"):
        nvfp4.quantize(torch.randn(4, 32), "tensor", amax=amax)


@pytest.mark.parametrize("x", [[[1.0] * 16], 3.0, None], ids=["list", "float", "None"])
def test_quantize_refuses_a_non_tensor_in_one_line(x):
    """Pins: a Python list gave ``AttributeError: 'list' object has no attribute 'device'``."""
    with pytest.raises(TypeError, match=r"^nvfp4.quantize expects a torch.Tensor, got "):
        nvfp4.quantize(x)


def test_quantize_still_takes_a_valid_amax_override():
    x = torch.randn(4, 32)
    q = nvfp4.quantize(x, "row", amax=x.abs().amax(dim=1))
    assert torch.equal(q.codes, nvfp4.quantize(x, "row").codes)
    nvfp4.quantize(torch.zeros(4, 32), "tensor", amax=torch.zeros(1))  # amax 0 is a valid (all-zero) domain


# ---- minite-diagnose ------------------------------------------------------------------------------
def _diagnose(*argv):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "minite_megatron.diagnostics.cli", *map(str, argv)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)


def _bad_files(tmp_path):
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(b"\x80\x04not a torch file" * 8)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    return corrupt, empty


@pytest.mark.parametrize("command", ["gap", "compare"])
def test_diagnose_exits_2_with_one_line_for_a_corrupt_or_empty_pt(tmp_path, command):
    corrupt, empty = _bad_files(tmp_path)
    for bad, why in ((corrupt, "UnpicklingError"), (empty, "the file is empty")):
        extra = ["--out", tmp_path / "out"] if command == "compare" else []
        proc = _diagnose(command, bad, bad, *extra)
        assert proc.returncode == 2, proc.stderr[-2000:]
        lines = [line for line in proc.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and f"minite-diagnose {command}: error: {bad}: not a readable" in lines[0], proc.stderr
        assert why in lines[0] and "Traceback" not in proc.stderr


def test_diagnose_exits_2_with_one_line_for_an_unknown_preset(tmp_path):
    proc = _diagnose("run", "--out", tmp_path / "out", "--preset", "qwen9")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "minite-diagnose run: error: unknown --preset 'qwen9'; known: qwen3-30b-a3b, qwen3-moe, tiny" in proc.stderr
    assert "Traceback" not in proc.stderr
