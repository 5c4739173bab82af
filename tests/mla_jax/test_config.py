import json
import math

import pytest

from mla_jax.config import DEEPSEEK_V2_LITE, DEEPSEEK_V3, DEEPSEEK_V32, ConfigError, DeepseekConfig
from tests.mla_jax.helpers import FIXTURES

V3 = DEEPSEEK_V3
V2_LITE = DEEPSEEK_V2_LITE


def test_v3_derived_dims_and_scale():
    cfg = DeepseekConfig.from_dict(V3)
    assert cfg.qk_head_dim == 192 and cfg.cache_row_dim == 576
    assert cfg.softmax_scale == pytest.approx(0.135234, abs=1e-6)  # 192^-0.5 * mscale(40, 1.0)^2
    assert cfg.softmax_scale != pytest.approx(576**-0.5, rel=0.05)
    assert cfg.quantization.weight_block_size == (128, 128)
    assert cfg.num_dense_layers == 3 and cfg.is_moe_layer(3) and not cfg.is_moe_layer(2)


def test_v2_lite():
    cfg = DeepseekConfig.from_dict(V2_LITE)
    assert cfg.q_lora_rank is None
    assert cfg.softmax_scale == pytest.approx(0.114721, abs=1e-6)


def test_no_rope_scaling_scale():
    d = {k: v for k, v in V2_LITE.items() if k != "rope_scaling"}
    assert DeepseekConfig.from_dict(d).softmax_scale == pytest.approx(192**-0.5)


@pytest.mark.parametrize("name", ["v2", "v2_lite", "v3", "v32", "glm_dsa"])
def test_reads_fixture_configs(name):
    cfg = DeepseekConfig.from_json(f"{FIXTURES}/{name}")
    assert cfg.model_type.startswith("deepseek_v") or cfg.model_type == "glm_moe_dsa"
    assert cfg.use_sparse == (name in ("v32", "glm_dsa"))


def test_v32_sparse_fields():
    cfg = DeepseekConfig.from_dict(DEEPSEEK_V32)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (2048, 64, 128)
    assert cfg.use_sparse and not cfg.shares_topk and not cfg.index_rope_interleave
    assert cfg.num_indexer_layers == 61 and cfg.indexer_slot(60) == 60
    assert cfg.topk_method == "noaux_tc" and cfg.scoring_func == "sigmoid"  # V3's router
    assert not DeepseekConfig.from_dict(DEEPSEEK_V3).use_sparse


def test_glm_dsa_index_groups():
    cfg = DeepseekConfig.from_json(f"{FIXTURES}/glm_dsa")
    assert cfg.indexer_types == ("full", "shared", "full") and cfg.index_rope_interleave
    assert [cfg.indexer_slot(i) for i in range(3)] == [0, 0, 1] and cfg.num_indexer_layers == 2
    d = json.load(open(f"{FIXTURES}/glm_dsa/config.json"))
    del d["indexer_types"]
    # transformers' derivation: layer i is full iff max(i - offset + 1, 0) % freq == 0
    got = DeepseekConfig.from_dict({**d, "index_topk_freq": 2, "index_skip_topk_offset": 1})
    assert got.indexer_types == ("full", "shared", "full")
    assert DeepseekConfig.from_dict({**d, "index_topk_pattern": "FSF"}).indexer_types == ("full", "shared", "full")
    assert DeepseekConfig.from_dict(d).indexer_types is None  # default freq 1: every layer full


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(q_lora_rank=None), "q_lora_rank"),
        (dict(index_head_dim=32), "index_head_dim"),
        (dict(index_topk=0), "index_topk"),
        (dict(index_n_heads="64"), "index_n_heads"),
    ],
)
def test_invalid_sparse_fields_are_named(change, match):
    with pytest.raises(ConfigError, match=match):
        DeepseekConfig.from_dict({**DEEPSEEK_V32, **change})


@pytest.mark.parametrize(
    "types,match",
    [
        (["shared", "full", "full"], r"indexer_types\[0\]"),
        (["full", "half", "full"], "indexer_types"),
        (["full"], "indexer_types"),
    ],
)
def test_invalid_indexer_types_are_named(types, match):
    d = json.load(open(f"{FIXTURES}/glm_dsa/config.json"))
    with pytest.raises(ConfigError, match=match):
        DeepseekConfig.from_dict({**d, "indexer_types": types})


def test_transformers5_rope_parameters():
    d = dict(V3)
    rs = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": "yarn", "rope_theta": 1e4}
    assert DeepseekConfig.from_dict(d) == DeepseekConfig.from_dict(V3)


@pytest.mark.parametrize(
    "field",
    ["hidden_size", "kv_lora_rank", "num_attention_heads", "vocab_size", "qk_rope_head_dim", "max_position_embeddings"],
)
def test_missing_field_is_named(field):
    d = {k: v for k, v in V3.items() if k != field}
    with pytest.raises(ConfigError, match=field):
        DeepseekConfig.from_dict(d)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("hidden_size", "7168", "hidden_size"),
        ("kv_lora_rank", 0, "kv_lora_rank"),
        ("q_lora_rank", -1, "q_lora_rank"),
        ("model_type", "llama", "model_type"),
        ("topk_method", "weird", "topk_method"),
        ("num_key_value_heads", 1, "num_key_value_heads"),
        ("n_group", 3, "n_group"),
        ("norm_topk_prob", "yes", "norm_topk_prob"),
        ("quantization_config", dict(quant_method="awq"), "quant_method"),
        ("rope_scaling", dict(type="linear", factor=2.0), "rope_scaling"),
    ],
)
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
