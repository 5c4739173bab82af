"""pallas_kernels.mgpu's fp8 P.V operands (O^T = V^T P^T with V^T in registers) in a one-warpgroup kernel.

The kernel takes a [G, 256] e4m3 page chunk V and p [64, G], builds V^T from the page (`vt_fp8_operand`), stores p
as e4m3 P^T in the operands' token order (`pt_fp8_operand`), runs one fp8 wgmma, and writes O = P V back in natural
order (`ot_rows`). CPU: under the interpreter (the permutations as reshapes) and lowered for sm_90 (the register
regrouping, `ldmatrix.trans`, `prmt`); GPU (-m gpu): compiled, where the instructions' layouts are checked.
Inputs: random e4m3 over the whole range (both signs, subnormals included), so a byte from the wrong token or
latent changes the result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import mgpu
from pallas_kernels.util import BF16, FP8, is_sm90
from tests.pallas_kernels.mosaic_interpreter import run_interpreted

G, LAT = 64, 256  # page size, latents of V (two V^T chunks)


@functools.partial(jax.jit, static_argnames="interpret")
def _pv(v, p, *, interpret=False):
    def body(v_gmem, p_gmem, o_gmem):
        def scoped(page, p_smem, pt, stage, bars):
            v8, v16 = page
            plgpu.copy_gmem_to_smem(v_gmem, v8, bars.at[0])
            plgpu.copy_gmem_to_smem(p_gmem, p_smem, bars.at[1])
            plgpu.barrier_wait(bars.at[0])
            plgpu.barrier_wait(bars.at[1])
            p8 = plgpu.load(p_smem, (), layout=plgpu.Layout.WGMMA).astype(FP8)
            pt[...] = mgpu.pt_fp8_operand(p8, interpret=interpret)
            plgpu.commit_smem()
            vt = mgpu.vt_fp8_operand(v8, v16, interpret=interpret)  # [LAT, G]
            acc = plgpu.layout_cast(jnp.zeros((LAT, 64), jnp.float32), plgpu.Layout.WGMMA)
            if interpret:
                acc = acc + jnp.dot(vt.astype(jnp.float32), pt[...].astype(jnp.float32).T)
            else:
                acc = mgpu.wgmma_accumulate(acc, vt, pt.transpose((1, 0)), interpret=False)
            stage[...] = mgpu.ot_rows(acc, interpret=interpret)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(stage, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        page = plgpu.RefUnion(
            plgpu.SMEM((G, LAT), FP8, transforms=mgpu.tiled(FP8, 64)),
            plgpu.SMEM((G, LAT // 2), BF16, transforms=mgpu.tiled(BF16, 64)),
        )
        pl.run_scoped(
            scoped,
            page,
            plgpu.SMEM((64, G), jnp.float32),
            plgpu.SMEM((64, G), FP8, transforms=mgpu.tiled(FP8, 64)),
            plgpu.SMEM((64, LAT), jnp.float32),
            plgpu.Barrier(num_barriers=2),
        )

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((64, LAT), jnp.float32),
        interpret=mgpu.interpret_params(interpret),
        kernel_name="fp8_pv_operands",
    )
    return kernel(v, p)


def _inputs(seed):
    kv, kp = jax.random.split(jax.random.key(seed))
    v = jax.random.normal(kv, (G, LAT), jnp.float32) * jnp.exp2(jax.random.randint(kv, (G, LAT), -12, 8))
    v = jnp.clip(v, -448.0, 448.0).astype(FP8)
    p = jax.random.uniform(kp, (64, G), jnp.float32)
    return v, p


def _check(out, v, p, *, gpu=False):
    """O = P V: exact under the interpreter; on the GPU within 2^-8 of sum |p| |v| (Hopper's fp8 wgmma adds at about
    14 bits, DeepSeek-V3's report, section 3.3.2: measured 0.26 at a sum of ~1e3, session 37), far below what a
    token or latent out of place gives (an error of the order of |O| itself, in almost every element)."""
    p8, v32 = np.asarray(p.astype(FP8).astype(jnp.float32)), np.asarray(v.astype(jnp.float32))
    ref = p8 @ v32
    if gpu:
        bound = 2.0**-8 * (np.abs(p8) @ np.abs(v32))
        excess = np.abs(np.asarray(out) - ref) - bound
        assert (excess <= 0).all(), f"{(excess > 0).sum()} elements over the bound, worst by {excess.max()}"
    else:
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_orders_are_permutations():
    """The token order is a permutation of each 16-token group, the latent order of each 128-latent chunk."""
    t = mgpu._tokens_pv_order(jnp.arange(64))
    assert sorted(np.asarray(t).tolist()) == list(range(64)) and (np.asarray(t) // 16 == np.arange(64) // 16).all()
    rows = np.asarray(mgpu._vt_chunk_rows(jnp.arange(256)[:, None]))[:, 0]
    assert sorted(rows.tolist()) == list(range(256)) and (rows // 128 == np.arange(256) // 128).all()
    assert rows[:4].tolist() == [0, 2, 4, 6] and rows[64:66].tolist() == [1, 3]


def test_interpreted():
    v, p = _inputs(0)
    _check(run_interpreted(_pv, v, p), v, p)


def test_lowers_for_sm90():
    """The GPU path (transposed 16-bit load, `prmt`, registers regrouped into the 8-bit and the O layouts, the
    register-operand fp8 wgmma) passes Mosaic GPU's lowering."""
    v, p = _inputs(1)
    text = _pv.trace(v, p).lower(lowering_platforms=("cuda",)).as_text()
    assert "fp8_pv_operands" in text


@pytest.mark.gpu
def test_gpu():
    if jax.default_backend() != "gpu" or not is_sm90():
        pytest.skip("needs an sm_90 GPU")
    for seed in range(3):
        v, p = _inputs(seed)
        _check(_pv(v, p), v, p, gpu=True)
