"""The MLA layer: projections, decoupled RoPE, weight absorption and the two attention algorithms.

At the attention boundary the layer hands over what vLLM's does: q [T, N, P+R], kv_c_normed [T, L],
k_pe [T, 1, R]. Then either

- compute-friendly (prefill, "naive"): up-project the latents into k_nope [S, N, P] and v [S, N, V] and run MHA
  with K width P+R = 192 and V width 128 (k_pe broadcast to all heads, V not padded), or
- data-movement (decode, "absorbed"): q_nope [T, N, P] @ W_UK_T [N, P, L] -> [T, N, L]; MQA over the 576-wide
  latent rows with the latent itself as V; the [T, N, L] output @ W_UV [N, L, V].

`kv_b_proj` [N*(P+V), L] is split once after loading into W_UK_T [N, P, L] and W_UV [N, L, V]
(`split_kv_b_proj`); both algorithms then use these two tensors, so kv_b_proj is not kept twice.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import reference
from mla_jax.cache import KVCache, write_kv_layer
from mla_jax.config import DeepseekConfig
from mla_jax.indexer import topk_mask
from mla_jax.layers import act_dtype, in_place, layer_row, linears, rms_norm
from mla_jax.rope import apply_rope, rope_cos_sin
from pallas_kernels import cache_write
from pallas_kernels import head_matmul as head_matmul_kernel
from pallas_kernels.launch import run as run_launches
from pallas_kernels.util import FLOAT_DTYPES


def split_kv_b_proj(kv_b_weight: jnp.ndarray, cfg: DeepseekConfig) -> tuple[jnp.ndarray, jnp.ndarray]:
    """kv_b_proj.weight [N*(P+V), L] (per head [k_nope | v] rows) -> W_UK_T [N, P, L], W_UV [N, L, V]."""
    N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if kv_b_weight.shape != (N * (P + V), L):
        raise ValueError(f"kv_b_proj.weight has shape {kv_b_weight.shape}, expected {(N * (P + V), L)}")
    w = kv_b_weight.reshape(N, P + V, L)
    return w[:, :P, :], jnp.swapaxes(w[:, P:, :], 1, 2)


def mla_project(
    p: dict, cfg: DeepseekConfig, x: jnp.ndarray, positions: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
    """x [T, D], positions i32[T] -> q [T, N, P+R] (rope applied to q_pe), kv_c_normed [T, L], k_pe [T, 1, R]."""
    return mla_project_with_q_latent(p, cfg, x, positions)[:3]


def mla_project_q_kv(
    p: dict,
    cfg: DeepseekConfig,
    x: jnp.ndarray,
    positions: jnp.ndarray,
    *,
    rope: tuple[jnp.ndarray, jnp.ndarray] | None = None,
    rope_q: bool = True,
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray | None]:
    """The projections before the latent's norm and rope: q [T, N, P+R] (rope applied to q_pe; with
    rope_q=False not yet: `rope_q_pe`, or `absorb_q(..., rope=)` in its kernel), the raw kv_a_proj_with_mqa output
    kv [T, L+R], the rope's cos, sin f32[T, R/2] (`rope`: computed once for every layer by the caller) and the
    q latent [T, Q_lora] (None without q-LoRA). The paged step hands kv to `write_latent_rows`
    (norm, rope and cache write in one kernel on a GPU). The linears of x (q_proj or q_a_proj, and
    kv_a_proj_with_mqa) are one `linears` call: one kernel on a GPU for few tokens."""
    T = x.shape[0]
    N = cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q_resid = None
        q, kv = linears((p["q_proj"], p["kv_a_proj_with_mqa"]), x)  # [T, N*(P+R)], [T, L+R]
    else:
        q_a, kv = linears((p["q_a_proj"], p["kv_a_proj_with_mqa"]), x)  # [T, Q_lora], [T, L+R]
        q_resid = rms_norm(p["q_a_layernorm"], q_a, cfg.rms_norm_eps)  # [T, Q_lora]
        (q,) = linears((p["q_b_proj"],), q_resid)
    q = q.reshape(T, N, cfg.qk_head_dim)  # [T, N, P+R]
    cos, sin = rope_cos_sin(cfg, positions) if rope is None else rope
    if rope_q:
        q = rope_q_pe(cfg, q, cos, sin)
    return q, kv, cos, sin, q_resid


def rope_q_pe(cfg: DeepseekConfig, q: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """q [T, N, P+R] with its q_pe rotated (cos, sin f32[T, R/2])."""
    P = cfg.qk_nope_head_dim
    return jnp.concatenate([q[..., :P], apply_rope(q[..., P:], cos, sin)], axis=-1)


def mla_project_with_q_latent(
    p: dict, cfg: DeepseekConfig, x: jnp.ndarray, positions: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray, jnp.ndarray | None]:
    """`mla_project` plus the q latent q_a_layernorm(q_a_proj(x)) [T, Q_lora] (None without q-LoRA), which the
    sparse-attention indexer reads."""
    q, kv, cos, sin, q_resid = mla_project_q_kv(p, cfg, x, positions)
    kv_c_normed, k_pe = latent_rows(p["kv_a_layernorm"], kv, cos, sin, cfg.rms_norm_eps)
    return q, kv_c_normed, k_pe, q_resid


def latent_rows(norm: dict, kv: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray, eps: float):
    """The raw kv_a_proj_with_mqa output kv [T, L+R] -> (kv_c_normed [T, L], k_pe [T, 1, R]): the norm on the latent
    only (`norm`: kv_a_layernorm's params, L its width), the rope (cos, sin f32[T, R/2]) on k_pe, one head shared by
    all query heads."""
    L = norm["weight"].shape[-1]
    return rms_norm(norm, kv[:, :L], eps), apply_rope(kv[:, None, L:], cos, sin)


def write_latent_rows(
    cache: KVCache,
    layer: int | jax.Array,
    kv: jax.Array,
    norm: dict,
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    eps: float,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """`latent_rows` written into layer ``layer`` of the cache at ``slot_mapping`` (like `write_kv_layer`):
    (kv_c_normed [T, L], k_pe [T, 1, R], the cache). ``norm``: kv_a_layernorm's params, the weight [L] or a
    `LayerRow` of the stacked [Lyr, L] (read in place).

    On a GPU one Pallas kernel (`pallas_kernels.cache_write`: norm, rope and the cache write, an fp8 cache's
    quantization and scale too, the cache aliased in place; XLA would run four to six kernels); other backends and
    shapes the kernel does not take run `latent_rows` + `write_kv_layer`, with the same results (``interpret=True``
    runs the kernel in the Pallas interpreter, for tests).
    """
    w, wi = in_place(norm["weight"])
    L = w.shape[-1]
    _check_latent_rows(cache, layer, kv)
    use_kernel = interpret or jax.default_backend() == "gpu"
    if use_kernel and cache_write.supported(L, cache.width - L):
        rows, kv_cache, *scale = cache_write.write_latent_rows(
            kv,
            w,
            cos,
            sin,
            slot_mapping,
            cache.kv_c_and_k_pe_cache,
            layer,
            eps=eps,
            weight_index=wi,
            kv_scale=cache.kv_scale,
            interpret=interpret,
        )  # [T, L+R]
        return _kernel_rows(cache, kv, L, rows, kv_cache, scale)
    kv_c_normed, k_pe = latent_rows(norm, kv, cos, sin, eps)
    return kv_c_normed, k_pe, write_kv_layer(cache, layer, kv_c_normed, k_pe, slot_mapping)


def _check_latent_rows(cache: KVCache, layer: int | jax.Array, kv: jax.Array) -> None:
    """kv [T, L+R] rows of the cache's width, and a static layer inside the cache."""
    if kv.ndim != 2 or kv.shape[1] != cache.width:
        raise ValueError(f"kv must be [T, L+R] = [T, {cache.width}] (the cache's row width), got shape {kv.shape}")
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < cache.num_layers:
        raise ValueError(f"layer {layer} out of range for a cache with {cache.num_layers} layers")


def _kernel_rows(cache: KVCache, kv: jax.Array, L: int, rows, kv_cache, scale) -> tuple[jax.Array, jax.Array, KVCache]:
    """The cache write kernel's outputs (rows [T, L+R], the cache, the fp8 scales or nothing) as `write_latent_rows`
    returns them."""
    k_pe = rows[:, None, L:].astype(kv.dtype)  # [T, 1, R] (exact: promoted from kv's dtype)
    kv_scale = scale[0] if scale else cache.kv_scale  # (rows, cache, kv_scale) for an fp8 cache
    return rows[:, :L], k_pe, dataclasses.replace(cache, kv_c_and_k_pe_cache=kv_cache, kv_scale=kv_scale)


# A decode-only step's absorb_q and cache write as one launch on a GPU (`absorb_q_and_write_latent_rows`): both read
# the q + kv projection's output and neither the other's, and each is latency bound at decode sizes (~2-3 us of
# device time for a few KB at batch 1), where XLA's command buffer runs them one after the other. Off until measured
# on a GPU (scripts/gpu_session.sh part 87: the kernels' GPU tests with it on, the batch-1 / 32 steps on and off).
ABSORB_WITH_CACHE_WRITE = False


def absorb_q_and_write_latent_rows(
    p: dict,
    cfg: DeepseekConfig,
    q: jax.Array,
    cache: KVCache,
    layer: int | jax.Array,
    kv: jax.Array,
    norm: dict,
    rope: tuple[jax.Array, jax.Array],
    slot_mapping: jax.Array,
    eps: float,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, KVCache]:
    """(absorbed q [T, N, L+R], kv_c_normed [T, L], k_pe [T, 1, R], the cache): `absorb_q(p, cfg, q, rope)` and
    `write_latent_rows(cache, layer, kv, norm, *rope, slot_mapping, eps)` for a step whose T tokens are all decode
    tokens (q unrotated, rope = (cos, sin) f32[T, R/2]). Where both kernels take the shapes, on a GPU with
    ABSORB_WITH_CACHE_WRITE (or ``interpret=True``, for tests), their programs run in one launch
    (`pallas_kernels.launch`: the cache write's first, so that its few programs start at once), with the two calls'
    results bit for bit; else the two calls."""
    P = cfg.qk_nope_head_dim
    w, w_layer = in_place(p["W_UK_T"])  # [(Lyr,) N, P, L]
    nw, n_layer = in_place(norm["weight"])
    L, width = nw.shape[-1], cache.width
    fused = (
        (interpret or ABSORB_WITH_CACHE_WRITE)
        and _head_matmul_ok(q, w, interpret)
        and q.shape[-1] > w.shape[-2] == P  # absorb_q's kernel call
        and kv.shape[:1] == q.shape[:1]
        and cache_write.supported(L, width - L)
    )
    if not fused:
        with jax.named_scope("cache_write"):
            kv_c_normed, k_pe, cache = write_latent_rows(cache, layer, kv, norm, *rope, slot_mapping, eps)
        with jax.named_scope("absorb_q"):
            return absorb_q(p, cfg, q, rope=rope), kv_c_normed, k_pe, cache
    _check_latent_rows(cache, layer, kv)
    absorb, absorbed = head_matmul_kernel.head_matmul_launch(
        q, w, tail_in_x=True, tail_rope=rope, rhs_index=w_layer, interpret=interpret
    )
    write = cache_write.write_latent_rows_launch(
        kv,
        nw,
        *rope,
        slot_mapping,
        cache.kv_c_and_k_pe_cache,
        layer,
        eps=eps,
        weight_index=n_layer,
        kv_scale=cache.kv_scale,
        num_warps=absorb.num_warps,
    )
    with jax.named_scope("absorb_q"):  # (the trace's part of the launch)
        (rows, kv_cache, *scale), (q_mqa,) = run_launches([write, absorb], interpret=interpret)
    return absorbed(q_mqa), *_kernel_rows(cache, kv, L, rows, kv_cache, scale)


def absorb_q(
    p: dict, cfg: DeepseekConfig, q: jnp.ndarray, rope: tuple[jnp.ndarray, jnp.ndarray] | None = None
) -> jnp.ndarray:
    """q [T, N, P+R] -> absorbed q [T, N, L+R]: q_nope through W_UK_T (one batched matmul), then q_pe (rotated
    first by `rope` = (cos, sin) f32[T, R/2] when q comes unrotated: `mla_project_q_kv(..., rope_q=False)`).

    On a GPU for up to HEAD_MATMUL_MAX_T tokens, one kernel (`head_matmul`) reads q in place, multiplies q_nope and
    writes q_pe (rotated) behind it (XLA: a 5.7 us concatenate fusion at T=1 on the H200 and, for the rope, one
    more; issue #22); elsewhere jnp."""
    P = cfg.qk_nope_head_dim
    w, layer = in_place(p["W_UK_T"])  # [(Lyr,) N, P, L]
    if _head_matmul_ok(q, w) and q.shape[-1] > w.shape[-2] == P:  # q = [q_nope | q_pe], q_pe the kernel's tail
        return head_matmul_kernel.head_matmul(q, w, tail_in_x=True, tail_rope=rope, rhs_index=layer)
    if rope is not None:
        q = rope_q_pe(cfg, q, *rope)
    if layer is not None:
        w = layer_row(p["W_UK_T"])
    ql_nope = jnp.einsum("tnp,npl->tnl", q[..., :P], w)  # [T, N, L]
    return jnp.concatenate([ql_nope, q[..., P:].astype(ql_nope.dtype)], axis=-1)


def up_project_kv(
    p: dict, cfg: DeepseekConfig, kv_c_normed: jnp.ndarray, k_pe: jnp.ndarray
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """kv_c_normed [S, L], k_pe [S, 1, R] -> k [S, N, P+R] (k_pe broadcast to all heads), v [S, N, V]."""
    k_nope = jnp.einsum("sl,npl->snp", kv_c_normed, layer_row(p["W_UK_T"]))  # [S, N, P]
    v = jnp.einsum("sl,nlv->snv", kv_c_normed, layer_row(p["W_UV"]))  # [S, N, V]
    k_pe = jnp.broadcast_to(k_pe, (k_pe.shape[0], k_nope.shape[1], k_pe.shape[-1])).astype(k_nope.dtype)
    return jnp.concatenate([k_nope, k_pe], axis=-1), v


# At most this many tokens take the per-head matmul kernel (`pallas_kernels.head_matmul`) on a GPU, more take XLA's
# batched matmul: decode batches are weight-bandwidth bound (the kernel's case), prefill chunks compute bound
# (cuBLAS's). 128: see `layers.LINEAR_MAX_T` (session 33: the batch-128 step and the 96-row verify step gain).
HEAD_MATMUL_MAX_T = 128


def _head_matmul_ok(x: jnp.ndarray, w: jnp.ndarray, interpret: bool = False) -> bool:
    """The per-head matmul kernel for x [T, N, K] and w's dtype: on a GPU (or interpreted), 1 <= T <=
    HEAD_MATMUL_MAX_T, one float dtype (the kernel multiplies in x's; XLA's einsum promotes mixed dtypes, so those stay
    there)."""
    return (
        (interpret or jax.default_backend() == "gpu")
        and 1 <= x.shape[0] <= HEAD_MATMUL_MAX_T
        and x.dtype == w.dtype
        and jnp.dtype(x.dtype) in FLOAT_DTYPES
    )


def v_up_proj(p: dict, latent: jnp.ndarray) -> jnp.ndarray:
    """Latent attention output [T, N, L] -> [T, N, V] through W_UV, in W_UV's dtype. On a GPU for up to
    HEAD_MATMUL_MAX_T tokens the per-head matmul kernel (XLA: a multiply and a reduce fusion, 4.6 us at T=1 on the
    H200, issue #22), elsewhere jnp."""
    w, layer = in_place(p["W_UV"])  # [(Lyr,) N, L, V]
    latent = latent.astype(w.dtype)
    if _head_matmul_ok(latent, w):
        return head_matmul_kernel.head_matmul(latent, w, rhs_index=layer)
    if layer is not None:
        w = layer_row(p["W_UV"])
    return jnp.einsum("tnl,nlv->tnv", latent, w)


def o_proj(p: dict, attn: jnp.ndarray) -> jnp.ndarray:
    """attn [T, N, V] -> [T, D] (`linears`: on a GPU for few tokens the linear kernel)."""
    x = attn.reshape(attn.shape[0], -1).astype(act_dtype(p["o_proj"], p["W_UV"].dtype))  # [T, N*V]
    return linears((p["o_proj"],), x)[0]


def mla_forward_full(
    p: dict,
    cfg: DeepseekConfig,
    x: jnp.ndarray,
    positions: jnp.ndarray,
    *,
    algorithm: str = "naive",
    scale: float | None = None,
    topk_indices: jnp.ndarray | None = None,
) -> jnp.ndarray:
    """Whole-sequence causal MLA for one sequence, no cache: x [S, D] -> [S, D].

    `algorithm` "naive" is the compute-friendly MHA path, "absorbed" the data-movement MQA path; both must
    agree. `scale` overrides the softmax scale (tests use it to show 576^-0.5 is wrong). `topk_indices`
    i32[S, K] (sparse attention; -1 = none): query s attends only to the causal positions among its row.
    """
    scale = cfg.softmax_scale if scale is None else scale
    q, kv_c_normed, k_pe = mla_project(p, cfg, x, positions)
    mask = None if topk_indices is None else topk_mask(topk_indices, x.shape[0])  # [S, S]
    if algorithm == "naive":
        k, v = up_project_kv(p, cfg, kv_c_normed, k_pe)
        attn = reference.causal_mha(q, k, v, scale) if mask is None else masked_mha(q, k, v, scale, mask)
    elif algorithm == "absorbed":
        q_mqa = absorb_q(p, cfg, q)  # [S, N, L+R]
        kv_c_and_k_pe = jnp.concatenate([kv_c_normed, k_pe[:, 0, :].astype(kv_c_normed.dtype)], axis=-1)
        if mask is None:
            latent = reference.causal_mqa(q_mqa, kv_c_and_k_pe, scale, cfg.kv_lora_rank)  # [S, N, L]
        else:
            latent = masked_mqa(q_mqa, kv_c_and_k_pe, scale, cfg.kv_lora_rank, mask)
        attn = v_up_proj(p, latent)  # [S, N, V]
    else:
        raise ValueError(f"algorithm must be 'naive' or 'absorbed', got {algorithm!r}")
    return o_proj(p, attn.astype(x.dtype))


def masked_mha(q: jnp.ndarray, k: jnp.ndarray, v: jnp.ndarray, scale: float, mask: jnp.ndarray) -> jnp.ndarray:
    """`reference.causal_mha` with an extra mask bool[S, S] (True = attend) on top of causality (f32)."""
    S = q.shape[0]
    logits = jnp.einsum("snd,tnd->nst", q.astype(jnp.float32), k.astype(jnp.float32)) * scale  # [N, S, S]
    keep = jnp.tril(jnp.ones((S, S), bool)) & mask
    probs = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    return jnp.einsum("nst,tnv->snv", probs, v.astype(jnp.float32))


def masked_mqa(
    q: jnp.ndarray, kv_c_and_k_pe: jnp.ndarray, scale: float, kv_lora_rank: int, mask: jnp.ndarray
) -> jnp.ndarray:
    """`reference.causal_mqa` with an extra mask bool[S, S] (True = attend) on top of causality (f32)."""
    S = q.shape[0]
    kv = kv_c_and_k_pe.astype(jnp.float32)
    logits = jnp.einsum("snd,td->nst", q.astype(jnp.float32), kv) * scale  # [N, S, S]
    keep = jnp.tril(jnp.ones((S, S), bool)) & mask
    probs = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    return jnp.einsum("nst,tl->snl", probs, kv[:, :kv_lora_rank])
