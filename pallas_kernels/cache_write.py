"""The new tokens' latent rows into the paged MLA cache in one kernel (RMSNorm + RoPE + scatter), Triton-lowered.

    write_latent_rows(kv [T, L+R], weight [L], cos [T, R/2], sin [T, R/2], slot_mapping i32[T],
                      cache [Lyr_c, P, G, L+R], layer, *, eps) -> (rows [T, L+R], cache)
    write_latent_rows(..., weight [Lyr, L], ..., weight_index=i)   # row i of stacked layers' norm weights
    write_latent_rows(..., cache e4m3 [Lyr_c, P, G, L+R], ..., kv_scale=f32 [Lyr_c, P, G])
        -> (rows, cache, kv_scale)                                    # the fp8 cache: row and its scale

kv is the raw kv_a_proj_with_mqa output [kv_c | k_pe]. A row is normed and roped as the model does it:
kv_c_normed = weight * (kv_c32 * rsqrt(mean(kv_c32^2) + eps)).astype(kv.dtype) (HF DeepseekRMSNorm, the weight
multiply after the cast back, like `pallas_kernels.rms_norm`), k_pe = DeepSeek's interleaved-pair RoPE in float32
cast back to kv's dtype; rows = [kv_c_normed | k_pe] in result_type(weight, kv) is returned (prefill reads
kv_c_normed and k_pe) and, cast to the cache dtype, stored at cache[layer, slot // G, slot % G] for each token's
slot in `slot_mapping`. A slot < 0 or >= P * G (padding: -1) or a layer outside [0, Lyr_c) stores nothing. An fp8
cache (float8_e4m3fn, with `kv_scale`) stores the row in the cache's per-token format (`util.quantize_rows`:
scale = max|row| / 448, the row / scale in e4m3) and the scale at kv_scale[layer, slot // G, slot % G].

Why: XLA runs the norm (a Pallas kernel), the RoPE with its slices and concatenation, and the scatter (a
dynamic-slice and a dynamic-update-slice fusion) as four kernels a layer, each ~1-2 us at batch 1 on the H200 (an fp8
cache: the quantization's amax and the scales' scatter too); this is one. One program per token row, the row in
registers: one 2^k-wide load of the latent (the sum of squares has the norm kernel's order, so the stored rows are
bitwise the same), the rope's even and odd lanes as two strided loads (R/2 each: Triton's loads are powers of two,
576 is not), the row stored to the output and, under `pl.when(valid)`, to its cache slot (fp8: the row quantized
in registers, its scale beside it).

In place: the cache is input and output of the call (`input_output_aliases`), a whole-array block (under the
Triton lowering a block only sets a base pointer; offsets switch to int64 above 4 GiB), so XLA hands the kernel the
cache's buffer and only the T rows are written. Inside a layer scan keep the cache in the carry and pass the layer
index (traced): the norm weight likewise is read in place from the stacked weights (`weight_index`), since a slice
feeding a custom call would be materialized.

`write_latent_rows_reference` (plain jnp) is the reference and the path for shapes the kernel does not take (L or
R/2 not a power of two).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.launch import Launch
from pallas_kernels.launch import run as run_launches
from pallas_kernels.rms_norm import add_rms_norm_reference
from pallas_kernels.util import (
    FLOAT_DTYPES,
    FP8,
    check_stacked_index,
    fp8_row_payload,
    fp8_row_scale,
    is_pow2,
    scatter_rows,
)

__all__ = ["supported", "write_latent_rows", "write_latent_rows_launch", "write_latent_rows_reference"]


def supported(kv_lora_rank: int, rope_dim: int) -> bool:
    """Whether the kernel takes rows of L = kv_lora_rank latent and R = rope_dim rope values (L and R/2 powers of
    two, R even)."""
    return is_pow2(kv_lora_rank) and rope_dim % 2 == 0 and is_pow2(rope_dim // 2)


def _check(kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale=None):
    if kv.ndim != 2:
        raise ValueError(f"kv must be [T, L+R], got shape {kv.shape}")
    if cache.ndim != 4:
        raise ValueError(f"cache must be [num_layers, num_pages, G, L+R], got shape {cache.shape}")
    t, w = kv.shape
    if cache.shape[3] != w:
        raise ValueError(f"kv rows are {w} wide, the cache's {cache.shape[3]}")
    if weight_index is None:
        if weight.ndim != 1:
            raise ValueError(f"weight must be [L], got shape {weight.shape} (a stacked [Lyr, L] needs weight_index)")
    else:
        if weight.ndim != 2:
            raise ValueError(f"a stacked weight must be [Lyr, L], got shape {weight.shape}")
        check_stacked_index(weight_index, weight.shape[0], "weight_index", f"{weight.shape[0]} stacked weights")
    lat = weight.shape[-1]
    if not 0 < lat < w:
        raise ValueError(f"weight width L = {lat} must lie in (0, {w}) (the kv row width L+R)")
    r = w - lat
    if r % 2:
        raise ValueError(f"rope width R = {w} - {lat} = {r} must be even (interleaved pairs)")
    for name, a in (("cos", cos), ("sin", sin)):
        if a.shape != (t, r // 2):
            raise ValueError(f"{name} must be [T, R/2] = {(t, r // 2)}, got shape {a.shape}")
    if slot_mapping.shape != (t,) or not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(
            f"slot_mapping must be an integer [T] = ({t},) array, got {slot_mapping.shape} {slot_mapping.dtype}"
        )
    for name, a in (("kv", kv), ("weight", weight)) + ((("cache", cache),) if cache.dtype != FP8 else ()):
        if jnp.dtype(a.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be bfloat16, float16 or float32, got {a.dtype}")
    if (cache.dtype == FP8) != (kv_scale is not None):
        raise ValueError(
            "an fp8 (float8_e4m3fn) cache needs kv_scale, and only an fp8 cache takes one: "
            f"cache {cache.dtype}, kv_scale {None if kv_scale is None else kv_scale.dtype}"
        )
    if kv_scale is not None and (kv_scale.shape != cache.shape[:3] or kv_scale.dtype != jnp.float32):
        raise ValueError(
            f"kv_scale must be f32 {cache.shape[:3]} (the cache's [Lyr, P, G]), got {kv_scale.dtype} {kv_scale.shape}"
        )
    check_stacked_index(layer, cache.shape[0], "layer", f"a cache of {cache.shape[0]} layers")
    return lat, r


def _rope(x1, x2, cos, sin):
    """Rotated (evens, odds) of interleaved pairs, float32 (mla_jax.rope.apply_rope's arithmetic)."""
    x1, x2 = x1.astype(jnp.float32), x2.astype(jnp.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


def write_latent_rows_reference(
    kv, weight, cos, sin, slot_mapping, cache, layer, *, eps: float, weight_index=None, kv_scale=None
):
    """(rows [T, L+R], cache), and the scales with `kv_scale`: the module docstring's contract in plain jnp (one
    scatter, padding dropped)."""
    lat, r = _check(kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale)
    normed, _ = add_rms_norm_reference(kv[:, :lat], None, weight, eps=eps, weight_index=weight_index)  # [T, L]
    pe = kv[:, lat:].reshape(-1, r // 2, 2)
    o1, o2 = _rope(pe[..., 0], pe[..., 1], cos, sin)
    k_pe = jnp.stack([o1, o2], -1).reshape(-1, r).astype(kv.dtype)  # [T, R]
    rows = jnp.concatenate([normed, k_pe.astype(normed.dtype)], -1)  # [T, L+R]
    cache, scale = scatter_rows(cache, kv_scale, rows, slot_mapping, layer)
    return (rows, cache) if kv_scale is None else (rows, cache, scale)


def _stored_f32(x):
    """x's values as stored in its dtype, in float32. For bf16 through the bits: XLA (the Pallas interpreter runs the
    kernel as HLO) folds a rounding to bf16 followed by an upcast into nothing, and the fp8 row would then quantize
    the unrounded row (a scale up to 0.4% off the stored row's)."""
    if x.dtype != jnp.bfloat16:
        return x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _kernel(ids, kv_ref, w_ref, cos_ref, sin_ref, slot_ref, layer_ref, wi_ref, *refs, eps, lat, r, fp8):
    # the cache (and the fp8 scales) in, aliased to the same outputs; kv, cos, sin and rows whole, row i this program's
    rows_ref, cache_ref, scale_ref = refs[2:] if fp8 else (refs[1], refs[2], None)
    (i,) = ids
    nl, p, g, _ = cache_ref.shape
    half = r // 2
    # the norm: rms_norm's kernel on one lat-wide chunk (same order of the sum of squares)
    x = kv_ref[i, pl.ds(0, lat)]  # [L] kv dtype
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.sum(xf * xf) / lat + eps)
    wrow = jnp.clip(wi_ref[0], 0, w_ref.shape[0] - 1)
    normed = w_ref[wrow, pl.ds(0, lat)] * (xf * inv).astype(kv_ref.dtype)  # [L] rows dtype
    evens, odds = pl.ds(lat, half, stride=2), pl.ds(lat + 1, half, stride=2)
    cos, sin = cos_ref[i, pl.ds(0, half)], sin_ref[i, pl.ds(0, half)]
    o1, o2 = _rope(kv_ref[i, evens], kv_ref[i, odds], cos, sin)  # [R/2] f32
    o1, o2 = o1.astype(kv_ref.dtype).astype(rows_ref.dtype), o2.astype(kv_ref.dtype).astype(rows_ref.dtype)
    rows_ref[i, pl.ds(0, lat)] = normed.astype(rows_ref.dtype)
    rows_ref[i, evens] = o1
    rows_ref[i, odds] = o2

    slot = slot_ref[i]
    layer = layer_ref[0]
    valid = (slot >= 0) & (slot < p * g) & (layer >= 0) & (layer < nl)

    parts = (normed.astype(rows_ref.dtype), o1, o2)  # the row's [L], evens, odds
    if fp8:  # util.quantize_rows on the row
        parts = tuple(map(_stored_f32, parts))
        amax = jnp.maximum(
            jnp.maximum(jnp.max(jnp.abs(parts[0])), jnp.max(jnp.abs(parts[1]))), jnp.max(jnp.abs(parts[2]))
        )
        scale = fp8_row_scale(amax)
        parts = tuple(fp8_row_payload(x, scale) for x in parts)

    @pl.when(valid)
    def _():
        page, off = slot // g, slot % g
        for x, cols in zip(parts, (pl.ds(0, lat), evens, odds)):
            cache_ref[layer, page, off, cols] = x.astype(cache_ref.dtype)
        if fp8:
            scale_ref[layer, page, off] = scale


def launch(kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale, *, eps, num_warps):
    """The kernel's `launch.Launch` (outputs: rows, cache (, kv_scale)): layer and weight_index i32[1]. For `_impl`,
    and for a call that runs the kernel beside another (`launch.run`)."""
    t, w = kv.shape
    lat = weight.shape[-1]
    if weight.ndim == 1:  # one weight: row 0 of [1, L]
        weight = weight[None]
    fp8 = kv_scale is not None
    scales = (kv_scale,) if fp8 else ()
    inputs = (kv, weight, cos.astype(jnp.float32), sin.astype(jnp.float32), slot_mapping.astype(jnp.int32))
    return Launch(
        functools.partial(_kernel, eps=eps, lat=lat, r=w - lat, fp8=fp8),
        grid=(t,),
        inputs=inputs + (layer, weight_index, cache) + scales,
        out_shape=(jax.ShapeDtypeStruct((t, w), jnp.result_type(weight.dtype, kv.dtype)),)
        + tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (cache, *scales)),
        aliases=((7, 1), (8, 2)) if fp8 else ((7, 1),),
        num_warps=num_warps,
        name=f"cache_write_l{lat}_r{w - lat}" + ("_fp8" if fp8 else ""),
    )


@functools.partial(jax.jit, static_argnames=("eps", "interpret", "num_warps"))
def _impl(kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale, *, eps, interpret, num_warps):
    args = (kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale)
    (outs,) = run_launches([launch(*args, eps=eps, num_warps=num_warps)], interpret=interpret)
    return list(outs)


def write_latent_rows(
    kv,  # [T, L+R] bf16/f16/f32: kv_a_proj_with_mqa's output
    weight,  # [L] kv_a_layernorm, or [Lyr, L] with weight_index
    cos,  # [T, R/2] f32 (rope_cos_sin)
    sin,  # [T, R/2] f32
    slot_mapping,  # i32[T]; < 0 or >= P * G: padding, stores nothing
    cache,  # [Lyr_c, P, G, L+R] bf16/f16/f32, or float8_e4m3fn with kv_scale; updated in place
    layer,  # i32 scalar (may be traced); outside [0, Lyr_c) stores nothing
    *,
    eps: float,
    weight_index=None,  # i32 scalar (may be traced): the row of a stacked weight
    kv_scale=None,  # f32 [Lyr_c, P, G]: an fp8 cache's per-token scales, updated in place
    interpret: bool = False,
    num_warps: int = 4,
):
    """(rows [T, L+R] = [kv_c_normed | k_pe], cache with the rows stored), and kv_scale with theirs when given; see
    the module docstring. The cache is
    donated to the call only in the sense of aliasing: under jit, XLA updates its buffer in place when the caller
    does not use the old value afterwards (a copy otherwise). A static weight_index outside [0, Lyr) is an error,
    a traced one is clamped; a static layer outside [0, Lyr_c) is an error."""
    lat, r = _check(kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale)
    if not supported(lat, r) or kv.shape[0] == 0:
        return write_latent_rows_reference(
            kv, weight, cos, sin, slot_mapping, cache, layer, eps=eps, weight_index=weight_index, kv_scale=kv_scale
        )
    layer, wi = _indices(layer, weight_index)
    return _impl(
        kv,
        weight,
        cos,
        sin,
        slot_mapping,
        cache,
        layer,
        wi,
        kv_scale,
        eps=float(eps),
        interpret=bool(interpret),
        num_warps=int(num_warps),
    )


def _indices(layer, weight_index):
    """i32[1] each (a reshape, no XLA kernel): the cache layer, the weight row (clamped in the kernel)."""
    wi = jnp.asarray(0 if weight_index is None else weight_index, jnp.int32).reshape(1)
    return jnp.asarray(layer, jnp.int32).reshape(1), wi


def write_latent_rows_launch(
    kv, weight, cos, sin, slot_mapping, cache, layer, *, eps: float, weight_index=None, kv_scale=None, num_warps=4
):
    """`write_latent_rows`'s kernel as a `launch.Launch` (outputs rows, cache (, kv_scale), the cache and scales
    aliased), for a launch beside another kernel's programs (`launch.run`); shapes the kernel takes (`supported`)
    and T >= 1 only."""
    lat, r = _check(kv, weight, cos, sin, slot_mapping, cache, layer, weight_index, kv_scale)
    if not supported(lat, r) or kv.shape[0] == 0:
        raise ValueError(f"write_latent_rows_launch: no kernel for L={lat}, R={r}, T={kv.shape[0]}")
    layer, wi = _indices(layer, weight_index)
    return launch(kv, weight, cos, sin, slot_mapping, cache, layer, wi, kv_scale, eps=float(eps), num_warps=num_warps)
