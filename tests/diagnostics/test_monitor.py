"""GapMonitor: console line, real tensorboard event files, threshold alerts."""

import logging

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.tensorboard import SummaryWriter

from minite_megatron.diagnostics import GapAlert, GapMonitor, gap_metrics


def _batch(gap: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    learner = -torch.rand(2, 6, generator=g)
    rollout = learner.clone()
    rollout[0, 0] += gap
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    return learner, rollout, mask


def test_update_logs_metrics_and_scalars_to_tensorboard(tmp_path, caplog):
    writer = SummaryWriter(log_dir=str(tmp_path))
    lines = []
    mon = GapMonitor(threshold=1.0, writer=writer, print_fn=lines.append)
    with caplog.at_level(logging.INFO, logger="minite_megatron.diagnostics.monitor"):
        for step in range(3):
            out = mon.update(step, *_batch(1e-3 * (step + 1)), loss=torch.tensor(0.5 - 0.1 * step), reward=0.25 * step)
    writer.close()
    assert out["train/loss"] == pytest.approx(0.3) and out["train/reward"] == 0.5
    assert out["rollout_corr/logprob_abs_diff_max"] == pytest.approx(3e-3, rel=1e-3)
    assert mon.alerts == 0 and mon.updates == 3
    assert lines[0].startswith("step 0 | loss 0.5 | reward 0 | |dlogp| mean")
    assert any("step 2" in r.message for r in caplog.records)

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/reward", "rollout_corr/k3_kl", "rollout_corr/token_mult_prob_error",
                "rollout_corr/train_rollout_logprob_abs_diff", "training/rollout_probs_diff_mean"):
        assert tag in tags, tag
    ev = acc.Scalars("rollout_corr/logprob_abs_diff_max")
    assert [e.step for e in ev] == [0, 1, 2]
    want = gap_metrics(*_batch(2e-3))["rollout_corr/logprob_abs_diff_max"]
    assert ev[1].value == pytest.approx(want, rel=1e-6)  # tensorboard stores fp32


def test_threshold_alerts_count_warn_and_raise(tmp_path, caplog):
    writer = SummaryWriter(log_dir=str(tmp_path))
    mon = GapMonitor(threshold={"rollout_corr/logprob_abs_diff_max": 1e-2, "rollout_corr/k3_kl": 1.0}, writer=writer)
    with caplog.at_level(logging.WARNING, logger="minite_megatron.diagnostics.monitor"):
        mon.update(0, *_batch(1e-3))
        mon.update(1, *_batch(5e-2))
        mon.update(2, *_batch(6e-2))
    writer.close()
    assert mon.alerts == 2 and mon.alerts_by_key == {"rollout_corr/logprob_abs_diff_max": 2}
    warn = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 2 and "rollout_corr/logprob_abs_diff_max" in warn[0] and "> 0.01" in warn[0]
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("rollout_corr/alerts")] == [(1, 1.0), (2, 2.0)]

    strict = GapMonitor(threshold=0.0, raise_on_alert=True)
    strict.update(0, *_batch(0.0))  # exactly equal: 0 > 0 is false, no alert
    with pytest.raises(GapAlert, match="logprob_abs_diff_mean"):
        strict.update(1, *_batch(1e-7))
    assert strict.alerts == 1


def test_log_every_and_bad_configuration(caplog):
    mon = GapMonitor(log_every=2)
    with caplog.at_level(logging.INFO, logger="minite_megatron.diagnostics.monitor"):
        for step in range(4):
            mon.update(step, *_batch(1e-3))
    assert [r.message.split(" |")[0] for r in caplog.records] == ["step 0", "step 2"]
    with pytest.raises(ValueError, match="log_every"):
        GapMonitor(log_every=0)
    with pytest.raises(ValueError, match=">= 0"):
        GapMonitor(threshold=-1.0)
    with pytest.raises(TypeError, match="add_scalar"):
        GapMonitor(writer=object())
    with pytest.raises(KeyError, match="not a computed metric"):
        GapMonitor(threshold={"rollout_corr/nope": 1.0}).update(0, *_batch(1e-3))
    with pytest.raises(ValueError, match="single numbers"):
        GapMonitor().update(0, *_batch(1e-3), loss=torch.zeros(2))
