"""pallas_kernels.fp8_matmul (block-scaled fp8 GEMMs, Mosaic GPU) against its float32 references.

CPU: the kernel runs under the Mosaic GPU interpreter (race detector on) and is lowered for sm_90
(layout inference, wgmma/TMA checks). GPU (-m gpu): the compiled kernel at model shapes.

Inputs: the kernel tests use `testing.fp8_lossless_operands`: e4m3 values with a +-448 planted in every
(row, K block) of x, times power-of-two scales that differ between neighbouring K blocks, rows, N blocks and
experts (up to 2^6 apart). quantize_act is then lossless (its scales are exactly the planted ones: asserted), so
the reference is the float64 product of the dequantized inputs, with no quantization error to hide a bug in,
and a scale taken from a neighbouring K block, row or N block is off by >= 2x on a block.
Poison: activation rows past sum(group_sizes) are NaN, and so are the weights and scales of the
stacked layers not picked and of the experts no row is routed to (a read of any of them gives NaN).
Tolerances: float32 out agrees to float32 rounding (1e-5 relative to the output scale), bf16 out to bf16
rounding (one half ulp: 2^-8 relative); against the unquantized-activation reference the e4m3 activation error
(3 mantissa bits: |err| <= 2^-4 |x| per element, averaging down over K) bounds it at 4% of the output scale.
On the GPU (`testing.FP8_GEMM_GPU_TOL`) the fp8 wgmma's own accumulation is coarser than float32.

The XLA paths convert e4m3 to float32 behind an optimization barrier (`test_fp8_converts_behind_barrier`):
without it XLA's GPU compiler folded the jitted quantize -> dequantize, which the CPU compiler does not, so
only `test_gpu_xla_path_rounds_activations` can show that on a GPU.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.checkpoint.fp8 import dequantize_fp8_blocks
from pallas_kernels import fp8_matmul as F
from pallas_kernels.testing import FP8_GEMM_GPU_TOL, fp8_lossless_operands
from tests.pallas_kernels.mosaic_interpreter import run_interpreted

FP8_NAN = np.uint8(0x7F)


def _weights(rng, shape):
    w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(shape[-1])
    wq, ws = F.quantize_weight_blocks(jnp.asarray(w))
    return np.array(wq), np.array(ws)


def _poison_fp8(a, index):
    a = a.copy()
    a.view(np.uint8)[index] = FP8_NAN
    return a


def _close(out, ref, rel):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "NaN/inf leaked into the output"
    scale = max(float(np.abs(ref).max()), 1e-6)
    err = float(np.abs(out - ref).max())
    assert err <= rel * scale, f"max |out - ref| = {err:.3g} > {rel} x {scale:.3g}"


# ---- quantizers (plain JAX) ----


def test_weight_quantization_matches_checkpoint_format():
    """quantize -> dequantize within e4m3's rounding of each block's amax, scale shapes with ragged edge
    blocks, and the jnp dequantizer agrees with the checkpoint's numpy one exactly."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 200, 300)).astype(np.float32)
    wq, ws = F.quantize_weight_blocks(jnp.asarray(w))
    assert wq.dtype == jnp.float8_e4m3fn and ws.shape == (2, 2, 3) and ws.dtype == jnp.float32
    wd = np.asarray(F.dequantize_weight_blocks(wq, ws))
    np.testing.assert_array_equal(wd, dequantize_fp8_blocks(np.asarray(wq), np.asarray(ws)))
    amax = np.abs(w).max()
    assert np.abs(wd - w).max() <= amax * 2.0**-4
    assert np.abs(wd).max() <= amax * (1 + 2.0**-4)


def test_act_quantization_per_token_block():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 200)).astype(np.float32) * np.array([1, 100, 1e-3, 0, 7])[:, None]
    q, s = F.quantize_act(jnp.asarray(x))
    assert q.shape == (5, 200) and s.shape == (5, 2)
    xd = np.asarray(q, np.float32) * np.repeat(np.asarray(s), 128, axis=1)[:, :200]
    blocks = np.abs(np.pad(x, ((0, 0), (0, 56)))).reshape(5, 2, 128).max(-1)
    np.testing.assert_allclose(np.asarray(s), np.maximum(blocks, 1e-4) / 448.0, rtol=1e-6)
    assert np.all(np.abs(xd - x) <= np.repeat(blocks, 128, axis=1)[:, :200] * 2.0**-4)
    assert np.all(xd[3] == 0)  # an all-zero row stays 0 (no 0/0)


def test_xla_paths_match_references():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((9, 200)), jnp.float32)
    wq, ws = _weights(rng, (130, 200))  # ragged blocks: the portable path takes any shape
    quantized = F.fp8_matmul_quantized_reference(x, wq, ws)
    _close(jax.jit(F.fp8_matmul_xla)(x, wq, ws), quantized, 1e-5)
    _close(quantized, F.fp8_matmul_reference(x, wq, ws), 0.04)
    # lossless inputs: both are the float64 product of the dequantized operands
    x, _, wq, ws, wd = fp8_lossless_operands(rng, 3, 192, 384)
    _close(F.fp8_matmul_quantized_reference(jnp.asarray(x), wq, ws), x.astype(np.float64) @ wd.T, 1e-6)
    _close(jax.jit(F.fp8_matmul_xla)(jnp.asarray(x), wq, ws), x.astype(np.float64) @ wd.T, 1e-6)


# ---- the kernel (interpreter) ----


@pytest.mark.parametrize(
    "m, n, k, out_dtype, k_splits, stages",
    [(1, 128, 512, jnp.bfloat16, 2, None), (130, 192, 384, jnp.float32, None, None), (64, 128, 384, jnp.float32, 1, 1)],
)
def test_dense_interpret(m, n, k, out_dtype, k_splits, stages):
    """bm 64 / 128 (two row tiles, the second partial), bn 128 / 64 (N tiles sharing a scale block), K split
    in two (float32 partials: each split must start at its own K block), a 2-deep ring that wraps (3 K
    blocks) and a 1-deep one; every K block, row and N block with its own scale."""
    rng = np.random.default_rng(m + n + k)
    x, xs, wq, ws, wd = fp8_lossless_operands(rng, m, n, k)
    xb = jnp.asarray(x, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(F.quantize_act(xb)[1]), xs)  # lossless: the planted scales
    out = run_interpreted(
        F.fp8_matmul, xb, jnp.asarray(wq), jnp.asarray(ws), out_dtype=out_dtype, k_splits=k_splits, stages=stages
    )
    assert out.shape == (m, n) and out.dtype == out_dtype
    _close(out, x.astype(np.float64) @ wd.T, 1e-5 if out_dtype == jnp.float32 else 2.0**-8)


def test_dense_interpret_stacked_in_place():
    """A dense linear's weights stacked over layers [Lyr, N, K] (what the model's layer scan hands the kernel), read
    in place at a traced layer: the other layers' weights and scales are NaN; the XLA path agrees."""
    rng = np.random.default_rng(5)
    m, n, k = 3, 192, 256
    x, _, wq, ws, wd = fp8_lossless_operands(rng, m, n, k, lead=(3,))
    wq = _poison_fp8(_poison_fp8(wq, (0,)), (2,))
    ws[0], ws[2] = np.nan, np.nan
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(ws))
    out = run_interpreted(F.fp8_matmul, *args, rhs_index=jnp.int32(1), out_dtype=jnp.float32)
    ref = x.astype(np.float64) @ wd[1].T
    _close(out, ref, 1e-5)
    _close(F.fp8_matmul_xla(*args, rhs_index=jnp.int32(1), out_dtype=jnp.float32), ref, 1e-5)
    with pytest.raises(ValueError, match="a stacked w needs rhs_index"):
        F.fp8_matmul(*args)
    with pytest.raises(ValueError, match=r"\[Lyr, N, K\] with rhs_index"):
        F.fp8_matmul(args[0], args[1][0], args[2][0], rhs_index=0)


def test_grouped_interpret_stacked_in_place():
    """Stacked [Lyr, G, N, K] experts read in place at a traced layer: the other layer and the experts
    no row reaches are NaN (weights and scales), rows past sum(group_sizes) NaN and come out exactly 0;
    groups straddle the 64-row tiles and one is empty; each expert's blocks have their own scales."""
    rng = np.random.default_rng(3)
    sizes = np.array([5, 0, 70, 3], np.int32)
    m, n, k, total = 90, 128, 256, int(sizes.sum())
    x, _, wq, ws, wd = fp8_lossless_operands(rng, m, n, k, lead=(2, 4))
    x[total:] = np.nan
    wq = _poison_fp8(_poison_fp8(wq, (0,)), (1, 1))
    ws[0], ws[1, 1] = np.nan, np.nan
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(ws), jnp.asarray(sizes))
    out = run_interpreted(F.fp8_grouped_matmul, *args, rhs_index=jnp.int32(1), out_dtype=jnp.float32)
    out = np.asarray(out)
    assert np.all(out[total:] == 0)
    group = np.repeat(np.arange(4), sizes)
    ref = np.einsum("mk,mnk->mn", x[:total].astype(np.float64), wd[1, group])
    _close(out[:total], ref, 1e-5)


def test_grouped_interpret_row_groups():
    """Unsorted rows, each with its own expert (row_groups, a decode token's top-k copies): a stacked layer in
    place (the other layer NaN), rows of an expert outside [0, G) NaN and exactly 0, one expert hit twice."""
    rng = np.random.default_rng(5)
    groups = np.array([2, 0, 4, 2, -1, 3], np.int32)
    m, n, k = len(groups), 128, 256
    x, _, wq, ws, wd = fp8_lossless_operands(rng, m, n, k, lead=(2, 4))
    bad = (groups < 0) | (groups >= 4)
    x[bad] = np.nan
    wq = _poison_fp8(wq, (0,))
    ws[0] = np.nan
    args = (jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(ws))
    out = run_interpreted(
        F.fp8_grouped_matmul, *args, row_groups=jnp.asarray(groups), rhs_index=jnp.int32(1), out_dtype=jnp.float32
    )
    out = np.asarray(out)
    assert np.all(out[bad] == 0)
    ref = np.einsum("mk,mnk->mn", x[~bad].astype(np.float64), wd[1, groups[~bad]])
    _close(out[~bad], ref, 1e-5)
    want = F.fp8_grouped_matmul_reference(*args, row_groups=jnp.asarray(groups), rhs_index=1)
    _close(out[~bad], np.asarray(want)[~bad], 1e-5)
    assert np.all(np.asarray(want)[bad] == 0)


def _converts_from_fp8(jaxpr, produced_by=None):
    """(producer primitive name or None for an input, ...) of each e4m3 -> float convert in `jaxpr` (nested)."""
    produced_by = {} if produced_by is None else produced_by
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.float8_e4m3fn:
            found.append(produced_by.get(eqn.invars[0]))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _converts_from_fp8(sub)
        for v in eqn.outvars:
            produced_by[v] = eqn.primitive.name
    return found


def test_fp8_converts_behind_barrier():
    """Each e4m3 -> float convert of the XLA paths and references reads an optimization barrier's output (or a
    function input): XLA (GPU) cannot fold it with the quantizing convert before it."""
    x = jnp.zeros((4, 256), jnp.bfloat16)
    wq, ws = F.quantize_weight_blocks(jnp.ones((2, 128, 256)))
    gs = jnp.array([3, 1], jnp.int32)
    for fn, args in [
        (F.fp8_matmul_xla, (x, wq[0], ws[0])),
        (F.fp8_matmul_quantized_reference, (x, wq[0], ws[0])),
        (F.fp8_grouped_matmul_xla, (x, wq, ws, gs)),
        (lambda x, w, s: F.dequantize_weight_blocks(*F.quantize_weight_blocks(w.astype(jnp.float32))), (x, wq, ws)),
    ]:
        producers = _converts_from_fp8(jax.make_jaxpr(fn)(*args).jaxpr)
        assert producers and all(p in ("optimization_barrier", None) for p in producers), producers


# ---- the sm_90 lowering (CPU) ----


@pytest.mark.parametrize(
    "m, n, k, stages", [(1, 576, 7168, None), (4096, 7168, 2048, None), (100, 2048, 512, 4), (1, 1536, 7168, None)]
)
def test_dense_lowers_for_sm90(h200, m, n, k, stages):  # (h200: the activations' Triton quantization)
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((F.cdiv(n, 128), k // 128), jnp.float32)
    f = jax.jit(lambda x, w, s: F.fp8_matmul(x, w, s, stages=stages))
    assert "mosaic_gpu" in f.trace(x, w, s).lower(lowering_platforms=("cuda",)).as_text()


def test_dense_stacked_lowers_for_sm90(h200):
    x = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((26, 3072, 2048), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((26, 24, 16), jnp.float32)
    f = jax.jit(lambda x, w, s, i: F.fp8_matmul(x, w, s, rhs_index=i))
    lowered = f.trace(x, w, s, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "mosaic_gpu" in text and "dynamic_slice" not in text  # the whole stack goes in: no slice of it


def test_grouped_lowers_for_sm90(h200):
    x = jax.ShapeDtypeStruct((2048, 7168), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3, 256, 4096, 7168), jnp.float8_e4m3fn)
    s = jax.ShapeDtypeStruct((3, 256, 32, 56), jnp.float32)
    gs = jax.ShapeDtypeStruct((256,), jnp.int32)
    f = jax.jit(lambda x, w, s, gs, i: F.fp8_grouped_matmul(x, w, s, gs, rhs_index=i))
    lowered = f.trace(x, w, s, gs, jax.ShapeDtypeStruct((), jnp.int32)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


@pytest.mark.parametrize(
    "shape_w, shape_s, dtype, match",
    [
        ((128, 256), (1, 2), jnp.bfloat16, "float8_e4m3fn"),
        ((128, 256), (1, 1), jnp.float8_e4m3fn, "scale_inv"),
        ((128, 200), (1, 2), jnp.float8_e4m3fn, "multiple of 128"),
        ((96, 256), (1, 2), jnp.float8_e4m3fn, "multiple of 64"),
    ],
)
def test_bad_inputs_raise(shape_w, shape_s, dtype, match):
    x = jnp.zeros((4, shape_w[1]), jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        F.fp8_matmul(x, jnp.zeros(shape_w, dtype), jnp.ones(shape_s, jnp.float32))


def test_default_k_splits():
    assert F.default_k_splits(1, 1536, 7168, sms=132) == 8  # 12 N tiles: split K
    assert F.default_k_splits(4096, 7168, 7168, sms=132) == 1  # many row tiles: no split
    assert F.default_k_splits(8, 2048, 7168, g=32, sms=132) == 2
    with pytest.raises(ValueError, match="k_splits"):
        F.fp8_matmul(jnp.zeros((4, 384), jnp.bfloat16), *F.quantize_weight_blocks(jnp.ones((128, 384))), k_splits=2)


def test_unsupported_reason():
    assert F.unsupported_reason(576, 7168) is None
    assert "K=10944" in F.unsupported_reason(2048, 10944)


# ---- GPU ----

V3_DENSE = [
    (1, 24576, 1536),
    (1, 1536, 7168),
    (64, 576, 7168),
    (2048, 7168, 16384),
    (4096, 18432, 7168),
    (300, 7168, 18432),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", V3_DENSE)
def test_gpu_dense(m, n, k):
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wq, ws = F.quantize_weight_blocks(jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.bfloat16))
    out = F.fp8_matmul(x, wq, ws, out_dtype=jnp.float32)
    with jax.default_matmul_precision("highest"):  # the kernel's numerics in XLA, float32 (not TF32)
        ref = F.fp8_matmul_xla(x, wq, ws, out_dtype=jnp.float32)
    _close(out, ref, FP8_GEMM_GPU_TOL)
    _close(
        F.fp8_matmul(x, wq, ws), ref, FP8_GEMM_GPU_TOL + 2.0**-8
    )  # bf16 out (the model's), default K splits and stages


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m, n, k, k_splits, stages",
    [(1, 1536, 7168, None, None), (64, 576, 7168, 1, 1), (300, 7168, 2048, 1, 2), (256, 2048, 7168, 4, 3)],
)
def test_gpu_dense_exact_scales(m, n, k, k_splits, stages):
    """Lossless operands (`fp8_lossless_operands`): each K block, row, N block with its own power-of-two scale."""
    x, _, wq, ws, wd = fp8_lossless_operands(np.random.default_rng(m + k), m, n, k)
    out = F.fp8_matmul(
        jnp.asarray(x, jnp.bfloat16),
        jnp.asarray(wq),
        jnp.asarray(ws),
        out_dtype=jnp.float32,
        k_splits=k_splits,
        stages=stages,
    )
    _close(out, x.astype(np.float64) @ wd.T, FP8_GEMM_GPU_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 3072, 2048), (128, 2816, 2048)])
def test_gpu_dense_stacked_in_place(m, n, k):
    """Layer 1 of weights stacked over 3 layers, read in place at a traced index, equals the kernel on that layer's
    own weights (the other layers NaN)."""
    x, _, wq, ws, _ = fp8_lossless_operands(np.random.default_rng(m + n), m, n, k, lead=(3,))
    own = F.fp8_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq[1]), jnp.asarray(ws[1]), out_dtype=jnp.float32)
    wq = _poison_fp8(_poison_fp8(wq, (0,)), (2,))
    ws[0], ws[2] = np.nan, np.nan
    f = jax.jit(lambda x, w, s, i: F.fp8_matmul(x, w, s, rhs_index=i, out_dtype=jnp.float32))
    out = f(jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(ws), jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(own))


@pytest.mark.gpu
def test_gpu_xla_path_rounds_activations():
    """The jitted XLA path on the GPU computes with e4m3-rounded activations (without `_f32`'s barrier XLA
    folded them away): it equals the float64 product of the materialized quantized operands, and that is
    > 1e-2 of max|ref| away from the unquantized-activation product on random data."""
    rng = np.random.default_rng(7)
    m, n, k = 64, 1536, 7168
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    wq, ws = F.quantize_weight_blocks(jnp.asarray(rng.standard_normal((n, k)) / np.sqrt(k), jnp.float32))
    with jax.default_matmul_precision("highest"):
        out = jax.jit(lambda x, w, s: F.fp8_matmul_xla(x, w, s, out_dtype=jnp.float32))(x, wq, ws)
    xq, xs = F.quantize_act(x)
    wd = dequantize_fp8_blocks(np.asarray(wq), np.asarray(ws)).astype(np.float64)
    xd = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64), 128, axis=1)
    ref = xd @ wd.T
    _close(out, ref, 1e-5)
    unquantized = np.asarray(x, np.float64) @ wd.T
    assert np.abs(ref - unquantized).max() > 1e-2 * np.abs(ref).max()


@pytest.mark.gpu
@pytest.mark.parametrize("m, g, n, k", [(8 * 16, 32, 4096, 7168), (4096, 32, 7168, 2048), (2000, 64, 2816, 2048)])
def test_gpu_grouped(m, g, n, k):
    rng = np.random.default_rng(g + m)
    sizes = rng.multinomial(m - 7, np.ones(g) / g).astype(np.int32)  # 7 padding rows
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[m - 7 :] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(m), (2, g, n, k), jnp.bfloat16) * jnp.bfloat16(k**-0.5)  # on device
    wq, ws = jax.jit(F.quantize_weight_blocks)(w)
    del w
    out = np.asarray(F.fp8_grouped_matmul(x, wq, ws, jnp.asarray(sizes), rhs_index=1, out_dtype=jnp.float32))
    assert np.all(out[m - 7 :] == 0)
    with jax.default_matmul_precision("highest"):  # the kernel's numerics in XLA, float32 (not TF32)
        ref = F.fp8_grouped_matmul_xla(x, wq, ws, jnp.asarray(sizes), rhs_index=1, out_dtype=jnp.float32)
    _close(out[: m - 7], np.asarray(ref)[: m - 7], FP8_GEMM_GPU_TOL)


@pytest.mark.gpu
def test_gpu_grouped_row_groups():
    """Unsorted rows with their own experts (a decode token's top-8 copies at V3's expert shape), one expert
    hit twice and one row of another device's expert (NaN, exactly 0), against the sorted call's rows."""
    rng = np.random.default_rng(21)
    g, n, k = 32, 2048, 7168
    groups = rng.permutation(g)[:8].astype(np.int32)
    groups[5], groups[6] = groups[2], g  # a repeat, and an out-of-range copy
    x = rng.standard_normal((8, k)).astype(np.float32)
    x[6] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (2, g, n, k), jnp.bfloat16) * jnp.bfloat16(k**-0.5)
    wq, ws = jax.jit(F.quantize_weight_blocks)(w)
    del w
    out = np.asarray(
        F.fp8_grouped_matmul(x, wq, ws, row_groups=jnp.asarray(groups), rhs_index=1, out_dtype=jnp.float32)
    )
    assert np.all(out[6] == 0)
    keep = groups < g
    order = np.argsort(np.where(keep, groups, g), kind="stable")
    sizes = jnp.asarray(np.bincount(groups[keep], minlength=g).astype(np.int32))
    want = np.asarray(F.fp8_grouped_matmul(x[order], wq, ws, sizes, rhs_index=1, out_dtype=jnp.float32))
    np.testing.assert_array_equal(out[order][keep[order]], want[keep[order]])
