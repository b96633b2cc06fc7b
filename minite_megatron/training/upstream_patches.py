"""Fixes of megatron-core bugs, kept as upstream patches in ``patches/`` and applied at run time.

Each ``patches/megatron-core-<version>/NNNN-<name>.patch`` is a ``git diff`` against the files of
that megatron-core wheel (``patches/README.md`` reports each bug upstream-style). No installed
file is edited: :func:`apply` (called by :func:`minite_megatron.launch.prepare`, on CPUs and GPUs
alike) reads the installed source of each patched module, applies the patch's hunks to that text
in memory (every context and removed line must match exactly, as ``git apply`` requires), and
installs each function or method the patch changes or adds, compiled from the patched text with
the installed file's name and line numbers:

* a changed function keeps its identity and gets the patched code object (``__code__``), so
  every reference to it (bound methods, ``from x import f`` copies, subclasses) runs the fix;
* an added function, or one whose decorators the patch changes, is defined (decorated) in the
  module's globals and set on its class (or module).

A patch whose directory names another megatron-core version is skipped; one that no longer
applies to the installed file logs a warning naming it and is skipped (the bug it fixes stays).
Idempotent. ``applied()`` lists what is in effect (the launcher logs it).
"""

from __future__ import annotations

import ast
import importlib
import linecache
import logging
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A patch that cannot be applied to the installed megatron-core (the message says why)."""


@dataclass(frozen=True)
class FilePatch:
    path: str  # e.g. "megatron/core/optimizer/optimizer.py"
    hunks: tuple[tuple[int, tuple[tuple[str, str], ...]], ...]  # (old start line, ((" "|"-"|"+", text), ...))


def patch_dirs() -> list[Path]:
    """Where the patches are: the source tree's ``patches/``, or the installed data files
    (``setup.cfg``; setuptools spells that folder with underscores)."""
    here = Path(__file__).resolve().parents[2] / "patches"
    return [p for p in (here, Path(sys.prefix) / "share" / "minite_megatron" / "patches") if p.is_dir()]


def patches_for(version: str) -> list[Path]:
    """The patch files for megatron-core ``version`` (its release part, e.g. ``0.19.2``)."""
    release = re.match(r"\d+(\.\d+)*", version)
    release = release.group(0) if release else version
    for root in patch_dirs():
        for name in (f"megatron-core-{release}", f"megatron_core_{release}"):
            if (root / name).is_dir():
                return sorted((root / name).glob("*.patch"))
    return []


def parse_patch(text: str) -> list[FilePatch]:
    """The file patches of a ``git diff`` (unified format)."""
    files: list[FilePatch] = []
    path, hunks, body, start = None, [], None, 0

    def close_file():
        if body is not None:
            hunks.append((start, tuple(body)))
        if path is not None:
            files.append(FilePatch(path, tuple(hunks)))

    for line in text.splitlines():
        if line.startswith("diff --git "):
            close_file()
            path, hunks, body = None, [], None
        elif body is None and line.startswith("+++ "):
            path = line[4:].strip()
            path = path[2:] if path.startswith("b/") else path
        elif line.startswith("@@"):
            if body is not None:
                hunks.append((start, tuple(body)))
            m = _HUNK.match(line)
            if not m:
                raise PatchError(f"bad hunk header {line!r}")
            start, body = int(m.group(1)), []
        elif body is not None and (not line or line[0] in " -+"):
            body.append((line[0], line[1:]) if line else (" ", ""))
    close_file()
    return files


def apply_hunks(source: str, patch: FilePatch) -> tuple[str, list[int]]:
    """``source`` with ``patch`` applied, and the 1-based lines of the new text that changed (an
    added line, or the line before a removal).

    Each hunk must match exactly; at its recorded position (shifted by the hunks before it)
    first, else anywhere if unique. Raises :class:`PatchError`.
    """
    lines = source.splitlines()
    changed, shift = [], 0
    for start, body in patch.hunks:
        old = [text for tag, text in body if tag != "+"]
        new = [text for tag, text in body if tag != "-"]
        guess = start - 1 + shift
        candidates = [guess] if lines[guess:guess + len(old)] == old else [
            i for i in range(len(lines) - len(old) + 1) if lines[i:i + len(old)] == old
        ]
        if len(candidates) != 1:
            raise PatchError(f"{patch.path}: hunk at line {start} does not apply "
                             f"({'no' if not candidates else len(candidates)} matching places)")
        at = candidates[0]
        line_no = at  # 0-based index into the new text
        for tag, _ in body:
            if tag == "+":
                changed.append(line_no + 1)
                line_no += 1
            elif tag == "-":
                changed.append(max(line_no, 1))
            else:
                line_no += 1
        lines[at:at + len(old)] = new
        shift = at - (start - 1) + len(new) - len(old)
    return "\n".join(lines) + "\n", changed


def _functions_touching(tree: ast.Module, changed: list[int]) -> list[tuple[list[str], ast.AST]]:
    """``(qualified name parts, node)`` of the innermost functions holding changed lines."""
    found: dict[tuple[str, ...], ast.AST] = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = (*scope, child.name)
                start = min([child.lineno] + [d.lineno for d in getattr(child, "decorator_list", [])])
                touches = any(start <= line <= child.end_lineno for line in changed)
                if isinstance(child, ast.ClassDef):
                    visit(child, inner)
                elif touches:
                    found[inner] = child
    visit(tree, ())
    return [(list(k), v) for k, v in found.items()]


def _compile(node: ast.AST, filename: str, *, decorated: bool) -> types.CodeType:
    """The module-level code defining ``node`` (with or without its decorators)."""
    if not decorated:
        copy = type(node)(**{f: getattr(node, f) for f in node._fields})
        copy.decorator_list = []
        for attr in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
            setattr(copy, attr, getattr(node, attr))
        node = copy
    return compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")


def _plain_function(obj):
    while obj is not None and not isinstance(obj, types.FunctionType):
        obj = getattr(obj, "__wrapped__", None) or getattr(obj, "__func__", None)
    return obj


def _install(module: types.ModuleType, parts: list[str], node: ast.AST, filename: str, decorators_changed: bool) -> str:
    """Install the patched definition ``node`` of ``module.<parts>`` (see the module docstring)."""
    holder = module
    for name in parts[:-1]:
        holder = getattr(holder, name)
    name = parts[-1]
    current = vars(holder).get(name) if isinstance(holder, type) else getattr(holder, name, None)
    target = _plain_function(current)
    if current is not None and target is None:
        raise PatchError(f"{'.'.join(parts)} exists but is not a plain function")
    if target is None or decorators_changed:
        # a new function, or new decorators: define it (decorated) in the module's globals
        namespace: dict = {}
        exec(_compile(node, filename, decorated=True), module.__dict__, namespace)  # noqa: S102
        if "__class__" in _plain_function(namespace[name]).__code__.co_freevars:
            raise PatchError(f"{'.'.join(parts)} uses zero-argument super(): cannot be defined outside its class")
        setattr(holder, name, namespace[name])
        return "added" if target is None else "replaced"
    while isinstance(getattr(target, "__wrapped__", None), types.FunctionType):
        target = target.__wrapped__
    code = next(c for c in _compile(node, filename, decorated=False).co_consts
                if isinstance(c, types.CodeType) and c.co_name == name)
    if target.__code__.co_freevars != code.co_freevars:
        raise PatchError(f"{'.'.join(parts)}: the patched function's closure differs (cannot swap its code)")
    target.__code__ = code
    return "changed"


_applied: dict[str, list[str]] = {}


def apply_patch(path: Path) -> list[str]:
    """Apply one patch file at run time; returns the qualified names installed."""
    installed = []
    for file_patch in parse_patch(path.read_text()):
        module_name = file_patch.path.removesuffix(".py").replace("/", ".")
        module = importlib.import_module(module_name)
        source, changed = apply_hunks(Path(module.__file__).read_text(), file_patch)
        # tracebacks through the patched functions show the patched lines
        filename = f"{module.__file__} [patched at run time: {path.name}]"
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
        tree = ast.parse(source, filename)
        for parts, node in _functions_touching(tree, changed):
            decorators = {d.lineno for d in node.decorator_list}
            how = _install(module, parts, node, filename, decorators_changed=bool(decorators & set(changed)))
            installed.append(f"{module_name}.{'.'.join(parts)} ({how})")
    return installed


def apply() -> dict[str, list[str]]:
    """Apply every patch for the installed megatron-core (see the module docstring)."""
    from megatron.core import package_info

    for path in patches_for(str(package_info.__version__)):
        if path.name in _applied:
            continue
        try:
            _applied[path.name] = apply_patch(path)
        except (PatchError, OSError, SyntaxError, AttributeError, ImportError) as e:
            logger.warning("minite: upstream patch %s not applied to megatron-core %s: %s (the bug it fixes "
                           "remains)", path.name, package_info.__version__, e)
            _applied[path.name] = []
    return dict(_applied)


def applied() -> dict[str, list[str]]:
    """Patch file name -> what it installed, for the patches applied in this process."""
    return dict(_applied)
