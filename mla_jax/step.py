"""One model step over a mixed batch through the paged latent cache, on one device or a mesh.

Per layer (`mla_paged`): project every token (q, kv_c_normed, k_pe), write the new latent rows into the cache
at `slot_mapping`, then split the batch as vLLM does: the first `num_decode_tokens` rows go through
`forward_mqa` (absorbed q, latent out, then W_UV), the rest through `forward_mha`; both results go through
o_proj. The layers are `mla_jax.model.decoder_layers`, the one layer loop of the model; the stacked cache stays
in its carry and is updated in place (it is donated by `jit_step` / `engine_step`).

With a `ParallelPlan` the same step function runs inside one `shard_map` over the plan's mesh, each device on
its shards, with the plan's collectives (`mla_jax.comm.Comm`); without one, with `LOCAL`, the identity. Under
data-parallel attention each "dp" rank runs it on its own metadata (its requests, its page pool), all ranks with
the same static BatchShape.

Sparse-attention models (DeepSeek-V3.2) run `mla_jax.sparse.mla_paged_sparse` in the same layer loop instead,
with the index group's top-k in the loop's carry next to the cache.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax import attention, sparse
from mla_jax.cache import KVCache
from mla_jax.comm import LOCAL, Comm
from mla_jax.config import DeepseekConfig
from mla_jax.metadata import AttentionMetadata
from mla_jax.mla import (
    absorb_q,
    absorb_q_and_write_latent_rows,
    mla_project_q_kv,
    o_proj,
    rope_q_pe,
    v_up_proj,
    write_latent_rows,
)
from mla_jax.model import Params, decoder_layers, embed, lm_logits
from mla_jax.packed import Packed
from mla_jax.rope import rope_cos_sin
from mla_jax.sampling import SamplingArrays, sample
from mla_jax.sharding import DP

if TYPE_CHECKING:
    from mla_jax.parallel import ParallelPlan


def mla_paged(
    p: dict,
    cfg: DeepseekConfig,
    x: jax.Array,
    md: AttentionMetadata,
    cache: KVCache,
    layer: jax.Array,
    backend: attention.Backend,
    *,
    comm: Comm = LOCAL,
    batch_invariant: bool = False,
    rope: tuple[jax.Array, jax.Array] | None = None,
    decode_plan: attention.DecodePlan | None = None,
) -> tuple[jax.Array, KVCache]:
    """x [T, D] -> ([T, D], cache with this step's rows of `layer` written). `cfg` has this device's heads; `md`
    is this device's view (`Comm.local_view`): under DCP its slot_mapping writes only the rank's own tokens.
    `rope`: the rope's (cos, sin) f32[T, R/2] at md.positions, computed once for every layer (`_device_hidden`);
    q_pe is rotated in the absorb kernel for decode rows, by XLA for prefill rows. `decode_plan`: the step's
    `plan_decode` (what every layer's decode kernel shares), None: the kernel builds its own."""
    s = md.shape
    N, L, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    with jax.named_scope("mla_project"):
        q, kv, cos, sin, _ = mla_project_q_kv(p, cfg, x, md.positions, rope=rope, rope_q=False)
    norm, eps = p["kv_a_layernorm"], cfg.rms_norm_eps
    Td = s.num_decode_tokens
    q_mqa = None
    if Td and not s.num_prefill_tokens:  # a decode-only step: absorb_q beside the cache write (one launch on a GPU)
        q_mqa, kv_c_normed, k_pe, cache = absorb_q_and_write_latent_rows(
            p, cfg, q, cache, layer, kv, norm, (cos, sin), md.slot_mapping, eps
        )
    else:
        with jax.named_scope("cache_write"):  # the latent's norm and rope too: one kernel on a GPU
            kv_c_normed, k_pe, cache = write_latent_rows(cache, layer, kv, norm, cos, sin, md.slot_mapping, eps)
    kv_flat, scale_flat, offset = cache.flat_layers(layer)
    outs = []
    if Td:
        with jax.named_scope("absorb_q"):
            if q_mqa is None:
                q_mqa = absorb_q(p, cfg, q[:Td], rope=(cos[:Td], sin[:Td]))
            q_mqa = comm.gather_decode_q(q_mqa.astype(x.dtype))  # [Td, N (dcp*N), L+R]
            q_mqa = q_mqa.reshape(s.num_decodes, s.decode_query_len, -1, L + R)
        with jax.named_scope("attention"):
            latent, lse = attention.forward_mqa(
                backend,
                q_mqa,
                kv_flat,
                scale_flat,
                md.decode,
                offset,
                scale=cfg.softmax_scale,
                kv_lora_rank=L,
                batch_invariant=batch_invariant,
                plan=decode_plan,
            )  # [Bd, Q, N, L]
            latent = comm.combine_decode(latent, lse)  # [Bd, Q, N, L]
        with jax.named_scope("v_up_proj"):
            outs.append(v_up_proj(p, latent.reshape(Td, N, L)))  # [Td, N, V]
    if s.num_prefill_tokens:
        with jax.named_scope("prefill_attention"):
            outs.append(
                attention.forward_mha(
                    backend,
                    p,
                    cfg,
                    rope_q_pe(cfg, q[Td:], cos[Td:], sin[Td:]),
                    kv_c_normed[Td:],
                    k_pe[Td:],
                    kv_flat,
                    scale_flat,
                    md.prefill,
                    offset,
                    workspace_rows=s.workspace_rows,
                    max_chunks=s.max_chunks,
                    comm=comm,
                )
            )  # [Tp, N, V]
    attn = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    with jax.named_scope("o_proj"):
        return o_proj(p, attn.astype(x.dtype)), cache


def _device_hidden(
    params: Params,
    cache: KVCache,
    md: AttentionMetadata,
    *,
    cfg: DeepseekConfig,
    comm: Comm,
    backend: str,
    batch_invariant: bool,
    gmm_impl: str,
) -> tuple[jax.Array, KVCache]:
    """The layers on one device's shards: (last hidden state [T, D] of every row, before the final norm; cache).
    Speculative decoding reads it for the MTP drafter (`mla_jax.spec_decode`)."""
    be = attention.get_backend(backend)
    heads = cfg.num_attention_heads // comm.head_shards
    cfg_loc = cfg if heads == cfg.num_attention_heads else dataclasses.replace(cfg, num_attention_heads=heads)
    view = comm.local_view(md, cache.page_size)  # once per step, for every layer
    x = embed(params, cfg, md.input_ids, comm)
    if cfg.use_sparse:  # the loop state also carries the index group's top-k (positions and slots)
        rows = sparse.token_rows(view)  # once per step
        K = sparse.topk_budget(cfg, view, cache.page_size)
        none = jnp.full((md.shape.num_tokens, K), -1, jnp.int32)

        def sparse_attn(p, h, state, layer):
            out, c, topk = sparse.mla_paged_sparse(p, cfg_loc, h, view, state[0], state[1], layer, be, rows)
            return out, (c, topk)

        x, (cache, _) = decoder_layers(params, cfg, x, sparse_attn, (cache, (none, none)), gmm_impl=gmm_impl, comm=comm)
        return x, cache

    rope = rope_cos_sin(cfg, view.positions)  # once for every layer (XLA left it in the layer loop: 2 kernels a layer)
    plan = plan_decode(be, cfg_loc, view, cache, x.dtype, comm=comm, batch_invariant=batch_invariant)

    def attn(p, h, cache, layer):
        kw = dict(comm=comm, batch_invariant=batch_invariant, rope=rope, decode_plan=plan)
        return mla_paged(p, cfg_loc, h, view, cache, layer, be, **kw)

    return decoder_layers(params, cfg, x, attn, cache, gmm_impl=gmm_impl, comm=comm)


def plan_decode(
    be: attention.Backend,
    cfg: DeepseekConfig,
    md: AttentionMetadata,
    cache: KVCache,
    dtype,
    *,
    comm: Comm = LOCAL,
    batch_invariant: bool = False,
) -> attention.DecodePlan | None:
    """What every layer's decode attention of this step shares (`attention.plan_mqa`: the Hopper kernel's work
    list), built once before the layer loop; None without decode rows or where nothing is shared. `cfg` has this
    device's heads, `md` is this device's view, as `mla_paged` gets them."""
    s = md.shape
    if not s.num_decode_tokens:
        return None
    L = cfg.kv_lora_rank
    heads = cfg.num_attention_heads * comm.dcp  # what comm.gather_decode_q gives each rank
    q = jax.ShapeDtypeStruct((s.num_decodes, s.decode_query_len, heads, L + cfg.qk_rope_head_dim), dtype)
    kv_flat, scale_flat, _ = cache.flat_layers(0)
    kw = dict(scale=cfg.softmax_scale, kv_lora_rank=L, batch_invariant=batch_invariant)
    return attention.plan_mqa(be, q, kv_flat, scale_flat, md.decode, **kw)


def _device_step(params: Params, cache: KVCache, md: AttentionMetadata, *, cfg: DeepseekConfig, **kw):
    """The step on one device's shards: (logits f32[num_logits, vocab (this device's rows)], cache)."""
    x, cache = _device_hidden(params, cache, md, cfg=cfg, **kw)
    return lm_logits(params, cfg, x[md.logits_indices]), cache


def _rank_step(f, params: Params, cache: KVCache, md: AttentionMetadata):
    """DP: the step on this rank's metadata (the [1, ...] shard of the stacked [dp, ...] metadata)."""
    return f(params, cache, jax.tree.map(lambda a: a[0], md))


def check_cache(cfg: DeepseekConfig, cache: KVCache) -> None:
    """The cache has the model's layers (and, optionally, one more per MTP layer the drafter runs) of L+R rows."""
    layers = tuple(range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_mtp_layers + 1))
    if cache.num_layers not in layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model {' or '.join(map(str, layers))}")
    if cache.width != cfg.cache_row_dim:
        raise ValueError(f"cache rows are {cache.width} wide, the model needs L+R = {cfg.cache_row_dim}")


def forward_step(
    params: Params,
    cfg: DeepseekConfig,
    cache: KVCache,
    md: AttentionMetadata,
    *,
    backend: str = "xla",
    plan: ParallelPlan | None = None,
    batch_invariant: bool = False,
    gmm_impl: str = "ragged_dot",
) -> tuple[jax.Array, KVCache]:
    """One step: (logits f32[num_logits, vocab] at `md.logits_indices`, updated cache).

    `backend` names the attention backend (`mla_jax.attention.BACKENDS`), `gmm_impl` the MoE expert matmul
    (`mla_jax.layers.expert_gmm`); `batch_invariant` decodes with one KV split (outputs independent of the
    batch). With `plan`, params and cache are laid out on its mesh and `md` is the replicated metadata built
    with the virtual page size (page_size * dcp); the logits come out split by vocab. Under DP (`plan.dp` > 1)
    `md` is the per-rank metadata stacked on a leading [dp] axis (`parallel.stack_metadata`, each rank's block
    tables numbering its own pool's pages) and the logits are [dp * num_logits, vocab], rank-major."""
    check_cache(cfg, cache)
    if cfg.use_sparse:
        sparse.check_sparse_cache(cfg, cache)
        if plan is not None:
            raise NotImplementedError(f"{cfg.model_type}: sparse attention on a mesh (ParallelPlan) is not supported")
    kw = dict(cfg=cfg, backend=backend, batch_invariant=batch_invariant, gmm_impl=gmm_impl)
    if plan is None:
        return _device_step(params, cache, md, comm=LOCAL, **kw)
    plan.validate(cfg)
    if cache.page_size % plan.dcp:
        raise ValueError(f"cache page axis {cache.page_size} is not a multiple of dcp={plan.dcp}")
    if plan.dp > 1 and (md.input_ids.ndim != 2 or md.input_ids.shape[0] != plan.dp):
        raise ValueError(
            f"dp={plan.dp}: the metadata needs a leading [dp] axis (parallel.stack_metadata), input_ids has shape "
            f"{tuple(md.input_ids.shape)}"
        )
    if cache.num_pages % plan.dp:
        raise ValueError(f"cache has {cache.num_pages} pages, not a multiple of dp={plan.dp} (one pool per rank)")
    cspecs = plan.cache_specs(cache.is_fp8)
    f = functools.partial(_device_step, comm=plan.comm(cfg), **kw)
    if plan.dp > 1:  # each DP rank its own [1, ...] slice of the stacked metadata
        f = functools.partial(_rank_step, f)
    return jax.shard_map(
        f,
        mesh=plan.mesh,
        in_specs=(plan.param_specs(params, cfg), cspecs, P(DP) if plan.dp > 1 else P()),
        out_specs=(plan.logits_spec(params, cfg), cspecs),
        check_vma=False,
    )(params, cache, md)  # Pallas calls carry no varying-axes types


STATIC_ARGNAMES = ("cfg", "backend", "plan", "batch_invariant", "gmm_impl")


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES, donate_argnames=("cache",))
def jit_step(
    params: Params,
    cfg: DeepseekConfig,
    cache: KVCache,
    md: AttentionMetadata,
    *,
    backend: str = "xla",
    plan: ParallelPlan | None = None,
    batch_invariant: bool = False,
    gmm_impl: str = "ragged_dot",
) -> tuple[jax.Array, KVCache]:
    """`forward_step` compiled once per (config, backend, plan, BatchShape); the cache is donated (updated in
    place)."""
    return forward_step(
        params, cfg, cache, md, backend=backend, plan=plan, batch_invariant=batch_invariant, gmm_impl=gmm_impl
    )


def step_batch(md: AttentionMetadata, sampling: SamplingArrays, prev_index=None) -> Packed:
    """`engine_step`'s host inputs as one buffer: the metadata, the sampling arrays and `prev_index` i32[T] (per
    token row, the row of the previous step's token buffer that holds its input id, or -1 where `md.input_ids`
    has it; all -1 when None)."""
    if prev_index is None:
        prev_index = np.full(np.shape(md.input_ids), -1, np.int32)  # DP: [dp, T]
    return Packed.of((md, sampling, prev_index))


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES, donate_argnames=("cache",))
def engine_step(
    params: Params,
    cfg: DeepseekConfig,
    cache: KVCache,
    batch: Packed,
    token_buffer: jax.Array | None = None,
    *,
    backend: str,
    plan: ParallelPlan | None = None,
    batch_invariant: bool = False,
    gmm_impl: str = "ragged_dot",
) -> tuple[jax.Array, jax.Array, KVCache, jax.Array | None]:
    """Forward + sampling: (token ids i32[num_logits], logprobs f32[num_logits], updated cache, token buffer).
    `batch` is `step_batch(md, sampling, prev_index)`: the step's host inputs in one host→device transfer. On a
    mesh the logits are all-gathered and every device samples the same tokens.

    `token_buffer` i32[S] (S >= num_logits, fixed by the caller so that every step has the same signature) holds
    the previous step's sampled ids: rows with `prev_index` >= 0 take their input id from it, so the host can
    schedule and send step n+1 before it has step n's tokens (`Engine` async scheduling). The step returns it
    with this step's ids in rows [0, num_logits); None in, None out.

    With `sampling.num_top_logprobs` = n > 0 (static: a separate compiled variant, used only for steps where a
    request asks for top logprobs) token ids and logprobs are [num_logits, 1 + n]: column 0 the sampled token,
    columns 1..n the n most likely ones (`mla_jax.sampling.sample`)."""
    md, sampling, prev_index = batch.unpack()
    if token_buffer is not None:
        prev = token_buffer[jnp.maximum(prev_index, 0)]
        md = dataclasses.replace(md, input_ids=jnp.where(prev_index >= 0, prev, md.input_ids))
    logits, cache = forward_step(
        params, cfg, cache, md, backend=backend, plan=plan, batch_invariant=batch_invariant, gmm_impl=gmm_impl
    )
    if plan is None:
        with jax.named_scope("sample"):
            tokens, logprobs = sample(logits, sampling)
    else:
        rep = NamedSharding(plan.mesh, P())
        tokens, logprobs = sample(jax.lax.with_sharding_constraint(logits, rep), sampling)
        tokens, logprobs = (
            jax.lax.with_sharding_constraint(tokens, rep),
            jax.lax.with_sharding_constraint(logprobs, rep),
        )
    if token_buffer is not None:
        token_buffer = token_buffer.at[: tokens.shape[0]].set(tokens if tokens.ndim == 1 else tokens[:, 0])
    return tokens, logprobs, cache, token_buffer
