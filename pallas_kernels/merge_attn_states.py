"""Merge two partial attention results by their log-sum-exp (vLLM's `merge_attn_states`).

Used by chunked-context prefill: the new-token (causal) pass and each context-chunk pass produce
(output, lse) over disjoint key sets; the merge is the exact softmax over their union.

Two implementations with one contract:
- "xla": plain jnp under jit (also the float32 reference when fed float32); XLA fuses it into one
  elementwise kernel.
- "pallas": a Triton-lowered kernel over [T*N] rows of V, one pass, to get closer to the copy
  bandwidth than XLA's elementwise fusions (measured in bench/prefill.py).

Edge cases (as vLLM): an lse of +inf is treated as -inf (an empty partial); a side whose lse is -inf
contributes nothing, and its output is ignored even if it holds NaN, so the other side comes back
exactly; both -inf gives output 0 and lse -inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import FLOAT_DTYPES, cdiv


def _validate(prefix_output, prefix_lse, suffix_output, suffix_lse):
    if prefix_output.ndim != 3:
        raise ValueError(f"prefix_output must be [T, N, V], got shape {prefix_output.shape}")
    if suffix_output.shape != prefix_output.shape:
        raise ValueError(f"suffix_output shape {suffix_output.shape} != prefix_output shape {prefix_output.shape}")
    if suffix_output.dtype != prefix_output.dtype:
        raise ValueError(f"output dtypes differ: {prefix_output.dtype} vs {suffix_output.dtype}")
    if jnp.dtype(prefix_output.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"output dtype must be bfloat16, float16 or float32, got {prefix_output.dtype}")
    for name, lse in (("prefix_lse", prefix_lse), ("suffix_lse", suffix_lse)):
        if lse.shape != prefix_output.shape[:2]:
            raise ValueError(f"{name} must be [T, N] = {prefix_output.shape[:2]}, got {lse.shape}")
        if lse.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32, got {lse.dtype}")


def _merge_math(p_out, p_lse, s_out, s_lse):
    """Shared elementwise math: lse [...], out [..., V] in float32."""
    p_lse = jnp.where(p_lse == jnp.inf, -jnp.inf, p_lse)
    s_lse = jnp.where(s_lse == jnp.inf, -jnp.inf, s_lse)
    m = jnp.maximum(p_lse, s_lse)
    alive = m > -jnp.inf
    m_safe = jnp.where(alive, m, 0.0)
    p_w = jnp.exp(p_lse - m_safe)  # exp(-inf) = 0 for an empty side
    s_w = jnp.exp(s_lse - m_safe)
    tot = p_w + s_w
    tot_safe = jnp.where(alive, tot, 1.0)
    p_scale = (p_w / tot_safe)[..., None]
    s_scale = (s_w / tot_safe)[..., None]
    # `where` rather than a zero weight, so NaN in an empty side's output cannot leak.
    out = jnp.where(p_scale > 0, p_out * p_scale, 0.0) + jnp.where(s_scale > 0, s_out * s_scale, 0.0)
    lse = jnp.where(alive, jnp.log(tot_safe) + m_safe, -jnp.inf)
    return out, lse


@jax.jit
def merge_attn_states_reference(prefix_output, prefix_lse, suffix_output, suffix_lse):
    """Plain jnp; float32 math, output in the input dtype."""
    _validate(prefix_output, prefix_lse, suffix_output, suffix_lse)
    out, lse = _merge_math(prefix_output.astype(jnp.float32), prefix_lse, suffix_output.astype(jnp.float32), suffix_lse)
    return out.astype(prefix_output.dtype), lse


def _merge_kernel(po_ref, pl_ref, so_ref, sl_ref, o_ref, lse_ref, *, rows: int, block: int):
    r = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    ok = r < rows
    p_lse = pltriton.load(pl_ref, mask=ok, other=-jnp.inf)
    s_lse = pltriton.load(sl_ref, mask=ok, other=-jnp.inf)
    p_out = pltriton.load(po_ref, mask=ok[:, None], other=0).astype(jnp.float32)
    s_out = pltriton.load(so_ref, mask=ok[:, None], other=0).astype(jnp.float32)
    out, lse = _merge_math(p_out, p_lse, s_out, s_lse)
    pltriton.store(o_ref, out.astype(o_ref.dtype), mask=ok[:, None])
    pltriton.store(lse_ref, lse, mask=ok)


@functools.partial(jax.jit, static_argnames=("block_rows", "num_warps", "interpret"))
def _merge_pallas(
    prefix_output, prefix_lse, suffix_output, suffix_lse, *, block_rows: int, num_warps: int, interpret: bool
):
    t, n, dv = prefix_output.shape
    if dv < 1 or dv & (dv - 1):
        raise ValueError(f"pallas merge needs a power-of-two V head dim, got {dv}")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two")
    rows = t * n
    po = prefix_output.reshape(rows, dv)  # free: contiguous
    so = suffix_output.reshape(rows, dv)
    grid = (cdiv(rows, block_rows),)
    row_spec = pl.BlockSpec((block_rows, dv), lambda i: (i, 0))
    lse_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
    out, lse = pl.pallas_call(
        functools.partial(_merge_kernel, rows=rows, block=block_rows),
        grid=grid,
        in_specs=[row_spec, lse_spec, row_spec, lse_spec],
        out_specs=[row_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, dv), prefix_output.dtype), jax.ShapeDtypeStruct((rows,), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"merge_attn_states_r{block_rows}",
    )(po, prefix_lse.reshape(rows), so, suffix_lse.reshape(rows))
    return out.reshape(t, n, dv), lse.reshape(t, n)


def merge_attn_states(
    prefix_output,
    prefix_lse,
    suffix_output,
    suffix_lse,
    *,
    impl: str = "auto",
    interpret: bool = False,
    block_rows: int = 16,
    num_warps: int = 4,
):
    """(output [T, N, V] in the inputs' dtype, lse f32[T, N]) of attention over both key sets.

    impl "auto" is "pallas" on GPU (on the H200 it is closer to the copy ceiling than XLA's fusion,
    and block_rows 16-64 with num_warps 2-8 are all within 2%: bench/prefill.py --sweep,
    docs/perf-notes.md) and "xla" elsewhere.
    """
    _validate(prefix_output, prefix_lse, suffix_output, suffix_lse)
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl == "xla":
        return merge_attn_states_reference(prefix_output, prefix_lse, suffix_output, suffix_lse)
    if impl == "pallas":
        return _merge_pallas(
            prefix_output,
            prefix_lse,
            suffix_output,
            suffix_lse,
            block_rows=block_rows,
            num_warps=num_warps,
            interpret=interpret,
        )
    raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
