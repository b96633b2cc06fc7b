"""The serving tests run in the second environment (.venv-vllm, scripts/setup_vllm_env.sh) where the
real vllm package is installed; in the main environment they skip."""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: run scripts/test_vllm.sh (.venv-vllm)")
