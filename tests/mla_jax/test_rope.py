import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.rope import apply_rope, rope_cos_sin, rope_inv_freq
from tests.mla_jax.helpers import tiny_config


def test_apply_rope_is_complex_rotation_of_pairs():
    """DeepSeek's interleaved layout: pair (x[2i], x[2i+1]) is the complex number x[2i] + j x[2i+1] rotated by
    angle pos * inv_freq[i] (HF DeepseekV2's freqs_cis form)."""
    cfg = tiny_config(rope_scaling=None)
    T, R = 7, cfg.qk_rope_head_dim
    x = np.random.default_rng(0).normal(size=(T, 3, R)).astype(np.float32)
    pos = np.array([0, 1, 2, 5, 9, 100, 250], np.int32)
    cos, sin = rope_cos_sin(cfg, jnp.asarray(pos))
    got = np.asarray(apply_rope(jnp.asarray(x), cos, sin))
    inv, _ = rope_inv_freq(cfg)
    z = (x[..., 0::2] + 1j * x[..., 1::2]) * np.exp(1j * pos[:, None, None] * inv[None, None, :])
    want = np.stack([z.real, z.imag], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_scores_depend_on_relative_position_only():
    cfg = tiny_config(rope_scaling=None)
    k = jax.random.split(jax.random.key(1), 2)
    q = jax.random.normal(k[0], (1, cfg.qk_rope_head_dim))
    kk = jax.random.normal(k[1], (1, cfg.qk_rope_head_dim))

    def score(pq, pk):
        cq, sq = rope_cos_sin(cfg, jnp.array([pq]))
        ck, sk = rope_cos_sin(cfg, jnp.array([pk]))
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(kk, ck, sk)))

    assert abs(score(10, 3) - score(107, 100)) < 1e-4
    assert abs(score(10, 3) - score(10, 4)) > 1e-3


def test_yarn_blends_interpolation_and_extrapolation():
    base = tiny_config(rope_scaling=None)
    cfg = tiny_config()
    inv0, f0 = rope_inv_freq(base)
    inv, f = rope_inv_freq(cfg)
    assert f0 == 1.0 and f != 1.0  # mscale 1.0 over mscale_all_dim 0.8
    # high-frequency dims extrapolate (unchanged), the lowest interpolate (divided by the factor)
    np.testing.assert_allclose(inv[0], inv0[0], rtol=1e-6)
    np.testing.assert_allclose(inv[-1], inv0[-1] / cfg.rope_scaling.factor, rtol=1e-6)
