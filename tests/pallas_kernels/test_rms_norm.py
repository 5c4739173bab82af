"""The fused residual add + RMSNorm kernel against its reference: interpreted on CPU, lowered to Triton for an
H200 on CPU, and on the GPU (`gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_reference, chunk_width, combine_copies_reference

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
    [
        (2048, jnp.bfloat16, True),
        (7168, jnp.bfloat16, True),
        (16384, jnp.bfloat16, True),
        (96, jnp.float32, False),
        (48, jnp.float32, True),
    ],
)
def test_matches_reference(d, dtype, residual):
    x, r, w = _inputs(d, d, dtype, residual)
    out, h = add_rms_norm(x, r, w, eps=1e-6, interpret=True)
    _check(out, h, *add_rms_norm_reference(x, r, w, eps=1e-6), dtype)


def _stacked(seed, layers, d, dtype):
    """Weights of `layers` layers, each row far from the others (a read of the wrong row shows)."""
    w = 1.0 + 0.1 * jax.random.normal(jax.random.key(seed), (layers, d), jnp.float32)
    return (w * (1.0 + jnp.arange(layers, dtype=jnp.float32))[:, None]).astype(dtype)


@pytest.mark.parametrize("residual", [True, False])
def test_stacked_weight_row_in_a_scan(residual):
    """Row i of stacked [Lyr, D] weights, the index traced (a layer scan's counter): the reference on row i."""
    x, r, _ = _inputs(4, 2048, jnp.bfloat16, residual)
    ws = _stacked(5, 4, 2048, jnp.bfloat16)

    def scan(fn):
        def body(i, _):
            return i + 1, fn(i)

        return jax.lax.scan(body, jnp.int32(0), None, length=4)[1]

    got = jax.jit(lambda: scan(lambda i: add_rms_norm(x, r, ws, eps=1e-6, weight_index=i, interpret=True)))()
    for i in range(4):
        ref = add_rms_norm_reference(x, r, ws[i], eps=1e-6)
        _check(got[0][i], got[1][i], *ref, jnp.bfloat16)
    out, h = add_rms_norm(x, r, ws, eps=1e-6, weight_index=3, interpret=True)  # a static index
    _check(out, h, *add_rms_norm_reference(x, r, ws[3], eps=1e-6), jnp.bfloat16)


def test_stacked_weight_gradient_reaches_its_row():
    x, r, _ = _inputs(6, 64, jnp.float32)
    ws = _stacked(7, 3, 64, jnp.float32)

    def grads(fn):
        return jax.grad(lambda x, r, w: jnp.sum(jnp.sin(fn(x, r, w)[0])), argnums=(0, 1, 2))(x, r, ws)

    got = grads(lambda x, r, w: add_rms_norm(x, r, w, eps=1e-6, weight_index=jnp.int32(1), interpret=True))
    want = grads(lambda x, r, w: add_rms_norm_reference(x, r, w[1], eps=1e-6))
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got[2])[[0, 2]])  # only row 1 was read


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
    ws = _stacked(8, 3, 64, jnp.float32)
    with pytest.raises(ValueError, match="weight_index=3 is out of range for 3"):
        add_rms_norm(x, r, ws, eps=1e-6, weight_index=3)
    with pytest.raises(ValueError, match="stacked weight must be"):
        add_rms_norm(x, r, ws[:, :32], eps=1e-6, weight_index=0)
    with pytest.raises(ValueError, match="weight_index must be an integer scalar"):
        add_rms_norm(x, r, ws, eps=1e-6, weight_index=jnp.zeros(2, jnp.int32))


def test_lowers_to_triton(h200):
    """Triton IR on CPU (Pallas's lowering, not the Triton compiler) for an H200 at V3's width: one kernel, a
    program per row."""
    a = jax.ShapeDtypeStruct((5, 7168), jnp.bfloat16)
    wt = jax.ShapeDtypeStruct((7168,), jnp.bfloat16)
    f = jax.jit(lambda x, r, w: add_rms_norm(x, r, w, eps=1e-6))
    text = f.trace(a, a, wt).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 5 : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text
    # stacked weights, the row picked by a traced index: the whole [Lyr, D] array goes in (no slice of it)
    ws = jax.ShapeDtypeStruct((61, 7168), jnp.bfloat16)
    f = jax.jit(lambda x, r, w, i: add_rms_norm(x, r, w, eps=1e-6, weight_index=i))
    text = f.trace(a, a, ws, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "tensor<61x7168xbf16>" in text
    assert "dynamic_slice" not in text
    # an MoE layer's copies as the residual (V2-Lite at batch 1: top-6 and 2 shared chunks): still one kernel
    x1, y = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16)
    cw, w1 = jax.ShapeDtypeStruct((1, 6), jnp.float32), jax.ShapeDtypeStruct((2048,), jnp.bfloat16)
    f = jax.jit(lambda x, y, cw, w: add_rms_norm(x, y, w, eps=1e-6, residual_weights=cw, residual_shared=2))
    text = f.trace(x1, y, cw, w1).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "tensor<8x2048xbf16>" in text


def _router_case(d, e, layers, interpret, rtol):
    """add_rms_norm(..., router=) with stacked norm and gate weights at a traced layer (the other layers' gates NaN):
    normed and h as without the router (bitwise), the logits against the normed rows @ gate^T in float64. In
    interpret mode XLA keeps the normed row's excess float32 precision in the product (the GPU kernel rounds it to
    bf16 first, as route's input is), hence the looser rtol there."""
    x, r, _ = _inputs(d + e, d, jnp.bfloat16)
    ws = _stacked(d, layers, d, jnp.bfloat16)
    rng = np.random.default_rng(e)
    g = np.full((layers, e, d), np.nan, np.float32)
    g[layers - 2] = rng.standard_normal((e, d)) / np.sqrt(d)
    i = jnp.int32(layers - 2)
    f = jax.jit(lambda i: add_rms_norm(x, r, ws, eps=1e-6, weight_index=i, router=jnp.asarray(g), interpret=interpret))
    out, h, logits = f(i)
    base, base_h = add_rms_norm(x, r, ws, eps=1e-6, weight_index=i, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(base_h))
    want = np.asarray(out, np.float64) @ g[layers - 2].astype(np.float64).T
    assert logits.shape == (3, e) and logits.dtype == jnp.float32
    scale = np.abs(want).max(axis=1, keepdims=True)  # rows of very different scales (ROW_SCALES) norm alike
    np.testing.assert_allclose(np.asarray(logits) / scale, want / scale, rtol=0, atol=rtol)
    ref = add_rms_norm_reference(x, r, ws, eps=1e-6, weight_index=layers - 2, router=jnp.asarray(g))[2]
    np.testing.assert_allclose(np.asarray(ref) / scale, want / scale, rtol=0, atol=2e-2)  # (excess precision too)


@pytest.mark.parametrize("d, e", [(64, 8), (256, 64)])  # 256 x 64: several expert blocks of programs per row
def test_router_logits_in_the_norm_kernel(d, e):
    _router_case(d, e, 3, True, 2e-2)


def test_router_bad_inputs():
    x, r, w = _inputs(0, 64, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"router must be \[E, D=64\]"):
        add_rms_norm(x, r, w, eps=1e-6, router=jnp.zeros((8, 32), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="router dtype must be float32"):
        add_rms_norm(x, r, w, eps=1e-6, router=jnp.zeros((8, 64), jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match=r"router must be \[Lyr=2, E, D=64\]"):
        ws = jnp.stack([w, w])
        add_rms_norm(x, r, ws, eps=1e-6, weight_index=0, router=jnp.zeros((3, 8, 64), jnp.float32), interpret=True)


def _copies_case(d, top_k, shared, interpret, router=False):
    """residual as an MoE layer's copies (token t's K routed copies, then S shared chunks' T rows, rows of the
    tokens' own very different scales): the kernel's h and normed against the reference on the combined residual
    (h bitwise: the same float32 combine, cast, then the same add), with stacked weights at a traced layer."""
    x, _, _ = _inputs(d, d, jnp.bfloat16)
    t = x.shape[0]
    k = jax.random.split(jax.random.key(d + top_k), 2)
    tok_scale = jnp.asarray(ROW_SCALES, jnp.float32)
    scale = jnp.concatenate([jnp.repeat(tok_scale, top_k), jnp.tile(tok_scale, shared)])[:, None]
    copies = (jax.random.normal(k[0], (t * (top_k + shared), d), jnp.float32) * scale).astype(jnp.bfloat16)
    cw = jax.random.uniform(k[1], (t, top_k), jnp.float32)
    ws = _stacked(d, 3, d, jnp.bfloat16)
    g = jnp.asarray(np.random.default_rng(d).standard_normal((3, 8, d)) / np.sqrt(d), jnp.float32) if router else None
    kw = dict(eps=1e-6, residual_weights=cw, residual_shared=shared, router=g)
    f = jax.jit(lambda i: add_rms_norm(x, copies, ws, weight_index=i, interpret=interpret, **kw))
    got = f(jnp.int32(1))
    combined = combine_copies_reference(copies, cw, shared)
    want = add_rms_norm_reference(x, combined, ws, eps=1e-6, weight_index=1, router=g)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    _check(got[0], got[1], want[0], want[1], jnp.bfloat16)
    if router:  # the same logits as the norm of the combined residual's
        np.testing.assert_array_equal(
            np.asarray(got[2]),
            np.asarray(
                add_rms_norm(x, combined, ws, **{**kw, "residual_weights": None}, weight_index=1, interpret=interpret)[
                    2
                ]
            ),
        )
    ref = add_rms_norm_reference(x, copies, ws, weight_index=1, **kw)  # the reference takes the copies too
    np.testing.assert_array_equal(np.asarray(ref[1]), np.asarray(want[1]))


@pytest.mark.parametrize("top_k, shared, router", [(6, 2, False), (6, 2, True), (8, 0, False), (1, 1, False)])
def test_residual_copies_combined_in_the_kernel(top_k, shared, router):
    _copies_case(64, top_k, shared, True, router)


def test_combine_copies_reference_is_the_weighted_sum():
    t, k, s, d = 2, 3, 2, 4
    y = np.arange((t * k + s * t) * d, dtype=np.float32).reshape(-1, d)
    w = np.array([[0.5, 1.0, 2.0], [1.0, 0.0, 0.25]], np.float32)
    want = np.stack(
        [sum(w[i, j] * y[i * k + j] for j in range(k)) + sum(y[t * k + c * t + i] for c in range(s)) for i in range(t)]
    )
    np.testing.assert_allclose(np.asarray(combine_copies_reference(jnp.asarray(y), jnp.asarray(w), s)), want)


def test_residual_copies_bad_inputs():
    x, _, w = _inputs(1, 64, jnp.bfloat16)
    y = jnp.zeros((3 * 8, 64), jnp.bfloat16)
    cw = jnp.zeros((3, 6), jnp.float32)
    with pytest.raises(ValueError, match=r"copies must be \[T\*K \+ S\*T, D\] = \[24, 64\]"):
        add_rms_norm(x, y[:20], w, eps=1e-6, residual_weights=cw, residual_shared=2)
    with pytest.raises(ValueError, match=r"residual_weights must be f32\[T=3, K\]"):
        add_rms_norm(x, y, w, eps=1e-6, residual_weights=cw.astype(jnp.bfloat16), residual_shared=2)
    with pytest.raises(ValueError, match="residual_shared must be an int >= 0"):
        add_rms_norm(x, y, w, eps=1e-6, residual_weights=cw, residual_shared=-1)
    with pytest.raises(ValueError, match="residual_weights needs the residual copies"):
        add_rms_norm(x, None, w, eps=1e-6, residual_weights=cw)


@pytest.mark.gpu
@pytest.mark.parametrize("top_k, shared, router", [(6, 2, False), (6, 2, True), (8, 0, False)])
def test_gpu_residual_copies(top_k, shared, router):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _copies_case(2048, top_k, shared, False, router)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,residual", [(2048, jnp.bfloat16, True), (7168, jnp.bfloat16, False)])
def test_gpu_matches_reference(d, dtype, residual):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    x, r, w = _inputs(d + 1, d, dtype, residual)
    out, h = add_rms_norm(x, r, w, eps=1e-6)
    _check(out, h, *add_rms_norm_reference(x, r, w, eps=1e-6), dtype)
    ws = _stacked(d, 5, d, dtype)
    out, h = jax.jit(lambda i: add_rms_norm(x, r, ws, eps=1e-6, weight_index=i))(jnp.int32(3))
    _check(out, h, *add_rms_norm_reference(x, r, ws[3], eps=1e-6), dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("d, e", [(2048, 64), (7168, 256)])  # V2-Lite's, V3's gates
def test_gpu_router_logits_in_the_norm_kernel(d, e):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _router_case(d, e, 4, False, 1e-5)
