"""pallas_kernels.sparse_mla_decode_sm90 (Hopper, Mosaic GPU) against the float32 sparse-decode reference.

CPU: the kernel runs under the Mosaic GPU interpreter (copies, mbarriers, wgmma and the three warpgroups
simulated; its race detector on), and it is lowered for sm_90 (Mosaic GPU's passes: layout inference, wgmma
and copy shapes, the shared-memory budget). GPU (-m gpu): the real kernel at the V3.2 shapes.

Inputs (`testing.sparse_decode_inputs`): fresh random numbers, every cache row and fp8 scale that no table names
NaN, q rows with an empty table NaN; tables with -1 holes anywhere, rows shorter than K, all -1 padding rows,
multi-token rows; the interpreter fills fresh shared memory with NaN too. Tolerances: `testing.DECODE_TOL`.
The interpreter's 3 warpgroups need >= 3 XLA CPU workers: see mosaic_interpreter.py.
"""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_decode
from pallas_kernels import sparse_mla_decode_sm90 as k90
from pallas_kernels.sparse_mla_decode import sparse_mla_decode_reference
from pallas_kernels.testing import DECODE_SCALE as SCALE
from pallas_kernels.testing import (
    SPARSE_DECODE_GPU_CASES,
    assert_decode_close,
    decode_gpu_tolerance,
    sparse_decode_inputs,
)
from tests.pallas_kernels.mosaic_interpreter import NPROC_IN_TIME, run_interpreted

# (name, sparse_decode_inputs keywords, kernel keywords, DECODE_TOL kind): interpreted, L = 128 but for two
# cases at the real 512 / 64 widths
CASES = [
    (
        "n16_bf16_ragged_empty_row_2splits",
        dict(b=3, nq=1, n=16, k=100, lens=[150, 0, 30], l=128, r=64, g=16),
        dict(num_kv_splits=2),
        "bf16",
    ),
    (
        "fp8_q2_causal_n16_3splits",
        dict(b=2, nq=2, n=16, k=130, lens=[200, 5], l=128, r=64, g=32, cache_dtype="fp8", causal=True),
        dict(num_kv_splits=3),
        "fp8",
    ),
    ("n80_two_head_tiles_q2", dict(b=1, nq=2, n=80, k=64, lens=[70], l=128, r=64, g=16), {}, "bf16"),
    ("l512_n128_fp8", dict(b=1, nq=1, n=128, k=64, lens=[90], l=512, r=64, g=64, cache_dtype="fp8"), {}, "fp8"),
    ("l512_n16_bf16_default_splits", dict(b=2, nq=1, n=16, k=128, lens=[300, 64], l=512, r=64, g=64), {}, "bf16"),
]

# On the GPU: the portable kernel's cases (N 128/16/64, K 2048, bf16/fp8, Q 1/2) and N 16/128 at Q = 2.
GPU_CASES = SPARSE_DECODE_GPU_CASES + [
    (
        "q2_causal_n16_k2048_fp8",
        dict(b=3, nq=2, n=16, k=2048, lens=[6000, 2049, 40], causal=True, cache_dtype="fp8"),
        {},
        "fp8",
    ),
    ("q2_causal_n128_k2048_bf16", dict(b=2, nq=2, n=128, k=2048, lens=[2100, 4096], causal=True), {}, "bf16"),
    ("n16_k2048_bf16_empty_row", dict(b=3, nq=1, n=16, k=2048, lens=[10000, 0, 2047]), {}, "bf16"),
]


def _run(fn, q, cache, table, ks, l, **kw):
    return fn(q, cache, table, scale=SCALE, kv_scale=ks, kv_lora_rank=l, **kw)


def _reference(q, cache, table, ks, l):
    """The float32 reference, jitted: one compile a call instead of one per eager op (~1 s on 2 cores)."""
    return jax.jit(lambda *a: _run(sparse_mla_decode_reference, *a, l))(q, cache, table, ks)


def _interpreted(q, cache, table, ks, l, **kw):
    return run_interpreted(k90.sparse_mla_decode_sm90, q, cache, table, scale=SCALE, kv_scale=ks, kv_lora_rank=l, **kw)


@pytest.mark.parametrize("name,inputs,kernel,kind", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(name, inputs, kernel, kind):
    q, cache, table, ks, _, _ = sparse_decode_inputs(zlib.crc32(name.encode()), **inputs)
    l = inputs["l"]
    out, lse = _interpreted(q, cache, table, ks, l, **kernel)
    ref, ref_lse = _reference(q, cache, table, ks, l)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_decode_close(out, lse, ref, ref_lse, kind)


def test_empty_interior_tile_and_out_of_range_slot_under_jit():
    """A 64-entry tile with no named slot between named ones (its logits all -inf), and, under jit, a slot past
    the pool (never read: as -1); the rows no longer named are NaN."""
    l = 128
    q, cache, table, _, _, _ = sparse_decode_inputs(11, b=2, nq=1, n=16, k=192, lens=[400, 150], l=l, r=64, g=16)
    num_slots = cache.shape[0] * cache.shape[1]
    table = table.at[0, 0, 64:128].set(-1)
    still = np.unique(np.asarray(table)[np.asarray(table) >= 0])
    rows = np.array(cache.astype(jnp.float32)).reshape(num_slots, -1)
    rows[np.setdiff1d(np.arange(num_slots), still)] = np.nan
    cache = jnp.asarray(rows.reshape(cache.shape)).astype(jnp.bfloat16)
    bad = table.at[1, 0, 5].set(num_slots + 5)
    jitted = jax.jit(lambda t: _interpreted(q, cache, t, None, l, num_kv_splits=1))
    out, lse = jitted(bad)
    ref, ref_lse = _reference(q, cache, bad.at[1, 0, 5].set(-1), None, l)
    assert_decode_close(out, lse, ref, ref_lse, "bf16")


def _inputs(**over):
    kw = dict(b=1, nq=1, n=16, k=64, lens=[20], l=128, r=64, g=16)
    kw.update(over)
    q, cache, table, ks, _, _ = sparse_decode_inputs(2, **kw)
    return q, cache, table, ks


def test_bad_inputs():
    q, cache, table, ks = _inputs()
    num_slots = cache.shape[0] * cache.shape[1]
    call = k90.sparse_mla_decode_sm90
    with pytest.raises(ValueError, match=f"slot {num_slots + 1} outside"):
        call(q, cache, table.at[0, 0, 0].set(num_slots + 1), scale=SCALE, kv_lora_rank=128, interpret=True)
    with pytest.raises(ValueError, match="topk_slots must be int32"):
        call(q, cache, table.astype(jnp.int16), scale=SCALE, kv_lora_rank=128, interpret=True)
    with pytest.raises(ValueError, match="cache dtype float32 is not bfloat16 or float8"):
        call(q, cache.astype(jnp.float32), table, scale=SCALE, kv_lora_rank=128, interpret=True)
    with pytest.raises(ValueError, match="kv_scale must be given exactly for an fp8 cache"):
        call(q, cache.astype(jnp.float8_e4m3fn), table, scale=SCALE, kv_lora_rank=128, interpret=True)
    with pytest.raises(ValueError, match="L=64, R=128: needs L % 128 == 0"):
        call(q, cache, table, scale=SCALE, kv_lora_rank=64, interpret=True)
    with pytest.raises(ValueError, match="q dtype float32"):
        call(q.astype(jnp.float32), cache, table, scale=SCALE, kv_lora_rank=128, interpret=True)
    with pytest.raises(ValueError, match="num_kv_splits must be a positive int"):
        call(q, cache, table, scale=SCALE, kv_lora_rank=128, num_kv_splits=0, interpret=True)


def test_attention_backend_pallas_sm90(monkeypatch):
    """A backend list with this kernel first (`attention.SPARSE_DECODE_SM90`, as the Hopper backends will have it
    once it has passed on a GPU) goes through it where `unsupported_reason` is None and falls through to the
    portable kernel otherwise (here L = 64 / R = 16)."""
    from mla_jax import attention
    from pallas_kernels import sparse_mla_decode as smd

    calls = []
    real90, real = k90.sparse_mla_decode_sm90, smd.sparse_mla_decode
    monkeypatch.setattr(k90, "sparse_mla_decode_sm90", lambda *a, **kw: calls.append("sm90") or real90(*a, **kw))
    monkeypatch.setattr(smd, "sparse_mla_decode", lambda *a, **kw: calls.append("triton") or real(*a, **kw))
    if not NPROC_IN_TIME:
        pytest.skip("NPROC was raised too late for the interpreter")
    kernels = (attention.SPARSE_DECODE_SM90,) + attention.HOPPER_SPARSE_DECODE
    decode = attention.Backend("sm90_sparse_first", (), (), None, None, sparse_decode=kernels).sparse_mla_decode
    for (l, r), want in (((128, 64), "sm90"), ((64, 16), "triton")):
        q, cache, table, ks = _inputs(b=2, nq=2, k=48, lens=[50, 9], l=l, r=r)
        out, lse = decode(q, cache, table, scale=SCALE, kv_scale=ks, kv_lora_rank=l)
        ref, ref_lse = _reference(q, cache, table, ks, l)
        assert_decode_close(out, lse, ref, ref_lse, "bf16")
        assert calls[-1] == want
    assert len(calls) == 2


def _lower_for_sm90(cache_dtype, n, **kw):
    q, cache, table, ks, _, _ = sparse_decode_inputs(9, b=2, nq=1, n=n, k=256, lens=[300, 40], cache_dtype=cache_dtype)
    f = jax.jit(lambda *a: k90.sparse_mla_decode_sm90(*a[:3], kv_scale=a[3], scale=SCALE, num_sms=132, **kw))
    return f.trace(q, cache, table, ks).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "cache_dtype, n, kw",
    [
        ("bf16", 16, dict(num_kv_splits=1)),
        ("fp8", 16, dict(num_kv_splits=1)),
        ("fp8", 128, dict(num_kv_splits=2)),
        ("bf16", 80, dict(num_kv_splits=3)),
    ],
)
def test_lowers_for_sm90(cache_dtype, n, kw, monkeypatch):
    """The GPU code path at L = 512 / R = 64 passes Mosaic GPU's lowering for sm_90: layout inference (which
    refuses bank-conflicting transfers), wgmma and copy shapes, 227 KB of shared memory. The split merge is a
    Triton kernel, which cannot lower without a GPU: its jnp reference stands in (tested in test_mla_decode.py)."""

    def merge_ref(o_part, lse_part, *, out_dtype, interpret):
        out, lse = mla_decode.merge_splits_reference(o_part, lse_part)
        return out.astype(out_dtype), lse

    monkeypatch.setattr(k90, "merge_splits", merge_ref)
    assert "mosaic_gpu" in _lower_for_sm90(cache_dtype, n, **kw)


# ----------------------------------------------------------------------------------------------
# GPU (make gpu): the real kernel at the V3.2 shapes.


@pytest.mark.gpu
@pytest.mark.parametrize("name,inputs,kernel,kind", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gpu_matches_reference(name, inputs, kernel, kind):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, cache, table, ks, _, _ = sparse_decode_inputs(zlib.crc32(name.encode()), **inputs)
    out, lse = _run(k90.sparse_mla_decode_sm90, q, cache, table, ks, 512, **kernel)
    ref, ref_lse = _run(sparse_mla_decode_reference, q, cache, table, ks, 512)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    assert_decode_close(out, lse, ref, ref_lse, kind, lse_tol=decode_gpu_tolerance(kind)[1])
