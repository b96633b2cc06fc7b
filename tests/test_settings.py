"""The environment is read in one module, once (issue 25: seven variables read in five places, one
of them at import, ``MINITE_BACKEND`` in two).

Pins: no module of ``minite_megatron/`` or ``kernels/`` but ``minite_megatron/settings.py`` touches
``os.environ`` / ``os.getenv`` / ``os.putenv`` (an ``ast`` walk, nothing imported); every variable of
:class:`Settings` is parsed from its text; a bad value fails with one line naming the variable;
the table of docs/architecture.md is the one the dataclass prints; a value is read once and
:func:`overridden` changes it for a block only.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from minite_megatron import settings as settings_module
from minite_megatron.settings import Settings, SettingsError, overridden, settings, table

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_FILE = ROOT / "minite_megatron" / "settings.py"
ENV_CALLS = {"environ", "getenv", "putenv", "unsetenv", "environb", "getenvb"}


def environment_uses(path: Path) -> list[str]:
    """``line: what`` of every use of ``os.environ`` / ``os.getenv`` (also ``from os import environ``)."""
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENV_CALLS and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            found.append(f"{node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [f"{node.lineno}: from os import {a.name}" for a in node.names if a.name in ENV_CALLS]
    return found


def test_only_settings_reads_the_environment():
    bad = []
    for top in ("minite_megatron", "kernels"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == SETTINGS_FILE:
                continue
            bad += [f"{path.relative_to(ROOT)}:{use}" for use in environment_uses(path)]
    assert not bad, "environment read outside minite_megatron/settings.py (add a Settings field):\n" + "\n".join(bad)


def test_the_walk_sees_every_form(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\nfrom os import environ\nx = os.environ.get('A')\ny = os.getenv('B')\n")
    assert sorted(environment_uses(path)) == ["2: from os import environ", "3: os.environ", "4: os.getenv"]


def test_settings_imports_only_the_standard_library():
    """Layer 0: every layer (the kernels too) may read it."""
    tree = ast.parse(SETTINGS_FILE.read_text())
    modules = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))
    import sys

    assert modules <= set(sys.stdlib_module_names) | {"__future__"}, modules


#: field -> (text, parsed value): one good value of each variable, not its default
GOOD = {
    "backend": ("triton", "triton"),
    "strict_backend": (" reference ", "reference"),
    "attention_backward": ("recompute", "recompute"),
    "megatron_combine": ("1", True),
    "recipe_json": ('{"strict": true}', '{"strict": true}'),
    "blackwell_mma_k": ("96", 96),
    "triton_interpret": ("TRUE", True),
    "world_size": ("8", 8),
    "local_rank": ("3", 3),
}
#: field -> a value it cannot have
BAD = {
    "backend": "tri ton", "strict_backend": "torch;", "attention_backward": "both", "megatron_combine": "2",
    "recipe_json": "[1, 2]", "blackwell_mma_k": "128", "triton_interpret": "maybe", "world_size": "0",
    "local_rank": "-1",
}


def test_every_variable_is_listed_here():
    names = [f.name for f in dataclasses.fields(Settings)]
    assert sorted(GOOD) == sorted(BAD) == sorted(names)
    assert all(f.metadata["env"] and f.metadata["meaning"] for f in dataclasses.fields(Settings))


@pytest.mark.parametrize("field", sorted(GOOD))
def test_each_variable_is_parsed(field):
    env = {f.name: f.metadata["env"] for f in dataclasses.fields(Settings)}[field]
    text, value = GOOD[field]
    parsed = Settings.read({env: text})
    assert getattr(parsed, field) == value
    assert getattr(parsed, field) != getattr(Settings(), field)  # not the default
    assert Settings.read({env: ""}) == Settings() == Settings.read({})  # empty or unset: the defaults


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_bad_value_fails_in_one_line_naming_the_variable(field):
    env = {f.name: f.metadata["env"] for f in dataclasses.fields(Settings)}[field]
    with pytest.raises(SettingsError) as info:
        Settings.read({env: BAD[field]})
    message = str(info.value)
    assert message.startswith(env) and "\n" not in message, message


def test_bool_values_follow_tritons_rule():
    for text in ("1", "true", "On", "YES"):
        assert Settings.read({"TRITON_INTERPRET": text}).triton_interpret
    for text in ("0", "false", "off", "no"):
        assert not Settings.read({"TRITON_INTERPRET": text}).triton_interpret


def test_read_once_cleared_on_request_and_overridden_for_a_block(monkeypatch):
    monkeypatch.setenv("MINITE_ATTENTION_BACKWARD", "direct")
    settings.cache_clear()
    first = settings()
    assert first.attention_backward == "direct"
    monkeypatch.setenv("MINITE_ATTENTION_BACKWARD", "recompute")
    assert settings() is first  # read once
    settings.cache_clear()
    assert settings().attention_backward == "recompute"
    with overridden(attention_backward="direct", strict_backend="triton") as inside:
        assert settings() is inside and (inside.attention_backward, inside.strict_backend) == ("direct", "triton")
        with overridden(attention_backward="recompute"):
            assert (settings().attention_backward, settings().strict_backend) == ("recompute", "triton")
        assert settings() is inside
    assert settings().attention_backward == "recompute" and settings().strict_backend is None
    with pytest.raises(TypeError):
        with overridden(no_such_field=1):
            pass


def test_a_bad_variable_fails_the_first_read(monkeypatch):
    from minite_megatron.nvfp4.backends import get_backend, invariant_backend

    monkeypatch.setenv("MINITE_STRICT_BACKEND", "no backend")
    settings.cache_clear()
    with pytest.raises(SettingsError, match="^MINITE_STRICT_BACKEND='no backend'"):
        get_backend(None, "cpu")
    monkeypatch.setenv("MINITE_STRICT_BACKEND", "torch")  # a name, but not a backend's: the lookup says so
    monkeypatch.setenv("MINITE_BACKEND", "nosuch")
    settings.cache_clear()
    with pytest.raises(ValueError, match="^MINITE_BACKEND='nosuch': unknown NVFP4 backend; known: reference"):
        get_backend(None, "cpu")
    with pytest.raises(ValueError, match="^MINITE_STRICT_BACKEND='torch': unknown NVFP4 backend; known: reference"):
        invariant_backend("cpu")


def test_exported_variables_are_listed(monkeypatch):
    monkeypatch.delenv("NO_VCS_VERSION", raising=False)
    assert settings_module.export_default("NO_VCS_VERSION", "1")
    assert not settings_module.export_default("NO_VCS_VERSION", "2")  # set already: left alone
    assert settings_module.environment()["NO_VCS_VERSION"] == "1"
    assert "NO_VCS_VERSION" not in settings_module.environment(without=("NO_VCS_VERSION",))
    settings_module.unexport("NO_VCS_VERSION")
    assert "NO_VCS_VERSION" not in settings_module.environment()
    with pytest.raises(ValueError, match="not listed in settings.EXPORTED"):
        settings_module.export_default("SOMETHING_ELSE", "1")


def test_the_architecture_page_holds_the_table():
    """docs/architecture.md's table is the dataclass's (regenerate: ``python -m minite_megatron.settings``)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("<!-- settings table (python -m minite_megatron.settings) -->\n")
    end = text.index("<!-- end of the settings table -->")
    doc = text[start:end].split("\n", 1)[1].strip()
    assert doc == table(), "docs/architecture.md's environment table differs from Settings: regenerate it"


def test_the_readme_links_the_table():
    assert "docs/architecture.md#the-environment" in (ROOT / "README.md").read_text()
