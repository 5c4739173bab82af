"""Loading: `load_model` takes a converted mla-jax checkpoint or an HF directory; `load_checkpoint` restores a
converted one; `abstract_params` / `read_metadata` describe one without reading any array.

    cfg, params = load_model("path/to/converted", mesh=mesh)               # an HF directory loads too

`load_checkpoint` restores a group at a time; each layer, once complete, goes into stacked, already-placed
(optionally sharded) device buffers `dense_layers` / `moe_layers` by a donated in-place update, so restoring
needs host memory for about one group + one layer, never the model. FP8 weights kept by `keep_fp8` are
dequantized per layer, so the params returned are always plain weights that the model runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks, fp8_block
from mla_jax.checkpoint.hf import CheckpointError
from mla_jax.checkpoint.layout import FORMAT, FORMAT_VERSION, METADATA, PARAMS_DIR, get_path, is_router, set_path
from mla_jax.checkpoint.params import load_hf_checkpoint
from mla_jax.checkpoint.plan import weight_dtype
from mla_jax.checkpoint.validate import mtp_tensor_specs
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import F32, FP8_E4M3, as_dtype
from mla_jax.model import MTP_GROUP, Params, init_params


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def read_metadata(path: str) -> dict:
    """The metadata of a converted checkpoint; CheckpointError if `path` is not a complete one."""
    mpath = os.path.join(path, METADATA)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if not os.path.isfile(mpath):
        raise CheckpointError(
            f"{path}: no {METADATA}: not a converted mla-jax checkpoint (or an interrupted conversion)"
        )
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath}: corrupted ({e})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{mpath}: format {meta.get('format')!r} v{meta.get('format_version')!r} is not "
            f"{FORMAT!r} v{FORMAT_VERSION}"
        )
    return meta


def abstract_params(path: str, dtype: Any = None) -> tuple[DeepseekConfig, Params]:
    """(config, pytree of jax.ShapeDtypeStruct) of a converted checkpoint, without reading any array. Checked
    against the shapes the model needs for config.json."""
    meta = read_metadata(path)
    cfg = DeepseekConfig.from_json(path)
    n_mtp = meta["stacks"].get(MTP_GROUP, {}).get("num_layers", 0)
    if n_mtp != cfg.num_mtp_layers:  # the converter found no MTP tensors (`validate.resolve_mtp`)
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=n_mtp)
    target = weight_dtype(dtype) if dtype is not None else as_dtype(meta["dtype"])
    tree: dict = {}
    for u in meta["units"]:
        for lf in u["leaves"]:
            p = tuple(lf["path"])
            if p[-1].endswith(SCALE_SUFFIX):
                continue  # folded into the dequantized weight
            shape = list(lf["shape"])
            if u["experts"]:
                shape[0] = cfg.n_routed_experts
            if u["stack"]:
                p = ("model", u["stack"]) + p
                shape = [meta["stacks"][u["stack"]]["num_layers"]] + shape
            set_path(tree, p, jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(F32 if is_router(p) else target)))
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    got_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    want_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(want)[0]}
    if cfg.topk_method != "noaux_tc":  # init_params always makes the V3 bias; other routers never read it
        want_flat = {k: v for k, v in want_flat.items() if "e_score_correction_bias" not in k}
    for k, (shape, optional) in mtp_tensor_specs(cfg).items():  # optional MTP tensors: checked when present
        key = "".join(f"['{p}']" for p in ("model", MTP_GROUP, *k.split(".")))
        if optional:
            want_flat.pop(key, None)
        if optional and key in got_flat:
            want_flat[key] = (cfg.num_mtp_layers, *shape)
    for k in sorted(set(got_flat) | set(want_flat)):
        if got_flat.get(k) != want_flat.get(k):
            raise CheckpointError(
                f"{path}: param {k} is {got_flat.get(k)} in {METADATA} but config.json needs {want_flat.get(k)}"
            )
    return cfg, tree


def _restore_group(ck, path: str, g: dict, units: dict[str, dict]) -> dict:
    import orbax.checkpoint as ocp

    gdir = os.path.join(path, PARAMS_DIR, g["name"])
    if not os.path.isdir(gdir):
        raise CheckpointError(f"{path}: group '{g['name']}' is missing ({gdir})")
    args: dict = {}
    for key in g["units"]:
        for lf in units[key]["leaves"]:
            set_path(args, (key, *lf["path"]), ocp.RestoreArgs(restore_type=np.ndarray))
    try:
        tree = ck.restore(gdir, args=ocp.args.PyTreeRestore(restore_args=args))
    except Exception as e:  # orbax / tensorstore raise many types: name the group
        raise CheckpointError(f"{path}: cannot restore group '{g['name']}': {e}") from e
    for key in g["units"]:
        for lf in units[key]["leaves"]:
            name = "/".join((key, *lf["path"]))
            try:
                x = get_path(tree, (key, *lf["path"]))
            except (KeyError, TypeError):
                raise CheckpointError(f"{gdir}: missing array {name}") from None
            want = (tuple(lf["shape"]), as_dtype(lf["dtype"]))
            if (x.shape, x.dtype) != want:
                raise CheckpointError(f"{gdir}: array {name} is {x.shape} {x.dtype}, expected {want[0]} {want[1]}")
    return tree


def _collect(flat: dict, unit: dict, tree: dict, cfg: DeepseekConfig) -> None:
    """Add one restored unit's arrays to its layer's flat {path: array} (expert chunks into [E, ...])."""
    for lf in unit["leaves"]:
        p = tuple(lf["path"])
        x = get_path(tree, p)
        if unit["experts"]:
            e0, e1 = unit["experts"]
            if p not in flat:
                flat[p] = np.empty((cfg.n_routed_experts, *x.shape[1:]), x.dtype)
            flat[p][e0:e1] = x
        else:
            flat[p] = x


def _finalize(flat: dict, target: np.dtype, block) -> dict:
    """fp8 + scale pairs dequantized, everything cast to `target` (router float32) -> a nested tree."""
    out: dict = {}
    for p, x in flat.items():
        if p[-1].endswith(SCALE_SUFFIX):
            continue
        if x.dtype == FP8_E4M3:
            x = dequantize_fp8_blocks(x, flat[p[:-1] + (p[-1] + SCALE_SUFFIX,)], block, "/".join(p))
        dt = F32 if is_router(p) else target
        set_path(out, p, x if x.dtype == dt else x.astype(dt))
    return out


def _alloc(spec):
    """Zeroed stacked buffers; module-level with a hashable spec so repeated loads reuse the compilation."""
    treedef, leaves = spec
    return jax.tree.unflatten(treedef, [jnp.zeros(shape, dt) for shape, dt in leaves])


def _update(stack, layer, i):
    """Write one layer into the stacked buffers (donated: in place, no second copy of the stack)."""
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), i, 0), stack, layer)


def load_checkpoint(
    path: str, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None
) -> tuple[DeepseekConfig, Params]:
    """A converted checkpoint -> (config, params) in the layout `mla_jax.model.forward` takes.

    `dtype` (bf16 / fp32) casts the weights (the router stays float32); default: the dtype it was converted
    to; fp8 weights kept by --keep-fp8 are dequantized to it. With `mesh` (an axis named "tp"; Auto axis
    types) every array is placed with `mla_jax.sharding.param_shardings`. Groups are restored one at a time
    and each completed layer is written into stacked, already-placed buffers by a donated in-place update, so
    host memory stays near one group + one layer."""
    import orbax.checkpoint as ocp

    from mla_jax.sharding import param_shardings

    meta = read_metadata(path)
    cfg, abstract = abstract_params(path, dtype)
    target = weight_dtype(dtype) if dtype is not None else as_dtype(meta["dtype"])
    block = tuple(meta.get("fp8_block") or fp8_block(cfg))
    shardings = param_shardings(abstract, cfg, mesh) if mesh is not None else None
    units = {u["key"]: u for u in meta["units"]}

    def put(x, s=None):
        return jax.device_put(x, s) if s is not None else jax.device_put(x)

    params: dict = {}
    stacks, layer_sh, update = {}, {}, {}
    remaining: dict[tuple, int] = {}
    for u in meta["units"]:
        if u["stack"]:
            remaining[(u["stack"], u["index"])] = remaining.get((u["stack"], u["index"]), 0) + 1
    for stack, info in meta["stacks"].items():
        if sorted(i for s, i in remaining if s == stack) != list(range(info["num_layers"])):
            raise CheckpointError(f"{path}: the units of {stack} do not cover layers 0..{info['num_layers'] - 1}")
        s_abs = abstract["model"][stack]
        s_sh = shardings["model"][stack] if shardings else None
        out_sh = {"out_shardings": s_sh} if s_sh is not None else {}
        leaves, treedef = jax.tree.flatten(s_abs)
        stacks[stack] = jax.jit(_alloc, static_argnums=0, **out_sh)(
            (treedef, tuple((a.shape, a.dtype.name) for a in leaves))
        )  # one compile per stack, not per shape
        layer_sh[stack] = (
            None
            if s_sh is None
            else jax.tree.map(
                lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:])), s_sh
            )
        )
        update[stack] = jax.jit(_update, donate_argnums=0, **out_sh)

    pending: dict[tuple, dict] = {}
    ck = ocp.PyTreeCheckpointer()
    try:
        for g in meta["groups"]:
            tree = _restore_group(ck, path, g, units)
            for key in g["units"]:
                u = units[key]
                if u["stack"] is None:  # top-level leaves are complete on their own
                    flat: dict = {}
                    _collect(flat, u, tree[key], cfg)
                    host = _finalize(flat, target, block)
                    for kp, x in jax.tree_util.tree_flatten_with_path(host)[0]:
                        p = tuple(k.key for k in kp)
                        set_path(params, p, put(x, get_path(shardings, p) if shardings else None))
                    continue
                slot = (u["stack"], u["index"])
                _collect(pending.setdefault(slot, {}), u, tree[key], cfg)
                remaining[slot] -= 1
                if remaining[slot]:
                    continue
                layer = _finalize(pending.pop(slot), target, block)
                stack = u["stack"]
                if jax.tree.structure(layer) != jax.tree.structure(abstract["model"][stack]):
                    raise CheckpointError(f"{path}: the units of {stack}[{u['index']}] do not hold the layer's params")
                if layer_sh[stack] is not None:
                    dev = jax.tree.map(put, layer, layer_sh[stack])
                else:
                    dev = jax.tree.map(put, layer)
                stacks[stack] = update[stack](stacks[stack], dev, jnp.int32(u["index"]))
                del layer, dev
            del tree
    finally:
        ck.close()
    if pending or any(remaining.values()):
        raise CheckpointError(f"{path}: incomplete layers {sorted(k for k, v in remaining.items() if v)}")
    for stack, bufs in stacks.items():
        params.setdefault("model", {})[stack] = bufs
    return cfg, params


def load_model(path: str, dtype: Any = None, mesh: jax.sharding.Mesh | None = None) -> tuple[DeepseekConfig, Params]:
    """Load a converted mla-jax checkpoint or a Hugging Face checkpoint directory, optionally onto a
    tensor-parallel `mesh` (see `load_checkpoint`)."""
    path = os.fspath(path)
    if is_converted(path):
        return load_checkpoint(path, dtype=dtype, mesh=mesh)
    has_weights = os.path.isdir(path) and any(
        f == "model.safetensors.index.json" or (f.startswith("model") and f.endswith(".safetensors"))
        for f in os.listdir(path)
    )
    if not (has_weights and os.path.isfile(os.path.join(path, "config.json"))):
        raise CheckpointError(
            f"{path}: neither a converted mla-jax checkpoint ({METADATA}) nor a Hugging Face "
            "checkpoint (config.json + model*.safetensors)"
        )
    cfg, params = load_hf_checkpoint(path, dtype=None if dtype is None else jnp.dtype(weight_dtype(dtype)))
    if mesh is not None:
        from mla_jax.sharding import shard_params

        params = shard_params(params, cfg, mesh)
    return cfg, params
