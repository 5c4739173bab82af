"""Paged latent KV cache: layout, padding, fp8 round trip, in-place (donated) updates."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.cache import (
    FP8_MAX,
    FP8_ROW_FORMATS,
    Fp8Rows,
    KVCache,
    bytes_per_token,
    cache_bytes,
    check_page_size,
    check_slot_mapping,
    dequantize_cache_rows,
    dequantize_rows,
    fp8_format_row_bytes,
    gather_rows,
    init_kv_cache,
    num_pages_for_bytes,
    quantize_cache_rows,
    quantize_rows,
    row_bytes,
    update_cache,
    write_kv,
    write_kv_layer,
)

L, R = 512, 64
W = L + R


def _inputs(rng, t, dtype):
    kv_c = (rng.standard_normal((t, L)) * 2).astype(np.float32)
    k_pe = (rng.standard_normal((t, R)) * 3).astype(np.float32)
    return jnp.asarray(kv_c, dtype), jnp.asarray(k_pe, dtype)


def _slots(rng, num_pages, page_size, t, num_pad=0):
    """t distinct real slots (always including slot 0 and the last slot when t >= 2) + pad."""
    n = num_pages * page_size
    s = rng.choice(np.arange(1, n - 1), size=t - 2, replace=False).tolist() + [0, n - 1]
    s = np.array(s + [-1] * num_pad, np.int32)
    rng.shuffle(s)
    return s


def _bits(x):
    x = np.asarray(x)
    return x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---------------------------------------------------------------------------------------------------
# sizes and construction


def test_row_bytes():
    assert row_bytes("bf16") == 1152
    assert row_bytes("fp8") == 580  # 576 B payload + 4 B f32 scale
    assert row_bytes("fp32") == 2304
    assert row_bytes(jnp.bfloat16) == 1152
    assert bytes_per_token(61, "bf16") == 61 * 1152
    assert bytes_per_token(27, "fp8") == 27 * 580
    assert cache_bytes(2, 10, 64, "fp8") == 2 * 10 * 64 * 580
    assert num_pages_for_bytes(cache_bytes(2, 10, 64, "bf16") + 5, 2, 64, "bf16") == 10
    with pytest.raises(ValueError, match="dtype"):
        row_bytes("int8")


def test_cache_bytes_match_arrays():
    for dt in ("bf16", "fp8", "fp32"):
        c = init_kv_cache(2, 3, 16, dtype=dt)
        nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(c))
        assert nbytes == cache_bytes(2, 3, 16, dt)


@pytest.mark.parametrize("dt,jdt", [("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn), ("fp32", jnp.float32)])
def test_init(dt, jdt):
    c = init_kv_cache(3, 5, 32, dtype=dt)
    assert c.kv_c_and_k_pe_cache.shape == (3, 5, 32, W)
    assert c.kv_c_and_k_pe_cache.dtype == jdt
    assert (c.num_layers, c.num_pages, c.page_size, c.width) == (3, 5, 32, W)
    if dt == "fp8":
        assert c.kv_scale.shape == (3, 5, 32) and c.kv_scale.dtype == jnp.float32
        assert c.is_fp8
    else:
        assert c.kv_scale is None and not c.is_fp8
    # pytree round trip
    leaves, tree = jax.tree_util.tree_flatten(c)
    assert len(leaves) == (2 if dt == "fp8" else 1)
    assert isinstance(jax.tree_util.tree_unflatten(tree, leaves), KVCache)


def test_page_size_validation():
    for g in (16, 32, 64, 128):
        check_page_size(g)
    for g in (1, 8, 48, 256):
        with pytest.raises(ValueError, match="page_size"):
            init_kv_cache(1, 2, g)
    for g in (1, 2, 4, 256):
        check_page_size(g, allow_any_page_size=True)
    for g in (0, 3, 12):
        with pytest.raises(ValueError, match="power of two"):
            check_page_size(g, allow_any_page_size=True)
    assert init_kv_cache(1, 2).page_size == 64  # default


# ---------------------------------------------------------------------------------------------------
# layout


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dt,jdt", [("fp32", jnp.float32), ("bf16", jnp.bfloat16)])
def test_exact_layout(page_size, dt, jdt):
    rng = np.random.default_rng(page_size)
    num_pages, t = 3, 9
    cache = init_kv_cache(1, num_pages, page_size, dtype=dt, fill=np.nan)
    kv_c, k_pe = _inputs(rng, t + 3, jdt)  # the 3 padding tokens carry data that must not land
    slots = _slots(rng, num_pages, page_size, t, num_pad=3)  # padding interleaved with real tokens
    layer, _ = cache.layer(0)
    new, scale = jax.jit(write_kv)(layer, None, kv_c, k_pe, jnp.asarray(slots))
    assert scale is None
    new = np.asarray(new)
    kv_c, k_pe = np.asarray(kv_c), np.asarray(k_pe)
    written = np.zeros((num_pages, page_size), bool)
    for i, s in enumerate(slots):
        if s < 0:
            continue
        page, off = divmod(int(s), page_size)
        np.testing.assert_array_equal(_bits(new[page, off, :L]), _bits(kv_c[i]))  # latent first
        np.testing.assert_array_equal(_bits(new[page, off, L:]), _bits(k_pe[i]))  # then rope
        written[page, off] = True
    assert written[0, 0] and written[-1, -1]
    assert np.isnan(new[~written].astype(np.float32)).all(), "rows that were not written changed"


def test_k_pe_with_head_axis():
    rng = np.random.default_rng(0)
    layer = init_kv_cache(1, 2, 16, dtype="fp32").layer(0)[0]
    kv_c, k_pe = _inputs(rng, 4, jnp.float32)
    slots = jnp.array([3, 17, 0, 31], jnp.int32)
    a, _ = write_kv(layer, None, kv_c, k_pe, slots)
    b, _ = write_kv(layer, None, kv_c, k_pe[:, None, :], slots)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_padding_and_out_of_range_slots_write_nowhere():
    rng = np.random.default_rng(1)
    page_size, num_pages = 16, 2
    n = num_pages * page_size
    layer = init_kv_cache(1, num_pages, page_size, dtype="fp32", fill=np.nan).layer(0)[0]
    kv_c, k_pe = _inputs(rng, 5, jnp.float32)
    # -1 (padding), other negatives, and slots >= n must not wrap onto slot 0 / the last slot.
    slots = jnp.array([-1, -2, -n, n, n + 5], jnp.int32)
    new, _ = jax.jit(write_kv)(layer, None, kv_c, k_pe, slots)
    assert np.isnan(np.asarray(new)).all()


def test_all_padding_fp8_keeps_scales():
    rng = np.random.default_rng(2)
    c = init_kv_cache(1, 2, 16, dtype="fp8", fill=np.nan)
    kv_c, k_pe = _inputs(rng, 3, jnp.bfloat16)
    new, scale = write_kv(*c.layer(0), kv_c, k_pe, jnp.full((3,), -1, jnp.int32))
    assert np.isnan(np.asarray(new).astype(np.float32)).all()
    np.testing.assert_array_equal(np.asarray(scale), 1.0)


def test_write_input_validation():
    layer = init_kv_cache(1, 2, 16, dtype="fp32").layer(0)[0]
    kv_c, k_pe = jnp.ones((3, L)), jnp.ones((3, R))
    s = jnp.arange(3, dtype=jnp.int32)
    with pytest.raises(ValueError, match="width"):
        write_kv(layer, None, kv_c[:, :500], k_pe, s)
    with pytest.raises(ValueError, match="tokens"):
        write_kv(layer, None, kv_c, k_pe[:2], s)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(layer, None, kv_c, k_pe, s[:2])
    with pytest.raises(ValueError, match="integer"):
        write_kv(layer, None, kv_c, k_pe, s.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"\[T, 1, R\]"):
        write_kv(layer, None, kv_c, jnp.ones((3, 2, R)), s)
    with pytest.raises(ValueError, match="non-fp8"):
        write_kv(layer, jnp.ones((2, 16)), kv_c, k_pe, s)
    c8 = init_kv_cache(1, 2, 16, dtype="fp8")
    with pytest.raises(ValueError, match="kv_scale"):
        write_kv(c8.layer(0)[0], None, kv_c, k_pe, s)
    with pytest.raises(ValueError, match="layer 5"):
        write_kv_layer(c8, 5, kv_c, k_pe, s)


# ---------------------------------------------------------------------------------------------------
# fp8


def test_fp8_quantize_rows_bound():
    rng = np.random.default_rng(3)
    t = 64
    # per-row magnitudes from 1e-3 to 1e3, plus an all-zero row and a row with one huge outlier
    x = rng.standard_normal((t, W)).astype(np.float32) * np.logspace(-3, 3, t, dtype=np.float32)[:, None]
    x[5] = 0.0
    x[6, 100] = 1e4
    q, s = quantize_rows(jnp.asarray(x))
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (t,)
    s = np.asarray(s)
    assert s[5] == 1.0
    np.testing.assert_allclose(s[np.arange(t) != 5], np.abs(x).max(-1)[np.arange(t) != 5] / FP8_MAX, rtol=1e-6)
    qf = np.asarray(q).astype(np.float32)
    assert np.abs(qf).max() <= FP8_MAX and np.isfinite(qf).all()
    back = np.asarray(dequantize_rows(q, jnp.asarray(s)))
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal spacing 2^-9 (scaled).
    bound = np.abs(x) * 2.0**-4 + s[:, None] * 2.0**-10 + 1e-30
    assert (np.abs(back - x) <= bound).all()
    np.testing.assert_array_equal(back[5], 0.0)


def test_fp8_write_round_trip_and_untouched():
    rng = np.random.default_rng(4)
    page_size, num_pages, t = 16, 4, 20
    c = init_kv_cache(2, num_pages, page_size, dtype="fp8", fill=np.nan)
    kv_c, k_pe = _inputs(rng, t, jnp.bfloat16)
    slots = _slots(rng, num_pages, page_size, t)
    new = jax.jit(write_kv_layer)(c, 1, kv_c, k_pe, jnp.asarray(slots))
    rows = np.concatenate([np.asarray(kv_c, np.float32), np.asarray(k_pe, np.float32)], -1)
    got = np.asarray(gather_rows(*new.layer(1), jnp.asarray(slots)))
    amax = np.abs(rows).max(-1, keepdims=True)
    assert (np.abs(got - rows) <= np.abs(rows) * 2.0**-4 + amax / FP8_MAX * 2.0**-10).all()
    scale = np.asarray(new.kv_scale[1]).reshape(-1)
    np.testing.assert_allclose(scale[slots], amax[:, 0] / FP8_MAX, rtol=1e-6)
    kv = np.asarray(new.kv_c_and_k_pe_cache).astype(np.float32)
    assert np.isnan(kv[0]).all(), "other layer changed"
    mask = np.ones(num_pages * page_size, bool)
    mask[slots] = False
    assert np.isnan(kv[1].reshape(-1, W)[mask]).all(), "unwritten rows changed"
    np.testing.assert_array_equal(scale[mask], 1.0)


# ---------------------------------------------------------------------------------------------------
# fp8 row formats (compared in notebooks/09_fp8_cache_formats.ipynb)


def _packed_row_bytes(p: Fp8Rows) -> int:
    return sum(a.shape[-1] * a.dtype.itemsize for a in p if a is not None)


def test_fp8_row_format_bytes():
    want = {"per_token": 580, "ds_mla": 656, "per_group": 596, "bf16_rope": 644}  # DeepSeek-V3 dims, group 128
    assert {f: fp8_format_row_bytes(f) for f in FP8_ROW_FORMATS} == want
    assert fp8_format_row_bytes("per_token") == row_bytes("fp8")
    x = jnp.ones((2, 3, W), jnp.float32)
    for f in FP8_ROW_FORMATS:  # the bytes are those of the arrays the format stores
        assert _packed_row_bytes(quantize_cache_rows(x, f)) == want[f]
        small = quantize_cache_rows(jnp.ones((2, 80)), f, kv_lora_rank=64, group=16)  # the demo model's dims
        assert _packed_row_bytes(small) == fp8_format_row_bytes(f, kv_lora_rank=64, rope_dim=16, group=16)
    assert fp8_format_row_bytes("ds_mla", kv_lora_rank=64, rope_dim=16, group=16) == 64 + 4 * 4 + 32
    assert fp8_format_row_bytes("ds_mla", kv_lora_rank=64, rope_dim=16) == 64 + 4 + 32  # group 128 > L: one scale
    with pytest.raises(ValueError, match="unknown fp8 row format"):
        fp8_format_row_bytes("per_tensor")
    with pytest.raises(ValueError, match="must divide kv_lora_rank"):
        quantize_cache_rows(x, "ds_mla", group=96)
    with pytest.raises(ValueError, match="unknown fp8 row format"):
        dequantize_cache_rows(quantize_cache_rows(x, "ds_mla"), "fp8_ds_mla")
    with pytest.raises(ValueError, match="not in format 'per_group'"):
        dequantize_cache_rows(quantize_cache_rows(x, "ds_mla"), "per_group")
    with pytest.raises(ValueError, match="not in format 'ds_mla'"):
        dequantize_cache_rows(quantize_cache_rows(x, "bf16_rope"), "ds_mla")
    with pytest.raises(ValueError, match="R >= 1"):
        quantize_cache_rows(x[..., :L], "per_token")


@pytest.mark.parametrize("fmt", FP8_ROW_FORMATS)
def test_fp8_row_format_round_trip_bound(fmt):
    """Every value within e4m3's rounding (2^-4 relative, 2^-10 of its own scale absolute near zero) or bf16's
    (2^-8) of the input; each scale is amax / 448 of exactly the values it covers; zero rows come back zero."""
    rng = np.random.default_rng(7)
    t, g = 48, 128
    x = rng.standard_normal((4, t // 4, W)).astype(np.float32) * np.logspace(-3, 3, t, dtype=np.float32).reshape(
        4, -1, 1
    )
    x[..., L:] *= 8.0  # rope larger than the latent, as in the demo model's rows
    x[..., 3:5, 128:256] *= 1e-3  # one quiet latent group
    x[1, 2] = 0.0  # a zero row
    x[2, 1, :L] = 0.0  # a zero latent with a non-zero rope
    p = quantize_cache_rows(jnp.asarray(x), fmt)
    back = np.asarray(dequantize_cache_rows(p, fmt))
    assert back.shape == x.shape and back.dtype == np.float32 and np.isfinite(back).all()
    q, s = np.asarray(p.values).astype(np.float32), np.asarray(p.scales)
    assert p.values.dtype == jnp.float8_e4m3fn and np.abs(q).max() <= FP8_MAX
    # the scale of each value (same layout as x) and the values each scale covers
    if fmt == "per_token":
        cover = [(slice(0, W), 0)]
    elif fmt == "bf16_rope":
        cover = [(slice(0, L), 0)]
    else:
        cover = [(slice(i * g, (i + 1) * g), i) for i in range(L // g)]
        cover += [(slice(L, W), L // g)] if fmt == "per_group" else []
    e4m3 = np.zeros(W, bool)
    for sl, k in cover:
        amax = np.abs(x[..., sl]).max(-1)
        np.testing.assert_allclose(s[..., k], np.where(amax > 0, amax / FP8_MAX, 1.0), rtol=1e-6)
        err = np.abs(back[..., sl] - x[..., sl])
        assert (err <= np.abs(x[..., sl]) * 2.0**-4 + s[..., k : k + 1] * 2.0**-10).all(), (fmt, sl)
        e4m3[sl] = True
    assert s.shape == x.shape[:-1] + (len(cover),)
    if fmt in ("ds_mla", "bf16_rope"):
        assert p.rope.dtype == jnp.bfloat16 and not e4m3[L:].any()
        assert (np.abs(back[..., L:] - x[..., L:]) <= np.abs(x[..., L:]) * 2.0**-8).all()
    else:
        assert p.rope is None and e4m3.all()
    np.testing.assert_array_equal(back[1, 2], 0.0)
    np.testing.assert_array_equal(back[2, 1, :L], 0.0)
    assert (s[1, 2] == 1.0).all()


def test_fp8_row_formats_rope_in_bf16_or_own_scale_cut_the_error():
    """With a rope 8x the latent (the demo's rows: rope RMS 2-8x the latent's), one row scale costs the latent
    precision (its small values go subnormal); per-group scales recover it, a bf16 rope is ~16x more exact."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((256, W)).astype(np.float32)
    x[:, L:] *= 8.0
    x[:, :L] *= np.exp(rng.standard_normal(L)).astype(np.float32)  # uneven channels, as after RMSNorm's weight

    def err(fmt, part):
        back = np.asarray(dequantize_cache_rows(quantize_cache_rows(jnp.asarray(x), fmt), fmt))
        return np.linalg.norm(back[:, part] - x[:, part]) / np.linalg.norm(x[:, part])

    lat, rope = slice(0, L), slice(L, W)
    assert err("ds_mla", lat) < err("per_token", lat)
    assert err("per_group", lat) == err("ds_mla", lat)  # the same latent scales
    assert err("ds_mla", rope) < err("per_token", rope) / 8
    assert err("bf16_rope", rope) == err("ds_mla", rope)


def test_fp8_per_token_format_is_what_the_cache_stores():
    rng = np.random.default_rng(9)
    page_size, num_pages, t = 16, 2, 20
    c = init_kv_cache(1, num_pages, page_size, dtype="fp8", fill=np.nan)
    kv_c, k_pe = _inputs(rng, t, jnp.bfloat16)
    slots = _slots(rng, num_pages, page_size, t)
    kv, scale = write_kv(*c.layer(0), kv_c, k_pe, jnp.asarray(slots))
    rows = jnp.concatenate([kv_c, k_pe], -1)  # [T, L+R] bf16, as the write path takes them
    p = quantize_cache_rows(rows, "per_token")
    np.testing.assert_array_equal(_bits(p.values), _bits(kv.reshape(-1, W)[slots]))
    np.testing.assert_array_equal(_bits(p.scales[:, 0]), _bits(scale.reshape(-1)[slots]))
    np.testing.assert_array_equal(
        _bits(dequantize_cache_rows(p, "per_token")), _bits(gather_rows(kv, scale, jnp.asarray(slots)))
    )


# ---------------------------------------------------------------------------------------------------
# stacked cache, traced layer index


@pytest.mark.parametrize("dt,jdt", [("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp8", jnp.bfloat16)])
def test_write_kv_layer_matches_write_kv(dt, jdt):
    rng = np.random.default_rng(5)
    nl, num_pages, page_size, t = 3, 3, 16, 7
    c = init_kv_cache(nl, num_pages, page_size, dtype=dt, fill=np.nan)
    kv_c, k_pe = _inputs(rng, nl * t, jdt)
    kv_c, k_pe = kv_c.reshape(nl, t, L), k_pe.reshape(nl, t, R)
    slots = jnp.asarray(_slots(rng, num_pages, page_size, t, num_pad=2)[:t])

    @jax.jit
    def all_layers(cache):  # the pattern the model uses: cache in the fori carry, traced layer index
        return jax.lax.fori_loop(0, nl, lambda i, cc: write_kv_layer(cc, i, kv_c[i], k_pe[i], slots), cache)

    got = all_layers(c)
    for i in range(nl):
        want_kv, want_s = write_kv(*c.layer(i), kv_c[i], k_pe[i], slots)
        np.testing.assert_array_equal(_bits(got.kv_c_and_k_pe_cache[i]), _bits(want_kv))
        if dt == "fp8":
            np.testing.assert_array_equal(np.asarray(got.kv_scale[i]), np.asarray(want_s))


def test_negative_traced_layer_writes_nothing():
    rng = np.random.default_rng(6)
    c = init_kv_cache(2, 2, 16, dtype="fp32", fill=np.nan)
    kv_c, k_pe = _inputs(rng, 2, jnp.float32)
    new = jax.jit(write_kv_layer)(c, jnp.int32(-1), kv_c, k_pe, jnp.array([0, 31], jnp.int32))
    assert np.isnan(np.asarray(new.kv_c_and_k_pe_cache)).all()


# ---------------------------------------------------------------------------------------------------
# in-place update: aliasing + donation


@pytest.mark.parametrize("dt", ["bf16", "fp32", "fp8"])
def test_update_cache_is_in_place(dt):
    rng = np.random.default_rng(7)
    nl, num_pages, page_size, t = 4, 16, 16, 8
    c = init_kv_cache(nl, num_pages, page_size, dtype=dt)
    kv_c, k_pe = _inputs(rng, t, jnp.bfloat16)
    slots = jnp.asarray(_slots(rng, num_pages, page_size, t))
    layer = jnp.int32(2)
    compiled = update_cache.lower(c, layer, kv_c, k_pe, slots).compile()
    hlo = compiled.as_text()
    # jax 0.11 prints "input_output_alias={ {}: (0, {}, may-alias) }" (one output) or, with the fp8
    # scale, "input_output_alias={ {0}: (0, {}, may-alias), {1}: (1, {}, may-alias) }".
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo)
    assert alias, "no input/output aliasing in the compiled HLO"
    pairs = re.findall(r"\{(\d*)\}: \((\d+), \{\}, (?:may|must)-alias\)", alias.group(1))
    want = [("0", "0"), ("1", "1")] if dt == "fp8" else [("", "0")]
    assert sorted(pairs) == want, alias.group(0)
    cache_nbytes = c.kv_c_and_k_pe_cache.nbytes
    ma = compiled.memory_analysis()
    if ma is not None:
        assert ma.alias_size_in_bytes >= cache_nbytes
        if dt != "fp8":  # XLA:CPU upcasts an fp8 scatter through a full f16 copy (GPU: native, see gpu test)
            assert ma.temp_size_in_bytes < cache_nbytes // 8, ma
    kv_in, scale_in = c.kv_c_and_k_pe_cache, c.kv_scale
    out = update_cache(c, layer, kv_c, k_pe, slots)
    assert kv_in.is_deleted(), "donated cache buffer still alive: the update copied the cache"
    if scale_in is not None:
        assert scale_in.is_deleted()
    got = np.asarray(gather_rows(*out.layer(2), slots))
    rows = np.concatenate([np.asarray(kv_c, np.float32), np.asarray(k_pe, np.float32)], -1)
    np.testing.assert_allclose(got, rows, rtol=2.0**-4 if dt == "fp8" else 0, atol=1e-2 if dt == "fp8" else 0)


@pytest.mark.gpu
@pytest.mark.parametrize("dt", ["bf16", "fp8"])
def test_update_cache_in_place_gpu(dt):
    """On GPU the fp8 scatter must be native too: no cache-sized temporary (DeepSeek-sized layer)."""
    nl, num_pages, page_size, t = 4, 2048, 64, 256
    c = init_kv_cache(nl, num_pages, page_size, dtype=dt)
    rng = np.random.default_rng(8)
    kv_c, k_pe = _inputs(rng, t, jnp.bfloat16)
    slots = jnp.asarray(_slots(rng, num_pages, page_size, t))
    compiled = update_cache.lower(c, jnp.int32(1), kv_c, k_pe, slots).compile()
    ma = compiled.memory_analysis()
    assert ma.alias_size_in_bytes >= c.kv_c_and_k_pe_cache.nbytes
    assert ma.temp_size_in_bytes < c.kv_c_and_k_pe_cache.nbytes // 64, ma
    kv_in = c.kv_c_and_k_pe_cache
    out = update_cache(c, jnp.int32(1), kv_c, k_pe, slots)
    jax.block_until_ready(out)
    assert kv_in.is_deleted()


# ---------------------------------------------------------------------------------------------------
# host-side slot mapping validation


def test_check_slot_mapping():
    check_slot_mapping(np.array([0, 5, -1, 31, -1], np.int32), 2, 16)
    check_slot_mapping(np.zeros((0,), np.int32), 2, 16)
    with pytest.raises(ValueError, match="int32"):
        check_slot_mapping(np.array([0, 1], np.int64), 2, 16)
    with pytest.raises(ValueError, match="numpy"):
        check_slot_mapping([0, 1], 2, 16)
    with pytest.raises(ValueError, match="1-D"):
        check_slot_mapping(np.zeros((2, 2), np.int32), 2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 32 out of range"):
        check_slot_mapping(np.array([0, 1, 32], np.int32), 2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2"):
        check_slot_mapping(np.array([-2, 1], np.int32), 2, 16)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = -1"):
        check_slot_mapping(np.array([0, -1], np.int32), 2, 16, allow_padding=False)
    with pytest.raises(ValueError, match="slot 7 more than once"):
        check_slot_mapping(np.array([7, -1, 3, -1, 7], np.int32), 2, 16)
