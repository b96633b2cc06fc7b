#!/usr/bin/env bash
# Run the test suite (CPU: GPU tests skip with a reason; Triton kernels run under TRITON_INTERPRET=1).
# Extra arguments go to pytest, e.g. `scripts/test.sh tests/nvfp4 -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -ra "$@"
