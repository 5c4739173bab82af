"""Prefix caching: chain hashes, reference counts, LRU eviction, pinning (allocator, with a hypothesis state machine
that tracks page contents), and through the engine: outputs identical with and without caching, cached prefixes
prefilled only past the hit, no page ever written while shared or cached, preemption and eviction."""

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mla_jax import model
from mla_jax.allocator import OutOfPages, PagePool, hash_page, page_hashes
from mla_jax.engine import Engine, EngineConfig
from mla_jax.sampling import SamplingParams
from tests.mla_jax.helpers import paged_config


def _snapshot(pool):
    return (
        sorted(pool._free),
        {r: list(p) for r, p in pool._pages.items()},
        dict(pool._tokens),
        list(pool._ref),
        dict(pool._hash_to_page),
        list(pool._evictable),
    )


def _admit(pool, rid, tokens, upto=None):
    """Looks up the cached prefix of `tokens` (leaving the last token to compute) and allocates `upto` tokens."""
    G = pool.page_size
    hashes = page_hashes(tokens, G)
    hits = pool.cached_prefix(hashes[: (len(tokens) - 1) // G])
    pool.allocate(rid, len(tokens) if upto is None else upto, cached_pages=hits)
    return hits, hashes


def _register(pool, rid, hashes, n_full):
    return [pool.cache_page(rid, i, hashes[i]) for i in range(n_full)]


def test_page_hashes_chain():
    a = list(range(10))
    h = page_hashes(a, 4)
    assert len(h) == 2  # the partial third page has no hash
    assert h[0] == hash_page(None, [0, 1, 2, 3]) and h[1] == hash_page(h[0], [4, 5, 6, 7])
    assert page_hashes(a, 4, h[:1]) == h and page_hashes(a + [10, 11], 4, h)[:2] == h
    # the same page after a different prefix hashes differently; ids are not confused with their bytes
    assert page_hashes([9, 9, 9, 9, 4, 5, 6, 7], 4)[1] != h[1]
    assert hash_page(None, [1, 0]) != hash_page(None, [256])


def test_shared_pages_reference_counted_and_kept_after_free():
    pool = PagePool(10, 4, enable_prefix_caching=True)  # 9 usable
    prompt = list(range(10))
    hits, hashes = _admit(pool, "a", prompt)
    assert hits == [] and pool.pages("a") == [1, 2, 3]
    assert _register(pool, "a", hashes, 2) == [True, True]
    with pytest.raises(ValueError, match="not full"):
        pool.cache_page("a", 2, b"x")
    pool.check_invariants()
    # b starts with the same 2 pages: shares them, its third page is its own
    hits, _ = _admit(pool, "b", prompt + [99])
    assert hits == [1, 2] and pool.pages("b")[:2] == [1, 2] and pool.pages("b")[2] not in (1, 2, 3)
    assert pool.ref_count(1) == pool.ref_count(2) == 2 and pool.ref_count(pool.pages("b")[2]) == 1
    pool.check_invariants()
    pool.free("a")
    assert pool.ref_count(1) == 1 and pool.num_evictable_pages == 0  # still held by b
    pool.free("b")
    # the cached pages stay (evictable, counted as free); the uncached ones went back to the free list
    assert pool.num_cached_pages == 2 and pool.num_evictable_pages == 2
    assert pool.num_free_pages == pool.num_usable_pages
    pool.check_invariants()
    # a prompt that is exactly the cached pages still computes its last token: only the first page is a hit
    hits, _ = _admit(pool, "c", prompt[:8])
    assert hits == [1] and len(pool.pages("c")) == 2 and pool.pages("c")[1] != 2
    pool.check_invariants()


def test_eviction_is_lru_and_never_takes_held_pages():
    pool = PagePool(7, 2, enable_prefix_caching=True)  # 6 usable pages of 2 tokens
    for rid, toks in (("a", [1, 2, 3, 4]), ("b", [5, 6, 7, 8])):
        _, hashes = _admit(pool, rid, toks)
        _register(pool, rid, hashes, 2)
    pool.free("a")  # pages 2, 1 become evictable (tail first: the tail is evicted first)
    pool.free("b")  # then 4, 3
    assert list(pool._evictable) == [2, 1, 4, 3]
    hits, _ = _admit(pool, "c", [5, 6, 7, 8, 0])  # pins b's two pages again
    assert hits == [3, 4] and len(pool.pages("c")) == 3
    # c's third page came from the never-cached free list; d takes the last one, then evicts a's, tail first
    assert pool.allocate("d", 6) == [6, 2, 1] and pool.num_evictions == 2
    assert pool.cached_prefix(page_hashes([1, 2, 3, 4], 2)) == []  # a's prefix is gone
    with pytest.raises(OutOfPages):
        pool.allocate("e", 1)  # everything left is held: c's shared pages are never evicted
    pool.check_invariants()


def test_allocate_with_cached_pages_is_atomic():
    pool = PagePool(6, 4, enable_prefix_caching=True)  # 5 usable
    _, hashes = _admit(pool, "a", list(range(8)))
    _register(pool, "a", hashes, 2)
    pool.free("a")  # 2 evictable
    pool.allocate("x", 8)  # 2 of the 3 never-cached free pages: 1 free + 2 evictable left
    before = _snapshot(pool)
    hits = pool.cached_prefix(hashes)
    # the 2 hits are evictable now but stop being free once pinned: 1 page free for the other 3 needed
    with pytest.raises(OutOfPages) as e:
        pool.allocate("b", 20, cached_pages=hits)
    assert (e.value.needed, e.value.free) == (3, 1)
    assert _snapshot(pool) == before
    with pytest.raises(ValueError, match="not in the prefix cache"):
        pool.allocate("b", 8, cached_pages=[5])
    with pytest.raises(ValueError, match="do not fill"):
        pool.allocate("b", 7, cached_pages=hits)
    assert _snapshot(pool) == before
    pool.allocate("b", 12, cached_pages=hits)
    assert pool.pages("b")[:2] == hits and pool.num_free_pages == 0
    pool.check_invariants()


def test_duplicate_content_stays_private_and_reset():
    pool = PagePool(8, 4, enable_prefix_caching=True)
    toks = list(range(9))
    _, ha = _admit(pool, "a", toks)
    _, hb = _admit(pool, "b", toks)  # admitted before a's pages were registered: no hit, its own copies
    assert _register(pool, "a", ha, 2) == [True, True]
    assert _register(pool, "b", hb, 2) == [False, False]
    assert pool.num_cached_pages == 2
    pool.free("b")
    pool.free("a")
    assert pool.num_evictable_pages == 2 and pool.num_free_pages == pool.num_usable_pages
    assert pool.reset_prefix_cache() == 2 and pool.num_cached_pages == 0
    assert pool.cached_prefix(ha) == []
    pool.check_invariants()
    off = PagePool(8, 4)
    off.allocate("a", 8)
    assert off.cache_page("a", 0, ha[0]) is False and off.cached_prefix(ha) == []
    off.check_invariants()


def test_check_invariants_catches_corruption():
    pool = PagePool(8, 4, enable_prefix_caching=True)
    _, h = _admit(pool, "a", list(range(9)))
    _register(pool, "a", h, 2)
    pool.check_invariants()
    pool._ref[1] += 1
    with pytest.raises(AssertionError, match="ref count"):
        pool.check_invariants()
    pool._ref[1] -= 1
    pool._pages["b"] = [3]  # a's uncached, still written page shared with another request
    pool._tokens["b"] = 4
    pool._ref[3] += 1
    with pytest.raises(AssertionError, match="writes into cached page|not cached"):
        pool.check_invariants()


class PrefixPoolMachine(RuleBasedStateMachine):
    """Requests from a few token sequences with common prefixes are admitted with cache lookups, grow token by
    token, register their full pages, and finish, in random order over a small pool. A shadow of every page's
    content checks that a cache hit hands out exactly the tokens the request needs and that no request writes a
    page another request can read."""

    G = 2
    SEQS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6, 0, 0, 0], [7, 7, 7, 7, 7]]

    def __init__(self):
        super().__init__()
        self.pool = PagePool(9, self.G, enable_prefix_caching=True)
        self.reqs = {}  # rid -> [tokens, computed, hashes]
        self.content = {}  # page -> tuple of token ids written there
        self.next_id = 0

    @rule(seq=st.integers(0, len(SEQS) - 1), extra=st.integers(0, 3))
    def admit(self, seq, extra):
        toks = self.SEQS[seq][: len(self.SEQS[seq]) - extra]
        rid = self.next_id
        self.next_id += 1
        before = _snapshot(self.pool)
        G = self.G
        hashes = page_hashes(toks, G)
        hits = self.pool.cached_prefix(hashes[: (len(toks) - 1) // G])
        try:
            self.pool.allocate(rid, len(hits) * G + 1, cached_pages=hits)
        except OutOfPages:
            assert _snapshot(self.pool) == before
            return
        for i, p in enumerate(hits):
            assert self.content[p] == tuple(toks[i * G : (i + 1) * G]), "a cache hit with the wrong tokens"
        self.reqs[rid] = [toks, len(hits) * G, hashes]
        self._write(rid, len(hits) * G)

    def _write(self, rid, pos):
        """The request computes token `pos` (its page must be its own and uncached), then registers full pages."""
        toks, _, hashes = self.reqs[rid]
        page = self.pool.pages(rid)[pos // self.G]
        assert self.pool.ref_count(page) == 1 and self.pool.page_hash(page) is None, "write into a shared page"
        old = self.content.get(page, ())
        self.content[page] = (old if pos % self.G else ()) + (toks[pos],)
        self.reqs[rid][1] = pos + 1
        for i in range((pos + 1) // self.G):
            self.pool.cache_page(rid, i, hashes[i])

    @precondition(lambda self: any(c < len(t) for t, c, _ in self.reqs.values()))
    @rule(data=st.data())
    def grow(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, (t, c, _) in self.reqs.items() if c < len(t))))
        _, computed, _ = self.reqs[rid]
        try:
            self.pool.append(rid, 1)
        except OutOfPages:
            return
        self._write(rid, computed)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.pool.free(rid)
        del self.reqs[rid]

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for p in self.pool._page_hash:
            assert len(self.content[p]) == self.G, "a cached page is not full"


TestPrefixPoolMachine = PrefixPoolMachine.TestCase
TestPrefixPoolMachine.settings = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ---- through the engine ---------------------------------------------------------------------------------------
# One static config for every engine here (the same cache shape and buckets: compiled once for the module); 12
# usable pages of 16 tokens for up to 8 requests of up to 64 tokens, so the bigger tests preempt and evict.
CONFIG = dict(
    max_model_len=64,
    max_num_seqs=8,
    page_size=16,
    num_pages=13,
    token_budget=64,
    max_prefills=2,
    decode_buckets=(8,),
    prefill_buckets=(64,),
    cache_dtype="fp32",
)


@pytest.fixture(scope="module")
def tiny():
    cfg = paged_config(num_hidden_layers=2)
    return cfg, model.init_params(cfg, jax.random.key(0), std=0.3)


def _run_waves(eng, waves, check=None):
    """Submits each wave of (prompt, params) once the previous one finished; returns outputs per wave."""
    res = []
    for wave in waves:
        ids = [eng.add_request(p, s) for p, s in wave]
        final = {}
        while eng.has_unfinished:
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
            eng.pool.check_invariants()
            if check:
                check(eng)
        res.append([final[i] for i in ids])
    return res


def _shared_prefix_waves(cfg, seed):
    rng = np.random.default_rng(seed)
    system = rng.integers(0, cfg.vocab_size, 35).tolist()
    prompts = [system + rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in (3, 9, 1, 12)]
    prompts += [system[:32], system[:33], rng.integers(0, cfg.vocab_size, 20).tolist()]
    sps = [
        SamplingParams(max_new_tokens=int(rng.integers(4, 12)), temperature=float(t), seed=i)
        for i, t in enumerate([0, 1, 0, 1, 0, 1, 0])
    ]
    wave = list(zip(prompts, sps))
    return [wave, wave[::-1]]


def test_outputs_identical_with_and_without_prefix_caching(tiny):
    cfg, params = tiny
    waves = _shared_prefix_waves(cfg, 0)
    off = _run_waves(Engine(params, cfg, EngineConfig(**CONFIG)), waves)
    eng = Engine(params, cfg, EngineConfig(**CONFIG, enable_prefix_caching=True))
    on = _run_waves(eng, waves)
    assert [[o.token_ids for o in w] for w in on] == [[o.token_ids for o in w] for w in off]
    s = eng.scheduler
    assert 0 < s.prefix_cache_hits < s.prefix_cache_queries
    # hits are whole pages and leave the last token to compute (of the prompt, or after a preemption of the prompt
    # and outputs so far); the second wave repeats the first
    for w, wave in zip(on, waves):
        assert all(
            o.num_cached_tokens % 16 == 0 and o.num_cached_tokens <= 16 * ((len(p) + len(o.token_ids) - 1) // 16)
            for o, (p, _) in zip(w, wave)
        )
    assert sum(o.num_cached_tokens for o in on[1]) > sum(o.num_cached_tokens for o in on[0])
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages and eng.pool.num_cached_pages > 0


def test_cached_prefix_prefills_only_the_rest(tiny):
    cfg, params = tiny
    eng = Engine(params, cfg, EngineConfig(**CONFIG, enable_prefix_caching=True))
    prompt = list(range(1, 41))  # 40 tokens: 2 full pages
    first = _run_waves(eng, [[(prompt, SamplingParams(max_new_tokens=4))]])[0][0]
    scheduled = []
    schedule = eng.scheduler.schedule

    def spy():
        chunks = schedule()
        scheduled.append([(c.start, c.num_tokens) for c in chunks])
        return chunks

    eng.scheduler.schedule = spy
    again = _run_waves(eng, [[(prompt, SamplingParams(max_new_tokens=4))]])[0][0]
    assert again.token_ids == first.token_ids and again.num_cached_tokens == 32
    assert scheduled[0] == [(32, 8)]  # the prefill computes only the 8 tokens past the cached pages
    # a prompt ending in the page just cached by the first request's outputs: 40 prompt + 3 computed outputs
    longer = prompt + first.token_ids[:3] + [5, 6, 7, 8, 9, 10]
    out = _run_waves(eng, [[(longer, SamplingParams(max_new_tokens=2))]])[0][0]
    assert out.num_cached_tokens == 32  # the third page (tokens 32..47) was never full: not cached


def test_no_page_written_while_shared_or_cached_with_preemption(tiny):
    """Every slot a step writes is in a page held by one request and not cached; with a pool small enough to
    preempt and evict, outputs still equal the uncached run."""
    cfg, params = tiny
    rng = np.random.default_rng(3)
    system = rng.integers(0, cfg.vocab_size, 40).tolist()
    wave = []
    for i in range(14):
        prompt = system[: int(rng.integers(17, 41))] + rng.integers(0, cfg.vocab_size, int(rng.integers(1, 8))).tolist()
        wave.append((prompt, SamplingParams(max_new_tokens=int(rng.integers(4, 16)), temperature=float(i % 2), seed=i)))
    waves = [wave, wave[::2]]
    off = _run_waves(Engine(params, cfg, EngineConfig(**CONFIG)), waves)
    eng = Engine(params, cfg, EngineConfig(**CONFIG, enable_prefix_caching=True))
    run = eng._dispatch
    written = []

    def checked_run(md, sampling, prev_index=None):
        slots = np.asarray(md.slot_mapping)
        pages = set((slots[slots >= 0] // eng.config.page_size).tolist())
        for p in pages:
            assert eng.pool.ref_count(p) == 1, f"step writes page {p} held by {eng.pool.ref_count(p)} requests"
            assert eng.pool.page_hash(p) is None, f"step writes cached page {p}"
        written.append(len(pages))
        return run(md, sampling, prev_index)

    eng._dispatch = checked_run
    on = _run_waves(eng, waves)
    assert [[o.token_ids for o in w] for w in on] == [[o.token_ids for o in w] for w in off]
    assert eng.scheduler.num_preemptions > 0 and eng.pool.num_evictions > 0 and eng.scheduler.prefix_cache_hits > 0
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages and not eng.pool.request_ids
    assert written


def test_abort_releases_references(tiny):
    cfg, params = tiny
    eng = Engine(params, cfg, EngineConfig(**CONFIG, enable_prefix_caching=True))
    prompt = list(range(3, 43))
    _run_waves(eng, [[(prompt, SamplingParams(max_new_tokens=2))]])
    a = eng.add_request(prompt + [1], SamplingParams(max_new_tokens=20))
    b = eng.add_request(prompt + [2], SamplingParams(max_new_tokens=20))
    eng.step()
    shared = eng.pool.pages(a)[:2]
    assert eng.pool.pages(b)[:2] == shared and all(eng.pool.ref_count(p) == 2 for p in shared)
    assert eng.abort(a) and not eng.abort(a)
    assert a not in eng.pool and all(eng.pool.ref_count(p) == 1 for p in shared)
    eng.pool.check_invariants()
    final = eng.run()
    assert set(final) == {b} and eng.pool.num_free_pages == eng.pool.num_usable_pages
