"""The files and tests the docs name exist.

Reads docs/*.md, README.md, BENCHMARKS.md, PARALLELISM.md and ALIGNMENT.md; every repository
path they name (``minite_megatron/...``, ``tests/...``, ``benchmarks/...``, or a ``.py`` file inside
a package such as ``rollout/logprobs.py``; a ``*`` is a glob that must match) must exist, and every test name (``test_...``, ``test_x_*`` a prefix) must be a test
function or test file under tests/. Pins issue 11's stale references: docs/numerics.md and
docs/strict.md named tests that no longer existed.
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
