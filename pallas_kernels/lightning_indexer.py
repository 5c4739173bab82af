"""The lightning indexer's scores over the paged index-key cache (DeepSeek-V3.2 sparse attention) as a Pallas
kernel (Triton lowering), and its exact top-k.

    indexer_logits(q [T, H, D], weights f32[T, H], index_k_cache [pages, G, D], block_table i32[T, max_pages],
                   seq_lens i32[T], *, scale, k_scale=None) -> f32[T, S]     (S = max_pages * G)

    logits[t, s] = sum_h weights[t, h] * relu(scale * q[t, h] . k[s])   for s < seq_lens[t], else -inf

where k[s] is the cached index key of token s of row t's request (page block_table[t, s // G], offset s % G;
fp8 keys times their per-token k_scale). Every token row of a step (decode rows, multi-token rows, prefill
tokens, each with its request's block table row and the number of keys it sees) goes through one call.
`indexer_topk` keeps each row's K best positions with `lax.top_k` on those logits: exact, best first, equal
scores in position order (lower first; HF's torch.topk orders CPU ties arbitrarily, so fixtures avoid them),
-1 where a row sees fewer than K keys.

Kernel: grid (T, S / block_k). A program loads its row's q [H, D] and weights once, gathers block_k key rows
through the block table (masked loads: keys at or past seq_len, never-written pages, are not read), one dot
[H, D] x [D, block_k] in f32, ReLU, the weighted sum over heads, and writes block_k logits; blocks wholly past
seq_len only write -inf. Triton needs powers of two >= 16 for the dot: D and block_k are, heads are padded to
16 with zero weights; the page size must be a power of two (shift and mask). fp8 keys are upcast to q's dtype
and the scale applied to the dot's output. Rows are the fastest grid axis, so the prefill tokens of a request,
which read the same key blocks, run side by side and share them through L2.

Shapes: T query rows, H indexer heads (H_I), D index head dim (D_I), G page size, S key positions, K top-k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import FLOAT_DTYPES, FP8, cdiv, is_pow2, next_pow2


def validate_indexer(q, weights, index_k_cache, block_table, seq_lens, k_scale, *, for_kernel: bool = False) -> None:
    """The contract (trace time, before any work); errors name the argument."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    t, h, d = q.shape
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be bfloat16, float16 or float32, got {q.dtype}")
    if weights.shape != (t, h):
        raise ValueError(f"weights must be [T, H] = {(t, h)}, got {weights.shape}")
    if index_k_cache.ndim != 3 or index_k_cache.shape[-1] != d:
        raise ValueError(f"index_k_cache must be [pages, G, {d}], got shape {index_k_cache.shape}")
    cdt = jnp.dtype(index_k_cache.dtype)
    if cdt not in FLOAT_DTYPES + (FP8,):
        raise ValueError(f"index_k_cache dtype must be bf16/f16/f32/float8_e4m3fn (+ k_scale), got {cdt}")
    if (cdt == FP8) != (k_scale is not None):
        raise ValueError(f"k_scale must be given exactly for an fp8 index_k_cache (its dtype is {cdt})")
    if k_scale is not None and (k_scale.shape != index_k_cache.shape[:2] or k_scale.dtype != jnp.float32):
        raise ValueError(
            f"k_scale must be f32[pages, G] = {index_k_cache.shape[:2]}, got {k_scale.dtype}{k_scale.shape}"
        )
    if block_table.ndim != 2 or block_table.shape[0] != t or block_table.dtype != jnp.int32:
        raise ValueError(f"block_table must be i32[T={t}, max_pages], got {block_table.dtype}{block_table.shape}")
    if seq_lens.shape != (t,) or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be i32[T={t}], got {seq_lens.dtype}{seq_lens.shape}")
    if for_kernel and not (is_pow2(d) and d >= 16):
        raise ValueError(f"index head dim {d} must be a power of two >= 16")
    if for_kernel and not is_pow2(index_k_cache.shape[1]):
        raise ValueError(f"index_k_cache page size {index_k_cache.shape[1]} must be a power of two")


def _indexer_kernel(
    q_ref,  # [H', D]
    w_ref,  # f32[H'] (0 on padding heads)
    k_ref,  # [pages*G, D] (whole pool; rows gathered through the block table)
    ks_ref,  # f32[pages*G], or None
    bt_ref,  # i32[max_pages]: this row's block table
    lens_ref,  # i32[T]
    o_ref,  # f32[block_k]
    *,
    page_size: int,
    scale: float,
    compute_dtype,
):
    t, j = pl.program_id(0), pl.program_id(1)
    block_k = o_ref.shape[0]
    d = q_ref.shape[1]
    seq_len = lens_ref[t]
    start = j * block_k

    @pl.when(start < seq_len)
    def _():
        col = start + jnp.arange(block_k, dtype=jnp.int32)  # [bk] key positions
        ok = col < seq_len
        shift = page_size.bit_length() - 1  # page_size is a power of two
        page = pltriton.load(bt_ref.at[lax.shift_right_logical(col, shift)], mask=ok, other=0)
        row = page * page_size + (col & (page_size - 1))
        keys = pltriton.load(
            k_ref.at[row[:, None], jnp.arange(d, dtype=jnp.int32)[None, :]], mask=ok[:, None], other=0.0
        ).astype(compute_dtype)  # [bk, D]
        s = lax.dot_general(
            q_ref[...].astype(compute_dtype), keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [H', bk]
        if ks_ref is not None:
            s = s * pltriton.load(ks_ref.at[row], mask=ok, other=0.0)[None, :]
        s = jnp.maximum(s * scale, 0.0)
        logits = jnp.sum(w_ref[...][:, None] * s, axis=0)  # [bk]
        o_ref[...] = jnp.where(ok, logits, -jnp.inf)

    @pl.when(start >= seq_len)
    def _():
        o_ref[...] = jnp.full((block_k,), -jnp.inf, jnp.float32)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_k", "num_warps", "num_stages"))
def _logits_impl(
    q, weights, cache, block_table, seq_lens, k_scale, *, scale, interpret, block_k, num_warps, num_stages
):
    t, h, d = q.shape
    pages, g, _ = cache.shape
    s_len = block_table.shape[1] * g
    fp8 = cache.dtype == FP8
    compute_dtype = q.dtype if fp8 else jnp.promote_types(q.dtype, cache.dtype)
    block_k = block_k or min(128, max(16, next_pow2(s_len)))
    num_warps = num_warps or 4
    num_stages = num_stages or 2
    h_pad = max(16, next_pow2(h))
    s_pad = cdiv(s_len, block_k) * block_k
    qp = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, 0)))
    wp = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, h_pad - h)))
    # a row sees at most the block table's keys
    lens = jnp.clip(seq_lens, 0, s_len)
    out = pl.pallas_call(
        functools.partial(_indexer_kernel, page_size=g, scale=float(scale), compute_dtype=compute_dtype),
        grid=(t, s_pad // block_k),
        in_specs=[
            pl.BlockSpec((None, h_pad, d), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, h_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((pages * g, d), lambda i, j: (0, 0)),
            pl.BlockSpec((pages * g,), lambda i, j: (0,)) if fp8 else None,
            pl.BlockSpec((None, block_table.shape[1]), lambda i, j: (i, 0)),
            pl.BlockSpec((t,), lambda i, j: (0,)),
        ],
        out_specs=pl.BlockSpec((None, block_k), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((t, s_pad), jnp.float32),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"lightning_indexer_{block_k=}_{h_pad=}",
    )(qp, wp, cache.reshape(pages * g, d), k_scale.reshape(pages * g) if fp8 else None, block_table, lens)
    return out[:, :s_len]


def indexer_logits(
    q,  # [T, H, D] bf16/f16/f32: the indexer's queries (RoPE applied)
    weights,  # f32[T, H]: per-head weights (weights_proj(x) * H^-0.5)
    index_k_cache,  # [pages, G, D] bf16/f16/f32, or float8_e4m3fn with k_scale
    block_table,  # i32[T, max_pages]: each row's request block table
    seq_lens,  # i32[T]: keys each row sees (0 for padding rows)
    *,
    scale: float,  # D^-0.5
    k_scale=None,  # f32[pages, G] (fp8 cache only)
    interpret: bool = False,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """f32[T, max_pages * G]: the ReLU-weighted index scores of every row over the keys it sees, -inf past
    seq_lens (Pallas kernel). Tuning: block_k keys per program (power of two >= 16; default min(128, S))."""
    validate_indexer(q, weights, index_k_cache, block_table, seq_lens, k_scale, for_kernel=True)
    if block_k is not None and not (is_pow2(block_k) and block_k >= 16):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    return _logits_impl(
        q,
        weights,
        index_k_cache,
        block_table,
        seq_lens,
        k_scale,
        scale=float(scale),
        interpret=bool(interpret),
        block_k=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def indexer_logits_reference(q, weights, index_k_cache, block_table, seq_lens, *, scale: float, k_scale=None, **_):
    """Float32 reference on the gathered keys (HIGHEST precision einsums, as HF computes the scores)."""
    validate_indexer(q, weights, index_k_cache, block_table, seq_lens, k_scale)
    keys = index_k_cache[block_table].astype(jnp.float32)  # [T, max_pages, G, D]
    if k_scale is not None:
        keys = keys * k_scale[block_table][..., None]
    keys = keys.reshape(keys.shape[0], -1, keys.shape[-1])  # [T, S, D]
    visible = jnp.arange(keys.shape[1])[None, :] < seq_lens[:, None]  # [T, S]
    keys = jnp.where(visible[..., None], keys, 0.0)  # never-written (NaN) rows cannot reach a visible score
    hi = lax.Precision.HIGHEST
    s = jax.nn.relu(jnp.einsum("thd,tsd->ths", q.astype(jnp.float32), keys, precision=hi) * scale)  # [T, H, S]
    logits = jnp.einsum("th,ths->ts", weights.astype(jnp.float32), s, precision=hi)
    return jnp.where(visible, logits, -jnp.inf)


def topk_from_logits(logits, k: int):
    """logits f32[T, S] (-inf = not visible) -> i32[T, min(k, S)]: best first, lower position first on equal
    scores (`lax.top_k`), -1 where a row has fewer than k visible keys."""
    vals, idx = lax.top_k(logits, min(k, logits.shape[-1]))
    return jnp.where(vals > -jnp.inf, idx, -1).astype(jnp.int32)


def indexer_topk(q, weights, index_k_cache, block_table, seq_lens, *, scale: float, k: int, k_scale=None, **kw):
    """i32[T, min(k, S)]: each row's top-k key positions by `indexer_logits` (kernel) and `lax.top_k`."""
    return topk_from_logits(
        indexer_logits(q, weights, index_k_cache, block_table, seq_lens, scale=scale, k_scale=k_scale, **kw), k
    )


def indexer_topk_reference(
    q, weights, index_k_cache, block_table, seq_lens, *, scale: float, k: int, k_scale=None, **_
):
    """`indexer_topk` on the reference logits."""
    return topk_from_logits(
        indexer_logits_reference(q, weights, index_k_cache, block_table, seq_lens, scale=scale, k_scale=k_scale), k
    )
