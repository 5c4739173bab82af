"""HF tensors -> our params pytree (`build_params`), and `load_hf_checkpoint`, which loads an HF directory
directly into memory.

Accepted layouts: single `model.safetensors` or shards with `model.safetensors.index.json`; experts per expert
(`mlp.experts.{j}.{gate,up,down}_proj.weight`, the hub format) or transformers' fused layout
(`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]); bf16/fp16/fp32 weights, and
DeepSeek-V3's block FP8 weights (dequantized). The MTP layers (`model.layers.{num_hidden_layers + j}.*`, config
`num_nextn_predict_layers`) go to `params["model"]["mtp_layers"]` (`mla_jax.mtp`) when whole; other MTP tensors
(`validate.is_mtp`) are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from mla_jax.checkpoint.fp8 import (
    FP8_LINEARS,
    SCALE_SUFFIX,
    check_weights,
    dequantize_fp8_blocks,
    fp8_block,
    quantize_fp8_blocks,
)
from mla_jax.checkpoint.hf import CheckpointDir, CheckpointError
from mla_jax.checkpoint.validate import (
    check_float_dtype,
    check_tensors,
    indexer_source_layer,
    mtp_optional_present,
    mtp_tensor_specs,
    resolve_mtp,
)
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import FP8_E4M3
from mla_jax.model import MTP_GROUP, Params, param_groups, prepare_params, stack_layers


def read_tensor(ckpt: CheckpointDir, name: str, cfg: DeepseekConfig) -> np.ndarray:
    """One tensor, dequantized to float32 when it is a block-FP8 weight with a `_scale_inv` companion."""
    w = ckpt.get(name)
    if w.dtype == FP8_E4M3:
        sname = name + SCALE_SUFFIX
        if sname not in ckpt:
            raise CheckpointError(f"tensor '{name}' is fp8 but '{sname}' is missing")
        return dequantize_fp8_blocks(w, ckpt.get(sname), fp8_block(cfg), name)
    check_float_dtype(name, w.dtype)
    return w


def read_fp8(ckpt: CheckpointDir, name: str, cfg: DeepseekConfig) -> tuple[np.ndarray, np.ndarray]:
    """A weight for `weights="fp8"`: the checkpoint's e4m3 + scale_inv as stored, or a float weight block-quantized."""
    w = ckpt.get(name)
    if w.dtype == FP8_E4M3:
        sname = name + SCALE_SUFFIX
        if sname not in ckpt:
            raise CheckpointError(f"tensor '{name}' is fp8 but '{sname}' is missing")
        s = ckpt.get(sname)
        dequantize_fp8_blocks(w[..., :1, :1], s[..., :1, :1], fp8_block(cfg), name)  # validates the block dims
        if tuple(fp8_block(cfg)) != (128, 128):
            raise CheckpointError(f"tensor '{name}': fp8 at run time needs 128x128 blocks, not {fp8_block(cfg)}")
        return w, s
    check_float_dtype(name, w.dtype)
    return quantize_fp8_blocks(w)


def build_params(
    get: Callable[[str], np.ndarray],
    cfg: DeepseekConfig,
    *,
    fused_experts: bool,
    dtype: Any = None,
    get_fp8: Callable[[str], tuple[np.ndarray, np.ndarray]] | None = None,
    mtp_optional: tuple[str, ...] = (),
) -> Params:
    """Assemble our params from HF-named tensors. `dtype` casts weights (router weights stay float32). With
    `get_fp8` (weights="fp8") the `FP8_LINEARS` keep e4m3 weights + float32 `weight_scale_inv` (HF names).
    `mtp_optional` names the optional MTP tensors present (`validate.mtp_optional_present`)."""

    def fp8_pair(name):
        w, s = get_fp8(name)
        return {"weight": jnp.asarray(w), "weight_scale_inv": jnp.asarray(s, jnp.float32)}

    def arr(x, keep_f32=False):
        x = np.asarray(x)
        if keep_f32:
            return jnp.asarray(x, jnp.float32)
        return jnp.asarray(x, dtype) if dtype is not None else jnp.asarray(x)

    def linear(name):
        if get_fp8 is not None and name.rsplit(".", 1)[-1] in FP8_LINEARS:
            return fp8_pair(name + ".weight")
        return {"weight": arr(get(name + ".weight"))}

    def layer(i: int) -> Params:
        pre = f"model.layers.{i}."
        a = pre + "self_attn."
        attn: Params = {k: linear(a + k) for k in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")}
        keys = ("q_proj",) if cfg.q_lora_rank is None else ("q_a_proj", "q_a_layernorm", "q_b_proj")
        attn |= {k: linear(a + k) for k in keys}
        if cfg.use_sparse:
            ind = f"model.layers.{indexer_source_layer(cfg, i)}.self_attn.indexer."
            attn["indexer"] = {
                "wq_b": linear(ind + "wq_b"),
                "wk": linear(ind + "wk"),
                "k_norm": {"weight": arr(get(ind + "k_norm.weight")), "bias": arr(get(ind + "k_norm.bias"))},
                "weights_proj": {"weight": arr(get(ind + "weights_proj.weight"), keep_f32=True)},
            }  # f32 as in HF
        m = pre + "mlp."
        if cfg.is_moe_layer(i):
            gate = {"weight": arr(get(m + "gate.weight"), keep_f32=True)}
            if cfg.topk_method == "noaux_tc":
                gate["e_score_correction_bias"] = arr(get(m + "gate.e_score_correction_bias"), keep_f32=True)
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            if get_fp8 is not None:
                if fused_experts:
                    raise CheckpointError("weights='fp8' does not take transformers' fused expert layout")
                experts = {}
                for k in ("gate_proj", "up_proj", "down_proj"):
                    pairs = [get_fp8(m + f"experts.{j}.{k}.weight") for j in range(E)]
                    experts[k] = {
                        "weight": jnp.asarray(np.stack([w for w, _ in pairs])),
                        "weight_scale_inv": jnp.asarray(np.stack([s for _, s in pairs]), jnp.float32),
                    }
            elif fused_experts:
                gu = np.asarray(get(m + "experts.gate_up_proj"))
                experts = {
                    "gate_proj": {"weight": arr(gu[:, :I])},
                    "up_proj": {"weight": arr(gu[:, I:])},
                    "down_proj": {"weight": arr(get(m + "experts.down_proj"))},
                }
            else:
                experts = {
                    k: {"weight": arr(np.stack([np.asarray(get(m + f"experts.{j}.{k}.weight")) for j in range(E)]))}
                    for k in ("gate_proj", "up_proj", "down_proj")
                }
            mlp: Params = {"gate": gate, "experts": experts}
            if cfg.n_shared_experts:
                mlp["shared_experts"] = {
                    k: linear(m + "shared_experts." + k) for k in ("gate_proj", "up_proj", "down_proj")
                }
        else:
            mlp = {k: linear(m + k) for k in ("gate_proj", "up_proj", "down_proj")}
        return {
            "input_layernorm": linear(pre + "input_layernorm"),
            "self_attn": attn,
            "post_attention_layernorm": linear(pre + "post_attention_layernorm"),
            "mlp": mlp,
        }

    model: Params = {"embed_tokens": linear("model.embed_tokens"), "norm": linear("model.norm")}

    def mtp_extra(i: int) -> Params:
        out: Params = {}
        for k, (_, optional) in mtp_tensor_specs(cfg).items():
            if not optional or k in mtp_optional:
                path = k.split(".")[:-1]
                node = out
                for p in path[:-1]:
                    node = node.setdefault(p, {})
                node[path[-1]] = linear(f"model.layers.{i}.{k[: -len('.weight')]}")
        return out

    for name, start, n in param_groups(cfg):
        if name == MTP_GROUP:
            try:  # a caller's unresolved config (`validate.resolve_mtp`) for a checkpoint without the MTP layer
                get(f"model.layers.{start}.self_attn.kv_a_proj_with_mqa.weight")
            except CheckpointError:
                continue
        extra = mtp_extra if name == MTP_GROUP else (lambda i: {})
        model[name] = stack_layers([layer(i) | extra(i) for i in range(start, start + n)])
    params: Params = {"model": model}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = linear("lm_head")
    return prepare_params(params, cfg)


def load_hf_checkpoint(
    path: str, *, dtype: Any = None, weights: str = "bf16", progress: bool = False
) -> tuple[DeepseekConfig, Params]:
    """config.json + safetensors in `path` -> (config, params). `dtype` (e.g. jnp.bfloat16) casts the weights;
    None keeps the stored float dtype (fp8 weights are dequantized to float32). weights="fp8": the
    `FP8_LINEARS` stay e4m3 + scale_inv (an FP8 checkpoint's as stored, float ones block-quantized) and the
    other weights default to bfloat16 (the fp8 GEMMs' activation dtype). `progress`: a bar over the bytes
    read, on stderr."""
    from tqdm import tqdm

    ckpt = CheckpointDir(path)
    cfg = resolve_mtp(DeepseekConfig.from_json(path), ckpt.keys())
    fused, mtp = check_tensors(ckpt, cfg)
    opt = mtp_optional_present(ckpt.keys(), cfg)
    skip = set(mtp)
    total = sum(ckpt.nbytes(n) for n in ckpt.keys() if n not in skip)
    keep_fp8 = check_weights(weights) == "fp8"
    if keep_fp8 and dtype is None:
        dtype = jnp.bfloat16
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading", disable=not progress, leave=False) as bar:

        def counted(read):
            def get(name: str):
                x = read(name)
                scale = ckpt.nbytes(name + SCALE_SUFFIX) if name + SCALE_SUFFIX in ckpt else 0
                bar.update(ckpt.nbytes(name) + scale)
                return x

            return get

        get_fp8 = counted(lambda n: read_fp8(ckpt, n, cfg)) if keep_fp8 else None
        get = counted(lambda n: read_tensor(ckpt, n, cfg))
        return cfg, build_params(get, cfg, fused_experts=fused, dtype=dtype, get_fp8=get_fp8, mtp_optional=opt)
