"""Data-parallel attention with expert-parallel MoE (`mla_jax.parallel`, "dp" axis) on 8 virtual CPU devices.

Each DP rank runs its own requests from its own page pool in the one shard_mapped step; the routed experts are
split over every device and the ranks' tokens all-gathered to them and reduce-scattered back. Checked: logits of
a teacher-forced mixed schedule (request r on rank r % dp; ranks with no request in a step run an empty share and
still join the MoE collectives) equal the one-device full forward for DP 2/4/8, DP x TP and DP x TP x DCP; every
rank writes exactly its own requests' rows into its own pages (the rest of the cache stays NaN); greedy `generate`
equals one-device greedy decoding; a soak with preemptions keeps every rank's page accounting exact; bad layouts
fail with errors naming them. Tolerances as tests/mla_jax/test_parallel.py (float32: only the order of sums
changes). Steps compile at XLA optimisation level 0 (multihost_worker.FAST_COMPILE).
"""

import numpy as np
import pytest

from mla_jax import parallel, step
from mla_jax.allocator import PagePool
from mla_jax.engine import Engine, EngineConfig, generate
from mla_jax.sampling import SamplingParams
from mla_jax.scheduler import DPScheduler, Status
from tests.mla_jax.multihost_worker import (
    NUM_PAGES,
    PAGE,
    PROMPTS,
    SCHEDULE,
    engine_config,
    fast_engine_step,
    full_logits,
    greedy_tokens,
    parallel_config,
    random_params,
    run_schedule_parallel,
    sequences,
)
from tests.mla_jax.multihost_worker import (
    prompts as make_prompts,
)

ATOL = 1e-4


@pytest.fixture(scope="module")
def setup():
    cfg = parallel_config()
    params = random_params(cfg, 0, std=0.2)
    seqs = sequences(cfg)
    return cfg, params, seqs, full_logits(params, cfg, seqs)


@pytest.mark.parametrize(
    "mesh",
    [dict(dp=2), dict(dp=8), dict(dp=4, tp=2), dict(dp=2, tp=2, dcp=2)],
    ids=["dp2", "dp8", "dp4xtp2", "dp2xtp2xdcp2"],
)
def test_dp_logits_match_one_device(setup, mesh):
    """The mixed SCHEDULE (chunked prefills with multi-chunk contexts, single- and multi-token decodes) with
    request r on DP rank r % dp equals the one-device full forward; under DP 8 four ranks never get a request
    and the others sit idle in some steps. Then the cache: rank r's slice of the page axis holds exactly the rows
    of its requests, at their pages of its own pool."""
    cfg, params, seqs, full = setup
    plan = parallel.ParallelPlan(parallel.make_mesh(**mesh))
    assert plan.expert_shards == plan.num_devices  # experts over every device
    out, cache, pools = run_schedule_parallel(params, cfg, seqs, SCHEDULE, plan=plan, return_state=True)
    assert len(out) == 17  # every logit row of SCHEDULE
    assert max(float(np.abs(got - full[r][pos]).max()) for r, pos, got in out) < ATOL
    kv = parallel.to_host(cache.kv_c_and_k_pe_cache)[0]  # [dp * NUM_PAGES, G*dcp, L+R], layer 0
    assert kv.shape[0] == plan.dp * NUM_PAGES
    gv = PAGE * plan.dcp
    for rank, pool in enumerate(pools):
        written = ~np.isnan(kv[rank * NUM_PAGES : (rank + 1) * NUM_PAGES]).any(-1)
        want = np.zeros_like(written)
        for r in pool.request_ids:
            assert r % plan.dp == rank
            pos = np.arange(len(seqs[r]))
            want[np.asarray(pool.pages(r))[pos // gv], pos % gv] = True
        np.testing.assert_array_equal(written, want)


def test_generate_greedy_dp8(monkeypatch):
    """`generate` on DP 8 (one expert per device; 6 prompts, so two ranks stay idle every step) gives the
    one-device greedy tokens."""
    monkeypatch.setattr(step, "engine_step", fast_engine_step())
    cfg = parallel_config()
    params = random_params(cfg, 1, std=0.3)
    ps = make_prompts(cfg)
    want = greedy_tokens(params, cfg, ps, PROMPTS[1])
    plan = parallel.ParallelPlan(parallel.make_mesh(dp=8))
    outs = generate(params, cfg, ps, SamplingParams(max_new_tokens=PROMPTS[1]), engine_config(), plan=plan)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)


def test_soak_dp_tp_preemption(monkeypatch):
    """DP 2 x TP 2 engine, 2 sequences and 9 usable pages of 8 per rank, 8 requests of 34..46 tokens (two of
    them need 10 or more pages): the ranks preempt and resume their own requests. After every step each rank's
    pool holds exactly its running requests (pages covering their tokens, invariants intact); at the end every
    page is free and the tokens are the one-device greedy ones."""
    monkeypatch.setattr(step, "engine_step", fast_engine_step())
    cfg = parallel_config()
    params = random_params(cfg, 2, std=0.3)
    rng = np.random.default_rng(3)
    lens = [int(n) for n in rng.integers(20, 30, 8)]
    news = [int(n) for n in rng.integers(14, 23, 8)]
    ps = [rng.integers(0, cfg.vocab_size, n).tolist() for n in lens]
    config = EngineConfig(
        max_model_len=64,
        max_num_seqs=4,
        page_size=PAGE,
        num_pages=10,
        token_budget=32,
        max_prefills=2,
        decode_buckets=(2,),
        prefill_buckets=(32,),
        cache_dtype="fp32",
    )
    plan = parallel.ParallelPlan(parallel.make_mesh(dp=2, tp=2))
    eng = Engine(params, cfg, config, plan=plan)
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(ps, news)]
    final, ranks = {}, {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        for rank, sched in enumerate(eng.scheduler.ranks):
            pool = sched.pool
            pool.check_invariants()
            assert sorted(pool.request_ids) == sorted(r.request_id for r in sched.running)
            for r in sched.running:
                assert r.dp_rank == rank and ranks.setdefault(r.request_id, rank) == rank  # never moves
                assert pool.num_tokens(r.request_id) >= r.num_computed_tokens
                assert len(pool.pages(r.request_id)) == pool.pages_needed(pool.num_tokens(r.request_id))
            held = sum(len(pool.pages(r)) for r in pool.request_ids)
            assert pool.num_held_pages == held and pool.num_free_pages == pool.num_usable_pages - held
    assert all(s.num_preemptions > 0 for s in eng.scheduler.ranks)  # both ranks preempted
    assert set(ranks.values()) == {0, 1}
    for s in eng.scheduler.ranks:
        assert s.pool.num_free_pages == s.pool.num_usable_pages and not s.pool.request_ids
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages == 18
    want = greedy_tokens(params, cfg, ps, max(news))
    assert [final[i].token_ids for i in ids] == [w[:n] for w, n in zip(want, news)]


# --------------------------------------------------------------------------------------- host side, errors


def test_dp_scheduler_assignment():
    """New requests go to the rank with the fewest tokens that has a slot and the pages; an assigned request
    stays on its rank; a full rank is skipped; nothing fits: the request waits."""
    pools = [PagePool(9, 4) for _ in range(2)]
    s = DPScheduler(pools, max_num_seqs=4, token_budget=64, max_prefills=4)
    p = SamplingParams()
    a = s.add("a", [1] * 20, p)  # -> rank 0 (tie: same free pages, lower rank)
    b = s.add("b", [1] * 8, p)  # -> rank 1 (fewer tokens)
    c = s.add("c", [1] * 4, p)  # -> rank 1 (8 < 20 tokens)
    chunks = s.schedule()
    assert (a.dp_rank, b.dp_rank, c.dp_rank) == (0, 1, 1)
    assert {ch.request.request_id for ch in chunks} == {"a", "b", "c"}
    assert pools[0].request_ids == ["a"] and sorted(pools[1].request_ids) == ["b", "c"]
    d = s.add("d", [1] * 12, p)  # rank 1 is full (2 sequences): rank 0, its 3 free pages fit 12 tokens
    s.schedule()
    assert d.dp_rank == 0 and d.status is Status.RUNNING
    e = s.add("e", [1] * 4, p)  # both ranks full: waits
    s.schedule()
    assert list(s.unassigned) == [e] and s.waiting[0] is e
    s.finish(b, "stop")
    s.schedule()
    assert e.dp_rank == 1 and e.status is Status.RUNNING
    assert s.abort("a") is a and "a" not in pools[0]
    with pytest.raises(ValueError, match="max_num_seqs 3 does not divide over dp=2"):
        DPScheduler(pools, max_num_seqs=3, token_budget=8, max_prefills=1)


def test_dp_layout_errors():
    cfg = parallel_config()
    with pytest.raises(ValueError, match="6 attention heads do not divide over tp\\*dcp = 4"):
        parallel.ParallelPlan(parallel.make_mesh(dp=2, tp=4)).validate(parallel_config(num_attention_heads=6))
    with pytest.raises(ValueError, match="12 routed experts do not divide over 8 devices"):
        parallel.ParallelPlan(parallel.make_mesh(dp=8)).validate(parallel_config(n_routed_experts=12))
    with pytest.raises(ValueError, match="12 routed experts do not divide over 8 devices"):
        parallel.ParallelPlan(parallel.make_mesh(dp=4, tp=2)).validate(parallel_config(n_routed_experts=12))
    with pytest.raises(ValueError, match="moe='tp' with dp=2"):
        parallel.ParallelPlan(parallel.make_mesh(dp=2, tp=2), moe="tp")
    with pytest.raises(ValueError, match="needs 16 devices, 8 available"):
        parallel.make_mesh(dp=8, tp=2)
    with pytest.raises(ValueError, match="dp must be an int >= 1"):
        parallel.make_mesh(dp=0)
    plan = parallel.ParallelPlan(parallel.make_mesh(dp=8))
    with pytest.raises(ValueError, match="max_num_seqs 4 does not divide over dp=8"):
        Engine({}, cfg, EngineConfig(max_num_seqs=4), plan=plan)  # before any param is touched
    with pytest.raises(ValueError, match="speculative decoding with data-parallel attention"):
        Engine({}, cfg, EngineConfig(max_num_seqs=8, num_speculative_tokens=2, speculative_method="ngram"), plan=plan)
    with pytest.raises(ValueError, match="leading \\[dp\\] axis"):
        from mla_jax.metadata import BatchShape, empty_metadata

        params = plan.shard_params(random_params(cfg, 0), cfg)
        cache = plan.init_cache(cfg, 4, PAGE)
        step.forward_step(params, cfg, cache, empty_metadata(BatchShape(num_decodes=1)), plan=plan)
    sp = plan.shard_params(random_params(cfg, 0), cfg)
    m = sp["model"]["moe_layers"]
    assert m["mlp"]["experts"]["up_proj"]["weight"].addressable_shards[0].data.shape == (1, 1, 16, 32)  # E/8
    assert m["self_attn"]["W_UK_T"].sharding.is_fully_replicated  # attention replicated over dp
    assert sp["model"]["embed_tokens"]["weight"].sharding.is_fully_replicated


@pytest.mark.gpu
@pytest.mark.parametrize("mesh", [dict(dp=2), dict(dp=2, tp=2), dict(dp=4)], ids=["dp2", "dp2xtp2", "dp4"])
def test_dp_pallas_kernels_on_gpus(setup, mesh):
    """The Pallas backend (decode, prefill, gather) and the Pallas grouped GEMM under DP on real GPUs, against the
    one-GPU full forward (float32 model and cache; Triton's f32 dots may run as tf32: 2e-2, as test_parallel)."""
    import jax

    n = int(np.prod(list(mesh.values())))
    if jax.default_backend() != "gpu" or jax.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    cfg, params, seqs, full = setup
    plan = parallel.ParallelPlan(parallel.make_mesh(**mesh))
    kw = dict(backend="pallas", compiler_options=None, gmm_impl="pallas")
    out = run_schedule_parallel(params, cfg, seqs, SCHEDULE, plan=plan, **kw)
    assert len(out) == 17
    assert max(float(np.abs(got - full[r][pos]).max()) for r, pos, got in out) < 2e-2
