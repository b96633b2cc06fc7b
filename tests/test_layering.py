"""Imports run down the layers of docs/architecture.md, and no modules import each other in a loop.

Walks the ``import`` statements (function-level ones included) of every module under
``minite_megatron/`` and ``kernels/`` (installed as ``minite_kernels``) with ``ast``, nothing is
imported. Pins the drift of issue 11: ``specs.py -> strict/megatron.py -> strict/specs.py ->
specs.py`` and ``kernels/triton/_build/_aot.py <-> _aot_kernels.py`` (circles), ``ops/linear.py`` and
``rollout/engine.py`` importing ``diagnostics.capture`` (upward imports), and
``modules/linear.py`` calling a sibling class's ``StrictRowParallelLinear.forward(self, ...)``.

And the one door to the kernels (issue 25: five modules imported ``minite_kernels.triton.*`` and
chose on ``x.is_cuda``, ``invariant/backend.py`` found kernels by name): no module of
``minite_megatron/`` outside the backend layer (``nvfp4/backends.py``) reaches ``minite_kernels`` --
by an import or a module name in a string -- or asks ``.is_cuda`` / ``device.type == "cuda"``
but for the non-kernel uses listed with their reasons.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE_ROW = re.compile(r"^\| (\d+) \| `([^`]+)` \|")


def layer_table() -> dict[str, int]:
    """``{path: layer}`` from the table of docs/architecture.md (a folder or a ``.py`` file)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = {m.group(2): int(m.group(1)) for m in map(TABLE_ROW.match, text.splitlines()) if m}
    assert table, "docs/architecture.md: no layer table rows ('| N | `path` | ... |') found"
    return table


def module_files() -> dict[str, Path]:
    """``{dotted module name: file}`` of every product module."""
    mods = {}
    for top, name in (("minite_megatron", "minite_megatron"), ("kernels", "minite_kernels")):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / top).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def imports_of(module: str, path: Path, known: set[str]) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every product import in ``path`` (``from a import b`` names
    module ``a.b`` where that is a module, else ``a``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return [(line, t) for line, t in found if t.split(".")[0] in ("minite_megatron", "minite_kernels")]


def repo_path(module: str, mods: dict[str, Path]) -> str:
    return str(mods[module].relative_to(ROOT)) if module in mods else module


def layer_of(path: str, table: dict[str, int]) -> tuple[str, int] | None:
    """The table entry that holds ``path`` (the longest matching folder or the file itself)."""
    best = None
    for entry, layer in table.items():
        if path == entry or path.startswith(entry.rstrip("/") + "/"):
            if best is None or len(entry) > len(best[0]):
                best = (entry, layer)
    return best


@pytest.fixture(scope="module")
def graph():
    mods = module_files()
    known = set(mods)
    edges = {}
    for module, path in mods.items():
        targets = []
        for line, target in imports_of(module, path, known):
            while target not in known and "." in target:  # an attribute imported as a module path
                target = target.rpartition(".")[0]
            if target in known and target != module:
                targets.append((line, target))
        edges[module] = sorted(set(targets))
    return mods, edges


def test_every_module_has_a_layer(graph):
    mods, _ = graph
    table = layer_table()
    missing = sorted({repo_path(m, mods) for m in mods if layer_of(repo_path(m, mods), table) is None})
    assert not missing, f"not in docs/architecture.md's layer table: {missing}"
    stale = sorted(p for p in table if not (ROOT / p).exists())
    assert not stale, f"docs/architecture.md's layer table names paths that do not exist: {stale}"


def test_imports_run_down_the_layers(graph):
    mods, edges = graph
    table = layer_table()
    bad = []
    for module, targets in edges.items():
        src = repo_path(module, mods)
        if layer_of(src, table) is None:
            continue  # test_every_module_has_a_layer names it
        src_entry, src_layer = layer_of(src, table)
        for line, target in targets:
            dst = repo_path(target, mods)
            dst_entry, dst_layer = layer_of(dst, table) or (None, -1)
            if dst_entry == src_entry or dst_layer < src_layer:
                continue
            how = "up" if dst_layer > src_layer else "sideways"
            bad.append(f"{src}:{line} imports {target} ({how}: layer {src_layer} {src_entry} -> layer {dst_layer} {dst_entry})")
    assert not bad, "imports against the layering (docs/architecture.md):\n" + "\n".join(bad)


def test_no_import_circles(graph):
    mods, edges = graph
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(component)

    for v in edges:
        if v not in index:
            visit(v)
    described = []
    for component in circles:
        inside = set(component)
        links = [f"{repo_path(a, mods)}:{line} -> {b}" for a in sorted(inside) for line, b in edges[a] if b in inside]
        described.append("circle of " + ", ".join(sorted(repo_path(m, mods) for m in component)) + ":\n  " + "\n  ".join(links))
    assert not circles, "import circles:\n" + "\n".join(described)


def sibling_method_calls(sources: dict[str, str]) -> list[str]:
    """``Other.method(self, ...)`` inside a class whose ancestors (by name, through the classes of
    ``sources``) do not include ``Other``: borrowing a sibling's method instead of sharing a
    function or a base class."""
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    classes = [c for tree in trees.values() for c in ast.walk(tree) if isinstance(c, ast.ClassDef)]
    bases = {}
    for c in classes:
        bases.setdefault(c.name, set()).update(b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in c.bases)

    def ancestors(name, seen=()):
        out = set()
        for b in bases.get(name, ()):
            if b not in seen:
                out |= {b} | ancestors(b, (*seen, b))
        return out

    found = []
    for name, tree in trees.items():
        for c in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            allowed = ancestors(c.name) | {c.name}
            for n in ast.walk(c):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)
                        and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "self"):
                    owner = n.func.value.id
                    if owner[:1].isupper() and owner not in allowed:
                        found.append(f"{name}:{n.lineno}: {c.name} calls {owner}.{n.func.attr}(self, ...)")
    return found


def test_no_class_borrows_a_sibling_method(graph):
    mods, _ = graph
    sources = {repo_path(m, mods): path.read_text() for m, path in mods.items()}
    found = sibling_method_calls(sources)
    assert not found, "methods borrowed from a class that is not a base (share a function instead):\n" + "\n".join(found)
    old = "class A(B):\n    def forward(self, x):\n        return StrictRowParallelLinear.forward(self, x)\n"
    assert sibling_method_calls({"linear.py": old}) == ["linear.py:3: A calls StrictRowParallelLinear.forward(self, ...)"]


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk itself: a function-level relative import from ops into diagnostics is found."""
    path = tmp_path / "linear.py"
    path.write_text("def f():\n    from ..diagnostics.capture import capture\n")
    known = {"minite_megatron.diagnostics.capture", "minite_megatron.ops.linear"}
    assert imports_of("minite_megatron.ops.linear", path, known) == [(2, "minite_megatron.diagnostics.capture")]


# ---- the one door to the kernels (issue 25) -------------------------------------------------------
#: The backend layer (docs/architecture.md): the only modules of minite_megatron/ that reach the kernels.
BACKEND_LAYER = {"minite_megatron/nvfp4/backends.py"}
#: Files that ask whether a tensor is on a GPU for something other than choosing a kernel: file -> why.
DEVICE_CHECKS_ALLOWED = {
    "minite_megatron/cpu_compat.py": "maps CUDA device arguments to the CPU (the compatibility layer itself)",
    "minite_megatron/diagnostics/run.py": "a diagnostic run's default preset and dtype by device",
    "minite_megatron/invariant/attention.py": "no host read of the mask while a CUDA graph is being captured",
    "minite_megatron/invariant/topk.py": "no host read (the NaN check) while a CUDA graph is being captured",
    "minite_megatron/nvfp4/group_sizes.py": "pinned host memory and the device index of the group-size tensors",
    "minite_megatron/ops/grouped_linear.py": "whether torch's own _grouped_mm runs there (an ATen op's limits)",
    "minite_megatron/rollout/fast_path.py": "the KV cache / prefill memory checks and timing events of a GPU",
    "minite_megatron/rollout/resident.py": "the progress log of allocated GPU memory",
    "minite_megatron/ops/seeds.py": "pinned staging memory and the copy event of the device seeds a CUDA graph reads",
    "minite_megatron/rollout/support.py": "CUDA graphs need a GPU",
    "minite_megatron/testing.py": "the host-sync counter classifies host <-> device copies",
    "minite_megatron/training/cuda_graphs.py": "CUDA graphs need a GPU",
}
KERNEL_MODULE = re.compile(r"^minite_kernels([.:][\w.:]*)?$")


def _docstrings(tree) -> set[int]:
    return {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}


def kernel_reaches(path: Path) -> list[str]:
    """``line: what`` of every way ``path`` reaches ``minite_kernels``: an import (function-level
    ones too), or a module name as a string (``importlib.import_module("minite_kernels...")``,
    ``__import__``, the start of an f-string), docstrings aside."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "minite_kernels"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "minite_kernels":
            found.append(f"{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                and KERNEL_MODULE.match(node.value):
            found.append(f"{node.lineno}: the string {node.value!r}")  # (an f-string's first part too)
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


def device_checks(path: Path) -> list[str]:
    """``line: what`` of every ``x.is_cuda`` and ``x.type == / != "cuda"`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "is_cuda":
            found.append(f"{node.lineno}: .is_cuda")
        elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "type"
              and any(isinstance(c, ast.Constant) and c.value == "cuda" for c in node.comparators)):
            found.append(f"{node.lineno}: .type compared with 'cuda'")
    return sorted(found, key=lambda s: int(s.split(":")[0]))


def _package_files() -> dict[str, Path]:
    return {str(p.relative_to(ROOT)): p for p in sorted((ROOT / "minite_megatron").rglob("*.py"))}


def test_only_the_backend_layer_reaches_the_kernels():
    bad = [f"{name}:{what}" for name, path in _package_files().items()
           if name not in BACKEND_LAYER for what in kernel_reaches(path)]
    assert not bad, ("minite_kernels reached outside the backend layer (add a Backend method, "
                     "docs/architecture.md 'Where to add'):\n" + "\n".join(bad))
    assert all(kernel_reaches(ROOT / name) for name in BACKEND_LAYER), "the backend layer reaches no kernel?"


def test_no_kernel_is_chosen_by_device_outside_the_backend_layer():
    files = _package_files()
    bad = [f"{name}:{what}" for name, path in files.items()
           if name not in BACKEND_LAYER | set(DEVICE_CHECKS_ALLOWED) for what in device_checks(path)]
    assert not bad, ("a device check outside the backend layer (choose kernels through get_backend / supports, or "
                     "allow a non-kernel use in DEVICE_CHECKS_ALLOWED with its reason):\n" + "\n".join(bad))
    stale = sorted(name for name in DEVICE_CHECKS_ALLOWED if name not in files or not device_checks(files[name]))
    assert not stale, f"DEVICE_CHECKS_ALLOWED names files without a device check: {stale}"


def test_the_door_checker_sees_every_way_in(tmp_path):
    path = tmp_path / "m.py"
    path.write_text('"""Uses minite_kernels.triton (a docstring: fine)."""\nimport importlib\n'
                    "def f(name, x):\n    from minite_kernels.triton import moe\n"
                    '    importlib.import_module("minite_kernels.triton.moe.moe_route")\n'
                    '    importlib.import_module(f"minite_kernels.triton.{name}")\n'
                    "    import minite_kernels\n    return x.is_cuda or x.device.type == 'cuda'\n")
    assert kernel_reaches(path) == ["4: from minite_kernels.triton import ...",
                                    "5: the string 'minite_kernels.triton.moe.moe_route'",
                                    "6: the string 'minite_kernels.triton.'", "7: import minite_kernels"]
    assert device_checks(path) == ["8: .is_cuda", "8: .type compared with 'cuda'"]
