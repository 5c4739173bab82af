"""Varlen flash attention for MLA prefill (Pallas, Triton lowering), with its float32 reference.

Shapes: q/k [T, N, P+R] (192 for DeepSeek), v [T, N, V] (128), ragged sequences packed along T and
described by `q_start_loc`/`k_start_loc` (vLLM's `query_start_loc` convention).

Design: the wrapper turns the start locations into a per-query-row key window [lo, hi) (one tiny XLA
fusion over Tq rows); causality (bottom-right aligned) and sequence membership both live in that
window, so the kernel is the same for the causal new-token pass and the non-causal context-chunk
pass. Grid (q blocks, heads), q blocks fastest so that concurrently running programs share one head's
K/V in L2, and reversed so the longest causal blocks start first. Each program walks keys over the
union of its rows' windows in three loops: masked tiles before the region every row sees, unmasked
tiles inside it, masked tiles after it (the causal diagonal, the tail of a sequence, or the second
sequence of a q block that straddles a boundary). Head dims that are not powers of two (192 =
128 + 64) are split into two ref slices and two dots, because Triton tensors must be powers of two.

Speed on the H200 against cuDNN (bench/prefill.py): docs/perf-notes.md and bench/results/.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import BIG, LN2, LOG2E, MASK_VALUE, cdiv, is_pow2, next_pow2, row_windows, validate_prefill


def _pow2_split(d: int) -> tuple[tuple[int, int], ...] | None:
    """(offset, size) pieces for a head dim that is 2^a or 2^a + 2^b (each piece >= 16), else None."""
    if d >= 16 and d & (d - 1) == 0:
        return ((0, d),)
    hi = 1 << (d.bit_length() - 1)
    lo = d - hi
    if lo >= 16 and lo & (lo - 1) == 0:
        return ((0, hi), (hi, lo))
    return None


def _kernel(
    lo_ref,
    hi_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    lse_ref,
    *,
    qk_scale: float,
    tq: int,
    n_qblocks: int,
    block_q: int,
    block_k: int,
    dq_split,
    dv: int,
):
    # f32 inputs: exact f32 dots (the default would be TF32); bf16/f16 use the tensor cores as is.
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    qb = n_qblocks - 1 - pl.program_id(0)
    rows = qb * block_q + jnp.arange(block_q, dtype=jnp.int32)
    in_bounds = rows < tq
    lo = pltriton.load(lo_ref, mask=in_bounds, other=BIG)  # [block_q]
    hi = pltriton.load(hi_ref, mask=in_bounds, other=0)
    nonempty = lo < hi
    lo_min = jnp.min(lo)  # empty rows hold lo=BIG, hi=0, so they drop out of min/max
    hi_max = jnp.max(hi)
    lo_max = jnp.max(jnp.where(nonempty, lo, 0))
    hi_min = jnp.min(jnp.where(nonempty, hi, BIG))
    span = jnp.maximum(hi_max - lo_min, 0)
    div = jax.lax.div  # operands are >= 0, so truncation is floor
    n_tiles = div(span + block_k - 1, block_k)
    # Tiles [j_a, j_b) lie inside every nonempty row's window: no mask needed.
    j_a = jnp.minimum(div(jnp.maximum(lo_max - lo_min, 0) + block_k - 1, block_k), n_tiles)
    j_b = jnp.clip(div(jnp.maximum(hi_min - lo_min, 0), block_k), j_a, n_tiles)

    qs = [pltriton.load(q_ref.at[:, pl.ds(off, sz)], mask=in_bounds[:, None], other=0) for off, sz in dq_split]
    k_iota = jnp.arange(block_k, dtype=jnp.int32)

    def body(j, carry, masked):
        acc, m_i, l_i = carry
        start = lo_min + j * block_k
        if masked:
            kpos = start + k_iota
            kin = (kpos < hi_max)[:, None]  # rows past the union: maybe out of bounds or NaN padding
            ks = [
                pltriton.load(k_ref.at[pl.ds(start, block_k), pl.ds(off, sz)], mask=kin, other=0)
                for off, sz in dq_split
            ]
            v = pltriton.load(v_ref.at[pl.ds(start, block_k), :], mask=kin, other=0)
        else:
            ks = [k_ref[pl.ds(start, block_k), pl.ds(off, sz)] for off, sz in dq_split]
            v = v_ref[pl.ds(start, block_k), :]
        s = pltriton.dot(qs[0], ks[0], trans_b=True, precision=precision)
        for qp, kp in zip(qs[1:], ks[1:]):
            s = s + pltriton.dot(qp, kp, trans_b=True, precision=precision)  # [block_q, block_k]
        if masked:
            see = (kpos[None, :] >= lo[:, None]) & (kpos[None, :] < hi[:, None])
            s = jnp.where(see, s * qk_scale, MASK_VALUE)  # log2 domain
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
            p = jnp.exp2(s - m_new[:, None])
        else:
            # scale > 0, so max commutes with it; s * scale - m is one FMA per logit.
            m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * qk_scale)
            p = jnp.exp2(s * qk_scale - m_new[:, None])
        alpha = jnp.exp2(m_i - m_new)
        l_new = l_i * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + pltriton.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_new, l_new

    carry = (
        jnp.zeros((block_q, dv), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = jax.lax.fori_loop(0, j_a, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(j_a, j_b, functools.partial(body, masked=False), carry)
    acc, m_i, l_i = jax.lax.fori_loop(j_b, n_tiles, functools.partial(body, masked=True), carry)

    l_safe = jnp.where(nonempty, l_i, 1.0)
    out = jnp.where(nonempty[:, None], acc / l_safe[:, None], 0.0)
    lse = jnp.where(nonempty, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
    pltriton.store(o_ref, out.astype(o_ref.dtype), mask=in_bounds[:, None])
    pltriton.store(lse_ref, lse, mask=in_bounds)


def _defaults(dtype, dq: int, dv: int, tq: int):
    # bf16/f16: best of the H200 sweep (bench/prefill.py --sweep) on all three fixed shapes, 4% off
    # the best on the varlen mix. f32 (tests, not a fast path) needs smaller tiles for registers/SMEM.
    if jnp.dtype(dtype) == jnp.float32:
        bq, bk, warps, stages = 64, 32, 4, 2
    else:
        bq, bk, warps, stages = 128, 128, 8, 2
    # Don't make tiny problems pay for a big block.
    bq = max(16, min(bq, next_pow2(tq)))
    return bq, bk, warps, stages


@functools.partial(
    jax.jit, static_argnames=("causal", "scale", "interpret", "block_q", "block_k", "num_warps", "num_stages")
)
def flash_prefill(
    q,
    k,
    v,
    q_start_loc,
    k_start_loc,
    *,
    causal: bool,
    scale: float,
    interpret: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Varlen attention. Returns (out [Tq, N, V] q.dtype, lse f32[Tq, N] natural log).

    Sequence s owns q rows [q_start_loc[s], q_start_loc[s+1]) and k/v rows [k_start_loc[s],
    k_start_loc[s+1]). Causal is bottom-right aligned: q row i of a segment sees its first
    k_len - q_len + i + 1 keys. Padding rows, and rows that see no key, get out 0 and lse -inf.
    """
    validate_prefill(q, k, v, q_start_loc, k_start_loc)
    tq, n, dq = q.shape
    tk, dv = k.shape[0], v.shape[2]
    dq_split = _pow2_split(dq)
    if dq_split is None:
        raise ValueError(f"q/k head dim {dq} must be 2^a or 2^a + 2^b with pieces >= 16")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if dv < 16 or not is_pow2(dv):
        raise ValueError(f"v head dim {dv} must be a power of two >= 16")
    d_bq, d_bk, d_warps, d_stages = _defaults(q.dtype, dq, dv, tq)
    block_q = d_bq if block_q is None else block_q
    block_k = d_bk if block_k is None else block_k
    num_warps = d_warps if num_warps is None else num_warps
    num_stages = d_stages if num_stages is None else num_stages
    for name, b in (("block_q", block_q), ("block_k", block_k)):
        if b < 16 or not is_pow2(b):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton dot)")

    lo, hi = row_windows(q_start_loc, k_start_loc, tq, tk, causal)
    if tk < block_k:  # tiny inputs: the unmasked tile slice must fit the array even when never run
        k = jnp.pad(k, ((0, block_k - tk), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, block_k - tk), (0, 0), (0, 0)))
        tk = block_k
    n_qblocks = cdiv(tq, block_q)
    rev = lambda i: n_qblocks - 1 - i  # noqa: E731  longest causal blocks first
    kernel = functools.partial(
        _kernel,
        qk_scale=float(scale) * LOG2E,
        tq=tq,
        n_qblocks=n_qblocks,
        block_q=block_q,
        block_k=block_k,
        dq_split=dq_split,
        dv=dv,
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(n_qblocks, n),
        in_specs=[
            pl.BlockSpec((block_q,), lambda i, h: (rev(i),)),
            pl.BlockSpec((block_q,), lambda i, h: (rev(i),)),
            pl.BlockSpec((block_q, None, dq), lambda i, h: (rev(i), h, 0)),
            pl.BlockSpec((tk, None, dq), lambda i, h: (0, h, 0)),
            pl.BlockSpec((tk, None, dv), lambda i, h: (0, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((block_q, None, dv), lambda i, h: (rev(i), h, 0)),
            pl.BlockSpec((block_q, None), lambda i, h: (rev(i), h)),
        ],
        out_shape=[jax.ShapeDtypeStruct((tq, n, dv), q.dtype), jax.ShapeDtypeStruct((tq, n), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"flash_prefill_bq{block_q}_bk{block_k}_w{num_warps}_s{num_stages}",
    )(lo, hi, q, k, v)
    return out, lse


def flash_prefill_reference(
    q, k, v, q_start_loc, k_start_loc, *, causal: bool, scale: float, interpret: bool = False, **tuning
):
    """Float32 plain-JAX reference with an explicit [N, Tq, Tk] mask built from segment ids."""
    del interpret, tuning
    validate_prefill(q, k, v, q_start_loc, k_start_loc)
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    tq, tk = q.shape[0], k.shape[0]
    n_seq = q_start_loc.shape[0] - 1
    qi = jnp.arange(tq)
    kj = jnp.arange(tk)
    # Segment id = number of sequence starts at or before the row (1-based), 0 or > S outside.
    q_seg = jnp.sum(qi[:, None] >= q_start_loc[None, :], axis=1) - 1
    k_seg = jnp.sum(kj[:, None] >= k_start_loc[None, :], axis=1) - 1
    q_ok = (q_seg >= 0) & (q_seg < n_seq)
    k_ok = (k_seg >= 0) & (k_seg < n_seq)
    mask = (q_seg[:, None] == k_seg[None, :]) & q_ok[:, None] & k_ok[None, :]
    if causal:
        qsc = jnp.clip(q_seg, 0, n_seq - 1)
        q_len = q_start_loc[qsc + 1] - q_start_loc[qsc]
        k_len = k_start_loc[qsc + 1] - k_start_loc[qsc]
        q_idx = qi - q_start_loc[qsc]  # position within the q segment
        k_idx = kj[None, :] - k_start_loc[qsc][:, None]  # position within the row's own k segment
        mask &= k_idx < (k_len - q_len + q_idx + 1)[:, None]
    # Zero rows outside every sequence so NaN padding cannot leak through 0 * NaN.
    q = jnp.where(q_ok[:, None, None], q, 0.0)
    k = jnp.where(k_ok[:, None, None], k, 0.0)
    v = jnp.where(k_ok[:, None, None], v, 0.0)
    logits = jnp.einsum("qnh,knh->nqk", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    logits = jnp.where(mask[None], logits, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)  # [N, Tq]; -inf where the row sees nothing
    any_key = jnp.isfinite(lse)
    p = jnp.where(mask[None], jnp.exp(logits - jnp.where(any_key, lse, 0.0)[..., None]), 0.0)
    out = jnp.einsum("nqk,knv->qnv", p, v, precision=jax.lax.Precision.HIGHEST)
    return out, lse.T
