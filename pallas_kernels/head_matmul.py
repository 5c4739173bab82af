"""Per-head batched matmul for MLA's absorbed decode path: a Pallas kernel lowered through Triton.

    head_matmul(x [T, N, K], w [N, K, M]) -> [T, N, M]                    out[t, n] = x[t, n] @ w[n]
    head_matmul(x, w, tail=t [T, N, R]) -> [T, N, M+R]                   ... then t[t, n] in columns [M, M+R)
    head_matmul(x [T, N, K+R], w, tail_in_x=True) -> [T, N, M+R]         the tail is x's own last R columns
    head_matmul(x, w [Lyr, N, K, M], rhs_index=i)                          w[i] of layers' stacked weights

Accumulation in float32, output in x's dtype (the tail is cast to it). The two MLA uses:
- `absorb_q`: q [T, N, P+R] -> [T, N, L+R], q_nope @ W_UK_T [N, P, L], q_pe copied behind it. `tail_in_x` reads
  q once, in place: sliced into q_nope and q_pe first, each slice would be a copy kernel feeding the call.
- `v_up_proj`: the attention's latent output [T, N, L] @ W_UV [N, L, V] -> [T, N, V].

Why: at decode sizes both are weight-bandwidth bound (2 MB of bf16 weights each for DeepSeek-V2-Lite's 16 heads,
~0.5 us at the H200's copy bandwidth), but XLA runs absorb_q as one concatenate fusion (5.7 us at T=1) and
v_up_proj as a multiply fusion plus a reduce fusion (4.6 us together): issue #22.

Stacked layers: w may carry one more leading axis, [Lyr, N, K, M], with `rhs_index` (an int32 scalar, may be
traced) picking the layer, read in place and clamped to [0, Lyr) in the kernel (as `grouped_matmul`'s): a model
that scans over its layers then hands the kernel the scan-invariant stack, where a slice of the layer would be a
device copy of it (a slice feeding a custom call is a new buffer).

Design: grid (row tiles, column blocks, heads), row tiles fastest so that programs running together share one
weight tile in L2. A program owns `block_t` rows x `block_n` output columns of one head: it loops over K in
`block_k` steps (an unmasked loop over whole steps, then one masked step for a ragged end of K), accumulating
x tile [block_t, block_k] @ w tile [block_k, block_n] in float32, and stores its columns (masked at the edges of
T and M). With a tail, the programs of column block 0 also copy their rows' tail into columns [M, M+R). Decode
(T <= 16: one row tile, the rows past T masked) reads each weight byte once, so the tuning aims at bytes in
flight: `block_n` shrinks until the programs fill the SMs (a 2 MB weight is about what the H200 has in flight at
once), and Triton pipelines the K steps (`num_stages`).

Triton constraints: every load/store is a power of two in size and dots need M, N, K >= 16, so rows come in tiles
of at least 16 and blocks are powers of two >= 16; T, K, M and R are arbitrary (edges are masked); dot operands
share one dtype (x and w must).

`head_matmul_reference` (plain jnp, float32) is the reference and, recomputed, the kernel's backward (a custom
VJP), so a differentiated model still works. Tests: interpret mode on CPU, the compiled kernel with `-m gpu`;
H200 numbers: bench/head_matmul.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.launch import Launch
from pallas_kernels.launch import run as run_launches
from pallas_kernels.util import (
    FLOAT_DTYPES,
    cdiv,
    check_stacked_index,
    check_warps_stages,
    is_pow2,
    mask_and,
    masked_load,
    masked_store,
    next_pow2,
    num_sms,
    pad_to,
)

__all__ = ["default_tuning", "head_matmul", "head_matmul_launch", "head_matmul_reference"]


def _validate(x, w, tail, tail_in_x, rhs_index, block_t, block_n, block_k, num_warps, num_stages):
    """Shapes (T, N, K, M, R) after the contract's checks; R = 0 without a tail."""
    if not hasattr(x, "ndim") or x.ndim != 3:
        raise ValueError(f"x must be [T, N, K], got shape {getattr(x, 'shape', None)}")
    stacked = rhs_index is not None
    if not hasattr(w, "ndim") or w.ndim != 3 + stacked:
        want = "[Lyr, N, K, M] with rhs_index" if stacked else "[N, K, M] (a stacked w needs rhs_index)"
        raise ValueError(f"w must be {want}, got shape {getattr(w, 'shape', None)}")
    if stacked:
        check_stacked_index(rhs_index, w.shape[0], "rhs_index", f"w with {w.shape[0]} stacked layers")
    if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"x dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w dtypes differ: {x.dtype} vs {w.dtype} (cast one first)")
    t, n, kx = x.shape
    n_w, k, m = w.shape[-3:]
    if n != n_w:
        raise ValueError(f"x {x.shape} has N={n} heads, w {w.shape} has {n_w}")
    if min(n, k, m) < 1:
        raise ValueError(f"empty dimension: x {x.shape}, w {w.shape}")
    if tail_in_x and tail is not None:
        raise ValueError("give the tail either as `tail` or inside x (tail_in_x=True), not both")
    if tail_in_x:
        if kx <= k:
            raise ValueError(f"tail_in_x: x {x.shape} must be [T, N, K+R] with R >= 1 past w's K={k}")
        r = kx - k
    else:
        if kx != k:
            raise ValueError(f"x {x.shape} has K={kx}, but w {w.shape} has K={k}")
        r = 0
        if tail is not None:
            if not hasattr(tail, "ndim") or tail.ndim != 3 or tail.shape[:2] != (t, n) or tail.shape[2] < 1:
                raise ValueError(f"tail must be [T={t}, N={n}, R>=1], got shape {getattr(tail, 'shape', None)}")
            if jnp.dtype(tail.dtype) not in FLOAT_DTYPES:
                raise ValueError(f"tail dtype must be bfloat16, float16 or float32, got {tail.dtype}")
            r = tail.shape[2]
    for name, b in (("block_t", block_t), ("block_n", block_n), ("block_k", block_k)):
        if b is not None and not (is_pow2(b) and b >= 16):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton dot)")
    check_warps_stages(num_warps, num_stages)
    return t, n, k, m, r


def default_tuning(t: int, n: int, k: int, m: int, dtype, sms: int | None = None):
    """(block_t, block_n, block_k, num_warps, num_stages) from static shapes.

    Guesses until bench/head_matmul.py has H200 numbers (its --sweep times alternatives):
    - rows: one tile up to 64 rows (the weight read once), 16-row tiles at least (Triton dot);
    - columns: from 128 down to 16 until (row tiles x column blocks x heads) programs fill the SMs, so that a
      decode step's weight reads are all in flight together;
    - K: 128-deep steps, as many stages as steps, up to 4, within 128 KB of shared memory (the H200 has 227 KB a
      block; decode tiles, 16 x 128 and 128 x 16-32 bf16, take 8-12 KB a stage, 64 x 128 and 128 x 128 take 48).
    float32 (tests, not a fast path): smaller tiles for registers and shared memory.
    """
    f32 = jnp.dtype(dtype) == jnp.float32
    bt = min(32 if f32 else 64, max(16, next_pow2(t)))
    bk = min(32 if f32 else 128, max(16, next_pow2(k)))
    bn = min(64 if f32 else 128, max(16, next_pow2(m)))
    sms = num_sms() if sms is None else sms
    while bn > 16 and cdiv(t, bt) * cdiv(m, bn) * n < sms:
        bn //= 2
    stage_bytes = (bt * bk + bk * bn) * jnp.dtype(dtype).itemsize
    stages = max(1, min(4, cdiv(k, bk), (128 << 10) // stage_bytes))
    return bt, bn, bk, 4, stages


def _kernel(
    ids,
    *refs,
    t: int,
    k: int,
    m: int,
    r: int,
    tail_off: int,
    separate_tail: bool,
    rope: bool,
    num_layers: int,
    stacked: bool,
    bt: int,
    bn: int,
    bk: int,
    precision,
):
    # refs: layer i32[1], x [T, N, Kx], w [(Lyr,) N, K, M], (tail [T, N, R],) (cos, sin f32[T, R/2],) out [T, N, M+R]
    layer_ref, x_ref, w_ref = refs[:3]
    out_ref = refs[-1]
    tail_ref = refs[3] if separate_tail else x_ref  # tail_in_x: x's columns [K, K+R)
    cos_ref, sin_ref = refs[-3:-1] if rope else (None, None)
    i, j, h = ids  # row tile (fastest: programs in flight share the weight tile), output column block, head
    row0 = i * bt
    col0 = j * bn
    rows = row0 + jnp.arange(bt, dtype=jnp.int32)
    cols = col0 + jnp.arange(bn, dtype=jnp.int32)
    row_in = (rows < t)[:, None] if t % bt else None  # static: only a ragged last row tile needs it
    col_in = (cols < m)[None, :] if m % bn else None
    # w[layer, h] of stacked layers (the index clamped here, not by an XLA kernel before the call), else w[h]
    lead = (jnp.clip(layer_ref[0], 0, num_layers - 1), h) if stacked else (h,)

    def step(kk, acc, k_in=None):
        k0 = kk * bk
        xt = masked_load(
            x_ref.at[pl.ds(row0, bt), h, pl.ds(k0, bk)], mask_and(row_in, None if k_in is None else k_in[None, :])
        )
        wt = masked_load(
            w_ref.at[(*lead, pl.ds(k0, bk), pl.ds(col0, bn))], mask_and(None if k_in is None else k_in[:, None], col_in)
        )
        return acc + lax.dot_general(
            xt, wt, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )

    full_steps = k // bk
    acc = lax.fori_loop(0, full_steps, step, jnp.zeros((bt, bn), jnp.float32))
    if k % bk:  # static: one masked step for the ragged end of K (the loop keeps its K offset dynamic: a static
        # slice past K fails to trace)
        k_in = full_steps * bk + jnp.arange(bk, dtype=jnp.int32) < k
        acc = lax.fori_loop(full_steps, full_steps + 1, lambda kk, a: step(kk, a, k_in), acc)
    masked_store(out_ref.at[pl.ds(row0, bt), h, pl.ds(col0, bn)], acc.astype(out_ref.dtype), mask_and(row_in, col_in))

    if r and rope:  # the tail's interleaved pairs rotated (`mla_jax.rope.apply_rope`): float32, then x's dtype
        rp = next_pow2(r)
        lane = jnp.arange(rp, dtype=jnp.int32)
        even = (lane % 2 == 0)[None, :]
        live = lane < r
        rows2 = jnp.minimum(rows, t - 1)[:, None]  # (gathers index rows past T clamped; their stores are masked)

        @pl.when(j == 0)
        def _():
            # out[2i] = x[2i] cos_i - x[2i+1] sin_i, out[2i+1] = x[2i+1] cos_i + x[2i] sin_i: the tail and its
            # neighbours one column right / left (contiguous loads), cos and sin gathered per lane
            # (+ j, which is 0 here: dynamic offsets, since a static slice past the array fails to trace)
            x0 = masked_load(tail_ref.at[pl.ds(row0, bt), h, pl.ds(tail_off + j, rp)], mask_and(row_in, live[None, :]))
            right = (lane + 1 < r)[None, :]
            left = ((lane >= 1) & live)[None, :]
            xr = masked_load(tail_ref.at[pl.ds(row0, bt), h, pl.ds(tail_off + 1 + j, rp)], mask_and(row_in, right))
            xl = masked_load(tail_ref.at[pl.ds(row0, bt), h, pl.ds(tail_off - 1 + j, rp)], mask_and(row_in, left))
            idx = jnp.minimum(lane // 2, r // 2 - 1)[None, :]
            c = pltriton.load(cos_ref.at[rows2, idx], mask=mask_and(row_in, live[None, :]), other=0.0)
            sn = pltriton.load(sin_ref.at[rows2, idx], mask=mask_and(row_in, live[None, :]), other=0.0)
            x0, xr, xl = (v.astype(jnp.float32) for v in (x0, xr, xl))
            rot = jnp.where(even, x0 * c - xr * sn, x0 * c + xl * sn)
            tail_in = mask_and(row_in, live[None, :] if rp != r else None)
            v = rot.astype(tail_ref.dtype).astype(out_ref.dtype)
            masked_store(out_ref.at[pl.ds(row0, bt), h, pl.ds(m + j, rp)], v, tail_in)

    elif r:
        rp = next_pow2(r)
        tail_in = (jnp.arange(rp, dtype=jnp.int32) < r)[None, :] if rp != r else None

        @pl.when(j == 0)
        def _():
            # (+ j, which is 0 here: a dynamic column offset, since a static slice past the array fails to trace)
            v = masked_load(tail_ref.at[pl.ds(row0, bt), h, pl.ds(tail_off + j, rp)], mask_and(row_in, tail_in))
            masked_store(
                out_ref.at[pl.ds(row0, bt), h, pl.ds(m + j, rp)], v.astype(out_ref.dtype), mask_and(row_in, tail_in)
            )


def launch(x, w, tail, layer, rope, *, tail_in_x, interpret, block_t, block_n, block_k, num_warps, num_stages):
    """(the kernel's `launch.Launch`, a function of its output giving the result [T, N, M+R]): layer i32[1], the
    index into w's leading axis when w is stacked [Lyr, N, K, M] (4-D); rope None or (cos, sin) f32[T, R/2] rotating
    the tail. For `_impl`, and for a call that runs the kernel beside another (`launch.run`)."""
    stacked = w.ndim == 4
    t, n, kx = x.shape
    k, m = w.shape[-2:]
    r = kx - k if tail_in_x else (0 if tail is None else tail.shape[2])
    tail_off = k if tail_in_x else 0
    rp = next_pow2(r) if r else 0
    width = m + r
    t_out, width_out = t, width
    if interpret:  # blocks larger than their arrays: zero padding (masked out by the kernel, sliced off)
        t_pad = max(t, block_t)
        x = pad_to(pad_to(x, 0, t_pad), 2, max(block_k, tail_off + rp + (rope is not None)))  # rope: +1 right
        w = pad_to(pad_to(w, w.ndim - 2, block_k), w.ndim - 1, block_n)
        if tail is not None:
            tail = pad_to(pad_to(tail, 0, t_pad), 2, rp)
        if rope is not None:
            rope = tuple(pad_to(a, 0, t_pad) for a in rope)
        t_out, width_out = t_pad, max(width, block_n, m + rp)
    kernel = functools.partial(
        _kernel,
        t=t,
        k=k,
        m=m,
        r=r,
        tail_off=tail_off,
        separate_tail=tail is not None,
        rope=rope is not None,
        num_layers=w.shape[0] if stacked else 1,
        stacked=stacked,
        bt=block_t,
        bn=block_n,
        bk=block_k,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None,  # exact f32, not TF32
    )
    inputs = [layer, x, w] + ([tail] if tail is not None else []) + (list(rope) if rope is not None else [])
    spec = Launch(
        kernel,
        grid=(cdiv(t, block_t), cdiv(m, block_n), n),
        inputs=tuple(inputs),
        out_shape=(jax.ShapeDtypeStruct((t_out, n, width_out), x.dtype),),
        num_warps=num_warps,
        num_stages=num_stages,
        name=f"head_matmul_bt{block_t}_bn{block_n}_bk{block_k}_w{num_warps}_s{num_stages}"
        + (f"_tail{r}" if r else "")
        + ("_rope" if rope is not None else ""),
    )
    return spec, lambda out: out[:t, :, :width] if (t_out, width_out) != (t, width) else out


@functools.partial(
    jax.jit,
    static_argnames=("tail_in_x", "interpret", "block_t", "block_n", "block_k", "num_warps", "num_stages"),
)
def _impl(x, w, tail, layer, rope, *, tail_in_x, interpret, **tuning):
    spec, result = launch(x, w, tail, layer, rope, tail_in_x=tail_in_x, interpret=interpret, **tuning)
    ((out,),) = run_launches([spec], interpret=interpret)
    return result(out)


def head_matmul(
    x,  # [T, N, K] (tail_in_x: [T, N, K+R]) bf16/f16/f32
    w,  # [N, K, M], or [Lyr, N, K, M] with rhs_index; x's dtype
    tail=None,  # [T, N, R] or None: copied into output columns [M, M+R)
    *,
    tail_in_x: bool = False,
    tail_rope=None,  # (cos, sin) f32[T, R/2] or None: with tail_in_x, the tail's interleaved pairs rotated
    rhs_index=None,  # i32 scalar (may be traced): the layer of a stacked w
    interpret: bool = False,
    block_t: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """out[t, n, :M] = x[t, n, :K] @ w[n] (w[rhs_index, n] when stacked), accumulated in float32, in x's dtype;
    with a tail (`tail`, or x's columns [K, K+R) with tail_in_x) out[t, n, M:] = the tail cast to x's dtype.
    Returns [T, N, M] or [T, N, M+R]. With tail_rope = (cos, sin) the tail is rotated first, pair by pair as
    `mla_jax.rope.apply_rope` does (float32, rounded to the tail's dtype): absorb_q's q_pe rope in the same kernel.
    A static rhs_index must lie in [0, Lyr); a traced one is clamped.
    Tuning (None = `default_tuning`): block_t rows per tile, block_n output columns, block_k K step (powers of
    two >= 16), num_warps, num_stages (Triton pipelining of the K loop)."""
    tuning = (block_t, block_n, block_k, num_warps, num_stages)
    t, n, _, m, r = _validate(x, w, tail, tail_in_x, rhs_index, *tuning)
    if t == 0:
        return jnp.zeros((0, n, m + r), x.dtype)
    layer, rope, static = _resolve(x, w, tail, tail_in_x, tail_rope, rhs_index, interpret, tuning)
    return _differentiable(x, w, tail, layer, rope, static)


def _resolve(x, w, tail, tail_in_x, tail_rope, rhs_index, interpret, tuning):
    """(layer i32[1], rope, the static arguments of `_run`) of a validated call with T >= 1: the tuning's Nones from
    `default_tuning`, no block larger than its (power-of-two rounded) dimension (it would only compute padding)."""
    t, n, k, m, r = _validate(x, w, tail, tail_in_x, rhs_index, *tuning)
    rope = _check_rope(tail_rope, t, r, tail_in_x)
    d = default_tuning(t, n, k, m, x.dtype)
    bt, bn, bk, warps, stages = (d[i] if v is None else v for i, v in enumerate(tuning))
    bt, bn, bk = (min(b, max(16, next_pow2(v))) for b, v in ((bt, t), (bn, m), (bk, k)))
    layer = jnp.asarray(0 if rhs_index is None else rhs_index, jnp.int32).reshape(1)  # clamped in the kernel
    return layer, rope, (bool(tail_in_x), bool(interpret), bt, bn, bk, warps, stages)


_TUNING = ("block_t", "block_n", "block_k", "num_warps", "num_stages")


def head_matmul_launch(x, w, tail=None, *, tail_in_x=False, tail_rope=None, rhs_index=None, interpret=False, **tuning):
    """`head_matmul`'s kernel as a `launch.Launch` and a function of its one output giving `head_matmul`'s result,
    for a launch beside another kernel's programs (`launch.run`); T >= 1, not differentiable. Tuning: `head_matmul`'s
    keywords."""
    if set(tuning) - set(_TUNING):
        raise TypeError(f"head_matmul_launch got unexpected arguments {sorted(set(tuning) - set(_TUNING))}")
    tuning = tuple(tuning.get(name) for name in _TUNING)
    if x.ndim == 3 and x.shape[0] == 0:
        raise ValueError("head_matmul_launch needs T >= 1 rows")
    layer, rope, static = _resolve(x, w, tail, tail_in_x, tail_rope, rhs_index, interpret, tuning)
    tail_in_x, interpret, bt, bn, bk, warps, stages = static
    kw = dict(block_t=bt, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    return launch(x, w, tail, layer, rope, tail_in_x=tail_in_x, interpret=interpret, **kw)


def _check_rope(tail_rope, t: int, r: int, tail_in_x: bool):
    """tail_rope as a (cos, sin) pair of f32[T, R/2], or None."""
    if tail_rope is None:
        return None
    if not tail_in_x:
        raise ValueError("tail_rope rotates a tail inside x (tail_in_x=True, absorb_q's q_pe)")
    if r == 0 or r % 2:
        raise ValueError(f"tail_rope needs a tail of an even width R, got R={r}")
    if not isinstance(tail_rope, (tuple, list)) or len(tail_rope) != 2:
        raise ValueError("tail_rope must be a (cos, sin) pair")
    for name, a in zip(("cos", "sin"), tail_rope):
        if getattr(a, "shape", None) != (t, r // 2):
            raise ValueError(f"tail_rope {name} must be [T, R/2] = {(t, r // 2)}, got {getattr(a, 'shape', None)}")
    return tuple(jnp.asarray(a, jnp.float32) for a in tail_rope)


# The kernel forward, the reference's backward (recomputed): the kernel has no derivative of its own, and a
# model differentiated through absorb_q / v_up_proj (training through `model.forward`) must not fail.
def _run(x, w, tail, layer, rope, static):
    tail_in_x, interpret, bt, bn, bk, warps, stages = static
    kw = dict(block_t=bt, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)
    return _impl(x, w, tail, layer, rope, tail_in_x=tail_in_x, interpret=interpret, **kw)


_differentiable = jax.custom_vjp(_run, nondiff_argnums=(5,))


def _differentiable_fwd(x, w, tail, layer, rope, static):
    return _run(x, w, tail, layer, rope, static), (x, w, tail, layer, rope)


def _differentiable_bwd(static, saved, g):
    x, w, tail, layer, rope = saved
    index = layer[0] if w.ndim == 4 else None

    def f(x, w, tail, rope):
        ref = head_matmul_reference(x, w, tail, tail_in_x=static[0], tail_rope=rope, rhs_index=index)
        return ref.astype(x.dtype)

    _, vjp = jax.vjp(f, x, w, tail, rope)
    dx, dw, dtail, drope = vjp(g)
    return dx, dw, dtail, None, drope


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def head_matmul_reference(x, w, tail=None, *, tail_in_x: bool = False, tail_rope=None, rhs_index=None, **tuning):
    """Float32 plain-JAX reference (returns float32): one einsum at full precision, then the tail (rotated by
    tail_rope; with rhs_index, the layer sliced out first, clamped as the kernel does). Tuning arguments are
    accepted and ignored."""
    del tuning
    _, _, _, _, r = _validate(x, w, tail, tail_in_x, rhs_index, None, None, None, None, None)
    rope = _check_rope(tail_rope, x.shape[0], r, tail_in_x)
    if rhs_index is not None:
        w = lax.dynamic_index_in_dim(w, jnp.clip(rhs_index, 0, w.shape[0] - 1), keepdims=False)
    k = w.shape[1]
    if tail_in_x:
        x, tail = x[..., :k], x[..., k:]
    out = jnp.einsum(
        "tnk,nkm->tnm", x.astype(jnp.float32), w.astype(jnp.float32), precision=lax.Precision.HIGHEST
    )  # [T, N, M]
    if tail is None:
        return out
    if rope is not None:  # `mla_jax.rope.apply_rope`'s rotation of interleaved pairs, rounded to the tail's dtype
        pairs = tail.astype(jnp.float32).reshape(*tail.shape[:2], r // 2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        c, sn = (a[:, None, :] for a in rope)
        tail = jnp.stack([x1 * c - x2 * sn, x2 * c + x1 * sn], axis=-1).reshape(tail.shape).astype(tail.dtype)
    # the tail as the kernel stores it: cast to x's dtype first
    return jnp.concatenate([out, tail.astype(x.dtype).astype(jnp.float32)], axis=-1)
