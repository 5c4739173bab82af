"""Building blocks over plain param pytrees named after the HF checkpoint: RMSNorm, dense MLP, MoE.

Weights keep the HF (torch Linear) layout [out, in]; stacked experts are [E, out, in].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mla_jax.config import DeepseekConfig
from pallas_kernels import grouped_matmul as gmm_kernel

GMM_IMPLS = ("ragged_dot", "pallas")


def rms_norm(p: dict, x: jnp.ndarray, eps: float) -> jnp.ndarray:
    """HF DeepseekRMSNorm: normalise in float32, cast back, then scale by the weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return p["weight"] * xf.astype(x.dtype)


def linear(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """x [..., in] @ weight[out, in]^T."""
    return jnp.einsum("...i,oi->...o", x, p["weight"])


def mlp(p: dict, x: jnp.ndarray) -> jnp.ndarray:
    """SwiGLU MLP: down(silu(gate(x)) * up(x)). x [T, D]."""
    return linear(p["down_proj"], jax.nn.silu(linear(p["gate_proj"], x)) * linear(p["up_proj"], x))


def route(p_gate: dict, cfg: DeepseekConfig, x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Router: x [T, D] -> (weights f32[T, K], expert ids i32[T, K]). Scores in float32 as HF/vLLM do."""
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    logits = jnp.einsum("td,ed->te", x.astype(jnp.float32), p_gate["weight"].astype(jnp.float32))  # [T, E]
    T = x.shape[0]
    if cfg.scoring_func == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)

    if cfg.topk_method == "noaux_tc":
        # V3: the correction bias steers selection only; weights come from the unbiased sigmoid.
        choice = scores + p_gate["e_score_correction_bias"].astype(jnp.float32)[None, :]
        grouped = choice.reshape(T, cfg.n_group, E // cfg.n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]: sum of top-2
        choice = _mask_groups(choice, group_scores, cfg, fill=-jnp.inf)
        _, ids = jax.lax.top_k(choice, K)
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * cfg.routed_scaling_factor
    else:
        choice = scores
        if cfg.topk_method == "group_limited_greedy":
            group_scores = jnp.max(scores.reshape(T, cfg.n_group, E // cfg.n_group), axis=-1)
            choice = _mask_groups(scores, group_scores, cfg, fill=0.0)
        weights, ids = jax.lax.top_k(choice, K)
        # DeepSeek-V2's gate: renormalise when asked, otherwise scale (V2 and V2-Lite ship norm_topk_prob=false).
        if cfg.norm_topk_prob and K > 1:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        else:
            weights = weights * cfg.routed_scaling_factor
    return weights, ids.astype(jnp.int32)


def _mask_groups(scores: jnp.ndarray, group_scores: jnp.ndarray, cfg: DeepseekConfig, fill: float) -> jnp.ndarray:
    """Keep the experts of the `topk_group` best groups; the rest get `fill`."""
    T, E = scores.shape
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
    keep = jnp.zeros((T, cfg.n_group), bool).at[jnp.arange(T)[:, None], top_groups].set(True)
    keep = jnp.repeat(keep, E // cfg.n_group, axis=1)  # [T, E]
    return jnp.where(keep, scores, fill)


def expert_gmm(lhs: jnp.ndarray, w: jnp.ndarray, group_sizes: jnp.ndarray, impl: str = "ragged_dot",
               layer: jnp.ndarray | int | None = None) -> jnp.ndarray:
    """Grouped matmul of expert-sorted rows: lhs [M, in] x w [E, out, in] (HF layout) -> [M, out].

    Row block e (group_sizes[e] rows) uses expert e; rows past sum(group_sizes) come out 0. "ragged_dot" is
    `jax.lax.ragged_dot_general` (XLA's GPU lowering may expand it into a dense [E, M, in] problem);
    "pallas" is `pallas_kernels.grouped_matmul`, which computes each row's own expert only (interpret mode on
    a CPU). With `layer`, w is stacked over a scan's layers, [layers, E, out, in], and layer `layer` is used:
    the Pallas kernel reads it in place (no per-layer copy of the experts), ragged_dot slices it out.
    """
    if impl == "pallas":
        return gmm_kernel.grouped_matmul(lhs, w, group_sizes, transpose_rhs=True, rhs_index=layer,
                                         interpret=jax.default_backend() == "cpu")
    if impl != "ragged_dot":
        raise ValueError(f"gmm_impl must be one of {GMM_IMPLS}, got {impl!r}")
    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    # rhs is [E, out, in] (HF layout): contract lhs dim 1 with rhs dim 2.
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(lhs, w, group_sizes, dn)


def moe(p: dict, cfg: DeepseekConfig, x: jnp.ndarray, *, gmm_impl: str = "ragged_dot",
        experts: dict | None = None, layer: jnp.ndarray | int | None = None) -> jnp.ndarray:
    """Routed experts + shared experts. x [T, D] -> [T, D].

    Token copies are sorted by expert and run through grouped matmuls (`expert_gmm` with `gmm_impl`), so
    each expert only computes its own tokens. `experts` and `layer` (see `model.split_experts`): the routed
    experts of every layer of the group stacked [layers, E, out, in], used at `layer`, in place of
    p["experts"].
    """
    T, D = x.shape
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    weights, ids = route(p["gate"], cfg, x)  # [T, K]
    flat = ids.reshape(-1)  # [T*K]
    order = jnp.argsort(flat, stable=True)
    token = order // K  # source token of each sorted copy
    group_sizes = jnp.bincount(flat, length=E).astype(jnp.int32)  # [E]
    xs = x[token]  # [T*K, D]
    ex, layer = (p["experts"], None) if experts is None else (experts, layer)  # layer indexes stacked ones

    def gmm(lhs, w):
        return expert_gmm(lhs, w, group_sizes, gmm_impl, layer)

    h = jax.nn.silu(gmm(xs, ex["gate_proj"]["weight"])) * gmm(xs, ex["up_proj"]["weight"])  # [T*K, I]
    y = gmm(h, ex["down_proj"]["weight"])  # [T*K, D]
    w_sorted = weights.reshape(-1)[order].astype(y.dtype)
    routed = jnp.zeros((T, D), y.dtype).at[token].add(y * w_sorted[:, None])
    out = routed.astype(x.dtype)
    if cfg.n_shared_experts:
        out = out + mlp(p["shared_experts"], x)
    return out
