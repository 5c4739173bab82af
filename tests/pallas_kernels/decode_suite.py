"""The decode test suite every paged decode kernel subclasses.

The cases, the NaN-poisoned input builder, the float32 reference of a kernel's options and the
tolerance table live in `pallas_kernels.testing` (the benchmarks check the same cases). A subclass
names its kernel (`KERNEL`, the name the cases list in `kernels`) and says how to call it
(`decode`): it then runs its interpreted cases on CPU and, with `-m gpu`, its GPU cases on the GPU.
Kernel-specific tests (bad inputs, batch invariance, schedules, lowering) stay in the kernel's file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.testing import (
    DECODE_CASES,
    DECODE_GPU_CASES,
    assert_decode_close,
    cases_for,
    decode_gpu_tolerance,
    decode_kind,
    decode_reference,
)


class DecodeSuite:
    KERNEL: str = ""

    def decode(self, q, cache, bt, sl, ks, *, l, interpret, **kernel_kw):
        """(out, lse) of the kernel on these inputs, scale `testing.DECODE_SCALE`."""
        raise NotImplementedError

    def check_case(self, case, seq_lens):
        """Hook: assertions on an interpreted case's inputs (e.g. that it exercises a code path)."""

    def require_gpu(self):
        if jax.default_backend() != "gpu":
            pytest.skip("needs a GPU")

    def pytest_generate_tests(self, metafunc):
        for arg, table in (("case", DECODE_CASES), ("gpu_case", DECODE_GPU_CASES)):
            if arg in metafunc.fixturenames:
                cases = cases_for(table, self.KERNEL)
                metafunc.parametrize(arg, cases, ids=[c.name for c in cases])

    def test_matches_reference(self, case):
        q, cache, bt, sl, ks = case.make()
        self.check_case(case, sl)
        out, lse = self.decode(q, cache, bt, sl, ks, l=case.l, interpret=True, **case.kernel)
        # The reference jitted: one compile a case instead of one per eager op (~1 s a case on 2 cores).
        ref, ref_lse = jax.jit(lambda *a: decode_reference(*a, case.kernel, case.l))(q, cache, bt, sl, ks)
        assert out.dtype == q.dtype and lse.dtype == jnp.float32
        assert_decode_close(out, lse, ref, ref_lse, decode_kind(case))

    @pytest.mark.gpu
    def test_gpu_matches_reference(self, gpu_case):
        self.require_gpu()
        case = gpu_case
        q, cache, bt, sl, ks = case.make()
        out, lse = self.decode(q, cache, bt, sl, ks, l=case.l, interpret=False, **case.kernel)
        ref, ref_lse = decode_reference(q, cache, bt, sl, ks, case.kernel, case.l)
        assert out.dtype == q.dtype and lse.dtype == jnp.float32
        # GPU dots accumulate in a different order than the CPU reference: same out bounds, lse 1e-2
        # (fp8_qk: its own bounds, see pallas_kernels/testing.py).
        kind = decode_kind(case)
        out_tol, lse_tol = decode_gpu_tolerance(kind)
        assert_decode_close(out, lse, ref, ref_lse, kind, lse_tol=lse_tol, out_tol=out_tol)
