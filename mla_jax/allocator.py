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
"""

from __future__ import annotations

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


class PagePool:
    """Fixed pool of ``num_pages`` pages of ``page_size`` tokens each."""

    def __init__(self, num_pages: int, page_size: int, *, reserve_pad_page: bool = True,
                 pad_page_id: int = 0):
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
        # Stack of free pages; popping from the end hands out low ids first on a fresh pool.
        self._free: list[int] = list(range(self.num_pages - 1, first - 1, -1))
        self._pages: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}

    # --- queries -----------------------------------------------------------------------------------

    @property
    def num_usable_pages(self) -> int:
        """Pages that can ever be handed out (``num_pages`` minus the reserved pad page)."""
        return self.num_pages - (1 if self.reserve_pad_page else 0)

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_held_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

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
        return self.pages_needed(num_tokens) <= len(self._free)

    def append_pages_needed(self, request_id: Hashable, num_new_tokens: int) -> int:
        """Pages ``append(request_id, num_new_tokens)`` would take from the free list."""
        held = self._get(request_id)
        return max(0, cdiv(self._tokens[request_id] + num_new_tokens, self.page_size) - len(held))

    def can_append(self, request_id: Hashable, num_new_tokens: int) -> bool:
        return self.append_pages_needed(request_id, num_new_tokens) <= len(self._free)

    # --- mutations (all-or-nothing) ------------------------------------------------------------------

    @staticmethod
    def _check_count(name: str, n: int) -> int:
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
        return int(n)

    def _take(self, n: int, request_id: Hashable) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(n, len(self._free), request_id)
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def allocate(self, request_id: Hashable, num_tokens: int) -> list[int]:
        """Register a new request holding ``num_tokens`` tokens; returns its pages."""
        num_tokens = self._check_count("num_tokens", num_tokens)
        if request_id in self._pages:
            raise ValueError(f"request {request_id!r} is already allocated")
        pages = self._take(self.pages_needed(num_tokens), request_id)
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

    def free(self, request_id: Hashable) -> None:
        """Release all pages of a request (the request id becomes unknown)."""
        held = self._get(request_id)
        # Push in reverse so the request's first page is the next one handed out.
        self._free.extend(reversed(held))
        del self._pages[request_id]
        del self._tokens[request_id]

    # --- kernel metadata -----------------------------------------------------------------------------

    def block_table(self, request_ids: Sequence[Hashable], width: int | None = None, *,
                    pad_page_id: int | None = None) -> np.ndarray:
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
            out[i, :len(p)] = p
        return out

    def slot_mapping(self, request_id: Hashable, start: int, end: int) -> np.ndarray:
        """int32 [end - start] cache slots of token positions [start, end) of a request."""
        held = self._get(request_id)
        n = self._tokens[request_id]
        if not 0 <= start <= end <= n:
            raise ValueError(f"slot_mapping range [{start}, {end}) not within the {n} tokens of "
                             f"request {request_id!r}")
        pos = np.arange(start, end, dtype=np.int64)
        pages = np.asarray(held, dtype=np.int64)[pos // self.page_size] if len(pos) else pos
        return (pages * self.page_size + pos % self.page_size).astype(np.int32)

    def check_invariants(self) -> None:
        """Assert internal consistency (tests / debugging)."""
        held = [p for ps in self._pages.values() for p in ps]
        all_ids = held + self._free
        assert len(all_ids) == len(set(all_ids)), "a page is held twice or held and free"
        expected = set(range(1 if self.reserve_pad_page else 0, self.num_pages))
        assert set(all_ids) == expected, "pages leaked or foreign page ids"
        for r, ps in self._pages.items():
            assert len(ps) == self.pages_needed(self._tokens[r]), f"request {r!r} holds wrong page count"
