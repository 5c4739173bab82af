"""Token-sparse latent MQA decode on Hopper (sm_90): a Mosaic GPU kernel (per-row TMA gather + wgmma).

Same API and outputs as `pallas_kernels.sparse_mla_decode.sparse_mla_decode` (the Triton-lowered, portable
kernel); its float32 reference `sparse_mla_decode_reference` is this kernel's reference too.

    sparse_mla_decode_sm90(q [B, Q, N, L+R], kv_cache [pages, G, L+R], topk_slots i32[B, Q, K], *, scale,
                           kv_scale=None, kv_lora_rank) -> (out [B, Q, N, L], lse f32[B, Q, N])

Shape legend: B rows, Q query tokens per row, N heads, L kv_lora_rank (512), R rope (64), K table width,
T head tiles of 64 (the wgmma M dimension), S splits of the table, rows = B * Q query rows (each has its own
table, so unlike the dense decode the Q tokens of a request are not folded into one tile).

Work decomposition: one CTA per (query row, split s, head tile h), h fastest (the CTAs that gather the same
rows run together and share them in L2). A CTA owns 64 heads (the real ones: N = 16 moves 16 rows of q and of
the outputs) and the table entries [s * K/S, (s + 1) * K/S) up to the row's last named slot, 64 at a time
(one KV tile). S == 1 writes the final output; S > 1 writes f32 partials merged by `mla_decode.merge_splits`
(`choose_num_kv_splits_sm90` picks S with table tiles in place of pages).

The gather. Hopper's TMA has no row gather (Blackwell's gather4), and a wgmma operand tile cannot take one
row at a time (its 8-row swizzle atoms), so the producer warpgroup gathers in two steps:
- it issues, per entry of a 64-entry tile, one TMA (no zero fill: the slot is checked first) of the named
  cache row into row j of a staging tile [64, L+R]; an unnamed entry (-1, or a slot outside the pool under jit)
  copies nothing and arrives instead, so the tile's barrier always counts 64 arrivals and the bytes of every
  named row. Each staging row is its own tile of 64-column chunks, unswizzled, its pitch a multiple of 128
  bytes (bf16 1152; fp8 576 padded to 640) so that every copy starts 128-byte aligned. Not swizzled because
  the TMA swizzles by the absolute shared-memory address while Mosaic's loads swizzle by the offset from the
  sliced ref: a 64-column chunk of a row starts at c * 128 bytes, inside a 1 KB swizzle period, so the two
  disagree for every chunk but those at 1 KB multiples (the first GPU run of the swizzled staging failed
  every case). The bf16 relayout reads whole 128-byte lines (conflict-free); the fp8 one reads in the
  wgmma layout, with bank conflicts (`optimized=False`);
- then it re-lays the staging tile into the swizzled wgmma tile (the fp8 cache: cast to bf16 on the way,
  exact), zeroing the rows of unnamed entries (p = 0 there, but 0 * NaN garbage would poison P.V), and
  hands the tile to the consumers.
The slot table reaches shared memory by TMA, one 64-entry tile at a time (with its `tokens` tile: -1 for an
unnamed entry, else 1 or, fp8, the row's kv_scale, gathered by XLA beforehand), two tiles deep; the copies of
tile i + 1 fly while the consumers work on tile i (one staging tile: `_STAGES`).

Consumers, as in `mla_decode_sm90` (bf16 path): warpgroup 0 runs S = Q K^T (one wgmma over L+R), the
online softmax (f32, exp2; masked tokens -inf; fp8: logits and p times the per-token scale), P to shared
memory and P V for output columns [0, L/2); warpgroup 1 waits for P and runs P V for [L/2, L). Epilogue:
normalized output and LSE (natural log) by TMA through staging that aliases the loop buffers.

Shared memory at L+R = 576: Q 72 KB + wgmma tile 72 KB + staging (bf16 72 KB, fp8 40 KB) + P 8 KB + slot and
token tiles and alpha: bf16 226 KB of the 227 KB (Pallas starts every buffer at a 1 KB boundary), fp8 194 KB.

Barriers (every waiter waits every phase, in order):
  q_bar            Q landed (TMA)                                          WG0 waits
  slot_ready[2]    slot and token tiles landed (TMA, 2 arrivals)           producer waits
  stage_ready      the 64 entries of the staging tile: copies or arrivals  producer waits
  kv_ready         the wgmma tile of tile i written                        WG0, WG1 wait
  kv_consumed      both consumers done with tile i (2 arrivals)            producer waits
  p_ready / p_consumed / epi_bar / fin_bar: as in mla_decode_sm90

Testing: the CPU tests run it under the Mosaic GPU interpreter (race detector on) and lower it for sm_90
(layouts, wgmma and copy shapes, the shared-memory budget); the `gpu` tests run it on the H200.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mgpu import (
    ROW_LAYOUT,
    SMEM_BYTES,
    interpret_params,
    rows_bcast,
    smem_bytes,
    softmax_state,
    softmax_step,
    static_interpret,
    tiled,
    wgmma_accumulate,
    write_out,
)
from pallas_kernels.mla_decode import merge_splits

# The dense Hopper decode's pieces this kernel shares: the tile height, the split-count model, the consumer
# state, the row-vector layout and the output write.
from pallas_kernels.mla_decode_sm90 import (
    TILE_M,
    cache_and_width_reason,
    choose_num_kv_splits_sm90,
)
from pallas_kernels.sparse_mla_decode import check_concrete, sparse_mla_decode_reference, validate_sparse_decode
from pallas_kernels.util import BF16, F16, FP8, LN2, LOG2E, cdiv, check_interpreter_workers, is_sm90
from pallas_kernels.util import num_sms as _device_num_sms

__all__ = [
    "sparse_mla_decode_sm90",
    "sparse_mla_decode_reference",
    "unsupported_reason",
    "is_sm90",
    "TILE_K",
]

TILE_K = 64  # table entries (gathered rows) per KV tile: the wgmma N of Q K^T and K of P V

# Rows of the loop's row-vector buffer.
_ROW_ALPHA = 0  # alpha_i (WG0 -> WG1)
_ROWS = 1  # then the token tiles: row _ROWS + b holds the `tokens` entries of slot buffer b


def unsupported_reason(q, kv_cache, kv_lora_rank: int = 512) -> str | None:
    """None when this kernel takes these (static) shapes and dtypes, else why not; callers fall back to the
    portable `pallas_kernels.sparse_mla_decode`."""
    if jnp.dtype(q.dtype) not in (BF16, F16):
        return f"q dtype {q.dtype}: this kernel computes in bfloat16"
    return cache_and_width_reason(kv_cache.dtype, kv_lora_rank, q.shape[-1])


@dataclasses.dataclass(frozen=True)
class _Cfg:
    l: int  # latent width (output columns), split in two halves, one per consumer WG
    d: int  # L + R
    head_tiles: int  # 64-row tiles per query row
    tail: int  # rows moved for the last head tile: its real rows rounded up to 8 (<= 64)
    splits: int  # S: splits of the table (1: final output, else f32 partials)
    split_tokens: int  # table entries per split (a multiple of TILE_K)
    stages: int  # staging ring depth
    num_slots: int  # pages * G: slots outside [0, num_slots) are unnamed
    fp8: bool
    sm_scale: float
    out_dtype: object  # q.dtype (S == 1) or f32 (partials)
    interpret: bool  # Mosaic GPU interpreter (CPU): see mgpu.wgmma_accumulate

    @property
    def slot_bufs(self):  # slot tiles in flight: the staging ring's plus the next one
        return self.stages + 1

    @property
    def rows_per_tile(self):  # rows per head tile in the output arrays: 64, or the single tile's real rows
        return TILE_M if self.head_tiles > 1 else self.tail


def _smem_plan(cfg: _Cfg):
    """(aliased groups, per-CTA bytes): group A lives during the loop, group B (output staging) after it."""
    f32 = jnp.float32
    kv_dt = FP8 if cfg.fp8 else BF16
    group_a = [
        plgpu.SMEM((TILE_M, cfg.d), BF16, transforms=tiled(BF16)),  # Q
        plgpu.SMEM((TILE_K, cfg.d), BF16, transforms=tiled(BF16)),  # the wgmma KV tile
        # staging ring: gathered rows, each row its own tile of 64-column chunks (a row copy is one TMA)
        plgpu.SMEM(
            (cfg.stages, TILE_K, _stage_cols(cfg)),
            kv_dt,
            transforms=(plgpu.TilingTransform((1, 64)),),
        ),
        plgpu.SMEM((TILE_M, TILE_K), BF16, transforms=tiled(BF16)),  # P
        plgpu.SMEM((cfg.slot_bufs, TILE_K), jnp.int32),  # slot tiles
        # row vectors (_ROW_*), then the token tiles: one buffer (refs start at 1 KB boundaries; bf16 has 1 KB
        # to spare)
        plgpu.SMEM((_ROWS + cfg.slot_bufs, TILE_K), f32),
    ]
    half = cfg.l // 2
    # [2, 64, L/2] output staging (one half per consumer WG) and the epilogue's row vectors: [0] 1/l, [1] lse.
    group_b = [
        plgpu.SMEM((2, TILE_M, half), cfg.out_dtype, transforms=tiled(cfg.out_dtype)),
        plgpu.SMEM((2, TILE_M), f32),
    ]
    groups = [group_a, group_b]
    return groups, max(map(smem_bytes, groups))


def _barriers(cfg):
    return dict(
        q_bar=plgpu.Barrier(),
        slot_ready=plgpu.Barrier(num_arrivals=2, num_barriers=cfg.slot_bufs),  # slot and token tiles
        stage_ready=plgpu.Barrier(num_arrivals=TILE_K, num_barriers=cfg.stages),
        kv_ready=plgpu.Barrier(),
        kv_consumed=plgpu.Barrier(num_arrivals=2),
        p_ready=plgpu.Barrier(),
        p_consumed=plgpu.Barrier(),
        epi_bar=plgpu.Barrier(num_arrivals=2),
        fin_bar=plgpu.Barrier(),
    )


def _kernel(*refs, cfg: _Cfg):
    q_gmem, kv_gmem, table_gmem, tokens_gmem, nvalid_gmem, out_gmem, lse_gmem = refs
    gmem = dict(q=q_gmem, kv=kv_gmem, table=table_gmem, tokens=tokens_gmem, out=out_gmem, lse=lse_gmem)
    groups, _ = _smem_plan(cfg)

    def scoped(union, **bars):
        (q_smem, tile, staging, p_smem, slots, loop_rows), (out_stage, out_rows) = union
        smem = dict(
            q=q_smem,
            tile=tile,
            staging=staging,
            p=p_smem,
            slots=slots,
            loop_rows=loop_rows,
            out_stage=out_stage,
            out_rows=out_rows,
        )
        _body(cfg, gmem, smem, bars, nvalid_gmem)

    pl.run_scoped(scoped, plgpu.RefUnion(*(tuple(g) for g in groups)), collective_axes="wg", **_barriers(cfg))


def _body(cfg, gmem, smem, bars, nvalid_gmem):
    wg = lax.axis_index("wg")
    t, s_count = cfg.head_tiles, cfg.splits
    piece = lax.axis_index("piece")
    h = lax.rem(piece, jnp.int32(t))
    split = lax.rem(piece // t, jnp.int32(s_count))
    row = piece // (t * s_count)
    start = split * cfg.split_tokens  # this piece's table entries [start, end)
    end = jnp.minimum(nvalid_gmem[row], start + cfg.split_tokens)
    n = (jnp.maximum(end - start, 0) + TILE_K - 1) // TILE_K  # KV tiles
    rpt = cfg.rows_per_tile
    half = cfg.l // 2
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    f32 = jnp.float32
    tile, loop_rows, p_smem = smem["tile"], smem["loop_rows"], smem["p"]

    def by_rows(fn):
        """fn(rows) with the static number of real rows of this head tile (fewer only in the last one)."""
        if cfg.tail == TILE_M:
            fn(TILE_M)
        else:
            last = h == t - 1
            pl.when(last)(lambda: fn(cfg.tail))
            if t > 1:
                pl.when(jnp.logical_not(last))(lambda: fn(TILE_M))

    def out_dst(cols):
        """(out ref(rows), lse ref(rows)) of this piece: the final output or split `split`'s partial."""
        lead = (row,) if s_count == 1 else (row, split)
        return (
            lambda k: gmem["out"].at[(*lead, pl.ds(h * rpt, k), cols)],
            lambda k: gmem["lse"].at[(*lead, pl.ds(h * rpt, k))],
        )

    write_o = n > 0 if s_count > 1 else True  # an empty split writes only lse = -inf (the merge skips it)

    @pl.when(wg == 0)
    def _softmax_wg():
        plgpu.set_max_registers(_REGS[0], action="increase")

        @pl.when(n > 0)
        def _():
            by_rows(
                lambda k: plgpu.copy_gmem_to_smem(
                    gmem["q"].at[row, pl.ds(h * TILE_M, k)], smem["q"].at[pl.ds(0, k)], bars["q_bar"]
                )
            )
            plgpu.barrier_wait(bars["q_bar"])

        qk_scale = cfg.sm_scale * LOG2E

        def step(i, carry):
            acc, m_i, l_i = carry
            with jax.named_scope("wait_kv"):
                plgpu.barrier_wait(bars["kv_ready"])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, smem["q"], tile.T)
                return acc_ref[...]

            with jax.named_scope("qk"):
                s = pl.run_scoped(qk, plgpu.ACC((TILE_M, TILE_K), f32))  # [64 heads, 64 entries]
            with jax.named_scope("softmax"):
                tok = plgpu.load(loop_rows.at[_ROWS + lax.rem(i, jnp.int32(cfg.slot_bufs))], (), layout=col_layout)
                ks = lax.broadcast_in_dim(tok, s.shape, [1])  # the tile's `tokens` entries
                named = ks >= 0.0
                if cfg.fp8:  # logits of the fp8 rows times their per-token scale
                    s = s * ks
                s = jnp.where(named, s * qk_scale, -jnp.inf)
                m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)

            @pl.when(i > 0)
            @jax.named_scope("wait_p_consumed")
            def _():
                plgpu.barrier_wait(bars["p_consumed"])  # WG1 is done with P_{i-1} and alpha_{i-1}

            with jax.named_scope("store_p"):
                # V = fp8 row * scale: fold it into p (p = 0 at unnamed entries, so their -1 stays out)
                p_smem[...] = (p * ks if cfg.fp8 else p).astype(BF16)
                loop_rows[_ROW_ALPHA] = alpha
                plgpu.commit_smem()  # (also orders the token tile's read before the TMA that reuses it)
                plgpu.barrier_arrive(bars["p_ready"])
            with jax.named_scope("pv"):
                acc = acc * rows_bcast(alpha, acc.shape)
                acc = wgmma_accumulate(acc, p_smem, tile.at[:, pl.ds(0, half)], interpret=cfg.interpret)
            plgpu.barrier_arrive(bars["kv_consumed"])
            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, n, step, softmax_state(TILE_M, cfg.l // 2))
        pl.when(n > 0)(lambda: plgpu.barrier_wait(bars["p_consumed"]))  # its last phase too

        # Epilogue: after both consumers are done with the loop's buffers, which the staging aliases.
        plgpu.barrier_arrive(bars["epi_bar"])
        plgpu.barrier_wait(bars["epi_bar"])
        has = l_i > 0
        safe_l = jnp.where(has, l_i, 1.0)
        inv = jnp.where(has, 1.0 / safe_l, 0.0)
        rows = smem["out_rows"]
        rows[0] = inv
        rows[1] = jnp.where(has, (m_i + jnp.log2(safe_l)) * LN2, -jnp.inf)
        o_dst, lse_dst = out_dst(pl.ds(0, half))
        pl.when(write_o)(lambda: write_out(acc, inv, smem["out_stage"].at[0], o_dst, by_rows))
        plgpu.commit_smem()
        plgpu.barrier_arrive(bars["fin_bar"])  # 1/l published for WG1
        by_rows(lambda k: plgpu.copy_smem_to_gmem(rows.at[1, pl.ds(0, k)], lse_dst(k)))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _pv_wg():
        plgpu.set_max_registers(_REGS[0], action="increase")

        def step(i, acc):
            with jax.named_scope("wait_p"):
                plgpu.barrier_wait(bars["kv_ready"])
                plgpu.barrier_wait(bars["p_ready"])
            with jax.named_scope("pv"):
                alpha = plgpu.load(loop_rows.at[_ROW_ALPHA], (), layout=ROW_LAYOUT)
                acc = acc * rows_bcast(alpha, acc.shape)
                acc = wgmma_accumulate(acc, p_smem, tile.at[:, pl.ds(half, half)], interpret=cfg.interpret)
            plgpu.barrier_arrive(bars["p_consumed"])
            plgpu.barrier_arrive(bars["kv_consumed"])
            return acc

        acc = lax.fori_loop(0, n, step, softmax_state(TILE_M, cfg.l // 2)[0])
        plgpu.barrier_arrive(bars["epi_bar"])
        plgpu.barrier_wait(bars["epi_bar"])
        plgpu.barrier_wait(bars["fin_bar"])  # WG0 has written 1/l
        o_dst, _ = out_dst(pl.ds(half, half))

        @pl.when(write_o)
        def _():
            inv = plgpu.load(smem["out_rows"].at[0], (), layout=ROW_LAYOUT)
            write_out(acc, inv, smem["out_stage"].at[1], o_dst, by_rows)
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _producer_wg():
        plgpu.set_max_registers(_REGS[1], action="decrease")
        _produce(cfg, gmem, smem, bars, row, start, n)


def _produce(cfg, gmem, smem, bars, row, start, n):
    """The producer warpgroup: slot tiles by TMA, the named rows by per-row bulk copies into the staging
    ring, then each staging tile re-laid (and cast) into the wgmma tile once the consumers release it."""
    stages, bufs = cfg.stages, cfg.slot_bufs
    staging, slots, tile, loop_rows = smem["staging"], smem["slots"], smem["tile"], smem["loop_rows"]
    slot_ready, stage_ready = bars["slot_ready"], bars["stage_ready"]

    def rem(i, k):
        return lax.rem(i, jnp.int32(k))

    def named_slot(slot):
        return (slot >= 0) & (slot < cfg.num_slots)

    def fetch_slots(i):
        """TMA the slot and token tiles of KV tile i into buffer i % bufs."""
        b = rem(i, bufs)
        cols = pl.ds(start + i * TILE_K, TILE_K)
        plgpu.copy_gmem_to_smem(gmem["table"].at[row, cols], slots.at[b], slot_ready.at[b])
        plgpu.copy_gmem_to_smem(gmem["tokens"].at[row, cols], loop_rows.at[_ROWS + b], slot_ready.at[b])

    def gather(i):
        """The named rows of KV tile i into staging slot i % stages: one copy or one arrival per entry."""
        b, st = rem(i, bufs), rem(i, stages)
        plgpu.barrier_wait(slot_ready.at[b])
        bar = stage_ready.at[st]

        def entry(j, _):
            slot = slots[b, j]
            named = named_slot(slot)

            @pl.when(named)
            def _():
                plgpu.copy_gmem_to_smem(
                    gmem["kv"].at[pl.ds(slot, 1)],
                    staging.at[st, pl.ds(j, 1), pl.ds(0, cfg.d)],
                    bar,
                    oob_mode=plgpu.OOBFillMode.PROMISE_IN_BOUNDS,  # (named: the slot is in the pool)
                )

            pl.when(jnp.logical_not(named))(lambda: plgpu.barrier_arrive(bar))
            return ()

        # (unrolled on the GPU; the interpreter compiles the rolled loop much faster)
        lax.fori_loop(0, TILE_K, entry, (), unroll=1 if cfg.interpret else 8)

    def relayout(i):
        """Staging slot i % stages -> the wgmma tile (bf16), the rows of unnamed entries zeroed."""
        b, st = rem(i, bufs), rem(i, stages)
        named = loop_rows.at[_ROWS + b][...] >= 0.0  # [64]
        keep = lax.broadcast_in_dim(named, (TILE_K, 64), [0])
        with jax.named_scope("relayout"):
            for c in range(cfg.d // 64):
                cols = pl.ds(64 * c, 64)
                x = plgpu.load(
                    staging.at[st, :, cols], (), layout=_FP8_LAYOUT if cfg.fp8 else _COPY_LAYOUT, optimized=not cfg.fp8
                )
                if cfg.fp8:  # exact: e4m3 -> f32 -> bf16
                    x = x.astype(jnp.float32).astype(BF16)
                tile.at[:, cols][...] = jnp.where(keep, x, jnp.zeros((), BF16))
        plgpu.commit_smem()  # generic reads/writes before the consumers' wgmma and the next copies
        plgpu.barrier_arrive(bars["kv_ready"])

    for j in range(bufs):
        pl.when(j < n)(functools.partial(fetch_slots, jnp.int32(j)))
    for j in range(stages):
        pl.when(j < n)(functools.partial(gather, jnp.int32(j)))

    def step(i, _):
        st = rem(i, stages)
        with jax.named_scope("wait_rows"):
            plgpu.barrier_wait(stage_ready.at[st])

        @pl.when(i > 0)
        def _():
            with jax.named_scope("wait_free"):
                plgpu.barrier_wait(bars["kv_consumed"])  # both consumers are done with tile i - 1
            # ... so its slot buffer, (i - 1) % bufs, takes the slots of tile i - 1 + bufs = i + stages
            pl.when(i - 1 + bufs < n)(lambda: fetch_slots(i - 1 + bufs))

        relayout(i)
        pl.when(i + stages < n)(lambda: gather(i + stages))  # staging slot i % stages is free again
        return ()

    lax.fori_loop(0, n, step, ())
    pl.when(n > 0)(lambda: plgpu.barrier_wait(bars["kv_consumed"]))  # the last tile's release


# (consumer, producer) registers per thread: the CTA holds 384 threads x 168 = 64512, so
# 2 x 128 x consumer + 128 x producer <= 64512 (as mla_decode_sm90's fp8 split: the producer converts 64 x 64
# chunks).
_REGS = (208, 88)


# The relayout's register layouts: bf16, 16-byte vectors along rows (the layout of copies to and from a swizzled
# tile); fp8, the wgmma layout (its cast to bf16 stores into the wgmma tile).
_COPY_LAYOUT = plgpu.Layout.SMEM_GMEM_COPY((TILE_K, 64), BF16, 128)
_FP8_LAYOUT = plgpu.Layout.WGMMA


# Staging tiles: what 227 KB hold next to Q and the wgmma tile is one [64, L+R] bf16 tile (fp8, with its rows
# padded to 640 bytes, would need 234 KB for two). The copies of tile i + 1 fly while the consumers work on tile i.
_STAGES = 1


def _stage_cols(cfg) -> int:
    """Staging row width (elements): L+R rounded up to a multiple of 128 bytes, so that every row's copy starts
    128-byte aligned (the TMA's shared-memory alignment)."""
    per_128 = 128 // (1 if cfg.fp8 else 2)
    return cdiv(cfg.d, per_128) * per_128


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "num_kv_splits", "interpret", "sms"))
def _impl(q, kv_cache, topk_slots, kv_scale, *, scale, kv_lora_rank, num_kv_splits, interpret, sms):
    b, nq, n, d = q.shape
    l = kv_lora_rank
    pages, g, _ = kv_cache.shape
    num_slots = pages * g
    k = topk_slots.shape[-1]
    rows = b * nq
    fp8 = jnp.dtype(kv_cache.dtype) == FP8
    head_tiles = cdiv(n, TILE_M)
    tail = cdiv(n - (head_tiles - 1) * TILE_M, 8) * 8  # real rows of the last head tile, to 8
    k_tiles = cdiv(k, TILE_K)
    splits = num_kv_splits or choose_num_kv_splits_sm90(rows, head_tiles, k_tiles, sms)
    tiles_per_split = cdiv(k_tiles, min(splits, k_tiles))
    splits = cdiv(k_tiles, tiles_per_split)
    split_tokens = tiles_per_split * TILE_K
    k_pad = splits * split_tokens
    final = splits == 1
    cfg = _Cfg(
        l=l,
        d=d,
        head_tiles=head_tiles,
        tail=tail,
        splits=splits,
        split_tokens=split_tokens,
        stages=_STAGES,
        num_slots=num_slots,
        fp8=fp8,
        sm_scale=float(scale),
        out_dtype=jnp.dtype(q.dtype) if final else jnp.dtype(jnp.float32),
        interpret=bool(interpret),
    )
    _, smem = _smem_plan(cfg)
    if smem > SMEM_BYTES:  # pragma: no cover - guarded by unsupported_reason's L <= 512
        raise ValueError(f"L+R={d} needs {smem} B of shared memory per CTA; {SMEM_BYTES} B are available")

    table = topk_slots.reshape(rows, k)  # [rows, K]
    named = (table >= 0) & (table < num_slots)
    # entries up to the last named slot: the loop stops there (a row's -1 tail costs nothing)
    n_valid = jnp.max(jnp.where(named, jnp.arange(1, k + 1, dtype=jnp.int32), 0), axis=1)  # [rows]
    table = jnp.pad(table, ((0, 0), (0, k_pad - k)), constant_values=-1)  # [rows, K']
    m_q = (head_tiles - 1) * TILE_M + tail
    q_rows = q.reshape(rows, n, d).astype(BF16)  # [rows, N, L+R]
    if m_q != n:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, m_q - n), (0, 0)))
    kv_rows = kv_cache.reshape(num_slots, d)  # [pages * G, L+R]
    # f32[rows, K'] `tokens`, TMA'd with the slots: -1 for an unnamed entry, else 1 (bf16) or the row's kv_scale
    # (fp8; an unnamed slot's scale may be garbage)
    if fp8:
        tokens = jnp.where(named, kv_scale.reshape(num_slots)[jnp.where(named, table[:, :k], 0)], -1.0)
    else:
        tokens = jnp.where(named, 1.0, -1.0)
    tokens = jnp.pad(tokens, ((0, 0), (0, k_pad - k)), constant_values=-1.0)
    args = [q_rows, kv_rows, table, tokens, n_valid]

    rpt = cfg.rows_per_tile
    m_out = head_tiles * rpt  # rows per query row in the output arrays
    lead = (rows,) if final else (rows, splits)
    out_type = (
        jax.ShapeDtypeStruct((*lead, m_out, l), cfg.out_dtype),
        jax.ShapeDtypeStruct((*lead, m_out), jnp.float32),
    )
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=out_type,
        grid=(rows * splits * head_tiles,),
        grid_names=("piece",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret_params(interpret),
        kernel_name=f"sparse_mla_decode_sm90_splits{splits}_stages{cfg.stages}",
    )
    out, lse = kernel(*args)
    if not final:
        # Pieces with no tiles wrote only lse = -inf; the merge never reads their outputs.
        out, lse = merge_splits(out, lse, out_dtype=q.dtype, interpret=bool(interpret))
    out = out[:, :n].reshape(b, nq, n, l).astype(q.dtype)
    lse = lse[:, :n].reshape(b, nq, n)
    return out, lse


def sparse_mla_decode_sm90(
    q,  # [B, Q, N, L+R] bf16/f16: absorbed q_nope (L) then q_pe (R); computed in bf16
    kv_cache,  # [pages, G, L+R] bf16, or float8_e4m3fn with kv_scale
    topk_slots,  # i32[B, Q, K]: slots (page * G + offset) each query row attends to; -1 = none
    *,
    scale: float,
    kv_scale=None,  # f32[pages, G] (fp8 cache only)
    kv_lora_rank: int = 512,
    num_kv_splits: int | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    num_sms: int | None = None,
):
    """Hopper token-sparse latent MQA over the named slots. Returns (out [B, Q, N, L] in q.dtype, lse f32[B, Q,
    N]); a row with no named slot gives out 0 and lse -inf. Same contract as `sparse_mla_decode`: a concrete
    table with a slot outside [-1, pages * G) raises ValueError; under jit such entries are never read (as -1).
    Any page size G; L a multiple of 128 up to 512, R a multiple of 64; cache bf16 or fp8 e4m3 (cast to bf16 in
    shared memory, per-token scale applied to the logits and to p).

    num_kv_splits: static split count of the K table (None: `choose_num_kv_splits_sm90` for `num_sms` SMs,
    default the device's). interpret: run under the Mosaic GPU interpreter (CPU testing): True, or the
    interpreter's `plgpu.InterpretGPUParams`; it needs >= 3 XLA CPU workers (NPROC)."""
    validate_sparse_decode(q, kv_cache, topk_slots, kv_scale, kv_lora_rank)
    reason = unsupported_reason(q, kv_cache, kv_lora_rank)
    if reason is not None:
        raise ValueError(f"sparse_mla_decode_sm90 does not take this call ({reason}); use sparse_mla_decode")
    check_concrete(topk_slots, kv_cache)
    if num_kv_splits is not None and not (isinstance(num_kv_splits, int) and num_kv_splits >= 1):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits}")
    if num_sms is not None and not (isinstance(num_sms, int) and num_sms >= 1):
        raise ValueError(f"num_sms must be a positive int, got {num_sms}")
    check_interpreter_workers(interpret)
    return _impl(
        q,
        kv_cache,
        topk_slots,
        kv_scale,
        scale=float(scale),
        kv_lora_rank=int(kv_lora_rank),
        num_kv_splits=num_kv_splits,
        interpret=static_interpret(interpret),
        sms=int(num_sms) if num_sms is not None else _device_num_sms(),
    )
