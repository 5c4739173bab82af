"""Varlen flash attention for MLA prefill on Hopper (sm_90): a Mosaic GPU kernel (TMA + wgmma, FA3-style).

Same API and outputs as `pallas_kernels.flash_prefill.flash_prefill` (the Triton-lowered, portable
kernel), whose float32 reference `flash_prefill_reference` is this kernel's reference too. Both take
their per-row key windows from `pallas_kernels.util.row_windows`: sequence membership and
bottom-right-aligned causality both live in a window [lo, hi) of key rows per query row, so one kernel
serves the causal new-token pass and the non-causal context-chunk pass (q_start_loc != k_start_loc).

Shapes: q/k [T, N, Dq] (Dq = P+R = 192 for DeepSeek), v [T, N, V] (128, not padded), ragged sequences
packed along T; out [Tq, N, V] in q.dtype, lse f32[Tq, N] (natural log).

Work decomposition: one CTA per (q tile of 128 packed rows, head), grid (N, q tiles), heads fastest: a
wave holds one q tile (reversed: the longest causal tiles first) of many heads, each CTA on its own head's
K/V. With q tiles fastest (the Triton kernel's order, meant to share a head's K/V in L2) up to 64 CTAs
read the same K/V rows at once: 377 / 360 TFLOP/s at 1x8192x128 / 4x4096x128 causal against 596-606 /
550-560 heads fastest (H100, 2026-12-05, bench/results/prefill-h200.json). A tile may straddle
sequences. A per-tile metadata row (built by a few XLA ops over the row windows) holds the key span
[base, base + n*BK) of the tile and, per consumer warpgroup, which of the n key tiles it skips (no row
sees a key), computes unmasked (every non-empty row sees every key) or computes masked (causal
diagonal, sequence edges).

One CTA, 3 warpgroups (`plgpu.kernel(num_threads=3)`):
- Warpgroups 0 and 1 (consumers) each own 64 query rows: they TMA their Q rows (3 column chunks of 64
  for Dq = 192, so each chunk is a contiguous [64, 64] tile that later stages the output) and row
  windows, then per key tile: S = Q K^T (one wgmma per 64-wide chunk of Dq, f32 accumulator), online
  softmax in registers (exp2, log2-scaled logits; masked tiles use `where`, never a multiply, so NaN
  padding cannot leak), acc = acc * alpha + P V (wgmma with P from registers); the row sum of P is taken
  after the schedule barrier, outside the softmax's turn (tokamax's order for head dims > 128: +1-5%).
  An optional schedule barrier ping-pongs the two consumers (FA3): one's softmax overlaps the other's
  wgmmas.
- Warpgroup 2 (producer) TMAs K and V tiles into a `num_stages`-deep ring (separate K and V barriers,
  so QK^T starts before V lands). TMA zero-fills rows past the end of the arrays; rows of the first
  and last key tiles outside the tile's visible keys (NaN padding, another sequence) are zeroed in
  shared memory before the consumers see V (P is 0 there, but 0 * NaN = NaN).
- Epilogue: each consumer normalizes, stages its [64, V] output in its own Q buffer and TMAs it out
  (rows past T are dropped by TMA); LSE goes out per head as [N, Tq'] rows and is transposed outside.

Shared memory (bf16, Dq 192, V 128, BK 128, 2 stages): Q 48 KB + K 96 KB + V 64 KB + 1 KB = 209 KB of
227 KB.

Barriers (every waiter waits every phase of a barrier, in order -- each warpgroup tracks parities
itself; consumers that skip a key tile still wait for it and release it):
  q_bar[wg]     Q rows + row windows landed (TMA)              consumer wg waits
  k_ready[st]   K tile in ring slot                            every consumer waits
  v_ready[st]   V tile in ring slot (TMA, or producer arrive)  every consumer waits
  k_free[st]    both consumers done with K slot (2 arrivals)   producer waits
  v_free[st]    both consumers done with V slot (2 arrivals)   producer waits
  raw_bar       the producer's own TMA of a V tile it zeroes   producer waits
  sched         ping-pong between the consumers (2 arrivals)   both consumers

Under the Mosaic GPU interpreter (CPU tests) P goes through shared memory and each P V product into a
fresh accumulator (the interpreter has no register-operand wgmma and no `run_state` over an
accumulator); `p_in_smem=True` selects the shared-memory P on a GPU too.

Alignment: Mosaic GPU's TMA into 8-row-tiled shared memory needs 8-aligned row offsets (key tiles
start at an 8-aligned base below the tile's first key; the rows before it are masked and zeroed like
the tail) and row counts that are multiples of 8: token counts that are not cost a padded copy of
q/k/v and out in the wrapper.

Testing: the CPU tests run it under the Mosaic GPU interpreter (race detector on) and lower it
for sm_90 (Mosaic GPU's Python passes: layout inference, wgmma/TMA checks); the `gpu` tests run it
on the H200. It is the prefill of the default Hopper backend (mla_jax.attention); its speed
against cuDNN is in docs/perf-notes.md and bench/results/prefill-h200.json.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.flash_prefill import flash_prefill_reference
from pallas_kernels.mgpu import (
    SMEM_BYTES,
    copy_zeroing_rows,
    interpret_params,
    smem_bytes,
    static_interpret,
    tiled,
    wgmma_accumulate,
)
from pallas_kernels.util import (
    BIG,
    HALF_DTYPES,
    LN2,
    LOG2E,
    M_INIT,
    cdiv,
    check_interpreter_workers,
    is_sm90,
    row_windows,
    validate_prefill,
)

__all__ = ["flash_prefill_sm90", "flash_prefill_reference", "is_sm90", "unsupported_reason"]

_WGS = 2  # consumer warpgroups
_WG_ROWS = 64  # query rows of a consumer warpgroup (wgmma M)
_BLOCK_Q = _WGS * _WG_ROWS  # query rows per CTA
_CHUNK = 64  # 128-byte swizzle width of bf16/f16: wgmma K step and TMA column chunk
# (consumer, producer) registers per thread: 2 x 128 x 224 + 128 x 56 = 64512 <= 64K. A consumer
# holds the [64, V] f32 accumulator (64 at V=128), the [64, BK] f32 logits (64) and its mask/P;
# the producer zeroes [64, 64] chunks of the last V tile.
_REGS = (224, 56)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    dq: int
    dv: int
    bk: int  # key rows per tile
    stages: int  # K/V ring depth
    n_qtiles: int
    qk_scale: float  # softmax scale * log2(e)
    dtype: object
    p_in_smem: bool  # P through shared memory (always under the interpreter)
    sched: bool  # ping-pong schedule barrier between the consumers
    interpret: bool


def _smem_plan(cfg: _Cfg):
    dt = cfg.dtype
    bufs = [
        plgpu.SMEM((_WGS, cfg.dq // _CHUNK, _WG_ROWS, _CHUNK), dt, transforms=tiled(dt)),  # Q / out
        plgpu.SMEM((cfg.stages, cfg.bk, cfg.dq), dt, transforms=tiled(dt)),  # K ring
        plgpu.SMEM((cfg.stages, cfg.bk, cfg.dv), dt, transforms=tiled(dt)),  # V ring
        plgpu.SMEM((_WGS, 2, _WG_ROWS), jnp.int32),  # lo, hi
        plgpu.SMEM((_WGS, _WG_ROWS), jnp.float32),  # lse
    ]
    if cfg.p_in_smem:
        bufs.append(plgpu.SMEM((_WGS, _WG_ROWS, cfg.bk), dt, transforms=tiled(dt)))
    return bufs, smem_bytes(bufs) + 1024  # + barriers


def _kernel(q_gmem, k_gmem, v_gmem, rows_gmem, meta_gmem, out_gmem, lse_gmem, *, cfg: _Cfg):
    bufs, _ = _smem_plan(cfg)
    if not cfg.p_in_smem:
        bufs.append(None)
    bars = [
        plgpu.Barrier(num_arrivals=cfg.dq // _CHUNK + 1, num_barriers=_WGS),  # q_bar
        plgpu.Barrier(num_barriers=cfg.stages),  # k_ready
        plgpu.Barrier(num_barriers=cfg.stages),  # v_ready
        plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages),  # k_free
        plgpu.Barrier(num_arrivals=_WGS, num_barriers=cfg.stages),  # v_free
        plgpu.Barrier(),  # raw_bar
        plgpu.Barrier(num_arrivals=2),  # sched
    ]

    def scoped(smem, q_bar, k_ready, v_ready, k_free, v_free, raw_bar, sched):
        q_smem, k_ring, v_ring, rows_smem, lse_smem, p_smem = smem
        _body(
            cfg,
            dict(
                q_gmem=q_gmem,
                k_gmem=k_gmem,
                v_gmem=v_gmem,
                rows_gmem=rows_gmem,
                meta_gmem=meta_gmem,
                out_gmem=out_gmem,
                lse_gmem=lse_gmem,
                q_smem=q_smem,
                k_ring=k_ring,
                v_ring=v_ring,
                rows_smem=rows_smem,
                lse_smem=lse_smem,
                p_smem=p_smem,
                q_bar=q_bar,
                k_ready=k_ready,
                v_ready=v_ready,
                k_free=k_free,
                v_free=v_free,
                raw_bar=raw_bar,
                sched=sched,
            ),
        )

    pl.run_scoped(scoped, bufs, *bars, collective_axes="wg")


def _body(cfg: _Cfg, r):
    wg = lax.axis_index("wg")
    qt = cfg.n_qtiles - 1 - lax.axis_index("qt")  # longest causal tiles first
    h = lax.axis_index("h")
    f32 = jnp.float32
    bk, stages = cfg.bk, cfg.stages
    meta = r["meta_gmem"]
    # Key tiles start at base + j*BK with base a multiple of 8: a TMA into 8-row-tiled shared memory
    # needs an 8-aligned row offset.
    base, n, hi_max, lo_min = (meta[qt, i] for i in range(4))
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    k_ready, v_ready, k_free, v_free = r["k_ready"], r["v_ready"], r["k_free"], r["v_free"]
    k_ring, v_ring = r["k_ring"], r["v_ring"]

    def slot_of(j):
        return lax.rem(j, jnp.int32(stages))

    def sched_sync():
        plgpu.barrier_arrive(r["sched"])
        plgpu.barrier_wait(r["sched"])

    @pl.when(wg < _WGS)
    def _consumer():
        plgpu.set_max_registers(_REGS[0], action="increase")
        t0 = pl.multiple_of(qt * _WGS * _WG_ROWS + wg * _WG_ROWS, _WG_ROWS)
        q_smem = r["q_smem"].at[wg]  # [Dq/64, 64, 64]
        n_qc = cfg.dq // _CHUNK
        for c in range(n_qc):
            plgpu.copy_gmem_to_smem(
                r["q_gmem"].at[pl.ds(t0, _WG_ROWS), h, pl.ds(c * _CHUNK, _CHUNK)], q_smem.at[c], r["q_bar"].at[wg]
            )
        plgpu.copy_gmem_to_smem(r["rows_gmem"].at[:, pl.ds(t0, _WG_ROWS)], r["rows_smem"].at[wg], r["q_bar"].at[wg])
        plgpu.barrier_wait(r["q_bar"].at[wg])
        lo = plgpu.load(r["rows_smem"].at[wg, 0], layout=row_layout)  # [64] int32
        hi = plgpu.load(r["rows_smem"].at[wg, 1], layout=row_layout)
        p_ref = r["p_smem"].at[wg] if cfg.p_in_smem else None

        def softmax(s, m_i, kstart, masked):
            """p = exp2(logits - m_new) (f32, [64, BK]), m_new, alpha = exp2(m_i - m_new); log2 units.
            Masked: keys outside a row's window [lo, hi) get p = 0 (where, not a multiply: NaN padding)."""
            if masked:
                kpos = plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=plgpu.Layout.WGMMA) + kstart
                see = (kpos >= lax.broadcast_in_dim(lo, s.shape, [0])) & (kpos < lax.broadcast_in_dim(hi, s.shape, [0]))
                s = jnp.where(see, s * cfg.qk_scale, -jnp.inf)
                m_new = jnp.maximum(m_i, s.max(axis=1))
                p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            else:
                # scale > 0 commutes with max; s * scale - m is one FMA per logit.
                m_new = jnp.maximum(m_i, s.max(axis=1) * cfg.qk_scale)
                p = jnp.exp2(s * cfg.qk_scale - lax.broadcast_in_dim(m_new, s.shape, [0]))
            return p, m_new, jnp.exp2(m_i - m_new)

        def issue_qk(s_ref, slot):
            for c in range(n_qc):
                plgpu.wgmma(s_ref, q_smem.at[c], k_ring.at[slot, :, pl.ds(c * _CHUNK, _CHUNK)].T)

        def step(j, carry, mode):
            slot = slot_of(j)
            plgpu.barrier_wait(k_ready.at[slot])
            if mode == "skip":  # no row of this warpgroup sees these keys: keep barrier phases in step
                plgpu.barrier_arrive(k_free.at[slot])
                if cfg.sched:
                    sched_sync()
                plgpu.barrier_wait(v_ready.at[slot])
                if cfg.sched:
                    sched_sync()
                plgpu.barrier_arrive(v_free.at[slot])
                return carry
            acc, m_i, l_i = carry

            def qk(s_ref):
                issue_qk(s_ref, slot)
                if cfg.sched:
                    sched_sync()  # the other consumer's softmax runs while this wgmma does
                return s_ref[...]

            s = pl.run_scoped(qk, plgpu.ACC((_WG_ROWS, bk), f32))  # [64, BK] f32
            plgpu.barrier_arrive(k_free.at[slot])
            p, m_new, alpha = softmax(s, m_i, base + j * bk, mode == "masked")
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            pb = p.astype(cfg.dtype)
            if cfg.sched:
                plgpu.barrier_arrive(r["sched"])  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            if cfg.sched:
                plgpu.barrier_wait(r["sched"])  # the tensor cores are ours
            l_i = l_i * alpha + p.sum(axis=1)  # in the tensor cores' turn: the softmax's is the shorter
            acc = _pv(cfg, acc, pb, p_ref, v_ring.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m_new, l_i

        e0, ja, jb, e1 = (meta[qt, 4 + 4 * wg + i] for i in range(4))
        acc = plgpu.layout_cast(jnp.zeros((_WG_ROWS, cfg.dv), f32), plgpu.Layout.WGMMA)
        m_i = plgpu.layout_cast(jnp.full((_WG_ROWS,), M_INIT, f32), row_layout)
        l_i = plgpu.layout_cast(jnp.zeros((_WG_ROWS,), f32), row_layout)
        carry = (acc, m_i, l_i)
        if cfg.sched:
            pl.when(wg == 1)(sched_sync)  # offset the consumers by half a step
        for lo_j, hi_j, mode in (
            (0, e0, "skip"),
            (e0, ja, "masked"),
            (ja, jb, "full"),
            (jb, e1, "masked"),
            (e1, n, "skip"),
        ):
            carry = lax.fori_loop(lo_j, hi_j, functools.partial(step, mode=mode), carry)
        if cfg.sched:
            pl.when(wg == 0)(sched_sync)
        acc, m_i, l_i = carry

        nonempty = lo < hi
        l_safe = jnp.where(nonempty, l_i, 1.0)
        inv = 1.0 / l_safe
        lse = jnp.where(nonempty, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf)
        keep = lax.broadcast_in_dim(lo, acc.shape, [0]) < lax.broadcast_in_dim(hi, acc.shape, [0])
        # where, not a multiply: rows that see nothing may hold NaN (NaN padding q in unmasked tiles).
        out = jnp.where(keep, acc * lax.broadcast_in_dim(inv, acc.shape, [0]), 0.0)
        for c in range(cfg.dv // _CHUNK):  # Q is dead: its first chunks stage the output
            q_smem.at[c][...] = out[:, c * _CHUNK : (c + 1) * _CHUNK].astype(cfg.dtype)
        r["lse_smem"].at[wg][...] = lse
        plgpu.commit_smem()
        for c in range(cfg.dv // _CHUNK):
            plgpu.copy_smem_to_gmem(q_smem.at[c], r["out_gmem"].at[pl.ds(t0, _WG_ROWS), h, pl.ds(c * _CHUNK, _CHUNK)])
        plgpu.copy_smem_to_gmem(r["lse_smem"].at[wg], r["lse_gmem"].at[h, pl.ds(t0, _WG_ROWS)])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == _WGS)
    def _producer():
        plgpu.set_max_registers(_REGS[1], action="decrease")

        def step(j, _):
            slot = slot_of(j)
            start = pl.multiple_of(base + j * bk, 8)

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(k_free.at[slot])

            plgpu.copy_gmem_to_smem(r["k_gmem"].at[pl.ds(start, bk), h], k_ring.at[slot], k_ready.at[slot])

            @pl.when(j >= stages)
            def _():
                plgpu.barrier_wait(v_free.at[slot])

            # Rows [v_lo, v_hi) of this tile are keys some query row sees; the others (before the
            # tile's first key: 8-alignment of base; past its last: the last tile) may be NaN padding.
            v_lo, v_hi = lo_min - start, hi_max - start
            copy_zeroing_rows(
                r["v_gmem"].at[pl.ds(start, bk), h],
                v_ring.at[slot],
                v_ready.at[slot],
                r["raw_bar"],
                partial=(v_lo > 0) | (v_hi < bk),
                lo=v_lo,
                hi=v_hi,
            )
            return ()

        lax.fori_loop(0, n, step, ())

        # Observe the consumers' last releases too (each waiter sees every phase).
        def drain(j, _):
            plgpu.barrier_wait(k_free.at[slot_of(j)])
            plgpu.barrier_wait(v_free.at[slot_of(j)])
            return ()

        lax.fori_loop(jnp.maximum(n - stages, 0), n, drain, ())


def _p_operand(cfg: _Cfg, p, p_ref):
    """P as the P V wgmma's A operand: its registers, or with `p_in_smem` the shared-memory copy (written
    and fenced here). The interpreter has no register-operand wgmma, so there P always goes through
    shared memory (`cfg.p_in_smem` is forced on)."""
    if not cfg.p_in_smem:
        return p
    p_ref[...] = p
    plgpu.commit_smem()  # generic-proxy writes before the wgmma (async proxy) reads
    return p_ref


def _pv(cfg: _Cfg, acc, p, p_ref, v_ref):
    """acc + p @ v with one wgmma (waits for it)."""
    return wgmma_accumulate(acc, _p_operand(cfg, p, p_ref), v_ref, interpret=cfg.interpret)


def _tile_meta(lo, hi, n_qtiles: int, bk: int):
    """Per q tile: [base, n, hi_max, lo_min, (e0, ja, jb, e1) x 2 consumer warpgroups],
    int32[n_qtiles, 12].

    The tile's keys are [base, base + n*BK): the union [lo_min, hi_max) of its rows' windows, base
    rounded down to a multiple of 8 (TMA row alignment), the end up to whole tiles.
    For warpgroup w, key tiles [0, e0) and [e1, n) are skipped (no row sees a key), [ja, jb) lie
    inside every non-empty row's window (no mask), the rest are masked."""
    lo = lo.reshape(n_qtiles, _WGS, _WG_ROWS)
    hi = hi.reshape(n_qtiles, _WGS, _WG_ROWS)
    ne = lo < hi  # empty rows: lo=BIG, hi=0
    lo_min = jnp.min(jnp.where(ne, lo, BIG), axis=-1)  # [n_qtiles, _WGS]
    hi_max = jnp.max(jnp.where(ne, hi, 0), axis=-1)
    lo_max = jnp.max(jnp.where(ne, lo, 0), axis=-1)
    hi_min = jnp.min(jnp.where(ne, hi, BIG), axis=-1)
    any_w = jnp.any(ne, axis=-1)
    any_t = jnp.any(any_w, axis=-1)
    first = jnp.where(any_t, jnp.min(lo_min, axis=-1), 0)  # [n_qtiles]
    base = first // 8 * 8
    top = jnp.where(any_t, jnp.max(hi_max, axis=-1), 0)
    n = (jnp.maximum(top - base, 0) + bk - 1) // bk
    b, nn = base[:, None], n[:, None]
    e0 = jnp.clip((lo_min - b) // bk, 0, nn)
    e1 = jnp.clip((hi_max - b + bk - 1) // bk, e0, nn)
    ja = jnp.clip((lo_max - b + bk - 1) // bk, e0, e1)
    jb = jnp.clip((hi_min - b) // bk, ja, e1)
    e0, ja, jb, e1 = (jnp.where(any_w, x, nn) for x in (e0, ja, jb, e1))  # empty: skip all
    per_wg = jnp.stack([e0, ja, jb, e1], axis=-1).reshape(n_qtiles, 4 * _WGS)  # wg-major
    return jnp.concatenate([base[:, None], n[:, None], top[:, None], first[:, None], per_wg], axis=1).astype(jnp.int32)


def _defaults(p_in_smem: bool):
    # BK 128, 2 stages fills 209 KB; P in shared memory needs 32 KB more, so BK 64 there.
    return (64, 3) if p_in_smem else (128, 2)


def unsupported_reason(q, k, v) -> str | None:
    """None when this kernel takes these (static) shapes and dtypes, else why not; callers fall back
    to the portable `pallas_kernels.flash_prefill` (f32 inputs, head dims not multiples of 64...)."""
    if jnp.dtype(q.dtype) not in HALF_DTYPES:
        return f"dtype {q.dtype} is not bfloat16 or float16"
    dq, dv = q.shape[-1], v.shape[-1]
    if dq % _CHUNK or dv % _CHUNK or dv > dq or dv > 256:
        return f"head dims q/k {dq}, v {dv}: need multiples of 64 with v <= q/k and v <= 256"
    return None


def _validate_sm90(q, k, v, q_start_loc, k_start_loc, scale, interpret, block_k, num_warps, num_stages, p_in_smem):
    validate_prefill(q, k, v, q_start_loc, k_start_loc)
    if jnp.dtype(q.dtype) not in HALF_DTYPES:
        raise ValueError(f"q/k/v dtype must be bfloat16 or float16 for the sm90 kernel, got {q.dtype}")
    dq, dv = q.shape[2], v.shape[2]
    if dq % _CHUNK:
        raise ValueError(f"q/k head dim {dq} must be a multiple of {_CHUNK} (wgmma K chunks)")
    if dv % _CHUNK or dv > dq or dv > 256:
        raise ValueError(
            f"v head dim {dv} must be a multiple of {_CHUNK}, <= the q/k head dim {dq} "
            "(the output is staged in the Q buffer) and <= 256 (wgmma N)"
        )
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    if num_warps is not None and num_warps != 4 * (_WGS + 1):
        raise ValueError(f"num_warps={num_warps}: the sm90 kernel runs {_WGS + 1} warpgroups ({4 * (_WGS + 1)} warps)")
    if block_k is not None and block_k not in (64, 128):
        raise ValueError(f"block_k={block_k} must be 64 or 128 (wgmma N; [64, BK] f32 logits in registers)")
    if num_stages is not None and not (isinstance(num_stages, int) and num_stages >= 2):
        raise ValueError(f"num_stages must be an int >= 2, got {num_stages}")
    if p_in_smem is not None and not isinstance(p_in_smem, bool):
        raise ValueError(f"p_in_smem must be a bool or None, got {p_in_smem!r}")
    check_interpreter_workers(interpret, _WGS + 1)


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal",
        "scale",
        "interpret",
        "block_k",
        "num_stages",
        "p_in_smem",
        "schedule_barrier",
    ),
)
def _impl(
    q,
    k,
    v,
    q_start_loc,
    k_start_loc,
    *,
    causal,
    scale,
    interpret,
    block_k,
    num_stages,
    p_in_smem,
    schedule_barrier,
):
    tq, n, dq = q.shape
    tk, dv = k.shape[0], v.shape[2]
    n_qtiles = cdiv(tq, _BLOCK_Q)
    tq_pad = n_qtiles * _BLOCK_Q
    cfg = _Cfg(
        dq=dq,
        dv=dv,
        bk=block_k,
        stages=num_stages,
        n_qtiles=n_qtiles,
        qk_scale=float(scale) * LOG2E,
        dtype=jnp.dtype(q.dtype),
        p_in_smem=p_in_smem,
        sched=schedule_barrier,
        interpret=bool(interpret),
    )
    _, smem = _smem_plan(cfg)
    if smem > SMEM_BYTES:
        raise ValueError(
            f"block_k={block_k}, num_stages={num_stages} (p_in_smem={p_in_smem}) need "
            f"{smem} B of shared memory per CTA; {SMEM_BYTES} B are available"
        )

    # Row windows of the padded q tiles (rows past Tq see nothing); [2, Tq'] so that one TMA brings a
    # warpgroup's lo and hi (Tq' * 4 bytes is a multiple of 16, as TMA strides must be).
    lo, hi = row_windows(q_start_loc, k_start_loc, tq_pad, tk, causal)
    rows = jnp.stack([lo, hi])
    meta = _tile_meta(lo, hi, n_qtiles, block_k)
    # TMA zero-fills reads and drops writes past the end of an array, but Mosaic GPU's TMA into 8-row
    # tiled (swizzled) shared memory needs row counts that are multiples of 8, and a window no larger
    # than the array: other token counts cost a padded copy (pad T to 8 upstream to avoid it).
    tq_k = max(cdiv(tq, 8) * 8, _WG_ROWS)
    tk_k = max(cdiv(tk, 8) * 8, block_k)
    if tq_k != tq:
        q = jnp.pad(q, ((0, tq_k - tq), (0, 0), (0, 0)))
    if tk_k != tk:
        k = jnp.pad(k, ((0, tk_k - tk), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, tk_k - tk), (0, 0), (0, 0)))

    out, lse = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg),
        out_type=(jax.ShapeDtypeStruct((tq_k, n, dv), q.dtype), jax.ShapeDtypeStruct((n, tq_pad), jnp.float32)),
        grid=(n, n_qtiles),
        grid_names=("h", "qt"),
        num_threads=_WGS + 1,
        thread_name="wg",
        # Row reductions of the WGMMA layout stay within a warp: no cross-warp reduction scratch.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret_params(interpret),
        kernel_name=(
            f"flash_prefill_sm90_bq{_BLOCK_Q}_bk{block_k}_s{num_stages}"
            f"{'_psmem' if p_in_smem else ''}{'_sched' if schedule_barrier else ''}"
        ),
    )(q, k, v, rows, meta)
    return (out if tq_k == tq else out[:tq]), lse[:, :tq].T


def flash_prefill_sm90(
    q,  # [Tq, N, Dq] bf16/f16 (Dq = P+R = 192)
    k,  # [Tk, N, Dq]
    v,  # [Tk, N, V] (V = 128, not padded)
    q_start_loc,  # i32[S+1]
    k_start_loc,  # i32[S+1]
    *,
    causal: bool,
    scale: float,
    interpret: bool | plgpu.InterpretGPUParams = False,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    p_in_smem: bool | None = None,
    schedule_barrier: bool = True,
):
    """Hopper varlen attention. Returns (out [Tq, N, V] q.dtype, lse f32[Tq, N] natural log).

    Same contract as `pallas_kernels.flash_prefill.flash_prefill`: sequence s owns q rows
    [q_start_loc[s], q_start_loc[s+1]) and k/v rows [k_start_loc[s], k_start_loc[s+1]); causal is
    bottom-right aligned (q row i of a segment sees its first k_len - q_len + i + 1 keys); padding
    rows and rows that see no key get out 0 and lse -inf. bf16/f16 only, head dims multiples of 64.
    Token counts that are not multiples of 8 (or below 64 rows of q / block_k rows of k) cost a padded
    copy of the inputs and of out (TMA into swizzled shared memory moves 8-row tiles).

    Tuning (keyword-only, static): block_k key rows per tile (64 or 128; default 128, 64 with P in
    shared memory), num_stages K/V ring depth (>= 2; default 2, 3 with BK 64), p_in_smem (P V with
    P from shared memory instead of registers; forced under the interpreter), schedule_barrier (FA3
    ping-pong of the two consumer warpgroups). A CTA takes 128 query rows (two consumer warpgroups of
    64). num_warps follows (12: 4 per warpgroup, the producer's too); it is accepted for signature
    compatibility with flash_prefill.
    interpret: run under the Mosaic GPU interpreter (CPU testing): True, or a
    `plgpu.InterpretGPUParams` (e.g. detect_races=True). It needs an XLA CPU worker per warpgroup (3:
    NPROC).
    """
    _validate_sm90(q, k, v, q_start_loc, k_start_loc, scale, interpret, block_k, num_warps, num_stages, p_in_smem)
    p_in_smem = bool(interpret) or bool(p_in_smem)
    d_bk, d_stages = _defaults(p_in_smem)
    block_k = d_bk if block_k is None else block_k
    num_stages = (d_stages if block_k == d_bk else 2) if num_stages is None else num_stages
    return _impl(
        q,
        k,
        v,
        q_start_loc,
        k_start_loc,
        causal=bool(causal),
        scale=float(scale),
        interpret=static_interpret(interpret),
        block_k=int(block_k),
        num_stages=int(num_stages),
        p_in_smem=p_in_smem,
        schedule_barrier=bool(schedule_barrier),
    )
