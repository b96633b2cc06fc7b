"""The megatron-core patches in ``patches/`` still apply to the installed wheel, and the launcher's
run-time application installs exactly what they change (``minite_megatron.training.upstream_patches``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from minite_megatron.training import upstream_patches

ROOT = Path(__file__).resolve().parents[2]


def _installed_version() -> str:
    from megatron.core import package_info

    return str(package_info.__version__)


def _patches():
    found = upstream_patches.patches_for(_installed_version())
    assert found, f"no patches/ directory for the installed megatron-core {_installed_version()}"
    return found


def _site_packages() -> Path:
    import megatron.core  # (``megatron`` itself is a namespace package)

    return Path(megatron.core.__file__).resolve().parents[2]


@pytest.mark.parametrize("patch", _patches(), ids=lambda p: p.name)
def test_patch_applies_to_the_installed_wheel(patch, tmp_path):
    """``git apply --check`` on a copy of the files the patch names (never the venv itself)."""
    for fp in upstream_patches.parse_patch(patch.read_text()):
        dst = tmp_path / fp.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(_site_packages() / fp.path, dst)
    proc = subprocess.run(["git", "apply", "--check", str(patch)], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_in_memory_application_equals_git_apply(tmp_path):
    """The run-time applier produces the same text as ``git apply`` for every patched file."""
    for patch in _patches():
        for fp in upstream_patches.parse_patch(patch.read_text()):
            dst = tmp_path / patch.stem / fp.path
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(_site_packages() / fp.path, dst)
            ours, _ = upstream_patches.apply_hunks((_site_packages() / fp.path).read_text(), fp)
            subprocess.run(["git", "apply", str(patch)], cwd=tmp_path / patch.stem, check=True, capture_output=True)
            assert dst.read_text() == ours, f"{patch.name}: {fp.path}"


def test_run_time_application_installs_the_fixes():
    applied = upstream_patches.apply()
    assert applied == upstream_patches.apply()  # idempotent
    installed = [name for names in applied.values() for name in names]
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    assert any("ChainedOptimizer._regroup_saved_sub_optimizers (added)" in n for n in installed)
    assert callable(ChainedOptimizer._regroup_saved_sub_optimizers)
    assert "patched at run time" in ChainedOptimizer.load_state_dict.__code__.co_filename
    assert "patched at run time" in DistributedOptimizer.state_dict.__code__.co_filename
    # the decorator the patch adds is in effect (torch.no_grad wraps the replaced method)
    wrapped = DistributedOptimizer.load_parameter_state_from_dp_reshardable
    assert getattr(wrapped, "__wrapped__", None) is not None


def test_a_patch_that_no_longer_applies_is_refused_naming_the_hunk():
    patch = _patches()[0]
    fp = upstream_patches.parse_patch(patch.read_text())[0]
    with pytest.raises(upstream_patches.PatchError, match="does not apply"):
        upstream_patches.apply_hunks("def unrelated():\n    pass\n", fp)


def test_every_patch_is_reported_in_the_readme():
    readme = (ROOT / "patches" / "README.md").read_text()
    for patch in _patches():
        assert patch.name in readme, f"{patch.name} is not described in patches/README.md"
