"""The prefill test suite every varlen prefill attention kernel subclasses.

The cases, the NaN-padded input builder, the check and the dtype tolerance table live in
`pallas_kernels.testing` (the benchmarks check the same cases); the reference is
`flash_prefill.flash_prefill_reference`. A subclass names its kernel (`KERNEL`, the name the cases
list in `kernels`), says how to call it (`prefill`) and sets its lse bounds: it then runs its
interpreted cases on CPU and, with `-m gpu`, its GPU cases on the GPU. Kernel-specific tests stay
in the kernel's file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.testing import PREFILL_CASES, PREFILL_GPU_CASES, cases_for, check_prefill


class PrefillSuite:
    KERNEL: str = ""
    LSE_TOL: float = 0.0  # lse bound (absolute) in interpret mode
    GPU_LSE_TOL: float = 0.0  # and on the GPU
    LSE_RTOL: float = 0.0

    def prefill(self, q, k, v, qs, ks, *, causal, scale, interpret, **tuning):
        raise NotImplementedError

    def require_gpu(self):
        if jax.default_backend() != "gpu":
            pytest.skip("needs a GPU")

    def pytest_generate_tests(self, metafunc):
        for arg, table in (("case", PREFILL_CASES), ("gpu_case", PREFILL_GPU_CASES)):
            if arg in metafunc.fixturenames:
                cases = cases_for(table, self.KERNEL)
                metafunc.parametrize(arg, cases, ids=[c.name for c in cases])

    def run_case(self, case, *, interpret=True):
        """Run `case`, check it against the reference; (out f32, lse) as numpy arrays."""
        q, k, v, qs, ks = case.make()
        out, lse = self.prefill(
            q, k, v, qs, ks, causal=case.causal, scale=case.scale, interpret=interpret, **case.kernel
        )
        assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == q.dtype
        assert lse.shape == q.shape[:2] and lse.dtype == jnp.float32
        ref, ref_lse = case.reference(q, k, v, qs, ks)
        return check_prefill(
            out, lse, ref, ref_lse, lse_rtol=self.LSE_RTOL, lse_tol=self.LSE_TOL if interpret else self.GPU_LSE_TOL
        )

    def test_matches_reference(self, case):
        self.run_case(case)

    @pytest.mark.gpu
    def test_gpu_matches_reference(self, gpu_case):
        self.require_gpu()
        self.run_case(gpu_case, interpret=False)
