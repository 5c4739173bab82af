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
