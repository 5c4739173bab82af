"""Several dense linears of one input in one launch: a Pallas kernel lowered through Triton.

    linear(x [T, K], (w_0 [N_0, K], w_1 [N_1, K], ...)) -> (x @ w_0^T [T, N_0], x @ w_1^T [T, N_1], ...)
    linear(x, (w_0 [Lyr, N_0, K], ...), rhs_index=i)              w_j[i] of layers' stacked weights

Weights in the HF (torch Linear) layout [out, in]; float32 accumulation; outputs in `out_dtype` (default the
promotion of x's and the weights' dtypes, as `jnp.einsum` gives). The MLA uses (`mla_jax.layers.linears`): q_proj
and kv_a_proj_with_mqa of one hidden state as one call (V3: q_a_proj and kv_a_proj_with_mqa), o_proj, and the MoE
router's logits (bf16 x, float32 weight, float32 out).

Why: at batch 1 a decode step is weight-bandwidth bound, but XLA runs each projection as its own reduce fusion at
2.1-2.6 TB/s of the H200's 4.3 TB/s (q_proj [3072, 2048] 4.8 us and kv_a_proj_with_mqa [576, 2048] 2.4 us, two
kernels reading the same x; o_proj 3.9 us; the router 2.4 us: issue #22); and at batch >= 8 the GEMM fusions do not
read the layer scan's slice of the stacked weights in place, so each weight is first copied (~5 us a layer at
batch 128).

Stacked layers: every weight may carry one more leading axis, [Lyr, N_j, K], with `rhs_index` (an int32 scalar,
may be traced) picking the layer, read in place and clamped to [0, Lyr) in the kernel (as `grouped_matmul`'s and
`head_matmul`'s): the layer loop hands the kernel the scan-invariant stacks, where a slice of the layer would be
a device copy (a slice feeding a custom call is a new buffer).

Design: grid (row tiles, N blocks of all the weights), row tiles fastest so that the programs running together
share one weight tile in L2. The N axis is flattened over the weights: blocks [B_0, B_0 + cdiv(N_j, block_n)) are
weight j's, so one launch (and one wave of programs) covers all of them; a program branches (statically unrolled,
`pl.when`) on its weight. It loops over K in `block_k` steps (an unmasked loop over whole steps, then one masked
step for a ragged end of K; Triton pipelines the loop, `num_stages`) and stores its [block_t, block_n] tile,
masked at the edges of T and N_j. Decode (T <= block_t: one row tile) reads each weight byte once; the tuning aims
at bytes in flight: `block_n` shrinks until the programs fill the SMs.

Two inner products, by the compute dtype (the promotion of x's and the weights' dtypes, both cast to it in the
kernel: the router's bf16 x needs no XLA convert kernel):
- bf16 / f16: a Triton dot of [block_t, block_k] x [block_k, block_n] (tensor cores, float32 accumulation); rows in
  tiles of >= 16 (dot M >= 16; at T = 1, 15 of them are masked zeros, free in a bandwidth-bound kernel).
- float32 (the router, which must be exact float32 as HF computes it): an elementwise multiply and a sum over K of
  a [block_t, block_n, block_k] product, plain FMA arithmetic, never TF32. (A Triton dot of float32 operands is
  TF32 at Pallas's default precision and IEEE at `Precision.HIGHEST`, an FMA loop too, but it pads rows to 16: at
  T = 1 it would compute 16 times the useful products.) Row tiles need no minimum there (1 at T = 1).
Weights of one call share one dtype, so that the programs share one tile shape: mixing dtypes in one launch is not
supported, and nothing needs it (the router's input is another hidden state than the attention's projections').

Block-FP8 weights (`scales`: DeepSeek-V3's e4m3 weights with one float32 `weight_scale_inv` per 128 x 128 block,
`fp8_matmul`'s format): the W8A8 product of `fp8_matmul` at decode sizes, where that Mosaic GPU kernel pads the
tokens to a 64-row tile, quantizes them in XLA kernels of their own and splits K with an XLA sum after it (the
fp8-weight step at batch 1 ran 9 of its calls a layer, ~6-8 us each, 1249 kernels a step against bf16's 400 at
0cf314c: docs/perf-notes.md session 20). Here x is quantized once before the call (`fp8_quant.quantize_act`, one
kernel: per row per 128 channels, as `fp8_matmul` does; quantizing in the kernel made every program redo it for the
whole of x), the kernel multiplies the e4m3 tiles in a dot of fp8 operands (exact products, float32 sums; a cast of
the tiles to bf16 before a bf16 dot kept Triton from prefetching them: 4x slower on the H200, docs/perf-notes.md
session 22) and adds each 128-deep scale block's product times (row scale x block scale) to the float32 sum:
`fp8_matmul_quantized_reference`'s math, float32 summation order aside. The scales of all the tile's K blocks are
loaded before the K loop (`util.block_scales`); a loop step covers block_k / 128 scale blocks (unrolled); block_n <=
128, so a program's columns share one scale row.

Not here: split K (a few programs could not fill the SMs only for N far below block_n x SMs: the router's 64 rows,
for which the float32 path shrinks block_n to 1 instead).

Triton constraints: every load/store is a power of two in size, so block sizes are (T, N_j and K are arbitrary:
edges are masked); dots need M, N, K >= 16.

`linear_reference` (plain jnp, float32) is the reference and, recomputed, the kernel's backward (a custom VJP), so a
differentiated model still works. Tests: tests/pallas_kernels/test_linear.py (interpret mode on CPU, the Triton
lowering for an H200 on CPU, the compiled kernel with `-m gpu`); H200 numbers: bench/linear.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import fp8_quant
from pallas_kernels.fp8_matmul import fp8_matmul_quantized_reference
from pallas_kernels.util import (
    F32,
    FLOAT_DTYPES,
    FP8,
    FP8_BLOCK,
    block_scale,
    block_scales,
    cdiv,
    check_fp8_blocks,
    check_fp8_weight,
    check_stacked_index,
    check_warps_stages,
    is_pow2,
    load_e4m3,
    mask_and,
    masked_load,
    masked_store,
    next_pow2,
    num_sms,
    pad_to,
)

__all__ = ["compute_dtype", "default_tuning", "linear", "linear_reference"]


def compute_dtype(x_dtype, w_dtype):
    """The dtype the kernel multiplies in: the promotion of x's and the weights' (bf16 x, f32 weight: f32)."""
    return jnp.promote_types(x_dtype, w_dtype)


def _validate(x, weights, rhs_index, out_dtype, block_t, block_n, block_k, num_warps, num_stages, scales=None):
    """(T, K, (N_j, ...), stacked) after the contract's checks."""
    if scales is not None:
        _validate_fp8(weights, scales, block_n, block_k)
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x must be [T, K], got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not isinstance(weights, (tuple, list)) or not weights:
        raise ValueError(f"weights must be a non-empty tuple of [N, K] arrays, got {type(weights).__name__}")
    stacked = rhs_index is not None
    t, k = x.shape
    ns = []
    for j, w in enumerate(weights):
        if not hasattr(w, "ndim") or w.ndim != 2 + stacked:
            want = "[Lyr, N, K] with rhs_index" if stacked else "[N, K] (stacked [Lyr, N, K] weights need rhs_index)"
            raise ValueError(f"weights[{j}] must be {want}, got shape {getattr(w, 'shape', None)}")
        if scales is None and jnp.dtype(w.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"weights[{j}] dtype must be bfloat16, float16 or float32, got {w.dtype}")
        if w.dtype != weights[0].dtype:
            raise ValueError(
                f"weights[{j}] dtype {w.dtype} differs from weights[0]'s {weights[0].dtype} (one dtype a call)"
            )
        if w.shape[-1] != k:
            raise ValueError(f"weights[{j}] {w.shape} has K={w.shape[-1]}, but x {x.shape} has K={k}")
        if stacked and w.shape[0] != weights[0].shape[0]:
            raise ValueError(f"weights[{j}] has {w.shape[0]} stacked layers, weights[0] {weights[0].shape[0]}")
        if min(w.shape) < 1:
            raise ValueError(f"weights[{j}] has an empty dimension: shape {w.shape}")
        ns.append(w.shape[-2])
    if k < 1:
        raise ValueError(f"x has an empty K dimension: shape {x.shape}")
    if stacked:
        n_layers = weights[0].shape[0]
        check_stacked_index(rhs_index, n_layers, "rhs_index", f"weights with {n_layers} stacked layers")
    if out_dtype is not None and jnp.dtype(out_dtype) not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be None, bfloat16, float16 or float32, got {out_dtype}")
    dot = scales is not None or compute_dtype(x.dtype, weights[0].dtype) != F32
    least = 16 if dot else 1  # Triton dot: M, N, K >= 16
    for name, b in (("block_t", block_t), ("block_n", block_n), ("block_k", block_k)):
        if b is not None and not (is_pow2(b) and b >= (16 if name == "block_k" else least)):
            raise ValueError(f"{name}={b} must be a power of two >= {16 if name == 'block_k' else least}")
    check_warps_stages(num_warps, num_stages)
    return t, k, tuple(ns), stacked


def _validate_fp8(weights, scales, block_n, block_k):
    if not isinstance(scales, (tuple, list)) or not isinstance(weights, (tuple, list)) or len(scales) != len(weights):
        raise ValueError("scales must be a tuple with one [(Lyr,) cdiv(N, 128), cdiv(K, 128)] array per weight")
    for j, (w, sc) in enumerate(zip(weights, scales)):
        check_fp8_weight(w, sc, f"weights[{j}]", f"scales[{j}]")
    check_fp8_blocks(block_n, block_k, "fp8 weights", whole_blocks=True)


def default_tuning(t: int, ns: tuple[int, ...], k: int, dtype, sms: int | None = None):
    """(block_t, block_n, block_k, num_warps, num_stages) from static shapes; `dtype` the compute dtype.

    From bench/linear.py's --sweep on the H200 (2026-12-02, one move at a time from the earlier guesses, the weights
    stacked over layers as the layer loop reads them; bench/results/linear-h200.json):
    - bf16 / f16 (dot): one row tile up to 64 rows (16 at least); 256-deep K steps; block_n from 64 down to 16
      until the programs fill the SMs (q_proj + kv_a_proj of V2-Lite at T = 1: 228 programs of 16 x 2048 weight
      rows, 64 KB each); 4 stages in flight within 128 KB of shared memory; 1 warp for a 16-row tile, 2 above (4
      warps: V2-Lite's q_proj + kv_a_proj at T = 1 7.99 us -> 6.37 with 1 warp; at T = 32 8.49 -> 7.04 with 2).
    - float32 (multiply and reduce): row tiles of up to 8 rows, a product tile of at most 8192 elements (64 float32
      registers a thread at 4 warps), block_n down to 1 until the programs fill the SMs (the router's 64 rows at
      T = 1: 64 programs of one weight row each), K in steps of up to 1024 (the router at T = 1: 3.0 us with
      512-wide steps, 1.9 with 1024).
    - block-FP8 (a dot of e4m3 tiles): docs/perf-notes.md session 22's probe kernel (V3's q_a_proj [1536, 7168], 16
      rows, block_n 16): 256-deep K steps with 4 warps 10.3 us, 1 warp 11.5 (128-deep 12.5, 512 10.9, 1024 10.4;
      2 stages 16.9 where 4 take 10.9; block_n 32 25.5).
    """
    sms = num_sms() if sms is None else sms
    if jnp.dtype(dtype) == FP8:  # fp8 weights, fp8 dot: 1-byte tiles, K steps of 2 scale blocks, 4 warps
        bt = min(64, max(16, next_pow2(t)))
        bn = max(16, min(64, next_pow2(max(ns))))
        while bn > 16 and cdiv(t, bt) * sum(cdiv(n, bn) for n in ns) < sms:
            bn //= 2
        bk = min(2 * FP8_BLOCK, max(FP8_BLOCK, next_pow2(k)))
        stages = max(1, min(4, cdiv(k, bk), (128 << 10) // ((bt + bn) * bk)))
        return bt, bn, bk, 4, stages
    if jnp.dtype(dtype) == F32:
        bt = min(8, next_pow2(t))
        bk = max(16, min(1024, next_pow2(k)))
        bn = max(1, min(16, next_pow2(max(ns)), 8192 // (bt * bk)))
        while bn > 1 and cdiv(t, bt) * sum(cdiv(n, bn) for n in ns) < sms:
            bn //= 2
        stage_bytes = (bt + bn) * bk * 4
    else:
        bt = min(64, max(16, next_pow2(t)))
        bk = max(16, min(256, next_pow2(k)))
        bn = max(16, min(64, next_pow2(max(ns))))
        while bn > 16 and cdiv(t, bt) * sum(cdiv(n, bn) for n in ns) < sms:
            bn //= 2
        stage_bytes = (bt + bn) * bk * jnp.dtype(dtype).itemsize
    stages = max(1, min(4, cdiv(k, bk), (128 << 10) // stage_bytes))
    warps = 4 if jnp.dtype(dtype) == F32 else 1 if bt <= 16 else 2
    return bt, bn, bk, warps, stages


def _kernel(
    layer_ref,
    x_ref,
    *refs,
    t: int,
    k: int,
    ns: tuple[int, ...],
    starts: tuple[int, ...],
    num_layers: int,
    stacked: bool,
    bt: int,
    bn: int,
    bk: int,
    cdt,
    fp8: bool,
):
    # refs: the weights [(Lyr,) N_j, K], with fp8 weights their scales [(Lyr,) N_j / 128, K / 128] and x's f32[T,
    # K / 128] (x e4m3: `quantize_act`), then the outputs
    nw = len(ns)
    w_refs, out_refs = refs[:nw], refs[nw * (1 + fp8) + fp8 :]
    s_refs = refs[nw : 2 * nw] if fp8 else (None,) * nw
    xs_ref = refs[2 * nw] if fp8 else None
    i = pl.program_id(0)  # row tile (fastest: programs in flight share the weight tile)
    j = pl.program_id(1)  # N block, flattened over the weights
    row0 = i * bt
    rows = row0 + jnp.arange(bt, dtype=jnp.int32)
    row_in = (rows < t)[:, None] if t % bt else None  # static: only a ragged last row tile needs it
    # the layer of stacked weights, clamped here (not by an XLA kernel before the call)
    lead = (jnp.clip(layer_ref[0], 0, num_layers - 1),) if stacked else ()
    dot = jnp.dtype(cdt) != F32

    def product(xt, wt):  # [bt, bk] x [bn, bk] -> f32[bt, bn]
        if dot:
            return lax.dot_general(xt, wt, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        # exact float32: multiply elementwise, sum over K (no TF32 anywhere)
        return jnp.sum(xt[:, None, :] * wt[None, :, :], axis=2)

    def fp8_k_loop(w_ref, s_ref, col0, col_in, acc):
        # W8A8: a dot of the e4m3 tiles (exact products, float32 sums: a cast of the tiles to bf16 first kept Triton
        # from prefetching them, 4x slower on the H200), scaled by x's row scale x the weight block's (bn <= 128
        # columns: one block) for each 128-deep K block; bk // 128 blocks a loop step
        scale = block_scales(xs_ref, pl.ds(row0, bt), s_ref, (*lead, col0 // FP8_BLOCK), row_in)

        def blocks(kb0, count, acc, k_in=None):  # scale blocks kb0 .. kb0 + count - 1
            for b in range(count):
                k0 = (kb0 + b) * FP8_BLOCK
                xt = load_e4m3(x_ref.at[pl.ds(row0, bt), pl.ds(k0, FP8_BLOCK)], row_in, k_in)
                wt = load_e4m3(w_ref.at[(*lead, pl.ds(col0, bn), pl.ds(k0, FP8_BLOCK))], col_in, k_in)
                acc = acc + product(xt, wt) * block_scale(scale, kb0 + b)
            return acc

        sub, whole = bk // FP8_BLOCK, k // FP8_BLOCK
        acc = lax.fori_loop(0, whole // sub, lambda i, a: blocks(i * sub, sub, a), acc)
        acc = lax.fori_loop(whole // sub * sub, whole, lambda kb, a: blocks(kb, 1, a), acc)
        if k % FP8_BLOCK:  # the ragged end of K, masked
            k_in = whole * FP8_BLOCK + jnp.arange(FP8_BLOCK, dtype=jnp.int32) < k
            acc = lax.fori_loop(whole, whole + 1, lambda kb, a: blocks(kb, 1, a, k_in), acc)
        return acc

    def block(w_ref, s_ref, out_ref, n, start):
        col0 = (j - start) * bn
        cols = col0 + jnp.arange(bn, dtype=jnp.int32)
        col_in = (cols < n)[:, None] if n % bn else None  # [bn, 1], for the weight tile

        acc = jnp.zeros((bt, bn), jnp.float32)
        if fp8:
            acc = fp8_k_loop(w_ref, s_ref, col0, col_in, acc)
        else:

            def step(kk, acc, k_in=None):
                k0 = kk * bk
                k_x, k_w = (None, None) if k_in is None else (k_in[None, :], k_in[None, :])
                xt = masked_load(x_ref.at[pl.ds(row0, bt), pl.ds(k0, bk)], mask_and(row_in, k_x), cdt)
                wt = masked_load(w_ref.at[(*lead, pl.ds(col0, bn), pl.ds(k0, bk))], mask_and(col_in, k_w), cdt)
                return acc + product(xt, wt)

            full_steps = k // bk
            acc = lax.fori_loop(0, full_steps, step, acc)
            if k % bk:  # static: one masked step for the ragged end of K (the loop keeps its K offset dynamic: a
                # static slice past K fails to trace)
                k_in = full_steps * bk + jnp.arange(bk, dtype=jnp.int32) < k
                acc = lax.fori_loop(full_steps, full_steps + 1, lambda kk, a: step(kk, a, k_in), acc)
        out_mask = mask_and(row_in, None if col_in is None else (cols < n)[None, :])
        masked_store(out_ref.at[pl.ds(row0, bt), pl.ds(col0, bn)], acc.astype(out_ref.dtype), out_mask)

    for w_ref, s_ref, out_ref, n, start, end in zip(w_refs, s_refs, out_refs, ns, starts, starts[1:]):
        if len(ns) == 1:
            block(w_ref, s_ref, out_ref, n, start)
        else:  # this program's weight: blocks [start, end) of the flattened N axis
            pl.when((j >= start) & (j < end))(functools.partial(block, w_ref, s_ref, out_ref, n, start))


@functools.partial(
    jax.jit, static_argnames=("out_dtype", "interpret", "block_t", "block_n", "block_k", "num_warps", "num_stages")
)
def _impl(x, weights, scales, layer, *, out_dtype, interpret, block_t, block_n, block_k, num_warps, num_stages):
    """layer: i32[1], the index into the weights' leading axis when they are stacked [Lyr, N_j, K] (3-D); scales:
    () or, with fp8 weights, their block scales and then x's (x e4m3, `quantize_act`'s)."""
    stacked = weights[0].ndim == 3
    fp8 = bool(scales)
    t, k = x.shape
    ns = tuple(w.shape[-2] for w in weights)
    t_out, ns_out = t, ns
    if interpret:  # blocks larger than their arrays: zero padding (masked out by the kernel, sliced off)
        x = pad_to(pad_to(x, 0, block_t), 1, block_k)
        if fp8:  # the scales' K blocks to a power of two (`block_scales`), x's rows to the row tile
            scales = tuple(pad_to(a, a.ndim - 1, next_pow2(a.shape[-1])) for a in scales)
            scales = (*scales[:-1], pad_to(scales[-1], 0, block_t))
        weights = tuple(pad_to(pad_to(w, w.ndim - 2, block_n), w.ndim - 1, block_k) for w in weights)
        t_out, ns_out = max(t, block_t), tuple(max(n, block_n) for n in ns)
    blocks = [cdiv(n, block_n) for n in ns]
    starts = tuple(sum(blocks[:j]) for j in range(len(ns) + 1))
    cdt = jnp.bfloat16 if fp8 else compute_dtype(x.dtype, weights[0].dtype)  # fp8: a dot of e4m3 tiles (`product`)
    kernel = functools.partial(
        _kernel,
        t=t,
        k=k,
        ns=ns,
        starts=starts,
        num_layers=weights[0].shape[0] if stacked else 1,
        stacked=stacked,
        bt=block_t,
        bn=block_n,
        bk=block_k,
        cdt=cdt,
        fp8=fp8,
    )
    inputs = [layer, x, *weights, *scales]
    # Whole-array blocks: under the Triton lowering a block only sets a base pointer; the kernel offsets itself.
    whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0,) * len(shape))  # noqa: E731
    outs = pl.pallas_call(
        kernel,
        grid=(cdiv(t, block_t), starts[-1]),
        in_specs=[whole(a.shape) for a in inputs],
        out_specs=[whole((t_out, n)) for n in ns_out],
        out_shape=[jax.ShapeDtypeStruct((t_out, n), out_dtype) for n in ns_out],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"linear{len(ns)}_{'fp8' if fp8 else 'dot' if jnp.dtype(cdt) != F32 else 'f32'}_bt{block_t}"
        f"_bn{block_n}_bk{block_k}_w{num_warps}_s{num_stages}",
    )(*inputs)
    return tuple(o if o.shape == (t, n) else o[:t, :n] for o, n in zip(outs, ns))


def linear(
    x,  # [T, K] bf16/f16/f32
    weights,  # tuple of [N_j, K] (HF [out, in]), or of [Lyr, N_j, K] with rhs_index; one dtype
    *,
    scales=None,  # with e4m3 weights: their f32 block scales [(Lyr,) cdiv(N_j, 128), cdiv(K, 128)], a tuple
    rhs_index=None,  # i32 scalar (may be traced): the layer of stacked weights
    out_dtype=None,  # default: the promotion of x's and the weights' dtypes (x's with fp8 weights)
    interpret: bool = False,
    block_t: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """(x @ w_0^T, x @ w_1^T, ...) as a tuple of [T, N_j], in one kernel launch (w_j[rhs_index] when stacked),
    multiplied in the promotion of x's and the weights' dtypes (float32 exactly, as an elementwise multiply and
    reduce), accumulated in float32, stored in out_dtype. A static rhs_index must lie in [0, Lyr); a traced one is
    clamped. Tuning (None = `default_tuning`): block_t rows per tile, block_n weight rows per program, block_k K step
    (powers of two; >= 16 for the bf16/f16 dot, block_k always), num_warps, num_stages (Triton pipelining).
    With `scales` (block-FP8 weights; x of any float dtype, quantized first): W8A8 as `fp8_matmul` computes it (the
    module docstring); not differentiable (an inference format)."""
    weights = tuple(weights) if isinstance(weights, (tuple, list)) else weights
    scales = tuple(scales) if isinstance(scales, (tuple, list)) else scales
    tuning = (block_t, block_n, block_k, num_warps, num_stages)
    t, k, ns, stacked = _validate(x, weights, rhs_index, out_dtype, *tuning, scales=scales)
    fp8 = scales is not None
    cdt = jnp.dtype(x.dtype) if fp8 else compute_dtype(x.dtype, weights[0].dtype)
    out_dtype = jnp.dtype(cdt if out_dtype is None else out_dtype)
    if t == 0:
        return tuple(jnp.zeros((0, n), out_dtype) for n in ns)
    d = default_tuning(t, ns, k, FP8 if fp8 else cdt)
    bt, bn, bk, warps, stages = (d[i] if v is None else v for i, v in enumerate(tuning))
    # No block larger than its (power-of-two rounded) dimension: it would only compute padding.
    least = 16 if jnp.dtype(cdt) != F32 else 1
    bt, bn = min(bt, max(least, next_pow2(t))), min(bn, max(least, next_pow2(max(ns))))
    bk = min(bk, max(FP8_BLOCK if fp8 else 16, next_pow2(k)))
    layer = jnp.asarray(0 if rhs_index is None else rhs_index, jnp.int32).reshape(1)  # clamped in the kernel
    static = (out_dtype.name, bool(interpret), bt, bn, bk, warps, stages)
    if fp8:
        return _run(x, weights, layer, static, scales)
    return _differentiable(x, weights, layer, static)


# The kernel forward, the reference's backward (recomputed): the kernel has no derivative of its own, and a model
# differentiated through its projections (training through `model.forward`) must not fail.
def _run(x, weights, layer, static, scales=()):
    out_dtype, interpret, bt, bn, bk, warps, stages = static
    kw = dict(block_t=bt, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    if scales:  # W8A8: x quantized once (one kernel), not by each program of the kernel
        x, x_scale = fp8_quant.quantize_act(x, interpret=interpret)
        scales = (*scales, x_scale)
    return _impl(x, weights, scales, layer, out_dtype=out_dtype, interpret=interpret, **kw)


def _run_dense(x, weights, layer, static):
    return _run(x, weights, layer, static)


_differentiable = jax.custom_vjp(_run_dense, nondiff_argnums=(3,))


def _differentiable_fwd(x, weights, layer, static):
    return _run_dense(x, weights, layer, static), (x, weights, layer)


def _differentiable_bwd(static, saved, g):
    x, weights, layer = saved
    index = layer[0] if weights[0].ndim == 3 else None

    def f(x, weights):
        return tuple(o.astype(static[0]) for o in linear_reference(x, weights, rhs_index=index))

    _, vjp = jax.vjp(f, x, weights)
    return (*vjp(tuple(g)), None)


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def linear_reference(x, weights, *, scales=None, rhs_index=None, out_dtype=None, **tuning):
    """Float32 plain-JAX reference (returns a tuple of float32 [T, N_j]): one einsum per weight at full precision
    (with rhs_index, the layer sliced out first, clamped as the kernel does); with `scales`, the W8A8 product's math
    (`fp8_matmul_quantized_reference`). out_dtype and the tuning arguments are accepted (checked) and ignored."""
    tuning.pop("interpret", None)
    weights = tuple(weights) if isinstance(weights, (tuple, list)) else weights
    scales = tuple(scales) if isinstance(scales, (tuple, list)) else scales
    keys = ("block_t", "block_n", "block_k", "num_warps", "num_stages")
    _validate(x, weights, rhs_index, out_dtype, *(tuning.pop(key, None) for key in keys), scales=scales)
    if tuning:
        raise TypeError(f"linear_reference got unexpected arguments {sorted(tuning)}")

    def layer(a):
        return a if rhs_index is None else lax.dynamic_index_in_dim(a, jnp.clip(rhs_index, 0, a.shape[0] - 1), 0, False)

    if scales is not None:
        return tuple(fp8_matmul_quantized_reference(x, layer(w), layer(sc)) for w, sc in zip(weights, scales))
    xf = x.astype(jnp.float32)
    return tuple(
        jnp.einsum("tk,nk->tn", xf, layer(w).astype(jnp.float32), precision=lax.Precision.HIGHEST) for w in weights
    )
