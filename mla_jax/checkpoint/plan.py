"""Conversion planning: which arrays a converted checkpoint stores, from which HF tensors, packed how.

Orbax writes a whole pytree per save, so the converter saves one *group* at a time, which bounds its host
memory by the largest group instead of the model. A *unit* is the embedding, one layer minus its routed experts
(`layer_007-core`: norms, attention with W_UK_T / W_UV already split from kv_b_proj, router, dense or shared
MLP, all in our final layout), one chunk of one expert projection stacked [e0:e1, out, in]
(`layer_007-experts-gate_proj-000-031`; a V3 layer's experts are 22 GB in bf16, so E is cut into chunks of at
most `max_group_mb`), or the final norm + lm_head. Consecutive units are packed into groups of at most
`max_group_mb` (default 2 GiB): a tiny model is one group, DeepSeek-V3 a few hundred. Peak host memory is about
max(max_group_mb, largest unit) plus allocator slack.

FP8 weights are dequantized to `dtype` by default. With `keep_fp8=True` they are stored as e4m3 next to a
`weight_scale_inv` leaf (about half the disk of bf16) and dequantized per layer on load. kv_b_proj is always
dequantized (it is split per head into W_UK_T / W_UV across block boundaries). The router is kept in float32.
With `weights="fp8"` every `fp8.FP8_LINEARS` weight is stored as e4m3 + scale_inv: an fp8 source's as is, a
float source's block-quantized at conversion (write.py reports the quantization error).
The MTP layers (model.layers.{num_hidden_layers + j}.*, config num_nextn_predict_layers) are the stack
`mtp_layers`, a layer's units plus enorm, hnorm, eh_proj, shared_head (and embed_tokens when present); MTP
layers not loaded (`validate.is_mtp`, named by `validate.mtp_layer_index`) are skipped and counted.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
from tqdm import tqdm

from mla_jax.checkpoint.fp8 import FP8_LINEARS, SCALE_SUFFIX, check_weights, fp8_block, fp8_scale_shape
from mla_jax.checkpoint.hf import CheckpointDir, CheckpointError
from mla_jax.checkpoint.validate import (
    IGNORED,
    check_fp8_scales,
    check_tensors,
    indexer_source_layer,
    indexer_tensor_specs,
    mtp_optional_present,
    mtp_tensor_specs,
    resolve_mtp,
)
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import BF16, F32, as_dtype
from mla_jax.model import MTP_GROUP, param_groups

DEFAULT_MAX_GROUP_MB = 2048


class ConvertError(CheckpointError):
    """The conversion cannot proceed (output directory, options); the message says why."""


def weight_dtype(d: Any) -> np.dtype:
    """The dtype converted weights are stored or loaded in: bf16 or fp32 (names as in `dtypes.DTYPES`)."""
    dt = as_dtype(d)
    if dt not in (BF16, F32):
        raise ConvertError(f"dtype {d!r} is not supported (bf16, fp32)")
    return dt


def fmt_bytes(n: float) -> str:
    return tqdm.format_sizeof(n, "B")


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
    """The smallest piece written at once (see the module doc); its leaves' paths are relative to its layer."""

    key: str  # no dots: orbax joins tree keys with "."
    stack: str | None  # "dense_layers" | "moe_layers"; None: top-level leaves (paths from the root)
    index: int  # position in the stack
    layer: int  # HF layer index, -1 for top-level units
    leaves: list[Leaf]
    source_bytes: int = 0
    experts: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        return sum(math.prod(lf.shape) * as_dtype(lf.dtype).itemsize for lf in self.leaves)


@dataclasses.dataclass
class Group:
    """Consecutive units written as one orbax checkpoint {unit key: unit tree}."""

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
    weights: str = "bf16"  # "fp8": FP8_LINEARS stored as e4m3 + scale_inv (float sources block-quantized)

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


def make_plan(
    ckpt: CheckpointDir,
    cfg: DeepseekConfig,
    *,
    dtype: Any = "bf16",
    keep_fp8: bool = False,
    max_group_mb: float = DEFAULT_MAX_GROUP_MB,
    weights: str = "bf16",
) -> Plan:
    """Validate the checkpoint against `cfg` (headers only: names, shapes, dtypes, fp8 scales; nothing is read)
    and plan units and groups. Raises CheckpointError naming the first bad tensor."""
    dtype = weight_dtype(dtype)
    fp8_out = check_weights(weights) == "fp8"  # FP8_LINEARS stored e4m3 + scale (float sources block-quantized)
    if not max_group_mb > 0:
        raise ConvertError(f"max_group_mb must be > 0, got {max_group_mb}")
    cfg = resolve_mtp(cfg, ckpt.keys())
    fused, mtp = check_tensors(ckpt, cfg)
    names = ckpt.keys()
    ignored = sorted(n for n in names if IGNORED.match(n))
    skipped = sorted(set(mtp) | {n for n in names if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in mtp})
    drop = set(skipped) | set(ignored)
    used = [n for n in names if n not in drop and not n.endswith(SCALE_SUFFIX)]
    quantized = set(check_fp8_scales(ckpt, cfg, used))
    block = fp8_block(cfg)
    D = dtype.name
    N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    max_bytes = max(1, int(max_group_mb * 2**20))

    def weight(path, name, shape, out_dtype=D) -> list[Leaf]:
        if (keep_fp8 and name in quantized) or (fp8_out and path[-1] == "weight" and path[-2] in FP8_LINEARS):
            return [
                Leaf(path, shape, "float8_e4m3fn", (name,), name, part="fp8"),
                Leaf(
                    path[:-1] + ("weight" + SCALE_SUFFIX,),
                    fp8_scale_shape(shape, block),
                    "float32",
                    (name,),
                    name + SCALE_SUFFIX,
                    part="scale",
                ),
            ]
        return [Leaf(path, shape, out_dtype, (name,), name)]

    def src_bytes(name: str) -> int:
        return ckpt.nbytes(name) + (ckpt.nbytes(name + SCALE_SUFFIX) if name in quantized else 0)

    units: list[Unit] = []

    def add(unit: Unit) -> None:
        if not unit.source_bytes:
            unit.source_bytes = sum(src_bytes(s) for s in {s for lf in unit.leaves for s in lf.sources})
        units.append(unit)

    vocab_shape = (cfg.vocab_size, cfg.hidden_size)
    add(
        Unit(
            "embed", None, 0, -1, weight(("model", "embed_tokens", "weight"), "model.embed_tokens.weight", vocab_shape)
        )
    )
    mtp_keys = [k for k, (_, opt) in mtp_tensor_specs(cfg).items() if not opt or k in mtp_optional_present(names, cfg)]
    for stack, start, n in param_groups(cfg):
        for idx in range(n):
            i = start + idx
            pre = f"model.layers.{i}."
            leaves: list[Leaf] = []

            def hf(rel: str, pre=pre) -> tuple[tuple[str, ...], str, tuple[int, ...]]:
                return tuple(rel.split(".")), pre + rel, ckpt.spec(pre + rel)[1]

            for rel in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                leaves += weight(*hf(rel))
            if stack == MTP_GROUP:
                for rel in mtp_keys:
                    leaves += weight(*hf(rel))
            keys = ["q_proj"] if cfg.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"]
            for k in keys + ["kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj"]:
                leaves += weight(*hf(f"self_attn.{k}.weight"))
            kvb = pre + "self_attn.kv_b_proj.weight"  # always dequantized: split per head across 128-row blocks
            leaves += [
                Leaf(("self_attn", "W_UK_T"), (N, P, L), D, (kvb,), kvb, op="uk"),
                Leaf(("self_attn", "W_UV"), (N, L, V), D, (kvb,), kvb, op="uv"),
            ]
            if cfg.use_sparse:  # a layer sharing an earlier top-k stores its group's indexer (never read)
                ind = f"model.layers.{indexer_source_layer(cfg, i)}.self_attn.indexer."
                for rel in indexer_tensor_specs(cfg):
                    keep_f32 = rel.startswith("weights_proj")  # float32 in HF
                    leaves += weight(
                        ("self_attn", "indexer", *rel.split(".")),
                        ind + rel,
                        ckpt.spec(ind + rel)[1],
                        out_dtype="float32" if keep_f32 else D,
                    )
            if cfg.is_moe_layer(i):
                leaves += weight(*hf("mlp.gate.weight"), out_dtype="float32")
                if cfg.topk_method == "noaux_tc":
                    leaves += weight(*hf("mlp.gate.e_score_correction_bias"), out_dtype="float32")
                if cfg.n_shared_experts:
                    for k in ("gate_proj", "up_proj", "down_proj"):
                        leaves += weight(*hf(f"mlp.shared_experts.{k}.weight"))
                add(Unit(f"layer_{i:03d}-core", stack, idx, i, leaves))
                for u in _expert_units(
                    cfg, i, stack, idx, fused, quantized, keep_fp8, block, D, max_bytes, src_bytes, fp8_out
                ):
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
    return Plan(cfg, dtype, keep_fp8, fused, sorted(quantized), skipped, ignored, units, groups, n_src, weights)


def _expert_units(
    cfg: DeepseekConfig,
    i: int,
    stack: str,
    idx: int,
    fused: bool,
    quantized: set[str],
    keep_fp8: bool,
    block: tuple[int, int],
    D: str,
    max_bytes: int,
    src_bytes: Callable[[str], int],
    fp8_out: bool = False,
) -> list[Unit]:
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
            if q and (keep_fp8 or fp8_out) and (rows[0] % block[0] or rows[1] % block[0]):
                raise ConvertError(
                    f"tensor '{src}': cannot keep fp8 when splitting gate/up at row {I}, which is "
                    f"not a multiple of the {block[0]}-row scale block (convert without "
                    "--keep-fp8)"
                )
        else:
            q = pre + f"0.{proj}.weight" in quantized
        store = "float8_e4m3fn" if (q and keep_fp8) or fp8_out else D
        per_expert = math.prod(shape) * as_dtype(store).itemsize
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
            leaves = [
                Leaf(
                    path,
                    (n, *shape),
                    store,
                    srcs,
                    origin,
                    part="fp8" if store != D else "value",
                    select=sel,
                    stacked=not fused,
                )
            ]
            if store != D:
                leaves.append(
                    Leaf(
                        path[:-1] + ("weight" + SCALE_SUFFIX,),
                        (n, *fp8_scale_shape(shape, block)),
                        "float32",
                        srcs,
                        origin + SCALE_SUFFIX,
                        part="scale",
                        select=sel,
                        stacked=not fused,
                    )
                )
            out.append(
                Unit(
                    f"layer_{i:03d}-experts-{proj}-{e0:03d}-{e1 - 1:03d}",
                    stack,
                    idx,
                    i,
                    leaves,
                    source_bytes=sb,
                    experts=(e0, e1),
                )
            )
    return out


def describe_plan(plan: Plan, src: str, out: str | None) -> list[str]:
    """The --dry-run mapping: HF name(s) -> our param path, shape, dtype (layers and expert chunks folded)."""
    cfg = plan.cfg
    lines = [
        f"{src} -> {out}",
        f"  {cfg.model_type}: {cfg.num_hidden_layers} layers "
        f"({cfg.num_dense_layers} dense, {cfg.num_hidden_layers - cfg.num_dense_layers} MoE), "
        f"experts {'fused' if plan.fused_experts else 'per expert'}, "
        + (
            f"{len(plan.quantized)} fp8 weights {'kept as e4m3 + scale_inv' if plan.keep_fp8 else 'dequantized'}"
            if plan.quantized
            else "no fp8 weights"
        )
        + f", dtype {plan.dtype.name}",
    ]
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
        note = {"uk": "  (kv_b_proj rows [k_nope] per head)", "uv": "  (kv_b_proj rows [v] per head, transposed)"}.get(
            lf.op, ""
        )
        if lf.part == "value" and any(s in plan.quantized for s in lf.sources):
            note += "  (fp8 dequantized)"
        lines.append(f"  {origin} -> {'/'.join(full)} {shape} {lf.dtype}{note}")
    lines.append(
        f"  {plan.num_params} params from {plan.source_tensors} HF tensors, in {len(plan.units)} units / "
        f"{len(plan.groups)} groups; skipping {len(plan.skipped)} MTP tensors"
        + (f" (model.layers.{cfg.num_hidden_layers}.*)" if plan.skipped else "")
        + (f", ignoring {len(plan.ignored)} rotary inv_freq buffers" if plan.ignored else "")
    )
    lines.append(
        f"  source {fmt_bytes(plan.source_bytes)}, output {fmt_bytes(plan.stored_bytes)}, largest "
        f"group {fmt_bytes(plan.largest_group.nbytes)} (about the peak host memory)"
    )
    return lines
