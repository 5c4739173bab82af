"""head_matmul (per-head batched matmul, optional tail, stacked weights) vs its float32 reference: interpreted on
CPU, lowered to Triton for an H200 on CPU, and compiled on the GPU (`-m gpu`); and its use by mla.absorb_q /
mla.v_up_proj."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import mla
from mla_jax.layers import LayerRow
from pallas_kernels import head_matmul as hm
from pallas_kernels.head_matmul import default_tuning, head_matmul, head_matmul_reference

# |out - ref| <= ATOL + RTOL |ref| with outputs of unit scale; bf16 rounds the output to 8 bits.
TOL = {jnp.bfloat16: (2e-2, 2e-2), jnp.float32: (2e-5, 1e-5)}
SMALL = dict(block_t=16, block_n=16, block_k=16)  # many tiles and ragged edges at test sizes


def _inputs(seed, t, n, k, m, dtype, r=0, tail_dtype=None, layers=None):
    """x [T, N, K] (with r: [T, N, K+r], the tail in its last r columns), w [N, K, M] scaled for unit outputs
    (with layers: [layers, N, K, M], each layer distinct)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, n, k + r), np.float32), dtype)
    lead = () if layers is None else (layers,)
    w = rng.standard_normal((*lead, n, k, m), np.float32) / np.sqrt(k)
    if layers is not None:
        w = w * (1.0 + np.arange(layers, dtype=np.float32))[:, None, None, None]
    tail = None if tail_dtype is None else jnp.asarray(rng.standard_normal((t, n, r), np.float32), tail_dtype)
    return x, jnp.asarray(w, dtype), tail


def _close(out, ref, dtype):
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
    assert np.all(np.isfinite(out))
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "t,n,k,m,dtype,tuning",
    [
        (1, 2, 40, 24, jnp.float32, SMALL),  # decode: one token; K and M ragged
        (20, 3, 64, 48, jnp.float32, SMALL),  # two row tiles, the last ragged (T not a multiple of 16)
        (5, 2, 48, 80, jnp.bfloat16, {}),  # default tuning: blocks clamped to the dims (and zero-padded here)
        (37, 2, 128, 64, jnp.bfloat16, dict(block_t=16, block_n=32, block_k=32, num_stages=2)),
    ],
)
def test_matches_reference(t, n, k, m, dtype, tuning):
    x, w, _ = _inputs(t * 100 + k, t, n, k, m, dtype)
    out = head_matmul(x, w, interpret=True, **tuning)
    assert out.shape == (t, n, m) and out.dtype == dtype
    _close(out, head_matmul_reference(x, w), dtype)


@pytest.mark.parametrize("t,r,tail_dtype", [(19, 10, jnp.float32)])
def test_separate_tail_cast_into_the_last_columns(t, r, tail_dtype):
    """tail [T, N, R] (a float32 tail for bf16 x: cast, as absorb_q casts q_pe) lands in columns [M, M+R)."""
    x, w, tail = _inputs(t + r, t, 2, 40, 24, jnp.bfloat16, r=0, tail_dtype=tail_dtype)
    tail = jnp.asarray(np.random.default_rng(t).standard_normal((t, 2, r)), tail_dtype)
    out = head_matmul(x, w, tail, interpret=True, **SMALL)
    assert out.shape == (t, 2, 24 + r) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[..., 24:]), np.asarray(tail.astype(jnp.bfloat16)))  # a copy
    _close(out, head_matmul_reference(x, w, tail), jnp.bfloat16)


@pytest.mark.parametrize("k", [48, 40])  # K a multiple of block_k, and not: the masked step reads into the tail
def test_tail_in_x_is_copied_never_multiplied(k):
    """tail_in_x (absorb_q's q [T, N, P+R]): the NaN-poisoned tail columns come out as they are and must not leak
    into the product; with clean tail columns, the reference."""
    t, n, m, r = 18, 2, 40, 12
    x, w, _ = _inputs(k, t, n, k, m, jnp.float32, r=r)
    out = head_matmul(x, w, tail_in_x=True, interpret=True, **SMALL)
    assert out.shape == (t, n, m + r)
    np.testing.assert_array_equal(np.asarray(out[..., m:]), np.asarray(x[..., k:]))
    _close(out, head_matmul_reference(x, w, tail_in_x=True), jnp.float32)
    poisoned = x.at[..., k:].set(jnp.nan)
    out = head_matmul(poisoned, w, tail_in_x=True, interpret=True, **SMALL)
    assert np.all(np.isnan(np.asarray(out[..., m:])))
    _close(out[..., :m], head_matmul_reference(x[..., :k], w), jnp.float32)


def _poisoned_stack(w, layers, index):
    """[layers, N, K, M]: layer `index` holds w, every other layer NaN (a read of the wrong layer shows)."""
    return jnp.full((layers,) + w.shape, jnp.nan, w.dtype).at[index].set(w)


def test_stacked_static_index_reads_its_layer_only():
    x, w, _ = _inputs(7, 20, 3, 40, 24, jnp.float32, r=8)
    want = head_matmul(x, w, tail_in_x=True, interpret=True, **SMALL)
    for index in (0, 1, np.int32(2)):
        st = _poisoned_stack(w, 3, int(index))
        got = head_matmul(x, st, tail_in_x=True, rhs_index=index, interpret=True, **SMALL)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # same kernel, same sums
        ref = head_matmul_reference(x, st, tail_in_x=True, rhs_index=index)
        np.testing.assert_array_equal(np.asarray(ref), np.asarray(head_matmul_reference(x, w, tail_in_x=True)))


def test_stacked_traced_index_in_jit_and_scan():
    """A traced index under jit (clamped when out of range) and a lax.scan's layer counter over the stacked
    weights closed over (the model's use), each layer's weights distinct."""
    layers = 3
    x, st, _ = _inputs(11, 5, 2, 40, 24, jnp.bfloat16, layers=layers)
    per_layer = [np.asarray(head_matmul(x, st[i], interpret=True, **SMALL).astype(jnp.float32)) for i in range(3)]
    f = jax.jit(lambda i: head_matmul(x, st, rhs_index=i, interpret=True, **SMALL))
    for i, want in ((1, 1), (2, 2), (-4, 0), (7, layers - 1)):  # out of range: clamped
        np.testing.assert_array_equal(np.asarray(f(jnp.int32(i)).astype(jnp.float32)), per_layer[want])

    def body(i, _):
        return i + 1, head_matmul(x, st, rhs_index=i, interpret=True, **SMALL)

    _, outs = jax.jit(lambda: jax.lax.scan(body, jnp.int32(0), None, length=layers))()
    for i in range(layers):
        np.testing.assert_array_equal(np.asarray(outs[i].astype(jnp.float32)), per_layer[i])
        _close(outs[i], head_matmul_reference(x, st, rhs_index=jnp.int32(i)), jnp.bfloat16)


def test_gradients_are_the_references():
    """Differentiable (the reference's backward): x, the stacked weights (only the indexed layer's) and the tail."""
    x, st, _ = _inputs(3, 4, 2, 32, 16, jnp.float32, layers=2)
    tail = jnp.asarray(np.random.default_rng(4).standard_normal((4, 2, 8)), jnp.float32)

    def grads(fn):
        return jax.grad(lambda x, w, t: jnp.sum(jnp.sin(fn(x, w, t))), argnums=(0, 1, 2))(x, st, tail)

    got = grads(lambda x, w, t: head_matmul(x, w, t, rhs_index=jnp.int32(1), interpret=True))
    want = grads(lambda x, w, t: head_matmul_reference(x, w, t, rhs_index=1))
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(got[1])[0])  # only layer 1 was read


def test_default_tuning():
    # V2-Lite decode (16 heads): absorb [128 -> 512] and W_UV [512 -> 128]; V3 (128 heads); a prefill-sized T
    assert default_tuning(1, 16, 128, 512, jnp.bfloat16, sms=132) == (16, 32, 128, 4, 1)
    assert default_tuning(1, 16, 512, 128, jnp.bfloat16, sms=132) == (16, 16, 128, 4, 4)
    assert default_tuning(1, 128, 128, 512, jnp.bfloat16, sms=132) == (16, 128, 128, 4, 1)
    assert default_tuning(1, 128, 512, 128, jnp.bfloat16, sms=132) == (16, 64, 128, 4, 4)
    assert default_tuning(200, 16, 512, 128, jnp.bfloat16, sms=132) == (64, 32, 128, 4, 4)
    assert default_tuning(3, 2, 40, 24, jnp.float32, sms=132) == (16, 16, 32, 4, 2)


def test_empty_token_axis():
    x, w, _ = _inputs(0, 0, 2, 16, 24, jnp.float32, r=4)
    assert head_matmul(x, w, tail_in_x=True).shape == (0, 2, 28)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(x=np.zeros((4, 16), np.float32)), r"x must be \[T, N, K\]"),
        (dict(x=np.zeros((4, 2, 16), np.int32)), "x dtype"),
        (dict(w=np.zeros((2, 16, 24), np.float16)), "dtypes differ"),
        (dict(w=np.zeros((3, 16, 24), np.float32)), "N=2 heads"),
        (dict(w=np.zeros((2, 20, 24), np.float32)), "K=20"),
        (dict(w=np.zeros((2, 16), np.float32)), r"w must be \[N, K, M\]"),
        (dict(w=np.zeros((3, 2, 16, 24), np.float32)), "needs rhs_index"),
        (dict(rhs_index=0), r"\[Lyr, N, K, M\]"),
        (dict(w=np.zeros((3, 2, 16, 24), np.float32), rhs_index=3), "rhs_index=3 is out of range for w with 3"),
        (dict(w=np.zeros((3, 2, 16, 24), np.float32), rhs_index=1.0), "integer scalar"),
        (dict(tail=np.zeros((4, 2), np.float32)), r"tail must be \[T=4, N=2, R>=1\]"),
        (dict(tail=np.zeros((3, 2, 8), np.float32)), r"tail must be \[T=4"),
        (dict(tail=np.zeros((4, 2, 8), np.int32)), "tail dtype"),
        (dict(tail=np.zeros((4, 2, 8), np.float32), tail_in_x=True), "not both"),
        (dict(tail_in_x=True), r"\[T, N, K\+R\] with R >= 1"),
        (dict(block_t=8), "block_t=8"),
        (dict(block_n=24), "block_n=24"),
        (dict(num_warps=3), "num_warps"),
        (dict(num_stages=0), "num_stages"),
    ],
)
def test_bad_inputs(kw, match):
    args = dict(x=np.zeros((4, 2, 16), np.float32), w=np.zeros((2, 16, 24), np.float32), tail=None)
    for key in ("x", "w", "tail"):
        if key in kw:
            args[key] = kw.pop(key)
    args = {key: None if v is None else jnp.asarray(v) for key, v in args.items()}
    with pytest.raises(ValueError, match=match):
        head_matmul(args["x"], args["w"], args["tail"], interpret=True, **kw)
    if not {"block_t", "block_n", "num_warps", "num_stages"} & kw.keys():
        with pytest.raises(ValueError, match=match):
            head_matmul_reference(args["x"], args["w"], args["tail"], **kw)


# ---- the MLA's use: absorb_q and v_up_proj ----


class _Cfg:  # the two fields absorb_q reads
    qk_nope_head_dim = 32


def _mla_params(seed, layers=None):
    _, w_uk, _ = _inputs(seed, 1, 4, 32, 64, jnp.float32, layers=layers)  # W_UK_T [(Lyr,) N, P, L]
    _, w_uv, _ = _inputs(seed + 1, 1, 4, 64, 32, jnp.float32, layers=layers)  # W_UV [(Lyr,) N, L, V]
    return w_uk, w_uv


def test_mla_absorb_and_v_up_take_the_kernel_on_a_gpu(monkeypatch):
    """With the backend reported as a GPU (the kernel interpreted), absorb_q / v_up_proj give the jnp path's
    results, also for LayerRow (stacked, read in place) weights; more than HEAD_MATMUL_MAX_T tokens, another
    dtype, stay with jnp."""
    w_uk, w_uv = _mla_params(5)
    st_uk, st_uv = _mla_params(6, layers=3)
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((6, 4, 32 + 16)), jnp.float32)  # [T, N, P+R]
    latent = jnp.asarray(rng.standard_normal((6, 4, 64)), jnp.float32)  # [T, N, L]
    p = {"W_UK_T": w_uk, "W_UV": w_uv}
    p_rows = {"W_UK_T": LayerRow(st_uk, jnp.int32(2)), "W_UV": LayerRow(st_uv, jnp.int32(2))}
    p_st = {"W_UK_T": st_uk[2], "W_UV": st_uv[2]}
    ang = rng.random((6, 8)) * 6.0
    rope = (jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32))
    want = [(mla.absorb_q(pp, _Cfg, q), mla.v_up_proj(pp, latent)) for pp in (p, p_st)]
    want_rope = mla.absorb_q(p, _Cfg, q, rope=rope)  # jnp: rope_q_pe, then the product

    calls, kernel = [], hm.head_matmul

    def spy(*a, **kw):
        calls.append(kw.get("tail_in_x", False))
        return kernel(*a, interpret=True, **kw)

    monkeypatch.setattr(mla.head_matmul_kernel, "head_matmul", spy)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for pp, (a, v) in zip((p, p_rows), want):
        _close(mla.absorb_q(pp, _Cfg, q), a, jnp.float32)
        _close(mla.v_up_proj(pp, latent), v, jnp.float32)
    assert calls == [True, False, True, False]
    _close(mla.absorb_q(p, _Cfg, q, rope=rope), want_rope, jnp.float32)  # q_pe rotated in the kernel
    assert calls[-1] is True
    calls.pop()
    monkeypatch.setattr(mla, "HEAD_MATMUL_MAX_T", 5)  # 6 tokens: jnp
    mla.absorb_q(p, _Cfg, q)
    mla.absorb_q(p, _Cfg, q.astype(jnp.bfloat16))  # mixed dtypes: jnp (which promotes)
    assert mla.v_up_proj(p_rows, latent).shape == (6, 4, 32)
    assert len(calls) == 4


# ---- Triton lowering for an H200, on CPU (Pallas's lowering, not the Triton compiler) ----


def test_lowers_to_triton(h200):
    """DeepSeek-V2-Lite's decode shapes: one Triton kernel each, q read whole (no slice or concatenate around the
    call), a stacked weight passed whole (no slice of it), the grid (row tiles, column blocks, heads)."""
    sds = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    cases = [  # (fn, args, grid, the weight as the call takes it)
        (
            lambda q, w: head_matmul(q, w, tail_in_x=True),
            (sds((1, 16, 192), bf), sds((16, 128, 512), bf)),
            (1, 16, 16),
            "tensor<16x128x512xbf16>",
        ),
        (
            lambda x, w: head_matmul(x, w),
            (sds((1, 16, 512), bf), sds((16, 512, 128), bf)),
            (1, 8, 16),
            "tensor<16x512x128xbf16>",
        ),
        (
            lambda x, w, i: head_matmul(x, w, rhs_index=i),
            (sds((37, 16, 512), bf), sds((27, 16, 512, 128), bf), sds((), jnp.int32)),
            (1, 8, 16),
            "tensor<27x16x512x128xbf16>",
        ),
        (
            lambda x, w, t: head_matmul(x, w, t),  # ragged dims, a float32 tail cast in the kernel
            (sds((5, 3, 100), bf), sds((3, 100, 200), bf), sds((5, 3, 40), jnp.float32)),
            (1, 13, 3),
            "tensor<3x100x200xbf16>",
        ),
    ]
    for fn, args, (gx, gy, gz), weight in cases:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert f"grid_x = {gx} : i32, grid_y = {gy} : i32, grid_z = {gz} : i32" in text
        assert "slice" not in text and "concatenate" not in text and weight in text


# ---- GPU: the compiled Triton kernel ----


def _rope_case(seed, t, n, k, m, r, layers=None, interpret=True, **tuning):
    """tail_rope: q [T, N, K+R] whose q_pe (the tail) is rotated in the kernel; the tail exactly as
    `mla_jax.rope.apply_rope` rounds it, the product against the reference (a stacked w at a traced layer)."""
    from mla_jax.rope import apply_rope

    x, w, _ = _inputs(seed, t, n, k, m, jnp.bfloat16, r=r, layers=layers)
    ang = np.random.default_rng(seed).random((t, r // 2)) * 6.0
    rope = (jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32))
    kw = dict(tail_in_x=True, tail_rope=rope, rhs_index=None if layers is None else jnp.int32(layers - 1))
    out = jax.jit(lambda a: head_matmul(a, w, interpret=interpret, **kw, **tuning))(x)
    np.testing.assert_array_equal(np.asarray(out[..., m:]), np.asarray(apply_rope(x[..., k:], *rope)))
    _close(out, head_matmul_reference(x, w, **kw), jnp.bfloat16)


@pytest.mark.parametrize("t, r", [(1, 16), (19, 12)])  # 12: a ragged, non-power-of-two rope width
def test_tail_rope_rotates_the_tail_as_apply_rope(t, r):
    _rope_case(t, t, 3, 48, 40, r, layers=2, **SMALL)
    with pytest.raises(ValueError, match="tail_in_x"):
        x, w, tail = _inputs(0, t, 3, 48, 40, jnp.bfloat16, r=r, tail_dtype=jnp.bfloat16)
        head_matmul(x[..., :48], w, tail, tail_rope=(jnp.zeros((t, r // 2)),) * 2, interpret=True)
    with pytest.raises(ValueError, match=r"\[T, R/2\]"):
        x, w, _ = _inputs(0, t, 3, 48, 40, jnp.bfloat16, r=r)
        head_matmul(x, w, tail_in_x=True, tail_rope=(jnp.zeros((t, r)),) * 2, interpret=True)


def _gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 130])
@pytest.mark.parametrize("n,k,m,r", [(16, 128, 512, 64), (16, 512, 128, 0), (128, 128, 512, 64), (3, 100, 200, 40)])
def test_gpu_matches_reference(t, n, k, m, r):
    """The absorb (tail in x) and W_UV shapes of V2-Lite and V3 at decode and prefill-sized T, and ragged dims."""
    _gpu()
    x, w, _ = _inputs(t * 7 + n, t, n, k, m, jnp.bfloat16, r=r)
    out = head_matmul(x, w, tail_in_x=bool(r))
    assert out.shape == (t, n, m + r)
    _close(out, head_matmul_reference(x, w, tail_in_x=bool(r)), jnp.bfloat16)
    if r:
        np.testing.assert_array_equal(np.asarray(out[..., m:]), np.asarray(x[..., k:]))


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [{}, SMALL, dict(block_t=32, block_n=64, block_k=64, num_warps=8, num_stages=2)])
def test_gpu_f32_tuning_and_separate_tail(tuning):
    _gpu()
    x, w, tail = _inputs(3, 21, 4, 72, 40, jnp.float32, tail_dtype=jnp.bfloat16)
    tail = jnp.asarray(np.random.default_rng(1).standard_normal((21, 4, 24)), jnp.bfloat16)
    out = head_matmul(x, w, tail, **tuning)
    _close(out, head_matmul_reference(x, w, tail), jnp.float32)


@pytest.mark.gpu
def test_gpu_stacked_traced_index_poisoned_layers():
    """V2-Lite's W_UV stacked over 4 layers, the wanted layer between NaN ones; the index traced (and clamped)."""
    _gpu()
    x, w, _ = _inputs(9, 3, 16, 512, 128, jnp.bfloat16)
    want = np.asarray(head_matmul(x, w).astype(jnp.float32))
    f = jax.jit(lambda st, i: head_matmul(x, st, rhs_index=i))
    for index, arg in ((1, 1), (2, 2), (3, 9)):
        st = _poisoned_stack(w, 4, index)
        np.testing.assert_array_equal(np.asarray(f(st, jnp.int32(arg)).astype(jnp.float32)), want)
    _close(want, head_matmul_reference(x, w), jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_mla_absorb_and_v_up_use_the_kernel():
    """On the GPU, absorb_q / v_up_proj at decode sizes compile to the kernel and agree with XLA's einsums."""
    _gpu()
    N, P, L, R, V = 16, 128, 512, 64, 128

    class Cfg:
        qk_nope_head_dim = P

    _, w_uk, _ = _inputs(1, 1, N, P, L, jnp.bfloat16)
    _, w_uv, _ = _inputs(2, 1, N, L, V, jnp.bfloat16)
    p = {"W_UK_T": w_uk, "W_UV": w_uv}
    q, _, _ = _inputs(3, 4, N, P + R, 1, jnp.bfloat16)
    latent, _, _ = _inputs(4, 4, N, L, 1, jnp.bfloat16)
    absorb = jax.jit(functools.partial(mla.absorb_q, p, Cfg))
    v_up = jax.jit(functools.partial(mla.v_up_proj, p))
    for f, a in ((absorb, q), (v_up, latent)):
        assert "head_matmul_bt" in f.lower(a).as_text()  # the kernel (its pallas_call name), not an einsum
    ql = jnp.einsum("tnp,npl->tnl", q[..., :P], w_uk, preferred_element_type=jnp.float32)
    _close(absorb(q), jnp.concatenate([ql, q[..., P:].astype(jnp.float32)], -1), jnp.bfloat16)
    _close(v_up(latent), jnp.einsum("tnl,nlv->tnv", latent, w_uv, preferred_element_type=jnp.float32), jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64])
def test_gpu_tail_rope(t):
    """absorb_q's shape (V2-Lite: 16 heads, P 128, L 512, R 64) with q_pe rotated in the kernel, bitwise as
    apply_rope; stacked W_UK_T at a traced layer."""
    _gpu()
    _rope_case(t, t, 16, 128, 512, 64, layers=3, interpret=False)
