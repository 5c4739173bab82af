"""Memory plan: what each device holds for a config, a mesh (DP x EP x TP x DCP) and a cache size.

    plan = memory_plan(DeepseekConfig.from_dict(DEEPSEEK_V3), ep=8, weights="fp8")
    print(plan.report())   # weights by kind, cache, workspaces, activations; the cached tokens that fit

Weights are exact: the shapes of the prepared params (kv_b_proj split into W_UK_T / W_UV; `weights="fp8"`: the
`checkpoint.fp8.FP8_LINEARS` as e4m3 + float32 128x128 block scales), each leaf's per-device shard from
`mla_jax.sharding.param_shardings` on an abstract mesh (no devices needed). The latent cache is exact too
(`mla_jax.cache.bytes_per_token`): replicated over TP and EP (MLA's latent is shared by all heads; attention is
replicated over EP), split by tokens over DCP, and under data-parallel attention (DP) each DP group caches its own
requests' tokens, so the mesh holds dp times as many distinct tokens (`mesh_cache_tokens`). Activations and
workspaces are estimates for one step of `max_num_tokens` tokens (the largest live intermediates, see
`_activation_bytes`), and `reserve_fraction` of the device is left for XLA's temporaries, fragmentation and the
CUDA context. `capacity_table`: the cached tokens of one 8-GPU node under TP 8, DCP 8, DP 8 and DP 4 x TP 2.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from mla_jax.cache import DEFAULT_PAGE_SIZE, bytes_per_token
from mla_jax.checkpoint.fp8 import FP8_LINEARS, check_weights
from mla_jax.config import DeepseekConfig
from pallas_kernels.util import cdiv

H200_BYTES = 141 * 10**9  # HBM3e per H200 (the runtime sees ~140 GB; see reserve_fraction)
KINDS = ("attention", "dense_mlp", "shared_experts", "routed_experts", "router", "embed", "lm_head", "norms")


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device (every device of the mesh holds the same amounts)."""

    devices: int
    mesh: dict[str, int]
    weights: dict[str, int]  # by kind (KINDS)
    cache_tokens: int  # tokens the latent cache of one DP group holds (all its requests together, whole pages)
    cache: int
    workspace: int
    activations: int
    reserve: int
    capacity: int

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def device_cache_tokens(self) -> int:
        """Token rows (all layers) one device stores: its DP group's tokens, its 1/dcp share of them."""
        return self.cache_tokens // self.mesh.get("dcp", 1)

    @property
    def mesh_cache_tokens(self) -> int:
        """Distinct tokens cached on the whole mesh: one group's under TP / EP / DCP, dp groups' under DP."""
        return self.cache_tokens * self.mesh.get("dp", 1)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.cache + self.workspace + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def report(self) -> str:
        gb = lambda b: f"{b / 1e9:8.2f} GB"  # noqa: E731
        mesh = " x ".join(f"{k}{v}" for k, v in self.mesh.items())
        lines = [f"per device ({self.devices} devices, {mesh}):"]
        lines += [f"  weights {k:<16}{gb(v)}" for k, v in self.weights.items() if v]
        lines += [
            f"  weights total           {gb(self.weight_bytes)}",
            f"  latent cache            {gb(self.cache)}  ({self.device_cache_tokens} token rows; "
            f"{self.mesh_cache_tokens} distinct tokens on the mesh)",
            f"  workspaces              {gb(self.workspace)}",
            f"  activations             {gb(self.activations)}",
            f"  reserve                 {gb(self.reserve)}",
            f"  total                   {gb(self.total)} of {gb(self.capacity)}: "
            + ("fits" if self.fits else "DOES NOT FIT"),
        ]
        return "\n".join(lines)


def weight_kind(path: tuple[str, ...]) -> str:
    """The KINDS entry of a params leaf, from its path."""
    name = "/".join(path)
    if "embed_tokens" in name:
        return "embed"
    if path[0] == "lm_head":
        return "lm_head"
    if "/mlp/experts/" in name:
        return "routed_experts"
    if "/mlp/shared_experts/" in name:
        return "shared_experts"
    if "/mlp/gate/" in name:
        return "router"
    if "/mlp/" in name:
        return "dense_mlp"
    if "layernorm" in name or name == "model/norm/weight":
        return "norms"
    return "attention"


def abstract_params(cfg: DeepseekConfig, *, weights: str = "fp8", dtype: Any = jnp.bfloat16) -> Any:
    """The prepared params as jax.ShapeDtypeStruct (nothing allocated): `dtype` weights, router float32, and
    with weights="fp8" the FP8_LINEARS as {"weight": e4m3, "weight_scale_inv": f32 [cdiv(out,128), cdiv(in,128)]}."""
    from mla_jax.model import init_params, prepare_params

    check_weights(weights)
    tree = jax.eval_shape(lambda: prepare_params(init_params(cfg, jax.random.key(0), dtype=dtype), cfg))

    def walk(node, name, path):
        if not isinstance(node, dict):
            if "gate" in path[-2:-1] and path[-3:-2] == ("mlp",) or path[-1] == "e_score_correction_bias":
                return jax.ShapeDtypeStruct(node.shape, jnp.float32)  # the router stays float32
            return node
        if weights == "fp8" and name in FP8_LINEARS and "weight" in node:
            w = node["weight"]
            scale = (*w.shape[:-2], cdiv(w.shape[-2], 128), cdiv(w.shape[-1], 128))
            return {
                **node,
                "weight": jax.ShapeDtypeStruct(w.shape, jnp.float8_e4m3fn),
                "weight_scale_inv": jax.ShapeDtypeStruct(scale, jnp.float32),
            }
        return {k: walk(v, k, (*path, k)) for k, v in node.items()}

    return walk(tree, "", ())


def weight_bytes_per_device(tree: Any, cfg: DeepseekConfig, mesh_shape: dict[str, int], *, moe: str = "ep"):
    """{kind: bytes} one device holds of `tree` (arrays or ShapeDtypeStruct) laid out by
    `sharding.param_shardings` on a mesh of `mesh_shape` ({"dp": .., "ep": .., "tp": .., "dcp": ..}, any
    subset)."""
    from mla_jax.sharding import param_shardings

    out = dict.fromkeys(KINDS, 0)
    sizes = {k: v for k, v in mesh_shape.items() if v > 1}
    if not sizes:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            keys = tuple(getattr(k, "key", str(k)) for k in path)
            out[weight_kind(keys)] += math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
        return out
    order = [a for a in ("dp", "ep", "tp", "dcp") if a in sizes]  # make_mesh's device order
    mesh = jax.sharding.AbstractMesh(tuple(sizes[a] for a in order), tuple(order))
    shardings = param_shardings(tree, cfg, mesh, moe=moe)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    for (path, leaf), sh in zip(flat, jax.tree.leaves(shardings)):
        keys = tuple(getattr(k, "key", str(k)) for k in path)
        out[weight_kind(keys)] += math.prod(sh.shard_shape(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
    return out


def _activation_bytes(
    cfg: DeepseekConfig, t: int, heads: int, model: int, ep: int, weights: str, logit_rows: int, dp: int = 1
):
    """(activations, workspaces) of one step of t tokens on one device: estimates of the largest live arrays.

    activations: the residual stream and norms (4 x [T, D] bf16), attention's per-head tensors (q, the
    absorbed q, the latent output, k/v of the prefill MHA: [T, N_loc, 192+576+512+2*(192+128)] bf16), the MoE
    copies of every token (all-gather dispatch: [T*K, D] in, [T*K, 2 I_loc] gate/up, [T*K, D] out, plus the
    fp8 copies of the GEMM inputs; under DP of all dp ranks' T tokens), and float32 logits of `logit_rows` rows
    over the local vocab.
    workspaces: the decode kernels' float32 split partials (16 splits x logit_rows requests x N_loc x L) and
    the dequantized kv_b-free MLA needs no weight workspace; fp8 activation scales are in the MoE term."""
    D, N, L, V = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.vocab_size
    n_loc = max(1, N // heads)
    resid = 4 * t * D * 2
    attn = t * n_loc * (192 + 576 + 512 + 2 * (192 + 128)) * 2
    moe = 0
    if cfg.n_routed_experts:
        k = cfg.num_experts_per_tok
        i_loc = cfg.moe_intermediate_size if ep * dp > 1 else cdiv(cfg.moe_intermediate_size, model)
        moe = dp * t * k * (2 * D * 2 + 2 * i_loc * 2 + (D + i_loc if weights == "fp8" else 0))
    dense = t * cdiv(cfg.intermediate_size, model) * 3 * 2
    logits = logit_rows * cdiv(V, model) * 4
    workspace = 16 * logit_rows * n_loc * L * 4
    return resid + max(attn, moe, dense) + logits, workspace


def memory_plan(
    cfg: DeepseekConfig,
    *,
    ep: int = 1,
    tp: int = 1,
    dcp: int = 1,
    dp: int = 1,
    weights: str = "fp8",
    cache_tokens: int | None = None,
    cache_dtype: Any = "bf16",
    page_size: int = DEFAULT_PAGE_SIZE,
    max_num_tokens: int = 8192,
    max_num_seqs: int = 256,
    device_bytes: int = H200_BYTES,
    reserve_fraction: float = 0.05,
) -> MemoryPlan:
    """Per-device memory of `cfg` on a dp x ep x tp x dcp mesh (`mla_jax.parallel.make_mesh`'s axes, `moe="ep"`
    layout when ep or dp > 1, else experts split by TP). cache_tokens None: the most whole pages that fit after
    weights, activations, workspaces and the reserve. Under DP `cache_tokens`, `max_num_tokens` and
    `max_num_seqs` are per DP rank."""
    check_weights(weights)
    mesh_shape = {"dp": dp, "ep": ep, "tp": tp, "dcp": dcp}
    devices = dp * ep * tp * dcp
    moe = "ep" if ep * dp > 1 else "tp"
    w = weight_bytes_per_device(abstract_params(cfg, weights=weights), cfg, mesh_shape, moe=moe)
    heads, model = tp * dcp, ep * tp * dcp
    act, ws = _activation_bytes(cfg, max_num_tokens, heads, model, ep, weights, max_num_seqs, dp)
    reserve = int(reserve_fraction * device_bytes)
    per_token = bytes_per_token(
        cfg.num_hidden_layers, cache_dtype, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim
    )
    if cache_tokens is None:
        free = device_bytes - sum(w.values()) - act - ws - reserve
        pages = max(0, free * dcp // (per_token * page_size))
        cache_tokens = int(pages * page_size)
    cache = cdiv(cdiv(cache_tokens, page_size) * page_size, dcp) * per_token
    return MemoryPlan(devices, mesh_shape, w, int(cache_tokens), cache, ws, act, reserve, device_bytes)


# The node layouts of the capacity table: (name, make_mesh sizes). vLLM's -tp 8 / -tp 8 -dcp 8 / -dp 8 with expert
# parallel / -dp 4 -tp 2 with expert parallel.
CAPACITY_LAYOUTS = (
    ("TP 8", dict(tp=8)),
    ("DCP 8", dict(dcp=8)),
    ("DP 8", dict(dp=8)),
    ("DP 4 x TP 2", dict(dp=4, tp=2)),
)


def capacity_table(
    models: dict[str, tuple[DeepseekConfig, str]], *, node_tokens: int = 8192, node_seqs: int = 256, **kw
) -> list[dict]:
    """Cached-token capacity of one 8-GPU node per model ({name: (config, weights "fp8" | "bf16")}) and
    `CAPACITY_LAYOUTS`, from `memory_plan` (exact weight shards and cache rows; `kw` goes to it): per row the
    weights a GPU holds, the token rows a GPU caches, and the distinct tokens the node caches.

    Every layout runs steps of `node_tokens` tokens and `node_seqs` sequences over the node, so a DP rank's
    budget is 1/dp of them: its all-gather dispatch holds the MoE copies of all ranks' tokens, as many as one
    TP group's of the same node-wide step."""
    rows = []
    for name, (cfg, weights) in models.items():
        for layout, mesh in CAPACITY_LAYOUTS:
            dp = mesh.get("dp", 1)
            budget = dict(max_num_tokens=node_tokens // dp, max_num_seqs=node_seqs // dp)
            p = memory_plan(cfg, weights=weights, **mesh, **budget, **kw)
            rows.append(
                dict(
                    model=name,
                    layout=layout,
                    weights_gb_per_gpu=round(p.weight_bytes / 1e9, 1),
                    tokens_per_gpu=p.device_cache_tokens,
                    tokens_per_node=p.mesh_cache_tokens,
                    fits=p.fits,
                )
            )
    return rows
