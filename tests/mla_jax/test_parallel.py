"""Multi-device serving (`mla_jax.parallel`) on 8 virtual CPU devices: tensor parallel 2/4/8, DCP 2/4 (page and
token interleave, fp8 cache), expert parallel (alone and as TP2 x DCP2 x EP2, and the moe="tp" layout), against
the one-device full forward; greedy `generate` on the mesh; the DCP index arithmetic against brute force; layouts
and errors.

Tolerances: float32 weights, activations and cache (fp8 where stated, then compared with the one-device fp8
run). The mesh changes only the order of sums (all-reduces of partial o_proj / MLP / expert outputs, the LSE
combine over DCP ranks, the row order inside context chunks), so logits of magnitude ~5 agree to ~2e-6;
ATOL = 1e-4 as in test_paged.py. Greedy tokens must be identical (argmax margins here are far above 1e-4).
Steps are compiled at XLA optimisation level 0 (multihost_worker.FAST_COMPILE) to keep the file's time down.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import comm, parallel, step
from mla_jax.engine import generate
from mla_jax.sampling import SamplingParams
from tests.mla_jax.multihost_worker import (
    FAST_COMPILE,
    PAGE,
    PROMPTS,
    SCHEDULE,
    engine_config,
    fast_engine_step,
    full_logits,
    greedy_tokens,
    parallel_config,
    prompts,
    random_params,
    run_schedule_parallel,
    sequences,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    cfg = parallel_config()
    params = random_params(cfg, 0, std=0.2)
    seqs = sequences(cfg)
    return cfg, params, seqs, full_logits(params, cfg, seqs)


def _max_err(out, want):
    assert len(out) == 17  # every logit row of SCHEDULE
    return max(float(np.abs(got - want(r, pos)).max()) for r, pos, got in out)


def test_eight_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize(
    "mesh,plan_kw,cache_dtype",
    [
        (dict(tp=2), dict(moe="tp"), "fp32"),  # experts split by their intermediate dim
        (dict(tp=4), {}, "fp32"),  # 2 heads, 2 experts per device
        (dict(tp=8), {}, "fp32"),  # 1 head, 1 expert per device
        (dict(dcp=2), dict(dcp_interleave=1), "fp32"),  # vLLM's token interleave
        (dict(dcp=4), {}, "fp8"),  # page interleave, fp8 rows with their per-token scales split alike
        (dict(tp=2, dcp=2, ep=2), {}, "fp32"),  # heads 4-way, cache 2-way, experts 8-way; attention replicated on ep
    ],
    ids=["tp2-moe_tp", "tp4", "tp8", "dcp2-tok", "dcp4-fp8", "tp2xdcp2xep2"],
)
def test_paged_logits_match_one_device(setup, mesh, plan_kw, cache_dtype):
    """Mixed batches (prefills with multi-chunk contexts, single- and multi-token decodes) through the paged cache
    on the mesh equal the one-device full forward (fp32 cache) or the one-device paged run with the same virtual
    pages (fp8 cache: quantisation moves logits by up to ~1 here, a routing flip, on one device as well). The
    unused cache rows are NaN on every rank: a rank reading a row it does not own, or a wrong local length,
    would show."""
    cfg, params, seqs, full = setup
    plan = parallel.ParallelPlan(parallel.make_mesh(**mesh), **plan_kw)
    out, cache, pool = run_schedule_parallel(
        params, cfg, seqs, SCHEDULE, plan=plan, cache_dtype=cache_dtype, return_state=True
    )
    if cache_dtype == "fp32":
        assert _max_err(out, lambda r, pos: full[r][pos]) < ATOL
    else:
        one = run_schedule_parallel(params, cfg, seqs, SCHEDULE, page_size=PAGE * plan.dcp, cache_dtype=cache_dtype)
        ref = {(r, pos): lg for r, pos, lg in one}
        assert _max_err(out, lambda r, pos: ref[r, pos]) < ATOL
        assert _max_err(out, lambda r, pos: full[r][pos]) > 1e-3  # the fp8 cache really is in use
    # Writes went to the owning rank only: every token's row is written exactly once, on one rank.
    kv = parallel.to_host(cache.kv_c_and_k_pe_cache)[0].astype(np.float32)  # [pages, G*dcp, L+R], layer 0
    written = ~np.isnan(kv).any(-1)
    assert written.sum() == sum(len(s) for s in seqs)
    if plan.dcp > 1 and plan.dcp_interleave is None:
        # page interleave: the global array is the one-device cache of page size G*dcp, cut into dcp slices
        gv = PAGE * plan.dcp
        want = np.zeros_like(written)
        for r, s in enumerate(seqs):
            pos = np.arange(len(s))
            want[np.asarray(pool.pages(r))[pos // gv], pos % gv] = True
        np.testing.assert_array_equal(written, want)


def test_generate_greedy_on_mesh(monkeypatch):
    """`generate(..., plan=)` on TP2 x DCP2 x EP2 (scheduler, virtual pages, all-gathered logits, sampling) gives
    the one-device greedy tokens."""
    monkeypatch.setattr(step, "engine_step", fast_engine_step())
    cfg = parallel_config()
    params = random_params(cfg, 1, std=0.3)
    ps = prompts(cfg)
    want = greedy_tokens(params, cfg, ps, PROMPTS[1])
    plan = parallel.ParallelPlan(parallel.make_mesh(tp=2, dcp=2, ep=2))
    outs = generate(params, cfg, ps, SamplingParams(max_new_tokens=PROMPTS[1]), engine_config(), plan=plan)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)


# ------------------------------------------------------------------------------------- DCP index arithmetic


@pytest.mark.parametrize("dcp,interleave,page", [(2, 1, 4), (2, 4, 4), (4, 2, 4), (4, 8, 8), (3, 2, 4)])
def test_dcp_indexing_against_enumeration(dcp, interleave, page):
    """Local lengths and slots against a plain enumeration of positions: position p belongs to rank
    (p // I) % dcp, whose tokens fill its pages in order."""
    n_pos = 5 * page * dcp + 3
    gv = page * dcp
    blocks = np.array([7, 2, 9, 4, 1, 3], np.int64)  # a request's pages (virtual pages)
    owner = (np.arange(n_pos) // interleave) % dcp
    for r in range(dcp):
        mine = np.flatnonzero(owner == r)  # this rank's positions, in order: local index = rank among them
        lens = np.asarray(comm.dcp_local_len(jnp.arange(n_pos + 1), dcp, interleave, r))
        np.testing.assert_array_equal(lens, [np.sum(mine < n) for n in range(n_pos + 1)])
        slots = blocks[np.arange(n_pos) // gv] * gv + np.arange(n_pos) % gv
        local = np.asarray(comm.dcp_local_slots(jnp.asarray(np.append(slots, -1), jnp.int32), page, dcp, interleave, r))
        want = np.full(n_pos + 1, -1)
        li = np.arange(len(mine))
        want[mine] = blocks[li // page] * page + li % page  # local index -> the same block ids, page G
        np.testing.assert_array_equal(local, want)
        if interleave == page:  # page interleave: rank r's slice of the virtual page is [r*G, (r+1)*G)
            assert np.all((np.arange(n_pos) % gv)[mine] // page == r)


def test_local_workspace_rows_bound():
    rng = np.random.default_rng(0)
    for _ in range(200):
        dcp, interleave = int(rng.choice([2, 4])), int(rng.choice([1, 2, 8]))
        sp = int(rng.integers(1, 5))
        lens = rng.integers(0, 100, sp)
        w = int(lens.sum()) or 1
        for r in range(dcp):
            got = int(np.asarray(comm.dcp_local_len(jnp.asarray(lens), dcp, interleave, r)).sum())
            assert got <= comm.local_workspace_rows(w, sp, dcp, interleave)


# ----------------------------------------------------------------------------------------- layout, errors


def test_layout_on_mesh():
    cfg = parallel_config()
    params = random_params(cfg, 0)
    plan = parallel.ParallelPlan(parallel.make_mesh(tp=2, dcp=2, ep=2))
    sp = plan.shard_params(params, cfg)
    m = sp["model"]["moe_layers"]

    def local(x):
        return x.addressable_shards[0].data.shape

    assert local(m["self_attn"]["W_UK_T"]) == (1, 2, 16, 32)  # [layers, N/(tp*dcp), P, L]
    assert local(m["self_attn"]["o_proj"]["weight"]) == (1, 32, 2 * 16)  # [layers, D, N_loc*V]
    assert local(m["mlp"]["experts"]["down_proj"]["weight"]) == (1, 1, 32, 16)  # [layers, E/8, D, I]
    assert local(m["mlp"]["shared_experts"]["up_proj"]["weight"]) == (1, 2, 32)  # [layers, I_shared/8, D]
    assert local(sp["model"]["embed_tokens"]["weight"]) == (12, 32)  # vocab 96 / 8
    assert m["self_attn"]["kv_a_proj_with_mqa"]["weight"].sharding.is_fully_replicated
    assert m["mlp"]["gate"]["weight"].sharding.is_fully_replicated
    cache = plan.init_cache(cfg, 5, PAGE, dtype="fp8")
    assert cache.kv_c_and_k_pe_cache.shape == (2, 5, PAGE * 2, 48)  # global: virtual pages of G*dcp rows
    assert local(cache.kv_c_and_k_pe_cache) == (2, 5, PAGE, 48) and local(cache.kv_scale) == (2, 5, PAGE)
    tp = parallel.ParallelPlan(parallel.make_mesh(tp=4), moe="tp")
    w = tp.shard_params(params, cfg)["model"]["moe_layers"]["mlp"]["experts"]
    assert local(w["gate_proj"]["weight"]) == (1, 8, 4, 32)  # every expert, I/4 rows
    assert local(w["down_proj"]["weight"]) == (1, 8, 32, 4)
    assert tp.init_cache(cfg, 5, PAGE).kv_c_and_k_pe_cache.sharding.is_fully_replicated  # plain TP: replicated


def test_plan_errors():
    cfg = parallel_config()
    with pytest.raises(ValueError, match="6 attention heads do not divide over tp\\*dcp = 4"):
        parallel.ParallelPlan(parallel.make_mesh(tp=2, dcp=2)).validate(parallel_config(num_attention_heads=6))
    with pytest.raises(ValueError, match="12 routed experts do not divide over 8 devices"):
        parallel.ParallelPlan(parallel.make_mesh(tp=8)).validate(parallel_config(n_routed_experts=12))
    with pytest.raises(ValueError, match="moe_intermediate_size 12 does not divide over 8"):
        parallel.ParallelPlan(parallel.make_mesh(ep=8), moe="tp").validate(parallel_config(moe_intermediate_size=12))
    with pytest.raises(ValueError, match="needs 16 devices, 8 available"):
        parallel.make_mesh(tp=4, dcp=4)
    with pytest.raises(ValueError, match="not supported"):
        parallel.ParallelPlan(jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("sp", "tp")))
    with pytest.raises(ValueError, match="moe must be one of"):
        parallel.ParallelPlan(parallel.make_mesh(tp=2), moe="dense")
    parallel.ParallelPlan(parallel.make_mesh(tp=2, dcp=2, ep=2)).validate(cfg)


def _alias_check(plan, backend, compiler_options):
    """The donated cache is updated in place on every device (DCP exists to save this memory)."""
    from mla_jax.metadata import BatchShape, ScheduledRequest, build_metadata

    cfg = parallel_config()
    params = plan.shard_params(random_params(cfg, 0), cfg)
    cache = plan.init_cache(cfg, 64, 16, dtype="bf16")
    md, _ = build_metadata(
        [ScheduledRequest([1], 5, [1])],
        page_size=16 * plan.dcp,
        num_pages=64,
        shape=BatchShape(num_decodes=4, max_pages=4),
    )
    jit_step = jax.jit(
        step.jit_step.__wrapped__,
        static_argnames=step.STATIC_ARGNAMES,
        donate_argnames=("cache",),
        compiler_options=compiler_options,
    )
    ma = jit_step.lower(params, cfg, cache, plan.replicate(md), plan=plan, backend=backend).compile().memory_analysis()
    local = cache.kv_c_and_k_pe_cache.addressable_shards[0].data.nbytes
    assert ma.alias_size_in_bytes >= local and ma.temp_size_in_bytes < local, ma


def test_cache_updated_in_place():
    _alias_check(parallel.ParallelPlan(parallel.make_mesh(tp=2, dcp=2)), "xla", FAST_COMPILE)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "mesh", [dict(tp=2), dict(dcp=2), dict(tp=2, dcp=2), dict(dcp=4)], ids=["tp2", "dcp2", "tp2xdcp2", "dcp4"]
)
def test_pallas_kernels_on_gpus(mesh):
    """The Pallas backend (Triton decode, prefill, gather, merge) inside shard_map on real GPUs, against the
    one-GPU Pallas run with the same virtual pages. float32 model and cache; Triton's f32 dots may run as tf32,
    so logits (~5) agree to ~1e-2 rather than 1e-4."""
    n = int(np.prod(list(mesh.values())))
    if jax.default_backend() != "gpu" or jax.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    cfg = parallel_config()
    params = random_params(cfg, 0, std=0.2)
    seqs = sequences(cfg)
    plan = parallel.ParallelPlan(parallel.make_mesh(**mesh))
    out = run_schedule_parallel(params, cfg, seqs, SCHEDULE, plan=plan, backend="pallas", compiler_options=None)
    one = run_schedule_parallel(
        params, cfg, seqs, SCHEDULE, page_size=PAGE * plan.dcp, backend="pallas", compiler_options=None
    )
    ref = {(r, pos): lg for r, pos, lg in one}
    assert _max_err(out, lambda r, pos: ref[r, pos]) < 2e-2
    _alias_check(plan, "pallas", None)
