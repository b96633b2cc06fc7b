"""``python -m benchmarks.seeds_comparison`` on a CPU: the rows' Megatron arguments (same model
and parallel layout, only the implementation flags differ; the minite row passes Megatron's
real parser and miniTE's checks), the dry run, each row's refusal with its reason, and the
parser of Megatron's log lines. No number is produced here: the runs need 8 Blackwell GPUs."""

from __future__ import annotations

import sys

import pytest

from benchmarks import seeds_comparison as sc

KW = dict(layers=4, iters=10, micro_batch=1, global_batch=16, seq_length=4096)


@pytest.fixture(scope="module")
def base():
    return sc.config_args()


def _without(argv, *flags_with_values, bare=()):
    out, i = [], 0
    while i < len(argv):
        if argv[i] in flags_with_values:
            i += 2
            continue
        if argv[i] not in bare:
            out.append(argv[i])
        i += 1
    return out


def test_rows_share_model_and_layout_and_differ_only_in_the_implementation(base):
    rows = {r: sc.training_args(r, base, **KW) for r in ("minite", "minite_strict", "te_bf16", "te_nvfp4")}
    m = rows["minite"]
    assert m[m.index("--transformer-impl") + 1] == "minite" and m[m.index("--num-layers") + 1] == "4"
    for flag, value in (("--expert-model-parallel-size", "8"), ("--tensor-model-parallel-size", "1"),
                        ("--num-experts", "128"), ("--hidden-size", "2048"), ("--global-batch-size", "16")):
        for argv in rows.values():
            assert argv[argv.index(flag) + 1] == value and argv.count(flag) == 1
    assert rows["te_bf16"][rows["te_bf16"].index("--transformer-impl") + 1] == "transformer_engine"
    assert "--fp4-recipe" not in rows["te_bf16"] and "--fp4-recipe" not in m
    n = rows["te_nvfp4"]
    assert n[n.index("--fp4-format") + 1] == "e2m1" and n[n.index("--fp4-recipe") + 1] == "nvfp4"
    assert "--minite-strict" in rows["minite_strict"] and "--minite-strict" not in m
    common = _without(m, "--transformer-impl")
    assert _without(rows["te_bf16"], "--transformer-impl") == common
    assert _without(rows["te_nvfp4"], "--transformer-impl", "--fp4-format", "--fp4-recipe") == common
    assert _without(rows["minite_strict"], "--transformer-impl", bare=("--minite-strict",)) == common
    assert m.count("--vocab-size") == 1 and "--log-throughput" in m and "--log-memory-interval" in m


def test_minite_row_passes_megatrons_parser_and_minites_checks(base, monkeypatch):
    from minite_megatron import cpu_compat, megatron_args

    with cpu_compat.activated():
        megatron_args.install()
        try:
            from megatron.training import arguments

            monkeypatch.setenv("WORLD_SIZE", "8")
            monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *sc.training_args("minite_strict", base, **KW)])
            args = arguments.parse_args()
            arguments.validate_args(args, {})
            assert megatron_args.validate_minite_args(args) is None
        finally:
            megatron_args.uninstall()
    assert (args.num_layers, args.expert_model_parallel_size, args.train_iters) == (4, 8, 10)
    assert args.log_throughput and args.log_memory_interval == 1 and args.mock_data


def test_dry_run_prints_each_command_with_what_it_needs(capsys):
    assert sc.main(["--dry-run", "--layers", "4"]) == 0
    out = capsys.readouterr().out
    for row in sc.ROWS:
        assert f"# {row}: needs" in out
    assert "torchrun --standalone --nproc-per-node=8 -m minite_megatron.launch" in out
    assert f"Transformer Engine >= {sc.TE_FP4_MIN}" in out and "--fp4-recipe nvfp4" in out
    assert "minite_megatron.diagnostics.cli run --strict --preset qwen3-moe" in out


def test_every_row_is_refused_here_with_its_reason(capsys, tmp_path):
    """This CPU machine has no GPU and no TE: every row refused, exit 2, nothing measured."""
    code = sc.main(["--log-dir", str(tmp_path), "--no-save"], machine=sc.Machine(torchrun=True, te_error="ModuleNotFoundError"))
    out = capsys.readouterr().out
    assert code == 2
    assert out.count("refused: needs 8 CUDA GPUs, this machine has 0") == 4
    assert "refused: needs 1 CUDA GPU, this machine has 0" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "machine,row,reason",
    [
        (sc.Machine(gpus=8, capabilities=[(9, 0)] * 8, names=["H200"] * 8, torchrun=True, te_version="2.16.0"), "te_bf16", None),
        (sc.Machine(gpus=8, capabilities=[(9, 0)] * 8, names=["H200"] * 8, torchrun=True, te_version="2.16.0"), "te_nvfp4",
         "compute capability 10.0 or 10.3"),
        (sc.Machine(gpus=8, capabilities=[(10, 3)] * 8, names=["B300"] * 8, torchrun=True, te_version="2.6.1"), "te_nvfp4",
         "Transformer Engine >= 2.7.0 for --fp4-recipe nvfp4, found 2.6.1"),
        (sc.Machine(gpus=8, capabilities=[(10, 3)] * 8, names=["B300"] * 8, torchrun=True, te_error="ImportError: x"), "te_bf16",
         "does not import here (ImportError: x)"),
        (sc.Machine(gpus=4, capabilities=[(10, 0)] * 4, names=["B200"] * 4, torchrun=True), "minite", "needs 8 CUDA GPUs, this machine has 4"),
        (sc.Machine(gpus=8, capabilities=[(10, 0)] * 8, names=["B200"] * 8, torchrun=False), "minite", "torchrun"),
        (sc.Machine(gpus=1, capabilities=[(12, 0)], names=["RTX"], torchrun=True), "strict_gap", "RTX (12.0)"),
    ],
)
def test_refusal_reasons(machine, row, reason):
    got = sc.refusal(row, machine, 8)
    if reason is None:
        assert got is None
    else:
        assert reason in got


# Megatron's own log format (megatron/training/training.py training_log, utils report_memory).
_LOG = """\
 [2026-12-02 10:00:00.000000] iteration        1/      10 | consumed samples:           16 | elapsed time per iteration (ms): 90000.0 | throughput per GPU (TFLOP/s/GPU): 10.0 | learning rate: 1.000000E-05 | global batch size:    16 | lm loss: 1.2E+01 |
[Rank 0] (after 1 iterations) memory (MB) | allocated: 1000.00 | max allocated: 2048.00 | reserved: 3000.00 | max reserved: 3000.00
 [2026-12-02 10:00:01.000000] iteration        2/      10 | consumed samples:           32 | elapsed time per iteration (ms): 1000.0 | throughput per GPU (TFLOP/s/GPU): 400.0 | learning rate: 1.000000E-05 | global batch size:    16 | lm loss: 1.1E+01 |
[Rank 0] (after 2 iterations) memory (MB) | allocated: 1000.00 | max allocated: 4096.00 | reserved: 5000.00 | max reserved: 5000.00
 [2026-12-02 10:00:02.000000] iteration        3/      10 | consumed samples:           48 | elapsed time per iteration (ms): 1200.0 | throughput per GPU (TFLOP/s/GPU): 350.0 | learning rate: 1.000000E-05 | global batch size:    16 | lm loss: 1.05E+01 |
 [2026-12-02 10:00:03.000000] iteration        4/      10 | consumed samples:           64 | elapsed time per iteration (ms): 1100.0 | throughput per GPU (TFLOP/s/GPU): 380.0 | learning rate: 1.000000E-05 | global batch size:    16 | lm loss: 1.0E+01 |
"""


def test_log_parser_reads_megatrons_lines_after_the_warmup():
    """A parser test on text in Megatron's format (not a measurement): median step time of
    iterations 2-4, tokens/s per GPU = 16 x 4096 / 1.1 s / 8, rank 0's peak allocation."""
    got = sc.parse_training_log(_LOG, warmup=1, seq_length=4096, world_size=8)
    assert got["iterations"] == 3 and got["step_ms"] == 1100.0 and got["tflops_per_gpu"] == 380.0
    assert got["tokens_per_s_per_gpu"] == pytest.approx(16 * 4096 / 1.1 / 8)
    assert got["peak_allocated_gib"] == 4.0 and got["last_loss"] == 10.0
    with pytest.raises(ValueError, match="after the first 4 iterations"):
        sc.parse_training_log(_LOG, warmup=4, seq_length=4096, world_size=8)


def test_bad_arguments_name_the_flag(capsys):
    for argv, flag in ((["--rows", "minite,tf32"], "--rows"), (["--warmup", "20", "--iters", "20"], "--warmup"),
                       (["--global-batch", "12"], "--global-batch"), (["--nproc", "3"], "--nproc")):
        with pytest.raises(SystemExit):
            sc.main(argv + ["--dry-run"])
        assert flag in capsys.readouterr().err
