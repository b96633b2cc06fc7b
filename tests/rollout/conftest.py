"""Fixtures of the rollout tests: the tiny Megatron GPT builders shared with tests/strict."""

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_gpt():
    name = "minite_tests_strict_tiny_gpt"
    if name not in sys.modules:
        path = Path(__file__).parent.parent / "strict" / "tiny_gpt.py"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    mod = sys.modules[name]
    mod.init_single_process()
    return mod


@pytest.fixture(scope="module")
def strict_model(tiny_gpt):
    return tiny_gpt.build_gpt(True, seed=21)
