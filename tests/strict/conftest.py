"""Fixtures of the strict tests: the tiny Megatron GPT builders (tiny_gpt.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest


def load_tiny_gpt():
    name = "minite_tests_strict_tiny_gpt"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("tiny_gpt.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tiny_gpt():
    mod = load_tiny_gpt()
    mod.init_single_process()
    return mod
