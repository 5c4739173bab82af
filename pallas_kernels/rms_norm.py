"""Residual add + RMSNorm in one kernel (vLLM's `fused_add_rms_norm`), Triton-lowered.

    add_rms_norm(x [T, D], residual [T, D] | None, weight [D], *, eps) -> (normed [T, D], h [T, D])
    add_rms_norm(x, residual, weight [Lyr, D], eps=eps, weight_index=i)     # row i of stacked layers' weights
    add_rms_norm(x, copies [T*K + S*T, D], weight, eps=eps, residual_weights=w f32[T, K], residual_shared=S)

h = x + residual (in x's dtype, as the model adds its residual stream; h = x without a residual) and
normed = weight * (h32 * rsqrt(mean(h32^2) + eps)).astype(x.dtype) with h32 = h in float32: HF's
DeepseekRMSNorm on h. XLA runs the add, the sum of squares and the scaling as three kernels (a decode step at batch
1 on the H200: ~1.3 us each, two norms a layer); this is one, a program per row: pass 1 adds the chunks, writes h
and sums the squares; pass 2 normalizes h, kept in registers for rows up to KEEP_ROW wide (wider ones recompute it
from the inputs, re-read from L2: reading back its own stores would need a barrier between the threads), and writes
the normalized chunks. Chunks are the largest power of two
dividing D, up to 2048 (Triton's loads are powers of two): 7168 = 7 x 1024, 2048 = 1 x 2048.

The residual may come as an MoE layer's uncombined expert outputs (`residual_weights`): the grouped down kernel's
copies in its order (`grouped_matmul.copy_groups`: token t's K routed copies at rows t*K.., then S shared chunks' T
rows each at T*K + s*T) and the router weights; the kernel combines them (`combine_copies_reference`, float32, cast
to x's dtype) as it adds, so a decode step runs no combine kernel between the MoE layer and the next norm.

A model that scans over its layers hands the kernel the stacked norm weights and the layer index (`weight_index`,
may be traced): the kernel reads row i in place, where a weight sliced out by the scan would be materialized (a
slice feeding a custom call is a new buffer: a device copy per norm per layer, as long as the norm itself at batch
1).

`add_rms_norm_reference` (plain jnp) is the reference, the path on CPU and for widths without such a chunk, and the
kernel's backward (a custom VJP), so a differentiated norm works.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import FLOAT_DTYPES, check_stacked_index

__all__ = ["add_rms_norm", "add_rms_norm_reference", "chunk_width", "combine_copies_reference"]

_MAX_CHUNK = 2048
KEEP_ROW = 8192  # rows up to this wide keep h in registers between the passes; wider ones recompute it


def chunk_width(d: int) -> int | None:
    """The kernel's chunk for a row of d values: the largest power of two dividing d, at most 2048; None when
    that is below 16 (the kernel declines)."""
    c = d & -d
    c = min(c, _MAX_CHUNK)
    return c if c >= 16 else None


def combine_copies_reference(copies, weights, shared: int, dtype=None):
    """An MoE layer's output [T, D] (in `dtype`, default the copies') from its uncombined expert outputs: copies
    [T*K + S*T, D] (token t's K routed copies at rows t*K.., then the S shared chunks' T rows each), router weights
    f32[T, K]: sum_k w[t, k] copy[t*K + k] + sum_s copy[T*K + s*T + t], in float32."""
    t, k = weights.shape
    d = copies.shape[-1]
    y = copies.astype(jnp.float32)
    routed = jnp.sum(y[: t * k].reshape(t, k, d) * weights[:, :, None].astype(jnp.float32), axis=1)
    if shared:
        routed = routed + jnp.sum(y[t * k :].reshape(shared, t, d), axis=0)
    return routed.astype(copies.dtype if dtype is None else dtype)


def _check_copies(x, copies, weights, shared):
    t = x.shape[0]
    if weights.ndim != 2 or weights.shape[0] != t or jnp.dtype(weights.dtype) != jnp.float32:
        raise ValueError(f"residual_weights must be f32[T={t}, K], got {weights.dtype}{list(weights.shape)}")
    if not isinstance(shared, int) or shared < 0:
        raise ValueError(f"residual_shared must be an int >= 0 (the shared chunks), got {shared!r}")
    rows = t * weights.shape[1] + shared * t
    if copies.shape != (rows, x.shape[1]) or copies.dtype != x.dtype:
        raise ValueError(
            f"the residual copies must be [T*K + S*T, D] = [{rows}, {x.shape[1]}] {x.dtype}, "
            f"got {list(copies.shape)} {copies.dtype}"
        )


def add_rms_norm_reference(
    x, residual, weight, *, eps: float, weight_index=None, router=None, residual_weights=None, residual_shared=0
):
    """(normed, h): h = x + residual in x's dtype, normed = HF DeepseekRMSNorm(h) (weight[weight_index] when
    stacked). With `router` (an MoE gate's f32 weight [(Lyr,) E, D], at weight_index when stacked) also its logits
    f32[T, E] = normed @ router^T in float32, as `mla_jax.layers.route` computes them. With `residual_weights`,
    residual is an MoE layer's copies, combined first (`combine_copies_reference`)."""
    if residual_weights is not None:
        _check_copies(x, residual, residual_weights, residual_shared)
        residual = combine_copies_reference(residual, residual_weights, residual_shared, x.dtype)
    if weight_index is not None:
        weight = weight[weight_index]
    h = x if residual is None else x + residual
    hf = h.astype(jnp.float32)
    hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    normed = weight * hf.astype(h.dtype)
    if router is None:
        return normed, h
    g = router[weight_index] if router.ndim == 3 else router
    logits = jnp.einsum("td,ed->te", normed.astype(jnp.float32), g.astype(jnp.float32), precision="highest")
    return normed, h, logits


def _kernel(
    *refs, eps: float, d: int, chunk: int, has_residual: bool, router_block: int, top_k: int, shared: int, tokens: int
):
    refs = list(refs)
    x_ref = refs.pop(0)
    r_ref = refs.pop(0) if has_residual else None  # [D] row, or all the copies [T*K + S*T, D] (top_k > 0)
    cw_ref = refs.pop(0) if top_k else None  # the router weights, f32 [T*K]
    w_ref, idx_ref = refs.pop(0), refs.pop(0)
    g_ref = refs.pop(0) if router_block else None  # the router's f32 weight [Lyr, E, D]
    out_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None
    logits_ref = refs.pop(0) if router_block else None  # f32 [E] of this row, its block of experts
    n = d // chunk
    # the weight's row (0 for an unstacked [1, D] weight), clamped here, not by an XLA kernel before the call
    layer = jnp.clip(idx_ref[0], 0, w_ref.shape[0] - 1)
    e = pl.program_id(1) if router_block else 0  # expert block: every block's program renormalizes its row
    first = e == 0  # the program that stores the row's h and normed

    def residual(cols):  # [chunk] in x's dtype: the row's residual, or its copies combined (float32, as the reference)
        if not top_k:
            return r_ref[cols]
        t = pl.program_id(0)
        acc = jnp.zeros((chunk,), jnp.float32)
        for j in range(top_k):
            acc = acc + r_ref[t * top_k + j, cols].astype(jnp.float32) * cw_ref[t * top_k + j]
        if shared:
            sh = r_ref[tokens * top_k + t, cols].astype(jnp.float32)
            for j in range(1, shared):
                sh = sh + r_ref[tokens * (top_k + j) + t, cols].astype(jnp.float32)
            acc = acc + sh
        return acc.astype(x_ref.dtype)

    def h_chunk(c):  # [chunk] in x's dtype
        cols = pl.ds(c * chunk, chunk)
        return x_ref[cols] + residual(cols) if has_residual else x_ref[cols]

    def store(ref, cols, v):
        if router_block:
            pltriton.store(ref.at[cols], v, mask=jnp.full(v.shape, first))
        else:
            ref[cols] = v

    kept = []  # the row's h chunks, held in registers for pass 2 (up to KEEP_ROW values: 56 a thread at 4 warps)
    ss = jnp.float32(0.0)
    for c in range(n):
        h = h_chunk(c)
        if d <= KEEP_ROW:
            kept.append(h)
        if has_residual:
            store(h_ref, pl.ds(c * chunk, chunk), h)
        hf = h.astype(jnp.float32)
        ss = ss + jnp.sum(hf * hf)
    inv = jax.lax.rsqrt(ss / d + eps)
    if router_block:
        experts = pl.ds(e * router_block, router_block)
        acc = jnp.zeros((router_block,), jnp.float32)
    for c in range(n):
        cols = pl.ds(c * chunk, chunk)
        hf = (kept[c] if kept else h_chunk(c)).astype(jnp.float32)
        normed = w_ref[layer, cols] * (hf * inv).astype(x_ref.dtype)
        store(out_ref, cols, normed)
        if router_block:  # the router's logits of the normed row, exact float32 (a multiply and a sum, no TF32)
            g = g_ref[layer, experts, cols]  # [eb, chunk]
            acc = acc + jnp.sum(g * normed.astype(jnp.float32)[None, :], axis=1)
    if router_block:
        logits_ref[experts] = acc


@functools.partial(jax.jit, static_argnames=("shared", "eps", "interpret", "num_warps"))
def _impl(
    x, residual, weight, weight_index, router, copy_w, *, shared: int, eps: float, interpret: bool, num_warps: int
):
    t, d = x.shape
    chunk = chunk_width(d)
    has_residual = residual is not None
    top_k = 0 if copy_w is None else copy_w.shape[1]
    if weight.ndim == 1:  # one weight: row 0 of [1, D] (the wrapper's weight_index is 0)
        weight = weight[None]
    if router is not None and router.ndim == 2:
        router = router[None]
    eb = router_block(router.shape[1], chunk) if router is not None else 0
    idx = jnp.asarray(weight_index, jnp.int32).reshape(1)  # i32[1], clamped in the kernel
    row = pl.BlockSpec((None, d), lambda i, *_: (i, 0))
    whole = lambda shape: pl.BlockSpec(shape, lambda i, *_: (0,) * len(shape))  # noqa: E731
    in_specs = [row] + ([whole(residual.shape) if top_k else row] if has_residual else [])
    inputs = [x] + ([residual] if has_residual else [])
    if top_k:  # the copies whole (a program reads its token's rows), the weights flat (scalar loads)
        in_specs.append(whole((t * top_k,)))
        inputs.append(copy_w.reshape(t * top_k))
    in_specs += [whole(weight.shape), whole((1,))]
    inputs += [weight, idx]
    if eb:
        in_specs.append(whole(router.shape))
        inputs.append(router)
    out_shape = [jax.ShapeDtypeStruct((t, d), jnp.result_type(weight.dtype, x.dtype))]
    out_specs = [row]
    if has_residual:
        out_shape.append(jax.ShapeDtypeStruct((t, d), x.dtype))
        out_specs.append(row)
    if eb:
        out_shape.append(jax.ShapeDtypeStruct((t, router.shape[1]), jnp.float32))
        out_specs.append(pl.BlockSpec((None, router.shape[1]), lambda i, *_: (i, 0)))
    name = f"add_rms_norm_d{d}" if has_residual else f"rms_norm_d{d}"
    kernel = functools.partial(
        _kernel,
        eps=eps,
        d=d,
        chunk=chunk,
        has_residual=has_residual,
        router_block=eb,
        top_k=top_k,
        shared=shared,
        tokens=t,
    )
    outs = pl.pallas_call(
        kernel,
        grid=(t, router.shape[1] // eb) if eb else (t,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name=name + (f"_copies_k{top_k}_s{shared}" if top_k else "") + (f"_router_e{router.shape[1]}" if eb else ""),
    )(*inputs)
    normed, h = outs[0], (outs[1] if has_residual else x)
    return (normed, h, outs[-1]) if eb else (normed, h)


ROUTER_TILE = 8192  # f32 router weights one program multiplies per chunk of the row: [experts, chunk]


def router_block(num_experts: int, chunk: int = _MAX_CHUNK) -> int:
    """Experts per program of the fused router: a power of two dividing E, the tile [eb, chunk] at most ROUTER_TILE
    elements (so E/eb programs per row share the router's reads); 0 when E has no such divisor."""
    eb = num_experts & -num_experts
    while eb > 1 and eb * chunk > ROUTER_TILE:
        eb //= 2
    return eb if eb * chunk <= ROUTER_TILE else 0


def add_rms_norm(
    x,  # [T, D] bf16/f16/f32
    residual,  # [T, D] like x, or None
    weight,  # [D], or [Lyr, D] with weight_index
    *,
    eps: float,
    weight_index=None,  # i32 scalar (may be traced): the row of a stacked weight
    router=None,  # f32 [E, D], or [Lyr, E, D] with weight_index: an MoE gate whose logits come out too
    residual_weights=None,  # f32 [T, K]: residual is an MoE layer's copies [T*K + S*T, D], combined in the kernel
    residual_shared: int = 0,  # S: the copies' shared chunks
    interpret: bool = False,
    num_warps: int = 4,
):
    """(normed [T, D], h [T, D]), with `router` (normed, h, logits f32[T, E]); see the module docstring. Widths
    without a power-of-two chunk >= 16 run the reference. A static weight_index outside [0, Lyr) is an error; a
    traced one is clamped.

    The router's logits in the same kernel: a grid of E/eb programs per row (`router_block`), each renormalizing its
    row (a few KB from L2) and multiplying it with eb of the gate's rows in float32, so a decode step runs no
    separate router GEMV after the MoE layer's input norm."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got shape {x.shape}")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if residual_weights is not None:
        if residual is None:
            raise ValueError("residual_weights needs the residual copies")
        _check_copies(x, residual, residual_weights, residual_shared)
    elif residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.shape} {x.dtype}), got {residual.shape} {residual.dtype}")
    if weight_index is None and weight.shape != x.shape[1:]:
        raise ValueError(f"weight must be [D] = [{x.shape[1]}], got shape {weight.shape}")
    if weight_index is not None:
        if weight.ndim != 2 or weight.shape[1] != x.shape[1]:
            raise ValueError(f"a stacked weight must be [Lyr, D={x.shape[1]}], got shape {weight.shape}")
        check_stacked_index(weight_index, weight.shape[0], "weight_index", f"{weight.shape[0]} stacked weights")
    if router is not None:
        stacked = weight_index is not None
        ok = router.ndim == 2 + stacked and router.shape[-1] == x.shape[1]
        if not ok or (stacked and router.shape[0] != weight.shape[0]):
            lead = f"Lyr={weight.shape[0]}, " if stacked else ""
            raise ValueError(f"router must be [{lead}E, D={x.shape[1]}], got shape {router.shape}")
        if jnp.dtype(router.dtype) != jnp.float32:
            raise ValueError(f"router dtype must be float32 (the gate's scores are float32), got {router.dtype}")
    chunk = chunk_width(x.shape[1])
    if chunk is None or x.shape[0] == 0 or (router is not None and not router_block(router.shape[-2], chunk)):
        return add_rms_norm_reference(
            x,
            residual,
            weight,
            eps=eps,
            weight_index=weight_index,
            router=router,
            residual_weights=residual_weights,
            residual_shared=residual_shared,
        )
    index = jnp.zeros((), jnp.int32) if weight_index is None else jnp.asarray(weight_index, jnp.int32)
    statics = (int(residual_shared), float(eps), bool(interpret), int(num_warps))
    return _differentiable(x, residual, weight, index, router, residual_weights, *statics)


# The kernel forward, the reference's backward (recomputed): the kernel has no derivative of its own, and a norm
# on a differentiated path (training through `model.forward`) must not fail.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _differentiable(x, residual, weight, index, router, copy_w, shared, eps, interpret, num_warps):
    kw = dict(shared=shared, eps=eps, interpret=interpret, num_warps=num_warps)
    return _impl(x, residual, weight, index, router, copy_w, **kw)


def _differentiable_fwd(x, residual, weight, index, router, copy_w, shared, eps, interpret, num_warps):
    kw = dict(shared=shared, eps=eps, interpret=interpret, num_warps=num_warps)
    out = _impl(x, residual, weight, index, router, copy_w, **kw)
    return out, (x, residual, weight, index, router, copy_w)


def _differentiable_bwd(shared, eps, interpret, num_warps, saved, g):
    x, residual, weight, index, router, copy_w = saved
    stacked = index if weight.ndim == 2 else None

    def f(x, r, w, gate, cw):
        kw = dict(weight_index=stacked, router=gate, residual_weights=cw, residual_shared=shared)
        return add_rms_norm_reference(x, r, w, eps=eps, **kw)

    dx, dr, dw, dg, dcw = jax.vjp(f, x, residual, weight, router, copy_w)[1](g)
    return dx, dr, dw, None, dg, dcw


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)
