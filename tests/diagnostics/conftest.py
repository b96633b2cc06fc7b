"""Fixtures of the diagnostics tests: the tiny two-mode MoE engine (tiny_moe.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_tiny_moe():
    name = "minite_tests_diagnostics_tiny_moe"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("tiny_moe.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="session")
def tiny_moe():
    return _load_tiny_moe()
