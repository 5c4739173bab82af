"""Paged latent KV cache for MLA (one KV head, vLLM `kv_c_and_k_pe_cache` layout).

Layout
------
``kv_c_and_k_pe_cache``: ``[num_layers, num_pages, G, L + R]`` with G the page size,
L = kv_lora_rank = 512 (``kv_c_normed``, already RMS-normed) followed by R = rope_dim = 64
(``k_pe``, rope already applied). One row per token per layer, a single KV head shared by all
query heads (MQA view of MLA). Token slot ``s = page * G + offset`` lives at ``[layer, s // G, s % G]``.

Bytes per row (L + R = 576):

* ``"bf16"``: 576 * 2 = 1152 B.
* ``"fp8"`` (float8_e4m3fn): 576 B of payload + a separate float32 per-token scale in
  ``kv_scale[layer, page, offset]`` (4 B) = 580 B. ``scale = max|row| / 448`` (all-zero row:
  scale 1), stored value = ``row / scale`` (clipped to +-448), dequant = ``fp8 * scale``.
  One scale covers the whole 576-wide row (latent and rope together).
* ``"fp32"``: 2304 B; exact, for tests.

Other fp8 row formats (per-128 latent scales, rope in bf16: vLLM's ``fp8_ds_mla``, 656 B) are defined next to the
quantisation (``FP8_ROW_FORMATS``, ``quantize_cache_rows``) to be measured against this one; the cache stores only
the per-token format (accuracy: docs/perf-notes.md, notebooks/09_fp8_cache_formats.ipynb).

Page sizes: production page sizes are {16, 32, 64, 128} (FlashMLA: 64, Cutlass MLA: 128); default 64.
Tiny tests may pass ``allow_any_page_size=True`` to use any power of two >= 1.

Writes: ``write_kv`` / ``write_kv_layer`` do one scatter of the concatenated [T, L + R] rows
(plus one scatter of the [T] scales for fp8). ``slot_mapping`` entries < 0 (padding, -1) write
nowhere: they are remapped to an out-of-range index and dropped (``mode="drop"`` alone would not
help, because jnp indexing wraps negative indices). Out-of-range slots are dropped too; validate
slot mappings on the host with ``check_slot_mapping``. The paged step writes through `mla_jax.mla.write_latent_rows`,
which takes the raw kv_a projection: the latent's RMSNorm, the rope and the write in one Pallas kernel on a GPU, the
same rows as the norm + rope + ``write_kv_layer`` it replaces (its path for fp8 and off the GPU).

The scatter stays in the cache dtype: XLA:GPU treats scatter as a data-movement op that supports
fp8/bf16 natively. (XLA:CPU float-normalises an fp8 scatter by upcasting the whole cache to f16 and
back, i.e. one full copy per write; that is a CPU-only cost and the reason the fp8 no-copy test is
GPU-only. A uint8 bitcast does not help there: CPU materialises the bitcast-convert too.)

Index-key cache (sparse attention, DeepSeek-V3.2): ``index_k_cache`` ``[num_index_layers, num_pages, G, D_I]``
holds each token's lightning-indexer key (D_I = index_head_dim, 128), one layer per indexer ("full") layer,
paged exactly like the latent rows and written at the same ``slot_mapping`` in the same step. bf16, fp32, or
fp8 e4m3 with a per-token f32 scale ``index_k_scale`` (vLLM's format: one scale per 128-wide key, as above).
None (both) for dense models.

In-place updates: ``update_cache`` is jitted with the cache donated, so XLA aliases the output to
the input buffers (no copy of the cache per step). Inside a scan/fori over layers, keep the
``KVCache`` in the carry and call ``write_kv_layer`` with the (traced) layer index; do not pass the
stacked cache as scan ``xs``/``ys`` (that slices and restacks, i.e. copies).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.dtypes import as_dtype
from pallas_kernels.util import FP8_MAX, quantize_rows, scatter_rows  # noqa: F401 (re-exported: the cache's row format)

SUPPORTED_PAGE_SIZES = (16, 32, 64, 128)
DEFAULT_PAGE_SIZE = 64

CACHE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float32))


def cache_dtype(dtype: Any) -> jnp.dtype:
    """Normalise "bf16" | "fp8" | "fp32" (any name of `mla_jax.dtypes`, or a dtype) to a jnp dtype."""
    try:
        d = jnp.dtype(as_dtype(dtype))
    except TypeError:
        d = None
    if d not in CACHE_DTYPES:
        raise ValueError(f"unknown KV cache dtype {dtype!r}; expected one of 'bf16', 'fp8', 'fp32'")
    return d


def is_fp8(dtype: Any) -> bool:
    return cache_dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn)


def row_bytes(dtype: Any, *, kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes one token occupies in one layer (payload + fp8 scale)."""
    d = cache_dtype(dtype)
    n = (kv_lora_rank + rope_dim) * d.itemsize
    return n + 4 if d == jnp.dtype(jnp.float8_e4m3fn) else n


def bytes_per_token(num_layers: int, dtype: Any, *, kv_lora_rank: int = 512, rope_dim: int = 64) -> int:
    """Bytes one token occupies across all layers."""
    return num_layers * row_bytes(dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)


def cache_bytes(
    num_layers: int, num_pages: int, page_size: int, dtype: Any, *, kv_lora_rank: int = 512, rope_dim: int = 64
) -> int:
    """Total bytes of a cache made by ``init_kv_cache`` with these arguments."""
    return num_pages * page_size * bytes_per_token(num_layers, dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)


def num_pages_for_bytes(
    budget_bytes: int, num_layers: int, page_size: int, dtype: Any, *, kv_lora_rank: int = 512, rope_dim: int = 64
) -> int:
    """Largest page count whose cache fits in ``budget_bytes``."""
    per_page = page_size * bytes_per_token(num_layers, dtype, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    return max(0, int(budget_bytes) // per_page)


def check_page_size(page_size: int, *, allow_any_page_size: bool = False) -> None:
    if not isinstance(page_size, (int, np.integer)) or isinstance(page_size, bool):
        raise ValueError(f"page_size must be an int, got {type(page_size).__name__}")
    if allow_any_page_size:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {page_size}")
    elif page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(
            f"page_size must be one of {SUPPORTED_PAGE_SIZES} (or pass allow_any_page_size=True "
            f"for tests), got {page_size}"
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Stacked paged latent cache for all layers (a pytree; ``kv_scale`` is None unless fp8)."""

    kv_c_and_k_pe_cache: jax.Array  # [num_layers, num_pages, G, L+R]  bf16 | float8_e4m3fn | f32
    kv_scale: jax.Array | None  # [num_layers, num_pages, G] f32 (fp8 only)
    index_k_cache: jax.Array | None = None  # [num_index_layers, num_pages, G, D_I] (sparse attention only)
    index_k_scale: jax.Array | None = None  # [num_index_layers, num_pages, G] f32 (fp8 index cache only)

    @property
    def num_layers(self) -> int:
        return self.kv_c_and_k_pe_cache.shape[0]

    @property
    def num_pages(self) -> int:
        return self.kv_c_and_k_pe_cache.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv_c_and_k_pe_cache.shape[2]

    @property
    def width(self) -> int:  # L + R
        return self.kv_c_and_k_pe_cache.shape[3]

    @property
    def dtype(self) -> jnp.dtype:
        return self.kv_c_and_k_pe_cache.dtype

    @property
    def is_fp8(self) -> bool:
        return self.kv_scale is not None

    def flat_layers(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array | None, jax.Array]:
        """All layers as one page pool, [num_layers * num_pages, G, L+R] (a free reshape, no layer slice copied),
        its scales or None, and the page offset of `layer` to add to block tables."""
        nl, p, g, w = self.kv_c_and_k_pe_cache.shape
        scale = None if self.kv_scale is None else self.kv_scale.reshape(nl * p, g)
        return self.kv_c_and_k_pe_cache.reshape(nl * p, g, w), scale, layer * p

    def layer(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """One layer's ([num_pages, G, L+R] cache, [num_pages, G] scale or None)."""
        scale = None if self.kv_scale is None else self.kv_scale[layer]
        return self.kv_c_and_k_pe_cache[layer], scale


def init_kv_cache(
    num_layers: int,
    num_pages: int,
    page_size: int = DEFAULT_PAGE_SIZE,
    *,
    kv_lora_rank: int = 512,
    rope_dim: int = 64,
    dtype: Any = "bf16",
    allow_any_page_size: bool = False,
    fill: float = 0.0,
    index_head_dim: int | None = None,
    num_index_layers: int | None = None,
    index_dtype: Any = None,
) -> KVCache:
    """Allocate a zero-filled cache (``fill`` lets tests poison it, e.g. with NaN; fp8 has a NaN).

    ``index_head_dim`` (sparse-attention models: ``cfg.index_head_dim``) adds the index-key cache with
    ``num_index_layers`` layers (default ``num_layers``; ``cfg.num_indexer_layers``) in ``index_dtype``
    (default: ``dtype``). `init_kv_cache_for` reads all of these from a config."""
    check_page_size(page_size, allow_any_page_size=allow_any_page_size)
    if num_layers < 1 or num_pages < 1:
        raise ValueError(f"num_layers and num_pages must be >= 1, got {num_layers}, {num_pages}")
    d = cache_dtype(dtype)
    shape = (num_layers, num_pages, page_size, kv_lora_rank + rope_dim)
    kv = jnp.full(shape, fill, dtype=d)
    scale = jnp.ones(shape[:3], jnp.float32) if d == jnp.dtype(jnp.float8_e4m3fn) else None
    if index_head_dim is None:
        return KVCache(kv, scale)
    di = cache_dtype(dtype if index_dtype is None else index_dtype)
    ishape = (num_layers if num_index_layers is None else num_index_layers, num_pages, page_size, index_head_dim)
    ik = jnp.full(ishape, fill, dtype=di)
    iscale = jnp.ones(ishape[:3], jnp.float32) if di == jnp.dtype(jnp.float8_e4m3fn) else None
    return KVCache(kv, scale, ik, iscale)


def init_kv_cache_for(cfg: Any, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, **kw) -> KVCache:
    """`init_kv_cache` with the dims of a `DeepseekConfig` (the index-key cache too for sparse models)."""
    if getattr(cfg, "use_sparse", False):
        kw = dict(index_head_dim=cfg.index_head_dim, num_index_layers=cfg.num_indexer_layers, **kw)
    return init_kv_cache(
        cfg.num_hidden_layers, num_pages, page_size, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, **kw
    )


# ----------------------------------------------------------------------------------------------------
# Quantisation


def dequantize_rows(q: jax.Array, scale: jax.Array | None, dtype: Any = jnp.float32) -> jax.Array:
    """Inverse of ``quantize_rows`` (``scale`` broadcast over the last dim); identity cast if None."""
    if scale is None:
        return q.astype(dtype)
    return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


# fp8 row formats, compared for accuracy in notebooks/09_fp8_cache_formats.ipynb (docs/perf-notes.md). The cache
# stores "per_token" (`write_kv`); the others exist to be measured against it (no kernel reads them yet).
#   "per_token": L+R e4m3, one f32 scale for the whole row (latent and rope together): 576 + 4 = 580 B.
#   "ds_mla":    vLLM's `fp8_ds_mla` (FlashMLA's sparse fp8 row): L e4m3 with one f32 scale per `group` (128)
#                latent values, rope kept in bf16: 512 + 4 * 4 + 64 * 2 = 656 B.
#   "per_group": the ds_mla scales, but the rope in e4m3 too under a scale of its own: 576 + 5 * 4 = 596 B.
#   "bf16_rope": one f32 scale for the latent, rope kept in bf16: 512 + 4 + 128 = 644 B.
# (The four form a 2 x 2: one scale or one per group for the latent, rope in e4m3 or bf16.)
FP8_ROW_FORMATS = ("per_token", "ds_mla", "per_group", "bf16_rope")
_BF16_ROPE = ("ds_mla", "bf16_rope")


class Fp8Rows(NamedTuple):
    """Rows [..., L+R] in an fp8 row format: ``values`` e4m3 [..., L+R] (rope included) or [..., L] ("ds_mla"),
    ``scales`` f32 [..., S] (S = 1 for "per_token" and "bf16_rope", L / group for "ds_mla", L / group + 1 for
    "per_group": the last one the rope's), ``rope`` bf16 [..., R] ("ds_mla", "bf16_rope") or None."""

    values: jax.Array
    scales: jax.Array
    rope: jax.Array | None


def _format_groups(fmt: str, kv_lora_rank: int, rope_dim: int, group: int) -> int:
    """Latent values per scale of ``fmt`` (checked; "per_token": the whole row's)."""
    if fmt not in FP8_ROW_FORMATS:
        raise ValueError(f"unknown fp8 row format {fmt!r}; expected one of {FP8_ROW_FORMATS}")
    if fmt in ("per_token", "bf16_rope"):
        return kv_lora_rank
    g = min(group, kv_lora_rank)
    if g < 1 or kv_lora_rank % g:
        raise ValueError(f"group {group} must divide kv_lora_rank {kv_lora_rank} (or be >= it)")
    if fmt == "per_group" and rope_dim > g:
        raise ValueError(f"per_group keeps the rope ({rope_dim}) under one scale: it must fit in group {g}")
    return g


def fp8_format_row_bytes(fmt: str, *, kv_lora_rank: int = 512, rope_dim: int = 64, group: int = 128) -> int:
    """Bytes one token occupies in one layer in fp8 row format ``fmt`` (payload + scales); "per_token" is
    `row_bytes("fp8")`."""
    g = _format_groups(fmt, kv_lora_rank, rope_dim, group)
    if fmt == "per_token":
        return kv_lora_rank + rope_dim + 4
    if fmt in _BF16_ROPE:
        return kv_lora_rank + 4 * (kv_lora_rank // g) + 2 * rope_dim
    return kv_lora_rank + rope_dim + 4 * (kv_lora_rank // g + 1)


def _quantize_groups(x: jax.Array, g: int) -> tuple[jax.Array, jax.Array]:
    """x [..., n * g] -> (e4m3 [..., n * g], f32 scales [..., n]): `quantize_rows` on each g-wide group."""
    lead, w = x.shape[:-1], x.shape[-1]
    q, s = quantize_rows(x.reshape(-1, g))
    return q.reshape(*lead, w), s.reshape(*lead, w // g)


def _dequantize_groups(q: jax.Array, scales: jax.Array) -> jax.Array:
    """Inverse of `_quantize_groups` -> f32."""
    n = scales.shape[-1]
    lead, w = q.shape[:-1], q.shape[-1]
    return dequantize_rows(q.reshape(*lead, n, w // n), scales).reshape(*lead, w)


def quantize_cache_rows(rows: jax.Array, fmt: str, *, kv_lora_rank: int = 512, group: int = 128) -> Fp8Rows:
    """Rows [..., L+R] (``[kv_c_normed | k_pe]``) -> `Fp8Rows` in fp8 row format ``fmt`` (`FP8_ROW_FORMATS`).
    "per_token" is exactly what `write_kv` stores (`quantize_rows`: values and the scale, as [..., 1])."""
    L = kv_lora_rank
    if rows.shape[-1] <= L:
        raise ValueError(f"rows must be [..., L+R] with L = kv_lora_rank = {L} and R >= 1, got shape {rows.shape}")
    g = _format_groups(fmt, L, rows.shape[-1] - L, group)
    rows = rows.astype(jnp.float32)
    if fmt == "per_token":
        q, s = _quantize_groups(rows, rows.shape[-1])
        return Fp8Rows(q, s, None)
    q, s = _quantize_groups(rows[..., :L], g)  # [..., L], [..., L / g]
    if fmt in _BF16_ROPE:
        return Fp8Rows(q, s, rows[..., L:].astype(jnp.bfloat16))
    qr, sr = _quantize_groups(rows[..., L:], rows.shape[-1] - L)  # the rope under its own scale
    return Fp8Rows(jnp.concatenate([q, qr], -1), jnp.concatenate([s, sr], -1), None)


def dequantize_cache_rows(packed: Fp8Rows, fmt: str, *, kv_lora_rank: int = 512) -> jax.Array:
    """Inverse of `quantize_cache_rows` -> f32 rows [..., L+R]."""
    if fmt not in FP8_ROW_FORMATS:
        raise ValueError(f"unknown fp8 row format {fmt!r}; expected one of {FP8_ROW_FORMATS}")
    q, s, rope = packed
    if (rope is not None) != (fmt in _BF16_ROPE) or (fmt in ("per_token", "bf16_rope")) != (s.shape[-1] == 1):
        raise ValueError(
            f"packed rows (values {q.shape}, scales {s.shape}, rope {None if rope is None else rope.shape}) are not "
            f"in format {fmt!r}"
        )
    if fmt == "per_token":
        return dequantize_rows(q, s[..., 0])
    if fmt in _BF16_ROPE:
        return jnp.concatenate([_dequantize_groups(q, s), rope.astype(jnp.float32)], -1)
    L = kv_lora_rank
    return jnp.concatenate([_dequantize_groups(q[..., :L], s[..., :-1]), dequantize_rows(q[..., L:], s[..., -1])], -1)


# ----------------------------------------------------------------------------------------------------
# Writes


def _rows_and_slots(kv_c_normed, k_pe, slot_mapping, width: int):
    if kv_c_normed.ndim != 2:
        raise ValueError(f"kv_c_normed must be [T, L], got shape {kv_c_normed.shape}")
    if k_pe.ndim == 3:
        if k_pe.shape[1] != 1:
            raise ValueError(f"k_pe must be [T, R] or [T, 1, R], got shape {k_pe.shape}")
        k_pe = k_pe[:, 0, :]
    if k_pe.ndim != 2:
        raise ValueError(f"k_pe must be [T, R] or [T, 1, R], got shape {k_pe.shape}")
    t = kv_c_normed.shape[0]
    if k_pe.shape[0] != t:
        raise ValueError(f"k_pe has {k_pe.shape[0]} tokens, kv_c_normed has {t}")
    if kv_c_normed.shape[1] + k_pe.shape[1] != width:
        raise ValueError(
            f"kv_c_normed width {kv_c_normed.shape[1]} + k_pe width {k_pe.shape[1]} != cache row width {width}"
        )
    if slot_mapping.shape != (t,):
        raise ValueError(f"slot_mapping must have shape ({t},), got {slot_mapping.shape}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be an integer array, got dtype {slot_mapping.dtype}")
    # Promote to a common dtype before concatenating so latent and rope are treated alike.
    dt = jnp.promote_types(kv_c_normed.dtype, k_pe.dtype)
    rows = jnp.concatenate([kv_c_normed.astype(dt), k_pe.astype(dt)], axis=-1)  # [T, L+R]
    return rows, slot_mapping.astype(jnp.int32)


def _check_scale(cache, scale, scale_shape):
    fp8 = cache.dtype == jnp.dtype(jnp.float8_e4m3fn)
    if fp8 and scale is None:
        raise ValueError("fp8 cache needs a kv_scale array")
    if not fp8 and scale is not None:
        raise ValueError(f"kv_scale given for a non-fp8 cache of dtype {cache.dtype}")
    if scale is not None and scale.shape != scale_shape:
        raise ValueError(f"kv_scale shape {scale.shape} != expected {scale_shape}")
    return fp8


def write_kv(
    kv_c_and_k_pe_cache: jax.Array,
    kv_scale: jax.Array | None,
    kv_c_normed: jax.Array,
    k_pe: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
    """Write T tokens into one layer's cache.

    kv_c_and_k_pe_cache: [num_pages, G, L+R]; kv_scale: [num_pages, G] f32 or None;
    kv_c_normed: [T, L]; k_pe: [T, R] or [T, 1, R]; slot_mapping: int [T], -1 = padding.
    Returns (new cache layer, new scale layer or None).
    """
    if kv_c_and_k_pe_cache.ndim != 3:
        raise ValueError(f"cache layer must be [num_pages, G, L+R], got shape {kv_c_and_k_pe_cache.shape}")
    p, g, w = kv_c_and_k_pe_cache.shape
    fp8 = _check_scale(kv_c_and_k_pe_cache, kv_scale, (p, g))
    rows, slots = _rows_and_slots(kv_c_normed, k_pe, slot_mapping, w)
    return scatter_rows(kv_c_and_k_pe_cache, kv_scale if fp8 else None, rows, slots)


def write_kv_layer(
    cache: KVCache, layer: int | jax.Array, kv_c_normed: jax.Array, k_pe: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Write T tokens into layer ``layer`` (python int or traced i32 scalar) of the stacked cache.

    Scatters straight into the stacked [num_layers, P*G, L+R] view with (layer, slot) indices, so
    XLA updates the buffer in place (no per-layer slice/restack).
    An out-of-range layer index writes nothing inside jit; a python int is checked here.
    """
    kv = cache.kv_c_and_k_pe_cache
    nl, p, g, w = kv.shape
    fp8 = _check_scale(kv, cache.kv_scale, (nl, p, g))
    if isinstance(layer, (int, np.integer)) and not 0 <= layer < nl:
        raise ValueError(f"layer {layer} out of range for a cache with {nl} layers")
    rows, slots = _rows_and_slots(kv_c_normed, k_pe, slot_mapping, w)
    kv, scale = scatter_rows(kv, cache.kv_scale if fp8 else None, rows, slots, layer)
    return KVCache(kv, scale, cache.index_k_cache, cache.index_k_scale)


def write_index_k_layer(
    cache: KVCache, index_layer: int | jax.Array, index_k: jax.Array, slot_mapping: jax.Array
) -> KVCache:
    """Write T tokens' indexer keys index_k [T, D_I] into index layer ``index_layer`` of the index-key cache at
    ``slot_mapping`` (-1: nowhere), quantized per token for an fp8 cache; one scatter, in place like
    `write_kv_layer`."""
    ik = cache.index_k_cache
    if ik is None:
        raise ValueError("the cache has no index-key cache (init_kv_cache(index_head_dim=...))")
    d = ik.shape[-1]
    fp8 = ik.dtype == jnp.dtype(jnp.float8_e4m3fn)
    if fp8 != (cache.index_k_scale is not None):
        raise ValueError(f"index_k_scale must be given exactly for an fp8 index-key cache (dtype {ik.dtype})")
    if index_k.shape != (slot_mapping.shape[0], d):
        raise ValueError(f"index_k must be [T, {d}] for T = {slot_mapping.shape[0]} slots, got {index_k.shape}")
    ik, scale = scatter_rows(ik, cache.index_k_scale, index_k, slot_mapping, index_layer)
    return dataclasses.replace(cache, index_k_cache=ik, index_k_scale=scale)


# Jitted step entry: the cache (arg 0) is donated so the update is in place. The caller must not use
# the cache it passed in afterwards (its buffers are deleted).
update_cache = jax.jit(write_kv_layer, donate_argnums=(0,))


# ----------------------------------------------------------------------------------------------------
# Reads (reference / tests / context gather)


def gather_rows(
    kv_c_and_k_pe_cache: jax.Array, kv_scale: jax.Array | None, slots: jax.Array, dtype: Any = jnp.float32
) -> jax.Array:
    """Read rows at ``slots`` from one layer ([num_pages, G, L+R]) and dequantize -> [T, L+R].

    Slots are clamped into range (callers mask rows they did not ask for, e.g. padding -1).
    """
    p, g, w = kv_c_and_k_pe_cache.shape
    slots = jnp.clip(jnp.asarray(slots, jnp.int32), 0, p * g - 1)
    rows = kv_c_and_k_pe_cache.reshape(p * g, w)[slots]
    scale = None if kv_scale is None else kv_scale.reshape(p * g)[slots]
    return dequantize_rows(rows, scale, dtype)


# ----------------------------------------------------------------------------------------------------
# Host-side validation (metadata builder)


def check_slot_mapping(slot_mapping: np.ndarray, num_pages: int, page_size: int, *, allow_padding: bool = True) -> None:
    """Raise ValueError naming the problem if ``slot_mapping`` is not a valid int32 [T] slot list.

    Valid: int32, 1-D, every entry in [0, num_pages * page_size) or -1 (padding, if allowed), and no
    real slot repeated (a repeated slot in one scatter has an unspecified winner).
    """
    if not isinstance(slot_mapping, np.ndarray):
        raise ValueError(f"slot_mapping must be a numpy array, got {type(slot_mapping).__name__}")
    if slot_mapping.dtype != np.int32:
        raise ValueError(f"slot_mapping dtype must be int32, got {slot_mapping.dtype}")
    if slot_mapping.ndim != 1:
        raise ValueError(f"slot_mapping must be 1-D [T], got shape {slot_mapping.shape}")
    num_slots = num_pages * page_size
    lo = -1 if allow_padding else 0
    bad = np.nonzero((slot_mapping < lo) | (slot_mapping >= num_slots))[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"slot_mapping[{i}] = {int(slot_mapping[i])} out of range [{lo}, {num_slots}) "
            f"({bad.size} bad entries; num_pages={num_pages}, page_size={page_size})"
        )
    real = slot_mapping[slot_mapping >= 0]
    uniq, counts = np.unique(real, return_counts=True)
    if np.any(counts > 1):
        dup = int(uniq[np.argmax(counts > 1)])
        raise ValueError(f"slot_mapping writes slot {dup} more than once")
