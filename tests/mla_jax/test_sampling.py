"""Sampling: the vocabulary sort runs only in steps where a sampled row filters (top-k / top-p), and a row
samples the same token whether or not such a row shares its step."""

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.sampling import SamplingArrays, SamplingParams, filtered_logprobs, sample


def _all_primitives(jaxpr):
    names = set()
    for e in jaxpr.eqns:
        names.add(e.primitive.name)
        for sub in jax.core.subjaxprs(e) if hasattr(jax.core, "subjaxprs") else ():
            names |= _all_primitives(sub)
        for v in e.params.values():
            if hasattr(v, "jaxpr"):
                names |= _all_primitives(v.jaxpr if hasattr(v.jaxpr, "eqns") else v.jaxpr.jaxpr)
    return names


def test_sort_only_when_a_row_filters():
    logits = jax.random.normal(jax.random.key(0), (3, 50))
    plain = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), None]
    filt = [SamplingParams(), SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.7, top_p=0.9)]
    a = SamplingArrays.build(plain, [5, 6, 0], 3)
    b = SamplingArrays.build(filt, [5, 6, 7], 3)
    assert not a.filtered and b.filtered
    assert not SamplingArrays.build([SamplingParams(top_k=5)], [0], 1).filtered  # greedy: nothing to filter
    sa = jax.tree.map(jnp.asarray, a)
    sb = jax.tree.map(jnp.asarray, b)
    assert "sort" not in _all_primitives(jax.make_jaxpr(lambda x: sample(x, sa))(logits).jaxpr)
    assert "sort" in _all_primitives(jax.make_jaxpr(lambda x: sample(x, sb))(logits).jaxpr)
    # the greedy and the plain-temperature row draw the same token with and without a filtering neighbour
    ta, _ = sample(logits, sa)
    tb, _ = sample(logits, sb)
    assert ta[0] == tb[0] == jnp.argmax(logits[0]) and ta[1] == tb[1]


def test_unfiltered_logprobs_equal_the_filtered_path():
    logits = jax.random.normal(jax.random.key(1), (2, 40)) * 3
    sp = [SamplingParams(temperature=0.7, seed=2), SamplingParams(temperature=1.3, seed=3)]
    fast = jax.tree.map(jnp.asarray, SamplingArrays.build(sp, [1, 2], 2))
    slow = jax.tree.map(
        jnp.asarray, SamplingArrays.build(sp + [SamplingParams(temperature=1.0, top_k=4)], [1, 2, 3], 3)
    )
    lp_fast = filtered_logprobs(logits, fast)
    lp_slow = filtered_logprobs(jnp.concatenate([logits, logits[:1]]), slow)[:2]
    np.testing.assert_allclose(lp_fast, lp_slow, atol=1e-5)


def test_plain_temperature_samples_the_softmax():
    """Many seeds, one row: the unfiltered draw follows softmax(logits / T) (chi-square-free check on a tiny vocab)."""
    logits = jnp.asarray([[2.0, 1.0, 0.0, -1.0]])
    n = 4000
    seeds = np.arange(n, dtype=np.int32)
    arrs = SamplingArrays(
        jnp.full((n,), 1.5), jnp.zeros((n,), jnp.int32), jnp.ones((n,)), jnp.asarray(seeds), jnp.zeros((n,), jnp.int32)
    )
    tokens, _ = jax.jit(sample)(jnp.repeat(logits, n, axis=0), arrs)
    freq = np.bincount(np.asarray(tokens), minlength=4) / n
    want = np.asarray(jax.nn.softmax(logits[0] / 1.5))
    np.testing.assert_allclose(freq, want, atol=0.03)
