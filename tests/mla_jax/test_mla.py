"""Both MLA algorithms agree; the absorbed one needs the 192-based scale."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model
from mla_jax.mla import mla_forward_full, split_kv_b_proj
from tests.mla_jax.helpers import tiny_config


def _layer0(params):
    return jax.tree.map(lambda a: a[0], params["model"]["dense_layers"]["self_attn"])


@pytest.mark.parametrize("seed,S,q_lora", [(0, 1, 24), (1, 9, 24), (2, 33, None)])
def test_absorbed_equals_naive(seed, S, q_lora):
    cfg = tiny_config(q_lora_rank=q_lora)
    params = model.init_params(cfg, jax.random.key(seed), std=0.3)
    p = _layer0(params)
    x = jax.random.normal(jax.random.key(seed + 100), (S, cfg.hidden_size))
    pos = jnp.arange(S, dtype=jnp.int32) + seed * 7
    a = mla_forward_full(p, cfg, x, pos, algorithm="naive")
    b = mla_forward_full(p, cfg, x, pos, algorithm="absorbed")
    assert float(jnp.abs(a).max()) > 1e-2
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
    wrong = mla_forward_full(p, cfg, x, pos, algorithm="absorbed", scale=cfg.cache_row_dim**-0.5)
    if S > 1:
        assert float(jnp.abs(wrong - a).max()) > 100 * 2e-5


def test_whole_model_absorbed_equals_naive():
    cfg = tiny_config()
    params = model.init_params(cfg, jax.random.key(3), std=0.2)
    ids = jax.random.randint(jax.random.key(4), (2, 21), 0, cfg.vocab_size)
    a = model.forward(params, cfg, ids)
    b = model.forward(params, cfg, ids, attention="absorbed")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5, rtol=1e-5)


def test_split_kv_b_proj_layout():
    cfg = tiny_config()
    N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w = jnp.arange(N * (P + V) * L, dtype=jnp.float32).reshape(N * (P + V), L)
    uk, uv = split_kv_b_proj(w, cfg)
    assert uk.shape == (N, P, L) and uv.shape == (N, L, V)
    # head n's rows are [k_nope (P) | v (V)]
    np.testing.assert_array_equal(uk[1, 2], w[1 * (P + V) + 2])
    np.testing.assert_array_equal(uv[1, :, 3], w[1 * (P + V) + P + 3])
    with pytest.raises(ValueError, match="kv_b_proj"):
        split_kv_b_proj(w[:-1], cfg)
