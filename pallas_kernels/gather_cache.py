"""Gather one context chunk's latent rows from the paged cache into a contiguous workspace.

For chunked-context prefill (vLLM's `gather_and_maybe_dequant_cache`): sequence s's chunk is
context tokens [chunk_starts[s], chunk_starts[s] + len_s) with len_s = cu_chunk_lens[s+1] -
cu_chunk_lens[s]; it lands in workspace rows [cu_chunk_lens[s], cu_chunk_lens[s+1]). Rows past
cu_chunk_lens[S] are zero. fp8 caches are dequantised with a per-token scale f32[num_pages, G].

Both implementations share the row -> cache-slot map (an XLA fusion over W rows); they differ in
the data movement:
- "xla": a row gather `cache.reshape(-1, C)[slot]` plus select/scale; also the reference.
- "pallas": a Triton kernel, `block_rows` workspace rows per program, the row's C = L + R columns
  loaded as power-of-two pieces (576 = 512 + 64) with the slot vector as an integer-array index.

On the H200 "pallas" is the faster for bf16 and fp8 caches (bench/prefill.py; measured figures in
docs/perf-notes.md and bench/results/prefill-h200.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.util import CACHE_DTYPES, FLOAT_DTYPES, FP8, cdiv


def _validate(cache, block_table, chunk_starts, cu_chunk_lens, workspace_rows, kv_scale, out_dtype):
    if cache.ndim != 3:
        raise ValueError(f"kv_c_and_k_pe_cache must be [num_pages, G, L+R], got shape {cache.shape}")
    if jnp.dtype(cache.dtype) not in CACHE_DTYPES:
        raise ValueError(f"cache dtype must be bf16/f16/f32/float8_e4m3fn, got {cache.dtype}")
    if jnp.dtype(out_dtype) not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be bf16/f16/f32, got {out_dtype}")
    if block_table.ndim != 2 or block_table.dtype != jnp.int32:
        raise ValueError(f"block_table must be i32[S, max_pages], got {block_table.dtype}{block_table.shape}")
    n_seq = block_table.shape[0]
    if chunk_starts.shape != (n_seq,) or chunk_starts.dtype != jnp.int32:
        raise ValueError(f"chunk_starts must be i32[{n_seq}], got {chunk_starts.dtype}{chunk_starts.shape}")
    if cu_chunk_lens.shape != (n_seq + 1,) or cu_chunk_lens.dtype != jnp.int32:
        raise ValueError(f"cu_chunk_lens must be i32[{n_seq + 1}], got {cu_chunk_lens.dtype}{cu_chunk_lens.shape}")
    if not isinstance(workspace_rows, int) or workspace_rows < 1:
        raise ValueError(f"workspace_rows must be a positive int, got {workspace_rows!r}")
    is_fp8 = jnp.dtype(cache.dtype) == FP8
    if is_fp8 and kv_scale is None:
        raise ValueError("an fp8 cache needs kv_scale f32[num_pages, G]")
    if kv_scale is not None:
        if not is_fp8:
            raise ValueError(f"kv_scale is only for fp8 caches, cache dtype is {cache.dtype}")
        if kv_scale.shape != cache.shape[:2] or kv_scale.dtype != jnp.float32:
            raise ValueError(f"kv_scale must be f32{cache.shape[:2]}, got {kv_scale.dtype}{kv_scale.shape}")


def _row_slots(block_table, chunk_starts, cu_chunk_lens, page: int, w: int):
    """Flat cache slot (page * G + offset) of each workspace row; -1 for rows past the chunks."""
    n_seq = block_table.shape[0]
    rows = jnp.arange(w, dtype=jnp.int32)
    # one fusion; the default "scan" method is a while loop (a host round trip per step on GPU)
    seq = jnp.searchsorted(cu_chunk_lens[1:], rows, side="right", method="compare_all").astype(jnp.int32)
    valid = (rows >= cu_chunk_lens[0]) & (seq < n_seq)
    seq = jnp.minimum(seq, n_seq - 1)
    pos = chunk_starts[seq] + rows - cu_chunk_lens[seq]  # context token index within the sequence
    page_idx = jnp.clip(pos // page, 0, block_table.shape[1] - 1)
    slot = block_table[seq, page_idx] * page + pos % page
    return jnp.where(valid, slot, -1)


def _gather_kernel(slot_ref, cache_ref, *rest, n_slots: int, w: int, block: int, pieces, has_scale: bool):
    if has_scale:
        scale_ref, out_ref = rest
    else:
        (out_ref,) = rest
    r = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
    in_ws = r < w
    slot = pltriton.load(slot_ref, mask=in_ws, other=-1)
    ok = (slot >= 0) & (slot < n_slots)  # also keeps a bad block table from reading out of bounds
    safe = jnp.where(ok, slot, 0)
    # Unmasked gathers at clamped (always valid) slots; invalid rows are zeroed afterwards.
    if has_scale:
        scale = scale_ref[safe][:, None]
    for off, size in pieces:
        x = cache_ref[safe, pl.ds(off, size)]
        x = x.astype(jnp.float32) * scale if has_scale else x
        x = jnp.where(ok[:, None], x, 0).astype(out_ref.dtype)
        pltriton.store(out_ref.at[:, pl.ds(off, size)], x, mask=in_ws[:, None])


def _pow2_pieces(c: int):
    pieces, off = [], 0
    for bit in reversed(range(c.bit_length())):
        if c & (1 << bit):
            pieces.append((off, 1 << bit))
            off += 1 << bit
    return tuple(pieces)


@functools.partial(
    jax.jit, static_argnames=("workspace_rows", "out_dtype", "impl", "interpret", "block_rows", "num_warps")
)
def _gather_cache(
    cache,
    block_table,
    chunk_starts,
    cu_chunk_lens,
    kv_scale,
    *,
    workspace_rows,
    out_dtype,
    impl,
    interpret,
    block_rows,
    num_warps,
):
    n_pages, page, c = cache.shape
    slot = _row_slots(block_table, chunk_starts, cu_chunk_lens, page, workspace_rows)
    flat = cache.reshape(n_pages * page, c)
    if impl == "xla":
        ok = slot >= 0
        safe = jnp.where(ok, slot, 0)
        x = flat[safe]
        if kv_scale is not None:
            x = x.astype(jnp.float32) * kv_scale.reshape(-1)[safe][:, None]
        return jnp.where(ok[:, None], x, 0).astype(out_dtype)
    pieces = _pow2_pieces(c)
    if len(pieces) > 3:
        raise ValueError(f"pallas gather: row width {c} needs {len(pieces)} power-of-two pieces (max 3)")
    has_scale = kv_scale is not None
    args = [slot, flat] + ([kv_scale.reshape(-1)] if has_scale else [])
    in_specs = [
        pl.BlockSpec((block_rows,), lambda i: (i,)),
        pl.BlockSpec((n_pages * page, c), lambda i: (0, 0)),
    ]  # whole pool: pointer only
    if has_scale:
        in_specs.append(pl.BlockSpec((n_pages * page,), lambda i: (0,)))
    return pl.pallas_call(
        functools.partial(
            _gather_kernel,
            n_slots=n_pages * page,
            w=workspace_rows,
            block=block_rows,
            pieces=pieces,
            has_scale=has_scale,
        ),
        grid=(cdiv(workspace_rows, block_rows),),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((block_rows, c), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((workspace_rows, c), out_dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=f"gather_cache_r{block_rows}",
    )(*args)


def gather_cache(
    kv_c_and_k_pe_cache,
    block_table,
    chunk_starts,
    cu_chunk_lens,
    *,
    workspace_rows: int,
    kv_scale=None,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    interpret: bool = False,
    block_rows: int = 32,
    num_warps: int = 4,
):
    """Workspace [workspace_rows, L+R] out_dtype holding each sequence's chunk rows, zero past cu[S].

    chunk_starts[s] is the first context token of sequence s's chunk; rows of sequence s go to
    workspace rows [cu_chunk_lens[s], cu_chunk_lens[s+1]); fp8 caches come out as fp8 * kv_scale.
    impl "auto" is "pallas" on GPU (the faster on H200, bench/prefill.py) and "xla" elsewhere.
    """
    _validate(kv_c_and_k_pe_cache, block_table, chunk_starts, cu_chunk_lens, workspace_rows, kv_scale, out_dtype)
    if impl == "auto":
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
    if impl not in ("xla", "pallas"):
        raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
    if block_rows < 1 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows={block_rows} must be a power of two")
    return _gather_cache(
        kv_c_and_k_pe_cache,
        block_table,
        chunk_starts,
        cu_chunk_lens,
        kv_scale,
        workspace_rows=workspace_rows,
        out_dtype=jnp.dtype(out_dtype),
        impl=impl,
        interpret=interpret,
        block_rows=block_rows,
        num_warps=num_warps,
    )


def gather_cache_reference(
    kv_c_and_k_pe_cache,
    block_table,
    chunk_starts,
    cu_chunk_lens,
    *,
    workspace_rows: int,
    kv_scale=None,
    out_dtype=jnp.bfloat16,
    **_,
):
    """Float32 reference with independent indexing: un-page each sequence (block_table order), then
    copy its chunk slice into the workspace. Host loop over sequences; for tests only."""
    import numpy as np

    _validate(kv_c_and_k_pe_cache, block_table, chunk_starts, cu_chunk_lens, workspace_rows, kv_scale, out_dtype)
    cache = np.asarray(kv_c_and_k_pe_cache.astype(jnp.float32))
    if kv_scale is not None:
        cache = cache * np.asarray(kv_scale)[:, :, None]
    bt, starts, cu = (np.asarray(x) for x in (block_table, chunk_starts, cu_chunk_lens))
    out = np.zeros((workspace_rows, cache.shape[2]), np.float32)
    for s in range(bt.shape[0]):
        n = int(cu[s + 1] - cu[s])
        if n <= 0:
            continue
        seq_rows = cache[bt[s]].reshape(-1, cache.shape[2])  # the sequence's context, contiguous
        out[cu[s] : cu[s + 1]] = seq_rows[starts[s] : starts[s] + n]
    return jnp.asarray(out)
