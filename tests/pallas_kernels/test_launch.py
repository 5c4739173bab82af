"""Kernels side by side in one launch (`pallas_kernels.launch`): the runner on two toy kernels (program ids, aliases,
errors), then the decode step's absorb_q beside the cache write (`mla.absorb_q_and_write_latent_rows`) against the
two kernels run alone, bit for bit: interpreted on CPU, lowered to Triton for an H200 on CPU, the model's paged step
through it, and on the GPU (`gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import mla
from mla_jax.cache import KVCache
from mla_jax.layers import LayerRow
from pallas_kernels import head_matmul, launch
from tests.mla_jax.helpers import paged_config
from tests.pallas_kernels.test_cache_write import _same, _same_fp8, _written_only, step_through_kernel


def _ids_launch(x, grid, name, num_warps=4):
    """out[f] = 1000 * (f + 1) + x[f] at the flat index f of the program's ids (axis 0 fastest)."""
    n = int(np.prod(grid))

    def body(ids, x_ref, o_ref):
        f, stride = 0, 1
        for i, g in zip(ids, grid):
            f, stride = f + i * stride, stride * g
        o_ref[f] = x_ref[f] + 1000.0 * (f + 1).astype(jnp.float32)

    return launch.Launch(body, grid, (x,), (jax.ShapeDtypeStruct((n,), jnp.float32),), num_warps=num_warps, name=name)


def _bump_launch(y, rows):
    """y[r] += 1 for r < rows, in place (y aliased to the output)."""

    def body(ids, y_ref, o_ref):
        (r,) = ids
        o_ref[r] = y_ref[r] + 1.0

    return launch.Launch(body, (rows,), (y,), (jax.ShapeDtypeStruct(y.shape, y.dtype),), aliases=((0, 0),), name="b")


def test_two_launches_in_one_call_match_each_alone():
    x = jnp.arange(24, dtype=jnp.float32)
    y = jnp.full((8,), jnp.nan, jnp.float32).at[:5].set(jnp.arange(5.0))
    a, b = _ids_launch(x, (3, 2, 4), "a"), _bump_launch(y, 5)
    ((alone_a,),) = launch.run([a], interpret=True)
    ((alone_b,),) = launch.run([b], interpret=True)
    (both_a,), (both_b,) = launch.run([a, b], interpret=True)
    want_a = np.arange(24) + 1000.0 * (np.arange(24) + 1)  # every program once, its ids unflattened axis 0 fastest
    np.testing.assert_array_equal(np.asarray(alone_a), want_a)
    np.testing.assert_array_equal(np.asarray(both_a), want_a)
    want_b = np.concatenate([np.arange(1.0, 6.0), np.full(3, np.nan)])  # rows past 5 untouched (in place)
    np.testing.assert_array_equal(np.asarray(alone_b), want_b)
    np.testing.assert_array_equal(np.asarray(both_b), want_b)
    (b_first,), (a_second,) = launch.run([b, a], interpret=True)  # the order of the launches does not matter
    np.testing.assert_array_equal(np.asarray(a_second), want_a)
    np.testing.assert_array_equal(np.asarray(b_first), want_b)


def test_run_errors():
    x = jnp.zeros((4,), jnp.float32)
    with pytest.raises(ValueError, match="at least one Launch"):
        launch.run([])
    with pytest.raises(ValueError, match="share num_warps"):
        launch.run([_ids_launch(x, (4,), "a"), _ids_launch(x, (4,), "b", num_warps=8)], interpret=True)
    with pytest.raises(ValueError, match="needs a program"):
        launch.run([_ids_launch(x, (0,), "a")], interpret=True)


# ------------------------------------------------------------------ absorb_q beside the cache write

EPS = 1e-6
LAYERS, PAGES, G = 3, 5, 4
SLOTS = np.array([7, -1, 0, PAGES * G, 13], np.int32)  # -1 and >= P * G: padding, stores nothing


def _absorb_inputs(seed, fp8=False, stacked=True):
    """The tiny paged config, its layer params (W_UK_T and kv_a_layernorm stacked over layers as the layer loop
    reads them, `LayerRow`s of layer 1, or plain), q [T, N, P+R], kv [T, L+R], rope f32[T, R/2] twice, and a
    NaN-poisoned cache (fp8: payload and scales)."""
    cfg, t = paged_config(), len(SLOTS)
    n, p_, r, lat = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    k = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(k[0], (t, n, p_ + r), jnp.float32).astype(jnp.bfloat16)
    kv = (jax.random.normal(k[1], (t, lat + r), jnp.float32) * 3.0).astype(jnp.bfloat16)
    w_uk = (jax.random.normal(k[2], (LAYERS, n, p_, lat), jnp.float32) * 0.2).astype(jnp.bfloat16)
    w_uk = w_uk * (1.0 + jnp.arange(LAYERS, dtype=jnp.bfloat16))[:, None, None, None]  # a wrong layer shows
    norm_w = (1.0 + 0.1 * jax.random.normal(k[3], (LAYERS, lat), jnp.float32)) * (1.0 + jnp.arange(LAYERS))[:, None]
    ang = jax.random.uniform(k[4], (t, r // 2), jnp.float32, 0.0, 50.0)
    rope = (jnp.cos(ang), jnp.sin(ang))
    i = jnp.int32(1)
    if stacked:
        p = {"W_UK_T": LayerRow(w_uk, i)}
        norm = {"weight": LayerRow(norm_w.astype(jnp.bfloat16), i)}
    else:
        p, norm = {"W_UK_T": w_uk[1]}, {"weight": norm_w[1].astype(jnp.bfloat16)}
    payload = jnp.full((LAYERS, PAGES, G, lat + r), jnp.nan, jnp.bfloat16)
    cache = (
        KVCache(payload.astype(jnp.float8_e4m3fn), jnp.full((LAYERS, PAGES, G), jnp.nan))
        if fp8
        else KVCache(payload, None)
    )
    return cfg, p, norm, q, kv, rope, cache


def _alone(cfg, p, norm, q, kv, rope, cache, layer):
    """The two kernels run alone (interpreted), as the step runs them without the fused launch."""
    w, wi = (p["W_UK_T"].stacked, p["W_UK_T"].index) if isinstance(p["W_UK_T"], LayerRow) else (p["W_UK_T"], None)
    q_mqa = head_matmul.head_matmul(q, w, tail_in_x=True, tail_rope=rope, rhs_index=wi, interpret=True)
    kv_c_normed, k_pe, cache = mla.write_latent_rows(
        cache, layer, kv, norm, *rope, jnp.asarray(SLOTS), EPS, interpret=True
    )
    return q_mqa, kv_c_normed, k_pe, cache


def _fused(cfg, p, norm, q, kv, rope, cache, layer):
    return mla.absorb_q_and_write_latent_rows(
        p, cfg, q, cache, layer, kv, norm, rope, jnp.asarray(SLOTS), EPS, interpret=True
    )


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("stacked", [True, False])
def test_absorb_beside_cache_write_matches_the_kernels_alone(fp8, stacked):
    """One launch gives each kernel's own results bit for bit: the absorbed q (q_pe rotated behind it), the normed
    latent and k_pe, and the cache written at the valid slots of the layer only (the NaN-poisoned rest untouched;
    fp8: the payload and scales, `_same_fp8`)."""
    cfg, p, norm, q, kv, rope, cache = _absorb_inputs(3, fp8=fp8, stacked=stacked)
    layer = jnp.int32(2)
    got = jax.jit(_fused, static_argnums=0)(cfg, p, norm, q, kv, rope, cache, layer)
    want = jax.jit(_alone, static_argnums=0)(cfg, p, norm, q, kv, rope, cache, layer)
    for a, b in zip(got[:3], want[:3]):
        _same(a, b)
    if fp8:
        g, w = got[3], want[3]
        _same_fp8(g.kv_c_and_k_pe_cache, g.kv_scale, w.kv_c_and_k_pe_cache, w.kv_scale)
    else:
        _same(got[3].kv_c_and_k_pe_cache, want[3].kv_c_and_k_pe_cache)
    _written_only(got[3].kv_c_and_k_pe_cache, 2, SLOTS)
    ref = head_matmul.head_matmul_reference(
        q,
        p["W_UK_T"].stacked if stacked else p["W_UK_T"],
        tail_in_x=True,
        tail_rope=rope,
        rhs_index=jnp.int32(1) if stacked else None,
    )  # and the absorbed q against the float32 reference
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


def test_absorb_beside_cache_write_falls_back_off_the_kernels():
    """Off a GPU (and not interpreted) the two calls run as the step ran them; a static layer outside the cache is an
    error either way."""
    cfg, p, norm, q, kv, rope, cache = _absorb_inputs(4)
    got = mla.absorb_q_and_write_latent_rows(p, cfg, q, cache, 0, kv, norm, rope, jnp.asarray(SLOTS), EPS)
    want = (
        mla.absorb_q(p, cfg, q, rope=rope),
        *mla.write_latent_rows(cache, 0, kv, norm, *rope, jnp.asarray(SLOTS), EPS),
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _same(a, b)
    for interpret in (False, True):
        with pytest.raises(ValueError, match="layer 3 out of range"):
            mla.absorb_q_and_write_latent_rows(
                p, cfg, q, cache, 3, kv, norm, rope, jnp.asarray(SLOTS), EPS, interpret=interpret
            )


@pytest.mark.parametrize("fp8", [False, True])
def test_absorb_beside_cache_write_lowers_to_one_triton_kernel(h200, monkeypatch, fp8):
    """Triton IR on CPU (Pallas's lowering, not the Triton compiler), as the GPU step would run it (the switch on,
    the backend a GPU's): one kernel whose grid is the cache write's T programs then absorb_q's, the cache (and
    the scales) aliased to its outputs, no slice of the stacked weights or of the cache."""
    monkeypatch.setattr(mla, "ABSORB_WITH_CACHE_WRITE", True)
    monkeypatch.setattr(mla.jax, "default_backend", lambda: "gpu")
    sd = jax.ShapeDtypeStruct
    t, n, lat, r = 2, 16, 512, 64
    cfg = paged_config(num_attention_heads=n, kv_lora_rank=lat, qk_rope_head_dim=r, qk_nope_head_dim=128)
    cache = sd((27, 512, 64, lat + r), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    scale = sd((27, 512, 64), jnp.float32) if fp8 else None

    def f(q, w_uk, norm_w, kv, cos, sin, slots, payload, kv_scale, i):
        p, norm = {"W_UK_T": LayerRow(w_uk, i)}, {"weight": LayerRow(norm_w, i)}
        out = mla.absorb_q_and_write_latent_rows(
            p, cfg, q, KVCache(payload, kv_scale), i, kv, norm, (cos, sin), slots, EPS
        )
        return out[0], out[3]

    args = (
        sd((t, n, 192), jnp.bfloat16),
        sd((27, n, 128, lat), jnp.bfloat16),
        sd((27, lat), jnp.bfloat16),
        sd((t, lat + r), jnp.bfloat16),
        sd((t, r // 2), jnp.float32),
        sd((t, r // 2), jnp.float32),
        sd((t,), jnp.int32),
        cache,
        scale,
        sd((), jnp.int32),
    )
    text = jax.jit(f, donate_argnums=(7, 8)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    spec, _ = head_matmul.head_matmul_launch(
        jnp.zeros((t, n, 192), jnp.bfloat16),
        jnp.zeros((n, 128, lat), jnp.bfloat16),
        tail_in_x=True,
        tail_rope=(jnp.zeros((t, r // 2)),) * 2,
    )
    assert f"grid_x = {t + spec.programs} : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text
    assert f'name = "cache_write_l{lat}_r{r}' + ("_fp8" if fp8 else "") + "_head_matmul_" in text
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 7" in text  # the cache
    assert ("output_operand_alias<output_tuple_indices = [2], operand_index = 8" in text) == fp8
    assert "dynamic_slice" not in text and "dynamic_update_slice" not in text and "scatter" not in text


def test_paged_decode_step_through_the_fused_launch(monkeypatch):
    """The model's jitted paged step, a decode-only step after a prefill, with absorb_q and the cache write in one
    launch (interpreted): the cache of the step without it bit for bit, its logits to the absorbed product's
    float32 rounding (the jnp einsum and the kernel's dot sum in other orders)."""
    from mla_jax import model
    from mla_jax import step as step_mod
    from mla_jax.allocator import PagePool
    from mla_jax.cache import init_kv_cache_for
    from mla_jax.metadata import build_metadata
    from tests.mla_jax.helpers import step_requests

    cfg = paged_config()
    params = model.init_params(cfg, jax.random.key(0), std=0.2)
    pool = PagePool(31, 16)
    cache = init_kv_cache_for(cfg, 31, 16, dtype="bf16", allow_any_page_size=True, fill=float("nan"))
    seqs = [list(range(1, 20)), list(range(3, 30))]
    md1, _ = build_metadata(step_requests(pool, seqs, [0, 0], [(0, 5), (1, 9)]), page_size=16, num_pages=31)
    md2, _ = build_metadata(step_requests(pool, seqs, [5, 9], [(0, 1), (1, 1)]), page_size=16, num_pages=31)
    assert md2.shape.num_prefill_tokens == 0 and md2.shape.num_decode_tokens == 2
    _, cache = step_mod.jit_step(params, cfg, cache, md1.to_device())
    cache2 = jax.tree.map(jnp.copy, cache)
    want_logits, want_cache = step_mod.jit_step(params, cfg, cache, md2.to_device())
    entry = "absorb_q_and_write_latent_rows"
    got_logits, got_cache = step_through_kernel(monkeypatch, entry, params, cfg, cache2, md2.to_device())
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        _same(a, b)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=2e-2, atol=2e-2)
    written = np.isfinite(np.asarray(got_cache.kv_c_and_k_pe_cache, np.float32)).all(-1)
    assert written.sum() == cfg.num_hidden_layers * 16  # 14 prefill and 2 decode rows a layer, the rest NaN


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("t", [1, 32, 128])
def test_gpu_absorb_beside_cache_write_matches_the_kernels_alone(monkeypatch, fp8, t):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    monkeypatch.setattr(mla, "ABSORB_WITH_CACHE_WRITE", True)
    cfg = paged_config(num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128)
    k = jax.random.split(jax.random.key(t), 5)
    n, lat, r = 16, 512, 64
    q = jax.random.normal(k[0], (t, n, 192), jnp.float32).astype(jnp.bfloat16)
    kv = (jax.random.normal(k[1], (t, lat + r), jnp.float32) * 3).astype(jnp.bfloat16)
    w_uk = (jax.random.normal(k[2], (4, n, 128, lat), jnp.float32) * 0.1).astype(jnp.bfloat16)
    norm_w = (1.0 + 0.1 * jax.random.normal(k[3], (4, lat), jnp.float32)).astype(jnp.bfloat16)
    ang = jax.random.uniform(k[4], (t, r // 2), jnp.float32, 0.0, 50.0)
    rope = (jnp.cos(ang), jnp.sin(ang))
    slots = np.random.default_rng(t).permutation(8 * 64)[:t].astype(np.int32)
    slots[::5] = -1
    slots = jnp.asarray(slots)
    payload = jnp.full((4, 8, 64, lat + r), jnp.nan, jnp.bfloat16)
    cache = KVCache(payload.astype(jnp.float8_e4m3fn), jnp.full((4, 8, 64), jnp.nan)) if fp8 else KVCache(payload, None)
    i = jnp.int32(2)
    p, norm = {"W_UK_T": LayerRow(w_uk, i)}, {"weight": LayerRow(norm_w, i)}

    @jax.jit
    def fused(cache):
        return mla.absorb_q_and_write_latent_rows(p, cfg, q, cache, i, kv, norm, rope, slots, EPS)

    @jax.jit
    def alone(cache):
        kv_c_normed, k_pe, cache = mla.write_latent_rows(cache, i, kv, norm, *rope, slots, EPS)
        return mla.absorb_q(p, cfg, q, rope=rope), kv_c_normed, k_pe, cache

    got, want = fused(jax.tree.map(jnp.copy, cache)), alone(jax.tree.map(jnp.copy, cache))
    for a, b in zip(got[:3], want[:3]):
        _same(a, b)
    if fp8:
        _same_fp8(got[3].kv_c_and_k_pe_cache, got[3].kv_scale, want[3].kv_c_and_k_pe_cache, want[3].kv_scale)
    else:
        _same(got[3].kv_c_and_k_pe_cache, want[3].kv_c_and_k_pe_cache)
