#!/usr/bin/env bash
# Create .venv with Python >= 3.12 and install miniTE-Megatron with its test tools.
# Needs only the package registry: no GPU, no Transformer Engine, no CUTLASS.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  local c
  for c in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  # pyenv installs that are not the global version are not on PATH.
  for c in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
    if [ -x "$c" ] && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  return 1
}

PY=$(find_python) || { echo "setup.sh: Python >= 3.12 not found (megatron-core 0.19 needs it); set PYTHON=/path/to/python3.12" >&2; exit 1; }
echo "setup.sh: using $PY ($("$PY" --version))"
if [ ! -x .venv/bin/python ]; then
  # A clean install peaks at ~7.5 GB (torch's CUDA wheel and its libraries, pip's unpacked wheels, then
  # .venv-vllm): say so at once rather than fail minutes later with pip's "No space left on device".
  need_gib=${MINITE_MIN_FREE_GIB:-9}
  free_gib=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
  if [ "$free_gib" -lt "$need_gib" ]; then
    echo "setup.sh: only $free_gib GiB free on $(df -P . | awk 'NR == 2 {print $6}') for .venv; a clean install needs ~$need_gib GiB (set MINITE_MIN_FREE_GIB to change this check)" >&2
    exit 1
  fi
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt -e '.[test,cutlass]'
# upstream_warnings: no import-time notes of megatron-core, and its own version (not + this repository's git HEAD)
.venv/bin/python -c 'from minite_megatron.training import upstream_warnings; upstream_warnings.install()
import torch, megatron.core, minite_megatron; print(f"setup.sh: ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, minite_megatron {minite_megatron.__version__}")'
# The second test environment with the real vLLM for tests/serving (docs/serving.md); MINITE_SKIP_VLLM=1 skips it.
[ "${MINITE_SKIP_VLLM:-0}" = 1 ] || scripts/setup_vllm_env.sh
echo "setup.sh: done; the README's python / torchrun / minite-* commands run after: source .venv/bin/activate"
