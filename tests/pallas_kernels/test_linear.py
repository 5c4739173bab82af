"""linear (several dense linears of one input in one launch, stacked weights read in place) vs its float32
reference: interpreted on CPU, lowered to Triton for an H200 on CPU, and compiled on the GPU (`-m gpu`); and its use
by mla.mla_project_q_kv / mla.o_proj / layers.route and the layer loop (`model.split_in_place`)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import layers, mla, model
from mla_jax.layers import LayerRow
from pallas_kernels import linear as lin
from pallas_kernels.linear import default_tuning, linear, linear_reference
from tests.mla_jax.helpers import tiny_config

# |out - ref| <= ATOL + RTOL |ref| with outputs of unit scale; bf16 rounds the output to 8 bits; float32 is exact
# float32 arithmetic (only the summation order differs from the reference's).
TOL = {jnp.bfloat16: (2e-2, 2e-2), jnp.float32: (1e-6, 1e-6)}
SMALL = dict(block_t=16, block_n=16, block_k=16)  # many tiles and ragged edges at test sizes


def _inputs(seed, t, ns, k, x_dtype, w_dtype, layers=None):
    """x [T, K] and weights [N_j, K] (with layers: [layers, N_j, K], each layer distinct), scaled for unit outputs."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, k), np.float32), x_dtype)
    lead = () if layers is None else (layers,)
    ws = []
    for n in ns:
        w = rng.standard_normal((*lead, n, k), np.float32) / np.sqrt(k)
        if layers is not None:
            w = w * (1.0 + np.arange(layers, dtype=np.float32))[:, None, None]
        ws.append(jnp.asarray(w, w_dtype))
    return x, tuple(ws)


def _close(outs, refs, dtype):
    assert len(outs) == len(refs)
    for out, ref in zip(outs, refs):
        out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
        assert out.shape == ref.shape and np.all(np.isfinite(out))
        atol, rtol = TOL[dtype]
        np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)


def _poisoned_stack(w, layers: int, index: int):
    """[layers, N, K] with w at `index` and NaN elsewhere: a read of another layer shows."""
    st = jnp.full((layers, *w.shape), jnp.nan, w.dtype)
    return st.at[index].set(w)


@pytest.mark.parametrize(
    "t,ns,k,x_dtype,w_dtype,tuning",
    [
        (3, (40, 24), 72, jnp.bfloat16, jnp.bfloat16, SMALL),  # two weights, ragged N, K and T
        (19, (33,), 48, jnp.bfloat16, jnp.bfloat16, dict(block_t=16, block_n=32, block_k=32)),  # 2 row tiles
        (2, (20, 16, 7), 40, jnp.bfloat16, jnp.bfloat16, {}),  # three weights, default tuning
        (5, (7, 33), 40, jnp.float32, jnp.float32, dict(block_t=2, block_n=4, block_k=16)),  # f32: ragged everything
        (1, (64,), 100, jnp.bfloat16, jnp.float32, {}),  # the router: bf16 x cast to f32 in the kernel
    ],
)
def test_matches_reference(t, ns, k, x_dtype, w_dtype, tuning):
    x, ws = _inputs(t + k, t, ns, k, x_dtype, w_dtype)
    outs = linear(x, ws, interpret=True, **tuning)
    want = jnp.promote_types(x_dtype, w_dtype)
    assert [o.shape for o in outs] == [(t, n) for n in ns] and all(o.dtype == want for o in outs)
    _close(outs, linear_reference(x, ws), w_dtype if want == jnp.float32 else jnp.bfloat16)


def test_router_is_exact_float32():
    """bf16 x and a float32 weight: every product and sum in float32 (no TF32, no bf16 rounding of the weight), as
    HF's router computes; out_dtype float32 from bf16 weights too."""
    x, (w,) = _inputs(1, 3, (64,), 96, jnp.bfloat16, jnp.float32)
    (out,) = linear(x, (w,), out_dtype=jnp.float32, interpret=True)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-6, atol=1e-6)
    bad = np.asarray(x, np.float64) @ np.asarray(w.astype(jnp.bfloat16), np.float64).T  # what a bf16 product gives
    assert np.max(np.abs(bad - ref)) > 100 * np.max(np.abs(np.asarray(out) - ref))
    (o16,) = linear(x, (w.astype(jnp.bfloat16),), out_dtype=jnp.float32, interpret=True)
    assert o16.dtype == jnp.float32


def test_stacked_traced_index_poisoned_layers():
    """Two weights stacked over 4 layers, the wanted layer between NaN ones; the index traced (out of range:
    clamped) and static."""
    x, ws = _inputs(9, 5, (40, 24), 72, jnp.bfloat16, jnp.bfloat16)
    want = linear(x, ws, interpret=True, **SMALL)
    f = jax.jit(lambda sts, i: linear(x, sts, rhs_index=i, interpret=True, **SMALL))
    for index, arg in ((1, 1), (3, 9), (0, -2)):
        sts = tuple(_poisoned_stack(w, 4, index) for w in ws)
        for a, b in zip(f(sts, jnp.int32(arg)), want):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    sts = tuple(_poisoned_stack(w, 4, 2) for w in ws)
    _close(linear(x, sts, rhs_index=2, interpret=True), linear_reference(x, ws), jnp.bfloat16)


def test_gradient_is_the_references():
    x, ws = _inputs(4, 3, (20, 16), 24, jnp.float32, jnp.float32)

    def loss(fn, x, ws):
        a, b = fn(x, ws)
        return jnp.sum(a**2) + jnp.sum(jnp.sin(b))

    got = jax.grad(lambda x, ws: loss(lambda *a: linear(*a, interpret=True), x, ws), argnums=(0, 1))(x, ws)
    ref = jax.grad(lambda x, ws: loss(linear_reference, x, ws), argnums=(0, 1))(x, ws)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "args,kw,match",
    [
        ((jnp.zeros((2, 3, 4)), (jnp.zeros((5, 4)),)), {}, "x must be"),
        ((jnp.zeros((2, 4)), ()), {}, "non-empty tuple"),
        ((jnp.zeros((2, 4)), (jnp.zeros((5, 3)),)), {}, r"weights\[0\].*K=3"),
        ((jnp.zeros((2, 4)), (jnp.zeros((5, 4)), jnp.zeros((5, 4), jnp.bfloat16))), {}, "one dtype a call"),
        ((jnp.zeros((2, 4)), (jnp.zeros((3, 5, 4)),)), {}, "need rhs_index"),
        ((jnp.zeros((2, 4)), (jnp.zeros((3, 5, 4)),)), dict(rhs_index=3), "out of range"),
        ((jnp.zeros((2, 4)), (jnp.zeros((3, 5, 4)), jnp.zeros((2, 5, 4)))), dict(rhs_index=0), "stacked layers"),
        ((jnp.zeros((2, 4), jnp.int32), (jnp.zeros((5, 4)),)), {}, "x dtype"),
        ((jnp.zeros((2, 4), jnp.bfloat16), (jnp.zeros((5, 4), jnp.bfloat16),)), dict(block_n=8), "block_n=8"),
        ((jnp.zeros((2, 4)), (jnp.zeros((5, 4)),)), dict(block_k=24), "block_k=24"),
        ((jnp.zeros((2, 4)), (jnp.zeros((5, 4)),)), dict(num_warps=3), "num_warps"),
        ((jnp.zeros((2, 4)), (jnp.zeros((5, 4)),)), dict(out_dtype=jnp.int8), "out_dtype"),
    ],
)
def test_bad_inputs(args, kw, match):
    with pytest.raises(ValueError, match=match):
        linear(*args, interpret=True, **kw)


def test_empty_t_and_default_tuning():
    outs = linear(jnp.zeros((0, 8), jnp.bfloat16), (jnp.zeros((5, 8), jnp.bfloat16),))
    assert outs[0].shape == (0, 5)
    bt, bn, bk, warps, stages = default_tuning(1, (3072, 576), 2048, jnp.bfloat16, sms=132)
    assert (bt, bn, bk, warps, stages) == (16, 16, 256, 1, 4) and 3072 // bn + 576 // bn >= 132  # fill the SMs
    assert default_tuning(32, (3072, 576), 2048, jnp.bfloat16, sms=132)[3] == 2
    bt, bn, bk, _, _ = default_tuning(1, (64,), 2048, jnp.float32, sms=132)
    assert bt == 1 and 64 // bn >= 32 and bk == 1024  # the router: enough programs for the SMs


# ---- block-FP8 weights (W8A8, `scales`) ----


def _fp8_inputs(seed, t, ns, k, layers=None, index=0):
    """bf16 x [T, K] and block-FP8 weights (e4m3 [N_j, K] + f32 scales), each weight's rows at different scales so
    that a wrong scale block shows; with `layers`, stacked [layers, ...] with NaN weights and scales but at `index`."""
    from pallas_kernels.fp8_matmul import quantize_weight_blocks

    x, ws = _inputs(seed, t, ns, k, jnp.bfloat16, jnp.float32)
    qs, ss = [], []
    for w in ws:
        rows = jnp.exp2(jnp.arange(w.shape[0], dtype=jnp.float32) % 7 - 3)[:, None]  # 2^-3 .. 2^3 by row
        q, sc = quantize_weight_blocks(w * rows)
        if layers is not None:
            q, sc = _poisoned_stack(q, layers, index), _poisoned_stack(sc, layers, index)
        qs.append(q)
        ss.append(sc)
    return x, tuple(qs), tuple(ss)


@pytest.mark.parametrize(
    "t,ns,k,tuning",
    [
        (1, (200, 64), 300, {}),  # decode: ragged N and K (a partial last scale block), two weights
        (3, (40, 24), 72, dict(block_n=16)),  # K below one block
        (33, (96, 130), 256, dict(block_t=16, block_n=32, num_stages=2)),  # 3 row tiles, N past one scale row
        (5, (48,), 946, dict(block_k=512)),  # K steps of 4 blocks: one step, 3 single blocks, a partial block
    ],
)
def test_fp8_matches_the_w8a8_math(t, ns, k, tuning):
    """The fp8 path against `fp8_matmul_quantized_reference` (x quantized per row per 128 channels, per-block
    scaled float32 sums): float32 summation order apart, the same numbers; and against the model's portable fp8
    path (`fp8_matmul_xla`, the same quantization) within float32 rounding."""
    from pallas_kernels.fp8_matmul import fp8_matmul_xla

    x, ws, ss = _fp8_inputs(t * 7 + k, t, ns, k)
    outs = linear(x, ws, scales=ss, interpret=True, out_dtype=jnp.float32, **tuning)
    refs = linear_reference(x, ws, scales=ss)
    for out, ref, w, sc in zip(outs, refs, ws, ss):
        out, ref = np.asarray(out), np.asarray(ref)
        assert out.shape == ref.shape == (t, w.shape[0]) and np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        xla = np.asarray(fp8_matmul_xla(x, w, sc, out_dtype=jnp.float32))
        np.testing.assert_allclose(out, xla, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    bf = linear(x, ws, scales=ss, interpret=True, **tuning)  # default out: x's dtype
    assert all(o.dtype == jnp.bfloat16 for o in bf)


def test_fp8_stacked_traced_index_poisoned_layers():
    """fp8 weights and scales stacked over 3 layers, the others NaN: the traced index (clamped) reads only its own."""
    x, ws, ss = _fp8_inputs(5, 4, (96, 40), 200)
    want = linear(x, ws, scales=ss, interpret=True, out_dtype=jnp.float32)
    f = jax.jit(lambda w, s, i: linear(x, w, scales=s, rhs_index=i, interpret=True, out_dtype=jnp.float32))
    for index, arg in ((1, 1), (2, 7), (0, -1)):
        _, sw, sss = _fp8_inputs(5, 4, (96, 40), 200, layers=3, index=index)
        for a, b in zip(f(sw, sss, jnp.int32(arg)), want):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ref = linear_reference(x, sw, scales=sss, rhs_index=index)
        for a, b in zip(want, ref):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_fp8_bad_inputs():
    x, ws, ss = _fp8_inputs(1, 2, (64,), 128)
    cases = [
        (dict(weights=ws, scales=None), "dtype must be bfloat16"),  # e4m3 weights without their scales
        (dict(weights=ws, scales=(ss[0][:, :0],)), r"scales\[0\] must be float32 \(1, 1\)"),
        (dict(weights=ws, scales=(ss[0].astype(jnp.bfloat16),)), r"scales\[0\] must be float32"),
        (dict(weights=ws, scales=ss + ss), "one \\[\\(Lyr,\\) cdiv"),
        (dict(weights=(ws[0].astype(jnp.bfloat16),), scales=ss), r"weights\[0\] must be float8_e4m3fn"),
        (dict(weights=ws, scales=ss, block_k=64), "block_k=64"),
        (dict(weights=ws, scales=ss, block_n=256), "block_n=256"),
    ]
    for kw, match in cases:
        kw = {"x": x, **kw}
        with pytest.raises(ValueError, match=match):
            linear(kw.pop("x"), kw.pop("weights"), interpret=True, **kw)


def test_fp8_default_tuning():
    bt, bn, bk, warps, stages = default_tuning(1, (3072, 576), 2048, jnp.float8_e4m3fn, sms=132)
    assert (bt, bk, warps) == (16, 256, 4) and 3072 // bn + 576 // bn >= 132 and 1 <= stages <= 4
    assert default_tuning(32, (2048,), 1408, jnp.float8_e4m3fn, sms=132)[1:4] == (16, 256, 4)
    assert default_tuning(1, (64,), 100, jnp.float8_e4m3fn, sms=132)[2] == 128  # K under one step: one block


# ---- Triton lowering for an H200, on CPU (Pallas's lowering, not the Triton compiler) ----


def test_lowers_to_triton(h200):
    """DeepSeek-V2-Lite's decode shapes: one Triton kernel each, the grid (row tiles, N blocks of all weights), the
    stacked weights passed whole (no slice of them)."""
    sds = jax.ShapeDtypeStruct
    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    cases = [  # (fn, args, grid, the weights as the call takes them)
        (
            lambda x, a, b: linear(x, (a, b)),
            (sds((1, 2048), bf), sds((3072, 2048), bf), sds((576, 2048), bf)),
            (1, 228),
        ),
        (
            lambda x, a, b, i: linear(x, (a, b), rhs_index=i),
            (sds((32, 2048), bf), sds((26, 3072, 2048), bf), sds((26, 576, 2048), bf), sds((), i32)),
            (1, 228),
        ),
        (lambda x, a: linear(x, (a,)), (sds((8, 2048), bf), sds((2048, 2048), bf)), (1, 128)),
        (lambda x, a: linear(x, (a,), out_dtype=f32), (sds((1, 2048), bf), sds((64, 2048), f32)), (1, 64)),
        (lambda x, a, b: linear(x, (a, b)), (sds((5, 100), bf), sds((40, 100), bf), sds((7, 100), bf)), (1, 4)),
        (lambda x, a: linear(x, (a,)), (sds((37, 100), f32), sds((9, 100), f32)), None),
    ]
    f8 = jnp.float8_e4m3fn
    cases += [  # fp8 weights: V2-Lite's q_proj + kv_a_proj (stacked, traced layer) and a shared expert's down_proj
        (
            lambda x, a, b, sa, sb, i: linear(x, (a, b), scales=(sa, sb), rhs_index=i),
            (sds((1, 2048), bf), sds((26, 3072, 2048), f8), sds((26, 576, 2048), f8))
            + (sds((26, 24, 16), f32), sds((26, 5, 16), f32), sds((), i32)),
            (1, 228),
        ),
        (lambda x, a, sa: linear(x, (a,), scales=(sa,)), (sds((32, 2816), bf), sds((2048, 2816), f8)), None),
    ]
    cases[-1] = (cases[-1][0], cases[-1][1] + (sds((16, 22), f32),), None)
    for fn, args, grid in cases:
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        fp8 = args[1].dtype == f8  # then x's quantization kernel (`fp8_quant`) first
        assert text.count("__gpu$xla.gpu.triton") == 1 + fp8 and ("quantize_act_k" in text) == fp8
        if grid is not None:
            assert f"grid_x = {grid[0]} : i32, grid_y = {grid[1]} : i32, grid_z = 1 : i32" in text
        assert "slice" not in text and "concatenate" not in text
        for w in args[1:]:
            if w.ndim >= 2:
                assert f"tensor<{'x'.join(map(str, w.shape))}x" in text


# ---- the model's use: mla_project_q_kv, o_proj, route, the layer loop ----


LINEAR_KEYS = {path[1] for path in model.LAYER_LINEARS}


def _layer(cfg, seed, dtype=jnp.float32):
    """One MoE layer's params that the linears read (self_attn's projections and norms, W_UV for o_proj's dtype, the
    router), random: `model.init_params` compiles for seconds."""
    rng = np.random.default_rng(seed)
    N, D, Qk, L, R, V = (
        cfg.num_attention_heads,
        cfg.hidden_size,
        cfg.qk_head_dim,
        cfg.kv_lora_rank,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )

    def w(*shape, dt=dtype):
        return {"weight": jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-1]), dt)}

    attn = {"kv_a_proj_with_mqa": w(L + R, D), "kv_a_layernorm": w(L), "o_proj": w(D, N * V)}
    attn["W_UV"] = w(N, L, V)["weight"]
    if cfg.q_lora_rank is None:
        attn["q_proj"] = w(N * Qk, D)
    else:
        attn |= {"q_a_proj": w(cfg.q_lora_rank, D), "q_a_layernorm": w(cfg.q_lora_rank)}
        attn["q_b_proj"] = w(N * Qk, cfg.q_lora_rank)
    gate = w(cfg.n_routed_experts, D, dt=jnp.float32)
    gate["e_score_correction_bias"] = jnp.asarray(0.05 * rng.standard_normal(cfg.n_routed_experts), jnp.float32)
    return {"self_attn": attn, "mlp": {"gate": gate}}


def _spy(monkeypatch, calls):
    kernel = lin.linear

    def spy(x, weights, **kw):
        calls.append(tuple(w.shape for w in weights))
        return kernel(x, weights, interpret=True, **kw)

    monkeypatch.setattr(layers.linear_kernel, "linear", spy)


def test_fp8_linears_take_the_kernel_on_a_gpu(monkeypatch):
    """`layers.linears` of block-FP8 weights with the backend reported as a GPU (the kernel interpreted): q + kv as
    one call, a single weight (o_proj's case, one token too) as another, plain and `LayerRow`s, with the portable W8A8
    path's results (`layers.linear` on the CPU: `fp8_matmul_xla`); more than FP8_LINEAR_MAX_T tokens do not take it."""
    ws_x, ws, ss = _fp8_inputs(11, 5, (96, 40), 200)
    _, stw, sts = _fp8_inputs(11, 5, (96, 40), 200, layers=3, index=2)
    plain = [{"weight": w, "weight_scale_inv": sc} for w, sc in zip(ws, ss)]
    i = jnp.int32(2)  # one index object, as the layer loop's LayerRows share theirs
    rows = [{"weight": LayerRow(w, i), "weight_scale_inv": LayerRow(sc, i)} for w, sc in zip(stw, sts)]
    cases = [(plain, ws_x), (plain[:1], ws_x[:1]), (rows, ws_x), (rows[1:], ws_x[:1])]
    want = [[np.asarray(layers.linear(p, x).astype(jnp.float32)) for p in ps] for ps, x in cases]  # CPU path
    calls = []
    _spy(monkeypatch, calls)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for (ps, x), ref in zip(cases, want):
        n = len(calls)
        got = layers.linears(tuple(ps), x)
        assert len(calls) == n + 1 and calls[-1] == tuple(layers.in_place(p["weight"])[0].shape for p in ps)
        for g, r in zip(got, ref):
            assert g.dtype == jnp.bfloat16
            np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), r, rtol=1e-2, atol=1e-2 * np.abs(r).max())
    # K = 200 past FP8_LINEAR_MAX_K: the Mosaic GPU GEMM's where it takes the shape, else still this kernel
    monkeypatch.setattr(layers, "FP8_LINEAR_MAX_K", 128)
    monkeypatch.setattr(layers, "_fp8_kernel_ok", lambda n, k: True)
    assert not layers._linear_kernel_ok(tuple(plain), ws_x)
    monkeypatch.setattr(layers, "_fp8_kernel_ok", lambda n, k: False)
    assert layers._linear_kernel_ok(tuple(plain), ws_x)
    monkeypatch.setattr(layers, "FP8_LINEAR_MAX_T", 4)  # 5 tokens: the fp8 GEMM's path, not this kernel
    n = len(calls)
    layers.linears(tuple(plain), ws_x)  # (the GEMM's XLA form: no GPU here)
    assert len(calls) == n


def test_model_takes_the_kernel_on_a_gpu(monkeypatch):
    """With the backend reported as a GPU (the kernel interpreted): q_proj + kv_a_proj_with_mqa are one call (V2),
    q_a_proj + kv_a_proj_with_mqa then q_b_proj with q-LoRA (V3), o_proj and the router one each, for plain and
    LayerRow weights, with jnp's results; more than LINEAR_MAX_T tokens stay with XLA."""
    T = 5
    rng = np.random.default_rng(3)
    outs = {}
    for q_lora in (None, 24):
        cfg = tiny_config(q_lora_rank=q_lora, num_hidden_layers=2, first_k_dense_replace=1)
        p = _layer(cfg, 1)
        x = jnp.asarray(rng.standard_normal((T, cfg.hidden_size)), jnp.float32)
        attn = jnp.asarray(rng.standard_normal((T, cfg.num_attention_heads, cfg.v_head_dim)), jnp.float32)
        pos = jnp.arange(T, dtype=jnp.int32)
        outs[q_lora] = (
            mla.mla_project_q_kv(p["self_attn"], cfg, x, pos),
            mla.o_proj(p["self_attn"], attn),
            layers.route(p["mlp"]["gate"], cfg, x),
            (cfg, p, x, attn, pos),
        )
    calls = []
    _spy(monkeypatch, calls)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(layers.moe_router, "moe_topk", layers.moe_router.moe_topk_reference)  # the selection: jnp
    for q_lora, (proj, o, routed, (cfg, p, x, attn, pos)) in outs.items():
        stacked = jax.tree.map(lambda a: jnp.stack([jnp.full_like(a, jnp.nan), a]), p)  # row 1 = p, row 0 NaN
        # the linears' weights as LayerRows of row 1 (the rest as it is), one index as `model.with_layer_rows` gives
        one = jnp.int32(1)
        rows_attn = {
            k: {"weight": LayerRow(stacked["self_attn"][k]["weight"], one)} if k in LINEAR_KEYS else v
            for k, v in p["self_attn"].items()
        }
        rows_gate = p["mlp"]["gate"] | {"weight": LayerRow(stacked["mlp"]["gate"]["weight"], one)}
        variants = [(rows_attn, rows_gate)]  # (plain weights: V2 only, to keep the test short)
        for pa, gate in ([(p["self_attn"], p["mlp"]["gate"])] if q_lora is None else []) + variants:
            n = len(calls)
            got = mla.mla_project_q_kv(pa, cfg, x, pos)
            for a, b in zip(got[:4], proj[:4]):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(mla.o_proj(pa, attn)), np.asarray(o), rtol=1e-5, atol=1e-5)
            w, ids = layers.route(gate, cfg, x)
            np.testing.assert_array_equal(np.asarray(ids), np.asarray(routed[1]))
            np.testing.assert_allclose(np.asarray(w), np.asarray(routed[0]), rtol=1e-6, atol=1e-6)
            N, D, Qk = cfg.num_attention_heads, cfg.hidden_size, cfg.qk_head_dim
            L, R, E = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.n_routed_experts
            lead = () if pa is p["self_attn"] else (2,)
            want = (
                [((*lead, N * Qk, D), (*lead, L + R, D))]
                if q_lora is None
                else [
                    ((*lead, q_lora, D), (*lead, L + R, D)),
                    ((*lead, N * Qk, q_lora),),
                ]
            )
            want += [((*lead, D, N * cfg.v_head_dim),), ((*lead, E, D),)]
            assert calls[n:] == want
    monkeypatch.setattr(layers, "LINEAR_MAX_T", T - 1)  # T tokens: XLA, of the LayerRows' rows (`layer_row`)
    n = len(calls)
    for a, b in zip(mla.mla_project_q_kv(rows_attn, cfg, x, pos)[:4], proj[:4]):  # the q-LoRA case's
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(mla.o_proj(rows_attn, attn)), np.asarray(o), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(layers.route(rows_gate, cfg, x)[1]), np.asarray(routed[1]))
    assert len(calls) == n


def _layer_loop_for_cuda(cfg, params, T: int) -> str:
    """The decode layer loop (dense + MoE groups, a stand-in for the attention) of T tokens lowered for CUDA."""

    def attention(p, h, state, layer):
        q, kv, _, _, _ = mla.mla_project_q_kv(p, cfg, h, jnp.zeros((h.shape[0],), jnp.int32))
        attn = q[..., : cfg.v_head_dim] + kv[:, None, : cfg.v_head_dim]  # [T, N, V], a stand-in for the attention
        return mla.o_proj(p, attn), state

    f = jax.jit(lambda p, x: model.decoder_layers(p, cfg, x, attention, None, gmm_impl="pallas")[0])
    x = jax.ShapeDtypeStruct((T, cfg.hidden_size), jnp.bfloat16)
    return f.trace(params, x).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("T", [1, 2])
def test_layer_loop_lowers_with_one_kernel_for_q_and_kv(monkeypatch, h200, T):
    """A decode step's layer loop (dense + MoE groups) lowered for CUDA with the GPU dispatch: per scanned group one
    linear kernel for q_proj + kv_a_proj_with_mqa, one for the dense layer's gate_proj + up_proj, and for T > 1 one
    for o_proj and the dense down_proj (one token through one weight of <= XLA_GEMV_MAX_K inputs stays with XLA's
    GEMV, which slices the stacked weight itself); the MoE router's logits come out of the post-attention norm
    kernel (`layers.router_fusable`); the kernels take the whole stacked weights (read in place: no slice of them in
    the program)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = tiny_config(
        q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1, hidden_size=64, intermediate_size=80
    )
    params = jax.eval_shape(lambda k: model.init_params(cfg, k, dtype=jnp.bfloat16), jax.random.PRNGKey(0))

    text = _layer_loop_for_cuda(cfg, params, T)
    names = re.findall(r'name = "(linear\d_\w+?)_bt', text)
    singles = [] if T == 1 else ["linear1_dot"] * 3  # o_proj of both groups, the dense down_proj
    assert sorted(names) == sorted(["linear2_dot"] * 3 + singles), names
    assert len(re.findall(r'name = "add_rms_norm_d64_router_e8"', text)) == 1  # the MoE group's norm and router
    for group in ("dense_layers", "moe_layers"):
        g = params["model"][group]
        for name in ("q_proj", "kv_a_proj_with_mqa", "o_proj"):
            shape = "x".join(map(str, g["self_attn"][name]["weight"].shape))
            sliced = re.search(rf"dynamic_slice[^\n]*tensor<{shape}x[bf]", text) is not None
            assert sliced == (T == 1 and name == "o_proj"), (group, name)
            assert f"tensor<{shape}x" in text
    gate = "x".join(map(str, params["model"]["moe_layers"]["mlp"]["gate"]["weight"].shape))
    assert re.search(rf"dynamic_slice[^\n]*tensor<{gate}xf32", text) is None and f"tensor<{gate}xf32" in text


@pytest.mark.parametrize("T", [1, 2])
def test_fp8_layer_loop_lowers_with_the_kernel(monkeypatch, h200, T):
    """The same layer loop with block-FP8 weights (`quantize_params`): q + kv, o_proj, the dense MLP's and the shared
    expert's linears are the fp8 linear kernel (one token included), the stacked fp8 weights and scales read in
    place."""
    from mla_jax.checkpoint.fp8 import quantize_params

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = tiny_config(
        q_lora_rank=None, num_hidden_layers=3, first_k_dense_replace=1, hidden_size=64, intermediate_size=80
    )
    params = quantize_params(model.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16))[0]
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)

    text = _layer_loop_for_cuda(cfg, params, T)
    names = re.findall(r'name = "(linear\d_\w+?)_bt', text)
    # per group q + kv and o_proj; the dense layer's MLP and the MoE layer's shared expert: gate + up, then down
    assert sorted(names) == sorted(["linear2_fp8"] * 4 + ["linear1_fp8"] * 4), names
    for group in ("dense_layers", "moe_layers"):
        g = params["model"][group]["self_attn"]
        for name in ("q_proj", "kv_a_proj_with_mqa", "o_proj"):
            for leaf in ("weight", "weight_scale_inv"):
                shape = "x".join(map(str, g[name][leaf].shape))
                assert re.search(rf"dynamic_slice[^\n]*tensor<{shape}x", text) is None, (group, name, leaf)
                assert f"tensor<{shape}x" in text


# ---- GPU: the compiled Triton kernel ----


def _gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 32, 130])
@pytest.mark.parametrize(
    "ns,k,w_dtype",
    [
        ((3072, 576), 2048, jnp.bfloat16),
        ((2048,), 2048, jnp.bfloat16),
        ((64,), 2048, jnp.float32),
        ((40, 7), 100, jnp.bfloat16),
    ],
)
def test_gpu_matches_reference(t, ns, k, w_dtype):
    """V2-Lite's q_proj + kv_a_proj_with_mqa, o_proj and router (bf16 x, f32 weight and out) at decode and larger T,
    and ragged dims."""
    _gpu()
    x, ws = _inputs(t + len(ns), t, ns, k, jnp.bfloat16, w_dtype)
    out_dtype = jnp.float32 if w_dtype == jnp.float32 else None
    _close(linear(x, ws, out_dtype=out_dtype), linear_reference(x, ws), w_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tuning", [{}, SMALL, dict(block_t=32, block_n=64, block_k=64, num_warps=8, num_stages=2)])
def test_gpu_tuning_and_f32(tuning):
    _gpu()
    for w_dtype in (jnp.bfloat16, jnp.float32):
        x, ws = _inputs(3, 21, (40, 72), 200, w_dtype, w_dtype)
        _close(linear(x, ws, **tuning), linear_reference(x, ws), w_dtype)


@pytest.mark.gpu
def test_gpu_stacked_traced_index_poisoned_layers():
    """V2-Lite's q_proj + kv_a_proj_with_mqa stacked over 4 layers, the wanted layer between NaN ones; the index
    traced (and clamped)."""
    _gpu()
    x, ws = _inputs(9, 3, (3072, 576), 2048, jnp.bfloat16, jnp.bfloat16)
    want = [np.asarray(o.astype(jnp.float32)) for o in linear(x, ws)]
    f = jax.jit(lambda sts, i: linear(x, sts, rhs_index=i))
    for index, arg in ((1, 1), (2, 2), (3, 9)):
        sts = tuple(_poisoned_stack(w, 4, index) for w in ws)
        for a, b in zip(f(sts, jnp.int32(arg)), want):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), b)
    _close(want, linear_reference(x, ws), jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_router_exact_and_model_use(monkeypatch):
    """On the GPU: the router's logits agree with a float64 product to float32 rounding (no TF32), and the model's
    linears (q_proj + kv_a_proj_with_mqa in one call, o_proj, route) at decode sizes compile to the kernel and agree
    with the XLA path (LINEAR_MAX_T = 0)."""
    _gpu()
    x, (w,) = _inputs(5, 4, (64,), 2048, jnp.bfloat16, jnp.float32)
    (out,) = jax.jit(lambda x, w: linear(x, (w,), out_dtype=jnp.float32))(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=2e-6)
    cfg = tiny_config(q_lora_rank=None, num_hidden_layers=2, first_k_dense_replace=1, hidden_size=256)
    p = _layer(cfg, 2, jnp.bfloat16)
    xs = jnp.asarray(np.random.default_rng(0).standard_normal((3, cfg.hidden_size)), jnp.bfloat16)
    attn = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4, cfg.v_head_dim)), jnp.bfloat16)
    fns = {
        "linear2_dot": lambda p: layers.linears((p["self_attn"]["q_proj"], p["self_attn"]["kv_a_proj_with_mqa"]), xs),
        "linear1_dot": lambda p: mla.o_proj(p["self_attn"], attn),
        "linear1_f32": lambda p: layers.route(p["mlp"]["gate"], cfg, xs),
    }
    got = {}
    for name, fn in fns.items():
        assert name in jax.jit(fn).lower(p).as_text()
        got[name] = jax.jit(fn)(p)
    monkeypatch.setattr(layers, "LINEAR_MAX_T", 0)
    jax.clear_caches()  # (the traces above were cached with the kernel)
    for name, fn in fns.items():
        want = jax.jit(fn)(p)
        assert name not in jax.jit(fn).lower(p).as_text()
        if name == "linear1_f32":
            np.testing.assert_array_equal(np.asarray(got[name][1]), np.asarray(want[1]))
            np.testing.assert_allclose(np.asarray(got[name][0]), np.asarray(want[0]), rtol=1e-5, atol=1e-6)
        else:
            _close(
                jax.tree.leaves(got[name]),
                [np.asarray(o.astype(jnp.float32)) for o in jax.tree.leaves(want)],
                jnp.bfloat16,
            )


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 32, 64])
@pytest.mark.parametrize("ns,k", [((3072, 576), 2048), ((2048,), 2048), ((2816, 2816), 2048), ((2048,), 1408)])
def test_gpu_fp8_matches_the_w8a8_math(t, ns, k):
    """Block-FP8 weights at V2-Lite's decode shapes (q + kv, o_proj, a shared expert's gate + up and down) against
    `fp8_matmul_quantized_reference`, and with the layer stacked between NaN ones, the index traced."""
    _gpu()
    x, ws, ss = _fp8_inputs(t + k, t, ns, k)
    got = linear(x, ws, scales=ss, out_dtype=jnp.float32)
    for out, ref in zip(got, linear_reference(x, ws, scales=ss)):
        ref = np.asarray(ref)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    _, sw, sss = _fp8_inputs(t + k, t, ns, k, layers=3, index=1)
    f = jax.jit(lambda w, s, i: linear(x, w, scales=s, rhs_index=i, out_dtype=jnp.float32))
    for a, b in zip(f(sw, sss, jnp.int32(1)), got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
