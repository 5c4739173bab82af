"""Plain-jnp whole-sequence causal attention in float32: the ground truth for the model's paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_mha(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, scale: float) -> jnp.ndarray:
    """q, k [S, N, P+R]; v [S, N, V] -> [S, N, V] in float32. Query s sees keys 0..s."""
    S = q.shape[0]
    logits = jnp.einsum("snd,tnd->nst", q.astype(jnp.float32), k.astype(jnp.float32)) * scale  # [N, S, S]
    mask = jnp.tril(jnp.ones((S, S), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("nst,tnv->snv", probs, v.astype(jnp.float32))


def causal_mqa(q: jnp.ndarray, kv_c_and_k_pe: jnp.ndarray, scale: float, kv_lora_rank: int) -> jnp.ndarray:
    """Absorbed MQA: q [S, N, L+R], one shared KV row per token [S, L+R] -> latent output [S, N, L] (f32).

    K is the whole row; V is its first L (latent) columns.
    """
    S = q.shape[0]
    kv = kv_c_and_k_pe.astype(jnp.float32)
    logits = jnp.einsum("snd,td->nst", q.astype(jnp.float32), kv) * scale  # [N, S, S]
    mask = jnp.tril(jnp.ones((S, S), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    return jnp.einsum("nst,tl->snl", probs, kv[:, :kv_lora_rank])
