"""The RL example runs end to end (real Megatron-Core, NVFP4 learner and rollout engine)."""

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_rl_grpo_strict_has_zero_gap(tmp_path):
    code = (
        "import json, sys; sys.argv = ['rl_grpo.py']; sys.path.insert(0, 'examples');"
        "import rl_grpo; out = rl_grpo.main(['--steps', '2', '--pretrain-steps', '2', '--prompts', '4', '--group', '2',"
        " '--new-tokens', '6', '--strict', '--no-progress', '--tensorboard', sys.argv[0] and %r]);"
        "print('HISTORY=' + json.dumps(out['history']))" % str(tmp_path / "tb")
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    line = next(l for l in res.stdout.splitlines() if l.startswith("HISTORY="))
    history = json.loads(line[len("HISTORY="):])
    assert len(history) == 2
    for h in history:
        assert h["rollout_corr/train_rollout_logprob_abs_diff"] == 0.0
        assert h["rollout_corr/logprob_abs_diff_max"] == 0.0
        assert 0.0 <= h["reward"] <= 1.0
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "tb").iterdir())
