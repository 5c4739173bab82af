"""DeepSeek-V3's multi-token prediction (MTP) module, as vLLM's `deepseek_mtp.py` runs it for speculation.

MTP layer j is HF layer `model.layers.{num_hidden_layers + j}`: a full decoder layer plus

    enorm, hnorm {"weight": [D]}, eh_proj {"weight": [D, 2D]}, shared_head {"norm": {"weight": [D]},
    "head": {"weight": [vocab, D]}}, embed_tokens {"weight": [vocab, D]}

(`embed_tokens` and `shared_head.head` are optional: absent, the target's embedding / lm_head serve). Our params
keep them stacked over the MTP layers in `params["model"]["mtp_layers"]` (`mla_jax.model.param_groups`).

At position p the module reads the target's last hidden state h_p (before the final norm) and the embedding of
the token at p+1, and predicts the token at p+2:

    x = eh_proj(concat(enorm(embed(t_{p+1})), hnorm(h_p)))      # embedding zeroed at position 0, as vLLM does
    x = decoder layer(x)                                          # through `mla_jax.model.decoder_layers`
    logits = shared_head.head(shared_head.norm(x))

Drafting k tokens feeds x back as the next step's hidden state. The decoder layer attends over its own latent
cache layer (the engine's cache layer num_hidden_layers), filled at the target's slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mla_jax.config import DeepseekConfig
from mla_jax.layers import linear, rms_norm
from mla_jax.model import MTP_GROUP, AttentionFn, Params, decoder_layers, full_attention, lm_head_weight

LAYER_KEYS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def has_mtp(params: Params, cfg: DeepseekConfig) -> bool:
    return cfg.num_mtp_layers > 0 and MTP_GROUP in params["model"]


@functools.lru_cache(maxsize=None)
def mtp_config(cfg: DeepseekConfig) -> DeepseekConfig:
    """The config under which one MTP decoder layer runs through `decoder_layers`: one layer, dense or MoE as
    HF layer num_hidden_layers is."""
    moe = cfg.is_moe_layer(cfg.num_hidden_layers)
    return dataclasses.replace(
        cfg, num_hidden_layers=1, first_k_dense_replace=0 if moe else 1, num_nextn_predict_layers=0
    )


def _layer(params: Params, cfg: DeepseekConfig, j: int) -> Params:
    if not has_mtp(params, cfg):
        raise ValueError(
            f"the model has no MTP layers (config num_nextn_predict_layers={cfg.num_nextn_predict_layers})"
        )
    if not 0 <= j < cfg.num_mtp_layers:
        raise IndexError(f"MTP layer {j} out of range [0, {cfg.num_mtp_layers})")
    stacked = params["model"][MTP_GROUP]
    return stacked if cfg.num_mtp_layers == 1 else jax.tree.map(lambda a: a[j : j + 1], stacked)  # [1, ...]


def mtp_hidden(
    params: Params,
    cfg: DeepseekConfig,
    hidden: jax.Array,
    next_ids: jax.Array,
    positions: jax.Array,
    attention: AttentionFn,
    state: Any,
    *,
    j: int = 0,
    gmm_impl: str = "ragged_dot",
) -> tuple[jax.Array, Any]:
    """MTP layer j over T rows: the target's hidden states [T, D], the next tokens i32[T] and the rows'
    positions i32[T] -> (MTP hidden state [T, D] before shared_head.norm, loop state). `attention` is the
    layer loop's attention (it sees layer index 0)."""
    p = _layer(params, cfg, j)
    eps = cfg.rms_norm_eps
    table = p["embed_tokens"]["weight"][0] if "embed_tokens" in p else params["model"]["embed_tokens"]["weight"]
    e = jnp.take(table, next_ids, axis=0)  # [T, D]
    e = jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e)  # vLLM: position 0 needs no MTP input
    sq = lambda d: jax.tree.map(lambda a: a[0], d)  # noqa: E731
    x = jnp.concatenate([rms_norm(sq(p["enorm"]), e, eps), rms_norm(sq(p["hnorm"]), hidden.astype(e.dtype), eps)], -1)
    x = linear(sq(p["eh_proj"]), x)  # [T, D]
    mcfg = mtp_config(cfg)
    group = "moe_layers" if mcfg.first_k_dense_replace == 0 else "dense_layers"
    sub = {"model": {group: {k: p[k] for k in LAYER_KEYS}}}
    return decoder_layers(sub, mcfg, x, attention, state, gmm_impl=gmm_impl)


def mtp_logits(params: Params, cfg: DeepseekConfig, x: jax.Array, *, j: int = 0) -> jax.Array:
    """shared_head: x [T, D] -> logits f32[T, vocab]."""
    p = _layer(params, cfg, j)
    head = p["shared_head"]
    x = rms_norm({"weight": head["norm"]["weight"][0]}, x, cfg.rms_norm_eps)
    w = head["head"]["weight"][0] if "head" in head else lm_head_weight(params)
    return linear({"weight": w}, x).astype(jnp.float32)


def mtp_forward(
    params: Params,
    cfg: DeepseekConfig,
    input_ids: jax.Array,
    hidden: jax.Array,
    *,
    j: int = 0,
    attention: str = "naive",
    gmm_impl: str = "ragged_dot",
) -> jax.Array:
    """The cache-free MTP forward (training, tests): input_ids i32[B, S] and the target's hidden states
    [B, S, D] (`mla_jax.model.forward_hidden`) -> logits f32[B, S-1, vocab], row p predicting token p+2 from
    (h_p, token p+1)."""
    B, S = input_ids.shape
    h = hidden[:, :-1].reshape(B * (S - 1), -1)
    nxt = input_ids[:, 1:].reshape(-1)
    pos = jnp.tile(jnp.arange(S - 1, dtype=jnp.int32), B)
    x, _ = mtp_hidden(params, cfg, h, nxt, pos, full_attention(cfg, B, S - 1, attention), None, j=j, gmm_impl=gmm_impl)
    return mtp_logits(params, cfg, x, j=j).reshape(B, S - 1, -1)
