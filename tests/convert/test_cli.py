"""``minite-convert``: the torch_dist checkpoint it writes trains in ``megatron.training`` (the first
iteration's loss is the HF model's loss on that batch), converts back to the original BF16 bits,
and every bad input gives one line and exit status 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minite_megatron.convert.cli import main
from minite_megatron.testing import assert_bitwise_equal
from tests.megatron._dist import free_port

from .conftest import COMMON, MOE, load_hf
from .test_import import FP32_TOL, _hf_tensors

pytestmark = pytest.mark.usefixtures("single_process")
ROOT = Path(__file__).resolve().parents[2]
SEQ = 32
PERIOD = [108, 80, 64, 34, 39, 5, 9, 2, 22, 103, 82, 115, 63, 77, 123, 92]
"""Every document of the corpus is this sequence; its period divides the sequence length, so every
training sample Megatron cuts out of the corpus is the same ``SEQ + 1`` tokens."""


def _corpus(prefix: Path) -> list[int]:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for _ in range(64):
        builder.add_document(np.array(PERIOD, dtype=np.uint16), [len(PERIOD)])
    builder.finalize(str(prefix) + ".idx")
    return (PERIOD * (SEQ // len(PERIOD) + 1))[: SEQ + 1]


def _pretrain(load_flags: list[str], data: Path, loss_log: Path) -> subprocess.CompletedProcess:
    """Two iterations of examples/pretrain_gpt.py on the local spec, FP32, with the HF model's architecture."""
    e = MOE
    args = [
        "--transformer-impl", "local", "--num-layers", e["num_hidden_layers"], "--hidden-size", e["hidden_size"],
        "--ffn-hidden-size", e["intermediate_size"], "--num-attention-heads", e["num_attention_heads"],
        "--group-query-attention", "--num-query-groups", e["num_key_value_heads"], "--kv-channels", e["head_dim"],
        "--qk-layernorm", "--num-experts", e["num_experts"], "--moe-router-topk", e["num_experts_per_tok"],
        "--moe-ffn-hidden-size", e["moe_intermediate_size"], "--moe-layer-freq", "[0,1]",
        "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "aux_loss",
        "--moe-aux-loss-coeff", "0.001", "--moe-router-dtype", "fp32", "--normalization", "RMSNorm",
        "--norm-epsilon", e["rms_norm_eps"], "--swiglu", "--disable-bias-linear", "--position-embedding-type", "rope",
        "--rotary-base", int(e["rope_theta"]), "--untie-embeddings-and-output-weights", "--attention-backend", "unfused",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--no-rope-fusion", "--no-persist-layer-norm",
        "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion", "--seq-length", SEQ, "--max-position-embeddings", e["max_position_embeddings"],
        "--micro-batch-size", 2, "--global-batch-size", 2, "--train-iters", 2, "--lr", "1e-3", "--seed", 1234,
        "--data-path", data, "--split", "100,0,0", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", COMMON["vocab_size"] - 1,  # NullTokenizer adds the EOD id: 128 ids, no padding
        "--num-workers", 0, "--eval-iters", 0, "--eval-interval", 1000, "--log-interval", 1, "--loss-log", loss_log,
        *load_flags,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NVTE_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "minite_megatron.launch", str(ROOT / "examples" / "pretrain_gpt.py"),
                           *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.multiproc
def test_converted_checkpoint_trains_in_megatron_training_from_the_hf_loss(hf_moe_dir, tmp_path, capsys):
    """hf-to-megatron -> ``pretrain_gpt.py --load DIR`` (megatron.training's loader: the tracker
    file, ``release/``, the common state's args and checkpoint version) -> iteration 1's loss is
    the HF model's loss on that batch, iteration 2's is lower; megatron-to-hf of the converted
    checkpoint gives back the HF BF16 bits."""
    ckpt = tmp_path / "megatron"
    assert main(["hf-to-megatron", "--hf-dir", str(hf_moe_dir), "--out", str(ckpt), "--dtype", "fp32",
                 "--no-progress"]) == 0
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (ckpt / "release" / "metadata.json").is_file()
    sample = torch.tensor(_corpus(tmp_path / "corpus"))
    run = _pretrain(["--load", str(ckpt)], tmp_path / "corpus", tmp_path / "loss.jsonl")
    assert run.returncode == 0, run.stderr[-4000:]
    assert "loading release distributed checkpoint" in run.stdout + run.stderr
    losses = {r["iteration"]: r["lm loss"] for r in map(json.loads, (tmp_path / "loss.jsonl").read_text().splitlines())}
    with torch.no_grad():
        logits = load_hf(hf_moe_dir)(sample[None, :SEQ]).logits[0]
    hf_loss = torch.nn.functional.cross_entropy(logits, sample[1:]).item()
    assert abs(losses[1] - hf_loss) <= FP32_TOL * hf_loss, (losses, hf_loss)
    assert losses[2] < losses[1]

    back = tmp_path / "hf_back"
    assert main(["megatron-to-hf", "--load", str(ckpt), "--out", str(back), "--max-shard-size", "60KB",
                 "--no-progress"]) == 0
    src, got = _hf_tensors(hf_moe_dir), _hf_tensors(back)
    assert sorted(got) == sorted(src)
    for name in src:
        assert_bitwise_equal(got[name], src[name], name=name)
    assert "wrote" in capsys.readouterr().out


def _bad_inputs(hf_moe_dir: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, a string the one error line must hold)."""

    def variant(name: str, edit) -> Path:
        d = tmp / name
        shutil.copytree(hf_moe_dir, d)
        edit(d)
        return d

    def set_config(**fields):
        def edit(d):
            cfg = json.loads((d / "config.json").read_text())
            cfg.update(fields)
            (d / "config.json").write_text(json.dumps(cfg))
        return edit

    def drop_from_index(d):
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        del idx["weight_map"]["model.layers.1.mlp.experts.3.down_proj.weight"]
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))

    index = json.loads((hf_moe_dir / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    h2m = ["hf-to-megatron", "--out", str(tmp / "out")]
    return {
        "missing directory": (h2m + ["--hf-dir", str(tmp / "nowhere")], "nowhere is not a directory"),
        "missing config": (h2m + ["--hf-dir", str(variant("noconfig", lambda d: (d / "config.json").unlink()))],
                           "config.json"),
        "index names a missing shard": (h2m + ["--hf-dir", str(variant("noshard", lambda d: (d / shard).unlink()))],
                                        f"names shard {shard}, which is missing"),
        "missing tensor": (h2m + ["--hf-dir", str(variant("notensor", drop_from_index))],
                           "lacks tensor model.layers.1.mlp.experts.3.down_proj.weight"),
        "shape mismatch": (h2m + ["--hf-dir", str(variant("shape", set_config(intermediate_size=80)))],
                           "mlp.gate_proj.weight in model-0000"),  # ... has shape [96, 64]; config.json implies [80, 64]
        "unsupported architecture": (h2m + ["--hf-dir", str(variant("llama", set_config(model_type="llama")))],
                                     "model_type='llama'"),
        "unsupported field": (h2m + ["--hf-dir", str(variant("swa", set_config(use_sliding_window=True)))],
                              "use_sliding_window"),
        "unknown field": (h2m + ["--hf-dir", str(variant("unknown", set_config(shared_expert_intermediate_size=64)))],
                          "'shared_expert_intermediate_size'"),
        "rope scaling": (h2m + ["--hf-dir", str(variant("yarn", set_config(rope_parameters={"rope_type": "yarn",
                                                                                          "rope_theta": 1e6})))],
                         "rope_parameters.rope_type='yarn'"),
        "parallel sizes without torchrun": (h2m + ["--hf-dir", str(hf_moe_dir), "--tp", "2"], "need torchrun"),
        "not a Megatron checkpoint": (["megatron-to-hf", "--load", str(hf_moe_dir), "--out", str(tmp / "o")],
                                      "latest_checkpointed_iteration.txt"),
    }


def test_bad_input_gives_one_line_and_exit_status_2(hf_moe_dir, tmp_path, capsys):
    """Pins: each bad input stops the CLI before any model is built, with one line on stderr that
    names the file, field, flag or tensor (no traceback), and exit status 2."""
    for case, (argv, needle) in _bad_inputs(hf_moe_dir, tmp_path).items():
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, case
        assert err.startswith("minite-convert: error: ") and "\n" not in err, (case, err)
        assert needle in err, (case, err)
    assert not (tmp_path / "out").exists()


def test_module_entry_point_exits_2_without_a_traceback(tmp_path):
    """``python -m minite_megatron.convert`` (what the ``minite-convert`` script runs)."""
    res = subprocess.run([sys.executable, "-m", "minite_megatron.convert", "hf-to-megatron", "--hf-dir",
                          str(tmp_path / "missing"), "--out", str(tmp_path / "out")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [f"minite-convert: error: {tmp_path / 'missing'} is not a directory"]
