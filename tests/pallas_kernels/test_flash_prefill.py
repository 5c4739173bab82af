"""flash_prefill vs its float32 reference (CPU: interpret mode; GPU: `-m gpu`).

The cases, inputs (NaN padding) and the check are the shared prefill suite's
(tests/pallas_kernels/prefill_suite.py, pallas_kernels/testing.py); this file adds the Triton
kernel's own tests. Output tolerance |out - ref| <= atol + rtol |ref| (bf16 rounds P and the output
to 8 bits); lse within 1e-4 (+1e-6 relative): float32 math on exactly the reference's (rounded)
inputs, on CPU and GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.flash_prefill import flash_prefill, flash_prefill_reference
from pallas_kernels.testing import FLASH_PREFILL, LENS, PrefillCase, prefill_inputs
from tests.pallas_kernels.prefill_suite import PrefillSuite


class TestFlashPrefill(PrefillSuite):
    KERNEL = FLASH_PREFILL
    LSE_TOL = GPU_LSE_TOL = 1e-4
    LSE_RTOL = 1e-6

    def prefill(self, q, k, v, qs, ks, *, causal, scale, interpret, **tuning):
        return flash_prefill(q, k, v, qs, ks, causal=causal, scale=scale, interpret=interpret, **tuning)

    def test_causal_q_longer_than_k_leaves_rows_empty(self):
        # first q_len - k_len rows of a segment see no key: out 0, lse -inf
        case = PrefillCase(
            "causal_q_longer_than_k",
            (12, 3),
            (4, 0),
            True,
            dict(n=2, dq=48, dv=32, dtype=jnp.float32),
            dict(block_q=16, block_k=16),
            scale=0.3,
            seed=0,
        )
        _, lse = self.run_case(case)
        assert np.all(np.isneginf(lse[:8])) and np.all(np.isfinite(lse[8:12]))


def test_q_start_offset_rows_before_first_sequence_are_padding():
    q, k, v, qs, ks = prefill_inputs(3, [10, 7], [10, 7], n=2, dq=48, dv=32, dtype=jnp.float32)
    qs = qs + 3  # rows 0..2 belong to no sequence (NaN-poison them)
    q = q.at[:3].set(jnp.nan)
    out, lse = flash_prefill(q, k, v, qs, ks, causal=False, scale=0.3, interpret=True, block_q=16, block_k=16)
    ref, ref_lse = flash_prefill_reference(q, k, v, qs, ks, causal=False, scale=0.3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)
    assert np.all(np.isneginf(np.asarray(lse)[:3])) and np.all(np.asarray(out)[:3] == 0)


def test_jit_and_determinism():
    q, k, v, qs, ks = prefill_inputs(4, LENS, LENS, n=2, dq=48, dv=32, dtype=jnp.bfloat16)
    f = jax.jit(lambda *a: flash_prefill(*a, causal=True, scale=0.3, interpret=True, block_q=16, block_k=16))
    a, b = f(q, k, v, qs, ks), f(q, k, v, qs, ks)
    np.testing.assert_array_equal(np.asarray(a[0].astype(jnp.float32)), np.asarray(b[0].astype(jnp.float32)))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(q=np.zeros((4, 2, 48), np.float16).astype(np.int32)), "dtype"),
        (dict(k=np.zeros((6, 2, 40), np.float32)), "head dims differ"),
        (dict(v=np.zeros((5, 2, 32), np.float32)), "token counts differ"),
        (dict(v=np.zeros((6, 3, 32), np.float32)), "head counts"),
        (dict(q_start_loc=np.array([0.0, 4.0], np.float32)), "int32"),
        (dict(k_start_loc=np.array([0, 3, 6], np.int32)), "same number"),
        (
            dict(
                q=np.zeros((4, 2, 48), np.float32),
                k=np.zeros((6, 2, 48), np.float32),
                v=np.zeros((6, 2, 48), np.float32),
            ),
            "v head dim",
        ),
        (dict(q=np.zeros((4, 2, 40), np.float32), k=np.zeros((6, 2, 40), np.float32)), "2\\^a"),
        (dict(block_q=24), "block_q"),
        (dict(q=np.zeros((4, 48), np.float32)), "\\[T, N, H\\]"),
    ],
)
def test_bad_inputs_raise(bad, match):
    args = dict(
        q=np.zeros((4, 2, 48), np.float32),
        k=np.zeros((6, 2, 48), np.float32),
        v=np.zeros((6, 2, 32), np.float32),
        q_start_loc=np.array([0, 4], np.int32),
        k_start_loc=np.array([0, 6], np.int32),
    )
    tuning = {}
    for key, val in bad.items():
        (tuning if key.startswith("block") else args)[key] = val
    args = {key: jnp.asarray(val) for key, val in args.items()}
    with pytest.raises(ValueError, match=match):
        flash_prefill(**args, causal=True, scale=0.1, interpret=True, **tuning)
