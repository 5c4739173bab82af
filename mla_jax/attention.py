"""Attention backends, following vLLM's split of the MLA layer:

- `forward_mqa(q [Bd, Q, N, L+R] absorbed, cache, decode metadata) -> (latent out [Bd, Q, N, L], lse [Bd, Q, N])`
  reads the paged latent cache (the decode hot loop);
- `forward_mha(...) -> [Tp, N, V]` for prefill: causal MHA over the new tokens (k/v up-projected from their
  own latents), plus the context already in the cache, gathered chunk by chunk into a workspace of W rows,
  up-projected there and attended non-causally; all parts merged through their LSEs.

A backend (`BACKENDS`, by name) is an ordered list of decode kernels and one of prefill kernels, each with a
`supports` predicate that says why it declines a call (or None); a call goes to the first kernel that
accepts it, so the fallback order is the order in the table; every list ends with the plain-JAX reference,
which takes any shape.
Pallas kernels run in interpret mode when the default device is a CPU. Caches arrive flattened over layers,
[num_layers * num_pages, G, L+R], so no layer slice is copied; block tables number pages within one layer, offset
by the layer's first page (`KVCache.flat_layers`): the decode kernels take it as `page_offset` (the Triton kernel
adds it in-kernel, so a layer's decode runs no XLA op on its block table), prefill adds it to its block table.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mla_jax.comm import LOCAL, Comm
from mla_jax.config import DeepseekConfig
from mla_jax.metadata import DecodeMetadata, PrefillMetadata
from mla_jax.mla import up_project_kv
from pallas_kernels import flash_prefill as fp
from pallas_kernels import flash_prefill_sm90 as fp90
from pallas_kernels import gather_cache as gc
from pallas_kernels import lightning_indexer as li
from pallas_kernels import merge_attn_states as ms
from pallas_kernels import mla_decode as md
from pallas_kernels import mla_decode_sm90 as md90
from pallas_kernels import sparse_mla_decode as smd
from pallas_kernels import sparse_mla_decode_sm90 as smd90


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _always(*_, **__) -> str | None:
    return None


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One implementation of an attention op: `fn` has the signature of the op's `pallas_kernels` function;
    `supports(same arguments)` returns None when `fn` takes the call, else the reason it declines; `plan`, where
    given, builds the part of `fn`'s work that a step's layers share."""

    name: str
    fn: Callable[..., Any]
    supports: Callable[..., str | None] = _always
    # (same arguments) -> what `fn` takes as `plan=` that depends only on the step's metadata (a decode's work
    # list), built once a step for every layer; None from it (or no `plan`): nothing to share
    plan: Callable[..., Any] | None = None


# ---- decode: (q [B, Q, N, L+R], cache [pages, G, L+R], block_table, seq_lens, *, scale, kv_scale, kv_lora_rank,
#      batch_invariant, page_offset) -> (out [B, Q, N, L], lse f32[B, Q, N]); request b's i-th page is pool page
#      block_table[b, i] + page_offset (an int32 scalar, may be traced; None = 0)


def _decode_triton(q, cache, block_table, seq_lens, **kw):
    return md.mla_decode(q, cache, block_table, seq_lens, interpret=_interpret(), **kw)


def _fp8_pv(q, cache, kw) -> bool:
    """An fp8 cache's 64-row tiles run the fp8 P.V kernel (`fp8_qk=True` there: q and P rounded to e4m3 as FlashMLA's
    fp8 kernel rounds them, 1.6% against float32 on that q; 0.33x the exact path's time at 64x128x4096, H100, session
    41); the narrow kernel's stay exact."""
    return md90.uses_fp8_pv(q.shape[1] * q.shape[2], cache.dtype, kw.get("kv_lora_rank", 512))


def _decode_sm90(q, cache, block_table, seq_lens, **kw):
    fp8_qk = _fp8_pv(q, cache, kw)
    return md90.mla_decode_sm90(q, cache, block_table, seq_lens, interpret=_interpret(), fp8_qk=fp8_qk, **kw)


def _decode_sm90_fp8qk(q, cache, block_table, seq_lens, **kw):
    return md90.mla_decode_sm90(
        q, cache, block_table, seq_lens, interpret=_interpret(), fp8_qk=True, fp8_q_split=False, **kw
    )


def _plan_sm90(q, cache, block_table, seq_lens, **kw):
    fp8_qk = _fp8_pv(q, cache, kw)
    return md90.decode_plan(q, cache, block_table, seq_lens, interpret=_interpret(), fp8_qk=fp8_qk, **kw)


def _plan_sm90_fp8qk(q, cache, block_table, seq_lens, **kw):
    return md90.decode_plan(q, cache, block_table, seq_lens, interpret=_interpret(), fp8_qk=True, **kw)


# Fewest query rows (query tokens x heads, which share the 64-row Hopper kernel's wgmma tile) it takes on an fp8 cache;
# fewer go to the Triton kernel, over a page pool of less than 4 GB. Measured on the H200 (decode-h200.json):
# at 16 rows (16 heads, one token) Triton is faster there (1.04-1.19x); at 48 (16 heads x 3 speculative tokens) the
# Hopper kernel is, 1.03-1.58x (B 8/32, ctx 1k/4k). Up to 32 rows of a bf16 cache (16 of an fp8 one) go to the narrow
# Hopper kernel (tokens on the wgmma M axis, `mla_decode_sm90_narrow`), faster than Triton at every pool size from batch
# 2: 80.6 vs 102.8 us at (64, 16, 4096), 277 vs 325 us at (128, 16, 8192) (bf16, device time, 2026-12-02).
SM90_MIN_ROWS = 48
# From 2^32 bytes of pool on, the Triton lowering indexes the pool with 64-bit offsets, computed per element of each
# tile: at (128, 16, 4096) its kernel took 304 us over a 4.6 or 16 GB pool against 182 us over 4.0 GB, where the
# Hopper kernel (TMA) took 194 us at every size. So over such a pool (any server's) the Hopper kernel takes all rows
# but one request's: at batch 1 (latency-bound) the offsets cost nothing measurable, Triton 9.5 / 8.8 us against the
# Hopper kernel's 13.5 / 13.1 (device time, 16 heads, ctx 4k / 1k, 16 GB pool). One request's rows go to the narrow
# kernel where it takes them: an fp8 cache's since part 28 (9.5 / 11.1 us at ctx 1k / 4k against Triton's 13.0 /
# 13.7, H200), a bf16 cache's since its bf16 split partials and unmasked merge loads (session 31, H100, one call:
# 6.16 / 6.68 / 13.11 us at 16 heads, ctx 1k / 4k / 16k, against Triton's 7.28 / 8.20 / 16.34; 32 rows 8.55 against
# 10.99; the batch-1 step 2.66 / 2.69 ms against 2.90 / 2.89 at ctx 1k / 4k). Rows past the narrow kernel's stay on
# Triton at batch 1 (the 64-row tile is mostly padding there).
TRITON_64BIT_POOL_BYTES = 2**32


def _sm90_declines(q, cache, block_table, seq_lens, *, kv_lora_rank=512, fp8_qk=False, **_) -> str | None:
    rows = q.shape[1] * q.shape[2]
    if rows < SM90_MIN_ROWS:
        narrow = md90.uses_narrow(rows, cache.dtype, fp8_qk=fp8_qk)
        if q.shape[0] == 1 and not narrow:
            return f"{rows} rows of one request, {cache.dtype} cache (< {SM90_MIN_ROWS}: Triton is faster at batch 1)"
        if not narrow and cache.size * jnp.dtype(cache.dtype).itemsize <= TRITON_64BIT_POOL_BYTES:
            return (
                f"{q.shape[2]} heads x {q.shape[1]} query tokens = {rows} rows of a {cache.dtype} cache over a pool "
                f"below 4 GB (< {SM90_MIN_ROWS}: Triton is faster)"
            )
    return md90.unsupported_reason(q, cache, kv_lora_rank)


def _sm90_fp8qk_declines(q, cache, *args, kv_lora_rank=512, **kw) -> str | None:
    if jnp.dtype(cache.dtype) != jnp.float8_e4m3fn:
        return f"the cache is {cache.dtype}, not float8_e4m3fn"
    reason = md90.fp8_qk_reason(q.shape[1] * q.shape[2], kv_lora_rank)
    if reason:
        return reason
    return _sm90_declines(q, cache, *args, kv_lora_rank=kv_lora_rank, fp8_qk=True, **kw)


def _pow2_at_least_16(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def _triton_decode_declines(q, cache, block_table, seq_lens, *, kv_lora_rank=512, **_) -> str | None:
    rope = q.shape[-1] - kv_lora_rank
    if not (_pow2_at_least_16(kv_lora_rank) and _pow2_at_least_16(rope)):
        return f"latent {kv_lora_rank} and rope {rope} dims must be powers of two >= 16"
    if cache.shape[1] & (cache.shape[1] - 1):
        return f"page size {cache.shape[1]} is not a power of two"
    return None


DECODE_XLA = Kernel("xla", md.mla_decode_reference)
DECODE_TRITON = Kernel("triton", _decode_triton, _triton_decode_declines)
DECODE_SM90 = Kernel("sm90", _decode_sm90, _sm90_declines, _plan_sm90)
# fp8_qk everywhere (opt-in, lossy): in the narrow kernel too (one e4m3 term of q: faster than its exact split), as
# the default does in 64-row tiles
DECODE_SM90_FP8QK = Kernel("sm90_fp8qk", _decode_sm90_fp8qk, _sm90_fp8qk_declines, _plan_sm90_fp8qk)

# ---- prefill: (q [Tq, N, P+R], k [Tk, N, P+R], v [Tk, N, V], q_start_loc, k_start_loc, *, causal, scale)
#      -> (out [Tq, N, V], lse f32[Tq, N])


def _prefill_triton(q, k, v, q_start_loc, k_start_loc, **kw):
    return fp.flash_prefill(q, k, v, q_start_loc, k_start_loc, interpret=_interpret(), **kw)


def _prefill_sm90(q, k, v, q_start_loc, k_start_loc, **kw):
    return fp90.flash_prefill_sm90(q, k, v, q_start_loc, k_start_loc, interpret=_interpret(), **kw)


def _prefill_sm90_declines(q, k, v, *_, **__) -> str | None:
    return fp90.unsupported_reason(q, k, v)


def _triton_prefill_declines(q, k, v, *_, **__) -> str | None:
    dq, dv = q.shape[-1], v.shape[-1]
    low = dq & -dq  # the q/k head dim is split into at most two power-of-two pieces, each >= 16
    if bin(dq).count("1") > 2 or low < 16 or not _pow2_at_least_16(dv):
        return f"q/k head dim {dq} must be 2^a or 2^a + 2^b (pieces >= 16) and v head dim {dv} a power of two >= 16"
    return None


PREFILL_XLA = Kernel("xla", fp.flash_prefill_reference)
PREFILL_TRITON = Kernel("triton", _prefill_triton, _triton_prefill_declines)
PREFILL_SM90 = Kernel("sm90", _prefill_sm90, _prefill_sm90_declines)


# ---- context gather and LSE merge: "auto" is the Pallas kernel on GPU (faster on the H200, see
#      bench/results/prefill-h200.json), XLA elsewhere.


def _gather_xla(*args, **kw):
    return gc.gather_cache(*args, impl="xla", **kw)


def _gather_auto(kv_cache, *args, **kw):
    # the Pallas gather copies a row as at most three power-of-two pieces
    impl = "auto" if bin(kv_cache.shape[-1]).count("1") <= 3 else "xla"
    return gc.gather_cache(kv_cache, *args, impl=impl, **kw)


def _merge_xla(*args):
    return ms.merge_attn_states(*args, impl="xla")


def _merge_auto(prefix_output, *args):
    v = prefix_output.shape[-1]  # the Pallas merge needs a power-of-two V head dim
    return ms.merge_attn_states(prefix_output, *args, impl="auto" if v & (v - 1) == 0 else "xla")


# ---- sparse attention (DeepSeek-V3.2): (q [B, Q, N, L+R], cache [pages, G, L+R], topk_slots i32[B, Q, K], *,
#      scale, kv_scale, kv_lora_rank) -> (out [B, Q, N, L], lse f32[B, Q, N]); rows read only their K named slots.


def _sparse_decode_triton(q, cache, topk_slots, **kw):
    return smd.sparse_mla_decode(q, cache, topk_slots, interpret=_interpret(), **kw)


def _sparse_triton_declines(q, cache, topk_slots, *, kv_lora_rank=512, **_) -> str | None:
    rope = q.shape[-1] - kv_lora_rank
    if not (_pow2_at_least_16(kv_lora_rank) and _pow2_at_least_16(rope)):
        return f"latent {kv_lora_rank} and rope {rope} dims must be powers of two >= 16"
    return None


def _sparse_decode_sm90(q, cache, topk_slots, **kw):
    return smd90.sparse_mla_decode_sm90(q, cache, topk_slots, interpret=_interpret(), **kw)


def _sparse_sm90_declines(q, cache, topk_slots, *, kv_lora_rank=512, **_) -> str | None:
    return smd90.unsupported_reason(q, cache, kv_lora_rank)


SPARSE_DECODE_XLA = Kernel("xla", smd.sparse_mla_decode_reference)
SPARSE_DECODE_TRITON = Kernel("triton", _sparse_decode_triton, _sparse_triton_declines)
SPARSE_DECODE_SM90 = Kernel("sm90", _sparse_decode_sm90, _sparse_sm90_declines)
# The Hopper backends' sparse decode list. SPARSE_DECODE_SM90 passes its `gpu` tests but the Triton kernel is faster
# on the H200 at every shape bench/sparse.py times (e.g. 133 vs 183 us at 128 heads, 32k, bf16; sparse-h200.json), so
# it is not in the list; it is reachable directly (`pallas_kernels.sparse_mla_decode_sm90`).
HOPPER_SPARSE_DECODE = (SPARSE_DECODE_TRITON, SPARSE_DECODE_XLA)

# ---- the lightning indexer's top-k: (q [T, H_I, D_I], weights f32[T, H_I], index_k_cache [pages, G, D_I],
#      block_table i32[T, max_pages], seq_lens i32[T], *, scale, k, k_scale) -> topk_indices i32[T, min(k, S)]
#      (the Pallas score kernel with its bin histogram, then the radix-select kernel: exact, ties to the lower
#      position, in ascending position order; the reference: lax.top_k on the plain-JAX scores)


def _indexer_triton(*args, **kw):
    return li.indexer_topk(*args, interpret=_interpret(), **kw)


def _indexer_triton_declines(q, weights, index_k_cache, *_, **__) -> str | None:
    d, g = q.shape[-1], index_k_cache.shape[1]
    if not _pow2_at_least_16(d) or g & (g - 1):
        return f"index head dim {d} must be a power of two >= 16 and page size {g} a power of two"
    return None


INDEXER_XLA = Kernel("xla", li.indexer_topk_reference)
INDEXER_TRITON = Kernel("triton", _indexer_triton, _indexer_triton_declines)

# Prefill rows of sparse layers: sequences up to this many tokens take the masked dense MHA path, longer ones the
# token-sparse MQA path, keyed by query heads per device (`sparse_prefill_mha_max_len`; other head counts take the
# nearest measured one). Measured on the H200 by `bench/sparse.py --only threshold` (bench/results/sparse-h200.json,
# `prefill_threshold` rows: one sparse layer, prompts of 1k-8k tokens, top-k 2048): MQA was faster at every length,
# 2.0-3.7x at N = 128 and 1.4-2.9x at N = 16 (the masked MHA up-projects every key and masks full f32 logits), so 0.
SPARSE_PREFILL_MHA_MAX_LEN: dict[int, int] = {128: 0, 16: 0}


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """A decode kernel's per-step work (`Kernel.plan`), built once before the layer loop: the kernel's name and
    what it takes as `plan=`."""

    kernel: str
    arrays: Any


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    decode: tuple[Kernel, ...]  # tried in order; the last (xla) takes every call
    prefill: tuple[Kernel, ...]
    gather_cache: Callable[..., jax.Array]  # pallas_kernels.gather_cache signature
    merge_attn_states: Callable[..., tuple[jax.Array, jax.Array]]  # pallas_kernels.merge_attn_states signature
    sparse_decode: tuple[Kernel, ...] = (SPARSE_DECODE_XLA,)
    indexer: tuple[Kernel, ...] = (INDEXER_XLA,)
    # None: SPARSE_PREFILL_MHA_MAX_LEN / index_topk; a number forces it (tests pick a path with 0 or a large one)
    sparse_prefill_mha_max_len: int | None = None

    def mla_decode(self, *args, plan: DecodePlan | None = None, **kw) -> tuple[jax.Array, jax.Array]:
        """The first decode kernel that takes the call; `plan`: the step's `plan_decode` for these arguments."""
        kernel = pick(self.decode, *args, **kw)
        if plan is not None:
            if plan.kernel != kernel.name:
                raise ValueError(f"plan: built for the {plan.kernel} decode kernel, the call runs {kernel.name}")
            kw = dict(kw, plan=plan.arrays)
        return kernel.fn(*args, **kw)

    def plan_decode(self, *args, **kw) -> DecodePlan | None:
        """What the decode kernel `mla_decode(*args, **kw)` picks shares across a step's layers (the arguments'
        block_table and seq_lens), built once; None where it shares nothing. q and the cache may be
        ShapeDtypeStructs."""
        kernel = pick(self.decode, *args, **kw)
        arrays = None if kernel.plan is None else kernel.plan(*args, **kw)
        return None if arrays is None else DecodePlan(kernel.name, arrays)

    def sparse_mla_decode(self, *args, **kw) -> tuple[jax.Array, jax.Array]:
        return pick(self.sparse_decode, *args, **kw).fn(*args, **kw)

    def indexer_topk(self, *args, **kw) -> jax.Array:
        return pick(self.indexer, *args, **kw).fn(*args, **kw)

    def flash_prefill(self, *args, **kw) -> tuple[jax.Array, jax.Array]:
        return pick(self.prefill, *args, **kw).fn(*args, **kw)


def pick(kernels: tuple[Kernel, ...], *args, **kw) -> Kernel:
    """The first kernel that supports the call (shapes and dtypes are static: decided at trace time). Landing on
    the plain-JAX reference after a Pallas kernel declined warns once, naming the kernel and its reason."""
    declined = []
    for k in kernels:
        reason = k.supports(*args, **kw)
        if reason is None:
            if k.name == "xla" and declined:
                warnings.warn(
                    f"attention: the {declined[-1][0]} kernel declines ({declined[-1][1]}); using the "
                    "plain-JAX (xla) one",
                    stacklevel=3,
                )
            return k
        declined.append((k.name, reason))
    raise ValueError("no kernel supports this call: " + "; ".join(f"{n}: {r}" for n, r in declined))


BACKENDS: dict[str, Backend] = {
    # plain-JAX references: runs anywhere, the default on CPU
    "xla": Backend("xla", (DECODE_XLA,), (PREFILL_XLA,), _gather_xla, _merge_xla),
    # the portable Triton-lowered kernels: the default on GPUs other than Hopper
    "pallas": Backend(
        "pallas",
        (DECODE_TRITON, DECODE_XLA),
        (PREFILL_TRITON, PREFILL_XLA),
        _gather_auto,
        _merge_auto,
        sparse_decode=(SPARSE_DECODE_TRITON, SPARSE_DECODE_XLA),
        indexer=(INDEXER_TRITON, INDEXER_XLA),
    ),
    # the Hopper (Mosaic GPU) kernels where they apply, else the Triton ones: the default on Hopper
    "pallas_sm90": Backend(
        "pallas_sm90",
        (DECODE_SM90, DECODE_TRITON, DECODE_XLA),
        (PREFILL_SM90, PREFILL_TRITON, PREFILL_XLA),
        _gather_auto,
        _merge_auto,
        sparse_decode=HOPPER_SPARSE_DECODE,
        indexer=(INDEXER_TRITON, INDEXER_XLA),
    ),
    # "pallas_sm90" with an fp8 cache's q as one e4m3 term in both decode kernels (opt-in: faster, lossier)
    "pallas_sm90_fp8qk": Backend(
        "pallas_sm90_fp8qk",
        (DECODE_SM90_FP8QK, DECODE_SM90, DECODE_TRITON, DECODE_XLA),
        (PREFILL_SM90, PREFILL_TRITON, PREFILL_XLA),
        _gather_auto,
        _merge_auto,
        sparse_decode=HOPPER_SPARSE_DECODE,
        indexer=(INDEXER_TRITON, INDEXER_XLA),
    ),
}


def sparse_prefill_mha_max_len(backend: Backend, num_heads: int) -> int:
    """Longest prefill sequence (tokens) that takes the masked dense MHA path on a sparse layer."""
    if backend.sparse_prefill_mha_max_len is not None:
        return backend.sparse_prefill_mha_max_len
    nearest = min(SPARSE_PREFILL_MHA_MAX_LEN, key=lambda n: (abs(n - num_heads), n))
    return SPARSE_PREFILL_MHA_MAX_LEN[nearest]


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose one of {', '.join(map(repr, BACKENDS))}")
    return BACKENDS[name]


def default_backend_name() -> str:
    if _interpret():
        return "xla"
    return "pallas_sm90" if md90.is_sm90() else "pallas"


def forward_mqa(
    backend: Backend,
    q: jax.Array,
    kv_cache: jax.Array,
    kv_scale: jax.Array | None,
    decode: DecodeMetadata,
    block_offset: jax.Array,
    *,
    scale: float,
    kv_lora_rank: int,
    batch_invariant: bool = False,
    plan: DecodePlan | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q [Bd, Q, N, L+R] -> (latent [Bd, Q, N, L], lse f32[Bd, Q, N]). kv_cache is the pool of every layer;
    decode.block_table's pages are the layer's, numbered from its first page `block_offset` (the kernel adds it).
    `plan`: the step's `plan_mqa` (built once for every layer), or None."""
    kw = dict(scale=scale, kv_scale=kv_scale, kv_lora_rank=kv_lora_rank, batch_invariant=batch_invariant)
    return backend.mla_decode(
        q, kv_cache, decode.block_table, decode.seq_lens, page_offset=block_offset, plan=plan, **kw
    )


def plan_mqa(
    backend: Backend,
    q: jax.ShapeDtypeStruct,
    kv_cache: jax.Array,
    kv_scale: jax.Array | None,
    decode: DecodeMetadata,
    *,
    scale: float,
    kv_lora_rank: int,
    batch_invariant: bool = False,
) -> DecodePlan | None:
    """What every layer's `forward_mqa` of a step shares (the decode metadata is the same in each: the Hopper
    kernel's work list), built once before the layer loop; q [Bd, Q, N, L+R] as a shape, the other arguments as
    forward_mqa's (the page offset changes nothing)."""
    kw = dict(scale=scale, kv_scale=kv_scale, kv_lora_rank=kv_lora_rank, batch_invariant=batch_invariant)
    return backend.plan_decode(q, kv_cache, decode.block_table, decode.seq_lens, page_offset=None, **kw)


def forward_mha(
    backend: Backend,
    p: dict,
    cfg: DeepseekConfig,
    q: jax.Array,
    kv_c_normed: jax.Array,
    k_pe: jax.Array,
    kv_cache: jax.Array,
    kv_scale: jax.Array | None,
    prefill: PrefillMetadata,
    block_offset: jax.Array,
    *,
    workspace_rows: int,
    max_chunks: int,
    comm: Comm = LOCAL,
) -> jax.Array:
    """Prefill attention: q [Tp, N, P+R], kv_c_normed [Tp, L], k_pe [Tp, 1, R] of the new tokens -> [Tp, N, V]."""
    scale = cfg.softmax_scale
    L = cfg.kv_lora_rank
    qsl = prefill.query_start_loc
    k, v = up_project_kv(p, cfg, kv_c_normed, k_pe)  # [Tp, N, P+R], [Tp, N, V]
    out, lse = backend.flash_prefill(q, k.astype(q.dtype), v.astype(q.dtype), qsl, qsl, causal=True, scale=scale)
    if max_chunks == 0:
        return out
    block_table = prefill.block_table + block_offset

    def chunk(c, carry):
        acc, acc_lse = carry
        ws = comm.gather_cache(
            backend.gather_cache,
            kv_cache,
            block_table,
            prefill.chunk_starts[c],
            prefill.cu_chunk_lens[c],
            workspace_rows=workspace_rows,
            kv_scale=kv_scale,
            out_dtype=q.dtype,
        )  # [W, L+R]
        kc, vc = up_project_kv(p, cfg, ws[:, :L], ws[:, None, L:])  # [W, N, P+R], [W, N, V]
        o, l = backend.flash_prefill(
            q, kc.astype(q.dtype), vc.astype(q.dtype), qsl, prefill.cu_chunk_lens[c], causal=False, scale=scale
        )
        return backend.merge_attn_states(acc, acc_lse, o.astype(jnp.float32), l)

    # Rows without context keep output 0 and LSE -inf, so they weigh nothing in the final merge.
    init = (jnp.zeros(out.shape, jnp.float32), jnp.full(lse.shape, -jnp.inf, jnp.float32))
    ctx_out, ctx_lse = jax.lax.fori_loop(0, jnp.minimum(prefill.num_chunks, max_chunks), chunk, init)
    merged, _ = backend.merge_attn_states(ctx_out, ctx_lse, out.astype(jnp.float32), lse)
    return merged.astype(out.dtype)
