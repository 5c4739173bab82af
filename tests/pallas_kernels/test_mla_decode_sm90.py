"""pallas_kernels.mla_decode_sm90 (Hopper, Mosaic GPU) against the float32 reference.

CPU: the kernel runs under the Mosaic GPU interpreter (TMA, mbarriers, wgmma and the three
warpgroups simulated; its happens-before race detector on), and it is lowered for sm_90 (Mosaic
GPU's Python passes: layout inference, wgmma/TMA checks, the shared-memory budget). GPU (-m gpu):
the real kernel against the reference.

The cases, inputs and tolerances are the shared decode suite's (decode_suite.py,
pallas_kernels/testing.py): fresh random numbers, every cache row no query attends to NaN, q rows
with seq_len 0 NaN; the interpreter fills fresh shared memory with NaN too. Tolerances: bf16 and
fp8 caches |out - ref| <= 2e-2 + 2e-2 |ref|, lse within 1e-3 (interpreter), 1e-2 (GPU); fp8_qk on
the GPU its own (testing.DECODE_TOL["fp8_qk"]).

The interpreter's 3 warpgroups need >= 3 XLA CPU workers: see mosaic_interpreter.py.
"""

from __future__ import annotations

import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_decode
from pallas_kernels import mla_decode_sm90 as k90
from pallas_kernels import mla_decode_sm90_narrow as narrow_kernel
from pallas_kernels.testing import (
    DECODE_CASES,
    DECODE_TOL,
    MLA_DECODE_SM90,
    assert_decode_close,
    decode_inputs,
    decode_kind,
    decode_reference,
)
from pallas_kernels.testing import DECODE_SCALE as SCALE
from tests.pallas_kernels.decode_suite import DecodeSuite
from tests.pallas_kernels.mosaic_interpreter import NPROC_IN_TIME, run_interpreted

L, R, G = 512, 64, 64


class TestMlaDecodeSm90(DecodeSuite):
    KERNEL = MLA_DECODE_SM90

    def decode(self, q, cache, bt, sl, ks, *, l, interpret, **kernel_kw):
        if interpret:
            return run_interpreted(
                k90.mla_decode_sm90, q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=l, **kernel_kw
            )
        return k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=l, **kernel_kw)

    def check_case(self, case, seq_lens):
        if case.kernel.get("schedule") == "worklist":  # the case must exercise split and whole tiles
            rows = np.repeat(np.asarray(seq_lens), case.inputs["n"], axis=1)
            rows = np.pad(rows, ((0, 0), (0, -rows.shape[1] % k90.TILE_M)))
            tile_len = rows.reshape(rows.shape[0], -1, k90.TILE_M).max(-1)
            meta, _ = k90.worklist_pieces_reference(
                jnp.asarray(tile_len), case.kernel["num_sms"], k90._WORKLIST_MIN_PAGES
            )
            slots = np.asarray(meta)[:, 4]
            assert (slots >= 0).any() and (slots == -1).any()


def run_decode(q, cache, bt, sl, ks, **kw):
    """The interpreted kernel (race detector on) at L = 512."""
    return run_interpreted(k90.mla_decode_sm90, q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L, **kw)


@pytest.mark.parametrize("num_sms", [1, 4, 132])
def test_worklist_pieces_cover_each_tile(num_sms):
    """The metadata step: pieces tile [0, pages) of every head tile in order, split pieces get
    consecutive unique slots within the static bound, and the grid bound holds."""
    rng = np.random.default_rng(num_sms)
    pieces_fn = jax.jit(k90.worklist_pieces_reference, static_argnums=(1, 2))
    b, t = 7, 2
    for trial in range(12):
        tile_len = rng.integers(0, [700, 20000, 200000][trial % 3], (b, t)).astype(np.int32)
        tile_len[rng.random((b, t)) < 0.2] = 0
        meta, slot_tile = pieces_fn(jnp.asarray(tile_len), num_sms, k90._WORKLIST_MIN_PAGES)
        meta, slot_tile = np.asarray(meta), np.asarray(slot_tile)
        assert meta.shape == (b * t + k90.worklist_slots(num_sms), 6)
        pages = -(-tile_len.reshape(-1) // G)
        seen = {tile: [] for tile in range(b * t)}
        for bb, hh, p0, n, slot, tl in meta:
            if slot == -2:
                assert n == 0
                continue
            tile = bb * t + hh
            assert tl == tile_len[bb, hh]
            seen[tile].append((p0, n, slot))
        for tile, pieces in seen.items():
            assert pieces, f"tile {tile} has no piece"
            assert [p0 for p0, _, _ in pieces] == list(np.cumsum([0] + [n for _, n, _ in pieces])[:-1])
            assert sum(n for _, n, _ in pieces) == pages[tile]
            slots = [slot for _, _, slot in pieces]
            if len(pieces) == 1:
                assert slots == [-1]
            else:
                assert all(n > 0 for _, n, _ in pieces)
                assert slots == list(range(slots[0], slots[0] + len(slots)))
                assert all(slot_tile[sl] == tile for sl in slots)
        assert (slot_tile >= 0).sum() == sum(len(p) for p in seen.values() if len(p) > 1)


def _cuts_want(pages, num_sms, min_pages=4):
    """`_worklist_cuts` in exact rationals: one wave (pieces <= 9/8 total / SMs) where its pieces number at most
    SMs, else pieces <= total / (1.5 SMs); min_pages and the clip to [1, pages] in both."""

    def cuts(share):
        target = max(share * int(pages.sum()) / num_sms, Fraction(min_pages))
        return [min(max(math.ceil(Fraction(int(p)) / target), 1), max(int(p), 1)) for p in pages]

    one = cuts(Fraction(9, 8))
    return one if sum(one) <= num_sms else cuts(Fraction(2, 3))


def test_worklist_cuts_ceil():
    """k = ceil(pages / target) against exact rationals, both rules: exact multiples (uniform lengths give
    pages / target = 1.5 SMs / tiles) included, and batches on both sides of the one-wave test; padding tiles
    (not `real`) change nothing."""
    rng = np.random.default_rng(3)
    cases = [np.full(12, 6), np.full(11, 9), np.array([0, 0, 5]), np.zeros(4, int), np.arange(1, 40)]
    cases += [np.full(40, 16), np.full(33, 127), np.full(64, 64), np.r_[np.full(30, 16), 400], np.full(60, 3)]
    cases += [rng.integers(0, 3000, rng.integers(1, 60)) for _ in range(40)]
    cuts = jax.jit(k90._worklist_cuts, static_argnums=(1, 2))
    rules = {True: 0, False: 0}  # cases cut in one wave or not
    for pages in cases:
        for num_sms in (1, 4, 132):
            want = _cuts_want(pages, num_sms)
            rules[sum(want) <= num_sms] += 1
            padded = np.zeros(64, np.int32)  # padding tiles, masked off: one compile per num_sms
            padded[: len(pages)] = pages
            got = cuts(jnp.asarray(padded), num_sms, 4, jnp.arange(64) < len(pages))
            np.testing.assert_array_equal(np.asarray(got)[: len(pages)], want)
    assert min(rules.values()) > 10, rules


def test_worklist_one_wave_uniform():
    """A batch of equal requests that fits one wave is cut as the grid would (128 x 16 pages on 132 SMs: whole;
    64 x 64: halves) and a ragged one of as many requests takes the many-wave rule."""
    cuts = jax.jit(k90._worklist_cuts, static_argnums=(1, 2))
    np.testing.assert_array_equal(cuts(jnp.full(128, 16, jnp.int32), 132, 4), np.ones(128))
    np.testing.assert_array_equal(cuts(jnp.full(128, 128, jnp.int32), 132, 4), np.ones(128))
    np.testing.assert_array_equal(cuts(jnp.full(64, 64, jnp.int32), 132, 4), np.full(64, 2))
    ragged = np.r_[np.full(127, 4), 512].astype(np.int32)  # the long request alone would want ~20 pieces
    got = np.asarray(cuts(jnp.asarray(ragged), 132, 4))
    assert got.sum() > 132 and got[-1] == math.ceil(512 / max(Fraction(2 * int(ragged.sum()), 3 * 132), 4))


@pytest.mark.parametrize(
    "b, kw, want",
    [
        (k90.NARROW_WORKLIST_MIN_BATCH, {}, "worklist"),
        (k90.NARROW_WORKLIST_MIN_BATCH - 1, {}, "grid"),
        (k90.NARROW_WORKLIST_MIN_BATCH, dict(num_kv_splits=2), "grid"),
        (k90.NARROW_WORKLIST_MIN_BATCH, dict(batch_invariant=True), "grid"),
        (k90.NARROW_WORKLIST_MIN_BATCH, dict(schedule="grid"), "grid"),
        (2, dict(schedule="worklist"), "worklist"),
    ],
)
def test_default_schedule_by_batch(monkeypatch, b, kw, want):
    """schedule=None: the narrow kernel cuts requests by length from NARROW_WORKLIST_MIN_BATCH requests on
    (unless splits or batch invariance are asked for); an explicit schedule is kept."""

    class Chosen(Exception):
        pass

    def spy(*args, schedule, **_):
        raise Chosen(schedule)

    monkeypatch.setattr(k90, "_narrow", spy)
    q = jax.ShapeDtypeStruct((b, 1, 16, L + R), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((64, G, L + R), jnp.bfloat16)
    bt, sl = jax.ShapeDtypeStruct((b, 8), jnp.int32), jax.ShapeDtypeStruct((b, 1), jnp.int32)
    with pytest.raises(Chosen) as chosen:
        jax.eval_shape(lambda *a: k90.mla_decode_sm90(*a, scale=SCALE, num_sms=132, **kw), q, cache, bt, sl)
    assert chosen.value.args[0] == want


def test_worklist_bounds_error():
    k90._check_worklist_bounds(256, 512, 132, 4)  # a decode batch: fine
    with pytest.raises(ValueError, match="overflow its int32"):
        k90._check_worklist_bounds(4096, 2**18 - 1, 132, 4)


def _worklist_lengths(rng, nt):
    """Head-tile lengths i32[nt] of varied kinds: ragged with zeros, all equal (ties), one huge
    request among tiny ones, all zero, a few pages each."""
    kind = rng.integers(5)
    if kind == 0:
        tl = rng.integers(0, 40000, nt)
        tl[rng.random(nt) < 0.25] = 0
    elif kind == 1:
        tl = np.full(nt, rng.integers(1, 40000))
    elif kind == 2:
        tl = rng.integers(0, 300, nt)
        tl[rng.integers(nt)] = rng.integers(100000, 1 << 20)
    elif kind == 3:
        tl = np.zeros(nt)
    else:
        tl = rng.integers(0, 12 * G, nt)
    return tl.astype(np.int32)


def _worklist_want(ref_fn, tile_len, num_sms):
    """(meta, slot_tile) of the reference, then the merge's (seg_first, seg_count) from slot_tile and its list of
    split tiles."""
    meta, slot_tile = ref_fn(tile_len, num_sms, k90._WORKLIST_MIN_PAGES)
    seg_first, seg_count = mla_decode.segments_from_slot_tile(slot_tile, tile_len.size)
    num_split = min(tile_len.size, k90.worklist_slots(num_sms) // 2)
    return meta, slot_tile, seg_first, seg_count, mla_decode.split_tiles_of(seg_count, num_split)


@pytest.mark.parametrize("num_sms", [4, 132])
def test_worklist_kernel_matches_reference(num_sms):
    """The one-program Triton kernel (interpret mode) writes the reference's meta and slot_tile, and
    the merge's segments, bit for bit, B*T from 1 to 300 (padding tiles of the power-of-two lanes
    change nothing)."""
    rng = np.random.default_rng(num_sms)
    # The reference and the segments in one program: one compile a shape instead of one each plus eager ops.
    want_fn = jax.jit(lambda tile_len: _worklist_want(k90.worklist_pieces_reference, tile_len, num_sms))
    for b, t in ((1, 1), (5, 3), (33, 2), (300, 1)):
        for _ in range(6):
            tile_len = jnp.asarray(_worklist_lengths(rng, b * t).reshape(b, t))
            got = k90.worklist_pieces(tile_len, num_sms, k90._WORKLIST_MIN_PAGES, interpret=True)
            want = want_fn(tile_len)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype == jnp.int32
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_worklist_kernel_lowers_to_triton(h200):
    """Triton IR generation on CPU with an H200 stand-in for the device query: one kernel, one
    program, at decode size (128 requests x 2 head tiles, 132 SMs) and at one tile."""
    for b, t in ((128, 2), (1, 1)):
        f = jax.jit(lambda x: k90.worklist_pieces(x, 132, k90._WORKLIST_MIN_PAGES))
        text = f.trace(jax.ShapeDtypeStruct((b, t), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert "grid_x = 1 : i32, grid_y = 1 : i32, grid_z = 1 : i32" in text


@pytest.mark.gpu
def test_gpu_worklist_kernel_matches_reference():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(7)
    ref_fn = jax.jit(k90.worklist_pieces_reference, static_argnums=(1, 2))
    for b, t in ((1, 1), (7, 2), (128, 2), (256, 1), (512, 2)):
        for num_sms in (4, 132):
            for _ in range(8):
                tile_len = jnp.asarray(_worklist_lengths(rng, b * t).reshape(b, t))
                got = k90.worklist_pieces(tile_len, num_sms, k90._WORKLIST_MIN_PAGES)
                want = _worklist_want(ref_fn, tile_len, num_sms)
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_batch_invariant_bitwise():
    kw = dict(b=3, nq=1, n=16, l=L, r=R, g=G, max_pages=2, lens=[90, 33, 128])
    q, cache, bt, sl, _ = decode_inputs(5, **kw)
    out, lse = run_decode(q, cache, bt, sl, None, batch_invariant=True)
    out1, lse1 = run_decode(q[1:2], cache, bt[1:2], sl[1:2], None, batch_invariant=True)
    np.testing.assert_array_equal(np.asarray(out[1:2], np.float32), np.asarray(out1, np.float32))
    np.testing.assert_array_equal(np.asarray(lse[1:2]), np.asarray(lse1))


@pytest.mark.parametrize("n, cache_dtype", [(16, "bf16"), (128, "fp8")])
def test_step_plan(monkeypatch, n, cache_dtype):
    """`decode_plan` is the work list the call would build (narrow and 64-row kernels), and a call given it builds
    none (worklist_pieces patched to fail) and still matches the float32 reference; it is None where the grid
    runs, and a plan where the grid runs or of another batch is an error that names it."""
    lens = [3000, 40, 700, 0, 1500]
    kw = dict(b=len(lens), nq=1, n=n, l=L, r=R, g=G, max_pages=48, lens=lens, cache_dtype=cache_dtype)
    q, cache, bt, sl, ks = decode_inputs(17, **kw)
    opts = dict(schedule="worklist", num_sms=4)
    plan = k90.decode_plan(q, cache, bt, sl, interpret=True, **opts)
    _, tile_len = k90._row_and_tile_lens(sl, n, bt.shape[1])
    want = k90.worklist_pieces(tile_len, 4, k90._WORKLIST_MIN_PAGES, interpret=True)
    for got, w in zip(plan, [want[0], *want[2:]], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    assert (np.asarray(plan.meta)[:, 4] >= 0).any(), "the case must split a tile"

    def no_metadata(*_, **__):
        raise AssertionError("the call built a work list of its own")

    monkeypatch.setattr(k90, "worklist_pieces", no_metadata)
    out, lse = run_decode(q, cache, bt, sl, ks, plan=plan, **opts)
    ref, ref_lse = jax.jit(lambda *a: decode_reference(*a, {}))(q, cache, bt, sl, ks)
    assert_decode_close(out, lse, ref, ref_lse, cache_dtype)

    assert k90.decode_plan(q, cache, bt, sl, schedule="grid", num_sms=4) is None
    assert k90.decode_plan(q, cache, bt, sl, num_sms=4) is None  # 5 requests: the grid by default
    call = lambda *a, **o: jax.eval_shape(  # noqa: E731
        lambda *a: k90.mla_decode_sm90(*a, scale=SCALE, kv_scale=ks, **o), *a
    )
    with pytest.raises(ValueError, match="this call runs schedule='grid'"):
        call(q, cache, bt, sl, schedule="grid", num_sms=4, plan=plan)
    with pytest.raises(ValueError, match="plan.meta is int32"):
        call(q[:3], cache, bt[:3], sl[:3], plan=plan, **opts)


def test_attention_backend_pallas_sm90(monkeypatch):
    """get_backend("pallas_sm90") decodes through this kernel for page 64 when heads x query tokens fill
    its 64-row tile, or are few enough for its narrow kernel (one request's too); through the portable kernel
    otherwise (another page size); an fp8 cache exactly in the narrow kernel, with fp8 P.V in 64-row tiles; CPU
    keeps "xla" as the default backend."""
    from mla_jax import attention

    calls = []
    real = k90.mla_decode_sm90
    monkeypatch.setattr(
        k90, "mla_decode_sm90", lambda *a, **kw: calls.append(kw.get("fp8_qk", False)) or real(*a, **kw)
    )
    if not NPROC_IN_TIME:
        pytest.skip("NPROC was raised too late for the interpreter")
    decode = attention.get_backend("pallas_sm90").mla_decode
    # sm90; page 16; 16 rows (narrow); 16 rows of one request (narrow)
    for g, nq, lens, n_calls in ((G, 4, [100, 7], 1), (16, 4, [100, 7], 1), (G, 1, [100, 7], 2), (G, 1, [90], 3)):
        q, cache, bt, sl, _ = decode_inputs(21, b=len(lens), nq=nq, n=16, l=L, r=R, g=g, max_pages=128 // g, lens=lens)
        out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=None, kv_lora_rank=L)
        ref, ref_lse = jax.jit(lambda *a: k90.mla_decode_reference(*a, scale=SCALE))(q, cache, bt, sl)
        assert_decode_close(out, lse, ref, ref_lse, "bf16")
        assert len(calls) == n_calls
    # one request's 16 rows of an fp8 cache: the narrow kernel (faster than Triton's fp8 path at batch 1 on the H200)
    q, cache, bt, sl, ks = decode_inputs(25, b=1, nq=1, n=16, l=L, r=R, g=G, max_pages=3, lens=[150], cache_dtype="fp8")
    out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L)
    ref, ref_lse = jax.jit(lambda *a: decode_reference(*a, {}))(q, cache, bt, sl, ks)
    assert_decode_close(out, lse, ref, ref_lse, "fp8")
    assert len(calls) == 4 and not any(calls)
    # 4 tokens x 16 heads of an fp8 cache: one 64-row tile, the fp8 P.V kernel
    q, cache, bt, sl, ks = decode_inputs(
        26, b=2, nq=4, n=16, l=L, r=R, g=G, max_pages=3, lens=[150, 7], cache_dtype="fp8"
    )
    out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L)
    ref, ref_lse = jax.jit(lambda *a: decode_reference(*a, {"fp8_qk": True}))(q, cache, bt, sl, ks)
    assert_decode_close(out, lse, ref, ref_lse, "fp8_pv")
    assert calls == [False] * 4 + [True]
    assert attention.default_backend_name() == "xla"


def test_attention_backend_pallas_sm90_fp8qk(monkeypatch):
    """ "pallas_sm90_fp8qk" decodes an fp8 cache with fp8_qk=True on one e4m3 term of q (fp8_q_split=False: against
    the reference on that q) and a bf16 cache exactly like "pallas_sm90"."""
    from mla_jax import attention

    calls = []
    real = k90.mla_decode_sm90
    monkeypatch.setattr(
        k90,
        "mla_decode_sm90",
        lambda *a, **kw: calls.append((kw.get("fp8_qk", False), kw.get("fp8_q_split"))) or real(*a, **kw),
    )
    if not NPROC_IN_TIME:
        pytest.skip("NPROC was raised too late for the interpreter")
    decode = attention.get_backend("pallas_sm90_fp8qk").mla_decode
    for cache_dtype in ("fp8", "bf16"):
        q, cache, bt, sl, ks = decode_inputs(
            23, b=2, nq=4, n=16, l=L, r=R, g=G, max_pages=3, lens=[150, 7], cache_dtype=cache_dtype
        )
        out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=L)
        fp8_qk = cache_dtype == "fp8"
        kw = {"fp8_qk": True, "fp8_q_split": False} if fp8_qk else {}
        ref, ref_lse = jax.jit(lambda *a: decode_reference(*a, kw))(q, cache, bt, sl, ks)
        # 64 rows: the 64-row kernel, whose fp8_qk rounds P to e4m3 for its fp8 P.V
        assert k90.uses_fp8_pv(64, cache.dtype) == fp8_qk
        assert_decode_close(out, lse, ref, ref_lse, "fp8_pv" if fp8_qk else "bf16")
        assert calls[-1] == ((True, False) if fp8_qk else (False, None))
    assert len(calls) == 2


def _merge_splits_ref(o_part, lse_part, *, out_dtype, interpret, transposed=False):
    """`merge_splits`'s jnp reference in its signature: the Triton merge needs a GPU to lower."""
    out, lse = mla_decode.merge_splits_reference(jnp.swapaxes(o_part, -1, -2) if transposed else o_part, lse_part)
    return out.astype(out_dtype), lse


def _lower_for_sm90(cache_dtype, n=16, **kw):
    q, cache, bt, sl, ks = decode_inputs(
        9, b=2, nq=1, n=n, l=L, r=R, g=G, max_pages=3, lens=[150, 7], cache_dtype=cache_dtype
    )
    f = jax.jit(lambda *a: k90.mla_decode_sm90(*a[:4], kv_scale=a[4], scale=SCALE, **kw))
    return f.trace(q, cache, bt, sl, ks).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "cache_dtype, kw",
    [
        ("bf16", dict(num_kv_splits=2, num_sms=132)),
        ("bf16", dict(num_kv_splits=1, num_sms=132)),
        ("fp8", dict(num_kv_splits=2, num_sms=132)),
        ("fp8", dict(num_kv_splits=1, fp8_stages=1, num_sms=132)),
        ("bf16", dict(schedule="worklist", num_sms=132)),
        ("bf16", dict(n=80, num_kv_splits=2, num_sms=132)),  # 2 tiles, the last with 16 rows
        ("fp8", dict(n=128, schedule="worklist", num_sms=132)),
        ("fp8", dict(num_kv_splits=1, fp8_qk=True, num_sms=132)),
        ("fp8", dict(n=128, schedule="worklist", fp8_qk=True, num_sms=132)),
        ("fp8", dict(schedule="worklist", num_sms=132)),  # the narrow kernel's work list
        ("fp8", dict(schedule="worklist", fp8_qk=True, num_sms=132)),
        ("bf16", dict(n=40, schedule="worklist", num_sms=132)),  # 64-row work list, one 40-row tile
    ],
)
def test_lowers_for_sm90(cache_dtype, kw, monkeypatch, h200):
    """The GPU code path (which differs from the interpreted one in `mgpu.wgmma_accumulate` and in WG0's P.V taking P
    from its registers, bf16 and exact fp8) passes Mosaic GPU's Python lowering for sm_90: layouts, wgmma and TMA
    shapes, 227 KB of shared memory.
    The split merges are Triton kernels, which need a GPU to lower: their jnp references stand in
    here (the kernel has its own interpreter and GPU tests in test_mla_decode.py)."""

    monkeypatch.setattr(k90, "merge_splits", _merge_splits_ref)

    def merge_segments_ref(
        out, lse, o_part, lse_part, seg_first, seg_count, split_tiles, *, interpret, transposed=False
    ):
        if transposed:  # [P * L, M] -> [P * M, L]
            m, l = out.shape[1], out.shape[2]
            p = lse_part.shape[0] // m
            o_part = jnp.swapaxes(o_part.reshape(p, l, m), 1, 2).reshape(p * m, l)
        return mla_decode.merge_segments_reference(out, lse, o_part, lse_part, seg_first, seg_count)

    monkeypatch.setattr(k90, "merge_segments", merge_segments_ref)
    text = _lower_for_sm90(cache_dtype, **kw)
    assert "mosaic_gpu" in text
    # Which kernel: the narrow one for <= 16 rows, either schedule (fp8_qk: its one-term q), else 64-row tiles.
    narrow = kw.get("n", 16) <= 16
    kind = {"bf16": "bf16", "fp8": "fp8qk" if kw.get("fp8_qk") else "fp8"}[cache_dtype]
    assert (f"mla_decode_sm90_narrow_{kind}_m16" in text) == narrow
    assert ("uses_pdl" in text) == (narrow and narrow_kernel.PDL)
    # Triton kernels (with an H200 stand-in for the device query): the work list's metadata step, and the 64-row
    # fp8_qk's q quantize (the narrow kernel splits an fp8 cache's q in place).
    quantize = bool(kw.get("fp8_qk")) and not narrow
    assert text.count("__gpu$xla.gpu.triton") == (kw.get("schedule") == "worklist") + quantize
    assert ("quantize_q_fp8_r" in text) == quantize


def _case_matches(name, **over):
    """The 64-row case `name` of the shared table with kernel options `over` on top, interpreted (race detector on),
    against the float32 reference for those options (fp8_qk: "fp8_pv"); returns (the case, its inputs, the kernel's
    lse)."""
    case = next(c for c in DECODE_CASES if c.name == name)
    kw = dict(case.kernel, **over)
    inputs = case.make()
    out, lse = run_decode(*inputs, **kw)
    ref, ref_lse = jax.jit(lambda *a: decode_reference(*a, kw, case.l))(*inputs)
    assert_decode_close(out, lse, ref, ref_lse, "fp8_pv" if kw.get("fp8_qk") else decode_kind(case))
    return case, inputs, lse


@pytest.mark.parametrize("name", ["fp8_qk_n40_worklist", "fp8_qk_q2_causal_n64_2splits"])
def test_fp8_pv_two_q_terms_keep_the_residual(name):
    """fp8_q_split=True on 64-row fp8_qk cases, interpreted (race detector on): against the float32 reference on
    (q_hi + its residual) * scale, P rounded to e4m3 its only other loss ("fp8_pv"; NaN-poisoned rows past each
    length; the work list with 24 padding rows and a 1-token request; causal rows of two tokens over two splits, a
    split past a request's length a piece without pages, odd and even page pairs); and its lse off the one-term
    reference's by more than that bound, so the kernel did add the residual's chain. (The shared suite runs fp8_qk
    cases on one term, the default, but for `fp8_qk_split_n128`.)"""
    case, inputs, lse = _case_matches(name, fp8_q_split=True)
    one_ref_lse = np.asarray(jax.jit(lambda *a: decode_reference(*a, case.kernel, case.l))(*inputs)[1])
    live = np.isfinite(one_ref_lse)
    assert np.abs(np.asarray(lse)[live] - one_ref_lse[live]).max() > DECODE_TOL["fp8_pv"][1]


@pytest.fixture
def knob_on(request, monkeypatch):
    """The 64-row kernel's switch `request.param` on (`SPLIT_SLOTS`: the bf16 body's ring slots in three buffers and
    two barrier groups; `BF16_PAIRS`: the bf16 kernel's pages in pairs), read at trace time: the jitted kernels traced
    afresh before and after."""
    jax.clear_caches()
    monkeypatch.setattr(k90, request.param, True)
    yield
    jax.clear_caches()


@pytest.mark.parametrize(
    "name",
    [
        "q2_causal_n40_straddling_tiles_3splits_page_offset_bf16",
        "worklist_rows64_single_tile_n40_bf16",
        "fp8_q2_causal_n64_2splits",
        "worklist_fp8_q2_causal_n64",
    ],
)
@pytest.mark.parametrize("knob_on", ["SPLIT_SLOTS"], indirect=True)
def test_split_slots_match_reference(name, knob_on):
    """Slots in three buffers, interpreted (race detector on: the next page's group 0 lands while WG1 reads this
    page's group 1), against the reference: bf16 causal rows straddling two tiles over three splits (partial last pages
    zeroed a part at a time) and the work list; exact fp8 (the producer casts into group 0, WG1 into group 1) on the
    grid and the work list."""
    _case_matches(name)


@pytest.mark.parametrize(
    "name, over",
    [
        ("q2_causal_n40_straddling_tiles_3splits_page_offset_bf16", {}),
        ("q2_causal_n40_straddling_tiles_3splits_page_offset_bf16", dict(num_kv_splits=1)),
        ("worklist_rows64_single_tile_n40_bf16", {}),
        ("n80_two_tiles_tail16_1split_bf16", {}),
    ],
)
@pytest.mark.parametrize("knob_on", ["BF16_PAIRS"], indirect=True)
def test_bf16_pairs_match_reference(name, over, knob_on, monkeypatch):
    """Pages in pairs on a bf16 cache, interpreted (race detector on: each slot's parts released and reloaded one by
    one, P in the rope's buffer, the maxima's rendezvous), against the reference: causal rows straddling two tiles over
    three splits (pieces of 2 and 0 pages) and over one (4 and 2: the slots reused by a second pair, partial last
    pages zeroed a part at a time); the work list (8 pages cut into pieces, a 1-page request: a pair of one); two tiles
    with a 1-page request."""
    calls = []
    body = k90._body_pairs16
    monkeypatch.setattr(k90, "_body_pairs16", lambda *a: calls.append(1) or body(*a))
    _case_matches(name, **over)
    assert calls  # the pairs body is what ran


def test_fp8_pv_needs_an_even_ring():
    """An odd fp8 ring would hand a slot's pages to both consumers in turn: refused, naming the argument."""
    case = next(c for c in DECODE_CASES if c.name == "fp8_qk_n40_worklist")
    with pytest.raises(ValueError, match="fp8_stages=3: the fp8 P.V kernel's page pairs need an even fp8 ring"):
        run_decode(*case.make(), **dict(case.kernel, fp8_stages=3))


@pytest.mark.parametrize("kw", [dict(n=128, num_kv_splits=2), dict(n=64, schedule="worklist")])
@pytest.mark.parametrize("knob_on", ["BF16_PAIRS"], indirect=True)
def test_bf16_pairs_lower_for_sm90(kw, knob_on, monkeypatch, h200):
    """Pages in pairs on a bf16 cache (three TMAs a page, QK^T's parts each after its wait, P stored into the rope's
    buffer, the own page's P.V with P from registers, the other's from shared memory, the odd pair's conditional)
    pass Mosaic GPU's lowering in either schedule."""
    monkeypatch.setattr(k90, "merge_splits", _merge_splits_ref)
    assert "_pairs16" in _lower_for_sm90("bf16", num_sms=132, **kw)


@pytest.mark.parametrize(
    "cache_dtype, kw",
    [
        ("bf16", dict(n=128, num_kv_splits=2)),
        ("bf16", dict(n=64, schedule="worklist")),
        ("fp8", dict(n=64, num_kv_splits=2)),
    ],
)
@pytest.mark.parametrize("knob_on", ["SPLIT_SLOTS"], indirect=True)
def test_split_slots_lower_for_sm90(cache_dtype, kw, knob_on, monkeypatch, h200):
    """Slots in three buffers (TMAs of a page's column slices, QK^T as three wgmmas on Q's column slices, a group's
    wait between them, P.V on a whole part) pass Mosaic GPU's lowering, bf16 and exact fp8."""
    monkeypatch.setattr(k90, "merge_splits", _merge_splits_ref)
    assert "_slots3" in _lower_for_sm90(cache_dtype, num_sms=132, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(n=64, num_kv_splits=2),
        dict(n=128, schedule="worklist"),
        dict(n=64, num_kv_splits=2, fp8_q_split=True),
    ],
)
def test_fp8_pv_lowers_for_sm90(kw, monkeypatch, h200):
    """The fp8 P.V kernel's GPU path (transposed 16-bit loads of the ring's bf16 view, register regrouping, the
    register-operand fp8 wgmma, O^T's store; the page pairs: two P^T buffers, 4 fp8 pages, the maxima's rendezvous,
    the odd pair's conditional), in either schedule, passes Mosaic GPU's lowering, with its quantize kernel (two
    terms: Q's [64, 2 (L+R)] beside the 4 pages in 227 KB, the quantize split)."""
    monkeypatch.setattr(k90, "merge_splits", _merge_splits_ref)
    text = _lower_for_sm90("fp8", fp8_qk=True, num_sms=132, **kw)
    one = not kw.get("fp8_q_split")
    assert "_pv8" in text and "quantize_q_fp8_r" in text
    assert ("_split" in text) != one and ("_pv8_q1" in text) == one
    assert "fp8stages4_pv8" in text


@pytest.mark.parametrize("pdl", [True, False])
def test_narrow_kernel_pdl_marks_its_launch(pdl, monkeypatch, h200):
    """With `PDL` the narrow kernel waits for the previous kernel before its first read (`griddepcontrol.wait`), and
    Mosaic GPU marks its module for a programmatic dependent launch (`uses_pdl`); without it, neither."""
    monkeypatch.setattr(narrow_kernel, "PDL", pdl)
    jax.clear_caches()  # the kernel's trace is cached by its static arguments, not by PDL

    monkeypatch.setattr(k90, "merge_splits", _merge_splits_ref)
    text = _lower_for_sm90("bf16", num_kv_splits=2, num_sms=132)
    assert "mla_decode_sm90_narrow_bf16_m16" in text
    assert ("uses_pdl" in text) == pdl
    jax.clear_caches()


def test_shared_memory_budget_error():
    with pytest.raises(ValueError, match="shared memory"):
        _lower_for_sm90("bf16", num_stages=3, num_sms=132)


def _bad(**over):
    q, cache, bt, sl, ks = decode_inputs(3, b=2, nq=1, n=16, l=L, r=R, g=G, max_pages=2, lens=[20, 3])
    args = dict(q=q, kv_c_and_k_pe_cache=cache, block_table=bt, seq_lens=sl, scale=SCALE, kv_scale=ks, interpret=True)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, match",
    [
        (lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][:, :32]), "page size G=32"),
        (
            lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.float32)),
            "dtype must be bfloat16 or float8",
        ),
        (
            lambda a: dict(
                q=a["q"][..., :544], kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][..., :544], kv_lora_rank=480
            ),
            "kv_lora_rank must be a multiple of 128",
        ),
        (lambda a: dict(q=a["q"][..., :544], kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][..., :544]), "rope dim"),
        (lambda a: dict(q=a["q"][0]), "q must be"),
        (lambda a: dict(block_table=a["block_table"][:1]), "block_table must be"),
        (lambda a: dict(num_stages=0), "num_stages"),
        (lambda a: dict(fp8_stages=0), "fp8_stages"),
        (
            lambda a: dict(
                kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.bfloat16), kv_scale=None, fp8_qk=True
            ),
            "fp8_qk=True needs a float8_e4m3fn",
        ),
        (lambda a: dict(fp8_q_split=False), "fp8_q_split=False applies to fp8_qk=True only"),
        (
            lambda a: dict(
                kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.float8_e4m3fn),
                kv_scale=jnp.ones(a["kv_c_and_k_pe_cache"].shape[:2], jnp.float32),
                fp8_qk=True,
                fp8_q_split=True,
            ),
            "fp8_q_split=True: 16 query rows a request run the narrow kernel",
        ),
        (lambda a: dict(num_sms=0), "num_sms"),
        (lambda a: dict(schedule="persistent"), "schedule"),
        (lambda a: dict(schedule="worklist", num_kv_splits=2), "num_kv_splits applies"),
    ],
)
def test_bad_inputs_raise(over, match):
    args = _bad()
    args.update(over(args))
    with pytest.raises(ValueError, match=match):
        k90.mla_decode_sm90(**args)


def test_fp8_pv_latent_width(monkeypatch):
    """fp8_qk=True in 64-row tiles at kv_lora_rank 384 (a P.V half of 192 latents: no whole V^T chunks) is a
    ValueError naming it, before any kernel runs; the default backend decodes it exactly instead and
    "pallas_sm90_fp8qk" declines to the exact kernel (nothing reads a V^T chunk past the half)."""
    from mla_jax import attention

    q, cache, bt, sl, ks = decode_inputs(4, b=1, nq=1, n=64, l=384, r=R, g=G, max_pages=2, lens=[70], cache_dtype="fp8")
    assert not k90.uses_fp8_pv(64, cache.dtype, 384) and k90.uses_fp8_pv(64, cache.dtype, 256)
    with pytest.raises(ValueError, match="kv_lora_rank a multiple of 256.*got 384"):
        k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=384, fp8_qk=True, interpret=True)
    calls = []
    monkeypatch.setattr(k90, "mla_decode_sm90", lambda *a, **kw: calls.append(kw.get("fp8_qk", False)))
    for name in ("pallas_sm90", "pallas_sm90_fp8qk"):
        attention.get_backend(name).mla_decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=384)
    assert calls == [False, False]


def test_choose_num_kv_splits_sm90():
    sms = 132
    # One request, 2 head tiles, 512 pages: fill the SMs with ~8-page splits.
    s = k90.choose_num_kv_splits_sm90(1, 2, 512, sms)
    assert 60 <= s <= 66 and 2 * s <= sms
    assert k90.choose_num_kv_splits_sm90(128, 2, 128, sms) == 1  # 256 CTAs: 2 full waves
    assert k90.choose_num_kv_splits_sm90(64, 1, 64, sms) == 2  # 64 CTAs -> 128
    assert k90.choose_num_kv_splits_sm90(1, 1, 1, sms) == 1
    for b, t, p in [(32, 1, 16), (64, 2, 64), (512, 2, 2560), (3, 1, 7)]:
        s = k90.choose_num_kv_splits_sm90(b, t, p, sms)
        assert 1 <= s <= p


# ----------------------------------------------------------------------------------------------
# GPU (make gpu): the real kernel; the shared cases run in TestMlaDecodeSm90.


@pytest.mark.gpu
def test_gpu_batch_invariant_bitwise():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, cache, bt, sl, _ = decode_inputs(77, b=3, nq=1, n=128, l=L, r=R, g=G, max_pages=40, lens=[2500, 700, 64])
    out, lse = k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, batch_invariant=True)
    out1, lse1 = k90.mla_decode_sm90(q[1:2], cache, bt[1:2], sl[1:2], scale=SCALE, batch_invariant=True)
    np.testing.assert_array_equal(np.asarray(out[1:2], np.float32), np.asarray(out1, np.float32))
    np.testing.assert_array_equal(np.asarray(lse[1:2]), np.asarray(lse1))


def test_trace_summary():
    """bench/trace_sm90.py's reduction of Mosaic GPU profiler events: nested scopes per warpgroup,
    per-CTA totals and the mean CTA span (tid = 1 + warpgroup + 3 * block)."""
    from bench import trace_sm90 as trace

    ev = lambda name, ph, ts, tid: {"name": name, "ph": ph, "ts": ts, "pid": 1, "tid": tid}
    events = []
    for block, t0 in ((0, 0.0), (1, 100.0)):
        wg0, wg1 = 1 + 3 * block, 2 + 3 * block
        events += [
            ev("qk", "B", t0, wg0),
            ev("qk", "E", t0 + 2, wg0),
            ev("pv", "B", t0 + 2, wg0),
            ev("wait", "B", t0 + 3, wg0),
            ev("wait", "E", t0 + 4, wg0),
            ev("pv", "E", t0 + 6, wg0),
            ev("pv", "B", t0 + 1, wg1),
            ev("pv", "E", t0 + 9, wg1),
        ]
    scopes, span = trace.summarize(events)
    assert span == 9.0
    assert scopes[0]["qk"] == (2, 2.0, 2.0) and scopes[0]["pv"] == (2, 4.0, 4.0)
    assert scopes[0]["wait"] == (2, 1.0, 1.0) and scopes[1]["pv"] == (2, 8.0, 8.0)


def _hilo_inputs(b=3, m=16, seed=3):
    """bf16 q [B, M, 576]: rows from 2^-20 to 2^19, elements over 20 binades within a row, an all-zero row and one
    at exactly 448 * 2^-7 (amax / 448 a power of two)."""
    k = jax.random.split(jax.random.key(seed), 3)
    mag = jnp.exp2(jax.random.randint(k[0], (b, m, 1), -20, 20).astype(jnp.float32))
    q = (
        jax.random.normal(k[1], (b, m, 576))
        * mag
        * jnp.exp2(jax.random.uniform(k[2], (b, m, 576), minval=-18, maxval=2))
    )
    return q.at[1, 3].set(0.0).at[0, 5].set(448.0 * 2.0**-7).astype(jnp.bfloat16)


def test_split_q_matches_quantize_q_hilo():
    """The fp8 narrow kernel's q split (its own kernel here, interpreted) gives `quantize_q_hilo`'s terms and
    scales bitwise (the fp8_qk mode's q, `quantize_q_fp8`, is its q_hi and s_hi)."""
    from pallas_kernels.mla_decode_sm90_narrow import quantize_q_fp8, quantize_q_hilo, split_q

    q = _hilo_inputs()
    got, want = split_q(q, interpret=True), quantize_q_hilo(q)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for a, b in zip(quantize_q_fp8(q), (want[0], want[2])):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("programs", [2048, 4])
def test_quantize_q_fp8_rows_is_quantize_q_fp8(programs, monkeypatch):
    """The 64-row `fp8_qk`'s q quantize as one Triton kernel (interpreted): `quantize_q_fp8` bitwise, with a program a
    row and (a lowered program target) 8 rows a program."""
    from pallas_kernels import mla_decode_sm90_narrow as narrow

    monkeypatch.setattr(narrow, "_QUANT_PROGRAMS", programs)
    q = _hilo_inputs(b=3, m=16)
    for split in (False, True):
        got = narrow.quantize_q_fp8_rows(q, 512, split=split, interpret=True)
        want = narrow.quantize_q_fp8(q, split=split)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    # The split's two terms: q to ~2^-8 of each row's largest (the residual is exact where it is an e4m3 normal).
    q2 = k90.fp8_qk_reference_q(q, split=True)
    qf = np.asarray(q, np.float32)
    rowmax = np.abs(qf).max(-1, keepdims=True)
    assert np.all(np.abs(np.asarray(q2) - qf) <= 2**-8 * rowmax)  # all-zero rows exactly 0


@pytest.mark.gpu
def test_gpu_quantize_q_fp8_rows_is_exact():
    """On the GPU too (a program a row at 1x128 rows, 4 rows a program at 64x128)."""
    from pallas_kernels import mla_decode_sm90_narrow as narrow

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    for b, m in ((1, 128), (64, 128)):
        q = _hilo_inputs(b=b, m=m)
        for split in (False, True):
            f = jax.jit(narrow.quantize_q_fp8_rows, static_argnums=1, static_argnames="split")
            for a, w in zip(f(q, 512, split=split), narrow.quantize_q_fp8(q, split=split)):
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(w).view(np.uint8))


def test_split_q_lowers_for_sm90():
    """The split's windows ([M, 128] bf16 in the copy layout, e4m3 stores into the 64-byte-swizzled Q tile) pass
    Mosaic GPU's lowering for sm_90."""
    from pallas_kernels.mla_decode_sm90_narrow import split_q

    q = jax.ShapeDtypeStruct((4, 16, 576), jnp.bfloat16)
    text = jax.jit(lambda q: split_q(q)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
def test_gpu_split_q_is_exact():
    """On the GPU the in-kernel split is `quantize_q_hilo`'s bitwise (power-of-two scales from the bits, rounding by
    float32 adds: nothing for the device to round differently), and reproduces the bf16 q exactly for every element
    of at least s_hi * 2^-6."""
    from pallas_kernels.mla_decode_sm90_narrow import quantize_q_hilo, split_q

    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q = _hilo_inputs(b=64)
    got = jax.jit(split_q)(q)
    for a, b in zip(got, quantize_q_hilo(q)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    hi, lo, s = (np.asarray(x, np.float64) for x in got)
    want = np.asarray(q, np.float64)
    back = (hi + lo / 16) * s[..., None]
    big = np.abs(want) >= s[..., None] * 2.0**-6
    np.testing.assert_array_equal(back[big], want[big])


def test_quantize_q_hilo_reproduces_bf16_q():
    """q_hi + q_lo / 16 at the row's power-of-two scale is a bf16 q exactly for every element of at least s_hi * 2^-6
    (below it, q_hi is subnormal and q_lo underflows: the error stays below e4m3's smallest step at that scale);
    no element saturates to NaN, whatever the row's magnitude; an all-zero row gets scale 1."""
    from pallas_kernels.mla_decode_sm90_narrow import quantize_q_hilo

    k = jax.random.split(jax.random.key(3), 3)
    mag = jnp.exp2(jax.random.randint(k[0], (6, 1), -20, 20).astype(jnp.float32))  # rows from 2^-20 to 2^19
    q = jax.random.normal(k[1], (6, 576)) * mag * jnp.exp2(jax.random.uniform(k[2], (6, 576), minval=-18, maxval=2))
    q = jnp.concatenate([q, jnp.zeros((1, 576)), jnp.full((1, 576), 448.0 * 2.0**-7)]).astype(jnp.bfloat16)
    q_hi, q_lo, s_hi = quantize_q_hilo(q)
    assert q_hi.dtype == q_lo.dtype == jnp.float8_e4m3fn and s_hi.shape == (8,)
    hi, lo = np.asarray(q_hi, np.float64), np.asarray(q_lo, np.float64)
    assert np.isfinite(hi).all() and np.isfinite(lo).all()
    s = np.asarray(s_hi, np.float64)
    assert np.all(np.log2(s) == np.round(np.log2(s))) and s[6] == 1.0
    back = (hi + lo / 16) * s[:, None]
    want = np.asarray(q, np.float64)
    big = np.abs(want) >= s[:, None] * 2.0**-6
    np.testing.assert_array_equal(back[big], want[big])
    assert np.all(np.abs(back - want) <= s[:, None] * 2.0**-13)  # e4m3's subnormal step 2^-9, at scale s / 16
    assert big[:, :].sum() > 0.5 * big.size  # the exact part is most of q, not a vacuous check
