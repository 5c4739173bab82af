"""DeepSeek V2 / V2-Lite / V3 / V3.2 (and GLM-MoE-DSA) configuration, read from a Hugging Face `config.json`.

Shape legend used across the project: B batch (requests), T tokens, N heads, D hidden, L kv_lora_rank (512),
R qk_rope_head_dim (64), P qk_nope_head_dim (128), V v_head_dim (128), G page size, E routed experts; for
DeepSeek Sparse Attention (V3.2's lightning indexer) H_I index_n_heads (64), D_I index_head_dim (128),
K index_topk (2048).

Sparse models: `deepseek_v32` runs the indexer in every layer; `glm_moe_dsa` may mark layers "shared"
(`indexer_types`), which reuse the top-k of the last "full" layer before them (vLLM's index groups).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

# The published configs (hub config.json fields), for benchmarks, notebooks and tests: `DeepseekConfig.from_dict`.
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    vocab_size=129280,
    hidden_size=7168,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    moe_layer_freq=1,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-6,
    rope_theta=10000,
    max_position_embeddings=163840,
    tie_word_embeddings=False,
    hidden_act="silu",
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    quantization_config=dict(activation_scheme="dynamic", fmt="e4m3", quant_method="fp8", weight_block_size=[128, 128]),
)
DEEPSEEK_V32 = dict(DEEPSEEK_V3, model_type="deepseek_v32", index_topk=2048, index_n_heads=64, index_head_dim=128)
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    n_routed_experts=64,
    n_shared_experts=2,
    num_experts_per_tok=6,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    topk_method="greedy",
    scoring_func="softmax",
    n_group=1,
    topk_group=1,
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling=dict(
        type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=0.707,
        mscale_all_dim=0.707,
    ),
)


class ConfigError(ValueError):
    """A config.json field is missing or invalid; the message names it."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """DeepSeek's YaRN: `rope_scaling` (or transformers 5's `rope_parameters`) with type "yarn"."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class QuantizationConfig:
    """DeepSeek-V3's FP8 block quantization (`quant_method: fp8`, e4m3, 128x128 weight blocks)."""

    quant_method: str
    fmt: str
    weight_block_size: tuple[int, int]
    activation_scheme: str = "dynamic"


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    model_type: str  # "deepseek_v2" | "deepseek_v3"
    vocab_size: int
    hidden_size: int  # D
    num_hidden_layers: int
    num_attention_heads: int  # N
    q_lora_rank: int | None  # None: q_proj directly (V2-Lite)
    kv_lora_rank: int  # L
    qk_nope_head_dim: int  # P
    qk_rope_head_dim: int  # R
    v_head_dim: int  # V
    intermediate_size: int  # dense MLP
    moe_intermediate_size: int
    n_routed_experts: int | None  # E; None: dense model
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    scoring_func: str  # "softmax" | "sigmoid"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = False
    quantization: QuantizationConfig | None = None
    # DeepSeek Sparse Attention (None: a dense model).
    index_topk: int | None = None  # K
    index_n_heads: int = 0  # H_I
    index_head_dim: int = 0  # D_I (its first R dims carry RoPE)
    index_rope_interleave: bool = False  # V3.2: half-split RoPE in the indexer; GLM-MoE-DSA: interleaved pairs
    indexer_types: tuple[str, ...] | None = None  # per layer "full" (runs the indexer) | "shared" (reuses)
    # Multi-token prediction (DeepSeek-V3 MTP): layers `model.layers.{num_hidden_layers + i}.*` in the checkpoint.
    num_nextn_predict_layers: int = 0
    # Whether the checkpoint holds the MTP layers whole, so they load (`checkpoint.validate.resolve_mtp`); a
    # checkpoint that drops them, or keeps part of one, loads without MTP and its MTP tensors are skipped.
    mtp_loaded: bool = True

    # Derived dims.
    @property
    def qk_head_dim(self) -> int:
        """P + R = 192: the per-head query/key width of the un-absorbed attention."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_row_dim(self) -> int:
        """L + R = 576: one latent cache row per token (512 latent, then 64 rope)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 times YaRN's mscale^2. Absorption keeps the dot products equal, so the absorbed
        576-wide decode uses this same scale; 576^-0.5 would flatten every distribution."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            m = yarn_get_mscale(rs.factor, rs.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        return self.n_routed_experts is not None and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def use_sparse(self) -> bool:
        """DeepSeek Sparse Attention: MLA reads only the indexer's top `index_topk` tokens of each query."""
        return self.index_topk is not None

    def is_indexer_layer(self, i: int) -> bool:
        """Layer i runs its own indexer ("full"); a "shared" layer reuses the previous full layer's top-k."""
        return self.use_sparse and (self.indexer_types is None or self.indexer_types[i] == "full")

    @property
    def num_indexer_layers(self) -> int:
        """Layers with an indexer, hence with an index-key cache."""
        return sum(self.is_indexer_layer(i) for i in range(self.num_hidden_layers))

    def indexer_slot(self, i: int) -> int:
        """Index-key cache layer of the indexer whose top-k layer i uses (its own, or its group's)."""
        return sum(self.is_indexer_layer(j) for j in range(i + 1)) - 1

    @property
    def shares_topk(self) -> bool:
        """Some layer reuses another's top-k (index groups of more than one layer)."""
        return self.use_sparse and self.num_indexer_layers < self.num_hidden_layers

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers loaded and run (speculative decoding). Sparse-attention models' MTP layers are not
        supported: their tensors are skipped as before."""
        return 0 if self.use_sparse or not self.mtp_loaded else self.num_nextn_predict_layers

    @property
    def num_dense_layers(self) -> int:
        return sum(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeepseekConfig":
        return _parse(d)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "DeepseekConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config.json not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return _parse(d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


_SUPPORTED = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
_SPARSE = ("deepseek_v32", "glm_moe_dsa")


def _get(
    d: Mapping[str, Any],
    key: str,
    typ: type | tuple[type, ...],
    default: Any = ...,
    *,
    positive: bool = False,
    aliases: tuple[str, ...] = (),
) -> Any:
    for k in (key, *aliases):
        if k in d and d[k] is not None:
            v = d[k]
            break
    else:
        if default is ...:
            raise ConfigError(f"config.json: missing required field '{key}'")
        return default
    if typ is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if isinstance(v, bool) and typ is not bool:
        raise ConfigError(f"config.json: field '{key}' must be {typ}, got bool {v!r}")
    if not isinstance(v, typ):
        raise ConfigError(
            f"config.json: field '{key}' must be {getattr(typ, '__name__', typ)}, got {type(v).__name__} {v!r}"
        )
    if positive and not v > 0:
        raise ConfigError(f"config.json: field '{key}' must be > 0, got {v!r}")
    return v


def _parse_rope(d: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); hub checkpoints `rope_scaling`.
    rp = d.get("rope_parameters") or {}
    rs = d.get("rope_scaling") or {}
    for name, v in (("rope_parameters", rp), ("rope_scaling", rs)):
        if not isinstance(v, Mapping):
            raise ConfigError(f"config.json: field '{name}' must be an object or null, got {v!r}")
    theta = d.get("rope_theta", rp.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"config.json: field 'rope_theta' must be a positive number, got {theta!r}")
    src = rs or rp
    kind = src.get("type", src.get("rope_type", "default")) if src else "default"
    if kind in ("default", None):
        return float(theta), None
    if kind != "yarn":
        raise ConfigError(f"config.json: rope_scaling type '{kind}' is not supported (only 'yarn')")
    name = "rope_scaling" if rs else "rope_parameters"
    factor = _get(src, "factor", float, positive=True)
    omax = _get(src, "original_max_position_embeddings", int, positive=True)
    scaling = RopeScaling(
        factor=factor,
        original_max_position_embeddings=omax,
        beta_fast=_get(src, "beta_fast", float, 32.0),
        beta_slow=_get(src, "beta_slow", float, 1.0),
        mscale=_get(src, "mscale", float, 1.0),
        mscale_all_dim=_get(src, "mscale_all_dim", float, 0.0),
    )
    if "attention_factor" in src and src["attention_factor"] is not None:
        raise ConfigError(f"config.json: {name}.attention_factor is not supported for DeepSeek YaRN")
    return float(theta), scaling


def _parse_quant(d: Mapping[str, Any]) -> QuantizationConfig | None:
    q = d.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, Mapping):
        raise ConfigError(f"config.json: field 'quantization_config' must be an object or null, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(
            f"config.json: quantization_config.quant_method '{method}' is not supported (only DeepSeek's block fp8)"
        )
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"config.json: quantization_config.fmt '{fmt}' is not supported (only e4m3)")
    block = q.get("weight_block_size")
    if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ConfigError(
            f"config.json: quantization_config.weight_block_size must be two positive ints, got {block!r}"
        )
    return QuantizationConfig(method, fmt, (block[0], block[1]), q.get("activation_scheme", "dynamic"))


def _parse(d: Mapping[str, Any]) -> DeepseekConfig:
    if not isinstance(d, Mapping):
        raise ConfigError("config.json: top level must be an object")
    model_type = _get(d, "model_type", str)
    if model_type not in _SUPPORTED:
        raise ConfigError(f"config.json: model_type '{model_type}' is not supported ({', '.join(_SUPPORTED)})")
    v3 = model_type != "deepseek_v2"  # V3.2 and GLM-MoE-DSA route like V3 (sigmoid, noaux_tc)
    theta, rope_scaling = _parse_rope(d)
    n_heads = _get(d, "num_attention_heads", int, positive=True)
    n_kv = d.get("num_key_value_heads", n_heads)
    if n_kv != n_heads:
        raise ConfigError(
            f"config.json: num_key_value_heads ({n_kv}) must equal num_attention_heads ({n_heads}) for MLA"
        )
    experts = _get(d, "n_routed_experts", int, None, aliases=("num_experts", "num_local_experts"))
    q_lora = d.get("q_lora_rank")
    if q_lora is not None and (not isinstance(q_lora, int) or isinstance(q_lora, bool) or q_lora <= 0):
        raise ConfigError(f"config.json: field 'q_lora_rank' must be a positive int or null, got {q_lora!r}")
    cfg = DeepseekConfig(
        model_type=model_type,
        vocab_size=_get(d, "vocab_size", int, positive=True),
        hidden_size=_get(d, "hidden_size", int, positive=True),
        num_hidden_layers=_get(d, "num_hidden_layers", int, positive=True),
        num_attention_heads=n_heads,
        q_lora_rank=q_lora,
        kv_lora_rank=_get(d, "kv_lora_rank", int, positive=True),
        qk_nope_head_dim=_get(d, "qk_nope_head_dim", int, positive=True),
        qk_rope_head_dim=_get(d, "qk_rope_head_dim", int, positive=True),
        v_head_dim=_get(d, "v_head_dim", int, positive=True),
        intermediate_size=_get(d, "intermediate_size", int, positive=True),
        moe_intermediate_size=_get(d, "moe_intermediate_size", int, 0) if experts else 0,
        n_routed_experts=experts,
        n_shared_experts=_get(d, "n_shared_experts", int, 0),
        num_experts_per_tok=_get(d, "num_experts_per_tok", int, 0),
        first_k_dense_replace=_get(d, "first_k_dense_replace", int, 0),
        moe_layer_freq=_get(d, "moe_layer_freq", int, 1, positive=True),
        topk_method=_get(d, "topk_method", str, "noaux_tc" if v3 else "greedy"),
        scoring_func=_get(d, "scoring_func", str, "sigmoid" if v3 else "softmax"),
        n_group=_get(d, "n_group", int, 1, positive=True),
        topk_group=_get(d, "topk_group", int, 1, positive=True),
        norm_topk_prob=_get(d, "norm_topk_prob", bool, v3),
        routed_scaling_factor=_get(d, "routed_scaling_factor", float, 1.0),
        rms_norm_eps=_get(d, "rms_norm_eps", float, 1e-6, positive=True),
        rope_theta=theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=_get(d, "max_position_embeddings", int, positive=True),
        tie_word_embeddings=_get(d, "tie_word_embeddings", bool, False),
        hidden_act=_get(d, "hidden_act", str, "silu"),
        attention_bias=_get(d, "attention_bias", bool, False),
        quantization=_parse_quant(d),
        num_nextn_predict_layers=_get(d, "num_nextn_predict_layers", int, 0),
        **(_parse_sparse(d, model_type) if model_type in _SPARSE else {}),
    )
    _validate(cfg)
    return cfg


def _parse_sparse(d: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The DSA fields: index_topk / index_n_heads / index_head_dim, and GLM-MoE-DSA's per-layer indexer types
    (`indexer_types`, else `index_topk_pattern` "FSS..." or `index_topk_freq` / `index_skip_topk_offset`, as
    transformers derives them)."""
    n = _get(d, "num_hidden_layers", int, positive=True)
    out: dict[str, Any] = dict(
        index_topk=_get(d, "index_topk", int, 2048, positive=True),
        index_n_heads=_get(d, "index_n_heads", int, 64 if model_type == "deepseek_v32" else 32, positive=True),
        index_head_dim=_get(d, "index_head_dim", int, 128, positive=True),
        index_rope_interleave=model_type == "glm_moe_dsa",
    )
    if model_type != "glm_moe_dsa":
        return out
    types = d.get("indexer_types")
    if types is None and d.get("index_topk_pattern") is not None:
        pat = d["index_topk_pattern"]
        types = [{"F": "full", "S": "shared"}.get(c, c) for c in pat] if isinstance(pat, str) else list(pat)
    if types is None:
        freq = max(_get(d, "index_topk_freq", int, 1), 1)
        offset = _get(d, "index_skip_topk_offset", int, 2)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(types, (list, tuple)) or len(types) != n or any(t not in ("full", "shared") for t in types):
        raise ConfigError(
            f"config.json: indexer_types must list 'full' or 'shared' for each of the {n} layers, got {types!r}"
        )
    if types[0] != "full":
        raise ConfigError("config.json: indexer_types[0] must be 'full' (a shared layer reuses an earlier top-k)")
    out["indexer_types"] = None if all(t == "full" for t in types) else tuple(types)
    return out


def _validate(c: DeepseekConfig) -> None:
    if c.use_sparse:
        if c.q_lora_rank is None:
            raise ConfigError(f"config.json: {c.model_type} needs q_lora_rank (the indexer reads the q latent)")
        if not c.qk_rope_head_dim <= c.index_head_dim:
            raise ConfigError(
                f"config.json: index_head_dim ({c.index_head_dim}) must be >= qk_rope_head_dim "
                f"({c.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim dims"
            )
    if c.hidden_act != "silu":
        raise ConfigError(f"config.json: hidden_act '{c.hidden_act}' is not supported (only 'silu')")
    if c.attention_bias:
        raise ConfigError("config.json: attention_bias=true is not supported (DeepSeek checkpoints have none)")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"config.json: qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    if c.n_routed_experts is not None:
        if c.moe_intermediate_size <= 0:
            raise ConfigError("config.json: field 'moe_intermediate_size' must be > 0 for a MoE model")
        if not 0 < c.num_experts_per_tok <= c.n_routed_experts:
            raise ConfigError(
                f"config.json: num_experts_per_tok ({c.num_experts_per_tok}) must be in "
                f"[1, n_routed_experts={c.n_routed_experts}]"
            )
        if c.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ConfigError(f"config.json: topk_method '{c.topk_method}' is not supported")
        if c.scoring_func not in ("softmax", "sigmoid"):
            raise ConfigError(f"config.json: scoring_func '{c.scoring_func}' is not supported")
        if c.topk_method == "noaux_tc" and c.scoring_func != "sigmoid":
            raise ConfigError("config.json: topk_method 'noaux_tc' needs scoring_func 'sigmoid'")
        if c.n_routed_experts % c.n_group:
            raise ConfigError(
                f"config.json: n_routed_experts ({c.n_routed_experts}) must be divisible by n_group ({c.n_group})"
            )
        if c.topk_group > c.n_group:
            raise ConfigError(f"config.json: topk_group ({c.topk_group}) must be <= n_group ({c.n_group})")
        if c.topk_method == "noaux_tc" and c.n_routed_experts // c.n_group < 2:
            raise ConfigError("config.json: noaux_tc ranks groups by their top-2 scores: each group needs >= 2 experts")
