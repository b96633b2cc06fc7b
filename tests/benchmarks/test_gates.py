"""``--gate MODULE.NAME=true|false`` of the benchmarks (``benchmarks._timing.gates_set``): a gated-off
path is measured in the same command as the default, the gate is recorded in the JSON line, it is
put back after the run, and a typo is one error line instead of the default measured under another
label."""

import json

import pytest

from benchmarks._timing import gates_set
from minite_megatron.ops import linear as gated

GATE = "minite_megatron.ops.linear.SHARED_DY_AMAX_GPU_VERIFIED"


def test_gate_is_set_for_the_body_and_put_back():
    before = gated.SHARED_DY_AMAX_GPU_VERIFIED
    with gates_set([f"{GATE}={'false' if before else 'true'}"]) as gates:
        assert gated.SHARED_DY_AMAX_GPU_VERIFIED is (not before)
        assert gates == {GATE: not before}
    assert gated.SHARED_DY_AMAX_GPU_VERIFIED is before
    with pytest.raises(RuntimeError), gates_set([f"{GATE}=1"]):
        raise RuntimeError("the benchmark failed")
    assert gated.SHARED_DY_AMAX_GPU_VERIFIED is before  # also after a failure


@pytest.mark.parametrize("spec, says", [
    (GATE, "expected MODULE.NAME=true|false"),
    (f"{GATE}=yes", "expected MODULE.NAME=true|false"),
    ("SHARED_DY_AMAX_GPU_VERIFIED=true", "expected MODULE.NAME=true|false"),
    ("minite_megatron.modules.no_such_module.X=true", "does not import"),
    ("minite_megatron.ops.linear.SHARED_DY_AMAX_GPU_VERIFID=true", "no bool attribute 'SHARED_DY_AMAX_GPU_VERIFID'"),
    ("minite_megatron.ops.linear.torch=true", "no bool attribute 'torch'"),
])
def test_bad_gate_is_one_line_naming_the_flag(spec, says):
    before = gated.SHARED_DY_AMAX_GPU_VERIFIED
    with pytest.raises(SystemExit) as e, gates_set([f"{GATE}={'false' if before else 'true'}", spec]):
        pass
    msg = str(e.value)
    assert msg.startswith(f"--gate {spec!r}") and says in msg and "\n" not in msg, msg
    assert gated.SHARED_DY_AMAX_GPU_VERIFIED is before  # the first, valid gate was put back


def test_learner_step_records_the_gate_and_puts_it_back(tmp_path):
    from benchmarks import learner_step

    before = gated.SHARED_DY_AMAX_GPU_VERIFIED
    value = "false" if before else "true"
    learner_step.main(["--smoke", "--variants", "bf16", "--iters", "1", "--warmup", "1", "--gate", f"{GATE}={value}",
                       "--out", str(tmp_path), "--json-dir", str(tmp_path)])
    line = json.loads((tmp_path / "learner_step.jsonl").read_text().splitlines()[-1])
    assert line["gates"] == {GATE: not before}
    assert gated.SHARED_DY_AMAX_GPU_VERIFIED is before


def test_device_session_gates_name_existing_gates():
    """Every ``--gate`` of ``benchmarks/device_session.sh`` names an existing bool gate: a typo there
    would spend scarce device time measuring the default under the gate's name (it would stop with
    the one error line, after the machine's start)."""
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parents[2] / "benchmarks" / "device_session.sh").read_text()
    specs = re.findall(r"--gate (\S+)", script)
    assert specs, "device_session.sh: no --gate found (the 'pending' step sets its gates with it)"
    for spec in specs:
        with gates_set([spec]) as gates:
            assert list(gates) == [spec.partition("=")[0]]


def test_rollout_rolled_dense_strict_is_its_gate(monkeypatch):
    """``benchmarks.rollout --rolled-dense-strict`` sets the same gate as its ``--gate`` spelling:
    for the run, recorded, put back after."""
    from benchmarks import rollout
    from minite_kernels.triton import decode_gemm

    seen = {}
    monkeypatch.setattr(rollout, "_main", lambda argv, gates: seen.update(
        gates=gates, during=decode_gemm.ROLLED_DENSE_STRICT_VERIFIED))
    before = decode_gemm.ROLLED_DENSE_STRICT_VERIFIED
    rollout.main(["--rolled-dense-strict"])
    assert seen == {"gates": {"minite_kernels.triton.decode_gemm.ROLLED_DENSE_STRICT_VERIFIED": True}, "during": True}
    assert decode_gemm.ROLLED_DENSE_STRICT_VERIFIED is before
