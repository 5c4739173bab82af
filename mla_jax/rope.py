"""Decoupled RoPE with DeepSeek's YaRN, applied only to q_pe and the single shared k_pe.

DeepSeek checkpoints lay the R rope dims out as interleaved pairs (x0, x1), (x2, x3), ... each rotated by one
frequency (GPT-J style, vLLM's `is_neox_style=False`). We rotate the pairs in place, so the k_pe stored in the
cache keeps the checkpoint's order. (HF's `apply_rotary_pos_emb_interleave` returns the pairs de-interleaved as
[evens | odds]; q·k is the same either way because q_pe and k_pe are permuted alike.)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from mla_jax.config import DeepseekConfig, RopeScaling, yarn_get_mscale


def _yarn_correction_range(rs: RopeScaling, dim: int, base: float) -> tuple[float, float]:
    def correction_dim(num_rotations: float) -> float:
        return (
            dim * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))
        )

    low = math.floor(correction_dim(rs.beta_fast))
    high = math.ceil(correction_dim(rs.beta_slow))
    return max(low, 0), min(high, dim - 1)


def rope_inv_freq(cfg: DeepseekConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq f32[R/2], attention_factor multiplying cos and sin).

    Computed in float32 as the reference implementations do, so angles match them bit for bit where possible.
    """
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq, 1.0
    inv_interp = (np.float32(1.0) / (np.float32(rs.factor) * pos_freqs)).astype(np.float32)
    low, high = _yarn_correction_range(rs, dim, base)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrap_weight = (np.float32(1.0) - ramp).astype(np.float32)
    inv_freq = (inv_interp * (1 - extrap_weight) + inv_freq * extrap_weight).astype(np.float32)
    if rs.mscale and rs.mscale_all_dim:
        attention_factor = yarn_get_mscale(rs.factor, rs.mscale) / yarn_get_mscale(rs.factor, rs.mscale_all_dim)
    else:
        attention_factor = yarn_get_mscale(rs.factor)
    return inv_freq, float(attention_factor)


def rope_cos_sin(cfg: DeepseekConfig, positions: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """positions i32[T] -> (cos, sin) f32[T, R/2], already scaled by YaRN's attention factor."""
    inv_freq, attention_factor = rope_inv_freq(cfg)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, R/2]
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates interleaved pairs. x [T, ..., R]; cos, sin [T, R/2]. Computed in float32, returned in x.dtype."""
    shape = x.shape
    xf = x.astype(jnp.float32).reshape(*shape[:-1], shape[-1] // 2, 2)
    x1, x2 = xf[..., 0], xf[..., 1]  # [T, ..., R/2]
    bshape = (shape[0],) + (1,) * (len(shape) - 2) + (shape[-1] // 2,)
    c, s = cos.reshape(bshape), sin.reshape(bshape)
    out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.reshape(shape).astype(x.dtype)
