"""Imports run down the layers of docs/architecture.md, and no modules import each other in a loop.

Walks the ``import`` statements (function-level ones included) of every module under
``minite_megatron/`` and ``kernels/`` (installed as ``minite_kernels``) with ``ast``, nothing is
imported. Pins the drift of issue 11: ``specs.py -> strict/megatron.py -> strict/specs.py ->
specs.py`` and ``kernels/triton/_build/_aot.py <-> _aot_kernels.py`` (circles), ``ops/linear.py`` and
``rollout/engine.py`` importing ``diagnostics.capture`` (upward imports), and
``modules/linear.py`` calling a sibling class's ``StrictRowParallelLinear.forward(self, ...)``.
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
