"""pallas_kernels.mla_decode against its float32 reference (CPU: interpret=True; GPU: -m gpu).

The cases, inputs (NaN-poisoned: a kernel that reads any row no query attends to fails) and
tolerances are the shared decode suite's (tests/pallas_kernels/decode_suite.py,
pallas_kernels/testing.py); this file adds the Triton kernel's own tests: the reference itself,
split counts, batch invariance, a traced page_offset with ragged per-token lengths, the lowering (one
kernel, no XLA op on the block table or seq_lens), bad inputs and the split merges.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_decode import (
    _mla_decode_impl,
    choose_num_kv_splits,
    merge_segments,
    merge_segments_reference,
    merge_splits,
    merge_splits_reference,
    mla_decode,
    mla_decode_reference,
    segments_from_slot_tile,
)
from pallas_kernels.testing import DECODE_SCALE as SCALE
from pallas_kernels.testing import MLA_DECODE, assert_decode_close, decode_inputs
from tests.pallas_kernels.decode_suite import DecodeSuite


class TestMlaDecode(DecodeSuite):
    KERNEL = MLA_DECODE

    def decode(self, q, cache, bt, sl, ks, *, l, interpret, **kernel_kw):
        return mla_decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, kv_lora_rank=l, interpret=interpret, **kernel_kw)


def test_reference_matches_dense_numpy():
    """The reference itself, against a per-request float64 loop over the block table."""
    b, nq, n, l, r, g = 2, 2, 4, 32, 16, 8
    q, cache, bt, sl, _ = decode_inputs(7, b=b, nq=nq, n=n, l=l, r=r, g=g, max_pages=4, lens=[19, 8], causal=True)
    ref, ref_lse = mla_decode_reference(q, cache, bt, sl, scale=SCALE, kv_lora_rank=l)
    qn, cn, btn, sln = (np.asarray(x, np.float64) for x in (q.astype(jnp.float32), cache.astype(jnp.float32), bt, sl))
    for i in range(b):
        rows = cn[btn[i].astype(int)].reshape(-1, l + r)
        for t in range(nq):
            k = rows[: int(sln[i, t])]
            logits = SCALE * qn[i, t] @ k.T  # [N, len]
            lse = np.log(np.sum(np.exp(logits), axis=-1))
            out = np.exp(logits - lse[:, None]) @ k[:, :l]
            np.testing.assert_allclose(np.asarray(ref_lse[i, t]), lse, rtol=0, atol=1e-4)
            np.testing.assert_allclose(np.asarray(ref[i, t], np.float32), out, rtol=2e-2, atol=2e-2)


def test_num_kv_splits_agree():
    kw = dict(b=2, nq=1, n=16, l=64, r=16, g=16, max_pages=8, lens=[100, 57])
    q, cache, bt, sl, _ = decode_inputs(11, **kw)
    outs = [
        mla_decode(q, cache, bt, sl, scale=SCALE, kv_lora_rank=64, interpret=True, num_kv_splits=s, block_kv=16)
        for s in (1, 4)
    ]
    ref, ref_lse = jax.jit(lambda *a: mla_decode_reference(*a, scale=SCALE, kv_lora_rank=64))(q, cache, bt, sl)
    for out, lse in outs:
        assert_decode_close(out, lse, ref, ref_lse, "bf16")
    np.testing.assert_allclose(
        np.asarray(outs[0][0], np.float32), np.asarray(outs[1][0], np.float32), rtol=2e-2, atol=2e-2
    )
    np.testing.assert_allclose(np.asarray(outs[0][1]), np.asarray(outs[1][1]), rtol=0, atol=1e-4)


def test_batch_invariant_bitwise():
    kw = dict(b=3, nq=1, n=16, l=64, r=16, g=16, max_pages=6, lens=[90, 33, 7])
    q, cache, bt, sl, _ = decode_inputs(5, **kw)
    common = dict(scale=SCALE, kv_lora_rank=64, interpret=True, batch_invariant=True, block_kv=32)
    out, lse = mla_decode(q, cache, bt, sl, **common)
    out1, lse1 = mla_decode(q[1:2], cache, bt[1:2], sl[1:2], **common)
    np.testing.assert_array_equal(np.asarray(out[1:2], np.float32), np.asarray(out1, np.float32))
    np.testing.assert_array_equal(np.asarray(lse[1:2]), np.asarray(lse1))


def _gpu_if_false(interpret):
    if not interpret and jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")


@pytest.mark.parametrize("interpret", [True, pytest.param(False, marks=pytest.mark.gpu)])
def test_traced_page_offset_ragged_query_tokens(interpret):
    """The kernel computes each row's length and pool page itself: Q=3 speculative tokens of unrelated
    lengths (row m is token m // N's: 12 heads in 16-row blocks, so tokens straddle head blocks, and 12
    padding rows), the block table's P pages at a traced page_offset of a pool whose other pages, [0, offset)
    and [offset + P, 2 offset + P), are NaN (a skipped or doubled offset reads NaN). Against the reference
    over the same pool and offset, the reference against itself over the un-offset pages, the kernel bitwise
    against itself over those; stage 1's padding rows attend to nothing."""
    _gpu_if_false(interpret)
    off = 16
    q, pool, bt, _, _ = decode_inputs(
        13, b=2, nq=3, n=12, l=64, r=16, g=16, max_pages=4, lens=[50, 20], page_offset=off
    )
    sl = jnp.asarray([[50, 3, 17], [0, 20, 9]], jnp.int32)  # [B, Q]: per token; row (1, 0) is empty
    q = q.at[1, 0].set(jnp.nan)  # an empty row's q is never used
    kw = dict(scale=SCALE, kv_lora_rank=64, interpret=interpret, block_h=16, block_kv=16, num_kv_splits=2)
    f = jax.jit(lambda q, c, bt, sl, o: mla_decode(q, c, bt, sl, page_offset=o, **kw))
    out, lse = f(q, pool, bt, sl, jnp.int32(off))
    reference = lambda o: jax.jit(lambda *a: mla_decode_reference(*a, scale=SCALE, kv_lora_rank=64, page_offset=o))
    ref, ref_lse = reference(off)(q, pool, bt, sl)
    assert_decode_close(out, lse, ref, ref_lse, "bf16")
    assert np.all(np.asarray(lse)[1, 0] == -np.inf)
    pages = pool[off:-off]  # the block table's pages, un-offset
    ref0, ref0_lse = reference(None)(q, pages, bt, sl)
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(ref0, np.float32))
    np.testing.assert_array_equal(np.asarray(ref_lse), np.asarray(ref0_lse))
    out0, lse0 = mla_decode(q, pages, bt, sl, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out0, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse0))
    # Stage 1's partials over the 48 padded rows: the 12 padding rows attend to nothing (lse -inf).
    kw.pop("interpret")
    _, lse_part = _mla_decode_impl(
        q,
        pool,
        bt,
        sl,
        None,
        off,
        interpret=interpret,
        batch_invariant=False,
        num_warps=None,
        num_stages=None,
        return_partials=True,
        **kw,
    )
    assert lse_part.shape == (2, 2, 48)
    assert np.all(np.asarray(lse_part)[..., 36:] == -np.inf) and np.all(np.isfinite(np.asarray(lse_part)[0, 0, :36]))


def test_lowers_to_one_triton_kernel(h200):
    """Triton IR on CPU (Pallas's lowering rules, not the Triton compiler) for an H200, batch-1 decode with a
    traced page_offset: the block table, seq_lens and offset go straight into the one kernel (issue #22: the
    repeat/pad/clamp of seq_lens and the block table + offset were small XLA kernels of every layer's step)."""
    import re

    S = jax.ShapeDtypeStruct
    args = (S((1, 1, 16, 576), jnp.bfloat16), S((256, 64, 576), jnp.bfloat16), S((1, 64), jnp.int32))
    args += (S((1, 1), jnp.int32), S((), jnp.int32))
    f = jax.jit(lambda q, c, bt, sl, o: mla_decode(q, c, bt, sl, scale=SCALE, page_offset=o, num_kv_splits=1))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert set(re.findall(r"stablehlo\.(\w+)", text)) == {"custom_call", "reshape"}  # no ops but free reshapes


def _bad(**over):
    q, cache, bt, sl, _ = decode_inputs(3, b=2, nq=1, n=16, l=64, r=16, g=16, max_pages=2, lens=[20, 3])
    args = dict(
        q=q, kv_c_and_k_pe_cache=cache, block_table=bt, seq_lens=sl, scale=SCALE, kv_lora_rank=64, interpret=True
    )
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over, match",
    [
        (lambda a: dict(q=a["q"][0]), "q must be"),
        (lambda a: dict(q=a["q"].astype(jnp.int32)), "q dtype"),
        (lambda a: dict(kv_lora_rank=48), "kv_lora_rank"),
        (lambda a: dict(q=a["q"][..., :72], kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][..., :72]), "rope dim"),
        (lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][..., :72]), "last dim"),
        (lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"][:, :12]), "page size"),
        (
            lambda a: dict(kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.float8_e4m3fn)),
            "kv_scale is required",
        ),
        (
            lambda a: dict(
                kv_c_and_k_pe_cache=a["kv_c_and_k_pe_cache"].astype(jnp.float8_e4m3fn),
                kv_scale=jnp.ones((3, 16), jnp.float32),
            ),
            "kv_scale must be",
        ),
        (lambda a: dict(kv_scale=jnp.ones(a["kv_c_and_k_pe_cache"].shape[:2], jnp.float32)), "only for a float8"),
        (lambda a: dict(block_table=a["block_table"][:1]), "block_table must be"),
        (
            lambda a: dict(
                block_table=a["block_table"].astype(jnp.int64)
                if jax.config.jax_enable_x64
                else a["block_table"].astype(jnp.int16)
            ),
            "block_table dtype",
        ),
        (lambda a: dict(block_table=a["block_table"][:, :0]), "at least one page"),
        (lambda a: dict(seq_lens=a["seq_lens"][:, 0]), "seq_lens must be"),
        (lambda a: dict(seq_lens=a["seq_lens"].astype(jnp.float32)), "seq_lens dtype"),
        (lambda a: dict(num_kv_splits=0), "num_kv_splits"),
        (lambda a: dict(block_h=24), "block_h"),
        (lambda a: dict(block_kv=8), "block_kv"),
        (lambda a: dict(fp8_mode="fast"), "fp8_mode"),
        (lambda a: dict(page_offset=-1), "page_offset=-1 is out of range"),
        (lambda a: dict(page_offset=6), "page_offset=6 is out of range for kv_c_and_k_pe_cache of 6 pages"),
        (lambda a: dict(page_offset=jnp.zeros((1,), jnp.int32)), "page_offset must be an integer scalar"),
        (lambda a: dict(page_offset=2.0), "page_offset must be an integer scalar"),
    ],
)
def test_bad_inputs_raise(over, match):
    args = _bad()
    args.update(over(args))
    with pytest.raises(ValueError, match=match):
        mla_decode(**args)


def test_choose_num_kv_splits():
    for b, rows, ctx in [
        (1, 16, 64),
        (64, 16, 4096),
        (128, 128, 8192),
        (1, 128, 32768),
        (32, 16, 1024),
        (512, 16, 163840),
    ]:
        s = choose_num_kv_splits(b, rows, ctx, 132)
        assert 1 <= s <= 264
    assert choose_num_kv_splits(1, 16, 64, 132) == 1  # short context: no split
    assert choose_num_kv_splits(1, 128, 32768, 132) > 16  # one request: split to fill SMs
    # One memory-bound request: 64-token splits, at most one per SM (H200 device-time sweep).
    assert choose_num_kv_splits(1, 16, 4096, 132) == 64
    assert choose_num_kv_splits(1, 16, 1024, 132) == 16
    assert choose_num_kv_splits(1, 16, 32768, 132) == 128
    assert choose_num_kv_splits(1, 16, 32768, 132) == 128
    assert choose_num_kv_splits(512, 128, 8192, 132) == 1  # batch alone fills the SMs
    assert choose_num_kv_splits(8, 16, 8192, 132) >= choose_num_kv_splits(64, 16, 8192, 132)


@pytest.mark.parametrize(
    "b,splits,m,l,transposed",
    [
        (2, 5, 24, 64, False),
        (1, 64, 16, 512, False),
        (3, 2, 8, 32, False),
        (1, 1, 16, 64, False),
        (2, 3, 8, 48, False),
        (2, 3, 16, 512, True),  # the narrow Hopper decode's [L, M] partials
        (3, 1, 8, 64, True),
        (1, 7, 32, 128, True),
        (2, 2, 24, 64, True),  # M not a power of two: the reference path
    ],
)
@pytest.mark.parametrize("part_dtype", [jnp.float32, jnp.bfloat16])
def test_merge_splits_kernel(b, splits, m, l, transposed, part_dtype):
    """The stage-2 merge kernel against its jnp reference: dead splits (lse -inf) hold NaN partials
    that must never be read, one row has no live split at all (out 0, lse -inf). transposed: the
    partials arrive as [B, S, L, M]; bf16: as the Hopper decodes write them (merged in f32)."""
    rng = np.random.default_rng(splits * 100 + l)
    # the partials' values as given (bf16-representable for bf16), in f32 for the references
    o_part = np.array(jnp.asarray(rng.standard_normal((b, splits, m, l)), part_dtype), np.float32)
    lse_part = rng.uniform(-3.0, 8.0, (b, splits, m)).astype(np.float32)
    dead = rng.random((b, splits, m)) < 0.3
    dead[0, :, 1] = True
    lse_part[dead] = -np.inf
    o_part[dead] = np.nan
    given = np.swapaxes(o_part, -1, -2).copy() if transposed else o_part
    kw = dict(transposed=True) if transposed else {}
    given = jnp.asarray(given, part_dtype)
    out, lse = merge_splits(given, jnp.asarray(lse_part), out_dtype=jnp.float32, interpret=True, **kw)
    ref, ref_lse = jax.jit(merge_splits_reference)(jnp.asarray(o_part), jnp.asarray(lse_part))
    assert out.shape == (b, m, l) and lse.shape == (b, m)
    assert np.all(np.isfinite(np.asarray(out)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)
    assert np.all(np.asarray(out)[0, 1] == 0) and np.asarray(lse)[0, 1] == -np.inf
    # the reference itself, against float64 numpy over the live splits
    w = np.where(dead, 0.0, np.exp(lse_part.astype(np.float64)))
    expect = np.nansum(np.where(dead[..., None], 0.0, w[..., None] * o_part), axis=1)
    denom = w.sum(axis=1)
    live = denom > 0
    np.testing.assert_allclose(
        np.asarray(ref)[live], (expect / np.where(live, denom, 1)[..., None])[live], rtol=1e-5, atol=1e-6
    )
    bf, _ = merge_splits(given, jnp.asarray(lse_part), out_dtype=jnp.bfloat16, interpret=True, **kw)
    assert bf.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf, np.float32), np.asarray(ref), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("part_dtype", [jnp.float32, jnp.bfloat16])
def test_merge_splits_lowers_to_one_kernel(transposed, part_dtype, h200):
    """Triton IR on CPU for an H200: one kernel and free reshapes, nothing else (the merged lse was written once per
    column block and sliced after the kernel, an XLA kernel of its own: ~1.1 us of a 17 us decode call; bf16
    partials are read as they are, no convert kernel before)."""
    o_shape = (32, 4, 512, 16) if transposed else (32, 4, 16, 512)
    args = (jax.ShapeDtypeStruct(o_shape, part_dtype), jax.ShapeDtypeStruct((32, 4, 16), jnp.float32))
    f = jax.jit(lambda o, lse: merge_splits(o, lse, out_dtype=jnp.bfloat16, transposed=transposed))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert set(re.findall(r"stablehlo\.(\w+)", text)) == {"custom_call", "reshape"}


@pytest.mark.gpu
@pytest.mark.parametrize("part_dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_merge_splits(part_dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(7)
    b, splits, m, l = 2, 64, 128, 512  # (1, 128, 32k)-like: 64 splits, block_l 128
    o_part = np.array(jnp.asarray(rng.standard_normal((b, splits, m, l)), part_dtype), np.float32)
    lse_part = rng.uniform(-3.0, 8.0, (b, splits, m)).astype(np.float32)
    dead = rng.random((b, splits, m)) < 0.3
    lse_part[dead], o_part[dead] = -np.inf, np.nan
    out, lse = merge_splits(jnp.asarray(o_part, part_dtype), jnp.asarray(lse_part))
    ref, ref_lse = merge_splits_reference(jnp.asarray(o_part), jnp.asarray(lse_part))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-5)
    # The narrow Hopper decode's transposed partials: [B, S, L, M], M = 16.
    o_t, lse_t = o_part[:, :, :16], lse_part[:, :, :16]
    o_tg = jnp.asarray(np.swapaxes(o_t, -1, -2).copy(), part_dtype)
    out, lse = merge_splits(o_tg, jnp.asarray(lse_t), transposed=True)
    ref, ref_lse = merge_splits_reference(jnp.asarray(o_t), jnp.asarray(lse_t))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-5)


def _segment_case(seed, m, l, counts, out_dtype):
    """Inputs of merge_segments for tiles with counts[u] slots each (laid out in a shuffled tile
    order, with an unused slot after some tiles). NaN poison: unused slots and the one slot of a
    count-1 tile hold NaN with a finite lse (read only if the kernel merges a tile it must not);
    dead partials (lse -inf) of split tiles hold NaN; row 1 of the first split tile has no live
    partial at all. Returns numpy arrays and the expected (seg_first, seg_count)."""
    rng = np.random.default_rng(seed)
    u = len(counts)
    slot_tile, first = [], np.zeros(u, np.int32)
    for t in rng.permutation(u):
        first[t] = len(slot_tile) if counts[t] else 0
        slot_tile += [t] * counts[t] + ([-1] if rng.random() < 0.5 else [])
    slot_tile = np.asarray(slot_tile, np.int32)
    p = len(slot_tile)
    o_part = rng.standard_normal((p, m, l)).astype(np.float32)
    lse_part = rng.uniform(-3.0, 8.0, (p, m)).astype(np.float32)
    counts = np.asarray(counts, np.int32)
    split = counts >= 2
    owner = np.where(slot_tile >= 0, slot_tile, 0)
    in_split = (slot_tile >= 0) & split[owner]  # [P]
    dead = in_split[:, None] & (rng.random((p, m)) < 0.3)  # [P, M]
    if split.any():
        dead[slot_tile == np.flatnonzero(split)[0], 1] = True
    lse_part[dead] = -np.inf
    o_part[dead | ~in_split[:, None]] = np.nan
    out = rng.standard_normal((u, m, l)).astype(np.float32)
    out = np.asarray(jnp.asarray(out).astype(out_dtype))
    lse = rng.uniform(-3.0, 8.0, (u, m)).astype(np.float32)
    return (out, lse, o_part.reshape(p * m, l), lse_part.reshape(p * m), slot_tile, first, counts, dead)


def _merge_segments_float64(out, lse, o_part, lse_part, slot_tile, counts, dead):
    """The merge of each split tile's live slots in float64 numpy (other tiles: their input)."""
    u, m, l = out.shape
    p = slot_tile.shape[0]
    o_part, lse_part = o_part.reshape(p, m, l), lse_part.reshape(p, m).astype(np.float64)
    exp_out, exp_lse = out.astype(np.float64), lse.astype(np.float64)
    for t in np.flatnonzero(counts >= 2):
        sl = slot_tile == t
        w = np.where(dead[sl], 0.0, np.exp(lse_part[sl]))  # [S, M]
        num = np.where(dead[sl][..., None], 0.0, w[..., None] * o_part[sl]).sum(axis=0)
        den = w.sum(axis=0)
        has = den > 0
        exp_out[t] = np.where(has[:, None], num / np.where(has, den, 1.0)[:, None], 0.0)
        exp_lse[t] = np.where(has, np.log(np.where(has, den, 1.0)), -np.inf)
    return exp_out, exp_lse


@pytest.mark.parametrize(
    "m,l,counts,out_dtype",
    [
        (8, 32, [3, 1, 0, 5, 2], jnp.float32),
        (16, 64, [3, 1, 0, 5, 2], jnp.bfloat16),
        (8, 64, [2, 0, 20, 1, 4], jnp.bfloat16),  # 20 slots: five steps of the online loop
        (16, 32, [0, 2, 1, 0, 0], jnp.float32),
        (8, 32, [1, 0, 1, 0, 0], jnp.float32),  # nothing split: only padding programs
        (8, 48, [3, 1, 0, 5, 2], jnp.bfloat16),  # L not a power of two: the jnp fallback
    ],
)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("part_dtype", [jnp.float32, jnp.bfloat16])
def test_merge_segments_kernel(m, l, counts, out_dtype, transposed, part_dtype):
    """The work-list merge kernel against its jnp reference, and the reference against float64
    numpy: split tiles get the LSE merge of their live slots, all other tiles stay bit-identical.
    transposed: the partials as the narrow Hopper decode writes them, each slot's [L, M] slab; bf16: in the
    dtype both Hopper decodes write."""
    out, lse, o_part, lse_part, slot_tile, first, count, dead = _segment_case(
        sum(counts) * 10 + l, m, l, counts, out_dtype
    )
    o_part = np.array(jnp.asarray(o_part, part_dtype), np.float32)  # the values as given (NaN poison kept)
    seg_first, seg_count = segments_from_slot_tile(jnp.asarray(slot_tile), len(counts))
    np.testing.assert_array_equal(np.asarray(seg_first), first)
    np.testing.assert_array_equal(np.asarray(seg_count), count)
    args = (jnp.asarray(out), jnp.asarray(lse), jnp.asarray(o_part, part_dtype), jnp.asarray(lse_part))
    args += (seg_first, seg_count)
    if transposed:
        p = lse_part.shape[0] // m
        o_t = np.swapaxes(o_part.reshape(p, m, l), 1, 2).reshape(p * l, m)
        got, got_lse = merge_segments(
            *args[:2], jnp.asarray(o_t, part_dtype), *args[3:], transposed=True, interpret=True
        )
    else:
        got, got_lse = merge_segments(*args, interpret=True)
    ref, ref_lse = jax.jit(merge_segments_reference)(*args)
    assert got.dtype == out.dtype and got.shape == out.shape and got_lse.shape == lse.shape
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    got_lse, ref_lse = np.asarray(got_lse), np.asarray(ref_lse)
    split = count >= 2
    for res, res_lse in ((got, got_lse), (ref, ref_lse)):
        np.testing.assert_array_equal(res[~split], np.asarray(out, np.float32)[~split])
        np.testing.assert_array_equal(res_lse[~split], lse[~split])
        assert np.all(np.isfinite(res))
    if split.any():  # row 1 of the first split tile has no live partial
        t = np.flatnonzero(split)[0]
        assert np.all(got[t, 1] == 0) and got_lse[t, 1] == -np.inf
    tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(got_lse, ref_lse, rtol=1e-6, atol=1e-6)
    exp_out, exp_lse = _merge_segments_float64(
        np.asarray(out, np.float32), lse, o_part, lse_part, slot_tile, count, dead
    )
    np.testing.assert_allclose(ref, exp_out, rtol=tol, atol=tol)
    np.testing.assert_allclose(ref_lse, exp_lse, rtol=1e-6, atol=1e-5)


def test_merge_segments_lowers_to_triton(h200):
    """Triton IR generation on CPU (Pallas's lowering rules, not the Triton compiler) at work-list
    size (200 tiles, 396 slots on an H200), with an H200 stand-in for the device query: one kernel
    (the split-tile list from an XLA nonzero), grid (198 split tiles at most, 16 column blocks of all 64
    rows), out/lse aliased to its inputs."""
    u, m, l, p = 200, 64, 512, 396
    shapes = [
        ((u, m, l), jnp.bfloat16),
        ((u, m), jnp.float32),
        ((p * m, l), jnp.float32),
        ((p * m,), jnp.float32),
        ((u,), jnp.int32),
        ((u,), jnp.int32),
    ]
    f = jax.jit(lambda *a: merge_segments(*a))
    text = f.trace(*(jax.ShapeDtypeStruct(*x) for x in shapes)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 198 : i32, grid_y = 16 : i32, grid_z = 1 : i32" in text
    assert text.count("stablehlo.output_operand_alias") == 2


def test_merge_segments_transposed_lowers_to_triton(h200):
    """The transposed merge as the narrow Hopper decode's work list calls it (128 requests of 16 rows, 396 slots
    on an H200, the split-tile list given): one Triton kernel and nothing else, grid (128 split requests at
    most, 4 column blocks), out/lse aliased."""
    u, m, l, p = 128, 16, 512, 396
    shapes = [
        ((u, m, l), jnp.bfloat16),
        ((u, m), jnp.float32),
        ((p * l, m), jnp.float32),
        ((p * m,), jnp.float32),
        ((u,), jnp.int32),
        ((u,), jnp.int32),
        ((min(u, p // 2),), jnp.int32),
    ]
    f = jax.jit(lambda *a: merge_segments(*a, transposed=True))
    text = f.trace(*(jax.ShapeDtypeStruct(*x) for x in shapes)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "grid_x = 128 : i32, grid_y = 4 : i32, grid_z = 1 : i32" in text
    assert text.count("stablehlo.output_operand_alias") == 2
    assert "stablehlo.scatter" not in text and "stablehlo.gather" not in text  # no XLA glue around it


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_merge_segments(transposed):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    # Work-list-like: 4 tiles of 64 rows (16 transposed), one split into 66 slots (5 steps of 16), one into 3.
    m = 16 if transposed else 64
    out, lse, o_part, lse_part, slot_tile, _, count, _ = _segment_case(11, m, 512, [0, 66, 1, 3], jnp.bfloat16)
    seg_first, seg_count = segments_from_slot_tile(jnp.asarray(slot_tile), 4)
    args = tuple(jnp.asarray(x) for x in (out, lse, o_part, lse_part)) + (seg_first, seg_count)
    if transposed:
        p = slot_tile.shape[0]
        o_t = jnp.asarray(np.swapaxes(o_part.reshape(p, m, 512), 1, 2).reshape(p * 512, m))
        got, got_lse = merge_segments(*args[:2], o_t, *args[3:], transposed=True)
    else:
        got, got_lse = merge_segments(*args)
    ref, ref_lse = merge_segments_reference(*args)
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    split = count >= 2
    np.testing.assert_array_equal(got[~split], np.asarray(out, np.float32)[~split])
    np.testing.assert_array_equal(np.asarray(got_lse)[~split], lse[~split])
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("b,splits,m", [(1, 64, 16), (8, 16, 16), (128, 2, 32), (4, 5, 8)])
def test_merge_splits_transposed_lowers_to_triton(h200, b, splits, m):
    """The transposed merge's Triton IR generation on CPU (its [S', block_l, M] gather and the [block_l, M]
    transpose), with an H200 stand-in for the device query: one kernel of >= 16 column blocks a request and >= 256
    programs in all (~2 an SM) where 4 columns a program allow it."""
    l = 512
    f = jax.jit(lambda o, s: merge_splits(o, s, out_dtype=jnp.bfloat16, transposed=True))
    args = (jax.ShapeDtypeStruct((b, splits, l, m), jnp.float32), jax.ShapeDtypeStruct((b, splits, m), jnp.float32))
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32", text)
    gx, gy = int(grid.group(1)), int(grid.group(2))
    assert gx == b and gy >= 16 and gx * gy >= min(256, b * l // 4) and l % gy == 0
