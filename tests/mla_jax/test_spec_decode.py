"""Speculative decoding (`mla_jax.spec_decode`): greedy outputs identical to plain decoding with both drafters
(batch sizes, chunked prefill, preemption), rollback of the page pool, zero recompiles in steady state, the MTP
drafts against the cache-free MTP forward, speculative sampling's exactness, and config errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model as M
from mla_jax import spec_decode
from mla_jax.engine import Engine, EngineConfig
from mla_jax.metadata import BatchShape, ScheduledRequest, build_metadata
from mla_jax.mtp import mtp_forward
from mla_jax.sampling import SamplingArrays, SamplingParams, filtered_logprobs
from mla_jax.spec_decode import NgramDrafter, accept
from pallas_kernels.util import cdiv
from tests.mla_jax.helpers import tiny_config
from tests.mla_jax.multihost_worker import fast_jit

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    # Dense (MoE compiles slower; the MTP layer's MoE path is the same `decoder_layers` code, test_mtp covers it).
    cfg = tiny_config(num_hidden_layers=1, vocab_size=VOCAB, num_nextn_predict_layers=1, n_routed_experts=None)
    return cfg, M.init_params(cfg, jax.random.key(0))


def _config(**kw):
    # One decode and one prefill bucket: every run here shares a few compiled shapes. 12 pages of 8 cannot hold
    # the four requests at once: preemption. token_budget 24 < the 30-token prompt: chunked prefill.
    base = dict(
        max_model_len=64,
        max_num_seqs=4,
        page_size=8,
        num_pages=12,
        token_budget=24,
        max_prefills=2,
        decode_buckets=(4,),
        prefill_buckets=(24,),
        cache_dtype="fp32",
    )
    return EngineConfig(**(base | kw))


def _prompts(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for L in (30, 5, 11, 3)[:n]:  # repeated halves: matches for the n-gram drafter
        half = rng.integers(0, VOCAB, size=max(1, L // 2)).tolist()
        out.append((half * 3)[:L])
    return out


def _run(engine, prompts, sp, on_step=None):
    """Steps to the end, checking after every step that each running request without a step in flight holds
    exactly the pages of its computed tokens (what a run without speculation holds); one with a step in flight
    (async) at most the rows of that step's drafts and their worst-case successors more. Returns the final
    outputs in prompt order."""
    ids = [engine.add_request(p, sp) for p in prompts]
    final = {}
    G, k = engine.pool.page_size, engine.spec_k
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        engine.pool.check_invariants()
        for r in engine.scheduler.running:
            held = engine.pool.num_tokens(r.request_id)
            if r.num_pending:
                assert r.num_computed_tokens <= held <= r.num_computed_tokens + 2 * k
            else:
                assert held == r.num_computed_tokens
            assert len(engine.pool.pages(r.request_id)) == cdiv(held, G)
        if on_step:
            on_step(engine)
    assert engine.pool.num_free_pages == engine.pool.num_usable_pages
    return [final[i] for i in ids]


@pytest.fixture(scope="module")
def reference(model):
    cfg, params = model
    sp = SamplingParams(max_new_tokens=14)
    eng = Engine(params, cfg, _config())
    out = _run(eng, _prompts(4), sp)
    assert eng.scheduler.num_preemptions > 0
    return sp, out


@pytest.mark.parametrize("method,k,async_scheduling", [("ngram", 3, False), ("mtp", 2, False), ("mtp", 2, True)])
def test_greedy_identical_batch_sizes_preemption_chunked_prefill(model, reference, method, k, async_scheduling):
    """Token-for-token the plain run's outputs at batch 4 (with preemption and chunked prefill), 2 and 1; no
    compile after warm-up; with MTP, the first draft after each step is the cache-free MTP forward's argmax at
    the last computed position (the paged MTP layer, its cache layer and slots are right). Async MTP steps take
    their rows from the step in flight on the device (`spec_decode.follow_prev`): the drafts the host sees are
    placeholders then, so the draft check runs synchronously."""
    cfg, params = model
    sp, ref = reference
    kw = dict(num_speculative_tokens=k, speculative_method=method, async_scheduling=async_scheduling)
    eng = Engine(params, cfg, _config(**kw))
    assert eng.async_scheduling == async_scheduling
    eng.warmup(all_shapes=True)
    before = eng.counter.count
    seen = []  # (request index, tokens so far, first draft)
    in_flight = []  # async: requests seen with a step in flight

    def record(e):
        seen.extend(
            (r.request_id, r.num_tokens, r.draft_token_ids[0])
            for r in e.scheduler.running
            if r.draft_token_ids and not r.num_pending
        )
        in_flight.extend(r.request_id for r in e.scheduler.running if r.num_pending)

    got = _run(eng, _prompts(4), sp, record)
    assert bool(in_flight) == async_scheduling
    assert eng.counter.count == before, "speculative steps compiled after warm-up"
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert eng.scheduler.num_preemptions > 0
    assert eng.num_draft_tokens > 0 and 0 <= eng.acceptance_rate <= 1
    assert sum(o.num_draft_tokens for o in got) <= eng.num_draft_tokens  # preempted requests' drafts count too
    for n in (1, 2):  # smaller batches (same compiled shapes)
        e = Engine(params, cfg, _config(**kw))
        assert [o.token_ids for o in _run(e, _prompts(4)[-n:], sp)] == [o.token_ids for o in ref[-n:]]
    if method != "mtp" or async_scheduling:
        return
    full = [p + o.token_ids for p, o in zip(_prompts(4), got)]
    S = max(len(t) for t in full)
    ids = jnp.asarray([t + [0] * (S - len(t)) for t in full], jnp.int32)
    want = np.asarray(jnp.argmax(mtp_forward(params, cfg, ids, M.forward_hidden(params, cfg, ids)), -1))
    match = [want[i, n - 2] == d for i, n, d in seen]  # row p predicts token p+2
    assert len(match) > 10 and np.mean(match) > 0.95, np.mean(match)  # fp32; a rare near-tie may flip


def test_async_mtp_abort_in_flight(model, reference):
    """A request aborted while its speculative step is in flight (async MTP): the step's outputs for it are
    dropped, its pages go back, and the other requests' greedy outputs are still the plain run's."""
    cfg, params = model
    sp, ref = reference
    eng = Engine(params, cfg, _config(num_speculative_tokens=2, speculative_method="mtp"))
    ids = [eng.add_request(p, sp) for p in _prompts(4)]
    final = {}
    while not any(r.request_id == ids[1] and r.num_pending for r in eng.scheduler.running):
        final |= {o.request_id: o for o in eng.step() if o.finished}
    assert eng.abort(ids[1])
    while eng.has_unfinished:
        for o in eng.step():
            assert o.request_id != ids[1]
            if o.finished:
                final[o.request_id] = o
        eng.pool.check_invariants()
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
    assert ids[1] not in final
    assert [final[i].token_ids for i in ids if i != ids[1]] == [o.token_ids for i, o in zip(ids, ref) if i != ids[1]]


def test_async_mtp_to_max_model_len(model):
    """A request that fills max_model_len exactly (prompt + max_new_tokens = 64): async MTP steps near its end
    verify rows past the last position that matters, which must write nowhere and read nothing (the page
    allocation stops at max_model_len); the output is the plain run's."""
    cfg, params = model
    prompt, sp = _prompts(1)[0], SamplingParams(max_new_tokens=34)
    assert len(prompt) + sp.max_new_tokens == _config().max_model_len
    want = _run(Engine(params, cfg, _config()), [prompt], sp)[0].token_ids
    eng = Engine(params, cfg, _config(num_speculative_tokens=2, speculative_method="mtp"))
    got = _run(eng, [prompt], sp)[0].token_ids
    assert got == want and len(got) == sp.max_new_tokens


def _small_vocab_model():
    """A 4-token vocabulary: a random MTP layer's drafts are often accepted, so async rows really move."""
    cfg = tiny_config(num_hidden_layers=1, vocab_size=4, num_nextn_predict_layers=1, n_routed_experts=None)
    return cfg, M.init_params(cfg, jax.random.key(1))


def test_async_mtp_soak(model):
    """120 greedy requests of random prompt and output lengths (some with a stop token) arriving over time through
    async MTP steps in a pool small enough to preempt, a random running request aborted now and then (often with
    its step in flight): every request that was not aborted ends with the plain run's tokens, the page pool's
    invariants hold after every step and every page is free at the end. (The lifecycle under load; the rows that
    accepted drafts move are checked where drafts are often accepted: the demo and small-vocabulary tests.)"""
    cfg, params = model
    rng = np.random.default_rng(3)
    reqs = []
    for _ in range(120):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 31))).tolist()
        stop = (int(rng.integers(0, VOCAB)),) if rng.random() < 0.3 else ()
        reqs.append((prompt, SamplingParams(max_new_tokens=int(rng.integers(1, 21)), stop_token_ids=stop)))
    plain = Engine(params, cfg, _config())
    ids = [plain.add_request(p, sp) for p, sp in reqs]
    done = plain.run()
    want = [done[i].token_ids for i in ids]

    eng = Engine(params, cfg, _config(num_speculative_tokens=2, speculative_method="mtp"))
    pending, rid_of, final, aborted = list(range(len(reqs))), {}, {}, set()
    while pending or eng.has_unfinished:
        for _ in range(int(rng.integers(0, 3))):
            if pending:
                i = pending.pop(0)
                rid_of[eng.add_request(*reqs[i])] = i
        running = [r.request_id for r in eng.scheduler.running]
        if running and rng.random() < 0.05:
            rid = running[int(rng.integers(len(running)))]
            assert eng.abort(rid)
            aborted.add(rid_of[rid])
        for o in eng.step():
            if o.finished:
                final[rid_of[o.request_id]] = o.token_ids
        eng.pool.check_invariants()
    assert eng.scheduler.num_preemptions > 5 and len(aborted) > 2 and eng.num_accepted_tokens > 0
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages and not eng.pool.request_ids
    assert sorted(final) == sorted(set(range(len(reqs))) - aborted)
    bad = [i for i in final if final[i] != want[i]]
    assert not bad, f"{len(bad)} requests differ from the plain run, e.g. {bad[:5]}"


def test_async_mtp_sampled_as_sync():
    """Sampled speculative steps (temperature 1, a seed per request) give the same tokens with and without async
    scheduling: an async row's sampling position (its seed's fold-in) moves with the accepted drafts of the step
    it follows, as the synchronous host would have placed it. Pages for all (no preemption), so that both
    schedules verify the same drafts, up to the last k tokens (which sampled token a row gives depends on whether
    it had a draft): near max_new_tokens an async step may verify drafts whose outputs turn out to be past it."""
    cfg, params = _small_vocab_model()
    prompts = [[int(t) % 4 for t in p] for p in _prompts(4)]
    n, k = 16, 2
    sps = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=s) for s in range(4)]
    outs = []
    for a in (False, True):
        ec = _config(num_pages=64, num_speculative_tokens=k, speculative_method="mtp", async_scheduling=a)
        eng = Engine(params, cfg, ec)
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, sps)]
        final = eng.run()
        outs.append([final[i].token_ids[: n - k - 1] for i in ids])
        assert eng.scheduler.num_preemptions == 0 and eng.num_accepted_tokens > 5
    assert outs[0] == outs[1]


def test_follow_prev_rows_from_the_step_in_flight():
    """`follow_prev` against rows worked out by hand: decodes whose last step is in flight take row 0's input from
    that step's last output, rows 1..m from its drafts, positions / slots / seq_lens / sampling positions moved by
    its accepted drafts (the carry's entries in any order), rows at or past the pages' capacity written nowhere
    and attending nothing; a decode without a step in flight and the prefill rows are the host's."""
    G, k, Q = 4, 2, 3
    S = 6  # carry entries
    rng = np.random.default_rng(0)
    carry = spec_decode.SpecCarry(
        rng.integers(1, VOCAB, (S, Q)).astype(np.int32),
        np.array([1, 3, 2, 1, 3, 2], np.int32),
        rng.integers(1, VOCAB, (S, k)).astype(np.int32),
    )
    # (host's computed tokens n, drafts m, pages, prev entry); pages are distinct, shuffled
    pages = rng.permutation(30).tolist()
    decodes = [(5, 2, pages[0:3], 1), (9, 1, pages[3:7], 4), (2, 2, pages[7:9], -1), (6, 2, pages[9:12], 2)]
    reqs = [ScheduledRequest([0] * (1 + m), n, pg) for n, m, pg, _ in decodes]
    reqs.append(ScheduledRequest(list(range(1, 6)), 3, pages[12:14]))  # a prefill chunk
    shape = BatchShape(
        num_decodes=4,
        decode_query_len=Q,
        num_prefills=1,
        num_prefill_tokens=8,
        max_pages=4,
        workspace_rows=16,
        max_chunks=1,
    )
    kw = dict(page_size=G, num_pages=32, shape=shape, is_decode=[True] * 4 + [False], workspace_rows=16)
    md, order = build_metadata(reqs, **kw)
    assert order == [0, 1, 2, 3, 4]
    spec = spec_decode.SpecArrays.empty(shape)
    spec.prev_entry[:] = [e for *_, e in decodes]
    spec.capacity[:4] = [len(pg) * G for _, _, pg, _ in decodes]
    spec.capacity[3] = 9  # request 3 (n 6, 1 accepted: rows at 7, 8, 9): its row at 9 writes nowhere
    pos = list(range(shape.num_logits))
    sampling = SamplingArrays.build([SamplingParams()] * shape.num_logits, pos, shape.num_logits)
    dev = lambda t: jax.tree.map(jnp.asarray, t)  # noqa: E731
    got_md, got_s = spec_decode.follow_prev(dev(md), dev(sampling), dev(spec), dev(carry), G)
    ids, positions = np.asarray(got_md.input_ids), np.asarray(got_md.positions)
    slots, seq = np.asarray(got_md.slot_mapping), np.asarray(got_md.decode.seq_lens)
    for b, (n, m, pg, e) in enumerate(decodes):
        a = int(carry.num_out[e]) - 1 if e >= 0 else 0
        for j in range(Q):
            t = b * Q + j
            assert np.asarray(got_s.position)[t] == pos[t] + a
            if j > m:  # padding row
                assert slots[t] == -1 and seq[b, j] == 0
                continue
            p = n + a + j
            assert positions[t] == p
            if e < 0:
                assert ids[t] == 0 and slots[t] == md.slot_mapping[t] and seq[b, j] == md.decode.seq_lens[b, j]
                continue
            assert ids[t] == (carry.tokens[e, a] if j == 0 else carry.drafts[e, j - 1])
            live = p < spec.capacity[b]
            assert slots[t] == (pg[p // G] * G + p % G if live else -1), (b, j)
            assert seq[b, j] == (p + 1 if live else 0), (b, j)
    Td = shape.num_decode_tokens
    for name in ("input_ids", "positions", "slot_mapping"):
        np.testing.assert_array_equal(np.asarray(getattr(got_md, name))[Td:], getattr(md, name)[Td:])
    np.testing.assert_array_equal(np.asarray(got_s.position)[Td:], pos[Td:])


def test_ngram_drafter():
    d = NgramDrafter(3, min_n=1, max_n=3)
    assert d.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]  # suffix [1, 2, 3] seen at 0
    assert d.propose([5, 6, 7, 5, 6]) == [7, 5, 6]
    assert d.propose([9, 8, 7]) == []
    assert d.propose([1, 2, 1, 3, 1]) == [3, 1]  # the latest occurrence of [1]; fewer than k left


def test_speculative_sampling_preserves_the_target_distribution():
    """Seeded statistical test on a vocab of 6: the first output token is distributed as the target's filtered
    distribution p_0 whatever the draft, and, given the draft was accepted, the next one as p_1."""
    V, E, K = 6, 10000, 3
    rng = np.random.default_rng(0)
    logits = np.broadcast_to(rng.normal(size=(1, K, V)) * 1.5, (E, K, V)).astype(np.float32)
    drafts = np.stack([np.full(E, 2), np.full(E, 4)], axis=1).astype(np.int32)  # a fixed, deterministic draft
    sp = [SamplingParams(temperature=0.8, top_k=5, top_p=0.95, seed=7)] * (E * K)
    pos = (np.arange(E)[:, None] * 10 + np.arange(K)[None, :]).reshape(-1).tolist()  # distinct (seed, position)
    s = SamplingArrays.build(sp, pos, E * K)
    tokens, num_out, _ = accept(jnp.asarray(logits), jnp.asarray(drafts), jnp.full(E, 2, jnp.int32), s)
    tokens, num_out = np.asarray(tokens), np.asarray(num_out)
    p = np.exp(np.asarray(filtered_logprobs(jnp.asarray(logits[0]), SamplingArrays.build(sp[:K], [0] * K, K))))

    def close(f, q, n):  # within 4 standard errors per token
        assert np.all(np.abs(f - q) <= 4 * np.sqrt(q * (1 - q) / n) + 1e-4), (f, q)

    close(np.bincount(tokens[:, 0], minlength=V) / E, p[0], E)
    acc = num_out >= 2
    assert abs(acc.mean() - p[0, 2]) < 0.01
    close(np.bincount(tokens[acc, 1], minlength=V) / acc.sum(), p[1], acc.sum())
    # Greedy rows: longest matching prefix + the target's token.
    g = SamplingArrays.build([SamplingParams()] * 3, [0, 1, 2], 3)
    lg = np.full((1, 3, V), -5.0, np.float32)
    lg[0, 0, 2], lg[0, 1, 3], lg[0, 2, 1] = 1, 1, 1  # target: 2, then 3, then 1
    t, n, _ = accept(jnp.asarray(lg), jnp.asarray([[2, 4]], jnp.int32), jnp.asarray([2], jnp.int32), g)
    assert int(n[0]) == 2 and np.asarray(t)[0, :2].tolist() == [2, 3]


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(num_speculative_tokens=5, speculative_method="mtp"), "num_speculative_tokens must be an int in"),
        (dict(num_speculative_tokens=0, speculative_method="ngram"), "num_speculative_tokens must be an int in"),
        (dict(num_speculative_tokens=2), "speculative_method must be one of"),
        (dict(num_speculative_tokens=2, speculative_method="eagle"), "speculative_method must be one of"),
    ],
)
def test_bad_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw).resolved()


def test_mtp_without_weights_and_top_logprobs_errors(model):
    cfg, params = model
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=0)
    params = {**params, "model": {k: v for k, v in params["model"].items() if k != M.MTP_GROUP}}
    with pytest.raises(ValueError, match="speculative_method='mtp' needs MTP weights"):
        Engine(params, cfg, _config(num_speculative_tokens=1, speculative_method="mtp"))
    eng = Engine(params, cfg, _config(num_speculative_tokens=1, speculative_method="ngram"))
    with pytest.raises(ValueError, match="top_logprobs is not supported with speculative decoding"):
        eng.add_request([1, 2], SamplingParams(top_logprobs=2))


def _demo_greedy_identical(batches, methods, min_acceptance=0.0):
    """The shipped demo model (float32, xla backend: the same arithmetic with and without speculation): greedy
    outputs of each (method, k, async scheduling) identical to plain decoding's; the acceptance rates printed."""
    import os

    from tokenizers import Tokenizer

    from mla_jax.checkpoint import eos_token_ids, load_model
    from mla_jax.demo import DEMO_DIR

    cfg, params = load_model(DEMO_DIR, dtype=jnp.float32)
    tok = Tokenizer.from_file(os.path.join(DEMO_DIR, "tokenizer.json"))
    texts = ["import os\n\n\ndef list_python_files(root):", "class Stack:\n    def push(self, item):", "def f(x):"]
    prompts = [tok.encode(t).ids for t in texts]
    sp = SamplingParams(max_new_tokens=48, stop_token_ids=tuple(eos_token_ids(DEMO_DIR)))
    kw = dict(max_model_len=128, page_size=16, token_budget=128, max_prefills=3, cache_dtype="fp32", backend="xla")
    methods = [m for m in methods if m[0] != "mtp" or cfg.num_mtp_layers]
    for B in batches:
        ref = [o.token_ids for o in _gen(params, cfg, prompts[:B], sp, EngineConfig(max_num_seqs=B, **kw))]
        for method, k, async_scheduling in methods:
            spec = dict(num_speculative_tokens=k, speculative_method=method, async_scheduling=async_scheduling)
            eng = Engine(params, cfg, EngineConfig(max_num_seqs=B, **spec, **kw))
            got = _run(eng, prompts[:B], sp)
            assert [o.token_ids for o in got] == ref, (method, B)
            print(f"demo B={B} {method} k={k} async {async_scheduling}: acceptance rate {eng.acceptance_rate:.3f}")
            assert eng.acceptance_rate >= min_acceptance


def test_demo_model_async_mtp_greedy_identical():
    """Async MTP steps on a model whose drafts are often accepted (the demo's trained MTP layer: ~0.3 at batch
    3), so that the rows taken from the step in flight (`follow_prev`) move by accepted drafts."""
    _demo_greedy_identical((3,), [("mtp", 2, True)], min_acceptance=0.15)


@pytest.mark.gpu
def test_demo_model_greedy_identical_and_acceptance():
    """Both drafters, MTP synchronously and not, at batch 1 and 3 (-s prints the acceptance rates)."""
    _demo_greedy_identical((1, 3), [("ngram", 3, False), ("mtp", 2, False), ("mtp", 2, True)])


def _gen(params, cfg, prompts, sp, ec):
    return _run(Engine(params, cfg, ec), prompts, sp)


def test_mtp_layers_chain_as_vllm(model, reference, monkeypatch):
    """Two MTP layers, k = 3: draft i comes from MTP layer i % 2 (vLLM's `spec_step_idx % num_mtp_layers`), each
    with its own cache layer. Layer 1's shared_head.norm is zeroed, so its logits are all 0 and its draft is token
    0: every second draft is 0, the first and third (layer 0 again) are not constant; greedy outputs are the
    plain run's."""
    monkeypatch.setattr(spec_decode, "spec_step", fast_spec_step())
    cfg, params = model
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=2)
    mtp = jax.tree.map(lambda a: jnp.concatenate([a, a]), params["model"][M.MTP_GROUP])  # the module's layer, twice
    w = mtp["shared_head"]["norm"]["weight"]
    mtp = {**mtp, "shared_head": {**mtp["shared_head"], "norm": {"weight": w.at[1].set(0.0)}}}
    params = {**params, "model": {**params["model"], M.MTP_GROUP: mtp}}
    sp, ref = reference
    eng = Engine(params, cfg, _config(num_speculative_tokens=3, speculative_method="mtp", async_scheduling=False))
    seen = []
    got = _run(eng, _prompts(4)[2:], sp, lambda e: seen.extend(list(r.draft_token_ids) for r in e.scheduler.running))
    assert [o.token_ids for o in got] == [o.token_ids for o in ref[2:]]  # two prompts: two compiled shapes
    N = cfg.num_hidden_layers
    assert eng.cache.num_layers == N + 2
    kv = np.asarray(eng.cache.kv_c_and_k_pe_cache)
    assert np.abs(kv[N]).sum() > 0 and np.abs(kv[N + 1]).sum() > 0  # both MTP layers wrote their cache layer
    drafts = np.asarray([d for d in seen if len(d) == 3])
    assert len(drafts) > 5 and (drafts[:, 1] == 0).all()
    assert len(set(drafts[:, 0].tolist())) > 1 and len(set(drafts[:, 2].tolist())) > 1


def fast_spec_step():
    """`spec_decode.spec_step` recompiled at XLA optimisation level 0 (compile time of the extra models here)."""
    return fast_jit(spec_decode.spec_step, static_argnames=SPEC_STATIC, donate_argnames=("cache",))


SPEC_STATIC = ("cfg", "backend", "plan", "batch_invariant", "gmm_impl", "num_speculative_tokens", "method")


def test_mesh_mtp_chain_matches_one_device(monkeypatch):
    """TP2 x DCP2 x EP2 (8 virtual CPU devices): the speculative step runs on the mesh (`spec_step`'s manual
    computations), the MoE MTP layers (two, chained) split like the target's layers, their cache layers split
    by tokens. Output tokens and the drafts after every step are those of the one-device run with the same
    (virtual) page size (fp32; the mesh only reorders sums), synchronously; asynchronously the same tokens. The
    page size matters to MTP layer 1, whose cache holds only the rows its passes wrote below each request's page
    capacity."""
    from mla_jax import parallel
    from tests.mla_jax.multihost_worker import engine_config, parallel_config, prompts, random_params

    monkeypatch.setattr(spec_decode, "spec_step", fast_spec_step())
    cfg = parallel_config(num_nextn_predict_layers=2)
    params = random_params(cfg, 1, std=0.3)
    ps, n = prompts(cfg)[:3], 6
    plan = parallel.ParallelPlan(parallel.make_mesh(tp=2, dcp=2, ep=2))
    ec = dataclasses.replace(engine_config(), num_speculative_tokens=2, speculative_method="mtp")
    sync = dataclasses.replace(ec, async_scheduling=False)  # the host sees each step's drafts
    runs = []
    for pl, c in ((None, dataclasses.replace(sync, page_size=ec.page_size * plan.dcp)), (plan, sync), (plan, ec)):
        eng = Engine(params, cfg, c, plan=pl)
        seen = []
        out = _run(eng, ps, SamplingParams(max_new_tokens=n), lambda e: seen.append(_drafts(e)))
        assert eng.cache.num_layers == cfg.num_hidden_layers + 2
        runs.append(([o.token_ids for o in out], seen, eng.num_accepted_tokens))
    (one, one_drafts, one_acc), (mesh, mesh_drafts, mesh_acc), (mesh_async, _, async_acc) = runs
    assert one == mesh == mesh_async  # async: each step's rows from the last one's outputs on the mesh
    assert mesh_drafts == one_drafts and sum(len(d) for step in one_drafts for d in step) > 20
    assert one_acc == mesh_acc == async_acc


def _drafts(engine):
    return [list(r.draft_token_ids) for r in sorted(engine.scheduler.running, key=lambda r: r.request_id)]


def test_sparse_v32_ngram_greedy_identical(monkeypatch):
    """DeepSeek-V3.2 (sparse attention, index_topk 8 below the sequence lengths): the n-gram drafter's verify
    rows (k + 1 = 4 query rows per request, each scored by the indexer and attended sparsely at its own
    position) give the plain run's greedy tokens, with drafts accepted; MTP is refused with a clear error."""
    from mla_jax import step
    from tests.mla_jax.helpers import paged_config
    from tests.mla_jax.multihost_worker import fast_engine_step, random_params

    monkeypatch.setattr(step, "engine_step", fast_engine_step())
    monkeypatch.setattr(spec_decode, "spec_step", fast_spec_step())
    cfg = paged_config(
        model_type="deepseek_v32",
        index_topk=8,
        index_n_heads=4,
        index_head_dim=32,
        num_hidden_layers=1,
        n_routed_experts=None,
        vocab_size=VOCAB,
    )
    params = random_params(cfg, 2, std=0.2)
    ps = [p for p in _prompts(3) if len(p) > 8][:2]  # both fit the first step: two compiled shapes each
    sp = SamplingParams(max_new_tokens=16)
    ec = _config(cache_dtype="fp32")
    plain = _run(Engine(params, cfg, ec), ps, sp)
    eng = Engine(params, cfg, dataclasses.replace(ec, num_speculative_tokens=3, speculative_method="ngram"))
    got = _run(eng, ps, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert eng.num_accepted_tokens > 0
    with pytest.raises(ValueError, match="sparse attention, whose MTP layers are not loaded"):
        Engine(params, cfg, dataclasses.replace(ec, num_speculative_tokens=1, speculative_method="mtp"))
