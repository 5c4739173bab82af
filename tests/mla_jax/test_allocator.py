"""Host page allocator: unit tests plus a hypothesis state machine against a reference model."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mla_jax.allocator import OutOfPages, PagePool


def _snapshot(pool):
    return (sorted(pool._free), {r: list(p) for r, p in pool._pages.items()}, dict(pool._tokens))


def test_allocate_append_free_basic():
    pool = PagePool(8, 4)  # page 0 reserved -> 7 usable
    assert pool.num_usable_pages == 7 and pool.num_free_pages == 7
    assert pool.allocate("a", 0) == [] and pool.pages("a") == []
    assert pool.append("a", 1) == [1]  # first token opens a page
    assert pool.append("a", 3) == []  # fills it
    assert pool.append("a", 1) == [2]  # next page only when the last one is full
    assert pool.num_tokens("a") == 5 and pool.pages("a") == [1, 2]
    assert pool.allocate("b", 9) == [3, 4, 5]
    assert pool.num_free_pages == 2 and pool.num_held_pages == 5
    assert 0 not in pool.pages("a") + pool.pages("b")
    pool.free("a")
    assert "a" not in pool and pool.num_free_pages == 4
    assert pool.allocate("c", 4) == [1]  # freed pages are reused
    pool.free("b")
    pool.free("c")
    assert pool.num_free_pages == 7 and len(pool) == 0
    pool.check_invariants()


def test_no_reserved_page():
    pool = PagePool(3, 2, reserve_pad_page=False)
    assert pool.num_usable_pages == 3
    assert sorted(pool.allocate(1, 6)) == [0, 1, 2]
    assert not pool.can_allocate(1)
    assert pool.can_allocate(0)


def test_slot_mapping_and_block_table():
    pool = PagePool(16, 4)
    pool.allocate("x", 3)  # page 1
    pool.allocate("y", 6)  # pages 2, 3
    pool.append("x", 4)  # 7 tokens -> page 4 added
    assert pool.pages("x") == [1, 4]
    np.testing.assert_array_equal(pool.slot_mapping("x", 0, 7), [4, 5, 6, 7, 16, 17, 18])
    np.testing.assert_array_equal(pool.slot_mapping("x", 3, 5), [7, 16])
    assert pool.slot_mapping("x", 2, 2).shape == (0,)
    assert pool.slot_mapping("x", 0, 7).dtype == np.int32
    with pytest.raises(ValueError, match="not within"):
        pool.slot_mapping("x", 0, 8)
    with pytest.raises(ValueError, match="not within"):
        pool.slot_mapping("x", 3, 2)
    bt = pool.block_table(["y", "x"], 4)
    assert bt.dtype == np.int32
    np.testing.assert_array_equal(bt, [[2, 3, 0, 0], [1, 4, 0, 0]])
    np.testing.assert_array_equal(pool.block_table(["x"], 3, pad_page_id=9), [[1, 4, 9]])
    assert pool.block_table(["x", "y"]).shape == (2, 2)
    assert pool.block_table([], 5).shape == (0, 5)
    with pytest.raises(ValueError, match="width 1"):
        pool.block_table(["x"], 1)


def test_errors():
    pool = PagePool(4, 2)
    pool.allocate("a", 1)
    with pytest.raises(ValueError, match="already allocated"):
        pool.allocate("a", 1)
    for call in (
        lambda: pool.free("zz"),
        lambda: pool.append("zz", 1),
        lambda: pool.pages("zz"),
        lambda: pool.num_tokens("zz"),
        lambda: pool.slot_mapping("zz", 0, 0),
        lambda: pool.block_table(["a", "zz"], 4),
    ):
        with pytest.raises(KeyError, match="unknown request id 'zz'"):
            call()
    with pytest.raises(ValueError, match="num_new_tokens"):
        pool.append("a", -1)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.allocate("b", -3)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4, 0)
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(1, 4)  # only the reserved page


def test_out_of_pages_is_atomic():
    pool = PagePool(5, 4)  # 4 usable
    pool.allocate("a", 5)  # 2 pages
    before = _snapshot(pool)
    with pytest.raises(OutOfPages) as e:
        pool.allocate("b", 13)  # needs 4, 2 free
    assert (e.value.needed, e.value.free, e.value.request_id) == (4, 2, "b")
    assert "need 4, 2 free" in str(e.value)
    assert "b" not in pool and _snapshot(pool) == before
    with pytest.raises(OutOfPages) as e:
        pool.append("a", 12)  # 17 tokens -> 5 pages, needs 3 more
    assert (e.value.needed, e.value.free) == (3, 2)
    assert _snapshot(pool) == before and pool.num_tokens("a") == 5
    assert pool.append_pages_needed("a", 11) == 2 and pool.can_append("a", 11)
    assert not pool.can_append("a", 12)
    pool.append("a", 11)
    assert pool.num_free_pages == 0
    pool.check_invariants()


class PoolMachine(RuleBasedStateMachine):
    """Random allocate/append/free against a reference model of token counts."""

    def __init__(self):
        super().__init__()
        self.pool = None
        self.tokens = {}
        self.next_id = 0

    @precondition(lambda self: self.pool is None)
    @rule(num_pages=st.integers(2, 24), page_size=st.sampled_from([1, 2, 4, 16]), reserve=st.booleans())
    def make(self, num_pages, page_size, reserve):
        self.pool = PagePool(num_pages, page_size, reserve_pad_page=reserve)

    def _need(self, n):
        return -(-n // self.pool.page_size)

    @precondition(lambda self: self.pool is not None)
    @rule(n=st.integers(0, 80))
    def allocate(self, n):
        rid = f"r{self.next_id}"
        self.next_id += 1
        before = _snapshot(self.pool)
        fits = self._need(n) <= self.pool.num_free_pages
        assert self.pool.can_allocate(n) == fits
        if fits:
            pages = self.pool.allocate(rid, n)
            assert len(pages) == self._need(n)
            self.tokens[rid] = n
        else:
            with pytest.raises(OutOfPages):
                self.pool.allocate(rid, n)
            assert _snapshot(self.pool) == before

    @precondition(lambda self: self.pool is not None and self.tokens)
    @rule(data=st.data(), n=st.integers(0, 40))
    def append(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        before = _snapshot(self.pool)
        old_pages = self.pool.pages(rid)
        extra = self._need(self.tokens[rid] + n) - len(old_pages)
        if extra <= self.pool.num_free_pages:
            new = self.pool.append(rid, n)
            assert len(new) == extra and self.pool.pages(rid) == old_pages + new  # existing pages keep place
            self.tokens[rid] += n
        else:
            with pytest.raises(OutOfPages) as e:
                self.pool.append(rid, n)
            assert e.value.needed == extra
            assert _snapshot(self.pool) == before

    @precondition(lambda self: self.pool is not None and self.tokens)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        n_free = self.pool.num_free_pages
        held = len(self.pool.pages(rid))
        self.pool.free(rid)
        del self.tokens[rid]
        assert self.pool.num_free_pages == n_free + held

    @precondition(lambda self: self.pool is not None)
    @rule()
    def free_all(self):
        for rid in list(self.tokens):
            self.pool.free(rid)
        self.tokens.clear()
        assert self.pool.num_free_pages == self.pool.num_usable_pages

    @invariant()
    def consistent(self):
        if self.pool is None:
            return
        pool = self.pool
        held = [p for rid in self.tokens for p in pool.pages(rid)]
        assert len(held) == len(set(held)), "a page is held by two requests"
        assert not set(held) & set(pool._free), "a held page is also free"
        assert len(held) + pool.num_free_pages == pool.num_usable_pages, "pages leaked"
        if pool.reserve_pad_page:
            assert 0 not in held
        assert all(0 <= p < pool.num_pages for p in held)
        all_slots = []
        for rid, n in self.tokens.items():
            assert pool.num_tokens(rid) == n
            pages = pool.pages(rid)
            assert len(pages) == self._need(n)
            slots = pool.slot_mapping(rid, 0, n)
            g = pool.page_size
            np.testing.assert_array_equal(slots // g, [pages[i // g] for i in range(n)])
            np.testing.assert_array_equal(slots % g, np.arange(n) % g)
            all_slots.append(slots)
        if all_slots:
            s = np.concatenate(all_slots)
            assert len(np.unique(s)) == len(s), "two tokens share a slot"
        if self.tokens:
            rids = sorted(self.tokens)
            bt = pool.block_table(rids, max(len(pool.pages(r)) for r in rids) + 1)
            for i, r in enumerate(rids):
                k = len(pool.pages(r))
                assert bt[i, :k].tolist() == pool.pages(r) and (bt[i, k:] == pool.pad_page_id).all()
        pool.check_invariants()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_prefix_caching_pool_without_registrations_behaves_the_same():
    """With prefix caching on but no page registered, page ids and counts are those of the plain pool."""
    plain, cached = PagePool(9, 4), PagePool(9, 4, enable_prefix_caching=True)
    for pool in (plain, cached):
        pool.allocate("a", 5)
        pool.allocate("b", 9)
        pool.append("a", 4)
        pool.free("b")
        pool.allocate("c", 2)
    assert _snapshot(plain) == _snapshot(cached)
    assert cached.num_cached_pages == 0 and cached.num_free_pages == plain.num_free_pages
    cached.check_invariants()
