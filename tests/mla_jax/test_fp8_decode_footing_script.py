"""scripts/fp8_decode_footing.py on a small input: the modes' errors in the order their roundings imply (the
numbers at the benchmark's size: docs/perf-notes.md, session 38)."""

from __future__ import annotations

from tests.mla_jax.helpers import load_script


def test_footing_orders_the_modes():
    m = load_script("fp8_decode_footing")
    res = m.measure(b=1, n=16, ctx=256, l=128, r=64)
    assert set(res) == {"v3_yarn", "inv_sqrt_192"}
    for e in res.values():
        assert 0 < e["p_only"] < 0.05 and 0 < e["q2_p"] < 0.05
        # q's residual leaves P's rounding the only loss; one term of q adds its own, several times larger
        assert abs(e["q2_p"] - e["p_only"]) < 0.25 * e["p_only"]
        assert e["q1_p"] > 2 * e["p_only"] and e["q1"] > e["p_only"]
        # FlashMLA's emulated fp8 rounds q too: against its own q it errs what P's rounding does (its test's
        # footing), against the exact q about twice that or more (~3x at the benchmark's size), as one term of q does
        assert 0 < e["flashmla_own_q"] < 0.05 and e["flashmla"] > 1.5 * e["flashmla_own_q"]
        assert abs(e["q1_p_own_q"] - e["p_only"]) < 0.25 * e["p_only"] and e["q1_p"] > 0.5 * e["flashmla"]


def test_footing_on_the_demo_model():
    """The demo model's activations (2 windows of 64 tokens): an error per layer for each mode, two terms of q no
    worse than P's rounding alone by more than a quarter, one term at least as large as q's rounding alone."""
    m = load_script("fp8_decode_footing")
    res = m.measure_demo(num_windows=2, seq_len=64)
    assert set(res) == {"p_only", "q1", "q1_p", "q2_p"}
    layers = len(res["p_only"])
    assert layers > 1 and all(len(v) == layers for v in res.values())
    for p, q1, q1p, q2p in zip(res["p_only"], res["q1"], res["q1_p"], res["q2_p"]):
        assert 0 < p < 0.05 and abs(q2p - p) < 0.25 * p and q1p > q2p and q1 > 0


def test_footing_demo_loss():
    """The validation loss with each mode in every layer (2 windows of 64 tokens): the float32 mode is the model's
    own absorbed forward (fp8_cache_formats' float32 rows), and each mode moves the logits by its own amount."""
    import jax.numpy as jnp
    import numpy as np

    m = load_script("fp8_decode_footing")
    fcf = m._load_fp8_cache_formats()
    cfg, params, tok = fcf.load_demo()
    ids = jnp.asarray(fcf.windows(tok, fcf.VAL_FILES, 2, 64))
    ref, _, _ = fcf.forward_fake_quant(params, cfg, ids, 0, cfg.kv_lora_rank // 4)  # format 0: float32 rows
    np.testing.assert_allclose(np.asarray(m.forward_mode(params, cfg, ids, "f32")), np.asarray(ref), atol=2e-3)
    res = m.demo_loss(num_windows=2, seq_len=64)
    assert np.isfinite(res["val_loss_f32"]) and set(res) == {"val_loss_f32", "val_tokens", *m.LOSS_MODES}
    kls = [res[mode]["val_kl"] for mode in m.LOSS_MODES]
    assert all(0 < kl < 0.1 for kl in kls) and len(set(kls)) == len(kls)
