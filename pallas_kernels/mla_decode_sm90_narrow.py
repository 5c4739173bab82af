"""Hopper paged latent-MQA decode for few query rows (M = Q*N <= 32): tokens on the wgmma M axis.

`mla_decode_sm90` runs this kernel when a request has at most `NARROW_MAX_ROWS` query rows (N=16
heads: DeepSeek-V3 under TP 8, V2-Lite; N=16 with one speculative token; an fp8 cache: up to
`NARROW_FP8_MAX_ROWS`), the rest as 64-row tiles (`mla_decode_sm90._kernel`). Its float32 reference is
`mla_decode_reference`.

Why: a wgmma's M is 64. With rows on M, 16 rows fill a quarter of the tile, and both products run at
4x their useful FLOPs; at N=16 the padded 64-row kernel is bound by that padding, not by the cache
bytes (docs/perf-notes.md). Here the page's 64 tokens are M and the rows are the wgmma's N (a
multiple of 8, up to 256), so nothing is padded:

  S^T [G, M]  = K [G, L+R]  . Q^T [L+R, M]     (A: the ring slot as it landed; B: Q, K-major)
  O^T [L, M] += V^T [L, G] . P^T [G, M]        (A: the slot's first L columns, transposed;
                                                B: P^T stored as P [M, G], K-major)

The online softmax runs over the columns of S^T (one per query row): each page's column max is a
cross-warp reduction (the 64 tokens span the warpgroup's 4 warps); the column sums are kept
elementwise in a [G, M] accumulator and reduced once at the end. O^T is [L, M] f32: 4M registers
a thread (128 at M = 32), so one consumer warpgroup holds all L columns, and a producer warpgroup
keeps the next page in flight (one TMA per page, a `stages`-deep ring, zeroing the rows past the
length on a partial last page). The kernel is bound by the cache bytes, as decode at few rows
should be: 277 us at (128, 16, 8192), 4.4 TB/s of cache reads (bench/results/decode-h200.json).

fp8 cache (e4m3 rows, a float32 scale per token), exact up to float32 and the fp8 wgmma's
accumulation: Hopper's fp8 wgmma reads B only K-major, so of the two products only QK^T can run on the
fp8 page as it lands. Q is split per row into two e4m3 terms, q ~= (q_hi + q_lo / 16) s_hi
(`quantize_q_hilo`: the bf16 q's 8 significant bits as 4 + 4, exact but for underflow), in the kernel:
the consumer reads the bf16 rows from global memory into registers and stores the terms into Q's
shared memory (`split_q_into_smem`), so no kernel runs before this one. Q's shared memory holds q_hi's rows,
then q_lo's, so one fp8 wgmma chain with N = 2M computes both products (18 k32 instructions a page
where two N = M chains took 36: at N = 16 an instruction costs its latency, not its width);
S^T = hi columns * s_hi + lo columns * s_hi / 16, accumulated in float32 every `_QK_CHUNK` columns
(the fp8 wgmma accumulates at reduced precision: DeepSeek-V3 report 3.3.2), times the tokens'
scales. V's L columns are cast to bf16 (exact) by the producer and a third warpgroup, half each,
into a bf16 V slot (`stages` deep, default 2) while the consumer runs QK^T on the fp8 slot (a 2-deep
ring); P is multiplied by the tokens' scales, and page i's P.V runs after page i + 1's QK^T and
softmax (two P buffers), so each cast has a page's time. The consumer takes 240 registers a thread,
the other two 128 / 136 (`_FP8_REGS`). Shared memory: fp8 ring 2 x 36 KB, V 64 KB a slot, Q 2 x 9
KB: 16 rows (the split's windows need 16; fewer rows are padded).
fp8_qk (opt-in, lossy, as the 64-row kernel's mode): q as one e4m3 term per row (`quantize_q_fp8`:
the split's q_hi, also in the kernel), one fp8 product; the logits are those of that q (~5.8%
relative output error on N(0, 1) inputs, 1.7-2.0% on the demo model's activations:
docs/perf-notes.md).

Outputs: the final output [rows, L] through a transposed store of O^T into a [rows, L] staging tile
(the bf16 tile takes a transposed register store; an f32 one does not lower), then TMA; split
partials stay transposed, [L, rows] bf16 per piece, merged by `mla_decode.merge_splits(...,
transposed=True)`. Pieces are static, request b's pages cut into `splits` equal ranges, or (schedule
"worklist") each request cut by its length so that the pieces balance over the SMs (`mla_decode_sm90.worklist_pieces`),
the split requests' partials merged by `mla_decode.merge_segments(..., transposed=True)`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mgpu import (
    cast_fp8_columns,
    copy_zeroing_rows,
    interpret_params,
    smem_bytes,
    tiled,
    wgmma_accumulate,
)
from pallas_kernels.util import BF16, FP8, H200_SMS, LN2, LOG2E, M_INIT, is_pow2, next_pow2, round_e4m3

__all__ = [
    "NARROW_MAX_ROWS",
    "NARROW_FP8_MAX_ROWS",
    "narrow_rows",
    "narrow_decode",
    "quantize_q_fp8",
    "quantize_q_fp8_rows",
    "quantize_q_hilo",
    "split_q",
    "split_q_into_smem",
]

NARROW_MAX_ROWS = 32  # O^T [512, M] f32 is 4M registers a thread: 128 at M = 32
NARROW_FP8_MAX_ROWS = 16  # fp8: shared memory (two rings) and the QK^T chunk accumulators
PAGE_SIZE = 64
# Split partials: normalized O^T [L, M] per piece, in the output's dtype (half the bytes written and merged of f32;
# the rounding the output has anyway; lse stays f32).
_PARTIAL_DTYPE = BF16
_QK_CHUNK = 192  # fp8 QK^T: columns per float32 promotion (DeepGEMM's recipe promotes every 128)
# fp8: (consumer, producer, caster) registers a thread; the CTA launches with 384 x 168 = 64512. At the even split
# ptxas spilled 264 B a thread of the consumer (O^T and the QK^T partial sums); with these none (329 -> 297 us at
# 128x16x8192, with P.V moved after the next page's softmax, session 17).
_FP8_REGS = (240, 128, 136)
# Programmatic dependent launch: with PDL the kernel waits (`griddepcontrol.wait`) before its first read, which marks
# it for a PDL launch (Mosaic GPU's `uses_pdl`), so that its launch overlaps the previous kernel's end. Off until
# measured on a GPU (gpu_session.sh part 83: its GPU tests and the batch-1 step with and without it).
PDL = False
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a [G, M] / [L, M] accumulator (a query row)
_TOK = plgpu.Layout.WGMMA.reduce(1)  # one value per row (a token of the page)


def narrow_rows(m_rows: int, fp8: bool = False) -> int | None:
    """The wgmma N this kernel uses for `m_rows` query rows (the next power of two >= 8, >= 16 with an fp8 cache,
    whose in-kernel q split loads [16, 128] windows: the split merge's Triton tiles are powers of two), or None past
    its limit (`NARROW_MAX_ROWS`, fp8 cache `NARROW_FP8_MAX_ROWS`)."""
    rows = max(16 if fp8 else 8, next_pow2(m_rows))
    return rows if 0 < m_rows and rows <= min(NARROW_MAX_ROWS, NARROW_FP8_MAX_ROWS if fp8 else 1 << 30) else None


def quantize_q_hilo(q):
    """q [..., D] -> (q_hi, q_lo, s_hi): e4m3 [..., D] twice and float32 [...] per row, with
    q ~= (q_hi + q_lo / 16) s_hi.

    s_hi is a power of two (amax / 448 rounded up), so q_hi s_hi lies on q's binary grid. q_hi keeps 4
    significant bits of each element; the residual is at most half of q_hi's last place, <= 16 s_hi, so at
    the scale s_hi / 16 it fits e4m3 (<= 256 < 448) and its (at most 4, for a bf16 q) bits are exact for every
    element of at least s_hi 2^-6 (2^-13.8 of the row's largest or more): below it q_hi is subnormal and q_lo
    underflows. One reduction (the row's amax); all-zero rows get scale 1."""
    q = q.astype(jnp.float32)
    amax = jnp.max(jnp.abs(q), axis=-1)
    # The power of two at or above amax / 448, exactly (exp2 and log2 are approximate on some backends).
    m, e = jnp.frexp(jnp.where(amax > 0, amax, 448.0) / 448.0)  # m in [0.5, 1)
    sc = jnp.ldexp(jnp.float32(1), jnp.where(m == 0.5, e - 1, e))
    sc = jnp.where(amax > 448.0 * sc, 2.0 * sc, sc)  # amax / 448 rounded down onto a power of two
    x = q / sc[..., None]
    hi = round_e4m3(x)
    return hi.astype(FP8), round_e4m3((x - hi) * 16.0).astype(FP8), sc


def _pow2_above(v):
    """(2^ceil(log2 v), its biased exponent) for normal f32 v > 0, from the bits (exact on every backend)."""
    bits = lax.bitcast_convert_type(v, jnp.int32)
    e = (bits >> 23) + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return lax.bitcast_convert_type(e << 23, jnp.float32), e


def _row_scale(amax):
    """A row's amax [rows] -> (s_hi, 1 / s_hi), `quantize_q_hilo`'s power-of-two scale (amax / 448 rounded up, 1 for
    an all-zero row) and its exact inverse, from the bits: the in-kernel split and the Triton quantize share it."""
    sc, _ = _pow2_above(jnp.where(amax > 0, amax, 448.0) / 448.0)
    sc, e = _pow2_above(jnp.where(amax > 448.0 * sc, 2.0 * sc, sc))  # the division's rounding
    return sc, lax.bitcast_convert_type((254 - e) << 23, jnp.float32)


def split_q_into_smem(q_rows, q8, q_scales, *, lo: bool):
    """In the consumer warpgroup: `quantize_q_hilo` of the bf16 q rows `q_rows` [16, D] (global memory, read straight
    into registers) into q8's rows (q_hi's [0, 16), with `lo` q_lo's [16, 32)) and their scales s_hi into q_scales
    [16] (shared memory). The fp8 kernel's q split; `lo=False`: `fp8_qk`'s q.

    The rows go in as windows of [16, 128] in the copy layout (its smallest at 16 rows; a last window overlapping the
    one before it where D is not a multiple of 128), all kept in registers (72 a thread at D = 576); their
    elementwise |max| is reduced once per row (across warps: the kernel's reduction scratch). Bitwise
    `quantize_q_hilo` (`round_e4m3`, a power-of-two scale from the bits): what a Triton kernel computed before each
    call (1.3-3.2 us on the H200, a kernel a layer). The 64-row kernel's `fp8_qk` q is quantized before its call
    (`quantize_q_fp8_rows`): its 64 rows quantized here spilled (docs/perf-notes.md, session 29)."""
    rows, d = q_rows.shape
    w = 128
    starts = [*range(0, d - w + 1, w)] + ([d - w] if d % w else [])
    layout = plgpu.Layout.SMEM_GMEM_COPY((rows, w), BF16, 128)
    xs = [plgpu.load(q_rows.at[:, pl.ds(c, w)], layout=layout, optimized=False).astype(jnp.float32) for c in starts]
    sc, inv = _row_scale(jnp.max(functools.reduce(jnp.maximum, [jnp.abs(x) for x in xs]), axis=1))  # [rows]
    for c, x in zip(starts, xs):
        x = x * lax.broadcast_in_dim(inv, x.shape, [0])
        hi = round_e4m3(x)
        q8.at[pl.ds(0, rows), pl.ds(c, w)][...] = hi.astype(FP8)
        if lo:
            q8.at[pl.ds(rows, rows), pl.ds(c, w)][...] = round_e4m3((x - hi) * 16.0).astype(FP8)
    q_scales[...] = sc
    plgpu.commit_smem()  # generic-proxy writes before the wgmma reads (and the scales' loads)


def split_q(q, *, interpret: bool = False):
    """`split_q_into_smem` (the fp8 kernel's q split) as a kernel of its own, one CTA per request: q bf16 [B, 16, D]
    (D a multiple of 64, >= 128) -> (q_hi, q_lo e4m3 [B, 16, D], s_hi f32 [B, 16]), bitwise `quantize_q_hilo`'s (the
    tests' check of the split on the interpreter and the GPU)."""
    b, m, d = q.shape

    def body(q_gmem, hi_gmem, lo_gmem, s_gmem, q8, q_scales):
        i = lax.axis_index("b")
        split_q_into_smem(q_gmem.at[i], q8, q_scales, lo=True)
        for h, out in enumerate((hi_gmem, lo_gmem)):
            plgpu.copy_smem_to_gmem(q8.at[pl.ds(h * m, m)], out.at[i])
        plgpu.copy_smem_to_gmem(q_scales, s_gmem.at[i])
        plgpu.wait_smem_to_gmem(0)

    f8 = jax.ShapeDtypeStruct((b, m, d), FP8)
    return plgpu.kernel(
        body,
        out_type=(f8, f8, jax.ShapeDtypeStruct((b, m), jnp.float32)),
        scratch_types=(plgpu.SMEM((2 * m, d), FP8, transforms=tiled(FP8, 64)), plgpu.SMEM((m,), jnp.float32)),
        grid=(b,),
        grid_names=("b",),
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=2048),
        interpret=interpret_params(interpret),
        kernel_name=f"split_q_m{m}",
    )(q.astype(BF16))


def quantize_q_fp8(q, *, split: bool = False):
    """q [..., D] -> (float8_e4m3fn q / scale, f32 scale [...]) per row (head, token): `quantize_q_hilo`'s q_hi and
    its power-of-two scale (e4m3 keeps 4 significant bits whatever the scale: a power of two costs no precision and
    the narrow kernel computes it in place). What `fp8_qk=True` feeds the QK^T wgmma (lossy): its logits are those of
    q8 * scale, the reference's input for that mode.

    split: [..., 2D], q_hi then its residual q / scale - q_hi rounded to e4m3 at the same scale (q_hi + residual is q
    to ~2^-8, and both terms feed one fp8 accumulation: the 64-row kernel's fp8 P.V mode); residuals below e4m3's
    smallest subnormal (2^-9, ~2^-18 of the row's largest) vanish."""
    hi, _, sc = quantize_q_hilo(q)
    if not split:
        return hi, sc
    x = q.astype(jnp.float32) / sc[..., None]
    return jnp.concatenate([hi, round_e4m3(x - hi.astype(jnp.float32)).astype(FP8)], axis=-1), sc


_QUANT_PROGRAMS = 2048  # `quantize_q_fp8_rows` puts up to 8 rows in a program while this many programs remain


def _quantize_rows_kernel(q_ref, q8_ref, s_ref, *, l, r, split):
    """Rows [rows, L+R] -> `quantize_q_fp8`'s e4m3 rows (split: [rows, 2 (L+R)]) and power-of-two scales, the row's
    amax over the L and the R columns (Triton's blocks are powers of two)."""
    cols = ((0, l), (l, r))
    xs = [q_ref[:, pl.ds(*c)].astype(jnp.float32) for c in cols]  # [rows, L], [rows, R]
    sc, inv = _row_scale(jnp.maximum(jnp.max(jnp.abs(xs[0]), axis=1), jnp.max(jnp.abs(xs[1]), axis=1)))  # [rows]
    for x, (c0, w) in zip(xs, cols):
        x = x * inv[:, None]
        hi = round_e4m3(x)
        q8_ref[:, pl.ds(c0, w)] = hi.astype(FP8)
        if split:
            q8_ref[:, pl.ds(l + r + c0, w)] = round_e4m3(x - hi).astype(FP8)
    s_ref[...] = sc


def quantize_q_fp8_rows(q, l: int, *, split: bool = False, interpret: bool = False):
    """`quantize_q_fp8(q, split=split)` of q [B, M, L+R] as one Triton-lowered kernel (bitwise the same;
    `interpret`: the Pallas interpreter), for the 64-row kernel's `fp8_qk`, whose q is quantized before its call:
    XLA ran it as three kernels (1x128x32768: ~4 us of a 39.7 us call, 64x128x4096: ~13 us of 186 on an H100,
    session 30; quantizing in that kernel lost, one pass and two). L or R not powers of two run the jnp function.
    Programs of up to 8 rows, ~2048 of them (`_QUANT_PROGRAMS`) where the rows allow."""
    b, m, d = q.shape
    r = d - l
    if not (is_pow2(l) and is_pow2(r)):
        return quantize_q_fp8(q, split=split)
    d8 = 2 * d if split else d
    rows = 1
    while rows < 8 and m % (2 * rows) == 0 and b * m // (2 * rows) >= _QUANT_PROGRAMS:
        rows *= 2
    return pl.pallas_call(
        functools.partial(_quantize_rows_kernel, l=l, r=r, split=split),
        grid=(b, m // rows),
        in_specs=[pl.BlockSpec((None, rows, d), lambda i, j: (i, j, 0))],
        out_specs=[
            pl.BlockSpec((None, rows, d8), lambda i, j: (i, j, 0)),
            pl.BlockSpec((None, rows), lambda i, j: (i, j)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, m, d8), FP8), jax.ShapeDtypeStruct((b, m), jnp.float32)],
        interpret=bool(interpret),
        compiler_params=pltriton.CompilerParams(num_warps=4 if rows > 1 or b * m <= 4 * H200_SMS else 1, num_stages=1),
        name=f"quantize_q_fp8_r{rows}" + ("_split" if split else ""),
    )(q)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    rows: int  # the wgmma N: M rounded up to a power of two >= 8
    nq: int  # query tokens per request (row r belongs to token r // heads)
    heads: int
    l: int
    d: int
    stages: int  # page ring depth (bf16 cache), or V ring depth (fp8)
    splits: int  # pieces per request (static): piece p = (request p // splits, split p % splits)
    pps: int  # pages per split
    sm_scale: float
    interpret: bool
    fp8: bool = False
    fp8_stages: int = 2  # fp8 page ring depth
    qk8: bool = False  # fp8_qk (lossy): q as one e4m3 term, no lo product
    worklist: bool = False  # pieces from a metadata array instead (`mla_decode_sm90.worklist_pieces`)


def _smem(cfg):
    """Aliased groups: the loop's buffers | final output staging | partial staging."""
    f32 = jnp.float32
    if cfg.fp8:
        loop = [
            plgpu.SMEM(((1 if cfg.qk8 else 2) * cfg.rows, cfg.d), FP8, transforms=tiled(FP8, 64)),  # Q: hi, lo rows
            plgpu.SMEM((cfg.fp8_stages, PAGE_SIZE, cfg.d), FP8, transforms=tiled(FP8, 64)),  # fp8 pages
            plgpu.SMEM((cfg.stages, PAGE_SIZE, cfg.l), BF16, transforms=tiled(BF16)),  # V, cast
            plgpu.SMEM((2, cfg.rows, PAGE_SIZE), BF16, transforms=tiled(BF16)),  # P: page i's, page i - 1's
            plgpu.SMEM((cfg.fp8_stages, PAGE_SIZE), f32),  # the pages' token scales
            plgpu.SMEM((cfg.rows,), f32),  # Q's row scales (hi; lo = hi / 16)
        ]
    else:
        loop = [
            plgpu.SMEM((cfg.rows, cfg.d), BF16, transforms=tiled(BF16)),  # Q
            plgpu.SMEM((cfg.stages, PAGE_SIZE, cfg.d), BF16, transforms=tiled(BF16)),  # pages
            plgpu.SMEM((cfg.rows, PAGE_SIZE), BF16, transforms=tiled(BF16)),  # P (B = P^T, K-major)
        ]
    final = [plgpu.SMEM((cfg.rows, cfg.l), BF16, transforms=tiled(BF16)), plgpu.SMEM((cfg.rows,), f32)]
    part = [plgpu.SMEM((cfg.l, cfg.rows), _PARTIAL_DTYPE), plgpu.SMEM((cfg.rows,), f32)]
    groups = [loop, final, part]
    return groups, max(map(smem_bytes, groups))


def _barriers(cfg):
    if not cfg.fp8:
        return dict(
            q_bar=plgpu.Barrier(),  # Q landed
            kv_ready=plgpu.Barrier(num_barriers=cfg.stages),  # page landed (TMA, or producer after zeroing)
            kv_consumed=plgpu.Barrier(num_barriers=cfg.stages),  # consumer done with the slot
            raw_bar=plgpu.Barrier(),  # a partial last page's TMA, before its zeroing
        )
    return dict(
        f_ready=plgpu.Barrier(num_arrivals=2, num_barriers=cfg.fp8_stages),  # fp8 page and its scales
        # QK^T and the scales read (consumer), both halves of V cast (producer, caster)
        f_free=plgpu.Barrier(num_arrivals=3, num_barriers=cfg.fp8_stages),
        v_ready=plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),  # both halves of V cast
        v_free=plgpu.Barrier(num_barriers=cfg.stages),  # consumer's P.V done
    )


def _kernel(*refs, cfg):
    """Grid schedule: piece p is request b = p // splits, pages [s * pps, s * pps + n) of its block table,
    s = p % splits, everything derived here from seq_lens and page_offset (no metadata step before the
    launch: at one decode call per layer, each small XLA op before it is a kernel per layer). Work list:
    piece p's request, first page, page count and partial slot are row p of `meta` (`worklist_pieces`);
    slot -1 writes the final output, slot >= 0 a partial, slot -2 (past the last piece) nothing."""
    if cfg.fp8:
        q_gmem, kv_gmem, ks_gmem, bt_gmem, sl_gmem, off_gmem, *outs = refs
    else:
        q_gmem, kv_gmem, bt_gmem, sl_gmem, off_gmem, *outs = refs
        ks_gmem = None
    meta_gmem = outs.pop(0) if cfg.worklist else None
    out_gmem, lse_gmem, opart_gmem, lsepart_gmem = outs
    groups, _ = _smem(cfg)
    g, l = PAGE_SIZE, cfg.l
    capacity = bt_gmem.shape[1] * g

    def scoped(union, **bars):
        loop, (fin_o, fin_lse), (part_o, part_lse) = union
        if PDL and not cfg.interpret:  # launched early (PDL); every read waits for the previous kernel's writes
            plgpu.griddepcontrol_wait()
        piece = lax.axis_index("piece")
        if cfg.worklist:
            b, first, n, slot = (meta_gmem[piece, col] for col in (0, 2, 3, 4))
        else:
            b = lax.div(piece, jnp.int32(cfg.splits))
            first = lax.rem(piece, jnp.int32(cfg.splits)) * cfg.pps
            slot = piece
        sl = [jnp.minimum(sl_gmem[b, t], capacity) for t in range(cfg.nq)]  # each query token's length
        tile_len = functools.reduce(jnp.maximum, sl)
        if not cfg.worklist:
            n = jnp.clip(lax.div(tile_len + g - 1, g) - first, 0, cfg.pps)
        last_rows = jnp.minimum(tile_len - (first + n - 1) * g, g)

        def page_rows(i):  # rows of page i inside the length (< G only on the request's partial last page)
            return jnp.where(i == n - 1, last_rows, g)

        def page_id(i):
            return bt_gmem[b, first + i] + off_gmem[0]

        def epilogue(o, m_i, l_acc):
            l_i = l_acc.sum(axis=0)  # [M]
            has = l_i > 0
            safe_l = jnp.where(has, l_i, 1.0)
            inv = jnp.where(has, 1.0 / safe_l, 0.0)
            lse = jnp.where(has, (m_i + jnp.log2(safe_l)) * LN2, -jnp.inf)
            # The staging aliases the rings: every TMA into them has landed and every wgmma is done.
            o = o * lax.broadcast_in_dim(inv, o.shape, [1])

            def final():
                fin_o.T[...] = o.astype(BF16)
                fin_lse[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(fin_o, out_gmem.at[b])
                plgpu.copy_smem_to_gmem(fin_lse, lse_gmem.at[b])

            def partial():
                @pl.when(n > 0)  # an empty split writes its lse (-inf) only; the merge never reads its output
                def _():
                    part_o[...] = o.astype(part_o.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(part_o, opart_gmem.at[slot])

                part_lse[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(part_lse, lsepart_gmem.at[slot])

            if cfg.worklist:
                pl.when(slot == -1)(final)
                pl.when(slot >= 0)(partial)
            elif cfg.splits == 1:
                final()
            else:
                partial()
            plgpu.wait_smem_to_gmem(0)

        def online_softmax(s, lens, i, m_i, l_acc, p_ref, p_scale):
            """One page: s [G, M] f32 logits (log2 units, unmasked) -> (m, l_acc, alpha), P (the page's
            probabilities, times p_scale [G] (fp8: the tokens' scales) unless None) written to p_ref [M, G];
            the caller rescales O^T by alpha."""
            tok = (first + i) * g + plgpu.broadcasted_iota(jnp.int32, (g, cfg.rows), 0, layout=plgpu.Layout.WGMMA)
            s = jnp.where(tok < lax.broadcast_in_dim(lens, s.shape, [1]), s, -jnp.inf)
            m_new = jnp.maximum(m_i, s.max(axis=0))  # [M]: across the 4 warps
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
            l_acc = l_acc * lax.broadcast_in_dim(alpha, s.shape, [1]) + p
            if p_scale is not None:  # V = fp8 row * scale: the scale goes into p
                p = p * lax.broadcast_in_dim(p_scale, p.shape, [0])
            p_ref.T[...] = p.astype(p_ref.dtype)
            plgpu.commit_smem()
            return m_new, l_acc, alpha

        def rescale(o, alpha):
            return o * lax.broadcast_in_dim(alpha, o.shape, [1])

        def init():
            f32 = jnp.float32
            return (
                plgpu.layout_cast(jnp.zeros((l, cfg.rows), f32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((cfg.rows,), M_INIT, f32), _COL),
                plgpu.layout_cast(jnp.zeros((g, cfg.rows), f32), plgpu.Layout.WGMMA),
            )

        def row_lens():
            # Row r is query token r // heads's: its length; padding rows 0.
            r = plgpu.broadcasted_iota(jnp.int32, (cfg.rows,), 0, layout=_COL)
            lens = jnp.zeros((cfg.rows,), jnp.int32)
            for t in range(cfg.nq):
                lens = jnp.where((r >= t * cfg.heads) & (r < (t + 1) * cfg.heads), sl[t], lens)
            return lens

        wg = lax.axis_index("wg")
        c = cfg.sm_scale * LOG2E
        if cfg.fp8:
            _fp8_body(
                cfg,
                loop,
                bars,
                wg,
                b,
                n,
                page_rows,
                page_id,
                c,
                row_lens,
                init,
                online_softmax,
                rescale,
                epilogue,
                q_gmem,
                kv_gmem,
                ks_gmem,
            )
            return
        q_smem, ring, p_smem = loop
        m_q = q_gmem.shape[-2]  # real rows (a multiple of 8); the rest of the tile has length 0
        stages = cfg.stages

        @pl.when(wg == 0)
        def _consumer():
            @pl.when(n > 0)
            def _():
                plgpu.copy_gmem_to_smem(q_gmem.at[b], q_smem.at[pl.ds(0, m_q)], bars["q_bar"])
                plgpu.barrier_wait(bars["q_bar"])

            lens = row_lens()

            def step(i, carry):
                si = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(bars["kv_ready"].at[si])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, ring.at[si], q_smem.T)
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((g, cfg.rows), jnp.float32)) * c  # [G, M]
                o, m_i, l_acc = carry
                m_new, l_acc, alpha = online_softmax(s, lens, i, m_i, l_acc, p_smem, None)
                v_t = ring.at[si, :, pl.ds(0, l)].T
                o = wgmma_accumulate(rescale(o, alpha), v_t, p_smem.T, interpret=cfg.interpret)
                plgpu.barrier_arrive(bars["kv_consumed"].at[si])
                return o, m_new, l_acc

            epilogue(*lax.fori_loop(0, n, step, init()))

        @pl.when(wg == 1)
        def _producer():
            def step(i, _):
                si = lax.rem(i, jnp.int32(stages))

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(bars["kv_consumed"].at[si])

                copy_zeroing_rows(
                    kv_gmem.at[page_id(i)],
                    ring.at[si],
                    bars["kv_ready"].at[si],
                    bars["raw_bar"],
                    partial=(i == n - 1) & (last_rows < g),
                    lo=0,
                    hi=last_rows,
                )
                return ()

            lax.fori_loop(0, n, step, ())
            _drain(bars["kv_consumed"], n, stages)

    pl.run_scoped(scoped, plgpu.RefUnion(*(tuple(gr) for gr in groups)), collective_axes="wg", **_barriers(cfg))


def _drain(bar, n, depth):
    """Wait for the last `depth` phases of a per-slot barrier: each waiter observes every phase."""

    def body(i, _):
        plgpu.barrier_wait(bar.at[lax.rem(i, jnp.int32(depth))])
        return ()

    lax.fori_loop(jnp.maximum(n - depth, 0), n, body, ())


def _fp8_body(
    cfg,
    loop,
    bars,
    wg,
    b,
    n,
    page_rows,
    page_id,
    c,
    row_lens,
    init,
    online_softmax,
    rescale,
    epilogue,
    q_gmem,
    kv_gmem,
    ks_gmem,
):
    """fp8 cache, 3 warpgroups: 0 consumer (fp8 QK^T on the fp8 slot, softmax, bf16 P.V on the cast V),
    1 producer (TMA of pages and scales, then casts V's second half), 2 caster (V's first half)."""
    q8, f_ring, v_ring, p_smem, ks_ring, q_scales = loop
    g, l, d = PAGE_SIZE, cfg.l, cfg.d
    fst, vst = cfg.fp8_stages, cfg.stages
    half = l // 2

    def cast(i, chunks):
        """V columns of page i's fp8 slot -> bf16 in its V slot, exact; rows past the length zeroed (p = 0
        there, but 0 * NaN garbage would poison P.V)."""
        fs, vs = lax.rem(i, jnp.int32(fst)), lax.rem(i, jnp.int32(vst))
        plgpu.barrier_wait(bars["f_ready"].at[fs])

        @pl.when(i >= vst)
        def _():
            plgpu.barrier_wait(bars["v_free"].at[vs])

        cast_fp8_columns(f_ring.at[fs], v_ring.at[vs], page_rows(i), chunks)
        plgpu.commit_smem()  # generic-proxy writes before the wgmma reads; reads before the next TMA
        plgpu.barrier_arrive(bars["v_ready"].at[vs])
        plgpu.barrier_arrive(bars["f_free"].at[fs])

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(_FP8_REGS[0], action="increase")

        @pl.when(n > 0)
        def _():
            split_q_into_smem(q_gmem.at[b], q8, q_scales, lo=not cfg.qk8)

        lens = row_lens()
        s_hi = plgpu.load(q_scales, (), layout=_COL) * c
        chunks = [(k, min(_QK_CHUNK, d - k)) for k in range(0, d, _QK_CHUNK)]

        n_acc = len(chunks)
        n_col = q8.shape[0]  # the QK^T wgmma's N: q_hi's rows, then q_lo's (one instruction does both products)

        def issue_qk(page, accs):
            # float32 partial sums of _QK_CHUNK columns (the fp8 wgmma accumulates at reduced precision)
            for (k0, w), acc in zip(chunks, accs):
                plgpu.wgmma(acc, page.at[:, pl.ds(k0, w)], q8.at[:, pl.ds(k0, w)].T)

        def logits(i, fs, accs):
            """The QK^T partial sums -> page i's logits [G, M] (log2 units, times the tokens' scales) and the
            scales [G] (0 past the length); frees the fp8 slot's QK^T and scale reads."""
            acc = functools.reduce(jnp.add, accs)  # [G, n_col]
            hi = acc[:, : cfg.rows]
            s = hi * lax.broadcast_in_dim(s_hi, hi.shape, [1])
            if not cfg.qk8:
                s = s + acc[:, cfg.rows :] * lax.broadcast_in_dim(s_hi * (1 / 16), hi.shape, [1])  # q_lo's scale
            tok = plgpu.broadcasted_iota(jnp.int32, (g,), 0, layout=_TOK)
            ks = jnp.where(tok < page_rows(i), plgpu.load(ks_ring.at[fs], (), layout=_TOK), 0.0)  # [G]
            plgpu.commit_smem()  # the scales' generic-proxy read before the next TMA into the slot
            plgpu.barrier_arrive(bars["f_free"].at[fs])
            return s * lax.broadcast_in_dim(ks, s.shape, [0]), ks

        def pv(o, j):
            """O^T += V^T P^T of page j (its V slot and P buffer)."""
            vs, pj = lax.rem(j, jnp.int32(vst)), lax.rem(j, jnp.int32(2))
            plgpu.barrier_wait(bars["v_ready"].at[vs])
            o = wgmma_accumulate(o, v_ring.at[vs].T, p_smem.at[pj].T, interpret=cfg.interpret)
            plgpu.barrier_arrive(bars["v_free"].at[vs])
            return o

        def step(i, carry, first=False):
            """Page i: QK^T and the softmax, then P.V of page i - 1: a page's V cast has the next page's QK^T
            and softmax to land in. (P.V in flight during QK^T and the softmax, the FA3 order, measured slower:
            307 against 297 us at 128x16x8192, session 17.) The first page has no P.V before it."""
            o, m_i, l_acc = carry
            fs = lax.rem(i, jnp.int32(fst))
            plgpu.barrier_wait(bars["f_ready"].at[fs])

            def qk(*accs):
                issue_qk(f_ring.at[fs], accs)
                return [acc[...] for acc in accs]

            s, ks = logits(i, fs, pl.run_scoped(qk, *[plgpu.ACC((g, n_col), jnp.float32) for _ in range(n_acc)]))
            m_new, l_new, alpha = online_softmax(s, lens, i, m_i, l_acc, p_smem.at[lax.rem(i, jnp.int32(2))], ks)
            if not first:
                o = pv(o, i - 1)
            return rescale(o, alpha), m_new, l_new

        carry = lax.cond(n > 0, lambda c: step(jnp.int32(0), c, first=True), lambda c: c, init())
        o, m_i, l_acc = lax.fori_loop(1, jnp.maximum(n, 1), step, carry)
        epilogue(lax.cond(n > 0, lambda o: pv(o, n - 1), lambda o: o, o), m_i, l_acc)

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(_FP8_REGS[1], action="decrease")

        def fetch(i):
            fs = lax.rem(i, jnp.int32(fst))
            plgpu.copy_gmem_to_smem(kv_gmem.at[page_id(i)], f_ring.at[fs], bars["f_ready"].at[fs])
            plgpu.copy_gmem_to_smem(ks_gmem.at[page_id(i)], ks_ring.at[fs], bars["f_ready"].at[fs])

        for j in range(fst):
            pl.when(j < n)(functools.partial(fetch, jnp.int32(j)))

        def step(i, _):
            cast(i, range(half // 64, l // 64))
            fs = lax.rem(i, jnp.int32(fst))
            plgpu.barrier_wait(bars["f_free"].at[fs])  # QK^T, the scales and both casts are done with it
            pl.when(i + fst < n)(lambda: fetch(i + fst))
            return ()

        lax.fori_loop(0, n, step, ())
        _drain(bars["v_free"], n, vst)

    @pl.when(wg == 2)
    def _caster():
        plgpu.set_max_registers(_FP8_REGS[2], action="decrease")

        def step(i, _):
            cast(i, range(half // 64))
            return ()

        lax.fori_loop(0, n, step, ())
        _drain(bars["v_free"], n, vst)


def narrow_decode(
    q,
    cache,
    block_table,
    seq_lens,
    page_offset,
    *,
    scale,
    l,
    splits,
    stages,
    interpret,
    kv_scale=None,
    fp8_qk=False,
    meta=None,
    num_slots=0,
):
    """The kernel over B * splits pieces (request b's pages cut into `splits` equal static ranges), or with
    `meta` (i32 [J, 6] from `mla_decode_sm90.worklist_pieces`, one head tile a request) over its J pieces.

    q [B, Q, N, L+R] (rows Q*N within `narrow_rows`), cache bf16 [pages, 64, L+R] or e4m3 with kv_scale f32
    [pages, 64], block_table i32 [B, max_pages], seq_lens i32 [B, Q], page_offset i32 [1]. Returns, with
    R' = `narrow_rows(Q*N)`: splits == 1: (out bf16 [B, R', L], lse f32 [B, R']); else the partials
    (o_part bf16 [B * splits, L, R'] (transposed), lse_part f32 [B * splits, R']); with `meta` all four, the
    partials by slot ([num_slots, L, R'], [num_slots, R']) and the final rows of the requests not split (the
    split ones' rows are left for the merge). fp8_qk (fp8 cache): q as one e4m3 term (`quantize_q_fp8`,
    lossy), one fp8 product for QK^T."""
    b, nq, n, d = q.shape
    m_rows = nq * n
    fp8 = jnp.dtype(cache.dtype) == FP8
    rows = narrow_rows(m_rows, fp8)
    # rows TMA'd: whole 8-row tiles of the shared-memory layout; fp8: all `rows` (the split's windows read them)
    m_q = rows if fp8 else -(-m_rows // 8) * 8
    q_rows = q.reshape(b, m_rows, d).astype(BF16)
    if m_q != m_rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, m_q - m_rows), (0, 0)))
    q_args, cache_args = (q_rows,), ((cache, kv_scale) if fp8 else (cache,))
    max_pages = block_table.shape[1]
    pps = -(-max_pages // splits)
    splits = -(-max_pages // pps)
    cfg = _Cfg(
        rows=rows,
        nq=nq,
        heads=n,
        l=l,
        d=d,
        stages=stages,
        splits=splits,
        pps=pps,
        sm_scale=float(scale),
        interpret=bool(interpret),
        fp8=fp8,
        qk8=bool(fp8 and fp8_qk),
        worklist=meta is not None,
    )
    f32 = jnp.float32
    # Final rows (a placeholder row where every request is split), partials by piece or slot (one placeholder
    # where none is split).
    n_final = b if meta is not None or splits == 1 else 1
    n_part = num_slots if meta is not None else (1 if splits == 1 else b * splits)
    out_type = (
        jax.ShapeDtypeStruct((n_final, rows, l), BF16),
        jax.ShapeDtypeStruct((n_final, rows), f32),
        jax.ShapeDtypeStruct((n_part, l, rows), _PARTIAL_DTYPE),
        jax.ShapeDtypeStruct((n_part, rows), f32),
    )
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=out_type,
        grid=(b * splits if meta is None else meta.shape[0],),
        grid_names=("piece",),
        num_threads=3 if fp8 else 2,
        thread_name="wg",
        # The column max and sum reduce across the warpgroup's 4 warps (only the consumer reduces: the
        # reduction scratch is not shared).
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=2048),
        interpret=interpret_params(interpret),
        kernel_name=f"mla_decode_sm90_narrow_{'fp8qk' if cfg.qk8 else 'fp8' if fp8 else 'bf16'}_m{rows}_"
        + ("worklist" if meta is not None else f"s{splits}")
        + f"_stages{stages}",
    )
    meta_args = () if meta is None else (meta,)
    out, lse, o_part, lse_part = kernel(
        *q_args, *cache_args, block_table, seq_lens.astype(jnp.int32), page_offset, *meta_args
    )
    if meta is not None:
        return out, lse, o_part, lse_part
    return (out, lse) if splits == 1 else (o_part, lse_part)


def smem_plan_bytes(rows: int, l: int, d: int, stages: int, fp8: bool = False) -> int:
    """Shared memory a CTA of this kernel takes (the caller checks it against the budget)."""
    cfg = _Cfg(
        rows=rows, nq=1, heads=rows, l=l, d=d, stages=stages, splits=1, pps=1, sm_scale=1.0, interpret=False, fp8=fp8
    )
    return _smem(cfg)[1]
