"""Bytes moved per refit (the RL loop's weight sync into vLLM), NVFP4 vs a BF16 learner: computed
from the shapes, not timed.

    python -m benchmarks.refit_bytes                  # qwen3-moe preset + Qwen3-30B-A3B, several layouts
    python -m benchmarks.refit_bytes --json benchmarks/results

Two legs (``minite_megatron.serving.refit.refit_traffic``, the counts that
``tests/serving/test_refit_sharded.py`` checks against a real two-rank gather):

- gather: the learner's TP / EP / expert-TP shards into the rank that feeds the sampler
  (``gather_learner_weights``: packed codes, e4m3 scales, one fp32 global scale per shard, an
  8-byte header per collective; replicated tensors do not move);
- refit: that rank -> vLLM (the export tensors: ``weight`` / ``weight_scale`` /
  ``weight_scale_2`` per HF module, the high-precision tensors in BF16).

BF16: the same layout with every quantized weight in BF16 (2 bytes per element).
"""

from __future__ import annotations

from minite_megatron.training.cli import OneLineArgumentParser  # bad flags: one line, status 2
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

LAYOUTS = [  # (tp, ep, etp)
    (1, 1, 1), (2, 1, 2), (4, 1, 4), (8, 1, 8), (1, 8, 1), (2, 8, 1), (4, 8, 1), (8, 8, 1),
]


def models() -> dict[str, tuple[dict, int]]:
    from minite_megatron.training.presets import PRESETS

    p = PRESETS["qwen3-moe"]

    def cfg(layers, vocab):
        return dict(num_layers=layers, hidden_size=p["hidden"], num_attention_heads=p["heads"],
                    num_query_groups=p["groups"], kv_channels=p["head_dim"], ffn_hidden_size=4 * p["hidden"],
                    moe_ffn_hidden_size=p["moe_ffn"], num_moe_experts=p["experts"], moe_router_topk=p["topk"],
                    qk_layernorm=True), vocab

    # the preset (4 layers, 32k vocabulary) and Qwen3-30B-A3B itself (48 layers, 151936 tokens)
    return {"qwen3-moe preset": cfg(p["layers"], p["vocab"]), "Qwen3-30B-A3B": cfg(48, 151936)}


def main(argv=None) -> None:
    from benchmarks._timing import print_table, save

    from minite_megatron.serving.refit import refit_traffic

    ap = OneLineArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="", help="directory for refit_bytes.jsonl (empty: none)")
    args = ap.parse_args(argv)
    gib = 2.0**30
    out = {"benchmark": "refit_bytes", "command": "python -m benchmarks.refit_bytes " + " ".join(argv or sys.argv[1:]),
           "computed_from_shapes": True, "models": {}}
    for name, (cfg, vocab) in models().items():
        rows = []
        for tp, ep, etp in LAYOUTS:
            t = refit_traffic(cfg, vocab=vocab, tp=tp, ep=ep, etp=etp, hp_bytes=2)
            rows.append({"TP": tp, "EP": ep, "ETP": etp, "gather GiB": t.gather_bytes / gib,
                         "gather BF16 GiB": t.gather_bf16_bytes / gib, "refit GiB": t.refit_bytes / gib,
                         "refit BF16 GiB": t.refit_bf16_bytes / gib, "total GiB": t.total / gib,
                         "total BF16 GiB": t.total_bf16 / gib, "x BF16": t.total / t.total_bf16})
        print_table(f"{name}: bytes per refit (NVFP4 learner vs BF16 learner)", rows, list(rows[0]))
        out["models"][name] = {"config": cfg, "vocab": vocab, "rows": rows}
    if args.json:
        import datetime
        import platform

        import torch

        out.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device="none (computed)",
                   torch=torch.__version__, python=platform.python_version())
        print("\nwrote", save(out, "refit_bytes", [args.json]))


if __name__ == "__main__":
    main()
