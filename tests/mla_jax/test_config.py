import json
import math

import pytest

from mla_jax.config import ConfigError, DeepseekConfig
from tests.mla_jax.helpers import FIXTURES

V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, num_hidden_layers=61,
          num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
          moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
          first_k_dense_replace=3, moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8,
          topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, rms_norm_eps=1e-6, rope_theta=10000,
          max_position_embeddings=163840, tie_word_embeddings=False, hidden_act="silu",
          rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                            beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
          quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8",
                                   weight_block_size=[128, 128]))
V2_LITE = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, num_hidden_layers=27,
               num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=10944,
               moe_intermediate_size=1408, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
               first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", scoring_func="softmax", n_group=1,
               topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
               max_position_embeddings=163840, rope_theta=10000,
               rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                 beta_slow=1, mscale=0.707, mscale_all_dim=0.707))


def test_v3_derived_dims_and_scale():
    cfg = DeepseekConfig.from_dict(V3)
    assert cfg.qk_head_dim == 192 and cfg.cache_row_dim == 576
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)  # 192^-0.5 * mscale(40, 1.0)^2
    assert cfg.softmax_scale != pytest.approx(576 ** -0.5, rel=0.05)
    assert cfg.quantization.weight_block_size == (128, 128)
    assert cfg.num_dense_layers == 3 and cfg.is_moe_layer(3) and not cfg.is_moe_layer(2)


def test_v2_lite():
    cfg = DeepseekConfig.from_dict(V2_LITE)
    assert cfg.q_lora_rank is None
    assert cfg.softmax_scale == pytest.approx(0.114721, abs=1e-6)


def test_no_rope_scaling_scale():
    d = {k: v for k, v in V2_LITE.items() if k != "rope_scaling"}
    assert DeepseekConfig.from_dict(d).softmax_scale == pytest.approx(192 ** -0.5)


@pytest.mark.parametrize("name", ["v2", "v2_lite", "v3"])
def test_reads_fixture_configs(name):
    cfg = DeepseekConfig.from_json(f"{FIXTURES}/{name}")
    assert cfg.model_type.startswith("deepseek_v")


def test_transformers5_rope_parameters():
    d = dict(V3)
    rs = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": "yarn", "rope_theta": 1e4}
    assert DeepseekConfig.from_dict(d) == DeepseekConfig.from_dict(V3)


@pytest.mark.parametrize("field", ["hidden_size", "kv_lora_rank", "num_attention_heads", "vocab_size",
                                   "qk_rope_head_dim", "max_position_embeddings"])
def test_missing_field_is_named(field):
    d = {k: v for k, v in V3.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        DeepseekConfig.from_dict(d)


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", "7168", "hidden_size"), ("kv_lora_rank", 0, "kv_lora_rank"),
    ("q_lora_rank", -1, "q_lora_rank"), ("model_type", "llama", "model_type"),
    ("topk_method", "weird", "topk_method"), ("num_key_value_heads", 1, "num_key_value_heads"),
    ("n_group", 3, "n_group"), ("norm_topk_prob", "yes", "norm_topk_prob"),
    ("quantization_config", dict(quant_method="awq"), "quant_method"),
    ("rope_scaling", dict(type="linear", factor=2.0), "rope_scaling"),
])
def test_invalid_field_is_named(field, value, match):
    with pytest.raises(ConfigError, match=match):
        DeepseekConfig.from_dict({**V3, field: value})


def test_missing_yarn_field_is_named():
    rs = {k: v for k, v in V3["rope_scaling"].items() if k != "original_max_position_embeddings"}
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        DeepseekConfig.from_dict({**V3, "rope_scaling": rs})


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        DeepseekConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DeepseekConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(V3))
    assert DeepseekConfig.from_json(tmp_path).num_hidden_layers == 61
    assert math.isfinite(DeepseekConfig.from_json(tmp_path / "config.json").softmax_scale)
