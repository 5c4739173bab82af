"""Block-scaled FP8 GEMMs (W8A8, DeepSeek-V3's format) for Hopper: a Mosaic GPU kernel (TMA + fp8 wgmma).

Weights are e4m3 [N, K] (HF / torch Linear layout [out, in]) with one float32 `weight_scale_inv` per
128 x 128 block, [cdiv(N, 128), cdiv(K, 128)] (w ~= w_fp8 * scale_inv per block). Activations x [M, K]
are quantized right before the kernel, per token per 128 channels (`quantize_act`: e4m3 with a float32
scale per (row, K block), amax / 448). The kernel follows DeepGEMM's recipe: for each 128-deep K block,
one fp8 wgmma into a fresh float32 accumulator, which is then scaled by (activation scale of the row) x
(weight scale of the block) and added to the running float32 sum in registers ("promotion": the fp8
wgmma accumulates at reduced precision, so no more than 128 of K go into one accumulator). bf16 out.

Shapes: M tokens (rows), N output features, K input features, G experts, Lyr stacked layers.

Two entry points share one kernel body:
- `fp8_matmul(x, w, s)`: dense, x [M, K] @ w[N, K]^T.
- `fp8_grouped_matmul(x, w, s, group_sizes, rhs_index=)`: routed experts, x rows sorted by expert, w
  [G, N, K] (or [Lyr, G, N, K] with `rhs_index`, read in place), scales [G(, Lyr), cdiv(N,128),
  cdiv(K,128)]. It reuses `grouped_matmul.work_items` (row tile, row range, group) and stores only
  each item's rows (a ladder of power-of-two-row TMA stores, so items sharing a tile write disjoint
  rows); rows past sum(group_sizes) come out exactly 0, and padding items skip their K loop.
The dense GEMM is the grouped one with a single group (its work list is the row tiles).

Kernel: grid (N tiles, work items, K splits), one warpgroup per CTA; `plgpu.emit_pipeline` TMAs, per K
block, the [bm, 128] fp8 activation tile, its [bm] scales (from the transposed scales [Kb, M]) and the
[bn, 128] fp8 weight tile into a `stages`-deep ring (`default_stages`: two CTAs per SM); the weight scale
(one float32 per K block, bn <= 128) is read from global memory while the wgmma runs. bm 64 (M <= 64) or
128; bn 128, or 64 when N % 128 == 64 (two N tiles share a scale block). Few-row problems split K over the
third grid axis (`default_k_splits`: float32 partials summed by XLA) so that enough CTAs stream the
weights. Requires K % 128 == 0 and N % 64 == 0 (`unsupported_reason`); other shapes go to the plain-JAX
path (`fp8_matmul_xla`: the same activation quantization, XLA dequantize + float32 dot, so a model
computes the same numbers on either path). M is padded to the row tile (activations only: cheap).

Every e4m3 -> float32 conversion here goes through `_f32`, behind an optimization barrier: XLA's GPU pipeline
runs SimplifyFPConversions (with xla_allow_excess_precision, on by default), which folds a chain of float
converts inside one program, so a jitted quantize -> dequantize (f32 -> e4m3 -> f32) can skip the e4m3
rounding. The kernel's "error" of 2.6e-2 of max|ref| on the H200 against the jitted `fp8_matmul_xla`
(bench/results/fp8-gemm-h200.json at 82f5e73) is exactly the quantized-vs-unquantized-activation difference
of those inputs (M=1 q_a_proj: 0.02703 measured, 0.02703 recomputed on CPU; M=16384: 0.02656 / 0.02647): the
XLA path had computed with unquantized activations. The CPU compiler keeps the chain, so the interpreter tests
could not see it; `bench/fp8_gemm.py --diagnose` (row xla_jit_no_barrier) shows the fold on the GPU.

References beside it: `fp8_matmul_reference` (dequantized weights x unquantized activations in float32:
what the fp8 model approximates) and `fp8_matmul_quantized_reference` (the kernel's exact math: the same
quantized activations and per-block scaled float32 partial sums; differences are float32 rounding only).

Tests: tests/pallas_kernels/test_fp8_matmul.py (Mosaic GPU interpreter on CPU, sm_90 lowering; `-m gpu`
the compiled kernel); speed: bench/fp8_gemm.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import fp8_quant
from pallas_kernels.grouped_matmul import check_groups, row_items, work_items
from pallas_kernels.mgpu import interpret_params, static_interpret, tiled
from pallas_kernels.util import (
    BF16,
    F32,
    FP8,
    FP8_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_MAX,
    cdiv,
    check_fp8_weight,
    num_sms,
    quantize_act,
)

BLOCK = FP8_BLOCK  # quantization block: DeepSeek-V3's weight_block_size, and the kernel's K step
_ROW = plgpu.Layout.WGMMA.reduce(1)

__all__ = [
    "BLOCK",
    "quantize_act",
    "quantize_weight_blocks",
    "dequantize_weight_blocks",
    "unsupported_reason",
    "default_k_splits",
    "default_stages",
    "fp8_matmul",
    "dequantize_act",
    "fp8_matmul_xla",
    "fp8_matmul_reference",
    "fp8_matmul_quantized_reference",
    "fp8_grouped_matmul",
    "fp8_grouped_matmul_xla",
    "fp8_grouped_matmul_reference",
]


# ---- quantization (plain JAX) ----


def _f32(q):
    """e4m3 -> float32 that XLA cannot fold into the f32 -> e4m3 convert that made `q` (see the module
    docstring: without the barrier, XLA on GPU drops the fp8 rounding of a quantize -> dequantize in one jit)."""
    return lax.optimization_barrier(q).astype(F32)


def quantize_weight_blocks(w, block: tuple[int, int] = (BLOCK, BLOCK)):
    """w [..., N, K] -> (e4m3 [..., N, K], float32 scale_inv [..., cdiv(N, bn), cdiv(K, bk)]): one scale per
    block, amax / 448 (DeepSeek-V3's checkpoint format; edge blocks are partial)."""
    bn, bk = block
    *lead, n, k = w.shape
    nb, kb = cdiv(n, bn), cdiv(k, bk)
    wf = jnp.pad(w.astype(F32), [(0, 0)] * len(lead) + [(0, nb * bn - n), (0, kb * bk - k)])
    wf = wf.reshape(*lead, nb, bn, kb, bk)
    amax = jnp.max(jnp.abs(wf), axis=(-3, -1))  # [..., Nb, Kb]
    scale = jnp.maximum(amax, FP8_AMAX_FLOOR) / FP8_MAX
    q = (wf / scale[..., :, None, :, None]).astype(FP8).reshape(*lead, nb * bn, kb * bk)[..., :n, :k]
    return q, scale


def dequantize_weight_blocks(w, scale_inv, block: tuple[int, int] = (BLOCK, BLOCK), dtype=F32):
    """e4m3 w [..., N, K] * scale_inv per block -> `dtype` [..., N, K] (jnp; traceable)."""
    bn, bk = block
    n, k = w.shape[-2:]
    s = jnp.repeat(jnp.repeat(scale_inv.astype(F32), bn, axis=-2)[..., :n, :], bk, axis=-1)[..., :k]
    return (_f32(w) * s).astype(dtype)


# ---- validation ----


def _check_x(x, k):
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x must be [M, K], got shape {getattr(x, 'shape', None)}")
    if x.shape[1] != k:
        raise ValueError(f"x {x.shape} has K={x.shape[1]}, but the weight has K={k}")
    if x.shape[0] < 1:
        raise ValueError(f"x has no rows: {x.shape}")


def unsupported_reason(n: int, k: int) -> str | None:
    """Why the Mosaic GPU kernel cannot take an [N, K] weight (None: it can)."""
    if k % BLOCK:
        return f"K={k} is not a multiple of {BLOCK} (one fp8 wgmma K step per scale block)"
    if n % 64:
        return f"N={n} is not a multiple of 64 (wgmma N tile)"
    return None


# ---- the kernel ----


def _tiles(m: int, n: int):
    bm = 64 if m <= 64 else 128
    bn = 128 if n % 128 == 0 else 64
    return bm, bn


def _kernel(
    tile_ref,
    lo_ref,
    hi_ref,
    grp_ref,
    layer_ref,
    a_gmem,  # e4m3 [Mp, K]
    as_gmem,  # f32 [Kb, Mp] (activation scales, transposed: a row tile's scales per K block are contiguous)
    b_gmem,  # e4m3 [Lyr, G, N, K]
    bs_gmem,  # f32 [Lyr * G * Nb, Kb]
    out_gmem,  # [S, M, N] (S K splits; S == 1: out_dtype, else float32 partials)
    *,
    m: int,
    num_groups: int,
    num_layers: int,
    bm: int,
    bn: int,
    kb: int,
    nb: int,
    stages: int,
    steps: int,
    interpret: bool,
):
    j = lax.axis_index("n")
    i = lax.axis_index("w")
    split = lax.axis_index("s")
    k0 = split * steps  # this split's first K block
    tile, lo, hi, grp = tile_ref[i], lo_ref[i], hi_ref[i], grp_ref[i]
    layer = jnp.clip(layer_ref[0], 0, num_layers - 1)  # clamped here, not by an XLA kernel before the call
    g = jnp.clip(grp, 0, num_groups - 1)
    row0 = tile * bm
    start = jnp.maximum(lo, row0)
    size = jnp.maximum(jnp.minimum(hi, row0 + bm) - start, 0)  # rows this item stores
    is_gemm = (grp >= 0) & (grp < num_groups) & (size > 0)
    s_row = (layer * num_groups + g) * nb + (j * bn) // BLOCK  # this N tile's weight-scale row

    def step(idx, a_smem, as_smem, b_smem, total):
        sb = bs_gmem[s_row, k0 + idx[0]]  # scalar load, issued before the wgmma's result is read

        def mm(acc_ref):
            plgpu.wgmma(acc_ref, a_smem, b_smem.T)  # fp8 x fp8: both operands K-major
            sa = plgpu.load(as_smem.at[0], (), layout=_ROW)  # [bm] activation scales of this K block
            plgpu.commit_smem()  # order that generic-proxy read before the pipeline's next TMA into the slot
            part = acc_ref[...]  # waits for the wgmma
            return part * lax.broadcast_in_dim(sa * sb, part.shape, [0])

        return total + pl.run_scoped(mm, plgpu.ACC((bm, bn), F32))

    pipeline = plgpu.emit_pipeline(
        step,
        grid=(steps,),
        in_specs=[
            plgpu.BlockSpec((bm, BLOCK), lambda kk: (tile, k0 + kk), transforms=tiled(FP8)),
            plgpu.BlockSpec((1, bm), lambda kk: (k0 + kk, tile)),
            plgpu.BlockSpec((bn, BLOCK), lambda kk: (j, k0 + kk), transforms=tiled(FP8)),
        ],
        max_concurrent_steps=stages,
        init_carry=plgpu.layout_cast(jnp.zeros((bm, bn), F32), plgpu.Layout.WGMMA),
    )

    def store(o_smem):
        @pl.when(is_gemm)
        def _():
            acc = pipeline(a_gmem, as_gmem, b_gmem.at[layer, g])
            o_smem[...] = acc.astype(o_smem.dtype)

        @pl.when(jnp.logical_not(is_gemm))
        def _():
            o_smem[...] = plgpu.layout_cast(jnp.zeros((bm, bn), o_smem.dtype), plgpu.Layout.WGMMA)

        plgpu.commit_smem()
        # Rows [start, start + size) of the tile, in power-of-two pieces (TMA boxes are static).
        off = start - row0
        width = bm
        while width >= 1:

            @pl.when(size & width != 0)
            def _(off=off, width=width):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[pl.ds(off, width)], out_gmem.at[split, pl.ds(row0 + off, width), pl.ds(j * bn, bn)]
                )

            off = off + (size & width)
            width //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(store, plgpu.SMEM((bm, bn), out_gmem.dtype))
    del m


@functools.partial(jax.jit, static_argnames=("interpret", "stages", "splits", "out_dtype", "by_row"))
def _impl(xq, xs, w, ws, groups, layer, *, interpret, stages, splits, out_dtype, by_row):
    """xq e4m3 [M, K], xs f32 [M, Kb], w e4m3 [Lyr, G, N, K], ws f32 [Lyr, G, Nb, Kb], layer i32[1]; groups:
    group_sizes i32[G], or with by_row each row's group i32[M] (`grouped_matmul.row_items`)."""
    m, k = xq.shape
    lyr, g, n, _ = w.shape
    kb, nb = k // BLOCK, cdiv(n, BLOCK)
    bm, bn = _tiles(m, n)
    mp = cdiv(m, bm) * bm
    xq = jnp.pad(xq, ((0, mp - m), (0, 0)))  # rows past M: zeros, never stored
    xs_t = jnp.pad(xs, ((0, mp - m), (0, 0))).T  # [Kb, Mp]
    tile, lo, hi, grp = row_items(groups, g, bm) if by_row else work_items(groups, m, bm)
    kernel = plgpu.kernel(
        functools.partial(
            _kernel,
            m=m,
            num_groups=g,
            num_layers=lyr,
            bm=bm,
            bn=bn,
            kb=kb,
            nb=nb,
            stages=min(stages, kb // splits),
            steps=kb // splits,
            interpret=bool(interpret),
        ),
        out_type=jax.ShapeDtypeStruct((splits, m, n), out_dtype if splits == 1 else F32),
        grid=(n // bn, tile.shape[0], splits),
        grid_names=("n", "w", "s"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret_params(interpret),
        kernel_name=f"fp8_matmul_bm{bm}_bn{bn}_st{stages}_ks{splits}",
    )
    out = kernel(tile, lo, hi, grp, layer, xq, xs_t, w, ws.reshape(lyr * g * nb, kb))
    return out[0] if splits == 1 else jnp.sum(out, axis=0).astype(out_dtype)


def default_stages(m: int) -> int:
    """Ring depth (untuned; bench/fp8_gemm.py --stages sweeps it): sized so that two CTAs fit one SM's 227 KB
    of shared memory, so one CTA's wgmmas overlap the other's promotion and epilogue (DeepGEMM gets that
    from two math warpgroups). bm 128: 2 x 32.5 KB + 32 KB bf16 staging = 97 KB; bm 64 (decode, weight
    streaming wants loads in flight): 3 x 24.5 KB + 32 KB float32 staging = 106 KB."""
    return 3 if _tiles(m, 128)[0] == 64 else 2


def default_k_splits(m: int, n: int, k: int, g: int = 1, sms: int | None = None) -> int:
    """K splits for few-row (weight-bandwidth-bound) problems: with one row tile per group, the N tiles alone
    (N/128 CTAs: 12 for V3's q_a_proj) cannot pull HBM bandwidth; split K (a divisor of K/128, at most 8)
    until about 2 CTAs per SM. float32 partials [S, M, N] are summed by XLA (cheap when M is small)."""
    bm, bn = _tiles(m, n)
    if m > bm * 2:
        return 1
    sms = num_sms() if sms is None else sms
    ctas = (n // bn) * min(g, m)  # best case: every row in its own group's tile
    kb = k // BLOCK
    splits = 1
    for s in range(2, 9):
        if kb % s == 0 and kb // s >= 4 and ctas * s <= 2 * sms:
            splits = s
    return splits


def _run(x, w4, s4, groups, layer, interpret, out_dtype, k_splits, stages, by_row=False):
    m, k = x.shape
    kb = k // BLOCK
    if k_splits is None:
        k_splits = default_k_splits(m, w4.shape[-2], k, m if by_row else w4.shape[1])
    if not (isinstance(k_splits, int) and k_splits >= 1 and kb % k_splits == 0):
        raise ValueError(f"k_splits={k_splits!r} must be a positive divisor of K/128={kb}")
    stages = default_stages(m) if stages is None else stages
    if not (isinstance(stages, int) and 1 <= stages <= 8):
        raise ValueError(f"stages={stages!r} must be an int in [1, 8]")
    xq, xs = fp8_quant.quantize_act(x, interpret=bool(interpret))  # one Triton kernel (XLA: three)
    return _impl(
        xq,
        xs,
        w4,
        s4,
        groups,
        layer,
        interpret=static_interpret(interpret),
        stages=stages,
        splits=k_splits,
        out_dtype=jnp.dtype(out_dtype).name,
        by_row=by_row,
    )


def fp8_matmul(x, w, w_scale_inv, *, rhs_index=None, interpret=False, out_dtype=BF16, k_splits=None, stages=None):
    """x [M, K] (bf16/f32) @ dequant(w)[N, K]^T -> out_dtype [M, N], W8A8 with x quantized per token per
    128 channels (see the module docstring). w e4m3 [N, K], w_scale_inv f32 [cdiv(N,128), cdiv(K,128)], or
    stacked over layers [Lyr, N, K] / [Lyr, Nb, Kb] with `rhs_index` (static or traced int scalar, clamped)
    picking the layer, read in place (a layer scan's slice feeding the kernel would be a copy of the weight).
    Shapes the kernel does not take (`unsupported_reason`) raise; `fp8_matmul_xla` takes any.
    interpret: the Mosaic GPU interpreter (CPU tests): True or a `plgpu.InterpretGPUParams`.
    k_splits: K split into float32 partials (a divisor of K/128; None: `default_k_splits`); stages: TMA ring
    depth (None: `default_stages`)."""
    stacked = rhs_index is not None
    if not hasattr(w, "ndim") or w.ndim != 2 + stacked:
        want = "[Lyr, N, K] with rhs_index" if stacked else "[N, K] (a stacked w needs rhs_index)"
        raise ValueError(f"w must be {want}, got shape {getattr(w, 'shape', None)}")
    check_fp8_weight(w, w_scale_inv, "w", "w_scale_inv")
    n, k = w.shape[-2:]
    _check_x(x, k)
    if (why := unsupported_reason(n, k)) is not None:
        raise ValueError(f"fp8_matmul: {why}; use fp8_matmul_xla")
    sizes = jnp.full((1,), x.shape[0], jnp.int32)
    if stacked:  # [Lyr, 1 group, N, K]: the grouped kernel's layer axis
        layer = jnp.asarray(rhs_index, jnp.int32).reshape(1)  # clamped to [0, Lyr) in the kernel
        w, w_scale_inv = w[:, None], w_scale_inv[:, None]
    else:
        layer = jnp.zeros((1,), jnp.int32)
        w, w_scale_inv = w[None, None], w_scale_inv[None, None]
    return _run(x, w, w_scale_inv, sizes, layer, interpret, out_dtype, k_splits, stages)


def fp8_grouped_matmul(
    x,
    w,
    w_scale_inv,
    group_sizes=None,
    *,
    row_groups=None,
    rhs_index=None,
    interpret=False,
    out_dtype=BF16,
    k_splits=None,
    stages=None,
):
    """Routed experts: out[r] = x[r] @ dequant(w[g(r)])^T for the rows r of group g(r) (rows sorted by
    group, group_sizes i32[G], sum <= M); rows >= sum(group_sizes) come out exactly 0.

    w e4m3 [G, N, K] with scales f32 [G, cdiv(N,128), cdiv(K,128)], or stacked over layers [Lyr, G, N, K] /
    [Lyr, G, Nb, Kb] with `rhs_index` (static or traced int scalar, clamped) picking the layer, read in
    place. Same work list as `grouped_matmul` (grouped_matmul.work_items); row_groups (instead of
    group_sizes): i32[M], each row's group, rows in any order, a group outside [0, G) gives 0
    (grouped_matmul.row_items)."""
    stacked = rhs_index is not None
    if not hasattr(w, "ndim") or w.ndim != 3 + stacked:
        want = "[Lyr, G, N, K] with rhs_index" if stacked else "[G, N, K] (a stacked w needs rhs_index)"
        raise ValueError(f"w must be {want}, got shape {getattr(w, 'shape', None)}")
    check_fp8_weight(w, w_scale_inv, "w", "w_scale_inv")
    g, n, k = w.shape[-3:]
    _check_x(x, k)
    check_groups(group_sizes, row_groups, g, x.shape[0])
    if (why := unsupported_reason(n, k)) is not None:
        raise ValueError(f"fp8_grouped_matmul: {why}; use fp8_grouped_matmul_xla")
    if stacked:
        layer = jnp.asarray(rhs_index, jnp.int32).reshape(1)  # clamped to [0, Lyr) in the kernel
    else:
        w, w_scale_inv, layer = w[None], w_scale_inv[None], jnp.zeros((1,), jnp.int32)
    by_row = row_groups is not None
    groups = row_groups if by_row else group_sizes
    return _run(x, w, w_scale_inv, groups, layer, interpret, out_dtype, k_splits, stages, by_row)


# ---- plain-JAX paths and references ----


def dequantize_act(xq, xs, block: int = BLOCK):
    """e4m3 [M, K] x f32 scales [M, cdiv(K, block)] -> f32 [M, K]."""
    return _f32(xq) * jnp.repeat(xs, block, axis=1)[:, : xq.shape[1]]


def fp8_matmul_xla(x, w, w_scale_inv, *, rhs_index=None, out_dtype=None):
    """The portable path (CPU, shapes the kernel does not take) with the kernel's numerics: x quantized per
    token per 128 channels as the kernel does, both operands dequantized to float32, one XLA dot. With
    rhs_index, w / w_scale_inv are stacked over layers as in `fp8_matmul`."""
    if rhs_index is not None:
        w = lax.dynamic_index_in_dim(w, rhs_index, keepdims=False)
        w_scale_inv = lax.dynamic_index_in_dim(w_scale_inv, rhs_index, keepdims=False)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xd = dequantize_act(*quantize_act(x))
    wd = dequantize_weight_blocks(w, w_scale_inv)
    return jnp.einsum("mk,nk->mn", xd, wd, preferred_element_type=F32).astype(out_dtype)


def fp8_grouped_matmul_xla(x, w, w_scale_inv, group_sizes, *, rhs_index=None, out_dtype=None):
    """Portable grouped path, the kernel's numerics: quantized activations, the (layer's) experts dequantized
    to float32, `lax.ragged_dot_general`."""
    if rhs_index is not None:
        w = lax.dynamic_index_in_dim(w, rhs_index, keepdims=False)
        w_scale_inv = lax.dynamic_index_in_dim(w_scale_inv, rhs_index, keepdims=False)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    xd = dequantize_act(*quantize_act(x))
    wd = dequantize_weight_blocks(w, w_scale_inv)
    dn = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    return lax.ragged_dot_general(xd, wd, group_sizes, dn, preferred_element_type=F32).astype(out_dtype)


def fp8_matmul_reference(x, w, w_scale_inv):
    """float32 x @ dequant(w)^T, activations unquantized: what the W8A8 GEMM approximates."""
    wd = dequantize_weight_blocks(w, w_scale_inv)
    return jnp.dot(x.astype(F32), wd.T, precision=lax.Precision.HIGHEST)


def fp8_matmul_quantized_reference(x, w, w_scale_inv):
    """The kernel's math in plain JAX (float32): quantized activations, one product per 128-deep K block,
    scaled by (row scale x block scale) and summed over K blocks."""
    n, k = w.shape
    kb = cdiv(k, BLOCK)
    xq, xs = quantize_act(x)
    xb = jnp.pad(_f32(xq), ((0, 0), (0, kb * BLOCK - k))).reshape(-1, kb, BLOCK)  # [M, Kb, 128]
    wb = jnp.pad(_f32(w), ((0, 0), (0, kb * BLOCK - k))).reshape(n, kb, BLOCK)  # [N, Kb, 128]
    parts = jnp.einsum("mbk,nbk->mnb", xb, wb, precision=lax.Precision.HIGHEST)  # [M, N, Kb]
    ws = jnp.repeat(w_scale_inv.astype(F32), BLOCK, axis=0)[:n]  # [N, Kb]
    return jnp.sum(parts * xs[:, None, :] * ws[None, :, :], axis=-1)


def fp8_grouped_matmul_reference(
    x, w, w_scale_inv, group_sizes=None, *, row_groups=None, rhs_index=None, quantized=True
):
    """float32 grouped reference: per group, the dense reference on its rows (masked with `where`, so NaN
    padding rows cannot leak); rows past sum(group_sizes), or whose row_groups entry is outside [0, G), are 0.
    quantized: the kernel's exact math (`fp8_matmul_quantized_reference`), else unquantized activations."""
    if rhs_index is not None:
        w = lax.dynamic_index_in_dim(w, jnp.clip(rhs_index, 0, w.shape[0] - 1), keepdims=False)
        w_scale_inv = lax.dynamic_index_in_dim(w_scale_inv, jnp.clip(rhs_index, 0, w.shape[0] - 1), keepdims=False)
    ref = fp8_matmul_quantized_reference if quantized else fp8_matmul_reference
    m = x.shape[0]
    if row_groups is None:
        ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
        starts = ends - jnp.maximum(group_sizes, 0)
    rows = jnp.arange(m)
    out = jnp.zeros((m, w.shape[1]), F32)
    for e in range(w.shape[0]):
        inside = (row_groups == e if row_groups is not None else (rows >= starts[e]) & (rows < ends[e]))[:, None]
        xe = jnp.where(inside, x, 0)
        out = jnp.where(inside, ref(xe, w[e], w_scale_inv[e]), out)
    return out
