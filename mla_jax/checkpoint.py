"""Load a Hugging Face DeepSeek checkpoint directory (config.json + safetensors) into our params pytree.

Accepted layouts: single `model.safetensors` or shards with `model.safetensors.index.json`; experts per expert
(`mlp.experts.{j}.{gate,up,down}_proj.weight`, the hub format) or transformers' fused layout
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]); bf16/fp16/fp32 weights, and
DeepSeek-V3's FP8 e4m3 weights with float32 `weight_scale_inv` over 128x128 blocks (dequantized: w * scale_inv).
The MTP layer (`model.layers.{num_hidden_layers}.*`) is skipped.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mla_jax.config import DeepseekConfig
from mla_jax.model import Params, layer_groups, prepare_params, stack_layers
from mla_jax.safetensors_io import CheckpointDir, CheckpointError

_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def hf_tensor_specs(cfg: DeepseekConfig, *, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint for `cfg` holds (MTP layer excluded), with its shape."""
    D, N, L, R = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    P, V = cfg.qk_nope_head_dim, cfg.v_head_dim
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        s[pre + "input_layernorm.weight"] = (D,)
        s[pre + "post_attention_layernorm.weight"] = (D,)
        a = pre + "self_attn."
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
        m = pre + "mlp."
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


FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


def fp8_block(cfg: DeepseekConfig) -> tuple[int, int]:
    return cfg.quantization.weight_block_size if cfg.quantization else (128, 128)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """[..., M, K] weight -> [..., ceil(M/bm), ceil(K/bk)] scale_inv."""
    return (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def dequantize_fp8_blocks(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128),
                          name: str = "?") -> np.ndarray:
    """DeepSeek block FP8: w e4m3 [..., M, K], scale_inv f32 [..., ceil(M/bm), ceil(K/bk)] -> f32 w * scale_inv
    per block (a multiply despite the name); edge blocks are partial. Leading dims (stacked or fused experts)
    are batch dims."""
    bm, bk = block
    if w.ndim < 2:
        raise CheckpointError(f"tensor '{name}' is fp8 with shape {w.shape}: block scales need >= 2 dims")
    M, K = w.shape[-2:]
    want = fp8_scale_shape(w.shape, block)
    if scale_inv.shape != want:
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' has shape {scale_inv.shape}, expected {want} for "
                              f"weight {w.shape} with {bm}x{bk} blocks")
    # A 256-entry table is exact and much faster than ml_dtypes' element-wise fp8 -> f32 cast.
    out = _FP8_TABLE[np.asarray(w).view(np.uint8)]
    scale = np.asarray(scale_inv, np.float32)
    for r in range(want[-2]):  # one row of blocks at a time: no full-size float32 scale temporary
        out[..., r * bm:(r + 1) * bm, :] *= np.repeat(scale[..., r, :], bk, axis=-1)[..., None, :K]
    return out


_FP8_TABLE = np.arange(256, dtype=np.uint8).view(FP8_E4M3).astype(np.float32)


def _is_mtp(name: str, cfg: DeepseekConfig) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= cfg.num_hidden_layers


def read_tensor(ckpt: CheckpointDir, name: str, cfg: DeepseekConfig) -> np.ndarray:
    """One tensor, dequantized when it is a block-FP8 weight with a `_scale_inv` companion."""
    w = ckpt.get(name)
    if w.dtype == FP8_E4M3:
        sname = name + SCALE_SUFFIX
        if sname not in ckpt:
            raise CheckpointError(f"tensor '{name}' is fp8 but '{sname}' is missing")
        return dequantize_fp8_blocks(w, ckpt.get(sname), fp8_block(cfg), name)
    _check_float_dtype(name, w.dtype)
    return w


def _check_float_dtype(name: str, dtype: np.dtype) -> None:
    if dtype == FP8_E5M2:
        raise CheckpointError(f"tensor '{name}' is float8_e5m2: unsupported quantization (only DeepSeek's "
                              "e4m3 with 128x128 block scales)")
    if dtype.kind not in "fV":
        raise CheckpointError(f"tensor '{name}' has dtype {dtype}, expected a float type")


def check_fp8_scales(ckpt: CheckpointDir, cfg: DeepseekConfig, names: Iterable[str]) -> list[str]:
    """Header-only checks of the fp8 weights among `names`: each e4m3 weight has a float `_scale_inv` of the
    block shape; no e5m2; no scale without an fp8 weight. Returns the fp8 weight names."""
    block = fp8_block(cfg)
    quantized = []
    for n in names:
        dtype, shape = ckpt.spec(n)
        sname = n + SCALE_SUFFIX
        if dtype == FP8_E4M3:
            if sname not in ckpt:
                raise CheckpointError(f"tensor '{n}' is fp8 but '{sname}' is missing")
            sdtype, sshape = ckpt.spec(sname)
            if sdtype.kind != "f" and sdtype != np.dtype(ml_dtypes.bfloat16):
                raise CheckpointError(f"tensor '{sname}' has dtype {sdtype}, expected float32")
            want = fp8_scale_shape(shape, block) if len(shape) >= 2 else None
            if sshape != want:
                raise CheckpointError(f"tensor '{sname}' has shape {sshape}, expected {want} for weight {shape} "
                                      f"with {block[0]}x{block[1]} blocks")
            quantized.append(n)
        else:
            _check_float_dtype(n, dtype)
            if sname in ckpt:
                raise CheckpointError(f"tensor '{sname}' is a block scale but '{n}' is {dtype}, not fp8")
    return quantized


def check_tensors(ckpt: CheckpointDir, cfg: DeepseekConfig) -> tuple[bool, list[str]]:
    """Validates names and shapes against `cfg`; returns (fused_experts, skipped MTP names)."""
    names = set(ckpt.keys())
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    specs = hf_tensor_specs(cfg, fused_experts=fused)
    mtp = sorted(n for n in names if _is_mtp(n, cfg))
    scales = {n for n in names if n.endswith("_scale_inv")}
    missing = sorted(set(specs) - names)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{ckpt.path}: missing tensor '{missing[0]}'{more}")
    unexpected = sorted(names - set(specs) - set(mtp) - scales - {n for n in names if _IGNORED.match(n)})
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{ckpt.path}: unexpected tensor '{unexpected[0]}'{more}")
    for n in sorted(scales):
        base = n[: -len("_scale_inv")]
        if base not in names and not _is_mtp(n, cfg):
            raise CheckpointError(f"{ckpt.path}: unexpected tensor '{n}' (no weight '{base}')")
    for n, shape in specs.items():
        dtype, got = ckpt.spec(n)
        if got != shape:
            raise CheckpointError(f"tensor '{n}' has shape {got}, expected {shape}")
    check_fp8_scales(ckpt, cfg, specs)
    return fused, mtp


def build_params(get: Callable[[str], np.ndarray], cfg: DeepseekConfig, *, fused_experts: bool,
                 dtype: Any = None) -> Params:
    """Assemble our params from HF-named tensors. `dtype` casts weights (router weights stay float32)."""

    def arr(x, keep_f32=False):
        x = np.asarray(x)
        if keep_f32:
            return jnp.asarray(x, jnp.float32)
        return jnp.asarray(x, dtype) if dtype is not None else jnp.asarray(x)

    def linear(name):
        return {"weight": arr(get(name + ".weight"))}

    def layer(i: int) -> Params:
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        attn: Params = {k: linear(a + k) for k in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        keys = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
        attn |= {k: linear(a + k) for k in keys}
        m = pre + "mlp."
        if cfg.is_moe_layer(i):
            gate = {"weight": arr(get(m + "gate.weight"), keep_f32=True)}
            if cfg.topk_method == "noaux_tc":
                gate["e_score_correction_bias"] = arr(get(m + "gate.e_score_correction_bias"), keep_f32=True)
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            if fused_experts:
                gu = np.asarray(get(m + "experts.gate_up_proj"))
                experts = {"gate_proj": {"weight": arr(gu[:, :I])}, "up_proj": {"weight": arr(gu[:, I:])},
                           "down_proj": {"weight": arr(get(m + "experts.down_proj"))}}
            else:
                experts = {k: {"weight": arr(np.stack([np.asarray(get(m + f"experts.{j}.{k}.weight"))
                                                       for j in range(E)]))}
                           for k in ("gate_proj", "up_proj", "down_proj")}
            mlp: Params = {"gate": gate, "experts": experts}
            if cfg.n_shared_experts:
                mlp["shared_experts"] = {k: linear(m + "shared_experts." + k)
                                         for k in ("gate_proj", "up_proj", "down_proj")}
        else:
            mlp = {k: linear(m + k) for k in ("gate_proj", "up_proj", "down_proj")}
        return {"input_layernorm": linear(pre + "input_layernorm"), "self_attn": attn,
                "post_attention_layernorm": linear(pre + "post_attention_layernorm"), "mlp": mlp}

    model: Params = {"embed_tokens": linear("model.embed_tokens"), "norm": linear("model.norm")}
    for name, start, n in layer_groups(cfg):
        model[name] = stack_layers([layer(i) for i in range(start, start + n)])
    params: Params = {"model": model}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = linear("lm_head")
    return prepare_params(params, cfg)


def load_hf_checkpoint(path: str, *, dtype: Any = None) -> tuple[DeepseekConfig, Params]:
    """config.json + safetensors in `path` -> (config, params). `dtype` (e.g. jnp.bfloat16) casts the weights;
    None keeps the stored float dtype (fp8 weights are dequantized to float32)."""
    cfg = DeepseekConfig.from_json(path)
    ckpt = CheckpointDir(path)
    fused, _ = check_tensors(ckpt, cfg)
    return cfg, build_params(lambda n: read_tensor(ckpt, n, cfg), cfg, fused_experts=fused, dtype=dtype)


def skipped_mtp_tensors(names: Iterable[str], cfg: DeepseekConfig) -> list[str]:
    return sorted(n for n in names if _is_mtp(n, cfg))
