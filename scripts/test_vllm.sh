#!/usr/bin/env bash
# The serving tests inside the real vLLM (.venv-vllm from scripts/setup_vllm_env.sh), CPU only.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-ERROR}
exec .venv-vllm/bin/python -m pytest -q -ra -p no:cacheprovider tests/serving "$@"
