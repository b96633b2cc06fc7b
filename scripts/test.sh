#!/usr/bin/env bash
# Run the test suite (CPU: GPU tests skip with a reason; Triton kernels run under TRITON_INTERPRET=1).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/nvfp4 -x`. Without arguments, the serving
# tests then run inside the real vLLM too (scripts/test_vllm.sh, .venv-vllm), unless MINITE_SKIP_VLLM=1.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -gt 0 ] || [ "${MINITE_SKIP_VLLM:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
.venv/bin/python -m pytest -q -ra
scripts/test_vllm.sh
