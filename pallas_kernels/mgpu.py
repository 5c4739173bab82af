"""Helpers shared by the Mosaic GPU (Hopper) kernels: shared-memory layouts and budget, the
interpreter switch, the wgmma/TMA idioms both kernels use, and the register operands of an fp8 P.V."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mfa
from jax.experimental.mosaic.gpu import utils as mutils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.util import FP8, M_INIT, cdiv

SMEM_BYTES = 227 * 1024  # per-block opt-in shared memory on H100/H200
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a wgmma accumulator (softmax m, l)
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)  # one value per column (a token's scale; a head's alpha in O^T)


def tiled(dtype, minor_bytes=128):
    """Tiling + swizzle transforms for a wgmma/TMA operand with `minor_bytes`-byte swizzle."""
    elems = minor_bytes // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(minor_bytes))


def smem_bytes(refs) -> int:
    """Bytes of shared memory the `plgpu.SMEM` refs (nested lists of them too) take, each starting at a 1 KB
    boundary."""
    total = 0
    for ref in jax.tree.leaves(refs, is_leaf=lambda x: hasattr(x, "shape")):
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
    poison a P.V wgmma), and only then does the caller's warpgroup arrive on `ready`. An e4m3 `dst` (the fp8
    P.V's page) is zeroed as int8 bytes: Mosaic GPU has only bitwise operations on 8-bit types."""

    @pl.when(jnp.logical_not(partial))
    def _():
        plgpu.copy_gmem_to_smem(src, dst, ready)

    @pl.when(partial)
    def _():
        plgpu.copy_gmem_to_smem(src, dst, raw_bar)
        plgpu.barrier_wait(raw_bar)
        rows, cols = dst.shape
        if jnp.dtype(dst.dtype) == FP8:
            _zero_fp8_rows(dst, lo, hi)
        else:
            for rb in range(rows // 64):
                row = plgpu.broadcasted_iota(jnp.int32, (64, 64), 0, layout=plgpu.Layout.WGMMA) + rb * 64
                keep = (row >= lo) & (row < hi)
                for c in range(cols // 64):
                    block = dst.at[pl.ds(rb * 64, 64), pl.ds(c * 64, 64)]
                    block[...] = jnp.where(keep, block[...], jnp.zeros((), dst.dtype))
        plgpu.commit_smem()  # generic-proxy writes before the consumers' wgmma reads
        plgpu.barrier_arrive(ready)


def _zero_fp8_rows(ref, lo, hi):
    """Rows outside [lo, hi) of an e4m3 [G, cols] shared-memory tile (cols a multiple of 64) set to +0: the bytes
    and-ed with a mask as int8."""
    g, cols = ref.shape
    layout = plgpu.Layout.SMEM_GMEM_COPY((g, 64), FP8, 64)
    row = plgpu.broadcasted_iota(jnp.int32, (g, 64), 0, layout=layout)
    mask = jnp.where((row >= lo) & (row < hi), jnp.int32(-1), jnp.int32(0)).astype(jnp.int8)
    for c in range(cols // 64):
        block = ref.at[:, pl.ds(64 * c, 64)]
        x = lax.bitcast_convert_type(plgpu.load(block, (), layout=layout), jnp.int8)
        block[...] = lax.bitcast_convert_type(x & mask, FP8)


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


def softmax_step(s, m_i, l_i):
    """One online-softmax step over a tile of logits s [rows, cols] (log2 units, -inf where masked): (m_new, alpha,
    p, l_new) with p = exp2(s - m_new) and alpha = exp2(m_i - m_new) the accumulator's rescale."""
    m_new = jnp.maximum(m_i, s.max(axis=1))
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s - rows_bcast(m_new, s.shape))
    return m_new, alpha, p, l_i * alpha + p.sum(axis=1)


def rows_bcast(v, shape):
    """A per-row vector broadcast along the columns of `shape`."""
    return lax.broadcast_in_dim(v, shape, [0])


def write_out(acc, inv, stage, dst, by_rows, *, transposed=False, interpret=False):
    """Normalize, stage in shared memory, TMA the real rows to the output (this warpgroup's half
    of the columns); dst(rows) is the destination ref. transposed: acc is the fp8 P.V's O^T (`ot_rows`), inv
    one value per column."""
    if transposed:
        out = ot_rows(acc * lax.broadcast_in_dim(inv, acc.shape, [1]), interpret=interpret)
    else:
        out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    stage[...] = out.astype(stage.dtype)
    plgpu.commit_smem()
    by_rows(lambda k: plgpu.copy_smem_to_gmem(stage.at[pl.ds(0, k)], dst(k)))


# fp8 P.V as O^T = V^T P^T (Hopper's fp8 wgmma reads its shared-memory operands K-major only, and a page holds V
# N-major: [tokens, latents]). V^T is the register A operand, built from the page without a shared-memory round
# trip: the e4m3 page seen as 16-bit pairs of latents is read transposed (`ldmatrix.trans`, one pair of tokens a
# 16-bit half), and one byte permute (`prmt`) of two such registers gives the four tokens of one latent that an
# 8-bit A register holds (FA3's and FlashMLA's fp8 V transpose, kept in registers). The operand's rows and columns
# come out permuted, in orders fixed by the instructions:
#   row rho of a 128-latent chunk    <-> latent 2 (rho % 64) + rho // 64
#   column kappa of a 16-token group <-> token 2 (kappa // 4) + kappa % 2 + 8 ((kappa % 4) // 2)
# P^T (the B operand, [heads, tokens] K-major in shared memory) is stored in the same token order, which is exactly
# how an f32 accumulator's registers regroup into the 8-bit layout, so the token order cancels in the product; the
# latent order is undone when O^T leaves the accumulator (`ot_rows`). The interpreter runs the same permutations
# as reshapes (it has no inline Mosaic GPU code and no register-operand wgmma).
VT_CHUNK = 128  # latents of one V^T chunk: 64 16-bit columns, two 64-row wgmma tiles


def _tokens_pv_order(x):
    """x[..., kappa] = x[..., token(kappa)] over groups of 16 tokens (the order above)."""
    *lead, t = x.shape
    return jnp.swapaxes(x.reshape(*lead, t // 16, 2, 4, 2), -3, -2).reshape(x.shape)


def _vt_chunk_rows(x):
    """[c * 128, K] latent rows -> V^T's row order (row 128 c + 64 m + q <-> latent 128 c + 2 q + m)."""
    c = x.shape[0] // VT_CHUNK
    return jnp.swapaxes(x.reshape(c, 64, 2, x.shape[-1]), 1, 2).reshape(x.shape)


def _vt_operand_gpu(x, chunks: int):
    """The 16-bit transposed view's registers [64 c, G] (WGMMA layout) -> e4m3 V^T [128 c, G] (8-bit WGMMA layout)."""
    shape = (VT_CHUNK * chunks, 64)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(shape, FP8, layout=plgpu.Layout.WGMMA_8BIT),
    )
    def regroup(ctx, x):
        del ctx
        from jax._src.lib.mlir import ir
        from jax._src.lib.mlir.dialects import llvm

        i32 = ir.IntegerType.get_signless(32)
        e4m3x4 = ir.VectorType.get((4,), ir.Float8E4M3FNType.get())
        regs = x.registers  # [chunk, 8-token block, 1, 1, row half, ...]: (token pair) x (latent pair) bytes
        out = np.empty(mfa.WGMMA_LAYOUT_8BIT.registers_shape(shape), object)
        for c in range(chunks):
            for j in range(4):  # 16-token groups
                for h in range(2):
                    lo, hi = (mutils.bitcast(regs[c, 2 * j + i, 0, 0, h, 0, 0, 0, 0], i32) for i in range(2))
                    for m, sel in ((0, 0x6420), (1, 0x7531)):  # even / odd latent of the pair
                        r = llvm.inline_asm(i32, [lo, hi], f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r")
                        out[2 * c + m, j, 0, 0, h, 0, 0, 0, 0] = mutils.bitcast(r, e4m3x4)
        return mfa.FragmentedArray(_registers=out, _layout=mfa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return regroup(x)


def vt_fp8_operand(v8, v16, *, interpret):
    """V^T of an e4m3 page chunk as the register A operand of an fp8 wgmma: [128 c, G] e4m3, rows and columns in
    the orders above.

    v8: the chunk [G, 128 c] e4m3 in shared memory (64-byte swizzle); v16: the same bytes seen as [G, 64 c] bf16 (a
    `plgpu.RefUnion` alias with the matching tiling), which the GPU path reads transposed. G = 64."""
    chunks = v8.shape[1] // VT_CHUNK
    if interpret:
        return _vt_chunk_rows(_tokens_pv_order(v8[...].T))
    x = plgpu.load(v16.transpose((1, 0)), (), layout=plgpu.Layout.WGMMA)
    return _vt_operand_gpu(x, chunks)


def pt_fp8_operand(p, *, interpret):
    """P [rows, G] (e4m3, WGMMA layout) in the token order above, to store into the K-major P^T buffer.

    On the GPU it is the same registers regrouped: an accumulator thread's two 8-token column blocks hold exactly
    the four permuted columns an 8-bit layout thread holds."""
    if interpret:
        return _tokens_pv_order(p)
    rows = p.shape[0]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct((rows, 64), FP8, layout=plgpu.Layout.WGMMA_8BIT),
    )
    def regroup(ctx, p):
        del ctx
        from jax._src.lib.mlir.dialects import vector

        regs = p.registers
        out = np.empty(mfa.WGMMA_LAYOUT_8BIT.registers_shape((rows, 64)), object)
        for t in range(rows // 64):
            for j in range(4):
                for h in range(2):
                    a, b = (regs[t, 2 * j + i, 0, 0, h, 0, 0, 0, 0] for i in range(2))
                    out[t, j, 0, 0, h, 0, 0, 0, 0] = vector.shuffle(a, b, [0, 1, 2, 3])
        return mfa.FragmentedArray(_registers=out, _layout=mfa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return regroup(p)


# O [heads, latents] as the O^T accumulator's threads hold it: per 8 heads x 32 latents, lane (r, g) of warp w holds
# heads 8 j + 2 g + {0, 1} and latents 32 w + 16 h + 2 r + {0, 1} (the vector).
OT_ROWS_LAYOUT = plgpu.Layout.TILED(
    mfa.Tiling(((64, VT_CHUNK), (8, 32), (2, 16), (2,))), warp_dims=(-6,), lane_dims=(-2, -5), vector_dim=-1
)


def ot_rows(acc, *, interpret):
    """The O^T accumulator f32 [128 c, 64] (rows in V^T's latent order) as O [64, 128 c] in natural order; on the
    GPU in `OT_ROWS_LAYOUT` (registers regrouped, no data movement), ready to store."""
    c = acc.shape[0] // VT_CHUNK
    if interpret:
        return jnp.swapaxes(acc.reshape(c, 2, 64, 64), 1, 2).reshape(acc.shape).T
    layout = OT_ROWS_LAYOUT.to_mgpu()
    shape = (64, VT_CHUNK * c)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(shape, acc.dtype, layout=OT_ROWS_LAYOUT),
    )
    def regroup(ctx, acc):
        del ctx
        from jax._src.lib.mlir.dialects import vector

        regs = acc.registers  # [m tile, 8-head block, 1, 1, row half, ...], vector: 2 heads
        out = np.empty(layout.registers_shape(shape), object)
        for ch in range(c):
            for j in range(8):
                for h in range(2):
                    a, b = regs[2 * ch, j, 0, 0, h, 0, 0, 0, 0], regs[2 * ch + 1, j, 0, 0, h, 0, 0, 0, 0]
                    for e in range(2):
                        out[0, ch, j, 0, 0, h, e, 0, 0] = vector.shuffle(a, b, [e, 2 + e])
        return mfa.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return regroup(acc)


def vt_accumulate(acc, vt, pt, *, interpret):
    """acc f32 [128 c, 64] + V^T P^T: vt from `vt_fp8_operand`, pt the [64, G] e4m3 P^T buffer (`pt_fp8_operand`'s
    columns), as one fp8 wgmma with A in registers (waits for it). The interpreter has no register-operand wgmma:
    there a float32 dot (the same products, each exact in float32)."""
    if interpret:
        return acc + jnp.dot(vt.astype(jnp.float32), pt[...].astype(jnp.float32).T)
    return wgmma_accumulate(acc, vt, pt.transpose((1, 0)), interpret=False)
