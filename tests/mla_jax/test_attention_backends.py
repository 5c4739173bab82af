"""The backend registry: every Pallas backend falls through its kernels down to the plain-JAX reference for shapes
no kernel takes (one warning naming the kernel and its reason), and `pick` reads the table in order."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import attention
from mla_jax.cache import init_kv_cache
from mla_jax.metadata import ScheduledRequest, build_metadata
from mla_jax.model import init_params
from mla_jax.step import jit_step
from tests.mla_jax.helpers import tiny_config


def test_every_backend_ends_with_xla():
    for name, be in attention.BACKENDS.items():
        assert be.decode[-1] is attention.DECODE_XLA and be.prefill[-1] is attention.PREFILL_XLA, name


@pytest.mark.parametrize("backend", ["pallas", "pallas_sm90"])
def test_odd_dims_fall_through_to_xla(backend):
    """kv_lora_rank 40, rope 8, v head dim 24: no Pallas kernel takes them. The step runs (a mixed batch: one
    prefill with chunked context, one decode), warns, and equals the "xla" backend; NaN in unused cache rows."""
    cfg = tiny_config(kv_lora_rank=40, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=24)
    params = init_params(cfg, jax.random.key(0), std=0.2)
    steps = [  # prompts first (their rows are the second step's context), then a prefill with context + a decode
        [ScheduledRequest([1, 2, 3, 4], 0, [1, 2]), ScheduledRequest([5, 6, 7, 8, 9, 10], 0, [3, 4])],
        [ScheduledRequest([3, 5, 7, 9], 4, [1, 2]), ScheduledRequest([11], 6, [3, 4])],
    ]

    def run(name):
        cache = init_kv_cache(
            cfg.num_hidden_layers,
            8,
            4,
            kv_lora_rank=40,
            rope_dim=8,
            dtype="fp32",
            allow_any_page_size=True,
            fill=float("nan"),
        )
        out = []
        for reqs in steps:
            md, _ = build_metadata(reqs, page_size=4, num_pages=8, workspace_rows=16)
            logits, cache = jit_step(params, cfg, cache, md.to_device(), backend=name)
            out.append(np.asarray(logits))
        return np.concatenate(out)

    with pytest.warns(UserWarning, match=r"kernel declines \(.*\); using the plain-JAX"):
        got = run(backend)
    np.testing.assert_allclose(got, run("xla"), atol=1e-5, rtol=0)
    assert np.isfinite(got).all()


def test_pick_reports_every_reason_when_nothing_fits():
    never = attention.Kernel("never", lambda *a: None, lambda *a, **k: "never fits")
    with pytest.raises(ValueError, match="never: never fits"):
        attention.pick((never,), jnp.zeros(1))


def test_sparse_prefill_threshold_from_the_measured_table(monkeypatch):
    """A head count takes the nearest measured entry (ties to the smaller); a backend's own number overrides."""
    monkeypatch.setattr(attention, "SPARSE_PREFILL_MHA_MAX_LEN", {16: 100, 128: 7})
    b = attention.get_backend("xla")
    got = [attention.sparse_prefill_mha_max_len(b, n) for n in (8, 16, 64, 72, 80, 128, 256)]
    assert got == [100, 100, 100, 100, 7, 7, 7]
    forced = dataclasses.replace(b, sparse_prefill_mha_max_len=5)
    assert attention.sparse_prefill_mha_max_len(forced, 128) == 5


def test_hopper_decode_takes_few_rows_over_a_pool_of_64_bit_offsets():
    """Below SM90_MIN_ROWS rows the Hopper decode takes up to 32 rows of a bf16 cache (16 of an fp8 one) from batch
    2 on (its narrow, tokens-on-M kernel beat Triton at every pool size); other rows only over a pool above 4 GB,
    where the Triton lowering's 64-bit offsets made it 1.6x slower (attention.TRITON_64BIT_POOL_BYTES); at batch 1
    the narrow kernel takes its rows over any pool (faster there: fp8 since part 28, bf16 since session 31), the
    others stay on Triton."""
    from mla_jax import attention

    def pool(dtype, over):
        row = 64 * 576 * jnp.dtype(dtype).itemsize  # a page's bytes
        return jax.ShapeDtypeStruct((attention.TRITON_64BIT_POOL_BYTES // row + over, 64, 576), dtype)

    fp8 = jnp.float8_e4m3fn
    q = jax.ShapeDtypeStruct((128, 1, 16, 576), jnp.bfloat16)
    assert attention._sm90_declines(q, pool(jnp.bfloat16, 0), None, None) is None  # narrow kernel
    assert attention._sm90_declines(q, pool(jnp.bfloat16, 1), None, None) is None
    assert attention._sm90_declines(q, pool(fp8, 0), None, None) is None  # narrow kernel, <= 16 rows
    assert attention._sm90_declines(q, pool(fp8, 1), None, None) is None
    q32 = jax.ShapeDtypeStruct((8, 2, 16, 576), jnp.bfloat16)  # 32 rows: narrow on bf16 only
    assert attention._sm90_declines(q32, pool(jnp.bfloat16, 0), None, None) is None
    assert "Triton is faster" in attention._sm90_declines(q32, pool(fp8, 0), None, None)
    assert attention._sm90_declines(q32, pool(fp8, 1), None, None) is None
    assert attention._sm90_fp8qk_declines(q, pool(fp8, 0), None, None) is None  # lossy: narrow kernel too
    assert "Triton is faster" in attention._sm90_fp8qk_declines(q32, pool(fp8, 0), None, None)  # 64-row
    q40 = jax.ShapeDtypeStruct((8, 1, 40, 576), jnp.bfloat16)  # past the narrow kernel's 32 rows
    assert "Triton is faster" in attention._sm90_declines(q40, pool(jnp.bfloat16, 0), None, None)
    q1 = jax.ShapeDtypeStruct((1, 1, 16, 576), jnp.bfloat16)
    for over in (0, 1):
        assert attention._sm90_declines(q1, pool(jnp.bfloat16, over), None, None) is None  # one request: narrow
        assert attention._sm90_declines(q1, pool(fp8, over), None, None) is None
    q1x2 = jax.ShapeDtypeStruct((1, 2, 16, 576), jnp.bfloat16)  # 32 rows of one request: past narrow fp8's 16
    assert "batch 1" in attention._sm90_declines(q1x2, pool(fp8, 0), None, None)
    assert attention._sm90_declines(q1x2, pool(jnp.bfloat16, 0), None, None) is None  # bf16: narrow up to 32 rows
    q1x3 = jax.ShapeDtypeStruct((1, 3, 16, 576), jnp.bfloat16)  # 48 rows of one request: the 64-row kernel
    assert attention._sm90_declines(q1x3, pool(jnp.bfloat16, 0), None, None) is None
    q1_40 = jax.ShapeDtypeStruct((1, 1, 40, 576), jnp.bfloat16)  # past the narrow kernel, below 48: Triton
    assert "batch 1" in attention._sm90_declines(q1_40, pool(jnp.bfloat16, 0), None, None)
    q48 = jax.ShapeDtypeStruct((8, 3, 16, 576), jnp.bfloat16)
    assert attention._sm90_declines(q48, pool(jnp.bfloat16, 0), None, None) is None


def test_every_decode_kernel_takes_page_offset():
    """Every decode kernel of the table takes `page_offset` (forward_mqa passes the layer's first page) and
    rejects a bad static one, naming it, before any work."""
    from pallas_kernels.testing import DECODE_SCALE, decode_inputs

    q, cache, bt, sl, ks = decode_inputs(3, b=1, nq=1, n=16, max_pages=2, lens=[70], cache_dtype="fp8")
    kernels = {k.name: k for be in attention.BACKENDS.values() for k in be.decode}
    assert set(kernels) == {"xla", "triton", "sm90", "sm90_fp8qk"}
    for k in kernels.values():
        for bad, match in ((-1, "page_offset=-1 is out of range"), (jnp.zeros(2, jnp.int32), "page_offset must be")):
            with pytest.raises(ValueError, match=match):
                k.fn(q, cache, bt, sl, scale=DECODE_SCALE, kv_scale=ks, kv_lora_rank=512, page_offset=bad)


def _pallas_calls(jaxpr, depth=0, out=None):
    """(scan depth, kernel name) of every pallas_call in a jaxpr, nested ones included."""
    out = [] if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append((depth, str(eqn.params["name"])))
            continue
        inner = depth + (eqn.primitive.name == "scan")
        for v in eqn.params.values():
            for x in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(x, jax.extend.core.ClosedJaxpr):
                    _pallas_calls(x.jaxpr, inner, out)
                elif isinstance(x, jax.extend.core.Jaxpr):
                    _pallas_calls(x, inner, out)
    return out


def test_step_builds_the_decode_work_list_once():
    """A step whose decodes take the Hopper kernel's work list (64 requests of 16 heads: the narrow kernel) builds
    it once, before the layer loop (`step.plan_decode`), and every layer's decode reads it: the step's jaxpr has one
    metadata kernel, outside the layer scans, and a segment merge in each scan."""
    from mla_jax.step import forward_step
    from pallas_kernels import mla_decode_sm90 as md90
    from tests.pallas_kernels.mosaic_interpreter import require_nproc

    require_nproc()
    cfg = tiny_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=16)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    cache = jax.eval_shape(lambda: init_kv_cache(cfg.num_hidden_layers, 70, 64, kv_lora_rank=512, rope_dim=64))
    b = md90.NARROW_WORKLIST_MIN_BATCH
    md, _ = build_metadata([ScheduledRequest([1], 10 + 6 * (i % 9), [i]) for i in range(b)], page_size=64, num_pages=70)
    step = lambda p, c, m: forward_step(p, cfg, c, m, backend="pallas_sm90")  # noqa: E731
    calls = _pallas_calls(jax.make_jaxpr(step)(params, cache, md.to_device()).jaxpr)
    assert [c for c in calls if c[1] == "mla_decode_sm90_worklist"] == [(0, "mla_decode_sm90_worklist")], calls
    assert [d for d, name in calls if name.startswith("mla_decode_merge_segments")] == [1, 1], calls  # dense, MoE
