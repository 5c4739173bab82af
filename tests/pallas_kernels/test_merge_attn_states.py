"""merge_attn_states (xla and pallas) vs a float64 numpy merge (CPU: interpret; GPU: `-m gpu`)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.merge_attn_states import merge_attn_states

# Output tolerance by dtype (the merge is float32 math; bf16 rounds the result once).
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _numpy_merge(po, pl, so, sl):
    po, pl, so, sl = (np.asarray(x, np.float64) for x in (po, pl, so, sl))
    pl = np.where(pl == np.inf, -np.inf, pl)
    sl = np.where(sl == np.inf, -np.inf, sl)
    m = np.maximum(pl, sl)
    alive = np.isfinite(m)
    ms = np.where(alive, m, 0)
    pw, sw = np.exp(pl - ms), np.exp(sl - ms)
    tot = np.where(alive, pw + sw, 1)
    out = np.where(pw[..., None] > 0, np.nan_to_num(po) * (pw / tot)[..., None], 0) + np.where(
        sw[..., None] > 0, np.nan_to_num(so) * (sw / tot)[..., None], 0
    )
    return out, np.where(alive, np.log(tot) + ms, -np.inf)


def _inputs(seed, t=37, n=3, v=32):
    rng = np.random.default_rng(seed)
    po, so = (rng.standard_normal((t, n, v)).astype(np.float32) for _ in range(2))
    pl, sl = ((rng.standard_normal((t, n)) * 4).astype(np.float32) for _ in range(2))
    # Row 0: prefix empty (its output NaN garbage); row 1: suffix empty; row 2: both empty;
    # row 3 head 0: +inf lse (vLLM treats it as empty); row 4: equal lse.
    pl[0], po[0] = -np.inf, np.nan
    sl[1], so[1] = -np.inf, np.nan
    pl[2], sl[2], po[2], so[2] = -np.inf, -np.inf, np.nan, np.nan
    pl[3, 0] = np.inf
    sl[4] = pl[4]
    return po, pl, so, sl


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_merge_matches_numpy(impl, dtype):
    po, pl, so, sl = _inputs(0)
    args = (jnp.asarray(po, dtype), jnp.asarray(pl), jnp.asarray(so, dtype), jnp.asarray(sl))
    out, lse = merge_attn_states(*args, impl=impl, interpret=True, block_rows=16)
    assert out.dtype == dtype and out.shape == po.shape and lse.dtype == jnp.float32
    # reference on the dtype-rounded inputs
    ref, ref_lse = _numpy_merge(
        np.asarray(args[0].astype(jnp.float32)), pl, np.asarray(args[2].astype(jnp.float32)), sl
    )
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert np.all(np.isfinite(out)) and not np.any(np.isnan(lse))
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-5, rtol=1e-6)
    # -inf on one side gives the other side exactly; both -inf gives 0 / -inf
    a0, a2 = np.asarray(args[0].astype(jnp.float32)), np.asarray(args[2].astype(jnp.float32))
    np.testing.assert_array_equal(out[0], a2[0])
    np.testing.assert_array_equal(lse[0], sl[0])
    np.testing.assert_array_equal(out[1], a0[1])
    np.testing.assert_array_equal(lse[1], pl[1])
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))
    np.testing.assert_array_equal(out[3, 0], a2[3, 0])


def test_impls_agree():
    po, pl, so, sl = _inputs(1, t=50, n=4, v=64)
    args = (jnp.asarray(po), jnp.asarray(pl), jnp.asarray(so), jnp.asarray(sl))
    a = merge_attn_states(*args, impl="xla")
    b = merge_attn_states(*args, impl="pallas", interpret=True, block_rows=64)
    np.testing.assert_allclose(np.asarray(a[0]), np.asarray(b[0]), atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(suffix_output=np.zeros((4, 2, 16), np.float32)), "suffix_output shape"),
        (dict(prefix_lse=np.zeros((4, 3), np.float32)), "prefix_lse"),
        (dict(suffix_lse=np.zeros((4, 2), np.float16)), "float32"),
        (dict(prefix_output=np.zeros((4, 2, 32), np.int32), suffix_output=np.zeros((4, 2, 32), np.int32)), "dtype"),
        (dict(impl="cuda"), "impl"),
    ],
)
def test_bad_inputs_raise(kw, match):
    args = dict(
        prefix_output=np.zeros((4, 2, 32), np.float32),
        prefix_lse=np.zeros((4, 2), np.float32),
        suffix_output=np.zeros((4, 2, 32), np.float32),
        suffix_lse=np.zeros((4, 2), np.float32),
    )
    impl = kw.pop("impl", "pallas")
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        merge_attn_states(**{k: jnp.asarray(v) for k, v in args.items()}, impl=impl, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_gpu_merge(impl):
    po, pl, so, sl = _inputs(2, t=3000, n=16, v=128)
    args = (jnp.asarray(po, jnp.bfloat16), jnp.asarray(pl), jnp.asarray(so, jnp.bfloat16), jnp.asarray(sl))
    out, lse = merge_attn_states(*args, impl=impl)
    ref, ref_lse = _numpy_merge(
        np.asarray(args[0].astype(jnp.float32)), pl, np.asarray(args[2].astype(jnp.float32)), sl
    )
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), ref, atol=1e-2, rtol=1e-2)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=1e-5, rtol=1e-6)
