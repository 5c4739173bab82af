"""fp8_quant.quantize_act (the W8A8 activation quantization kernel) against `util.quantize_act`: the same e4m3
values and scales bit for bit (interpret mode on CPU, the Triton kernel with `-m gpu`), its Triton lowering for an
H200, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.fp8_quant import quantize_act, quantize_act_reference


def _x(seed, t, k, dtype):
    """Rows at scales 2^-12..2^8 per 128-channel block (each block its own scale), a zero block, a tie to round."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x *= np.exp2(rng.integers(-12, 9, (t, k // 128 if k % 128 == 0 else k // 128 + 1)))[
        :, np.repeat(np.arange((k + 127) // 128), 128)[:k]
    ]
    x[0, :128] = 0.0  # an all-zero block: the floor scale
    return jnp.asarray(x, dtype)


def _same(got, want):
    (q, s), (qr, sr) = got, want
    assert q.dtype == jnp.float8_e4m3fn and q.shape == qr.shape and s.shape == sr.shape and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32)), np.asarray(qr.astype(jnp.float32)))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(sr))


@pytest.mark.parametrize(
    "t,k,dtype,block_rows",
    [
        (1, 7168, jnp.bfloat16, 32),  # V3's hidden at one token: 56 blocks, a ragged second program
        (5, 256, jnp.float32, 4),  # 10 blocks over 3 programs
        (3, 1408, jnp.float16, 32),  # fewer blocks than a program
        (2, 300, jnp.bfloat16, 32),  # K not a multiple of 128: the reference's path
    ],
)
def test_matches_reference_bit_for_bit(t, k, dtype, block_rows):
    x = _x(t * k, t, k, dtype)
    _same(quantize_act(x, interpret=True, block_rows=block_rows), quantize_act_reference(x))


def test_nan_block_stays_in_its_block():
    """A NaN in one block makes that block's scale NaN and nothing else (no read across blocks or rows)."""
    x = _x(1, 2, 512, jnp.bfloat16).at[1, 130].set(jnp.nan)
    q, s = quantize_act(x, interpret=True, block_rows=2)
    s = np.asarray(s)
    assert np.isnan(s[1, 1]) and np.isfinite(np.delete(s.reshape(-1), 5)).all()
    qf = np.asarray(q.astype(jnp.float32))
    assert np.isfinite(qf[0]).all() and np.isfinite(qf[1, :128]).all() and np.isfinite(qf[1, 256:]).all()


def test_bad_inputs():
    for x, match in (
        (jnp.zeros((4,), jnp.bfloat16), r"x must be \[T, K\]"),
        (jnp.zeros((2, 128), jnp.int32), "x dtype must be"),
    ):
        with pytest.raises(ValueError, match=match):
            quantize_act(x, interpret=True)
    with pytest.raises(ValueError, match="block_rows=3"):
        quantize_act(jnp.zeros((2, 128), jnp.bfloat16), interpret=True, block_rows=3)


def test_lowers_to_triton(h200):
    f = jax.jit(quantize_act)
    text = f.trace(jax.ShapeDtypeStruct((1, 7168), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "quantize_act_k7168" in text


@pytest.mark.gpu
@pytest.mark.parametrize("t,k", [(1, 7168), (64, 2048), (4096, 1408)])
def test_gpu_matches_reference(t, k):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x = _x(t + k, t, k, jnp.bfloat16)
    _same(jax.jit(quantize_act)(x), jax.jit(quantize_act_reference)(x))
