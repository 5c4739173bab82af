"""Export our params to a Hugging Face DeepSeek-V3 (or V3.2) checkpoint directory (the inverse of
`load_hf_checkpoint`).

    export_hf(params, cfg, tokenizer, out_dir)

writes config.json (model_type deepseek_v3 / deepseek_v32, architectures ["DeepseekV3ForCausalLM"] /
["DeepseekV32ForCausalLM"]), model.safetensors in the hub layout (kv_b_proj merged back from W_UK_T / W_UV, layers
unstacked to `model.layers.{i}.*`, experts to `mlp.experts.{j}.{gate,up,down}_proj.weight`, V3.2's lightning
indexer to `self_attn.indexer.*`), tokenizer.json and tokenizer_config.json. Weights are stored in `dtype` (bf16 by
default, as DeepSeek ships them) except `e_score_correction_bias` and the indexer's `weights_proj`, which stay
float32 as in the hub checkpoints. `load_hf_checkpoint(out_dir)` gives back exactly the params cast to those dtypes.

dtype="fp8" writes DeepSeek-V3's block-FP8 format: the `checkpoint.fp8.FP8_LINEARS` weights as e4m3 with a float32
`weight_scale_inv` per 128x128 block (params already in fp8, e.g. `load_model(..., weights="fp8")`, keep their
bytes; float ones are block-quantized by `quantize_params`, the error going into the safetensors metadata as
"fp8_quantization"), everything else bf16 (kv_b_proj too: we hold it split into W_UK_T / W_UV), and config.json
gains DeepSeek's quantization_config; `load_hf_checkpoint(out_dir, weights="fp8")` gives back the same e4m3 bytes.
Params holding fp8 pairs exported in a float dtype are dequantized.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks, fp8_scale_shape, quantize_params
from mla_jax.checkpoint.hf import save_file
from mla_jax.checkpoint.validate import hf_tensor_specs, mtp_tensor_specs
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import DTYPES
from mla_jax.model import MTP_GROUP, Params, param_groups

EXPORT_DTYPES = ("bf16", "fp16", "fp32", "fp8")
EXPORT_MODEL_TYPES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}
FP8_BLOCK = (128, 128)
# DeepSeek-V3's config.json entry for its block-FP8 weights (what `DeepseekConfig` parses back).
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": list(FP8_BLOCK),
}


def _export_dtype(dtype: str) -> np.dtype:
    """The dtype of the float tensors (dtype="fp8": bf16, beside the e4m3 linears)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {EXPORT_DTYPES}")
    return DTYPES["bf16" if dtype == "fp8" else dtype]


def merge_kv_b_proj(w_uk_t: jnp.ndarray, w_uv: jnp.ndarray) -> jnp.ndarray:
    """W_UK_T [N, P, L], W_UV [N, L, V] -> kv_b_proj.weight [N*(P+V), L] (per head: k_nope rows, then v rows).
    Exact inverse of `mla.split_kv_b_proj`."""
    N, P, L = w_uk_t.shape
    w = jnp.concatenate([w_uk_t, jnp.swapaxes(w_uv, 1, 2)], axis=1)  # [N, P+V, L]
    return w.reshape(N * w.shape[1], L)


def hf_config_dict(
    cfg: DeepseekConfig, *, dtype: str = "bf16", bos_token_id: int | None = None, eos_token_id: int | None = None
) -> dict[str, Any]:
    """config.json for transformers' DeepseekV3ForCausalLM (and our `DeepseekConfig.from_json`)."""
    if cfg.model_type not in EXPORT_MODEL_TYPES:
        raise ValueError(f"export writes DeepSeek-V3 and V3.2 checkpoints; config has model_type {cfg.model_type!r}")
    d: dict[str, Any] = {
        "architectures": [EXPORT_MODEL_TYPES[cfg.model_type]],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_attention_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "topk_method": cfg.topk_method,
        "scoring_func": cfg.scoring_func,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        # Our rope rotates interleaved pairs, as DeepSeek's checkpoints are laid out (HF: rope_interleave=True).
        "rope_interleave": True,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": _export_dtype(dtype).name,  # bfloat16, float16, float32
    }
    if cfg.use_sparse:  # DeepSeek-V3.2's lightning indexer (every layer has its own)
        d |= {"index_topk": cfg.index_topk, "index_n_heads": cfg.index_n_heads, "index_head_dim": cfg.index_head_dim}
    rs = cfg.rope_scaling
    if rs is None:
        d["rope_scaling"] = None
    else:
        d["rope_scaling"] = {
            "type": "yarn",
            "factor": rs.factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
            "beta_fast": rs.beta_fast,
            "beta_slow": rs.beta_slow,
            "mscale": rs.mscale,
            "mscale_all_dim": rs.mscale_all_dim,
        }
    if dtype == "fp8":
        d["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    if cfg.num_mtp_layers:
        d["num_nextn_predict_layers"] = cfg.num_mtp_layers
    if bos_token_id is not None:
        d["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        d["eos_token_id"] = eos_token_id
    return d


def hf_tensors(params: Params, cfg: DeepseekConfig, *, dtype: str = "bf16") -> dict[str, np.ndarray]:
    """Our (prepared) params -> {HF tensor name: numpy array} in the hub layout, in `hf_tensor_specs` order (each
    fp8 weight followed by its `weight_scale_inv`). dtype="fp8": float `FP8_LINEARS` weights are block-quantized
    here (`export_hf` does it first, to report the error)."""
    wdt = _export_dtype(dtype)
    fp8 = dtype == "fp8"
    if fp8:
        params, _ = quantize_params(params, block=FP8_BLOCK)
    model = params["model"]
    out: dict[str, np.ndarray] = {}

    def put(name: str, x, keep_f32: bool = False):
        out[name] = np.asarray(jax.device_get(x), np.float32).astype(np.float32 if keep_f32 else wdt)

    def put_linear(name: str, node: dict):
        """A linear's weight: an fp8 pair ({"weight": e4m3, "weight_scale_inv"}) as e4m3 + scales when exporting
        fp8, else dequantized; a float weight cast."""
        if "weight_scale_inv" not in node:
            put(name, node["weight"])
            return
        w, s = np.asarray(jax.device_get(node["weight"])), np.asarray(jax.device_get(node["weight_scale_inv"]))
        if fp8:
            out[name], out[name + SCALE_SUFFIX] = w, s.astype(np.float32)
        else:
            out[name] = dequantize_fp8_blocks(w, s, FP8_BLOCK, name).astype(wdt)

    put("model.embed_tokens.weight", model["embed_tokens"]["weight"])
    mtp_opt = []
    for group, start, n in param_groups(cfg):
        stacked = model[group]
        for k in range(n):
            lp = jax.tree.map(lambda x: x[k], stacked)
            pre = f"model.layers.{start + k}."
            if group == MTP_GROUP:
                for rel, (_, optional) in mtp_tensor_specs(cfg).items():
                    node = lp
                    for part in rel.split(".")[:-1]:
                        node = node.get(part) if isinstance(node, dict) else None
                    if isinstance(node, dict) and "weight" in node:
                        put_linear(pre + rel, node)
                        if optional:
                            mtp_opt.append((pre + rel, out[pre + rel].shape))
            put(pre + "input_layernorm.weight", lp["input_layernorm"]["weight"])
            put(pre + "post_attention_layernorm.weight", lp["post_attention_layernorm"]["weight"])
            a = lp["self_attn"]
            for key in (
                "q_proj",
                "q_a_proj",
                "q_a_layernorm",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_a_layernorm",
                "o_proj",
            ):
                if key in a:
                    put_linear(pre + f"self_attn.{key}.weight", a[key])
            kv_b = a["kv_b_proj"]["weight"] if "kv_b_proj" in a else merge_kv_b_proj(a["W_UK_T"], a["W_UV"])
            put(pre + "self_attn.kv_b_proj.weight", kv_b)
            if cfg.use_sparse:  # weights_proj stays float32, as HF's checkpoints and our loader keep it
                ind, ip = pre + "self_attn.indexer.", a["indexer"]
                for key in ("wq_b", "wk", "k_norm"):
                    put_linear(ind + f"{key}.weight", ip[key])
                put(ind + "k_norm.bias", ip["k_norm"]["bias"])
                put(ind + "weights_proj.weight", ip["weights_proj"]["weight"], keep_f32=True)
            m = lp["mlp"]
            if cfg.is_moe_layer(start + k):
                put(pre + "mlp.gate.weight", m["gate"]["weight"])
                if cfg.topk_method == "noaux_tc":
                    put(pre + "mlp.gate.e_score_correction_bias", m["gate"]["e_score_correction_bias"], keep_f32=True)
                for j in range(cfg.n_routed_experts):
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        expert = {k: v[j] for k, v in m["experts"][proj].items()}
                        put_linear(pre + f"mlp.experts.{j}.{proj}.weight", expert)
                if cfg.n_shared_experts:
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        put_linear(pre + f"mlp.shared_experts.{proj}.weight", m["shared_experts"][proj])
            else:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    put_linear(pre + f"mlp.{proj}.weight", m[proj])
    put("model.norm.weight", model["norm"]["weight"])
    if not cfg.tie_word_embeddings:
        put("lm_head.weight", params["lm_head"]["weight"])
    specs = hf_tensor_specs(cfg) | dict(mtp_opt)
    scales = {n for n in out if n.endswith(SCALE_SUFFIX)}
    if set(specs) != set(out) - scales:
        raise ValueError(f"export produced {sorted((set(out) - scales) ^ set(specs))[:3]} not matching the HF layout")
    for name, shape in specs.items():
        if out[name].shape != shape:
            raise ValueError(f"tensor '{name}' has shape {out[name].shape}, expected {shape}")
        if name + SCALE_SUFFIX in scales and out[name + SCALE_SUFFIX].shape != fp8_scale_shape(shape, FP8_BLOCK):
            raise ValueError(f"tensor '{name}{SCALE_SUFFIX}' has shape {out[name + SCALE_SUFFIX].shape}")
    ordered = {}
    for name in specs:
        ordered[name] = out[name]
        if name + SCALE_SUFFIX in scales:
            ordered[name + SCALE_SUFFIX] = out[name + SCALE_SUFFIX]
    return ordered


def export_hf(
    params: Params,
    cfg: DeepseekConfig,
    tokenizer: Any,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bf16",
    eos_token: str | None = "<|endoftext|>",
    model_max_length: int | None = None,
    metadata: dict[str, str] | None = None,
) -> dict[str, int]:
    """Writes config.json, model.safetensors, tokenizer.json, tokenizer_config.json into out_dir (created).

    `tokenizer` is a `tokenizers.Tokenizer`, a path to a tokenizer.json, or its JSON text; `eos_token` (looked up
    in its vocab) becomes bos/eos_token_id, so `mla-jax generate` stops there. dtype="fp8": see the module
    docstring; the block-quantization error of float weights (`quantize_params`: max_rel, rms_rel, tensors) is
    the model.safetensors metadata "fp8_quantization" (JSON). Returns {file: bytes}.
    """
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    if hasattr(tokenizer, "to_str"):
        tok_json = tokenizer.to_str()
    elif isinstance(tokenizer, (str, os.PathLike)) and os.path.exists(tokenizer):
        with open(tokenizer) as f:
            tok_json = f.read()
    elif isinstance(tokenizer, str):
        tok_json = tokenizer
    else:
        raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, a path or JSON text, got {type(tokenizer)}")
    vocab = json.loads(tok_json)["model"]["vocab"]
    added = {t["content"]: t["id"] for t in json.loads(tok_json).get("added_tokens", [])}
    eos_id = None
    if eos_token is not None:
        eos_id = added.get(eos_token, vocab.get(eos_token))
        if eos_id is None:
            raise ValueError(f"eos token {eos_token!r} is not in the tokenizer")
    n_tok = max([*vocab.values(), *added.values()]) + 1
    if n_tok > cfg.vocab_size:
        raise ValueError(f"tokenizer has {n_tok} ids but the model's vocab_size is {cfg.vocab_size}")

    meta = {"format": "pt", **(metadata or {})}
    if dtype == "fp8":
        params, err = quantize_params(params, block=FP8_BLOCK)  # float FP8_LINEARS -> e4m3 (fp8 ones kept)
        if err["tensors"]:
            meta["fp8_quantization"] = json.dumps(err)
    tensors = hf_tensors(params, cfg, dtype=dtype)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=meta)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, dtype=dtype, bos_token_id=eos_id, eos_token_id=eos_id), f, indent=2)
        f.write("\n")
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(tok_json)
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    if eos_token is not None:
        tcfg |= {"bos_token": eos_token, "eos_token": eos_token}
    if model_max_length:
        tcfg["model_max_length"] = model_max_length
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tcfg, f, indent=2)
        f.write("\n")
    return {n: os.path.getsize(os.path.join(out_dir, n)) for n in sorted(os.listdir(out_dir))}
