"""gather_cache (xla and pallas) vs its float32 reference (CPU: interpret; GPU: `-m gpu`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gather_cache import gather_cache, gather_cache_reference


def _inputs(seed, *, page, width, ctx_lens, starts, lens, dtype, extra_rows=7):
    """Shuffled pages; every page no chunk reads (other sequences' unused pages, spare pages that
    block-table padding points to) is NaN, as is its fp8 scale."""
    rng = np.random.default_rng(seed)
    n_pp = [max(1, -(-c // page)) for c in ctx_lens]
    max_pages = max(n_pp) + 2
    num_pages = sum(n_pp) + 2
    perm = rng.permutation(num_pages).astype(np.int32)
    bt = np.empty((len(ctx_lens), max_pages), np.int32)
    read = np.zeros(num_pages, bool)
    pos = 0
    for s, n in enumerate(n_pp):
        bt[s, :n] = perm[pos : pos + n]
        bt[s, n:] = perm[-1]
        if lens[s]:
            read[perm[pos + starts[s] // page : pos + -(-(starts[s] + lens[s]) // page)]] = True
        pos += n
    cache = rng.standard_normal((num_pages, page, width)).astype(np.float32)
    kv_scale = None
    if dtype == jnp.float8_e4m3fn:
        cache = jnp.asarray(cache * 2, dtype)  # fp8 has no NaN-free poison: poison the scale
        kv_scale = rng.uniform(0.25, 0.75, (num_pages, page)).astype(np.float32)
        kv_scale[~read] = np.nan
        kv_scale = jnp.asarray(kv_scale)
    else:
        cache[~read] = np.nan
        cache = jnp.asarray(cache, dtype)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return (
        cache,
        jnp.asarray(bt),
        jnp.asarray(np.asarray(starts, np.int32)),
        jnp.asarray(cu),
        int(cu[-1]) + extra_rows,
        kv_scale,
    )


CASES = dict(  # page 8: chunks start page-aligned, end mid-page, one is empty, one is 1 token
    page=8, width=80, ctx_lens=[45, 16, 9, 70], starts=[16, 0, 8, 0], lens=[29, 0, 1, 64]
)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_gather_matches_reference(impl, dtype):
    cache, bt, starts, cu, w, ks = _inputs(0, dtype=dtype, **CASES)
    out_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16
    out = gather_cache(
        cache,
        bt,
        starts,
        cu,
        workspace_rows=w,
        kv_scale=ks,
        out_dtype=out_dtype,
        impl=impl,
        interpret=True,
        block_rows=16,
    )
    ref = gather_cache_reference(cache, bt, starts, cu, workspace_rows=w, kv_scale=ks)
    assert out.shape == (w, CASES["width"]) and out.dtype == out_dtype
    out = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out))
    # a copy: exact up to the output rounding (bf16 output of an f32 product rounds once)
    expect = np.asarray(jnp.asarray(ref).astype(out_dtype).astype(jnp.float32))
    np.testing.assert_array_equal(out, expect)
    assert np.all(out[int(cu[-1]) :] == 0)


def test_workspace_smaller_than_chunks_and_exact_fp8_dequant():
    cache, bt, starts, cu, w, ks = _inputs(1, dtype=jnp.float8_e4m3fn, **CASES)
    w = int(cu[-1]) - 5  # rows past the workspace are simply not written
    for impl in ("xla", "pallas"):
        out = gather_cache(
            cache,
            bt,
            starts,
            cu,
            workspace_rows=w,
            kv_scale=ks,
            out_dtype=jnp.float32,
            impl=impl,
            interpret=True,
            block_rows=8,
        )
        ref = gather_cache_reference(cache, bt, starts, cu, workspace_rows=int(cu[-1]), kv_scale=ks)
        np.testing.assert_array_equal(np.asarray(out), np.asarray(ref)[:w])


def test_power_of_two_width_single_piece():
    cache, bt, starts, cu, w, ks = _inputs(
        2, dtype=jnp.bfloat16, page=16, width=64, ctx_lens=[40, 33], starts=[16, 0], lens=[24, 33]
    )
    a = gather_cache(cache, bt, starts, cu, workspace_rows=w, impl="pallas", interpret=True)
    b = gather_cache(cache, bt, starts, cu, workspace_rows=w, impl="xla")
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(cache=np.zeros((4, 8, 16), np.int8)), "cache dtype"),
        (dict(cache=np.zeros((32, 16), np.float32)), "num_pages"),
        (dict(block_table=np.zeros((2, 3), np.float32)), "block_table"),
        (dict(chunk_starts=np.zeros((3,), np.int32)), "chunk_starts"),
        (dict(cu=np.zeros((2,), np.int32)), "cu_chunk_lens"),
        (dict(workspace_rows=0), "workspace_rows"),
        (dict(kv_scale=np.zeros((4, 8), np.float32)), "only for fp8"),
        (dict(cache=np.zeros((4, 8, 16), np.float32).astype(jnp.float8_e4m3fn)), "needs kv_scale"),
        (dict(impl="triton"), "impl"),
        (dict(out_dtype=jnp.int32), "out_dtype"),
    ],
)
def test_bad_inputs_raise(kw, match):
    args = dict(
        cache=np.zeros((4, 8, 16), np.float32),
        block_table=np.zeros((2, 3), np.int32),
        chunk_starts=np.zeros((2,), np.int32),
        cu=np.zeros((3,), np.int32),
    )
    opts = dict(workspace_rows=8, impl="xla", kv_scale=None, out_dtype=jnp.bfloat16)
    for k, v in kw.items():
        (opts if k in opts else args)[k] = v
    if opts["kv_scale"] is not None:
        opts["kv_scale"] = jnp.asarray(opts["kv_scale"])
    args = [jnp.asarray(v) for v in args.values()]
    with pytest.raises(ValueError, match=match):
        gather_cache(*args, **opts)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_gpu_gather(impl, dtype):
    cache, bt, starts, cu, w, ks = _inputs(
        3,
        dtype=dtype,
        page=64,
        width=576,
        ctx_lens=[3000, 64, 10, 2000],
        starts=[1024, 0, 0, 64],
        lens=[1976, 0, 10, 1111],
    )
    out = gather_cache(cache, bt, starts, cu, workspace_rows=w, kv_scale=ks, out_dtype=jnp.float32, impl=impl)
    ref = gather_cache_reference(cache, bt, starts, cu, workspace_rows=w, kv_scale=ks)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
