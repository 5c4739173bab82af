"""Tensor-parallel layout of the params pytree on a `jax.sharding.Mesh` with an axis named "tp".

What is split over "tp" (weights in HF [out, in] layout; stacked layers add a leading, unsplit layer axis):

    attention, by heads     q_b_proj / q_proj rows, W_UK_T [N, P, L] and W_UV [N, L, V] on N, o_proj columns
    routed experts, on E    experts.{gate,up,down}_proj [E, out, in]
    dense MLP / shared      gate_proj, up_proj rows and down_proj columns (the intermediate dim)
    embedding, lm_head      by vocab (rows)

Everything else is replicated: norms, q_a_proj, kv_a_proj_with_mqa (the latent is shared by all heads), the
router (gate.weight, e_score_correction_bias). Other mesh axes (e.g. "dp") replicate.

Divisibility rule: a tensor is split only when its *unit count* is divisible by the "tp" size (heads N for the
attention tensors, so a head is never cut in two; E for experts; the intermediate size for MLPs; vocab for
embed/lm_head). Otherwise that tensor is replicated, so any mesh works and only memory/speed changes.
"""
from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mla_jax.config import DeepseekConfig

TP = "tp"
_STACKS = ("dense_layers", "moe_layers")


def _key(k: Any) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def param_spec(path: tuple[str, ...], ndim: int, cfg: DeepseekConfig, tp: int) -> PartitionSpec:
    """The PartitionSpec of one leaf, from its path in the params pytree (e.g. ("model", "moe_layers",
    "self_attn", "W_UK_T")) and rank."""
    stacked = len(path) > 2 and path[0] == "model" and path[1] in _STACKS
    rel = path[2:] if stacked else path
    lead = 1 if stacked else 0
    name = "/".join(rel)
    N, E, V = cfg.num_attention_heads, cfg.n_routed_experts or 0, cfg.vocab_size
    inter = cfg.intermediate_size
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts

    axis, units = None, 0
    if name in ("model/embed_tokens/weight", "lm_head/weight"):
        axis, units = 0, V
    elif name in ("self_attn/q_b_proj/weight", "self_attn/q_proj/weight", "self_attn/W_UK_T", "self_attn/W_UV"):
        axis, units = 0, N
    elif name == "self_attn/o_proj/weight":
        axis, units = 1, N
    elif name.startswith("mlp/experts/"):
        axis, units = 0, E
    elif name in ("mlp/gate_proj/weight", "mlp/up_proj/weight"):
        axis, units = 0, inter
    elif name == "mlp/down_proj/weight":
        axis, units = 1, inter
    elif name in ("mlp/shared_experts/gate_proj/weight", "mlp/shared_experts/up_proj/weight"):
        axis, units = 0, shared
    elif name == "mlp/shared_experts/down_proj/weight":
        axis, units = 1, shared
    spec = [None] * ndim
    if axis is not None and tp > 1 and units and units % tp == 0 and lead + axis < ndim:
        spec[lead + axis] = TP
    return PartitionSpec(*spec)


def param_shardings(params_or_abstract: Any, cfg: DeepseekConfig, mesh: Mesh) -> Any:
    """A pytree of NamedSharding matching `params_or_abstract` (arrays or jax.ShapeDtypeStruct leaves)."""
    if TP not in mesh.axis_names:
        raise ValueError(f"mesh axes {mesh.axis_names} have no '{TP}' axis for tensor parallelism")
    tp = mesh.shape[TP]

    def one(path, leaf):
        keys = tuple(_key(k) for k in path)
        return NamedSharding(mesh, param_spec(keys, len(leaf.shape), cfg, tp))

    return jax.tree_util.tree_map_with_path(one, params_or_abstract)


def shard_params(params: Any, cfg: DeepseekConfig, mesh: Mesh) -> Any:
    """Place (or re-place) params onto `mesh` with the tensor-parallel layout."""
    return jax.device_put(params, param_shardings(params, cfg, mesh))
