"""Attention backends, following vLLM's split of the MLA layer:

- `forward_mqa(q [Bd, Q, N, L+R] absorbed, cache, decode metadata) -> (latent out [Bd, Q, N, L], lse [Bd, Q, N])`
  reads the paged latent cache (the decode hot loop);
- `forward_mha(...) -> [Tp, N, V]` for prefill: causal MHA over the new tokens (k/v up-projected from their
  own latents), plus the context already in the cache, gathered chunk by chunk into a workspace of W rows,
  up-projected there and attended non-causally; all parts merged through their LSEs.

A backend is a set of array functions picked by name: "xla" (plain-JAX references, runs anywhere),
"pallas" (the Triton-lowered Pallas kernels, portable; interpret mode on CPU) or "pallas_sm90" ("pallas" with
decode and prefill through the Hopper Mosaic GPU kernels where they apply and are faster; the default on Hopper);
"pallas_sm90_fp8qk" is "pallas_sm90" with an fp8 cache decoded by an fp8 QK^T on a per-row fp8 q (faster, lossy,
opt-in). Caches arrive flattened over layers,
[num_layers * num_pages, G, L+R], with block tables already offset to the layer, so no layer slice is copied.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mla_jax.config import DeepseekConfig
from mla_jax.metadata import DecodeMetadata, PrefillMetadata
from mla_jax.mla import up_project_kv
from pallas_kernels import flash_prefill as fp
from pallas_kernels import flash_prefill_sm90 as fp90
from pallas_kernels import gather_cache as gc
from pallas_kernels import merge_attn_states as ms
from pallas_kernels import mla_decode as md
from pallas_kernels import mla_decode_sm90 as md90

# The Hopper kernels are the default on compute capability 9.x: both passed their GPU checks on an H200
# (2026-11-29: bench/decode.py's 9 sm90 cases; 8 of the 12 GPU tests of the prefill kernel, none failed).
SM90_VERIFIED = True
# Where the sm90 decode kernel is used: its CTA tile holds 64 query rows (heads x query tokens). With fewer rows
# (e.g. 16 heads, one token) the tile is mostly padding and the Triton kernel was ~10% faster on the H200
# (bench/results/decode-h200.json: N=16 bf16 121 vs 130 us, 353 vs 394 us); with 128 heads sm90 is ~2x faster.
SM90_DECODE_MIN_ROWS = md90.TILE_M


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    mla_decode: Callable[..., Any]  # pallas_kernels.mla_decode signature
    flash_prefill: Callable[..., Any]  # pallas_kernels.flash_prefill signature
    gather_cache: Callable[..., Any]  # pallas_kernels.gather_cache signature
    merge_attn_states: Callable[..., Any]  # pallas_kernels.merge_attn_states signature


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


@functools.cache
def get_backend(name: str, *, batch_invariant: bool = False) -> Backend:
    """"xla" or "pallas" (Pallas kernels run in interpret mode when the default device is a CPU)."""
    if name == "xla":
        return Backend("xla", md.mla_decode_reference, fp.flash_prefill_reference,
                       functools.partial(gc.gather_cache, impl="xla"),
                       functools.partial(ms.merge_attn_states, impl="xla"))
    if name in ("pallas", "pallas_sm90", "pallas_sm90_fp8qk"):
        interp = _on_cpu()
        decode = functools.partial(md.mla_decode, interpret=interp, batch_invariant=batch_invariant)
        prefill = functools.partial(fp.flash_prefill, interpret=interp)
        if name.startswith("pallas_sm90"):
            decode = functools.partial(_sm90_decode, decode, interpret=interp, batch_invariant=batch_invariant,
                                       fp8_qk=name == "pallas_sm90_fp8qk")
            prefill = functools.partial(_sm90_prefill, prefill, interpret=interp)
        return Backend(
            name,
            decode,
            prefill,
            # "auto": the Pallas gather and merge on GPU (H200: gather 2.6 vs 2.0 TB/s, merge 4.1 vs 3.9 TB/s,
            # bench/results/prefill-h200.json), XLA elsewhere.
            functools.partial(gc.gather_cache, impl="auto"),
            functools.partial(ms.merge_attn_states, impl="auto"))
    raise ValueError(f"unknown attention backend {name!r}: choose 'xla', 'pallas', 'pallas_sm90' or "
                     "'pallas_sm90_fp8qk'")


def _sm90_decode(fallback, q, cache, *args, interpret, batch_invariant, fp8_qk=False, **kw):
    """The Hopper kernel where it applies (static shapes/dtypes) and fills its tile, else the portable one.
    fp8_qk ("pallas_sm90_fp8qk", fp8 caches only): QK^T as an fp8 wgmma on a per-row fp8 q, 1.35-2.1x the exact
    dequantizing path on the H200 but lossy (docs/perf-notes.md); opt-in."""
    rows = q.shape[1] * q.shape[2]  # [B, Q, N, L+R]: query tokens x heads share a tile
    if rows < SM90_DECODE_MIN_ROWS or md90.unsupported_reason(q, cache, kw.get("kv_lora_rank", 512)) is not None:
        return fallback(q, cache, *args, **kw)
    if fp8_qk and jnp.dtype(cache.dtype) == jnp.float8_e4m3fn:
        kw = dict(kw, fp8_qk=True)
    return md90.mla_decode_sm90(q, cache, *args, interpret=interpret, batch_invariant=batch_invariant, **kw)


def _sm90_prefill(fallback, q, k, v, *args, interpret, **kw):
    """The Hopper flash attention (faster than the Triton one on every measured shape, 1.05-1.6x) where it
    applies (bf16/f16, head dims multiples of 64), else the portable one."""
    if fp90.unsupported_reason(q, k, v) is not None:
        return fallback(q, k, v, *args, **kw)
    return fp90.flash_prefill_sm90(q, k, v, *args, interpret=interpret, **kw)


def default_backend_name() -> str:
    if _on_cpu():
        return "xla"
    return "pallas_sm90" if SM90_VERIFIED and md90.is_sm90() else "pallas"


def forward_mqa(backend: Backend, q: jax.Array, kv_cache: jax.Array, kv_scale: jax.Array | None,
                decode: DecodeMetadata, block_offset: jax.Array, *, scale: float, kv_lora_rank: int
                ) -> tuple[jax.Array, jax.Array]:
    """q [Bd, Q, N, L+R] -> (latent [Bd, Q, N, L], lse f32[Bd, Q, N])."""
    return backend.mla_decode(q, kv_cache, decode.block_table + block_offset, decode.seq_lens, scale=scale,
                              kv_scale=kv_scale, kv_lora_rank=kv_lora_rank)


def forward_mha(backend: Backend, p: dict, cfg: DeepseekConfig, q: jax.Array, kv_c_normed: jax.Array,
                k_pe: jax.Array, kv_cache: jax.Array, kv_scale: jax.Array | None, prefill: PrefillMetadata,
                block_offset: jax.Array, *, workspace_rows: int, max_chunks: int) -> jax.Array:
    """Prefill attention: q [Tp, N, P+R], kv_c_normed [Tp, L], k_pe [Tp, 1, R] of the new tokens -> [Tp, N, V]."""
    scale = cfg.softmax_scale
    L = cfg.kv_lora_rank
    qsl = prefill.query_start_loc
    k, v = up_project_kv(p, cfg, kv_c_normed, k_pe)  # [Tp, N, P+R], [Tp, N, V]
    out, lse = backend.flash_prefill(q, k.astype(q.dtype), v.astype(q.dtype), qsl, qsl, causal=True,
                                     scale=scale)
    if max_chunks == 0:
        return out
    block_table = prefill.block_table + block_offset

    def chunk(c, carry):
        acc, acc_lse = carry
        ws = backend.gather_cache(kv_cache, block_table, prefill.chunk_starts[c], prefill.cu_chunk_lens[c],
                                  workspace_rows=workspace_rows, kv_scale=kv_scale, out_dtype=q.dtype)  # [W, L+R]
        kc, vc = up_project_kv(p, cfg, ws[:, :L], ws[:, None, L:])  # [W, N, P+R], [W, N, V]
        o, l = backend.flash_prefill(q, kc.astype(q.dtype), vc.astype(q.dtype), qsl, prefill.cu_chunk_lens[c],
                                     causal=False, scale=scale)
        return backend.merge_attn_states(acc, acc_lse, o.astype(jnp.float32), l)

    # Rows without context keep output 0 and LSE -inf, so they weigh nothing in the final merge.
    init = (jnp.zeros(out.shape, jnp.float32), jnp.full(lse.shape, -jnp.inf, jnp.float32))
    ctx_out, ctx_lse = jax.lax.fori_loop(0, jnp.minimum(prefill.num_chunks, max_chunks), chunk, init)
    merged, _ = backend.merge_attn_states(ctx_out, ctx_lse, out.astype(jnp.float32), lse)
    return merged.astype(out.dtype)
