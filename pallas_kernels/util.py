"""Helpers shared by the kernels: sizes, dtypes, the device, the CPU interpreter, softmax constants,
prefill row windows and the input checks that several kernels share.

Nothing here imports `mla_jax`; `mla_jax` uses `cdiv` from here.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

H200_SMS = 132

# ---------------------------------------------------------------------------------------------
# dtypes

BF16 = jnp.dtype(jnp.bfloat16)
F16 = jnp.dtype(jnp.float16)
F32 = jnp.dtype(jnp.float32)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FLOAT_DTYPES = (BF16, F16, F32)  # what the Triton-lowered kernels compute in
HALF_DTYPES = (BF16, F16)  # wgmma operands of the Hopper kernels
CACHE_DTYPES = FLOAT_DTYPES + (FP8,)  # paged KV caches (fp8 with a per-token scale)
# The one table of short dtype names: the tests, benchmarks and case tables here, and mla_jax (`--dtype bf16`,
# `cache_dtype="fp8"`, through mla_jax.dtypes).
DTYPE_NAMES = {"bf16": BF16, "f16": F16, "fp16": F16, "f32": F32, "fp32": F32, "fp8": FP8, "fp8_e4m3": FP8}

# ---------------------------------------------------------------------------------------------
# Softmax constants

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Finite start for a running max: masked logits are -inf, so exp2(-inf - m) = 0 and
# exp2(m_prev - m_next) never sees inf - inf, even for rows with no valid token.
M_INIT = -1e30
# Finite mask value for logits: -inf would give (-inf) - (-inf) = NaN in the running-max correction.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
BIG = 1 << 30  # "no window" sentinel for row bounds (fits int32 arithmetic without overflow)

# ---------------------------------------------------------------------------------------------
# Sizes


def round_e4m3(x):
    """float32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, as float32: the quantized
    value without a cast to e4m3 and back, which XLA folds into nothing (in the Pallas interpreter, and on the GPU
    within one jit: `fp8_matmul._f32`), and a cast of it to e4m3 is exact whatever rounding the backend's cast does.
    The add and subtract of 1.5 * 2^(e + 20), whose last place is e4m3's quantum 2^(e - 3) at x's binade e (at least
    -6: the subnormals' 2^-9), round in float32, ties to even."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    e = jnp.maximum((bits >> 23) & 0xFF, 121)  # x's biased exponent, at least 2^-6's
    magic = jax.lax.bitcast_convert_type(((e + 20) << 23) | 0x400000, jnp.float32)
    r = jax.lax.bitcast_convert_type((x + magic) - magic, jnp.int32) | (bits & jnp.int32(-(2**31)))  # -0 stays -0
    return jax.lax.bitcast_convert_type(r, jnp.float32)


FP8_BLOCK = 128  # DeepSeek-V3's weight_block_size: one float32 scale per 128 x 128 block of an e4m3 weight
FP8_AMAX_FLOOR = 1e-4  # DeepGEMM's clamp for an activation block: all zeros get a tiny scale, not 0 (0 / 0)


def check_fp8_weight(w, scale, w_name: str, scale_name: str):
    """A block-FP8 weight's contract: w float8_e4m3fn [..., N, K] with float32 scales [..., cdiv(N, 128),
    cdiv(K, 128)] (DeepSeek-V3's `weight_scale_inv`); a ValueError naming the argument otherwise."""
    if not hasattr(w, "dtype") or jnp.dtype(w.dtype) != FP8:
        raise ValueError(f"{w_name} must be float8_e4m3fn, got {getattr(w, 'dtype', type(w))}")
    want = (*w.shape[:-2], cdiv(w.shape[-2], FP8_BLOCK), cdiv(w.shape[-1], FP8_BLOCK))
    if not hasattr(scale, "shape") or tuple(scale.shape) != want or jnp.dtype(scale.dtype) != jnp.float32:
        raise ValueError(
            f"{scale_name} must be float32 {want} (one per {FP8_BLOCK}x{FP8_BLOCK} block of {w_name} {w.shape}), "
            f"got {getattr(scale, 'dtype', type(scale))} {getattr(scale, 'shape', None)}"
        )


def check_fp8_blocks(block_n, block_k, what: str, whole_blocks: bool = False):
    """A Triton kernel's tiles over block-FP8 weights: K steps of one scale block (`whole_blocks`: of a power of two of
    them), at most one scale row of columns a program."""
    if block_k is not None:
        ok = is_pow2(block_k) and block_k >= FP8_BLOCK if whole_blocks else block_k == FP8_BLOCK
        if not ok:
            per = f"a power of two of their {FP8_BLOCK}-wide" if whole_blocks else f"their {FP8_BLOCK}-wide"
            raise ValueError(f"block_k={block_k}: {what} step K by {per} scale blocks")
    if block_n is not None and block_n > FP8_BLOCK:
        raise ValueError(f"block_n={block_n}: at most {FP8_BLOCK} with {what} (one scale row a program)")


def quantize_act_tile(x):
    """Activation rows x [R, W] (one K block each: W <= 128; masked columns 0) quantized per row, the W8A8 format of
    `quantize_act`: (the e4m3 values as float32, scale f32[R]), scale = max(amax, floor) / 448."""
    x = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(x), axis=1), FP8_AMAX_FLOOR) / FP8_MAX
    return round_e4m3(x / scale[:, None]), scale


def quantize_act(x, block: int = FP8_BLOCK):
    """x [M, K] -> (e4m3 [M, K], float32 scale [M, cdiv(K, block)]): the W8A8 activation format (DeepGEMM's), per
    token per `block` channels, scale = amax / 448 so that x ~= x_fp8 * scale. A ragged last block is quantized over
    its own width. The reference of `fp8_quant.quantize_act` (one kernel where XLA runs three), which runs before
    every fp8 GEMM: quantizing in the Triton GEMMs' programs instead cost every program the whole x (part 30: the
    fp8-weight step at batch 1 6.79 ms with the Triton kernels quantizing their tiles, 3.26 through the Mosaic
    GEMMs)."""
    m, k = x.shape
    kb = cdiv(k, block)
    xf = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, kb * block - k))).reshape(m * kb, block)
    q, scale = quantize_act_tile(xf)  # per (row, K block); the values exact in e4m3
    return q.astype(FP8).reshape(m, kb * block)[:, :k], scale.reshape(m, kb)


def block_scales(xs_ref, rows, ws_ref, ws_lead: tuple, row_mask=None, k_block0=0):
    """A W8A8 tile's scales for every K block, f32[R, Kp] (Kp = next_pow2(Kb), blocks past Kb 0): its rows' x
    scales, `xs_ref` [M, Kb] at `rows` (a `pl.ds`, or row indices [R, 1] to gather; rows masked by `row_mask` [R, 1]
    read 0), times the weight blocks' scales `ws_ref[ws_lead]` [Kb] from block `k_block0` (the tile's row of scale
    blocks; a shared chunk's start further along a weight's K). Loaded once before a Triton kernel's K loop, which
    picks its block's column with `block_scale`, so that no load in the loop is one Triton does not prefetch (it
    pipelines the loads that feed a dot). Not measured against a scale load a step: part 34 replaced those with this
    and the time did not move, both behind the bf16 cast of the tiles that bound the kernel then; the select costs
    O(Kp) a block, O(K^2) a tile (docs/perf-notes.md session 22). Interpret mode: pad ws to k_block0 + Kp, xs to
    Kp."""
    kb = xs_ref.shape[-1]
    kp = next_pow2(kb)
    kcols = jnp.arange(kp, dtype=jnp.int32)
    k_in = (kcols < kb) if kp != kb else None
    ws = masked_load(ws_ref.at[(*ws_lead, pl.ds(k_block0, kp))], k_in)  # [Kp]
    k_mask = None if k_in is None else k_in[None, :]
    if isinstance(rows, pl.Slice):
        xs = masked_load(xs_ref.at[rows, pl.ds(0, kp)], mask_and(row_mask, k_mask))
    else:
        xs = masked_load(xs_ref.at[rows, kcols[None, :]], mask_and(row_mask, k_mask))
    return xs * ws[None, :]


def block_scale(scales, kk):
    """Column kk of `block_scales`' [R, Kp] as [R, 1] (a select and a sum: a Triton tensor has no dynamic index)."""
    kcols = jnp.arange(scales.shape[1], dtype=jnp.int32)
    return jnp.sum(jnp.where(kcols[None, :] == kk, scales, 0.0), axis=1, keepdims=True)


def fp8_row_scale(amax):
    """A row's scale in the fp8 latent cache's per-token format from its max |value| (f32): amax / 448, an all-zero
    row 1."""
    return jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)


def fp8_row_payload(x, scale):
    """A row's stored values (or a part of the row's) at its `fp8_row_scale`: x / scale clipped to +-448, rounded to
    the nearest e4m3, still float32 (its cast to e4m3 is exact)."""
    return round_e4m3(jnp.clip(x / scale, -FP8_MAX, FP8_MAX))


def quantize_rows(rows) -> tuple[jax.Array, jax.Array]:
    """Rows [..., W] -> (float8_e4m3fn [..., W], f32 scale [...]): the fp8 latent cache's per-token format
    (`fp8_row_scale`, `fp8_row_payload`)."""
    rows = rows.astype(jnp.float32)
    scale = fp8_row_scale(jnp.max(jnp.abs(rows), axis=-1))
    return fp8_row_payload(rows, scale[..., None]).astype(FP8), scale


def scatter_rows(cache, scale, rows, slot_mapping, layer=None):
    """rows [T, W] into a paged cache at flat slots: cache [P, G, W], or [NL, P, G, W] at `layer` (a negative or
    out-of-range layer writes nothing); slot_mapping int [T] of P * G slots, negative = padding (dropped, never
    wrapped). With `scale` (the cache's [(NL,) P, G] f32 scales) the rows are quantized per token (`quantize_rows`).
    Returns (cache, scale or None), one scatter each: in place under jit. The latent and index-key cache writes of
    `mla_jax.cache` and the cache write kernel's reference."""
    *lead, p, g, w = cache.shape
    slots = slot_mapping.astype(jnp.int32)
    idx = (jnp.where(slots < 0, jnp.int32(p * g), slots),)
    if layer is not None:
        layer = jnp.asarray(layer, jnp.int32)
        idx = (jnp.where(layer < 0, jnp.int32(lead[0]), layer),) + idx
    flat = cache.reshape(*lead, p * g, w)
    if scale is None:
        return flat.at[idx].set(rows.astype(cache.dtype), mode="drop").reshape(cache.shape), None
    q, s = quantize_rows(rows)
    scale = scale.reshape(*lead, p * g).at[idx].set(s, mode="drop").reshape(scale.shape)
    return flat.at[idx].set(q, mode="drop").reshape(cache.shape), scale


def is_pow2(x) -> bool:
    return isinstance(x, (int, np.integer)) and x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a, b):
    """ceil(a / b) for integers (Python ints or integer arrays), b > 0."""
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# Device and interpreter


def check_stacked_index(index, num_layers: int, name: str, what: str) -> None:
    """The layer index of weights stacked over a scan's layers: an integer scalar; a static one must lie in
    [0, num_layers) (`what`: the stack, for the message); a traced one is clamped by the kernel that reads it."""
    shape = getattr(index, "shape", ())
    dtype = getattr(index, "dtype", None)
    if (
        isinstance(index, bool)
        or shape != ()
        or not (isinstance(index, int) or (dtype is not None and jnp.issubdtype(dtype, jnp.integer)))
    ):
        raise ValueError(f"{name} must be an integer scalar, got {index!r}")
    try:
        value = int(index)  # static: a Python or numpy int, or a concrete array
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    if not 0 <= value < num_layers:
        raise ValueError(f"{name}={value} is out of range for {what}")


def num_sms() -> int:
    """SM count of the default device (132 on H200); 132 when unknown (CPU, interpret mode)."""
    try:
        n = getattr(jax.devices()[0], "core_count", None)
        return int(n) if n else H200_SMS
    except Exception:  # pragma: no cover - no backend at all
        return H200_SMS


def is_sm90(device=None) -> bool:
    """True on a Hopper GPU (compute capability 9.x), the only target of the Mosaic GPU kernels."""
    try:
        device = device or jax.devices()[0]
    except RuntimeError:  # pragma: no cover - no backend
        return False
    cc = str(getattr(device, "compute_capability", "") or "")
    return device.platform == "gpu" and cc.split(".")[0] == "9"


def cpu_workers() -> int:
    """XLA's CPU thread-pool size: $NPROC if set (read when the client is created), else the cores."""
    try:
        return int(os.environ.get("NPROC") or len(os.sched_getaffinity(0)))
    except (ValueError, AttributeError):
        return os.cpu_count() or 1


def check_interpreter_workers(interpret, warpgroups: int = 3) -> None:
    """The Mosaic GPU interpreter runs each of a kernel's warpgroups as a program that blocks in host
    callbacks at barriers: with fewer XLA CPU workers than warpgroups it would deadlock."""
    if interpret and cpu_workers() < warpgroups:
        raise ValueError(
            f"interpret=True needs >= {warpgroups} XLA CPU workers (the kernel's {warpgroups} warpgroups block "
            f"in host callbacks at barriers and would deadlock); this process has {cpu_workers()}: set the "
            f"environment variable NPROC=8 before JAX creates its CPU client"
        )


# ---------------------------------------------------------------------------------------------
# Prefill: input checks and per-row key windows (flash_prefill, flash_prefill_sm90)


def validate_prefill(q, k, v, q_start_loc, k_start_loc):
    """The varlen attention contract both prefill kernels (and their reference) share."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 3:
            raise ValueError(f"{name} must be [T, N, H], got shape {x.shape}")
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"head counts differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v token counts differ: k {k.shape}, v {v.shape}")
    for name, x in (("q_start_loc", q_start_loc), ("k_start_loc", k_start_loc)):
        if x.ndim != 1 or x.shape[0] < 2:
            raise ValueError(f"{name} must be i32[S+1] with S >= 1, got shape {x.shape}")
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")
    if q_start_loc.shape != k_start_loc.shape:
        raise ValueError(
            f"q_start_loc {q_start_loc.shape} and k_start_loc {k_start_loc.shape} "
            "must describe the same number of sequences"
        )
    if q.shape[0] == 0 or k.shape[0] == 0:
        raise ValueError(f"empty token axis: q {q.shape}, k {k.shape}")


def row_windows(q_start_loc, k_start_loc, tq: int, tk: int, causal: bool):
    """Per q row, the key rows [lo, hi) it attends to; empty rows get lo=BIG, hi=0.

    Sequence membership and bottom-right-aligned causality both live in this window, so one kernel
    serves the causal new-token pass and the non-causal context-chunk pass."""
    qs, ks = q_start_loc, k_start_loc
    n_seq = qs.shape[0] - 1
    rows = jnp.arange(tq, dtype=jnp.int32)
    # qs[s] <= row < qs[s+1]; compare_all is one fusion (the default "scan" is a while loop, which
    # costs a host round trip per step on GPU).
    seq = jnp.searchsorted(qs[1:], rows, side="right", method="compare_all").astype(jnp.int32)
    valid = (rows >= qs[0]) & (seq < n_seq)
    seq = jnp.minimum(seq, n_seq - 1)
    q0, q1, k0, k1 = qs[seq], qs[seq + 1], ks[seq], ks[seq + 1]
    k_len = k1 - k0
    if causal:
        n_vis = jnp.clip(k_len - (q1 - q0) + (rows - q0) + 1, 0, k_len)
    else:
        n_vis = k_len
    lo = jnp.clip(k0, 0, tk)
    hi = jnp.clip(k0 + n_vis, 0, tk)  # clipping keeps bad start locs from reading out of bounds
    ok = valid & (hi > lo)
    return jnp.where(ok, lo, BIG), jnp.where(ok, hi, 0)


# ---------------------------------------------------------------------------------------------
# Decode: input checks (mla_decode, mla_decode_sm90 and their reference)


def validate_decode(
    q,
    cache,
    block_table,
    seq_lens,
    kv_scale,
    kv_lora_rank,
    num_kv_splits,
    scale,
    block_h,
    block_kv,
    num_warps,
    num_stages,
    fp8_mode=None,
    *,
    for_kernel=True,
):
    """The paged decode contract. `for_kernel=False` (the reference, the Hopper kernel) accepts any
    L, R and page size; the Triton kernel needs powers of two >= 16."""
    if not hasattr(q, "ndim") or q.ndim != 4:
        raise ValueError(f"q must be [B, Q, N, L+R], got shape {getattr(q, 'shape', None)}")
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"q dtype must be bfloat16, float16 or float32, got {q.dtype}")
    b, nq, n, d = q.shape
    l = kv_lora_rank
    r = d - l
    if not (isinstance(l, (int, np.integer)) and 0 < l < d):
        raise ValueError(f"kv_lora_rank must be an int in (0, {d}), got {kv_lora_rank}")
    if for_kernel and not (is_pow2(int(l)) and l >= 16):
        raise ValueError(f"kv_lora_rank must be a power of two >= 16, got {kv_lora_rank}")
    if for_kernel and not (is_pow2(r) and r >= 16):
        raise ValueError(f"q last dim {d} minus kv_lora_rank {l} = rope dim {r} must be a power of two >= 16")
    if b < 1 or nq < 1 or n < 1:
        raise ValueError(f"q has an empty dimension: shape {q.shape}")
    if cache.ndim != 3:
        raise ValueError(f"kv_c_and_k_pe_cache must be [num_pages, G, L+R], got shape {cache.shape}")
    num_pages, g, dc = cache.shape
    if dc != d:
        raise ValueError(f"kv_c_and_k_pe_cache last dim {dc} != q last dim {d} (L+R)")
    if for_kernel and not is_pow2(g):
        raise ValueError(f"kv_c_and_k_pe_cache page size G={g} must be a power of two")
    if num_pages < 1:
        raise ValueError("kv_c_and_k_pe_cache has no pages")
    cdt = jnp.dtype(cache.dtype)
    if cdt not in CACHE_DTYPES:
        raise ValueError(f"kv_c_and_k_pe_cache dtype must be bf16/f16/f32/float8_e4m3fn, got {cdt}")
    if cdt == FP8:
        if kv_scale is None:
            raise ValueError("kv_scale is required when kv_c_and_k_pe_cache is float8_e4m3fn")
        if kv_scale.shape != (num_pages, g):
            raise ValueError(f"kv_scale must be [num_pages, G] = {(num_pages, g)}, got {kv_scale.shape}")
        if jnp.dtype(kv_scale.dtype) != jnp.float32:
            raise ValueError(f"kv_scale dtype must be float32, got {kv_scale.dtype}")
    elif kv_scale is not None:
        raise ValueError(f"kv_scale is only for a float8_e4m3fn cache; the cache is {cdt}")
    if block_table.ndim != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be i32[B={b}, max_pages], got shape {block_table.shape}")
    if jnp.dtype(block_table.dtype) != jnp.int32:
        raise ValueError(f"block_table dtype must be int32, got {block_table.dtype}")
    max_pages = block_table.shape[1]
    if max_pages < 1:
        raise ValueError("block_table must have at least one page column")
    if max_pages * g >= 2**31 or num_pages * g >= 2**31:  # token and row indices are int32
        raise ValueError(
            f"block_table width {max_pages} or num_pages {num_pages} x page size {g} exceeds int32 token indexing"
        )
    if seq_lens.shape != (b, nq):
        raise ValueError(f"seq_lens must be i32[B, Q] = {(b, nq)}, got shape {seq_lens.shape}")
    if jnp.dtype(seq_lens.dtype) != jnp.int32:
        raise ValueError(f"seq_lens dtype must be int32, got {seq_lens.dtype}")
    if num_kv_splits is not None and not (isinstance(num_kv_splits, (int, np.integer)) and num_kv_splits >= 1):
        raise ValueError(f"num_kv_splits must be a positive int or None, got {num_kv_splits}")
    if not isinstance(scale, (float, int, np.floating)):
        raise ValueError(f"scale must be a static Python float, got {type(scale).__name__}")
    if block_h is not None and not (is_pow2(block_h) and block_h >= 16):
        raise ValueError(f"block_h must be a power of two >= 16, got {block_h}")
    if block_kv is not None and not (is_pow2(block_kv) and block_kv >= 16):
        raise ValueError(f"block_kv must be a power of two >= 16, got {block_kv}")
    check_warps_stages(num_warps, num_stages)
    if fp8_mode not in (None, "scale_logits", "dequant_tile"):
        raise ValueError(f"fp8_mode must be 'scale_logits' or 'dequant_tile', got {fp8_mode!r}")


def check_warps_stages(num_warps, num_stages) -> None:
    """The Triton launch's num_warps (a power of two up to 16) and num_stages (pipelining depth), None = default."""
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be one of 1, 2, 4, 8, 16, got {num_warps}")
    if num_stages is not None and not (isinstance(num_stages, int) and num_stages >= 1):
        raise ValueError(f"num_stages must be a positive int, got {num_stages}")


def mask_and(a, b):
    """a & b of two optional masks (None: everything in bounds)."""
    if a is None:
        return b
    return a if b is None else a & b


def masked_load(ref, mask, dtype=None):
    """A Triton-lowered load of a ref view, masked (0 where False) unless mask is None, cast to `dtype` if given. An
    fp8 ref's masked lanes are zeroed after the cast (Triton cannot fill them with an fp8 constant)."""
    if mask is None:
        v = ref[...]
        return v if dtype is None else v.astype(dtype)
    if jnp.dtype(ref.dtype) == FP8:
        return jnp.where(mask, pltriton.load(ref, mask=mask).astype(dtype or jnp.float32), 0)
    v = pltriton.load(ref, mask=mask, other=0)
    return v if dtype is None else v.astype(dtype)


def load_e4m3(ref, mask=None, k_in=None):
    """A Triton-lowered load of an e4m3 tile kept e4m3, for a dot of fp8 operands: lanes masked by `mask` (rows or
    columns whose products the caller discards) are left undefined, lanes past K (`k_in` [W], over the tile's last
    axis) are zero (Triton cannot fill a load with an fp8 constant: a select of a converted zero)."""
    k_mask = None if k_in is None else k_in[None, :]
    full = mask_and(mask, k_mask)
    v = ref[...] if full is None else pltriton.load(ref, mask=full)
    if k_mask is not None:
        v = jnp.where(k_mask, v, jnp.zeros(v.shape, jnp.float32).astype(v.dtype))
    return v


def masked_store(ref, val, mask):
    """A Triton-lowered store into a ref view, masked unless mask is None."""
    if mask is None:
        ref[...] = val
    else:
        pltriton.store(ref, val, mask=mask)


def pad_to(a, axis: int, size: int):
    """a zero-padded at the end of `axis` to at least `size` (interpret mode only: it cannot slice a block larger
    than the array, where the GPU masks)."""
    if a.shape[axis] >= size:
        return a
    pad = [(0, 0)] * a.ndim
    pad[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, pad)
