"""``minite-diagnose vllm`` on bad input: one line naming the flag and the file, exit status 2, before
any model or engine is built (the runs themselves: tests/serving/test_vllm_diagnose.py, in .venv-vllm)."""

import importlib.util
import json

import pytest

from minite_megatron.diagnostics.cli import main

# an export's config.json as minite-export writes it (the fields the command reads first)
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "max_position_embeddings": 64,
          "quantization_config": {"quant_method": "minite_nvfp4"}, "minite": {"variant": "minite"}}


def _error(capsys, *argv):
    assert main(["vllm", *map(str, argv)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_missing_directory(tmp_path, capsys):
    assert _error(capsys, "--model", tmp_path / "nope") == (
        f"minite-diagnose vllm: error: --model {tmp_path / 'nope'}: no such directory")


def test_directory_that_is_not_an_export(tmp_path, capsys):
    assert "no config.json: not an exported model" in _error(capsys, "--model", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": {"quant_method": "modelopt"}}))
    assert "quant_method is 'modelopt', not 'minite_nvfp4': not a minite export" in _error(capsys, "--model", tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    assert "config.json is not valid JSON" in _error(capsys, "--model", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "architectures": ["Qwen3ForCausalLM"]}))
    assert "architecture 'Qwen3ForCausalLM'; the minite-vllm model class serves Qwen3MoeForCausalLM" in _error(
        capsys, "--model", tmp_path)


def test_bad_prompts_and_flags(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    bad = tmp_path / "prompts.json"
    bad.write_text("[[1, 2], [300]]")
    assert f"--prompts {bad}: prompt 1 is not a non-empty list of token ids in [0, 256)" in _error(
        capsys, "--model", tmp_path, "--prompts", bad)
    assert "--prompts" in _error(capsys, "--model", tmp_path, "--prompts", tmp_path / "none.json")
    assert "--vllm-stock-ops attention: choose from norm, rope" in _error(
        capsys, "--model", tmp_path, "--vllm-stock-ops", "attention")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_without_vllm_says_where_to_get_it(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert "vLLM is not installed in this environment" in _error(capsys, "--model", tmp_path)
