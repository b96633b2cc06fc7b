"""``config.json`` -> Megatron ``TransformerConfig`` + ``GPTModel`` kwargs: every mapped field, the MoE
layer pattern, both RoPE spellings, and the refusals (one line naming the field). No model built."""

from __future__ import annotations

import pytest
import torch

from minite_megatron.convert import ConvertError, transformer_config_from_hf
from minite_megatron.convert.hf_config import hf_dims
from minite_megatron.convert.megatron_checkpoint import megatron_args

from .conftest import DENSE, MOE

pytestmark = pytest.mark.usefixtures("single_process")

QWEN3_MOE = dict(MOE, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"])
QWEN3 = dict(DENSE, model_type="qwen3", architectures=["Qwen3ForCausalLM"])


def test_dense_fields_map_to_megatron():
    cfg = dict(QWEN3, rms_norm_eps=1e-5, attention_dropout=0.1, initializer_range=0.03, torch_dtype="bfloat16",
               bos_token_id=1, eos_token_id=2, transformers_version="4.51.0", use_cache=True, max_window_layers=28,
               sliding_window=None, use_sliding_window=False)
    tc, kw = transformer_config_from_hf(cfg)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (2, 64, 96)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (4, 2, 16)
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5 and tc.qk_layernorm
    assert tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert not tc.add_bias_linear and not tc.add_qkv_bias
    assert tc.attention_dropout == 0.1 and tc.hidden_dropout == 0.0 and tc.init_method_std == 0.03
    assert not tc.num_moe_experts
    assert kw == dict(vocab_size=128, max_sequence_length=64, position_embedding_type="rope", rotary_base=1e6,
                      rotary_percent=1.0, share_embeddings_and_output_weights=True)


def test_moe_fields_map_to_megatron():
    tc, kw = transformer_config_from_hf(dict(QWEN3_MOE, router_aux_loss_coef=0.01))
    assert (tc.num_moe_experts, tc.moe_router_topk, tc.moe_ffn_hidden_size) == (4, 2, 32)
    assert tc.moe_layer_freq == [0, 1] and not tc.moe_router_pre_softmax
    assert tc.moe_router_dtype == "fp32" and tc.moe_aux_loss_coeff == 0.01
    assert tc.moe_router_load_balancing_type == "aux_loss" and not tc.moe_shared_expert_intermediate_size
    assert kw["share_embeddings_and_output_weights"] is False
    tc, _ = transformer_config_from_hf(dict(QWEN3_MOE, norm_topk_prob=False))
    assert tc.moe_router_pre_softmax


@pytest.mark.parametrize("fields, pattern", [
    (dict(mlp_only_layers=[], decoder_sparse_step=1, num_hidden_layers=4), 1),  # all MoE: the int, stacked keys
    (dict(mlp_only_layers=[], decoder_sparse_step=2, num_hidden_layers=4), [0, 1, 0, 1]),  # (i + 1) % step == 0
    (dict(mlp_only_layers=[0, 3], decoder_sparse_step=1, num_hidden_layers=4), [0, 1, 1, 0]),
])
def test_moe_layer_pattern_follows_transformers(fields, pattern):
    """The rule of transformers' Qwen3MoeDecoderLayer: sparse iff not in mlp_only_layers and
    ``(layer + 1) % decoder_sparse_step == 0``."""
    tc, _ = transformer_config_from_hf(dict(QWEN3_MOE, **fields))
    assert tc.moe_layer_freq == pattern


def test_rope_theta_in_either_spelling_and_overrides():
    v4 = dict(QWEN3, rope_theta=5e5, rope_scaling=None)
    v5 = dict(QWEN3, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    v5.pop("rope_theta")
    assert transformer_config_from_hf(v4)[1]["rotary_base"] == transformer_config_from_hf(v5)[1]["rotary_base"] == 5e5
    tc, kw = transformer_config_from_hf(QWEN3, params_dtype=torch.bfloat16, max_sequence_length=32,
                                        make_vocab_size_divisible_by=96)
    assert tc.params_dtype == torch.bfloat16 and kw["max_sequence_length"] == 32 and kw["vocab_size"] == 192


def test_megatron_args_use_megatron_flag_names():
    """The ``args`` stored in the checkpoint: what ``--load`` checks and ``--use-checkpoint-args`` reads."""
    ns = megatron_args(QWEN3_MOE, padded_vocab_size=128, make_vocab_size_divisible_by=128,
                       parallel=dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1))
    assert (ns.num_layers, ns.hidden_size, ns.num_attention_heads, ns.add_position_embedding) == (2, 64, 4, True)
    assert ns.num_experts == 4 and ns.moe_layer_freq == [0, 1] and ns.swiglu and ns.qk_layernorm
    assert ns.untie_embeddings_and_output_weights and ns.group_query_attention and ns.num_query_groups == 2
    assert megatron_args(QWEN3, padded_vocab_size=128, make_vocab_size_divisible_by=128, parallel={}).num_experts is None


@pytest.mark.parametrize("fields, needle", [
    (dict(model_type="llama"), "model_type='llama'"),
    (dict(architectures=["Qwen3MoeForSequenceClassification"]), "architectures="),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config"),
    (dict(shared_expert_intermediate_size=64), "'shared_expert_intermediate_size'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
     "rope_parameters.partial_rotary_factor"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(num_experts_per_tok=8), "num_experts_per_tok=8 exceeds num_experts=4"),
    (dict(mlp_only_layers=[5]), "mlp_only_layers"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(hidden_size=0), "hidden_size=0"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
])
def test_unsupported_configs_are_refused_naming_the_field(fields, needle):
    with pytest.raises(ConvertError) as e:
        hf_dims(dict(QWEN3_MOE, **fields))
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg


def test_dense_config_refuses_moe_fields_and_bad_overrides():
    with pytest.raises(ConvertError, match="'num_experts' is not supported for model_type='qwen3'"):
        hf_dims(dict(QWEN3, num_experts=4))
    with pytest.raises(ConvertError, match="'no_such_field' is neither a TransformerConfig field"):
        transformer_config_from_hf(QWEN3, no_such_field=1)
