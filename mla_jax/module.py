"""A thin Flax (linen) module over the functional MLA layer.

Its params are exactly one layer's `self_attn` tensors of the HF checkpoint, by name and [out, in] layout
(`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
`o_proj`), so `MLAAttention(cfg).apply({"params": tensors}, x, positions)` runs checkpoint weights as they are.
kv_b_proj is split into W_UK_T / W_UV on the fly (a reshape); the model itself stores the split once instead.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mla_jax.config import DeepseekConfig
from mla_jax.mla import mla_forward_full, split_kv_b_proj


class MLAAttention(nn.Module):
    cfg: DeepseekConfig
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, *, algorithm: str = "naive") -> jax.Array:
        """Whole-sequence causal MLA: x [S, D], positions i32[S] -> [S, D]."""
        c = self.cfg
        D, N, L, R = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
        P, V = c.qk_nope_head_dim, c.v_head_dim
        init = nn.initializers.normal(0.02)

        def w(name, *shape):
            return {"weight": self.param(name, lambda k: {"weight": init(k, shape, self.dtype)})["weight"]}

        def norm(name, n):
            return {"weight": self.param(name, lambda k: {"weight": jnp.ones((n,), self.dtype)})["weight"]}

        p = {
            "kv_a_proj_with_mqa": w("kv_a_proj_with_mqa", L + R, D),
            "kv_a_layernorm": norm("kv_a_layernorm", L),
            "o_proj": w("o_proj", D, N * V),
        }
        if c.q_lora_rank is None:
            p["q_proj"] = w("q_proj", N * (P + R), D)
        else:
            p |= {
                "q_a_proj": w("q_a_proj", c.q_lora_rank, D),
                "q_a_layernorm": norm("q_a_layernorm", c.q_lora_rank),
                "q_b_proj": w("q_b_proj", N * (P + R), c.q_lora_rank),
            }
        p["W_UK_T"], p["W_UV"] = split_kv_b_proj(w("kv_b_proj", N * (P + V), L)["weight"], c)
        return mla_forward_full(p, c, x, positions, algorithm=algorithm)
