"""One model step over a mixed batch through the paged latent cache.

Per layer: project every token (q, kv_c_normed, k_pe), write the new latent rows into the cache at
`slot_mapping`, then the MLA layer splits the batch as vLLM does: the first `num_decode_tokens` rows go through
`forward_mqa` (absorbed q, latent out, then W_UV), the rest through `forward_mha`; both results go through
o_proj. The stacked cache stays in the scan carry and is updated in place (it is donated by `jit_step`).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mla_jax import attention
from mla_jax.cache import KVCache, write_kv_layer
from mla_jax.config import DeepseekConfig
from mla_jax.layers import linear, rms_norm
from mla_jax.metadata import AttentionMetadata
from mla_jax.mla import absorb_q, mla_project, o_proj, v_up_proj
from mla_jax.model import Params, ffn, layer_groups, lm_head_weight, split_experts


def mla_paged(p: dict, cfg: DeepseekConfig, x: jax.Array, md: AttentionMetadata, cache: KVCache,
              layer: jax.Array, backend: attention.Backend) -> tuple[jax.Array, KVCache]:
    """x [T, D] -> ([T, D], cache with this step's rows of `layer` written)."""
    s = md.shape
    N, L = cfg.num_attention_heads, cfg.kv_lora_rank
    q, kv_c_normed, k_pe = mla_project(p, cfg, x, md.positions)
    cache = write_kv_layer(cache, layer, kv_c_normed, k_pe, md.slot_mapping)
    kv_flat, scale_flat, offset = cache.flat_layers(layer)
    outs = []
    Td = s.num_decode_tokens
    if Td:
        q_mqa = absorb_q(p, cfg, q[:Td]).astype(x.dtype)  # [Td, N, L+R]
        q_mqa = q_mqa.reshape(s.num_decodes, s.decode_query_len, N, L + cfg.qk_rope_head_dim)
        latent, _ = attention.forward_mqa(backend, q_mqa, kv_flat, scale_flat, md.decode, offset,
                                          scale=cfg.softmax_scale, kv_lora_rank=L)  # [Bd, Q, N, L]
        outs.append(v_up_proj(p, latent.reshape(Td, N, L)))  # [Td, N, V]
    if s.num_prefill_tokens:
        outs.append(attention.forward_mha(
            backend, p, cfg, q[Td:], kv_c_normed[Td:], k_pe[Td:], kv_flat, scale_flat, md.prefill, offset,
            workspace_rows=s.workspace_rows, max_chunks=s.max_chunks))  # [Tp, N, V]
    attn = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return o_proj(p, attn.astype(x.dtype)), cache


def forward_step(params: Params, cfg: DeepseekConfig, cache: KVCache, md: AttentionMetadata, *,
                 backend: str = "xla", batch_invariant: bool = False, gmm_impl: str = "ragged_dot"
                 ) -> tuple[jax.Array, KVCache]:
    """One step: (logits f32[num_logits, vocab] at `md.logits_indices`, updated cache). `gmm_impl` picks the
    MoE expert matmul (`mla_jax.layers.expert_gmm`)."""
    be = attention.get_backend(backend, batch_invariant=batch_invariant)
    if cache.num_layers != cfg.num_hidden_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model {cfg.num_hidden_layers}")
    if cache.width != cfg.cache_row_dim:
        raise ValueError(f"cache rows are {cache.width} wide, the model needs L+R = {cfg.cache_row_dim}")
    model = params["model"]
    x = model["embed_tokens"]["weight"][md.input_ids]  # [T, D]
    for name, start, n in layer_groups(cfg):
        is_moe = name == "moe_layers"
        scanned, experts = split_experts(model[name], is_moe, gmm_impl)

        def body(carry, p, is_moe=is_moe, start=start, experts=experts):
            h, cache, layer = carry  # layer: the model's layer index (the cache's); layer - start: the group's
            a, cache = mla_paged(p["self_attn"], cfg, rms_norm(p["input_layernorm"], h, cfg.rms_norm_eps), md,
                                 cache, layer, be)
            h = h + a
            h = h + ffn(p["mlp"], cfg, rms_norm(p["post_attention_layernorm"], h, cfg.rms_norm_eps), is_moe,
                        gmm_impl, experts, layer - start)
            return (h, cache, layer + 1), None

        (x, cache, _), _ = jax.lax.scan(body, (x, cache, jnp.int32(start)), scanned)
    x = rms_norm(model["norm"], x[md.logits_indices], cfg.rms_norm_eps)
    logits = linear({"weight": lm_head_weight(params)}, x).astype(jnp.float32)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("cfg", "backend", "batch_invariant", "gmm_impl"),
                   donate_argnames=("cache",))
def jit_step(params: Params, cfg: DeepseekConfig, cache: KVCache, md: AttentionMetadata, *,
             backend: str = "xla", batch_invariant: bool = False, gmm_impl: str = "ragged_dot"
             ) -> tuple[jax.Array, KVCache]:
    """`forward_step` compiled once per (config, backend, BatchShape); the cache is donated (updated in place)."""
    return forward_step(params, cfg, cache, md, backend=backend, batch_invariant=batch_invariant,
                        gmm_impl=gmm_impl)
