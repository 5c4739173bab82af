"""mla_jax.memory: the per-device plan against the arrays a reduced model actually places on a mesh, and the
V3-on-8-H200 plans (fp8 fits with a stated cache; bf16 does not)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from mla_jax.cache import init_kv_cache_for
from mla_jax.checkpoint.fp8 import quantize_params
from mla_jax.config import DEEPSEEK_V3, DeepseekConfig
from mla_jax.memory import KINDS, abstract_params, memory_plan, weight_bytes_per_device, weight_kind
from mla_jax.model import prepare_params
from mla_jax.parallel import make_mesh
from mla_jax.sharding import shard_params
from tests.mla_jax.helpers import tiny_config
from tests.mla_jax.multihost_worker import random_params

# 128-multiples where fp8 blocks meet a split (2 heads x 64 rows of q_b / columns of o_proj per shard); a
# ragged replicated one too (kv_a: 128 + 8 rows).
REDUCED = dict(
    hidden_size=256,
    vocab_size=512,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=56,
    qk_rope_head_dim=8,
    v_head_dim=64,
    intermediate_size=512,
    moe_intermediate_size=256,
    num_hidden_layers=2,
)


def _actual_per_device(params):
    """{kind: bytes} of the shards device 0 holds."""
    out = dict.fromkeys(KINDS, 0)
    dev = jax.devices()[0]
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = tuple(k.key for k in path)
        out[weight_kind(keys)] += sum(s.data.nbytes for s in leaf.addressable_shards if s.device == dev)
    return out


@pytest.mark.parametrize("weights, ep, tp, dp", [("fp8", 2, 2, 1), ("bf16", 1, 2, 1), ("fp8", 1, 2, 2)])
def test_plan_matches_placed_arrays(weights, ep, tp, dp):
    if len(jax.devices()) < ep * tp * dp:
        pytest.skip(f"needs {ep * tp * dp} devices")
    cfg = tiny_config(**REDUCED)
    params = prepare_params(random_params(cfg, 0), cfg)  # numpy-drawn: eager init_params compiles per shape
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x if any(getattr(k, "key", None) == "gate" for k in p[-2:-1]) else x.astype(jnp.bfloat16), params
    )  # bf16 weights, the router in float32 (as the loader keeps them)
    if weights == "fp8":
        params, _ = quantize_params(params)
    mesh = make_mesh(ep=ep, tp=tp, dp=dp)
    moe = "ep" if ep * dp > 1 else "tp"
    shape = {"dp": dp, "ep": ep, "tp": tp, "dcp": 1}
    placed = shard_params(params, cfg, mesh, moe=moe)
    plan = weight_bytes_per_device(abstract_params(cfg, weights=weights), cfg, shape, moe=moe)
    actual = _actual_per_device(placed)
    assert plan == actual
    assert actual["routed_experts"] > 0 and actual["attention"] > 0
    full = memory_plan(cfg, ep=ep, tp=tp, dp=dp, weights=weights, cache_tokens=1000, page_size=64, device_bytes=10**9)
    assert full.weights == actual
    cache = init_kv_cache_for(cfg, num_pages=16, page_size=64)  # 1000 tokens -> 16 whole pages
    assert full.cache == cache.kv_c_and_k_pe_cache.nbytes and full.cache_tokens == 1000
    assert full.mesh_cache_tokens == 1000 * dp  # each DP group its own requests' tokens


def test_fp8_head_split_must_keep_whole_blocks():
    cfg = tiny_config(**{**REDUCED, "qk_nope_head_dim": 32})  # 2 heads x 40 rows of q_b per shard
    with pytest.raises(ValueError, match="q_b_proj.*scale"):
        memory_plan(cfg, tp=2, weights="fp8", cache_tokens=64)


def test_v3_on_8_h200():
    """V3 in fp8 on one 8 x H200 node: EP 8 and TP 8 fit with >= 400k cached tokens (bf16 latent cache);
    in bf16 the weights alone exceed the device."""
    cfg = DeepseekConfig.from_dict(DEEPSEEK_V3)
    ep8 = memory_plan(cfg, ep=8, weights="fp8")
    assert ep8.fits and ep8.cache_tokens >= 400_000, ep8.report()
    assert 80e9 < ep8.weights["routed_experts"] < 83e9  # 58 layers x 32 experts x 3 x 2048 x 7168 B + scales
    tp8 = memory_plan(cfg, tp=8, weights="fp8")
    assert tp8.fits and tp8.cache_tokens >= 400_000, tp8.report()
    mixed = memory_plan(cfg, ep=4, tp=2, weights="fp8", cache_tokens=500_000)
    assert mixed.fits, mixed.report()
    bf16 = memory_plan(cfg, ep=8, weights="bf16")
    assert not bf16.fits and bf16.cache_tokens == 0


def test_capacity_table_v3_v2_lite():
    """The README's capacity table: TP 8 caches one GPU's tokens per node (the latent is replicated), DCP 8 and DP 8
    eight GPUs' worth; DP replicates attention (more weights a GPU) but V3's node still caches several times
    TP 8's tokens."""
    from mla_jax.config import DEEPSEEK_V2_LITE
    from mla_jax.memory import CAPACITY_LAYOUTS, capacity_table

    models = {
        "V3": (DeepseekConfig.from_dict(DEEPSEEK_V3), "fp8"),
        "V2-Lite": (DeepseekConfig.from_dict(DEEPSEEK_V2_LITE), "bf16"),
    }
    rows = {(r["model"], r["layout"]): r for r in capacity_table(models)}
    assert len(rows) == 2 * len(CAPACITY_LAYOUTS) and all(r["fits"] for r in rows.values())
    for m in models:
        tp8, dcp8, dp8, dp4 = (rows[m, name] for name, _ in CAPACITY_LAYOUTS)
        assert tp8["tokens_per_node"] == tp8["tokens_per_gpu"]
        assert (
            dp8["tokens_per_node"] == 8 * dp8["tokens_per_gpu"] and dp4["tokens_per_node"] == 4 * dp4["tokens_per_gpu"]
        )
        assert abs(dcp8["tokens_per_node"] - 8 * dcp8["tokens_per_gpu"]) <= 8
        assert dp8["weights_gb_per_gpu"] > dp4["weights_gb_per_gpu"] > tp8["weights_gb_per_gpu"]
    assert rows["V3", "DP 8"]["tokens_per_node"] > 4 * rows["V3", "TP 8"]["tokens_per_node"]
