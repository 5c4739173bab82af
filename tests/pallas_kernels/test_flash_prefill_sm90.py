"""pallas_kernels.flash_prefill_sm90 (Hopper, Mosaic GPU) against flash_prefill's float32 reference.

CPU: the kernel runs under the Mosaic GPU interpreter (TMA with its out-of-bounds zero fill and
dropped stores, mbarriers, wgmma, the three warpgroups; happens-before race detector on), and it is
lowered for sm_90 (Mosaic GPU's Python passes: layout inference, wgmma/TMA checks, the code path with
P in registers that the interpreter cannot run). GPU (-m gpu): the compiled kernel.

Inputs: fresh random numbers; q/k/v rows past the last sequence are NaN, as are rows before the first
sequence where a test shifts the start locations; the interpreter fills fresh shared memory with NaN.

Tolerances (bf16/f16 operands, f32 accumulation, P rounded to the input dtype, out rounded to it):
  |out - ref| <= 2e-2 + 2e-2 |ref|; lse (f32 math) within 1e-3 (interpreter: exact exp2/log2),
  1e-2 on the GPU (approximate exp2/log2); rows that see no key: out exactly 0, lse exactly -inf.
"""
from __future__ import annotations

import os
import zlib

os.environ.setdefault("NPROC", "8")  # >= 3 XLA CPU workers for the interpreter's 3 warpgroups

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

from pallas_kernels import flash_prefill_sm90 as k90  # noqa: E402
from pallas_kernels.flash_prefill import flash_prefill_reference  # noqa: E402
from pallas_kernels.util import row_windows  # noqa: E402

_NPROC_IN_TIME = (not xla_bridge.backends_are_initialized()
                  or int(os.environ.get("NPROC", "0") or 0) >= 4)
DQ, DV = 192, 128
SCALE = DQ ** -0.5
TOL = (2e-2, 2e-2)   # (atol, rtol) for bf16/f16 outputs
LSE_TOL = {"interpret": 1e-3, "gpu": 1e-2}


def _locs(lens, start=0):
  return (start + np.concatenate([[0], np.cumsum(lens)])).astype(np.int32)


def make_inputs(seed, q_lens, k_lens, *, n=2, dq=DQ, dv=DV, dtype=jnp.bfloat16, pad=5,
                q_start=0, k_start=0):
  """Packed q/k/v with NaN in every row outside the sequences (before the first, after the last)."""
  rng = np.random.default_rng(seed)
  qs, ks = _locs(q_lens, q_start), _locs(k_lens, k_start)
  tq, tk = int(qs[-1]) + pad, int(ks[-1]) + pad
  q = rng.standard_normal((tq, n, dq), np.float32)
  k = rng.standard_normal((tk, n, dq), np.float32)
  v = rng.standard_normal((tk, n, dv), np.float32)
  q[qs[-1]:], k[ks[-1]:], v[ks[-1]:] = np.nan, np.nan, np.nan
  q[:q_start], k[:k_start], v[:k_start] = np.nan, np.nan, np.nan
  return [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(qs), jnp.asarray(ks)]


def run_interpreted(*args, **kw):
  """The one helper that touches interpreter internals (private API: race state and reset)."""
  if not _NPROC_IN_TIME:
    pytest.skip("JAX's CPU client was created before NPROC was raised: the interpreter's 3 "
                "warpgroups would deadlock on 2 workers (set NPROC=8 in tests/conftest.py)")
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  try:
    out = jax.block_until_ready(k90.flash_prefill_sm90(*args, interpret=params, **kw))
  except Exception:
    ipc.reset_gpu_interpret_mode_state()  # the interpreter's shared state survives a failure
    raise
  assert not ipc.get_races().races_found, "the interpreter's race detector fired"
  return out


def check(out, lse, ref, ref_lse, lse_tol):
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  ref, lse, ref_lse = np.asarray(ref), np.asarray(lse), np.asarray(ref_lse)
  assert np.all(np.isfinite(out)), "NaN/inf in the output (padding leaked?)"
  np.testing.assert_allclose(out, ref, atol=TOL[0], rtol=TOL[1])
  assert not np.any(np.isnan(lse))
  np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
  fin = np.isfinite(ref_lse)
  np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=lse_tol, rtol=0)
  assert np.all(out[~fin] == 0)


def run_case(seed, q_lens, k_lens, *, causal, interpret=True, **kw):
  tuning = {key: kw.pop(key) for key in ("block_k", "num_stages", "schedule_barrier",
                                          "p_in_smem") if key in kw}
  q, k, v, qs, ks = make_inputs(seed, q_lens, k_lens, **kw)
  if interpret:
    out, lse = run_interpreted(q, k, v, qs, ks, causal=causal, scale=SCALE, **tuning)
  else:
    out, lse = k90.flash_prefill_sm90(q, k, v, qs, ks, causal=causal, scale=SCALE, **tuning)
  assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype
  assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
  ref, ref_lse = flash_prefill_reference(q, k, v, qs, ks, causal=causal, scale=SCALE)
  check(out, lse, ref, ref_lse, LSE_TOL["interpret" if interpret else "gpu"])
  return out, lse


LENS = [5, 0, 37, 1, 20, 0]   # ragged, empty and one-token sequences in one q tile

CASES = {
    # name: (q_lens, k_lens, causal, kwargs)
    "causal_ragged_one_tile": (LENS, LENS, True, {}),
    # 4 q tiles, sequences straddling tiles, several 64-key tiles per CTA: every loop kind (skip,
    # masked, unmasked) runs; rows past Tq (a partial last tile) are dropped by TMA.
    "causal_multi_tile": ([150, 1, 0, 230, 7], None, True, {}),
    "causal_multi_tile_no_sched_2stages": ([150, 1, 0, 230, 7], None, True,
                                           dict(schedule_barrier=False, num_stages=2)),
    # bottom-right aligned causal with q shorter than k, and q longer than k (empty rows)
    "causal_q_shorter_than_k": ([5, 0, 37, 1, 20], [9, 3, 60, 1, 27], True, {}),
    "causal_q_longer_than_k": ([12, 3, 70], [4, 0, 66], True, {}),
    # context-chunk pass: non-causal, each sequence's queries against its own chunk rows
    "noncausal_chunk": ([5, 0, 37, 1, 20], [9, 3, 200, 1, 7], False, {}),
    "noncausal_chunk_f16_4heads": ([70, 64, 1], [130, 0, 65], False,
                                   dict(n=4, dtype=jnp.float16, num_stages=2)),
    "single_token_sequences": ([1, 1, 1, 1, 1], None, True, dict(n=3)),
    # Tq < 64 and Tk < block_k: the only shapes padded by the wrapper
    "tiny": ([3, 9], None, True, {}),
    # rows before the first sequence are NaN padding (q and k): the first key tile starts below
    # the first visible key (8-row TMA alignment) and its NaN V rows must be zeroed
    "start_offsets_nan_before": ([10, 40], [13, 21], True, dict(q_start=3, k_start=5)),
    # the non-pow2 head dims the API allows: q/k 128, v 64
    "head_dims_128_64": ([33, 90], None, True, dict(dq=128, dv=64)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_matches_reference(name):
  q_lens, k_lens, causal, kw = CASES[name]
  run_case(zlib.crc32(name.encode()), q_lens, q_lens if k_lens is None else k_lens, causal=causal,
           **dict(kw))


def test_tile_meta_classifies_key_tiles():
  """The per-tile metadata against brute force over the row windows: skipped tiles hold no key a
  row of the warpgroup sees, unmasked tiles only keys every non-empty row sees, and the span
  [base, base + n BK) covers every visible key with base 8-aligned."""
  rng = np.random.default_rng(0)
  windows = jax.jit(row_windows, static_argnums=(2, 3, 4))
  meta_fn = jax.jit(k90._tile_meta, static_argnums=(2, 3))
  for trial in range(12):
    n_seq = int(rng.integers(1, 7))
    q_lens = rng.integers(0, 300, n_seq)
    q_lens[rng.random(n_seq) < 0.3] = int(rng.integers(0, 2))
    causal = bool(trial % 2)
    k_lens = q_lens + (rng.integers(0, 100, n_seq) if trial % 3 else 0)
    qs, ks = _locs(q_lens, int(rng.integers(0, 4))), _locs(k_lens, int(rng.integers(0, 12)))
    tq, tk = int(qs[-1]) + 3, int(ks[-1]) + 2
    bk = [64, 128][trial % 2]
    n_qtiles = -(-tq // k90.BLOCK_Q)
    lo, hi = windows(jnp.asarray(qs), jnp.asarray(ks), n_qtiles * k90.BLOCK_Q, tk, causal)
    meta = np.asarray(meta_fn(lo, hi, n_qtiles, bk))
    lo, hi = np.asarray(lo).reshape(n_qtiles, 2, 64), np.asarray(hi).reshape(n_qtiles, 2, 64)
    for t in range(n_qtiles):
      base, n, top, first = meta[t, :4]
      ne_t = lo[t] < hi[t]
      assert base % 8 == 0
      if ne_t.any():
        assert first == lo[t][ne_t].min() and top == hi[t][ne_t].max()
        assert base <= first < base + 8 and base + (n - 1) * bk < top <= base + n * bk
      else:
        assert n == 0
      keys = base + np.arange(n * bk)
      for w in range(2):
        rlo, rhi, ne = lo[t, w], hi[t, w], ne_t[w]
        e0, ja, jb, e1 = meta[t, 4 + 4 * w: 8 + 4 * w]
        assert 0 <= e0 <= ja <= jb <= e1 <= n
        sees = ((keys[None] >= rlo[:, None]) & (keys[None] < rhi[:, None])).reshape(64, n, bk)
        tile = np.arange(n)
        skip = (tile < e0) | (tile >= e1)
        full = (tile >= ja) & (tile < jb)
        assert not sees[:, skip].any(), (trial, t, w)
        assert sees[ne][:, full].all(), (trial, t, w)


def test_jit_and_determinism():
  q, k, v, qs, ks = make_inputs(4, LENS, LENS)
  a = run_interpreted(q, k, v, qs, ks, causal=True, scale=SCALE)
  b = run_interpreted(q, k, v, qs, ks, causal=True, scale=SCALE)
  np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
  np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def _lower_for_sm90(causal=True, pad=5, **kw):
  q, k, v, qs, ks = make_inputs(9, [700, 1, 300], [700, 1, 300] if causal else [900, 64, 5], n=4,
                                pad=pad)
  f = jax.jit(lambda *a: k90.flash_prefill_sm90(*a, causal=causal, scale=SCALE, **kw))
  return f.trace(q, k, v, qs, ks).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("causal, kw", [
    (True, {}),
    (False, {}),
    (True, dict(schedule_barrier=False)),
    (True, dict(p_in_smem=True)),
    (True, dict(block_k=64, num_stages=4)),
])
def test_lowers_for_sm90(causal, kw):
  """The GPU code path (P in registers, accumulating wgmma; differs from the interpreted one in
  `_pv`) passes Mosaic GPU's Python lowering for sm_90: layout inference, wgmma and TMA shapes
  (T = 1006: padded to 8-row multiples; T = 1008 as is)."""
  assert "mosaic_gpu" in _lower_for_sm90(causal, **kw)
  if not kw:
    assert "mosaic_gpu" in _lower_for_sm90(causal, pad=7)


def test_shared_memory_budget_error():
  with pytest.raises(ValueError, match="shared memory"):
    _lower_for_sm90(block_k=128, num_stages=3)


def _bad_args(**over):
  args = dict(q=np.zeros((4, 2, 192), np.float32), k=np.zeros((6, 2, 192), np.float32),
              v=np.zeros((6, 2, 128), np.float32), q_start_loc=np.array([0, 4], np.int32),
              k_start_loc=np.array([0, 6], np.int32))
  for name in ("q", "k", "v"):
    args[name] = args[name].astype(jnp.bfloat16)
  args.update(over)
  return {key: jnp.asarray(val) for key, val in args.items()}


@pytest.mark.parametrize("over, tuning, match", [
    (dict(q=np.zeros((4, 2, 192), np.float32), k=np.zeros((6, 2, 192), np.float32),
          v=np.zeros((6, 2, 128), np.float32)), {}, "bfloat16 or float16"),
    (dict(q=np.zeros((4, 2, 160), jnp.bfloat16), k=np.zeros((6, 2, 160), jnp.bfloat16)), {},
     "multiple of 64"),
    (dict(v=np.zeros((6, 2, 96), jnp.bfloat16)), {}, "v head dim"),
    (dict(v=np.zeros((6, 2, 256), jnp.bfloat16)), {}, "v head dim"),
    (dict(k=np.zeros((6, 2, 128), jnp.bfloat16)), {}, "head dims differ"),
    (dict(q_start_loc=np.array([0, 4, 4], np.int32)), {}, "same number"),
    (dict(q=np.zeros((4, 192), jnp.bfloat16)), {}, "\\[T, N, H\\]"),
    ({}, dict(block_k=96), "block_k"),
    ({}, dict(num_stages=1), "num_stages"),
    ({}, dict(block_q=64), "block_q"),
    ({}, dict(num_warps=8), "num_warps"),
    ({}, dict(scale=-1.0), "scale"),
])
def test_bad_inputs_raise(over, tuning, match):
  tuning = dict(tuning)
  scale = tuning.pop("scale", 0.1)
  with pytest.raises(ValueError, match=match):
    k90.flash_prefill_sm90(**_bad_args(**over), causal=True, scale=scale, interpret=True, **tuning)


def test_unsupported_reason():
  q, k, v = (jnp.zeros((4, 2, d), jnp.bfloat16) for d in (192, 192, 128))
  assert k90.unsupported_reason(q, k, v) is None
  assert "dtype" in k90.unsupported_reason(q.astype(jnp.float32), k, v)
  assert "head dims" in k90.unsupported_reason(q[..., :48], k[..., :48], v[..., :32])


def test_attention_backend_pallas_sm90(monkeypatch):
  """get_backend("pallas_sm90") prefills through this kernel for bf16 and through the portable
  Triton-lowered one where this kernel does not apply (f32)."""
  if not _NPROC_IN_TIME:
    pytest.skip("NPROC was raised too late for the interpreter")
  from mla_jax import attention
  calls = []
  real = k90.flash_prefill_sm90
  monkeypatch.setattr(k90, "flash_prefill_sm90", lambda *a, **kw: calls.append(1) or real(*a, **kw))
  prefill = attention.get_backend("pallas_sm90").flash_prefill
  for dtype, n_calls in ((jnp.bfloat16, 1), (jnp.float32, 1)):
    q, k, v, qs, ks = make_inputs(41, [20, 1, 9], [20, 1, 9], dtype=dtype)
    out, lse = prefill(q, k, v, qs, ks, causal=True, scale=SCALE)
    ref, ref_lse = flash_prefill_reference(q, k, v, qs, ks, causal=True, scale=SCALE)
    check(out, lse, ref, ref_lse, LSE_TOL["interpret"])
    assert len(calls) == n_calls


# ----------------------------------------------------------------------------------------------
# GPU (make gpu): the compiled kernel.

def _need_sm90():
  if jax.default_backend() != "gpu" or not k90.is_sm90():
    pytest.skip("needs a Hopper GPU (compute capability 9.x)")


GPU_CASES = [
    # (q_lens, k_lens, causal, kwargs)
    ([700, 0, 1, 129, 1000], None, True, dict(n=8)),
    ([700, 0, 1, 129, 1000], [300, 5, 0, 640, 64], False, dict(n=8)),
    ([1000, 3000], None, True, dict(n=16)),                                # the larger shape
    ([300, 5, 64, 200], [1000, 3, 640, 64], True, dict(n=8)),              # causal, q < k
    ([1024, 1024], None, True, dict(n=16, schedule_barrier=False)),
    ([700, 0, 1, 129, 1000], None, True, dict(n=4, p_in_smem=True)),
    ([700, 0, 1, 129, 1000], None, True, dict(n=4, block_k=64, num_stages=4)),
    ([513, 77, 1], [900, 77, 2], False, dict(n=4, dtype=jnp.float16)),
    ([10, 40, 333], [13, 21, 500], True, dict(n=4, q_start=3, k_start=5)),  # NaN before starts
    ([3, 9], None, True, dict(n=2)),                                        # tiny: padded path
]


@pytest.mark.gpu
@pytest.mark.parametrize("idx", range(len(GPU_CASES)))
def test_gpu_matches_reference(idx):
  _need_sm90()
  q_lens, k_lens, causal, kw = GPU_CASES[idx]
  run_case(3000 + idx, q_lens, q_lens if k_lens is None else k_lens, causal=causal,
           interpret=False, **dict(kw))


@pytest.mark.gpu
def test_gpu_matches_triton_kernel():
  """Same inputs through the portable Triton-lowered kernel: the two agree to bf16 rounding (each
  is within 2e-2 + 2e-2 |ref| of the reference, so twice that between them)."""
  _need_sm90()
  from pallas_kernels.flash_prefill import flash_prefill
  q, k, v, qs, ks = make_inputs(7, [1000, 3000], [1000, 3000], n=16)
  out, lse = k90.flash_prefill_sm90(q, k, v, qs, ks, causal=True, scale=SCALE)
  out_t, lse_t = flash_prefill(q, k, v, qs, ks, causal=True, scale=SCALE)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_t, np.float32),
                             atol=4e-2, rtol=4e-2)
  fin = np.isfinite(np.asarray(lse_t))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_t)[fin], atol=1e-2)


@pytest.mark.gpu
def test_gpu_deterministic():
  _need_sm90()
  q, k, v, qs, ks = make_inputs(8, [700, 1, 1000], [700, 1, 1000], n=8)
  f = jax.jit(lambda *a: k90.flash_prefill_sm90(*a, causal=True, scale=SCALE))
  a, b = f(q, k, v, qs, ks), f(q, k, v, qs, ks)
  np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
  np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
