"""scripts/fp8_cache_formats.py's attention measurement on a tiny random input: the fp8_qk query rounding (q in
e4m3, one f32 scale per row) and the LSE error it reports. The real numbers on the demo model:
notebooks/09_fp8_cache_formats.ipynb."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.mla_jax.helpers import load_script

L, R, N, S = 64, 16, 4, 32
SCALE = 0.125


def _script():
    return load_script("fp8_cache_formats")


def _inputs(seed=0):
    """q f32[layers=2, B=2, S, N, L+R], rows f32[2, 2, S, L+R], the rope 4x the latent as in the demo's rows."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 2, S, N, L + R)).astype(np.float32) * 2.0
    rows = rng.standard_normal((2, 2, S, L + R)).astype(np.float32)
    rows[..., L:] *= 4.0
    return q, rows


def test_round_q_fp8_is_e4m3_per_row():
    m = _script()
    q, _ = _inputs()
    q[0, 0, 0, 0] = 0.0  # an all-zero row stays zero
    got = np.asarray(m.round_q_fp8(jnp.asarray(q)))
    amax = np.abs(q).max(-1, keepdims=True)
    err = np.abs(got - q)
    # e4m3: 3 mantissa bits; subnormals at the row's scale, a power of two below 2 * amax / 448
    assert (err <= np.abs(q) * 2.0**-4 + 2 * amax / 448 * 2.0**-9).all()
    assert err.max() > 0 and np.isfinite(got).all()
    np.testing.assert_array_equal(got[0, 0, 0, 0], 0.0)
    # each row's largest |value| lands on e4m3's normal range (within 2^-4 of itself)
    np.testing.assert_allclose(np.abs(got).max(-1), amax[..., 0], rtol=2.0**-4)


def test_causal_mqa_lse_matches_float64():
    m = _script()
    q, rows = _inputs(1)
    out, lse = (np.asarray(a) for a in m.causal_mqa_lse(jnp.asarray(q[0, 0]), jnp.asarray(rows[0, 0]), SCALE, L))
    lg = np.einsum("snd,td->snt", q[0, 0].astype(np.float64), rows[0, 0].astype(np.float64)) * SCALE
    lg = np.where(np.tril(np.ones((S, S), bool))[:, None], lg, -np.inf)
    mx = lg.max(-1, keepdims=True)
    p = np.exp(lg - mx)
    np.testing.assert_allclose(lse, mx[..., 0] + np.log(p.sum(-1)), atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        out, np.einsum("snt,tl->snl", p / p.sum(-1, keepdims=True), rows[0, 0, :, :L]), atol=1e-5
    )


def test_fp8_qk_error_is_measured():
    """Exact q over the float32 rows: no error; fp8_qk's q: a finite, non-zero output and LSE error, and over
    per_token fp8 rows more error than the same rows with the exact q."""
    m = _script()
    q, rows = _inputs(2)
    mqa = jax.jit(jax.vmap(jax.vmap(lambda q, kv: m.causal_mqa_lse(q, kv, SCALE, L))))
    ref_out, ref_lse = (np.asarray(a) for a in mqa(q, rows))
    q8 = np.asarray(m.round_q_fp8(jnp.asarray(q)))

    none = m.attention_errors(mqa, q, rows, ref_out, ref_lse)
    assert set(none) == {"attn_out_err", "lse_err_max", "lse_err_mean"}
    assert max(v for vs in none.values() for v in vs) < 1e-6

    q_only = m.attention_errors(mqa, q8, rows, ref_out, ref_lse, "_fp8_qk")
    assert set(q_only) == {"attn_out_err_fp8_qk", "lse_err_max_fp8_qk", "lse_err_mean_fp8_qk"}
    for k, vs in q_only.items():
        assert len(vs) == 2 and np.isfinite(vs).all() and min(vs) > 1e-3, (k, vs)
    assert all(mx >= mn for mx, mn in zip(q_only["lse_err_max_fp8_qk"], q_only["lse_err_mean_fp8_qk"]))

    deq = np.asarray(m.fake_quant(jnp.asarray(rows), "per_token", kv_lora_rank=L, group=16))
    exact_q = m.attention_errors(mqa, q, deq, ref_out, ref_lse)
    fp8_qk = m.attention_errors(mqa, q8, deq, ref_out, ref_lse, "_fp8_qk")
    assert min(exact_q["attn_out_err"]) > 1e-3  # the rows' own error
    for e, e8 in zip(exact_q["attn_out_err"], fp8_qk["attn_out_err_fp8_qk"]):
        assert np.isfinite(e8) and e8 > 1.1 * e, (e, e8)
    assert np.mean(fp8_qk["lse_err_mean_fp8_qk"]) > np.mean(exact_q["lse_err_mean"])
