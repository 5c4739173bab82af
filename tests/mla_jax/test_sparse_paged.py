"""Sparse attention (DeepSeek-V3.2 DSA) through the paged caches: step-by-step runs (decodes, chunked prefills
with context, multi-token rows) equal the full forward, for both prefill algorithms, bf16/fp8 index caches,
index groups (GLM-MoE-DSA's shared layers); generate through the engine; bad caches get clear errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import attention, model
from mla_jax.cache import init_kv_cache, init_kv_cache_for
from mla_jax.metadata import ScheduledRequest, build_metadata
from mla_jax.step import jit_step
from tests.mla_jax.helpers import full_logits, paged_config, run_schedule
from tests.mla_jax.multihost_worker import random_params

ATOL = 1e-4
K = 8  # index_topk, below most sequence lengths here


def sparse_config(**kw):
    return paged_config(model_type="deepseek_v32", index_topk=K, index_n_heads=4, index_head_dim=32, **kw)


@pytest.fixture(scope="module", params=["v32", "shared"])
def setup(request):
    cfg = (
        sparse_config()
        if request.param == "v32"
        else dataclasses.replace(
            sparse_config(),
            model_type="glm_moe_dsa",
            indexer_types=("full", "shared", "full"),
            index_rope_interleave=True,
        )
    )
    params = random_params(cfg, 0, std=0.2)
    rng = np.random.default_rng(1)
    seqs = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (40, 50, 24, 33)]
    return cfg, params, seqs, full_logits(params, cfg, seqs)


# Teacher-forced steps through the paged caches (NaN-poisoned): small pages, a 16-row context workspace, 3-token
# decode rows.
run = functools.partial(run_schedule, page_size=8, num_pages=48, workspace_rows=16, reorder_batch_threshold=4)


# Prompts chunked over steps (a context of several chunks of W = 16 rows), decodes, 3-token decode rows, a
# late arrival.
MIXED = [
    [(0, 13), (1, 20)],
    [(0, 1), (1, 25), (2, 7)],
    [(0, 3), (1, 1), (2, 1), (3, 25)],
]


def _check(out, full, atol=ATOL):
    assert out
    for r, pos, got in out:
        np.testing.assert_allclose(got, full[r][pos], atol=atol, rtol=0, err_msg=f"request {r} position {pos}")


@pytest.fixture
def forced(monkeypatch):
    """Backends that force the prefill algorithm of sparse layers: "xla_mha" (masked dense MHA) and "xla_mqa"
    (token-sparse absorbed MQA)."""
    base = attention.BACKENDS["xla"]
    monkeypatch.setitem(
        attention.BACKENDS, "xla_mha", dataclasses.replace(base, name="xla_mha", sparse_prefill_mha_max_len=1 << 30)
    )
    monkeypatch.setitem(
        attention.BACKENDS, "xla_mqa", dataclasses.replace(base, name="xla_mqa", sparse_prefill_mha_max_len=0)
    )


@pytest.mark.parametrize("backend", ["xla_mha", "xla_mqa"])
def test_paged_steps_match_full_forward(setup, forced, backend):
    cfg, params, seqs, full = setup
    _check(run(params, cfg, seqs, MIXED, backend=backend), full)


def test_decode_steps_and_multi_token_rows(setup):
    cfg, params, seqs, full = setup
    sched = [[(0, 12), (2, 9)]] + [[(0, 1), (2, 1)]] * 3 + [[(0, 3), (2, 2)]]
    _check(run(params, cfg, seqs, sched), full)


@pytest.mark.parametrize("setup", ["v32"], indirect=True)  # the cache formats do not depend on index groups
@pytest.mark.parametrize("dtype,index_dtype", [("fp8", "fp32"), ("fp32", "fp8")])
def test_low_precision_caches(setup, dtype, index_dtype):
    """fp8 latent rows or fp8 index keys run end to end. The top-k is discrete: a perturbed score or hidden state
    can swap a pick, which moves that row's logits by O(1), so only the bulk is compared (the cache formats
    themselves are checked exactly in test_index_cache_write)."""
    cfg, params, seqs, full = setup
    out = run(params, cfg, seqs[:3], MIXED[:2], cache_dtype=dtype, index_dtype=index_dtype)
    errs = np.array([np.abs(got - full[r][pos]).max() for r, pos, got in out])
    scale = max(np.abs(f).max() for f in full)
    assert np.isfinite(errs).all() and errs.max() > 1e-7  # really lossy
    assert errs.mean() < 0.25 * scale, (errs, scale)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "fp32"])
def test_index_cache_write(dtype):
    """write_index_k_layer puts row t at [index layer, slot // G, slot % G] (padding slots write nowhere), in
    the cache dtype; fp8 keeps a per-token scale (relative error <= 2^-4)."""
    from mla_jax.cache import write_index_k_layer

    cache = init_kv_cache(
        3,
        4,
        8,
        kv_lora_rank=16,
        rope_dim=16,
        dtype="fp32",
        allow_any_page_size=True,
        fill=float("nan"),
        index_head_dim=32,
        num_index_layers=2,
        index_dtype=dtype,
    )
    k = jax.random.normal(jax.random.key(0), (5, 32)) * 3
    slots = jnp.asarray([3, 17, -1, 30, 8], jnp.int32)
    cache = write_index_k_layer(cache, 1, k, slots)
    ik = np.asarray(cache.index_k_cache.astype(jnp.float32))
    if cache.index_k_scale is not None:
        ik = ik * np.asarray(cache.index_k_scale)[..., None]
    tol = {"bf16": 2**-8, "fp8": 2**-4, "fp32": 0}[dtype]
    for t, sl in enumerate(np.asarray(slots)):
        if sl >= 0:
            np.testing.assert_allclose(ik[1, sl // 8, sl % 8], np.asarray(k[t]), rtol=tol, atol=tol * 3)
    written = {int(x) for x in np.asarray(slots) if x >= 0}
    untouched = [ik[li, s // 8, s % 8] for li in (0, 1) for s in range(32) if li == 0 or s not in written]
    assert np.isnan(np.stack(untouched)).all()


def test_sparsity_is_active(setup):
    """The full forward with the top-k off differs: the paged parity above is not dense attention."""
    cfg, params, seqs, full = setup
    dense = np.asarray(model.forward(params, dataclasses.replace(cfg, index_topk=1 << 20), jnp.asarray([seqs[1]]))[0])
    assert np.abs(dense[K:] - full[1][K:]).max() > 1e-2


def test_short_sequences_equal_dense_decode():
    """Every sequence at most index_topk long: the sparse paged steps equal the dense model's paged steps."""
    cfg = sparse_config()
    params = random_params(cfg, 3, std=0.2)
    dense_cfg = dataclasses.replace(cfg, index_topk=None)
    seqs = [[5, 7, 9, 11, 13, 15, 17, 19], [1, 2, 3, 4, 5, 6]]
    sched = [[(0, 4), (1, 3)], [(0, 1), (1, 1)], [(0, 2), (1, 2)], [(0, 1)]]
    a = run(params, cfg, seqs, sched)
    b = run(params, dense_cfg, seqs, sched)
    for (r, p, x), (r2, p2, y) in zip(a, b):
        assert (r, p) == (r2, p2)
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def test_generate_through_the_engine():
    """Greedy generation through the engine (continuous batching, prefill + decode steps) equals greedy
    decoding with the full forward."""
    from mla_jax.engine import Engine, EngineConfig
    from mla_jax.sampling import SamplingParams

    cfg = sparse_config()
    params = random_params(cfg, 1, std=0.2)

    eng = Engine(
        params,
        cfg,
        EngineConfig(
            max_model_len=64,
            max_num_seqs=2,
            page_size=8,
            cache_dtype="fp32",
            token_budget=32,
            max_prefills=2,
            decode_buckets=(2,),
            prefill_buckets=(32,),
        ),
    )
    prompts = [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26]]
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=6, temperature=0.0)) for p in prompts]
    final = eng.run()
    outs = [list(final[r].token_ids) for r in rids]
    assert all(len(o) == 6 for o in outs)
    full = full_logits(params, cfg, [list(p) + o for p, o in zip(prompts, outs)])  # teacher-forced: one forward
    for prompt, o, logits in zip(prompts, outs, full):
        assert o == [int(np.argmax(logits[t])) for t in range(len(prompt) - 1, len(prompt) + len(o) - 1)]


def test_bad_caches_are_rejected():
    cfg = sparse_config()
    params = random_params(cfg, 0, std=0.2)
    md, _ = build_metadata([ScheduledRequest([1, 2], 0, [0])], page_size=8, num_pages=4)
    dense = init_kv_cache(
        cfg.num_hidden_layers,
        4,
        8,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        dtype="fp32",
        allow_any_page_size=True,
    )
    with pytest.raises(ValueError, match="index-key cache"):
        jit_step(params, cfg, dense, md.to_device())
    good = init_kv_cache_for(cfg, 4, 8, dtype="fp32", allow_any_page_size=True)
    f16 = dataclasses.replace(good, index_k_cache=good.index_k_cache.astype(jnp.float16))
    with pytest.raises(ValueError, match="index-key cache dtype float16"):
        jit_step(params, cfg, f16, md.to_device())
    narrow = dataclasses.replace(good, index_k_cache=good.index_k_cache[..., :16])
    with pytest.raises(ValueError, match="index_head_dim"):
        jit_step(params, cfg, narrow, md.to_device())


@pytest.mark.parametrize("setup", ["v32"], indirect=True)
def test_pallas_backend_matches_full_forward(setup):
    """The "pallas" backend (Triton sparse decode kernel, interpreted on CPU) on decode and multi-token rows and
    token-sparse MQA prefill rows; NaN-poisoned caches."""
    cfg, params, seqs, full = setup
    sched = [[(0, 12)], [(0, 3)]]
    _check(run(params, cfg, seqs, sched, backend="pallas"), full)


def test_topk_table_past_a_sequence():
    """A top-k entry past its row's sequence is reported on the host and, traced, converted to -1 (no slot):
    it can never read another request's rows."""
    from mla_jax.sparse import check_topk_indices, positions_to_slots

    bt = jnp.asarray([[3, 1], [0, 2]], jnp.int32)
    sl = jnp.asarray([10, 5], jnp.int32)
    topk = jnp.asarray([[9, 0, -1], [4, 5, 1]], jnp.int32)  # row 1 names position 5 of a 5-token sequence
    with pytest.raises(ValueError, match="row 1 entry 1 names position 5, outside the row's sequence of 5 tokens"):
        check_topk_indices(topk, sl)
    check_topk_indices(topk.at[1, 1].set(-1), sl)
    slots = np.asarray(positions_to_slots(topk, bt, sl, 8))
    np.testing.assert_array_equal(slots, [[1 * 8 + 1, 3 * 8 + 0, -1], [0 * 8 + 4, -1, 0 * 8 + 1]])


def test_every_backend_ends_sparse_lists_with_xla():
    """The sparse decode and indexer lists fall through to the plain-JAX references, which take every shape; the
    GPU backends put the Pallas kernels first (the Hopper ones: `HOPPER_SPARSE_DECODE`, the portable kernel, which
    the H200 measured faster than the sm90 sparse decode)."""
    for name, be in attention.BACKENDS.items():
        assert be.sparse_decode[-1] is attention.SPARSE_DECODE_XLA and be.indexer[-1] is attention.INDEXER_XLA, name
    hopper = attention.HOPPER_SPARSE_DECODE[:-1]
    assert attention.SPARSE_DECODE_TRITON in hopper
    want = {"pallas": (attention.SPARSE_DECODE_TRITON,), "pallas_sm90": hopper, "pallas_sm90_fp8qk": hopper}
    for name, kernels in want.items():
        be = attention.BACKENDS[name]
        assert be.sparse_decode[:-1] == kernels and be.indexer[0] is attention.INDEXER_TRITON, name
