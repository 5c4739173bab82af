"""Context-chunk planning (vLLM common.py semantics)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_jax.chunking import ChunkPlan, plan_context_chunks, workspace_rows


def _check_plan(plan: ChunkPlan, ctx, w, g):
    ctx = np.asarray(ctx, np.int64)
    c, s = plan.num_chunks, len(ctx)
    assert plan.chunk_starts.shape == (plan.num_padded_chunks, s) and plan.chunk_starts.dtype == np.int32
    assert plan.chunk_lens.shape == (plan.num_padded_chunks, s) and plan.chunk_lens.dtype == np.int32
    assert plan.cu_chunk_lens.shape == (plan.num_padded_chunks, s + 1) and plan.cu_chunk_lens.dtype == np.int32
    assert (plan.chunk_starts % g == 0).all(), "chunk start not page aligned"
    assert (plan.chunk_lens >= 0).all()
    np.testing.assert_array_equal(plan.chunk_lens.sum(0), ctx)  # every context row exactly once
    totals = plan.chunk_lens.sum(1)
    assert (totals <= w).all(), "chunk exceeds the workspace"
    np.testing.assert_array_equal(plan.cu_chunk_lens[:, 0], 0)
    np.testing.assert_array_equal(np.diff(plan.cu_chunk_lens, axis=1), plan.chunk_lens)
    assert plan.max_chunk_rows == (int(totals.max()) if totals.size else 0)
    # chunks of a sequence are contiguous and in order: chunk k starts where chunk k-1 ended
    done = np.zeros(s, np.int64)
    for k in range(plan.num_padded_chunks):
        live = plan.chunk_lens[k] > 0
        np.testing.assert_array_equal(plan.chunk_starts[k][live], done[live])
        done += plan.chunk_lens[k]
    if c:
        assert plan.chunk_size % g == 0 and plan.chunk_size > 0
        assert plan.chunk_size * np.count_nonzero(ctx) <= w
        assert (plan.chunk_lens <= plan.chunk_size).all()
        assert plan.num_chunks == -(-int(ctx.max()) // plan.chunk_size)
        assert (plan.chunk_lens[c - 1] > 0).any()  # no trailing empty real chunk


def _check_rows(plan: ChunkPlan):
    seq, pos = plan.row_seq_and_pos()
    for k in range(plan.num_padded_chunks):
        want = [
            (i, p)
            for i in range(plan.num_seqs)
            for p in range(plan.chunk_starts[k, i], plan.chunk_starts[k, i] + plan.chunk_lens[k, i])
        ]
        n = len(want)
        assert list(zip(seq[k, :n].tolist(), pos[k, :n].tolist())) == want
        assert (seq[k, n:] == -1).all() and (pos[k, n:] == -1).all()


def test_workspace_rows():
    # DeepSeek-V3: 8 * 163840 > 64K cap
    assert workspace_rows(163840, 256, 64) == 64 * 1024
    # small model length: max(8 * 1024, 4 * 4 * 16) = 8192
    assert workspace_rows(1024, 4, 16) == 8192
    # 4 pages per sequence dominates
    assert workspace_rows(256, 64, 64) == 4 * 64 * 64
    # floor raised above the cap (vLLM would assert here)
    assert workspace_rows(4096, 2048, 64) == 2048 * 64
    for bad in ((0, 1, 16), (1, 0, 16), (1, 1, 0)):
        with pytest.raises(ValueError):
            workspace_rows(*bad)


def test_no_context():
    for ctx in ([], [0], [0, 0, 0]):
        p = plan_context_chunks(ctx, 256, 16)
        assert p.num_chunks == 0 and p.max_chunk_rows == 0 and p.chunk_size == 0
        assert p.chunk_starts.shape == (0, len(ctx)) and p.cu_chunk_lens.shape == (0, len(ctx) + 1)
        _check_plan(p, ctx, 256, 16)
        q = p.pad_to(3)
        assert q.chunk_lens.shape == (3, len(ctx)) and q.num_chunks == 0 and not q.chunk_lens.any()
        _check_plan(q, ctx, 256, 16)
        _check_rows(q)


def test_one_token_of_context():
    p = plan_context_chunks([0, 1], 256, 16)
    assert p.num_chunks == 1 and p.chunk_size == 256
    np.testing.assert_array_equal(p.chunk_lens, [[0, 1]])
    np.testing.assert_array_equal(p.cu_chunk_lens, [[0, 0, 1]])
    np.testing.assert_array_equal(p.chunk_starts, [[0, 0]])
    _check_rows(p)


@pytest.mark.parametrize("w", [256, 250])  # W a multiple of G and not
def test_context_exactly_w_and_w_plus_one(w):
    g = 16
    chunk = w // g * g
    p = plan_context_chunks([chunk], w, g)
    assert p.num_chunks == 1 and p.max_chunk_rows == chunk
    _check_plan(p, [chunk], w, g)
    p = plan_context_chunks([chunk + 1], w, g)
    assert p.num_chunks == 2
    np.testing.assert_array_equal(p.chunk_lens, [[chunk], [1]])
    np.testing.assert_array_equal(p.chunk_starts, [[0], [chunk]])
    _check_plan(p, [chunk + 1], w, g)
    p = plan_context_chunks([w], w, g)  # W itself: one chunk iff W is page aligned
    assert p.num_chunks == (1 if w % g == 0 else 2)
    _check_plan(p, [w], w, g)


def test_vllm_example():
    # the example in vLLM's comments: chunk 256, 3 chunks, 4 prefills with context
    p = plan_context_chunks([600, 256, 1, 513], 1024, 16)
    assert p.chunk_size == 256 and p.num_chunks == 3
    np.testing.assert_array_equal(p.chunk_starts, [[0] * 4, [256] * 4, [512] * 4])
    np.testing.assert_array_equal(p.chunk_lens, [[256, 256, 1, 256], [256, 0, 0, 256], [88, 0, 0, 1]])
    _check_plan(p, [600, 256, 1, 513], 1024, 16)
    _check_rows(p)


def test_many_sequences():
    g = 64
    w = workspace_rows(163840, 256, g)
    ctx = np.random.default_rng(0).integers(0, 20000, size=256)
    ctx[::7] = 0
    p = plan_context_chunks(ctx.tolist(), w, g)
    assert p.chunk_size == (w // np.count_nonzero(ctx)) // g * g
    _check_plan(p, ctx, w, g)
    # full batch of max_num_seqs sequences all with context: one page each per chunk at least
    p = plan_context_chunks([5] * 256, w, g)
    assert p.chunk_size == 256 and p.num_chunks == 1


def test_workspace_too_small_raises():
    with pytest.raises(ValueError, match="less than one page"):
        plan_context_chunks([10, 10, 10], 40, 16)
    plan_context_chunks([10, 0, 0], 40, 16)  # only prefills with context count
    with pytest.raises(ValueError, match=">= 0"):
        plan_context_chunks([-1], 40, 16)
    with pytest.raises(ValueError, match="workspace_rows"):
        plan_context_chunks([1], 0, 16)


def test_pad_to():
    p = plan_context_chunks([100, 30], 64, 16)
    q = p.pad_to(p.num_chunks + 2)
    assert q.num_chunks == p.num_chunks and q.num_padded_chunks == p.num_chunks + 2
    np.testing.assert_array_equal(q.chunk_lens[: p.num_chunks], p.chunk_lens)
    assert not q.chunk_lens[p.num_chunks :].any() and not q.cu_chunk_lens[p.num_chunks :].any()
    assert not q.chunk_starts[p.num_chunks :].any()
    _check_plan(q, [100, 30], 64, 16)
    _check_rows(q)
    assert p.pad_to(p.num_chunks).num_padded_chunks == p.num_chunks
    with pytest.raises(ValueError, match="cannot pad"):
        p.pad_to(p.num_chunks - 1)
    with pytest.raises(ValueError, match="num_rows"):
        p.row_seq_and_pos(p.max_chunk_rows - 1)


@settings(max_examples=150, deadline=None)
@given(
    ctx=st.lists(st.integers(0, 3000), max_size=12),
    w=st.integers(1, 4096),
    g=st.sampled_from([1, 4, 16, 64, 128]),
    pad=st.integers(0, 3),
)
def test_plan_properties(ctx, w, g, pad):
    n_ctx = sum(1 for c in ctx if c > 0)
    if n_ctx and w // n_ctx < g:
        with pytest.raises(ValueError):
            plan_context_chunks(ctx, w, g)
        return
    p = plan_context_chunks(ctx, w, g)
    _check_plan(p, ctx, w, g)
    q = p.pad_to(p.num_chunks + pad)
    _check_plan(q, ctx, w, g)
    if q.num_padded_chunks * max(q.max_chunk_rows, 1) <= 20000:
        _check_rows(q)
