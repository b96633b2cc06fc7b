"""Where a step's metrics go (on the logging rank): the console (one line through tqdm, so the
progress bar stays put), TensorBoard, a JSONL file (``repr``-exact floats: resumed runs are
compared with it), and at the end a PNG of the reward and held-out accuracy curves."""

from __future__ import annotations

import json
import math
import os

CONSOLE = (
    ("critic/rewards/mean", "reward"),
    ("train/accuracy", "acc"),
    ("val/accuracy", "val_acc"),
    ("actor/pg_loss", "pg_loss"),
    ("actor/pg_clipfrac", "clipfrac"),
    ("actor/ppo_kl", "ppo_kl"),
    ("actor/kl_loss", "kl"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad_norm"),
    ("response_length/mean", "resp_len"),
    ("rollout_corr/train_rollout_logprob_abs_diff", "gap"),
)
"""Console columns: (metric, label)."""

NONDETERMINISTIC_PREFIXES = ("perf/", "timing_s/")
"""Metrics that measure time (differ between otherwise identical runs)."""


class RunLog:
    """JSONL + TensorBoard + console for one run; a no-op object on non-logging ranks."""

    def __init__(self, log_dir: str | None, *, enabled: bool, tensorboard: bool, console):
        self.enabled = enabled and log_dir is not None
        self.console = console
        self.path = None
        self.writer = None
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.path = os.path.join(log_dir, "metrics.jsonl")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(log_dir, "tensorboard"))

    def write(self, record: dict) -> None:
        """Append one record (``{"step": s, "phase": ..., metric: value, ...}``)."""
        if not self.enabled:
            return
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.writer is not None:
            step = int(record["step"])
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step" and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()

    def line(self, record: dict) -> str:
        parts = [f"{record.get('phase', 'rl')} step {record['step']}"]
        for key, label in CONSOLE:
            v = record.get(key)
            if isinstance(v, float):
                parts.append(f"{label} {v:.4g}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def median(values) -> float:
    v = sorted(values)
    return v[len(v) // 2] if v else float("nan")


def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def versions() -> dict:
    """torch / triton / megatron-core / transformers versions (those importable)."""
    import importlib.metadata as md

    out = {}
    for name in ("torch", "triton", "megatron-core", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot_curves(jsonl_path: str, png_path: str, title: str) -> str:
    """Reward (training rollouts) and held-out greedy accuracy against the RL step, plus the
    learner/rollout gap on a log axis; returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(jsonl_path)
    rl = [r for r in records if r.get("phase") == "rl"]
    evals = [r for r in records if "val/accuracy" in r]
    fig, (ax, gx) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot([r["step"] for r in rl], [r["critic/rewards/mean"] for r in rl], label="reward (rollouts)", color="C0")
    if rl and "train/accuracy" in rl[0]:
        ax.plot([r["step"] for r in rl], [r["train/accuracy"] for r in rl], label="accuracy (rollouts)", color="C0",
                alpha=0.4, linestyle="--")
    ax.plot([r["step"] for r in evals], [r["val/accuracy"] for r in evals], "o-", label="held-out accuracy (greedy)",
            color="C1")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    key = "rollout_corr/train_rollout_logprob_abs_diff"
    gaps = [(r["step"], r[key]) for r in rl if key in r]
    positive = [(s, g) for s, g in gaps if g > 0]
    if positive:
        gx.semilogy([s for s, _ in positive], [g for _, g in positive], "o-", color="C2")
    zero = [s for s, g in gaps if g == 0]
    if zero:
        gx.plot(zero, [0.5] * len(zero), "s", color="C2", transform=gx.get_xaxis_transform(),
                label="exactly 0")
        gx.legend(loc="upper right")
    gx.set_xlabel("RL step")
    gx.set_title("learner vs rollout mean |dlogp|")
    gx.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path
