"""`util.round_e4m3`: float32 onto the float8_e4m3fn grid, ties to even, the same on the CPU (XLA), in the Pallas
interpreter and inside a Triton-lowered kernel on the GPU."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.util import FP8_MAX, round_e4m3


def _hard_inputs():
    """Every finite e4m3 value, the midpoints between neighbours and the float32 values either side of each (where a
    second rounding through f16 goes wrong), both zeros, values below the smallest subnormal, and random values
    over e4m3's whole range of binades."""
    grid = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = np.unique(grid[np.isfinite(grid)])
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(0)
    rand = rng.standard_normal(20_000) * np.exp2(rng.integers(-14, 9, 20_000))
    x = np.concatenate(
        [grid, mids, np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf), [-0.0, 0.0, 1e-30, -(2.0**-11)], rand]
    )
    return np.clip(x, -FP8_MAX, FP8_MAX).astype(np.float32)


def _nearest_e4m3(x):
    return x.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)  # ml_dtypes: one rounding, ties to even


def test_round_e4m3_is_the_nearest_e4m3():
    x = _hard_inputs()
    got = np.asarray(jax.jit(round_e4m3)(x))
    np.testing.assert_array_equal(got.view(np.uint32), _nearest_e4m3(x).view(np.uint32))  # -0 included


def test_round_e4m3_in_the_interpreted_kernel():
    """Inside a Pallas kernel run by the CPU interpreter (XLA): the cast of the rounded value, and its upcast, are
    exact (a plain cast and upcast would fold into nothing)."""
    x = _hard_inputs()[:8192].reshape(64, 128)

    def kernel(x_ref, o_ref):
        o_ref[...] = round_e4m3(x_ref[...]).astype(jnp.float8_e4m3fn)

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn), interpret=True)(x)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


@pytest.mark.gpu
def test_gpu_round_e4m3_in_a_triton_kernel():
    """On the GPU, in a Triton-lowered kernel: the stored e4m3 is the nearest value for every input."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x = _hard_inputs()
    x = np.resize(x, (x.size + 1023) // 1024 * 1024).reshape(-1, 1024)
    spec = pl.BlockSpec((1, 1024), lambda i: (i, 0))

    def kernel(x_ref, o_ref):
        o_ref[...] = round_e4m3(x_ref[...]).astype(jnp.float8_e4m3fn)

    got = pl.pallas_call(
        kernel,
        grid=(x.shape[0],),
        in_specs=[spec],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
    )(x)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint8), x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8))
