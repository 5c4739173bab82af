"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA) in plain JAX.

Each query token t scores every key token s it may see,

    index_logits[t, s] = sum_h w[t, h] * relu(D_I^-0.5 * q_I[t, h] . k_I[s]),

with q_I = wq_b(q latent) [T, H_I, D_I] (the q latent is MLA's q_a_layernorm(q_a_proj(x))), one shared key
k_I = k_norm(wk(x)) [T, D_I] per token (a LayerNorm with bias), RoPE on the first R dims of both (half-split
for V3.2, interleaved pairs for GLM-MoE-DSA; MLA itself always uses interleaved pairs), and per-head weights
w = weights_proj(x) * H_I^-0.5 (float32). MLA then attends only to the `index_topk` (K) best-scoring visible
tokens of each query. Ties go to the lower position (`jax.lax.top_k`); torch's CPU top-k orders ties
arbitrarily, so the HF fixtures are drawn without ties at the k-th score. The kept positions come in ascending
order (the order is irrelevant to attention; HF's mask from them is the same).

The index keys k_I are what the index-key cache stores (`mla_jax.cache`, written at `slot_mapping` like the
latent rows). DeepSeek's own kernels also Hadamard-rotate q_I and k_I and score in fp8; the rotation is
orthogonal (scores unchanged), and HF's reference omits it, as do we.

Shapes: T tokens, S key tokens, H_I indexer heads, D_I indexer head dim, R rope dims, K top-k.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mla_jax.config import DeepseekConfig
from mla_jax.layers import linear
from mla_jax.rope import apply_rope, rope_cos_sin
from pallas_kernels.lightning_indexer import topk_from_logits

LAYERNORM_EPS = 1e-6  # HF's k_norm = nn.LayerNorm(index_head_dim, eps=1e-6)


def layer_norm(p: dict, x: jax.Array, eps: float = LAYERNORM_EPS) -> jax.Array:
    """torch.nn.LayerNorm with weight and bias, computed in float32, returned in x.dtype."""
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps)
    return (y * p["weight"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split (GPT-NeoX, HF `rotate_half`) RoPE: dim j pairs with j + R/2. x [T, ..., R]; cos, sin [T, R/2]."""
    shape = x.shape
    h = shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :h], xf[..., h:]
    bshape = (shape[0],) + (1,) * (len(shape) - 2) + (h,)
    c, s = cos.reshape(bshape), sin.reshape(bshape)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def indexer_project(
    p: dict, cfg: DeepseekConfig, x: jax.Array, q_resid: jax.Array, positions: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D], q_resid [T, Q_lora], positions i32[T] -> (q_I [T, H_I, D_I], k_I [T, D_I], weights f32[T, H_I]).

    `p` is a layer's `self_attn["indexer"]`: wq_b, wk, k_norm {weight, bias}, weights_proj. The weights carry
    H_I^-0.5 (HF) but not the D_I^-0.5 softmax scale, which `index_logits` applies before the ReLU.
    """
    T = x.shape[0]
    H, Di, R = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = linear(p["wq_b"], q_resid).reshape(T, H, Di)  # [T, H_I, D_I]
    k = layer_norm(p["k_norm"], linear(p["wk"], x))  # [T, D_I]
    cos, sin = rope_cos_sin(cfg, positions)  # [T, R/2]
    rope = apply_rope if cfg.index_rope_interleave else apply_rope_half
    q = jnp.concatenate([rope(q[..., :R], cos, sin), q[..., R:]], axis=-1)
    k = jnp.concatenate([rope(k[:, None, :R], cos, sin)[:, 0], k[:, R:]], axis=-1)
    w = linear(p["weights_proj"], x.astype(p["weights_proj"]["weight"].dtype)).astype(jnp.float32) * H**-0.5
    return q, k, w  # [T, H_I, D_I], [T, D_I], [T, H_I]


def index_logits(q: jax.Array, weights: jax.Array, keys: jax.Array, scale: float) -> jax.Array:
    """q [T, H_I, D_I], weights f32[T, H_I], keys [T, S, D_I] (each query's own candidates) or [S, D_I] (shared)
    -> f32[T, S]: sum_h weights[t, h] * relu(scale * q[t, h] . keys[s]), in float32 as HF computes it."""
    qf = q.astype(jnp.float32)
    kf = keys.astype(jnp.float32)
    spec = "thd,tsd->ths" if keys.ndim == 3 else "thd,sd->ths"
    s = jax.nn.relu(jnp.einsum(spec, qf, kf, precision=jax.lax.Precision.HIGHEST) * scale)  # [T, H_I, S]
    return jnp.einsum("th,ths->ts", weights, s, precision=jax.lax.Precision.HIGHEST)


def topk_positions(logits: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """logits f32[T, S], visible bool[T, S] -> topk_indices i32[T, min(k, S)]: the best visible positions of
    each row, the lower position on ties, in ascending position order, -1 after them where a row sees fewer
    than k tokens (the top-k contract of `pallas_kernels.lightning_indexer`, whose reference this is)."""
    return topk_from_logits(jnp.where(visible, logits, -jnp.inf), k)


def topk_mask(topk_indices: jax.Array, num_keys: int) -> jax.Array:
    """topk_indices i32[T, K] (-1 = none) -> bool[T, num_keys], True at the selected positions."""
    T = topk_indices.shape[0]
    rows = jnp.broadcast_to(jnp.arange(T)[:, None], topk_indices.shape)
    cols = jnp.where(topk_indices >= 0, topk_indices, num_keys)  # out of range: dropped
    return jnp.zeros((T, num_keys), bool).at[rows, cols].set(True, mode="drop")


def causal_topk(p: dict, cfg: DeepseekConfig, x: jax.Array, q_resid: jax.Array, positions: jax.Array) -> jax.Array:
    """One whole sequence (no cache): x [S, D], q_resid [S, Q_lora] -> topk_indices i32[S, min(K, S)] over the
    causal positions (HF `DeepseekV32Indexer`)."""
    q, k, w = indexer_project(p, cfg, x, q_resid, positions)
    logits = index_logits(q, w, k, cfg.index_head_dim**-0.5)  # [S, S]
    S = x.shape[0]
    causal = jnp.tril(jnp.ones((S, S), bool))
    return topk_positions(logits, causal, cfg.index_topk)
