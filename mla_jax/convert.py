"""Convert a Hugging Face DeepSeek V2 / V2-Lite / V3 checkpoint into an mla-jax orbax checkpoint, streaming.

    convert("path/to/DeepSeek-V3", "path/to/converted", dtype="bf16")     # or: mla-jax convert HF_DIR OUT_DIR
    cfg, params = load_model("path/to/converted", mesh=mesh)               # an HF directory loads too

Layout of a converted directory. Orbax writes a whole pytree per save, so the converter saves one *group* at
a time, which bounds its host memory by the largest group instead of the model:

    OUT/
      mla_jax_checkpoint.json   format, versions, source, dtype, tensor counts, and every unit and group with
                                its leaves (shape, dtype, HF origin); written last
      config.json               the HF config, copied verbatim (+ tokenizer.json, tokenizer_config.json, ...)
      params/group_00000/ ...   one orbax PyTree checkpoint per group: {unit key: unit tree}

A *unit* is the embedding, one layer minus its routed experts (`layer_007-core`: norms, attention with W_UK_T /
W_UV already split from kv_b_proj, router, dense or shared MLP, all in our final layout), one chunk of one
expert projection stacked [e0:e1, out, in] (`layer_007-experts-gate_proj-000-031`; a V3 layer's experts are
22 GB in bf16, so E is cut into chunks of at most `max_group_mb`), or the final norm + lm_head. Consecutive
units are packed into groups of at most `max_group_mb` (default 2 GiB): a tiny model is one group, DeepSeek-V3
a few hundred. Peak host memory is about max(max_group_mb, largest unit) plus allocator slack.

`load_checkpoint` restores a group at a time; each layer, once complete, goes into stacked, already-placed
(optionally sharded) device buffers `dense_layers` / `moe_layers` by a donated in-place update, so restoring
also needs host memory for about one group + one layer, never the model.

FP8 (DeepSeek-V3's e4m3 weights with float32 128x128 `weight_scale_inv`): dequantized (w * scale_inv, partial
edge blocks) to `dtype` by default. With `keep_fp8=True` the quantized weights are stored as e4m3 next to a
`weight_scale_inv` leaf (about half the disk of bf16) and `load_checkpoint` dequantizes them per layer on
restore, so the params it returns are always plain `dtype` weights that the model runs. kv_b_proj is always
dequantized at conversion (it is split per head into W_UK_T / W_UV across block boundaries; vLLM dequantizes it
too). The router (gate.weight, e_score_correction_bias) is kept in float32. The MTP layer
(model.layers.{num_hidden_layers}.*) is skipped and counted.

Safety: everything is written into a sibling `.OUT.partial-<pid>` directory, the metadata file last, which is
renamed to OUT only on success. An interrupted run leaves at most that partial directory (never loadable: no
metadata, no config.json); the next run removes partial directories of dead processes, so a plain rerun
(no --force needed when OUT does not exist) replaces it cleanly. An existing OUT is replaced only with
`force=True`, only when it is an mla-jax checkpoint or empty, and only once the new one is complete: OUT is
renamed aside, the new one renamed in, the old one deleted (a crash between the two renames leaves the old one
as `.OUT.old-<pid>`).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import sys
import time
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mla_jax.checkpoint import (FP8_E4M3, SCALE_SUFFIX, _IGNORED, check_fp8_scales, check_tensors,
                                dequantize_fp8_blocks, fp8_block, fp8_scale_shape, load_hf_checkpoint)
from mla_jax.config import DeepseekConfig
from mla_jax.model import Params, init_params, layer_groups
from mla_jax.safetensors_io import CheckpointDir, CheckpointError

FORMAT = "mla-jax-orbax-groups"
FORMAT_VERSION = 1
METADATA = "mla_jax_checkpoint.json"
PARAMS_DIR = "params"
EXTRA_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
               "generation_config.json")
DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
          "fp32": np.dtype(np.float32), "float32": np.dtype(np.float32)}
PAUSE_ENV = "MLA_JAX_CONVERT_TEST_PAUSE_AFTER"  # test hook: sleep after this many groups (interrupt test)
DEFAULT_MAX_GROUP_MB = 2048
_F32 = np.dtype(np.float32)
_ROUTER = (("mlp", "gate", "weight"), ("mlp", "gate", "e_score_correction_bias"))


class ConvertError(CheckpointError):
    """The conversion cannot proceed (output directory, options); the message says why."""


# ----------------------------------------------------------------------------------------------- planning


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One stored array of a unit. `sources` are HF names stacked on a new axis 0 when `stacked`. `select` =
    (e0, e1, r0, r1) slices a fused [E, rows, in] source. `part`: "value" (float, dequantized if fp8), "fp8"
    (raw e4m3) or "scale" (its float32 scale_inv). `op`: "uk"/"uv" split kv_b_proj per head."""

    path: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    sources: tuple[str, ...]
    origin: str  # the HF name(s) as a pattern, for --dry-run and the metadata
    part: str = "value"
    op: str = ""
    select: tuple[int, int, int, int] | None = None
    stacked: bool = False


@dataclasses.dataclass
class Unit:
    """The smallest piece written at once: the embedding, one layer without its routed experts ("core"), one
    chunk of one expert projection [e0:e1], or the final norm + lm_head. Consecutive units are packed into
    groups of up to `max_group_mb`; each group is one orbax checkpoint {unit key: unit tree}."""

    key: str  # no dots: orbax joins tree keys with "."
    stack: str | None  # "dense_layers" | "moe_layers"; None: top-level leaves (paths from the root)
    index: int  # position in the stack
    layer: int  # HF layer index, -1 for top-level units
    leaves: list[Leaf]
    source_bytes: int = 0
    experts: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(math.prod(lf.shape) * _np_dtype(lf.dtype).itemsize for lf in self.leaves)


@dataclasses.dataclass
class Group:
    name: str
    units: list[Unit]

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def source_bytes(self) -> int:
        return sum(u.source_bytes for u in self.units)


@dataclasses.dataclass
class Plan:
    cfg: DeepseekConfig
    dtype: np.dtype
    keep_fp8: bool
    fused_experts: bool
    quantized: list[str]
    skipped: list[str]  # MTP layer tensors
    ignored: list[str]  # rotary_emb.inv_freq buffers
    units: list[Unit]
    groups: list[Group]
    source_tensors: int

    @property
    def source_bytes(self) -> int:
        return sum(u.source_bytes for u in self.units)

    @property
    def stored_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    @property
    def largest_group(self) -> Group:
        return max(self.groups, key=lambda g: g.nbytes)

    @property
    def num_params(self) -> int:
        return len({(u.stack,) + lf.path for u in self.units for lf in u.leaves if lf.part != "scale"})


def _np_dtype(d: Any) -> np.dtype:
    if isinstance(d, str) and d in DTYPES:
        return DTYPES[d]
    if isinstance(d, str) and hasattr(ml_dtypes, d):
        return np.dtype(getattr(ml_dtypes, d))
    return np.dtype(d)


def _as_dtype(d: Any) -> np.dtype:
    dt = _np_dtype(d)
    if dt not in (DTYPES["bf16"], DTYPES["fp32"]):
        raise ConvertError(f"dtype {d!r} is not supported (bf16, fp32)")
    return dt


def make_plan(ckpt: CheckpointDir, cfg: DeepseekConfig, *, dtype: Any = "bf16", keep_fp8: bool = False,
              max_group_mb: float = DEFAULT_MAX_GROUP_MB) -> Plan:
    """Validate the checkpoint against `cfg` (headers only: names, shapes, dtypes, fp8 scales; nothing is read)
    and plan units and groups. Raises CheckpointError naming the first bad tensor."""
    dtype = _as_dtype(dtype)
    if not max_group_mb > 0:
        raise ConvertError(f"max_group_mb must be > 0, got {max_group_mb}")
    fused, mtp = check_tensors(ckpt, cfg)
    names = ckpt.keys()
    ignored = sorted(n for n in names if _IGNORED.match(n))
    skipped = sorted(set(mtp) | {n for n in names if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in mtp})
    drop = set(skipped) | set(ignored)
    used = [n for n in names if n not in drop and not n.endswith(SCALE_SUFFIX)]
    quantized = set(check_fp8_scales(ckpt, cfg, used))
    block = fp8_block(cfg)
    D = dtype.name
    N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    max_bytes = max(1, int(max_group_mb * 2**20))

    def weight(path, name, shape, out_dtype=D) -> list[Leaf]:
        if keep_fp8 and name in quantized:
            return [Leaf(path, shape, "float8_e4m3fn", (name,), name, part="fp8"),
                    Leaf(path[:-1] + ("weight" + SCALE_SUFFIX,), fp8_scale_shape(shape, block), "float32",
                         (name,), name + SCALE_SUFFIX, part="scale")]
        return [Leaf(path, shape, out_dtype, (name,), name)]

    def src_bytes(name: str) -> int:
        return ckpt.nbytes(name) + (ckpt.nbytes(name + SCALE_SUFFIX) if name in quantized else 0)

    units: list[Unit] = []

    def add(unit: Unit) -> None:
        if not unit.source_bytes:
            unit.source_bytes = sum(src_bytes(s) for s in {s for lf in unit.leaves for s in lf.sources})
        units.append(unit)

    vocab_shape = (cfg.vocab_size, cfg.hidden_size)
    add(Unit("embed", None, 0, -1, weight(("model", "embed_tokens", "weight"), "model.embed_tokens.weight",
                                            vocab_shape)))
    for stack, start, n in layer_groups(cfg):
        for idx in range(n):
            i = start + idx
            pre = f"model.layers.{i}."
            leaves: list[Leaf] = []

            def hf(rel: str, pre=pre) -> tuple[tuple[str, ...], str, tuple[int, ...]]:
                return tuple(rel.split(".")), pre + rel, ckpt.spec(pre + rel)[1]

            for rel in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                leaves += weight(*hf(rel))
            keys = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
            for k in keys + ["kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj"]:
                leaves += weight(*hf(f"self_attn.{k}.weight"))
            kvb = pre + "self_attn.kv_b_proj.weight"  # always dequantized: split per head across 128-row blocks
            leaves += [Leaf(("self_attn", "W_UK_T"), (N, P, L), D, (kvb,), kvb, op="uk"),
                       Leaf(("self_attn", "W_UV"), (N, L, V), D, (kvb,), kvb, op="uv")]
            if stack == "moe_layers":
                leaves += weight(*hf("mlp.gate.weight"), out_dtype="float32")
                if cfg.topk_method == "noaux_tc":
                    leaves += weight(*hf("mlp.gate.e_score_correction_bias"), out_dtype="float32")
                if cfg.n_shared_experts:
                    for k in ("gate_proj", "up_proj", "down_proj"):
                        leaves += weight(*hf(f"mlp.shared_experts.{k}.weight"))
                add(Unit(f"layer_{i:03d}-core", stack, idx, i, leaves))
                for u in _expert_units(cfg, i, stack, idx, fused, quantized, keep_fp8, block, D, max_bytes,
                                       src_bytes):
                    add(u)
            else:
                for k in ("gate_proj", "up_proj", "down_proj"):
                    leaves += weight(*hf(f"mlp.{k}.weight"))
                add(Unit(f"layer_{i:03d}-core", stack, idx, i, leaves))
    final = weight(("model", "norm", "weight"), "model.norm.weight", (cfg.hidden_size,))
    if not cfg.tie_word_embeddings:
        final += weight(("lm_head", "weight"), "lm_head.weight", vocab_shape)
    add(Unit("final", None, 0, -1, final))

    groups: list[Group] = []  # greedy packing of consecutive units
    for u in units:
        if not groups or groups[-1].nbytes + u.nbytes > max_bytes:
            groups.append(Group(f"group_{len(groups):05d}", []))
        groups[-1].units.append(u)
    n_src = len(used) + len(quantized)
    return Plan(cfg, dtype, keep_fp8, fused, sorted(quantized), skipped, ignored, units, groups, n_src)


def _expert_units(cfg, i, stack, idx, fused, quantized, keep_fp8, block, D, max_bytes, src_bytes) -> list[Unit]:
    """Routed experts of layer i: per projection, chunks of experts of at most max_bytes each."""
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    pre = f"model.layers.{i}.mlp.experts."
    out = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        shape = (H, I) if proj == "down_proj" else (I, H)
        if fused:  # gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
            src = pre + ("down_proj" if proj == "down_proj" else "gate_up_proj")
            rows = {"gate_proj": (0, I), "up_proj": (I, 2 * I), "down_proj": (0, H)}[proj]
            q = src in quantized
            if q and keep_fp8 and (rows[0] % block[0] or rows[1] % block[0]):
                raise ConvertError(f"tensor '{src}': cannot keep fp8 when splitting gate/up at row {I}, which is "
                                   f"not a multiple of the {block[0]}-row scale block (convert without "
                                   "--keep-fp8)")
        else:
            q = pre + f"0.{proj}.weight" in quantized
        store = "float8_e4m3fn" if (q and keep_fp8) else D
        per_expert = math.prod(shape) * _np_dtype(store).itemsize
        chunk = max(1, min(E, max_bytes // max(per_expert, 1)))
        path = ("mlp", "experts", proj, "weight")
        for e0 in range(0, E, chunk):
            e1 = min(E, e0 + chunk)
            n = e1 - e0
            if fused:
                sel, srcs = (e0, e1, *rows), (src,)
                origin = f"{src}[{e0}:{e1}, {rows[0]}:{rows[1]}]"
                frac = (rows[1] - rows[0]) / (2 * I) if proj != "down_proj" else 1.0
                sb = int(src_bytes(src) * n / E * frac)
            else:
                sel, srcs = None, tuple(pre + f"{j}.{proj}.weight" for j in range(e0, e1))
                origin = pre + f"{{{e0}..{e1 - 1}}}.{proj}.weight"
                sb = sum(src_bytes(s) for s in srcs)
            leaves = [Leaf(path, (n, *shape), store, srcs, origin, part="fp8" if store != D else "value",
                           select=sel, stacked=not fused)]
            if store != D:
                leaves.append(Leaf(path[:-1] + ("weight" + SCALE_SUFFIX,), (n, *fp8_scale_shape(shape, block)),
                                   "float32", srcs, origin + SCALE_SUFFIX, part="scale", select=sel,
                                   stacked=not fused))
            out.append(Unit(f"layer_{i:03d}-experts-{proj}-{e0:03d}-{e1 - 1:03d}", stack, idx, i, leaves,
                            source_bytes=sb, experts=(e0, e1)))
    return out


# -------------------------------------------------------------------------------------------- materialize


def _fp8_nan(x: np.ndarray) -> bool:
    return bool(((x.view(np.uint8) & 0x7F) == 0x7F).any())  # e4m3fn's only non-finite codes


def _read(ckpt: CheckpointDir, name: str, part: str, select, block) -> np.ndarray:
    """A source tensor as float32 / its stored float dtype ("value", fp8 dequantized), raw e4m3 ("fp8") or its
    float32 scales ("scale"), optionally restricted to experts [e0, e1) and rows [r0, r1) of a fused tensor."""
    w = ckpt.get(name)
    q = w.dtype == FP8_E4M3
    if part == "value" and not q:
        x = w if select is None else w[select[0]:select[1], select[2]:select[3]]
        return x
    s = ckpt.get(name + SCALE_SUFFIX)
    if select is not None:
        e0, e1, r0, r1 = select
        w, s = w[e0:e1], s[e0:e1]
        if part == "value":  # dequantize whole row blocks, then slice (r0 need not be block-aligned)
            return dequantize_fp8_blocks(w, s, block, name)[:, r0:r1]
        w, s = w[:, r0:r1], s[:, r0 // block[0]:-(-r1 // block[0])]
    if part == "value":
        return dequantize_fp8_blocks(w, s, block, name)
    if part == "fp8":
        x = np.array(w)
        if _fp8_nan(x):
            raise CheckpointError(f"tensor '{name}' contains NaN")
        return x
    return np.asarray(s, np.float32)


def _finish(x: np.ndarray, leaf: Leaf, cfg: DeepseekConfig, name: str) -> np.ndarray:
    if leaf.op:
        N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        w = np.asarray(x).reshape(N, P + V, L)
        x = w[:, :P, :] if leaf.op == "uk" else np.swapaxes(w[:, P:, :], 1, 2)
    if leaf.part == "fp8":
        return x
    x = np.asarray(x)
    if x.dtype.kind in "fV" and not np.isfinite(x).all():
        raise CheckpointError(f"tensor '{name}' contains NaN or Inf (corrupted?)")
    return x


def materialize(ckpt: CheckpointDir, leaf: Leaf, cfg: DeepseekConfig) -> np.ndarray:
    """Read, dequantize / slice / split and cast one leaf into a fresh array of its stored dtype."""
    block = fp8_block(cfg)
    out = np.empty(leaf.shape, _np_dtype(leaf.dtype))
    if leaf.stacked:
        for j, name in enumerate(leaf.sources):  # one expert at a time: no [E, ...] float32 temporary
            out[j] = _finish(_read(ckpt, name, leaf.part, None, block), leaf, cfg, name)
    else:
        out[...] = _finish(_read(ckpt, leaf.sources[0], leaf.part, leaf.select, block), leaf, cfg,
                           leaf.sources[0])
    return out


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


# ---------------------------------------------------------------------------------------------- progress


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Progress:
    """A stderr progress line with bytes/s: redrawn in place on a terminal, one line per ~2 s otherwise."""

    def __init__(self, total_bytes: int, total_groups: int, stream: TextIO | None):
        self.total, self.groups, self.stream = total_bytes, total_groups, stream
        self.t0 = self.last = time.monotonic()
        self.tty = bool(stream) and hasattr(stream, "isatty") and stream.isatty()

    def update(self, done: int, groups: int, label: str) -> None:
        if self.stream is None:
            return
        now = time.monotonic()
        final = groups == self.groups
        if not final and now - self.last < (0.1 if self.tty else 2.0):
            return
        self.last = now
        el = max(now - self.t0, 1e-9)
        rate = done / el
        eta = (self.total - done) / rate if rate > 0 else 0.0
        pct = 100.0 * done / max(self.total, 1)
        line = (f"converting {pct:5.1f}% [{groups}/{self.groups} groups] {_fmt_bytes(done)} / "
                f"{_fmt_bytes(self.total)}  {_fmt_bytes(rate)}/s  "
                + (f"{el:.1f} s" if final else f"ETA {eta:.0f} s") + f"  {label}")
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150) + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------ convert


@dataclasses.dataclass
class ConvertResult:
    out_dir: str | None
    groups: int
    params: int
    source_bytes: int
    stored_bytes: int
    largest_group_bytes: int
    skipped_mtp: int
    seconds: float


def _versions() -> dict[str, str]:
    from importlib import metadata as md
    out = {"python": sys.version.split()[0]}
    for pkg in ("mla-jax", "jax", "jaxlib", "orbax-checkpoint", "numpy", "ml_dtypes", "tensorstore"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_dirs(parent: str, name: str, kinds: tuple[str, ...]) -> list[str]:
    pat = re.compile(r"\." + re.escape(name) + r"\.(" + "|".join(kinds) + r")-(\d+)$")
    out = []
    for entry in os.listdir(parent):
        m = pat.match(entry)
        if m and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2))):
            out.append(os.path.join(parent, entry))
    return out


def _replaceable(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path) and (
        not os.listdir(path) or os.path.exists(os.path.join(path, METADATA)))


def _check_output(src: str, out: str, force: bool) -> None:
    src, out = os.path.realpath(src), os.path.realpath(out)
    if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise ConvertError(f"output {out} must not be the HF directory {src}, inside it, or contain it")
    if os.path.lexists(out):
        if not force:
            raise ConvertError(f"{out} already exists; pass --force to replace it")
        if not _replaceable(out):
            raise ConvertError(f"{out} exists and is not an mla-jax checkpoint (no {METADATA}); refusing to "
                               "replace it, even with --force")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def describe_plan(plan: Plan, src: str, out: str | None) -> list[str]:
    """The --dry-run mapping: HF name(s) -> our param path, shape, dtype (layers and expert chunks folded)."""
    cfg = plan.cfg
    lines = [f"{src} -> {out}",
             f"  {cfg.model_type}: {cfg.num_hidden_layers} layers "
             f"({cfg.num_dense_layers} dense, {cfg.num_hidden_layers - cfg.num_dense_layers} MoE), "
             f"experts {'fused' if plan.fused_experts else 'per expert'}, "
             + (f"{len(plan.quantized)} fp8 weights "
                f"{'kept as e4m3 + scale_inv' if plan.keep_fp8 else 'dequantized'}" if plan.quantized
                else "no fp8 weights") + f", dtype {plan.dtype.name}"]
    rows: dict[tuple, list] = {}
    all_experts = f"experts.{{0..{(cfg.n_routed_experts or 1) - 1}}}"
    for u in plan.units:
        for lf in u.leaves:
            full = (("model", u.stack) + lf.path) if u.stack else lf.path
            origin = re.sub(r"^model\.layers\.\d+\.", "", lf.origin)
            origin = re.sub(r"experts\.\{\d+\.\.\d+\}", all_experts, re.sub(r"\[\d+:\d+, ", "[:, ", origin))
            r = rows.setdefault(full, [[], origin, lf, u.stack])
            if u.layer >= 0 and u.layer not in r[0]:
                r[0].append(u.layer)
    for full, (layers, origin, lf, stack) in rows.items():
        shape = list(lf.shape)
        if "experts" in full:
            shape[0] = cfg.n_routed_experts
        if stack:
            shape = [len(layers)] + shape
            origin = f"model.layers.{{{layers[0]}..{layers[-1]}}}." + origin
        note = {"uk": "  (kv_b_proj rows [k_nope] per head)",
                "uv": "  (kv_b_proj rows [v] per head, transposed)"}.get(lf.op, "")
        if lf.part == "value" and any(s in plan.quantized for s in lf.sources):
            note += "  (fp8 dequantized)"
        lines.append(f"  {origin} -> {'/'.join(full)} {shape} {lf.dtype}{note}")
    lines.append(f"  {plan.num_params} params from {plan.source_tensors} HF tensors, in {len(plan.units)} units / "
                 f"{len(plan.groups)} groups; skipping {len(plan.skipped)} MTP tensors"
                 + (f" (model.layers.{cfg.num_hidden_layers}.*)" if plan.skipped else "")
                 + (f", ignoring {len(plan.ignored)} rotary inv_freq buffers" if plan.ignored else ""))
    lines.append(f"  source {_fmt_bytes(plan.source_bytes)}, output {_fmt_bytes(plan.stored_bytes)}, largest "
                 f"group {_fmt_bytes(plan.largest_group.nbytes)} (about the peak host memory)")
    return lines


def convert(hf_dir: str, out_dir: str, *, dtype: Any = "bf16", keep_fp8: bool = False, force: bool = False,
            dry_run: bool = False, max_group_mb: float = DEFAULT_MAX_GROUP_MB, log: TextIO | None = sys.stderr,
            progress: bool = True) -> ConvertResult:
    """Convert `hf_dir` (config.json + safetensors, single or sharded) into `out_dir`; see the module doc.
    Everything is validated from the headers before anything is written. `dry_run` prints the mapping to
    stdout and writes nothing. `log` gets the messages and the progress line (None: silent)."""
    t0 = time.monotonic()
    cfg = DeepseekConfig.from_json(hf_dir)
    ckpt = CheckpointDir(hf_dir)
    plan = make_plan(ckpt, cfg, dtype=dtype, keep_fp8=keep_fp8, max_group_mb=max_group_mb)

    def say(msg: str) -> None:
        if log is not None:
            log.write(msg + "\n")
            log.flush()

    def result(out):
        return ConvertResult(out, len(plan.groups), plan.num_params, plan.source_bytes, plan.stored_bytes,
                             plan.largest_group.nbytes, len(plan.skipped), time.monotonic() - t0)

    if dry_run:
        lines = describe_plan(plan, os.path.abspath(hf_dir), os.path.abspath(out_dir) + " (dry run)")
        try:
            _check_output(hf_dir, out_dir, force)
        except ConvertError as e:
            lines.append(f"  note: a real run would fail: {e}")
        print("\n".join(lines))
        return result(None)
    _check_output(hf_dir, out_dir, force)
    if keep_fp8 and not plan.quantized:
        say("note: --keep-fp8: the source has no fp8 weights; nothing to keep")
    if plan.skipped:
        say(f"skipping {len(plan.skipped)} MTP tensors (model.layers.{cfg.num_hidden_layers}.*): multi-token "
            "prediction is not used for inference here")

    out = os.path.abspath(out_dir)
    parent, name = os.path.dirname(out), os.path.basename(out)
    os.makedirs(parent, exist_ok=True)
    for stale in _stale_dirs(parent, name, ("partial",)):
        say(f"removing {stale}: left by an interrupted conversion")
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
        _write(plan, ckpt, tmp, Progress(plan.source_bytes, len(plan.groups), log if progress else None))
        for f in EXTRA_FILES:
            if os.path.isfile(os.path.join(hf_dir, f)):
                shutil.copyfile(os.path.join(hf_dir, f), os.path.join(tmp, f))
        shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(tmp, "config.json"))
        with open(os.path.join(tmp, METADATA), "w") as fh:  # last: its presence marks a complete checkpoint
            json.dump(_metadata(plan, ckpt, hf_dir), fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync(tmp)
        if os.path.lexists(out):
            _check_output(hf_dir, out_dir, force)  # it may have appeared meanwhile
            old = os.path.join(parent, f".{name}.old-{os.getpid()}")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        _fsync(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in _stale_dirs(parent, name, ("partial", "old")):
        shutil.rmtree(stale, ignore_errors=True)
    res = result(out)
    say(f"wrote {out}: {plan.num_params} params, {_fmt_bytes(plan.stored_bytes)} {plan.dtype.name}"
        f"{' + fp8' if keep_fp8 and plan.quantized else ''} in {len(plan.groups)} groups, {res.seconds:.1f} s")
    return res


def _write(plan: Plan, ckpt: CheckpointDir, tmp: str, prog: Progress) -> None:
    import orbax.checkpoint as ocp

    params_dir = os.path.join(tmp, PARAMS_DIR)
    os.mkdir(params_dir)
    pause = int(os.environ.get(PAUSE_ENV, "0") or 0)
    done = 0
    ck = ocp.PyTreeCheckpointer()
    try:
        for k, g in enumerate(plan.groups):
            tree: dict = {}
            for u in g.units:
                for lf in u.leaves:
                    _set(tree, (u.key,) + lf.path, materialize(ckpt, lf, plan.cfg))
            ck.save(os.path.join(params_dir, g.name), tree)
            del tree
            done += g.source_bytes
            prog.update(done, k + 1, g.units[-1].key)
            if pause and k + 1 == pause:
                sys.stderr.write(f"{PAUSE_ENV}: paused after {pause} groups\n")
                sys.stderr.flush()
                time.sleep(3600)
    finally:
        ck.close()


def _metadata(plan: Plan, ckpt: CheckpointDir, hf_dir: str) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds"),
        "source": {
            "path": os.path.abspath(hf_dir),
            "files": {os.path.basename(f.path): os.path.getsize(f.path) for f in ckpt.files},
            "model_type": plan.cfg.model_type,
            "transformers_version": hf_cfg.get("transformers_version"),
            "quantization_config": hf_cfg.get("quantization_config"),
            "fused_experts": plan.fused_experts,
        },
        "dtype": plan.dtype.name,
        "keep_fp8": bool(plan.keep_fp8 and plan.quantized),
        "fp8_block": list(fp8_block(plan.cfg)),
        "versions": _versions(),
        "tensors": {"source": plan.source_tensors, "skipped_mtp": len(plan.skipped), "ignored": len(plan.ignored),
                    "fp8_weights": len(plan.quantized), "params": plan.num_params,
                    "stored_arrays": sum(len(u.leaves) for u in plan.units)},
        "bytes": {"source": plan.source_bytes, "stored": plan.stored_bytes,
                  "largest_group": plan.largest_group.nbytes},
        "stacks": {name: {"first_layer": start, "num_layers": n} for name, start, n in layer_groups(plan.cfg)},
        "groups": [{"name": g.name, "units": [u.key for u in g.units]} for g in plan.groups],
        "units": [{"key": u.key, "stack": u.stack, "index": u.index, "layer": u.layer,
                   "experts": list(u.experts) if u.experts else None,
                   "leaves": [{"path": list(lf.path), "shape": list(lf.shape), "dtype": lf.dtype, "from": lf.origin}
                              for lf in u.leaves]} for u in plan.units],
    }


# --------------------------------------------------------------------------------------------------- load


def is_converted(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def read_metadata(path: str) -> dict:
    """The metadata of a converted checkpoint; CheckpointError if `path` is not a complete one."""
    mpath = os.path.join(path, METADATA)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory")
    if not os.path.isfile(mpath):
        raise CheckpointError(f"{path}: no {METADATA}: not a converted mla-jax checkpoint (or an interrupted "
                              "conversion)")
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{mpath}: corrupted ({e})") from None
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{mpath}: format {meta.get('format')!r} v{meta.get('format_version')!r} is not "
                              f"{FORMAT!r} v{FORMAT_VERSION}")
    return meta


def _is_router(path: tuple[str, ...]) -> bool:
    return path[-3:] in _ROUTER


def abstract_params(path: str, dtype: Any = None) -> tuple[DeepseekConfig, Params]:
    """(config, pytree of jax.ShapeDtypeStruct) of a converted checkpoint, without reading any array. Checked
    against the shapes the model needs for config.json."""
    meta = read_metadata(path)
    cfg = DeepseekConfig.from_json(path)
    target = _as_dtype(dtype) if dtype is not None else _np_dtype(meta["dtype"])
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
            _set(tree, p, jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(_F32 if _is_router(p) else target)))
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    got_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
    want_flat = {jax.tree_util.keystr(k): v.shape for k, v in jax.tree_util.tree_flatten_with_path(want)[0]}
    if cfg.topk_method != "noaux_tc":  # init_params always makes the V3 bias; other routers never read it
        want_flat = {k: v for k, v in want_flat.items() if "e_score_correction_bias" not in k}
    for k in sorted(set(got_flat) | set(want_flat)):
        if got_flat.get(k) != want_flat.get(k):
            raise CheckpointError(f"{path}: param {k} is {got_flat.get(k)} in {METADATA} but config.json needs "
                                  f"{want_flat.get(k)}")
    return cfg, tree


def _restore_group(ck, path: str, g: dict, units: dict[str, dict]) -> dict:
    import orbax.checkpoint as ocp

    gdir = os.path.join(path, PARAMS_DIR, g["name"])
    if not os.path.isdir(gdir):
        raise CheckpointError(f"{path}: group '{g['name']}' is missing ({gdir})")
    args: dict = {}
    for key in g["units"]:
        for lf in units[key]["leaves"]:
            _set(args, (key, *lf["path"]), ocp.RestoreArgs(restore_type=np.ndarray))
    try:
        tree = ck.restore(gdir, args=ocp.args.PyTreeRestore(restore_args=args))
    except Exception as e:  # orbax / tensorstore raise many types: name the group
        raise CheckpointError(f"{path}: cannot restore group '{g['name']}': {e}") from e
    for key in g["units"]:
        for lf in units[key]["leaves"]:
            name = "/".join((key, *lf["path"]))
            try:
                x = _get(tree, (key, *lf["path"]))
            except (KeyError, TypeError):
                raise CheckpointError(f"{gdir}: missing array {name}") from None
            want = (tuple(lf["shape"]), _np_dtype(lf["dtype"]))
            if (x.shape, x.dtype) != want:
                raise CheckpointError(f"{gdir}: array {name} is {x.shape} {x.dtype}, expected {want[0]} {want[1]}")
    return tree


def _collect(flat: dict, unit: dict, tree: dict, cfg: DeepseekConfig) -> None:
    """Add one restored unit's arrays to its layer's flat {path: array} (expert chunks into [E, ...])."""
    for lf in unit["leaves"]:
        p = tuple(lf["path"])
        x = _get(tree, p)
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
        dt = _F32 if _is_router(p) else target
        _set(out, p, x if x.dtype == dt else x.astype(dt))
    return out


def _alloc(spec):
    """Zeroed stacked buffers; module-level with a hashable spec so repeated loads reuse the compilation."""
    treedef, leaves = spec
    return jax.tree.unflatten(treedef, [jnp.zeros(shape, dt) for shape, dt in leaves])


def _update(stack, layer, i):
    """Write one layer into the stacked buffers (donated: in place, no second copy of the stack)."""
    return jax.tree.map(lambda s, x: jax.lax.dynamic_update_index_in_dim(s, x.astype(s.dtype), i, 0), stack, layer)


def load_checkpoint(path: str, *, dtype: Any = None, mesh: jax.sharding.Mesh | None = None
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
    target = _as_dtype(dtype) if dtype is not None else _np_dtype(meta["dtype"])
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
            (treedef, tuple((a.shape, a.dtype.name) for a in leaves)))  # one compile per stack, not per shape
        layer_sh[stack] = None if s_sh is None else jax.tree.map(
            lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:])), s_sh)
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
                        _set(params, p, put(x, _get(shardings, p) if shardings else None))
                    continue
                slot = (u["stack"], u["index"])
                _collect(pending.setdefault(slot, {}), u, tree[key], cfg)
                remaining[slot] -= 1
                if remaining[slot]:
                    continue
                layer = _finalize(pending.pop(slot), target, block)
                stack = u["stack"]
                if jax.tree.structure(layer) != jax.tree.structure(abstract["model"][stack]):
                    raise CheckpointError(f"{path}: the units of {stack}[{u['index']}] do not hold the layer's "
                                          "params")
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


def load_model(path: str, dtype: Any = None, mesh: jax.sharding.Mesh | None = None
               ) -> tuple[DeepseekConfig, Params]:
    """Load a converted mla-jax checkpoint or a Hugging Face checkpoint directory, optionally onto a
    tensor-parallel `mesh` (see `load_checkpoint`)."""
    path = os.fspath(path)
    if is_converted(path):
        return load_checkpoint(path, dtype=dtype, mesh=mesh)
    has_weights = os.path.isdir(path) and any(
        f == "model.safetensors.index.json" or (f.startswith("model") and f.endswith(".safetensors"))
        for f in os.listdir(path))
    if not (has_weights and os.path.isfile(os.path.join(path, "config.json"))):
        raise CheckpointError(f"{path}: neither a converted mla-jax checkpoint ({METADATA}) nor a Hugging Face "
                              "checkpoint (config.json + model*.safetensors)")
    cfg, params = load_hf_checkpoint(path, dtype=None if dtype is None else jnp.dtype(_as_dtype(dtype)))
    if mesh is not None:
        from mla_jax.sharding import shard_params
        params = shard_params(params, cfg, mesh)
    return cfg, params
