"""moe_topk (the router's selection kernel) vs moe_topk_reference (CPU: interpret mode; GPU: `-m gpu`).

Ids must match exactly (ties and masked groups included); weights to float32 rounding (the kernel's exp and
sums run in another order than XLA's)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.moe_router import moe_topk, moe_topk_reference

# DeepSeek's three gates at small and real sizes: (E, kwargs)
GATES = {
    "v2_lite_greedy": (64, dict(top_k=6, scoring="softmax", scale=1.0)),
    "v2_group_limited": (160, dict(top_k=6, scoring="softmax", n_group=8, topk_group=3, scale=16.0)),
    "v2_norm": (16, dict(top_k=3, scoring="softmax", renormalize=True)),
    "v3_noaux_tc": (
        256,
        dict(top_k=8, scoring="sigmoid", n_group=8, topk_group=4, group_score="top2", fill=-np.inf, scale=2.5),
    ),
    "v3_renorm": (
        32,
        dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2", fill=-np.inf, renormalize=True),
    ),
}


def _logits(seed, t, e, scale=3.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((t, e)).astype(np.float32) * scale)


def _check(logits, bias, interpret=True, **kw):
    w, ids = moe_topk(logits, bias, interpret=interpret, **kw)
    w_ref, ids_ref = moe_topk_reference(logits, bias, **kw)
    assert w.shape == ids.shape == (logits.shape[0], kw["top_k"]) and w.dtype == jnp.float32
    assert ids.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2e-6, atol=1e-7)
    return np.asarray(ids)


@pytest.mark.parametrize("gate", sorted(GATES))
def test_gates_match_reference(gate):
    e, kw = GATES[gate]
    bias = None
    if kw.get("group_score") == "top2":
        bias = jnp.asarray(np.random.default_rng(1).standard_normal(e).astype(np.float32) * 0.1)
    ids = _check(_logits(len(gate), 5, e), bias, **kw)
    assert len(np.unique(ids)) > kw["top_k"]  # tokens route differently
    if kw.get("n_group", 1) > 1:  # every chosen expert lies in a kept group: at most topk_group groups per token
        groups = ids // (e // kw["n_group"])
        assert max(len(set(row)) for row in groups) <= kw["topk_group"]


def test_ties_pick_the_lowest_index_and_bias_steers_only():
    """Equal scores: lax.top_k's order (lowest expert first), for experts and for groups; a bias that flips the
    choice changes the ids, not the weights' source (the unbiased scores)."""
    e = 32
    logits = np.zeros((3, e), np.float32)
    logits[1, [3, 9, 17, 30]] = 2.0  # four equal winners in different groups
    logits[2] = np.repeat(np.arange(4, dtype=np.float32), 8)  # whole groups tie inside
    kw = dict(top_k=4, scoring="sigmoid", n_group=4, topk_group=2, group_score="top2", fill=-np.inf)
    ids = _check(jnp.asarray(logits), None, **kw)
    np.testing.assert_array_equal(ids[0], [0, 1, 2, 3])  # all tie: groups 0, 1, then their first experts
    np.testing.assert_array_equal(ids[1], [3, 9, 0, 1])  # groups tie too: 0 and 1 kept
    np.testing.assert_array_equal(ids[2], [24, 25, 26, 27])  # the best group, its experts in index order
    bias = np.zeros(e, np.float32)
    bias[31] = 5.0
    w, ids = moe_topk(jnp.asarray(logits), jnp.asarray(bias), interpret=True, **kw)
    assert np.asarray(ids)[0, 0] == 31 and np.asarray(w)[0, 0] == np.float32(0.5)  # sigmoid(0), unbiased
    _check(jnp.asarray(logits), jnp.asarray(bias), **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top_k=0), "top_k=0"),
        (dict(top_k=9, n_group=4, topk_group=1), r"top_k=9 must be an int in \[1, 4\]"),
        (dict(n_group=3), "n_group=3"),
        (dict(topk_group=5, n_group=4), "topk_group=5"),
        (dict(scoring="relu"), "scoring"),
        (dict(group_score="sum"), "group_score"),
        (dict(bias=jnp.zeros((8,))), r"bias must be f32\[E=16\]"),
        (dict(logits=jnp.zeros((2, 16), jnp.bfloat16)), r"logits must be f32\[T, E\]"),
    ],
)
def test_validation(kw, match):
    args = dict(logits=jnp.zeros((2, 16)), bias=None, top_k=2, scoring="softmax") | kw
    logits, bias = args.pop("logits"), args.pop("bias")
    for fn in (moe_topk, moe_topk_reference):
        with pytest.raises(ValueError, match=match):
            fn(logits, bias, **args)


@pytest.mark.gpu
@pytest.mark.parametrize("gate", sorted(GATES))
@pytest.mark.parametrize("t", [1, 128])
def test_gpu_gates(gate, t):
    e, kw = GATES[gate]
    bias = None
    if kw.get("group_score") == "top2":
        bias = jnp.asarray(np.random.default_rng(2).standard_normal(e).astype(np.float32) * 0.1)
    _check(_logits(t + e, t, e), bias, interpret=False, **kw)
    x = _logits(t, t, e)
    f = jax.jit(lambda v: moe_topk(v, bias, **kw))  # under jit, as the model calls it
    np.testing.assert_array_equal(np.asarray(f(x)[1]), np.asarray(moe_topk_reference(x, bias, **kw)[1]))
