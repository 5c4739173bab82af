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

The Pallas kernel (Triton lowering, like `mla_decode`): grid (head blocks, S splits of the K table, B*Q
rows). A program owns `block_h` heads of one query row and K/S table entries; it streams them in `block_kv`
steps: load the step's slots, gather those cache rows (masked: -1 and out-of-range entries are never read,
and the loop stops after the row's last named slot), two dots (L and R tiles) for the logits, online softmax
in exp2, the L tile reused as V. Splits are LSE-merged by `mla_decode.merge_splits`. The fp8 cache is upcast
to q's dtype, its per-token scale applied to the logits and to p (mla_decode's "scale_logits").

`sparse_mla_decode_reference` is the float32 reference: it gathers the named rows and runs a plain softmax.
Shapes: B rows, Q tokens per row, N heads, L latent, R rope, K table width, S splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mla_decode import (
    _default_tuning,
    choose_num_kv_splits,
    merge_splits,
    softmax_block,
    softmax_init,
    softmax_write,
)
from pallas_kernels.util import CACHE_DTYPES, FLOAT_DTYPES, FP8, LOG2E, cdiv, is_pow2, num_sms


def validate_sparse_decode(q, kv_cache, topk_slots, kv_scale, kv_lora_rank: int, *, for_kernel: bool = False) -> None:
    """Shapes and dtypes, with errors that name the argument (trace time, before any work). `for_kernel`: the
    Triton kernel's extra needs (L and R powers of two >= 16)."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, Q, N, L+R], got shape {q.shape}")
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be bfloat16, float16 or float32, got {q.dtype}")
    if kv_cache.ndim != 3 or kv_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"kv_cache must be [pages, G, {q.shape[-1]}], got shape {kv_cache.shape}")
    if jnp.dtype(kv_cache.dtype) not in CACHE_DTYPES:
        raise ValueError(f"kv_cache dtype must be bf16/f16/f32/float8_e4m3fn, got {kv_cache.dtype}")
    if topk_slots.ndim != 3 or topk_slots.shape[:2] != q.shape[:2]:
        raise ValueError(f"topk_slots must be [B, Q, K] = [{q.shape[0]}, {q.shape[1]}, K], got {topk_slots.shape}")
    if topk_slots.dtype != jnp.int32:
        raise ValueError(f"topk_slots must be int32, got {topk_slots.dtype}")
    if topk_slots.shape[-1] < 1:
        raise ValueError("topk_slots has no columns (K = 0)")
    if not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must be in (0, {q.shape[-1]})")
    r = q.shape[-1] - kv_lora_rank
    if for_kernel and not (is_pow2(int(kv_lora_rank)) and kv_lora_rank >= 16 and is_pow2(r) and r >= 16):
        raise ValueError(f"latent {kv_lora_rank} and rope {r} dims must be powers of two >= 16")
    fp8 = kv_cache.dtype == FP8
    if fp8 != (kv_scale is not None):
        raise ValueError(f"kv_scale must be given exactly for an fp8 cache (cache dtype {kv_cache.dtype})")
    if kv_scale is not None and kv_scale.shape != kv_cache.shape[:2]:
        raise ValueError(f"kv_scale must be [pages, G] = {kv_cache.shape[:2]}, got {kv_scale.shape}")
    if kv_scale is not None and kv_scale.dtype != jnp.float32:
        raise ValueError(f"kv_scale dtype must be float32, got {kv_scale.dtype}")
    if kv_cache.shape[0] * kv_cache.shape[1] >= 2**31:
        raise ValueError(f"kv_cache has {kv_cache.shape[0]} x {kv_cache.shape[1]} slots: beyond int32 slot indexing")


def check_topk_slots(topk_slots, num_slots: int) -> None:
    """Host-side check of a concrete table: every entry is -1 or a slot in [0, num_slots)."""
    import numpy as np

    t = np.asarray(topk_slots)
    bad = t[(t < -1) | (t >= num_slots)]
    if bad.size:
        raise ValueError(f"topk_slots holds slot {int(bad[0])} outside [-1, {num_slots}) ({bad.size} entries)")


def check_concrete(topk_slots, kv_cache) -> None:
    """Eagerly called with a concrete table: out-of-range slots are an error (under jit they are masked)."""
    if not isinstance(topk_slots, jax.core.Tracer):
        check_topk_slots(topk_slots, kv_cache.shape[0] * kv_cache.shape[1])


def _sparse_kernel(
    q_ref,  # [block_h, L+R]
    kv_ref,  # [pages*G, L+R] (whole pool; rows gathered by slot)
    kv_scale_ref,  # f32[pages*G], or None
    slots_ref,  # i32[K']: this row's slot table (-1 = none)
    n_valid_ref,  # i32[B*Q]: entries of each row's table up to its last named slot
    o_ref,  # [block_h, L]: normalized partial output
    lse_ref,  # f32[block_h]
    *,
    l: int,
    r: int,
    num_slots: int,
    block_kv: int,
    split_tokens: int,
    sm_scale: float,
    compute_dtype,
):
    split, row_id = pl.program_id(1), pl.program_id(2)
    block_h = q_ref.shape[0]
    start = split * split_tokens
    end = jnp.minimum(n_valid_ref[row_id], start + split_tokens)
    n_steps = (jnp.maximum(end - start, 0) + block_kv - 1) // block_kv

    q_nope = q_ref[:, pl.ds(0, l)].astype(compute_dtype)  # [block_h, L]
    q_pe = q_ref[:, pl.ds(l, r)].astype(compute_dtype)  # [block_h, R]
    qk_scale = sm_scale * LOG2E  # logits in log2 units for exp2
    cols_nope = jnp.arange(l, dtype=jnp.int32)[None, :]
    cols_pe = l + jnp.arange(r, dtype=jnp.int32)[None, :]
    fp8 = kv_scale_ref is not None

    def body(i, carry):
        acc, m_prev, l_prev = carry
        j = start + i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [bkv] table entries
        slot = pltriton.load(slots_ref.at[j], mask=j < end, other=-1)
        ok = (slot >= 0) & (slot < num_slots)  # -1 and out-of-range entries are never read
        row = jnp.where(ok, slot, 0)  # [bkv]
        row2 = row[:, None]  # (no value slicing under the Triton lowering: expand, never index, a value)
        k_nope = pltriton.load(kv_ref.at[row2, cols_nope], mask=ok[:, None], other=0.0).astype(compute_dtype)
        k_pe = pltriton.load(kv_ref.at[row2, cols_pe], mask=ok[:, None], other=0.0).astype(compute_dtype)
        dims = (((1,), (1,)), ((), ()))
        qk = lax.dot_general(q_nope, k_nope, dims, preferred_element_type=jnp.float32) + lax.dot_general(
            q_pe, k_pe, dims, preferred_element_type=jnp.float32
        )  # [bh, bkv]
        if fp8:
            ks = pltriton.load(kv_scale_ref.at[row], mask=ok, other=0.0)  # [bkv] f32
            s = qk * (ks * qk_scale)[None, :]
        else:
            s = qk * qk_scale
        s = jnp.where(ok[None, :], s, -jnp.inf)
        return softmax_block(acc, m_prev, l_prev, s, k_nope, ks if fp8 else None, compute_dtype)

    acc, m_i, l_i = lax.fori_loop(0, n_steps, body, softmax_init(block_h, l))
    softmax_write(acc, m_i, l_i, o_ref, lse_ref)


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "kv_lora_rank",
        "num_kv_splits",
        "interpret",
        "block_h",
        "block_kv",
        "num_warps",
        "num_stages",
    ),
)
def _sparse_impl(
    q,
    kv_cache,
    topk_slots,
    kv_scale,
    *,
    scale,
    kv_lora_rank,
    num_kv_splits,
    interpret,
    block_h,
    block_kv,
    num_warps,
    num_stages,
):
    b, nq, n, d = q.shape
    l = kv_lora_rank
    r = d - l
    pages, g, _ = kv_cache.shape
    k = topk_slots.shape[-1]
    rows = b * nq
    fp8 = kv_cache.dtype == FP8
    compute_dtype = q.dtype if fp8 else jnp.promote_types(q.dtype, kv_cache.dtype)
    block_h, block_kv, num_warps, num_stages, _ = _default_tuning(
        n, l, r, kv_cache.dtype, compute_dtype, block_h, block_kv, num_warps, num_stages, None
    )
    if num_kv_splits is None:
        num_kv_splits = choose_num_kv_splits(rows, n, k, num_sms())
    split_tokens = cdiv(cdiv(k, num_kv_splits), block_kv) * block_kv
    splits = cdiv(k, split_tokens)
    k_pad = splits * split_tokens

    n_pad = cdiv(n, block_h) * block_h
    q_rows = q.reshape(rows, n, d)  # [B*Q, N, L+R]
    if n_pad != n:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, n_pad - n), (0, 0)))
    table = topk_slots.reshape(rows, k)  # [B*Q, K]
    named = (table >= 0) & (table < pages * g)
    # entries up to the last named slot: the loop stops there (a row's -1 tail costs nothing)
    n_valid = jnp.max(jnp.where(named, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=1)  # [B*Q]
    if k_pad != k:
        table = jnp.pad(table, ((0, 0), (0, k_pad - k)), constant_values=-1)
    kv_rows = kv_cache.reshape(pages * g, d)
    scale_rows = kv_scale.reshape(pages * g) if fp8 else None

    final = splits == 1
    o_dtype = q.dtype if final else jnp.float32
    kernel = functools.partial(
        _sparse_kernel,
        l=l,
        r=r,
        num_slots=pages * g,
        block_kv=block_kv,
        split_tokens=split_tokens,
        sm_scale=float(scale),
        compute_dtype=compute_dtype,
    )
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=(n_pad // block_h, splits, rows),  # head blocks fastest: programs sharing a row's slots run together
        in_specs=[
            pl.BlockSpec((None, block_h, d), lambda h, s, i: (i, h, 0)),
            pl.BlockSpec((pages * g, d), lambda h, s, i: (0, 0)),
            pl.BlockSpec((pages * g,), lambda h, s, i: (0,)) if fp8 else None,
            pl.BlockSpec((None, k_pad), lambda h, s, i: (i, 0)),
            pl.BlockSpec((rows,), lambda h, s, i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, block_h, l), lambda h, s, i: (i, s, h, 0)),
            pl.BlockSpec((None, None, block_h), lambda h, s, i: (i, s, h)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((rows, splits, n_pad, l), o_dtype),
            jax.ShapeDtypeStruct((rows, splits, n_pad), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"sparse_mla_decode_{block_h=}_{block_kv=}_{splits=}_{num_warps=}_{num_stages=}",
    )(q_rows, kv_rows, scale_rows, table, n_valid)
    if final:
        out, lse = o_part[:, 0], lse_part[:, 0]
    else:
        out, lse = merge_splits(o_part, lse_part, out_dtype=q.dtype, interpret=interpret)
    return out[:, :n].reshape(b, nq, n, l).astype(q.dtype), lse[:, :n].reshape(b, nq, n)


def sparse_mla_decode(
    q,  # [B, Q, N, L+R] bf16/f16/f32: absorbed q_nope (L) then q_pe (R)
    kv_cache,  # [pages, G, L+R] bf16/f16/f32, or float8_e4m3fn with kv_scale
    topk_slots,  # i32[B, Q, K]: slots (page * G + offset) each query row attends to; -1 = none
    *,
    scale: float,
    kv_scale=None,  # f32[pages, G] (fp8 cache only)
    kv_lora_rank: int = 512,
    num_kv_splits: int | None = None,
    interpret: bool = False,
    block_h: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Token-sparse latent MQA over the named slots (Pallas, Triton lowering). Returns (out [B, Q, N, L] in
    q.dtype, lse f32[B, Q, N]); a row with no named slot gives out 0 and lse -inf.

    A concrete table with a slot outside [-1, pages * G) raises ValueError; under jit such entries are masked
    (never read). The order of a row's entries does not matter. Tuning (None = mla_decode's H200 defaults):
    num_kv_splits (static split count of the K table), block_h heads per program, block_kv table entries per
    step (powers of two >= 16), num_warps, num_stages."""
    validate_sparse_decode(q, kv_cache, topk_slots, kv_scale, kv_lora_rank, for_kernel=True)
    check_concrete(topk_slots, kv_cache)
    for name, v in (("block_h", block_h), ("block_kv", block_kv)):
        if v is not None and not (is_pow2(v) and v >= 16):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if num_kv_splits is not None and not (isinstance(num_kv_splits, int) and num_kv_splits >= 1):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits}")
    return _sparse_impl(
        q,
        kv_cache,
        topk_slots,
        kv_scale,
        scale=float(scale),
        kv_lora_rank=int(kv_lora_rank),
        num_kv_splits=num_kv_splits,
        interpret=bool(interpret),
        block_h=block_h,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def sparse_mla_decode_reference(
    q, kv_cache, topk_slots, *, scale: float, kv_scale=None, kv_lora_rank: int = 512, interpret: bool = False
):
    """Float32 reference: gather the K named rows per query row, mask -1 entries, softmax. Same outputs."""
    del interpret
    validate_sparse_decode(q, kv_cache, topk_slots, kv_scale, kv_lora_rank)
    pages, g, w = kv_cache.shape
    valid = (topk_slots >= 0) & (topk_slots < pages * g)  # [B, Q, K]; out-of-range entries as -1 (the kernel's)
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
