"""DeepSeek-V3's block FP8: e4m3 weights [..., M, K] with a float32 `weight_scale_inv` [..., ceil(M/bm),
ceil(K/bk)] over bm x bk blocks (128x128), dequantized as w * scale_inv per block."""

from __future__ import annotations

import numpy as np

from mla_jax.checkpoint.hf import CheckpointError
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import FP8_E4M3
from pallas_kernels.util import cdiv

SCALE_SUFFIX = "_scale_inv"

# A 256-entry table is exact and much faster than ml_dtypes' element-wise fp8 -> f32 cast.
_TABLE = np.arange(256, dtype=np.uint8).view(FP8_E4M3).astype(np.float32)


def fp8_block(cfg: DeepseekConfig) -> tuple[int, int]:
    return cfg.quantization.weight_block_size if cfg.quantization else (128, 128)


def fp8_scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """[..., M, K] weight -> [..., ceil(M/bm), ceil(K/bk)] scale_inv."""
    return (*shape[:-2], cdiv(shape[-2], block[0]), cdiv(shape[-1], block[1]))


def dequantize_fp8_blocks(
    w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128), name: str = "?"
) -> np.ndarray:
    """w e4m3 [..., M, K], scale_inv f32 [..., ceil(M/bm), ceil(K/bk)] -> f32 w * scale_inv per block (a multiply
    despite the name); edge blocks are partial. Leading dims (stacked or fused experts) are batch dims."""
    bm, bk = block
    if w.ndim < 2:
        raise CheckpointError(f"tensor '{name}' is fp8 with shape {w.shape}: block scales need >= 2 dims")
    K = w.shape[-1]
    want = fp8_scale_shape(w.shape, block)
    if scale_inv.shape != want:
        raise CheckpointError(
            f"tensor '{name}{SCALE_SUFFIX}' has shape {scale_inv.shape}, expected {want} for "
            f"weight {w.shape} with {bm}x{bk} blocks"
        )
    scale = np.asarray(scale_inv, np.float32)
    if not np.isfinite(scale).all():
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' contains NaN or Inf (corrupted?)")
    out = _TABLE[np.asarray(w).view(np.uint8)]
    for r in range(want[-2]):  # one row of blocks at a time: no full-size float32 scale temporary
        out[..., r * bm : (r + 1) * bm, :] *= np.repeat(scale[..., r, :], bk, axis=-1)[..., None, :K]
    return out


def has_fp8_nan(x: np.ndarray) -> bool:
    return bool(((np.asarray(x).view(np.uint8) & 0x7F) == 0x7F).any())  # e4m3fn's only non-finite codes


# ---- keeping weights in fp8 at run time (`load_model(..., weights="fp8")`) ----

WEIGHTS = ("bf16", "fp8")  # `weights=`: dequantized (the checkpoint's float dtype) or block-FP8 at run time

# The linears that run in fp8 (DeepSeek-V3's quantized set, kv_b_proj excepted: it is split per head into
# W_UK_T / W_UV across block boundaries, so it is always dequantized; the router, norms, embeddings, lm_head
# and the V3.2 indexer's weights_proj stay in float).
FP8_LINEARS = frozenset(
    (
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
)


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    return weights


def quantize_fp8_blocks(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """float w [..., M, K] -> (e4m3 [..., M, K], f32 scale_inv [..., ceil(M/bm), ceil(K/bk)]): amax/448 per
    block (DeepSeek-V3's format; `dequantize_fp8_blocks` inverts it up to e4m3 rounding). numpy, the same
    math as `pallas_kernels.fp8_matmul.quantize_weight_blocks` (which runs on the device)."""
    from pallas_kernels.util import FP8_AMAX_FLOOR, FP8_MAX

    bm, bk = block
    w = np.asarray(w, np.float32)
    *lead, m, k = w.shape
    mb, kb = cdiv(m, bm), cdiv(k, bk)
    wp = np.zeros((*lead, mb * bm, kb * bk), np.float32)
    wp[..., :m, :k] = w
    blocks = wp.reshape(*lead, mb, bm, kb, bk)
    scale = np.maximum(np.abs(blocks).max(axis=(-3, -1)), FP8_AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).reshape(*lead, mb * bm, kb * bk)[..., :m, :k]
    return q.astype(FP8_E4M3), scale.astype(np.float32)


def _quantize_one(w, block):
    import jax.numpy as jnp

    from pallas_kernels.fp8_matmul import dequantize_weight_blocks, quantize_weight_blocks

    q, s = quantize_weight_blocks(w, block)
    wf = jnp.asarray(w, jnp.float32)
    d = dequantize_weight_blocks(q, s, block) - wf
    return q, s, jnp.abs(d).max() / jnp.maximum(jnp.abs(wf).max(), 1e-30), jnp.sum(d * d), jnp.sum(wf * wf)


def quantize_params(params, *, block: tuple[int, int] = (128, 128)):
    """Block-quantize every `FP8_LINEARS` weight of a params pytree that is not fp8 yet -> (params, error):
    {"weight": e4m3, "weight_scale_inv": f32} leaves, and error = {"max_rel": max over tensors of
    max |w_dq - w| / max |w|, "rms_rel": sqrt(sum |w_dq - w|^2 / sum |w|^2) over all quantized weights,
    "tensors": count}."""
    import jax

    quantize = jax.jit(_quantize_one, static_argnums=1)
    stats = {"max_rel": 0.0, "err2": 0.0, "ref2": 0.0, "tensors": 0}

    def walk(node, name):
        if not isinstance(node, dict):
            return node
        if name in FP8_LINEARS and "weight" in node and "weight_scale_inv" not in node:
            q, s, max_rel, err2, ref2 = quantize(node["weight"], tuple(block))
            stats["max_rel"] = max(stats["max_rel"], float(max_rel))
            stats["err2"] += float(err2)
            stats["ref2"] += float(ref2)
            stats["tensors"] += 1
            return {**node, "weight": q, "weight_scale_inv": s}
        return {k: walk(v, k) for k, v in node.items()}

    out = walk(params, "")
    err = {
        "max_rel": stats["max_rel"],
        "rms_rel": float(np.sqrt(stats["err2"] / max(stats["ref2"], 1e-30))),
        "tensors": stats["tensors"],
    }
    return out, err
