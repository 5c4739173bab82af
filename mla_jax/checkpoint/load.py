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
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from mla_jax.checkpoint.fp8 import (
    FP8_LINEARS,
    SCALE_SUFFIX,
    check_weights,
    dequantize_fp8_blocks,
    fp8_block,
    quantize_params,
)
from mla_jax.checkpoint.hf import CheckpointError
from mla_jax.checkpoint.layout import (
    FORMAT,
    FORMAT_VERSION,
    METADATA,
    PARAMS_DIR,
    checksum,
    get_path,
    is_router,
    set_path,
)
from mla_jax.checkpoint.params import load_hf_checkpoint
from mla_jax.checkpoint.plan import weight_dtype
from mla_jax.checkpoint.validate import mtp_tensor_specs
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import F32, FP8_E4M3, as_dtype
from mla_jax.model import MTP_GROUP, Params, init_params, param_groups

STACKS = ("dense_layers", "moe_layers", MTP_GROUP)


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def read_metadata(path: str) -> dict:
    """The metadata of a converted checkpoint; CheckpointError if `path` is not a complete one, or if a field is
    missing or malformed (the message names the field)."""
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath}: corrupted ({e})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{mpath}: corrupted (not a JSON object)")
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        old = meta.get("format") == FORMAT and meta.get("format_version") == 1
        raise CheckpointError(
            f"{mpath}: format {meta.get('format')!r} v{meta.get('format_version')!r} is not "
            f"{FORMAT!r} v{FORMAT_VERSION}" + ("; convert the HF checkpoint again (v2 adds checksums)" if old else "")
        )
    _check_metadata(meta, mpath)
    return meta


def _field(obj: Any, key: str | int, typ: Any, where: str, mpath: str) -> Any:
    """obj[key], which must be of `typ` (a type, a tuple of them, or None for "null allowed" with a tuple)."""
    name = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
    name = name.lstrip(".")
    if isinstance(key, str) and (not isinstance(obj, dict) or key not in obj):
        raise CheckpointError(f"{mpath}: missing field '{name}'")
    v = obj[key]
    if isinstance(v, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,)) or not isinstance(v, typ):
        raise CheckpointError(f"{mpath}: field '{name}' is {type(v).__name__} {v!r:.60}, expected {_tname(typ)}")
    return v


def _tname(typ: Any) -> str:
    return " or ".join(t.__name__.replace("NoneType", "null") for t in (typ if isinstance(typ, tuple) else (typ,)))


def _ints(v: Any, name: str, mpath: str, n: int | None = None) -> list[int]:
    if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise CheckpointError(f"{mpath}: field '{name}' is {v!r:.60}, expected a list of non-negative ints")
    if n is not None and len(v) != n:
        raise CheckpointError(f"{mpath}: field '{name}' is {v!r:.60}, expected {n} ints")
    return v


def _check_metadata(meta: dict, mpath: str) -> None:
    """The fields the loader reads: present, of the right types, and consistent (every unit in one group, every
    stack named); so a malformed file is an error naming the field, never a KeyError later."""
    f = lambda obj, key, typ, where="": _field(obj, key, typ, where, mpath)  # noqa: E731
    dtype = f(meta, "dtype", str)
    try:
        weight_dtype(dtype)
    except CheckpointError:
        raise CheckpointError(f"{mpath}: field 'dtype' is {meta['dtype']!r}, expected bfloat16 or float32") from None
    if meta.get("fp8_block") is not None:
        _ints(meta["fp8_block"], "fp8_block", mpath, 2)
    stacks = f(meta, "stacks", dict)
    for name, info in stacks.items():
        if name not in STACKS:
            raise CheckpointError(f"{mpath}: field 'stacks.{name}' is not one of {', '.join(STACKS)}")
        f(info, "first_layer", int, f"stacks.{name}")
        f(info, "num_layers", int, f"stacks.{name}")
    units = f(meta, "units", list)
    keys: set[str] = set()
    for k in range(len(units)):
        u = f(units, k, dict, "units")
        w = f"units[{k}]"
        key = f(u, "key", str, w)
        if key in keys or not key or "/" in key or "." in key:
            raise CheckpointError(f"{mpath}: field '{w}.key' {key!r} is repeated or not a plain name")
        keys.add(key)
        stack = f(u, "stack", (str, type(None)), w)
        if stack is not None and stack not in stacks:
            raise CheckpointError(f"{mpath}: field '{w}.stack' {stack!r} is not in 'stacks'")
        f(u, "index", int, w)
        f(u, "layer", int, w)
        if f(u, "experts", (list, type(None)), w) is not None:
            _ints(u["experts"], f"{w}.experts", mpath, 2)
        leaves = f(u, "leaves", list, w)
        for j in range(len(leaves)):
            lf = f(leaves, j, dict, f"{w}.leaves")
            lw = f"{w}.leaves[{j}]"
            p = f(lf, "path", list, lw)
            if not p or any(not isinstance(x, str) or not x for x in p):
                raise CheckpointError(f"{mpath}: field '{lw}.path' is {p!r:.60}, expected a list of names")
            _ints(f(lf, "shape", list, lw), f"{lw}.shape", mpath)
            try:
                as_dtype(f(lf, "dtype", str, lw))
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{mpath}: field '{lw}.dtype' {lf['dtype']!r} is not a dtype") from None
            f(lf, "crc32", str, lw)
    grouped: set[str] = set()
    groups = f(meta, "groups", list)
    for k in range(len(groups)):
        g = f(groups, k, dict, "groups")
        name = f(g, "name", str, f"groups[{k}]")
        if not name or os.sep in name or name.startswith("."):
            raise CheckpointError(f"{mpath}: field 'groups[{k}].name' {name!r} is not a plain name")
        for key in f(g, "units", list, f"groups[{k}]"):
            if key not in keys or key in grouped:
                raise CheckpointError(f"{mpath}: field 'groups[{k}].units': unit {key!r} is unknown or repeated")
            grouped.add(key)
    if grouped != keys:
        raise CheckpointError(f"{mpath}: unit {sorted(keys - grouped)[0]!r} is in no group")


def abstract_params(path: str, dtype: Any = None, weights: str = "bf16") -> tuple[DeepseekConfig, Params]:
    """(config, pytree of jax.ShapeDtypeStruct) of a converted checkpoint, without reading any array. Checked
    against the shapes the model needs for config.json. weights="fp8": stored fp8 FP8_LINEARS stay e4m3 with
    their weight_scale_inv leaves."""
    meta = read_metadata(path)
    cfg = DeepseekConfig.from_json(path)
    n_mtp = meta["stacks"].get(MTP_GROUP, {}).get("num_layers", 0)
    if n_mtp != cfg.num_mtp_layers:  # the converter found no whole MTP layers (`validate.resolve_mtp`)
        n = n_mtp or cfg.num_nextn_predict_layers
        cfg = dataclasses.replace(cfg, mtp_loaded=n_mtp > 0, num_nextn_predict_layers=n)
    target = weight_dtype(dtype) if dtype is not None else as_dtype(meta["dtype"])
    tree: dict = {}
    for u in meta["units"]:
        for lf in u["leaves"]:
            p = tuple(lf["path"])
            kept = weights == "fp8" and _keeps_fp8(p)
            if p[-1].endswith(SCALE_SUFFIX) and not kept:
                continue  # folded into the dequantized weight
            shape = list(lf["shape"])
            if u["experts"]:
                shape[0] = cfg.n_routed_experts
            if u["stack"]:
                p = ("model", u["stack"]) + p
                shape = [meta["stacks"][u["stack"]]["num_layers"]] + shape
            dt = jnp.dtype(lf["dtype"]) if kept else jnp.dtype(F32 if is_router(p) else target)
            set_path(tree, p, jax.ShapeDtypeStruct(tuple(shape), dt))
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    got_flat = {
        jax.tree_util.keystr(k): v.shape
        for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        if k[-1].key != "weight" + SCALE_SUFFIX  # kept fp8 scales (weights="fp8"): the model has no such leaf
    }
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


def _restore_group(ck, path: str, g: dict, units: dict[str, dict], verify: bool = True) -> dict:
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
            if verify and checksum(x) != lf["crc32"]:
                raise CheckpointError(
                    f"{gdir}: array {name} (from {lf.get('from', '?')}) fails its checksum: the files are "
                    "corrupted (convert again; verify=False / --no-verify skips the check)"
                )
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


def _keeps_fp8(p: tuple) -> bool:
    """Whether weights="fp8" keeps this stored leaf (an FP8_LINEARS weight or its scales) as is."""
    return len(p) >= 2 and p[-2] in FP8_LINEARS and p[-1] in ("weight", "weight" + SCALE_SUFFIX)


def _finalize(flat: dict, target: np.dtype, block, weights: str = "bf16", prefix: str = "") -> dict:
    """fp8 + scale pairs dequantized (weights="fp8": FP8_LINEARS pairs kept), everything else cast to `target`
    (router float32) -> a nested tree. `prefix` (model.layers.{i}.) names a layer's tensors in errors."""
    out: dict = {}
    for p, x in flat.items():
        if weights == "fp8" and _keeps_fp8(p) and (x.dtype == FP8_E4M3 or p[-1].endswith(SCALE_SUFFIX)):
            if p[-1].endswith(SCALE_SUFFIX) or p[:-1] + (p[-1] + SCALE_SUFFIX,) in flat:
                set_path(out, p, x)
                continue
        if p[-1].endswith(SCALE_SUFFIX):
            continue
        if x.dtype == FP8_E4M3:
            x = dequantize_fp8_blocks(x, flat[p[:-1] + (p[-1] + SCALE_SUFFIX,)], block, prefix + ".".join(p))
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
    path: str,
    *,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    weights: str = "bf16",
    verify: bool = True,
    progress: bool = False,
) -> tuple[DeepseekConfig, Params]:
    """A converted checkpoint -> (config, params) in the layout `mla_jax.model.forward` takes.

    `dtype` (bf16 / fp32) casts the weights (the router stays float32); default: the dtype it was converted
    to; fp8 weights kept by --keep-fp8 are dequantized to it. With `mesh` (an axis named "tp"; Auto axis
    types) every array is placed with `mla_jax.sharding.param_shardings`. Groups are restored one at a time
    and each completed layer is written into stacked, already-placed buffers by a donated in-place update, so
    host memory stays near one group + one layer. `verify` checks each array's checksum (`layout.checksum`);
    `progress` shows a bar over the bytes restored, on stderr."""
    import orbax.checkpoint as ocp

    from mla_jax.sharding import param_shardings

    meta = read_metadata(path)
    cfg, abstract = abstract_params(path, dtype, check_weights(weights))
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
    nbytes = {
        k: sum(math.prod(lf["shape"]) * as_dtype(lf["dtype"]).itemsize for lf in u["leaves"]) for k, u in units.items()
    }
    bar = tqdm(total=sum(nbytes.values()), unit="B", unit_scale=True, desc="loading", disable=not progress, leave=False)
    try:
        for g in meta["groups"]:
            tree = _restore_group(ck, path, g, units, verify)
            bar.update(sum(nbytes[k] for k in g["units"]))
            for key in g["units"]:
                u = units[key]
                if u["stack"] is None:  # top-level leaves are complete on their own
                    flat: dict = {}
                    _collect(flat, u, tree[key], cfg)
                    host = _finalize(flat, target, block, weights)
                    for kp, x in jax.tree_util.tree_flatten_with_path(host)[0]:
                        p = tuple(k.key for k in kp)
                        set_path(params, p, put(x, get_path(shardings, p) if shardings else None))
                    continue
                slot = (u["stack"], u["index"])
                _collect(pending.setdefault(slot, {}), u, tree[key], cfg)
                remaining[slot] -= 1
                if remaining[slot]:
                    continue
                layer = _finalize(pending.pop(slot), target, block, weights, f"model.layers.{u['layer']}.")
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
        bar.close()
        ck.close()
    if pending or any(remaining.values()):
        raise CheckpointError(f"{path}: incomplete layers {sorted(k for k, v in remaining.items() if v)}")
    for stack, bufs in stacks.items():
        params.setdefault("model", {})[stack] = bufs
    return cfg, params


@jax.jit
def _finite_flags(params: Params) -> Params:
    """Per leaf: whether it is all finite; a stacked layer leaf [layers, ...] gives one flag per layer."""

    def flags(path, x):
        stacked = len(path) > 1 and getattr(path[1], "key", None) in STACKS
        return jnp.isfinite(x).all(axis=tuple(range(1, x.ndim))) if stacked else jnp.isfinite(x).all()

    return jax.tree_util.tree_map_with_path(flags, params)


def hf_name(cfg: DeepseekConfig, path: tuple[str, ...], layer: int | None = None, expert: int | None = None) -> str:
    """The HF tensor a param comes from: ("model", "moe_layers", "mlp", "experts", "up_proj", "weight") of layer
    3, expert 5 -> model.layers.3.mlp.experts.5.up_proj.weight; W_UK_T / W_UV -> kv_b_proj."""
    if layer is None:
        return ".".join(path)
    rel = list(path[2:])
    if rel[-1] in ("W_UK_T", "W_UV"):
        rel = rel[:-1] + ["kv_b_proj", "weight"]
    if rel[:2] == ["mlp", "experts"] and expert is not None:
        rel.insert(2, str(expert))
    return f"model.layers.{layer}." + ".".join(rel)


def check_finite(params: Params, cfg: DeepseekConfig, where: str) -> None:
    """CheckpointError naming the first tensor with a NaN or Inf. One on-device reduction per leaf (per layer of
    a stacked one) in one jitted call, so the cost is one read of the weights at memory bandwidth; only on a
    failure is the bad layer copied to the host to find the expert."""
    starts = {name: start for name, start, _ in param_groups(cfg)}
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(_finite_flags(params)))[0]
    for kp, ok in flat:
        if np.all(ok):
            continue
        path = tuple(k.key for k in kp)
        if len(path) > 1 and path[1] in STACKS:
            k = int(np.flatnonzero(~np.asarray(ok))[0])
            expert = None
            if path[2:4] == ("mlp", "experts"):
                x = np.asarray(get_path(params, path)[k])
                expert = int(np.argwhere(~np.isfinite(x))[0][0])
            name = hf_name(cfg, path, starts[path[1]] + k, expert)
        else:
            name = hf_name(cfg, path)
        raise CheckpointError(f"{where}: tensor '{name}' contains NaN or Inf (corrupted?)")


def load_model(
    path: str,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    *,
    weights: str = "bf16",
    verify: bool = True,
    progress: bool = False,
) -> tuple[DeepseekConfig, Params]:
    """Load a converted mla-jax checkpoint or a Hugging Face checkpoint directory, optionally onto a
    tensor-parallel `mesh` (see `load_checkpoint`). Every weight is checked for NaN / Inf (on device); a
    converted checkpoint's arrays are checked against their checksums too unless `verify=False`. Problems
    raise CheckpointError naming the tensor (or file, or metadata field). `progress`: a bar on stderr (the CLI
    shows it on a terminal only).

    weights="fp8": the linears of `checkpoint.fp8.FP8_LINEARS` stay block-FP8 at run time ({"weight": e4m3,
    "weight_scale_inv": f32}, run by the W8A8 GEMMs): an HF FP8 checkpoint's as stored (never dequantized),
    float weights block-quantized as they are read; a converted checkpoint keeps its stored fp8 pairs
    (`convert --keep-fp8` or `--weights fp8`) and quantizes any float ones after restoring."""
    path = os.fspath(path)
    check_weights(weights)
    if is_converted(path):
        cfg, params = load_checkpoint(path, dtype=dtype, mesh=mesh, weights=weights, verify=verify, progress=progress)
        check_finite(params, cfg, path)
        if weights == "fp8":  # stored fp8 pairs are kept; float FP8_LINEARS (a bf16 conversion) get quantized
            params, _ = quantize_params(params)
            if mesh is not None:
                from mla_jax.sharding import shard_params

                params = shard_params(params, cfg, mesh)
        return cfg, params
    has_weights = os.path.isdir(path) and any(
        f == "model.safetensors.index.json" or (f.startswith("model") and f.endswith(".safetensors"))
        for f in os.listdir(path)
    )
    if not (has_weights and os.path.isfile(os.path.join(path, "config.json"))):
        raise CheckpointError(
            f"{path}: neither a converted mla-jax checkpoint ({METADATA}) nor a Hugging Face "
            "checkpoint (config.json + model*.safetensors)"
        )
    cfg, params = load_hf_checkpoint(
        path, dtype=None if dtype is None else jnp.dtype(weight_dtype(dtype)), weights=weights, progress=progress
    )
    if mesh is not None:
        from mla_jax.sharding import shard_params

        params = shard_params(params, cfg, mesh)
    check_finite(params, cfg, path)
    return cfg, params
