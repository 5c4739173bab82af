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

Drafting k tokens feeds x back as the next step's hidden state. Draft step i (0 <= i < k) runs MTP layer
i % num_mtp_layers (`draft_layer`: vLLM's `DeepSeekMultiTokenPredictor` picks `mtp_start_layer_idx +
spec_step_idx % num_mtp_layers`, so a checkpoint with several MTP layers chains them and one with a single layer
reuses it for every step). MTP layer j attends over its own latent cache layer num_hidden_layers + j, filled at
the target's slots: layer 0 by the pass over every verified row, layers j > 0 (as in vLLM) only at the positions
their single-row draft passes ran, so their context holds rows of earlier drafts (draft quality only: the
verification keeps outputs exact).

On a mesh the same functions run inside the step's `shard_map`s with its `Comm`: the decoder layer's heads,
MLP and experts split as the target's (`mla_jax.sharding` covers the stacked MTP group), the target's
vocab-split embedding / lm_head looked up / all-gathered through the comm.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mla_jax.comm import LOCAL, Comm
from mla_jax.config import DeepseekConfig
from mla_jax.layers import linear, rms_norm
from mla_jax.model import MTP_GROUP, AttentionFn, Params, decoder_layers, full_attention, lm_head_weight

LAYER_KEYS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def has_mtp(params: Params, cfg: DeepseekConfig) -> bool:
    return cfg.num_mtp_layers > 0 and MTP_GROUP in params["model"]


def draft_layer(cfg: DeepseekConfig, i: int) -> int:
    """The MTP layer that makes draft i (0-based), as vLLM picks it: i % num_mtp_layers."""
    return i % cfg.num_mtp_layers


def num_draft_layers(cfg: DeepseekConfig, k: int) -> int:
    """MTP layers (hence extra latent cache layers) that drafting k tokens runs."""
    return min(cfg.num_mtp_layers, k)


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
    comm: Comm = LOCAL,
) -> tuple[jax.Array, Any]:
    """MTP layer j over T rows: the target's hidden states [T, D], the next tokens i32[T] and the rows'
    positions i32[T] -> (MTP hidden state [T, D] before shared_head.norm, loop state). `attention` is the
    layer loop's attention (it sees layer index 0)."""
    p = _layer(params, cfg, j)
    eps = cfg.rms_norm_eps
    table = p["embed_tokens"]["weight"][0] if "embed_tokens" in p else params["model"]["embed_tokens"]["weight"]
    e = comm.embed(table, next_ids, cfg.vocab_size)  # [T, D]
    e = jnp.where((positions == 0)[:, None], jnp.zeros_like(e), e)  # vLLM: position 0 needs no MTP input
    sq = lambda d: jax.tree.map(lambda a: a[0], d)  # noqa: E731
    x = jnp.concatenate([rms_norm(sq(p["enorm"]), e, eps), rms_norm(sq(p["hnorm"]), hidden.astype(e.dtype), eps)], -1)
    x = linear(sq(p["eh_proj"]), x)  # [T, D]
    mcfg = mtp_config(cfg)
    group = "moe_layers" if mcfg.first_k_dense_replace == 0 else "dense_layers"
    sub = {"model": {group: {k: p[k] for k in LAYER_KEYS}}}
    return decoder_layers(sub, mcfg, x, attention, state, gmm_impl=gmm_impl, comm=comm)


def full_vocab(logits: jax.Array, comm: Comm, vocab: int) -> jax.Array:
    """Logits f32[T, vocab or vocab/n] (n-way vocab split over the comm's model axes, as `Comm.embed` reads
    the embedding) -> the whole row on every device."""
    if logits.shape[-1] == vocab:
        return logits
    return jax.lax.all_gather(logits, comm.model_axes, axis=logits.ndim - 1, tiled=True)


def mtp_logits(params: Params, cfg: DeepseekConfig, x: jax.Array, *, j: int = 0, comm: Comm = LOCAL) -> jax.Array:
    """shared_head: x [T, D] -> logits f32[T, vocab] (the whole vocab, also on a mesh)."""
    p = _layer(params, cfg, j)
    head = p["shared_head"]
    x = rms_norm({"weight": head["norm"]["weight"][0]}, x, cfg.rms_norm_eps)
    w = head["head"]["weight"][0] if "head" in head else lm_head_weight(params)
    return full_vocab(linear({"weight": w}, x).astype(jnp.float32), comm, cfg.vocab_size)


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
