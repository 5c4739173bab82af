"""Hopper paged latent-MQA decode for few query rows (M = Q*N <= 32): tokens on the wgmma M axis.

`mla_decode_sm90` runs this kernel when a request has at most `NARROW_MAX_ROWS` query rows (N=16
heads: DeepSeek-V3 under TP 8, V2-Lite; N=16 with one speculative token), the rest as 64-row tiles
(`mla_decode_sm90._kernel`). Its float32 reference is `mla_decode_reference`.

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
keeps the next page in flight (one TMA per page, the `stages`-deep ring of mla_decode_sm90, zeroing
the rows past the length on a partial last page). Per 64-token page the consumer's wgmmas take
~0.7 us at N=16 while a bf16 page (72 KB) takes ~2.2 us to arrive at the SM's share of HBM
bandwidth: the kernel is bound by the cache bytes, as decode at few rows should be.

Outputs: the final output [rows, L] through a transposed store of O^T into a [rows, L] staging tile
(the bf16 tile takes a transposed register store; an f32 one does not lower), then TMA; split
partials stay transposed, [L, rows] f32 per slot, merged by `mla_decode.merge_splits(...,
transposed=True)`.

bf16 caches only (fp8 caches take the 64-row kernel). Pieces, metadata and splits are those of
`mla_decode_sm90` (its `_grid_pieces`, passed in as `meta`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu import copy_zeroing_rows, interpret_params, smem_bytes, tiled, wgmma_accumulate
from pallas_kernels.util import BF16, LN2, LOG2E, M_INIT, next_pow2

__all__ = ["NARROW_MAX_ROWS", "narrow_rows", "narrow_decode"]

NARROW_MAX_ROWS = 32  # O^T [512, M] f32 is 4M registers a thread: 128 at M = 32
PAGE_SIZE = 64
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a [G, M] / [L, M] accumulator (a query row)
_TOK = plgpu.Layout.WGMMA.reduce(1)  # one value per row (a token of the page)


def narrow_rows(m_rows: int) -> int | None:
    """The wgmma N this kernel uses for `m_rows` query rows (the next power of two >= 8: the split
    merge's Triton tiles are powers of two), or None past its limit."""
    rows = max(8, next_pow2(m_rows))
    return rows if 0 < m_rows and rows <= NARROW_MAX_ROWS else None


@dataclasses.dataclass(frozen=True)
class _Cfg:
    rows: int  # the wgmma N: M rounded up to a power of two >= 8
    nq: int  # query tokens per request (row r belongs to token r // heads)
    heads: int
    l: int
    d: int
    stages: int
    splits: int  # pieces per request (static): piece p = (request p // splits, split p % splits)
    pps: int  # pages per split
    sm_scale: float
    interpret: bool


def _smem(cfg):
    """Aliased groups: the loop's buffers | final output staging | f32 partial staging."""
    f32 = jnp.float32
    loop = [
        plgpu.SMEM((cfg.rows, cfg.d), BF16, transforms=tiled(BF16)),  # Q
        plgpu.SMEM((cfg.stages, PAGE_SIZE, cfg.d), BF16, transforms=tiled(BF16)),  # ring
        plgpu.SMEM((cfg.rows, PAGE_SIZE), BF16, transforms=tiled(BF16)),  # P (B = P^T, K-major)
    ]
    final = [plgpu.SMEM((cfg.rows, cfg.l), BF16, transforms=tiled(BF16)), plgpu.SMEM((cfg.rows,), f32)]
    part = [plgpu.SMEM((cfg.l, cfg.rows), f32), plgpu.SMEM((cfg.rows,), f32)]
    groups = [loop, final, part]
    return groups, max(map(smem_bytes, groups))


def _kernel(q_gmem, kv_gmem, bt_gmem, sl_gmem, off_gmem, out_gmem, lse_gmem, opart_gmem, lsepart_gmem, *, cfg):
    """Piece p: request b = p // splits, pages [s * pps, s * pps + n) of its block table, s = p % splits.
    Everything the piece needs is derived here from seq_lens and page_offset (no metadata step before the
    launch: at one decode call per layer, each small XLA op before it is a kernel per layer)."""
    groups, _ = _smem(cfg)
    g, l, stages = PAGE_SIZE, cfg.l, cfg.stages
    capacity = bt_gmem.shape[1] * g

    def scoped(union, q_bar, kv_ready, kv_consumed, raw_bar):
        (q_smem, ring, p_smem), (fin_o, fin_lse), (part_o, part_lse) = union
        piece = lax.axis_index("piece")
        b = lax.div(piece, jnp.int32(cfg.splits))
        first = lax.rem(piece, jnp.int32(cfg.splits)) * cfg.pps
        sl = [jnp.minimum(sl_gmem[b, t], capacity) for t in range(cfg.nq)]  # each query token's length
        tile_len = functools.reduce(jnp.maximum, sl)
        n = jnp.clip(lax.div(tile_len + g - 1, g) - first, 0, cfg.pps)
        last_rows = jnp.minimum(tile_len - (first + n - 1) * g, g)
        wg = lax.axis_index("wg")

        @pl.when(wg == 0)
        def _consumer():
            m_q = q_gmem.shape[1]  # real rows (multiple of 8); the rest of the tile has length 0

            @pl.when(n > 0)
            def _():
                plgpu.copy_gmem_to_smem(q_gmem.at[b], q_smem.at[pl.ds(0, m_q)], q_bar)
                plgpu.barrier_wait(q_bar)

            # Row r is query token r // heads's: its length; padding rows 0.
            r = plgpu.broadcasted_iota(jnp.int32, (cfg.rows,), 0, layout=_COL)
            lens = jnp.zeros((cfg.rows,), jnp.int32)
            for t in range(cfg.nq):
                lens = jnp.where((r >= t * cfg.heads) & (r < (t + 1) * cfg.heads), sl[t], lens)
            c = cfg.sm_scale * LOG2E

            def step(i, carry):
                o, m_i, l_acc = carry
                si = lax.rem(i, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[si])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, ring.at[si], q_smem.T)
                    return acc_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((g, cfg.rows), jnp.float32))  # [G, M]
                tok = (first + i) * g + plgpu.broadcasted_iota(jnp.int32, (g, cfg.rows), 0, layout=plgpu.Layout.WGMMA)
                s = jnp.where(tok < lax.broadcast_in_dim(lens, s.shape, [1]), s * c, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=0))  # [M]: across the 4 warps
                alpha = jnp.exp2(m_i - m_new)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [1]))
                l_acc = l_acc * lax.broadcast_in_dim(alpha, s.shape, [1]) + p
                p_smem.T[...] = p.astype(BF16)
                plgpu.commit_smem()
                o = o * lax.broadcast_in_dim(alpha, o.shape, [1])
                o = wgmma_accumulate(o, ring.at[si, :, pl.ds(0, l)].T, p_smem.T, interpret=cfg.interpret)
                plgpu.barrier_arrive(kv_consumed.at[si])
                return o, m_new, l_acc

            f32 = jnp.float32
            init = (
                plgpu.layout_cast(jnp.zeros((l, cfg.rows), f32), plgpu.Layout.WGMMA),
                plgpu.layout_cast(jnp.full((cfg.rows,), M_INIT, f32), _COL),
                plgpu.layout_cast(jnp.zeros((g, cfg.rows), f32), plgpu.Layout.WGMMA),
            )
            o, m_i, l_acc = lax.fori_loop(0, n, step, init)
            l_i = l_acc.sum(axis=0)  # [M]
            has = l_i > 0
            safe_l = jnp.where(has, l_i, 1.0)
            inv = jnp.where(has, 1.0 / safe_l, 0.0)
            lse = jnp.where(has, (m_i + jnp.log2(safe_l)) * LN2, -jnp.inf)
            # The staging aliases the ring: every TMA into it has landed (waited on above) and the
            # loop's wgmmas are done.
            o = o * lax.broadcast_in_dim(inv, o.shape, [1])

            if cfg.splits == 1:
                fin_o.T[...] = o.astype(BF16)
                fin_lse[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(fin_o, out_gmem.at[b])
                plgpu.copy_smem_to_gmem(fin_lse, lse_gmem.at[b])
            else:

                @pl.when(n > 0)  # an empty split writes its lse (-inf) only; the merge never reads its output
                def _():
                    part_o[...] = o
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(part_o, opart_gmem.at[piece])

                part_lse[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(part_lse, lsepart_gmem.at[piece])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 1)
        def _producer():
            page_offset = off_gmem[0]

            def step(i, _):
                si = lax.rem(i, jnp.int32(stages))

                @pl.when(i >= stages)
                def _():
                    plgpu.barrier_wait(kv_consumed.at[si])

                copy_zeroing_rows(
                    kv_gmem.at[bt_gmem[b, first + i] + page_offset],
                    ring.at[si],
                    kv_ready.at[si],
                    raw_bar,
                    partial=(i == n - 1) & (last_rows < g),
                    lo=0,
                    hi=last_rows,
                )
                return ()

            lax.fori_loop(0, n, step, ())

            def drain(i, _):  # each waiter observes every phase of kv_consumed
                plgpu.barrier_wait(kv_consumed.at[lax.rem(i, jnp.int32(stages))])
                return ()

            lax.fori_loop(jnp.maximum(n - stages, 0), n, drain, ())

    pl.run_scoped(
        scoped,
        plgpu.RefUnion(*(tuple(gr) for gr in groups)),
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(num_barriers=cfg.stages),
        plgpu.Barrier(),
        collective_axes="wg",
    )


def narrow_decode(q, cache, block_table, seq_lens, page_offset, *, scale, l, splits, stages, interpret):
    """The kernel over B * splits pieces (request b's pages cut into `splits` equal static ranges).

    q [B, Q, N, L+R] (rows Q*N <= NARROW_MAX_ROWS), cache bf16 [pages, 64, L+R], block_table i32
    [B, max_pages], seq_lens i32 [B, Q], page_offset i32 [1]. Returns, with R' = `narrow_rows(Q*N)`:
    splits == 1: (out bf16 [B, R', L], lse f32 [B, R']); else the partials (o_part f32 [B * splits, L, R']
    (transposed), lse_part f32 [B * splits, R'])."""
    b, nq, n, d = q.shape
    m_rows = nq * n
    rows = narrow_rows(m_rows)
    m_q = -(-m_rows // 8) * 8  # rows TMA'd: whole 8-row tiles of the shared-memory layout
    q_rows = q.reshape(b, m_rows, d).astype(BF16)
    if m_q != m_rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, m_q - m_rows), (0, 0)))
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
    )
    f32 = jnp.float32
    if splits == 1:
        out_type = (jax.ShapeDtypeStruct((b, rows, l), BF16), jax.ShapeDtypeStruct((b, rows), f32))
        unused = (jax.ShapeDtypeStruct((1, l, rows), f32), jax.ShapeDtypeStruct((1, rows), f32))
    else:
        out_type = (jax.ShapeDtypeStruct((1, rows, l), BF16), jax.ShapeDtypeStruct((1, rows), f32))
        unused = (jax.ShapeDtypeStruct((b * splits, l, rows), f32), jax.ShapeDtypeStruct((b * splits, rows), f32))
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=out_type + unused,
        grid=(b * splits,),
        grid_names=("piece",),
        num_threads=2,
        thread_name="wg",
        # The column max and sum reduce across the warpgroup's 4 warps (one consumer warpgroup: the
        # reduction scratch is not shared).
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=2048),
        interpret=interpret_params(interpret),
        kernel_name=f"mla_decode_sm90_narrow_m{rows}_s{splits}_stages{stages}",
    )
    out, lse, o_part, lse_part = kernel(q_rows, cache, block_table, seq_lens.astype(jnp.int32), page_offset)
    return (out, lse) if splits == 1 else (o_part, lse_part)


def smem_plan_bytes(rows: int, l: int, d: int, stages: int) -> int:
    """Shared memory a CTA of this kernel takes (the caller checks it against the budget)."""
    cfg = _Cfg(rows=rows, nq=1, heads=rows, l=l, d=d, stages=stages, splits=1, pps=1, sm_scale=1.0, interpret=False)
    return _smem(cfg)[1]
