"""flash_prefill vs its float32 reference (CPU: interpret mode; GPU: `-m gpu`)."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.flash_prefill import flash_prefill, flash_prefill_reference

# Output tolerance: |out - ref| <= ATOL + RTOL |ref|; bf16 rounds P and the output to 8 bits.
TOL = {jnp.bfloat16: (2e-2, 2e-2), jnp.float32: (2e-5, 1e-5)}
LSE_TOL = 1e-4  # lse is float32 math on exactly the reference's (rounded) inputs


def _locs(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _inputs(seed, q_lens, k_lens, n, dq, dv, dtype, pad=5):
  rng = np.random.default_rng(seed)
  qs, ks = _locs(q_lens), _locs(k_lens)
  tq, tk = int(qs[-1]) + pad, int(ks[-1]) + pad
  q = rng.standard_normal((tq, n, dq), np.float32)
  k = rng.standard_normal((tk, n, dq), np.float32)
  v = rng.standard_normal((tk, n, dv), np.float32)
  q[qs[-1]:], k[ks[-1]:], v[ks[-1]:] = np.nan, np.nan, np.nan  # padding must not leak
  return [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(qs), jnp.asarray(ks)]


def _check(q_lens, k_lens, *, causal, n=2, dq=48, dv=32, dtype=jnp.float32, seed=0,
           interpret=True, scale=0.3, **tuning):
  q, k, v, qs, ks = _inputs(seed, q_lens, k_lens, n, dq, dv, dtype)
  out, lse = flash_prefill(q, k, v, qs, ks, causal=causal, scale=scale, interpret=interpret,
                           **tuning)
  ref, ref_lse = flash_prefill_reference(q, k, v, qs, ks, causal=causal, scale=scale)
  assert out.shape == (q.shape[0], q.shape[1], dv) and out.dtype == q.dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
  lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
  atol, rtol = TOL[dtype]
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  assert not np.any(np.isnan(lse))
  fin = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=LSE_TOL, rtol=1e-6)
  # Padding rows and rows that see no key: exactly 0 / -inf.
  empty = ~fin
  assert np.all(out[empty] == 0)
  return out, lse


# Ragged lengths incl. zero-length and one-token sequences; block_q=16 so q blocks straddle.
LENS = [5, 0, 37, 1, 20, 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_causal_self(dtype):
  _check(LENS, LENS, causal=True, dtype=dtype, block_q=16, block_k=16)


def test_causal_q_shorter_than_k():
  # bottom-right aligned: q row i sees k_len - q_len + i + 1 keys
  _check([5, 0, 37, 1, 20], [9, 3, 60, 1, 27], causal=True, block_q=16, block_k=32)


def test_causal_q_longer_than_k_leaves_rows_empty():
  # first q_len - k_len rows of a segment see no key: out 0, lse -inf
  _, lse = _check([12, 3], [4, 0], causal=True, block_q=16, block_k=16)
  assert np.all(np.isneginf(lse[:8])) and np.all(np.isfinite(lse[8:12]))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_noncausal_chunk(dtype):
  # context-chunk pass: each sequence's queries against its own (differently sized) chunk rows
  _check([5, 0, 37, 1, 20], [9, 3, 60, 1, 7], causal=False, dtype=dtype, block_q=16, block_k=16)


def test_single_token_prefills_and_pow2_head_dims():
  _check([1, 1, 1, 1, 1], [1, 1, 1, 1, 1], causal=True, dq=32, dv=16, n=3, block_q=16,
         block_k=16)


def test_block_larger_than_everything():
  _check([3, 9], [3, 9], causal=True, block_q=64, block_k=64)


def test_deepseek_dims_bf16():
  # the real 192 = 128 + 64 q/k split with v 128, default tuning
  _check([40, 0, 90], [40, 0, 90], causal=True, dq=192, dv=128, dtype=jnp.bfloat16,
         scale=192 ** -0.5)


def test_q_start_offset_rows_before_first_sequence_are_padding():
  q, k, v, qs, ks = _inputs(3, [10, 7], [10, 7], 2, 48, 32, jnp.float32)
  qs = qs + 3  # rows 0..2 belong to no sequence (NaN-poison them)
  q = q.at[:3].set(jnp.nan)
  out, lse = flash_prefill(q, k, v, qs, ks, causal=False, scale=0.3, interpret=True,
                           block_q=16, block_k=16)
  ref, ref_lse = flash_prefill_reference(q, k, v, qs, ks, causal=False, scale=0.3)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)
  assert np.all(np.isneginf(np.asarray(lse)[:3])) and np.all(np.asarray(out)[:3] == 0)


def test_jit_and_determinism():
  q, k, v, qs, ks = _inputs(4, LENS, LENS, 2, 48, 32, jnp.bfloat16)
  f = jax.jit(lambda *a: flash_prefill(*a, causal=True, scale=0.3, interpret=True, block_q=16,
                                       block_k=16))
  a, b = f(q, k, v, qs, ks), f(q, k, v, qs, ks)
  np.testing.assert_array_equal(np.asarray(a[0].astype(jnp.float32)),
                                np.asarray(b[0].astype(jnp.float32)))


@pytest.mark.parametrize("bad, match", [
    (dict(q=np.zeros((4, 2, 48), np.float16).astype(np.int32)), "dtype"),
    (dict(k=np.zeros((6, 2, 40), np.float32)), "head dims differ"),
    (dict(v=np.zeros((5, 2, 32), np.float32)), "token counts differ"),
    (dict(v=np.zeros((6, 3, 32), np.float32)), "head counts"),
    (dict(q_start_loc=np.array([0.0, 4.0], np.float32)), "int32"),
    (dict(k_start_loc=np.array([0, 3, 6], np.int32)), "same number"),
    (dict(q=np.zeros((4, 2, 48), np.float32), k=np.zeros((6, 2, 48), np.float32),
          v=np.zeros((6, 2, 48), np.float32)), "v head dim"),
    (dict(q=np.zeros((4, 2, 40), np.float32), k=np.zeros((6, 2, 40), np.float32)), "2\\^a"),
    (dict(block_q=24), "block_q"),
    (dict(q=np.zeros((4, 48), np.float32)), "\\[T, N, H\\]"),
])
def test_bad_inputs_raise(bad, match):
  args = dict(q=np.zeros((4, 2, 48), np.float32), k=np.zeros((6, 2, 48), np.float32),
              v=np.zeros((6, 2, 32), np.float32), q_start_loc=np.array([0, 4], np.int32),
              k_start_loc=np.array([0, 6], np.int32))
  tuning = {}
  for key, val in bad.items():
    (tuning if key.startswith("block") else args)[key] = val
  args = {key: jnp.asarray(val) for key, val in args.items()}
  with pytest.raises(ValueError, match=match):
    flash_prefill(**args, causal=True, scale=0.1, interpret=True, **tuning)


# ---- GPU: the real Triton kernel (run by `make gpu`) ----

@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_deepseek_dims(causal, dtype):
  lens = [700, 0, 1, 129, 1000]
  k_lens = lens if causal else [300, 5, 0, 640, 64]
  _check(lens, k_lens, causal=causal, n=8, dq=192, dv=128, dtype=dtype, scale=192 ** -0.5,
         interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [dict(block_q=64, block_k=32, num_warps=4, num_stages=3),
                                    dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
                                    dict(block_q=128, block_k=64, num_warps=8, num_stages=3)])
def test_gpu_tuning_variants(tuning):
  _check([300, 17, 0, 513], [300, 17, 0, 513], causal=True, n=4, dq=192, dv=128,
         dtype=jnp.bfloat16, scale=192 ** -0.5, interpret=False, **tuning)
