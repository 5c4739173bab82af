"""The W8A8 activation quantization in one kernel (vLLM's `per_token_group_quant_fp8`), Triton-lowered.

    quantize_act(x [T, K]) -> (e4m3 [T, K], f32 scale [T, K / 128])

The format of `util.quantize_act` (the reference, and the path for K not a multiple of 128): per token per 128
channels, scale = max(amax, 1e-4) / 448, the values x / scale rounded to the nearest e4m3 (`util.round_e4m3`). Every
fp8 GEMM runs it on its activations first (the Triton linear and grouped kernels' W8A8 paths, the Mosaic GPU GEMMs);
XLA runs it as three kernels on the H200 (a reduce for the amax, a convert, a multiply: ~1 us each, five calls a
layer in the fp8-weight step at batch 1, bench/results/e2e-profile-b1-fp8-h200.json). Here: x seen as [T*K/128, 128]
rows of one scale block each (a free reshape), a program per `block_rows` of them, one load, the amax, the scale and
the rounded values in registers, two stores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import FLOAT_DTYPES, FP8, FP8_BLOCK, cdiv, masked_load, masked_store, quantize_act_tile
from pallas_kernels.util import quantize_act as quantize_act_reference

__all__ = ["quantize_act", "quantize_act_reference"]

BLOCK_ROWS = 32  # scale blocks a program: 16 KB of bf16 x; V3's 7168 channels at one token are 56, two programs


def _kernel(x_ref, q_ref, s_ref, *, rows: int, br: int):
    r0 = pl.program_id(0) * br
    row_in = (r0 + jnp.arange(br, dtype=jnp.int32) < rows) if rows % br else None
    x = masked_load(x_ref.at[pl.ds(r0, br)], None if row_in is None else row_in[:, None], jnp.float32)
    q, scale = quantize_act_tile(x)  # [br, 128], [br]
    masked_store(q_ref.at[pl.ds(r0, br)], q.astype(q_ref.dtype), None if row_in is None else row_in[:, None])
    masked_store(s_ref.at[pl.ds(r0, br)], scale, row_in)


@functools.partial(jax.jit, static_argnames=("interpret", "block_rows"))
def _impl(x, *, interpret: bool, block_rows: int):
    t, k = x.shape
    rows = t * k // FP8_BLOCK
    xb = x.reshape(rows, FP8_BLOCK)  # row r: token r // Kb, channels (r % Kb) * 128 ..
    br = block_rows
    if interpret and rows < br:  # the interpreter cannot slice a block past the array (the GPU masks)
        xb = jnp.pad(xb, ((0, br - rows), (0, 0)))
    n = max(rows, br) if interpret else rows
    q, s = pl.pallas_call(
        functools.partial(_kernel, rows=rows, br=br),
        grid=(cdiv(rows, br),),
        in_specs=[pl.BlockSpec(xb.shape, lambda i: (0, 0))],  # whole: under Triton a block is a base pointer
        out_specs=[pl.BlockSpec((n, FP8_BLOCK), lambda i: (0, 0)), pl.BlockSpec((n,), lambda i: (0,))],
        out_shape=[jax.ShapeDtypeStruct((n, FP8_BLOCK), FP8), jax.ShapeDtypeStruct((n,), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"quantize_act_k{k}_br{br}",
    )(xb)
    return q[:rows].reshape(t, k), s[:rows].reshape(t, k // FP8_BLOCK)


def quantize_act(x, *, interpret: bool = False, block_rows: int = BLOCK_ROWS):
    """x [T, K] (bf16 / f16 / f32) -> (float8_e4m3fn [T, K], float32 scale [T, cdiv(K, 128)]), `util.quantize_act`'s
    values exactly; one Triton kernel where K is a multiple of 128, the reference's XLA kernels otherwise (and for
    T = 0)."""
    if not hasattr(x, "ndim") or x.ndim != 2:
        raise ValueError(f"x must be [T, K], got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not (isinstance(block_rows, int) and block_rows >= 1 and block_rows & (block_rows - 1) == 0):
        raise ValueError(f"block_rows={block_rows} must be a power of two (a Triton block)")
    if x.shape[1] % FP8_BLOCK or x.shape[0] == 0:
        return quantize_act_reference(x)
    return _impl(x, interpret=bool(interpret), block_rows=block_rows)
