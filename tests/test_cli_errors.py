"""Every command line of the project: bad input is one line naming the flag, file or value, exit
status 2, no usage dump, no traceback; a clean run prints no warning; runs resume as Megatron's do.

Pins (issue 27): ``--minite-activation-scale bogus`` printed 741 lines of Megatron's usage before
the one that mattered; the RL trainer gave ~21-line tracebacks for a corrupt, missing or mistyped
``--recipe`` (naming ``--minite-strict``, a flag it does not have), ``--preset nope`` and ``--load
/missing``; ``--load`` of a ``minite-convert`` checkpoint built the tiny preset and died with a
shape mismatch; a rerun of ``examples/train_tiny_moe.sh`` retrained from iteration 1, and more
iterations stopped with ``AssertionError: OptimizerParamScheduler ...`` naming no flag; ~10
upstream warnings per run and 2,319 in the test log; ``megatron-core 0.19.2+<our sha>``.

Subprocesses are few (CI has 2 cores): the main job twice (a few iterations, then resumed),
a conversion, the RL trainer twice, the launcher on the converted checkpoint, the export and
megatron-to-hf of the main job's checkpoint, one launcher refusal; everything else runs in
this process.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minite_megatron.training import upstream_warnings

ROOT = Path(__file__).resolve().parents[1]
WARNING = re.compile(r"warning|warn\(", re.IGNORECASE)
# the environment before any in-process test ran Megatron (it sets NVTE_* attention variables)
_CLEAN_ENV = {k: v for k, v in os.environ.items()
              if k not in ("PYTHONWARNINGS", "NO_VCS_VERSION") and not k.startswith(("NVTE_", "MASTER_", "TORCHELASTIC"))}


def _env(**extra) -> dict:
    return dict(_CLEAN_ENV, **extra)


def _run(argv, timeout=400, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=ROOT, env=_env(**env), capture_output=True, text=True,
                          timeout=timeout)


def _warnings(text: str) -> list[str]:
    return [line for line in text.splitlines() if WARNING.search(line)]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_error_line(stderr: str, prefix: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith(prefix)]
    assert len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr and "usage:" not in stderr, stderr[-3000:]
    return errors[0]


# ---- the warning list ---------------------------------------------------------------------------
def test_pytest_filters_the_same_upstream_warnings_as_the_entry_points():
    """setup.cfg's filterwarnings and upstream_warnings.PYTHON_WARNINGS must not drift apart."""
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in cfg["tool:pytest"]["filterwarnings"].splitlines() if line.strip()]
    assert lines == upstream_warnings.pytest_filterwarnings()
    for w in upstream_warnings.PYTHON_WARNINGS:
        assert w.source.startswith(("megatron/", "torch/")), w  # each names the upstream file it silences
        assert ":" not in w.message, w  # pytest's filter syntax splits on ':'
    with pytest.warns(UserWarning, match="ours"):  # anything else still shows
        import warnings

        warnings.warn("ours: not an upstream note", UserWarning)


def test_megatron_core_reports_its_own_version():
    """megatron-core's package_info appends ``git rev-parse HEAD`` of whatever repository holds the
    venv (this one); the entry points set NO_VCS_VERSION so the version is megatron-core's own."""
    proc = _run([sys.executable, "-c", "from minite_megatron.training import upstream_warnings; "
                 "upstream_warnings.install(); import megatron.core, importlib.metadata as m; "
                 "print(megatron.core.__version__, m.version('megatron-core'))"], timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, dist = proc.stdout.split()
    assert ours == dist and "+" not in ours, proc.stdout


# ---- the LR schedule on --load --------------------------------------------------------------------
def test_a_schedule_that_differs_from_the_checkpoint_names_the_flag():
    """Megatron's scheduler asserts ``class input value 1760 and checkpointvalue 1600``; the
    launcher's fix names --train-iters and the two flags that resolve it, and changes nothing else."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from minite_megatron.training import megatron_wheel

    class _Opt:
        param_groups = [{"lr": 0.0, "weight_decay": 0.0}]

    def sched(decay_steps, **kw):
        return OptimizerParamScheduler(_Opt(), init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1,
                                       lr_decay_steps=decay_steps, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                       wd_incr_steps=decay_steps, wd_incr_style="constant",
                                       use_checkpoint_opt_param_scheduler=False, **kw)

    saved = sched(1600).state_dict()
    megatron_wheel.apply()
    try:
        with pytest.raises(megatron_wheel.ScheduleMismatch) as info:
            sched(1760).load_state_dict(saved)
        message = str(info.value)
        assert "total number of iterations 1600" in message and "--train-iters" in message and "1760" in message
        assert "--override-opt_param-scheduler" in message and "\n" not in message
        s = sched(1760, override_opt_param_scheduler=True)
        s.load_state_dict(saved)
        assert s.lr_decay_steps == 1760 and s.num_steps == saved["num_steps"]
        same = sched(1600)
        same.load_state_dict(saved)  # an exact resume passes untouched
    finally:
        megatron_wheel.revert()


# ---- the main job: resume, no warning, export ---------------------------------------------------------
@pytest.fixture(scope="module")
def main_job(tmp_path_factory):
    """examples/train_tiny_moe.sh for 6 iterations, then rerun with ITERS=8 (resumed, with
    --override-opt_param-scheduler) and with ITERS=8 again (nothing to train)."""
    d = tmp_path_factory.mktemp("main_job")
    env = dict(PYTHON=sys.executable, RUN_DIR=str(d / "run"), DATA=str(d / "data" / "tiny"))
    fast = ["--lr-warmup-iters", "1", "--log-interval", "1"]
    first = _run(["examples/train_tiny_moe.sh", *fast], ITERS="6", **env)
    longer = _run(["examples/train_tiny_moe.sh", *fast], ITERS="8", **env)
    resumed = _run(["examples/train_tiny_moe.sh", *fast, "--override-opt_param-scheduler"], ITERS="8", **env)
    again = _run(["examples/train_tiny_moe.sh", *fast], ITERS="8", **env)
    return dict(dir=d, first=first, longer=longer, resumed=resumed, again=again)


def test_the_main_job_prints_no_warning(main_job):
    """A new warning (ours, or an upstream one not in upstream_warnings) fails here."""
    first = main_job["first"]
    assert first.returncode == 0, first.stderr[-3000:]
    assert _warnings(first.stderr) == [] and _warnings(first.stdout) == []
    log = (main_job["dir"] / "run" / "train.log").read_text()
    assert _warnings(log) == [], log[-3000:]


def test_the_main_job_resumes_like_megatron(main_job):
    """More ITERS without the flag: one line naming it; with it: iterations 7-8 only; at the end: nothing to do."""
    longer = main_job["longer"]
    assert longer.returncode == 2, longer.stderr[-3000:]
    line = _one_error_line(longer.stderr, "error:")
    assert "--override-opt_param-scheduler" in line and "--train-iters" in line
    resumed = main_job["resumed"]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stderr and _warnings(resumed.stderr) == [], resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (main_job["dir"] / "run" / "loss.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [7, 8]
    again = main_job["again"]
    assert again.returncode == 0 and "nothing to train" in again.stderr, again.stderr[-3000:]


def test_the_main_jobs_checkpoint_exports_and_converts_to_hf(main_job, tmp_path):
    """minite-export writes the learner's NVFP4 export and the HF config the tiny preset lacks;
    megatron-to-hf then needs no --hf-config, and transformers loads the result."""
    ckpt = main_job["dir"] / "run" / "checkpoints"
    out, cfg = tmp_path / "export", tmp_path / "hf_config"
    proc = _run([sys.executable, "-m", "minite_megatron.convert.export_cli", "--load", ckpt, "--out", out,
                 "--hf-config-out", cfg], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _warnings(proc.stderr) == [], proc.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "minite_nvfp4"
    assert config["num_hidden_layers"] == 4 and config["num_experts"] == 8
    hf_config = json.loads((cfg / "config.json").read_text())
    assert "quantization_config" not in hf_config and hf_config["hidden_size"] == 64

    from minite_megatron.export import load_modelopt

    loaded = load_modelopt(out)
    assert loaded  # the export reads back (its bitwise round trip: tests/export)
    hf = _run([sys.executable, "-m", "minite_megatron.convert", "megatron-to-hf", "--load", ckpt, "--out",
               tmp_path / "hf", "--no-progress"], timeout=300)
    assert hf.returncode == 0 and _warnings(hf.stderr) == [], hf.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.num_hidden_layers == 4 and model.config.hidden_size == 64


# ---- the launcher ---------------------------------------------------------------------------------
def test_the_launcher_refuses_a_bad_choice_in_one_line_without_usage():
    proc = _run([sys.executable, "-m", "minite_megatron.launch", "examples/pretrain_gpt.py", "--transformer-impl",
                 "minite", "--minite-activation-scale", "bogus"], timeout=300)
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr, "error:")
    assert line == "error: argument --minite-activation-scale: invalid choice: 'bogus' (choose from 'row', 'tensor')"
    assert _warnings(proc.stderr) == [], proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) == 1, proc.stderr[-3000:]


# ---- the RL trainer ---------------------------------------------------------------------------------
def _train_grpo():
    sys.path.insert(0, str(ROOT / "examples" / "rl"))
    import train_grpo

    return train_grpo


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "{corrupt}"], r"--recipe \S+corrupt.json: not valid JSON \(Expecting"),
    (["--recipe", "{missing}"], r"--recipe \S+missing.json: cannot read the recipe file \(No such file"),
    (["--recipe", "{strict_false}"], r'--recipe \S+strict.json: recipe field "strict" must be a boolean'),
    (["--preset", "nope"], r"--preset 'nope': choose one of \['qwen3-30b-a3b', 'qwen3-moe', 'tiny'\]"),
    (["--load", "/missing"], r"--load /missing: no such directory"),
    (["--load", "{empty}"], r"--load \S+empty: no Megatron checkpoint there"),
    (["--hf-checkpoint", "{empty}"], r"--hf-checkpoint \S+empty: \S+config.json does not exist"),
    (["--hf-checkpoint", "{empty}", "--preset", "tiny"], r"--preset and --hf-checkpoint both name the model"),
    (["--digits", "12"], r"--digits must lie in \[1, 8\], got 12"),
    (["--steps", "x"], r"argument --steps/--num-rollout: invalid int value: 'x'"),
    (["--group", "1"], r"--group 1: group-relative advantages"),
    (["--no-such-flag"], r"unrecognized arguments: --no-such-flag"),
])
def test_the_rl_trainer_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    files = {"corrupt": tmp_path / "corrupt.json", "missing": tmp_path / "missing.json",
             "strict_false": tmp_path / "strict.json", "empty": tmp_path / "empty"}
    files["corrupt"].write_text('{"strict": tru')
    files["strict_false"].write_text('{"strict": "false"}')
    files["empty"].mkdir()
    argv = [a.format(**files) for a in argv] + ["--log-dir", str(tmp_path / "log"), "--no-tensorboard"]
    with pytest.raises(SystemExit) as info:
        _train_grpo()._run_cli(argv)
    assert info.value.code == 2
    line = _one_error_line(capsys.readouterr().err, "train_grpo.py: error: ")
    assert re.search(message, line), line
    assert "--minite-" not in line  # this script's flags, not the launcher's


def test_the_rl_trainer_trains_from_a_converted_transformers_model_by_load_alone(tmp_path):
    """``minite-convert hf-to-megatron`` of a transformers Qwen3-MoE, then ``train_grpo.py --load``
    with no model flag: the model is the checkpoint's (not the tiny preset: it was a shape
    mismatch), the run prints no warning, a rerun with the same --save resumes, and more --steps
    names --override-opt-param-scheduler; the launcher with --load alone trains the same model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=128, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, mlp_only_layers=[0], norm_topk_prob=True))
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    conv = _run([sys.executable, "-m", "minite_megatron.convert", "hf-to-megatron", "--hf-dir", tmp_path / "hf",
                 "--out", tmp_path / "ckpt", "--no-progress"], timeout=300)
    assert conv.returncode == 0, conv.stderr[-3000:]
    assert _warnings(conv.stderr + conv.stdout) == [], conv.stderr[-3000:]

    rl = [sys.executable, "examples/rl/train_grpo.py", "--sft-steps", "2", "--eval-size", "16", "--rollout-batch-size",
          "4", "--mini-batch-size", "4", "--no-plot", "--no-progress", "--no-tensorboard",
          "--log-dir", tmp_path / "log", "--save", tmp_path / "rl"]
    first = _run([*rl, "--load", tmp_path / "ckpt", "--steps", "1"], timeout=400)
    assert first.returncode == 0, first.stderr[-3000:]
    out = first.stdout + first.stderr
    assert _warnings(out) == [], out[-3000:]
    assert "loaded the weights of" in out and "1 RL steps" in out, out[-3000:]
    summary = json.loads((tmp_path / "log" / "summary.json").read_text())
    assert summary["model"]["hf_config"]["hidden_size"] == 128  # the checkpoint's model, not the preset's 64

    # the launcher: --load alone (no architecture flag) builds the converted model too
    launch = _run([sys.executable, "-m", "minite_megatron.launch", "examples/pretrain_gpt.py", "--transformer-impl",
                   "minite", "--load", tmp_path / "ckpt", "--mock-data", "--seq-length", "16", "--micro-batch-size", "2",
                   "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-4", "--attention-backend", "unfused",
                   "--eval-iters", "0", "--eval-interval", "2", "--vocab-size", "128"], timeout=400,
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    assert launch.returncode == 0, launch.stderr[-3000:]
    assert "adding --use-checkpoint-args" in launch.stderr, launch.stderr[-3000:]
    assert re.search(r"^ +hidden_size \.+ 128$", launch.stdout, re.M), launch.stdout[-3000:]  # the checkpoint's
    assert re.search(r"iteration +\d+/ +2 \|.* lm loss", launch.stdout), launch.stdout[-3000:]
    assert _warnings(launch.stderr) == [], launch.stderr[-3000:]

    more = _run([*rl, "--steps", "2"], timeout=400)  # no --load: resumes from --save
    assert more.returncode == 2, more.stderr[-3000:]
    line = _one_error_line(more.stderr, "train_grpo.py: error: ")
    assert "--override-opt-param-scheduler" in line and str(tmp_path / "rl") in line


# ---- minite-convert, minite-export, minite-diagnose, the benchmarks -------------------------------------
def test_convert_export_and_diagnose_refuse_bad_input_in_one_line(tmp_path, capsys):
    from minite_megatron.convert import cli as convert_cli
    from minite_megatron.convert import export_cli
    from minite_megatron.diagnostics import cli as diagnose_cli

    def refused(fn, argv, prefix, pattern):
        try:
            code = fn(argv)
        except SystemExit as e:  # argparse's errors
            code = e.code
        assert code == 2
        line = _one_error_line(capsys.readouterr().err, prefix)
        assert re.search(pattern, line), line

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    refused(convert_cli.main, ["hf-to-megatron"], "minite-convert hf-to-megatron: error:", "required: --hf-dir, --out")
    refused(convert_cli.main, ["hf-to-megatron", "--hf-dir", str(tmp_path / "no"), "--out", str(tmp_path / "o")],
            "minite-convert: error:", r"\S+/no is not a directory")
    refused(convert_cli.main, ["megatron-to-hf", "--load", "/missing", "--out", str(tmp_path / "o")],
            "minite-convert: error:", "--load /missing: /missing is not a directory")
    refused(export_cli.main, ["--load", "/missing", "--out", str(tmp_path / "o")], "minite-export: error:",
            "--load /missing: /missing is not a directory")
    refused(export_cli.main, ["--load", str(tmp_path), "--out", str(tmp_path / "full")], "minite-export: error:",
            r"--out \S+full exists and is not an empty directory")
    refused(export_cli.main, ["--load", str(tmp_path), "--out", str(tmp_path / "o"), "--variant", "modelopt-w4a4-static"],
            "minite-export: error:", "needs calibrated activation amaxes")
    refused(export_cli.main, ["--load", str(tmp_path), "--out", str(tmp_path / "o"), "--variant", "fp8"],
            "minite-export: error:", "argument --variant: invalid choice: 'fp8'")
    refused(diagnose_cli.main, ["bogus"], "minite-diagnose: error:", "argument command: invalid choice: 'bogus'")
    refused(diagnose_cli.main, ["gap", str(tmp_path / "a.pt")], "minite-diagnose gap: error:",
            "the following arguments are required: rollout")


def test_a_benchmarks_bad_flag_is_one_line():
    proc = _run([sys.executable, "-m", "benchmarks.kernels", "--sections", "refit_bytes", "--no-such-flag"], timeout=120)
    assert proc.returncode == 2
    assert "--no-such-flag" in _one_error_line(proc.stderr, "python -m benchmarks.kernels: error:")
