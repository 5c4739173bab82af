"""Model-parallel layout of the params pytree on a `jax.sharding.Mesh`.

Mesh axes this module knows: "tp" (tensor parallel), "dcp" (decode context parallel: attention heads are split
over it too, the latent cache by tokens, see `mla_jax.parallel`), "ep" (expert parallel only: attention is
replicated over it) and "dp" (data-parallel attention: each rank its own requests; only the routed experts are
split over it). Three groups of axes:

    head axes    ("tp", "dcp") present in the mesh: attention heads
    model axes   ("ep", "tp", "dcp") present in the mesh: everything else that is split, inside a DP group
    expert axes  ("dp",) + the model axes when "dp" has size > 1, else the model axes: routed experts (moe="ep")

What is split (weights in HF [out, in] layout; stacked layers add a leading, unsplit layer axis):

    attention, by heads     q_b_proj / q_proj rows, W_UK_T [N, P, L] and W_UV [N, L, V] on N, o_proj columns
                            (over the head axes)
    routed experts          moe="ep": experts.{gate,up,down}_proj [E, out, in] on E (over the expert axes);
                            moe="tp": each expert's intermediate dim (gate/up rows, down columns)
    dense MLP / shared      gate_proj, up_proj rows and down_proj columns (the intermediate dim)
    embedding, lm_head      by vocab (rows)
    (all of these but the moe="ep" experts over the model axes)

Everything else is replicated: norms, q_a_proj, kv_a_proj_with_mqa (the latent is shared by all heads), the
router (gate.weight, e_score_correction_bias). On a mesh whose only model axis is "tp" this is the plain
tensor-parallel layout (head and model axes are both "tp").

Divisibility rule: a tensor is split only when its *unit count* is divisible by the size of its axes (heads N
for the attention tensors, so a head is never cut in two; E or the expert intermediate size for experts; the
intermediate size for MLPs; vocab for embed/lm_head). Otherwise that tensor is replicated, so any mesh works and
only memory/speed changes (for checkpoint restore; `mla_jax.parallel` requires the heads and experts to divide).
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mla_jax.config import DeepseekConfig

TP = "tp"
DCP = "dcp"
EP = "ep"
DP = "dp"
HEAD_AXES = (TP, DCP)
MODEL_AXES = (EP, TP, DCP)
MESH_AXES = (DP, EP, TP, DCP)  # every axis a mesh may have, in device order (dp outermost)
MOE_MODES = ("ep", "tp")
_STACKS = ("dense_layers", "moe_layers", "mtp_layers")


def _key(k: Any) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


def mesh_axes(mesh: Mesh) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(head axes, model axes) of `mesh`, each in the fixed order above (the order devices are numbered in)."""
    names = mesh.axis_names
    return tuple(a for a in HEAD_AXES if a in names), tuple(a for a in MODEL_AXES if a in names)


def dp_size(mesh: Mesh) -> int:
    return int(mesh.shape[DP]) if DP in mesh.axis_names else 1


def expert_axes(mesh: Mesh) -> tuple[str, ...]:
    """The axes routed experts are split over by expert (moe="ep"): "dp" (when > 1) then the model axes."""
    model = mesh_axes(mesh)[1]
    return ((DP,) if dp_size(mesh) > 1 else ()) + model


def axes_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry for a group of axes ("tp" rather than ("tp",), None for no axes)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _spec(
    path: tuple[str, ...],
    ndim: int,
    cfg: DeepseekConfig,
    heads: tuple[Any, int],
    model: tuple[Any, int],
    moe: str,
    experts: tuple[Any, int] | None = None,
) -> PartitionSpec:
    stacked = len(path) > 2 and path[0] == "model" and path[1] in _STACKS
    rel = path[2:] if stacked else path
    lead = 1 if stacked else 0
    name = "/".join(rel)
    N, E, V = cfg.num_attention_heads, cfg.n_routed_experts or 0, cfg.vocab_size
    inter = cfg.intermediate_size
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts

    group, axis, units = model, None, 0
    if name in ("model/embed_tokens/weight", "lm_head/weight"):
        axis, units = 0, V
    elif name in ("self_attn/q_b_proj/weight", "self_attn/q_proj/weight", "self_attn/W_UK_T", "self_attn/W_UV"):
        group, axis, units = heads, 0, N
    elif name == "self_attn/o_proj/weight":
        group, axis, units = heads, 1, N
    elif name.startswith("mlp/experts/"):
        if moe == "ep":
            group, axis, units = experts or model, 0, E
        else:  # the intermediate dim: [E, I, D] rows of gate/up, [E, D, I] columns of down
            axis = 2 if name.startswith("mlp/experts/down_proj") else 1
            units = cfg.moe_intermediate_size
    elif name in ("mlp/gate_proj/weight", "mlp/up_proj/weight"):
        axis, units = 0, inter
    elif name == "mlp/down_proj/weight":
        axis, units = 1, inter
    elif name in ("mlp/shared_experts/gate_proj/weight", "mlp/shared_experts/up_proj/weight"):
        axis, units = 0, shared
    elif name == "mlp/shared_experts/down_proj/weight":
        axis, units = 1, shared
    entry, size = group
    spec = [None] * ndim
    if axis is not None and entry is not None and size > 1 and units and units % size == 0 and lead + axis < ndim:
        spec[lead + axis] = entry
    return PartitionSpec(*spec)


def param_spec(path: tuple[str, ...], ndim: int, cfg: DeepseekConfig, tp: int) -> PartitionSpec:
    """The PartitionSpec of one leaf on a plain "tp" mesh of size `tp`, from its path in the params pytree (e.g.
    ("model", "moe_layers", "self_attn", "W_UK_T")) and rank."""
    return _spec(path, ndim, cfg, (TP, tp), (TP, tp), "ep")


def param_shardings(params_or_abstract: Any, cfg: DeepseekConfig, mesh: Mesh, *, moe: str = "ep") -> Any:
    """A pytree of NamedSharding matching `params_or_abstract` (arrays or jax.ShapeDtypeStruct leaves)."""
    if moe not in MOE_MODES:
        raise ValueError(f"moe must be one of {MOE_MODES}, got {moe!r}")
    head_axes, model_axes = mesh_axes(mesh)
    ex_axes = expert_axes(mesh)
    if not ex_axes:
        raise ValueError(
            f"mesh axes {mesh.axis_names} have no '{TP}' axis (nor '{DCP}', '{EP}' or '{DP}') for model parallelism"
        )
    heads = (axes_entry(head_axes), math.prod(mesh.shape[a] for a in head_axes))
    model = (axes_entry(model_axes), math.prod(mesh.shape[a] for a in model_axes))
    experts = (axes_entry(ex_axes), math.prod(mesh.shape[a] for a in ex_axes))

    flat = jax.tree_util.tree_flatten_with_path(params_or_abstract)[0]
    shapes = {tuple(_key(k) for k in path): leaf.shape for path, leaf in flat}

    def one(path, leaf):
        keys = tuple(_key(k) for k in path)
        if keys[-1] == "weight_scale_inv":  # block-FP8: the scales split with their weight (see _fp8_spec)
            w = keys[:-1] + ("weight",)
            spec = _spec(w, len(leaf.shape), cfg, heads, model, moe, experts)
            return NamedSharding(mesh, _fp8_spec(spec, shapes[w], mesh))
        spec = _spec(keys, len(leaf.shape), cfg, heads, model, moe, experts)
        if keys[:-1] + ("weight_scale_inv",) in shapes:
            split = _fp8_spec(spec, leaf.shape, mesh)
            if split != spec and keys[-2] in ("q_proj", "q_b_proj", "o_proj"):  # the heads must stay split
                raise ValueError(
                    f"fp8 weight {'/'.join(keys)} {leaf.shape}: a {heads[1]}-way head split cuts its 128x128 scale "
                    "blocks (each shard needs whole blocks); use fewer head shards or bf16 weights"
                )
            spec = split
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, params_or_abstract)


def _fp8_spec(spec: PartitionSpec, weight_shape: tuple[int, ...], mesh: Mesh, block: int = 128) -> PartitionSpec:
    """A block-FP8 weight [..., out, in] (and its scales [..., cdiv(out,128), cdiv(in,128)]) keeps a split of
    its last two dims only when every shard holds whole 128-wide blocks; otherwise both are replicated there."""
    entries = list(spec) + [None] * (len(weight_shape) - len(spec))
    for ax in range(len(weight_shape) - 2, len(weight_shape)):
        e = entries[ax]
        if e is None:
            continue
        shards = math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e))
        if weight_shape[ax] % (shards * block):
            entries[ax] = None
    return PartitionSpec(*entries)


def shard_params(params: Any, cfg: DeepseekConfig, mesh: Mesh, *, moe: str = "ep") -> Any:
    """Place (or re-place) params onto `mesh` with the model-parallel layout."""
    return jax.device_put(params, param_shardings(params, cfg, mesh, moe=moe))
