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
    """`mla_jax.mla.write_latent_rows`: the kernel (interpreted) and the jnp path give the same rows; a LayerRow
    weight; an fp8 cache takes the jnp path."""
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
    fp8 = init_kv_cache(NL, P, G, kv_lora_rank=L, rope_dim=R, allow_any_page_size=True, dtype="fp8")
    *_, out = write_latent_rows(fp8, 0, kv, {"weight": ws[0]}, cos, sin, jnp.asarray(SLOTS), EPS, interpret=True)
    assert out.kv_scale is not None and out.dtype == jnp.float8_e4m3fn
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
    with pytest.raises(ValueError, match="cache dtype must be"):
        f(kv, w, cos, sin, slots, cache.astype(jnp.float8_e4m3fn), 0)
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


def _h200(monkeypatch):
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    monkeypatch.setattr(
        pallas_call_registration.gpu_info_lib,
        "get_gpu_info",
        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200),
    )


def test_lowers_to_triton(monkeypatch):
    """Triton IR on CPU (Pallas's lowering, not the Triton compiler) at V3's sizes and an 18 GB cache: one kernel,
    a program per row, the cache aliased to the output (no slice of the stacked weights or of the cache)."""
    _h200(monkeypatch)
    sd = jax.ShapeDtypeStruct
    t = 3
    args = (
        sd((t, 576), jnp.bfloat16),
        sd((61, 512), jnp.bfloat16),
        sd((t, 32), jnp.float32),
        sd((t, 32), jnp.float32),
        sd((t,), jnp.int32),
        sd((61, 4096, 64, 576), jnp.bfloat16),
        sd((), jnp.int32),
    )
    f = jax.jit(
        lambda kv, w, c, s, sl, cache, i: cache_write.write_latent_rows(
            kv, w, c, s, sl, cache, i, eps=EPS, weight_index=i
        ),
        donate_argnums=5,
    )
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 3 : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text
    assert "output_operand_alias<output_tuple_indices = [1], operand_index = 7" in text
    assert "tf.aliasing_output = 1" in text  # the donated cache is the call's output buffer
    assert "dynamic_slice" not in text and "dynamic_update_slice" not in text


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


def test_paged_step_through_the_kernel(monkeypatch):
    """The model's jitted paged step (mla_paged) with the kernel (interpreted) gives the logits and the cache of
    the jnp path, bitwise."""
    import mla_jax.step as step

    params, cfg, cache, md = _paged_step()
    assert cache_write.supported(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    cache2 = jax.tree.map(jnp.copy, cache)  # jit_step donates its cache
    want_logits, want_cache = step.jit_step(params, cfg, cache, md)
    calls = []
    entry = step.write_latent_rows

    def through_the_kernel(*a, **kw):
        calls.append(1)
        return entry(*a, **kw, interpret=True)

    monkeypatch.setattr(step, "write_latent_rows", through_the_kernel)
    jax.clear_caches()  # jit_step's trace of the jnp path (and, after, of the patched one) must not be reused
    try:
        got_logits, got_cache = step.jit_step(params, cfg, cache2, md)
    finally:
        jax.clear_caches()
    assert calls  # traced through the kernel
    _same(got_logits, want_logits)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
        _same(a, b)
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
