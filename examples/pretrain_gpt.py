"""Pretrain a GPT / MoE model with megatron.training (the megatron-core wheel), the plugin's own
training entry: what Megatron-LM's root ``pretrain_gpt.py`` does, for users without a Megatron-LM
checkout.

    python examples/pretrain_gpt.py --transformer-impl minite [MEGATRON FLAGS] [--progress-bar]
    python -m minite_megatron.launch examples/pretrain_gpt.py ...      (same thing)

It calls :func:`minite_megatron.launch.prepare` itself (CPU compatibility layer when there is
no GPU, ``--transformer-impl minite`` and the ``--minite-*`` flags), so it runs directly too.

Data: ``--mock-data`` (Megatron's MockGPTDataset) or ``--data-path PREFIX`` of an indexed corpus,
e.g. the one ``examples/make_tiny_corpus.py`` writes (``--tokenizer-type NullTokenizer
--vocab-size 256``). No downloads at run time. Extra flags of this script:
``--progress-bar`` (tqdm bar with the loss on the last rank) and ``--loss-log FILE`` (one JSON
line per iteration with the exact loss).
"""

import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from minite_megatron.launch import prepare  # noqa: E402

prepare()

import torch  # noqa: E402
from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.rerun_state_machine import get_rerun_state_machine  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402
from megatron.training import get_args, get_timers, pretrain, print_rank_0  # noqa: E402
from megatron.training import argument_utils, arguments  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage  # noqa: E402

from minite_megatron.training import progress  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def add_example_args(parser):
    group = parser.add_argument_group("examples/pretrain_gpt.py")
    group.add_argument("--progress-bar", action="store_true", help="tqdm progress bar with the loss")
    group.add_argument("--loss-log", type=str, default=None, help="append one JSON line per iteration")
    # a default, not Megatron's args_defaults (which warns "Overriding default arguments" whenever the
    # flag is given too)
    parser.set_defaults(tokenizer_type="NullTokenizer")
    return parser


def get_batch(data_iterator, vp_stage=None):
    """The micro-batch on this rank: read on TP rank 0, broadcast to the TP group, split for CP."""
    args = get_args()
    if not is_first_or_last_pipeline_stage(vp_stage):
        return (None,) * len(BATCH_KEYS)
    batch = {}
    if mpu.get_tensor_model_parallel_rank() == 0:
        batch = next(data_iterator)
        batch = {k: (batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None) for k in BATCH_KEYS}
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=False,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=mpu.is_pipeline_first_stage(),
        is_pipeline_last_stage=mpu.is_pipeline_last_stage(),
    )
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(k) for k in BATCH_KEYS)


def loss_func(loss_mask, output_tensor):
    """Sum of the masked per-token losses, the token count, and the report Megatron logs."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    if get_args().check_for_nan_in_loss_and_grad:
        get_rerun_state_machine().validate_result(
            result=loss, rejection_func=torch.isnan, message="NaN in local loss", tolerance=0.0, fatal=True
        )
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    timers("batch-generator").stop()
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def train_valid_test_datasets_provider(train_val_test_num_samples, vp_stage=None):
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")

    def built_on_this_rank():
        return mpu.get_tensor_model_parallel_rank() == 0 and is_first_or_last_pipeline_stage(vp_stage)

    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, built_on_this_rank, config).build()


train_valid_test_datasets_provider.is_distributed = True


def main():
    args = arguments.parse_and_validate_args(extra_args_provider=add_example_args)
    if args.progress_bar or args.loss_log:
        progress.install(bar=args.progress_bar, loss_log=args.loss_log)
    model_config = argument_utils.gpt_config_from_args(args)
    container = argument_utils.pretrain_cfg_container_from_args(args, model_config)
    pretrain(container, train_valid_test_datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
