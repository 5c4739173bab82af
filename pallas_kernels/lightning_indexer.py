"""The lightning indexer's scores over the paged index-key cache (DeepSeek-V3.2 sparse attention) and their
exact top-k, as Pallas kernels (Triton lowering).

    indexer_logits(q [T, H, D], weights f32[T, H], index_k_cache [pages, G, D], block_table i32[T, max_pages],
                   seq_lens i32[T], *, scale, k_scale=None) -> f32[T, S]     (S = max_pages * G)
    indexer_topk(..., k) -> topk_indices i32[T, min(k, S)]

    logits[t, s] = sum_h weights[t, h] * relu(scale * q[t, h] . k[s])   for s < seq_lens[t], else -inf

where k[s] is the cached index key of token s of row t's request (page block_table[t, s // G], offset s % G;
fp8 keys times their per-token k_scale). Every token row of a step (decode rows, multi-token rows, prefill
tokens, each with its request's block table row and the number of keys it sees) goes through one call.

The top-k contract (kernel and reference alike): each row's min(k, visible) best positions, where among
equal scores the lower position wins (as `lax.top_k` breaks ties; HF's torch.topk orders CPU ties
arbitrarily, so its fixtures avoid them), returned in ascending position order (the sparse decode then reads
the cache in address order), -1 after them. -0.0 scores equal +0.0, and NaN / -inf scores are never chosen.

Score kernel: grid (T, S / (block_k * blocks_per_program)). A program loads its row's q [H, D] and weights
once, then per block of block_k keys (a loop over its blocks_per_program blocks: q is read once per program,
and Triton pipelines the key loads across the loop) gathers the key rows through the block table (masked
loads: keys at or past seq_len, never-written pages, are not read), one dot [H, D] x [D, block_k] in f32,
ReLU, the weighted sum over heads, and writes block_k logits; blocks wholly past seq_len only write -inf.
blocks_per_program defaults to ~4 programs per SM over the step's rows (1: one block per program). Triton
needs powers of two >= 16 for the dot: D and block_k are, heads are padded to 16 with zero weights; the page
size must be a power of two (shift and mask). fp8 keys are upcast to q's dtype and the scale applied to the
dot's output. Rows are the fastest grid axis, so the prefill tokens of a request, which read the same key
blocks, run side by side and share them through L2.

Top-k without a sort (radix select): each score maps to an int32 key whose signed order is the float order
(`_order_key`). For the top-k the score kernel also counts its scores into a per-row histogram over the key's
top 11 bits (NUM_BINS bins, 4 per octave: atomic adds spread over all of the step's programs). The select
kernel, one program per row, reads the histogram and finds the bin holding the k-th best score (the bins
above it are taken whole), copies that bin's keys to a scratch row (one pass over the row), finds the k-th
key exactly by bisection over the remaining 21 bits on those few keys, then one pass in position order
writes every position above the threshold key and the first `need` positions equal to it. The [T, S] f32
scores do go through HBM (4 MB at T = 32, S = 32k: 1/64 of the keys the score kernel reads, and L2-resident
for the select that follows); what this replaces is lax.top_k's sort of every row. The select's scratch row
is as wide as the scores (only the boundary bin's count is written: the whole row when every score ties).

Shapes: T query rows, H indexer heads (H_I), D index head dim (D_I), G page size, S key positions, K top-k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import FLOAT_DTYPES, FP8, cdiv, is_pow2, next_pow2, num_sms

BIN_SHIFT = 21  # histogram bin = the order key's top 32 - 21 = 11 bits (sign, exponent, 2 mantissa bits)
NUM_BINS = 1 << (32 - BIN_SHIFT)
KEY_MIN = -(1 << 31)  # below every key of a choosable score


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


def _validate_k(k) -> None:
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"top-k k must be a positive int, got {k!r}")


def _pow2_knob(name: str, value, minimum: int) -> None:
    if value is not None and not (is_pow2(value) and value >= minimum):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")


# ---- order keys (shared by the kernels and the references)


def canonical_scores(x):
    """f32 scores with -0.0 made +0.0 and NaN made -inf (never chosen): the values both top-k paths rank."""
    return jnp.where(jnp.isnan(x), -jnp.inf, jnp.where(x == 0, 0.0, x))


def _order_key(v):
    """f32 -> i32 whose signed order is the float order (flip the magnitude bits of negative floats)."""
    bits = lax.bitcast_convert_type(v, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _bin(key):
    return lax.shift_right_arithmetic(key, BIN_SHIFT) + NUM_BINS // 2  # [0, NUM_BINS)


# ---- score kernel


def _indexer_kernel(
    q_ref,  # [H', D]
    w_ref,  # f32[H'] (0 on padding heads)
    k_ref,  # [pages*G, D] (whole pool; rows gathered through the block table)
    ks_ref,  # f32[pages*G], or None
    bt_ref,  # i32[max_pages]: this row's block table
    lens_ref,  # i32[T]
    hist_in_ref,  # i32[NUM_BINS] zeros (aliased to hist_ref), or None
    o_ref,  # f32[S_pad]: this row's logits (the program writes its blocks)
    hist_ref,  # i32[NUM_BINS]: this row's histogram of order-key bins, or None
    *,
    page_size: int,
    scale: float,
    compute_dtype,
    block_k: int,
    blocks_per_program: int,
):
    del hist_in_ref
    t, j = pl.program_id(0), pl.program_id(1)
    d = q_ref.shape[1]
    seq_len = lens_ref[t]
    first = j * blocks_per_program  # this program's first block
    n_blocks = jnp.minimum(blocks_per_program, o_ref.shape[0] // block_k - first)
    n_live = jnp.clip(cdiv(seq_len - first * block_k, block_k), 0, n_blocks)  # blocks with a visible key
    q = q_ref[...].astype(compute_dtype)  # loaded once for all the program's blocks
    w = w_ref[...]
    shift = page_size.bit_length() - 1  # page_size is a power of two

    def live(i, carry):
        start = (first + i) * block_k
        col = start + jnp.arange(block_k, dtype=jnp.int32)  # [bk] key positions
        ok = col < seq_len
        page = pltriton.load(bt_ref.at[lax.shift_right_logical(col, shift)], mask=ok, other=0)
        row = page * page_size + (col & (page_size - 1))
        keys = pltriton.load(
            k_ref.at[row[:, None], jnp.arange(d, dtype=jnp.int32)[None, :]], mask=ok[:, None], other=0.0
        ).astype(compute_dtype)  # [bk, D]
        s = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [H', bk]
        if ks_ref is not None:
            s = s * pltriton.load(ks_ref.at[row], mask=ok, other=0.0)[None, :]
        s = jnp.maximum(s * scale, 0.0)
        logits = canonical_scores(jnp.sum(w[:, None] * s, axis=0))  # [bk]
        logits = jnp.where(ok, logits, -jnp.inf)
        o_ref[pl.ds(start, block_k)] = logits
        if hist_ref is not None:
            counted = logits > -jnp.inf
            # atomic adds (Triton) / scatter-add (interpreter); uncounted lanes add 0
            jax.ref.addupdate(hist_ref, (jnp.where(counted, _bin(_order_key(logits)), 0),), counted.astype(jnp.int32))
        return carry

    def dead(i, carry):  # blocks wholly past seq_len: -inf only
        o_ref[pl.ds((first + i) * block_k, block_k)] = jnp.full((block_k,), -jnp.inf, jnp.float32)
        return carry

    lax.fori_loop(0, n_live, live, jnp.int32(0))  # (the Triton lowering needs an array carry)
    lax.fori_loop(n_live, n_blocks, dead, jnp.int32(0))


def _blocks_per_program(t: int, n_blocks: int) -> int:
    """Key blocks one program scores (q and weights loaded once for them): enough programs for ~4 per SM."""
    return max(1, cdiv(n_blocks, max(1, cdiv(4 * num_sms(), t))))


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "interpret",
        "block_k",
        "num_warps",
        "num_stages",
        "histogram",
        "width",
        "blocks_per_program",
    ),
)
def _logits_impl(
    q,
    weights,
    cache,
    block_table,
    seq_lens,
    k_scale,
    *,
    scale,
    interpret,
    block_k,
    num_warps,
    num_stages,
    histogram,
    width,
    blocks_per_program=None,
):
    """-> (logits f32[T, S_pad] (-inf past seq_lens), hist i32[T, NUM_BINS] or None), S_pad = S rounded up to
    a multiple of max(block_k, width)."""
    t, h, d = q.shape
    pages, g, _ = cache.shape
    s_len = block_table.shape[1] * g
    fp8 = cache.dtype == FP8
    compute_dtype = q.dtype if fp8 else jnp.promote_types(q.dtype, cache.dtype)
    block_k = block_k or min(128, max(16, next_pow2(s_len)))
    num_warps = num_warps or 4
    num_stages = num_stages or 2
    h_pad = max(16, next_pow2(h))
    s_pad = cdiv(s_len, max(block_k, width)) * max(block_k, width)
    qp = jnp.pad(q, ((0, 0), (0, h_pad - h), (0, 0)))
    wp = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, h_pad - h)))
    # a row sees at most the block table's keys
    lens = jnp.clip(seq_lens, 0, s_len)
    n_blocks = s_pad // block_k
    bpp = min(blocks_per_program or _blocks_per_program(t, n_blocks), n_blocks)
    row_hist = pl.BlockSpec((None, NUM_BINS), lambda i, j: (i, 0))
    out_shape = [jax.ShapeDtypeStruct((t, s_pad), jnp.float32)]
    if histogram:
        out_shape.append(jax.ShapeDtypeStruct((t, NUM_BINS), jnp.int32))
    out = pl.pallas_call(
        functools.partial(
            _indexer_kernel,
            page_size=g,
            scale=float(scale),
            compute_dtype=compute_dtype,
            block_k=block_k,
            blocks_per_program=bpp,
        ),
        grid=(t, cdiv(n_blocks, bpp)),
        in_specs=[
            pl.BlockSpec((None, h_pad, d), lambda i, j: (i, 0, 0)),
            pl.BlockSpec((None, h_pad), lambda i, j: (i, 0)),
            pl.BlockSpec((pages * g, d), lambda i, j: (0, 0)),
            pl.BlockSpec((pages * g,), lambda i, j: (0,)) if fp8 else None,
            pl.BlockSpec((None, block_table.shape[1]), lambda i, j: (i, 0)),
            pl.BlockSpec((t,), lambda i, j: (0,)),
            row_hist if histogram else None,
        ],
        out_specs=[pl.BlockSpec((None, s_pad), lambda i, j: (i, 0))] + ([row_hist] if histogram else [None]),
        out_shape=out_shape + ([] if histogram else [None]),
        input_output_aliases={5 + fp8: 1} if histogram else {},  # flat index of the zeros
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"lightning_indexer_{block_k=}_{bpp=}_{h_pad=}_{histogram=}",
    )(
        qp,
        wp,
        cache.reshape(pages * g, d),
        k_scale.reshape(pages * g) if fp8 else None,
        block_table,
        lens,
        jnp.zeros((t, NUM_BINS), jnp.int32) if histogram else None,
    )
    return out[0], out[1]


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
    blocks_per_program: int | None = None,
):
    """f32[T, max_pages * G]: the ReLU-weighted index scores of every row over the keys it sees, -inf past
    seq_lens (Pallas kernel; -0.0 written as +0.0). Tuning: block_k keys per dot (power of two >= 16; default
    min(128, S)), blocks_per_program (default: ~4 programs per SM)."""
    tuning = dict(block_k=block_k, num_warps=num_warps, num_stages=num_stages, blocks_per_program=blocks_per_program)
    logits, _ = _checked_scores(
        q, weights, index_k_cache, block_table, seq_lens, k_scale, scale, interpret, tuning, histogram=False, width=1
    )
    return logits[:, : block_table.shape[1] * index_k_cache.shape[1]]


def _checked_scores(q, weights, index_k_cache, block_table, seq_lens, k_scale, scale, interpret, tuning, **kw):
    """Validated inputs -> the score kernel's (logits, histogram) (`_logits_impl`; kw: histogram, width)."""
    validate_indexer(q, weights, index_k_cache, block_table, seq_lens, k_scale, for_kernel=True)
    _pow2_knob("block_k", tuning["block_k"], 16)
    args = (q, weights, index_k_cache, block_table, seq_lens, k_scale)
    return _logits_impl(*args, scale=float(scale), interpret=bool(interpret), **tuning, **kw)


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


# ---- exact top-k


def topk_from_logits(logits, k: int, seq_lens=None):
    """The top-k reference: logits f32[T, S] (-inf = not visible; positions >= seq_lens[t] too when given) ->
    i32[T, min(k, S)], the contract above, by `lax.top_k` (ties to the lower position) and a sort of the kept
    positions."""
    _validate_k(k)
    x = canonical_scores(logits.astype(jnp.float32))
    if seq_lens is not None:
        x = jnp.where(jnp.arange(x.shape[1])[None, :] < seq_lens[:, None], x, -jnp.inf)
    vals, idx = lax.top_k(x, min(k, x.shape[-1]))
    big = jnp.iinfo(jnp.int32).max
    idx = jnp.sort(jnp.where(vals > -jnp.inf, idx, big), axis=-1)
    return jnp.where(idx == big, -1, idx).astype(jnp.int32)


def logits_histogram(logits, seq_lens):
    """i32[T, NUM_BINS]: each row's count of choosable scores (position < seq_len, > -inf after
    `canonical_scores`) per order-key bin: what the score kernel counts (plain jnp; tests and `topk_select`)."""
    x = canonical_scores(logits.astype(jnp.float32))
    counted = (jnp.arange(x.shape[1])[None, :] < seq_lens[:, None]) & (x > -jnp.inf)
    rows = jnp.broadcast_to(jnp.arange(x.shape[0])[:, None], x.shape)
    bins = jnp.where(counted, _bin(_order_key(x)), 0)
    return jnp.zeros((x.shape[0], NUM_BINS), jnp.int32).at[rows, bins].add(counted.astype(jnp.int32))


def _select_kernel(
    x_ref,  # f32[S_pad]: this row's scores (canonical), -inf past seq_len
    hist_ref,  # i32[NUM_BINS]: this row's histogram (`logits_histogram`)
    lens_ref,  # i32[T]
    out_ref,  # i32[K_pad + W]: positions; the last W entries take masked lanes' stores
    cand_ref,  # i32[S_pad + W]: scratch, the boundary bin's keys; the last W take masked lanes' stores
    *,
    k: int,
    k_out: int,
    interpret: bool,
):
    t = pl.program_id(0)
    w = cand_ref.shape[0] - x_ref.shape[0]  # chunk width W
    lane = jnp.arange(w, dtype=jnp.int32)
    n = lens_ref[t]
    n_chunks = cdiv(n, w)

    def load_chunk(c):  # -> (positions, keys, choosable) of chunk c
        pos = c * w + lane
        v = pltriton.load(x_ref.at[pl.ds(c * w, w)], mask=pos < n, other=-jnp.inf)
        return pos, _order_key(v), v > -jnp.inf

    def excl_cumsum(m):
        m = m.astype(jnp.int32)
        return jnp.cumsum(m) - m

    # 1. the bin of the k-th best score, from the histogram
    h = hist_ref[...]  # [NUM_BINS]
    bins = jnp.arange(NUM_BINS, dtype=jnp.int32)
    total = jnp.sum(h)
    at_or_above = total - jnp.cumsum(h) + h  # choosable scores in bins >= b
    bstar = jnp.max(jnp.where(at_or_above >= k, bins, -1))
    take_all = total <= k
    above = jnp.sum(jnp.where(bins > bstar, h, 0))  # taken whole
    m = jnp.where(take_all, 0, jnp.sum(jnp.where(bins == bstar, h, 0)))  # boundary-bin candidates
    kk = k - above  # the boundary bin's share, in [1, m]

    # 2. the boundary bin's keys into the scratch row (position order is not needed there)
    def compact(c, cnt):
        _, key, ok = load_chunk(c)
        inb = ok & (_bin(key) == bstar)
        off = cnt + excl_cumsum(inb)
        pltriton.store(cand_ref.at[jnp.where(inb, off, x_ref.shape[0] + lane)], key, mask=inb)
        return cnt + jnp.sum(inb.astype(jnp.int32))

    lax.fori_loop(0, jnp.where(take_all, 0, n_chunks), compact, jnp.int32(0))
    if not interpret:  # (the interpreter runs a program as one sequence and has no barrier)
        pltriton.debug_barrier()  # the scratch stores are visible to every thread of the program

    def cand_chunk(c):  # (volatile: written by other threads of this program)
        return pltriton.load(cand_ref.at[pl.ds(c * w, w)], mask=c * w + lane < m, other=KEY_MIN, volatile=True)

    first = cand_chunk(0)  # the usual case, m <= W: every bisection step works on these registers

    def count_ge(thr):  # candidates with key >= thr
        def body(c, acc):
            return acc + jnp.sum((cand_chunk(c) >= thr).astype(jnp.int32))

        return lax.fori_loop(1, cdiv(m, w), body, jnp.sum((first >= thr).astype(jnp.int32)))

    # 3. the k-th key: the largest tau in the bin with count(key >= tau) >= kk, bit by bit
    def bisect(i, tau):
        trial = tau | lax.shift_left(jnp.int32(1), BIN_SHIFT - 1 - i)
        return jnp.where(count_ge(trial) >= kk, trial, tau)

    tau = lax.fori_loop(0, BIN_SHIFT, bisect, lax.shift_left(bstar - NUM_BINS // 2, BIN_SHIFT))
    need = jnp.where(take_all, 0, kk - count_ge(tau + 1))  # positions equal to tau to take (lowest first)
    tau = jnp.where(take_all, KEY_MIN, tau)

    # 4. one pass in position order: keys above tau, and the first `need` keys equal to it
    def emit(c, carry):
        n_sel, n_tie = carry
        pos, key, ok = load_chunk(c)
        tie = ok & (key == tau)
        sel = ok & ((key > tau) | (tie & (n_tie + excl_cumsum(tie) < need)))
        off = n_sel + excl_cumsum(sel)
        sel = sel & (off < k_out)
        pltriton.store(out_ref.at[jnp.where(sel, off, out_ref.shape[0] - w + lane)], pos, mask=sel)
        return n_sel + jnp.sum(sel.astype(jnp.int32)), n_tie + jnp.sum(tie.astype(jnp.int32))

    n_sel, _ = lax.fori_loop(0, n_chunks, emit, (jnp.int32(0), jnp.int32(0)))

    def tail(c, carry):
        j = c * w + lane
        pltriton.store(out_ref.at[pl.ds(c * w, w)], jnp.full((w,), -1, jnp.int32), mask=j >= n_sel)
        return carry

    lax.fori_loop(0, cdiv(k_out, w), tail, jnp.int32(0))


@functools.partial(jax.jit, static_argnames=("k", "interpret", "width", "num_warps"))
def _select_impl(logits, hist, seq_lens, *, k, interpret, width, num_warps):
    t, s_pad = logits.shape
    k_out = min(k, s_pad)
    k_pad = cdiv(k_out, width) * width
    lens = jnp.clip(seq_lens, 0, s_pad)
    out, _ = pl.pallas_call(
        functools.partial(_select_kernel, k=k, k_out=k_out, interpret=interpret),
        grid=(t,),
        in_specs=[
            pl.BlockSpec((None, s_pad), lambda i: (i, 0)),
            pl.BlockSpec((None, NUM_BINS), lambda i: (i, 0)),
            pl.BlockSpec((t,), lambda i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((None, k_pad + width), lambda i: (i, 0)),
            pl.BlockSpec((None, s_pad + width), lambda i: (i, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, k_pad + width), jnp.int32),
            jax.ShapeDtypeStruct((t, s_pad + width), jnp.int32),
        ],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        name=f"indexer_topk_select_{width=}",
    )(logits, hist, lens)
    return out[:, :k_out]


_SELECT_WIDTH = 1024  # scores per select step (default)


def topk_select(
    logits,  # f32[T, S]: -inf = not visible (positions >= seq_lens are not read)
    seq_lens,  # i32[T]
    k: int,
    *,
    hist=None,  # i32[T, NUM_BINS] (`logits_histogram`; computed here when None)
    interpret: bool = False,
    width: int | None = None,
    num_warps: int | None = None,
):
    """i32[T, min(k, S)]: the exact top-k of each row (the contract above) by the radix-select kernel; equal to
    `topk_from_logits(logits, k, seq_lens)`. Tuning: width scores per step (power of two >= 16)."""
    _validate_k(k)
    _pow2_knob("width", width, 16)
    if logits.ndim != 2 or logits.dtype != jnp.float32:
        raise ValueError(f"logits must be f32[T, S], got {logits.dtype}{logits.shape}")
    if seq_lens.shape != logits.shape[:1] or seq_lens.dtype != jnp.int32:
        raise ValueError(f"seq_lens must be i32[T={logits.shape[0]}], got {seq_lens.dtype}{seq_lens.shape}")
    width = width or _SELECT_WIDTH
    t, s = logits.shape
    x = canonical_scores(logits)
    x = jnp.pad(x, ((0, 0), (0, cdiv(s, width) * width - s)), constant_values=-jnp.inf)
    hist = logits_histogram(logits, seq_lens) if hist is None else hist
    if hist.shape != (t, NUM_BINS) or hist.dtype != jnp.int32:
        raise ValueError(f"hist must be i32[T, {NUM_BINS}], got {hist.dtype}{hist.shape}")
    out = _select_impl(
        x, hist, jnp.clip(seq_lens, 0, s), k=k, interpret=bool(interpret), width=width, num_warps=num_warps or 4
    )
    return out[:, : min(k, s)]


def indexer_topk(
    q,
    weights,
    index_k_cache,
    block_table,
    seq_lens,
    *,
    scale: float,
    k: int,
    k_scale=None,
    interpret: bool = False,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    width: int | None = None,
    select_warps: int | None = None,
    blocks_per_program: int | None = None,
):
    """topk_indices i32[T, min(k, S)]: each row's top-k key positions (the contract above): the score kernel
    (with its bin histogram) then the select kernel; equal to `topk_from_logits` of the same scores."""
    _validate_k(k)
    _pow2_knob("width", width, 16)
    width = width or _SELECT_WIDTH
    tuning = dict(block_k=block_k, num_warps=num_warps, num_stages=num_stages, blocks_per_program=blocks_per_program)
    logits, hist = _checked_scores(
        q, weights, index_k_cache, block_table, seq_lens, k_scale, scale, interpret, tuning, histogram=True, width=width
    )  # [T, S_pad], [T, NUM_BINS]
    s = block_table.shape[1] * index_k_cache.shape[1]
    out = _select_impl(
        logits,
        hist,
        jnp.clip(seq_lens, 0, s),
        k=k,
        interpret=bool(interpret),
        width=width,
        num_warps=select_warps or 4,
    )
    return out[:, : min(k, s)]


def indexer_topk_reference(
    q, weights, index_k_cache, block_table, seq_lens, *, scale: float, k: int, k_scale=None, **_
):
    """`topk_from_logits` on the reference logits."""
    return topk_from_logits(
        indexer_logits_reference(q, weights, index_k_cache, block_table, seq_lens, scale=scale, k_scale=k_scale), k
    )
