"""Chunked-context planning for MLA prefill (vLLM ``mla/common.py`` semantics, host side, numpy).

A prefill whose request already has tokens in the cache (its *context*) attends to that context by
gathering it from the paged cache into a contiguous workspace of ``W`` rows, up-projecting it with
``kv_b_proj`` to per-head k_nope/v, and running non-causal MHA per chunk; chunk results are merged
with the causal new-token result through their LSEs. ``W`` bounds the up-projected tensor
([W, N, P+V]), not the gather.

Plan (identical to vLLM):

* ``chunk = round_down(W // n_ctx, G)`` with ``n_ctx`` the number of prefills with context > 0;
  every prefill gets the same per-chunk budget.
* ``num_chunks = cdiv(max(context_lens), chunk)``.
* chunk ``c`` covers positions ``[c*chunk, min(ctx, (c+1)*chunk))`` of every prefill: starts are
  ``c * chunk`` for all sequences (page aligned, because the gather reads whole pages from a
  block-table entry), lengths are clamped at 0 for sequences whose context ended earlier (such a
  start may lie past the context; with length 0 nothing is read).
* Hence each chunk's total rows ``<= n_ctx * chunk <= W``.

Decisions:

* ``workspace_rows`` raises the floor to ``max_num_seqs * page_size`` (vLLM asserts instead), so
  ``W // n_ctx >= page_size`` holds whenever ``n_ctx <= max_num_seqs``. The result can therefore
  exceed 64K rows when ``max_num_seqs * page_size`` does.
* ``plan_context_chunks`` raises ValueError if ``W // n_ctx < page_size`` (no silent fallback).
* No context at all -> an empty plan (``num_chunks == 0``), not None; ``pad_to`` still works.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pallas_kernels.util import cdiv

WORKSPACE_CAP_ROWS = 64 * 1024


def workspace_rows(max_model_len: int, max_num_seqs: int, page_size: int) -> int:
    """Rows of the context-gather workspace W.

    ``min(max(8 * max_model_len, 4 * max_num_seqs * page_size), 64K)``, raised to at least
    ``max_num_seqs * page_size`` so that every prefill of a full batch gets >= one page per chunk.
    """
    for name, v in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs), ("page_size", page_size)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    w = min(max(8 * max_model_len, 4 * max_num_seqs * page_size), WORKSPACE_CAP_ROWS)
    return int(max(w, max_num_seqs * page_size))


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Context chunks of one step's prefills. C = chunk rows of the arrays, S = number of prefills.

    ``num_chunks`` is the number of real chunks; after ``pad_to`` the arrays have more rows, and the
    extra chunks are empty (length 0, start 0).
    """

    chunk_starts: np.ndarray  # int32 [C, S] first context position of each chunk (multiple of G)
    chunk_lens: np.ndarray  # int32 [C, S] rows of each sequence in each chunk (>= 0)
    cu_chunk_lens: np.ndarray  # int32 [C, S+1] exclusive prefix sums of chunk_lens along S
    num_chunks: int  # real chunks (<= C)
    max_chunk_rows: int  # max over chunks of the chunk's total rows (<= workspace_rows)
    chunk_size: int  # per-prefill rows per chunk (0 if there is no context)
    context_lens: np.ndarray  # int32 [S]
    workspace_rows: int  # W
    page_size: int  # G

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def num_padded_chunks(self) -> int:
        return int(self.chunk_starts.shape[0])

    @property
    def chunk_total_rows(self) -> np.ndarray:
        """int32 [C] rows of each chunk across sequences."""
        return self.cu_chunk_lens[:, -1]

    def pad_to(self, num_chunks_max: int) -> ChunkPlan:
        """Same plan with the arrays padded to ``num_chunks_max`` chunk rows of empty chunks."""
        c = self.num_padded_chunks
        if num_chunks_max < c:
            raise ValueError(f"cannot pad a plan of {c} chunks down to {num_chunks_max}")
        extra = num_chunks_max - c
        s = self.num_seqs

        def pad(a, width):
            return np.concatenate([a, np.zeros((extra, width), np.int32)], axis=0)

        return dataclasses.replace(
            self,
            chunk_starts=pad(self.chunk_starts, s),
            chunk_lens=pad(self.chunk_lens, s),
            cu_chunk_lens=pad(self.cu_chunk_lens, s + 1),
        )

    def row_seq_and_pos(self, num_rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Per workspace row of each chunk: (sequence index, context position), int32 [C, num_rows].

        Rows past a chunk's total are -1 in both arrays. ``num_rows`` defaults to ``max_chunk_rows``.
        The gather slot of a row is ``block_table[seq, pos // G] * G + pos % G``.
        """
        n = self.max_chunk_rows if num_rows is None else int(num_rows)
        if n < self.max_chunk_rows:
            raise ValueError(f"num_rows {n} < max_chunk_rows {self.max_chunk_rows}")
        c = self.num_padded_chunks
        if self.num_seqs == 0:
            return np.full((c, n), -1, np.int32), np.full((c, n), -1, np.int32)
        r = np.arange(n, dtype=np.int64)
        # Row r of chunk i belongs to the sequence s with cu[i, s] <= r < cu[i, s+1] (empty ones skipped).
        seq = (
            np.stack([np.searchsorted(self.cu_chunk_lens[i], r, side="right") - 1 for i in range(c)])
            if c
            else np.zeros((0, n), np.int64)
        )
        seq_c = np.clip(seq, 0, self.num_seqs - 1)
        valid = r[None, :] < self.chunk_total_rows[:, None]
        cu = np.take_along_axis(self.cu_chunk_lens.astype(np.int64), seq_c, axis=1)
        st = np.take_along_axis(self.chunk_starts.astype(np.int64), seq_c, axis=1)
        pos = st + r[None, :] - cu
        return (np.where(valid, seq_c, -1).astype(np.int32), np.where(valid, pos, -1).astype(np.int32))


def plan_context_chunks(context_lens: Sequence[int], workspace_rows: int, page_size: int) -> ChunkPlan:
    """Split the contexts of one step's prefills into page-aligned chunks of <= ``workspace_rows`` rows.

    ``context_lens[i]`` = tokens of prefill i already in the cache (0 = no context).
    Raises ValueError if ``workspace_rows // n_ctx < page_size``.
    """
    ctx = np.asarray(context_lens, dtype=np.int64).reshape(-1)
    if np.any(ctx < 0):
        raise ValueError(f"context_lens must be >= 0, got {ctx.tolist()}")
    if np.any(ctx > np.iinfo(np.int32).max):
        raise ValueError("context_lens must fit in int32")
    if not isinstance(workspace_rows, (int, np.integer)) or workspace_rows < 1:
        raise ValueError(f"workspace_rows must be an int >= 1, got {workspace_rows!r}")
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size!r}")
    s = ctx.shape[0]
    n_ctx = int(np.count_nonzero(ctx))
    if n_ctx == 0:
        z = np.zeros((0, s), np.int32)
        return ChunkPlan(
            z, z, np.zeros((0, s + 1), np.int32), 0, 0, 0, ctx.astype(np.int32), int(workspace_rows), int(page_size)
        )
    per_seq = workspace_rows // n_ctx
    chunk = per_seq // page_size * page_size
    if chunk == 0:
        raise ValueError(
            f"workspace of {workspace_rows} rows gives {n_ctx} prefills with context "
            f"{per_seq} rows each, less than one page ({page_size}); enlarge the workspace "
            f"(workspace_rows() guarantees >= max_num_seqs * page_size) or split the batch"
        )
    num_chunks = cdiv(int(ctx.max()), chunk)
    starts = np.broadcast_to((np.arange(num_chunks, dtype=np.int64) * chunk)[:, None], (num_chunks, s))
    lens = np.clip(np.minimum(ctx[None, :], starts + chunk) - starts, 0, None)
    cu = np.zeros((num_chunks, s + 1), np.int64)
    np.cumsum(lens, axis=1, out=cu[:, 1:])
    return ChunkPlan(
        chunk_starts=starts.astype(np.int32),
        chunk_lens=lens.astype(np.int32),
        cu_chunk_lens=cu.astype(np.int32),
        num_chunks=num_chunks,
        max_chunk_rows=int(cu[:, -1].max()),
        chunk_size=chunk,
        context_lens=ctx.astype(np.int32),
        workspace_rows=int(workspace_rows),
        page_size=int(page_size),
    )
