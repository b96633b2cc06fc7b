"""``minite-convert``: Hugging Face Qwen3 / Qwen3-MoE <-> Megatron ``torch_dist`` checkpoints.

.. code-block:: bash

    minite-convert hf-to-megatron --hf-dir Qwen3-30B-A3B --out ckpt/qwen3-30b-a3b        # then --load ckpt/...
    torchrun --nproc-per-node 8 -m minite_megatron.convert hf-to-megatron --hf-dir ... --out ... --tp 2 --ep 4
    minite-convert megatron-to-hf --load runs/rl/checkpoints --hf-config Qwen3-30B-A3B --out hf-out
    minite-convert megatron-to-hf --load runs/tiny_moe/checkpoints --out hf-out   # the HF config from its args

``hf-to-megatron`` writes a release checkpoint that ``megatron.training``
loads with ``--load DIR`` or ``--pretrained-checkpoint DIR --finetune``. Megatron re-shards a
``torch_dist`` checkpoint at load time, so one process (the default) converts for any training
layout; ``--tp/--pp/--ep/--etp`` under ``torchrun`` spread the reading and the memory over the
ranks, each of which reads only its shard. ``megatron-to-hf`` writes BF16 safetensors (sharded,
with the index) and ``config.json``, loadable by ``transformers``.

Bad input (a missing file, an index naming a missing shard, a shape mismatch, an unsupported
architecture or field) prints one line, ``minite-convert: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import sys

from ..training import upstream_warnings

upstream_warnings.install()  # at import: also in the worker processes that multiprocessing spawns

import torch  # noqa: E402

from ..training.cli import OneLineArgumentParser  # noqa: E402
from .errors import ConvertError  # noqa: E402
from ..settings import settings  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="minite-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megatron", help="HF checkpoint -> Megatron torch_dist checkpoint (release)")
    a.add_argument("--hf-dir", required=True, help="config.json + safetensors (sharded with the index)")
    a.add_argument("--out", required=True, help="the Megatron checkpoint directory (--load / --pretrained-checkpoint)")
    a.add_argument("--impl", choices=("local", "minite"), default="local",
                   help="spec to build the model on (default local: its checkpoint keys cover minite's too)")
    a.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="dtype of the stored weights")
    a.add_argument("--tp", type=int, default=1, help="tensor parallel size (under torchrun)")
    a.add_argument("--pp", type=int, default=1, help="pipeline parallel size (under torchrun)")
    a.add_argument("--ep", type=int, default=1, help="expert parallel size (under torchrun)")
    a.add_argument("--etp", type=int, default=None, help="expert tensor parallel size (default: --tp)")
    a.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary as megatron.training does (times --tp); zero rows")
    a.add_argument("--no-progress", action="store_true", help="no progress bar")
    b = sub.add_parser("megatron-to-hf", help="Megatron torch_dist checkpoint -> HF BF16 safetensors")
    b.add_argument("--load", required=True, help="a --save directory (its tracker file) or a checkpoint directory")
    b.add_argument("--iteration", default=None, help="an iteration number or 'release' (default: the tracker's)")
    b.add_argument("--hf-config", default=None,
                   help="HF config.json or checkpoint directory (default: the one hf-to-megatron stored, or the "
                        "one of the model a megatron.training checkpoint's args describe)")
    b.add_argument("--out", required=True, help="the HF output directory")
    b.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    b.add_argument("--max-shard-size", default="5GB", help="per safetensors file, e.g. 5GB, 500MB")
    b.add_argument("--no-progress", action="store_true")
    return p


def _positive(value: int | None, flag: str) -> None:
    if value is not None and value < 1:
        raise ConvertError(f"convert: {flag} must be >= 1, got {value}")


def _init_distributed(tp: int, pp: int, ep: int, etp: int | None) -> None:
    """Megatron's parallel state: torchrun's world (WORLD_SIZE > 1) or one process."""
    from megatron.core import parallel_state as ps

    world = settings().world_size
    if world == 1:
        if tp * pp * ep > 1 or (etp or 1) > 1:
            raise ConvertError("convert: --tp/--pp/--ep > 1 need torchrun with as many processes; one process "
                               "converts for any layout (Megatron re-shards torch_dist checkpoints at load)")
        from ..training.presets import init_single_process

        init_single_process(seed=None)
        return
    import torch.distributed as dist

    from .. import cpu_compat

    cpu_compat.activate()  # a no-op with a GPU
    if tp * pp > world or world % (tp * pp):
        raise ConvertError(f"convert: --tp {tp} x --pp {pp} does not divide the world size {world}")
    if torch.cuda.is_available():
        torch.cuda.set_device(settings().local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)


def hf_to_megatron(args) -> None:
    import torch.distributed as dist

    from .hf import build_gpt_from_hf
    from .hf_files import HFCheckpoint
    from .load import open_checkpoint
    from .megatron_checkpoint import save_torch_dist

    for flag in ("tp", "pp", "ep", "etp", "make_vocab_size_divisible_by"):
        _positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    open_checkpoint(args.hf_dir)  # every input check before any process group or model exists
    _init_distributed(args.tp, args.pp, args.ep, args.etp)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and dist.get_world_size() > 1 \
        else torch.device("cpu")
    model = build_gpt_from_hf(args.hf_dir, impl=args.impl, dtype=DTYPES[args.dtype], device=device,
                              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                              progress=False if args.no_progress else None)
    ckpt = save_torch_dist(model, args.out, HFCheckpoint(args.hf_dir).config,
                           make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    if dist.get_rank() == 0:
        print(f"minite-convert: wrote {ckpt} ({args.impl} spec, {args.dtype}); train with --load {args.out} "
              f"(or --pretrained-checkpoint {args.out} --finetune)")


def megatron_to_hf(args) -> None:
    from .megatron_checkpoint import find_torch_dist, stored_hf_config
    from .save import write_hf_from_torch_dist

    try:
        ckpt = find_torch_dist(args.load, args.iteration)
    except ConvertError as e:
        raise ConvertError(f"--load {args.load}: {str(e).removeprefix('convert: ')}") from None
    from ..training.presets import init_single_process

    init_single_process(seed=None)
    cfg = args.hf_config if args.hf_config is not None else stored_hf_config(ckpt)
    if cfg is None:  # a megatron.training run (e.g. a preset's): the HF config of the model its args describe
        from .megatron_model import model_from_checkpoint

        _, cfg, _, _ = model_from_checkpoint(args.load, iteration=args.iteration)
    names = write_hf_from_torch_dist(ckpt, args.out, cfg, dtype=DTYPES[args.dtype], max_shard_size=args.max_shard_size,
                                     progress=False if args.no_progress else None)
    print(f"minite-convert: wrote {args.out} ({len(names)} safetensors file(s), {args.dtype}) from {ckpt}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        (hf_to_megatron if args.command == "hf-to-megatron" else megatron_to_hf)(args)
    except ConvertError as e:
        print(f"minite-convert: error: {str(e).removeprefix('convert: ')}", file=sys.stderr)
        return 2
    return 0


__all__ = ["main"]
