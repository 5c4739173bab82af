"""pallas_kernels.lightning_indexer: the paged index-score kernel against its float32 reference (CPU:
interpret=True; GPU: -m gpu) and the exact top-k on it. Index-key pages no row's request owns, and the tail of each
request's last page, are NaN: a kernel that reads them fails; keys past a row's seq_len must score -inf."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lightning_indexer import (
    indexer_logits,
    indexer_logits_reference,
    indexer_topk,
    indexer_topk_reference,
)
from pallas_kernels.util import cdiv


def indexer_inputs(seed, *, req_lens, rows, h, d, g, dtype="bf16", spare=2):
    """(q, weights, cache, block_table, seq_lens, k_scale). rows: (request, keys seen) per query row, e.g. a
    decode row (r, req_lens[r]) or the prefill tokens of a request (r, 1..n); (r, 0) is a padding row."""
    rng = np.random.default_rng(seed)
    used = [cdiv(n, g) for n in req_lens]
    num_pages = sum(used) + spare
    perm = rng.permutation(num_pages)
    max_pages = max(used)
    bts, pos = [], 0
    cache = np.full((num_pages, g, d), np.nan, np.float32)
    for r, n in enumerate(req_lens):
        pages = perm[pos : pos + used[r]]
        pos += used[r]
        bts.append(np.concatenate([pages, rng.choice(perm[num_pages - spare :], max_pages - used[r])]))
        for j, p in enumerate(pages):
            cache[p, : min(g, n - j * g)] = rng.standard_normal((min(g, n - j * g), d))
    block_table = np.stack([bts[r] for r, _ in rows]).astype(np.int32)
    seq_lens = np.asarray([n for _, n in rows], np.int32)
    q = rng.standard_normal((len(rows), h, d)).astype(np.float32)
    weights = rng.standard_normal((len(rows), h)).astype(np.float32) * h**-0.5
    k_scale = None
    if dtype == "fp8":
        cache_j = jnp.asarray(cache * 4.0).astype(jnp.float8_e4m3fn)
        k_scale = jnp.asarray(rng.uniform(0.1, 0.4, (num_pages, g)).astype(np.float32))
    else:
        cache_j = jnp.asarray(cache).astype({"bf16": jnp.bfloat16, "f32": jnp.float32}[dtype])
    q_dtype = jnp.float32 if dtype == "f32" else jnp.bfloat16
    return (
        jnp.asarray(q, q_dtype),
        jnp.asarray(weights),
        cache_j,
        jnp.asarray(block_table),
        jnp.asarray(seq_lens),
        k_scale,
    )


def assert_topk_equivalent(idx, ref_logits, k, seq_lens, tol):
    """idx is a valid top-k of ref_logits: distinct visible positions, as many as min(k, seq_len), -1 after,
    their reference scores best first and equal (within tol, for near-ties) to the reference's k best."""
    idx, ref_logits = np.asarray(idx), np.asarray(ref_logits)
    for t in range(idx.shape[0]):
        n = min(k, int(seq_lens[t]), idx.shape[1])
        sel = idx[t, :n]
        assert (idx[t, n:] == -1).all() and (sel >= 0).all() and (sel < seq_lens[t]).all(), (t, idx[t])
        assert len(set(sel.tolist())) == n
        got = ref_logits[t, sel]
        want = np.sort(ref_logits[t, : int(seq_lens[t])])[::-1][:n]
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


CASES = [
    # a decode row, a request's 5 prefill tokens (causal: 1..5 keys past 12 of context), a padding row
    (
        "bf16_mixed_rows",
        dict(req_lens=[37, 17], rows=[(0, 37), (1, 13), (1, 14), (1, 15), (1, 16), (1, 17), (0, 0)], h=4, d=32, g=8),
        16,
    ),
    ("f32_h16_one_page_block", dict(req_lens=[64, 5], rows=[(0, 64), (1, 5)], h=16, d=16, g=16, dtype="f32"), 16),
    ("fp8_scaled_keys", dict(req_lens=[50, 70], rows=[(0, 50), (1, 70), (1, 69)], h=8, d=32, g=16, dtype="fp8"), 32),
]


@pytest.mark.parametrize("name,inputs,block_k", CASES, ids=[c[0] for c in CASES])
def test_logits_and_topk_match_reference(name, inputs, block_k):
    q, w, cache, bt, sl, ks = indexer_inputs(zlib.crc32(name.encode()), **inputs)
    scale = inputs["d"] ** -0.5
    got = np.asarray(indexer_logits(q, w, cache, bt, sl, scale=scale, k_scale=ks, interpret=True, block_k=block_k))
    ref = np.asarray(indexer_logits_reference(q, w, cache, bt, sl, scale=scale, k_scale=ks))
    vis = np.arange(got.shape[1])[None, :] < np.asarray(sl)[:, None]
    assert got.shape == ref.shape and (got[~vis] == -np.inf).all()
    assert np.isfinite(got[vis]).all(), "NaN/inf leaked into visible scores"
    np.testing.assert_allclose(got[vis], ref[vis], atol=1e-4, rtol=1e-4)
    for k in (8, 64):  # fewer than most rows see; more than any row sees (-1 tails)
        idx = indexer_topk(q, w, cache, bt, sl, scale=scale, k=k, k_scale=ks, interpret=True, block_k=block_k)
        assert_topk_equivalent(idx, ref, k, np.asarray(sl), 1e-4)


def test_ties_go_to_the_lower_position():
    """Repeated keys score exactly alike: the kernel path keeps the lower positions, as the reference does."""
    q, w, cache, bt, sl, _ = indexer_inputs(4, req_lens=[32], rows=[(0, 32), (0, 20)], h=4, d=16, g=8, dtype="f32")
    pool = cache.reshape(-1, 16)
    rows = bt[0][:, None] * 8 + jnp.arange(8)[None, :]  # request rows, position order
    rows = rows.reshape(-1)
    cache = pool.at[rows].set(pool[rows[jnp.arange(32) % 4]]).reshape(cache.shape)  # key s = key s % 4
    got = indexer_topk(q, w, cache, bt, sl, scale=0.25, k=6, interpret=True)
    ref = indexer_topk_reference(q, w, cache, bt, sl, scale=0.25, k=6)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    logits = np.asarray(indexer_logits_reference(q, w, cache, bt, sl, scale=0.25))
    for t, n in enumerate(np.asarray(sl)):  # best score first, then position order among the equal ones
        want = sorted(range(n), key=lambda s: (-logits[t, s % 4], s))[:6]
        np.testing.assert_array_equal(np.asarray(got)[t], want)


def test_bad_inputs():
    q, w, cache, bt, sl, _ = indexer_inputs(1, req_lens=[20], rows=[(0, 20)], h=4, d=32, g=8)
    with pytest.raises(ValueError, match="k_scale must be given exactly for an fp8 index_k_cache"):
        indexer_logits(q, w, cache.astype(jnp.float8_e4m3fn), bt, sl, scale=1.0)
    with pytest.raises(ValueError, match="index_k_cache dtype"):
        indexer_logits(q, w, cache.astype(jnp.int8), bt, sl, scale=1.0)
    with pytest.raises(ValueError, match="weights must be"):
        indexer_logits(q, w[:, :2], cache, bt, sl, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens must be"):
        indexer_logits(q, w, cache, bt, sl.astype(jnp.int16), scale=1.0)
    with pytest.raises(ValueError, match="index head dim 24"):
        indexer_logits(q[..., :24], w, cache[..., :24], bt, sl, scale=1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_matches_reference(dtype):
    """V3.2 sizes (64 heads x 128, page 64): 2 decode rows and 64 prefill tokens of a third request."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rows = [(0, 9000), (1, 2100)] + [(2, 3000 + i) for i in range(64)]
    q, w, cache, bt, sl, ks = indexer_inputs(7, req_lens=[9000, 2100, 3064], rows=rows, h=64, d=128, g=64, dtype=dtype)
    got = np.asarray(indexer_logits(q, w, cache, bt, sl, scale=128**-0.5, k_scale=ks))
    ref = np.asarray(indexer_logits_reference(q, w, cache, bt, sl, scale=128**-0.5, k_scale=ks))
    vis = np.arange(got.shape[1])[None, :] < np.asarray(sl)[:, None]
    assert (got[~vis] == -np.inf).all() and np.isfinite(got[vis]).all()
    np.testing.assert_allclose(got[vis], ref[vis], atol=2e-3, rtol=2e-3)
    idx = indexer_topk(q, w, cache, bt, sl, scale=128**-0.5, k=2048, k_scale=ks)
    assert_topk_equivalent(idx, ref, 2048, np.asarray(sl), 2e-3)
