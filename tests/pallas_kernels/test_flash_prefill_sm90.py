"""pallas_kernels.flash_prefill_sm90 (Hopper, Mosaic GPU) against flash_prefill's float32 reference.

CPU: the kernel runs under the Mosaic GPU interpreter (TMA with its out-of-bounds zero fill and
dropped stores, mbarriers, wgmma, the three warpgroups; happens-before race detector on), and it is
lowered for sm_90 (Mosaic GPU's Python passes: layout inference, wgmma/TMA checks, the code path
with P in registers that the interpreter cannot run). GPU (-m gpu): the compiled kernel.

The cases, inputs and the check are the shared prefill suite's (prefill_suite.py,
pallas_kernels/testing.py): fresh random numbers; q/k/v rows past the last sequence are NaN, as are
rows before the first sequence where a case shifts the start locations; the interpreter fills fresh
shared memory with NaN.

Tolerances (bf16/f16 operands, f32 accumulation, P rounded to the input dtype, out rounded to it):
  |out - ref| <= 2e-2 + 2e-2 |ref|; lse (f32 math) within 1e-3 (interpreter: exact exp2/log2),
  1e-2 on the GPU (approximate exp2/log2); rows that see no key: out exactly 0, lse exactly -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import flash_prefill_sm90 as k90
from pallas_kernels.flash_prefill import flash_prefill_reference
from pallas_kernels.testing import FLASH_PREFILL_SM90, LENS, check_prefill, locs, prefill_inputs
from pallas_kernels.testing import PREFILL_SCALE as SCALE
from pallas_kernels.util import cdiv, row_windows
from tests.pallas_kernels.mosaic_interpreter import NPROC_IN_TIME, run_interpreted
from tests.pallas_kernels.prefill_suite import PrefillSuite


class TestFlashPrefillSm90(PrefillSuite):
    KERNEL = FLASH_PREFILL_SM90
    LSE_TOL = 1e-3  # interpreter: exact exp2/log2
    GPU_LSE_TOL = 1e-2  # approximate exp2/log2

    def prefill(self, q, k, v, qs, ks, *, causal, scale, interpret, **tuning):
        if interpret:
            return run_interpreted(k90.flash_prefill_sm90, q, k, v, qs, ks, causal=causal, scale=scale, **tuning)
        return k90.flash_prefill_sm90(q, k, v, qs, ks, causal=causal, scale=scale, **tuning)

    def require_gpu(self):
        _need_sm90()


def run_prefill(*args, **kw):
    """The interpreted kernel (race detector on)."""
    return run_interpreted(k90.flash_prefill_sm90, *args, **kw)


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
        qs, ks = locs(q_lens, int(rng.integers(0, 4))), locs(k_lens, int(rng.integers(0, 12)))
        tq, tk = int(qs[-1]) + 3, int(ks[-1]) + 2
        bk = [64, 128][trial % 2]
        wgs = 2  # consumer warpgroups
        n_qtiles = cdiv(tq, 64 * wgs)
        lo, hi = windows(jnp.asarray(qs), jnp.asarray(ks), n_qtiles * 64 * wgs, tk, causal)
        meta = np.asarray(meta_fn(lo, hi, n_qtiles, bk))
        lo, hi = np.asarray(lo).reshape(n_qtiles, wgs, 64), np.asarray(hi).reshape(n_qtiles, wgs, 64)
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
            for w in range(wgs):
                rlo, rhi, ne = lo[t, w], hi[t, w], ne_t[w]
                e0, ja, jb, e1 = meta[t, 4 + 4 * w : 8 + 4 * w]
                assert 0 <= e0 <= ja <= jb <= e1 <= n
                sees = ((keys[None] >= rlo[:, None]) & (keys[None] < rhi[:, None])).reshape(64, n, bk)
                tile = np.arange(n)
                skip = (tile < e0) | (tile >= e1)
                full = (tile >= ja) & (tile < jb)
                assert not sees[:, skip].any(), (trial, t, w)
                assert sees[ne][:, full].all(), (trial, t, w)


def test_jit_and_determinism():
    q, k, v, qs, ks = prefill_inputs(4, LENS, LENS)
    a = run_prefill(q, k, v, qs, ks, causal=True, scale=SCALE)
    b = run_prefill(q, k, v, qs, ks, causal=True, scale=SCALE)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


def _lower_for_sm90(causal=True, pad=5, **kw):
    k_lens = [700, 1, 300] if causal else [900, 64, 5]
    q, k, v, qs, ks = prefill_inputs(9, [700, 1, 300], k_lens, n=4, pad=pad)
    f = jax.jit(lambda *a: k90.flash_prefill_sm90(*a, causal=causal, scale=SCALE, **kw))
    return f.trace(q, k, v, qs, ks).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "causal, kw",
    [
        (True, {}),
        (False, {}),
        (True, dict(schedule_barrier=False)),
        (True, dict(p_in_smem=True)),
        (True, dict(block_k=64, num_stages=4)),
    ],
)
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
    args = dict(
        q=np.zeros((4, 2, 192), np.float32),
        k=np.zeros((6, 2, 192), np.float32),
        v=np.zeros((6, 2, 128), np.float32),
        q_start_loc=np.array([0, 4], np.int32),
        k_start_loc=np.array([0, 6], np.int32),
    )
    for name in ("q", "k", "v"):
        args[name] = args[name].astype(jnp.bfloat16)
    args.update(over)
    return {key: jnp.asarray(val) for key, val in args.items()}


@pytest.mark.parametrize(
    "over, tuning, match",
    [
        (
            dict(
                q=np.zeros((4, 2, 192), np.float32),
                k=np.zeros((6, 2, 192), np.float32),
                v=np.zeros((6, 2, 128), np.float32),
            ),
            {},
            "bfloat16 or float16",
        ),
        (dict(q=np.zeros((4, 2, 160), jnp.bfloat16), k=np.zeros((6, 2, 160), jnp.bfloat16)), {}, "multiple of 64"),
        (dict(v=np.zeros((6, 2, 96), jnp.bfloat16)), {}, "v head dim"),
        (dict(v=np.zeros((6, 2, 256), jnp.bfloat16)), {}, "v head dim"),
        (dict(k=np.zeros((6, 2, 128), jnp.bfloat16)), {}, "head dims differ"),
        (dict(q_start_loc=np.array([0, 4, 4], np.int32)), {}, "same number"),
        (dict(q=np.zeros((4, 192), jnp.bfloat16)), {}, "\\[T, N, H\\]"),
        ({}, dict(block_k=96), "block_k"),
        ({}, dict(num_stages=1), "num_stages"),
        ({}, dict(num_warps=8), "num_warps"),
        ({}, dict(scale=-1.0), "scale"),
    ],
)
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
    if not NPROC_IN_TIME:
        pytest.skip("NPROC was raised too late for the interpreter")
    from mla_jax import attention

    calls = []
    real = k90.flash_prefill_sm90
    monkeypatch.setattr(k90, "flash_prefill_sm90", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prefill = attention.get_backend("pallas_sm90").flash_prefill
    for dtype, n_calls in ((jnp.bfloat16, 1), (jnp.float32, 1)):
        q, k, v, qs, ks = prefill_inputs(41, [20, 1, 9], [20, 1, 9], dtype=dtype)
        out, lse = prefill(q, k, v, qs, ks, causal=True, scale=SCALE)
        ref, ref_lse = flash_prefill_reference(q, k, v, qs, ks, causal=True, scale=SCALE)
        check_prefill(out, lse, ref, ref_lse, lse_tol=TestFlashPrefillSm90.LSE_TOL, tol=(2e-2, 2e-2))
        assert len(calls) == n_calls


# ----------------------------------------------------------------------------------------------
# GPU (make gpu): the compiled kernel; the shared cases run in TestFlashPrefillSm90.


def _need_sm90():
    if jax.default_backend() != "gpu" or not k90.is_sm90():
        pytest.skip("needs a Hopper GPU (compute capability 9.x)")


@pytest.mark.gpu
def test_gpu_matches_triton_kernel():
    """Same inputs through the portable Triton-lowered kernel: the two agree to bf16 rounding (each
    is within 2e-2 + 2e-2 |ref| of the reference, so twice that between them)."""
    _need_sm90()
    from pallas_kernels.flash_prefill import flash_prefill

    q, k, v, qs, ks = prefill_inputs(7, [1000, 3000], [1000, 3000], n=16)
    out, lse = k90.flash_prefill_sm90(q, k, v, qs, ks, causal=True, scale=SCALE)
    out_t, lse_t = flash_prefill(q, k, v, qs, ks, causal=True, scale=SCALE)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out_t, np.float32), atol=4e-2, rtol=4e-2)
    fin = np.isfinite(np.asarray(lse_t))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_t)[fin], atol=1e-2)


@pytest.mark.gpu
def test_gpu_deterministic():
    _need_sm90()
    q, k, v, qs, ks = prefill_inputs(8, [700, 1, 1000], [700, 1, 1000], n=8)
    f = jax.jit(lambda *a: k90.flash_prefill_sm90(*a, causal=True, scale=SCALE))
    a, b = f(q, k, v, qs, ks), f(q, k, v, qs, ks)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
