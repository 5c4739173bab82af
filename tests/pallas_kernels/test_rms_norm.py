"""The fused residual add + RMSNorm kernel against its reference: interpreted on CPU, lowered to Triton for an
H200 on CPU, and on the GPU (`gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_reference, chunk_width

# rows of very different scales, so that a row mixed with another (or a sum over the wrong columns) shows
ROW_SCALES = np.array([1.0, 300.0, 0.003])


def _inputs(seed, d, dtype, residual=True):
    k = jax.random.split(jax.random.key(seed), 3)
    s = jnp.asarray(ROW_SCALES, jnp.float32)[:, None]
    x = (jax.random.normal(k[0], (3, d), jnp.float32) * s).astype(dtype)
    r = (jax.random.normal(k[1], (3, d), jnp.float32) * s).astype(dtype) if residual else None
    w = (1.0 + 0.1 * jax.random.normal(k[2], (d,), jnp.float32)).astype(dtype)
    return x, r, w


def _check(out, h, ref, ref_h, dtype):
    assert out.dtype == ref.dtype and h.dtype == ref_h.dtype
    np.testing.assert_array_equal(np.asarray(h), np.asarray(ref_h))  # the add is the same add
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    # bf16: the kernel sums the squares chunk by chunk, so 1/rms differs in the last f32 bits, which can flip each
    # of the two bf16 roundings (the normalized value, its product with the weight): within two bf16 steps
    rtol = 1e-6 if dtype == jnp.float32 else 2.0**-6
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=0)


@pytest.mark.parametrize(
    "d,dtype,residual",
    [(2048, jnp.bfloat16, True), (7168, jnp.bfloat16, True), (96, jnp.float32, False), (48, jnp.float32, True)],
)
def test_matches_reference(d, dtype, residual):
    x, r, w = _inputs(d, d, dtype, residual)
    out, h = add_rms_norm(x, r, w, eps=1e-6, interpret=True)
    _check(out, h, *add_rms_norm_reference(x, r, w, eps=1e-6), dtype)


def test_chunks_and_declined_widths():
    assert [chunk_width(d) for d in (7168, 5120, 2048, 4096, 96, 40, 24)] == [1024, 1024, 2048, 2048, 32, None, None]
    x, r, w = _inputs(1, 40, jnp.float32)  # no chunk: the reference, same results
    out, h = add_rms_norm(x, r, w, eps=1e-6, interpret=True)
    ref, ref_h = add_rms_norm_reference(x, r, w, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(ref_h))


@pytest.mark.parametrize("residual", [True, False])
def test_gradients_are_the_references(residual):
    """Differentiable (the reference's backward): training through a kernel norm gets the reference's grads."""
    x, r, w = _inputs(3, 64, jnp.float32, residual)

    def loss(fn):
        def f(x, r, w):
            out, h = fn(x, r, w)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(h * h)

        return jax.grad(f, argnums=(0, 2) if r is None else (0, 1, 2))(x, r, w)

    got = loss(lambda x, r, w: add_rms_norm(x, r, w, eps=1e-6, interpret=True))
    want = loss(lambda x, r, w: add_rms_norm_reference(x, r, w, eps=1e-6))
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)


def test_bad_inputs():
    x, r, w = _inputs(2, 64, jnp.float32)
    with pytest.raises(ValueError, match="x must be"):
        add_rms_norm(x[0], None, w, eps=1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        add_rms_norm(x, r.astype(jnp.bfloat16), w, eps=1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(x, r, w[:32], eps=1e-6)
    with pytest.raises(ValueError, match="x dtype"):
        add_rms_norm(x.astype(jnp.int32), None, w, eps=1e-6)


def test_lowers_to_triton(monkeypatch):
    """Triton IR on CPU (Pallas's lowering, not the Triton compiler) for an H200 at V3's width: one kernel, a
    program per row."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    monkeypatch.setattr(
        pallas_call_registration.gpu_info_lib,
        "get_gpu_info",
        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200),
    )
    a = jax.ShapeDtypeStruct((5, 7168), jnp.bfloat16)
    wt = jax.ShapeDtypeStruct((7168,), jnp.bfloat16)
    f = jax.jit(lambda x, r, w: add_rms_norm(x, r, w, eps=1e-6))
    text = f.trace(a, a, wt).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 5 : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,residual", [(2048, jnp.bfloat16, True), (7168, jnp.bfloat16, False)])
def test_gpu_matches_reference(d, dtype, residual):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x, r, w = _inputs(d + 1, d, dtype, residual)
    out, h = add_rms_norm(x, r, w, eps=1e-6)
    _check(out, h, *add_rms_norm_reference(x, r, w, eps=1e-6), dtype)
