"""Host-side page allocator for the paged latent KV cache (pure Python / numpy, no JAX).

A request owns an ordered list of pages; token position ``pos`` of a request lives in slot
``pages[pos // G] * G + pos % G`` (G = page size), the slot numbering ``mla_jax.cache`` uses.

Page 0 is reserved by default (``reserve_pad_page=True``): it is never handed to a request, so it
can serve as the pad entry of block tables (``pad_page_id`` defaults to 0) and as a scratch page.
Padded block-table entries are never read for real data anyway, because kernels bound their reads
with ``seq_lens``; reserving the page only guarantees that a kernel which over-reads (a masked tail
tile) touches a page no request writes. With ``reserve_pad_page=False`` all pages are usable and pad
entries point at page 0, which may belong to a live request (still safe under the seq_lens bound).

Every mutating call checks capacity before changing anything: on failure it raises ``OutOfPages``
and leaves the pool exactly as it was.

Prefix caching (``enable_prefix_caching=True``), in the manner of vLLM v1's block pool: a *full* page whose
tokens are all in the cache can be registered under its chain hash (``hash_page``: the parent page's hash and
the page's token ids), so that another request whose tokens start the same way reuses it instead of
recomputing it. Pages are reference-counted: a cached page may be held by several requests at once, and it
stays cached (*evictable*) when the last one lets it go, until the pool needs the room; evictable pages are
reused least recently freed first, after the never-cached free pages. Only full pages are ever shared, and a
request writes only at positions past its cached prefix, so no page is ever written by two requests: a shared
page is immutable. A held page (reference count > 0) is never evicted. Evictable pages count as free.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import numpy as np

from pallas_kernels.util import cdiv


class OutOfPages(RuntimeError):
    """Not enough free pages; raised before any state changes."""

    def __init__(self, needed: int, free: int, request_id: Hashable | None = None):
        self.needed = needed
        self.free = free
        self.request_id = request_id
        who = "" if request_id is None else f" for request {request_id!r}"
        super().__init__(f"out of KV cache pages{who}: need {needed}, {free} free")


def hash_page(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chain hash of one full page: sha256 of the parent page's hash (None for a request's first page) and the
    page's token ids. Equal hashes mean equal token prefixes up to the end of the page (collisions of a
    256-bit hash are not a practical concern, unlike those of Python's 64-bit ``hash``)."""
    h = hashlib.sha256(parent or b"root")
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


def page_hashes(token_ids: Sequence[int], page_size: int, prior: Sequence[bytes] = ()) -> list[bytes]:
    """The chain hashes of the full pages of ``token_ids``: ``prior`` (hashes of its first pages, already
    computed) extended by those of the remaining full pages."""
    out = list(prior)
    for i in range(len(out), len(token_ids) // page_size):
        out.append(hash_page(out[-1] if out else None, token_ids[i * page_size : (i + 1) * page_size]))
    return out


class PagePool:
    """Fixed pool of ``num_pages`` pages of ``page_size`` tokens each, optionally with prefix caching."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        reserve_pad_page: bool = True,
        pad_page_id: int = 0,
        enable_prefix_caching: bool = False,
    ):
        if not isinstance(page_size, (int, np.integer)) or page_size < 1:
            raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
        first = 1 if reserve_pad_page else 0
        if not isinstance(num_pages, (int, np.integer)) or num_pages <= first:
            raise ValueError(f"num_pages must be an int > {first}, got {num_pages!r}")
        if not 0 <= pad_page_id < num_pages:
            raise ValueError(f"pad_page_id {pad_page_id} out of range [0, {num_pages})")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.reserve_pad_page = reserve_pad_page
        self.pad_page_id = int(pad_page_id)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        # Stack of free, uncached pages; popping from the end hands out low ids first on a fresh pool.
        self._free: list[int] = list(range(self.num_pages - 1, first - 1, -1))
        self._pages: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}
        self._ref = [0] * self.num_pages  # requests holding each page
        # Prefix cache: chain hash <-> page (registered full pages, held or evictable), and the evictable ones
        # (cached, held by nobody) from least to most recently freed.
        self._hash_to_page: dict[bytes, int] = {}
        self._page_hash: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    # --- queries -----------------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (``num_pages`` minus the reserved pad page)."""
        return self.num_pages - (1 if self.reserve_pad_page else 0)

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out: never-cached free pages plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_held_pages(self) -> int:
        """Pages held by at least one request."""
        return self.num_usable_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages registered in the prefix cache (held or evictable)."""
        return len(self._page_hash)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def ref_count(self, page: int) -> int:
        return self._ref[page]

    def page_hash(self, page: int) -> bytes | None:
        """The chain hash a page is cached under, None if it is not cached."""
        return self._page_hash.get(page)

    @property
    def request_ids(self) -> list[Hashable]:
        return list(self._pages)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def _get(self, request_id: Hashable) -> list[int]:
        try:
            return self._pages[request_id]
        except KeyError:
            raise KeyError(f"unknown request id {request_id!r}") from None

    def num_tokens(self, request_id: Hashable) -> int:
        self._get(request_id)
        return self._tokens[request_id]

    def pages(self, request_id: Hashable) -> list[int]:
        return list(self._get(request_id))

    def pages_needed(self, num_tokens: int) -> int:
        """Pages a new request of ``num_tokens`` tokens needs."""
        return cdiv(num_tokens, self.page_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.pages_needed(num_tokens) <= self.num_free_pages

    def append_pages_needed(self, request_id: Hashable, num_new_tokens: int) -> int:
        """Pages ``append(request_id, num_new_tokens)`` would take from the free list."""
        held = self._get(request_id)
        return max(0, cdiv(self._tokens[request_id] + num_new_tokens, self.page_size) - len(held))

    def can_append(self, request_id: Hashable, num_new_tokens: int) -> bool:
        return self.append_pages_needed(request_id, num_new_tokens) <= self.num_free_pages

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Pages of the longest cached chain prefix of ``hashes`` (a request's page hashes, first page first);
        empty without prefix caching. A pure lookup: nothing is pinned until ``allocate(..., cached_pages=)``."""
        out: list[int] = []
        if not self.enable_prefix_caching:
            return out
        for h in hashes:
            page = self._hash_to_page.get(h)
            if page is None:
                break
            out.append(page)
        return out

    # --- mutations (all-or-nothing) ------------------------------------------------------------------

    @staticmethod
    def _check_count(name: str, n: int) -> int:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        return int(n)

    def _take(self, n: int, request_id: Hashable) -> list[int]:
        """``n`` pages for a request (reference count 1): never-cached free pages first, then the least recently
        freed evictable ones (dropped from the cache)."""
        if n > self.num_free_pages:
            raise OutOfPages(n, self.num_free_pages, request_id)
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k :][::-1]
        del self._free[len(self._free) - k :]
        while len(taken) < n:
            page, _ = self._evictable.popitem(last=False)
            del self._hash_to_page[self._page_hash.pop(page)]
            self.num_evictions += 1
            taken.append(page)
        for p in taken:
            self._ref[p] = 1
        return taken

    def allocate(self, request_id: Hashable, num_tokens: int, cached_pages: Sequence[int] = ()) -> list[int]:
        """Register a new request holding ``num_tokens`` tokens; returns its pages.

        ``cached_pages`` (from ``cached_prefix``) become its first pages, shared with whoever else holds them:
        they must be cached and fully covered by ``num_tokens``. The rest are new pages."""
        num_tokens = self._check_count("num_tokens", num_tokens)
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} is already allocated")
        cached = [int(p) for p in cached_pages]
        if cached:
            if len(set(cached)) != len(cached):
                raise ValueError(f"cached_pages {cached} repeat a page")
            bad = [p for p in cached if p not in self._page_hash]
            if bad:
                raise ValueError(f"page {bad[0]} is not in the prefix cache")
            if num_tokens < len(cached) * self.page_size:
                raise ValueError(f"{num_tokens} tokens do not fill the {len(cached)} cached pages of {self.page_size}")
        need = max(0, self.pages_needed(num_tokens) - len(cached))
        free = self.num_free_pages - sum(1 for p in cached if self._ref[p] == 0)  # pinned ones stop being free
        if need > free:
            raise OutOfPages(need, free, request_id)
        for p in cached:  # pin first: evicting for the new pages must not take them
            if self._ref[p] == 0:
                del self._evictable[p]
            self._ref[p] += 1
        pages = cached + self._take(need, request_id)
        self._pages[request_id] = pages
        self._tokens[request_id] = num_tokens
        return list(pages)

    def append(self, request_id: Hashable, num_new_tokens: int) -> list[int]:
        """Grow a request by ``num_new_tokens``; returns the newly added pages (often empty)."""
        num_new_tokens = self._check_count("num_new_tokens", num_new_tokens)
        held = self._get(request_id)
        new = self._take(self.append_pages_needed(request_id, num_new_tokens), request_id)
        held.extend(new)
        self._tokens[request_id] += num_new_tokens
        return list(new)

    def truncate(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Shrink a request to its first ``num_tokens`` tokens (speculative decoding's rollback of rejected
        drafts); pages left empty are released as by ``free``. Returns them."""
        num_tokens = self._check_count("num_tokens", num_tokens)
        held = self._get(request_id)
        if num_tokens > self._tokens[request_id]:
            raise ValueError(
                f"cannot truncate request {request_id!r} to {num_tokens} > {self._tokens[request_id]} tokens"
            )
        keep = self.pages_needed(num_tokens)
        dropped = held[keep:]
        for p in reversed(dropped):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._page_hash:
                    self._evictable[p] = None
                else:
                    self._free.append(p)
        del held[keep:]
        self._tokens[request_id] = num_tokens
        return dropped

    def free(self, request_id: Hashable) -> None:
        """Release a request's references to its pages (the request id becomes unknown). A page nobody holds
        any more becomes free, or evictable if it is cached."""
        held = self._get(request_id)
        # In reverse: the request's first page is the next free page handed out, and its last cached page
        # the first evicted (a later request sharing the prefix needs the first pages most).
        for p in reversed(held):
            self._ref[p] -= 1
            if self._ref[p] == 0:
                if p in self._page_hash:
                    self._evictable[p] = None
                else:
                    self._free.append(p)
        del self._pages[request_id]
        del self._tokens[request_id]

    def cache_page(self, request_id: Hashable, index: int, page_hash: bytes) -> bool:
        """Register page ``index`` of a request, which must be full and hold its final tokens, under
        ``page_hash``; from now on it is immutable. Returns whether the page is (now) cached: False when
        another page is already cached under that hash (the request keeps its private copy) or without
        prefix caching."""
        if not self.enable_prefix_caching:
            return False
        held = self._get(request_id)
        if not 0 <= index < self._tokens[request_id] // self.page_size:
            raise ValueError(
                f"page {index} of request {request_id!r} is not full "
                f"({self._tokens[request_id]} tokens, pages of {self.page_size})"
            )
        page = held[index]
        have = self._page_hash.get(page)
        if have is not None:
            if have != page_hash:
                raise ValueError(f"page {page} is cached under another hash")
            return True
        if page_hash in self._hash_to_page:
            return False
        self._hash_to_page[page_hash] = page
        self._page_hash[page] = page_hash
        return True

    def reset_prefix_cache(self) -> int:
        """Drop every evictable page from the cache (they become plain free pages); pages held by requests
        stay cached. Returns the number dropped."""
        n = len(self._evictable)
        for p in self._evictable:
            del self._hash_to_page[self._page_hash.pop(p)]
            self._free.append(p)
        self._evictable.clear()
        return n

    # --- kernel metadata -----------------------------------------------------------------------------

    def block_table(
        self, request_ids: Sequence[Hashable], width: int | None = None, *, pad_page_id: int | None = None
    ) -> np.ndarray:
        """int32 [len(request_ids), width] page ids, padded with ``pad_page_id`` (default: the pool's).

        ``width`` defaults to the longest page list. Padded entries are never read for data:
        ``seq_lens`` bounds every read.
        """
        lists = [self._get(r) for r in request_ids]
        need = max((len(p) for p in lists), default=0)
        if width is None:
            width = need
        if width < need:
            raise ValueError(f"block_table width {width} < {need} pages held by one of the requests")
        pad = self.pad_page_id if pad_page_id is None else pad_page_id
        out = np.full((len(lists), width), pad, dtype=np.int32)
        for i, p in enumerate(lists):
            out[i, : len(p)] = p
        return out

    def slot_mapping(self, request_id: Hashable, start: int, end: int) -> np.ndarray:
        """int32 [end - start] cache slots of token positions [start, end) of a request."""
        held = self._get(request_id)
        n = self._tokens[request_id]
        if not 0 <= start <= end <= n:
            raise ValueError(f"slot_mapping range [{start}, {end}) not within the {n} tokens of request {request_id!r}")
        pos = np.arange(start, end, dtype=np.int64)
        pages = np.asarray(held, dtype=np.int64)[pos // self.page_size] if len(pos) else pos
        return (pages * self.page_size + pos % self.page_size).astype(np.int32)

    def check_invariants(self) -> None:
        """Assert internal consistency (tests / debugging): every usable page is exactly one of held, free or
        evictable; reference counts are the number of requests holding a page; the two cache maps are inverse;
        only cached pages are shared; every cached page a request holds is one of its full pages (it never
        writes there again); evictable pages are cached and held by nobody, free ones neither."""
        counts: dict[int, int] = {}
        for r, ps in self._pages.items():
            assert len(ps) == len(set(ps)), f"request {r!r} holds a page twice"
            assert len(ps) == self.pages_needed(self._tokens[r]), f"request {r!r} holds wrong page count"
            full = self._tokens[r] // self.page_size
            for i, p in enumerate(ps):
                counts[p] = counts.get(p, 0) + 1
                if p in self._page_hash:
                    assert i < full, f"request {r!r} writes into cached page {p} (index {i}, {full} full pages)"
        held = list(counts)
        all_ids = held + self._free + list(self._evictable)
        assert len(all_ids) == len(set(all_ids)), "a page is held and free, or free twice"
        expected = set(range(1 if self.reserve_pad_page else 0, self.num_pages))
        assert set(all_ids) == expected, "pages leaked or foreign page ids"
        for p in range(self.num_pages):
            assert self._ref[p] == counts.get(p, 0), f"page {p}: ref count {self._ref[p]}, held {counts.get(p, 0)}x"
            if counts.get(p, 0) > 1:
                assert p in self._page_hash, f"page {p} is shared by {counts[p]} requests but not cached"
        assert all(p not in self._page_hash for p in self._free), "a free page is still cached"
        assert all(p in self._page_hash for p in self._evictable), "an evictable page is not cached"
        assert len(self._hash_to_page) == len(self._page_hash), "cache maps differ in size"
        assert all(self._page_hash.get(p) == h for h, p in self._hash_to_page.items()), "cache maps disagree"
        if not self.enable_prefix_caching:
            assert not self._page_hash and not self._evictable, "pages cached with prefix caching off"


class PoolTotals:
    """Read-only page counts summed over several pools (data-parallel attention: one pool per DP rank), for stats
    that read an engine's `pool`; each rank's own pool does the allocating."""

    def __init__(self, pools: Sequence[PagePool]):
        self.pools = list(pools)
        self.page_size = self.pools[0].page_size

    num_pages = property(lambda self: sum(p.num_pages for p in self.pools))
    num_usable_pages = property(lambda self: sum(p.num_usable_pages for p in self.pools))
    num_free_pages = property(lambda self: sum(p.num_free_pages for p in self.pools))
    num_held_pages = property(lambda self: sum(p.num_held_pages for p in self.pools))
    num_cached_pages = property(lambda self: sum(p.num_cached_pages for p in self.pools))
    num_evictable_pages = property(lambda self: sum(p.num_evictable_pages for p in self.pools))

    @property
    def request_ids(self) -> list[Hashable]:
        return [r for p in self.pools for r in p.request_ids]

    def __contains__(self, request_id: Hashable) -> bool:
        return any(request_id in p for p in self.pools)

    def check_invariants(self) -> None:
        for p in self.pools:
            p.check_invariants()
