"""``minite-diagnose vllm``: serve an export with ``vllm.LLM`` (minite-vllm plugin), run the learner on the
same tokens, and name the first op where the two differ.

    minite-diagnose vllm --model out/qwen3-moe-nvfp4                         # 3 random prompts, 8 greedy tokens
    minite-diagnose vllm --model DIR --prompts prompts.json --new-tokens 16 --out runs/vllm_diag
    minite-diagnose vllm --model DIR --vllm-stock-ops norm                   # vLLM's own fused add + RMSNorm

The learner is built from the export alone (:mod:`.export_learner`: its own modules, the export's
recipe, weights whose quantization is the exported bytes, checked bit for bit). vLLM serves the same
directory (eager, ``logprobs_mode="raw_logits"``, in this process). Each prompt is a request of its
own; vLLM's forwards (prefill chunks, decode steps) and the learner's teacher-forced forward of the
prompt plus vLLM's tokens record the ops of :mod:`.op_trace` keyed by (sequence, position), which
:func:`~.compare.compare_traces` compares bitwise. Printed: the first op that differs (its layer,
name, the first position where it differs, how many elements differ there and over all positions,
max ``|diff|``), and the per-token gap of the generated tokens' log-probs (vLLM's reported ones vs
the learner's) under the names verl / slime use (``rollout_corr/train_rollout_logprob_abs_diff``,
``rollout_corr/k3_kl``, ...). With ``--out``: ``learner.pt`` / ``vllm.pt`` (traces), ``report.md`` /
``report.json`` / ``report.png`` and ``gap.json``.

``--prompts``: a ``.json`` file holding a list of token-id lists (or ``{"prompts": [...]}``), or a
``.jsonl`` file with one list (or ``{"prompt_token_ids": [...]}``) per line. Default: 3 prompts of 5,
12 and 9 random ids from ``--seed``.

Exit status 0; 1 with ``--fail-on-divergence`` when an op differs; 2 for bad input (one line on
stderr: a missing directory, a directory that is not a minite export, a bad prompts file, vLLM not
installed). Needs vLLM (``.venv-vllm``, ``scripts/setup_vllm_env.sh``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..settings import export
from .cli import format_metrics, register_subcommand
from .op_trace import STOCK_OPS

GAP_KEYS = ("rollout_corr/train_rollout_logprob_abs_diff", "rollout_corr/k3_kl", "rollout_corr/kl",
            "rollout_corr/logprob_abs_diff_mean", "rollout_corr/logprob_abs_diff_max",
            "rollout_corr/logprob_mismatch_frac", "rollout_corr/num_tokens", "rollout_corr/num_seqs")
"""The gap metrics printed (all of :func:`~.metrics.gap_metrics` go to ``gap.json``)."""


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="an export directory (minite-export, variant minite)")
    p.add_argument("--prompts", type=Path, default=None, help=".json / .jsonl file of token-id lists (default: random)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens vLLM generates per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="vLLM's sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="random prompts and vLLM's sampler")
    p.add_argument("--learner-recipe", default="{}", help="JSON recipe fields replaced for the learner only")
    p.add_argument("--vllm-stock-ops", default="",
                   help=f"comma-separated ops vLLM computes its own way instead of the plugin's ({', '.join(STOCK_OPS)})")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's chunked-prefill budget")
    p.add_argument("--out", type=Path, default=None, help="write traces, report.md/json/png and gap.json here")
    p.add_argument("--fail-on-divergence", action="store_true", help="exit with status 1 if an op differs")


def read_prompts(path: Path | None, vocab: int, seed: int) -> list[list[int]]:
    """The prompts (module docstring); ValueError naming the file for a bad one."""
    if path is None:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 12, 9)]
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path}: no such file")
    try:
        if path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        elif path.suffix == ".json":
            rows = json.loads(path.read_text())
            rows = rows.get("prompts") if isinstance(rows, dict) else rows
        else:
            raise ValueError(f"--prompts {path}: a .json or .jsonl file of token-id lists")
    except json.JSONDecodeError as e:
        raise ValueError(f"--prompts {path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    prompts = []
    for i, r in enumerate(rows if isinstance(rows, list) else [None]):
        ids = r.get("prompt_token_ids") if isinstance(r, dict) else r
        if not (isinstance(ids, list) and ids and all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
            raise ValueError(f"--prompts {path}: prompt {i} is not a non-empty list of token ids in [0, {vocab})")
        prompts.append(ids)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts")
    return prompts


def first_difference(cmp, ref, other) -> dict | None:
    """The first diverged op of ``cmp`` (``compare_traces(ref, other)``) in detail: its layer and op,
    the first (sequence, position) where it differs and how many of that row's elements differ,
    and the totals over all positions. None when every op is bitwise equal."""
    from ..testing import raw_bits
    from .capture import index_rows
    from .op_trace import op_of
    from .trace import describe_key

    r = cmp.first_divergence
    if r is None:
        return None
    out = {"name": r.name, "layer": r.layer, "op": op_of(r.name), "mismatched": r.mismatched, "elements": r.elements,
           "rows": r.rows_common, "max_abs": r.max_abs, "note": r.note, "where": None, "row_mismatched": None,
           "row_elements": None}
    a, b = ref[r.name], other[r.name]
    common = a.keys[torch.isin(a.keys, b.keys)]
    va = index_rows(a.values, torch.searchsorted(a.keys, common))
    vb = index_rows(b.values, torch.searchsorted(b.keys, common))
    if va.dtype == vb.dtype and va.shape == vb.shape:
        neq = (raw_bits(va) != raw_bits(vb)).reshape(va.shape[0], -1)
        rows = neq.any(1).nonzero().flatten()
        if rows.numel():
            j = int(rows[0])
            out.update(where=describe_key(int(common[j]), a.kind), row_mismatched=int(neq[j].sum()),
                       row_elements=int(neq.shape[1]))
    return out


def describe_first(first: dict | None, compared: int, not_compared: list[str]) -> str:
    """The verdict line: the first op that differs, or that none does (of how many compared)."""
    from .op_trace import OP_DESCRIPTIONS

    if first is None:
        if not compared:
            return "no op compared: the two traces share no op and position"
        if not_compared:
            return f"no difference in the {compared} ops compared ({len(not_compared)} not compared: {', '.join(not_compared[:4])})"
        return f"no difference: all {compared} ops bitwise equal at every position both ran"
    layer = f"layer {first['layer']}, " if first["layer"] is not None else ""
    what = OP_DESCRIPTIONS.get(first["op"], first["op"])
    line = f"first difference: {layer}op {first['op']} ({what})"
    if first["where"] is not None:
        line += (f", first at {first['where']}: {first['row_mismatched']} of {first['row_elements']} elements differ"
                 f"; {first['mismatched']} of {first['elements']} over {first['rows']} positions")
    else:
        line += f": {first['note'] or 'not comparable'}"
    return line + f", max |diff| {first['max_abs']:.6g}"


def _run(args: argparse.Namespace) -> int:
    from .export_learner import read_export_config

    cfg = read_export_config(args.model)  # bad input before anything heavy
    stock = tuple(s for s in args.vllm_stock_ops.split(",") if s)
    bad = sorted(set(stock) - set(STOCK_OPS))
    if bad:
        raise ValueError(f"--vllm-stock-ops {','.join(bad)}: choose from {', '.join(STOCK_OPS)}")
    if args.new_tokens < 1:
        raise ValueError(f"--new-tokens {args.new_tokens}: must be >= 1")
    try:
        overrides = json.loads(args.learner_recipe)
    except json.JSONDecodeError as e:
        raise ValueError(f"--learner-recipe: not valid JSON ({e.msg})") from None
    if not isinstance(overrides, dict):
        raise ValueError("--learner-recipe: a JSON object of recipe fields")
    prompts = read_prompts(args.prompts, int(cfg["vocab_size"]), args.seed)
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise ValueError("vLLM is not installed in this environment (scripts/setup_vllm_env.sh makes .venv-vllm)") from None

    from ..training.presets import init_single_process
    from .capture import Tracer
    from .compare import compare_traces
    from .export_learner import learner_from_export
    from .metrics import gap_metrics, pad_sequences
    from .op_trace import LearnerOpHooks, VllmOpHooks

    device = init_single_process(seed=None)  # the learner on the device vLLM runs on (the same NVFP4 backend)
    learner = learner_from_export(args.model, recipe_overrides=overrides, device=device)
    strict = bool(learner.recipe.strict)

    export("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the hooks reach its model
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    max_len = max(len(p) for p in prompts) + args.new_tokens
    if max_len > int(cfg["max_position_embeddings"]):
        raise ValueError(f"--prompts / --new-tokens: {max_len} tokens exceed the export's max_position_embeddings "
                         f"{cfg['max_position_embeddings']}")
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens,
                                                             "enable_chunked_prefill": True}
    # one request at a time: a KV cache for two of these sequences (K and V, BF16, every layer) and some slack
    kv_bytes = 2 * max_len * int(cfg["num_hidden_layers"]) * 2 * int(cfg["num_key_value_heads"]) * int(cfg["head_dim"]) * 2
    llm = LLM(model=str(args.model), dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=max_len, max_num_seqs=1, seed=args.seed, logprobs_mode="raw_logits",
              kv_cache_memory_bytes=kv_bytes + (16 << 20), enable_prefix_caching=False, **extra)
    vllm_config = llm.llm_engine.vllm_config
    tr_vllm = Tracer(engine="vllm")
    hooks = llm.apply_model(lambda m: VllmOpHooks(tr_vllm, m, stock, vllm_config).__enter__())[0]
    sp = SamplingParams(max_tokens=args.new_tokens, temperature=args.temperature, logprobs=0, detokenize=False,
                        ignore_eos=True)
    seqs, vllm_lps = [], []
    for i, prompt in enumerate(prompts):
        hooks.seq = i
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
        gen = list(out.token_ids)
        seqs.append(prompt + gen)
        vllm_lps.append(torch.tensor([d[t].logprob for d, t in zip(out.logprobs, gen)], dtype=torch.float32))
    llm.apply_model(lambda m: hooks.__exit__(None, None, None))

    tr_learn = Tracer(engine="learner")
    with LearnerOpHooks(tr_learn, learner.model) as lh:
        learner_lps = lh.score(seqs)
    ref, other = tr_learn.trace(), tr_vllm.trace()
    cmp = compare_traces(ref, other)
    first = first_difference(cmp, ref, other)

    lrn, mask = pad_sequences([lp[len(p) - 1:] for lp, p in zip(learner_lps, prompts)])
    rol, _ = pad_sequences(vllm_lps)
    metrics = gap_metrics(lrn, rol, mask)
    equal = sum(r.status == "equal" for r in cmp.results)
    compared = sum(r.compared for r in cmp.results)
    print(f"learner ({'strict' if strict else 'default'} recipe, built from {args.model}: {learner.quantized} NVFP4 "
          f"weights reproduced bitwise) vs vLLM {vllm.__version__} + minite-vllm"
          + (f" with vLLM's own {', '.join(stock)}" if stock else ""))
    print(f"{len(prompts)} prompts, {int(mask.sum())} generated tokens; {compared} ops compared, {equal} bitwise equal")
    print(describe_first(first, compared, [r.name for r in cmp.results if not r.compared]))
    print(format_metrics({k: metrics[k] for k in GAP_KEYS}))
    if args.out is not None:
        from .report import write_report

        args.out.mkdir(parents=True, exist_ok=True)
        ref.save(args.out / "learner.pt")
        other.save(args.out / "vllm.pt")
        write_report(cmp, args.out)
        (args.out / "gap.json").write_text(json.dumps({"first_difference": first, "metrics": metrics}, indent=1))
        print(f"report: {args.out / 'report.md'}")
    return 1 if (first is not None and args.fail_on_divergence) else 0


register_subcommand("vllm", "serve an export with vllm.LLM and the learner on the same tokens; name the first op "
                    "that differs", _add_arguments, _run)
