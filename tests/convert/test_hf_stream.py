"""A Hugging Face Qwen3-MoE checkpoint streamed into the resident NVFP4 model
(:mod:`minite_megatron.convert.hf_stream`) on the CPU: bit for bit the importer's full load
followed by the same quantization; one part's weights held at a time (measured on the tensors
read); one-line refusals before any weight is read. The checkpoint is a tiny random
``Qwen3MoeForCausalLM`` (2 layers, hidden 64, 8 experts top-2, vocabulary 256, qk-norm) written
by ``transformers`` in ~10 shards."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from minite_megatron.convert import ConvertError
from minite_megatron.convert.hf_stream import build_resident_gpt_from_hf
from minite_megatron.recipe import Recipe
from minite_megatron.rollout.resident import is_resident

from .hf_stream_cases import TINY, assert_same_rollouts, LiveBytes, assert_same_resident, importer_resident, save_tiny

pytestmark = pytest.mark.usefixtures("single_process")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("hf_tiny_moe"))


def _hf_bytes(path, prefix: str = "") -> int:
    """Bytes of the checkpoint's tensors whose names start with ``prefix``, from the shard headers."""
    from minite_megatron.convert.hf_files import HFCheckpoint

    ckpt = HFCheckpoint(path)
    return sum(2 * torch.Size(s).numel() for n, s in ckpt.shapes.items() if n.startswith(prefix))


@pytest.mark.parametrize("strict", [False, True])
def test_streamed_build_is_the_importer_bit_for_bit(tiny_dir, strict):
    """Every code, block scale, global scale and image of every quantized weight, and every BF16
    tensor (embedding, head, norms, router), equal in raw bits to loading the whole checkpoint
    with the importer and quantizing it; so are the learner's log-probs and the engine's rollouts
    on both, and in strict mode the rollouts' log-probs are the learner's (gap 0)."""
    assert len(list(tiny_dir.glob("*.safetensors"))) >= 6 and (tiny_dir / "model.safetensors.index.json").is_file()
    recipe = Recipe(strict=strict)
    res = build_resident_gpt_from_hf(tiny_dir, recipe, device="cpu", preset=TINY)
    ref = importer_resident(tiny_dir, recipe, "cpu")
    assert is_resident(res)
    assert assert_same_resident(res, ref) == 2 * 4  # per layer: qkv, proj, expert fc1, fc2
    w = res.decoder.layers[1].mlp.experts.linear_fc1.weight7
    assert w.stride() == (0, 0) and torch.isnan(w).all()
    assert_same_rollouts(res, ref, strict)


def test_one_part_is_held_at_a_time(tiny_dir):
    """The host tensors read and still alive (``weakref.finalize`` on each) never exceed one
    part: the largest layer's bytes, counted from the shard headers; all are freed at the end.
    The importer's full load, measured by the same hook, holds the whole checkpoint."""
    from minite_megatron.convert import build_gpt_from_hf, load_hf_weights

    live = LiveBytes()
    res = build_resident_gpt_from_hf(tiny_dir, device="cpu", preset=TINY, on_tensor=live)
    layer = max(_hf_bytes(tiny_dir, f"model.layers.{i}.") for i in range(TINY["layers"]))
    total = _hf_bytes(tiny_dir)
    report = res.minite_hf_stream
    assert [p for p, _ in report.parts][-2:] == ["decoder.layers.0.", "decoder.layers.1."]
    assert report.bytes_read == total and live.count > 0
    assert live.peak == report.largest_part_bytes == layer
    assert live.now == 0
    full = LiveBytes()
    load_hf_weights(build_gpt_from_hf(tiny_dir, impl="minite", device="cpu", dtype=torch.bfloat16), tiny_dir,
                    on_tensor=full)
    assert full.peak == total > 2.5 * layer


def _copy(src, dst, config=None, index=None):
    """``src`` copied to ``dst`` with ``config.json`` fields replaced and the index's
    ``weight_map`` edited (``{name: shard or None}``)."""
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if index:
        idx = json.loads((dst / "model.safetensors.index.json").read_text())
        for name, shard in index.items():
            if shard is None:
                del idx["weight_map"][name]
            else:
                idx["weight_map"][name] = shard
        (dst / "model.safetensors.index.json").write_text(json.dumps(idx))
    return dst


def _refused(path, match, preset=TINY):
    live = LiveBytes()
    with pytest.raises(ConvertError, match=match) as e:
        build_resident_gpt_from_hf(path, device="cpu", preset=preset, on_tensor=live)
    assert "\n" not in str(e.value)
    assert live.count == 0  # refused before any weight was read
    return str(e.value)


@pytest.mark.parametrize("fields, match", [
    ({"num_hidden_layers": 24}, r"config\.json: num_hidden_layers 24 != 2 \(the given preset\)"),
    ({"hidden_size": 128}, r"hidden_size 128 != 64"),
    ({"num_key_value_heads": 4}, r"num_key_value_heads 4 != 2"),
    ({"num_experts": 16, "num_local_experts": 16}, r"num_experts 16 != 8"),
    ({"num_experts_per_tok": 4}, r"num_experts_per_tok 4 != 2"),
    ({"moe_intermediate_size": 48}, r"moe_intermediate_size 48 != 32"),
    ({"vocab_size": 512}, r"vocab_size 512 != 256"),
    ({"mlp_only_layers": [0]}, r"make layers \[0\] dense"),
    ({"tie_word_embeddings": True}, r"tie_word_embeddings true != false"),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else None)
def test_config_of_other_shapes_is_refused_naming_the_field(tiny_dir, tmp_path, fields, match):
    cfg = json.loads((tiny_dir / "config.json").read_text())
    fields = {k: v for k, v in fields.items() if k in cfg or k != "num_local_experts"}
    _refused(_copy(tiny_dir, tmp_path / "c", config=fields), match)


def test_the_real_preset_names_its_fields(tiny_dir):
    """The qwen3-30b-a3b preset against a 2-layer checkpoint: the first field that differs."""
    _refused(tiny_dir, r"num_hidden_layers 2 != 48 \(the qwen3-30b-a3b preset\)", preset="qwen3-30b-a3b")


def test_missing_dir_index_shard_or_tensor_is_one_line(tiny_dir, tmp_path):
    _refused(tmp_path / "nowhere", r"nowhere is not a directory")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(tiny_dir / "config.json", bare / "config.json")
    _refused(bare, r"has neither model\.safetensors\.index\.json nor model\.safetensors")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    _refused(_copy(tiny_dir, tmp_path / "no_key", index={name: None}),
             rf"lacks tensor {re.escape(name)} .*model\.safetensors\.index\.json names no shard for it")
    idx = json.loads((tiny_dir / "model.safetensors.index.json").read_text())["weight_map"]
    other = next(s for s in sorted(set(idx.values())) if s != idx[name])
    _refused(_copy(tiny_dir, tmp_path / "wrong_shard", index={name: other}),
             f"places {re.escape(name)} in {re.escape(other)}, which does not hold it")
    gone = _copy(tiny_dir, tmp_path / "no_shard")
    (gone / idx[name]).unlink()
    _refused(gone, f"names shard {re.escape(idx[name])}, which is missing")


def _bench_args(path, out):
    return ["--preset", "tiny", "--hf-checkpoint", str(path), "--engines", "nvfp4", "--batches", "2", "--new", "3",
            "--prompt-min", "4", "--prompt-max", "8", "--kv-batch", "0", "--gap-batch", "2", "--rl-prompts", "1",
            "--rl-samples", "2", "--rl-new", "2", "--json", str(out)]


def test_rollout_full_runs_the_engine_on_a_checkpoint(tmp_path, monkeypatch):
    """``benchmarks/rollout_full.py --hf-checkpoint DIR`` (the tiny preset's shapes, on the CPU):
    the NVFP4 engine's rows on the checkpoint's weights, no section error, the JSON line names them."""
    import benchmarks.rollout_full as bench

    from .conftest import make_hf_model, save_hf

    path = save_hf(make_hf_model("moe", seed=2, mlp_only_layers=[], vocab_size=256), tmp_path / "hf",
                   max_shard_size="40KB")
    monkeypatch.setattr(bench, "save", lambda results, name, dirs: [])  # not into benchmarks/results/
    out = bench.main(_bench_args(path, tmp_path / "r.jsonl"))
    assert out["complete"] and out["weights"] == str(path.resolve())
    assert not [r for r in out["rows"] if "error" in r or "skipped" in r]
    timed = [r for r in out["rows"] if "decode_step_ms" in r]
    assert [r["batch"] for r in timed] == [2] and timed[0]["gap_tokens"] == 6
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[-1])["weights"] == str(path.resolve())


@pytest.mark.parametrize("extra, match", [
    ([], r"--hf-checkpoint \S+: \S+/config\.json: num_experts 8 != 4 \(the tiny preset\)$"),
    (["--layers", "1"], r"--layers cuts a random-weight model"),
])
def test_rollout_full_refuses_a_checkpoint_in_one_line(tiny_dir, tmp_path, capsys, extra, match):
    import benchmarks.rollout_full as bench

    with pytest.raises(SystemExit) as e:
        bench.main(_bench_args(tiny_dir, tmp_path / "r.jsonl") + extra)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(match, err), err
    assert not (tmp_path / "r.jsonl").exists()


def test_missing_tensor_of_a_single_file_checkpoint_names_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from .conftest import make_hf_model, save_hf

    path = save_hf(make_hf_model("moe", seed=3, mlp_only_layers=[], num_experts=8, vocab_size=256), tmp_path / "one")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_norm.weight"
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    _refused(path, rf"lacks tensor {re.escape(name)} .*model\.safetensors does not hold it")
