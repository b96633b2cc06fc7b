"""Every test that compiles kernels ahead of time (``run_aot_script``) carries the ``aot`` marker.

The GPU set (``benchmarks/device.sh gpu_set``) leaves the ``aot`` tests out: they compile for sm_90a
and read the machine code, which gives the same answer on any machine, and CI runs them. A test
that compiles ahead of time without the marker would spend the lent GPU's minutes on a CPU's work;
one marked that runs kernels on the GPU would go unchecked there. This reads the test files' syntax
trees: a test is an AOT test when it calls ``run_aot_script`` or takes a fixture of its module that
does.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _calls_aot(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "run_aot_script"
               for n in ast.walk(node))


def _has_aot_mark(decorators) -> bool:
    return any("mark.aot" in ast.unparse(d) for d in decorators)


def _module_marked(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in n.targets)
               and "mark.aot" in ast.unparse(n.value) for n in tree.body)


def aot_tests(path: Path) -> list[tuple[str, bool, bool]]:
    """(test name, compiles ahead of time, marked aot) for each test function of ``path``."""
    tree = ast.parse(path.read_text())
    funcs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    fixtures = {f.name for f in funcs if any("fixture" in ast.unparse(d) for d in f.decorator_list) and _calls_aot(f)}
    module = _module_marked(tree)
    return [(f.name, _calls_aot(f) or any(a.arg in fixtures for a in f.args.args), module or _has_aot_mark(f.decorator_list))
            for f in funcs if f.name.startswith("test_")]


def test_every_ahead_of_time_compile_test_is_marked_aot_and_only_those():
    found, wrong = 0, []
    for path in sorted(TESTS.rglob("test_*.py")):
        if "run_aot_script" not in path.read_text() or path == Path(__file__).resolve():
            continue
        for name, compiles, marked in aot_tests(path):
            found += compiles
            if compiles != marked:
                wrong.append(f"{path.relative_to(TESTS)}::{name} "
                             + ("compiles ahead of time without @pytest.mark.aot" if compiles else
                                "is marked aot but compiles nothing ahead of time"))
    assert found >= 15, f"only {found} AOT tests found: the scan no longer sees them"
    assert not wrong, "\n".join(wrong)
