"""pallas_kernels.sparse_mla_decode (token-sparse latent MQA over a [rows, K] slot table) against its float32
reference (CPU: interpret=True; GPU: -m gpu). Inputs are NaN-poisoned wherever no table names a row (cache rows,
fp8 scales, q rows of empty tables): a kernel that reads an unnamed slot fails. Tables hold -1 holes anywhere,
in random order, multi-token rows, rows shorter than K; with every visible token named the result equals the
dense paged decode."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_decode import mla_decode_reference
from pallas_kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_reference
from pallas_kernels.testing import DECODE_SCALE as SCALE
from pallas_kernels.testing import (
    SPARSE_DECODE_CASES,
    SPARSE_DECODE_GPU_CASES,
    assert_decode_close,
    decode_gpu_tolerance,
    sparse_decode_inputs,
)


def _run(fn, q, cache, table, ks, l, **kw):
    return fn(q, cache, table, scale=SCALE, kv_scale=ks, kv_lora_rank=l, **kw)


@pytest.mark.parametrize("name,inputs,kernel,kind", SPARSE_DECODE_CASES, ids=[c[0] for c in SPARSE_DECODE_CASES])
def test_matches_reference(name, inputs, kernel, kind):
    q, cache, table, ks, _, _ = sparse_decode_inputs(zlib.crc32(name.encode()), **inputs)
    l = inputs.get("l", 512)
    out, lse = _run(sparse_mla_decode, q, cache, table, ks, l, interpret=True, **kernel)
    ref, ref_lse = _run(sparse_mla_decode_reference, q, cache, table, ks, l)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_decode_close(out, lse, ref, ref_lse, kind)


def test_reference_matches_numpy():
    """The reference itself, against a float64 loop over each row's named slots."""
    l, r = 32, 16
    q, cache, table, _, _, _ = sparse_decode_inputs(3, b=2, nq=2, n=4, k=12, lens=[30, 5], l=l, r=r, g=8)
    ref, ref_lse = _run(sparse_mla_decode_reference, q, cache, table, None, l)
    rows = np.asarray(cache.astype(jnp.float32), np.float64).reshape(-1, l + r)
    qn, tn = np.asarray(q.astype(jnp.float32), np.float64), np.asarray(table)
    for i in range(2):
        for t in range(2):
            k = rows[tn[i, t][tn[i, t] >= 0]]
            logits = SCALE * qn[i, t] @ k.T  # [N, named]
            lse = np.log(np.exp(logits).sum(-1))
            np.testing.assert_allclose(np.asarray(ref_lse[i, t]), lse, atol=1e-4, rtol=0)
            out = np.exp(logits - lse[:, None]) @ k[:, :l]
            np.testing.assert_allclose(np.asarray(ref[i, t], np.float32), out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8"])
def test_short_sequences_equal_dense_decode(cache_dtype):
    """Rows that see fewer than K tokens name all of them: sparse decode == the dense paged decode."""
    l = 64
    q, cache, table, ks, bt, sl = sparse_decode_inputs(
        5, b=3, nq=2, n=16, k=64, lens=[40, 63, 1], l=l, r=16, g=16, causal=True, dense=True, cache_dtype=cache_dtype
    )
    dense, dense_lse = mla_decode_reference(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=l)
    out, lse = _run(sparse_mla_decode, q, cache, table, ks, l, interpret=True, block_kv=16)
    assert_decode_close(out, lse, dense, dense_lse, cache_dtype)
    ref, ref_lse = _run(sparse_mla_decode_reference, q, cache, table, ks, l)
    assert_decode_close(ref, ref_lse, dense, dense_lse, "f32" if cache_dtype == "bf16" else cache_dtype)


def test_out_of_range_slots():
    """A concrete table naming a slot past the pool is an error before any work; under jit such an entry is
    masked like -1 (never read)."""
    l = 32
    q, cache, table, _, _, _ = sparse_decode_inputs(9, b=2, nq=1, n=16, k=16, lens=[20, 9], l=l, r=16, g=8)
    num_slots = cache.shape[0] * cache.shape[1]
    bad = table.at[0, 0, 3].set(num_slots + 5)
    with pytest.raises(ValueError, match=f"slot {num_slots + 5} outside"):
        _run(sparse_mla_decode, q, cache, bad, None, l, interpret=True)
    jitted = jax.jit(lambda t: _run(sparse_mla_decode, q, cache, t, None, l, interpret=True, block_kv=16))
    out, lse = jitted(bad)
    ref, ref_lse = _run(sparse_mla_decode_reference, q, cache, table.at[0, 0, 3].set(-1), None, l)
    assert_decode_close(out, lse, ref, ref_lse, "bf16")


def test_bad_inputs():
    l = 32
    q, cache, table, _, _, _ = sparse_decode_inputs(2, b=1, nq=1, n=16, k=16, lens=[20], l=l, r=16, g=8)
    with pytest.raises(ValueError, match="topk_slots must be int32"):
        _run(sparse_mla_decode, q, cache, table.astype(jnp.int16), None, l)
    with pytest.raises(ValueError, match=r"topk_slots must be \[B, Q, K\]"):
        _run(sparse_mla_decode, q, cache, table[:, :, None], None, l)
    with pytest.raises(ValueError, match="kv_scale must be given exactly for an fp8 cache"):
        _run(sparse_mla_decode, q, cache.astype(jnp.float8_e4m3fn), table, None, l)
    with pytest.raises(ValueError, match="rope 24 dims must be powers of two"):
        _run(sparse_mla_decode, q, cache, table, None, 24)
    with pytest.raises(ValueError, match="block_kv must be a power of two"):
        _run(sparse_mla_decode, q, cache, table, None, l, block_kv=24)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,inputs,kernel,kind", SPARSE_DECODE_GPU_CASES, ids=[c[0] for c in SPARSE_DECODE_GPU_CASES]
)
def test_gpu_matches_reference(name, inputs, kernel, kind):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, cache, table, ks, _, _ = sparse_decode_inputs(zlib.crc32(name.encode()), **inputs)
    out, lse = _run(sparse_mla_decode, q, cache, table, ks, 512, **kernel)
    ref, ref_lse = _run(sparse_mla_decode_reference, q, cache, table, ks, 512)
    assert_decode_close(out, lse, ref, ref_lse, kind, lse_tol=decode_gpu_tolerance(kind)[1])
