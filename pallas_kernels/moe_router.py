"""The MoE router's selection in one kernel: scores, group limit, top-k and the weights, Triton-lowered.

    moe_topk(logits f32[T, E], bias f32[E] | None, *, top_k, scoring, n_group, topk_group, group_score, fill,
             renormalize, scale) -> (weights f32[T, K], ids i32[T, K])

What `mla_jax.layers.route` does after the router's logits (the GEMV stays in XLA), for DeepSeek's three gates:
- V2-Lite "greedy": softmax scores, the top-k of them;
- V2 "group_limited_greedy": softmax; each group's max; the experts of the `topk_group` best groups (the rest
  `fill` = 0); their top-k;
- V3 "noaux_tc": sigmoid scores; the choice adds the correction bias; each group's score is the sum of its two
  best choices; the experts of the best groups (the rest -inf); top-k of the choice, weights the unbiased scores.
Then weights / (sum + 1e-20) when `renormalize`, times `scale`.

Why: XLA runs the softmax, top-k (a sort of all E scores) and the slice of its first K as three kernels, 1.3 to
2.7 us each at batch 1 on the H200, in every MoE layer; here one program per token does it all in registers.
Ties pick the lowest expert index, as `lax.top_k` does, so ids match `moe_topk_reference` exactly when the scores
do (the kernel's exp may differ from XLA's in the last ulp; random scores never tie that closely).

Triton constraints: vectors are powers of two, so E is padded to Ep (masked loads, padded experts never chosen)
and the K outputs are stored from a Kp-wide vector with a mask. `moe_topk_reference` (plain jnp) is the
reference and the path on CPU (`mla_jax.layers.route`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import next_pow2

__all__ = ["moe_topk", "moe_topk_reference", "SCORINGS", "GROUP_SCORES"]

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")
F32 = jnp.float32


def _check(logits, bias, top_k, scoring, n_group, topk_group, group_score):
    if not hasattr(logits, "ndim") or logits.ndim != 2 or jnp.dtype(logits.dtype) != F32:
        raise ValueError(
            f"logits must be f32[T, E], got {getattr(logits, 'dtype', None)} {getattr(logits, 'shape', None)}"
        )
    e = logits.shape[1]
    if bias is not None and (getattr(bias, "shape", None) != (e,) or jnp.dtype(bias.dtype) != F32):
        raise ValueError(f"bias must be f32[E={e}], got {getattr(bias, 'dtype', None)} {getattr(bias, 'shape', None)}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if not (isinstance(n_group, int) and n_group >= 1 and e % n_group == 0):
        raise ValueError(f"n_group={n_group!r} must be a positive int dividing E={e}")
    if not (isinstance(topk_group, int) and 1 <= topk_group <= n_group):
        raise ValueError(f"topk_group={topk_group!r} must be an int in [1, n_group={n_group}]")
    kept = topk_group * (e // n_group)
    if not (isinstance(top_k, int) and 1 <= top_k <= kept):
        raise ValueError(f"top_k={top_k!r} must be an int in [1, {kept}] (the experts of the kept groups)")


def _scores(logits, scoring):
    return jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)


def moe_topk_reference(
    logits,
    bias=None,
    *,
    top_k: int,
    scoring: str,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "max",
    fill: float = 0.0,
    renormalize: bool = False,
    scale: float = 1.0,
):
    """Plain jnp (`lax.top_k`): (weights f32[T, K], ids i32[T, K]), as the module docstring says."""
    _check(logits, bias, top_k, scoring, n_group, topk_group, group_score)
    t, e = logits.shape
    scores = _scores(logits, scoring)
    choice = scores if bias is None else scores + bias[None, :]
    if n_group > 1:
        grouped = choice.reshape(t, n_group, e // n_group)
        if group_score == "top2":
            gs = jnp.sum(lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
        else:
            gs = jnp.max(grouped, axis=-1)
        _, top_groups = lax.top_k(gs, topk_group)  # [T, topk_group]
        keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, fill)
    _, ids = lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * scale, ids.astype(jnp.int32)


def _kernel(*refs, e, ep, kp, top_k, scoring, n_group, topk_group, group_score, fill, renormalize, scale, has_bias):
    if has_bias:
        logits_ref, bias_ref, w_ref, ids_ref = refs
    else:
        (logits_ref, w_ref, ids_ref), bias_ref = refs, None
    t = pl.program_id(0)
    col = jnp.arange(ep, dtype=jnp.int32)
    valid = col < e
    ninf = jnp.float32(-jnp.inf)
    big = jnp.int32(ep)
    x = pltriton.load(logits_ref.at[t, pl.ds(0, ep)], mask=valid, other=-jnp.inf)
    if scoring == "softmax":
        z = jnp.exp(x - jnp.max(x))
        scores = z / jnp.sum(z)
    else:
        scores = jnp.where(valid, 1.0 / (1.0 + jnp.exp(-x)), 0.0)
    choice = scores
    if has_bias:
        choice = choice + pltriton.load(bias_ref.at[pl.ds(0, ep)], mask=valid, other=0.0)
    choice = jnp.where(valid, choice, ninf)  # padded experts: never chosen

    def first_max(v, index=col):  # (max, its lowest index): lax.top_k's order on ties
        m = jnp.max(v)
        return m, jnp.min(jnp.where(v == m, index, big))

    if n_group > 1:
        gsize = e // n_group
        gid = col // gsize  # padded experts: gid >= n_group
        gcol = jnp.arange(next_pow2(n_group), dtype=jnp.int32)
        gscores = jnp.full(gcol.shape, ninf)
        for g in range(n_group):
            mine = jnp.where(gid == g, choice, ninf)
            m1, i1 = first_max(mine)
            s = m1 + jnp.max(jnp.where(col == i1, ninf, mine)) if group_score == "top2" else m1
            gscores = jnp.where(gcol == g, s, gscores)
        keep = jnp.zeros(col.shape, jnp.bool_)
        for _ in range(topk_group):
            _, gi = first_max(gscores, gcol)
            keep = keep | (gid == gi)
            gscores = jnp.where(gcol == gi, ninf, gscores)
        choice = jnp.where(keep, choice, jnp.where(valid, jnp.float32(fill), ninf))

    kcol = jnp.arange(kp, dtype=jnp.int32)
    ws = jnp.zeros((kp,), F32)
    ids = jnp.zeros((kp,), jnp.int32)
    for k in range(top_k):
        _, i = first_max(choice)
        ws = jnp.where(kcol == k, jnp.sum(jnp.where(col == i, scores, 0.0)), ws)
        ids = jnp.where(kcol == k, i, ids)
        choice = jnp.where(col == i, ninf, choice)
    if renormalize:
        ws = ws / (jnp.sum(ws) + 1e-20)
    out = kcol < top_k
    pltriton.store(w_ref.at[t, pl.ds(0, kp)], ws * scale, mask=out)
    pltriton.store(ids_ref.at[t, pl.ds(0, kp)], ids, mask=out)


@functools.partial(
    jax.jit,
    static_argnames=(
        "top_k",
        "scoring",
        "n_group",
        "topk_group",
        "group_score",
        "fill",
        "renormalize",
        "scale",
        "interpret",
    ),
)
def _impl(logits, bias, *, top_k, scoring, n_group, topk_group, group_score, fill, renormalize, scale, interpret):
    t, e = logits.shape
    ep, kp = next_pow2(e), next_pow2(top_k)
    k_out = top_k
    if interpret:  # the interpreter cannot slice past an array's end (the GPU masks): pad to whole vectors
        logits = jnp.pad(logits, ((0, 0), (0, ep - e)), constant_values=-jnp.inf)
        bias = None if bias is None else jnp.pad(bias, (0, ep - e))
        k_out = kp
    has_bias = bias is not None
    whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))  # noqa: E731
    kernel = functools.partial(
        _kernel,
        e=e,
        ep=ep,
        kp=kp,
        top_k=top_k,
        scoring=scoring,
        n_group=n_group,
        topk_group=topk_group,
        group_score=group_score,
        fill=fill,
        renormalize=renormalize,
        scale=scale,
        has_bias=has_bias,
    )
    weights, ids = pl.pallas_call(
        kernel,
        grid=(t,),
        in_specs=[whole(logits.shape)] + ([whole(bias.shape)] if has_bias else []),
        out_specs=[whole((t, k_out)), whole((t, k_out))],
        out_shape=[jax.ShapeDtypeStruct((t, k_out), F32), jax.ShapeDtypeStruct((t, k_out), jnp.int32)],
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=1, num_stages=1),
        name=f"moe_topk_e{e}_k{top_k}_g{n_group}",
    )(*([logits, bias] if has_bias else [logits]))
    return weights[:, :top_k], ids[:, :top_k]


def moe_topk(
    logits,
    bias=None,
    *,
    top_k: int,
    scoring: str,
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "max",
    fill: float = 0.0,
    renormalize: bool = False,
    scale: float = 1.0,
    interpret: bool = False,
):
    """The kernel: (weights f32[T, K], ids i32[T, K]) equal to `moe_topk_reference` (see the module docstring).
    logits f32[T, E] (the router's, in float32), bias f32[E] (V3's e_score_correction_bias) or None; fill: the
    choice of an expert outside the kept groups (0 for V2's gate, -inf for V3's)."""
    _check(logits, bias, top_k, scoring, n_group, topk_group, group_score)
    return _impl(
        logits,
        bias,
        top_k=top_k,
        scoring=scoring,
        n_group=n_group,
        topk_group=topk_group,
        group_score=group_score,
        fill=float(fill),
        renormalize=bool(renormalize),
        scale=float(scale),
        interpret=bool(interpret),
    )
