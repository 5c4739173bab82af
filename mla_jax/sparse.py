"""DeepSeek Sparse Attention through the paged caches: one MLA layer of the step for sparse models.

Per layer (`mla_paged_sparse`, called by `mla_jax.step.mla_paged` for sparse models inside the one layer loop):

1. project every token as dense MLA does, plus the q latent; write the latent rows at `slot_mapping`;
2. on an indexer ("full") layer: write this step's index keys into the index-key cache at the same slots, score
   every token row against the cached index keys of its request (positions < its seq_len, so a prefill token
   sees its context and the new tokens up to itself), keep the top K positions (`topk_indices`, -1 = none)
   and convert them once to physical slots within a layer (`topk_slots`); a "shared" layer reuses the pair
   from the loop's carry (vLLM's `SparseMLAIndexGroup`: one layer produces the indices, the group reuses them);
3. decode rows: token-sparse absorbed MQA over the selected latent rows (`Backend.sparse_mla_decode`);
4. prefill rows: masked dense MHA (new tokens causal + the context chunk by chunk, each key masked unless it
   is among the query's top-k) while the batch's prefill sequences are at most the backend's threshold long
   (`attention.sparse_prefill_mha_max_len`), else the token-sparse MQA path as for decode rows (chosen at run
   time by `lax.cond`; both are compiled).

A row that sees at most K tokens keeps all of them, so such sequences equal dense MLA.

Shapes: T tokens of the step (Td decode rows first, then Tp prefill tokens), K' = min(K, max_pages * G).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mla_jax import attention
from mla_jax.cache import KVCache, write_index_k_layer
from mla_jax.comm import LOCAL
from mla_jax.config import DeepseekConfig
from mla_jax.indexer import indexer_project, topk_mask
from mla_jax.metadata import AttentionMetadata
from mla_jax.mla import absorb_q, mla_project_q_kv, o_proj, up_project_kv, v_up_proj, write_latent_rows

TopK = tuple[jax.Array, jax.Array]  # (topk_indices i32[T, K'] logical positions, topk_slots i32[T, K']), -1 = none


def token_rows(md: AttentionMetadata) -> tuple[jax.Array, jax.Array]:
    """Each token row's request block table i32[T, max_pages] and seq_len i32[T] (keys it may see; 0 for
    padding rows), from the step's decode block and prefill segment."""
    s = md.shape
    parts_bt, parts_sl = [], []
    if s.num_decode_tokens:
        parts_bt.append(jnp.repeat(md.decode.block_table, s.decode_query_len, axis=0))
        parts_sl.append(md.decode.seq_lens.reshape(-1))
    if s.num_prefill_tokens:
        qsl = md.prefill.query_start_loc
        j = jnp.arange(s.num_prefill_tokens, dtype=jnp.int32)
        seq = jnp.clip(jnp.searchsorted(qsl, j, side="right") - 1, 0, s.num_prefills - 1)
        valid = j < qsl[-1]
        parts_bt.append(md.prefill.block_table[seq])
        parts_sl.append(jnp.where(valid, md.prefill.context_lens[seq] + j - qsl[seq] + 1, 0).astype(jnp.int32))
    return jnp.concatenate(parts_bt, axis=0), jnp.concatenate(parts_sl, axis=0)


def topk_budget(cfg: DeepseekConfig, md: AttentionMetadata, page_size: int) -> int:
    """K' = min(index_topk, block table capacity): the static width of the step's top-k tables."""
    return min(cfg.index_topk, md.shape.max_pages * page_size)


def positions_to_slots(
    topk_indices: jax.Array, block_table: jax.Array, seq_lens: jax.Array, page_size: int
) -> jax.Array:
    """topk_indices i32[T, K'] (positions, -1 = none), block_table i32[T, max_pages], seq_lens i32[T] -> slots
    within a layer. An entry outside the row's sequence [0, seq_len) becomes -1: it can never read another
    request's rows or a padding page (`check_topk_indices` reports such a table on the host)."""
    ok = (topk_indices >= 0) & (topk_indices < seq_lens[:, None])
    pos = jnp.where(ok, topk_indices, 0)
    page = jnp.take_along_axis(block_table, pos // page_size, axis=1)
    return jnp.where(ok, page * page_size + pos % page_size, -1).astype(jnp.int32)


def check_topk_indices(topk_indices, seq_lens) -> None:
    """Host-side check of a concrete top-k table: every entry of row t is -1 or a position in [0, seq_lens[t]).
    Raises ValueError naming the first bad row, entry and position."""
    import numpy as np

    t, sl = np.asarray(topk_indices), np.asarray(seq_lens)
    if t.ndim != 2 or sl.shape != (t.shape[0],):
        raise ValueError(f"topk_indices must be [T, K] with seq_lens [T], got {t.shape} and {sl.shape}")
    bad = (t < -1) | (t >= sl[:, None])
    if bad.any():
        row, col = map(int, np.argwhere(bad)[0])
        raise ValueError(
            f"topk_indices row {row} entry {col} names position {int(t[row, col])}, outside the row's sequence "
            f"of {int(sl[row])} tokens ({int(bad.sum())} such entries)"
        )


def paged_topk(
    backend: attention.Backend,
    p_idx: dict,
    cfg: DeepseekConfig,
    x: jax.Array,
    q_resid: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    index_layer: jax.Array,
    slot_mapping: jax.Array,
    block_table: jax.Array,
    seq_lens: jax.Array,
    k: int,
) -> tuple[KVCache, TopK]:
    """Write this step's index keys, then every row's top-k over its request's cached index keys
    (`Backend.indexer_topk`: the score kernel + exact top-k, or its plain-JAX reference)."""
    q, k_i, w = indexer_project(p_idx, cfg, x, q_resid, positions)  # [T, H_I, D_I], [T, D_I], [T, H_I]
    cache = write_index_k_layer(cache, index_layer, k_i, slot_mapping)
    ik = cache.index_k_cache[index_layer]  # [pages, G, D_I]
    k_scale = None if cache.index_k_scale is None else cache.index_k_scale[index_layer]
    topk = backend.indexer_topk(
        q, w, ik, block_table, seq_lens, scale=cfg.index_head_dim**-0.5, k=k, k_scale=k_scale
    )  # [T, K']
    return cache, (topk, positions_to_slots(topk, block_table, seq_lens, ik.shape[1]))


def _masked_attention(q, k, v, mask, scale):
    """q [Tq, N, P+R], k [Tk, N, P+R], v [Tk, N, V], mask bool[Tq, Tk] -> (out f32[Tq, N, V], lse f32[Tq, N])."""
    logits = (
        jnp.einsum("qnd,knd->nqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        * scale
    )  # [N, Tq, Tk]
    logits = jnp.where(mask[None], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    has = denom > 0
    out = jnp.einsum(
        "nqk,knv->qnv", e / jnp.where(has, denom, 1.0), v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    lse = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf)[..., 0]  # [N, Tq]
    return out, lse.T


def sparse_prefill_mha(
    backend: attention.Backend,
    p: dict,
    cfg: DeepseekConfig,
    q,
    kv_c_normed,
    k_pe,
    kv_flat,
    scale_flat,
    md: AttentionMetadata,
    block_offset,
    topk_indices,
    seq_lens,
) -> jax.Array:
    """Masked dense MHA for the prefill tokens: q [Tp, N, P+R] against the new tokens (causal) and the context
    chunks (gathered from the latent cache, up-projected), each key kept only if its position is among the
    query's topk_indices i32[Tp, K']; parts merged through their LSEs. -> [Tp, N, V]."""
    s, pre = md.shape, md.prefill
    scale, L = cfg.softmax_scale, cfg.kv_lora_rank
    Tp = q.shape[0]
    qsl = pre.query_start_loc
    j = jnp.arange(Tp, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qsl, j, side="right") - 1, 0, s.num_prefills - 1)
    valid = seq_lens > 0
    pos = seq_lens - 1  # the query's own position
    selected = topk_mask(topk_indices, s.max_pages * kv_flat.shape[1])  # [Tp, max_pages*G]
    k, v = up_project_kv(p, cfg, kv_c_normed, k_pe)  # [Tp, N, P+R], [Tp, N, V]
    pick = jnp.take_along_axis(selected, jnp.clip(pos, 0)[None, :].repeat(Tp, 0), axis=1)  # [Tp, Tp]: t sel j
    mask = valid[:, None] & valid[None, :] & (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None]) & pick
    out, lse = _masked_attention(q, k, v, mask, scale)
    if s.max_chunks == 0:
        return out.astype(q.dtype)
    block_table = pre.block_table + block_offset
    W = s.workspace_rows
    r = jnp.arange(W, dtype=jnp.int32)

    def chunk(c, carry):
        acc, acc_lse = carry
        cu = pre.cu_chunk_lens[c]
        ws = LOCAL.gather_cache(
            backend.gather_cache,
            kv_flat,
            block_table,
            pre.chunk_starts[c],
            cu,
            workspace_rows=W,
            kv_scale=scale_flat,
            out_dtype=q.dtype,
        )  # [W, L+R]
        kc, vc = up_project_kv(p, cfg, ws[:, :L], ws[:, None, L:])  # [W, N, P+R], [W, N, V]
        rseq = jnp.clip(jnp.searchsorted(cu, r, side="right") - 1, 0, s.num_prefills - 1)
        rpos = pre.chunk_starts[c][rseq] + r - cu[rseq]  # context position of workspace row r
        rvalid = r < cu[-1]
        sel = jnp.take_along_axis(
            selected, jnp.clip(rpos, 0, selected.shape[1] - 1)[None, :].repeat(Tp, 0), axis=1
        )  # [Tp, W]
        m = valid[:, None] & rvalid[None, :] & (rseq[None, :] == seq[:, None]) & sel
        o, l = _masked_attention(q, kc, vc, m, scale)
        return backend.merge_attn_states(acc, acc_lse, o, l)

    init = (jnp.zeros(out.shape, jnp.float32), jnp.full(lse.shape, -jnp.inf, jnp.float32))
    ctx_out, ctx_lse = jax.lax.fori_loop(0, jnp.minimum(pre.num_chunks, s.max_chunks), chunk, init)
    merged, _ = backend.merge_attn_states(ctx_out, ctx_lse, out, lse)
    return merged.astype(q.dtype)


def mla_paged_sparse(
    p: dict,
    cfg: DeepseekConfig,
    x: jax.Array,
    md: AttentionMetadata,
    cache: KVCache,
    topk: TopK,
    layer: jax.Array,
    backend: attention.Backend,
    rows: tuple[jax.Array, jax.Array],
) -> tuple[jax.Array, KVCache, TopK]:
    """x [T, D] -> ([T, D], cache with this layer's latent and index rows written, the layer's top-k).

    `topk` is the carry from the previous layer (read on "shared" layers); `rows` = `token_rows(md)`."""
    s = md.shape
    N, L = cfg.num_attention_heads, cfg.kv_lora_rank
    block_table, seq_lens = rows
    q, kv, cos, sin, q_resid = mla_project_q_kv(p, cfg, x, md.positions)
    norm, eps = p["kv_a_layernorm"], cfg.rms_norm_eps
    kv_c_normed, k_pe, cache = write_latent_rows(cache, layer, kv, norm, cos, sin, md.slot_mapping, eps)
    K = topk[0].shape[1]

    def own(cache):
        index_layer = jnp.asarray([cfg.indexer_slot(i) for i in range(cfg.num_hidden_layers)], jnp.int32)[layer]
        return paged_topk(
            backend,
            p["indexer"],
            cfg,
            x,
            q_resid,
            md.positions,
            cache,
            index_layer,
            md.slot_mapping,
            block_table,
            seq_lens,
            K,
        )

    if cfg.shares_topk:
        is_full = jnp.asarray([cfg.is_indexer_layer(i) for i in range(cfg.num_hidden_layers)])[layer]
        cache, topk = jax.lax.cond(is_full, own, lambda c: (c, topk), cache)
    else:
        cache, topk = own(cache)
    topk_indices, topk_slots = topk
    kv_flat, scale_flat, offset = cache.flat_layers(layer)
    g = kv_flat.shape[1]
    slots = jnp.where(topk_slots >= 0, topk_slots + offset * g, -1)  # into the layer-flattened pool
    q_mqa = absorb_q(p, cfg, q).astype(x.dtype)  # [T, N, L+R]

    def sparse_mqa(qm, sl):  # [R, N, L+R], [R, K'] -> [R, N, V]
        latent, _ = backend.sparse_mla_decode(
            qm[:, None], kv_flat, sl[:, None], scale=cfg.softmax_scale, kv_scale=scale_flat, kv_lora_rank=L
        )  # [R, 1, N, L]
        return v_up_proj(p, latent[:, 0])

    outs = []
    Td = s.num_decode_tokens
    if Td:
        outs.append(sparse_mqa(q_mqa[:Td], slots[:Td]))  # [Td, N, V]
    if s.num_prefill_tokens:

        def mha():
            return sparse_prefill_mha(
                backend,
                p,
                cfg,
                q[Td:],
                kv_c_normed[Td:],
                k_pe[Td:],
                kv_flat,
                scale_flat,
                md,
                offset,
                topk_indices[Td:],
                seq_lens[Td:],
            ).astype(x.dtype)

        def mqa():
            return sparse_mqa(q_mqa[Td:], slots[Td:]).astype(x.dtype)

        threshold = attention.sparse_prefill_mha_max_len(backend, N)
        outs.append(jax.lax.cond(jnp.max(seq_lens[Td:]) <= threshold, mha, mqa))  # [Tp, N, V]
    attn = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return o_proj(p, attn.astype(x.dtype)), cache, topk


def check_sparse_cache(cfg: DeepseekConfig, cache: KVCache) -> None:
    """The index-key cache a sparse model needs: present, [num_indexer_layers, pages, G, index_head_dim], a
    cache dtype (bf16 / fp8 e4m3 with scales / fp32). Raises ValueError naming the problem."""
    ik = cache.index_k_cache
    if ik is None:
        raise ValueError(
            f"{cfg.model_type} uses sparse attention: the cache needs an index-key cache "
            "(mla_jax.cache.init_kv_cache_for(cfg, ...) or init_kv_cache(index_head_dim=...))"
        )
    want = (cfg.num_indexer_layers, cache.num_pages, cache.page_size, cfg.index_head_dim)
    if tuple(ik.shape) != want:
        raise ValueError(
            f"index-key cache has shape {tuple(ik.shape)}, expected {want} "
            "(indexer layers, pages, page size, index_head_dim)"
        )
    ok = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32))
    if ik.dtype not in ok:
        raise ValueError(f"index-key cache dtype {ik.dtype} is not supported (bf16, float8_e4m3fn + scale, fp32)")
    fp8 = ik.dtype == jnp.dtype(jnp.float8_e4m3fn)
    if fp8 and (cache.index_k_scale is None or tuple(cache.index_k_scale.shape) != want[:3]):
        raise ValueError(f"an fp8 index-key cache needs index_k_scale of shape {want[:3]}")
    if not fp8 and cache.index_k_scale is not None:
        raise ValueError(f"index_k_scale given for an index-key cache of dtype {ik.dtype} (fp8 only)")
