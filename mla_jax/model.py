"""The DeepSeek V2 / V2-Lite / V3 model over a plain param pytree.

Params (names after the HF checkpoint, weights in HF [out, in] layout):

    {"model": {"embed_tokens": {"weight": [vocab, D]},
               "dense_layers": <layer pytree stacked on a leading axis: the first first_k_dense_replace layers>,
               "moe_layers":   <layer pytree stacked: the MoE layers>,
               "norm": {"weight": [D]}},
     "lm_head": {"weight": [vocab, D]}}          # absent when tie_word_embeddings

A layer is {"input_layernorm", "self_attn", "post_attention_layernorm", "mlp"}; `self_attn` holds q_a_proj,
q_a_layernorm, q_b_proj (or q_proj), kv_a_proj_with_mqa, kv_a_layernorm, o_proj and, in place of kv_b_proj,
W_UK_T [N, P, L] and W_UV [N, L, V] (split once by `prepare_params`). A MoE `mlp` holds gate {weight,
e_score_correction_bias}, experts {gate_proj, up_proj, down_proj} stacked to [E, out, in], shared_experts.
Layers of each kind are stacked so the forward is a `lax.scan` (compile time independent of depth).

Sparse models (DeepSeek-V3.2, GLM-MoE-DSA) add `self_attn["indexer"]` = {wq_b [H_I*D_I, Q_lora], wk [D_I, D],
k_norm {weight, bias} [D_I], weights_proj [H_I, D] (float32, as HF keeps it)}. Layers that reuse an earlier
layer's top-k ("shared") have no indexer in the checkpoint; they hold zeros of the same shapes so that the
layers still stack, and never read them.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mla_jax.comm import LOCAL, Comm
from mla_jax.config import ConfigError, DeepseekConfig
from mla_jax.indexer import causal_topk
from mla_jax.layers import (
    ExpertCopies,
    LayerRow,
    add_rms_norm,
    combined,
    linear,
    mlp,
    moe,
    moe_copies,
    rms_norm,
    router_fusable,
)
from mla_jax.mla import mla_forward_full, split_kv_b_proj

Params = dict[str, Any]


def check_supported(cfg: DeepseekConfig) -> None:
    if cfg.n_routed_experts is not None and cfg.moe_layer_freq != 1:
        raise ConfigError(
            f"config.json: moe_layer_freq={cfg.moe_layer_freq} is not supported (DeepSeek "
            "V2/V3 use 1: dense layers first, then MoE layers)"
        )


def layer_groups(cfg: DeepseekConfig) -> list[tuple[str, int, int]]:
    """[(group name, first layer index, number of layers)] in execution order."""
    check_supported(cfg)
    k = cfg.num_dense_layers
    groups = [("dense_layers", 0, k), ("moe_layers", k, cfg.num_hidden_layers - k)]
    return [g for g in groups if g[2] > 0]


MTP_GROUP = "mtp_layers"


def param_groups(cfg: DeepseekConfig) -> list[tuple[str, int, int]]:
    """Every stacked group of the params: `layer_groups`, then the MTP layers (`mla_jax.mtp`; HF layers
    num_hidden_layers.., each a decoder layer plus enorm, hnorm, eh_proj, shared_head), which the checkpoint code
    stores, loads and exports like the others; the decoder stack (`decoder_layers`) never runs them."""
    n = cfg.num_mtp_layers
    return layer_groups(cfg) + ([(MTP_GROUP, cfg.num_hidden_layers, n)] if n else [])


@functools.partial(jax.jit, static_argnames=("cfg", "dtype", "std"))
def init_params(cfg: DeepseekConfig, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> Params:
    """Random params in the HF layout (kv_b_proj included), for tests and benchmarks. Norm weights are
    1 + noise so that a missing norm cannot go unnoticed."""
    check_supported(cfg)
    D, N, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    P, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    keys = iter(jax.random.split(key, 4096))

    def w(*shape, s=std):
        return (s * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def norm(n):
        return {"weight": (1.0 + 0.1 * jax.random.normal(next(keys), (n,), jnp.float32)).astype(dtype)}

    def attn():
        a = {
            "kv_a_proj_with_mqa": {"weight": w(L + R, D)},
            "kv_a_layernorm": norm(L),
            "kv_b_proj": {"weight": w(N * (P + V), L)},
            "o_proj": {"weight": w(D, N * V)},
        }
        if cfg.q_lora_rank is None:
            a["q_proj"] = {"weight": w(N * (P + R), D)}
        else:
            a |= {
                "q_a_proj": {"weight": w(cfg.q_lora_rank, D)},
                "q_a_layernorm": norm(cfg.q_lora_rank),
                "q_b_proj": {"weight": w(N * (P + R), cfg.q_lora_rank)},
            }
        return a

    def indexer(full):
        H, Di = cfg.index_n_heads, cfg.index_head_dim
        ind = {
            "wq_b": {"weight": w(H * Di, cfg.q_lora_rank)},
            "wk": {"weight": w(Di, D)},
            "k_norm": {"weight": norm(Di)["weight"], "bias": w(Di, s=0.1)},
            "weights_proj": {"weight": w(H, D, s=1.0 / D**0.5).astype(jnp.float32)},
        }
        return ind if full else jax.tree.map(jnp.zeros_like, ind)

    def dense_mlp(inter):
        return {
            "gate_proj": {"weight": w(inter, D)},
            "up_proj": {"weight": w(inter, D)},
            "down_proj": {"weight": w(D, inter)},
        }

    def layer(i, is_moe):
        if is_moe:
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            m = {
                "gate": {
                    "weight": w(E, D, s=1.0 / D**0.5).astype(jnp.float32),
                    "e_score_correction_bias": w(E, s=0.05).astype(jnp.float32),
                },
                "experts": {
                    "gate_proj": {"weight": w(E, I, D)},
                    "up_proj": {"weight": w(E, I, D)},
                    "down_proj": {"weight": w(E, D, I)},
                },
            }
            if cfg.n_shared_experts:
                m["shared_experts"] = dense_mlp(I * cfg.n_shared_experts)
        else:
            m = dense_mlp(cfg.intermediate_size)
        out = {"input_layernorm": norm(D), "self_attn": attn(), "post_attention_layernorm": norm(D), "mlp": m}
        if cfg.use_sparse:  # drawn last: dense models keep their random params
            out["self_attn"]["indexer"] = indexer(cfg.is_indexer_layer(i))
        return out

    model: Params = {"embed_tokens": {"weight": w(cfg.vocab_size, D, s=1.0)}, "norm": norm(D)}
    for name, start, n in layer_groups(cfg):
        model[name] = stack_layers([layer(i, name == "moe_layers") for i in range(start, start + n)])
    params: Params = {"model": model}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = {"weight": w(cfg.vocab_size, D)}
    if cfg.num_mtp_layers:  # drawn last: models without MTP keep their random params
        mtp = []
        for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_mtp_layers):
            extra = {"enorm": norm(D), "hnorm": norm(D), "eh_proj": {"weight": w(D, 2 * D)}}
            extra["shared_head"] = {"norm": norm(D), "head": {"weight": w(cfg.vocab_size, D)}}
            mtp.append(layer(i, cfg.is_moe_layer(i)) | extra)
        model[MTP_GROUP] = stack_layers(mtp)
    return prepare_params(params, cfg)


def layer_params(params: Params, cfg: DeepseekConfig, i: int) -> Params:
    """Layer i's params (one slice of its stacked group), e.g. to look at one layer in a notebook."""
    for name, start, n in layer_groups(cfg):
        if start <= i < start + n:
            return jax.tree.map(lambda a: a[i - start], params["model"][name])
    raise IndexError(f"layer {i} out of range [0, {cfg.num_hidden_layers})")


def stack_layers(layers: list[Params]) -> Params:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)


def prepare_params(params: Params, cfg: DeepseekConfig) -> Params:
    """Split every layer's kv_b_proj into W_UK_T and W_UV (done once, after loading). Idempotent."""
    model = dict(params["model"])
    for name, _, _ in param_groups(cfg):
        if name not in model:  # an MTP group the checkpoint lacks
            continue
        group = dict(model[name])
        attn = dict(group["self_attn"])
        if "kv_b_proj" in attn:
            uk, uv = jax.vmap(lambda wt: split_kv_b_proj(wt, cfg))(attn.pop("kv_b_proj")["weight"])
            attn["W_UK_T"], attn["W_UV"] = uk, uv
        group["self_attn"] = attn
        model[name] = group
    return {**params, "model": model}


def lm_head_weight(params: Params) -> jnp.ndarray:
    return params["lm_head"]["weight"] if "lm_head" in params else params["model"]["embed_tokens"]["weight"]


def split_experts(group: Params, is_moe: bool, gmm_impl: str) -> tuple[Params, Params | None]:
    """A layer group's stacked params -> (the part to scan over, {"experts": the routed experts kept whole,
    "shared_experts": the shared experts kept whole, when there are such} or None).

    With gmm_impl="pallas" a MoE group's experts {gate_proj, up_proj, down_proj: {"weight": [layers, E, out,
    in]}} stay out of the scan's xs: scan slices each layer out of its xs, and a slice that feeds a custom call
    (the Pallas kernel) is materialized, a copy of all of that layer's expert weights every step although only
    the experts tokens hit are read. The scan body instead closes over the stacked arrays (scan-invariant, no
    copy) and the kernel reads layer i of them in place (`layers.moe(..., stacked=, layer=i)`). The same holds
    for the shared experts, which the routed experts' kernels run as more groups (`layers.shared_fusable`), or
    else `layers.moe` reads as `LayerRow`s (in place where a kernel reads them)."""
    if not (is_moe and gmm_impl == "pallas"):
        return group, None
    mlp_p = dict(group["mlp"])
    stacked = {"experts": mlp_p.pop("experts")}
    if "shared_experts" in mlp_p:
        stacked["shared_experts"] = mlp_p.pop("shared_experts")
    return {**group, "mlp": mlp_p}, stacked


# What a layer's kernels read in place from the stacked weights (`layers.LayerRow`), for the same reason as the
# experts: the norms (the norm kernel), the absorbed attention's per-head weights (`pallas_kernels.head_matmul`),
# the dense linears of the attention and the router's weight (`layers.linears`: `pallas_kernels.linear`) and, found
# by `split_in_place`, the fp8 linears (the fp8 GEMM, which takes the whole {weight, weight_scale_inv} node).
LAYER_NORMS = (
    ("input_layernorm",),
    ("post_attention_layernorm",),
    ("self_attn", "kv_a_layernorm"),
    ("self_attn", "q_a_layernorm"),
)
LAYER_ARRAYS = (("self_attn", "W_UK_T"), ("self_attn", "W_UV"))
# Read only through `layers.linear` / `layers.linears` (`mla.mla_project_q_kv`, `mla.o_proj`, `model.q_latent`,
# `layers.route`), which take a LayerRow; an fp8 one of these is moved whole with its scales instead.
LAYER_LINEARS = (
    ("self_attn", "q_proj", "weight"),
    ("self_attn", "q_a_proj", "weight"),
    ("self_attn", "q_b_proj", "weight"),
    ("self_attn", "kv_a_proj_with_mqa", "weight"),
    ("self_attn", "o_proj", "weight"),
    ("mlp", "gate", "weight"),
)


def _fp8_linear_paths(tree: Params, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Paths of the stacked fp8 linears {"weight": e4m3 [Lyr, N, K], "weight_scale_inv"} in a group (routed experts,
    [Lyr, E, N, K], are not among them: `split_experts`)."""
    paths = []
    for key, node in tree.items():
        if not isinstance(node, dict):
            continue
        if "weight_scale_inv" in node and node["weight"].ndim == 3:
            paths.append((*prefix, key))
        else:
            paths += _fp8_linear_paths(node, (*prefix, key))
    return paths


def split_in_place(group: Params) -> tuple[Params, dict]:
    """A layer group's stacked params -> (the rest, {path: {name: stacked [Lyr, ...]} or stacked [Lyr, ...]}) for its
    norms (LAYER_NORMS), per-head attention weights (LAYER_ARRAYS), dense linears (LAYER_LINEARS) and fp8 linears;
    `with_layer_rows` puts them back into one layer's params as `LayerRow`s. Only the forward's layer loop does this
    (the checkpoint code, sharding and memory accounting see the params as stored)."""
    fp8_paths = _fp8_linear_paths(group)
    dense = [path for path in LAYER_LINEARS if path[:-1] not in fp8_paths]
    paths = [path for path in LAYER_NORMS + LAYER_ARRAYS + tuple(dense) if _at(group, path) is not None] + fp8_paths
    rows, rest = {path: _at(group, path) for path in paths}, group
    for path in paths:
        rest = _replace_path(rest, path, None)
    return rest, rows


def with_layer_rows(p: Params, rows: dict, index: jax.Array) -> Params:
    """One layer's params with the `split_in_place` weights as `LayerRow`s of row `index`."""
    for path, node in rows.items():
        row = LayerRow(node, index) if not isinstance(node, dict) else {k: LayerRow(v, index) for k, v in node.items()}
        p = _replace_path(p, path, row)
    return p


def _at(tree: Params, path: tuple[str, ...]):
    """tree[path] of nested dicts, None where the path is missing."""
    for key in path:
        tree = tree.get(key) if isinstance(tree, dict) else None
    return tree


def _replace_path(tree: Params, path: tuple[str, ...], value) -> Params:
    """A copy of nested dicts `tree` with tree[path] set to value (removed when value is None)."""
    head, *rest = path
    out = dict(tree)
    if rest:
        out[head] = _replace_path(tree[head], tuple(rest), value)
    elif value is None:
        del out[head]
    else:
        out[head] = value
    return out


# The attention of one layer inside the layer loop: (the layer's self_attn params, the normed hidden state
# [T, D], the loop state (e.g. the paged cache), the layer index i32[]) -> ([T, D] output, new loop state).
AttentionFn = Callable[[Params, jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


def decoder_layers(
    params: Params,
    cfg: DeepseekConfig,
    x: jax.Array,
    attention: AttentionFn,
    state: Any,
    *,
    gmm_impl: str = "ragged_dot",
    comm: Comm = LOCAL,
) -> tuple[jax.Array, Any]:
    """The decoder stack over x [T, D] -> (hidden state after the last layer [T, D], final loop state).

    The one layer loop of the model: the full forward (`forward`), the paged step and the multi-device step
    (`mla_jax.step`) differ only in `attention` and `comm` (identity on one device; on a mesh the all-reduces
    after attention and after a split MLP/MoE). Each group of layers (dense, then MoE) is one `lax.scan`, so
    compile time does not grow with depth; `state` rides in the scan carry (the cache is updated in place). A MoE
    group whose experts' copies stay in token order (a decode step's: `layers.moe_copies`) carries its output
    uncombined (`ExpertCopies`), combined by the next layer's input norm kernel."""
    model = params["model"]
    eps = cfg.rms_norm_eps
    f = jnp.zeros_like(x)  # the pending MLP/MoE output (none before the first layer)
    for name, start, count in layer_groups(cfg):
        is_moe = name == "moe_layers"
        scanned, stacked = split_experts(model[name], is_moe, gmm_impl)
        scanned, rows = split_in_place(scanned)
        copies = None  # the shared chunks of this group's ExpertCopies, None: its MLP/MoE outputs are combined
        if is_moe:  # decided on one layer's shapes, as the body sees them
            view = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), scanned)
            view = with_layer_rows(view, rows, jnp.int32(0))
            copies = moe_copies(view["mlp"], cfg, x.shape[0], gmm_impl=gmm_impl, stacked=stacked, comm=comm)
        f = combined(f) if copies is None else ExpertCopies.of(combined(f), cfg.num_experts_per_tok, copies)

        def body(carry, p, is_moe=is_moe, start=start, stacked=stacked, rows=rows):
            # h: the residual stream without the previous layer's MLP/MoE output f, which is added here, in one
            # kernel with the norm (add_rms_norm); layer: the model's layer index (the cache's)
            h, f, state, layer = carry
            p = with_layer_rows(p, rows, layer - start)
            with jax.named_scope("norm"):
                hn, h = add_rms_norm(p["input_layernorm"], h, f, eps)
            a, state = attention(p["self_attn"], hn, state, layer)
            a = comm.reduce_heads(a).astype(h.dtype)
            norm = p["post_attention_layernorm"]
            # the MoE router's logits in the norm kernel where it takes them (one GEMV kernel less a layer)
            gate = p["mlp"]["gate"] if is_moe and router_fusable(norm, p["mlp"]["gate"], h, comm) else None
            with jax.named_scope("norm"):
                hn, h, *logits = add_rms_norm(norm, h, a, eps, router=gate)
            if is_moe:
                kw = dict(gmm_impl=gmm_impl, stacked=stacked, layer=layer - start, comm=comm, combine=copies is None)
                f = moe(p["mlp"], cfg, hn, logits=logits[0] if logits else None, **kw)
            else:
                with jax.named_scope("mlp"):
                    f = mlp(p["mlp"], hn, intermediate_size=cfg.intermediate_size, comm=comm)
            return (h, f if copies is not None else f.astype(h.dtype), state, layer + 1), None

        # length: every weight of a layer may be read in place (an fp8 model's), leaving no xs to scan over
        (x, f, state, _), _ = jax.lax.scan(body, (x, f, state, jnp.int32(start)), scanned, length=count)
    return x + combined(f), state


def embed(params: Params, cfg: DeepseekConfig, input_ids: jax.Array, comm: Comm = LOCAL) -> jax.Array:
    """input_ids i32[T] -> [T, D]."""
    return comm.embed(params["model"]["embed_tokens"]["weight"], input_ids, cfg.vocab_size)


def lm_logits(params: Params, cfg: DeepseekConfig, x: jax.Array) -> jax.Array:
    """Final norm and lm_head: x [T, D] -> logits f32[T, vocab] (this device's vocab rows on a mesh)."""
    with jax.named_scope("lm_head"):
        x = rms_norm(params["model"]["norm"], x, cfg.rms_norm_eps)
        return linear({"weight": lm_head_weight(params)}, x).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "scale", "gmm_impl"))
def forward(
    params: Params,
    cfg: DeepseekConfig,
    input_ids: jnp.ndarray,
    *,
    attention: str = "naive",
    scale: float | None = None,
    gmm_impl: str = "ragged_dot",
) -> jnp.ndarray:
    """Full-sequence causal forward without a cache: input_ids i32[B, S] -> logits f32[B, S, vocab].

    Each row is one sequence at positions 0..S-1. `attention` picks the MLA algorithm ("naive" MHA or
    "absorbed" MQA); `gmm_impl` the MoE expert matmul (`mla_jax.layers.expert_gmm`); the paged, batched path
    is `mla_jax.step`.
    """
    B, S = input_ids.shape
    x = forward_hidden(params, cfg, input_ids, attention=attention, scale=scale, gmm_impl=gmm_impl)
    return lm_logits(params, cfg, x.reshape(B * S, -1)).reshape(B, S, -1)


def full_attention(cfg: DeepseekConfig, B: int, S: int, algorithm: str = "naive", scale: float | None = None):
    """The cache-free causal attention of `forward` (rows of [B*S] tokens, each sequence at 0..S-1), as an
    `AttentionFn` (the MTP module's full forward runs it too)."""
    positions = jnp.arange(S, dtype=jnp.int32)

    def attn(p, h, state, layer):
        out = jax.vmap(lambda hs: mla_forward_full(p, cfg, hs, positions, algorithm=algorithm, scale=scale))(
            h.reshape(B, S, -1)
        )  # [B, S, D]
        return out.reshape(B * S, -1), state

    return attn


def forward_hidden(
    params: Params,
    cfg: DeepseekConfig,
    input_ids: jnp.ndarray,
    *,
    attention: str = "naive",
    scale: float | None = None,
    gmm_impl: str = "ragged_dot",
) -> jnp.ndarray:
    """`forward` up to the last layer: input_ids i32[B, S] -> hidden state [B, S, D] before the final norm
    (what the MTP module reads)."""
    B, S = input_ids.shape
    positions = jnp.arange(S, dtype=jnp.int32)

    def sparse_attn(p, h, topk, layer):
        """Sparse attention: the indexer's causal top-k (or, on a "shared" layer, the carried one) masks MLA."""
        hb = h.reshape(B, S, -1)  # [B, S, D]

        def own_topk():
            q_resid = jax.vmap(lambda hs: q_latent(p, cfg, hs))(hb)  # [B, S, Q_lora]
            return jax.vmap(lambda hs, qr: causal_topk(p["indexer"], cfg, hs, qr, positions))(hb, q_resid)

        if cfg.shares_topk:
            topk = jax.lax.cond(indexer_layer_table(cfg)[layer], own_topk, lambda: topk)
        else:
            topk = own_topk()  # [B, S, min(K, S)]
        out = jax.vmap(
            lambda hs, ti: mla_forward_full(p, cfg, hs, positions, algorithm=attention, scale=scale, topk_indices=ti)
        )(hb, topk)  # [B, S, D]
        return out.reshape(B * S, -1), topk

    x = embed(params, cfg, input_ids.reshape(-1))
    if cfg.use_sparse:
        topk0 = jnp.zeros((B, S, min(cfg.index_topk, S)), jnp.int32)
        x, _ = decoder_layers(params, cfg, x, sparse_attn, topk0, gmm_impl=gmm_impl)
    else:
        x, _ = decoder_layers(params, cfg, x, full_attention(cfg, B, S, attention, scale), None, gmm_impl=gmm_impl)
    return x.reshape(B, S, -1)


def q_latent(p: Params, cfg: DeepseekConfig, x: jax.Array) -> jax.Array:
    """MLA's q latent q_a_layernorm(q_a_proj(x)) [T, Q_lora], which the indexer reads."""
    return rms_norm(p["q_a_layernorm"], linear(p["q_a_proj"], x), cfg.rms_norm_eps)


def indexer_layer_table(cfg: DeepseekConfig) -> jax.Array:
    """bool[num_layers]: which layers run their own indexer (indexed by the layer loop's traced layer)."""
    return jnp.asarray([cfg.is_indexer_layer(i) for i in range(cfg.num_hidden_layers)])
