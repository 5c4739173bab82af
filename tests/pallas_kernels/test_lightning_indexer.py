"""pallas_kernels.lightning_indexer: the paged index-score kernel against its float32 reference (CPU:
interpret=True; GPU: -m gpu) and the exact top-k on it. Index-key pages no row's request owns, and the tail of each
request's last page, are NaN: a kernel that reads them fails; keys past a row's seq_len must score -inf."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lightning_indexer as li
from pallas_kernels.lightning_indexer import (
    canonical_scores,
    indexer_logits,
    indexer_logits_reference,
    indexer_topk,
    indexer_topk_reference,
    logits_histogram,
    topk_from_logits,
    topk_select,
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
    """idx is a valid top-k of ref_logits: distinct visible positions in ascending order, as many as
    min(k, seq_len), -1 after, their reference scores equal (within tol, for near-ties) to the reference's k best."""
    idx, ref_logits = np.asarray(idx), np.asarray(ref_logits)
    for t in range(idx.shape[0]):
        n = min(k, int(seq_lens[t]), idx.shape[1])
        sel = idx[t, :n]
        assert (idx[t, n:] == -1).all() and (sel >= 0).all() and (sel < seq_lens[t]).all(), (t, idx[t])
        assert (np.diff(sel) > 0).all(), ("not in ascending position order", t, sel)
        got = np.sort(ref_logits[t, sel])[::-1]
        want = np.sort(ref_logits[t, : int(seq_lens[t])])[::-1][:n]
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


CASES = [
    # a decode row, a request's 5 prefill tokens (causal: 1..5 keys past 12 of context), a padding row; k below
    # most rows' keys
    (
        "bf16_mixed_rows",
        dict(req_lens=[37, 17], rows=[(0, 37), (1, 13), (1, 14), (1, 15), (1, 16), (1, 17), (0, 0)], h=4, d=32, g=8),
        16,
        8,
    ),
    # k above every row's keys: -1 tails
    ("f32_h16_one_page_block", dict(req_lens=[64, 5], rows=[(0, 64), (1, 5)], h=16, d=16, g=16, dtype="f32"), 16, 96),
    ("fp8_scaled_keys", dict(req_lens=[50, 70], rows=[(0, 50), (1, 70), (1, 69)], h=8, d=32, g=16, dtype="fp8"), 32, 8),
]


@pytest.mark.parametrize("name,inputs,block_k,k", CASES, ids=[c[0] for c in CASES])
def test_logits_and_topk_match_reference(name, inputs, block_k, k):
    """Scores within tolerance of the float32 reference; the top-k exactly `topk_from_logits` of the kernel's own
    scores (the unfused path) and a valid top-k of the reference's."""
    q, w, cache, bt, sl, ks = indexer_inputs(zlib.crc32(name.encode()), **inputs)
    scale = inputs["d"] ** -0.5
    got = np.asarray(indexer_logits(q, w, cache, bt, sl, scale=scale, k_scale=ks, interpret=True, block_k=block_k))
    ref = np.asarray(indexer_logits_reference(q, w, cache, bt, sl, scale=scale, k_scale=ks))
    vis = np.arange(got.shape[1])[None, :] < np.asarray(sl)[:, None]
    assert got.shape == ref.shape and (got[~vis] == -np.inf).all()
    assert np.isfinite(got[vis]).all(), "NaN/inf leaked into visible scores"
    np.testing.assert_allclose(got[vis], ref[vis], atol=1e-4, rtol=1e-4)
    idx = indexer_topk(q, w, cache, bt, sl, scale=scale, k=k, k_scale=ks, interpret=True, block_k=block_k, width=16)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(topk_from_logits(jnp.asarray(got), k)))
    # several key blocks per program (the last program's range partial): the same scores
    got2 = indexer_logits(
        q, w, cache, bt, sl, scale=scale, k_scale=ks, interpret=True, block_k=block_k, blocks_per_program=2
    )
    np.testing.assert_array_equal(np.asarray(got2), got)
    assert_topk_equivalent(idx, ref, k, np.asarray(sl), 1e-4)


def integer_inputs(seed, **kw):
    """`indexer_inputs` with small-integer queries and keys, weights in {+-1, +-1/2} and power-of-two key scales:
    every score is exact in float32 whatever the summation order, so the kernels must equal the reference
    bit for bit, and equal scores (ties) are everywhere."""
    q, w, cache, bt, sl, ks = indexer_inputs(seed, **kw)
    rng = np.random.default_rng(seed + 1)
    c = np.asarray(cache.astype(jnp.float32))
    c = np.where(np.isnan(c), np.nan, rng.integers(-1, 2, c.shape)).astype(np.float32)  # NaN pages stay NaN
    q = jnp.asarray(rng.integers(-2, 3, q.shape), q.dtype)
    w = jnp.asarray(rng.choice([-1.0, -0.5, 0.5, 1.0], w.shape), jnp.float32)
    if ks is not None:
        ks = jnp.asarray(rng.choice([0.25, 0.5, 1.0], ks.shape), jnp.float32)
    return q, w, jnp.asarray(c).astype(cache.dtype), bt, sl, ks


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_topk_exact_on_integer_scores(dtype):
    """With exact scores the fused top-k equals the plain-JAX reference exactly: ties to the lower position,
    rows with fewer keys than k (-1 tails), a padding row, keys not a multiple of the block (NaN past them and
    on unowned pages); the score kernel's bin histogram equals the plain one of its scores."""
    rows = [(0, 61), (0, 3), (1, 40), (1, 41), (0, 0), (2, 9)]
    inputs = dict(req_lens=[61, 41, 9], rows=rows, h=4, d=16, g=8, dtype=dtype)
    q, w, cache, bt, sl, ks = integer_inputs(5 if dtype == "bf16" else 6, **inputs)
    kw = dict(scale=0.25, k_scale=ks)
    ref_logits = indexer_logits_reference(q, w, cache, bt, sl, **kw)
    got, hist = li._logits_impl(
        q,
        w,
        cache,
        bt,
        sl,
        ks,
        scale=0.25,
        interpret=True,
        block_k=16,
        num_warps=None,
        num_stages=None,
        histogram=True,
        width=16,
        blocks_per_program=3,  # 4 blocks a row: a full program and a partial one
    )
    s = ref_logits.shape[1]
    np.testing.assert_array_equal(np.asarray(got[:, :s]), np.asarray(canonical_scores(ref_logits)))
    assert (np.asarray(got[:, s:]) == -np.inf).all()
    np.testing.assert_array_equal(np.asarray(hist), np.asarray(logits_histogram(ref_logits, sl)))
    r = np.sort(np.asarray(ref_logits)[2, :40])[::-1]
    assert r[11] == r[12], "the case must tie across the k-th place"
    idx = indexer_topk(q, w, cache, bt, sl, k=12, interpret=True, block_k=16, width=16, blocks_per_program=3, **kw)
    idx = np.asarray(idx)
    np.testing.assert_array_equal(idx, np.asarray(indexer_topk_reference(q, w, cache, bt, sl, k=12, **kw)))
    lg = np.asarray(ref_logits)
    for t, n in enumerate(np.asarray(sl)):  # best score first, the lower position among equal ones; then sorted
        want = sorted(sorted(range(n), key=lambda s: (-lg[t, s], s))[:12])
        np.testing.assert_array_equal(idx[t], want + [-1] * (12 - len(want)))


def test_select_exact_on_crafted_scores():
    """The select kernel alone equals `topk_from_logits` on rows built to break it: ties at the k-th score,
    -0.0 next to +0.0, -inf among visible scores, NaN past seq_len, rows of one repeated value (the whole row
    in the boundary bin), fewer keys than k, none, exactly k; S not a multiple of the select width."""
    rng = np.random.default_rng(11)
    T, S, k = 8, 100, 8
    x = rng.integers(-3, 4, (T, S)).astype(np.float32)
    x[0] = rng.standard_normal(S)  # distinct scores
    x[1] = np.where(x[1] == 0, -0.0, x[1])
    x[1, ::3] = 0.0
    x[2, :] = 1.5  # one value: every key ties
    x[3, ::2] = -np.inf
    x[4] = rng.standard_normal(S) * 1e-30  # tiny magnitudes: subnormal bins
    x[5, :] = -2.0
    x[5, 40:50] = 7.0
    seq_lens = np.asarray([100, 97, 100, 51, 100, 60, 5, 0], np.int32)
    x[6, :3] = 9.0
    x[np.arange(S)[None, :] >= seq_lens[:, None]] = np.nan  # poison: positions past seq_len are never read
    x, seq_lens = jnp.asarray(x), jnp.asarray(seq_lens)
    got = topk_select(x, seq_lens, k, interpret=True, width=16)
    want = topk_from_logits(x, k, seq_lens)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(want)[2], np.arange(8))  # ties: the lowest positions
    np.testing.assert_array_equal(np.asarray(want)[6], [0, 1, 2, 3, 4, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(want)[7], [-1] * 8)


def test_kernels_lower_for_h200():
    """Both kernels (score with histogram, select) lower to Triton for an H200 on a CPU-only machine (an abstract
    device): a primitive the Triton lowering lacks fails here, not first on the GPU."""
    from jax.sharding import AbstractDevice, AbstractMesh, AxisType, use_abstract_mesh

    sds = jax.ShapeDtypeStruct
    args = [
        sds((4, 64, 128), jnp.bfloat16),
        sds((4, 64), jnp.float32),
        sds((64, 64, 128), jnp.float8_e4m3fn),
        sds((4, 40), jnp.int32),
        sds((4,), jnp.int32),
        sds((64, 64), jnp.float32),
    ]
    fn = jax.jit(
        lambda q, w, c, bt, sl, ks: indexer_topk(q, w, c, bt, sl, scale=0.1, k=2048, k_scale=ks, blocks_per_program=4)
    )
    dev = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    with use_abstract_mesh(AbstractMesh((1,), ("x",), (AxisType.Explicit,), abstract_device=dev)):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


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
    with pytest.raises(ValueError, match="top-k k must be a positive int"):
        indexer_topk(q, w, cache, bt, sl, scale=1.0, k=0)
    with pytest.raises(ValueError, match="width must be a power of two"):
        indexer_topk(q, w, cache, bt, sl, scale=1.0, k=4, width=24)
    with pytest.raises(ValueError, match="logits must be f32"):
        topk_select(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((2,), jnp.int32), 4)


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
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(topk_from_logits(jnp.asarray(got), 2048)))
    assert_topk_equivalent(idx, ref, 2048, np.asarray(sl), 2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,width,warps", [("bf16", 1024, 4), ("fp8", 4096, 8)])
def test_gpu_topk_exact_on_integer_scores(dtype, width, warps):
    """V3.2 sizes with exact (integer) scores, ties everywhere: the fused top-k equals the reference exactly
    (two select tunings)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rows = [(0, 9000), (1, 2100), (1, 1000)] + [(2, 3000 + i) for i in range(32)] + [(0, 0)]
    inputs = dict(req_lens=[9000, 2100, 3032], rows=rows, h=64, d=128, g=64, dtype=dtype)
    q, w, cache, bt, sl, ks = integer_inputs(8, **inputs)
    kw = dict(scale=0.25, k_scale=ks, k=2048)
    got = indexer_topk(q, w, cache, bt, sl, width=width, select_warps=warps, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(indexer_topk_reference(q, w, cache, bt, sl, **kw)))
