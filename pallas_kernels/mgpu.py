"""Helpers shared by the Mosaic GPU (Hopper) kernels: shared-memory layouts and budget, the
interpreter switch, and the wgmma/TMA idioms both kernels use."""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.util import M_INIT, cdiv

SMEM_BYTES = 227 * 1024  # per-block opt-in shared memory on H100/H200
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma accumulator (softmax m, l)


def tiled(dtype, minor_bytes=128):
    """Tiling + swizzle transforms for a wgmma/TMA operand with `minor_bytes`-byte swizzle."""
    elems = minor_bytes // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(minor_bytes))


def smem_bytes(refs) -> int:
    """Bytes of shared memory the `plgpu.SMEM` refs take, each starting at a 1 KB boundary."""
    total = 0
    for ref in refs:
        total = cdiv(total, 1024) * 1024 + math.prod(ref.shape) * jnp.dtype(ref.dtype).itemsize
    return total


def interpret_params(interpret):
    """`plgpu.kernel`'s `interpret` argument: the caller's `plgpu.InterpretGPUParams`, default
    parameters for True, None (compile for the GPU) for False."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def static_interpret(interpret):
    """`interpret` as a hashable static jit argument: the params object itself, or a bool."""
    return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else bool(interpret)


def wgmma_accumulate(acc, a, b, *, interpret: bool):
    """acc + a @ b with one wgmma accumulating into `acc`'s registers (waits for completion).

    `a` is a shared-memory ref or a register value, `b` a shared-memory ref. The Mosaic GPU interpreter
    (jax 0.11.2) can run neither `pl.run_state` over a wgmma accumulator ("MLIR translation rule for
    primitive 'wgmma' not found for platform cpu") nor a register-operand wgmma: there the product goes
    to a fresh zero accumulator and is added in registers (same math, one extra f32 rounding; it would
    double the registers on a GPU).
    """
    if interpret:

        def mm(acc_ref):
            plgpu.wgmma(acc_ref, a, b)
            return acc_ref[...]

        return acc + pl.run_scoped(mm, plgpu.ACC(acc.shape, jnp.float32))

    def mm(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(mm)(plgpu.ACC.init(acc))


def copy_zeroing_rows(src, dst, ready, raw_bar, *, partial, lo, hi):
    """TMA `src` (GMEM) into `dst` (SMEM, [rows, cols], both multiples of 64) so that `ready` fires.

    When `partial`, the copy lands on `raw_bar` instead, the rows of `dst` outside [lo, hi) are
    zeroed (they hold keys no query sees, possibly NaN padding: p = 0 there, but 0 * NaN would still
    poison a P.V wgmma), and only then does the caller's warpgroup arrive on `ready`."""

    @pl.when(jnp.logical_not(partial))
    def _():
        plgpu.copy_gmem_to_smem(src, dst, ready)

    @pl.when(partial)
    def _():
        plgpu.copy_gmem_to_smem(src, dst, raw_bar)
        plgpu.barrier_wait(raw_bar)
        rows, cols = dst.shape
        for rb in range(rows // 64):
            row = plgpu.broadcasted_iota(jnp.int32, (64, 64), 0, layout=plgpu.Layout.WGMMA) + rb * 64
            keep = (row >= lo) & (row < hi)
            for c in range(cols // 64):
                block = dst.at[pl.ds(rb * 64, 64), pl.ds(c * 64, 64)]
                block[...] = jnp.where(keep, block[...], jnp.zeros((), dst.dtype))
        plgpu.commit_smem()  # generic-proxy writes before the consumers' wgmma reads
        plgpu.barrier_arrive(ready)


def cast_fp8_columns(src, dst, valid_rows, chunks):
    """dst[:, 64c : 64c + 64] = src's e4m3 columns there, cast to dst's 16-bit dtype (exact), for each chunk c
    in `chunks`; rows >= valid_rows (a partial last page's) zeroed: p is 0 there, but 0 * NaN garbage would
    poison P.V. src and dst are [G, *] shared-memory tiles with 64-column (8, 64) tiling.

    The copy layout (`SMEM_GMEM_COPY`) moves 8 B of e4m3 and 16 B of the 16-bit type a thread per access,
    where the WGMMA layout moves 2 and 4: the cast was 40% of the narrow fp8 decode's time, and this layout
    with the mask on partial pages only took it from 278 to 222 us at (128, 16, 8192) (docs/perf-notes.md,
    session 18). The row mask costs as much again, so full pages skip it."""
    g, dtype = dst.shape[0], dst.dtype
    layout = plgpu.Layout.SMEM_GMEM_COPY((g, 64), dtype, 128)

    def cast(masked):
        keep = plgpu.broadcasted_iota(jnp.int32, (g, 64), 0, layout=layout) < valid_rows if masked else None
        for c in chunks:
            x = plgpu.load(src.at[:, pl.ds(64 * c, 64)], layout=layout)
            # sm_90 converts e4m3 to bf16 only through f32 (exact). To f16 it is one instruction, but f16 operands
            # measured no faster: the shared-memory traffic bounds the cast (session 30).
            x = x.astype(jnp.float32).astype(dtype)
            if masked:
                x = jnp.where(keep, x, jnp.zeros((), dtype))
            dst.at[:, pl.ds(64 * c, 64)][...] = x

    pl.when(valid_rows < g)(lambda: cast(True))
    pl.when(valid_rows >= g)(lambda: cast(False))


def softmax_state(rows: int, cols: int):
    """The online softmax's initial (acc f32[rows, cols] zeros in the wgmma layout, m = M_INIT, l = 0 per row)."""
    f32 = jnp.float32
    acc = plgpu.layout_cast(jnp.zeros((rows, cols), f32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((rows,), M_INIT, f32), ROW_LAYOUT)
    l_i = plgpu.layout_cast(jnp.zeros((rows,), f32), ROW_LAYOUT)
    return acc, m_i, l_i


def rows_bcast(v, shape):
    """A per-row vector broadcast along the columns of `shape`."""
    return lax.broadcast_in_dim(v, shape, [0])


def write_out(acc, inv, stage, dst, by_rows):
    """Normalize, stage in shared memory, TMA the real rows to the output (this warpgroup's half
    of the columns); dst(rows) is the destination ref."""
    out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    stage[...] = out.astype(stage.dtype)
    plgpu.commit_smem()
    by_rows(lambda k: plgpu.copy_smem_to_gmem(stage.at[pl.ds(0, k)], dst(k)))
