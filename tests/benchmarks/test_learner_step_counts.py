"""``benchmarks.learner_step --count-ops``: the host-cost proxy of a step is reproducible (the
same step dispatches the same ops, so before / after counts compare changes, not noise) and
lands in the JSON record."""

import json

import torch


def test_count_ops_is_reproducible_and_recorded(tmp_path):
    from benchmarks import learner_step

    records = learner_step.main(["--smoke", "--variants", "bf16,nvfp4", "--iters", "1", "--warmup", "1",
                                 "--count-ops", "--out", str(tmp_path), "--json-dir", str(tmp_path)])
    rows = {r["variant"]: r for r in records[0]["variants"]}
    assert set(rows) == {"bf16", "nvfp4"} and all("error" not in r for r in rows.values()), rows
    for r in rows.values():
        assert r["aten_ops_per_step"] > 0 and sum(r["aten_ops_top"].values()) <= r["aten_ops_per_step"]
        assert "host_syncs_per_step" not in r  # a GPU count only
    line = json.loads((tmp_path / "learner_step.jsonl").read_text().splitlines()[-1])
    assert line["variants"][1]["aten_ops_per_step"] == rows["nvfp4"]["aten_ops_per_step"]

    from minite_megatron.training.presets import PRESETS

    run, model = learner_step.build("nvfp4", PRESETS["tiny"], 32, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(7)
    data = (torch.randint(0, 256, (2, 32), generator=g), torch.randint(0, 256, (2, 32), generator=g))
    run(*data).backward()  # first-call state (caches, lazy buffers) out of the way
    counts = [learner_step.count_host_work(run, model, data, "step", cuda=False)["aten_ops_per_step"] for _ in range(2)]
    assert counts[0] == counts[1], counts
