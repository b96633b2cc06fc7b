"""Bytes moved per refit (the RL loop's weight sync into vLLM), NVFP4 vs a BF16 learner: computed
from the shapes, not timed.

    python -m benchmarks.kernels --sections refit_bytes                          # qwen3-moe preset + Qwen3-30B-A3B
    python -m benchmarks.kernels --sections refit_bytes --json-dir benchmarks/results   # and its JSON line

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

import argparse
import os
import sys

from . import RESULTS, command
from .._timing import print_table, save
from minite_megatron.training.cli import OneLineArgumentParser

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


def parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    ap.add_argument("--json-dir", default=RESULTS)
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="extra directory for the JSON line")
    return ap


def main(argv=None) -> dict:
    from minite_megatron.serving.refit import refit_traffic

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_known_args(argv)[0]
    gib = 2.0**30
    out = {"benchmark": "refit_bytes", "command": command(argv),
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
    import datetime
    import platform

    import torch

    out.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device="none (computed)",
               torch=torch.__version__, python=platform.python_version())
    print("\nwrote", save(out, "refit_bytes", [args.json_dir, args.out]))
    return out


if __name__ == "__main__":
    main()
