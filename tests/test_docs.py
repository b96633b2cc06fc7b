"""The files and tests the docs name exist.

Reads docs/*.md, README.md, BENCHMARKS.md, PARALLELISM.md and ALIGNMENT.md; every repository
path they name (``minite_megatron/...``, ``tests/...``, ``benchmarks/...``, or a ``.py`` file inside
a package such as ``rollout/logprobs.py``; a ``*`` is a glob that must match) must exist, and every test name (``test_...``, ``test_x_*`` a prefix) must be a test
function or test file under tests/; every module they cite (``python -m benchmarks.x``,
``minite_megatron.a.b``, ``minite_kernels.x``) must resolve to a module of the repository or a name
in it; and no path outside the repository (absolute, ``~/``, ``../``). Pins issue 11's stale
references (docs/numerics.md and docs/strict.md named tests that no longer existed) and issue 25's
(BENCHMARKS.md cited a deleted module and the device machines' own paths).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / n for n in ("README.md", "BENCHMARKS.md", "PARALLELISM.md", "ALIGNMENT.md")]
PATH = re.compile(r"(?<![\w./-])((?:minite_megatron|kernels|tests|benchmarks|examples|scripts|patches|docs)/[\w./*-]*[\w/*])")
SHORT_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)+[\w*-]+\.py)\b")  # ``rollout/logprobs.py``: inside a package
PACKAGES = ("minite_megatron", "kernels", "tests")
EXTERNAL = ("vllm/", "sglang/", "megatron/", "transformer_engine/", "torch/", "triton/")  # other projects' files
TEST = re.compile(r"(?<![\w/.])(test_\w+)(\*)?")
NOT_YET_WRITTEN = {
    "benchmarks/results/blackwell_bringup.jsonl": "appended by the first Blackwell run (none has run yet)",
}


def collect_test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.add(path.stem)
        names.update(re.findall(r"^\s*(?:async )?def (test_\w+)", path.read_text(), flags=re.M))
    return names


@pytest.fixture(scope="module")
def known_tests():
    return collect_test_names()


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_paths_exist(doc):
    missing = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        for m in PATH.finditer(line):
            path = m.group(1).rstrip(".")
            if "<" in path or path in NOT_YET_WRITTEN:
                continue
            found = any(ROOT.glob(path)) if "*" in path else (ROOT / path).exists()
            if not found:
                missing.append(f"{doc.name}:{lineno}: {path}")
        for m in SHORT_PATH.finditer(PATH.sub(" ", line)):
            path = m.group(1)
            if path.startswith(EXTERNAL):
                continue
            if not any(any(base.glob(path)) for base in (ROOT, *(ROOT / p for p in PACKAGES))):
                missing.append(f"{doc.name}:{lineno}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_tests_exist(doc, known_tests):
    missing = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        line = PATH.sub(" ", line)  # a test file named by its path is checked as a path
        for m in TEST.finditer(line):
            name, glob = m.group(1), m.group(2)
            ok = any(t.startswith(name) for t in known_tests) if glob else name in known_tests
            if not ok:
                missing.append(f"{doc.name}:{lineno}: {name}{glob or ''}")
    assert not missing, "tests named in the docs that do not exist:\n" + "\n".join(missing)


#: ``python -m a.b`` and the project's dotted names (``minite_megatron.x.y``, ``minite_kernels.x``,
#: ``benchmarks.x``): the module (or a name defined in it) must exist
PYTHON_M = re.compile(r"python3? -m ([\w.]+)")
DOTTED = re.compile(r"(?<![\w./-])((?:minite_megatron|minite_kernels|benchmarks)(?:\.\w+)+)")
#: files of the repository's packages by import name (``minite_kernels`` is ``kernels/`` installed)
IMPORT_ROOTS = {"minite_megatron": ROOT / "minite_megatron", "minite_kernels": ROOT / "kernels",
                "benchmarks": ROOT / "benchmarks", "tests": ROOT / "tests", "examples": ROOT / "examples"}
EXTERNAL_MODULES = ("torch", "pytest", "pip", "vllm", "sglang", "megatron", "transformer_engine", "triton", "venv",
                    "torch.distributed", "minite_megatron_cli")
#: an absolute path (``/work/...``, ``(/x/y)``) or a parent directory (``../``): outside the repository
OUTSIDE = re.compile(r"(?<![\w.:/$})\]>-])(/(?:[A-Za-z_][\w.-]*)(?:/[\w.*-]+)+/?|~/[\w./-]+|\.\./[\w./-]*)")


def _defines(source: str, name: str) -> bool:
    return re.search(rf"^\s*(?:def|class|async def)\s+{name}\b|^\s*{name}\s*[:=]|^\s*from .* import .*\b{name}\b"
                     rf"|^\s*import .*\b{name}\b|^\s*{name}\s*,|,\s*{name}\s*[,=)]", source, flags=re.M) is not None


def resolve_dotted(name: str) -> bool:
    """``a.b.c``: the longest prefix that is a module or package of the repository, then at most
    one name defined in it (``minite_megatron.nvfp4.NVFP4Tensor``); external modules pass."""
    parts = name.split(".")
    if parts[0] not in IMPORT_ROOTS:
        return name.startswith(EXTERNAL_MODULES)
    base = IMPORT_ROOTS[parts[0]]
    for i in range(len(parts), 0, -1):
        path = base.joinpath(*parts[1:i])
        module = path.with_suffix(".py") if i > 1 else None
        package = path / "__init__.py"
        for f in (module, package):
            if f is not None and f.is_file():
                rest = parts[i:]
                return not rest or (len(rest) == 1 and _defines(f.read_text(), rest[0]))
        if i == 1 and base.is_dir():
            return len(parts) == 1
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_named_modules_exist(doc):
    """A ``python -m`` command or a dotted name the doc cites resolves to a module of the repository
    (or a name defined in it): pins BENCHMARKS.md citing ``benchmarks.quantize_dual`` after its
    module was deleted."""
    missing = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        names = {m.group(1).rstrip(".") for m in PYTHON_M.finditer(line)}
        names |= {m.group(1).rstrip(".") for m in DOTTED.finditer(line)}
        for name in sorted(names):
            if not resolve_dotted(name):
                missing.append(f"{doc.name}:{lineno}: {name}")
    assert not missing, "modules named in the docs that do not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_paths_outside_the_repository(doc):
    """The docs name files by their path inside the repository: an absolute path (a machine's
    ``/work/...`` or ``/root/...``) or a ``../`` one points at something a reader's checkout does
    not have (BENCHMARKS.md cited the device sessions' ``/work/tools`` scripts)."""
    outside = []
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        line = re.sub(r"https?://\S+", " ", line)
        outside += [f"{doc.name}:{lineno}: {m.group(1)}" for m in OUTSIDE.finditer(line)]
    assert not outside, "paths outside the repository named in the docs:\n" + "\n".join(outside)
