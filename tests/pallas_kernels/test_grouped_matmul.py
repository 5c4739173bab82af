"""grouped_matmul vs its float32 reference (CPU: interpret mode; GPU: `-m gpu`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_matmul import (
    PER_COPY_MAX_COPIES,
    default_tuning,
    group_table,
    grouped_matmul,
    grouped_matmul_reference,
    num_work_items,
    row_items,
    work_item,
    work_items,
)

# |out - ref| <= ATOL + RTOL |ref| with outputs of unit scale; bf16 rounds the output to 8 bits.
TOL = {jnp.bfloat16: (2e-2, 2e-2), jnp.float32: (2e-5, 1e-5)}
SMALL = dict(block_m=16, block_n=16, block_k=32)  # many tiles, straddles and edges at test sizes


def _inputs(seed, sizes, m, n, k, dtype, transpose_rhs=True):
    """lhs rows past sum(sizes) are NaN (padding must not leak); rhs scaled for unit outputs."""
    rng = np.random.default_rng(seed)
    sizes = np.asarray(sizes, np.int32)
    lhs = rng.standard_normal((m, k), np.float32)
    lhs[int(sizes.sum()) :] = np.nan
    shape = (len(sizes), n, k) if transpose_rhs else (len(sizes), k, n)
    rhs = rng.standard_normal(shape, np.float32) / np.sqrt(k)
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(sizes)


def _check(
    sizes,
    m,
    n,
    k,
    *,
    dtype=jnp.float32,
    transpose_rhs=True,
    seed=0,
    interpret=True,
    preferred_element_type=None,
    **tuning,
):
    lhs, rhs, gs = _inputs(seed, sizes, m, n, k, dtype, transpose_rhs)
    out = grouped_matmul(
        lhs,
        rhs,
        gs,
        transpose_rhs=transpose_rhs,
        interpret=interpret,
        preferred_element_type=preferred_element_type,
        **tuning,
    )
    ref = grouped_matmul_reference(lhs, rhs, gs, transpose_rhs=transpose_rhs)
    want_dtype = dtype if preferred_element_type is None else preferred_element_type
    assert out.shape == (m, n) and out.dtype == want_dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
    assert np.all(np.isfinite(out))
    total = int(np.sum(sizes))
    assert np.all(out[total:] == 0)  # padding rows: exactly 0
    atol, rtol = TOL[dtype]
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)
    return out


def _sizes(seed, g, total, empty_frac=0.3):
    """Random split of `total` rows over g groups, about empty_frac of them empty."""
    rng = np.random.default_rng(seed)
    w = rng.random(g) * (rng.random(g) > empty_frac)
    if w.sum() == 0:
        w[0] = 1.0
    cuts = np.floor(np.cumsum(w) / w.sum() * total).astype(np.int64)
    return np.diff(np.concatenate([[0], cuts])).astype(np.int32)


# ---- work list (no kernel) ----


def _work_list_case(seed):
    """(G, M, block_m, sizes) of a random work list, some groups empty, their sum <= M."""
    rng = np.random.default_rng(seed)
    g, m, bm = int(rng.integers(1, 12)), int(rng.integers(1, 200)), int(rng.choice([16, 32]))
    return g, m, bm, _sizes(seed, g, int(rng.integers(0, m + 1)))


def _assert_every_row_once(row0, lo, hi, grp, sizes, m, bm):
    """Items (row0, lo, hi, group) cover every row of [0, M) exactly once, each row in an item of its own segment
    (group g = the padding segment past the sizes' sum); returns the rows each item covers."""
    owner = np.searchsorted(np.cumsum(sizes), np.arange(m), side="right")  # group of each row; g = padding
    hits = np.zeros(m, int)
    covered = []
    for r0, a, b, s in zip(row0, lo, hi, grp):
        rows = np.arange(max(a, r0), min(b, r0 + bm))
        assert np.all(owner[rows] == s)
        hits[rows] += 1
        covered.append(rows)
    np.testing.assert_array_equal(hits, 1)
    return covered


@pytest.mark.parametrize("seed", range(4))
def test_work_items_cover_every_row_once(seed):
    g, m, bm, sizes = _work_list_case(seed)
    tile, lo, hi, grp = (np.asarray(a) for a in work_items(jnp.asarray(sizes), m, bm))
    assert len(tile) == -(-m // bm) + min(g, m)  # the static bound
    _assert_every_row_once(tile * bm, lo, hi, grp, sizes, m, bm)


@pytest.mark.parametrize("seed", range(6))
def test_aligned_work_items_are_each_groups_own_tiles(seed):
    """`work_item(aligned=True)`: every row of [0, M) in exactly one item of its own segment, an item's rows within
    block_m of its row0 = its segment's first row + j * block_m (no tile shared between segments), so a segment of
    n rows has cdiv(n, block_m) items; within the static count, which the straddled list's bound also holds."""
    g, m, bm, sizes = _work_list_case(100 + seed)
    padded = jnp.asarray(np.concatenate([sizes, [0]]), jnp.int32)
    w = jnp.arange(num_work_items(m, g, bm), dtype=jnp.int32)
    row0, lo, hi, grp = (np.asarray(a) for a in jax.vmap(lambda i: work_item(padded, g, i, m, bm, aligned=True))(w))
    covered = _assert_every_row_once(row0, lo, hi, grp, sizes, m, bm)
    for r0, a, rows in zip(row0, lo, covered):
        if len(rows):
            assert r0 >= a and (r0 - a) % bm == 0  # the segment's own tiles
    seg_rows = np.diff(np.concatenate([[0], np.minimum(np.cumsum(sizes), m), [m]]))
    assert int(np.sum(hi > lo)) == int(np.sum(-(-seg_rows // bm)))  # cdiv(n, block_m) items a segment


# ---- interpret mode ----


@pytest.mark.parametrize("aligned", [True, False])
def test_sorted_tiles_aligned_or_straddled(aligned, monkeypatch):
    """Both tilings of sorted rows give the reference's product: groups of fewer rows than a tile (straddled: one
    tile holds several groups), empty groups, NaN padding rows past the sum."""
    monkeypatch.setattr(gm, "GROUP_ALIGNED_TILES", aligned)
    jax.clear_caches()  # the kernel's trace is cached by its arguments, not by the tiling
    _check([5, 0, 12, 3, 17, 1, 9], 60, 40, 72, **SMALL)
    jax.clear_caches()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_random_groups_with_empty_ones(dtype, transpose_rhs):
    # N = 40 and K = 72 are not multiples of the blocks (16, 32): masked edges and a K tail step
    sizes = _sizes(1, 7, 90)
    assert np.any(sizes == 0)
    _check(sizes, 96, 40, 72, dtype=dtype, transpose_rhs=transpose_rhs, **SMALL)


def test_one_group_holds_everything():
    _check([0, 0, 61, 0], 61, 24, 48, **SMALL)


def test_padding_rows_are_zero_and_nan_free():
    # sum < M: 37 NaN rows after the groups (expert-parallel layout), output rows 0 there
    _check([5, 0, 9, 13], 64, 32, 32, **SMALL)


def test_all_groups_empty():
    _check([0, 0, 0], 20, 16, 16, **SMALL)


def test_tiny_groups_straddle_tiles():
    # 1-3 row groups: each 16- or 32-row tile is shared by up to ~16 work items
    sizes = np.random.default_rng(2).integers(0, 4, 30).astype(np.int32)
    _check(sizes, int(sizes.sum()) + 3, 16, 40, block_m=32, block_n=16, block_k=16)
    _check(sizes, int(sizes.sum()) + 3, 16, 40, dtype=jnp.bfloat16, **SMALL)


def _row_inputs(seed, m, g, n, k, dtype, layers=None):
    """Unsorted rows with random groups, some outside [0, G) (another device's copies): their lhs rows are
    NaN; with `layers`, a stacked rhs whose other layers are NaN."""
    rng = np.random.default_rng(seed)
    groups = rng.integers(-1, g + 2, m).astype(np.int32)
    groups[: min(m, 3)] = [0, g - 1, g][: min(m, 3)]  # an in-range edge and an out-of-range one at least
    lhs = rng.standard_normal((m, k), np.float32)
    lhs[(groups < 0) | (groups >= g)] = np.nan
    rhs = rng.standard_normal((g, n, k), np.float32) / np.sqrt(k)
    if layers is not None:
        rhs = np.stack([rhs if i == layers[1] else np.full_like(rhs, np.nan) for i in range(layers[0])])
    return jnp.asarray(lhs, dtype), jnp.asarray(rhs, dtype), jnp.asarray(groups)


@pytest.mark.parametrize("m, dtype", [(6, jnp.float32), (21, jnp.float32), (16, jnp.bfloat16)])
def test_row_groups_unsorted(m, dtype):
    """row_groups: each row with its own group's weights, in any order, rows of a group outside [0, G) exactly
    0; 21 rows span two row tiles; N = 40, K = 72 leave masked edges and a K tail step."""
    lhs, rhs, groups = _row_inputs(m, m, 5, 40, 72, dtype)
    out = grouped_matmul(lhs, rhs, row_groups=groups, interpret=True, **SMALL)
    ref = grouped_matmul_reference(lhs, rhs, row_groups=groups)
    assert out.shape == (m, 40) and out.dtype == dtype
    out, ref = np.asarray(out.astype(jnp.float32)), np.asarray(ref)
    bad = (np.asarray(groups) < 0) | (np.asarray(groups) >= 5)
    assert bad.any() and not bad.all()
    assert np.all(out[bad] == 0) and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, *TOL[dtype][::-1])
    # the same rows sorted by group through group_sizes give the same products
    order = np.argsort(np.where(bad, 5, np.asarray(groups)), kind="stable")
    sizes = np.bincount(np.asarray(groups)[~bad], minlength=5).astype(np.int32)
    sorted_out = grouped_matmul(lhs[order], rhs, jnp.asarray(sizes), interpret=True, **SMALL)
    np.testing.assert_allclose(np.asarray(sorted_out.astype(jnp.float32)), out[order], *TOL[dtype][::-1])


def test_row_groups_stacked_in_place_and_items():
    """row_groups with a stacked rhs at a traced layer (the other layer NaN), default tuning; and the work
    list: one item per row, the row alone, with its group as given."""
    lhs, rhs, groups = _row_inputs(4, 6, 7, 48, 64, jnp.float32, layers=(2, 1))
    f = jax.jit(lambda i: grouped_matmul(lhs, rhs, row_groups=groups, rhs_index=i, interpret=True))
    out = np.asarray(f(jnp.int32(1)))
    ref = np.asarray(grouped_matmul_reference(lhs, rhs, row_groups=groups, rhs_index=1))
    np.testing.assert_allclose(out, ref, *TOL[jnp.float32][::-1])
    tile, lo, hi, grp = (np.asarray(a) for a in row_items(groups, 7, 16))
    g = np.asarray(groups)
    np.testing.assert_array_equal(lo, np.arange(6))
    np.testing.assert_array_equal(hi, np.arange(1, 7))
    np.testing.assert_array_equal(tile, np.zeros(6))
    np.testing.assert_array_equal(grp, g)  # out-of-range groups: the kernel stores zeros for them


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("by_row", [False, True])
def test_glu_gate_and_up_in_one_kernel(by_row, splits):
    """up_rhs: silu(lhs @ gate) * (lhs @ up) in one kernel, sorted groups (NaN padding rows -> 0) or unsorted
    rows; K = 88 with two K splits sums each projection's partials before the SwiGLU."""
    rng = np.random.default_rng(11)
    if by_row:
        lhs, gate, groups = _row_inputs(11, 9, 4, 40, 88, jnp.float32)
        kw = dict(row_groups=groups)
    else:
        lhs, gate, gs = _inputs(11, _sizes(11, 4, 30), 37, 40, 88, jnp.float32)
        kw = dict(group_sizes=gs)
    up = jnp.asarray(rng.standard_normal(gate.shape, np.float32) / np.sqrt(88))
    out = grouped_matmul(lhs, gate, up_rhs=up, interpret=True, num_k_splits=splits, **kw, **SMALL)
    ref = grouped_matmul_reference(lhs, gate, up_rhs=up, **kw)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.all(np.isfinite(out)) and np.abs(ref).max() > 0.1
    np.testing.assert_allclose(out, ref, *TOL[jnp.float32][::-1])
    two = jax.nn.silu(grouped_matmul(lhs, gate, interpret=True, **kw, **SMALL))
    two = two * grouped_matmul(lhs, up, interpret=True, **kw, **SMALL)
    np.testing.assert_allclose(out, np.asarray(two), *TOL[jnp.float32][::-1])
    with pytest.raises(ValueError, match="up_rhs must match rhs"):
        grouped_matmul(lhs, gate, up_rhs=up[:, :8], interpret=True, **kw)


def _shared_direct(x, shared, c, n, k, axis):
    """x [k] @ chunk c of a shared [N_s, K_s] weight (HF layout), in numpy float64."""
    w = shared[c * n : (c + 1) * n, :] if axis == "n" else shared[:, c * k : (c + 1) * k]
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def _shared_case(by_row, axis, glu, G, n, k, C, T, K, dtype, **tuning):
    """T tokens' copies, each K routed experts (distinct; token 1's second copy another device's, -1) then the C
    shared chunks, through grouped_matmul with a stacked rhs and shared weight at layer 1 (layer 0 NaN), checked
    against the chunks computed directly (float64) and against the reference. By row, lhs holds one row per
    token; sorted, the copies are ordered by group with the padding copy last as a NaN row (0 out)."""
    rng = np.random.default_rng(G + T + C)
    f = lambda *s: rng.standard_normal(s, np.float32)  # noqa: E731
    shape = (C * n, k) if axis == "n" else (n, C * k)
    w = {name: (f(G, n, k) / np.sqrt(k), f(*shape) / np.sqrt(k)) for name in ("gate", "up")}
    stack = lambda a: jnp.asarray(np.stack([np.full_like(a, np.nan), a]), dtype)  # noqa: E731
    x = f(T, k)
    routed = np.stack([rng.permutation(G)[:K] for _ in range(T)]).astype(np.int32)
    routed[min(1, T - 1), min(1, K - 1)] = -1
    # the kernel's order for a token's top-k (`copy_groups`): the T*K routed copies, then each chunk's T copies
    flat = np.concatenate([routed.reshape(-1), np.repeat(G + np.arange(C, dtype=np.int32), T)])
    rows = np.concatenate([np.repeat(np.arange(T), K), np.tile(np.arange(T), C)])
    if by_row:  # "flat": each copy's group and row; "topk": each token's routed groups [T, K] and row ("topk_copies":
        # and each copy's row, as the down projection reads the SwiGLU's output)
        groups = flat
        lhs = jnp.asarray(x[rows] if by_row in ("flat", "topk_copies") else x, dtype)
        kw = dict(row_groups=jnp.asarray(flat if by_row == "flat" else routed))
    else:
        order = np.argsort(np.where(flat < 0, G + C, flat), kind="stable")
        rows, groups = rows[order], flat[order]
        xs = x[rows].copy()
        xs[groups < 0] = np.nan
        sizes = np.bincount(groups[groups >= 0], minlength=G + C).astype(np.int32)
        lhs, kw = jnp.asarray(xs, dtype), dict(group_sizes=jnp.asarray(sizes))
    args = dict(rhs_index=jnp.int32(1), shared_rhs=stack(w["gate"][1]), **kw, **tuning)
    if glu:
        args |= dict(up_rhs=stack(w["up"][0]), shared_up_rhs=stack(w["up"][1]))
    rhs = stack(w["gate"][0])
    out = np.asarray(jax.jit(lambda a: grouped_matmul(a, rhs, **args))(lhs).astype(jnp.float32))
    ref = np.asarray(grouped_matmul_reference(lhs, rhs, **args))
    rounded = {name: tuple(np.asarray(jnp.asarray(a, dtype).astype(jnp.float32)) for a in v) for name, v in w.items()}
    xr = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    want = np.zeros((len(groups), n))
    direct = len(groups) <= 64  # (checked directly on few copies; many check against the reference only)
    for r, (t, g) in enumerate(zip(rows, groups)):
        if g < 0 or not direct:
            continue
        proj = {
            name: xr[t].astype(np.float64) @ ex[g].astype(np.float64).T
            if g < G
            else _shared_direct(xr[t], sh, g - G, n, k, axis)
            for name, (ex, sh) in rounded.items()
        }
        want[r] = proj["gate"] / (1 + np.exp(-proj["gate"])) * proj["up"] if glu else proj["gate"]
    assert np.all(np.isfinite(out)) and np.all(out[groups < 0] == 0)
    tol = TOL[jnp.float32 if dtype == jnp.float32 else jnp.bfloat16][::-1]
    np.testing.assert_allclose(out, want if direct else ref, *tol)
    if direct:
        np.testing.assert_allclose(ref, want, *TOL[jnp.float32][::-1])


@pytest.mark.parametrize("axis, glu", [("n", False), ("k", False), ("n", True)])  # glu: gate/up, cut by rows
@pytest.mark.parametrize("by_row", [False, "flat", "topk"])
def test_shared_chunks_are_groups(by_row, axis, glu):
    """shared_rhs: a stacked [Lyr, N_s, K_s] weight whose 2 chunks, along its rows (gate/up) or its columns
    (down), are groups G, G+1 beside the routed ones (N 40, K 72: masked edges and a K tail)."""
    _shared_case(by_row, axis, glu, 3, 40, 72, 2, 3, 2, jnp.float32, interpret=True, **SMALL)


def _group_table_case(t, k, g, c, interpret):
    rng = np.random.default_rng(t + g)
    ids = np.stack([rng.permutation(g)[:k] for _ in range(t)]).astype(np.int32)
    ids[0, -1], ids[-1, 0] = -1, g + 3  # another device's copy, an out-of-range group: the padding slot
    ids[1::2, 0] = -1  # many of them: more than T (the padding slot's row is T*K long)
    table, count = (np.asarray(a) for a in group_table(jnp.asarray(ids), g, c, interpret=interpret))
    assert count.shape == (g + c + 1,) and table.shape[0] == g + c + 1
    flat = ids.reshape(-1)
    seen = []
    for slot in range(g + c + 1):
        if slot < g:
            want = np.flatnonzero(flat == slot)
        elif slot < g + c:
            want = t * k + (slot - g) * t + np.arange(t)
        else:
            want = np.flatnonzero((flat < 0) | (flat >= g))
        assert count[slot] == len(want), slot
        np.testing.assert_array_equal(table[slot, : count[slot]], want)
        seen += list(want)
    assert sorted(seen) == list(range(t * (k + c)))


def test_top_k_by_group_other_devices_copies_are_zero():
    """Expert parallelism: most copies are another device's (group -1 here: 20 of 27, more than the T rows an expert
    slot has), all stored 0 (the padding slot's cdiv(T*K, block_m) tiles; the interpreter's unwritten rows are NaN),
    the rest as the reference."""
    rng = np.random.default_rng(5)
    t, k, g, n, d = 9, 3, 4, 24, 32
    ids = np.stack([rng.permutation(g)[:k] for _ in range(t)]).astype(np.int32)
    ids.reshape(-1)[rng.permutation(t * k)[:20]] = -1
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((g, n, d)), jnp.float32)
    out = np.asarray(grouped_matmul(x, w, row_groups=jnp.asarray(ids), interpret=True, **SMALL))
    ref = np.asarray(grouped_matmul_reference(x, w, row_groups=jnp.asarray(ids)))
    other = ids.reshape(-1) < 0
    assert np.all(out[other] == 0) and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, *TOL[jnp.float32][::-1])


@pytest.mark.parametrize("t, k, g, c", [(9, 3, 5, 2), (40, 2, 3, 0), (1, 6, 64, 2)])
def test_group_table_lists_each_slots_copies_in_order(t, k, g, c):
    """`group_table`: row s the copies of slot s (expert s, then the C shared chunks, then the padding slot of groups
    outside [0, G)) in copy order, numbered as `copy_groups` numbers them, and their count; every copy in exactly
    one slot."""
    _group_table_case(t, k, g, c, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [32, 128])
def test_gpu_group_table(t):
    """The table on the GPU at V2-Lite's routing (64 experts, top-6, 2 shared chunks; the other slots' copies' stores
    masked past the row)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _group_table_case(t, 6, 64, 2, interpret=False)


@pytest.mark.parametrize("axis, glu", [("n", True), ("k", False)])
@pytest.mark.parametrize("by_row", ["topk", "topk_copies"])
@pytest.mark.parametrize("t, top_k", [(9, 3), (20, 2)])
def test_top_k_by_group(t, top_k, by_row, axis, glu):
    """A token top-k of more than PER_COPY_MAX_COPIES copies: an item per (group, row tile), the group's copies found
    in the kernel (27 copies of 5 experts; 40 of 3, so an expert's copies span two 16-row tiles), the shared chunks'
    T copies each, another device's copy (-1) stored 0; lhs one row per token or per copy."""
    assert t * top_k > PER_COPY_MAX_COPIES
    _shared_case(by_row, axis, glu, 5 if top_k == 3 else 3, 40, 72, 2, t, top_k, jnp.float32, interpret=True, **SMALL)


@pytest.mark.parametrize("t, skew", [(40, True), (33, True), (24, False)])
def test_top_k_by_group_lists_every_slots_tiles(monkeypatch, t, skew):
    """Items by group list the slots' tiles one after another: every token's first copy to expert 0 (a slot of T
    copies over several 16-row tiles), the second spread over the other experts, a shared chunk of T copies and one
    copy of another device's (-1, stored 0); unskewed, random routing. The static count (`group_items`) bounds the
    tiles; with exactly as many items as tiles every copy's row comes out as the reference's, with fewer a tile's rows
    are missing (the list leaves no gap and no tile twice)."""
    g, k_top, n, k = 12, 2, 24, 40
    rng = np.random.default_rng(t)
    if skew:
        routed = np.stack([np.zeros(t, np.int32), 1 + np.arange(t, dtype=np.int32) % (g - 1)], 1)
    else:
        routed = np.stack([rng.permutation(g)[:k_top] for _ in range(t)]).astype(np.int32)
    routed[3, 1] = -1
    assert t * k_top > PER_COPY_MAX_COPIES
    x = jnp.asarray(rng.standard_normal((t, k), np.float32))
    rhs = jnp.asarray(rng.standard_normal((g, n, k), np.float32) / np.sqrt(k))
    shared = jnp.asarray(rng.standard_normal((n, k), np.float32) / np.sqrt(k))
    args = dict(row_groups=jnp.asarray(routed), shared_rhs=shared, **SMALL)
    ref = np.asarray(grouped_matmul_reference(x, rhs, **args))
    tiles = sum(-(-c // 16) for c in np.bincount(routed[routed >= 0], minlength=g)) + -(-t // 16) + 1  # + padding
    assert tiles <= gm.group_items(t, k_top, g, 1, 16)
    # (two fewer: the last, the padding slot's tile, only stores zeros, which the interpreter's fresh output holds)
    for items, ok in ((gm.group_items(t, k_top, g, 1, 16), True), (tiles, True), (tiles - 2, False)):
        monkeypatch.setattr(gm, "group_items", lambda *_, items=items: items)
        jax.clear_caches()  # (the call's jit traced with another count must not be reused)
        out = np.asarray(grouped_matmul(x, rhs, interpret=True, **args))
        assert out.shape == ref.shape == (t * (k_top + 1), n)
        assert np.allclose(out, ref, rtol=2e-5, atol=1e-5) == ok, items
        if ok:
            assert (out[3 * k_top + 1] == 0).all()  # another device's copy


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(shared_rhs=np.zeros((30, 72), np.float32)), "whole number of"),
        (dict(shared_rhs=np.zeros((80, 72), np.float16)), "dtype"),
        (dict(shared_rhs=np.zeros((2, 80, 72), np.float32)), r"\[N_s, K_s\]"),
        (dict(shared_up_rhs=np.zeros((80, 72), np.float32)), "needs shared_rhs"),
        (dict(shared_rhs=np.zeros((80, 72), np.float32), transpose_rhs=False), "transpose_rhs=True"),
        (dict(shared_rhs=np.zeros((80, 72), np.float32), group_sizes=jnp.ones((3,), jnp.int32)), r"i32\[G=5\]"),
        (dict(group_sizes=None, row_groups=jnp.zeros((3, 2), jnp.int32)), r"T=3 or T\*\(K\+C\)=6 rows"),
        (dict(group_sizes=None, row_groups=jnp.zeros((8, 1), jnp.float32)), "row_groups dtype"),
    ],
)
def test_shared_validation(kw, match):
    lhs = jnp.zeros((8, 72), jnp.float32)
    kw = dict(group_sizes=jnp.ones((5,), jnp.int32)) | kw
    rhs = jnp.zeros((3, 40, 72) if kw.get("transpose_rhs", True) else (3, 72, 40), jnp.float32)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(lhs, rhs, interpret=True, **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(), "exactly one"),
        (dict(group_sizes=jnp.ones((3,), jnp.int32), row_groups=jnp.zeros((8,), jnp.int32)), "exactly one"),
        (dict(row_groups=jnp.zeros((7,), jnp.int32)), r"row_groups must be i32\[M=8\]"),
        (dict(row_groups=jnp.zeros((8,), jnp.float32)), "row_groups dtype"),
    ],
)
def test_row_groups_validation(kw, match):
    lhs, rhs = jnp.zeros((8, 32)), jnp.zeros((3, 16, 32))
    with pytest.raises(ValueError, match=match):
        grouped_matmul(lhs, rhs, interpret=True, **kw)


@pytest.mark.parametrize("splits", [2, 3])
def test_k_splits(splits):
    # K = 88: 3 steps of 32 (the last one partial) split 2 or 3 ways into float32 partials
    _check(_sizes(3, 5, 50), 53, 24, 88, num_k_splits=splits, **SMALL)


def test_default_tuning_and_f32_output():
    # decode-like: 12 rows over 9 experts, default blocks; bf16 in, float32 out
    out = _check([2, 0, 1, 3, 0, 0, 4, 1, 1], 12, 48, 64, dtype=jnp.bfloat16, preferred_element_type=jnp.float32)
    assert out.dtype == np.float32


def test_default_tuning_table():
    # decode: 16-row tiles; prefill: 128; tiny problems get tiny blocks; split K only when idle SMs
    assert default_tuning(6, 1408, 2048, 64, jnp.bfloat16, sms=132)[0] == 16
    assert default_tuning(98304, 1408, 2048, 64, jnp.bfloat16, sms=132)[:3] == (128, 128, 64)
    assert default_tuning(5, 20, 20, 2, jnp.bfloat16, sms=132)[1:3] == (32, 32)
    assert default_tuning(8, 2048, 7168, 1, jnp.bfloat16, sms=132)[5] > 1
    assert default_tuning(768, 1408, 2048, 64, jnp.bfloat16, sms=132)[5] == 1
    # by row (decode copies; bench/moe_decode.py's H200 sweep): 128-wide N blocks but for the GLU past 8 copies
    assert default_tuning(8, 1408, 2048, 8, jnp.bfloat16, sms=132, by_row=True, glu=True) == (16, 128, 128, 4, 3, 1)
    assert default_tuning(16, 1408, 2048, 16, jnp.bfloat16, sms=132, by_row=True, glu=True)[1] == 64
    assert default_tuning(16, 2048, 1408, 16, jnp.bfloat16, sms=132, by_row=True) == (16, 128, 128, 4, 3, 1)
    # fp8 experts (the H200 sweep at T = 1 / 32): 128-deep K steps; by row 4 stages; sorted, the GLU 128 wide (its
    # epilogue quantizes the down projection's input), the down projection as bf16's
    fp8 = dict(sms=132, fp8=True)
    assert default_tuning(8, 1408, 2048, 8, jnp.bfloat16, by_row=True, glu=True, **fp8) == (16, 128, 128, 4, 4, 1)
    assert default_tuning(8, 2048, 1408, 8, jnp.bfloat16, by_row=True, **fp8) == (16, 128, 128, 4, 4, 1)
    assert default_tuning(256, 1408, 2048, 66, jnp.bfloat16, glu=True, **fp8) == (16, 128, 128, 4, 4, 1)
    assert default_tuning(256, 2048, 1408, 66, jnp.bfloat16, **fp8) == (16, 64, 128, 4, 4, 1)
    assert default_tuning(6, 32, 64, 4, jnp.float32, glu=True, **fp8)[1:3] == (32, 128)  # N under a block


def test_moe_pipeline_matches_dense_per_token_reference():
    """sort by expert -> gate/up/down grouped matmuls -> weighted unsort, jitted, vs numpy per token.

    Also the expert-parallel shard layout: only experts [e0, e0 + e_loc) are local; the other copies
    sort past the groups, must come out 0 and so contribute nothing.
    """
    t, k, e, d, inter = 13, 3, 6, 32, 40
    rng = np.random.default_rng(4)
    x = rng.standard_normal((t, d), np.float32)
    ids = np.argsort(rng.random((t, e)), axis=1)[:, :k].astype(np.int32)  # distinct experts
    wts = rng.random((t, k)).astype(np.float32)
    wg, wu = (rng.standard_normal((e, inter, d), np.float32) / np.sqrt(d) for _ in range(2))
    wd = rng.standard_normal((e, d, inter), np.float32) / np.sqrt(inter)

    def silu(v):
        return v / (1 + np.exp(-v))

    @jax.jit
    def routed(x, ids, wts, wg, wu, wd, e0):
        e_loc = wg.shape[0]
        flat = ids.reshape(-1) - e0
        mine = (flat >= 0) & (flat < e_loc)
        key = jnp.where(mine, flat, e_loc)
        order = jnp.argsort(key, stable=True)
        token = order // k
        gs = jnp.bincount(key, length=e_loc).astype(jnp.int32)
        xs = x[token]  # [T*K, D]
        gmm = lambda a, w: grouped_matmul(a, w, gs, interpret=True, **SMALL)  # noqa: E731
        h = jax.nn.silu(gmm(xs, wg)) * gmm(xs, wu)  # [T*K, I]
        y = gmm(h, wd)  # [T*K, D]
        w_sorted = jnp.where(mine[order], wts.reshape(-1)[order], 0.0)
        return jnp.zeros_like(x).at[token].add(y * w_sorted[:, None])

    for e0, e_loc in ((0, e), (2, 3)):
        want = np.zeros((t, d), np.float64)
        for i in range(t):
            for j in range(k):
                ex = ids[i, j]
                if e0 <= ex < e0 + e_loc:
                    h = silu(wg[ex] @ x[i]) * (wu[ex] @ x[i])
                    want[i] += wts[i, j] * (wd[ex] @ h)
        sl = slice(e0, e0 + e_loc)
        got = routed(x, ids, wts, wg[sl], wu[sl], wd[sl], e0)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)


# ---- stacked layers: rhs [Lyr, G, ...] read in place at rhs_index ----


def _stacked(seed, sizes, m, n, k, layers, dtype, transpose_rhs=True):
    """Inputs plus rhs stacked over `layers` layers whose other layers are NaN except the one wanted,
    which the caller picks: returns (lhs, one layer's rhs, group sizes, stack builder)."""
    lhs, rhs, gs = _inputs(seed, sizes, m, n, k, dtype, transpose_rhs)

    def stack(index):  # layer `index` holds rhs, every other layer NaN: reading the wrong one shows
        return jnp.full((layers,) + rhs.shape, jnp.nan, dtype).at[index].set(rhs)

    return lhs, rhs, gs, stack


@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_stacked_rhs_static_index(transpose_rhs):
    lhs, rhs, gs, stack = _stacked(9, _sizes(9, 5, 40), 45, 24, 40, 3, jnp.float32, transpose_rhs)
    want = grouped_matmul(lhs, rhs, gs, transpose_rhs=transpose_rhs, interpret=True, **SMALL)
    ref = grouped_matmul_reference(lhs, rhs, gs, transpose_rhs=transpose_rhs)
    for index in (0, 2, np.int32(1)):
        st = stack(int(index))
        got = grouped_matmul(lhs, st, gs, transpose_rhs=transpose_rhs, interpret=True, rhs_index=index, **SMALL)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # same kernel, same sums
        ref_st = grouped_matmul_reference(lhs, st, gs, transpose_rhs=transpose_rhs, rhs_index=index)
        np.testing.assert_array_equal(np.asarray(ref_st), np.asarray(ref))


def test_stacked_rhs_traced_index_in_jit_and_scan():
    """A traced index under jit (clamped when out of range) and the layer counter of a lax.scan whose
    body closes over the stacked weights (the model's use), each layer's weights distinct."""
    layers, sizes, m, n, k = 3, _sizes(10, 6, 30), 34, 40, 72
    lhs, _, gs = _inputs(10, sizes, m, n, k, jnp.bfloat16)
    rng = np.random.default_rng(11)
    st = jnp.asarray(rng.standard_normal((layers, len(sizes), n, k), np.float32) / np.sqrt(k), jnp.bfloat16)
    per_layer = [
        np.asarray(grouped_matmul(lhs, st[i], gs, interpret=True, **SMALL).astype(jnp.float32)) for i in range(layers)
    ]

    f = jax.jit(lambda i: grouped_matmul(lhs, st, gs, interpret=True, rhs_index=i, **SMALL))
    for i, want in ((1, 1), (2, 2), (-4, 0), (7, layers - 1)):  # out of range: clamped
        np.testing.assert_array_equal(np.asarray(f(jnp.int32(i)).astype(jnp.float32)), per_layer[want])

    def body(i, _):
        return i + 1, grouped_matmul(lhs, st, gs, interpret=True, rhs_index=i, **SMALL)

    _, outs = jax.jit(lambda: jax.lax.scan(body, jnp.int32(0), None, length=layers))()
    for i in range(layers):
        np.testing.assert_array_equal(np.asarray(outs[i].astype(jnp.float32)), per_layer[i])
        ref = grouped_matmul_reference(lhs, st, gs, rhs_index=jnp.int32(i))
        atol, rtol = TOL[jnp.bfloat16]
        np.testing.assert_allclose(per_layer[i], np.asarray(ref), atol=atol, rtol=rtol)


@pytest.mark.parametrize(
    "rhs_shape, index, match",
    [
        ((2, 3, 20, 16), None, "needs rhs_index"),  # stacked rhs without an index
        ((3, 20, 16), 0, r"\[Lyr, G, N, K\]"),  # an index with an unstacked rhs
        ((2, 3, 20, 16), 2, "rhs_index=2 is out of range for rhs with 2 stacked layers"),
        ((2, 3, 20, 16), -1, "rhs_index=-1 is out of range"),
        ((2, 3, 20, 16), jnp.int32(5), "rhs_index=5"),  # concrete arrays are static too
        ((2, 3, 20, 16), 1.0, "integer scalar"),
        ((2, 3, 20, 16), jnp.zeros((1,), jnp.int32), "integer scalar"),
        ((2, 3, 20, 24), 1, "K=24"),  # the per-layer checks still apply
    ],
)
def test_stacked_validation(rhs_shape, index, match):
    lhs = jnp.zeros((8, 16), jnp.float32)
    gs = jnp.array([3, 0, 5], jnp.int32)
    rhs = jnp.zeros(rhs_shape, jnp.float32)
    with pytest.raises(ValueError, match=match):
        grouped_matmul(lhs, rhs, gs, interpret=True, rhs_index=index)
    with pytest.raises(ValueError, match=match):
        grouped_matmul_reference(lhs, rhs, gs, rhs_index=index)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(lhs=np.zeros((8,), np.float32)), r"lhs must be \[M, K\]"),
        (dict(lhs=np.zeros((8, 16), np.int32)), "lhs dtype"),
        (dict(rhs=np.zeros((3, 16, 16), np.float16)), "dtypes differ"),
        (dict(rhs=np.zeros((3, 16), np.float32)), "rhs must be"),
        (dict(rhs=np.zeros((3, 16, 24), np.float32)), "K=24"),
        (dict(group_sizes=np.zeros((4,), np.int32)), r"group_sizes must be i32\[G=3\]"),
        (dict(group_sizes=np.zeros((3,), np.float32)), "group_sizes dtype"),
        (dict(block_m=24), "block_m=24"),
        (dict(block_k=8), "block_k=8"),
        (dict(num_warps=3), "num_warps"),
        (dict(num_k_splits=0), "num_k_splits"),
        (dict(preferred_element_type=jnp.int32), "preferred_element_type"),
    ],
)
def test_validation(bad, match):
    args = dict(
        lhs=np.zeros((8, 16), np.float32),
        rhs=np.zeros((3, 20, 16), np.float32),
        group_sizes=np.array([3, 0, 5], np.int32),
    )
    tuning = {}
    for key, val in bad.items():
        (args if key in args else tuning)[key] = val
    args = {key: jnp.asarray(val) for key, val in args.items()}
    with pytest.raises(ValueError, match=match):
        grouped_matmul(**args, interpret=True, **tuning)


# ---- GPU: the real Triton kernel (run by `make gpu`) ----


# ---- block-FP8 experts (W8A8: rhs_scale / up_scale) ----


def _fp8_experts(rng, lead, n, k, poison=None):
    """e4m3 experts [*lead, N, K] + f32 block scales, rows at scales 2^-3..2^3 (a wrong scale block shows); with
    `poison` (a layer index), every other layer's weights and scales NaN."""
    from pallas_kernels.fp8_matmul import quantize_weight_blocks

    real = lead if poison is None else lead[1:]  # poisoned: only the kept layer drawn (V2-Lite's 64 experts are
    # 185M weights a layer: drawing the NaN layers too tripled the GPU tests' host time)
    w = rng.standard_normal((*real, n, k), np.float32) / np.sqrt(k)
    w = w * np.exp2(np.arange(n) % 7 - 3.0)[:, None]
    q, sc = quantize_weight_blocks(jnp.asarray(w))
    if poison is not None:
        keep = (jnp.arange(lead[0]) == poison).reshape(-1, *(1,) * q.ndim)
        q, sc = jnp.where(keep, q[None], jnp.asarray(jnp.nan, q.dtype)), jnp.where(keep, sc[None], jnp.nan)
    return q, sc


def _close_rel(out, ref, rtol=1e-5):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape and np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.parametrize("splits", [1, 2])
def test_fp8_sorted_groups_nan_padding(splits):
    """Sorted rows with an empty group and NaN padding rows (which come out 0), ragged N and K (a partial last scale
    block), against `fp8_grouped_matmul_reference`'s W8A8 math: float32 summation order apart, the same numbers."""
    rng = np.random.default_rng(splits)
    g, n, k, m = 5, 200, 300, 40
    sizes = jnp.asarray([10, 0, 17, 5, 5], jnp.int32)
    x = rng.standard_normal((m, k), np.float32)
    x[37:] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    w, sc = _fp8_experts(rng, (g,), n, k)
    kw = dict(rhs_scale=sc, preferred_element_type=jnp.float32)
    out = grouped_matmul(x, w, sizes, interpret=True, num_k_splits=splits, **kw)
    _close_rel(out[:37], grouped_matmul_reference(x, w, sizes, rhs_scale=sc, preferred_element_type=jnp.float32)[:37])
    assert np.all(np.asarray(out[37:]) == 0)


def test_fp8_decode_top_k_glu_stacked_poisoned():
    """A decode step's shape: each token's top-k unsorted (one item per copy, the token's row read in the kernel),
    gate and up in one pass, the layer read in place between NaN layers (traced index); against the reference and,
    copy by copy, the Mosaic GPU kernel's portable path (`fp8_grouped_matmul_xla`: the same quantization)."""
    from pallas_kernels.fp8_matmul import fp8_grouped_matmul_xla

    rng = np.random.default_rng(7)
    t, top_k, g, n, k = 2, 3, 6, 96, 256
    x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(g)[:top_k] for _ in range(t)]), jnp.int32)
    ids = ids.at[1, 2].set(-1)  # another device's copy: 0
    (gw, gs), (uw, us) = (_fp8_experts(rng, (3, g), n, k, poison=1) for _ in range(2))
    kw = dict(row_groups=ids, up_rhs=uw, rhs_scale=gs, up_scale=us)
    f = jax.jit(lambda i: grouped_matmul(x, gw, rhs_index=i, interpret=True, preferred_element_type=jnp.float32, **kw))
    out = f(jnp.int32(1))
    _close_rel(out, grouped_matmul_reference(x, gw, rhs_index=1, **kw))
    one = jnp.ones((1,), jnp.int32)
    for r, e in enumerate(np.asarray(ids).reshape(-1)):
        if e < 0:
            assert np.all(np.asarray(out[r]) == 0)
            continue
        xr = x[r // top_k : r // top_k + 1]
        gate, up = (
            fp8_grouped_matmul_xla(xr, w[1, e : e + 1], sc[1, e : e + 1], one, out_dtype=jnp.float32)[0]
            for w, sc in ((gw, gs), (uw, us))
        )
        _close_rel(out[r], jax.nn.silu(gate) * up, rtol=1e-4)


def _fp8_shared_case(t, top_k, g, i_sz, d, c, interpret):
    """fp8 shared experts as C chunk groups of a decode step's kernels (t tokens' top-k unsorted; experts [I, D],
    shared [C*I, D] and [D, C*I], stacked over 3 layers, the layer read in place between NaN layers): gate + up with
    the chunks along N, down with them along K, against the reference (the chunks appended as groups with their
    blocks' scales) and against the shared MLP computed on its own (the W8A8 product of the whole shared weights:
    the chunks' K blocks are the whole weight's)."""
    from pallas_kernels.fp8_matmul import fp8_matmul_quantized_reference

    rng = np.random.default_rng(t * 7 + c)
    x = jnp.asarray(rng.standard_normal((t, d), np.float32), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(g)[:top_k] for _ in range(t)]), jnp.int32)
    (gw, gs), (uw, us) = (_fp8_experts(rng, (3, g), i_sz, d, poison=2) for _ in range(2))
    (sgw, sgs), (suw, sus) = (_fp8_experts(rng, (3,), c * i_sz, d, poison=2) for _ in range(2))
    dw, ds = _fp8_experts(rng, (3, g), d, i_sz, poison=2)
    sdw, sds_ = _fp8_experts(rng, (3,), d, c * i_sz, poison=2)
    glu_kw = dict(row_groups=ids, up_rhs=uw, rhs_scale=gs, up_scale=us, shared_rhs=sgw, shared_up_rhs=suw)
    glu_kw.update(shared_scale=sgs, shared_up_scale=sus)
    f = jax.jit(lambda i: grouped_matmul(x, gw, rhs_index=i, interpret=interpret, **glu_kw))
    h = f(jnp.int32(2))  # [T*(K+C), I]: the T*K routed copies, then each chunk's T rows
    assert h.shape == (t * (top_k + c), i_sz)
    _close_rel(h.astype(jnp.float32), grouped_matmul_reference(x, gw, rhs_index=2, **glu_kw), rtol=1e-2)
    # the chunks' rows against the shared gate / up on their own: chunk j's T rows are columns [j*I, (j+1)*I)
    want = jax.nn.silu(fp8_matmul_quantized_reference(x, sgw[2], sgs[2])) * fp8_matmul_quantized_reference(
        x, suw[2], sus[2]
    )  # [T, C*I]
    got = h[t * top_k :].reshape(c, t, i_sz).transpose(1, 0, 2).reshape(t, c * i_sz)
    _close_rel(got.astype(jnp.float32), want, rtol=1e-2)
    down_kw = dict(row_groups=ids, rhs_scale=ds, shared_rhs=sdw, shared_scale=sds_, preferred_element_type=jnp.float32)
    y = jax.jit(lambda hh, i: grouped_matmul(hh, dw, rhs_index=i, interpret=interpret, **down_kw))(h, jnp.int32(2))
    _close_rel(y, grouped_matmul_reference(h, dw, rhs_index=2, **down_kw), rtol=1e-4)
    # the chunks' partial outputs summed: the shared down projection of the shared intermediate
    chunk_sum = y[t * top_k :].reshape(c, t, d).sum(0)
    _close_rel(chunk_sum, fp8_matmul_quantized_reference(got, sdw[2], sds_[2]), rtol=1e-4)


@pytest.mark.parametrize("t, top_k", [(2, 2), (9, 3)])  # 4 copies, each its own item; 27, items by group
def test_fp8_shared_chunks_decode_stacked_poisoned(t, top_k):
    _fp8_shared_case(t=t, top_k=top_k, g=4, i_sz=256, d=200, c=2, interpret=True)


def _fp8_glu_case(by_row: bool, t: int, g: int, n: int, k: int, interpret: bool, block_n=None):
    """fp8 gate + up of t tokens' top-2 (unsorted copies, or sorted with NaN padding rows), stacked between NaN
    layers: (quantize_out's pair, `quantize_act` of the same call's output without it, the down projection of the
    pair, of that output)."""
    from pallas_kernels.fp8_quant import quantize_act_reference

    rng = np.random.default_rng(t * 3 + by_row)
    (gw, gs), (uw, us) = (_fp8_experts(rng, (3, g), n, k, poison=1) for _ in range(2))
    dw, ds = _fp8_experts(rng, (3, g), k, n, poison=1)
    ids = np.stack([rng.permutation(g)[:2] for _ in range(t)]).astype(np.int32)
    if by_row:
        x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
        kw = dict(row_groups=jnp.asarray(ids))
        dkw = dict(row_groups=jnp.asarray(ids.reshape(-1)))
    else:  # sorted copies and 3 NaN padding rows
        order = np.argsort(ids.reshape(-1), kind="stable")
        x = rng.standard_normal((t * 2 + 3, k), np.float32)
        x[: t * 2] = rng.standard_normal((t, k), np.float32)[order // 2]
        x[t * 2 :] = np.nan
        x = jnp.asarray(x, jnp.bfloat16)
        kw = dkw = dict(group_sizes=jnp.asarray(np.bincount(ids.reshape(-1), minlength=g), jnp.int32))
    glu = dict(kw, up_rhs=uw, rhs_scale=gs, up_scale=us, rhs_index=jnp.int32(1), block_n=block_n)
    f = jax.jit(lambda q: grouped_matmul(x, gw, interpret=interpret, quantize_out=q, **glu), static_argnums=0)
    pair, h = f(True), f(False)
    want = quantize_act_reference(h)
    down = dict(dkw, rhs_scale=ds, rhs_index=jnp.int32(1), preferred_element_type=jnp.bfloat16, interpret=interpret)
    y_pair = grouped_matmul(pair[0], dw, lhs_scale=pair[1], **down)
    y = grouped_matmul(h, dw, **down)
    return pair, want, y_pair, y


@pytest.mark.parametrize("by_row,t", [(True, 3), (True, 9), (False, 9)])  # by row at T = 9: items by group
@pytest.mark.parametrize("block_n", [128, 64])
def test_fp8_glu_output_quantized_for_the_down_projection(by_row, t, block_n):
    """quantize_out: the SwiGLU output in the W8A8 activation format, quantized in the epilogue (128-wide N blocks:
    a program's columns are one scale block; a ragged last one, N = 200) or after the kernel (64-wide): bit for bit
    `quantize_act` of the output the call gives without it (padding rows too); the down projection of the pair
    (lhs_scale=) the same as of that output, quantized by the call."""
    pair, want, y_pair, y = _fp8_glu_case(by_row, t, g=5, n=200, k=256, interpret=True, block_n=block_n)
    assert pair[0].dtype == jnp.float8_e4m3fn and pair[1].shape == want[1].shape == (pair[0].shape[0], 2)
    np.testing.assert_array_equal(np.asarray(pair[0]).view(np.uint8), np.asarray(want[0]).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(pair[1]), np.asarray(want[1]))
    assert np.all(np.isfinite(np.asarray(y, np.float32)))
    np.testing.assert_array_equal(np.asarray(y_pair, np.float32), np.asarray(y, np.float32))


def test_fp8_quantized_lhs_validation():
    rng = np.random.default_rng(0)
    w, sc = _fp8_experts(rng, (2,), 64, 256)
    sizes = jnp.asarray([2, 2], jnp.int32)
    xq, xs = jnp.zeros((4, 256), jnp.float8_e4m3fn), jnp.ones((4, 2), jnp.float32)
    bf = jnp.bfloat16
    cases = [
        (dict(lhs_scale=xs, preferred_element_type=bf), "is for fp8 experts: give rhs_scale"),
        (dict(lhs_scale=xs, rhs_scale=sc), "give preferred_element_type"),
        (dict(lhs_scale=xs[:, :1], rhs_scale=sc, preferred_element_type=bf), r"lhs_scale must be f32\[4, 2\]"),
        (dict(rhs_scale=sc, quantize_out=True), "quantize_out is for fp8 experts with up_rhs"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            grouped_matmul(xq, w, sizes, interpret=True, **kw)
    with pytest.raises(ValueError, match="lhs must be float8_e4m3fn"):
        xb = xq.astype(jnp.bfloat16)
        grouped_matmul(xb, w, sizes, lhs_scale=xs, rhs_scale=sc, preferred_element_type=jnp.float32)


def test_fp8_validation():
    rng = np.random.default_rng(0)
    w, sc = _fp8_experts(rng, (2,), 64, 128)
    x, sizes = jnp.zeros((4, 128), jnp.bfloat16), jnp.asarray([2, 2], jnp.int32)
    cases = [
        (dict(), "need their block scales"),
        (dict(rhs_scale=sc[:, :, :0]), r"rhs_scale must be float32 \(2, 1, 1\)"),
        (dict(rhs_scale=sc, block_k=64), "block_k=64"),
        (dict(rhs_scale=sc, block_n=256), "block_n=256"),
        (dict(rhs_scale=sc, up_rhs=w), "give up_scale exactly when up_rhs"),
        (dict(rhs_scale=sc, transpose_rhs=False), "transpose_rhs=True"),
        (dict(up_scale=sc), "up_scale needs rhs_scale"),
        (dict(rhs_scale=sc, shared_rhs=w[0]), "give shared_scale with shared_rhs"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            grouped_matmul(x, w, sizes, interpret=True, **kw)
    with pytest.raises(ValueError, match="is for float8_e4m3fn"):
        grouped_matmul(x, w.astype(jnp.bfloat16), sizes, rhs_scale=sc, interpret=True)
    wb = w.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="are for fp8 experts"):
        grouped_matmul(x, wb, sizes, shared_rhs=wb[0], shared_scale=sc[0], interpret=True)
    w1, sc1 = _fp8_experts(rng, (2,), 64, 192)  # a shared chunk along N of 64 rows: not whole scale blocks
    with pytest.raises(ValueError, match="whole 128-wide scale blocks"):
        grouped_matmul(
            jnp.zeros((4, 192), jnp.bfloat16),
            w1,
            sizes,
            rhs_scale=sc1,
            interpret=True,
            shared_rhs=w1[0].reshape(64, 192),
            shared_scale=sc1[0],
        )


def test_fp8_lowers_to_triton(h200):
    """V2-Lite's experts at a decode step (top-6 of one token, gate + up; down), stacked over 26 layers and read in
    place: one Triton kernel each after the activations' quantization kernel, no slice of the stacked e4m3 weights or
    scales."""
    sds = jax.ShapeDtypeStruct
    f8, bf, f32, i32 = jnp.float8_e4m3fn, jnp.bfloat16, jnp.float32, jnp.int32
    ids = sds((1, 6), i32)
    glu = jax.jit(
        lambda x, g, u, gs, us, ids, i: grouped_matmul(
            x, g, row_groups=ids, up_rhs=u, rhs_scale=gs, up_scale=us, rhs_index=i
        )
    )
    args = (sds((1, 2048), bf), sds((26, 64, 1408, 2048), f8), sds((26, 64, 1408, 2048), f8))
    args += (sds((26, 64, 11, 16), f32), sds((26, 64, 11, 16), f32), ids, sds((), i32))
    down = jax.jit(lambda h, w, s, ids, i: grouped_matmul(h, w, row_groups=ids, rhs_scale=s, rhs_index=i))
    dargs = (sds((6, 1408), bf), sds((26, 64, 2048, 1408), f8), sds((26, 64, 16, 11), f32), ids, sds((), i32))
    # the shared experts' 2 chunks as more groups (their stacked weights and scales read in place too)
    sglu = jax.jit(
        lambda x, g, u, gs, us, ids, i, sg, su, sgs, sus: grouped_matmul(
            x,
            g,
            row_groups=ids,
            up_rhs=u,
            rhs_scale=gs,
            up_scale=us,
            rhs_index=i,
            shared_rhs=sg,
            shared_up_rhs=su,
            shared_scale=sgs,
            shared_up_scale=sus,
        )
    )
    sargs = args + (sds((26, 2816, 2048), f8),) * 2 + (sds((26, 22, 16), f32),) * 2
    sdown = jax.jit(
        lambda h, w, s, ids, i, sw, ss: grouped_matmul(
            h, w, row_groups=ids, rhs_scale=s, rhs_index=i, shared_rhs=sw, shared_scale=ss
        )
    )
    sdargs = (sds((8, 1408), bf),) + dargs[1:] + (sds((26, 2048, 2816), f8), sds((26, 16, 22), f32))
    for fn, a in ((glu, args), (down, dargs), (sglu, sargs), (sdown, sdargs)):
        text = fn.trace(*a).lower(lowering_platforms=("cuda",)).as_text()
        # two Triton kernels: lhs's quantization (`fp8_quant`) and the grouped GEMM
        assert text.count("__gpu$xla.gpu.triton") == 2 and "quantize_act_k" in text and "slice" not in text
        assert "grouped_" in text and "_fp8_" in text


@pytest.mark.parametrize("fp8", [False, True])
def test_top_k_by_group_lowers_to_the_table_and_the_gemm(h200, fp8):
    """Batch 32's top-6 of V2-Lite's 64 experts with its 2 shared chunks, gate + up, items by group: `group_table`'s
    kernel and the GEMM (fp8: after the activations' quantization), no XLA sort, gather or scatter of the copies."""
    sds = jax.ShapeDtypeStruct
    wdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    w = sds((26, 64, 1408, 2048), wdt)
    sh = sds((26, 2816, 2048), wdt)
    args = [sds((32, 2048), jnp.bfloat16), w, w, sh, sh, sds((32, 6), jnp.int32), sds((), jnp.int32)]
    if fp8:
        args += [sds((26, 64, 11, 16), jnp.float32)] * 2 + [sds((26, 22, 16), jnp.float32)] * 2

    def f(x, g, u, sg, su, ids, i, *scales):
        kw = dict(zip(("rhs_scale", "up_scale", "shared_scale", "shared_up_scale"), scales))
        return grouped_matmul(x, g, row_groups=ids, up_rhs=u, shared_rhs=sg, shared_up_rhs=su, rhs_index=i, **kw)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2 + fp8 and "expert_table_t32_k6_g64_c2" in text
    for op in ("stablehlo.sort", "stablehlo.gather", "stablehlo.scatter", "stablehlo.dynamic_slice"):
        assert op not in text, op


@pytest.mark.parametrize("fp8", [False, True])
def test_sorted_lowers_to_one_triton_kernel(h200, fp8):
    """Sorted copies (batch 32's 192 copies of V2-Lite's 64 experts), gate + up: the kernel
    derives its work item from group_sizes itself, so the call lowers to the Triton kernel alone (fp8: after lhs's
    quantization), no XLA ops for the work list (an iota, reduces, gathers) before it."""
    sds = jax.ShapeDtypeStruct
    wdt = jnp.float8_e4m3fn if fp8 else jnp.bfloat16
    args = [sds((192, 2048), jnp.bfloat16), sds((26, 64, 1408, 2048), wdt), sds((26, 64, 1408, 2048), wdt)]
    args += [sds((64,), jnp.int32), sds((), jnp.int32)]
    kw = {}
    if fp8:
        args += [sds((26, 64, 11, 16), jnp.float32)] * 2

    def f(x, g, u, sizes, i, *scales):
        if scales:
            kw.update(rhs_scale=scales[0], up_scale=scales[1])
        return grouped_matmul(x, g, sizes, up_rhs=u, rhs_index=i, **kw)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 + fp8 and "grouped_glu" in text
    for op in ("stablehlo.iota", "stablehlo.reduce", "stablehlo.gather", "stablehlo.dynamic_slice"):
        assert op not in text, op


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_rhs", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_random_groups(dtype, transpose_rhs):
    # DeepSeek-V2-Lite gate/up shape (N 1408, K 2048) with ragged groups, empty ones, NaN padding
    _check(_sizes(5, 64, 1500), 1600, 1408, 2048, dtype=dtype, transpose_rhs=transpose_rhs, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tuning",
    [
        {},  # defaults (decode: 16-row tiles)
        dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
        dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),
        dict(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, num_k_splits=4),
    ],
)
def test_gpu_tuning_variants_and_edges(tuning):
    # down-proj shape (K 1408 = 11 x 128, not a multiple of 256), odd N, tiny groups, padding
    sizes = np.random.default_rng(6).integers(0, 5, 64).astype(np.int32)
    _check(sizes, int(sizes.sum()) + 21, 2000, 1408, dtype=jnp.bfloat16, interpret=False, **tuning)
    _check(_sizes(7, 32, 3000), 3100, 7168 + 48, 1408 + 40, dtype=jnp.bfloat16, interpret=False, **tuning)


@pytest.mark.gpu
def test_gpu_deterministic_and_matches_ragged_dot():
    lhs, rhs, gs = _inputs(8, _sizes(8, 64, 3000), 3000, 1408, 2048, jnp.bfloat16)
    f = jax.jit(lambda a, b, c: grouped_matmul(a, b, c))
    a, b = f(lhs, rhs, gs), f(lhs, rhs, gs)
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    want = jax.lax.ragged_dot_general(lhs, rhs, gs, dn, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), np.asarray(want), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_gpu_stacked_rhs(transpose_rhs):
    """rhs [Lyr, G, ...] indexed by a traced layer inside a jitted scan (the model's decode use) on
    the real kernel: every layer's output equals the unstacked call; other layers NaN in the static
    case."""
    layers, sizes, m, n, k = 3, _sizes(12, 64, 12), 12, 1408, 2048  # decode-like: tiny groups
    lhs, rhs, gs, stack = _stacked(12, sizes, m, n, k, layers, jnp.bfloat16, transpose_rhs)
    want = np.asarray(grouped_matmul(lhs, rhs, gs, transpose_rhs=transpose_rhs).astype(jnp.float32))
    got = grouped_matmul(lhs, stack(1), gs, transpose_rhs=transpose_rhs, rhs_index=1)
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), want)
    rng = np.random.default_rng(13)
    st = jnp.asarray(rng.standard_normal((layers,) + rhs.shape, np.float32) / np.sqrt(k), jnp.bfloat16)

    def body(i, _):
        return i + 1, grouped_matmul(lhs, st, gs, transpose_rhs=transpose_rhs, rhs_index=i)

    _, outs = jax.jit(lambda: jax.lax.scan(body, jnp.int32(0), None, length=layers))()
    for i in range(layers):
        one = grouped_matmul(lhs, st[i], gs, transpose_rhs=transpose_rhs)
        np.testing.assert_array_equal(np.asarray(outs[i].astype(jnp.float32)), np.asarray(one.astype(jnp.float32)))


@pytest.mark.gpu
@pytest.mark.parametrize("transpose_rhs", [True, False])
def test_gpu_dims_smaller_than_blocks(transpose_rhs):
    # On the GPU nothing is padded: M, N, K below the block sizes are masked in the kernel
    _check(
        [2, 0, 3, 1],
        9,
        20,
        24,
        dtype=jnp.bfloat16,
        transpose_rhs=transpose_rhs,
        interpret=False,
        block_m=16,
        block_n=32,
        block_k=32,
    )
    _check([2, 0, 3, 1], 9, 20, 24, dtype=jnp.float32, transpose_rhs=transpose_rhs, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [6, 12, 21])
def test_gpu_row_groups_decode_shapes(m):
    """row_groups on the real kernel at V2-Lite's expert shapes (gate/up N 1408 K 2048, down N 2048 K 1408),
    a stacked rhs at layer 1 (layer 0 NaN), out-of-range groups' rows NaN and exactly 0; the same rows sorted
    through group_sizes give the same bits."""
    for n, k in ((1408, 2048), (2048, 1408)):
        lhs, rhs, groups = _row_inputs(m + n, m, 64, n, k, jnp.bfloat16, layers=(2, 1))
        out = grouped_matmul(lhs, rhs, row_groups=groups, rhs_index=1)
        ref = np.asarray(grouped_matmul_reference(lhs, rhs, row_groups=groups, rhs_index=1))
        out = np.asarray(out.astype(jnp.float32))
        bad = (np.asarray(groups) < 0) | (np.asarray(groups) >= 64)
        assert np.all(out[bad] == 0) and np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, *TOL[jnp.bfloat16][::-1])
        order = np.argsort(np.where(bad, 64, np.asarray(groups)), kind="stable")
        sizes = jnp.asarray(np.bincount(np.asarray(groups)[~bad], minlength=64).astype(np.int32))
        got = grouped_matmul(lhs[order], rhs, sizes, rhs_index=1)
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), out[order])


@pytest.mark.gpu
@pytest.mark.parametrize("m", [6, 768])
def test_gpu_glu_decode_shapes(m):
    """The fused gate/up (SwiGLU) kernel at V2-Lite's expert shape (N 1408, K 2048), stacked at layer 1
    (gate's layer 0 NaN): 6 unsorted copies (batch 1) and 768 sorted ones (batch 128), against the float32
    reference."""
    rng = np.random.default_rng(m)
    if m == 6:
        lhs, gate, groups = _row_inputs(m, m, 64, 1408, 2048, jnp.bfloat16, layers=(2, 1))
        kw = dict(row_groups=groups)
    else:
        lhs, gate, gs, stack = _stacked(m, _sizes(m, 64, m - 5), m, 1408, 2048, 2, jnp.bfloat16, True)
        gate, kw = stack(1), dict(group_sizes=gs)
    up = jnp.asarray(rng.standard_normal(gate.shape, np.float32) / np.sqrt(2048), jnp.bfloat16)
    out = grouped_matmul(lhs, gate, up_rhs=up, rhs_index=1, **kw)
    ref = np.asarray(grouped_matmul_reference(lhs, gate, up_rhs=up, rhs_index=1, **kw))
    out = np.asarray(out.astype(jnp.float32))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("by_row, T", [("topk", 1), ("flat", 2), (False, 128), ("topk", 32), ("topk_copies", 128)])
def test_gpu_shared_chunks_decode_shapes(by_row, T):
    """The shared experts as 2 more groups at V2-Lite's expert shapes: gate/up (glu) N 1408 K 2048 with the shared
    [2816, 2048], down N 2048 K 1408 with the shared [2048, 2816]; batch 1-2 unsorted, 128 sorted; 32 and 128 as a
    top-k, items by group (an expert's copies over two row tiles at 128)."""
    _shared_case(by_row, "n", True, 16, 1408, 2048, 2, T, 6, jnp.bfloat16)  # 16 experts: the host work stays small
    _shared_case(by_row, "k", False, 16, 2048, 1408, 2, T, 6, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 32])
def test_gpu_fp8_shared_chunks_decode(t):
    """V2-Lite's fp8 shared experts (2 chunks of its [1408, 2048] experts) as groups of the routed kernels at a
    decode step (16 experts: the reference's host work stays small); 32 tokens: items by group, each row stored at
    its copy."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _fp8_shared_case(t=t, top_k=6, g=16, i_sz=1408, d=2048, c=2, interpret=False)


@pytest.mark.gpu
@pytest.mark.parametrize("by_row,t", [(True, 1), (True, 8), (False, 32), (True, 32)])  # (True, 32): items by group
def test_gpu_fp8_glu_output_quantized(by_row, t):
    """On the GPU, V2-Lite's expert shape (64 of [1408, 2048]) with 128-wide N blocks: the epilogue's quantization
    against `quantize_act` of the unquantized call's output (the same accumulators; all but a rounding tie the same
    e4m3 values), and the down projection of the pair against that of the output."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    pair, want, y_pair, y = _fp8_glu_case(by_row, t, g=64, n=1408, k=2048, interpret=False, block_n=128)
    same = np.asarray(pair[0]).view(np.uint8) == np.asarray(want[0]).view(np.uint8)
    assert same.mean() > 0.999, same.mean()
    np.testing.assert_allclose(np.asarray(pair[1]), np.asarray(want[1]), rtol=1e-6)
    _close_rel(y_pair, y, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 32])
def test_gpu_fp8_decode_experts(t):
    """V2-Lite's fp8 experts (64 of [1408, 2048]) at decode sizes, stacked over 3 layers between NaN ones: gate + up
    by token top-6 (unsorted at T <= 2, sorted by expert at 32) and down, against the W8A8 reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(t)
    g, top_k, n, k = 64, 6, 1408, 2048
    x = jnp.asarray(rng.standard_normal((t, k), np.float32), jnp.bfloat16)
    ids = jnp.asarray(np.stack([rng.permutation(g)[:top_k] for _ in range(t)]), jnp.int32)
    (gw, gs), (uw, us) = (_fp8_experts(rng, (3, g), n, k, poison=2) for _ in range(2))
    dw, ds = _fp8_experts(rng, (3, g), k, n, poison=2)
    if t * top_k <= 16:
        kw = dict(row_groups=ids)
        h_in = x
    else:  # sorted copies, group sizes
        order = jnp.argsort(ids.reshape(-1), stable=True)
        kw = dict(group_sizes=jnp.bincount(ids.reshape(-1), length=g).astype(jnp.int32))
        h_in = x[order // top_k]
    glu = dict(up_rhs=uw, rhs_scale=gs, up_scale=us, rhs_index=jnp.int32(2))
    h = grouped_matmul(h_in, gw, preferred_element_type=jnp.float32, **kw, **glu)
    _close_rel(h, grouped_matmul_reference(h_in, gw, **kw, **glu), rtol=1e-4)
    hb = h.astype(jnp.bfloat16)
    dkw = dict(kw, row_groups=ids.reshape(-1)) if "row_groups" in kw else kw
    y = grouped_matmul(hb, dw, rhs_scale=ds, rhs_index=jnp.int32(2), preferred_element_type=jnp.float32, **dkw)
    _close_rel(y, grouped_matmul_reference(hb, dw, rhs_scale=ds, rhs_index=2, **dkw), rtol=1e-4)
