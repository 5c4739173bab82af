"""Engine: static-shape steps (compile counter), scheduler with preemption, sampling, generate, bad requests."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model
from mla_jax.engine import Engine, EngineConfig, generate
from mla_jax.sampling import SamplingParams
from tests.mla_jax.helpers import paged_config

# fp32 cache: exact comparisons with the full forward (a bf16 cache moves logits by ~1e-2, enough to flip
# MoE routing of random weights). One decode and one prefill bucket: every test on this config runs the same
# three step shapes (decode, prefill, mixed), compiled once for the module by the warm-up test (the first test);
# the step shapes' compiles are most of this file's time. Several buckets: test_no_recompiles_after_warmup here,
# test_soak's batch-invariant solo runs (outputs across buckets).
SMALL = dict(
    max_model_len=64,
    max_num_seqs=8,
    page_size=16,
    token_budget=64,
    max_prefills=2,
    decode_buckets=(8,),
    prefill_buckets=(64,),
    cache_dtype="fp32",
)
TIGHT_PAGES = 7  # 6 usable pages of 16 tokens: preemptions (the tests with a tight pool share its compiles)


@pytest.fixture(scope="module")
def tiny():
    cfg = paged_config(num_hidden_layers=2)
    params = model.init_params(cfg, jax.random.key(0), std=0.3)
    return cfg, params


def full_logits(params, cfg, ids):
    """The full-sequence forward's logits [len(ids), vocab] for one sequence, padded to max_model_len (causal:
    the padding is ignored; one compile for every length)."""
    padded = np.zeros((1, SMALL["max_model_len"]), np.int32)
    padded[0, : len(ids)] = ids
    return np.asarray(model.forward(params, cfg, jnp.asarray(padded)))[0, : len(ids)]


def greedy_reference(params, cfg, prompt, n):
    """Greedy decoding over the full-sequence forward."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(full_logits(params, cfg, ids)[-1])))
    return ids[len(prompt) :]


def test_full_warmup_leaves_nothing_to_compile(tiny):
    """warmup(all_shapes=True) compiles every step a greedy and plain-sampling workload can need (mixed prefill +
    decode steps included); with top_logprobs=True, filtered=True also the variants of top-k / top-p sampling
    (which sorts the vocabulary) and top logprobs, so that a workload using them compiles nothing either.

    First in the module, on a cleared compilation cache: the warm-ups compile every step shape of SMALL, which
    the later tests then reuse."""
    cfg, params = tiny
    jax.clear_caches()  # nothing compiled by an earlier test: each warm-up here compiles its steps itself
    rng = np.random.default_rng(3)
    sps = [
        SamplingParams(max_new_tokens=5),
        SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(max_new_tokens=4, temperature=1.0, top_k=5, seed=2, top_logprobs=2),
        SamplingParams(max_new_tokens=7, temperature=0.5, seed=3),
    ]
    for variants, workload in ((False, [sps[0], sps[3]]), (True, sps)):
        eng = Engine(params, cfg, EngineConfig(**SMALL))
        start = eng.counter.count
        eng.warmup(all_shapes=True, top_logprobs=variants, filtered=variants)
        before = eng.counter.count
        assert before - start >= (9 if variants else 3)  # the 3 step shapes (x 4 variants, 3 x 1 compiled before)
        for i, sp in enumerate(workload * 2):
            eng.add_request(rng.integers(0, cfg.vocab_size, int(rng.integers(1, 30))).tolist(), sp)
            if i % 3 == 0:
                eng.step()  # requests join while others decode: mixed steps
        eng.run()
        assert eng.counter.count == before, f"{eng.counter.count - before} steps compiled after the warm-up {variants=}"


def test_generate_greedy_equals_full_forward(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 23, 1, 40, 9, 17)]
    want = [greedy_reference(params, cfg, p, 6) for p in prompts]
    for kw in (dict(max_num_seqs=2, max_prefills=1), dict(max_num_seqs=8, token_budget=32)):
        outs = generate(params, cfg, prompts, SamplingParams(max_new_tokens=6), EngineConfig(**{**SMALL, **kw}))
        assert [o.token_ids for o in outs] == want
        assert all(o.finish_reason == "length" for o in outs)


def test_no_recompiles_after_warmup(tiny):
    """After warm-up of every decode bucket, 1,000 decode steps whose batch size changes every step compile
    nothing new."""
    cfg, params = tiny
    eng = Engine(params, cfg, EngineConfig(**{**SMALL, "decode_buckets": (1, 2, 4, 8)}))
    seconds = eng.warmup(prefill=False)
    print(f"warm-up compile of {len(eng.config.decode_buckets)} decode buckets: {seconds:.1f} s")
    before = eng.counter.count
    rng = np.random.default_rng(1)
    sizes = set()
    for _step in range(1000):
        # one-token prompts are decodes from their first step; vary the batch every step
        live = len(eng.scheduler.running) + len(eng.scheduler.waiting)
        target = int(rng.integers(1, 9))
        for _ in range(max(0, target - live)):
            eng.add_request(
                [int(rng.integers(0, cfg.vocab_size))], SamplingParams(max_new_tokens=int(rng.integers(1, 6)))
            )
        outs = eng.step()
        sizes.add(len(outs))
    assert len(sizes) >= 5
    assert eng.counter.count == before, f"{eng.counter.count - before} new compilations"


def test_sampling_controls(tiny):
    cfg, params = tiny
    prompt = list(range(1, 12))
    greedy = generate(params, cfg, [prompt], SamplingParams(max_new_tokens=8), EngineConfig(**SMALL))[0]
    for sp in (
        SamplingParams(temperature=1.5, top_k=1, max_new_tokens=8, seed=3),
        SamplingParams(temperature=1.5, top_p=1e-6, max_new_tokens=8, seed=4),
    ):
        assert generate(params, cfg, [prompt], sp, EngineConfig(**SMALL))[0].token_ids == greedy.token_ids
    hot = [SamplingParams(temperature=2.0, max_new_tokens=8, seed=s, logprobs=True) for s in (1, 1, 2)]
    a, b, c = generate(params, cfg, [prompt] * 3, hot, EngineConfig(**SMALL))
    assert a.token_ids == b.token_ids != c.token_ids  # per-request seeds
    assert a.token_ids != greedy.token_ids
    # logprobs are those of the raw model distribution at each sampled token
    lp = jax.nn.log_softmax(full_logits(params, cfg, prompt + a.token_ids), axis=-1)
    want = [float(lp[len(prompt) - 1 + t, tok]) for t, tok in enumerate(a.token_ids)]
    np.testing.assert_allclose(a.logprobs, want, atol=1e-4)
    # top-k restricts samples to the k most likely tokens
    k3 = generate(
        params, cfg, [prompt], SamplingParams(temperature=5.0, top_k=3, max_new_tokens=8, seed=9), EngineConfig(**SMALL)
    )[0]
    logits = np.asarray(full_logits(params, cfg, prompt + k3.token_ids))
    for t, tok in enumerate(k3.token_ids):
        assert tok in np.argsort(-logits[len(prompt) - 1 + t])[:3]


def test_stop_tokens(tiny):
    cfg, params = tiny
    prompt = [3, 1, 4, 1, 5]
    full = generate(params, cfg, [prompt], SamplingParams(max_new_tokens=10), EngineConfig(**SMALL))[0]
    stop = full.token_ids[3]
    first = full.token_ids.index(stop)
    out = generate(
        params, cfg, [prompt], SamplingParams(max_new_tokens=10, stop_token_ids=(stop,)), EngineConfig(**SMALL)
    )[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


def test_preemption_keeps_outputs(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(10, 30, 6)]
    sps = [SamplingParams(max_new_tokens=12, temperature=t, seed=i) for i, t in enumerate([0, 1, 0, 1, 0, 1])]
    roomy = generate(params, cfg, prompts, sps, EngineConfig(**SMALL))
    eng = Engine(params, cfg, EngineConfig(**{**SMALL, "num_pages": TIGHT_PAGES}))
    ids = [eng.add_request(p, s) for p, s in zip(prompts, sps)]
    final = eng.run()
    assert eng.scheduler.num_preemptions > 0
    assert [final[i].token_ids for i in ids] == [o.token_ids for o in roomy]
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages


@pytest.mark.parametrize(
    "prompt,sp,match",
    [
        ([], SamplingParams(), "empty prompt"),
        ([1, 2, 96], SamplingParams(), "token id 96 out of vocab"),
        ([1] * 60, SamplingParams(max_new_tokens=8), "exceeds max_model_len"),
        ([1, 2], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ],
)
def test_bad_requests_rejected_without_disturbing_others(tiny, prompt, sp, match):
    cfg, params = tiny
    eng = Engine(params, cfg, EngineConfig(**SMALL))
    good = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    eng.step()
    with pytest.raises(ValueError, match=match):
        eng.add_request(prompt, sp)
    final = eng.run()
    assert final[good].token_ids == greedy_reference(params, cfg, [5, 6, 7], 4)


def test_abort_waiting_and_running(tiny):
    cfg, params = tiny
    eng = Engine(params, cfg, EngineConfig(**SMALL))
    a = eng.add_request([1, 2, 3], SamplingParams(max_new_tokens=20))
    b = eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=4))
    c = eng.add_request([7, 8], SamplingParams(max_new_tokens=4))
    assert eng.abort(c)  # still waiting
    eng.step()
    eng.step()
    assert a in eng.pool
    assert eng.abort(a) and not eng.abort(a) and not eng.abort("unknown")
    assert a not in eng.pool
    eng.pool.check_invariants()
    final = eng.run()
    assert set(final) == {b} and final[b].token_ids == greedy_reference(params, cfg, [5, 6, 7], 4)
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
    assert eng.add_request([1, 2], SamplingParams(max_new_tokens=1), request_id=a) == a  # the id is free again


def test_top_logprobs(tiny):
    """top_logprobs = n gives the n most likely tokens of the raw distribution at each position; a request in the
    same step that asks for none is unaffected, and check_request rejects too many."""
    cfg, params = tiny
    prompt = list(range(1, 12))
    sp = SamplingParams(temperature=1.0, seed=5, max_new_tokens=6, top_logprobs=3)
    a, b = generate(params, cfg, [prompt, [5, 6, 7]], [sp, SamplingParams(max_new_tokens=4)], EngineConfig(**SMALL))
    assert b.top_logprobs is None and b.logprobs is None
    assert b.token_ids == greedy_reference(params, cfg, [5, 6, 7], 4)
    lp = np.asarray(jax.nn.log_softmax(full_logits(params, cfg, prompt + a.token_ids), axis=-1))
    assert len(a.top_logprobs) == len(a.token_ids) == len(a.logprobs)
    for t, (tok, top) in enumerate(zip(a.token_ids, a.top_logprobs)):
        row = lp[len(prompt) - 1 + t]
        want = np.argsort(-row)[:3]
        assert [i for i, _ in top] == want.tolist()
        np.testing.assert_allclose([v for _, v in top], row[want], atol=1e-4)
        np.testing.assert_allclose(a.logprobs[t], row[tok], atol=1e-4)
    eng = Engine(params, cfg, EngineConfig(**SMALL))
    with pytest.raises(ValueError, match="top_logprobs"):
        eng.check_request([1], SamplingParams(top_logprobs=21))
    assert eng.check_request((np.int32(3), 4), SamplingParams()) == [3, 4]


def test_async_scheduling_same_outputs_and_overlapped(tiny, monkeypatch):
    """Async scheduling (the default) returns exactly what synchronous scheduling does, through stops, length
    limits, preemptions, prefix-cache hits, top logprobs and an abort; and it reads each step's sampled ids only
    after launching the next step."""
    import mla_jax.engine as engine_mod

    cfg, params = tiny
    rng = np.random.default_rng(7)
    shared = rng.integers(0, cfg.vocab_size, 20).tolist()  # a common prefix: prefix-cache hits
    prompts = [shared + rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(1, 12, 6)]
    prompts += [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in (1, 3)]
    sps = [
        SamplingParams(max_new_tokens=int(m), temperature=t, top_k=k, top_p=p, seed=i, top_logprobs=lp)
        for i, (m, t, k, p, lp) in enumerate(
            [(9, 0, 0, 1, 0), (5, 1, 0, 1, 0), (12, 0.8, 5, 0.9, 2), (1, 0, 0, 1, 0), (7, 1, 0, 1, 0)]
            + [(10, 0, 0, 1, 0), (4, 0.5, 3, 1, 0), (8, 1, 0, 0.8, 1)]
        )
    ]
    sync_cfg = EngineConfig(
        **{**SMALL, "num_pages": TIGHT_PAGES, "enable_prefix_caching": True, "async_scheduling": False}
    )
    # request 0 stops on any of a quarter of the vocabulary: it ends early, with a row in flight
    sps[0] = SamplingParams(max_new_tokens=9, stop_token_ids=tuple(range(2, cfg.vocab_size, 4)))

    def run(async_scheduling):
        eng = Engine(params, cfg, dataclasses.replace(sync_cfg, async_scheduling=async_scheduling))
        reads = []  # (steps launched, step whose ids are read) at each read of sampled ids
        real = engine_mod.to_host
        monkeypatch.setattr(engine_mod, "to_host", lambda x: (reads.append(eng.steps), real(x))[1])
        ids = [eng.add_request(p, s) for p, s in zip(prompts, sps)]
        doomed = eng.add_request(prompts[1], SamplingParams(max_new_tokens=30, temperature=1, seed=99))
        final, steps = {}, 0
        while eng.has_unfinished:
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
            steps += 1
            if steps == 4:
                assert eng.abort(doomed)
        monkeypatch.setattr(engine_mod, "to_host", real)
        assert doomed not in final
        assert eng.pool.num_free_pages == eng.pool.num_usable_pages
        eng.pool.check_invariants()
        return [final[i] for i in ids], eng, reads[::2]  # two reads (ids, logprobs) per step

    want, eng_sync, reads_sync = run(False)
    got, eng_async, reads_async = run(True)
    assert eng_sync.scheduler.num_preemptions > 0 and eng_sync.scheduler.prefix_cache_hits > 0
    assert want[0].finish_reason == "stop" and len(want[0].token_ids) < 9
    for w, g in zip(want, got):  # the same ids; logprobs to float32 rounding (the batches differ, so sums' order)
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason)
        np.testing.assert_allclose(g.logprobs or [], w.logprobs or [], rtol=1e-5, atol=1e-5)
        assert (g.top_logprobs is None) == (w.top_logprobs is None)
        for gt, wt in zip(g.top_logprobs or [], w.top_logprobs or []):
            assert [i for i, _ in gt] == [i for i, _ in wt]
            np.testing.assert_allclose([v for _, v in gt], [v for _, v in wt], rtol=1e-5, atol=1e-5)
    assert reads_sync == list(range(1, len(reads_sync) + 1))  # sync: step k's ids read before step k+1 launches
    # async: step k's ids are read once step k+1 is launched (except when nothing was left to launch)
    assert sum(n == k + 2 for k, n in enumerate(reads_async)) >= len(reads_async) - 3


@pytest.mark.gpu
def test_gpu_engine_through_the_hopper_decode():
    """On the H200 with the default backend: 64 heads (>= attention.SM90_MIN_ROWS rows, so the Mosaic GPU decode
    kernel), page 64, a bf16 cache, prompts of odd lengths so that the packed step inputs' arrays would start
    off 256-byte boundaries (Mosaic GPU refuses such inputs: the V3 slice's engine crashed so before packed's
    alignment). Async and synchronous scheduling return the same ids; the decode kernel is the Hopper one."""
    from mla_jax import attention
    from pallas_kernels import mla_decode_sm90 as md90

    if jax.default_backend() != "gpu" or not md90.is_sm90():
        pytest.skip("needs a Hopper GPU")
    cfg = paged_config(
        num_hidden_layers=2, num_attention_heads=64, kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=32
    )
    params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16, std=0.3)
    be = attention.get_backend(attention.default_backend_name())
    q = jnp.zeros((3, 1, 64, 128 + 64), jnp.bfloat16)
    cache = jnp.zeros((8, 64, 128 + 64), jnp.bfloat16)
    bt, sl = jnp.zeros((3, 2), jnp.int32), jnp.ones((3,), jnp.int32)
    assert attention.pick(be.decode, q, cache, bt, sl, kv_lora_rank=128).name == "sm90"
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in (5, 37, 70)]
    sp = SamplingParams(max_new_tokens=12)
    ec = EngineConfig(max_model_len=256, max_num_seqs=4, page_size=64, token_budget=128, cache_dtype="bf16")
    outs = {}
    for async_scheduling in (True, False):
        got = generate(params, cfg, prompts, sp, dataclasses.replace(ec, async_scheduling=async_scheduling))
        outs[async_scheduling] = [o.token_ids for o in got]
    assert outs[True] == outs[False] and all(len(t) == 12 for t in outs[True])
