"""Paged latent-MQA decode attention for MLA (DeepSeek), as a Pallas kernel lowered through Triton.

Shape legend: B requests, Q query tokens per request, N heads, L kv_lora_rank (512), R rope dim (64),
G page size, S kv splits, M = Q*N rows folded into the dot's M dimension.

The cache holds one shared KV "head" per token: row = [kv_c_normed (L) | k_pe (R)]. The absorbed query
row is [q_nope absorbed (L) | q_pe (R)], so logits = q . row over L+R and the output is p . kv_c over L
(the L-wide K tile is reused as V).

Stage 1 (Pallas): grid (head blocks, S, B). Each program owns `block_h` rows of M for one request and
one page-aligned slice of that request's cache, streams it in `block_kv`-token steps (a block-table
gather of token rows, loads masked by length so garbage/NaN past a row's end is never read), runs an
online softmax in exp2 and writes a normalized partial output and its LSE. Stage 2 (`merge_splits`,
one Pallas kernel) merges the S partials by LSE; with S == 1 stage 1 writes the final output directly.

Triton constraints that shape the code: every load/store and dot operand is a power of two in size, so
L+R is loaded as two tiles (L and R) and the logits are two dots; dots need M, N, K >= 16, so rows are
padded to `block_h` >= 16 and L, R, block_kv >= 16; fp8 x bf16 dots are rejected, so the fp8 tile is
upcast to the compute dtype, and the per-token dequant scale is applied to logits and to p
(fp8_mode="scale_logits", default: block_h x block_kv multiplies instead of block_kv x (L+R)), or to
the upcast tile (fp8_mode="dequant_tile").

The fp8 path is slower than bf16 on the H200 although it reads half the bytes: Triton upcasts the
fp8 tile through extra shared-memory copies and layout conversions (its compile time shows it).
Measured speed of both, against the copy/matmul ceilings and the XLA path: docs/perf-notes.md and
bench/results/decode-h200.json.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import (
    FP8,
    LN2,
    LOG2E,
    M_INIT,
    cdiv,
    check_stacked_index,
    next_pow2,
    num_sms,
    validate_decode,
)


def choose_num_kv_splits(batch: int, rows_per_request: int, max_seq_len: int, num_sms: int) -> int:
    """Static number of KV splits for stage 1.

    vLLM's Triton MLA uses next_pow2(max_seq_len // 512) splits capped at 2 x SMs. That ignores the
    programs the batch already provides (batch x head blocks), and every extra split costs a partial
    [block_h, L] f32 write + merge read and a pipeline prologue. So: split only until the programs
    reach a target number of waves, with a floor on tokens per split. Both depend on the regime
    (H200 sweeps, page 64, bf16; the timings are in docs/perf-notes.md):
    - rows_per_request <= 32 (e.g. N=16): memory-bound, one big-tile program per SM, so
      over-subscribe ~4 waves for latency hiding and ragged-length balance, down to ~256 tokens per
      split.
    - more rows (N=128): compute-bound with two head blocks re-reading K from L2; ~2 waves suffice,
      and more splits (or < 512 tokens per split, vLLM's floor) only add merge traffic.
    - one memory-bound request: down to 64 tokens per split (64-token blocks, `_mla_decode_impl`) while the
      splits fit one per SM: 9.8 / 8.8 us a call at (1, 16, 4096 / 1024) against 11.1 / 10.2 with 128-token
      splits (device time, which launch overhead hides in wall time at batch 1; decode-sweep-h200.json).
    """
    head_blocks = max(1, cdiv(rows_per_request, 64))
    programs = max(1, batch) * head_blocks
    memory_bound = rows_per_request <= 32
    waves = 4 if memory_bound else 2
    floor = 512 if not memory_bound else 64 if programs == 1 else 256
    ideal = next_pow2(max(1, max_seq_len // floor))
    if memory_bound and programs == 1:
        ideal = min(ideal, max(1, next_pow2(num_sms + 1) // 2))  # one split per SM at most
    fill = cdiv(waves * num_sms, programs)
    return int(max(1, min(ideal, fill, 2 * num_sms)))


def _default_tuning(m_rows, l, r, cache_dtype, compute_dtype, block_h, block_kv, num_warps, num_stages, fp8_mode):
    """Defaults from the H200 sweep (227 KB shared memory per block)."""
    if block_h is None:
        # Up to 64 rows per program: a [64, L] f32 accumulator already takes 128 registers/thread at 8
        # warps; 128 rows would spill. Fewer rows when the request has fewer (pad to >= 16 for the dot).
        block_h = min(64, max(16, next_pow2(m_rows)))
    is_fp8 = jnp.dtype(cache_dtype) == FP8
    if block_kv is None:
        if block_h >= 64:
            # q [64, L+R] stays in shared memory (72 KB) next to the K tiles; an upcast fp8 tile needs
            # its own bf16 copies (fp8 with 64 tokens asked for 242 KB, 128 tokens 410 KB).
            block_kv = 32 if is_fp8 or jnp.dtype(compute_dtype).itemsize == 4 else 64
        elif is_fp8:
            block_kv = 64  # (128,16,8192) fp8: 64 tokens 1.6x faster than 128 (upcast cost)
        else:
            block_kv = 128  # N=16 bf16: 128 tokens per step beat 64 by 8-15%
    if num_warps is None:
        num_warps = 8 if block_h >= 64 else 4  # 4 warps at 64 rows ran 2x slower
    if num_stages is None:
        num_stages = 3 if block_h >= 64 and not is_fp8 else 2  # 1 stage ran 2x slower at N=16
    if fp8_mode is None:
        fp8_mode = "scale_logits"
    return block_h, block_kv, num_warps, num_stages, fp8_mode


def softmax_init(rows: int, l: int):
    """(acc f32[rows, L], m f32[rows], l f32[rows]): the online softmax's start (finite M_INIT, see util)."""
    return jnp.zeros((rows, l), jnp.float32), jnp.full((rows,), M_INIT, jnp.float32), jnp.zeros((rows,), jnp.float32)


def softmax_block(acc, m_prev, l_prev, s, v, p_scale, compute_dtype):
    """One key block of the online softmax in exp2 (the decode kernels' shared body): s f32[rows, bkv] logits
    in log2 units (-inf = masked), v [bkv, L] values in compute_dtype, p_scale f32[bkv] or None (an fp8 row's
    per-token scale, folded into p so that V = row * scale) -> (acc, m, l) updated."""
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l_prev * alpha + jnp.sum(p, axis=1)
    if p_scale is not None:
        p = p * p_scale[None, :]
    pv = jnp.dot(p.astype(compute_dtype), v, preferred_element_type=jnp.float32)  # [rows, L]
    return acc * alpha[:, None] + pv, m_next, l_next


def softmax_write(acc, m_i, l_i, o_ref, lse_ref) -> None:
    """Normalized output and natural-log LSE of an online softmax; rows that saw no key: 0 and -inf."""
    has = l_i > 0
    inv = jnp.where(has, 1.0 / jnp.where(has, l_i, 1.0), 0.0)
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(has, (m_i + jnp.log2(jnp.where(has, l_i, 1.0))) * LN2, -jnp.inf)


def _stage1_kernel(
    q_ref,  # [block_h, L+R]
    kv_ref,  # [num_pages*G, L+R] (whole pool; rows gathered via the block table)
    kv_scale_ref,  # [num_pages*G] f32, or None
    bt_ref,  # i32[max_pages]: this request's block table row (pages numbered within the layer's range)
    sl_ref,  # i32[Q]: this request's seq_lens, one per query token
    off_ref,  # i32[1]: page_offset, added to every page id read from bt_ref
    o_ref,  # [block_h, L]: normalized partial output
    lse_ref,  # f32[block_h]
    *,
    l: int,
    r: int,
    heads: int,
    page_size: int,
    capacity: int,
    block_kv: int,
    split_tokens: int,
    sm_scale: float,
    compute_dtype,
    dequant_tile: bool,
):
    head_block, split = pl.program_id(0), pl.program_id(1)
    page_shift = page_size.bit_length() - 1
    block_h = q_ref.shape[0]
    nq = sl_ref.shape[0]
    # Row m of the folded (Q, N) rows is query token m // N's; padding rows (m >= Q*N) attend to nothing.
    # Done here rather than as XLA ops before the call (a repeat, pad and clamp of seq_lens: tiny kernels of
    # their own in every layer's decode step).
    m = head_block * block_h + jnp.arange(block_h, dtype=jnp.int32)  # [block_h]
    m_ok = m < nq * heads
    t = jnp.minimum(lax.div(m, jnp.int32(heads)), nq - 1)  # [block_h] (clamped: padding rows read nothing)
    lens = jnp.minimum(pltriton.load(sl_ref.at[t], mask=m_ok, other=0), capacity)  # [block_h]
    page_offset = off_ref[0]
    split_start = split * split_tokens
    # Steps are aligned to the split, and the split to block_kv, so only the length bounds the loop.
    end = jnp.minimum(jnp.max(lens), split_start + split_tokens)
    n_steps = (jnp.maximum(end - split_start, 0) + block_kv - 1) // block_kv

    q_nope = q_ref[:, pl.ds(0, l)].astype(compute_dtype)  # [block_h, L]
    q_pe = q_ref[:, pl.ds(l, r)].astype(compute_dtype)  # [block_h, R]
    qk_scale = sm_scale * LOG2E  # logits in log2 units for exp2
    cols_nope = jnp.arange(l, dtype=jnp.int32)[None, :]
    cols_pe = l + jnp.arange(r, dtype=jnp.int32)[None, :]

    def body(i, carry):
        acc, m_prev, l_prev = carry
        tok = split_start + i * block_kv + jnp.arange(block_kv, dtype=jnp.int32)  # [block_kv]
        tok_ok = tok < end
        page = pltriton.load(bt_ref.at[lax.shift_right_logical(tok, page_shift)], mask=tok_ok, other=0) + page_offset
        row = page * page_size + (tok & (page_size - 1))  # [bkv] rows of the flattened pool
        # Masked loads: rows past the block's longest length are never read (and read as 0, not NaN).
        # Columns are int-array indices too (interpret mode cannot mix gathers with slices).
        row2 = row[:, None]
        k_nope = pltriton.load(kv_ref.at[row2, cols_nope], mask=tok_ok[:, None], other=0.0)  # [bkv, L]
        k_pe = pltriton.load(kv_ref.at[row2, cols_pe], mask=tok_ok[:, None], other=0.0)  # [bkv, R]
        if kv_scale_ref is not None:
            ks = pltriton.load(kv_scale_ref.at[row], mask=tok_ok, other=0.0)  # [bkv] f32
        if kv_scale_ref is not None and dequant_tile:
            # Scale the upcast tile itself, in f32 then one rounding: a scale rounded to bf16 would shift
            # every logit of its token by the same ~0.2% (lse off by ~5e-2 on long peaky rows).
            ks_c = ks[:, None]
            k_nope = (k_nope.astype(jnp.float32) * ks_c).astype(compute_dtype)
            k_pe = (k_pe.astype(jnp.float32) * ks_c).astype(compute_dtype)
        else:
            k_nope = k_nope.astype(compute_dtype)
            k_pe = k_pe.astype(compute_dtype)
        dims = (((1,), (1,)), ((), ()))
        qk = lax.dot_general(q_nope, k_nope, dims, preferred_element_type=jnp.float32) + lax.dot_general(
            q_pe, k_pe, dims, preferred_element_type=jnp.float32
        )  # [bh, bkv]
        scale_logits = kv_scale_ref is not None and not dequant_tile
        if scale_logits:  # logits of the fp8 rows times the per-token scale
            s = qk * (ks * qk_scale)[None, :]
        else:
            s = qk * qk_scale
        valid = tok[None, :] < lens[:, None]  # [bh, bkv]: per-row (causal) length
        s = jnp.where(valid, s, -jnp.inf)
        return softmax_block(acc, m_prev, l_prev, s, k_nope, ks if scale_logits else None, compute_dtype)

    acc, m_i, l_i = lax.fori_loop(0, n_steps, body, softmax_init(block_h, l))
    softmax_write(acc, m_i, l_i, o_ref, lse_ref)


def merge_splits_reference(o_part, lse_part):
    """LSE-merge of per-split partials: o_part [..., S, M, L] (f32 or bf16), lse_part f32[..., S, M] (plain jnp).
    A split with lse -inf (no keys; its o_part may be unwritten memory) contributes nothing."""
    lse_max = jnp.max(lse_part, axis=-2)  # [..., M]
    safe = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    alive = jnp.isfinite(lse_part)
    w = jnp.where(alive, jnp.exp(lse_part - safe[..., None, :]), 0.0)  # [..., S, M]
    denom = jnp.sum(w, axis=-2)
    # Multiply-and-sum rather than einsum: XLA fuses it into one column reduction over S (an
    # einsum becomes a batched GEMV with K=S).
    out = jnp.sum(jnp.where(alive[..., None], w[..., None] * o_part.astype(jnp.float32), 0.0), axis=-3)  # [..., M, L]
    has = denom > 0
    out = out * jnp.where(has, 1.0 / jnp.where(has, denom, 1.0), 0.0)[..., None]
    lse = jnp.where(has, safe + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf)
    return out, lse


_MERGE_TILE = 8192  # f32 elements of partials one merge program holds: [S', block_l]
_MERGE_PROGRAMS = 256  # the transposed merge's programs at least (~2 an SM), down to 4 columns a program


def _merge_splits_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, splits: int, s_pad: int, rows_m: int):
    """Program (row, j) of grid (B*M, L / block_l): row b*M+m's S partials over one column block.
    Column block 0 also writes the row's merged lse (a 1-element block: no copy per column block to
    slice afterwards, which XLA ran as a kernel of its own)."""
    block_l = out_ref.shape[-1]
    row, j = pl.program_id(0), pl.program_id(1)
    b = row // rows_m
    s = jnp.arange(s_pad, dtype=jnp.int32)
    s_ok = s < splits
    part = (b * splits + s) * rows_m + (row - b * rows_m)  # [S'] rows of the [B*S*M, L] partials
    lse = pltriton.load(lse_ref.at[part], mask=s_ok, other=-jnp.inf)  # [S']
    alive = lse > -jnp.inf
    lse_max = jnp.max(lse)
    safe = jnp.where(lse_max > -jnp.inf, lse_max, 0.0)
    w = jnp.where(alive, jnp.exp(lse - safe), 0.0)
    denom = jnp.sum(w)
    cols = j * block_l + jnp.arange(block_l, dtype=jnp.int32)
    # Dead splits are never read: an sm90 piece with no pages leaves its partial unwritten. (Loading without this
    # mask, so that the load need not wait for the lse, measured 0.1-0.25 us slower here: docs/perf-notes.md.)
    o = pltriton.load(o_ref.at[part[:, None], cols[None, :]], mask=alive[:, None], other=0.0).astype(jnp.float32)
    has = denom > 0
    inv = jnp.where(has, 1.0 / jnp.where(has, denom, 1.0), 0.0)
    out_ref[...] = (jnp.sum(w[:, None] * o, axis=0) * inv).astype(out_ref.dtype)

    @pl.when(j == 0)
    def _():
        lse_out_ref[...] = jnp.full(
            lse_out_ref.shape, jnp.where(has, safe + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf), jnp.float32
        )


def _merge_splits_t_kernel(o_ref, lse_ref, out_ref, lse_out_ref, *, splits: int, s_pad: int, cols: int):
    """Program (b, j) of grid (B, L / block_l): request b's partials o_ref [B*S*L, M] (each split's
    [L, M] slab: transposed) over column block j, every split and all M rows in one gather
    [S', block_l, M]; writes out [M, block_l], and column block 0 the M merged lse."""
    block_l, m = out_ref.shape[-1], out_ref.shape[-2]
    b, j = pl.program_id(0), pl.program_id(1)
    s = jnp.arange(s_pad, dtype=jnp.int32)
    s_ok = s < splits
    rows = jnp.arange(m, dtype=jnp.int32)
    part = b * splits + jnp.minimum(s, splits - 1)  # [S']
    lse = pltriton.load(lse_ref.at[part[:, None], rows[None, :]], mask=s_ok[:, None], other=-jnp.inf)  # [S', M]
    alive = lse > -jnp.inf
    lse_max = jnp.max(lse, axis=0)  # [M]
    safe = jnp.where(lse_max > -jnp.inf, lse_max, 0.0)
    w = jnp.where(alive, jnp.exp(lse - safe[None, :]), 0.0)  # [S', M]
    denom = jnp.sum(w, axis=0)
    c = j * block_l + jnp.arange(block_l, dtype=jnp.int32)
    row = part[:, None] * cols + c[None, :]  # [S', block_l] rows of the [B*S*L, M] partials
    # Loaded without waiting for the lse (`part` is clamped to real splits; masked by `alive` the load waited one
    # memory latency: 0.2-0.4 us of this merge on the H100, docs/perf-notes.md); dead splits' slots may be unwritten
    # memory: selected away, never multiplied.
    o = pltriton.load(o_ref.at[row[:, :, None], rows[None, None, :]]).astype(jnp.float32)  # [S', block_l, M]
    acc = jnp.sum(jnp.where(alive[:, None, :], o * w[:, None, :], 0.0), axis=0)  # [block_l, M]
    has = denom > 0
    inv = jnp.where(has, 1.0 / jnp.where(has, denom, 1.0), 0.0)
    out_ref[...] = (acc * inv[None, :]).T.astype(out_ref.dtype)

    @pl.when(j == 0)
    def _():
        lse_out_ref[...] = jnp.where(has, safe + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("out_dtype", "transposed", "interpret"))
def merge_splits(o_part, lse_part, *, out_dtype=jnp.float32, transposed=False, interpret=False):
    """`merge_splits_reference` as one Pallas kernel: (out [B, M, L] out_dtype, lse f32[B, M]) from
    o_part [B, S, M, L] (transposed=True: [B, S, L, M], as the narrow Hopper decode writes them), f32 or
    bf16 (the Hopper decodes write bf16: half the bytes), lse_part f32[B, S, M]. One launch and one pass
    over the partials, where XLA's version takes 5-7 kernels, a third of a short many-split decode such
    as (1, 128, 32k) on the H200 (docs/perf-notes.md)."""
    if transposed:
        b, splits, l, m = o_part.shape
    else:
        b, splits, m, l = o_part.shape
    s_pad = next_pow2(splits)
    if l & (l - 1) or (transposed and m & (m - 1)):  # Triton tiles are powers of two
        o = jnp.swapaxes(o_part, -1, -2) if transposed else o_part
        out, lse = merge_splits_reference(o, lse_part)
        return out.astype(out_dtype), lse
    if transposed:
        # All splits in one gather: [S', block_l, M] <= _MERGE_TILE elements, and enough column blocks for
        # _MERGE_PROGRAMS programs (16 column blocks a request at least); batch 1 at 64 splits had 32 of 64 KB.
        blocks = next_pow2(cdiv(_MERGE_PROGRAMS, b))
        block_l = max(4, min(l, _MERGE_TILE // (s_pad * m), l // max(16, blocks)))
        out, lse = pl.pallas_call(
            functools.partial(_merge_splits_t_kernel, splits=splits, s_pad=s_pad, cols=l),
            grid=(b, l // block_l),
            in_specs=[
                pl.BlockSpec((b * splits * l, m), lambda i, j: (0, 0)),
                pl.BlockSpec((b * splits, m), lambda i, j: (0, 0)),
            ],
            out_specs=[
                pl.BlockSpec((None, m, block_l), lambda i, j: (i, 0, j)),
                pl.BlockSpec((None, m), lambda i, j: (i, 0)),
            ],
            out_shape=[jax.ShapeDtypeStruct((b, m, l), out_dtype), jax.ShapeDtypeStruct((b, m), jnp.float32)],
            interpret=interpret,
            compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
            name=f"mla_decode_merge_t_s{splits}",
        )(o_part.reshape(b * splits * l, m), lse_part.reshape(b * splits, m))
        return out, lse
    block_l = min(l, max(16, _MERGE_TILE // s_pad))
    n_lb = l // block_l
    out, lse = pl.pallas_call(
        functools.partial(_merge_splits_kernel, splits=splits, s_pad=s_pad, rows_m=m),
        grid=(b * m, n_lb),
        in_specs=[
            pl.BlockSpec((b * splits * m, l), lambda r, j: (0, 0)),
            pl.BlockSpec((b * splits * m,), lambda r, j: (0,)),
        ],
        out_specs=[pl.BlockSpec((None, block_l), lambda r, j: (r, j)), pl.BlockSpec((1,), lambda r, j: (r,))],
        out_shape=[jax.ShapeDtypeStruct((b * m, l), out_dtype), jax.ShapeDtypeStruct((b * m,), jnp.float32)],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name=f"mla_decode_merge_s{splits}",
    )(o_part.reshape(b * splits * m, l), lse_part.reshape(b * splits * m))
    return out.reshape(b, m, l), lse.reshape(b, m)


def segments_from_slot_tile(slot_tile, num_tiles: int):
    """(seg_first, seg_count) i32[U] from slot_tile i32[P], the tile of each partial slot or -1 for
    an unused slot. A tile's slots must be consecutive; a tile with no slot gets (0, 0)."""
    p = slot_tile.shape[0]
    ids = jnp.where(slot_tile >= 0, slot_tile, num_tiles)  # [P]; bin U collects unused slots
    count = jnp.zeros((num_tiles + 1,), jnp.int32).at[ids].add(1)[:num_tiles]
    first = jnp.full((num_tiles + 1,), p, jnp.int32).at[ids].min(jnp.arange(p, dtype=jnp.int32))[:num_tiles]
    return jnp.where(count > 0, first, 0), count


def merge_segments_reference(out, lse, o_part, lse_part, seg_first, seg_count):
    """Plain-jnp (segment_sum) `merge_segments`: tiles with seg_count >= 2 get the LSE merge of their
    slots seg_first .. seg_first + seg_count - 1 (math of `merge_splits_reference`); the others keep
    out/lse. out [U, M, L], lse f32[U, M], o_part [P * M, L] (f32 or bf16), lse_part f32[P * M]."""
    u, m, l = out.shape
    p = lse_part.shape[0] // m
    s = jnp.arange(p, dtype=jnp.int32)
    split = seg_count >= 2  # [U]
    in_seg = split[:, None] & (s >= seg_first[:, None]) & (s < (seg_first + seg_count)[:, None])
    owner = jnp.where(jnp.any(in_seg, axis=0), jnp.argmax(in_seg, axis=0), u)  # [P]; U: none
    used = owner < u
    lse_s = jnp.where(used[:, None], lse_part.reshape(p, m), -jnp.inf)  # [P, M]
    lse_max = jax.ops.segment_max(lse_s, owner, num_segments=u)  # [U, M]
    safe = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    alive = jnp.isfinite(lse_s)
    w = jnp.where(alive, jnp.exp(lse_s - safe[jnp.minimum(owner, u - 1)]), 0.0)  # [P, M]
    # Dead partials (and unused slots) may hold NaN: select them away before the multiply.
    o = jnp.where(alive[..., None], o_part.reshape(p, m, l).astype(jnp.float32), 0.0)
    num = jax.ops.segment_sum(w[..., None] * o, owner, num_segments=u)  # [U, M, L]
    den = jax.ops.segment_sum(w, owner, num_segments=u)  # [U, M]
    has = den > 0
    merged = num * jnp.where(has, 1.0 / jnp.where(has, den, 1.0), 0.0)[..., None]
    merged_lse = jnp.where(has, safe + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
    out = jnp.where(split[:, None, None], merged.astype(out.dtype), out)
    lse = jnp.where(split[:, None], merged_lse, lse)
    return out, lse


_SEG_CHUNK = 4  # slots per step of `merge_segments`' online loop (work-list tiles are cut into a few pieces)


def split_tiles_of(seg_count, num_split: int):
    """i32[R]: the tiles with seg_count >= 2 in order, padded with U (= len(seg_count)) to R = num_split entries;
    `worklist_pieces` writes the same list from its one program."""
    u = seg_count.shape[0]
    return jnp.nonzero(seg_count >= 2, size=num_split, fill_value=u)[0].astype(jnp.int32)


def _merge_segments_kernel(
    tile_ref,
    first_ref,
    count_ref,
    o_part_ref,
    lse_part_ref,
    out_in,
    lse_in,
    out_ref,
    lse_out_ref,
    *,
    slots: int,
    chunk: int,
    block_l: int,
    transposed: bool,
):
    """Program (r, j) of grid (R, L / block_l): all M rows of the r-th split tile over column block j, an
    online LSE merge over its slots `chunk` at a time (a running max rescales the sums, so no pass over
    all the slots comes first). o_part_ref is [P*M, L] (each slot's [M, L] rows), or with `transposed`
    [P*L, M] (each slot's [L, M] slab, as the narrow Hopper decode writes it); lse_part_ref [P*M].
    out_ref/lse_out_ref are the whole [U, M, L] / [U, M] arrays, aliased to out_in/lse_in."""
    del out_in, lse_in  # same buffers as out_ref/lse_out_ref
    u, m, l = out_ref.shape
    r, j = pl.program_id(0), pl.program_id(1)
    tile = tile_ref[r]
    safe_tile = jnp.minimum(tile, u - 1)
    first, count = first_ref[safe_tile], count_ref[safe_tile]
    rows = jnp.arange(m, dtype=jnp.int32)
    cols = j * block_l + jnp.arange(block_l, dtype=jnp.int32)

    @pl.when(tile < u)  # padding entries of the split-tile list: nothing to do
    def _():
        def step(c, carry):  # slots c*chunk .. c*chunk + chunk - 1
            acc, run_max, den = carry  # [block_l, M] (transposed) or [M, block_l]; [M]; [M]
            sc = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            pc = jnp.minimum(first + sc, slots - 1)  # [chunk]
            lc = pltriton.load(
                lse_part_ref.at[pc[:, None] * m + rows[None, :]], mask=(sc < count)[:, None], other=-jnp.inf
            )  # [chunk, M]
            new_max = jnp.maximum(run_max, jnp.max(lc, axis=0))
            safe = jnp.where(new_max > -jnp.inf, new_max, 0.0)
            alpha = jnp.where(run_max > -jnp.inf, jnp.exp(run_max - safe), 0.0)  # [M]
            alive = lc > -jnp.inf
            w = jnp.where(alive, jnp.exp(lc - safe[None, :]), 0.0)  # [chunk, M]
            # Dead partials are never read: a piece with no pages leaves its partial unwritten. (Unmasked loads,
            # which need not wait for the lse, measured 0.2-0.9 us slower here: they read past the live slots.)
            if transposed:
                o = pltriton.load(
                    o_part_ref.at[(pc[:, None] * l + cols[None, :])[:, :, None], rows[None, None, :]],
                    mask=alive[:, None, :],
                    other=0.0,
                ).astype(jnp.float32)  # [chunk, block_l, M]
                acc = acc * alpha[None, :] + jnp.sum(o * w[:, None, :], axis=0)
            else:
                o = pltriton.load(
                    o_part_ref.at[(pc[:, None] * m + rows[None, :])[:, :, None], cols[None, None, :]],
                    mask=alive[:, :, None],
                    other=0.0,
                ).astype(jnp.float32)  # [chunk, M, block_l]
                acc = acc * alpha[:, None] + jnp.sum(o * w[:, :, None], axis=0)
            return acc, new_max, den * alpha + jnp.sum(w, axis=0)

        acc0 = jnp.zeros((block_l, m) if transposed else (m, block_l), jnp.float32)
        init = (acc0, jnp.full((m,), -jnp.inf, jnp.float32), jnp.zeros((m,), jnp.float32))
        acc, run_max, den = lax.fori_loop(0, (count + chunk - 1) // chunk, step, init)
        has = den > 0
        inv = jnp.where(has, 1.0 / jnp.where(has, den, 1.0), 0.0)  # [M]
        merged = (acc * inv[None, :]).T if transposed else acc * inv[:, None]  # [M, block_l]
        pltriton.store(out_ref.at[tile, rows[:, None], cols[None, :]], merged.astype(out_ref.dtype))

        @pl.when(j == 0)
        def _():
            safe = jnp.where(run_max > -jnp.inf, run_max, 0.0)
            pltriton.store(
                lse_out_ref.at[tile, rows], jnp.where(has, safe + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)
            )


@functools.partial(jax.jit, static_argnames=("transposed", "interpret"))
def merge_segments(
    out, lse, o_part, lse_part, seg_first, seg_count, split_tiles=None, *, transposed=False, interpret=False
):
    """`merge_segments_reference` as one Pallas kernel, in place: (out [U, M, L], lse f32[U, M]) with
    each split tile (seg_count >= 2) replaced by the LSE merge of its slots of o_part [P * M, L] (f32 or bf16),
    lse_part f32[P * M]. Replaces the work-list merge's XLA segment_sum (it scatters ~23 MB over
    every slot and tile; ~9x slower on the H200, docs/perf-notes.md): one launch that reads only
    live split slots and writes only split tiles. out/lse are aliased to the
    outputs: where out is dead after the call (the sm90 decode) unsplit tiles are neither read nor
    copied; a standalone call copies out once.

    Segments of different tiles must be disjoint, so at most R = min(U, P // 2) tiles are split. Grid
    (R, L / block_l) over the list of split tiles (`split_tiles` i32[R], padded with U, as `worklist_pieces`
    writes it; computed here when None), rather than over all U tiles: the grid is static and most tiles are
    usually whole; padding programs exit at once. A program merges all M rows of its tile over one column block,
    `_SEG_CHUNK` slots a step with a running max, so its cost follows the tile's slot count, not P.
    transposed=True: o_part [P * L, M] (each slot's [L, M] slab, as the narrow Hopper decode writes its
    partials)."""
    u, m, l = out.shape
    slots = lse_part.shape[0] // m
    n_split = min(u, slots // 2)
    if l & (l - 1) or m & (m - 1) or n_split == 0:  # Triton tiles are powers of two
        if transposed:
            o_part = jnp.swapaxes(o_part.reshape(slots, l, m), 1, 2).reshape(slots * m, l)
        return merge_segments_reference(out, lse, o_part, lse_part, seg_first, seg_count)
    if split_tiles is None:
        split_tiles = split_tiles_of(seg_count, n_split)
    elif split_tiles.shape != (n_split,):
        raise ValueError(f"split_tiles has shape {split_tiles.shape}; expected ({n_split},) = min(U, slots // 2)")
    chunk = _SEG_CHUNK
    block_l = min(l, max(16, _MERGE_TILE // (chunk * m)))
    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_merge_segments_kernel, slots=slots, chunk=chunk, block_l=block_l, transposed=transposed),
        grid=(n_split, l // block_l),
        # Whole-array blocks: under the Triton lowering a block only sets a base pointer; the
        # kernel indexes rows and tiles itself.
        in_specs=[whole((n_split,))]
        + [whole((u,))] * 2
        + [whole(o_part.shape), whole((slots * m,)), whole((u, m, l)), whole((u, m))],
        out_specs=[whole((u, m, l)), whole((u, m))],
        out_shape=[jax.ShapeDtypeStruct(out.shape, out.dtype), jax.ShapeDtypeStruct(lse.shape, jnp.float32)],
        input_output_aliases={5: 0, 6: 1},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name=f"mla_decode_merge_segments{'_t' if transposed else ''}",
    )(
        split_tiles.astype(jnp.int32),
        seg_first.astype(jnp.int32),
        seg_count.astype(jnp.int32),
        o_part,
        lse_part,
        out,
        lse.astype(jnp.float32),
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "kv_lora_rank",
        "num_kv_splits",
        "batch_invariant",
        "interpret",
        "block_h",
        "block_kv",
        "num_warps",
        "num_stages",
        "fp8_mode",
        "return_partials",
    ),
)
def _mla_decode_impl(
    q,
    cache,
    block_table,
    seq_lens,
    kv_scale,
    page_offset=None,
    *,
    scale,
    kv_lora_rank,
    num_kv_splits,
    batch_invariant,
    interpret,
    block_h,
    block_kv,
    num_warps,
    num_stages,
    fp8_mode=None,
    return_partials=False,
):
    """`mla_decode` after validation; page_offset: None (0) or an integer scalar, static or traced.
    return_partials: stage 1's (o_part [B, S, M', L], lse_part f32[B, S, M']) over the padded rows M'."""
    b, nq, n, d = q.shape
    l = kv_lora_rank
    r = d - l
    num_pages, g, _ = cache.shape
    max_pages = block_table.shape[1]
    capacity = max_pages * g
    m_rows = nq * n
    is_fp8 = jnp.dtype(cache.dtype) == FP8
    compute_dtype = q.dtype if is_fp8 else jnp.promote_types(q.dtype, cache.dtype)
    if block_kv is None and b == 1 and m_rows <= 32 and not is_fp8:
        block_kv = 64  # one memory-bound request: 64-token splits, one per SM (choose_num_kv_splits)
    block_h, block_kv, num_warps, num_stages, fp8_mode = _default_tuning(
        m_rows, l, r, cache.dtype, compute_dtype, block_h, block_kv, num_warps, num_stages, fp8_mode
    )

    # Splits: static (seq_lens are traced), from the capacity; page- and step-aligned.
    if batch_invariant:
        num_splits = 1
    elif num_kv_splits is not None:
        num_splits = num_kv_splits
    else:
        num_splits = choose_num_kv_splits(b, m_rows, capacity, num_sms())
    align = max(g, block_kv)
    # Nearest whole number of blocks per split (rounding up would halve e.g. 32 splits of 4160 tokens to 17).
    split_tokens = max(1, round(capacity / (num_splits * align))) * align
    num_splits = cdiv(capacity, split_tokens)

    # Fold (Q, N) into rows; pad rows to a multiple of block_h (the kernel gives padding rows length 0, and
    # each row its query token's seq_len clamped to the capacity).
    m_pad = cdiv(m_rows, block_h) * block_h
    q_rows = q.reshape(b, m_rows, d)  # [B, M, L+R]
    if m_pad != m_rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, m_pad - m_rows), (0, 0)))
    offset = (
        jnp.zeros((1,), jnp.int32) if page_offset is None else jnp.asarray(page_offset, jnp.int32).reshape(1)
    )  # i32[1]
    kv_rows = cache.reshape(num_pages * g, d)  # [num_pages*G, L+R]
    scale_rows = kv_scale.reshape(num_pages * g) if is_fp8 else None

    final = num_splits == 1
    # Split partials in q's dtype (bf16), as both Hopper decodes': 2-9% less device time than f32 on an H100
    # (session 32; their merge reads in f32); return_partials (DCP's cross-device merge) stays f32.
    o_dtype = jnp.float32 if return_partials else q.dtype
    head_blocks = m_pad // block_h
    grid = (head_blocks, num_splits, b)  # head blocks fastest: programs sharing a KV slice run together
    kernel = functools.partial(
        _stage1_kernel,
        l=l,
        r=r,
        heads=n,
        page_size=g,
        capacity=capacity,
        block_kv=block_kv,
        split_tokens=split_tokens,
        sm_scale=float(scale),
        compute_dtype=compute_dtype,
        dequant_tile=is_fp8 and fp8_mode == "dequant_tile",
    )
    in_specs = [
        pl.BlockSpec((None, block_h, d), lambda h, s, i: (i, h, 0)),
        pl.BlockSpec((num_pages * g, d), lambda h, s, i: (0, 0)),
        pl.BlockSpec((num_pages * g,), lambda h, s, i: (0,)) if is_fp8 else None,
        pl.BlockSpec((None, max_pages), lambda h, s, i: (i, 0)),
        pl.BlockSpec((None, nq), lambda h, s, i: (i, 0)),
        pl.BlockSpec((1,), lambda h, s, i: (0,)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, block_h, l), lambda h, s, i: (i, s, h, 0)),
        pl.BlockSpec((None, None, block_h), lambda h, s, i: (i, s, h)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((b, num_splits, m_pad, l), o_dtype),
        jax.ShapeDtypeStruct((b, num_splits, m_pad), jnp.float32),
    ]
    o_part, lse_part = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"mla_decode_{block_h=}_{block_kv=}_{num_splits=}_{num_warps=}_{num_stages=}",
    )(q_rows, kv_rows, scale_rows, block_table, seq_lens, offset)
    if return_partials:
        return o_part, lse_part
    if final:
        out, lse = o_part[:, 0], lse_part[:, 0]
    else:
        out, lse = merge_splits(o_part, lse_part, out_dtype=q.dtype, interpret=interpret)
    out = out[:, :m_rows].reshape(b, nq, n, l).astype(q.dtype)
    lse = lse[:, :m_rows].reshape(b, nq, n)
    return out, lse


def check_page_offset(page_offset, num_pages: int) -> None:
    """The decode kernels' page_offset: None, or an integer scalar; a static one in [0, num_pages) (a traced one
    cannot be checked: like the block table's entries, it is the caller's)."""
    if page_offset is not None:
        check_stacked_index(page_offset, num_pages, "page_offset", f"kv_c_and_k_pe_cache of {num_pages} pages")


def mla_decode(
    q,  # [B, Q, N, L+R] bf16/f16/f32: absorbed q_nope (L) then q_pe (R)
    kv_c_and_k_pe_cache,  # [num_pages, G, L+R] bf16/f16/f32, or float8_e4m3fn with kv_scale
    block_table,  # i32[B, max_pages]: page ids, each read as page block_table[b, i] + page_offset of the pool
    seq_lens,  # i32[B, Q]: cache tokens query row (b, t) attends to; 0 = empty row
    *,
    scale: float,
    kv_scale=None,  # f32[num_pages, G]: row value = fp8 row * kv_scale (fp8 cache only)
    kv_lora_rank: int = 512,
    page_offset=None,  # integer scalar, static or traced (None = 0): the first page of block_table's range
    num_kv_splits: int | None = None,
    batch_invariant: bool = False,
    interpret: bool = False,
    block_h: int | None = None,
    block_kv: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_mode: str | None = None,
):
    """Paged latent-MQA decode attention. Returns (out [B, Q, N, L] in q.dtype, lse f32[B, Q, N]).

    lse is the natural log of sum(exp(scale * logits)) over the attended tokens; rows with seq_len 0
    give out 0 and lse -inf. Lengths beyond the block table's capacity (max_pages * G) are clamped.

    page_offset: block_table's entries are pages numbered within one range of the pool (one layer's pages
    of a cache flattened over layers, [num_layers * num_pages, G, L+R]); the kernel reads page
    block_table[b, i] + page_offset, adding it as it loads the page id, so that a layer's decode needs no
    XLA op on the block table. A static page_offset must lie in [0, num_pages).

    num_kv_splits: static stage-1 split count (None: `choose_num_kv_splits` on the static capacity).
    batch_invariant: one split, so a request's result is bitwise independent of the rest of the batch.
    Tuning (None = defaults for H200): block_h rows of Q*N per program (pow2 >= 16), block_kv tokens
    per step (pow2 >= 16, independent of the page size), num_warps, num_stages (Triton pipelining),
    fp8_mode: "scale_logits" (per-token scale on logits and p) or "dequant_tile" (scale the upcast tile).
    """
    validate_decode(
        q,
        kv_c_and_k_pe_cache,
        block_table,
        seq_lens,
        kv_scale,
        kv_lora_rank,
        num_kv_splits,
        scale,
        block_h,
        block_kv,
        num_warps,
        num_stages,
        fp8_mode,
    )
    check_page_offset(page_offset, kv_c_and_k_pe_cache.shape[0])
    return _mla_decode_impl(
        q,
        kv_c_and_k_pe_cache,
        block_table,
        seq_lens,
        kv_scale,
        page_offset,
        scale=float(scale),
        kv_lora_rank=int(kv_lora_rank),
        num_kv_splits=num_kv_splits,
        batch_invariant=bool(batch_invariant),
        interpret=bool(interpret),
        block_h=block_h,
        block_kv=block_kv,
        num_warps=num_warps,
        num_stages=num_stages,
        fp8_mode=fp8_mode,
    )


def mla_decode_reference(
    q,
    kv_c_and_k_pe_cache,
    block_table,
    seq_lens,
    *,
    scale: float,
    kv_scale=None,
    kv_lora_rank: int = 512,
    page_offset=None,
    num_kv_splits=None,
    batch_invariant=False,
    interpret=False,
    block_h=None,
    block_kv=None,
    num_warps=None,
    num_stages=None,
    fp8_mode=None,
):
    """Float32 reference on rows gathered per request (un-paged). Same signature and outputs."""
    del num_kv_splits, batch_invariant, interpret, block_h, block_kv, num_warps, num_stages, fp8_mode
    validate_decode(
        q,
        kv_c_and_k_pe_cache,
        block_table,
        seq_lens,
        kv_scale,
        kv_lora_rank,
        None,
        scale,
        None,
        None,
        None,
        None,
        for_kernel=False,
    )
    check_page_offset(page_offset, kv_c_and_k_pe_cache.shape[0])
    if page_offset is not None:
        block_table = block_table + jnp.asarray(page_offset, jnp.int32)
    b, nq, n, d = q.shape
    l = kv_lora_rank
    _, g, _ = kv_c_and_k_pe_cache.shape
    ctx = block_table.shape[1] * g
    kv = kv_c_and_k_pe_cache[block_table].astype(jnp.float32)  # [B, max_pages, G, L+R]
    if kv_scale is not None:
        kv = kv * kv_scale[block_table][..., None]
    kv = kv.reshape(b, ctx, d)  # [B, ctx, L+R]
    pos = jnp.arange(ctx, dtype=jnp.int32)
    # Zero rows no query row of the request attends to, so garbage there cannot reach p @ v.
    kv = jnp.where((pos[None, :] < jnp.max(seq_lens, axis=1)[:, None])[..., None], kv, 0.0)
    logits = scale * jnp.einsum(
        "bqnd,bsd->bqns", q.astype(jnp.float32), kv, precision=lax.Precision.HIGHEST
    )  # [B, Q, N, ctx]
    mask = (pos[None, None, :] < seq_lens[:, :, None])[:, :, None, :]  # [B, Q, 1, ctx]
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(logits - m)
    denom = jnp.sum(e, axis=-1, keepdims=True)  # [B, Q, N, 1]
    has = denom > 0
    p = e / jnp.where(has, denom, 1.0)
    out = jnp.einsum("bqns,bsl->bqnl", p, kv[..., :l], precision=lax.Precision.HIGHEST)
    lse = jnp.where(has, m + jnp.log(jnp.where(has, denom, 1.0)), -jnp.inf)[..., 0]
    return out.astype(q.dtype), lse
