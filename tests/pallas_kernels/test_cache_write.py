"""The latent-row cache write (RMSNorm + RoPE + paged write in one kernel) against the path it replaces
(rms_norm + apply_rope + write_kv_layer): interpreted on CPU, lowered to Triton for an H200 on CPU, the model's
paged step through it, and on the GPU (`gpu`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.cache import KVCache, write_kv_layer
from mla_jax.mla import write_latent_rows
from mla_jax.rope import apply_rope
from pallas_kernels import cache_write
from pallas_kernels.rms_norm import add_rms_norm_reference

L, R, NL, P, G = 64, 16, 3, 6, 4
EPS = 1e-6
ROW_SCALES = np.array([1.0, 300.0, 0.003, 7.0, 1.0, 0.5, 2.0])  # a row mixed with another shows
SLOTS = np.array([5, -1, 13, P * G, 0, 23, 100], np.int32)  # -1 and >= P * G: padding
T = len(SLOTS)


def _inputs(seed, dtype=jnp.bfloat16, t=T, lat=L, r=R, layers=None):
    k = jax.random.split(jax.random.key(seed), 3)
    s = jnp.asarray(np.resize(ROW_SCALES, t), jnp.float32)[:, None]
    kv = (jax.random.normal(k[0], (t, lat + r), jnp.float32) * s).astype(dtype)
    wshape = (lat,) if layers is None else (layers, lat)
    w = 1.0 + 0.1 * jax.random.normal(k[1], wshape, jnp.float32)
    if layers is not None:  # each layer's row far from the others (a read of the wrong row shows)
        w = w * (1.0 + jnp.arange(layers, dtype=jnp.float32))[:, None]
    ang = jax.random.uniform(k[2], (t, r // 2), jnp.float32, 0.0, 50.0)
    return kv, w.astype(dtype), jnp.cos(ang) * 1.3, jnp.sin(ang) * 1.3


def _poisoned(dtype, lat=L, r=R, layers=NL, pages=P):
    return jnp.full((layers, pages, G, lat + r), jnp.nan, dtype)


def _current_path(kv, w, cos, sin, slots, cache, layer, weight_index=None):
    """What mla_paged ran before: the norm, the rope, write_kv_layer."""
    lat = w.shape[-1]
    kv_c_normed, _ = add_rms_norm_reference(kv[:, :lat], None, w, eps=EPS, weight_index=weight_index)
    k_pe = apply_rope(kv[:, None, lat:], cos, sin)
    out = write_kv_layer(KVCache(cache, None), layer, kv_c_normed, k_pe, jnp.asarray(slots))
    return kv_c_normed, k_pe, out.kv_c_and_k_pe_cache


def _same(a, b):  # bitwise, NaN where NaN
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _same_fp8(got, got_scale, want, want_scale, max_frac=0.01):
    """fp8 payloads and scales from two implementations of `util.quantize_rows`: the same NaN (unwritten) pattern,
    scales within one f32 ulp and payloads within one e4m3 step, rarely apart (XLA's vectorized f32 division and
    a scalar one, or Triton's, may round the last bit differently, and a row / scale on an e4m3 tie then rounds
    the other way)."""
    gs, ws = np.asarray(got_scale), np.asarray(want_scale)
    assert got.dtype == want.dtype == jnp.float8_e4m3fn and gs.dtype == ws.dtype == np.float32
    assert (np.isnan(gs) == np.isnan(ws)).all()
    np.testing.assert_allclose(gs[~np.isnan(gs)], ws[~np.isnan(ws)], rtol=2.5e-7)
    gv, wv = np.asarray(got).view(np.uint8).astype(int), np.asarray(want).view(np.uint8).astype(int)
    assert (np.abs(gv - wv) <= 1).all()  # same sign, at most one e4m3 step apart
    assert (gv != wv).mean() <= max_frac


def _written_only(cache, layer, slots):
    """Every row of the NaN-poisoned cache is NaN except the valid slots of `layer`, which are finite."""
    c = np.asarray(cache, np.float32).reshape(cache.shape[0], -1, cache.shape[-1])
    finite = np.isfinite(c).all(-1)  # [layers, P*G]
    want = np.zeros_like(finite)
    if 0 <= layer < cache.shape[0]:
        s = slots[(slots >= 0) & (slots < c.shape[1])]
        want[layer, s] = True
    np.testing.assert_array_equal(finite, want)
    assert np.isnan(c[~want]).all()


@pytest.mark.parametrize(
    "kv_dtype,cache_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float16, jnp.float16), (jnp.bfloat16, jnp.float32)]
)
def test_matches_current_path_bitwise(kv_dtype, cache_dtype):
    kv, w, cos, sin = _inputs(0, kv_dtype)
    cache = _poisoned(cache_dtype)
    rows, got = jax.jit(
        lambda c, i: cache_write.write_latent_rows(kv, w, cos, sin, jnp.asarray(SLOTS), c, i, eps=EPS, interpret=True)
    )(cache, jnp.int32(1))
    kv_c_normed, k_pe, want = _current_path(kv, w, cos, sin, SLOTS, cache, 1)
    _same(got, want)
    _same(rows[:, :L], kv_c_normed)
    _same(rows[:, L:], k_pe[:, 0])
    _written_only(got, 1, SLOTS)
    ref_rows, ref_cache = cache_write.write_latent_rows_reference(
        kv, w, cos, sin, jnp.asarray(SLOTS), cache, 1, eps=EPS
    )  # the file's reference is the same contract
    _same(ref_cache, want)
    _same(ref_rows, rows)


def _fp8_current_path(kv, w, cos, sin, slots, cache, scale, layer, rms_norm=add_rms_norm_reference):
    """What the step ran for an fp8 cache before the kernel took it: the norm, the rope, write_kv_layer's
    quantization and two scatters."""
    lat = w.shape[-1]
    kv_c_normed, _ = rms_norm(kv[:, :lat], None, w, eps=EPS)
    k_pe = apply_rope(kv[:, None, lat:], cos, sin)
    out = write_kv_layer(KVCache(cache, scale), layer, kv_c_normed, k_pe, jnp.asarray(slots))
    return out.kv_c_and_k_pe_cache, out.kv_scale


def test_fp8_cache_matches_current_path_bitwise():
    """An fp8 cache: the row quantized per token (e4m3 payload, f32 scale) as write_kv_layer does (`_same_fp8`); the
    NaN-poisoned payload and scales are written at the valid slots of the layer only (an all-zero row: scale 1)."""
    kv, w, cos, sin = _inputs(5)
    kv = kv.at[4].set(0.0)  # slot 0: a zero row
    cache = _poisoned(jnp.bfloat16).astype(jnp.float8_e4m3fn)
    scale = jnp.full(cache.shape[:3], jnp.nan, jnp.float32)
    rows, got, got_s = jax.jit(
        lambda c, s, i: cache_write.write_latent_rows(
            kv, w, cos, sin, jnp.asarray(SLOTS), c, i, eps=EPS, kv_scale=s, interpret=True
        )
    )(cache, scale, jnp.int32(2))
    want, want_s = _fp8_current_path(kv, w, cos, sin, SLOTS, cache, scale, 2)
    _same_fp8(got, got_s, want, want_s)
    _written_only(got, 2, SLOTS)
    s = np.asarray(got_s).reshape(NL, -1)
    assert s[2, 0] == 1.0 and np.isfinite(s[2, [5, 13, 23]]).all() and np.isnan(np.delete(s[2], [0, 5, 13, 23])).all()
    assert np.isnan(s[[0, 1]]).all()
    ref = cache_write.write_latent_rows_reference(
        kv, w, cos, sin, jnp.asarray(SLOTS), cache, 2, eps=EPS, kv_scale=scale
    )  # the file's reference is the same contract
    _same(ref[0], rows)
    _same_fp8(got, got_s, ref[1], ref[2])
    with pytest.raises(ValueError, match="kv_scale must be f32"):
        cache_write.write_latent_rows(kv, w, cos, sin, jnp.asarray(SLOTS), cache, 0, eps=EPS, kv_scale=scale[:, 1:])
    with pytest.raises(ValueError, match="only an fp8 cache takes one"):
        cache_write.write_latent_rows(
            kv, w, cos, sin, jnp.asarray(SLOTS), cache.astype(jnp.bfloat16), 0, eps=EPS, kv_scale=scale
        )


def test_stacked_weight_and_traced_layer_in_a_scan():
    """A layer scan with the cache in the carry: layer i of the cache, row i of the stacked weights; traced layers
    3 and -1 (out of range) write nothing."""
    kv, ws, cos, sin = _inputs(1, layers=NL)
    slots = jnp.asarray(SLOTS)
    layers = jnp.asarray([0, 3, 2, -1], jnp.int32)

    def scan(c):
        def body(c, li):
            rows, c = cache_write.write_latent_rows(
                kv, ws, cos, sin, slots, c, li, eps=EPS, weight_index=jnp.clip(li, 0, NL - 1), interpret=True
            )
            return c, rows

        return jax.lax.scan(body, c, layers)

    got, rows = jax.jit(scan)(_poisoned(jnp.bfloat16))
    want = _poisoned(jnp.bfloat16)
    for j, li in enumerate([0, 3, 2, -1]):
        wi = min(max(li, 0), NL - 1)
        kv_c_normed, _, want = _current_path(kv, ws, cos, sin, SLOTS, want, jnp.int32(li), weight_index=wi)
        _same(rows[j, :, :L], kv_c_normed)
    _same(got, want)
    c = np.asarray(got, np.float32).reshape(NL, -1, L + R)
    assert np.isnan(c[1]).all()  # no layer wrote layer 1; layer 3 and -1 wrote nowhere
    _written_only(got[:1], 0, SLOTS)
    _written_only(got[2:], 0, SLOTS)


def test_mla_jax_entry_point():
    """`mla_jax.mla.write_latent_rows`: the kernel (interpreted) and the jnp path give the same rows and cache, bf16
    and fp8 (payload and scales); a LayerRow weight."""
    from mla_jax.cache import init_kv_cache
    from mla_jax.layers import LayerRow

    kv, ws, cos, sin = _inputs(2, layers=NL)
    cache = init_kv_cache(NL, P, G, kv_lora_rank=L, rope_dim=R, allow_any_page_size=True, fill=float("nan"))
    w = LayerRow(ws, jnp.int32(2))
    got = write_latent_rows(cache, jnp.int32(2), kv, {"weight": w}, cos, sin, jnp.asarray(SLOTS), EPS, interpret=True)
    want = write_latent_rows(cache, jnp.int32(2), kv, {"weight": w}, cos, sin, jnp.asarray(SLOTS), EPS)  # CPU: jnp
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _same(a, b)
    assert got[1].shape == (len(SLOTS), 1, R)
    fp8 = init_kv_cache(NL, P, G, kv_lora_rank=L, rope_dim=R, allow_any_page_size=True, dtype="fp8", fill=float("nan"))
    got = write_latent_rows(fp8, jnp.int32(1), kv, {"weight": w}, cos, sin, jnp.asarray(SLOTS), EPS, interpret=True)
    want = write_latent_rows(fp8, jnp.int32(1), kv, {"weight": w}, cos, sin, jnp.asarray(SLOTS), EPS)  # CPU: jnp
    assert got[2].kv_scale is not None and got[2].dtype == jnp.float8_e4m3fn
    _same(got[0], want[0])
    _same(got[1], want[1])
    _same_fp8(got[2].kv_c_and_k_pe_cache, got[2].kv_scale, want[2].kv_c_and_k_pe_cache, want[2].kv_scale)
    with pytest.raises(ValueError, match="layer 3 out of range"):
        write_latent_rows(cache, 3, kv, {"weight": ws[0]}, cos, sin, jnp.asarray(SLOTS), EPS)
    with pytest.raises(ValueError, match="kv must be"):
        write_latent_rows(cache, 0, kv[:, :L], {"weight": ws[0]}, cos, sin, jnp.asarray(SLOTS), EPS)


def test_bad_inputs():
    kv, w, cos, sin = _inputs(3)
    cache, slots = _poisoned(jnp.bfloat16), jnp.asarray(SLOTS)
    f = functools.partial(cache_write.write_latent_rows, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="kv must be"):
        f(kv[0], w, cos, sin, slots, cache, 0)
    with pytest.raises(ValueError, match="kv rows are 72 wide, the cache's 80"):
        f(kv[:, :72], w, cos, sin, slots, cache, 0)
    with pytest.raises(ValueError, match="rope width R = 80 - 63 = 17 must be even"):
        f(kv, w[:63], cos, sin, slots, cache, 0)
    with pytest.raises(ValueError, match="cos must be"):
        f(kv, w, cos[:, :4], sin, slots, cache, 0)
    with pytest.raises(ValueError, match="slot_mapping must be an integer"):
        f(kv, w, cos, sin, slots.astype(jnp.float32), cache, 0)
    with pytest.raises(ValueError, match="slot_mapping must be an integer"):
        f(kv, w, cos, sin, slots[:3], cache, 0)
    with pytest.raises(ValueError, match="layer=3 is out of range for a cache of 3 layers"):
        f(kv, w, cos, sin, slots, cache, 3)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        f(kv, w, cos, sin, slots, cache, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="an fp8 .* cache needs kv_scale"):
        f(kv, w, cos, sin, slots, cache.astype(jnp.float8_e4m3fn), 0)
    with pytest.raises(ValueError, match="cache dtype must be"):
        f(kv, w, cos, sin, slots, cache.astype(jnp.int8), 0)
    with pytest.raises(ValueError, match="needs weight_index"):
        f(kv, jnp.stack([w, w]), cos, sin, slots, cache, 0)
    with pytest.raises(ValueError, match="weight_index=2 is out of range for 2 stacked"):
        f(kv, jnp.stack([w, w]), cos, sin, slots, cache, 0, weight_index=2)
    with pytest.raises(ValueError, match="cache must be"):
        f(kv, w, cos, sin, slots, cache[0], 0)


def test_unsupported_widths_run_the_reference():
    assert cache_write.supported(512, 64) and not cache_write.supported(48, 64) and not cache_write.supported(64, 24)
    kv, w, cos, sin = _inputs(4, jnp.float32, lat=48, r=16)
    cache = _poisoned(jnp.float32, lat=48)
    got = cache_write.write_latent_rows(kv, w, cos, sin, jnp.asarray(SLOTS), cache, 0, eps=EPS, interpret=True)
    *_, want = _current_path(kv, w, cos, sin, SLOTS, cache, 0)
    _same(got[1], want)


def test_no_copy_of_the_cache_in_a_layer_scan():
    """Interpreted on CPU (the pallas_call becomes plain HLO): with the cache donated and in the scan's carry, the
    compiled step has no copy of a cache-shaped buffer."""
    t = 4
    sd = jax.ShapeDtypeStruct
    args = (
        sd((NL, P, G, L + R), jnp.bfloat16),
        sd((t, L + R), jnp.bfloat16),
        sd((NL, L), jnp.bfloat16),
        sd((t, R // 2), jnp.float32),
        sd((t, R // 2), jnp.float32),
        sd((t,), jnp.int32),
    )

    def step(cache, kv, w, cos, sin, slots):
        def body(c, i):
            rows, c = cache_write.write_latent_rows(
                kv, w, cos, sin, slots, c, i, eps=EPS, weight_index=i, interpret=True
            )
            return c, rows

        return jax.lax.scan(body, cache, jnp.arange(NL, dtype=jnp.int32))

    text = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    shape = f"bf16[{NL},{P},{G},{L + R}]"
    assert shape in text
    copies = [ln for ln in text.splitlines() if " copy(" in ln and f"= {shape}" in ln]
    assert not copies, copies


@pytest.mark.parametrize("fp8", [False, True])
def test_lowers_to_triton(h200, fp8):
    """Triton IR on CPU (Pallas's lowering, not the Triton compiler) at V3's sizes and an 18 GB cache (fp8: 9 GB
    and its scales; e4m3 casts need sm_89+): one kernel, a program per row, the cache (and the scales) aliased to
    the outputs (no slice of the stacked weights or of the cache)."""
    sd = jax.ShapeDtypeStruct
    t = 3
    cache = sd((61, 4096, 64, 576), jnp.float8_e4m3fn if fp8 else jnp.bfloat16)
    scale = sd((61, 4096, 64), jnp.float32) if fp8 else None
    args = (sd((t, 576), jnp.bfloat16), sd((61, 512), jnp.bfloat16), sd((t, 32), jnp.float32), sd((t, 32), jnp.float32))
    f = jax.jit(
        lambda kv, w, c, s, sl, cache, scale, i: cache_write.write_latent_rows(
            kv, w, c, s, sl, cache, i, eps=EPS, weight_index=i, kv_scale=scale
        ),
        donate_argnums=(5, 6),
    )
    text = f.trace(*args, sd((t,), jnp.int32), cache, scale, sd((), jnp.int32)).lower(lowering_platforms=("cuda",))
    text = text.as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert 'name = "cache_write_l512_r64' + ('_fp8"' if fp8 else '"') in text
    assert "grid_x = 3 : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 7" in text
    assert ("output_operand_alias<output_tuple_indices = [2], operand_index = 8" in text) == fp8
    assert "tf.aliasing_output = 1" in text  # the donated cache is the call's output buffer
    assert "dynamic_slice" not in text and "dynamic_update_slice" not in text and "scatter" not in text


def _paged_step(num_pages=37, cache_dtype="bf16", fill=float("nan")):
    """The tiny config's params, a NaN-poisoned cache and the metadata of one step: a decode (one token, which reads
    its own new row back from the cache) and a prefill."""
    from mla_jax import model
    from mla_jax.allocator import PagePool
    from mla_jax.cache import init_kv_cache_for
    from mla_jax.metadata import build_metadata
    from tests.mla_jax.helpers import paged_config, step_requests

    cfg = paged_config()
    params = model.init_params(cfg, jax.random.key(0), std=0.2)
    pool = PagePool(num_pages, 16)
    cache = init_kv_cache_for(cfg, num_pages, 16, dtype=cache_dtype, allow_any_page_size=True, fill=fill)
    seqs = [list(range(1, 20)), list(range(3, 30))]
    reqs = step_requests(pool, seqs, [0, 0], [(0, 1), (1, 9)])
    md, _ = build_metadata(reqs, page_size=16, num_pages=num_pages)
    assert md.shape.num_decode_tokens == 1 and md.shape.num_prefill_tokens == 9
    return params, cfg, cache, md.to_device()


def step_through_kernel(monkeypatch, entry: str, params, cfg, cache, md):
    """The jitted paged step (`step.jit_step`) with `step.<entry>` called with interpret=True (the kernels
    interpreted): (logits, cache), after checking that the step was traced through it."""
    import mla_jax.step as step

    calls = []
    fn = getattr(step, entry)

    def through_the_kernel(*a, **kw):
        calls.append(1)
        return fn(*a, **kw, interpret=True)

    monkeypatch.setattr(step, entry, through_the_kernel)
    jax.clear_caches()  # jit_step's trace of the jnp path (and, after, of the patched one) must not be reused
    try:
        out = step.jit_step(params, cfg, cache, md)
    finally:
        jax.clear_caches()
    assert calls  # traced through the kernel
    return out


def test_paged_step_through_the_kernel(monkeypatch):
    """The model's jitted paged step (mla_paged) with the kernel (interpreted) gives the logits and the cache of
    the jnp path, bitwise."""
    import mla_jax.step as step

    params, cfg, cache, md = _paged_step()
    assert cache_write.supported(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    cache2 = jax.tree.map(jnp.copy, cache)  # jit_step donates its cache
    want_logits, want_cache = step.jit_step(params, cfg, cache, md)
    got_logits, got_cache = step_through_kernel(monkeypatch, "write_latent_rows", params, cfg, cache2, md)
    _same(got_logits, want_logits)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        _same(a, b)
    written = np.isfinite(np.asarray(got_cache.kv_c_and_k_pe_cache, np.float32)).all(-1)
    assert written.sum() == cfg.num_hidden_layers * 10  # 10 tokens' rows in every layer, the rest still NaN


def test_fp8_paged_step_through_the_kernel(monkeypatch):
    """The jitted paged step with an fp8 cache through the kernel (interpreted): the payload and scales of the jnp
    path (`_same_fp8`), and its logits up to what one e4m3 step in a few stored values moves them."""
    import mla_jax.step as step

    params, cfg, cache, md = _paged_step(cache_dtype="fp8")
    assert cache.is_fp8
    cache2 = jax.tree.map(jnp.copy, cache)
    want_logits, want_cache = step.jit_step(params, cfg, cache, md)
    got_logits, got_cache = step_through_kernel(monkeypatch, "write_latent_rows", params, cfg, cache2, md)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=2e-2, atol=2e-2)
    _same_fp8(got_cache.kv_c_and_k_pe_cache, got_cache.kv_scale, want_cache.kv_c_and_k_pe_cache, want_cache.kv_scale)
    written = np.isfinite(np.asarray(got_cache.kv_c_and_k_pe_cache, np.float32)).all(-1)
    assert written.sum() == cfg.num_hidden_layers * 10  # 10 tokens' rows in every layer, the rest still NaN


# ---------------------------------------------------------------------------------------------------------------
# GPU: the Triton kernel against the path it replaces there (the rms_norm kernel, XLA's rope and scatter).


def _gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


def _gpu_current_path(kv, w, cos, sin, slots, cache, layer, weight_index=None):
    from pallas_kernels.rms_norm import add_rms_norm

    lat = w.shape[-1]
    kv_c_normed, _ = add_rms_norm(kv[:, :lat], None, w, eps=EPS, weight_index=weight_index)
    k_pe = apply_rope(kv[:, None, lat:], cos, sin)
    return write_kv_layer(KVCache(cache, None), layer, kv_c_normed, k_pe, slots).kv_c_and_k_pe_cache


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_gpu_matches_current_path_bitwise(dtype, t):
    _gpu()
    lat, r, layers, pages = 512, 64, 4, 96  # 384 slots: room for every row's own
    kv, ws, cos, sin = _inputs(t, dtype, t=t, lat=lat, r=r, layers=layers)
    rng = np.random.default_rng(t)
    slots = rng.permutation(pages * G)[:t].astype(np.int32)
    slots[::5] = -1
    slots[1::7] = pages * G + 3
    slots = jnp.asarray(slots)
    cache = _poisoned(dtype, lat=lat, r=r, layers=layers, pages=pages)
    for li in (2, -1, layers):
        f = jax.jit(
            lambda c, i: cache_write.write_latent_rows(kv, ws, cos, sin, slots, c, i, eps=EPS, weight_index=1)[1]
        )
        g = jax.jit(lambda c, i: _gpu_current_path(kv, ws, cos, sin, slots, c, i, weight_index=1))
        _same(f(cache, jnp.int32(li)), g(cache, jnp.int32(li)))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 300])
def test_gpu_fp8_matches_current_path(t):
    """The fp8 cache on the GPU against XLA's quantization and scatters (`_same_fp8`), at the valid slots only."""
    from pallas_kernels.rms_norm import add_rms_norm

    _gpu()
    lat, r, pages = 512, 64, 96
    kv, w, cos, sin = _inputs(t, jnp.bfloat16, t=t, lat=lat, r=r)
    rng = np.random.default_rng(t)
    slots = rng.permutation(pages * G)[:t].astype(np.int32)
    slots[::5] = -1
    slots = jnp.asarray(slots)
    cache = _poisoned(jnp.bfloat16, lat=lat, r=r, layers=2, pages=pages).astype(jnp.float8_e4m3fn)
    scale = jnp.full(cache.shape[:3], jnp.nan, jnp.float32)
    f = jax.jit(lambda c, s: cache_write.write_latent_rows(kv, w, cos, sin, slots, c, 1, eps=EPS, kv_scale=s)[1:])
    g = jax.jit(lambda c, s: _fp8_current_path(kv, w, cos, sin, slots, c, s, 1, rms_norm=add_rms_norm))
    (got, got_s), (want, want_s) = f(cache, scale), g(cache, scale)
    _same_fp8(got, got_s, want, want_s)
    _written_only(got, 1, np.asarray(slots))


@pytest.mark.gpu
def test_gpu_no_copy_of_the_cache_in_a_layer_scan():
    """Compiled for the GPU, the donated cache in a layer scan's carry: XLA adds no copy of it around the aliased
    custom call, and the step's temporaries are far smaller than the cache."""
    _gpu()
    layers, pages, t = 8, 512, 4  # a 38 MB cache
    sd = jax.ShapeDtypeStruct
    args = (
        sd((layers, pages, 64, 576), jnp.bfloat16),
        sd((t, 576), jnp.bfloat16),
        sd((layers, 512), jnp.bfloat16),
        sd((t, 32), jnp.float32),
        sd((t, 32), jnp.float32),
        sd((t,), jnp.int32),
    )

    def step(cache, kv, w, cos, sin, slots):
        def body(c, i):
            rows, c = cache_write.write_latent_rows(kv, w, cos, sin, slots, c, i, eps=EPS, weight_index=i)
            return c, rows

        return jax.lax.scan(body, cache, jnp.arange(layers, dtype=jnp.int32))

    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    text = compiled.as_text()
    shape = f"bf16[{layers},{pages},64,576]"
    copies = [ln for ln in text.splitlines() if " copy(" in ln and f"= {shape}" in ln]
    assert not copies, copies
    mem = compiled.memory_analysis()
    if mem is not None:
        assert mem.temp_size_in_bytes < layers * pages * 64 * 576 * 2 // 4, mem


def _jit_step_text():
    """The lowered and compiled texts of the model's jitted paged step (`_paged_step`) and the cache's HLO shape."""
    from mla_jax.step import jit_step

    params, cfg, cache, md = _paged_step(fill=0.0)
    lowered = jit_step.lower(params, cfg, cache, md)
    nl, p, g, w = cache.kv_c_and_k_pe_cache.shape
    return lowered.as_text(), lowered.compile().as_text(), f"bf16[{nl},{p},{g},{w}]"


@pytest.mark.gpu
def test_gpu_paged_step_writes_in_place():
    """The model's jitted step on the GPU: the cache write is the Triton kernel (no scatter of the latent rows),
    and XLA copies no cache-shaped buffer in the layer loop."""
    _gpu()
    lowered, text, shape = _jit_step_text()
    assert 'name = "cache_write_l32_r16"' in lowered  # the kernel, once (in the layer loop's body)
    copies = [ln for ln in text.splitlines() if " copy(" in ln and f"= {shape}" in ln]
    assert not copies, copies
