"""Paged latent-MQA decode attention for MLA on Hopper (sm_90): a Mosaic GPU kernel (TMA + wgmma).

Same API and outputs as `pallas_kernels.mla_decode.mla_decode` (the Triton-lowered, portable
kernel); its float32 reference `mla_decode_reference` is this kernel's reference too.

Shape legend: B requests, Q query tokens per request, N heads, L kv_lora_rank (512), R rope dim
(64), G page size (64), T head tiles per request, M = Q*N rows folded into the wgmma M dimension
(tiles of 64 rows; fewer rows are padded with length-0 rows).

Work decomposition: a "piece" is (request b, head tile h, pages [p0, p0 + n) of b's block table);
one CTA per piece, grid (pieces,). Only the real rows of a tile move (Q in, outputs out), rounded
up to 8: N=16 moves 16 rows, not 64. Pieces come from one of two schedules:
- "grid" (default): every tile cut into S static splits over the block table's capacity
  (`choose_num_kv_splits_sm90`); piece (b * S + s) * T + h, its pages derived in the kernel from
  seq_lens (as the rows' lengths are: no metadata step before the launch); S == 1 writes the final
  output directly, S > 1 writes partials (bf16) merged by LSE with the Triton module's `merge_splits`
  kernel.
- "worklist": a metadata step on device (FlashMLA's get_mla_metadata idea) cuts each tile by its
  actual length (`_worklist_cuts`: one wave of pieces <= 1.125 fair shares where they fit on the SMs,
  else pieces <= total pages / (1.5 SMs)), so long requests spread over many SMs and short ones stay
  whole (final output written directly); only split tiles go through partial slots, merged by
  `_merge_worklist`. The metadata step is one Triton-lowered Pallas kernel (`worklist_pieces`; plain-JAX
  reference `worklist_pieces_reference`: a metadata array [pieces, 6], (b, h, p0, n, slot, tile
  length)), built once a step where a step passes it (`decode_plan`).

One CTA, 3 warpgroups (`plgpu.kernel(num_threads=3)`), FlashMLA's sm90 schedule simplified:
- Warpgroup 2, producer: one TMA per page (block-table entry) into a `num_stages` shared-memory
  ring of [G, L+R] tiles. On the request's partial last page the rows past its length are zeroed in
  shared memory (P = 0 there, but 0 * NaN garbage would poison P.V). fp8 cache: the producer TMAs
  fp8 pages and their per-token scales into their own ring, casts each tile to bf16 (exact) into
  the ring, but for V's second half, which WG1 casts (the columns only its P.V reads; the cast
  bounds the fp8 page time), and passes the scales on; WG0 multiplies the logits and p by the
  per-token scale (the Triton kernel's fp8_mode="scale_logits"), so the wgmmas are the bf16 code.
- Warpgroup 0 ("softmax"): S = Q K^T as one wgmma over K = L+R (9 x 64 for 576), online softmax in
  registers (f32, exp2), P (bf16) and the per-row rescale alpha to shared memory, then P V for
  output columns [0, L/2) with P from its registers.
- Warpgroup 1: waits for P, rescales its accumulator by alpha, P V for columns [L/2, L). Each
  consumer keeps a [64, L/2] f32 accumulator (128 registers/thread at L=512), as in FlashMLA.
- bf16 pages in pairs (`BF16_PAIRS`, `_body_pairs16`; built, not yet measured): the fp8 P.V body's schedule on
  bf16 pages, each slot as its two latent halves and its rope (which then holds P) with a barrier pair each.
- Epilogue: normalized output and LSE (natural log) go out by TMA through staging buffers that
  alias the Q tile and the ring (`plgpu.RefUnion`: loop buffers | output staging, final or partial).
- fp8_qk=True (fp8 cache; `_body_pv8`): no cast at all. Q is quantized per row to e4m3 (`quantize_q_fp8`, one
  Triton kernel before the call), QK^T runs as fp8 wgmmas straight on the fp8 ring slot, and P.V too, as O^T =
  V^T P^T with V^T built in registers from the page (Hopper's fp8 wgmma reads shared-memory operands K-major
  only, and V is N-major in the page) and P rounded to e4m3: FlashMLA's fp8 kernel's two roundings (q and P),
  with a scale a row where it takes one a request. Its pages go in pairs, one a consumer warpgroup: each runs its
  page's QK^T, the softmax and the P^T store, the two consumers' row maxima exchanged a pair, then both pages'
  P.V on its half of the latents; the producer keeps the next pair in flight. fp8_q_split=True splits q into two
  e4m3 terms at one scale (q_hi and its residual), both QK^T chains in one accumulator, and P's rounding is then
  the mode's one loss (1.75x the time at 64x128x4096). At <= 16 rows a request the narrow kernel runs this mode
  instead (one fp8 term of q, V cast to bf16).

Shared memory at L+R = 576 (227 KB available): bf16, 2 stages: Q 72 KB + ring 2 x 72 KB + P 8 KB
+ row vectors = 225 KB, the output staging (64 KB for bf16 outputs and partials) reusing it; fp8: Q 72 KB +
ring 1 x 72 KB + fp8 ring 2 x 36 KB + P 8 KB = 225 KB (a second bf16 stage does not fit);
fp8_qk: Q 72 KB (two e4m3 terms; one: 36 KB) + fp8 ring 4 x 36 KB + 2 P^T 8 KB + scales and rows 2 KB = 226 KB
(each buffer in whole KB).

Barriers (mbarriers; every waiter waits every phase of a barrier, in order, and at most one phase
behind -- the parity discipline the interpreter checks):
  q_bar            Q tile + row lengths landed (TMA)                         WG0 waits
  kv_ready0[st]    ring slot holds page i (TMA, or producer arrive)          WG0, WG1 wait
  kv_consumed0[st] both consumers finished reading slot (2 arrivals)        producer waits
  p_ready          P_i and alpha_i in shared memory                          WG1 waits
  p_consumed       WG1's P_i . V wgmma done (P may be overwritten)           WG0 waits
  epi_bar          both consumers done with Q, the ring and P (2 arrivals)   WG0, WG1 wait
  fin_bar          1/l of every row in shared memory                         WG1 waits
  raw_bar / fp8_ready[st] / scale_ready[st]  TMA landed for the producer's own processing
                   (fp8_qk: for the consumers, which read the fp8 ring itself)
  fp8_consumed[f]  both casts done with fp8 slot f (2; fp8_qk: every consumer)  producer waits
  kv_ready0 takes 2 arrivals with an exact fp8 cache: the producer's columns and WG1's V half. With the slots in
  three buffers (`SPLIT_SLOTS`, `_Slots`) each of two groups has its own kv_ready{g} / kv_consumed{g}: group 0
  (WG0's latents and the rope) released by WG0, group 1 (WG1's latents) by WG1.
  fp8_qk (pages in pairs): p_ready[w] / p_consumed[w] per consumer's P^T (the other consumer waits / arrives),
  mx_ready (2 arrivals: both row maxima of the pair written), l_ready (WG1's l after the loop); scale_ready[f] is
  waited only by the slot's owner (an even ring: page 2k + w, consumer w, always lands in a slot of parity w).

Testing: the CPU tests run it under the Mosaic GPU interpreter (race detector on) and lower it for
sm_90 (Mosaic GPU's Python passes: layout inference, wgmma/TMA checks, the shared-memory budget);
the `gpu` tests run it on the H200. It is the decode of the default Hopper backend where heads x
query tokens fill its 64-row tile (mla_jax.attention), because at 128 heads it is faster than the
Triton kernel (measured on the H200: docs/perf-notes.md, bench/results/decode-h200.json). The
consumers' phases carry `jax.named_scope`s: with `TRACE` set, Mosaic GPU's profiler records them
per warpgroup (bench/trace_sm90.py). What limits it, measured that way, and the schedules tried
(FlashMLA's seesaw was slower with two page buffers): docs/perf-notes.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.mgpu import (
    COL_LAYOUT,
    ROW_LAYOUT,
    SMEM_BYTES,
    VT_CHUNK,
    cast_fp8_columns,
    copy_zeroing_rows,
    interpret_params,
    pt_fp8_operand,
    rows_bcast,
    smem_bytes,
    softmax_state,
    softmax_step,
    static_interpret,
    tiled,
    vt_accumulate,
    vt_fp8_operand,
    wgmma_accumulate,
    write_out,
)
from pallas_kernels.mla_decode import check_page_offset, merge_segments, merge_splits, mla_decode_reference
from pallas_kernels.mla_decode_sm90_narrow import (
    narrow_decode,
    narrow_rows,
    quantize_q_fp8,
    quantize_q_fp8_rows,
    smem_plan_bytes,
)
from pallas_kernels.util import (
    BF16,
    FP8,
    LN2,
    LOG2E,
    M_INIT,
    cdiv,
    check_interpreter_workers,
    is_sm90,
    next_pow2,
    validate_decode,
)
from pallas_kernels.util import num_sms as _device_num_sms

__all__ = [
    "mla_decode_sm90",
    "mla_decode_reference",
    "choose_num_kv_splits_sm90",
    "is_sm90",
    "unsupported_reason",
    "quantize_q_fp8",
    "fp8_qk_reference_q",
    "TILE_M",
    "PAGE_SIZE",
]

TILE_M = 64  # query rows per CTA (wgmma M)
PAGE_SIZE = 64  # the only supported page size (one page = one KV tile, FlashMLA's block size)


def unsupported_reason(q, cache, kv_lora_rank: int = 512) -> str | None:
    """None when this kernel takes these (static) shapes and dtypes, else why not; callers fall
    back to the portable `pallas_kernels.mla_decode` (page sizes other than 64, f32/f16 caches...)."""
    if cache.ndim != 3 or cache.shape[1] != PAGE_SIZE:
        return f"page size {cache.shape[1:2]} is not {PAGE_SIZE}"
    return cache_and_width_reason(cache.dtype, kv_lora_rank, q.shape[-1])


def cache_and_width_reason(cache_dtype, l: int, d: int) -> str | None:
    """None when a Hopper latent decode (dense or sparse) takes this cache dtype and row width (L latent
    columns split in two 64-aligned halves, one per consumer warpgroup, + R rope), else why not."""
    if jnp.dtype(cache_dtype) not in (BF16, FP8):
        return f"cache dtype {cache_dtype} is not bfloat16 or float8_e4m3fn"
    if l % 128 or l > 512 or (d - l) % 64 or d <= l:
        return f"L={l}, R={d - l}: needs L % 128 == 0, L <= 512, R % 64 == 0"
    return None


@dataclasses.dataclass(frozen=True)
class _Cfg:
    l: int  # latent width (output columns), split in two halves, one per consumer WG
    d: int  # L + R
    head_tiles: int  # 64-row tiles per request
    tail: int  # rows moved for the last tile: its real rows rounded up to 8 (<= 64)
    stages: int  # ring depth (tiles in the wgmma dtype)
    fp8_stages: int  # fp8 ring depth (0: bf16 cache)
    sm_scale: float
    final_dtype: object  # dtype of the final output (q.dtype) and of the split partials
    interpret: bool  # Mosaic GPU interpreter (CPU): see mgpu.wgmma_accumulate
    pv8: bool = False  # fp8 cache, fp8_qk: QK^T and P.V as fp8 wgmmas on the fp8 ring (O^T = V^T P^T, V^T in
    # registers: `_body_pv8`), Q as `q_terms` e4m3 terms with a per-row scale; no bf16 ring, no cast
    q_terms: int = 1  # pv8: q_hi alone, or q_hi and its residual (two QK^T chains in one accumulator)
    nq: int = 1  # query tokens per request (row t*N + n is token t's)
    heads: int = 64
    capacity: int = 1 << 30  # tokens the block table holds (longer lengths are clamped to it)
    splits: int = 1  # grid schedule: pieces per head tile, piece = (b * splits + s) * head_tiles + h
    pps: int = 1  # grid schedule: pages per split
    worklist: bool = False  # pieces from a metadata array (`worklist_pieces`) instead
    split_slots: bool = False  # the bf16 body's slots in three buffers, two barrier groups (`_Slots`)
    pairs16: bool = False  # bf16 cache: pages in pairs, one a consumer (`_body_pairs16`)


class _Slots:
    """The bf16 body's ring slots as parts (first column, width, barrier group), each part its own [stages, G, width]
    buffer and each group its own kv_ready{g} / kv_consumed{g} barriers. Whole (the default): one [G, L+R] part,
    released by both consumers. Split (`SPLIT_SLOTS`): WG0's latents [0, L/2) and the rope [L, L+R) in group 0,
    released by WG0 once its P.V is done, and WG1's latents [L/2, L) in group 1, released by WG1 (with an exact fp8
    cache WG1 writes those itself, after its own P.V: no release), so that the next page's group 0 lands while WG1
    still reads this page's group 1 and WG0's next QK^T starts on it."""

    def __init__(self, cfg: _Cfg):
        half, l, d = cfg.l // 2, cfg.l, cfg.d
        fp8 = cfg.fp8_stages > 0
        if cfg.split_slots:
            self.parts = [(0, half, 0), (l, d - l, 0), (half, half, 1)]
            self.releasers = {0: (0,), 1: () if fp8 else (1,)}
        else:
            self.parts = [(0, d, 0)]
            self.releasers = {0: (0, 1)}
        self.groups = sorted(self.releasers)
        self.wg1_group = self.group_of(half)
        # Arrivals that make a slot's group ready: one TMA a part; an exact fp8 cache: the casts that write into it
        # (the producer's columns, all but [L/2, L); WG1's, [L/2, L)).
        # An exact fp8 cache's casts: the producer's 64-column chunks (K's but V's second half, which WG1 casts) and
        # the groups they lie in.
        self.producer_chunks = [c for c in range(d // 64) if not half <= 64 * c < l]
        self.producer_groups = sorted({self.group_of(64 * c) for c in self.producer_chunks})
        if fp8:
            self.arrivals = {g: (g in self.producer_groups) + (g == self.wg1_group) for g in self.groups}
        else:
            self.arrivals = {g: sum(pg == g for *_, pg in self.parts) for g in self.groups}

    def group_of(self, col):
        return next(pg for c0, w, pg in self.parts if c0 <= col < c0 + w)

    def smem(self, stages):
        return [plgpu.SMEM((stages, PAGE_SIZE, w), BF16, transforms=tiled(BF16)) for _, w, _ in self.parts]

    def barriers(self, stages):
        bars = {f"kv_ready{g}": plgpu.Barrier(num_arrivals=self.arrivals[g], num_barriers=stages) for g in self.groups}
        for g, who in self.releasers.items():
            if who:
                bars[f"kv_consumed{g}"] = plgpu.Barrier(num_arrivals=len(who), num_barriers=stages)
        return bars

    def view(self, bufs, slot, col, width):
        """Ring slot `slot`'s columns [col, col + width), which lie in one part."""
        for (c0, w, _), buf in zip(self.parts, bufs, strict=True):
            if c0 <= col and col + width <= c0 + w:
                return buf.at[slot, :, pl.ds(col - c0, width)]
        raise ValueError(f"columns [{col}, {col + width}) straddle the slot's parts {self.parts}")


def _smem_plan(cfg: _Cfg):
    """(aliased groups, per-CTA bytes) of the shared-memory plan; see the module docstring.

    Group A lives during the page loop, B (output staging) in the epilogue only, so both share one
    `plgpu.RefUnion`. B stages the final output or the split partial alike: partials come in the output's dtype (at
    1x128x32768 f32 ones were 16.8 MB written at the kernel's end and read by the merge, as many bytes as the fp8
    cache; bf16 adds the rounding the output has anyway, and lse stays f32)."""
    f32 = jnp.float32
    half = cfg.l // 2
    dt = cfg.final_dtype
    stage = [plgpu.SMEM((2, TILE_M, half), dt, transforms=tiled(dt)), plgpu.SMEM((2, TILE_M), f32)]
    if cfg.pv8:
        # The fp8 ring first, so that the third group's bf16 view of it (`mgpu.vt_fp8_operand`) starts where it does.
        fst, d = cfg.fp8_stages, cfg.d
        ring8 = plgpu.SMEM((fst, PAGE_SIZE, d), FP8, transforms=tiled(FP8, 64))
        p_t = plgpu.SMEM((TILE_M, PAGE_SIZE), FP8, transforms=tiled(FP8, 64))  # P^T (K-major), V^T's token order
        group_a = [
            ring8,
            plgpu.SMEM((TILE_M, cfg.q_terms * d), FP8, transforms=tiled(FP8, 64)),  # Q: q_hi (then its residual)
            p_t,
            plgpu.SMEM((fst, PAGE_SIZE), f32),  # the token scales (before the rows: its TMA's alignment)
            plgpu.SMEM((_PV8_ROWS, TILE_M), f32),  # [0] unused, Q's scales, the pair's row maxima
            p_t,  # WG1's P^T
        ]
        ring16 = [plgpu.SMEM((fst, PAGE_SIZE, d // 2), BF16, transforms=tiled(BF16, 64))]
        groups = [group_a, stage, ring16]
        return groups, max(map(smem_bytes, groups))
    cdt = BF16  # wgmma operand dtype (Q, ring, P)
    q = plgpu.SMEM((TILE_M, cfg.d), cdt, transforms=tiled(cdt))
    if cfg.pairs16:  # two page slots, each as its two latent halves and its rope (then P), and the row vectors
        half, r = cfg.l // 2, cfg.d - cfg.l
        # (a buffer a slot: a wgmma's operand indexed by a constant slot would be a literal in its `run_state`)
        parts = [[plgpu.SMEM((PAGE_SIZE, w), cdt, transforms=tiled(cdt)) for _ in range(2)] for w in (half, half, r)]
        groups = [[q, *parts, plgpu.SMEM((_PV8_ROWS, TILE_M), f32)], stage]
        return groups, max(map(smem_bytes, groups))
    ring = _Slots(cfg).smem(cfg.stages)
    p = plgpu.SMEM((TILE_M, PAGE_SIZE), cdt, transforms=tiled(cdt))
    # Row vectors used during the loop, indexed by the _ROW_* constants.
    loop_rows = plgpu.SMEM((_ROWS + _extra_rows(cfg), TILE_M), f32)
    group_a = [q, ring, p, loop_rows]
    if cfg.fp8_stages:
        group_a.append(plgpu.SMEM((cfg.fp8_stages, PAGE_SIZE, cfg.d), FP8, transforms=tiled(FP8, 64)))
        group_a.append(plgpu.SMEM((cfg.fp8_stages, PAGE_SIZE), f32))
    # [2, 64, L/2] output staging (one half per consumer WG) and the epilogue's row vectors: [0] 1/l (WG0 -> WG1),
    # [1] lse.
    groups = [group_a, stage]
    return groups, max(map(smem_bytes, groups))


# Rows of the loop's row-vector buffer; an exact fp8 cache adds [_ROWS + slot]: the per-token scales of the
# page in ring slot `slot` (producer -> WG0); fp8 P.V adds [_ROWS]: Q's per-row scales instead
# (WG0 reads the token scales from the scale ring itself).
_ROW_ALPHA = 0  # alpha_i (WG0 -> the P.V warpgroups)
_ROWS = 1
_ROW_QSCALE = _ROWS


# The fp8 P.V body's row vectors: [_ROW_QSCALE] Q's scales (then WG1's l after the loop), [_ROW_MX + w] consumer w's
# logits' row max of the pair (exchanged; each consumer reads the other's before it arrives at p_ready, which the
# other waits for before it writes its next). 227 KB hold no more rows beside 4 fp8 pages and Q's two terms (every
# buffer takes whole KB).
_ROW_MX = 2
_PV8_ROWS = _ROW_MX + 2


def _extra_rows(cfg):
    return cfg.stages if cfg.fp8_stages else 0


# Work-list metadata, one row per CTA: (b, head tile, first page, pages, slot, tile length).
# slot: -1 final output, >= 0 partial slot, -2 no work (padding of the work list).
_META = 6


def _barriers(cfg):
    """The pipeline's mbarriers, by name (see the module docstring)."""
    if cfg.pv8:
        fst = cfg.fp8_stages
        return dict(
            q_bar=plgpu.Barrier(num_arrivals=2),  # Q, Q's scales
            fp8_ready=plgpu.Barrier(num_barriers=fst),  # page (TMA, or the producer after zeroing a partial page)
            scale_ready=plgpu.Barrier(num_barriers=fst),  # waited by the page's owner only (fst even)
            fp8_consumed=plgpu.Barrier(num_arrivals=2, num_barriers=fst),  # both consumers' V^T (the owner's K^T)
            mx_ready=plgpu.Barrier(num_arrivals=2),  # both consumers' row maxima of the pair
            p_ready=plgpu.Barrier(num_barriers=2),  # consumer w's P^T (and alpha) of the pair
            p_consumed=plgpu.Barrier(num_barriers=2),  # the other consumer's P.V on consumer w's P^T done
            l_ready=plgpu.Barrier(),  # WG1's l after the loop
            epi_bar=plgpu.Barrier(num_arrivals=2),
            fin_bar=plgpu.Barrier(),
            raw_bar=plgpu.Barrier(),
        )
    if cfg.pairs16:
        return dict(
            q_bar=plgpu.Barrier(),
            # a page's parts in slot s (TMA, or the producer after zeroing a partial page), per part
            lo_ready=plgpu.Barrier(num_barriers=2),
            hi_ready=plgpu.Barrier(num_barriers=2),
            pe_ready=plgpu.Barrier(num_barriers=2),
            lo_free=plgpu.Barrier(num_barriers=2),  # WG0's P.V of the slot's page done (its last reader)
            hi_free=plgpu.Barrier(num_barriers=2),  # WG1's
            pe_free=plgpu.Barrier(num_arrivals=2, num_barriers=2),  # both P.Vs (P lives in the rope's buffer)
            mx_ready=plgpu.Barrier(num_arrivals=2),  # both consumers' row maxima of the pair
            p_ready=plgpu.Barrier(num_barriers=2),  # consumer w's P of the pair in its slot's rope buffer
            l_ready=plgpu.Barrier(),  # WG1's l after the loop
            epi_bar=plgpu.Barrier(num_arrivals=2),
            fin_bar=plgpu.Barrier(),
            raw_bar=plgpu.Barrier(),
        )
    bars = dict(
        q_bar=plgpu.Barrier(),  # Q
        **_Slots(cfg).barriers(cfg.stages),
        p_ready=plgpu.Barrier(),
        p_consumed=plgpu.Barrier(),
        epi_bar=plgpu.Barrier(num_arrivals=2),
        fin_bar=plgpu.Barrier(),
        raw_bar=plgpu.Barrier(),
    )
    if cfg.fp8_stages:
        bars.update(
            fp8_ready=plgpu.Barrier(num_barriers=cfg.fp8_stages), scale_ready=plgpu.Barrier(num_barriers=cfg.fp8_stages)
        )
    if cfg.fp8_stages:  # both casts (producer, WG1) read the fp8 slot
        bars.update(fp8_consumed=plgpu.Barrier(num_arrivals=2, num_barriers=cfg.fp8_stages))
    return bars


def _kernel(*refs, cfg: _Cfg):
    """Inputs q, cache, (kv_scale: fp8), block_table, seq_lens, page_offset, (meta: work list), (Q's scales:
    fp8 QK^T); outputs final out and lse, partial out and lse."""
    is_fp8 = cfg.fp8_stages > 0
    refs = list(refs)
    ins = ["q_gmem", "kv_gmem"] + ["ks_gmem"] * is_fp8 + ["bt_gmem", "sl_gmem", "off_gmem"]
    ins += ["meta_gmem"] * cfg.worklist + ["qs_gmem"] * cfg.pv8
    outs = ["out_gmem", "lse_gmem", "opart_gmem", "lsepart_gmem"]
    gmem = dict(ks_gmem=None, meta_gmem=None, qs_gmem=None) | dict(zip(ins + outs, refs, strict=True))
    groups, _ = _smem_plan(cfg)

    def scoped(union, **bars):
        if cfg.pv8:
            refs_a, stage, (ring16,) = union
            fp8_ring, q_smem, p_smem, scale_ring, loop_rows = refs_a[:5]
            r = dict(gmem, q_smem=q_smem, ring16=ring16, p_smem=p_smem, loop_rows=loop_rows, fp8_ring=fp8_ring)
            r.update(p_smem=(p_smem, refs_a[5]))  # one P^T a consumer
            r.update(scale_ring=scale_ring, stage=stage, **bars)
            _body_pv8(cfg, r, _Piece(cfg, r))
            return
        refs_a, stage = union  # one tree of refs per aliased group
        if cfg.pairs16:
            q_smem, lo, hi, pe, loop_rows = refs_a
            r = dict(gmem, q_smem=q_smem, halves=(lo, hi), pe=pe, loop_rows=loop_rows, stage=stage, **bars)
            _body_pairs16(cfg, r, _Piece(cfg, r))
            return
        q_smem, ring, p_smem, loop_rows = refs_a[:4]
        fp8_ring, scale_ring = refs_a[4:] if is_fp8 else (None, None)
        r = dict(
            gmem,
            q_smem=q_smem,
            ring=ring,
            p_smem=p_smem,
            loop_rows=loop_rows,
            fp8_ring=fp8_ring,
            scale_ring=scale_ring,
            stage=stage,
            **bars,
        )
        _body(cfg, r, _Piece(cfg, r))

    pl.run_scoped(scoped, plgpu.RefUnion(*(tuple(g) for g in groups)), collective_axes="wg", **_barriers(cfg))


class _Piece:
    """This CTA's piece and what every warpgroup derives from it: pages [first, first + n) of
    request b's block table for head tile h, and where its outputs go."""

    def __init__(self, cfg, r):
        self.cfg, self.r = cfg, r
        piece = lax.axis_index("piece")
        if cfg.worklist:
            meta = r["meta_gmem"]
            self.b, self.h, self.first, self.n, self.slot, self.tile_len = (meta[piece, k] for k in range(_META))
        else:  # the grid: everything from the piece id and seq_lens (no metadata step before the launch)
            bs, self.h = lax.div(piece, jnp.int32(cfg.head_tiles)), lax.rem(piece, jnp.int32(cfg.head_tiles))
            self.b, s = lax.div(bs, jnp.int32(cfg.splits)), lax.rem(bs, jnp.int32(cfg.splits))
            self.first = s * cfg.pps
        # Each query token's length, clamped to the block table; the tile's rows [64 h, 64 h + 64) hold
        # tokens [64 h // N, (64 h + 63) // N].
        self.sl = [jnp.minimum(r["sl_gmem"][self.b, t], cfg.capacity) for t in range(cfg.nq)]
        lo, hi = self.h * TILE_M, self.h * TILE_M + TILE_M
        in_tile = [(t * cfg.heads < hi) & ((t + 1) * cfg.heads > lo) for t in range(cfg.nq)]
        if not cfg.worklist:
            self.tile_len = functools.reduce(jnp.maximum, [jnp.where(x, sl, 0) for x, sl in zip(in_tile, self.sl)])
            pages = lax.div(self.tile_len + PAGE_SIZE - 1, PAGE_SIZE)
            self.n = jnp.clip(pages - self.first, 0, cfg.pps)
            self.slot = piece if cfg.splits > 1 else jnp.int32(-1)
        # Valid rows of the last page (< G only on the request's partial last page).
        self.last_rows = jnp.minimum(self.tile_len - (self.first + self.n - 1) * PAGE_SIZE, PAGE_SIZE)
        # The leading pages of this piece that every real row of the tile attends to in full: their logits need no
        # mask (`logits`). The tile's padding rows are then unmasked, harmless: nothing reads or writes them.
        min_len = functools.reduce(jnp.minimum, [jnp.where(x, sl, cfg.capacity) for x, sl in zip(in_tile, self.sl)])
        self.full = jnp.clip(lax.div(min_len, PAGE_SIZE) - self.first, 0, self.n)
        self.final, self.partial = self.slot == -1, self.slot >= 0
        self.has_out = self.slot != -2

    def by_rows(self, fn):
        """fn(rows) with the static number of real rows of this tile (fewer only in the last tile:
        e.g. N=16 moves 16 rows of Q and of the outputs, not 64)."""
        cfg = self.cfg
        if cfg.tail == TILE_M:
            fn(TILE_M)
        else:
            last = self.h == cfg.head_tiles - 1
            pl.when(last)(lambda: fn(cfg.tail))
            if cfg.head_tiles > 1:
                pl.when(jnp.logical_not(last))(lambda: fn(TILE_M))

    def out_dsts(self, cols):
        """(staging refs, output refs(rows), lse refs(rows)) of the final and of the partial outputs."""
        r, b, h = self.r, self.b, self.h
        rpt = _rows_per_tile(self.cfg)
        stage_o, stage_rows = r["stage"]
        row0 = self.slot * rpt
        return (
            (
                stage_o,
                stage_rows,
                lambda k: r["out_gmem"].at[b, pl.ds(h * rpt, k), cols],
                lambda k: r["lse_gmem"].at[b, pl.ds(h * rpt, k)],
            ),
            (
                stage_o,
                stage_rows,
                lambda k: r["opart_gmem"].at[pl.ds(row0, k), cols],
                lambda k: r["lsepart_gmem"].at[pl.ds(row0, k)],
            ),
        )

    def load_q(self):
        """WG0, where the piece has pages: TMA the real rows of Q and wait for them (q_bar). The rest of the tile
        keeps whatever shared memory held (even NaN), harmless since those rows have length 0 and their logits are
        replaced by -inf."""
        pl.when(self.n > 0)(self._load_q)

    def _load_q(self):
        r = self.r
        self.by_rows(
            lambda k: plgpu.copy_gmem_to_smem(
                r["q_gmem"].at[self.b, pl.ds(self.h * TILE_M, k)], r["q_smem"].at[pl.ds(0, k)], r["q_bar"]
            )
        )
        if self.cfg.pv8:
            plgpu.copy_gmem_to_smem(
                r["qs_gmem"].at[self.b, pl.ds(self.h * TILE_M, TILE_M)], r["loop_rows"].at[_ROW_QSCALE], r["q_bar"]
            )
        plgpu.barrier_wait(r["q_bar"])

    def logit_scale(self):
        """sm_scale in log2 units, times Q's per-row scale when Q is fp8 (a [64] row vector)."""
        c = self.cfg.sm_scale * LOG2E
        if not self.cfg.pv8:
            return c
        return plgpu.load(self.r["loop_rows"].at[_ROW_QSCALE], layout=ROW_LAYOUT) * c

    def row_lens(self):
        """i32 [64] (row layout): the cache tokens each row of the tile attends to, 0 for padding rows."""
        cfg = self.cfg
        row = plgpu.broadcasted_iota(jnp.int32, (TILE_M,), 0, layout=ROW_LAYOUT) + self.h * TILE_M
        lens = jnp.zeros((TILE_M,), jnp.int32)
        for t, sl in enumerate(self.sl):
            lens = jnp.where((row >= t * cfg.heads) & (row < (t + 1) * cfg.heads), sl, lens)
        return lens

    def logits(self, s, page, scale, lens):
        """Scaled logits (log2 units) of this piece's page `page`, -inf past each row's length (`row_lens`); the
        mask's index, compare and select only on pages past `full` (1.7% of the bf16 kernel's time at 64x128x4096,
        2.8% of the one-term fp8 P.V's, H100, session 38)."""
        g = PAGE_SIZE
        scale = scale if isinstance(scale, float) else rows_bcast(scale, s.shape)

        def masked():
            tok = (self.first + page) * g + plgpu.broadcasted_iota(jnp.int32, (TILE_M, g), 1, layout=plgpu.Layout.WGMMA)
            valid = tok < lax.broadcast_in_dim(lens, (TILE_M, g), [0])
            return jnp.where(valid, s * scale, -jnp.inf)

        return lax.cond(page < self.full, lambda: s * scale, masked)

    def page_rows(self, page):
        """Rows of this piece's page `page` inside the tile's length (< G only on its partial last page)."""
        return jnp.where(page == self.n - 1, self.last_rows, PAGE_SIZE)

    def page_id(self, page):
        """The cache page of this piece's page `page` (its block-table entry plus the page offset)."""
        return self.r["bt_gmem"][self.b, self.first + page] + self.r["off_gmem"][0]

    def copy_page(self, page, dst, ready, cols=None):
        """TMA this piece's page `page` (its columns `cols`, a `pl.ds`, or all) into shared-memory `dst` so that
        `ready` fires; on the request's partial last page the rows past its length are zeroed first (`raw_bar`)."""
        src = self.r["kv_gmem"].at[self.page_id(page)]
        copy_zeroing_rows(
            src if cols is None else src.at[:, cols],
            dst,
            ready,
            self.r["raw_bar"],
            partial=(page == self.n - 1) & (self.last_rows < PAGE_SIZE),
            lo=0,
            hi=self.last_rows,
        )

    def fp8_logits(self, s, page, scales, scale, lens):
        """The fp8 P.V body: page `page`'s QK^T s [64, G] (fp8 rows) -> (its `logits`, the rows' token scales
        [G] as columns, 0 past the page's rows: next to garbage, p * scale must stay 0); `scales` the page's
        slot of the scale ring."""
        ks = plgpu.load(scales, (), layout=COL_LAYOUT)
        tok = plgpu.broadcasted_iota(jnp.int32, (PAGE_SIZE,), 0, layout=COL_LAYOUT)
        ks = jnp.where(tok < self.page_rows(page), ks, 0.0)
        return self.logits(s * lax.broadcast_in_dim(ks, s.shape, [1]), page, scale, lens), ks

    def write_out(self, acc, inv, stage, dst):
        cfg = self.cfg
        write_out(acc, inv, stage, dst, self.by_rows, transposed=cfg.pv8, interpret=cfg.interpret)

    def epilogue_wg0(self, acc, m_i, l_i):
        """Normalize WG0's half and write it with the lse (after both consumers are done with the loop's buffers,
        which the staging aliases); publish 1/l for WG1's half."""
        r, half = self.r, self.cfg.l // 2

        def epilogue(stage, rows, o_dst, lse_dst, write_o):
            has = l_i > 0
            safe_l = jnp.where(has, l_i, 1.0)
            inv = jnp.where(has, 1.0 / safe_l, 0.0)
            lse = jnp.where(has, (m_i + jnp.log2(safe_l)) * LN2, -jnp.inf)
            rows[0] = inv
            rows[1] = lse
            if self.cfg.pv8:  # O^T: 1/l a column, read back in that layout
                plgpu.commit_smem()
                inv = plgpu.load(rows.at[0], (), layout=COL_LAYOUT)
            pl.when(write_o)(lambda: self.write_out(acc, inv, stage.at[0], o_dst))
            plgpu.commit_smem()
            plgpu.barrier_arrive(r["fin_bar"])  # 1/l published for WG1
            self.by_rows(lambda k: plgpu.copy_smem_to_gmem(rows.at[1, pl.ds(0, k)], lse_dst(k)))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(self.has_out)
        def _():
            plgpu.barrier_arrive(r["epi_bar"])
            plgpu.barrier_wait(r["epi_bar"])  # both consumers are done with Q, the ring and P
            fin, part = self.out_dsts(pl.ds(0, half))
            pl.when(self.final)(lambda: epilogue(*fin, True))
            pl.when(self.partial)(lambda: epilogue(*part, self.n > 0))  # empty split: lse = -inf only

    def epilogue_wg1(self, acc):
        """Normalize and write the output's second half (columns [L/2, L)) with WG0's 1/l."""
        r, half = self.r, self.cfg.l // 2

        def epilogue(stage, rows, o_dst, lse_dst, write_o):
            del lse_dst

            @pl.when(write_o)
            def _():
                inv = plgpu.load(rows.at[0], layout=COL_LAYOUT if self.cfg.pv8 else ROW_LAYOUT)
                self.write_out(acc, inv, stage.at[1], o_dst)
                plgpu.wait_smem_to_gmem(0)

        @pl.when(self.has_out)
        def _():
            plgpu.barrier_arrive(r["epi_bar"])
            plgpu.barrier_wait(r["epi_bar"])
            plgpu.barrier_wait(r["fin_bar"])  # WG0 has written 1/l
            fin, part = self.out_dsts(pl.ds(half, half))
            pl.when(self.final)(lambda: epilogue(*fin, True))
            pl.when(self.partial)(lambda: epilogue(*part, self.n > 0))


def _logits_waited(issue):
    """[64, G] f32: the wgmmas `issue(acc_ref)` issues into a fresh zero accumulator, waited for."""

    def chain(acc_ref):
        issue(acc_ref)
        return acc_ref[...]

    return pl.run_scoped(chain, plgpu.ACC((TILE_M, PAGE_SIZE), jnp.float32))


def _body(cfg, r, pc):
    """One page at a time: WG0 runs QK^T, the softmax and P.V for columns [0, L/2); WG1 waits for
    P and runs P.V for [L/2, L); the producer keeps the next page in flight (the ring's slots: `_Slots`)."""
    wg = lax.axis_index("wg")
    g = PAGE_SIZE
    half = cfg.l // 2
    stages = cfg.stages
    is_fp8 = cfg.fp8_stages > 0
    n = pc.n
    ring, loop_rows, p_smem = r["ring"], r["loop_rows"], r["p_smem"]
    slots = _Slots(cfg)
    p_ready, p_consumed = r["p_ready"], r["p_consumed"]
    fst = cfg.fp8_stages

    def slot_of(i, depth):
        return lax.rem(i, jnp.int32(depth))

    def ready(grp, i):
        return r[f"kv_ready{grp}"].at[slot_of(i, stages)]

    def consumed(grp, i):
        return r[f"kv_consumed{grp}"].at[slot_of(i, stages)]

    def release(who, i):
        """Consumer `who` is done reading page i's slot."""
        for grp in slots.groups:
            if who in slots.releasers[grp]:
                plgpu.barrier_arrive(consumed(grp, i))

    def cast_fp8(fslot, slot_i, valid_rows, chunks):
        """The exact fp8 -> wgmma-dtype cast of 64-column chunks of the fp8 slot into the ring
        slot, rows past the length zeroed (p = 0 there, but 0 * NaN garbage would poison P.V)."""
        with jax.named_scope("convert"):
            for (c0, w, _), buf in zip(slots.parts, ring, strict=True):
                part = [c - c0 // 64 for c in chunks if c0 <= 64 * c < c0 + w]
                if part:
                    cast_fp8_columns(r["fp8_ring"].at[fslot, :, pl.ds(c0, w)], buf.at[slot_i], valid_rows, part)
            plgpu.commit_smem()  # generic reads/writes before the next TMA / the wgmmas

    @pl.when(wg == 0)
    def _softmax_wg():
        plgpu.set_max_registers(_regs(is_fp8)[0], action="increase")

        pc.load_q()
        logit_scale = pc.logit_scale()
        lens = pc.row_lens()
        col_layout = plgpu.Layout.WGMMA.reduce(0)

        def wait_kv(i, grp=0):
            with jax.named_scope("wait_kv"):
                plgpu.barrier_wait(ready(grp, i))

        def issue_qk(s_ref, i):
            """Page i's QK^T, a wgmma a part, each group's after its wait (group 0's: `wait_kv` before)."""
            slot = slot_of(i, stages)
            for grp in slots.groups:
                if grp:
                    wait_kv(i, grp)
                for c0, w, pg in slots.parts:
                    if pg == grp:
                        plgpu.wgmma(s_ref, r["q_smem"].at[:, pl.ds(c0, w)], slots.view(ring, slot, c0, w).T)

        def logits_of(issue, i):
            """[64, G] f32: `issue(s_ref, i)`'s logits, waited for."""
            with jax.named_scope("qk"):
                return _logits_waited(lambda s_ref: issue(s_ref, i))

        def softmax_and_p(i, s, m_i, l_i):
            """Page i's logits s -> P (and alpha) in shared memory for WG1; (alpha, m, l) after it and WG0's own P.V
            operand: P's registers (the register-operand wgmma: 1.2-2.0% off the 128-head rows against the
            shared-memory copy, H100, session 42), the copy in the interpreter, which has no register operand."""
            slot_i = slot_of(i, stages)
            with jax.named_scope("softmax"):
                if is_fp8:  # logits of the fp8 rows times their per-token scale
                    ks = plgpu.load(loop_rows.at[_ROWS + slot_i], layout=col_layout)
                    ks = lax.broadcast_in_dim(ks, s.shape, [1])
                    s = s * ks
                s = pc.logits(s, i, logit_scale, lens)
                m_new, alpha, p, l_i = softmax_step(s, m_i, l_i)

            @pl.when(i > 0)
            @jax.named_scope("wait_p_consumed")
            def _():
                plgpu.barrier_wait(p_consumed)  # WG1 is done with P_{i-1} and alpha_{i-1}

            with jax.named_scope("store_p"):
                # V = fp8 row * scale: fold the per-token scale into p.
                pb = (p * ks if is_fp8 else p).astype(BF16)
                p_smem[...] = pb
                loop_rows[_ROW_ALPHA] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready)
            return alpha, m_new, l_i, p_smem if cfg.interpret else pb

        def step(i, carry):
            acc, m_i, l_i = carry
            wait_kv(i)
            alpha, m_new, l_new, p_a = softmax_and_p(i, logits_of(issue_qk, i), m_i, l_i)
            with jax.named_scope("pv"):
                acc = acc * rows_bcast(alpha, acc.shape)
                v = slots.view(ring, slot_of(i, stages), 0, half)
                acc = wgmma_accumulate(acc, p_a, v, interpret=cfg.interpret)
            release(0, i)
            return acc, m_new, l_new

        acc, m_i, l_i = lax.fori_loop(0, n, step, softmax_state(TILE_M, cfg.l // 2))
        pl.when(n > 0)(lambda: plgpu.barrier_wait(p_consumed))  # its last phase too
        pc.epilogue_wg0(acc, m_i, l_i)

    @pl.when(wg == 1)
    def _pv_wg():
        plgpu.set_max_registers(_regs(is_fp8)[0], action="increase")

        def step(i, acc):
            slot_i = slot_of(i, stages)
            if is_fp8:
                # WG1 casts its own V half (columns [L/2, L)), the producer the rest: the cast, not the
                # wgmmas, bounds the fp8 page time, and only WG1's P.V reads this half (WG0's QK^T waits for
                # both casts).
                fslot = slot_of(i, fst)
                with jax.named_scope("wait_fp8"):
                    plgpu.barrier_wait(r["fp8_ready"].at[fslot])
                cast_fp8(fslot, slot_i, pc.page_rows(i), range(half // 64, cfg.l // 64))
                plgpu.barrier_arrive(ready(slots.wg1_group, i))
                plgpu.barrier_arrive(r["fp8_consumed"].at[fslot])
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(p_ready)
            else:
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(ready(slots.wg1_group, i))
                    plgpu.barrier_wait(p_ready)
            with jax.named_scope("pv"):
                alpha = plgpu.load(loop_rows.at[_ROW_ALPHA], layout=ROW_LAYOUT)
                acc = acc * rows_bcast(alpha, acc.shape)
                v = slots.view(ring, slot_i, half, half)
                acc = wgmma_accumulate(acc, p_smem, v, interpret=cfg.interpret)
            plgpu.barrier_arrive(p_consumed)
            release(1, i)
            return acc

        acc = lax.fori_loop(0, n, step, softmax_state(TILE_M, cfg.l // 2)[0])
        pc.epilogue_wg1(acc)

    @pl.when(wg == 2)
    def _producer_wg():
        plgpu.set_max_registers(_regs(is_fp8)[1], action="decrease")

        def wait_free(grp, i):
            @pl.when(i >= stages)
            @jax.named_scope("wait_free")
            def _():
                plgpu.barrier_wait(consumed(grp, i))

        if not is_fp8:

            def step(i, _):
                slot_i = slot_of(i, stages)
                for grp in slots.groups:
                    wait_free(grp, i)
                    for (c0, w, pg), buf in zip(slots.parts, ring, strict=True):
                        if pg == grp:
                            pc.copy_page(i, buf.at[slot_i], ready(grp, i), pl.ds(c0, w))
                return ()

            lax.fori_loop(0, n, step, ())
        else:
            fp8_ring, scale_ring = r["fp8_ring"], r["scale_ring"]
            fp8_ready, scale_ready = r["fp8_ready"], r["scale_ready"]
            mine, my_groups = slots.producer_chunks, slots.producer_groups

            def fetch(i):
                fslot = slot_of(i, fst)
                page = pc.page_id(i)
                plgpu.copy_gmem_to_smem(r["kv_gmem"].at[page], fp8_ring.at[fslot], fp8_ready.at[fslot])
                plgpu.copy_gmem_to_smem(r["ks_gmem"].at[page], scale_ring.at[fslot], scale_ready.at[fslot])

            for j in range(fst):
                pl.when(j < n)(functools.partial(fetch, jnp.int32(j)))

            def step(i, _):
                fslot = slot_of(i, fst)
                slot_i = slot_of(i, stages)
                with jax.named_scope("wait_fp8"):
                    plgpu.barrier_wait(fp8_ready.at[fslot])
                    plgpu.barrier_wait(scale_ready.at[fslot])
                for grp in my_groups:
                    wait_free(grp, i)

                valid_rows = pc.page_rows(i)
                # Per-token scales for WG0 (0 past the length: p * scale must stay 0 next to garbage).
                scale = plgpu.load(scale_ring.at[fslot], layout=ROW_LAYOUT)  # [G] f32
                tok = plgpu.broadcasted_iota(jnp.int32, (g,), 0, layout=ROW_LAYOUT)
                loop_rows[_ROWS + slot_i] = jnp.where(tok < valid_rows, scale, 0.0)
                cast_fp8(fslot, slot_i, valid_rows, mine)
                for grp in my_groups:
                    plgpu.barrier_arrive(ready(grp, i))
                # WG1's cast must be done with the fp8 slot too (waited on every page: each waiter observes every
                # phase)
                plgpu.barrier_arrive(r["fp8_consumed"].at[fslot])
                with jax.named_scope("wait_qk"):
                    plgpu.barrier_wait(r["fp8_consumed"].at[fslot])
                pl.when(i + fst < n)(lambda: fetch(i + fst))
                return ()

            lax.fori_loop(0, n, step, ())
        for grp in slots.groups:
            if slots.releasers[grp]:
                _drain(r[f"kv_consumed{grp}"], n, stages)


def _pairs_prologue(pc, w):
    """Consumer w of a pairs body before its loop: its registers, Q (WG0's TMA, waited for by both where the piece has
    pages); (the logits' scale, the rows' lengths)."""
    plgpu.set_max_registers(_REGS_PV8[w], action="increase")
    if w == 0:
        pc.load_q()
    else:
        pl.when(pc.n > 0)(lambda: plgpu.barrier_wait(pc.r["q_bar"]))
    return pc.logit_scale(), pc.row_lens()


def _other_max(pc, w, top):
    """The pair's maxima exchanged: consumer w's row max `top` to shared memory, the two consumers meet (`mx_ready`),
    the other's read back (row layout). Each reads the other's before it arrives at its p_ready, which the other waits
    for before it writes its next."""
    loop_rows = pc.r["loop_rows"]
    loop_rows[_ROW_MX + w] = top
    plgpu.commit_smem()
    plgpu.barrier_arrive(pc.r["mx_ready"])
    plgpu.barrier_wait(pc.r["mx_ready"])
    return plgpu.load(loop_rows.at[_ROW_MX + 1 - w], (), layout=ROW_LAYOUT)


def _pairs_loop(n, pair, carry):
    """`carry` through the piece's pairs of pages (`pair(k, carry, whole=True)`), then its odd page's pair of one."""
    pairs = lax.div(n, 2)
    carry = lax.fori_loop(0, pairs, functools.partial(pair, whole=True), carry)
    return lax.cond(lax.rem(n, 2) == 1, lambda c: pair(pairs, c, whole=False), lambda c: c, carry)


def _pairs_epilogue(pc, w, acc, m_i, l_i):
    """Consumer w of a pairs body after its loop: WG1 hands its l to WG0 (in the row of Q's scales, which both read
    before the first pair's rendezvous; unused with a bf16 cache), WG0 adds it; then each consumer's epilogue."""
    r, n, loop_rows = pc.r, pc.n, pc.r["loop_rows"]
    if w == 1:

        @pl.when(n > 0)
        def _():
            loop_rows[_ROW_QSCALE] = l_i
            plgpu.commit_smem()
            plgpu.barrier_arrive(r["l_ready"])

        pc.epilogue_wg1(acc)
    else:

        def add_wg1s():
            plgpu.barrier_wait(r["l_ready"])
            return l_i + plgpu.load(loop_rows.at[_ROW_QSCALE], (), layout=ROW_LAYOUT)

        pc.epilogue_wg0(acc, m_i, lax.cond(n > 0, add_wg1s, lambda: l_i))


def _body_pairs16(cfg, r, pc):
    """The bf16 kernel with its pages in pairs, one a consumer (the fp8 P.V body's schedule on bf16 pages,
    `BF16_PAIRS`): consumer w runs QK^T and the softmax of page 2k + w (ring slot w) and stores its P in the page's
    rope buffer once its QK^T is done with it; each consumer then adds both pages' P.V to its half of O (latents
    [w L/2, (w + 1) L/2)), its own page's with P from its registers. A slot is three buffers (the two latent halves,
    the rope) with a barrier pair each, so the next pair's loads start as each is released: a half by its P.V's
    consumer, the rope by both; each consumer's QK^T takes its own half first (the part it released first). The
    running max is exchanged once a pair as in `_body_pv8`; a piece with an odd number of pages ends on a pair of
    one (WG1 brings no page)."""
    wg = lax.axis_index("wg")
    half, l = cfg.l // 2, cfg.l
    f32 = jnp.float32
    n = pc.n
    halves, pe, p_ready = r["halves"], r["pe"], r["p_ready"]
    readies, frees = (r["lo_ready"], r["hi_ready"]), (r["lo_free"], r["hi_free"])

    def consumer(w):
        o = 1 - w
        logit_scale, lens = _pairs_prologue(pc, w)

        def logits(i):
            """Own page i's (ring slot w) scaled logits [64, G], log2 units, -inf past each row's length."""

            def issue(s_ref):
                for part in (w, o):  # own half first: the part this consumer released first
                    with jax.named_scope("wait_kv"):
                        plgpu.barrier_wait(readies[part].at[w])
                    plgpu.wgmma(s_ref, r["q_smem"].at[:, pl.ds(part * half, half)], halves[part][w].T)
                with jax.named_scope("wait_kv"):
                    plgpu.barrier_wait(r["pe_ready"].at[w])
                plgpu.wgmma(s_ref, r["q_smem"].at[:, pl.ds(l, cfg.d - l)], pe[w].T)

            with jax.named_scope("qk"):
                s = _logits_waited(issue)
            with jax.named_scope("softmax"):
                return pc.logits(s, i, logit_scale, lens)

        def exchange_max(top, m_i):
            """m = max(m, this consumer's row max `top`, the other's) of the pair, the same in both consumers."""
            with jax.named_scope("mx"):
                other = _other_max(pc, w, top)
            return jnp.maximum(m_i, jnp.maximum(top, other))

        def pv(acc, slot, a):
            """acc + P V of the page in `slot` over this consumer's half (P: `a`), then that half's and the rope's
            (P's) release."""
            with jax.named_scope("pv"):
                acc = wgmma_accumulate(acc, a, halves[w][slot], interpret=cfg.interpret)
            plgpu.barrier_arrive(frees[w].at[slot])
            plgpu.barrier_arrive(r["pe_free"].at[slot])
            return acc

        def pair(k, carry, *, whole):
            """Pair k (pages 2k in slot 0, 2k + 1 in slot 1; whole=False: page 2k alone)."""
            acc, m_i, l_i = carry
            mine = whole or w == 0
            if mine:
                s = logits(2 * k + w if w else 2 * k)  # (no `+ 0`: Mosaic GPU's lowering folds it to a Python int)
                top = s.max(axis=1)
            else:
                top = plgpu.layout_cast(jnp.full((TILE_M,), -jnp.inf, f32), ROW_LAYOUT)
            m_new = exchange_max(top, m_i)
            alpha = jnp.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * rows_bcast(alpha, acc.shape)
            if mine:
                with jax.named_scope("softmax"):
                    p = jnp.exp2(s - rows_bcast(m_new, s.shape))
                    l_i = l_i + p.sum(axis=1)
                with jax.named_scope("store_p"):
                    pb = p.astype(BF16)
                    pe[w][...] = pb  # QK^T is done with the rope: P takes its buffer
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[w])
                # Own page's P.V with P from registers (the interpreter has no register operand: the copy).
                acc = pv(acc, w, pe[w] if cfg.interpret else pb)
            if whole or w == 1:  # the other consumer's page (slot o)
                with jax.named_scope("wait_kv"):
                    plgpu.barrier_wait(readies[w].at[o])
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(p_ready.at[o])
                acc = pv(acc, o, pe[o])
            return acc, m_new, l_i

        acc, m_i, l_i = _pairs_loop(n, pair, softmax_state(TILE_M, half))
        _pairs_epilogue(pc, w, acc, m_i, l_i)

    def producer():
        """Each page's three parts TMA'd into its slot (a partial last page's rows past the length zeroed), the next
        pair's parts each as soon as its last reader releases it, in the order the consumers release them: each
        consumer's P.V of its own page first (slot 0's lo, slot 1's hi), then of the other's, then both ropes."""
        plgpu.set_max_registers(_REGS_PV8[2], action="decrease")
        parts = (
            (halves[0], r["lo_ready"], r["lo_free"], 0),
            (halves[1], r["hi_ready"], r["hi_free"], half),
            (pe, r["pe_ready"], r["pe_free"], l),
        )
        order = ((0, 0), (1, 1), (0, 1), (1, 0), (0, 2), (1, 2))  # (slot = page of the pair, part)

        def fetch(i, slot, part):
            buf, ready, _, c0 = parts[part]
            pc.copy_page(i, buf[slot], ready.at[slot], pl.ds(c0, buf[slot].shape[-1]))

        for slot, part in order:
            pl.when(slot < n)(functools.partial(fetch, jnp.int32(slot), slot, part))

        def step(k, _):
            for slot, part in order:  # pair k's release, part by part, then pair k + 1's part into its place
                i = 2 * k + slot if slot else 2 * k  # (no `+ 0`: see `pair`)

                @pl.when(i < n)
                def _():
                    with jax.named_scope("wait_free"):
                        plgpu.barrier_wait(parts[part][2].at[slot])
                    pl.when(i + 2 < n)(functools.partial(fetch, i + 2, slot, part))

            return ()

        lax.fori_loop(0, lax.div(n + 1, 2), step, ())

    pl.when(wg == 0)(lambda: consumer(0))
    pl.when(wg == 1)(lambda: consumer(1))
    pl.when(wg == 2)(producer)


def _vt_half(cfg, r, fslot, h):
    """The fp8 P.V body: this consumer's V^T [L/2, G] from fp8 slot `fslot` (latents [h L/2, (h + 1) L/2)), then
    the slot's release as far as this warpgroup's reads go."""
    half = cfg.l // 2
    with jax.named_scope("vt"):
        vt = vt_fp8_operand(
            r["fp8_ring"].at[fslot, :, pl.ds(h * half, half)],
            r["ring16"].at[fslot, :, pl.ds(h * half // 2, half // 2)],
            interpret=cfg.interpret,
        )
    plgpu.commit_smem()  # the generic-proxy reads before the next TMA into the slot
    plgpu.barrier_arrive(r["fp8_consumed"].at[fslot])
    return vt


def _pv8_producer(cfg, r, pc):
    """The fp8 P.V body's producer: each page and its token scales TMA'd into the `fp8_stages` ring (a partial last
    page's rows past the length zeroed: V's bytes feed P.V), the next page once both consumers release a slot."""
    plgpu.set_max_registers(_REGS_PV8[2], action="decrease")
    fst = cfg.fp8_stages

    def slot_of(i):
        return lax.rem(i, jnp.int32(fst))

    def fetch(i):
        fslot = slot_of(i)
        plgpu.copy_gmem_to_smem(r["ks_gmem"].at[pc.page_id(i)], r["scale_ring"].at[fslot], r["scale_ready"].at[fslot])
        pc.copy_page(i, r["fp8_ring"].at[fslot], r["fp8_ready"].at[fslot])

    for j in range(fst):
        pl.when(j < pc.n)(functools.partial(fetch, jnp.int32(j)))

    def step(i, _):
        with jax.named_scope("wait_free"):
            plgpu.barrier_wait(r["fp8_consumed"].at[slot_of(i)])  # every phase, in order
        pl.when(i + fst < pc.n)(lambda: fetch(i + fst))
        return ()

    lax.fori_loop(0, pc.n, step, ())


def _body_pv8(cfg, r, pc):
    """The fp8 P.V kernel, its pages in pairs: consumer w (WG0, WG1) runs QK^T (every term of q), the softmax and
    the P^T store of page 2k + w, so the two softmaxes of a pair run side by side; each consumer then adds both
    pages' V^T P^T to its half of O^T (latents [w L/2, (w + 1) L/2)). FlashMLA's seesaw on fp8 pages: 4 fp8 slots
    hold the next pair while this one runs (the bf16 seesaw lost with two 72 KB slots, pairs holding both;
    docs/perf-notes.md). One page at a time (WG0 every page's QK^T and softmax, WG1 P.V's second half only) took
    119.7 / 441.6 us against the pairs' 112.1 / 413.0 at 64x128x4096 / 128x128x8192 with one term of q (H100,
    session 41; 1x128x32768 26.8 against 27.2); with two terms the pairs lost (196.7 / 687.3 against 171.2 / 629.9,
    the residual's chain then on WG1), and one body serves both.

    One running max for both: each consumer's logits' row max goes to shared memory, the two are exchanged
    (`mx_ready`, a rendezvous a pair) and each takes m = max(m, both), the same value in both consumers (max is
    exact), so alpha and P'' = exp2(s + log2 scale - m) agree; each sums its own pages' p into its own l, and WG0 adds
    WG1's after the loop (both rescaled by the same alphas). A piece with an odd number of pages ends on a pair of
    one (WG1 brings no page: its max is -inf, it adds page 2k's P.V only)."""
    wg = lax.axis_index("wg")
    half = cfg.l // 2
    fst = cfg.fp8_stages
    f32 = jnp.float32
    n = pc.n
    fp8_ring, scale_ring = r["fp8_ring"], r["scale_ring"]
    loop_rows, p_smem = r["loop_rows"], r["p_smem"]
    fp8_ready, scale_ready = r["fp8_ready"], r["scale_ready"]
    p_ready, p_consumed = r["p_ready"], r["p_consumed"]

    def slot_of(i):
        return lax.rem(i, jnp.int32(fst))

    def consumer(w):
        o = 1 - w
        logit_scale, lens = _pairs_prologue(pc, w)

        def logits(i):
            """Page i's scaled logits [64, G] (log2 units, -inf past each row's length), its token scales as
            columns (0 past the page's rows) and their log2."""
            fslot = slot_of(i)
            with jax.named_scope("wait_kv"):
                plgpu.barrier_wait(fp8_ready.at[fslot])
                plgpu.barrier_wait(scale_ready.at[fslot])
            with jax.named_scope("qk"):

                def issue(acc_ref):
                    for term in range(cfg.q_terms):
                        plgpu.wgmma(acc_ref, r["q_smem"].at[:, pl.ds(term * cfg.d, cfg.d)], fp8_ring.at[fslot].T)

                s = _logits_waited(issue)
            with jax.named_scope("softmax"):
                s, ks = pc.fp8_logits(s, i, scale_ring.at[fslot], logit_scale, lens)
            return s, lax.broadcast_in_dim(ks, s.shape, [1]), jnp.log2(ks)

        def exchange_max(top, m_i, m_i_col):
            """m = max(m, this consumer's row max `top`, the other's) of the pair, as rows and as columns (alpha
            scales O^T's columns): the same values in both consumers (max is exact)."""
            with jax.named_scope("mx"):
                other = _other_max(pc, w, top)
                plgpu.commit_smem()  # (a side effect between: MLIR would fold the two loads of a row into one)
                cols = [plgpu.load(loop_rows.at[_ROW_MX + j], (), layout=COL_LAYOUT) for j in range(2)]
            return jnp.maximum(m_i, jnp.maximum(top, other)), jnp.maximum(m_i_col, jnp.maximum(*cols))

        def pv(acc, i, who):
            """acc + V^T P^T of page i (P^T of consumer `who`) for this consumer's latents."""
            fslot = slot_of(i)
            if who != w:
                with jax.named_scope("wait_kv"):
                    plgpu.barrier_wait(fp8_ready.at[fslot])
            vt = _vt_half(cfg, r, fslot, w)
            if who != w:
                with jax.named_scope("wait_p"):
                    plgpu.barrier_wait(p_ready.at[who])
            with jax.named_scope("pv"):
                acc = vt_accumulate(acc, vt, p_smem[who], interpret=cfg.interpret)
            if who != w:
                plgpu.barrier_arrive(p_consumed.at[who])
            return acc

        def pair(k, carry, *, whole):
            """Pair k (pages 2k, 2k + 1; whole=False: page 2k alone)."""
            acc, m_i, m_i_col, l_i = carry
            mine = whole or w == 0
            i = 2 * k + w if w else 2 * k  # (no `+ 0`: Mosaic GPU's lowering folds it to a Python int)
            if mine:
                s, ks_b, shift = logits(i)
                top = (s + lax.broadcast_in_dim(shift, s.shape, [1])).max(axis=1)
            else:
                top = plgpu.layout_cast(jnp.full((TILE_M,), -jnp.inf, f32), ROW_LAYOUT)
            m_new, m_new_col = exchange_max(top, m_i, m_i_col)
            l_i = l_i * jnp.exp2(m_i - m_new)
            if mine:
                with jax.named_scope("softmax"):
                    p = jnp.exp2(s - rows_bcast(m_new, s.shape))
                    l_i = l_i + p.sum(axis=1)

                @pl.when(k > 0)
                @jax.named_scope("wait_p_consumed")
                def _():
                    plgpu.barrier_wait(p_consumed.at[w])  # the other consumer is done with this one's last P^T

                with jax.named_scope("store_p"):
                    p_smem[w][...] = pt_fp8_operand((p * ks_b).astype(FP8), interpret=cfg.interpret)
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[w])
            acc = acc * lax.broadcast_in_dim(jnp.exp2(m_i_col - m_new_col), acc.shape, [1])  # alpha a column
            if mine:
                acc = pv(acc, i, w)
            if whole or w == 1:
                acc = pv(acc, 2 * k + o if o else 2 * k, o)
            return acc, m_new, m_new_col, l_i

        acc0 = plgpu.layout_cast(jnp.zeros((half, TILE_M), f32), plgpu.Layout.WGMMA)  # O^T [L/2, 64]
        _, m_0, l_0 = softmax_state(TILE_M, 64)
        m_0_col = plgpu.layout_cast(jnp.full((TILE_M,), M_INIT, f32), COL_LAYOUT)
        acc, m_i, _, l_i = _pairs_loop(n, pair, (acc0, m_0, m_0_col, l_0))
        # This consumer's P^T: its last phase (the other consumer's reads of it) too.
        mine_count = lax.div(n + 1 - w, 2)
        pl.when(mine_count > 0)(lambda: plgpu.barrier_wait(p_consumed.at[w]))
        _pairs_epilogue(pc, w, acc, m_i, l_i)

    pl.when(wg == 0)(lambda: consumer(0))
    pl.when(wg == 1)(lambda: consumer(1))
    pl.when(wg == 2)(functools.partial(_pv8_producer, cfg, r, pc))


# The bf16 body's ring slots in three buffers, two barrier groups (`_Slots`): the next page's WG0 latents and rope
# land once WG0's P.V is done, without waiting for WG1's, and WG0's next QK^T starts on them. The bf16 trace (H100,
# session 42) has WG0 wait 0.42 us of a 3.42 us page for it while the producer waits for a free slot 73% of its time.
# Built, off until measured (gpu_session part 115).
SPLIT_SLOTS = False

# The bf16 kernel's pages in pairs, one a consumer (`_body_pairs16`): each consumer warpgroup runs its own page's QK^T
# and softmax, then both pages' P.V on its half of the latents (the fp8 P.V body's schedule, 0.94x one page at a time
# on fp8 pages, session 41), where one page at a time leaves WG1 waiting for P ~70% of its time. Two slots (Q 72 KB
# + 2 x 72 KB) leave no room for the next pair in flight: each slot's parts are released and reloaded one by one.
# Built, off until measured (gpu_session part 117).
BF16_PAIRS = False

# (WG0, WG1, producer) registers a thread of the fp8 P.V kernel: each consumer holds an O^T [L/2, 64] f32 half; the
# producer only issues TMAs (and zeroes a partial page). Three consumers (WG0 QK^T and the softmax only) lost: 121.8
# against 112.6 us at 64x128x4096, 142.7 with the next page's QK^T in flight during the softmax (H100, session 38).
_REGS_PV8 = (232, 232, 40)


def _pairs16(is_fp8: bool, num_stages: int, l: int, d: int) -> bool:
    """Whether the bf16 pairs body runs: `BF16_PAIRS`, a bf16 cache, its two slots (num_stages 2), a rope as wide
    as a page (P [64, G] takes the rope's buffer) and halves one wgmma wide."""
    return BF16_PAIRS and not is_fp8 and num_stages == 2 and d - l == PAGE_SIZE == TILE_M and l // 2 <= 256


def _drain(kv_consumed, n, stages):
    """Wait for the consumers' last release of every used slot: each waiter observes every phase."""

    def body(i, _):
        plgpu.barrier_wait(kv_consumed.at[lax.rem(i, jnp.int32(stages))])
        return ()

    lax.fori_loop(jnp.maximum(n - stages, 0), n, body, ())


def _regs(is_fp8):
    """(consumer, producer) registers per thread. The CTA holds what it was launched with,
    384 threads x 168 = 64512, so 2 x 128 x consumer + 128 x producer <= 64512. Consumers hold a
    [64, L/2] f32 accumulator (128) plus the [64, 64] logits and still spill (ptxas); the fp8
    producer casts V's first half, WG1 its second. Kernel time at 64x128x4096 on the H200: bf16 (224, 56)
    175 us, 180 B spilled, (232, 40) 139 us, 132 B (session 18); fp8 exact (208, 88) 344 us, (216, 72)
    327, (200, 104) 385 (session 19; docs/perf-notes.md)."""
    return (216, 72) if is_fp8 else (232, 40)


def _rows_per_tile(cfg):
    """Rows per head tile in the output arrays: 64, or the single tile's real rows (N=16: 16)."""
    return TILE_M if cfg.head_tiles > 1 else cfg.tail


def choose_num_kv_splits_sm90(
    batch: int,
    head_tiles: int,
    max_pages: int,
    num_sms: int,
    *,
    cta_overhead_pages: float = 2.0,
    merge_cost: float = 0.25,
) -> int:
    """Static split count: minimize a makespan model over the SMs (one 225 KB CTA per SM).

    T(S) = waves(S) * (ceil(pages / S) + c0) + c1 * S * B * head_tiles / SMs, in page-times: c0 is
    the per-CTA fixed cost (Q load, pipeline fill, the [64, L] partial write: ~2 pages), c1 the
    merge cost per partial. With uniform lengths this picks S so that B * head_tiles * S fills whole
    waves: (1,128,32768) -> 64-66 splits of 8 pages; (64,16,4096) -> 2; (128,128,8192) -> 1.
    Its tuning variants are timed by bench/decode.py --sweep.
    """
    ctas = max(1, batch * head_tiles)
    best, best_t = 1, None
    for s in range(1, max(1, min(max_pages, 2 * num_sms)) + 1):
        pps = cdiv(max_pages, s)
        s_eff = cdiv(max_pages, pps)
        waves = cdiv(ctas * s_eff, num_sms)
        t = waves * (pps + cta_overhead_pages) + merge_cost * s_eff * ctas / num_sms * (s_eff > 1)
        if best_t is None or t < best_t - 1e-9:
            best, best_t = s_eff, t
    return int(best)


def _validate_sm90(
    q,
    cache,
    block_table,
    seq_lens,
    kv_scale,
    kv_lora_rank,
    num_kv_splits,
    scale,
    num_stages,
    fp8_stages,
    sms,
    interpret,
    schedule,
):
    validate_decode(
        q,
        cache,
        block_table,
        seq_lens,
        kv_scale,
        kv_lora_rank,
        num_kv_splits,
        scale,
        None,
        None,
        None,
        None,
        for_kernel=False,
    )
    l = kv_lora_rank
    d = q.shape[-1]
    if l % 128 or l > 512:
        raise ValueError(
            f"kv_lora_rank must be a multiple of 128 and <= 512 (two consumer warpgroups "
            f"of <= 256 wgmma columns), got {kv_lora_rank}"
        )
    if (d - l) % 64:
        raise ValueError(f"rope dim (q last dim {d} - kv_lora_rank {l}) must be a multiple of 64")
    if cache.shape[1] != PAGE_SIZE:
        raise ValueError(
            f"kv_c_and_k_pe_cache page size G={cache.shape[1]} is not supported by the "
            f"sm90 kernel (G={PAGE_SIZE} only); use pallas_kernels.mla_decode"
        )
    if block_table.shape[1] * PAGE_SIZE >= 2**24:
        raise ValueError(
            f"block_table width {block_table.shape[1]} x page size {PAGE_SIZE} exceeds "
            "2^24 tokens (row lengths travel as exact float32)"
        )
    if jnp.dtype(cache.dtype) not in (BF16, FP8):
        raise ValueError(
            f"kv_c_and_k_pe_cache dtype must be bfloat16 or float8_e4m3fn for the sm90 kernel, got {cache.dtype}"
        )
    if num_stages is not None and not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages must be a positive int, got {num_stages}")
    if fp8_stages is not None and not (isinstance(fp8_stages, int) and fp8_stages >= 1):
        raise ValueError(f"fp8_stages must be a positive int, got {fp8_stages}")
    if sms is not None and not (isinstance(sms, int) and sms >= 1):
        raise ValueError(f"num_sms must be a positive int, got {sms}")
    if schedule not in (None, "grid", "worklist"):
        raise ValueError(f"schedule must be None, 'grid' or 'worklist', got {schedule!r}")
    if schedule == "worklist" and num_kv_splits is not None:
        raise ValueError("num_kv_splits applies to schedule='grid'; the work list sizes its pieces")
    check_interpreter_workers(interpret)


def worklist_slots(num_sms: int) -> int:
    """Partial-output slots of the work-list schedule. A tile is split only when it is longer than the target
    (`_worklist_cuts`), into k = ceil(pages / target) < 2 pages / target pieces, so the split pieces number
    fewer than 2 total / target <= 3 SMs (one wave's: at most SMs)."""
    return 3 * num_sms


# Targets as (num, den): pieces of at most den * total pages / (num * SMs), ratios for exact integer arithmetic.
_WORKLIST_PIECES_PER_SM = (3, 2)  # many waves: target = total / (1.5 SMs)
_WORKLIST_ONE_WAVE = (8, 9)  # one wave: target = 1.125 total / SMs, taken when its pieces fit on the SMs


def _worklist_cuts(pages, num_sms: int, min_pages: int, real=None):
    """Pieces per head tile. One wave where it fits: k = ceil(pages / target), target = 1.125 total pages /
    SMs, when the pieces number at most SMs (every piece on its own SM, none longer than 1.125 the fair
    share: a near-uniform batch, cut as the grid cuts it and no more, so a batch of equal requests no
    longer than its fair share is not split or merged at all). Otherwise many waves: target = total /
    (1.5 SMs), so the SMs get 1.5 target-sized pieces each and the block scheduler evens out what the long
    tiles leave (a model of its list scheduling over a ragged batch, docs/perf-notes.md session 27:
    1.04-1.10x uniform, against 1.15-1.35x for pieces of round(pages / (total / SMs)), the rule measured
    at 1.18x on the H100). Both clip k to [1, max(pages, 1)] and keep pieces >= min_pages where the tile is.
    i32 pages [BT] -> i32 k [BT]; `real` bool[BT] (None: all) marks the tiles that count (the kernel's
    power-of-two padding does not).

    Exact integer arithmetic, target = a / b with b = num SMs, a = max(den total, b min_pages): k =
    floor((pages b + a - 1) / a). A float32 target and division would make exact multiples depend on
    the backend (XLA turns divisions into reciprocal multiplies; the GPU's reciprocal is div.full, 2 ulp);
    the work-list kernel and its reference must agree bit for bit. Operands are non-negative (lax.div =
    floor) and stay below 2^31 (`_check_worklist_bounds`). The plain-JAX reference and the kernel both
    call it."""
    total = jnp.sum(pages)

    def cuts(num, den):
        b = num * num_sms
        a = jnp.maximum(den * total, b * min_pages)
        return jnp.clip(lax.div(pages * b + a - 1, a), 1, jnp.maximum(pages, 1))

    one = cuts(*_WORKLIST_ONE_WAVE)
    counted = one if real is None else jnp.where(real, one, 0)
    return jnp.where(jnp.sum(counted) <= num_sms, one, cuts(*_WORKLIST_PIECES_PER_SM))


def _worklist_bound(num_tiles: int, max_pages: int, num_sms: int, min_pages: int) -> int:
    """A bound on the work list's i32 intermediates (`_worklist_cuts`, piece bounds i * pages)."""
    num = max(_WORKLIST_PIECES_PER_SM[0], _WORKLIST_ONE_WAVE[0])
    den = max(_WORKLIST_PIECES_PER_SM[1], _WORKLIST_ONE_WAVE[1])
    return max_pages * (num * num_sms + den * num_tiles + worklist_slots(num_sms)) + num * num_sms * min_pages


def _check_worklist_bounds(num_tiles: int, max_pages: int, num_sms: int, min_pages: int):
    """The work list's i32 arithmetic stays below 2^31."""
    if min_pages < 1 or num_sms < 1:
        raise ValueError(f"work list: min_pages ({min_pages}) and num_sms ({num_sms}) must be >= 1")
    bound = _worklist_bound(num_tiles, max_pages, num_sms, min_pages)
    if bound >= 2**31:
        raise ValueError(
            f"work list: {num_tiles} head tiles x {max_pages} pages per tile overflow its int32 "
            f"arithmetic ({bound} >= 2^31); use schedule='grid'"
        )


def worklist_pieces_reference(tile_len, num_sms: int, min_pages: int):
    """Length-adaptive schedule (the metadata step), plain JAX: each head tile with P pages is cut
    into k equal pieces (`_worklist_cuts`: one wave of pieces <= 1.125 fair shares where they fit on the SMs,
    else pieces <= total / (1.5 SMs); >= min_pages), so long requests spread over many SMs and short ones stay
    whole (no merge). i32 tile_len [B, T] -> (meta i32[B*T + slots, 6]: (b, h, p0, n, slot, tile length)
    per piece, slot -1 for a whole tile, -2 (n = 0) past the last piece; slot_tile i32[slots]: the
    tile of each partial slot or -1). The split pieces always fit the slots (`worklist_slots`)."""
    b, t = tile_len.shape
    nt = b * t
    slots = worklist_slots(num_sms)
    tl = tile_len.reshape(-1)
    pages = (tl + PAGE_SIZE - 1) // PAGE_SIZE  # [BT]
    k = _worklist_cuts(pages, num_sms, min_pages)
    end = jnp.cumsum(k)
    start = end - k
    split = k > 1
    split_start = jnp.cumsum(jnp.where(split, k, 0)) - jnp.where(split, k, 0)
    j = jnp.arange(nt + slots, dtype=jnp.int32)
    tile = jnp.minimum(jnp.searchsorted(end, j, side="right"), nt - 1).astype(jnp.int32)
    i = j - start[tile]
    kt, pg = k[tile], pages[tile]
    p0 = i * pg // kt
    n = (i + 1) * pg // kt - p0
    valid = j < end[-1]
    slot = jnp.where(split[tile], split_start[tile] + i, -1)
    slot = jnp.where(valid, slot, -2)
    meta = jnp.stack([tile // t, tile % t, p0, jnp.where(valid, n, 0), slot, tl[tile]], axis=-1)
    slot_tile = jnp.full((slots,), -1, jnp.int32).at[jnp.where(slot >= 0, slot, slots)].set(tile, mode="drop")
    return meta.astype(jnp.int32), slot_tile


def _worklist_kernel(
    tl_ref,  # i32[BT]
    meta_ref,  # i32[J, 6], J = BT + slots
    slot_tile_ref,  # i32[slots]
    seg_first_ref,  # i32[BT]: first slot of each split tile, else 0
    seg_count_ref,  # i32[BT]: slots of each split tile (its k), else 0
    split_ref,  # i32[R]: the split tiles in order, then BT (`mla_decode.split_tiles_of`)
    marks_ref,  # i32[MP] scratch: 1 where a tile's pieces end
    tile_ref,  # i32[3, BT'] scratch: start piece, first slot, pieces k of each tile
    slot_buf_ref,  # i32[SB] scratch: the tile of each slot
    split_buf_ref,  # i32[RB] scratch: the split tiles, then padding tiles' dummies
    *,
    t: int,
    num_sms: int,
    min_pages: int,
    interpret: bool,
):
    """One program. Prefix sums over the tiles (BT' = next_pow2(BT), padding tiles k = 0), then per
    piece j (J' = next_pow2(J) lanes) its tile = #(tiles ending at or before j), counted as a prefix
    sum of end marks scattered to global scratch; per-tile values are gathered back from scratch.
    Scatters go to distinct addresses (masked-off lanes to their own dummy slots past the live
    range) and a CTA barrier separates a scratch write from its reads."""
    nt = tl_ref.shape[0]
    n_rows = meta_ref.shape[0]
    slots = slot_tile_ref.shape[0]
    bt_pad = tile_ref.shape[1]
    j_pad = next_pow2(n_rows)
    s_pad = next_pow2(slots)
    barrier = (lambda: None) if interpret else pltriton.debug_barrier  # the interpreter runs in order

    u = jnp.arange(bt_pad, dtype=jnp.int32)
    real = u < nt
    tl = pltriton.load(tl_ref.at[jnp.minimum(u, nt - 1)], mask=real, other=0)  # [BT']
    pages = lax.div(tl + PAGE_SIZE - 1, PAGE_SIZE)
    k = jnp.where(real, _worklist_cuts(pages, num_sms, min_pages, real), 0)
    end = jnp.cumsum(k)
    ks = jnp.where(k > 1, k, 0)  # slots of split tiles
    total = jnp.sum(k)
    pltriton.store(marks_ref.at[pl.ds(0, marks_ref.shape[0])], jnp.zeros(marks_ref.shape, jnp.int32))
    pltriton.store(slot_buf_ref.at[pl.ds(0, slot_buf_ref.shape[0])], jnp.full(slot_buf_ref.shape, -1, jnp.int32))
    pltriton.store(tile_ref.at[jnp.int32(0), pl.ds(0, bt_pad)], end - k)
    pltriton.store(tile_ref.at[jnp.int32(1), pl.ds(0, bt_pad)], jnp.cumsum(ks) - ks)
    pltriton.store(tile_ref.at[jnp.int32(2), pl.ds(0, bt_pad)], k)
    pltriton.store(seg_first_ref.at[pl.ds(0, bt_pad)], jnp.where(k > 1, jnp.cumsum(ks) - ks, 0), mask=real)
    pltriton.store(seg_count_ref.at[pl.ds(0, bt_pad)], ks, mask=real)
    r_pad = next_pow2(split_ref.shape[0])
    pltriton.store(split_buf_ref.at[pl.ds(0, split_buf_ref.shape[0])], jnp.full(split_buf_ref.shape, nt, jnp.int32))
    barrier()
    # The r-th split tile at r; unsplit and padding tiles write dummies r_pad + u.
    rank = jnp.cumsum((k > 1).astype(jnp.int32)) - 1
    pltriton.store(split_buf_ref.at[jnp.where(k > 1, rank, r_pad + u)], u)
    # Real tiles end at distinct pieces 1..total (k >= 1); padding tiles mark j_pad + u.
    pltriton.store(marks_ref.at[jnp.where(real, end, j_pad + u)], jnp.ones((bt_pad,), jnp.int32))
    barrier()

    j = jnp.arange(j_pad, dtype=jnp.int32)
    tile = jnp.minimum(jnp.cumsum(pltriton.load(marks_ref.at[pl.ds(0, j_pad)])), nt - 1)  # [J']
    start = pltriton.load(tile_ref.at[jnp.int32(0), tile])
    split_start = pltriton.load(tile_ref.at[jnp.int32(1), tile])
    kt = pltriton.load(tile_ref.at[jnp.int32(2), tile])
    tl_t = pltriton.load(tl_ref.at[tile])
    pg = lax.div(tl_t + PAGE_SIZE - 1, PAGE_SIZE)
    i = j - start  # >= 0: piece i of its tile (past the last piece: of the last tile)
    p0 = lax.div(i * pg, kt)
    valid = j < total
    n = jnp.where(valid, lax.div((i + 1) * pg, kt) - p0, 0)
    slot = jnp.where(valid, jnp.where(kt > 1, split_start + i, -1), -2)
    rows = j < n_rows
    for col, val in enumerate((lax.div(tile, t), lax.rem(tile, t), p0, n, slot, tl_t)):
        pltriton.store(meta_ref.at[pl.ds(0, j_pad), jnp.int32(col)], val, mask=rows)
    # Split pieces own distinct slots < slots; the other pieces write dummies s_pad + j.
    pltriton.store(slot_buf_ref.at[jnp.where(slot >= 0, slot, s_pad + j)], tile)
    barrier()
    st = pltriton.load(slot_buf_ref.at[pl.ds(0, s_pad)])
    pltriton.store(slot_tile_ref.at[pl.ds(0, s_pad)], st, mask=jnp.arange(s_pad, dtype=jnp.int32) < slots)
    sp = pltriton.load(split_buf_ref.at[pl.ds(0, r_pad)])
    pltriton.store(split_ref.at[pl.ds(0, r_pad)], sp, mask=jnp.arange(r_pad, dtype=jnp.int32) < split_ref.shape[0])


@functools.partial(jax.jit, static_argnames=("num_sms", "min_pages", "interpret"))
def worklist_pieces(tile_len, num_sms: int, min_pages: int, *, interpret: bool = False):
    """`worklist_pieces_reference` as one Pallas kernel (Triton lowering, one program), bit for bit:
    i32 tile_len [B, T] -> (meta i32[B*T + slots, 6], slot_tile i32[slots]), and the merge's
    (seg_first, seg_count) i32[B*T] (`segments_from_slot_tile` of slot_tile, whose two XLA
    scatters it saves) and split-tile list i32[min(B*T, slots // 2)] (`split_tiles_of`, an XLA nonzero).
    The plain-JAX metadata step is ~15 XLA ops (cumsum, searchsorted, gathers, a scatter) that ran as ~50
    small kernels per decode call on the H200, more time than the worklist decode saved at uniform lengths
    (bench/results/decode-h200.json); this is one launch. Lengths must keep its int32 arithmetic
    below 2^31 (`_check_worklist_bounds`, checked by the decode)."""
    b, t = tile_len.shape
    nt = b * t
    slots = worklist_slots(num_sms)
    bt_pad = next_pow2(nt)
    j_pad = next_pow2(nt + slots)
    s_pad = next_pow2(slots)
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    shapes = [
        (nt + slots, 6),  # meta
        (slots,),  # slot_tile
        (nt,),  # seg_first
        (nt,),  # seg_count
        (min(nt, slots // 2),),  # split tiles (merge_segments' list)
        (next_pow2(j_pad + bt_pad),),  # marks: pieces, then padding tiles' dummies
        (3, bt_pad),  # per-tile start, first slot, k
        (next_pow2(s_pad + j_pad),),  # slot_buf: slots, then unsplit pieces' dummies
        (next_pow2(next_pow2(min(nt, slots // 2)) + bt_pad),),  # split_buf: split tiles, then the others' dummies
    ]
    meta, slot_tile, seg_first, seg_count, split_tiles, *_ = pl.pallas_call(
        functools.partial(_worklist_kernel, t=t, num_sms=num_sms, min_pages=min_pages, interpret=interpret),
        grid=(1,),
        # Whole-array blocks: under the Triton lowering a block only sets a base pointer.
        in_specs=[whole((nt,))],
        out_specs=[whole(s) for s in shapes],
        out_shape=[jax.ShapeDtypeStruct(s, jnp.int32) for s in shapes],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="mla_decode_sm90_worklist",
    )(tile_len.reshape(nt).astype(jnp.int32))
    return meta, slot_tile, seg_first, seg_count, split_tiles


class WorklistPlan(NamedTuple):
    """A decode step's work list (`decode_plan`): what every layer's call on the same block_table and seq_lens
    shares (`worklist_pieces`' meta and the merge's segments and split-tile list), built once a step."""

    meta: jax.Array  # i32[BT + slots, 6]
    seg_first: jax.Array  # i32[BT]
    seg_count: jax.Array  # i32[BT]
    split_tiles: jax.Array  # i32[min(BT, slots // 2)]


def _row_and_tile_lens(seq_lens, n: int, max_pages: int):
    """Row lengths i32[B, T*64] (query row t*N + n of request b attends seq_lens[b, t] tokens, clamped to the
    block table's capacity; padding rows 0) and their head tiles' lengths i32[B, T], T = ceil(Q*N / 64)."""
    b, nq = seq_lens.shape
    m_rows = nq * n
    m_pad = cdiv(m_rows, TILE_M) * TILE_M
    row_lens = jnp.minimum(jnp.repeat(seq_lens.astype(jnp.int32), n, axis=1), max_pages * PAGE_SIZE)
    row_lens = jnp.pad(row_lens, ((0, 0), (0, m_pad - m_rows)))
    return row_lens, jnp.max(row_lens.reshape(b, m_pad // TILE_M, TILE_M), axis=-1)


def _worklist_of(tile_len, max_pages: int, sms: int, interpret, plan: WorklistPlan | None):
    """The work list of head tiles i32[B, T]: the step's `plan` where one is given (checked against the call's
    shapes), else built here (one metadata kernel)."""
    nt = tile_len.size
    _check_worklist_bounds(nt, max_pages, sms, _WORKLIST_MIN_PAGES)
    if plan is None:
        meta, _, seg_first, seg_count, split_tiles = worklist_pieces(
            tile_len, sms, _WORKLIST_MIN_PAGES, interpret=bool(interpret)
        )
        return WorklistPlan(meta, seg_first, seg_count, split_tiles)
    want = WorklistPlan((nt + worklist_slots(sms), 6), (nt,), (nt,), (min(nt, worklist_slots(sms) // 2),))
    for name, arr, shape in zip(WorklistPlan._fields, plan, want, strict=True):
        if tuple(arr.shape) != shape or arr.dtype != jnp.int32:
            raise ValueError(
                f"plan.{name} is {arr.dtype}{list(arr.shape)}, this call's work list ({nt} head tiles, {sms} SMs) "
                f"needs int32{list(shape)}: a plan from decode_plan with this call's arguments"
            )
    return plan


def _resolve_schedule(q_shape, cache_dtype, max_pages, sms, schedule, num_kv_splits, batch_invariant, fp8_qk):
    """(narrow kernel?, "grid" or "worklist") for a call: `mla_decode_sm90`'s schedule=None rule, and
    batch_invariant's one piece a tile."""
    b, nq, n, _ = q_shape
    narrow = uses_narrow(nq * n, cache_dtype, fp8_qk=fp8_qk)
    if batch_invariant:
        return narrow, "grid"
    if schedule is None:
        by_length = narrow and b >= NARROW_WORKLIST_MIN_BATCH and num_kv_splits is None
        by_length &= _worklist_bound(b, max_pages, sms, _WORKLIST_MIN_PAGES) < 2**31
        schedule = "worklist" if by_length else "grid"
    return narrow, schedule


def decode_plan(
    q,
    kv_c_and_k_pe_cache,
    block_table,
    seq_lens,
    *,
    num_kv_splits: int | None = None,
    batch_invariant: bool = False,
    fp8_qk: bool = False,
    num_sms: int | None = None,
    schedule: str | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    **_,
) -> WorklistPlan | None:
    """The work list `mla_decode_sm90` would build for this call (same arguments; q and the cache may be
    ShapeDtypeStructs, the rest of its keywords are accepted and ignored), or None where it runs the grid.
    A step builds it once before its layer loop and passes it to every layer's call as `plan` (vLLM's
    metadata builder calls FlashMLA's get_mla_metadata once a step the same way): the layers share
    block_table and seq_lens, so the 27 layers of V2-Lite run one metadata kernel, not 27."""
    sms = int(num_sms) if num_sms is not None else _device_num_sms()
    max_pages = block_table.shape[1]
    fp8_qk = bool(fp8_qk) and jnp.dtype(kv_c_and_k_pe_cache.dtype) == FP8
    _, schedule = _resolve_schedule(
        q.shape, kv_c_and_k_pe_cache.dtype, max_pages, sms, schedule, num_kv_splits, batch_invariant, fp8_qk
    )
    if schedule != "worklist":
        return None
    _, tile_len = _row_and_tile_lens(seq_lens, q.shape[2], max_pages)
    return _worklist_of(tile_len, max_pages, sms, static_interpret(interpret), None)


def _merge_worklist(out, lse, o_part, lse_part, seg_first, seg_count, split_tiles, interpret=False):
    """LSE-merge the partial slots of each split tile into out [BT, 64, L] / lse [BT, 64], in place.

    Slots of a tile are consecutive: seg_first, seg_count i32[BT] (`worklist_pieces`). One Pallas kernel
    (`merge_segments`) reads only the live slots of split tiles and writes only those tiles; it
    replaced a much slower XLA segment_sum scatter (docs/perf-notes.md)."""
    return merge_segments(
        out,
        lse,
        o_part.reshape(-1, o_part.shape[-1]),
        lse_part.reshape(-1),
        seg_first,
        seg_count,
        split_tiles,
        interpret=interpret,
    )


# Developer tracing: (events per warpgroup, directory) makes the next compiled kernels write a
# Perfetto trace of their named scopes (qk, softmax, pv, waits) per warpgroup; bench/trace_sm90.py.
# The trace buffer takes shared memory, so only configurations below the 227 KB limit (L < 512).
TRACE: tuple[int, str] | None = None

_WORKLIST_MIN_PAGES = 4  # no piece shorter than this unless its tile is (FlashMLA: ~5 blocks)
# fp8 pages in flight with fp8 P.V (no bf16 ring): two pairs, the next one's loads under this one (the ring's parity
# is each page's owner, so it must be even). One page at a time, one term of q took 111.0 / 436.1 / 21.0 us at 4
# pages against 3's 130.8 / 499.1 / 23.2 at 64x128x4096, 128x128x8192, 1x128x32768 (H100, session 39).
_FP8_PV_STAGES = 4


def fp8_qk_reference_q(q, *, split: bool = False):
    """The f32 q whose exact logits `fp8_qk=True` computes: `quantize_q_fp8`'s q8 * scale (the
    reference's input for that mode); split (where `uses_fp8_pv`): q_hi + its residual, times the scale (that
    mode's error is its P, rounded to e4m3)."""
    q8, scale = quantize_q_fp8(q, split=split)
    if split:
        d = q.shape[-1]
        q8 = q8[..., :d].astype(jnp.float32) + q8[..., d:].astype(jnp.float32)
    return q8.astype(jnp.float32) * scale[..., None]


def uses_fp8_pv(m_rows: int, cache_dtype, kv_lora_rank: int = 512) -> bool:
    """Whether the 64-row kernel's fp8 P.V (`_body_pv8`, `fp8_qk=True`) can take `m_rows` query rows a request on a
    cache of `cache_dtype` with latent width `kv_lora_rank` (the narrow kernel takes fewer rows, with one fp8 term
    of q; each P.V warpgroup's half of the latents is whole 128-latent V^T chunks)."""
    return jnp.dtype(cache_dtype) == FP8 and not uses_narrow(m_rows, cache_dtype) and kv_lora_rank % (2 * VT_CHUNK) == 0


def fp8_qk_q_terms(m_rows: int, cache_dtype, kv_lora_rank: int = 512, fp8_q_split: bool | None = None) -> int:
    """The e4m3 terms of q that `fp8_qk=True` multiplies with `m_rows` query rows a request: two (q_hi and its
    residual) in the fp8 P.V kernel's 64-row tiles (`uses_fp8_pv`) with fp8_q_split=True, else one
    (`fp8_qk_reference_q(q, split=terms == 2)` is that q)."""
    return 2 if uses_fp8_pv(m_rows, cache_dtype, kv_lora_rank) and fp8_q_split else 1


def fp8_qk_reason(m_rows: int, kv_lora_rank: int) -> str | None:
    """Why `fp8_qk=True` cannot run for `m_rows` query rows a request at latent width `kv_lora_rank` on an fp8
    cache, else None (the narrow kernel takes any width; the 64-row tiles' fp8 P.V: `uses_fp8_pv`)."""
    if uses_narrow(m_rows, FP8) or uses_fp8_pv(m_rows, FP8, kv_lora_rank):
        return None
    return (
        f"fp8_qk=True in 64-row tiles ({m_rows} query rows a request) needs kv_lora_rank a multiple of "
        f"{2 * VT_CHUNK} (each P.V warpgroup's half in {VT_CHUNK}-latent V^T chunks), got {kv_lora_rank}"
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "l",
        "num_kv_splits",
        "batch_invariant",
        "interpret",
        "num_stages",
        "fp8_stages",
        "fp8_qk",
        "fp8_q_split",
        "sms",
        "schedule",
    ),
)
def _impl(
    q,
    cache,
    block_table,
    seq_lens,
    page_offset,
    kv_scale,
    plan,
    *,
    scale,
    l,
    num_kv_splits,
    batch_invariant,
    interpret,
    num_stages,
    fp8_stages,
    fp8_qk,
    fp8_q_split,
    sms,
    schedule,
):
    b, nq, n, d = q.shape
    _, g, _ = cache.shape
    max_pages = block_table.shape[1]
    m_rows = nq * n
    is_fp8 = jnp.dtype(cache.dtype) == FP8
    head_tiles = cdiv(m_rows, TILE_M)
    m_pad = head_tiles * TILE_M
    tail = cdiv(m_rows - (head_tiles - 1) * TILE_M, 8) * 8  # real rows of the last tile, to 8
    pv8 = bool(fp8_qk) and is_fp8
    q_terms = 2 if fp8_q_split else 1
    if num_stages is None:
        num_stages = 1 if is_fp8 else 2
    if fp8_stages is None:
        fp8_stages = _FP8_PV_STAGES if pv8 else 2
    if pv8 and fp8_stages % 2:
        raise ValueError(f"fp8_stages={fp8_stages}: the fp8 P.V kernel's page pairs need an even fp8 ring")
    pairs16 = _pairs16(is_fp8, num_stages, l, d)
    if batch_invariant:
        schedule, num_kv_splits = "grid", 1  # a request's pieces must not depend on the batch
    splits = 1
    if schedule == "grid":
        splits = num_kv_splits or choose_num_kv_splits_sm90(b, head_tiles, max_pages, sms)
        splits = cdiv(max_pages, cdiv(max_pages, min(splits, max_pages)))  # as the pages are cut
    cfg = _Cfg(
        l=l,
        d=d,
        head_tiles=head_tiles,
        tail=tail,
        stages=num_stages,
        fp8_stages=fp8_stages if is_fp8 else 0,
        sm_scale=float(scale),
        final_dtype=jnp.dtype(q.dtype),
        interpret=bool(interpret),
        pv8=pv8,
        q_terms=q_terms,
        nq=nq,
        heads=n,
        capacity=max_pages * g,
        splits=splits,
        pps=cdiv(max_pages, splits),
        worklist=schedule == "worklist",
        split_slots=SPLIT_SLOTS and not pv8 and not pairs16,
        pairs16=pairs16,
    )
    _, smem = _smem_plan(cfg)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"num_stages={num_stages} (fp8_stages={fp8_stages}) needs {smem} B of shared "
            f"memory per CTA; {SMEM_BYTES} B are available"
        )

    rpt = _rows_per_tile(cfg)
    m_out = head_tiles * rpt  # rows per request in the output arrays
    # Fold (Q, N) into rows t*N + n. The kernel moves whole tiles but the last one's real rows
    # rounded to 8 (q padded to that with zeros); padding rows have length 0 (the kernel derives the
    # row lengths, the tile lengths and, on the grid, each piece's pages from seq_lens).
    if pv8:
        # [B, M, D] e4m3, [B, M]: one Triton kernel (XLA ran quantize_q_fp8 as three)
        q_rows, q_scale = quantize_q_fp8_rows(
            q.reshape(b, m_rows, d), l, split=cfg.q_terms == 2, interpret=bool(interpret)
        )
        q_scale = jnp.pad(q_scale, ((0, 0), (0, m_pad - m_rows)), constant_values=1.0)
    else:
        q_rows = q.reshape(b, m_rows, d).astype(BF16)
    m_q = (head_tiles - 1) * TILE_M + tail
    if m_q != m_rows:
        q_rows = jnp.pad(q_rows, ((0, 0), (0, m_q - m_rows), (0, 0)))
    seq_lens = seq_lens.astype(jnp.int32)
    if schedule == "grid":
        pieces = b * splits * head_tiles
        n_slots = pieces if splits > 1 else 1
        name, meta_args = f"grid{splits}", []
    else:
        _, tile_len = _row_and_tile_lens(seq_lens, n, max_pages)  # [B, T]
        meta, seg_first, seg_count, split_tiles = _worklist_of(tile_len, max_pages, sms, interpret, plan)
        pieces, n_slots = meta.shape[0], worklist_slots(sms)
        name, meta_args = "worklist", [meta]

    args = [q_rows, cache] + ([kv_scale] if is_fp8 else []) + [block_table, seq_lens, page_offset] + meta_args
    args += [q_scale] if pv8 else []
    out_type = (
        jax.ShapeDtypeStruct((b, m_out, l), q.dtype),  # final outputs
        jax.ShapeDtypeStruct((b, m_out), jnp.float32),
        jax.ShapeDtypeStruct((n_slots * rpt, l), q.dtype),  # partials, by slot
        jax.ShapeDtypeStruct((n_slots * rpt,), jnp.float32),
    )
    kernel = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=out_type,
        grid=(pieces,),
        grid_names=("piece",),
        num_threads=3,
        thread_name="wg",
        # Row reductions of the WGMMA layout stay within a warp: no cross-warp reduction scratch.
        compiler_params=plgpu.CompilerParams(
            approx_math=True,
            reduction_scratch_bytes=0,
            **(dict(profile_space=TRACE[0], profile_dir=TRACE[1]) if TRACE else {}),
        ),
        interpret=interpret_params(interpret),
        kernel_name=f"mla_decode_sm90_{name}_stages{num_stages}_fp8stages{cfg.fp8_stages}"
        + ("_pv8" if pv8 else "")
        + ("_q1" if pv8 and cfg.q_terms == 1 else "")
        + ("_slots3" if cfg.split_slots else "")
        + ("_pairs16" if cfg.pairs16 else ""),
    )
    out, lse, o_part, lse_part = kernel(*args)
    if schedule == "grid" and splits > 1:
        # Pieces with no pages wrote only lse = -inf; the merge never reads their outputs.
        out, lse = merge_splits(
            o_part.reshape(b, splits, m_out, l),
            lse_part.reshape(b, splits, m_out),
            out_dtype=q.dtype,
            interpret=bool(interpret),
        )
    elif schedule == "worklist":
        out, lse = _merge_worklist(
            out.reshape(b * head_tiles, rpt, l),
            lse.reshape(b * head_tiles, rpt),
            o_part.reshape(-1, rpt, l),
            lse_part.reshape(-1, rpt),
            seg_first,
            seg_count,
            split_tiles,
            bool(interpret),
        )
        out, lse = out.reshape(b, m_out, l), lse.reshape(b, m_out)
    out = out[:, :m_rows].reshape(b, nq, n, l).astype(q.dtype)
    lse = lse[:, :m_rows].reshape(b, nq, n)
    return out, lse


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "l",
        "num_kv_splits",
        "batch_invariant",
        "interpret",
        "num_stages",
        "sms",
        "fp8_qk",
        "schedule",
    ),
)
def _narrow(
    q,
    cache,
    block_table,
    seq_lens,
    page_offset,
    kv_scale,
    plan,
    *,
    scale,
    l,
    num_kv_splits,
    batch_invariant,
    interpret,
    num_stages,
    sms,
    fp8_qk,
    schedule,
):
    """Few query rows: the tokens-on-M kernel of mla_decode_sm90_narrow. Grid schedule: B * splits pieces, split
    partials come back transposed and merge as such; with one split the call is one kernel (page offset, row
    lengths and piece bounds are derived inside it, and an fp8 cache's q split). Work list: the pieces
    of `worklist_pieces` (one head tile a request), split requests merged by `merge_segments(transposed=True)`."""
    b, nq, n, d = q.shape
    m_rows = nq * n
    fp8 = jnp.dtype(cache.dtype) == FP8
    rows = narrow_rows(m_rows, fp8)
    stages = num_stages or 2  # fp8: the bf16 V slots (one ran 384 us against two's 297 at 128x16x8192, session 17)
    smem = smem_plan_bytes(rows, l, d, stages, fp8)
    if smem > SMEM_BYTES:
        raise ValueError(f"num_stages={stages} needs {smem} B of shared memory per CTA; {SMEM_BYTES} B are available")
    max_pages = block_table.shape[1]
    kw = dict(kv_scale=kv_scale, scale=scale, l=l, stages=stages, interpret=interpret, fp8_qk=fp8_qk)
    if schedule == "worklist":  # (never with batch_invariant: `_resolve_schedule`)
        _, tile_len = _row_and_tile_lens(seq_lens, n, max_pages)  # [B, 1]: Q*N <= 32 rows, one tile
        meta, seg_first, seg_count, split_tiles = _worklist_of(tile_len, max_pages, sms, interpret, plan)
        out, lse, o_part, lse_part = narrow_decode(
            q, cache, block_table, seq_lens, page_offset, splits=1, meta=meta, num_slots=worklist_slots(sms), **kw
        )
        out, lse = merge_segments(
            out,
            lse,
            o_part.reshape(-1, rows),
            lse_part.reshape(-1),
            seg_first,
            seg_count,
            split_tiles,
            transposed=True,
            interpret=bool(interpret),
        )
    else:
        splits = 1 if batch_invariant else num_kv_splits or choose_num_kv_splits_sm90(b, 1, max_pages, sms)
        splits = cdiv(max_pages, cdiv(max_pages, min(splits, max_pages)))  # as the kernel cuts the pages
        out, lse = narrow_decode(q, cache, block_table, seq_lens, page_offset, splits=splits, **kw)
        if splits > 1:
            out, lse = merge_splits(
                out.reshape(b, splits, l, rows),
                lse.reshape(b, splits, rows),
                out_dtype=q.dtype,
                transposed=True,
                interpret=bool(interpret),
            )
    if rows != m_rows:
        out, lse = out[:, :m_rows], lse[:, :m_rows]
    return out.reshape(b, nq, n, l).astype(q.dtype), lse.reshape(b, nq, n)


# From this many requests the narrow kernel cuts requests by their lengths (`worklist_pieces`). Measured on the H100
# (2026-12-05, bench/decode.py, 16 heads, device time; bench/results/decode-h200.json h100_runs): 128 requests of
# log-uniform lengths in [256, 32k] took 461 / 314 us (bf16 / fp8) by the work list against the grid's 713 / 846,
# 1.04x / 1.16x the same tokens in uniform requests; uniform batches pay for its metadata kernel and merge, +4.5% /
# +5.8% at 128x8192 (418 / 247 us against 399 / 234), +9% / +17% at 64x4096, +32% / +34% at 32x1024. A server's large
# batches are ragged; small ones stay on the grid, whose splits are sized from the block table. Since session 28 a
# uniform batch that fits one wave is cut as the grid cuts it (no merge of two-piece tiles) and a step builds the work
# list once (`decode_plan`), not once a layer: +2.7% / +0.9% at 128x8192 bf16 / fp8 per call, and the batch-128 ctx-1k
# step 15.90 ms against the grid's 15.78 (+0.7%; H100, decode-h200.json / e2e-h200.json).
NARROW_WORKLIST_MIN_BATCH = 64


def uses_narrow(m_rows: int, cache_dtype, *, fp8_qk: bool = False) -> bool:
    """Whether `mla_decode_sm90` runs the narrow (tokens-on-M) kernel for `m_rows` query rows a request: up to
    `mla_decode_sm90_narrow.NARROW_MAX_ROWS` on a bf16 cache, `NARROW_FP8_MAX_ROWS` on an fp8 one (exact, or with
    fp8_qk lossy), with either schedule."""
    fp8 = jnp.dtype(cache_dtype) == FP8
    return narrow_rows(m_rows, fp8) is not None


def mla_decode_sm90(
    q,  # [B, Q, N, L+R]: absorbed q_nope (L) then q_pe (R); computed in bf16
    kv_c_and_k_pe_cache,  # [num_pages, 64, L+R] bf16, or float8_e4m3fn with kv_scale
    block_table,  # i32[B, max_pages]: page ids, each read as page block_table[b, i] + page_offset of the pool
    seq_lens,  # i32[B, Q]: cache tokens query row (b, t) attends to; 0 = empty row
    *,
    scale: float,
    kv_scale=None,  # f32[num_pages, 64]: row value = fp8 row * kv_scale (fp8 cache only)
    kv_lora_rank: int = 512,
    page_offset=None,  # integer scalar, static or traced (None = 0): the first page of block_table's range
    num_kv_splits: int | None = None,
    batch_invariant: bool = False,
    interpret: bool | plgpu.InterpretGPUParams = False,
    num_stages: int | None = None,
    fp8_stages: int | None = None,
    fp8_qk: bool = False,
    fp8_q_split: bool | None = None,
    num_sms: int | None = None,
    schedule: str | None = None,
    plan: WorklistPlan | None = None,
):
    """Hopper paged latent-MQA decode. Returns (out [B, Q, N, L] in q.dtype, lse f32[B, Q, N]).

    Same contract as `pallas_kernels.mla_decode.mla_decode`: lse is the natural log of
    sum(exp(scale * logits)); rows with seq_len 0 give out 0 and lse -inf; lengths beyond the block
    table's capacity are clamped; page_offset as there. Page size 64 only; L a multiple of 128 up to 512;
    R a multiple of 64; cache bf16 or fp8 e4m3 (cast to bf16 in shared memory, bf16 wgmma, per-token scale
    applied to the logits and to p).

    Few query rows a request (`uses_narrow`: Q*N <= 32 on a bf16 cache, <= 16 on an fp8 one, either schedule)
    run the narrow kernel (`mla_decode_sm90_narrow`: tokens on the wgmma M axis, nothing padded; an fp8
    cache's QK^T as fp8 wgmmas on a hi/lo split of q, or with fp8_qk as one on `quantize_q_fp8`'s q);
    num_kv_splits, batch_invariant and num_stages (its ring depth; on an fp8 cache the bf16 V slots') apply
    to it, fp8_stages does not. Both kernels add page_offset, derive the row lengths from
    seq_lens and, on the grid, each piece's pages in the kernel (no XLA op before the launch).

    schedule: None (default): "worklist" for the narrow kernel from `NARROW_WORKLIST_MIN_BATCH` requests on
    (without num_kv_splits or batch_invariant), else "grid". "grid": every head tile of every request cut into
    the same static number
    of splits, `num_kv_splits` (None: `choose_num_kv_splits_sm90` for `num_sms` SMs, default the
    device's), over the block table's capacity; "worklist": a metadata step on device cuts each tile
    by its actual length so the pieces balance over `num_sms` SMs (FlashMLA's get_mla_metadata idea;
    split tiles merged by LSE afterwards). batch_invariant: one piece per tile (bitwise independent
    of the rest of the batch). num_stages: bf16 ring depth (default 2; 1 for fp8,
    whose ring of `fp8_stages` (default 2) fp8 pages takes the rest of shared memory).
    An fp8 cache's pages are cast to bf16 for the bf16 wgmmas (f16 operands, whose cast from e4m3 is one
    instruction, measured no faster: the cast's shared-memory traffic bounds it, session 30).
    fp8_qk (fp8 cache only): in 64-row tiles, QK^T and P.V as fp8 wgmmas straight on the fp8 page, no cast (q
    quantized per row to e4m3, `quantize_q_fp8`; V^T built in registers; P rounded to e4m3; kv_lora_rank a
    multiple of 256): FlashMLA's fp8 footing, 1.6% against float32 on the q it multiplies at 1/sqrt(192), as
    FlashMLA's own test measures it (its emulated quantization: 1.6% too, and 4.8-5.0% against the exact q, where
    this mode errs 5.0%: scripts/fp8_decode_footing.py). In the narrow kernel: QK^T on one e4m3 term of q (the
    logits are those of the quantized q).
    fp8_q_split (with fp8_qk): None or False, one e4m3 term of q. True (64-row tiles only): q_hi and its residual,
    two QK^T chains (1.2% against float32 with the exact q, 6.2% with one term, at DeepSeek-V3's scale; 171.7
    against 117.6 us at 64x128x4096 with the quantize, H100, session 39).
    plan: the step's work list, `decode_plan` of the same block_table and seq_lens with the same options, built
    once for every layer (None: built here where the work list runs; an error where the grid does).
    interpret: run under the Mosaic GPU interpreter (CPU testing): True, or the interpreter's
    `plgpu.InterpretGPUParams` (e.g. detect_races=True). It needs >= 3 XLA CPU workers (NPROC).
    """
    _validate_sm90(
        q,
        kv_c_and_k_pe_cache,
        block_table,
        seq_lens,
        kv_scale,
        kv_lora_rank,
        num_kv_splits,
        scale,
        num_stages,
        fp8_stages,
        num_sms,
        interpret,
        schedule,
    )
    if fp8_qk and jnp.dtype(kv_c_and_k_pe_cache.dtype) != FP8:
        raise ValueError(f"fp8_qk=True needs a float8_e4m3fn kv_c_and_k_pe_cache, got {kv_c_and_k_pe_cache.dtype}")
    reason = fp8_qk_reason(q.shape[1] * q.shape[2], kv_lora_rank) if fp8_qk else None
    if reason:
        raise ValueError(reason)
    if fp8_q_split is not None and not fp8_qk:
        raise ValueError(f"fp8_q_split={fp8_q_split} applies to fp8_qk=True only")
    if fp8_q_split and uses_narrow(q.shape[1] * q.shape[2], kv_c_and_k_pe_cache.dtype, fp8_qk=True):
        raise ValueError(
            f"fp8_q_split=True: {q.shape[1] * q.shape[2]} query rows a request run the narrow kernel, whose fp8_qk "
            "takes one e4m3 term of q (two terms need the 64-row kernel)"
        )
    check_page_offset(page_offset, kv_c_and_k_pe_cache.shape[0])
    sms = int(num_sms) if num_sms is not None else _device_num_sms()
    narrow, schedule = _resolve_schedule(
        q.shape, kv_c_and_k_pe_cache.dtype, block_table.shape[1], sms, schedule, num_kv_splits, batch_invariant, fp8_qk
    )
    if plan is not None and schedule != "worklist":
        raise ValueError(f"plan: a work list was given, but this call runs schedule={schedule!r}")
    offset = jnp.zeros((1,), jnp.int32) if page_offset is None else jnp.asarray(page_offset, jnp.int32).reshape(1)
    args = (q, kv_c_and_k_pe_cache, block_table, seq_lens, offset, kv_scale, plan)
    kw = dict(
        scale=float(scale),
        l=int(kv_lora_rank),
        num_kv_splits=num_kv_splits,
        batch_invariant=bool(batch_invariant),
        interpret=static_interpret(interpret),
        num_stages=num_stages,
        sms=sms,
        fp8_qk=bool(fp8_qk),
        schedule=schedule,
    )
    if narrow:
        return _narrow(*args, **kw)
    return _impl(*args, fp8_stages=fp8_stages, fp8_q_split=fp8_q_split, **kw)
