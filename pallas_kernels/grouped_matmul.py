"""Grouped matmul for MoE experts (megablox-style): a Pallas kernel lowered through Triton.

Shapes: lhs [M, K] token copies sorted by expert (M = T*top_k rows), rhs [G, N, K] stacked expert
weights in the HF (torch Linear) layout [out, in] (`transpose_rhs=True`) or [G, K, N], group_sizes
i32[G]: group g owns rows [sum(sizes[:g]), sum(sizes[:g+1])). Rows at or past sum(group_sizes) are
padding (expert-parallel shards move other devices' copies there) and come out exactly 0.

Stacked layers: rhs may carry one more leading axis, [Lyr, G, N, K] (or [Lyr, G, K, N]), with
`rhs_index` (an int32 scalar, may be traced) picking the layer. The kernel indexes
rhs[rhs_index, g] itself, so a model that scans over layers can hand it the whole stacked weights
(scan-invariant): slicing the layer out first would make XLA materialize a copy of every expert of
that layer (a slice feeding a custom call is a new buffer), each step, although only the experts
that rows hit are read.

Why: XLA's GPU lowering of `ragged_dot` has, in many versions, expanded the ragged operand into
zero-padded per-group matrices, a dense [G, M, K] problem (every expert for every row); that defeats
the MoE sparsity and runs out of memory at prefill sizes. Here each row is multiplied by its own
expert only.

Design: a static-length list of work items (row tile, segment) from group_sizes (traced): each segment's
own tiles of `block_m` rows from its first row (`GROUP_ALIGNED_TILES`; or the tiles of [0, M), a tile that
straddles segment boundaries appearing once per segment it touches). Segments are the G groups plus one
padding segment [sum, M). The count is at most cdiv(M, block_m) + min(G, M) either way; unused items at the
end are no-ops. Grid (cdiv(N, block_n), items, k splits), N
blocks fastest so that the programs running together share one row tile of lhs and one expert's rhs
in L2. A program derives its own item (tile, row range, group) from group_sizes (`work_item`: two
cumsums and a search over the G + 1 segments in registers, where an XLA prologue computing the list
ran small kernels of its own before each call), loops over
its K range in `block_k` steps (an unmasked loop over whole steps, then one masked tail step when
block_k does not divide K), and stores only its own rows (a masked store), so two items sharing a
tile write disjoint rows and no atomics are needed. Padding items skip the K loop and store zeros.
Rows of the tile outside the item's range are still multiplied (an output row depends only on its
own lhs row, and such rows are never stored), so NaN or stale padding rows cannot leak.

Unsorted rows (`row_groups`, i32[M], instead of group_sizes): one work item per row, the row alone
with its own group (the kernel derives the items from its index; `row_items` is the same list as
arrays, for the fp8 kernel). For one decode token's top-k copies this skips the sort, the group
sizes and the inverse permutation (a chain of small XLA kernels, ~10 us a MoE layer at batch 1) at
no cost in weight reads, since one token's experts are distinct. Given each token's top-k (i32[T, K])
the kernel also numbers the copies itself and reads each copy's token row from an lhs of one row per
token, so nothing is concatenated or gathered before the call.

Items by group (a token top-k of more than PER_COPY_MAX_COPIES routed copies): one item per (group slot, row tile),
the slots the G experts, the C shared chunks and a padding slot (copies of groups outside [0, G), stored 0), a slot
of n copies cdiv(n, block_m) tiles, the slots' tiles listed one after another (`_group_tile`: no program for an empty
tile). A small kernel first lists each slot's copies (`group_table`: a compare, a cumsum and a scatter a slot); a
program finds its slot and tile from the counts, reads its tile's copies from the table, gathers their lhs rows
(their tokens', or their own) and stores each output row at its copy (distinct rows: no atomics). The output is in
copy order, as by row, so a decode batch runs no argsort, group sizes, gather of the copies, inverse permutation or
combine kernels (the next norm combines the copies, `mla_jax.layers.ExpertCopies`).

Shared experts (`shared_rhs`): a dense weight cut into C expert-sized chunks along its rows or its
columns (`shared_chunks`), groups G..G+C-1 beside the routed ones; by token top-k, one item per chunk
covers all T tokens' rows, so the shared weights are read once, as a separate MLP would.

Gate and up in one pass (`up_rhs`, the experts' up projection beside rhs, their gate): each program loads both
weights' tiles for its rows and writes silu(gate) * up from its two float32 accumulators (split K: the partials
of each, summed and combined by XLA), one launch where two GEMMs and an elementwise kernel were.

Block-FP8 experts (`rhs_scale` / `up_scale`: e4m3 weights [(Lyr,) G, N, K] with one float32 scale per 128 x 128
block, [(Lyr,) G, cdiv(N, 128), cdiv(K, 128)], DeepSeek-V3's format): the W8A8 product of `fp8_matmul`'s grouped GEMM,
at the sizes this kernel serves (decode: few rows per expert, unsorted copies, gate and up in one pass), where that
Mosaic GPU kernel needs its rows gathered, padded and quantized by XLA kernels first. lhs is quantized per row per
128 channels once before the call (`fp8_quant.quantize_act`, one kernel over lhs's rows, one per token for top-k
copies; quantizing in the kernel made every program redo its tile's, part 30), the kernel multiplies the e4m3 tiles
in a dot of fp8 operands (exact products; `linear` says why not as bf16), and scales each 128-deep K step's
product by (row scale x the expert's block scale, all the tile's loaded before the K loop: `util.block_scales`): K
steps are one scale block (block_k = 128; two a step, a dot each, ran slower on the H200: part 43), block_n <= 128
(a program's columns share one scale row). With `quantize_out` the SwiGLU kernel hands the down projection its
input already quantized (the epilogue's, with 128-wide N blocks), which takes it as `lhs_scale`. HF layout only;
fp8 shared chunks come with their scales and must be whole scale blocks (the chunk's first block is where its
scales start: `block_scales(k_block0=)`).

Weight-bound decode (few rows per expert) wants enough programs in flight to saturate HBM: small
row tiles (16) and narrow N blocks, and optionally `num_k_splits` > 1, which writes float32 partials
[S, M, N] that XLA sums (cheap when M is small).

Triton constraints: every load/store is a power of two in size, so block sizes are (M, N and K are
arbitrary: edges are masked); dots need M, N, K >= 16; dot operands share one dtype.

Tests: interpret mode on CPU, the compiled kernel with `-m gpu`; H200 numbers: bench/moe.py,
docs/perf-notes.md and bench/results/moe-h200.json.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import fp8_quant
from pallas_kernels.util import (
    FLOAT_DTYPES,
    FP8,
    FP8_BLOCK,
    block_scale,
    block_scales,
    cdiv,
    check_fp8_blocks,
    check_fp8_weight,
    check_stacked_index,
    check_warps_stages,
    is_pow2,
    load_e4m3,
    mask_and,
    masked_load,
    next_pow2,
    num_sms,
    pad_to,
    quantize_act_tile,
)

# Sorted rows (group_sizes) in tiles of their own group, from its first row (`work_item(aligned=True)`), else the
# block_m-row tiles of [0, M), a tile straddling groups an item of each. Aligned: never more items, and at decode
# sizes each expert's weights read once where a straddled expert of < block_m rows is often read twice (batch 128
# sorted: ~12 copies an expert in 16-row tiles, its experts at 0.77 / 0.74 of copy, H200, e95e17d; batch 128 runs by
# group since session 34, so sorted decode rows are those past `layers.BY_GROUP_MAX_COPIES`). Off until measured on
# a GPU (gpu_session.sh parts 80 and 84: the kernels and the sorted batch-128 step with and without it).
GROUP_ALIGNED_TILES = False
PER_COPY_MAX_COPIES = 16  # a token top-k of at most this many routed copies: each copy its own work item (its
# expert's weights read once per copy); more: an item per (group, row tile), each expert's weights read once a tile


def _validate(
    lhs,
    rhs,
    group_sizes,
    transpose_rhs,
    block_m,
    block_n,
    block_k,
    num_warps,
    num_stages,
    num_k_splits,
    preferred_element_type,
    rhs_index=None,
    row_groups=None,
    num_chunks=0,
    fp8=False,
):
    if not hasattr(lhs, "ndim") or lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K], got shape {getattr(lhs, 'shape', None)}")
    stacked = rhs_index is not None
    if not hasattr(rhs, "ndim") or rhs.ndim != 3 + stacked:
        want = (
            "[Lyr, G, N, K] (transpose_rhs=True) or [Lyr, G, K, N] with rhs_index"
            if stacked
            else "[G, N, K] (transpose_rhs=True) or [G, K, N] (a stacked rhs needs rhs_index)"
        )
        raise ValueError(f"rhs must be {want}, got shape {getattr(rhs, 'shape', None)}")
    if stacked:
        check_stacked_index(rhs_index, rhs.shape[0], "rhs_index", f"rhs with {rhs.shape[0]} stacked layers")
        rhs = jax.ShapeDtypeStruct(rhs.shape[1:], rhs.dtype)  # one layer, for the checks below
    if jnp.dtype(lhs.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"lhs dtype must be bfloat16, float16 or float32, got {lhs.dtype}")
    if lhs.dtype != rhs.dtype and not fp8:
        raise ValueError(f"lhs and rhs dtypes differ: {lhs.dtype} vs {rhs.dtype} (cast one first)")
    m, k = lhs.shape
    g = rhs.shape[0]
    k_rhs = rhs.shape[2] if transpose_rhs else rhs.shape[1]
    if k_rhs != k:
        layout = "[G, N, K]" if transpose_rhs else "[G, K, N]"
        raise ValueError(
            f"rhs {rhs.shape} read as {layout} has K={k_rhs}, but lhs {lhs.shape} has "
            f"K={k} (transpose_rhs={transpose_rhs})"
        )
    if m < 1 or k < 1 or g < 1 or min(rhs.shape) < 1:
        raise ValueError(f"empty dimension: lhs {lhs.shape}, rhs {rhs.shape}")
    rows = getattr(row_groups, "shape", (0,))
    if len(rows) == 2:  # each token's top-k [T, K]: T*(K+C) copies
        if group_sizes is not None:
            raise ValueError("give exactly one of group_sizes (rows sorted by group) and row_groups (each row's group)")
        t, top_k = rows
        copies = t * (top_k + num_chunks)
        if m not in (t, copies) or top_k < 1:
            raise ValueError(
                f"row_groups [T={t}, K={top_k}] (each token's top-k) needs lhs of T={t} or T*(K+C)={copies} rows "
                f"(C={num_chunks} shared chunks), got {m}"
            )
        if jnp.dtype(row_groups.dtype) != jnp.int32:
            raise ValueError(f"row_groups dtype must be int32, got {row_groups.dtype}")
    else:
        check_groups(group_sizes, row_groups, g + num_chunks, m)
    for name, b in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if b is not None and not (is_pow2(b) and b >= 16):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (Triton dot)")
    check_warps_stages(num_warps, num_stages)
    if num_k_splits is not None and not (isinstance(num_k_splits, int) and num_k_splits >= 1):
        raise ValueError(f"num_k_splits must be a positive int, got {num_k_splits}")
    if preferred_element_type is not None and jnp.dtype(preferred_element_type) not in FLOAT_DTYPES:
        raise ValueError(
            f"preferred_element_type must be None, bfloat16, float16 or float32, got {preferred_element_type}"
        )


def _validate_fp8(
    rhs,
    up_rhs,
    shared_rhs,
    transpose_rhs,
    rhs_scale,
    up_scale,
    block_n,
    block_k,
    shared_up_rhs=None,
    shared_scale=None,
    shared_up_scale=None,
):
    """Block-FP8 experts: e4m3 rhs (and up_rhs) with their float32 block scales, or neither; fp8 shared chunks with
    theirs, each chunk whole scale blocks."""
    e4m3 = [getattr(w, "dtype", None) is not None and jnp.dtype(w.dtype) == FP8 for w in (rhs, up_rhs) if w is not None]
    if rhs_scale is None:
        if up_scale is not None:
            raise ValueError("up_scale needs rhs_scale (the gate's block scales)")
        if shared_scale is not None or shared_up_scale is not None:
            raise ValueError("shared_scale / shared_up_scale are for fp8 experts (give rhs_scale)")
        if any(e4m3):
            raise ValueError("float8_e4m3fn rhs / up_rhs need their block scales: rhs_scale (and up_scale)")
        return
    if (up_rhs is None) != (up_scale is None):
        raise ValueError("give up_scale exactly when up_rhs is given (the up projection's block scales)")
    if not all(e4m3):
        raise ValueError(f"rhs_scale is for float8_e4m3fn rhs (and up_rhs), got {rhs.dtype}")
    if not transpose_rhs:
        raise ValueError("fp8 experts need transpose_rhs=True (HF [out, in] layout)")
    check_fp8_weight(rhs, rhs_scale, "rhs", "rhs_scale")
    if up_scale is not None:
        check_fp8_weight(up_rhs, up_scale, "up_rhs", "up_scale")
    if (shared_rhs is None) != (shared_scale is None) or (shared_up_rhs is None) != (shared_up_scale is None):
        raise ValueError("fp8 shared chunks: give shared_scale with shared_rhs, shared_up_scale with shared_up_rhs")
    if shared_rhs is not None:
        check_fp8_weight(shared_rhs, shared_scale, "shared_rhs", "shared_scale")
        if shared_up_rhs is not None:
            check_fp8_weight(shared_up_rhs, shared_up_scale, "shared_up_rhs", "shared_up_scale")
        n, k = rhs.shape[-2:]
        _, axis = shared_chunks(shared_rhs.shape, n, k)
        if (n if axis == "n" else k) % FP8_BLOCK:
            raise ValueError(
                f"fp8 shared chunks along {'N' if axis == 'n' else 'K'} must be whole {FP8_BLOCK}-wide scale blocks: "
                f"the experts' {'N' if axis == 'n' else 'K'} is {n if axis == 'n' else k}"
            )
    check_fp8_blocks(block_n, block_k, "fp8 experts")


def check_groups(group_sizes, row_groups, g: int, m: int):
    """Exactly one of group_sizes i32[G] (rows sorted by group) and row_groups i32[M] (each row's group)."""
    if (group_sizes is None) == (row_groups is None):
        raise ValueError("give exactly one of group_sizes (rows sorted by group) and row_groups (each row's group)")
    name, arr, size = ("group_sizes", group_sizes, g) if row_groups is None else ("row_groups", row_groups, m)
    want = f"i32[{'G' if row_groups is None else 'M'}={size}]"
    if not hasattr(arr, "ndim") or arr.ndim != 1 or arr.shape[0] != size:
        raise ValueError(f"{name} must be {want}, got shape {getattr(arr, 'shape', None)}")
    if jnp.dtype(arr.dtype) != jnp.int32:
        raise ValueError(f"{name} dtype must be int32, got {arr.dtype}")


def default_tuning(
    m: int,
    n: int,
    k: int,
    g: int,
    dtype,
    sms: int | None = None,
    *,
    by_row: bool = False,
    glu: bool = False,
    fp8: bool = False,
):
    """(block_m, block_n, block_k, num_warps, num_stages, num_k_splits) from static shapes.

    fp8 (block-FP8 experts, W8A8): K steps of one 128-deep scale block and N blocks within one scale row; from
    bench/moe_decode.py on the H200 (2026-12-04, V2-Lite's fp8 experts with the shared chunks, device time with the
    work list and lhs's quantization): by row 4 stages (T = 1: glu 18.5 -> 17.6 us, down 11.9 -> 11.1); sorted, the
    GLU's N blocks 128 wide (T = 32: 103.0 us against 102.1 with 64, within the sweep's spread; every other move was
    slower), so that its epilogue quantizes the output for the down projection (`quantize_out`: one kernel less a
    layer); else as for bf16 operands (`dtype` is lhs's before its quantization).

    By row (`row_groups`: a decode step's copies, each its own item) from bench/moe_decode.py on the H200
    (2026-12-02, V2-Lite's experts with the shared chunks, bench/results/moe-decode-h200.json): 3 stages, no K split,
    128-wide N blocks but for the GLU kernel past 8 copies (glu at T = 1, 8 copies: 29.2 us -> 25.8; down at T = 1 /
    2: 14.1 -> 13.5 / 25.6 -> 22.0; glu at T = 2, 16 copies: 44.4 -> 43.7 with 64-wide blocks, 45.6 with 128).
    Otherwise:

    Untuned guesses (no GPU measurement yet; bench/moe.py --sweep times alternatives):
    - row tile from the mean rows per group M/G (an upper bound on the real mean under expert
      parallelism, where part of M is padding): 16 for decode, up to 128 for prefill;
    - decode (row tile <= 32) is weight-bandwidth bound: 64-wide N blocks, 128-deep K steps, 4
      stages in flight; split K when even one item per group could not fill the SMs;
    - prefill: 128 x 128 x 64 tiles, 8 warps, 3 stages (32 KB of bf16 operands per stage).
    float32 (tests, not a fast path) uses smaller tiles for registers and shared memory.
    """
    if fp8:
        bm, bn, _, warps, stages, splits = default_tuning(m, n, k, g, dtype, sms, by_row=by_row, glu=glu)
        if by_row:
            stages = 4
        elif glu and bm <= 32:
            bn = FP8_BLOCK
        return bm, max(16, min(bn, FP8_BLOCK, next_pow2(n))), FP8_BLOCK, warps, stages, splits
    if by_row and jnp.dtype(dtype) != jnp.float32:
        bn = 64 if glu and m > 8 else 128
        return 16, max(16, min(bn, next_pow2(n))), max(16, min(128, next_pow2(k))), 4, 3, 1
    bm = min(128, max(16, next_pow2(cdiv(m, g))))
    if jnp.dtype(dtype) == jnp.float32:
        bm, bn, bk, warps, stages = min(bm, 64), 64, 32, 4, 2
    elif bm <= 32:
        bn, bk, warps, stages = 64, 128, 4, 4
    else:
        bn, bk, warps, stages = 128, 64, 8, 3
    # Don't make tiny problems pay for big blocks.
    bn = max(16, min(bn, next_pow2(n)))
    bk = max(16, min(bk, next_pow2(k)))
    splits = 1
    if bm <= 32:
        sms = num_sms() if sms is None else sms
        best_case_programs = min(g, m) * cdiv(n, bn)
        steps = cdiv(k, bk)
        while best_case_programs * splits < sms and splits * 2 <= min(8, steps // 4):
            splits *= 2
    return bm, bn, bk, warps, stages, splits


def _cumsum(x):
    """Inclusive cumsum of a short i32 vector as one compare-and-reduce fusion: XLA's GPU cumsum is a
    reduce-window kernel of its own (two of them were ~4 us of each MoE layer's decode step)."""
    i = jnp.arange(x.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], x[None, :], 0), axis=1).astype(x.dtype)


def _listed_tile(count, w, cumsum=jnp.cumsum):
    """Item w of a list of segments' tiles one after another (`count` [P] tiles each, in registers): (its segment s,
    its tile j within it, pick: v [P] -> v[s] as a select and a sum, a register vector having no gather). For w past
    the list's end s is past the last segment with tiles (the callers mark such items empty)."""
    idx = jnp.arange(count.shape[0], dtype=jnp.int32)
    end = cumsum(count)  # inclusive
    s = jnp.sum((end <= w).astype(jnp.int32))  # searchsorted(end, w, side="right")

    def pick(v):
        return jnp.sum(jnp.where(idx == s, v, 0))

    return s, w - (pick(end) - pick(count)), pick


def work_item(sizes, num_groups: int, w, m: int, block_m: int, cumsum=jnp.cumsum, aligned: bool = False):
    """Work item w's (row0, lo, hi, group) from the group sizes `sizes` [P] (P > num_groups; entries past G =
    num_groups are 0): scalar jnp, so the grouped kernel derives its own item (no XLA kernels before the call) and
    `work_items` the whole list.

    Item w covers rows [max(lo, row0), min(hi, row0 + block_m)) of segment `group`: group < G a group, group == G
    the padding segment [sum, M) (zeros). Tiles are the block_m-row tiles of [0, M) (row0 a multiple of block_m:
    a tile straddling a segment boundary is an item of each segment it touches), or with `aligned` each segment's
    own tiles from its first row (row0 = lo + j * block_m: no tile is shared, so a group's weights are read by
    cdiv(rows, block_m) items, where a straddled group of fewer rows than block_m is often read by two). Items past
    the list's end (w >= their count) have lo == hi == 0 (they store nothing) and group G. The count is at most
    cdiv(M, block_m) + min(G, M) either way (aligned: sum_s cdiv(n_s, block_m) <= cdiv(M, block_m) + (segments -
    1)).
    """
    g = num_groups
    idx = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    sizes = jnp.maximum(sizes, 0)
    csum = cumsum(sizes)  # sum > M is invalid input: clip, never read past M
    seg_lo = jnp.where(idx <= g, jnp.minimum(csum - sizes, m), 0)  # the groups, then the padding segment at G
    seg_hi = jnp.where(idx < g, jnp.minimum(csum, m), jnp.where(idx == g, m, 0))
    if aligned:  # a segment's tiles start at its first row
        first = seg_lo
        count = jnp.where(seg_hi > seg_lo, (seg_hi - seg_lo + block_m - 1) // block_m, 0)
    else:  # the tiles of [0, M) that a segment touches
        first = seg_lo // block_m
        count = jnp.where(seg_hi > seg_lo, (seg_hi - 1) // block_m - first + 1, 0)
    seg, j, pick = _listed_tile(count, w, cumsum)
    seg = jnp.minimum(seg, g)
    valid = w < jnp.sum(count)
    row0 = pick(first) + j * block_m if aligned else (pick(first) + j) * block_m
    zero = jnp.zeros((), jnp.int32)
    return (
        jnp.where(valid, row0, zero),
        jnp.where(valid, pick(seg_lo), zero),
        jnp.where(valid, pick(seg_hi), zero),
        jnp.where(valid, seg, g),
    )


def num_work_items(m: int, num_groups: int, block_m: int) -> int:
    """The work list's static length: cdiv(M, block_m) tiles, plus one item for each group boundary inside one."""
    return cdiv(m, block_m) + min(num_groups, m)


def work_items(group_sizes, m: int, block_m: int):
    """The whole work list from traced group sizes i32[G]: i32[W] arrays (tile, lo, hi, group), W =
    `num_work_items` (`work_item` of each w, the block_m-row tiles of [0, M), item w's rows [max(lo, tile *
    block_m), min(hi, (tile + 1) * block_m)): the Mosaic GPU fp8 grouped GEMM's list, whose TMA loads whole tiles;
    the Triton kernel derives its item itself)."""
    g = group_sizes.shape[0]
    sizes = jnp.pad(group_sizes.astype(jnp.int32), (0, 1))
    w = jnp.arange(num_work_items(m, g, block_m), dtype=jnp.int32)
    # _cumsum: one fusion each (XLA's GPU cumsum is a reduce-window kernel of its own)
    row0, lo, hi, grp = jax.vmap(lambda i: work_item(sizes, g, i, m, block_m, cumsum=_cumsum))(w)
    return row0 // block_m, lo, hi, grp


def row_items(row_groups, num_groups: int, block_m: int):
    """Work list for rows in any order, each with its own group: i32[M] arrays (tile, lo, hi, group).

    Item r is row r alone: tile r // block_m, rows [r, r + 1), group row_groups[r]; a group outside
    [0, G) makes it a padding item (the kernel stores 0 for the row). Every row has its item, so nothing needs
    sorting; but rows of one group each read that group's weights. For a few rows (one decode
    token's top-k copies), that beats sorting them, which costs a chain of small kernels.
    """
    del num_groups  # the kernels treat a group outside [0, G) as padding themselves
    r = np.arange(row_groups.shape[0], dtype=np.int32)  # (XLA turns these constants into iota kernels: the
    # Triton kernel computes them from its item index instead)
    return jnp.asarray(r // block_m), jnp.asarray(r), jnp.asarray(r + 1), row_groups.astype(jnp.int32)


def copy_groups(row_groups, num_groups: int, num_chunks: int):
    """(each copy's group i32[M], each copy's token i32[M]) in the kernel's order: for 1-D row_groups the rows
    themselves (copy r of token r); for a token's top-k [T, K] first the T*K routed copies token by token, then
    the C shared chunks' T copies each, chunk by chunk (groups G..G+C-1)."""
    if row_groups.ndim == 1:
        return row_groups, jnp.arange(row_groups.shape[0], dtype=jnp.int32)
    t, k = row_groups.shape
    chunks = jnp.repeat(num_groups + jnp.arange(num_chunks, dtype=jnp.int32), t)
    groups = jnp.concatenate([row_groups.astype(jnp.int32).reshape(-1), chunks])
    tokens = jnp.concatenate([jnp.repeat(jnp.arange(t, dtype=jnp.int32), k), jnp.tile(jnp.arange(t), num_chunks)])
    return groups, tokens.astype(jnp.int32)


def _group_table_kernel(ids_ref, table_ref, count_ref, *, tokens: int, top_k: int, num_groups: int, num_chunks: int):
    """Program g: group slot g's copies in copy order (`copy_groups`' numbering), row r of the table the slot's r-th
    copy, and their count. Slots: the G experts (their copies among the T*K routed ones: a compare, a cumsum for
    each copy's place, a scatter to it), the C shared chunks (all T tokens' copies) and, last, the padding slot
    (the routed copies whose group is outside [0, G), stored 0 by the GEMMs)."""
    slot = pl.program_id(0)
    n_routed = tokens * top_k
    c = jnp.arange(next_pow2(n_routed), dtype=jnp.int32)
    in_range = c < n_routed
    key = masked_load(ids_ref.at[c], in_range)  # the top-k flattened, [T*K]
    pad_slot = num_groups + num_chunks
    match = in_range & jnp.where(slot == pad_slot, (key < 0) | (key >= num_groups), key == slot)
    m32 = match.astype(jnp.int32)
    rank = jnp.cumsum(m32) - m32  # the copy's place among the slot's (copies of a token's top-k: one a slot)
    # copies of other slots go to distinct columns past T*K (masked on the GPU; the interpreter's masked scatter must
    # not see them collide with a real place)
    col = jnp.where(match, rank, n_routed + c)
    is_chunk = (slot >= num_groups) & (slot < pad_slot)
    chunk_copy = n_routed + (slot - num_groups) * tokens + jnp.arange(next_pow2(tokens), dtype=jnp.int32)
    t_in = jnp.arange(next_pow2(tokens), dtype=jnp.int32) < tokens

    @pl.when(is_chunk)
    def _():
        pltriton.store(table_ref.at[slot, pl.ds(0, next_pow2(tokens))], chunk_copy, mask=t_in)

    @pl.when(jnp.logical_not(is_chunk))
    def _():
        pltriton.store(table_ref.at[slot, col], c, mask=match)

    count_ref[slot] = jnp.where(is_chunk, tokens, jnp.sum(m32))


def group_table(top_k_ids, num_groups: int, num_chunks: int, *, interpret: bool = False):
    """Items by group's table from each token's top-k i32[T, K]: (table i32[G + C + 1, W], count i32[G + C + 1]),
    row s of the table slot s's copies in copy order (`_group_table_kernel`), the first count[s] valid (W = T*K, the
    padding slot's most; the interpreter's rows are longer, for its scatter). One small Triton kernel before the
    GEMMs: the sort, the group sizes, the gather of the copies and the inverse permutation of the sorted path."""
    tokens, top_k = top_k_ids.shape
    slots = num_groups + num_chunks + 1
    ids = top_k_ids.reshape(-1).astype(jnp.int32)
    width = tokens * top_k
    if interpret:  # power-of-two loads and the other slots' columns past T*K (the GPU masks them)
        ids = pad_to(ids, 0, next_pow2(width))
        width = max(next_pow2(tokens), width + next_pow2(width))
    whole = lambda shape: pl.BlockSpec(shape, lambda g: (0,) * len(shape))  # noqa: E731
    return pl.pallas_call(
        functools.partial(
            _group_table_kernel, tokens=tokens, top_k=top_k, num_groups=num_groups, num_chunks=num_chunks
        ),
        grid=(slots,),
        in_specs=[whole(ids.shape)],
        out_specs=[whole((slots, width)), whole((slots,))],
        out_shape=[jax.ShapeDtypeStruct((slots, width), jnp.int32), jax.ShapeDtypeStruct((slots,), jnp.int32)],
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name=f"expert_table_t{tokens}_k{top_k}_g{num_groups}_c{num_chunks}",
    )(ids)


def group_items(tokens: int, top_k: int, num_groups: int, num_chunks: int, block_m: int) -> int:
    """Items by group's static count: the slots' row tiles one after another (`_group_tile`), a slot of n copies
    cdiv(n, block_m) of them, so at most cdiv(T*K + C*T, block_m) + G + C + 1 in all (every slot's last tile may be
    partial), and at most (G + C) * cdiv(T, block_m) + cdiv(T*K, block_m) (a token's top-k hits an expert once, the
    padding slot holds routed copies only); items past the tiles' count do nothing."""
    slots = num_groups + num_chunks + 1
    compact = cdiv(tokens * (top_k + num_chunks), block_m) + slots
    return min(compact, (num_groups + num_chunks) * cdiv(tokens, block_m) + cdiv(tokens * top_k, block_m))


def _group_tile(
    table_ref, count_ref, i, tokens: int, top_k: int, num_groups: int, num_chunks: int, bm: int, per_token: bool
):
    """By group (a token top-k of more copies than per-copy items serve): work item i is row tile q of group slot s
    (`group_table`'s slots, the G experts, C shared chunks and the padding slot), the slots' cdiv(count, bm) tiles
    listed one after another (a cumsum of the counts and a search, in registers), so that no program runs for an
    empty tile (a list of cdiv(T, bm) tiles a slot ran 576 items at 128 tokens, ~130 of them with copies).
    Returns (the slot's group for the K loop, each tile row's copy i32[bm], its lhs row [bm, 1], whether it has one
    [bm]): two loads from the table and one of the counts."""
    slots = num_groups + num_chunks + 1
    idx = jnp.arange(next_pow2(slots), dtype=jnp.int32)
    counts = masked_load(count_ref.at[idx], idx < slots)  # 0 past the slots
    s, q, pick = _listed_tile((counts + bm - 1) // bm, i)  # q: the tile within slot s (s >= slots past the last)
    slot = jnp.minimum(s, slots - 1)
    want = q * bm + jnp.arange(bm, dtype=jnp.int32)  # the tile's places among the slot's copies
    has = (want < pick(counts)) & (s < slots)
    copy = masked_load(table_ref.at[slot, want], has)
    n_routed = tokens * top_k
    token = jnp.where(copy < n_routed, copy // top_k, (copy - n_routed) % tokens)
    src = jnp.where(has, token if per_token else copy, 0)  # a row without a copy reads row 0 (never stored)
    # rows without a copy point past M at distinct rows (masked on the GPU; the interpreter's masked scatter must
    # not see them collide with a real row)
    dst = jnp.where(has, copy, n_routed + num_chunks * tokens + jnp.arange(bm, dtype=jnp.int32))
    return slot, dst, src[:, None], has


def _kernel(
    *refs,
    by_row: bool,
    by_group: bool,
    top_k: int,
    tokens: int,
    lhs_per_token: bool,
    glu: bool,
    m: int,
    n: int,
    k: int,
    num_groups: int,
    num_segments: int,
    num_chunks: int,
    chunk_axis: str,
    num_layers: int,
    bm: int,
    bn: int,
    bk: int,
    steps_per_split: int,
    transpose_rhs: bool,
    stacked: bool,
    precision,
    fp8: bool,
    quant_out: bool,
    round_dtype: str,
):
    # the group sizes (sorted rows), by row each row's group (by group the table and counts); the layer; lhs;
    # (rhs,) or with glu (gate rhs, up rhs); with fp8 experts their block scales; then as many shared (chunked)
    # weights; out
    n_items = 2 if by_group else 1  # by group: `group_table`'s table and counts
    n_rhs = 2 if glu else 1
    item_refs, (layer_ref, lhs_ref) = refs[:n_items], refs[n_items : n_items + 2]
    rhs_refs = refs[n_items + 2 : n_items + 2 + n_rhs]
    n_w = n_items + 2 + n_rhs * (1 + fp8) + fp8
    scale_refs = refs[n_items + 2 + n_rhs : n_w - 1] if fp8 else (None,) * n_rhs
    xs_ref = refs[n_w - 1] if fp8 else None  # fp8: lhs e4m3 and its row scales f32[M, K / 128] (`quantize_act`)
    n_sh = n_rhs if num_chunks else 0
    n_out = 2 if quant_out else 1  # out, or the output's e4m3 values and row scales
    shared_refs, out_ref = refs[n_w : n_w + n_sh], refs[-n_out]
    shared_scale_refs = refs[n_w + n_sh : -n_out] if fp8 else None  # fp8 shared chunks: their weights' block scales
    j = pl.program_id(0)  # N block (fastest: programs in flight share the row tile and expert)
    i = pl.program_id(1)  # work item
    s = pl.program_id(2)  # K split
    dst = None  # by group: each tile row's output row (its copy), else the tile's rows are the output's
    if by_group:  # item = (group slot, row tile): the slot's copies from `group_table` (`_group_tile`)
        grp, dst, src, has = _group_tile(*item_refs, i, tokens, top_k, num_groups, num_chunks, bm, lhs_per_token)
        lo, hi = jnp.int32(0), jnp.int32(0)
        row0 = jnp.int32(0)
    elif by_row:  # the items from the item index itself (an XLA array of them would be an iota kernel a call)
        if top_k:  # T*K routed copies, one row each; then one item per shared chunk: its T rows (`copy_groups`)
            n_routed = tokens * top_k
            is_copy = i < n_routed
            c = i - n_routed
            lo = jnp.where(is_copy, i, n_routed + c * tokens)
            hi = jnp.where(is_copy, i + 1, n_routed + (c + 1) * tokens)
            grp = jnp.where(is_copy, item_refs[0][jnp.minimum(i, n_routed - 1)], num_groups + c)
        else:
            lo, hi, grp = i, i + 1, item_refs[0][i]
        row0 = lo  # the item's rows start its tile (rows past hi are masked)
    else:  # the item from the group sizes (`work_item`), in the kernel: no XLA kernels for the list before the call
        p = next_pow2(num_segments + 1)
        seg = jnp.arange(p, dtype=jnp.int32)
        sizes = masked_load(item_refs[0].at[pl.ds(0, p)], None if p == num_segments else seg < num_segments)
        row0, lo, hi, grp = work_item(sizes, num_segments, i, m, bm, aligned=GROUP_ALIGNED_TILES)
    col0 = j * bn
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    cols = col0 + jnp.arange(bn, dtype=jnp.int32)
    # static: only a ragged last tile, or group-aligned tiles (any may run past M), read past M
    row_in = (rows < m)[:, None] if (m % bm or GROUP_ALIGNED_TILES) and not by_row else None
    col_in = cols < n if n % bn else None
    is_routed = (grp >= 0) & (grp < num_groups)
    is_shared = (grp >= num_groups) & (grp < num_groups + num_chunks)  # else a padding item (zeros)
    g = jnp.clip(grp, 0, num_groups - 1)
    c = jnp.clip(grp - num_groups, 0, max(num_chunks - 1, 0))  # the shared weight's chunk
    layer = jnp.clip(layer_ref[0], 0, num_layers - 1)  # clamped here, not by an XLA kernel before the call
    # rhs[layer, g] of stacked layers, else rhs[g]; a shared weight is [layer] or plain, its chunk an offset
    lead = (layer, g) if stacked else (g,)
    shared_lead = (layer,) if stacked else ()
    n_off, k_off = (c * n, 0) if chunk_axis == "n" else (0, c * k)
    if transpose_rhs:  # rhs tile [bn, bk], contract both operands' dim 1
        dims = (((1,), (1,)), ((), ()))
    else:  # rhs tile [bk, bn]
        dims = (((1,), (0,)), ((), ()))
    kcols = jnp.arange(bk, dtype=jnp.int32)
    if by_row and not by_group:  # the tile's lhs rows, gathered: each copy's own row, or its token's when lhs has
        # one per token; the tile's rows past the item's repeat its first (one row's bytes for a one-row item, not the
        # next 15 rows')
        r_ = jnp.where(rows < hi, rows, lo)
        if lhs_per_token:
            r_ = jnp.where(r_ < tokens * top_k, r_ // top_k, (r_ - tokens * top_k) % tokens)
        src = r_[:, None]

    col_in_w = None if col_in is None else col_in[:, None]  # [bn, 1], for an HF-layout weight tile

    def step(kk, accs, weights, wlead, w_n0, w_k0, k_in=None, scales=None):
        k0 = kk * bk
        k_mask = None if k_in is None else k_in[None, :]
        if scales is not None:  # fp8 experts (HF layout): a dot of the e4m3 tiles (exact products; a cast to bf16
            # first kept Triton from prefetching them, `linear`), scaled by row scale x the expert's block scale for
            # this K block (`scales`: the weights' [bm, Kp] from `block_scales`)
            if by_row:
                x = load_e4m3(lhs_ref.at[src, (k0 + kcols)[None, :]], None, k_in)
            else:
                x = load_e4m3(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], row_in, k_in)
            new = []
            for rhs_ref, scale, acc in zip(weights, scales, accs):
                w = load_e4m3(rhs_ref.at[(*wlead, pl.ds(w_n0 + col0, bn), pl.ds(w_k0 + k0, bk))], col_in_w, k_in)
                part = lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
                new.append(acc + part * block_scale(scale, kk))
            return tuple(new)
        if by_row:
            x = masked_load(lhs_ref.at[src, (k0 + kcols)[None, :]], k_mask)
        else:
            x = masked_load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask_and(row_in, k_mask))
        new = []
        for rhs_ref, acc in zip(weights, accs):
            if transpose_rhs:
                w = masked_load(
                    rhs_ref.at[(*wlead, pl.ds(w_n0 + col0, bn), pl.ds(w_k0 + k0, bk))],
                    mask_and(None if col_in is None else col_in[:, None], k_mask),
                )
            else:
                w = masked_load(
                    rhs_ref.at[(*wlead, pl.ds(k0, bk), pl.ds(col0, bn))],
                    mask_and(None if k_in is None else k_in[:, None], None if col_in is None else col_in[None, :]),
                )
            new.append(acc + lax.dot_general(x, w, dims, precision=precision, preferred_element_type=jnp.float32))
        return tuple(new)

    full_steps = k // bk
    first = s * steps_per_split
    last = jnp.minimum(first + steps_per_split, full_steps)
    owned = jnp.maximum(last - first, 0)
    acc = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in rhs_refs)
    # One loop per weight source; the item's own source runs its steps, the other none.
    sources = [(is_routed, rhs_refs, lead, 0, 0, scale_refs if fp8 else None)]
    if num_chunks:
        sources.append((is_shared, shared_refs, shared_lead, n_off, k_off, shared_scale_refs))
    for on, weights, wlead, w_n0, w_k0, scales in sources:
        if scales is not None:  # the tile's scales for all K blocks, loaded before the K loop (`block_scales`)
            rows_at = src if by_row else pl.ds(row0, bm)
            nb, kb0 = (w_n0 + col0) // FP8_BLOCK, w_k0 // FP8_BLOCK  # a shared chunk: whole scale blocks in
            scales = tuple(block_scales(xs_ref, rows_at, r, (*wlead, nb), row_in, kb0) for r in scales)
        body = functools.partial(step, weights=weights, wlead=wlead, w_n0=w_n0, w_k0=w_k0, scales=scales)
        if by_group:  # a slot's tiles past its copies: nothing to compute (nor store)
            on = on & (jnp.sum(has.astype(jnp.int32)) > 0)
        acc = lax.fori_loop(first, first + jnp.where(on, owned, 0), body, acc)
        if k % bk:  # static: one masked step for the ragged end of K, run by the split that owns it
            k_in = full_steps * bk + kcols < k
            owns_tail = on & (full_steps >= first) & (full_steps < first + steps_per_split)
            # (the loop index keeps the tail's K offset dynamic: a static slice past K fails to trace)
            acc = lax.fori_loop(
                0, owns_tail.astype(jnp.int32), lambda t, a, body=body: body(full_steps + t, a, k_in=k_in), acc
            )
    mine = has if by_group else (rows >= lo) & (rows < hi)  # hi <= M, so this also keeps the store in bounds
    mask = mask_and(mine[:, None], None if col_in is None else col_in[None, :])
    # the tile's output rows: its own [row0, row0 + bm), or by group each row's copy (a scatter of distinct rows)
    out_rows = pl.ds(row0, bm) if dst is None else dst[:, None]
    out_cols = pl.ds(col0, bn) if dst is None else cols[None, :]
    if glu and out_ref.shape[0] == 1:  # one K split: the SwiGLU epilogue here, silu(gate) * up
        gate, up = acc
        out = (gate * jax.nn.sigmoid(gate) * up,)
    else:  # the partials of each (with glu: gate's then up's splits); the caller sums them
        out = acc
    if quant_out:  # one K split, the program's columns one scale block: the output in the W8A8 activation format
        # (`quantize_act` of it rounded to round_dtype), the next fp8 GEMM's input, without a kernel between
        v = out[0].astype(jnp.dtype(round_dtype)).astype(jnp.float32)
        q, row_scale = quantize_act_tile(v if col_in is None else jnp.where(col_in[None, :], v, 0.0))
        pltriton.store(out_ref.at[s, out_rows, out_cols], q.astype(out_ref.dtype), mask=mask)  # s = 0
        scale_col = pl.ds(j, 1) if dst is None else jnp.full((1, 1), j, jnp.int32)
        pltriton.store(refs[-1].at[out_rows, scale_col], row_scale[:, None], mask=mine[:, None])
        return
    for a, part in enumerate(out):
        blk = out_ref.at[a * (out_ref.shape[0] // len(out)) + s, out_rows, out_cols]
        pltriton.store(blk, part.astype(out_ref.dtype), mask=mask)


def shared_chunks(shared_shape, n: int, k: int) -> tuple[int, str]:
    """(C, axis) of a shared weight [(Lyr,) N_s, K_s] (HF [out, in] layout) cut into C chunks that each act as one
    more [n, k] group: along its output rows (N_s = C*n, K_s = k: an MoE's gate/up, chunk c = rows [c*n, (c+1)*n))
    or along its input columns (N_s = n, K_s = C*k: the down projection, chunk c = columns [c*k, (c+1)*k))."""
    ns, ks = shared_shape[-2:]
    if ks == k and ns % n == 0:
        return ns // n, "n"
    if ns == n and ks % k == 0:
        return ks // k, "k"
    raise ValueError(
        f"shared_rhs {tuple(shared_shape)} is not a whole number of [N={n}, K={k}] chunks along its rows or its columns"
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "transpose_rhs",
        "interpret",
        "block_m",
        "block_n",
        "block_k",
        "num_warps",
        "num_stages",
        "num_k_splits",
        "out_dtype",
        "by_row",
        "quantize_out",
    ),
)
def _gmm_impl(
    lhs,
    rhs,
    rhs_up,
    shared,
    shared_up,
    groups,
    layer,
    scales,
    shared_scales,
    *,
    by_row,
    transpose_rhs,
    interpret,
    block_m,
    block_n,
    block_k,
    num_warps,
    num_stages,
    num_k_splits,
    out_dtype,
    quantize_out=False,
):
    """groups: group_sizes i32[G (+C)] (rows sorted by group), or with by_row the group of each row i32[M].
    layer: i32[1], the index into rhs's leading axis when rhs is stacked [Lyr, G, ...] (4-D).
    rhs_up: None, or the up projection beside rhs (the gate): out = silu(lhs @ rhs) * (lhs @ rhs_up).
    shared (and beside it shared_up with rhs_up): None, or a weight [(Lyr,) N_s, K_s] whose C chunks
    (`shared_chunks`) are groups G..G+C-1. scales: () or, for e4m3 rhs (and rhs_up), their block scales, then lhs's
    row scales [M, cdiv(K, 128)] (lhs e4m3: `quantize_act`); shared_scales: () or e4m3 shared weights' scales.
    quantize_out (fp8 glu): returns (e4m3 [M, N], f32 [M, cdiv(N, 128)]), `quantize_act` of the out_dtype output:
    in the kernel's epilogue where a program's columns are one scale block and K is not split, else after it."""
    glu = rhs_up is not None
    rhss = (rhs, rhs_up) if glu else (rhs,)
    shareds = () if shared is None else (shared, shared_up) if glu else (shared,)
    stacked = rhs.ndim == 4
    lead = ((0, 0),) * (1 + stacked)  # no padding on the (layer,) group axes
    k = lhs.shape[1]
    g = rhs.shape[-3]
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    num_chunks, chunk_axis = shared_chunks(shared.shape, n, k) if shareds else (0, "n")
    top_k = groups.shape[1] if by_row and groups.ndim == 2 else 0  # a token's top-k [T, K]: the kernel adds chunks
    tokens = groups.shape[0] if top_k else 0
    if not by_row:
        m = lhs.shape[0]  # output rows
    else:
        m = tokens * (top_k + num_chunks) if top_k else groups.shape[0]
        groups = groups.reshape(-1)
    lhs_per_token = bool(top_k) and lhs.shape[0] == tokens != m  # by row: row r reads its token's lhs row
    by_group = tokens * top_k > PER_COPY_MAX_COPIES  # a token top-k of more copies: items by group (`_group_tile`)
    num_row_items = tokens * top_k + num_chunks if top_k else m
    if by_group:
        num_row_items = group_items(tokens, top_k, g, num_chunks, block_m)
    out_dtype = jnp.dtype(out_dtype)
    # Interpret mode cannot slice a block larger than the array (the GPU just masks): zero-pad a
    # dimension smaller than its block (tiny problems only: blocks are clamped to the next power of
    # two of their dimension by the caller, so the padding is under one block; a stacked rhs is
    # padded, so copied, whole: CPU tests only). A shared weight is padded chunk by chunk.
    m_out, n_out = m, n
    m_rows = m  # the output's rows (interpret mode: room for a tile past the last)
    if interpret and by_row:  # an item's tile starts at its first row: room for a whole tile past the last
        m = m_rows = m + block_m
    elif interpret and GROUP_ALIGNED_TILES:  # a segment's tile starts at any row below M: room for one past it
        lhs = jnp.pad(lhs, ((0, block_m), (0, 0)))
        scales = (*scales[:-1], jnp.pad(scales[-1], ((0, block_m), (0, 0)))) if scales else scales
        m_rows = m + block_m
    elif interpret and m < block_m:  # padding segment rows: output 0, sliced off
        lhs = jnp.pad(lhs, ((0, block_m - m), (0, 0)))
        scales = (*scales[:-1], jnp.pad(scales[-1], ((0, block_m - m), (0, 0)))) if scales else scales
        m = m_rows = block_m
    if interpret:  # the scales' K blocks to a power of two (`block_scales`); a shared chunk's read past its start
        scales = tuple(pad_to(a, a.ndim - 1, next_pow2(a.shape[-1])) for a in scales)
        kp = next_pow2(scales[-1].shape[-1]) if scales else 0
        shared_scales = tuple(pad_to(a, a.ndim - 1, a.shape[-1] + kp) for a in shared_scales)
    pad_k = block_k - k if interpret and k < block_k else 0  # zeros in K add nothing
    pad_n = block_n - n if interpret and n < block_n else 0
    if pad_k or pad_n:
        lhs = jnp.pad(lhs, ((0, 0), (0, pad_k)))
        pad = ((0, pad_n), (0, pad_k)) if transpose_rhs else ((0, pad_k), (0, pad_n))
        rhss = tuple(jnp.pad(r, lead + pad) for r in rhss)
        shareds = tuple(_pad_chunks(w, num_chunks, chunk_axis, n, k, pad_n, pad_k) for w in shareds)
        n, k = n + pad_n, k + pad_k
    # the kernel derives its item: by row from its index (`row_items`), sorted from the group sizes (`work_item`)
    num_items = num_row_items if by_row else num_work_items(m, groups.shape[0], block_m)
    num_segments = groups.shape[0]
    if interpret and not by_row:  # the kernel loads the sizes as a power-of-two vector (the GPU masks the rest)
        groups = pad_to(groups, 0, next_pow2(num_segments + 1))
    items = (groups.astype(jnp.int32),)
    if by_group:  # the slots' copies, one small kernel before the GEMM
        table, count = group_table(groups.reshape(tokens, top_k), g, num_chunks, interpret=interpret)
        # the kernel loads the counts as a power-of-two vector (the GPU masks the rest)
        items = (table, pad_to(count, 0, next_pow2(count.shape[0])) if interpret else count)
    steps_per_split = cdiv(cdiv(k, block_k), num_k_splits)
    splits = cdiv(cdiv(k, block_k), steps_per_split)  # no empty splits
    part_dtype = out_dtype if splits == 1 else jnp.float32
    quant_out = quantize_out and splits == 1 and (block_n == FP8_BLOCK or n_out <= block_n)
    parts = splits if splits == 1 or not glu else 2 * splits  # split K with glu: gate's partials, then up's
    precision = lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None  # exact f32, not TF32
    kernel = functools.partial(
        _kernel,
        by_row=by_row,
        by_group=by_group,
        top_k=top_k,
        tokens=tokens,
        lhs_per_token=lhs_per_token,
        glu=glu,
        m=m,
        n=n,
        k=k,
        num_groups=g,
        num_segments=num_segments,
        num_chunks=num_chunks,
        chunk_axis=chunk_axis,
        num_layers=rhs.shape[0] if stacked else 1,
        bm=block_m,
        bn=block_n,
        bk=block_k,
        steps_per_split=steps_per_split,
        transpose_rhs=transpose_rhs,
        stacked=stacked,
        precision=precision,
        fp8=bool(scales),
        quant_out=quant_out,
        round_dtype=out_dtype.name,
    )
    whole = lambda shape: pl.BlockSpec(shape, lambda j, i, s: (0,) * len(shape))  # noqa: E731
    out_shapes = [jax.ShapeDtypeStruct((parts, m_rows, n), FP8 if quant_out else part_dtype)]
    if quant_out:
        out_shapes.append(jax.ShapeDtypeStruct((m_rows, cdiv(n_out, FP8_BLOCK)), jnp.float32))
    weights = rhss + tuple(scales) + shareds + tuple(shared_scales)
    out = pl.pallas_call(
        kernel,
        grid=(cdiv(n, block_n), num_items, splits),
        # Whole-array blocks: under the Triton lowering a block only sets a base pointer; the
        # kernel offsets by its work item itself.
        in_specs=[whole(it.shape) for it in items]
        + [whole((1,)), whole(lhs.shape)]
        + [whole(w.shape) for w in weights],
        out_specs=[whole(o.shape) for o in out_shapes],
        out_shape=out_shapes,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(
            f"grouped_{'glu' if glu else 'matmul'}{'_shared' if shareds else ''}{'_fp8' if scales else ''}"
            f"_bm{block_m}_bn{block_n}_bk{block_k}"
            f"_w{num_warps}_s{num_stages}_ks{splits}{'_q' if quant_out else ''}"
        ),
    )(*items, layer, lhs, *weights)
    if quant_out:
        return out[0][0, :m_out, :n_out], out[1][:m_out]
    out = out[0]
    if splits == 1:
        out = out[0]
    elif glu:
        gate, up = jnp.sum(out[:splits], axis=0), jnp.sum(out[splits:], axis=0)
        out = (jax.nn.silu(gate) * up).astype(out_dtype)
    else:
        out = jnp.sum(out, axis=0).astype(out_dtype)
    if (m_out, n_out) != (m_rows, n):
        out = out[:m_out, :n_out]
    return fp8_quant.quantize_act(out, interpret=interpret) if quantize_out else out


def _pad_chunks(w, num_chunks: int, axis: str, n: int, k: int, pad_n: int, pad_k: int):
    """Interpret mode: a shared weight [(Lyr,) N_s, K_s] with each of its chunks zero-padded to [n + pad_n, k + pad_k]
    (so chunk c stays at offset c * the padded size)."""
    lead = w.shape[:-2]
    if axis == "n":
        w = w.reshape(*lead, num_chunks, n, k)
        w = jnp.pad(w, ((0, 0),) * (len(lead) + 1) + ((0, pad_n), (0, pad_k)))
        return w.reshape(*lead, num_chunks * (n + pad_n), k + pad_k)
    w = w.reshape(*lead, n, num_chunks, k)
    w = jnp.pad(w, ((0, 0),) * len(lead) + ((0, pad_n), (0, 0), (0, pad_k)))
    return w.reshape(*lead, n + pad_n, num_chunks * (k + pad_k))


def grouped_matmul(
    lhs,
    rhs,
    group_sizes=None,
    *,
    row_groups=None,
    transpose_rhs: bool = True,
    interpret: bool = False,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_k_splits: int | None = None,
    preferred_element_type=None,
    rhs_index=None,
    up_rhs=None,
    shared_rhs=None,
    shared_up_rhs=None,
    rhs_scale=None,
    up_scale=None,
    shared_scale=None,
    shared_up_scale=None,
    lhs_scale=None,
    quantize_out: bool = False,
):
    """out[r] = lhs[r] @ W[g(r)] for each row r of group g(r); rows >= sum(group_sizes) give 0.

    lhs [M, K] rows sorted by group; rhs [G, N, K] (HF [out, in] layout, transpose_rhs=True) or
    [G, K, N]; group_sizes i32[G] with sum <= M (a larger sum is clipped at M). Returns [M, N] in
    preferred_element_type (default lhs.dtype), accumulated in float32. Same result as
    `jax.lax.ragged_dot_general` contracting lhs dim 1 with rhs dim 2 (or 1).

    row_groups (instead of group_sizes): i32[M], each row's group, rows in any order; a row whose
    group is outside the groups gives 0 (`row_items`: one work item per row, so for a few rows only).
    row_groups may also be each token's top-k, i32[T, K]: M = T*(K+C) copies, first the T*K routed
    ones token by token (one item each), then each of the C shared chunks' T copies (one item per chunk,
    reading its weights once for all T tokens); `copy_groups` gives the order. lhs is then [M, K] or
    one row per token, [T, K] (each copy reads its token's row: no gather of the copies before the call).
    Past PER_COPY_MAX_COPIES routed copies, items by group (module docstring): same rows, same order.

    up_rhs: an MoE's up projection, the shape and dtype of rhs (then its gate projection): returns
    silu(lhs @ W) * (lhs @ W_up) in one kernel (each program reads both weights' tiles for its rows;
    the SwiGLU runs on the float32 accumulators), instead of two GEMMs and an elementwise kernel.

    shared_rhs (transpose_rhs=True): one more weight [N_s, K_s] (or stacked [Lyr, N_s, K_s] like rhs) made of
    C whole [N, K] chunks along its rows or its columns (`shared_chunks`), which are groups G..G+C-1: an MoE's
    shared experts, their intermediate dim cut into routed-expert-sized pieces, run as C more rows per token
    in the routed experts' kernel (each piece's output summed with weight 1 gives the shared MLP). With
    up_rhs, shared_up_rhs (the shape of shared_rhs) is the shared up projection. group_sizes is then
    i32[G + C].

    rhs_index: with rhs stacked over layers, [Lyr, G, N, K] (or [Lyr, G, K, N]), an integer scalar
    (static or traced) picking the layer, read in place (W = rhs[rhs_index]); a static index must be
    in range, a traced one is clamped to [0, Lyr).

    rhs_scale (and up_scale with up_rhs): block-FP8 experts, rhs e4m3 [(Lyr,) G, N, K] (transpose_rhs=True) with
    float32 scales [(Lyr,) G, cdiv(N, 128), cdiv(K, 128)]: the W8A8 product (lhs quantized per row per 128 channels
    before the kernel, the module docstring; lhs any float dtype, the output's). fp8 shared chunks: shared_rhs (and
    shared_up_rhs) e4m3 with shared_scale (and shared_up_scale) [(Lyr,) cdiv(N_s, 128), cdiv(K_s, 128)], the chunks
    whole scale blocks (N, or K for chunks along the columns, a multiple of 128). lhs_scale: lhs already in the W8A8
    activation format, e4m3 [M, K] with its row scales f32 [M, cdiv(K, 128)] (`fp8_quant.quantize_act`, or a
    quantize_out call's output); preferred_element_type then names the output's dtype. quantize_out (fp8 experts
    with up_rhs): the SwiGLU output returned in that format, (e4m3 [M, N], f32 [M, cdiv(N, 128)]) = `quantize_act`
    of the output in preferred_element_type: for the down projection's lhs / lhs_scale, quantized in this kernel's
    epilogue (with 128-wide N blocks and K unsplit; else by `quantize_act` after it).

    Tuning (None = `default_tuning`): block_m rows per tile, block_n, block_k (powers of two >= 16),
    num_warps, num_stages (Triton pipelining), num_k_splits (K split into float32 partials).
    """
    fp8 = rhs_scale is not None
    rows = lhs  # lhs given quantized (lhs_scale): checked as the float rows it stands for
    if lhs_scale is not None:
        _validate_lhs_scale(lhs, lhs_scale, fp8, preferred_element_type)
        rows = jax.ShapeDtypeStruct(lhs.shape, preferred_element_type)
    if quantize_out and not (fp8 and up_rhs is not None):
        raise ValueError("quantize_out is for fp8 experts with up_rhs (the SwiGLU output, the down projection's lhs)")
    num_chunks = _validate_shared(rhs, up_rhs, shared_rhs, shared_up_rhs, transpose_rhs, rhs_index)
    _validate_fp8(
        rhs,
        up_rhs,
        shared_rhs,
        transpose_rhs,
        rhs_scale,
        up_scale,
        block_n,
        block_k,
        shared_up_rhs,
        shared_scale,
        shared_up_scale,
    )
    _validate(
        rows,
        rhs,
        group_sizes,
        transpose_rhs,
        block_m,
        block_n,
        block_k,
        num_warps,
        num_stages,
        num_k_splits,
        preferred_element_type,
        rhs_index,
        row_groups,
        num_chunks,
        fp8,
    )
    if up_rhs is not None and (
        getattr(up_rhs, "shape", None) != rhs.shape or getattr(up_rhs, "dtype", None) != rhs.dtype
    ):
        raise ValueError(
            f"up_rhs must match rhs: {getattr(up_rhs, 'shape', None)} {getattr(up_rhs, 'dtype', None)} vs "
            f"{rhs.shape} {rhs.dtype}"
        )
    by_row = row_groups is not None
    if not by_row:
        m = lhs.shape[0]
    else:
        m = row_groups.shape[0] * (row_groups.shape[1] + num_chunks) if row_groups.ndim == 2 else row_groups.shape[0]
    k = lhs.shape[1]
    g = rhs.shape[-3] + num_chunks
    n = rhs.shape[-2] if transpose_rhs else rhs.shape[-1]
    # per-copy items tune as a group per row; items by group (a larger top-k) as sorted rows
    per_copy = by_row and not (row_groups.ndim == 2 and row_groups.size > PER_COPY_MAX_COPIES)
    d = default_tuning(m, n, k, m if per_copy else g, rows.dtype, by_row=per_copy, glu=up_rhs is not None, fp8=fp8)
    bm, bn, bk, warps, stages, splits = (
        d[i] if v is None else v for i, v in enumerate((block_m, block_n, block_k, num_warps, num_stages, num_k_splits))
    )
    # No block larger than its (power-of-two rounded) dimension: it would only compute padding (fp8: K steps stay
    # the scale blocks).
    bm, bn = (min(b, max(16, next_pow2(x))) for b, x in ((bm, m), (bn, n)))
    bk = bk if fp8 else min(bk, max(16, next_pow2(k)))
    out_dtype = jnp.dtype(rows.dtype if preferred_element_type is None else preferred_element_type)
    layer = (
        jnp.zeros((1,), jnp.int32)
        if rhs_index is None
        else jnp.asarray(rhs_index, jnp.int32).reshape(1)  # clamped to [0, Lyr) in the kernel
    )
    scales = ()
    if fp8:  # W8A8: lhs quantized once (one kernel), not by each program; its row scales after the weights'
        x_scale = lhs_scale
        if lhs_scale is None:
            lhs, x_scale = fp8_quant.quantize_act(lhs, interpret=bool(interpret))
        scales = (rhs_scale, up_scale, x_scale) if up_rhs is not None else (rhs_scale, x_scale)
    shared_scales = tuple(a for a in (shared_scale, shared_up_scale) if a is not None)
    return _gmm_impl(
        lhs,
        rhs,
        up_rhs,
        shared_rhs,
        shared_up_rhs,
        row_groups if by_row else group_sizes,
        layer,
        scales,
        shared_scales,
        by_row=by_row,
        transpose_rhs=bool(transpose_rhs),
        interpret=bool(interpret),
        block_m=bm,
        block_n=bn,
        block_k=bk,
        num_warps=warps,
        num_stages=stages,
        num_k_splits=splits,
        out_dtype=out_dtype.name,
        quantize_out=bool(quantize_out),
    )


def _validate_lhs_scale(lhs, lhs_scale, fp8: bool, preferred_element_type):
    """lhs in the W8A8 activation format: e4m3 [M, K] with f32 [M, cdiv(K, 128)] row scales, for fp8 experts, with
    the output's dtype named."""
    if not fp8:
        raise ValueError("lhs_scale (lhs already quantized) is for fp8 experts: give rhs_scale")
    if getattr(lhs, "ndim", None) != 2 or jnp.dtype(lhs.dtype) != FP8:
        raise ValueError(f"with lhs_scale, lhs must be float8_e4m3fn [M, K], got {getattr(lhs, 'dtype', None)}")
    want = (lhs.shape[0], cdiv(lhs.shape[1], FP8_BLOCK))
    if getattr(lhs_scale, "shape", None) != want or jnp.dtype(lhs_scale.dtype) != jnp.float32:
        raise ValueError(
            f"lhs_scale must be f32{list(want)} (lhs {list(lhs.shape)}'s row scales per {FP8_BLOCK} channels), got "
            f"{getattr(lhs_scale, 'dtype', None)}{list(getattr(lhs_scale, 'shape', ()))}"
        )
    if preferred_element_type is None:
        raise ValueError("with lhs_scale, give preferred_element_type (the output's dtype: lhs is e4m3)")


def _validate_shared(rhs, up_rhs, shared, shared_up, transpose_rhs, rhs_index) -> int:
    """The number of chunks C of shared_rhs (0 without), after checking it and shared_up_rhs against rhs."""
    if shared is None:
        if shared_up is not None:
            raise ValueError("shared_up_rhs needs shared_rhs (the shared gate projection)")
        return 0
    if (up_rhs is None) != (shared_up is None):
        raise ValueError("give shared_up_rhs exactly when up_rhs is given (the shared experts' up projection)")
    if not transpose_rhs:
        raise ValueError("shared_rhs needs transpose_rhs=True (HF [out, in] layout)")
    want = rhs.ndim - 1
    for name, w in (("shared_rhs", shared), ("shared_up_rhs", shared_up)):
        if w is None:
            continue
        if not hasattr(w, "ndim") or w.ndim != want:
            layout = "[Lyr, N_s, K_s] (rhs is stacked)" if rhs_index is not None else "[N_s, K_s]"
            raise ValueError(f"{name} must be {layout}, got shape {getattr(w, 'shape', None)}")
        if w.dtype != rhs.dtype:
            raise ValueError(f"{name} dtype {w.dtype} differs from rhs's {rhs.dtype}")
        if rhs_index is not None and w.shape[0] != rhs.shape[0]:
            raise ValueError(f"{name} has {w.shape[0]} stacked layers, rhs {rhs.shape[0]}")
    if shared_up is not None and shared_up.shape != shared.shape:
        raise ValueError(f"shared_up_rhs {shared_up.shape} must match shared_rhs {shared.shape}")
    return shared_chunks(shared.shape, rhs.shape[-2], rhs.shape[-1])[0]


def grouped_matmul_reference(
    lhs,
    rhs,
    group_sizes=None,
    *,
    row_groups=None,
    transpose_rhs: bool = True,
    interpret: bool = False,
    preferred_element_type=None,
    rhs_index=None,
    up_rhs=None,
    shared_rhs=None,
    shared_up_rhs=None,
    rhs_scale=None,
    up_scale=None,
    shared_scale=None,
    shared_up_scale=None,
    **tuning,
):
    """Float32 plain-JAX reference (returns float32): a masked dense matmul per group, summed.

    With rhs_index, rhs is stacked [Lyr, ...] and the layer is sliced out first (clamped as the
    kernel does). Costs G dense [M, K] x [K, N] products: for tests and moderate benchmark checks
    only. With up_rhs: silu(reference(rhs)) * reference(up_rhs). A shared_rhs's chunks are appended
    to rhs as groups G..G+C-1; an lhs of M/r rows (row_groups) is repeated r times first. With rhs_scale (fp8
    experts): `fp8_matmul.fp8_grouped_matmul_reference`, the W8A8 math (fp8 shared chunks appended as groups with
    their blocks' scales).
    """
    del interpret, tuning, preferred_element_type
    if up_rhs is not None:
        kw = dict(row_groups=row_groups, transpose_rhs=transpose_rhs, rhs_index=rhs_index)
        kw_g = dict(shared_rhs=shared_rhs, rhs_scale=rhs_scale, shared_scale=shared_scale)
        kw_u = dict(shared_rhs=shared_up_rhs, rhs_scale=up_scale, shared_scale=shared_up_scale)
        gate = grouped_matmul_reference(lhs, rhs, group_sizes, **kw_g, **kw)
        up = grouped_matmul_reference(lhs, up_rhs, group_sizes, **kw_u, **kw)
        return jax.nn.silu(gate) * up
    if rhs_scale is not None:
        from pallas_kernels.fp8_matmul import fp8_grouped_matmul_reference  # (it imports this module)

        num_chunks = _validate_shared(rhs, None, shared_rhs, None, transpose_rhs, rhs_index)
        _validate_fp8(rhs, None, shared_rhs, transpose_rhs, rhs_scale, None, None, None, None, shared_scale)
        _validate(lhs, rhs, group_sizes, transpose_rhs, *(None,) * 7, rhs_index, row_groups, num_chunks, True)
        if rhs_index is not None:  # the layer (clamped), then its shared chunks as groups G..G+C-1
            index = jnp.clip(rhs_index, 0, rhs.shape[0] - 1)
            rhs, rhs_scale = (lax.dynamic_index_in_dim(a, index, keepdims=False) for a in (rhs, rhs_scale))
            if shared_rhs is not None:
                shared_rhs, shared_scale = (
                    lax.dynamic_index_in_dim(a, index, keepdims=False) for a in (shared_rhs, shared_scale)
                )
        if shared_rhs is not None:
            n, k = rhs.shape[-2:]
            c, nb, kb = num_chunks, n // FP8_BLOCK, cdiv(k, FP8_BLOCK)
            if shared_chunks(shared_rhs.shape, n, k)[1] == "n":  # [C, N, K], scales [C, Nb, Kb]
                chunks, chunk_scales = shared_rhs.reshape(c, n, k), shared_scale.reshape(c, nb, kb)
            else:  # along K (whole scale blocks: k = kb * 128)
                chunks = jnp.swapaxes(shared_rhs.reshape(n, c, k), 0, 1)
                chunk_scales = jnp.swapaxes(shared_scale.reshape(cdiv(n, FP8_BLOCK), c, kb), 0, 1)
            rhs = jnp.concatenate([rhs, chunks], axis=0)
            rhs_scale = jnp.concatenate([rhs_scale, chunk_scales], axis=0)
        if row_groups is not None:
            row_groups, tokens = copy_groups(row_groups, rhs.shape[-3] - num_chunks, num_chunks)
            if row_groups.shape[0] != lhs.shape[0]:  # one lhs row per token
                lhs = lhs[tokens]
        return fp8_grouped_matmul_reference(lhs, rhs, rhs_scale, group_sizes, row_groups=row_groups)
    num_chunks = _validate_shared(rhs, None, shared_rhs, None, transpose_rhs, rhs_index)
    untuned = (None,) * 7  # blocks, warps, stages, splits, output type
    _validate(lhs, rhs, group_sizes, transpose_rhs, *untuned, rhs_index, row_groups, num_chunks)
    if rhs_index is not None:
        index = jnp.clip(rhs_index, 0, rhs.shape[0] - 1)
        rhs = lax.dynamic_index_in_dim(rhs, index, keepdims=False)
        if shared_rhs is not None:
            shared_rhs = lax.dynamic_index_in_dim(shared_rhs, index, keepdims=False)
    if shared_rhs is not None:  # [C, N, K] chunks after the G groups
        n, k = rhs.shape[-2:]
        _, axis = shared_chunks(shared_rhs.shape, n, k)
        chunks = (
            shared_rhs.reshape(num_chunks, n, k)
            if axis == "n"
            else jnp.swapaxes(shared_rhs.reshape(n, num_chunks, k), 0, 1)
        )
        rhs = jnp.concatenate([rhs, chunks.astype(rhs.dtype)], axis=0)
    if row_groups is not None:
        row_groups, tokens = copy_groups(row_groups, rhs.shape[0] - num_chunks, num_chunks)
        if row_groups.shape[0] != lhs.shape[0]:  # one lhs row per token
            lhs = lhs[tokens]
    m = lhs.shape[0]
    x = lhs.astype(jnp.float32)
    w = rhs.astype(jnp.float32)
    w = jnp.swapaxes(w, 1, 2) if transpose_rhs else w  # [G, K, N]
    if row_groups is not None:  # each row with its own group's weights [M, K, N]; other groups: 0
        valid = (row_groups >= 0) & (row_groups < w.shape[0])
        out = jnp.einsum("mk,mkn->mn", x, w[jnp.clip(row_groups, 0, w.shape[0] - 1)], precision=lax.Precision.HIGHEST)
        return jnp.where(valid[:, None], out, 0.0)  # where: a NaN row of another group must not leak
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    starts = ends - jnp.maximum(group_sizes, 0)
    rows = jnp.arange(m)

    def body(g, acc):
        inside = (rows >= starts[g]) & (rows < ends[g])
        xg = jnp.where(inside[:, None], x, 0.0)  # where, not multiply: NaN padding must not leak
        return acc + jnp.dot(xg, w[g], precision=lax.Precision.HIGHEST)

    return lax.fori_loop(0, w.shape[0], body, jnp.zeros((m, w.shape[2]), jnp.float32))
