"""The per-rank worker: train the tiny MoE in one layout after another, through Megatron's own
training machinery, and bring the results back in the single-process layout.

For each :class:`Run` (a spec, a layout, a number of steps, optionally a checkpoint to save or
to resume from), every rank:

1. initializes Megatron's model-parallel state for the layout (TP, SP, EP, ETP, PP, virtual
   PP), builds this rank's model chunks and loads the common initial weights (Megatron's
   distributed checkpointing re-shards them: TP splits, the SwiGLU fc1 interleave, the expert
   split, the pipeline stages);
2. wraps each chunk in Megatron's ``DistributedDataParallel``, builds Megatron's optimizer
   (``get_megatron_optimizer``: Adam, the distributed optimizer for ``do`` layouts, gradient
   clipping off), and trains ``steps`` steps as ``megatron.training.train_step`` does: zero the
   grad buffers, ``get_forward_backward_func()`` (no pipelining, 1F1B or the interleaved
   schedule) over this data-parallel rank's micro-batches, ``finalize_model_grads`` (data-
   parallel, sequence-parallel and pipeline-embedding reductions), ``optimizer.step()``;
3. records the per-token losses of every step (gathered from the last pipeline stage of every
   data-parallel rank into the global batch order), and the step-1 gradients: written into the
   parameters, saved with distributed checkpointing, and loaded back into a single-process-
   layout model (for the distributed optimizer, each bucket's reduce-scattered shards are first
   all-gathered).

Returns, on rank 0, ``{run.key: {"losses": [steps, B, S], "grads": {name: tensor}, ...}}``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch

from . import checkpoint, model as tiny
from .layouts import Layout, parse

LR = 1e-2
"""Large enough that a lost or misplaced optimizer state changes the next losses far beyond
the fp32 re-association bound (checkpoint tests rely on it)."""


@dataclass(frozen=True)
class Run:
    spec: str
    layout: str
    steps: int = 3
    grads: bool = True
    init: str | None = None  # folder of the initial weights (written by the first run if absent)
    save_at: int | None = None  # save model + optimizer after this step ...
    save_dir: str | None = None  # ... into this folder
    resume_from: str | None = None  # continue from this checkpoint (its iteration) to `steps`
    resume_optimizer: bool = True  # False: weights only, a fresh optimizer (a negative control)
    sharding_type: str = "dp_reshardable"  # distributed optimizer checkpoints (Megatron's default)
    global_batch: int = tiny.GLOBAL_BATCH  # sequences per step (the runner raises it for many DP ranks)
    tag: str = ""

    @property
    def key(self) -> str:
        return f"{self.spec}:{self.layout}" + (f":{self.tag}" if self.tag else "")


# ---- parallel state ---------------------------------------------------------------------------
def set_parallel(layout: Layout) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ---- one training run -------------------------------------------------------------------------
class _Recorder:
    """Per-token losses of the micro-batches this rank computes (last pipeline stage)."""

    def __init__(self):
        self.step = 0
        self.rows: list[tuple[int, int, torch.Tensor]] = []


def _forward_step_func(recorder: _Recorder):
    from megatron.core import parallel_state as ps

    pos = torch.arange(tiny.SEQ, device=_device()).unsqueeze(0).expand(tiny.MICRO_BATCH, -1)
    mask = torch.ones(tiny.SEQ, tiny.SEQ, dtype=torch.bool, device=_device()).triu(1).view(1, 1, tiny.SEQ, tiny.SEQ)

    def forward_step(data_iterator, model):
        first, tokens, labels = next(data_iterator)
        tokens, labels = tokens.to(_device()), labels.to(_device())
        output = model(tokens, pos, mask, labels=labels)

        def loss_func(output_tensor):
            per_token = output_tensor.float()
            if ps.get_tensor_model_parallel_rank() == 0:
                recorder.rows.append((recorder.step, first, per_token.detach().cpu().clone()))
            loss = per_token.sum()
            num_tokens = torch.tensor(per_token.numel(), dtype=torch.int, device=per_token.device)
            return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}

        return output, loss_func

    return forward_step


def _gather_sharded_grads(ddp_chunks: list) -> None:
    """Distributed optimizer: after the reduce-scatter each rank holds only its shard of each
    bucket's gradients; all-gather them so every rank has the whole reduced gradient."""
    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for ddp in ddp_chunks:
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            pg = group.intra_distributed_optimizer_instance_group
            for bucket in group.buckets:
                shards = shard_buffer(bucket.grad_data, pg.size())
                dist.all_gather_into_tensor(bucket.grad_data, shards[pg.rank()].clone(), group=pg)


def _save_grads(directory: str, ddp_chunks: list, distributed_optimizer: bool) -> None:
    if distributed_optimizer:
        _gather_sharded_grads(ddp_chunks)
    chunks = [d.module for d in ddp_chunks]
    params = [p for c in chunks for p in c.parameters()]
    backup = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.copy_(p.main_grad)
    checkpoint.save(directory, chunks)
    with torch.no_grad():
        for p, b in zip(params, backup):
            p.copy_(b)


def _gather_losses(recorder: _Recorder, steps: range, global_batch: int) -> torch.Tensor | None:
    """Every rank's recorded micro-batch losses -> ``[steps, B, S]`` on rank 0."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, recorder.rows)
    if dist.get_rank() != 0:
        return None
    out = torch.full((len(steps), global_batch, tiny.SEQ), float("nan"))
    seen = torch.zeros(len(steps), global_batch, dtype=torch.int)
    for rows in every:
        for step, first, losses in rows:
            i = step - steps.start
            out[i, first:first + losses.shape[0]] = losses
            seen[i, first:first + losses.shape[0]] += 1
    if not bool((seen == 1).all()):
        raise AssertionError(f"each sample's loss must come from exactly one rank; counts per step: {seen.tolist()}")
    return out


def train_run(run: Run, world: int, work_dir: str) -> dict[str, Any]:
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core import parallel_state as ps

    layout = parse(run.layout)
    tiny.check_layout(layout, world, run.global_batch)
    init = run.init or os.path.join(work_dir, "init")
    set_parallel(layout)
    config = tiny.transformer_config(layout)
    chunks = tiny.build_chunks(run.spec, config)
    have_init = [os.path.isdir(init)]
    dist.broadcast_object_list(have_init, src=0)  # every rank decides alike (rank 0 may be writing it)
    if not have_init[0]:
        checkpoint.save(init, chunks)  # the first run's own weights become everyone's
    checkpoint.load(init, chunks)

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=layout.do,
        check_for_nan_in_grad=False,
    )
    ddp_chunks = [
        DistributedDataParallel(config, ddp_config, module=c, disable_bucketing=i > 0) for i, c in enumerate(chunks)
    ]
    opt_config = OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0,
        use_distributed_optimizer=layout.do, params_dtype=config.params_dtype, bf16=config.bf16, fp16=config.fp16,
    )
    optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    start = 0
    if run.resume_from:
        start = checkpoint.load(run.resume_from, ddp_chunks, optimizer if run.resume_optimizer else None,
                                use_distributed_optimizer=layout.do)
    recorder = _Recorder()
    forward_step = _forward_step_func(recorder)
    forward_backward = get_forward_backward_func()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    grads_dir = os.path.join(work_dir, f"grads_{run.key.replace(':', '_')}")
    steps = range(start + 1, run.steps + 1)
    skipped, grad_norms = [], []
    for step in steps:
        recorder.step = step
        for d in ddp_chunks:
            d.zero_grad_buffer()
        optimizer.zero_grad()
        batches = tiny.micro_batches(step, dp, dp_rank, run.global_batch)
        iterators = [iter(batches) for _ in ddp_chunks]
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=iterators if layout.vp else iterators[0],
            model=ddp_chunks if layout.vp else ddp_chunks[0],
            num_microbatches=len(batches),
            seq_length=tiny.SEQ,
            micro_batch_size=tiny.MICRO_BATCH,
            forward_only=False,
        )
        if run.grads and step == 1:
            _save_grads(grads_dir, ddp_chunks, layout.do)
        ok, grad_norm, _ = optimizer.step()
        skipped.append(not ok)
        grad_norms.append(None if grad_norm is None else float(grad_norm))
        if run.save_at == step:
            checkpoint.save(run.save_dir, ddp_chunks, optimizer, iteration=step, use_distributed_optimizer=layout.do,
                            sharding_type=run.sharding_type)
    losses = _gather_losses(recorder, steps, run.global_batch)
    final_dir = os.path.join(work_dir, f"final_{run.key.replace(':', '_')}")
    checkpoint.save(final_dir, ddp_chunks)
    del ddp_chunks, optimizer, chunks

    # bring the step-1 gradients and the final weights back in the single-process layout
    ref = parse("ref")
    set_parallel(ref)
    ref_config = tiny.transformer_config(ref)
    out: dict[str, Any] = {"losses": losses, "skipped": skipped, "grad_norms": grad_norms, "start": start}
    for what, directory in (("grads", grads_dir), ("weights", final_dir)):
        if not os.path.isdir(directory):
            continue
        (ref_model,) = tiny.build_chunks(run.spec, ref_config)
        checkpoint.load(directory, [ref_model])
        out[what] = {k: v.detach().cpu().clone() for k, v in ref_model.state_dict().items()
                     if not k.endswith("_extra_state")}
    dist.barrier()
    if dist.get_rank() == 0:
        for directory in (grads_dir, final_dir):
            shutil.rmtree(directory, ignore_errors=True)
    dist.barrier()
    return out


def worker(rank: int, world: int, *, runs: list[Run], work_dir: str) -> dict | None:
    """Runs in every rank: each of ``runs`` in turn; rank 0 returns ``{run.key: result}``."""
    results = {}
    for run in runs:
        results[run.key] = train_run(run, world, work_dir)
    return results if rank == 0 else None
