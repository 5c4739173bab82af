"""An HF checkpoint against its config, from the headers only: tensor names and shapes (`hf_tensor_specs`),
float dtypes, and the fp8 weights' block scales. Raises `CheckpointError` naming the first bad tensor."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterable

import numpy as np

from mla_jax.checkpoint.fp8 import SCALE_SUFFIX, fp8_block, fp8_scale_shape
from mla_jax.checkpoint.hf import CheckpointDir, CheckpointError
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import BF16, FP8_E4M3, FP8_E5M2

IGNORED = re.compile(r".*rotary_emb\.inv_freq$")  # buffers some exports include; never used


def hf_tensor_specs(cfg: DeepseekConfig, *, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint for `cfg` must hold, with its shape: the layers, then the loaded MTP layers'
    (their decoder layer plus `mtp_tensor_specs`, optional ones excluded; none unless `cfg.num_mtp_layers`)."""
    D = cfg.hidden_size
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_hidden_layers + cfg.num_mtp_layers):
        pre = f"model.layers.{i}."
        if i >= cfg.num_hidden_layers:
            s.update({pre + k: shape for k, (shape, optional) in mtp_tensor_specs(cfg).items() if not optional})
        s.update({pre + k: v for k, v in layer_tensor_specs(cfg, i, fused_experts=fused_experts).items()})
    return s


def layer_tensor_specs(
    cfg: DeepseekConfig, i: int, *, fused_experts: bool = False, indexer: bool | None = None
) -> dict[str, tuple[int, ...]]:
    """The tensors of decoder layer i (names relative to `model.layers.{i}.`) with their shapes. `indexer`:
    whether it has the lightning indexer's tensors (default: `cfg.is_indexer_layer(i)`)."""
    D, N, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    P, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    s: dict[str, tuple[int, ...]] = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,)}
    a = "self_attn."
    if cfg.q_lora_rank is None:
        s[a + "q_proj.weight"] = (N * (P + R), D)
    else:
        s[a + "q_a_proj.weight"] = (cfg.q_lora_rank, D)
        s[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        s[a + "q_b_proj.weight"] = (N * (P + R), cfg.q_lora_rank)
    s[a + "kv_a_proj_with_mqa.weight"] = (L + R, D)
    s[a + "kv_a_layernorm.weight"] = (L,)
    s[a + "kv_b_proj.weight"] = (N * (P + V), L)
    s[a + "o_proj.weight"] = (D, N * V)
    if cfg.is_indexer_layer(i) if indexer is None else indexer:
        s.update({a + "indexer." + k: shape for k, shape in indexer_tensor_specs(cfg).items()})
    m = "mlp."
    if cfg.is_moe_layer(i):
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        s[m + "gate.weight"] = (E, D)
        if cfg.topk_method == "noaux_tc":
            s[m + "gate.e_score_correction_bias"] = (E,)
        if fused_experts:
            s[m + "experts.gate_up_proj"] = (E, 2 * I, D)
            s[m + "experts.down_proj"] = (E, D, I)
        else:
            for j in range(E):
                s[m + f"experts.{j}.gate_proj.weight"] = (I, D)
                s[m + f"experts.{j}.up_proj.weight"] = (I, D)
                s[m + f"experts.{j}.down_proj.weight"] = (D, I)
        if cfg.n_shared_experts:
            Is = I * cfg.n_shared_experts
            s[m + "shared_experts.gate_proj.weight"] = (Is, D)
            s[m + "shared_experts.up_proj.weight"] = (Is, D)
            s[m + "shared_experts.down_proj.weight"] = (D, Is)
    else:
        s[m + "gate_proj.weight"] = (cfg.intermediate_size, D)
        s[m + "up_proj.weight"] = (cfg.intermediate_size, D)
        s[m + "down_proj.weight"] = (D, cfg.intermediate_size)
    return s


def indexer_tensor_specs(cfg: DeepseekConfig) -> dict[str, tuple[int, ...]]:
    """The lightning indexer's tensors of one layer (names under `self_attn.indexer.`) with their shapes."""
    H, Di, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    return {
        "wq_b.weight": (H * Di, cfg.q_lora_rank),
        "wk.weight": (Di, D),
        "k_norm.weight": (Di,),
        "k_norm.bias": (Di,),
        "weights_proj.weight": (H, D),
    }


def indexer_source_layer(cfg: DeepseekConfig, i: int) -> int:
    """The layer whose indexer tensors fill layer i's indexer params: its own, or for a layer that shares an
    earlier top-k (no indexer in the checkpoint) the group's full layer, as a placeholder it never reads."""
    return max(j for j in range(i + 1) if cfg.is_indexer_layer(j))


# An MTP layer's own tensors (DeepSeek-V3's `model.layers.{num_hidden_layers + i}.*`, as vLLM's deepseek_mtp names
# them), besides the decoder layer's (`mtp_block`) names; embed_tokens and shared_head.head repeat the model's.
MTP_TENSORS = (
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
    "embed_tokens.weight",
)
MTP_REQUIRED = MTP_TENSORS[:4]  # present in every MTP layer (the last two only in some exports)


@functools.lru_cache(maxsize=64)
def _mtp_decoder_names(cfg: DeepseekConfig, layer: int) -> frozenset[str]:
    names: set[str] = set()
    for fused in (False, True):
        names |= set(layer_tensor_specs(cfg, layer, fused_experts=fused, indexer=cfg.use_sparse))
    return frozenset(names)


def mtp_layer_index(name: str, cfg: DeepseekConfig) -> int | None:
    """i when `name` is a tensor of multi-token-prediction layer i: `model.layers.{num_hidden_layers + i}.*` with
    i < `cfg.num_nextn_predict_layers`, named as an MTP tensor (enorm, hnorm, eh_proj, shared_head.norm/head,
    embed_tokens) or as one of a decoder layer's, or one's fp8 `_scale_inv`; None for every other name.

    The one place that decides which tensors are MTP ones: the loaders load the `cfg.num_mtp_layers` complete
    ones (`resolve_mtp`) and skip the rest (`is_mtp`); any other name beyond the config's layers is an error."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if not m:
        return None
    layer, rel = int(m.group(1)), m.group(2)
    i = layer - cfg.num_hidden_layers
    if not 0 <= i < cfg.num_nextn_predict_layers:
        return None
    if rel.endswith(SCALE_SUFFIX):
        rel = rel[: -len(SCALE_SUFFIX)]
    return i if rel in MTP_TENSORS or rel in _mtp_decoder_names(cfg, layer) else None


def mtp_tensor_specs(cfg: DeepseekConfig) -> dict[str, tuple[tuple[int, ...], bool]]:
    """An MTP layer's tensors besides its decoder layer (names under `model.layers.{i}.`) -> (shape, optional).
    `embed_tokens` and `shared_head.head` hold the target's embedding / lm_head in DeepSeek's checkpoints; absent,
    the target's serve (`mla_jax.mtp`)."""
    D, V = cfg.hidden_size, cfg.vocab_size
    return {
        "enorm.weight": ((D,), False),
        "hnorm.weight": ((D,), False),
        "eh_proj.weight": ((D, 2 * D), False),
        "shared_head.norm.weight": ((D,), False),
        "shared_head.head.weight": ((V, D), True),
        "embed_tokens.weight": ((V, D), True),
    }


def resolve_mtp(cfg: DeepseekConfig, names: Iterable[str]) -> DeepseekConfig:
    """`cfg` with mtp_loaded = False unless the checkpoint holds every tensor of its MTP layers: many checkpoints
    drop the MTP layer, or keep only part of it, but keep the config field; they load as before, without MTP,
    their MTP tensors skipped (`is_mtp`). The engine names the missing weights when asked for MTP speculation."""
    if not cfg.num_mtp_layers:
        return cfg
    names = set(names)
    need = set(hf_tensor_specs(cfg, fused_experts=any(n.endswith("mlp.experts.gate_up_proj") for n in names)))
    mtp = [n for n in need if re.match(r"model\.layers\.(\d+)\.", n) and int(n.split(".")[2]) >= cfg.num_hidden_layers]
    if all(n in names for n in mtp):
        return cfg
    return dataclasses.replace(cfg, mtp_loaded=False)


def mtp_optional_present(names: Iterable[str], cfg: DeepseekConfig) -> tuple[str, ...]:
    """The optional MTP tensors (relative names) the checkpoint holds, the same for every loaded MTP layer."""
    names = set(names)
    N, n = cfg.num_hidden_layers, cfg.num_mtp_layers
    out = []
    for k, (_, optional) in mtp_tensor_specs(cfg).items():
        have = [f"model.layers.{i}.{k}" in names for i in range(N, N + n)]
        if optional and any(have):
            if not all(have):
                raise CheckpointError(
                    f"tensor 'model.layers.{N + have.index(False)}.{k}' is missing (other MTP layers have it)"
                )
            out.append(k)
    return tuple(out)


def is_mtp(name: str, cfg: DeepseekConfig) -> bool:
    """A tensor of a multi-token-prediction layer that is not loaded, so skipped (`mtp_layer_index` names it and
    its layer is past the `cfg.num_mtp_layers` loaded ones: e.g. every MTP layer of a sparse-attention model, or
    of a checkpoint that keeps only part of one)."""
    i = mtp_layer_index(name, cfg)
    return i is not None and i >= cfg.num_mtp_layers


def check_float_dtype(name: str, dtype: np.dtype) -> None:
    if dtype == FP8_E5M2:
        raise CheckpointError(
            f"tensor '{name}' is float8_e5m2: unsupported quantization (only DeepSeek's e4m3 with 128x128 block scales)"
        )
    if dtype.kind not in "fV":
        raise CheckpointError(f"tensor '{name}' has dtype {dtype}, expected a float type")


def check_fp8_scales(ckpt: CheckpointDir, cfg: DeepseekConfig, names: Iterable[str]) -> list[str]:
    """Each e4m3 weight among `names` has a float `_scale_inv` of the block shape; no e5m2; no scale without an
    fp8 weight. Returns the fp8 weight names."""
    block = fp8_block(cfg)
    quantized = []
    for n in names:
        dtype, shape = ckpt.spec(n)
        sname = n + SCALE_SUFFIX
        if dtype == FP8_E4M3:
            if sname not in ckpt:
                raise CheckpointError(f"tensor '{n}' is fp8 but '{sname}' is missing")
            sdtype, sshape = ckpt.spec(sname)
            if sdtype.kind != "f" and sdtype != BF16:
                raise CheckpointError(f"tensor '{sname}' has dtype {sdtype}, expected float32")
            want = fp8_scale_shape(shape, block) if len(shape) >= 2 else None
            if sshape != want:
                raise CheckpointError(
                    f"tensor '{sname}' has shape {sshape}, expected {want} for weight {shape} "
                    f"with {block[0]}x{block[1]} blocks"
                )
            quantized.append(n)
        else:
            check_float_dtype(n, dtype)
            if sname in ckpt:
                raise CheckpointError(f"tensor '{sname}' is a block scale but '{n}' is {dtype}, not fp8")
    return quantized


def check_tensors(ckpt: CheckpointDir, cfg: DeepseekConfig) -> tuple[bool, list[str]]:
    """Names, shapes, dtypes and fp8 scales against `cfg` (after `resolve_mtp`); returns (fused_experts, skipped
    MTP names). Every name must be one `cfg` needs, an fp8 scale of one, a rotary buffer, or a skipped MTP
    layer's (`is_mtp`); anything else (junk, or the layers of a checkpoint deeper than the config) is an error
    naming it."""
    names = set(ckpt.keys())
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    specs = hf_tensor_specs(cfg, fused_experts=fused)
    N = cfg.num_hidden_layers
    for k in mtp_optional_present(names, cfg):
        for i in range(N, N + cfg.num_mtp_layers):
            specs[f"model.layers.{i}.{k}"] = mtp_tensor_specs(cfg)[k][0]
    mtp = sorted(n for n in names if is_mtp(n, cfg))
    scales = {n for n in names if n.endswith(SCALE_SUFFIX)}
    missing = sorted(set(specs) - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{ckpt.path}: missing tensor '{missing[0]}'{more}")
    unexpected = sorted(names - set(specs) - set(mtp) - scales - {n for n in names if IGNORED.match(n)})
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        m = re.match(r"model\.layers\.(\d+)\.", unexpected[0])
        why = ""
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            why = (
                f": config.json has num_hidden_layers {cfg.num_hidden_layers} and num_nextn_predict_layers "
                f"{cfg.num_nextn_predict_layers} (MTP layers may only hold MTP and decoder-layer tensors)"
            )
        raise CheckpointError(f"{ckpt.path}: unexpected tensor '{unexpected[0]}'{more}{why}")
    for n in sorted(scales):
        base = n[: -len(SCALE_SUFFIX)]
        if base not in names:
            raise CheckpointError(f"{ckpt.path}: unexpected tensor '{n}' (no weight '{base}')")
    for i in sorted({mtp_layer_index(n, cfg) for n in mtp}):
        pre = f"model.layers.{cfg.num_hidden_layers + i}."
        lacking = [pre + k for k in MTP_REQUIRED if pre + k not in names]
        if len(lacking) == len(MTP_REQUIRED):  # a decoder layer, not an MTP one (some missing: a partial MTP layer)
            raise CheckpointError(
                f"{ckpt.path}: '{pre}*' is not an MTP layer (no '{lacking[0]}'): does config.json's "
                f"num_hidden_layers {cfg.num_hidden_layers} match the checkpoint's layers?"
            )
    for n, shape in specs.items():
        _, got = ckpt.spec(n)
        if got != shape:
            raise CheckpointError(f"tensor '{n}' has shape {got}, expected {shape}")
    check_fp8_scales(ckpt, cfg, specs)
    return fused, mtp
