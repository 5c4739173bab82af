"""Token-sparse latent MQA (DeepSeek Sparse Attention): each query row attends only to the cache rows its
[rows, K] table of physical slots names (the lightning indexer's top-k, converted from positions to slots
once per index group), instead of every row of its block table.

    sparse_mla_decode(q [B, Q, N, L+R], kv_cache [pages, G, L+R], topk_slots i32[B, Q, K], *, scale,
                      kv_scale=None, kv_lora_rank) -> (out [B, Q, N, L], lse f32[B, Q, N])

A slot is page * G + offset in `kv_cache` (pages flattened over layers: the caller adds its layer's offset);
-1 means "no token" (a row sees fewer than K tokens, or a padding row: all -1, out 0 and lse -inf). K = the
latent row as key, its first L columns as value, as in `mla_decode`. The fp8 cache takes its per-token
`kv_scale` [pages, G]. Rows are independent, so decode rows, multi-token rows and prefill tokens all go
through the same call (prefill tokens as rows with Q = 1).

`sparse_mla_decode_reference` is the float32 reference: it gathers the named rows and runs a plain softmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def validate_sparse_decode(q, kv_cache, topk_slots, kv_scale, kv_lora_rank: int) -> None:
    """Shapes and dtypes, with errors that name the argument (trace time, before any work)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, N, L+R], got shape {q.shape}")
    if kv_cache.ndim != 3 or kv_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"kv_cache must be [pages, G, {q.shape[-1]}], got shape {kv_cache.shape}")
    if topk_slots.ndim != 3 or topk_slots.shape[:2] != q.shape[:2]:
        raise ValueError(f"topk_slots must be [B, Q, K] = [{q.shape[0]}, {q.shape[1]}, K], got {topk_slots.shape}")
    if topk_slots.dtype != jnp.int32:
        raise ValueError(f"topk_slots must be int32, got {topk_slots.dtype}")
    if not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must be in (0, {q.shape[-1]})")
    fp8 = kv_cache.dtype == jnp.dtype(jnp.float8_e4m3fn)
    if fp8 != (kv_scale is not None):
        raise ValueError(f"kv_scale must be given exactly for an fp8 cache (cache dtype {kv_cache.dtype})")
    if kv_scale is not None and kv_scale.shape != kv_cache.shape[:2]:
        raise ValueError(f"kv_scale must be [pages, G] = {kv_cache.shape[:2]}, got {kv_scale.shape}")


def check_topk_slots(topk_slots, num_slots: int) -> None:
    """Host-side check of a concrete table: every entry is -1 or a slot in [0, num_slots)."""
    import numpy as np

    t = np.asarray(topk_slots)
    bad = t[(t < -1) | (t >= num_slots)]
    if bad.size:
        raise ValueError(f"topk_slots holds slot {int(bad[0])} outside [-1, {num_slots}) ({bad.size} entries)")


def sparse_mla_decode_reference(
    q, kv_cache, topk_slots, *, scale: float, kv_scale=None, kv_lora_rank: int = 512, interpret: bool = False
):
    """Float32 reference: gather the K named rows per query row, mask -1 entries, softmax. Same outputs."""
    del interpret
    validate_sparse_decode(q, kv_cache, topk_slots, kv_scale, kv_lora_rank)
    pages, g, w = kv_cache.shape
    valid = topk_slots >= 0  # [B, Q, K]
    slots = jnp.where(valid, topk_slots, 0)
    kv = kv_cache.reshape(pages * g, w)[slots].astype(jnp.float32)  # [B, Q, K, L+R]
    if kv_scale is not None:
        kv = kv * kv_scale.reshape(pages * g)[slots][..., None]
    kv = jnp.where(valid[..., None], kv, 0.0)  # unnamed rows (garbage, NaN) never reach p @ v
    logits = scale * jnp.einsum("bqnd,bqkd->bqnk", q.astype(jnp.float32), kv, precision=jax.lax.Precision.HIGHEST)
    logits = jnp.where(valid[:, :, None, :], logits, -jnp.inf)  # [B, Q, N, K]
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    has = denom > 0
    p = e / jnp.where(has, denom, 1.0)
    out = jnp.einsum("bqnk,bqkl->bqnl", p, kv[..., :kv_lora_rank], precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf)[..., 0]
    return out.astype(q.dtype), lse
