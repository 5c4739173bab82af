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
