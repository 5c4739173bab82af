"""Inputs and checks shared by the kernel tests and the benchmarks (like numpy.testing).

One definition of each correctness case: the CPU tests run the small interpreted cases, the `gpu`
tests every GPU case, and bench/decode.py and bench/prefill.py check the GPU cases marked `bench`
before they time a kernel. A case names the kernels it applies to (`kernels`); cases that both
kernels of a pair take are written once.

Inputs are fresh random numbers with NaN poison wherever a kernel must not read: a kernel that reads
or mixes in any of it produces NaN and fails.
- decode: every cache row no query attends to is NaN (unused pages, the tail of each request's last
  page, the pages that block-table padding entries point to); q rows with seq_len 0 are NaN too.
- prefill: q/k/v rows outside every sequence (before the first, after the last) are NaN.

Tolerances (|out - ref| <= tol + tol |ref| for decode, atol + rtol |ref| for prefill; out rounded to
the input dtype, lse in f32):
- decode, `DECODE_TOL[kind]` (out, lse): bf16/fp8 (bf16 compute) 2e-2, lse 1e-3; f32 q (f32
  compute) 1e-4, 1e-4; "fp8_qk" (the Hopper kernel's QK^T as an fp8 wgmma, against the reference
  on its quantized q) 4e-2, 3e-2: the H200's fp8 wgmma accumulates with reduced precision
  (DeepSeek-V3 report, section 3.3.2: about 14 bits), so its lse errors are of order 1e-2 there
  (measured on the H200, see docs/perf-notes.md), where the interpreter (exact f32) gives 1e-5;
  interpreted fp8_qk cases therefore use "fp8". "fp8_pv" (the 64-row kernel's fp8_qk: QK^T on q's e4m3 terms, P
  rounded to e4m3 for an fp8 P.V) 1e-1 elementwise and 2% in norm, lse 1e-3. On the GPU
  the lse bound is `DECODE_GPU_LSE_TOL` (dots accumulate in another order than the CPU reference),
  except for "fp8_qk" and "fp8_pv" (`decode_gpu_tolerance`).
- prefill, `PREFILL_TOL[dtype]` (atol, rtol): bf16/f16 2e-2 (P and the output rounded to 8 bits),
  f32 2e-5, 1e-5; the lse bound is the kernel's (exact exp2/log2 or approximate math), set by
  its test suite.
fp8 decode with fp8_mode="dequant_tile" rounds fp8 * kv_scale to bf16 before its dots, so its
reference is the bf16 reference over that rounded cache (a looser bound would hide bugs). The fp8
reference otherwise uses the dequantized cache (fp8 value * kv_scale in float32).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash_prefill import flash_prefill_reference
from pallas_kernels.mla_decode import mla_decode_reference
from pallas_kernels.mla_decode_sm90 import fp8_qk_q_terms, fp8_qk_reference_q, uses_fp8_pv
from pallas_kernels.util import BF16, F16, F32, FP8, cdiv

# Kernel names used in the cases' `kernels`.
MLA_DECODE, MLA_DECODE_SM90 = "mla_decode", "mla_decode_sm90"
FLASH_PREFILL, FLASH_PREFILL_SM90 = "flash_prefill", "flash_prefill_sm90"


def _seed(name: str, seed: int | None) -> int:
    return zlib.crc32(name.encode()) if seed is None else seed


# ---------------------------------------------------------------------------------------------
# Decode

DECODE_SCALE = 192**-0.5 * 1.87385  # DeepSeek-V3: 192^-0.5 * mscale^2
DECODE_TOL = {
    "bf16": (2e-2, 1e-3),
    "fp8": (2e-2, 1e-3),
    "fp8_qk": (4e-2, 3e-2),
    "fp8_pv": (1e-1, 1e-3),
    "f32": (1e-4, 1e-4),
}
DECODE_GPU_LSE_TOL = 1e-2
FP8_PV_NORM_TOL = 2e-2  # "fp8_pv" cases: |out - ref| / |ref| over the whole output (issue 20's footing)


def decode_gpu_tolerance(kind: str) -> tuple[float, float]:
    """(out, lse) tolerance of a decode case on the GPU."""
    out_tol, lse_tol = DECODE_TOL[kind]
    if kind == "fp8_pv":
        # Two fp8 wgmma chains of logits into one accumulator at the fp8 adds' reduced precision (lse 0.050, H100,
        # session 37); e4m3 P on the GPU's exp2: one element of 196608 at 0.081.
        return 1e-1, 6e-2
    return out_tol, lse_tol if kind == "fp8_qk" else DECODE_GPU_LSE_TOL


def decode_kind(case) -> str:
    """A case's tolerance key as this tree runs it: "fp8_pv" for an fp8_qk case on the 64-row kernel (P rounded
    to e4m3: an element's error up to 2^-4 of the |values| it averages, so elementwise 1e-1 (0.092 where a 7-token
    request's few large values cancel, interpreted: exactly P's rounding), and `FP8_PV_NORM_TOL` over the output)."""
    inp = case.inputs
    cache_dtype = FP8 if inp.get("cache_dtype") == "fp8" else BF16
    if case.kernel.get("fp8_qk") and uses_fp8_pv(inp["nq"] * inp["n"], cache_dtype, inp.get("l", 512)):
        return "fp8_pv"
    return case.kind


def decode_inputs(
    seed,
    *,
    b,
    nq,
    n,
    max_pages,
    lens,
    l=512,
    r=64,
    g=64,
    cache_dtype="bf16",
    q_dtype="bf16",
    causal=False,
    page_offset=0,
):
    """(q, cache, block_table, seq_lens, kv_scale) with NaN poison. lens[i]: cache tokens of request
    i (its last query row's length); causal rows see lens[i] - (nq - 1 - t) tokens, non-causal rows
    all lens[i]. cache_dtype "bf16" or "fp8" (with a per-token kv_scale), q_dtype "bf16" or "f32".
    page_offset (the kernels' keyword): the block table numbers pages from 0 but they lie at pool pages
    page_offset + id, between page_offset NaN pages (NaN scales) before and after them, so that a kernel
    that skips the offset or adds it twice reads only NaN (page_offset 0, or at least the P pages drawn:
    lens' pages + 3 spares)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens)
    used = [cdiv(int(x), g) for x in lens]
    spare = 3
    num_pages = sum(used) + spare
    if 0 < page_offset < num_pages:
        raise ValueError(f"page_offset {page_offset} must be 0 or >= the {num_pages} pages drawn")
    perm = rng.permutation(num_pages)
    spare_pages = perm[num_pages - spare :]
    block_table = np.empty((b, max_pages), np.int32)
    cache = np.full((num_pages, g, l + r), np.nan, np.float32)
    pos = 0
    for i in range(b):
        pages = perm[pos : pos + used[i]]
        pos += used[i]
        block_table[i, : used[i]] = pages
        block_table[i, used[i] :] = rng.choice(spare_pages, max_pages - used[i])
        for j, page in enumerate(pages):
            rows = min(g, int(lens[i]) - j * g)
            cache[page, :rows] = rng.standard_normal((rows, l + r))
    if causal:
        seq_lens = lens[:, None] - (nq - 1) + np.arange(nq)[None, :]
    else:
        seq_lens = np.repeat(lens[:, None], nq, axis=1)
    seq_lens = np.where(lens[:, None] > 0, np.maximum(seq_lens, 0), 0).astype(np.int32)
    q = rng.standard_normal((b, nq, n, l + r)).astype(np.float32)
    q[seq_lens == 0] = np.nan
    scales = rng.uniform(0.25, 0.75, (num_pages, g)).astype(np.float32) if cache_dtype == "fp8" else None
    if page_offset:
        cache = np.pad(cache, ((page_offset, page_offset), (0, 0), (0, 0)), constant_values=np.nan)
        scales = (
            None if scales is None else np.pad(scales, ((page_offset, page_offset), (0, 0)), constant_values=np.nan)
        )
    kv_scale = None
    if cache_dtype == "fp8":
        cache_j = jnp.asarray(cache * 2.0).astype(jnp.float8_e4m3fn)
        kv_scale = jnp.asarray(scales)
    else:
        cache_j = jnp.asarray(cache).astype(jnp.bfloat16)
    q_j = jnp.asarray(q).astype(jnp.float32 if q_dtype == "f32" else jnp.bfloat16)
    return q_j, cache_j, jnp.asarray(block_table), jnp.asarray(seq_lens), kv_scale


def decode_reference(q, cache, bt, sl, ks, kernel_kw, l=512, *, scale=DECODE_SCALE):
    """The float32 reference for these kernel options: fp8_mode="dequant_tile" is checked against
    the bf16 cache it rounds to; with fp8_qk the kernel's logits are those of the per-row
    fp8-quantized q (`mla_decode_sm90.quantize_q_fp8`), so that is the reference's q."""
    if kernel_kw.get("fp8_mode") == "dequant_tile":
        cache, ks = (cache.astype(jnp.float32) * ks[..., None]).astype(jnp.bfloat16), None
    if kernel_kw.get("fp8_qk"):
        terms = fp8_qk_q_terms(q.shape[1] * q.shape[2], cache.dtype, l, kernel_kw.get("fp8_q_split"))
        q = fp8_qk_reference_q(q, split=terms == 2)
    return mla_decode_reference(
        q, cache, bt, sl, scale=scale, kv_scale=ks, kv_lora_rank=l, page_offset=kernel_kw.get("page_offset")
    )


def assert_decode_close(out, lse, ref, ref_lse, kind, lse_tol=None, out_tol=None):
    default_out_tol, default_lse_tol = DECODE_TOL[kind]
    out_tol = default_out_tol if out_tol is None else out_tol
    lse_tol = default_lse_tol if lse_tol is None else lse_tol
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    assert np.all(np.isfinite(out)), "NaN/inf leaked into the output"
    np.testing.assert_allclose(out, ref, rtol=out_tol, atol=out_tol)
    if kind == "fp8_pv":
        assert np.linalg.norm(out - ref) <= FP8_PV_NORM_TOL * np.linalg.norm(ref), "fp8 P.V: over 2% in norm"
    empty = ~np.isfinite(ref_lse)
    assert np.all(lse[empty] == -np.inf) and np.all(out[empty] == 0), "empty rows must be 0 / -inf"
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=0, atol=lse_tol)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
    name: str
    inputs: dict  # `decode_inputs` keywords (L, R, G default to 512, 64, 64)
    kernel: dict = dataclasses.field(default_factory=dict)  # the kernel's keywords (page_offset also places the pages)
    kind: str = "bf16"  # DECODE_TOL key
    kernels: tuple = (MLA_DECODE, MLA_DECODE_SM90)
    seed: int | None = None  # None: crc32 of the name
    bench: bool = False  # checked by bench/decode.py before timing

    @property
    def l(self) -> int:
        return self.inputs.get("l", 512)

    def make(self):
        return decode_inputs(_seed(self.name, self.seed), page_offset=self.kernel.get("page_offset", 0), **self.inputs)


def _dc(name, kernels, kind="bf16", kernel=None, seed=None, bench=False, **inputs):
    return DecodeCase(name, inputs, dict(kernel or {}), kind, kernels, seed, bench)


_TRITON, _SM90, _BOTH = (MLA_DECODE,), (MLA_DECODE_SM90,), (MLA_DECODE, MLA_DECODE_SM90)

# Interpreted on CPU: small shapes, each exercising one of the kernel's paths.
DECODE_CASES = [
    # Triton kernel (any power-of-two L, R >= 16 and page size)
    _dc(
        "n16_l512_g16_bf16",
        _TRITON,
        kernel=dict(block_kv=32),
        b=3,
        nq=1,
        n=16,
        l=512,
        r=64,
        g=16,
        max_pages=4,
        lens=[37, 0, 5],
    ),
    _dc(
        "n32_g64_f32q_subpage_steps",
        _TRITON,
        "f32",
        dict(block_kv=32, num_kv_splits=2),
        b=2,
        nq=1,
        n=32,
        l=64,
        r=16,
        g=64,
        max_pages=4,
        lens=[130, 64],
        q_dtype="f32",
    ),
    _dc(
        "n128_g128_two_head_blocks",
        _TRITON,
        kernel=dict(block_kv=64),
        b=2,
        nq=1,
        n=128,
        l=32,
        r=16,
        g=128,
        max_pages=3,
        lens=[200, 1],
    ),
    _dc(
        "q3_causal_n16_g16_padded_rows",
        _TRITON,
        kernel=dict(num_kv_splits=3, block_kv=16),
        b=2,
        nq=3,
        n=16,
        l=64,
        r=16,
        g=16,
        max_pages=4,
        lens=[40, 2],
        causal=True,
    ),
    _dc(
        "q2_noncausal_n32_g64_empty_request",
        _TRITON,
        kernel=dict(block_kv=64),
        b=2,
        nq=2,
        n=32,
        l=64,
        r=16,
        g=64,
        max_pages=3,
        lens=[100, 0],
    ),
    _dc(
        "fp8_l512_g64_splits",
        _TRITON,
        "fp8",
        dict(num_kv_splits=2, block_kv=64),
        b=2,
        nq=1,
        n=16,
        l=512,
        r=64,
        g=64,
        max_pages=3,
        lens=[150, 64],
        cache_dtype="fp8",
    ),
    _dc(
        "fp8_causal_dequant_tile_g16",
        _TRITON,
        "fp8",
        dict(fp8_mode="dequant_tile", block_kv=32),
        b=2,
        nq=2,
        n=16,
        l=64,
        r=16,
        g=16,
        max_pages=5,
        lens=[70, 1],
        cache_dtype="fp8",
        causal=True,
    ),
    # Hopper kernel (L = 512, R = 64, page 64)
    # 3 requests, ragged (2 pages + 22 rows, empty, exactly 1 page), 2 splits: f32 partials + merge.
    _dc(
        "n16_ragged_empty_2splits_bf16",
        _SM90,
        kernel=dict(num_kv_splits=2),
        b=3,
        nq=1,
        n=16,
        max_pages=3,
        lens=[150, 0, 64],
    ),
    # The narrow (tokens-on-M) kernel: Q=2 causal x 16 heads = 32 rows at page_offset 13 of a NaN pool,
    # 3 splits (transposed f32 partials, one split empty for the short requests), an empty request.
    _dc(
        "narrow_q2_causal_n16_3splits_page_offset_bf16",
        _SM90,
        kernel=dict(num_kv_splits=3, page_offset=13),
        b=3,
        nq=2,
        n=16,
        max_pages=3,
        lens=[190, 0, 65],
        causal=True,
    ),
    # The narrow kernel on an fp8 cache (q split hi/lo, V cast by two warpgroups): 3 splits at page_offset 12,
    # a partial last page, an empty request, a 1-token request.
    _dc(
        "narrow_fp8_n16_3splits_page_offset",
        _SM90,
        "fp8",
        kernel=dict(num_kv_splits=3, page_offset=12),
        b=4,
        nq=1,
        n=16,
        max_pages=4,
        lens=[200, 0, 1, 64],
        cache_dtype="fp8",
    ),
    # The narrow kernel with 12 heads: 16 rows TMA'd, 4 of them padding (length 0); one split, 1-stage ring.
    _dc(
        "narrow_n12_padded_1split_stages1_bf16",
        _SM90,
        kernel=dict(num_kv_splits=1, num_stages=1),
        b=2,
        nq=1,
        n=12,
        max_pages=3,
        lens=[129, 1],
    ),
    # Two head tiles, the second with 16 real rows (only those move), one split (final bf16
    # output staged directly), a 1-token request.
    _dc(
        "n80_two_tiles_tail16_1split_bf16",
        _SM90,
        kernel=dict(num_kv_splits=1),
        b=2,
        nq=1,
        n=80,
        max_pages=2,
        lens=[100, 1],
    ),
    # Spec decode: Q=3 causal rows folded into one padded tile, 1-stage ring (reuse every page); the pages at
    # page_offset 8 of a NaN pool (the layer pages of a cache flattened over layers).
    _dc(
        "q3_causal_n16_stages1_page_offset_bf16",
        _SM90,
        kernel=dict(num_kv_splits=1, num_stages=1, page_offset=8),
        b=2,
        nq=3,
        n=16,
        max_pages=3,
        lens=[140, 2],
        causal=True,
    ),
    # Q=2 causal rows of N=40 heads: token 1's rows 40..79 straddle the two head tiles, so the second tile's
    # length (derived in the kernel from seq_lens) is token 1's and the first's the longer of both; 3 splits of
    # 4 pages (the last split of the short request empty), pages at page_offset 9 of a NaN pool.
    _dc(
        "q2_causal_n40_straddling_tiles_3splits_page_offset_bf16",
        _SM90,
        kernel=dict(num_kv_splits=3, page_offset=9),
        b=2,
        nq=2,
        n=40,
        max_pages=4,
        lens=[230, 66],
        causal=True,
    ),
    # fp8 cache, Q=2 causal, N=64 (2 tiles), 2 splits over 3 pages; 1-token request.
    _dc(
        "fp8_q2_causal_n64_2splits",
        _SM90,
        "fp8",
        dict(num_kv_splits=2),
        b=2,
        nq=2,
        n=64,
        max_pages=3,
        lens=[170, 1],
        causal=True,
        cache_dtype="fp8",
    ),
    # Work list over 2 "SMs" in the narrow kernel (N=20: 24 rows move, q padded by 4 zero rows; 32-row
    # tiles): the 10-page request is cut in two pieces (transposed partials merged by LSE), the 1-page one
    # stays whole (final output written directly), the empty one writes zeros / -inf.
    _dc(
        "worklist_split_whole_empty_n20_bf16",
        _SM90,
        kernel=dict(schedule="worklist", num_sms=2),
        b=3,
        nq=1,
        n=20,
        max_pages=12,
        lens=[600, 64, 0],
    ),
    # The narrow kernel's work list on an fp8 cache (q split hi/lo) at page_offset 14 of a NaN pool, 3 "SMs":
    # the 9-page request in pieces, causal Q=1 rows, a 1-token and an empty request whole.
    _dc(
        "narrow_worklist_fp8_n16_page_offset",
        _SM90,
        "fp8",
        kernel=dict(schedule="worklist", num_sms=3, page_offset=14),
        b=4,
        nq=1,
        n=16,
        max_pages=10,
        lens=[530, 1, 0, 64],
        cache_dtype="fp8",
    ),
    # The narrow kernel's work list with Q=2 causal x 8 heads (16 rows): the long request's causal rows end in
    # different pieces; 40 heads x 1 token on the 64-row kernel's work list (one 40-row tile).
    _dc(
        "narrow_worklist_q2_causal_n8_bf16",
        _SM90,
        kernel=dict(schedule="worklist", num_sms=2),
        b=3,
        nq=2,
        n=8,
        max_pages=9,
        lens=[513, 70, 2],
        causal=True,
    ),
    _dc(
        "worklist_rows64_single_tile_n40_bf16",
        _SM90,
        kernel=dict(schedule="worklist", num_sms=2),
        b=2,
        nq=1,
        n=40,
        max_pages=8,
        lens=[450, 30],
    ),
    # Work list, fp8, Q=2 causal x 64 heads = 2 tiles per request, 4 "SMs": tiles of 11 pages
    # split in two, 3-page tiles whole; causal rows end inside the first piece of the split.
    _dc(
        "worklist_fp8_q2_causal_n64",
        _SM90,
        "fp8",
        dict(schedule="worklist", num_sms=4),
        b=2,
        nq=2,
        n=64,
        max_pages=12,
        lens=[700, 130],
        causal=True,
        cache_dtype="fp8",
    ),
    # fp8, a 1-deep fp8 ring.
    _dc(
        "fp8_1stage",
        _SM90,
        "fp8",
        dict(fp8_stages=1, num_kv_splits=1),
        b=2,
        nq=1,
        n=16,
        max_pages=4,
        lens=[200, 64],
        cache_dtype="fp8",
    ),
    # fp8 QK^T (fp8 q, per-row scale) on the fp8 ring, V cast alone: Q=2 causal, 2 tiles, 2 splits,
    # the default 3-deep fp8 ring; a 1-token request.
    _dc(
        "fp8_qk_q2_causal_n64_2splits",
        _SM90,
        "fp8",
        dict(fp8_qk=True, num_kv_splits=2),
        b=2,
        nq=2,
        n=64,
        max_pages=4,
        lens=[170, 1],
        causal=True,
        cache_dtype="fp8",
    ),
    # fp8 QK^T over one 40-row tile (its Q moved as 40 rows, quantized with their scales), the work list.
    _dc(
        "fp8_qk_n40_worklist",
        _SM90,
        "fp8",
        dict(fp8_qk=True, schedule="worklist", num_sms=8),
        b=3,
        nq=1,
        n=40,
        max_pages=5,
        lens=[300, 65, 9],
        cache_dtype="fp8",
    ),
    # fp8 QK^T with a 1-deep fp8 ring (every page waits for WG0's QK^T and the cast to free the
    # slot) and a 2-deep V ring; 5 pages, a partial last one, N=16.
    _dc(
        "fp8_qk_fp8stages1_n16",
        _SM90,
        "fp8",
        dict(fp8_qk=True, fp8_stages=1, num_stages=2, num_kv_splits=1),
        b=2,
        nq=1,
        n=16,
        max_pages=5,
        lens=[300, 64],
        cache_dtype="fp8",
    ),
]

# On the GPU (L = 512, R = 64): the project's sizes, ragged, empty and 1-token requests.
DECODE_GPU_CASES = [
    # both kernels
    _dc("n16_ragged_bf16", _BOTH, seed=1000, bench=True, b=4, nq=1, n=16, max_pages=48, lens=[3000, 1, 0, 1100]),
    _dc(
        "n16_ragged_fp8",
        _BOTH,
        "fp8",
        seed=1001,
        bench=True,
        b=4,
        nq=1,
        n=16,
        max_pages=48,
        lens=[3000, 1, 0, 1100],
        cache_dtype="fp8",
    ),
    _dc("q2_causal_n128_bf16", _BOTH, seed=1002, b=3, nq=2, n=128, max_pages=24, lens=[1500, 65, 2], causal=True),
    # A layer's pages at page_offset 32 of a NaN pool (25 pages drawn), Q=3 causal x 16 heads (Triton: 16 padding rows)
    _dc(
        "q3_causal_n16_page_offset",
        _BOTH,
        kernel=dict(page_offset=32),
        seed=1006,
        b=3,
        nq=3,
        n=16,
        max_pages=24,
        lens=[1200, 70, 1],
        causal=True,
    ),
    _dc(
        "n16_7splits_bf16",
        _BOTH,
        kernel=dict(num_kv_splits=7),
        seed=1005,
        b=2,
        nq=1,
        n=16,
        max_pages=64,
        lens=[4000, 200],
    ),
    _dc("n128_bf16", _BOTH, bench=True, b=3, nq=1, n=128, max_pages=20, lens=[1200, 64, 999]),
    # The narrow Hopper kernel: 8 heads, Q=2 causal (16 rows), 5 splits, a page offset; 32 rows, one split.
    _dc(
        "narrow_q2_causal_n8_5splits_page_offset",
        _BOTH,
        kernel=dict(num_kv_splits=5, page_offset=40),
        seed=1010,
        b=3,
        nq=2,
        n=8,
        max_pages=32,
        lens=[2000, 3, 0],
        causal=True,
    ),
    _dc(
        "narrow_n32_1split",
        _BOTH,
        kernel=dict(num_kv_splits=1),
        seed=1011,
        b=2,
        nq=1,
        n=32,
        max_pages=40,
        lens=[2500, 64],
    ),
    _dc(
        "q4_causal_n32_batch_invariant",
        _BOTH,
        kernel=dict(batch_invariant=True),
        bench=True,
        b=2,
        nq=4,
        n=32,
        max_pages=16,
        lens=[1000, 17],
        causal=True,
    ),
    # Triton kernel: other page sizes, fp8_mode
    _dc(
        "n128_g16_fp8",
        _TRITON,
        "fp8",
        seed=1003,
        b=3,
        nq=1,
        n=128,
        g=16,
        max_pages=80,
        lens=[1200, 16, 999],
        cache_dtype="fp8",
    ),
    _dc(
        "q4_causal_n32_g128_fp8_dequant_tile",
        _TRITON,
        "fp8",
        dict(fp8_mode="dequant_tile"),
        seed=1004,
        b=2,
        nq=4,
        n=32,
        g=128,
        max_pages=10,
        lens=[1100, 5],
        causal=True,
        cache_dtype="fp8",
    ),
    _dc(
        "q2_causal_n64_g16_fp8",
        _TRITON,
        "fp8",
        bench=True,
        b=3,
        nq=2,
        n=64,
        g=16,
        max_pages=80,
        lens=[1200, 64, 999],
        cache_dtype="fp8",
        causal=True,
    ),
    _dc(
        "q3_n16_g128_5splits",
        _TRITON,
        kernel=dict(num_kv_splits=5),
        bench=True,
        b=2,
        nq=3,
        n=16,
        g=128,
        max_pages=12,
        lens=[1500, 300],
    ),
    # Hopper kernel: its schedules, ring depths and fp8 modes
    _dc(
        "n16_ragged_fp8_sm90",
        _SM90,
        "fp8",
        dict(),
        seed=2002,
        bench=True,
        b=4,
        nq=1,
        n=16,
        max_pages=48,
        lens=[3000, 1, 0, 1100],
        cache_dtype="fp8",
    ),
    _dc("n128_fp8", _SM90, "fp8", seed=2004, b=3, nq=1, n=128, max_pages=20, lens=[1200, 64, 999], cache_dtype="fp8"),
    _dc(
        "q4_causal_n32_stages1",
        _SM90,
        kernel=dict(num_stages=1),
        seed=2005,
        b=2,
        nq=4,
        n=32,
        max_pages=18,
        lens=[1100, 5],
        causal=True,
    ),
    _dc("n128_8000", _SM90, seed=2007, b=1, nq=1, n=128, max_pages=128, lens=[8000]),
    _dc(
        "worklist_n16_ragged",
        _SM90,
        kernel=dict(schedule="worklist"),
        seed=2008,
        bench=True,
        b=5,
        nq=1,
        n=16,
        max_pages=160,
        lens=[10000, 3, 0, 700, 64],
    ),
    # The narrow kernel's work list over the device's SMs: fp8 (exact and fp8_qk), 16 heads, ragged with
    # empty and one-token requests.
    _dc(
        "narrow_worklist_fp8_n16_ragged",
        _SM90,
        "fp8",
        dict(schedule="worklist"),
        seed=2013,
        bench=True,
        b=6,
        nq=1,
        n=16,
        max_pages=160,
        lens=[10000, 3, 0, 700, 64, 1],
        cache_dtype="fp8",
    ),
    _dc(
        "narrow_worklist_fp8_qk_n16_ragged",
        _SM90,
        "fp8_qk",
        dict(schedule="worklist", fp8_qk=True),
        seed=2014,
        b=4,
        nq=1,
        n=16,
        max_pages=160,
        lens=[9000, 0, 700, 65],
        cache_dtype="fp8",
    ),
    _dc(
        "worklist_fp8_q2_causal_n64_5000",
        _SM90,
        "fp8",
        dict(schedule="worklist"),
        seed=2009,
        bench=True,
        b=3,
        nq=2,
        n=64,
        max_pages=80,
        lens=[5000, 100, 1],
        causal=True,
        cache_dtype="fp8",
    ),
    _dc(
        "fp8_qk_n128",
        _SM90,
        "fp8_qk",
        dict(fp8_qk=True),
        seed=2010,
        bench=True,
        b=3,
        nq=1,
        n=128,
        max_pages=20,
        lens=[1200, 64, 999],
        cache_dtype="fp8",
    ),
    _dc(
        "fp8_qk_split_n128",  # two e4m3 terms of q (fp8_q_split=True: both QK^T chains on the page's consumer)
        _SM90,
        "fp8_qk",
        dict(fp8_qk=True, fp8_q_split=True),
        seed=2099,
        b=2,
        nq=1,
        n=128,
        max_pages=12,
        lens=[700, 65],
        cache_dtype="fp8",
    ),
    _dc(
        "fp8_qk_fp8stages1_n16_ragged",
        _SM90,
        "fp8_qk",
        dict(fp8_qk=True, fp8_stages=1, num_stages=2),
        seed=2011,
        b=4,
        nq=1,
        n=16,
        max_pages=48,
        lens=[3000, 1, 0, 1100],
        cache_dtype="fp8",
    ),
    _dc(
        "fp8_qk_worklist_q2_causal_n64",
        _SM90,
        "fp8_qk",
        dict(fp8_qk=True, schedule="worklist"),
        seed=2012,
        b=3,
        nq=2,
        n=64,
        max_pages=80,
        lens=[5000, 100, 1],
        causal=True,
        cache_dtype="fp8",
    ),
    _dc(
        "fp8_q2_causal_n64",
        _SM90,
        "fp8",
        bench=True,
        b=3,
        nq=2,
        n=64,
        max_pages=20,
        lens=[1200, 64, 999],
        causal=True,
        cache_dtype="fp8",
    ),
    _dc(
        "q3_n16_5splits",
        _SM90,
        kernel=dict(num_kv_splits=5),
        bench=True,
        b=2,
        nq=3,
        n=16,
        max_pages=24,
        lens=[1500, 300],
    ),
    _dc("n128_32k", _SM90, bench=True, b=1, nq=1, n=128, max_pages=512, lens=[32768]),
    _dc(
        "worklist_n128_32k",
        _SM90,
        kernel=dict(schedule="worklist"),
        bench=True,
        b=1,
        nq=1,
        n=128,
        max_pages=512,
        lens=[32768],
    ),
    _dc(
        "fp8_qk_worklist_q2_causal_n64",
        _SM90,
        "fp8_qk",
        dict(fp8_qk=True, schedule="worklist"),
        bench=True,
        b=3,
        nq=2,
        n=64,
        max_pages=80,
        lens=[5000, 100, 1],
        causal=True,
        cache_dtype="fp8",
    ),
]


def cases_for(cases, kernel: str, *, bench: bool = False):
    """The cases of `cases` that `kernel` takes (only those marked `bench` if asked)."""
    return [c for c in cases if kernel in c.kernels and (c.bench or not bench)]


# ---------------------------------------------------------------------------------------------
# Prefill

PREFILL_SCALE = 192**-0.5
PREFILL_TOL = {BF16: (2e-2, 2e-2), F16: (2e-2, 2e-2), F32: (2e-5, 1e-5)}  # (atol, rtol)


def locs(lens, start=0):
    """Start locations i32[S+1] of sequences of these lengths packed from row `start`."""
    return (start + np.concatenate([[0], np.cumsum(lens)])).astype(np.int32)


def prefill_inputs(seed, q_lens, k_lens, *, n=2, dq=192, dv=128, dtype=jnp.bfloat16, pad=5, q_start=0, k_start=0):
    """(q, k, v, q_start_loc, k_start_loc): packed q/k/v with NaN in every row outside the
    sequences (`q_start`/`k_start` rows before the first, `pad` rows after the last)."""
    rng = np.random.default_rng(seed)
    qs, ks = locs(q_lens, q_start), locs(k_lens, k_start)
    tq, tk = int(qs[-1]) + pad, int(ks[-1]) + pad
    q = rng.standard_normal((tq, n, dq), np.float32)
    k = rng.standard_normal((tk, n, dq), np.float32)
    v = rng.standard_normal((tk, n, dv), np.float32)
    q[qs[-1] :], k[ks[-1] :], v[ks[-1] :] = np.nan, np.nan, np.nan
    q[:q_start], k[:k_start], v[:k_start] = np.nan, np.nan, np.nan
    return [jnp.asarray(x, dtype) for x in (q, k, v)] + [jnp.asarray(qs), jnp.asarray(ks)]


def check_prefill(out, lse, ref, ref_lse, *, lse_tol, lse_rtol=0.0, tol=None):
    """out within `tol` (atol, rtol; default PREFILL_TOL of its dtype) of the reference and finite,
    lse within lse_tol where the reference is finite and -inf exactly where it is; rows that see no
    key: out exactly 0. Returns (out, lse) as numpy arrays (out in f32)."""
    atol, rtol = PREFILL_TOL[jnp.dtype(out.dtype)] if tol is None else tol
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    ref, lse, ref_lse = np.asarray(ref), np.asarray(lse), np.asarray(ref_lse)
    assert np.all(np.isfinite(out)), "NaN/inf in the output (padding leaked?)"
    np.testing.assert_allclose(out, ref, atol=atol, rtol=rtol)
    assert not np.any(np.isnan(lse))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=lse_tol, rtol=lse_rtol)
    assert np.all(out[~fin] == 0), "rows that see no key must be 0"
    return out, lse


@dataclasses.dataclass(frozen=True)
class PrefillCase:
    name: str
    q_lens: tuple
    k_lens: tuple | None  # None: the q lengths (self-attention)
    causal: bool
    inputs: dict = dataclasses.field(default_factory=dict)  # `prefill_inputs` keywords
    kernel: dict = dataclasses.field(default_factory=dict)  # the kernel's tuning keywords
    kernels: tuple = (FLASH_PREFILL, FLASH_PREFILL_SM90)
    scale: float = PREFILL_SCALE
    seed: int | None = None  # None: crc32 of the name
    bench: bool = False  # checked by bench/prefill.py before timing

    def make(self):
        k_lens = self.q_lens if self.k_lens is None else self.k_lens
        return prefill_inputs(_seed(self.name, self.seed), self.q_lens, k_lens, **self.inputs)

    def reference(self, q, k, v, qs, ks):
        return flash_prefill_reference(q, k, v, qs, ks, causal=self.causal, scale=self.scale)


def _pc(name, q_lens, k_lens, causal, kernels, kernel=None, seed=None, bench=False, scale=None, **inputs):
    return PrefillCase(
        name,
        tuple(q_lens),
        None if k_lens is None else tuple(k_lens),
        causal,
        inputs,
        dict(kernel or {}),
        kernels,
        PREFILL_SCALE if scale is None else scale,
        seed,
        bench,
    )


_FP, _FP90, _FP_BOTH = (FLASH_PREFILL,), (FLASH_PREFILL_SM90,), (FLASH_PREFILL, FLASH_PREFILL_SM90)
LENS = [5, 0, 37, 1, 20, 0]  # ragged, empty and one-token sequences in one q block
_TRITON_SMALL = dict(n=2, dq=48, dv=32, dtype=jnp.float32)  # q/k 48 = 32 + 16: two dots
_B16 = dict(block_q=16, block_k=16)

# Interpreted on CPU.
PREFILL_CASES = [
    # Triton kernel, block_q 16 so that q blocks straddle sequences
    _pc("causal_self_f32", LENS, None, True, _FP, _B16, seed=0, scale=0.3, **_TRITON_SMALL),
    _pc("causal_self_bf16", LENS, None, True, _FP, _B16, seed=0, scale=0.3, **{**_TRITON_SMALL, "dtype": jnp.bfloat16}),
    # bottom-right aligned: q row i sees k_len - q_len + i + 1 keys
    _pc(
        "causal_q_shorter_than_k",
        [5, 0, 37, 1, 20],
        [9, 3, 60, 1, 27],
        True,
        _FP,
        dict(block_q=16, block_k=32),
        seed=0,
        scale=0.3,
        **_TRITON_SMALL,
    ),
    # context-chunk pass: each sequence's queries against its own (differently sized) chunk rows
    _pc(
        "noncausal_chunk_f32", [5, 0, 37, 1, 20], [9, 3, 60, 1, 7], False, _FP, _B16, seed=0, scale=0.3, **_TRITON_SMALL
    ),
    _pc(
        "noncausal_chunk_bf16",
        [5, 0, 37, 1, 20],
        [9, 3, 60, 1, 7],
        False,
        _FP,
        _B16,
        seed=0,
        scale=0.3,
        **{**_TRITON_SMALL, "dtype": jnp.bfloat16},
    ),
    _pc(
        "single_token_prefills_pow2_head_dims",
        [1, 1, 1, 1, 1],
        None,
        True,
        _FP,
        _B16,
        seed=0,
        scale=0.3,
        **{**_TRITON_SMALL, "n": 3, "dq": 32, "dv": 16},
    ),
    _pc(
        "block_larger_than_everything",
        [3, 9],
        None,
        True,
        _FP,
        dict(block_q=64, block_k=64),
        seed=0,
        scale=0.3,
        **_TRITON_SMALL,
    ),
    # the real 192 = 128 + 64 q/k split with v 128, default tuning
    _pc("deepseek_dims_bf16", [40, 0, 90], None, True, _FP, seed=0, n=2, dq=192, dv=128, dtype=jnp.bfloat16),
    # Hopper kernel (bf16, q/k 192, v 128 unless noted)
    _pc("causal_ragged_one_tile", LENS, None, True, _FP90),
    # 4 q tiles, sequences straddling tiles, several 64-key tiles per CTA: every loop kind (skip,
    # masked, unmasked) runs; rows past Tq (a partial last tile) are dropped by TMA.
    _pc("causal_multi_tile", [150, 1, 0, 230, 7], None, True, _FP90),
    _pc(
        "causal_multi_tile_no_sched_2stages",
        [150, 1, 0, 230, 7],
        None,
        True,
        _FP90,
        dict(schedule_barrier=False, num_stages=2),
    ),
    # bottom-right aligned causal with q shorter than k, and q longer than k (empty rows)
    _pc("causal_q_shorter_than_k", [5, 0, 37, 1, 20], [9, 3, 60, 1, 27], True, _FP90),
    _pc("causal_q_longer_than_k", [12, 3, 70], [4, 0, 66], True, _FP90),
    # context-chunk pass: non-causal, each sequence's queries against its own chunk rows
    _pc("noncausal_chunk", [5, 0, 37, 1, 20], [9, 3, 200, 1, 7], False, _FP90),
    _pc(
        "noncausal_chunk_f16_4heads",
        [70, 64, 1],
        [130, 0, 65],
        False,
        _FP90,
        dict(num_stages=2),
        n=4,
        dtype=jnp.float16,
    ),
    _pc("single_token_sequences", [1, 1, 1, 1, 1], None, True, _FP90, n=3),
    # Tq < 64 and Tk < block_k: the only shapes padded by the wrapper
    _pc("tiny", [3, 9], None, True, _FP90),
    # rows before the first sequence are NaN padding (q and k): the first key tile starts below
    # the first visible key (8-row TMA alignment) and its NaN V rows must be zeroed
    _pc("start_offsets_nan_before", [10, 40], [13, 21], True, _FP90, q_start=3, k_start=5),
    # the non-pow2 head dims the API allows: q/k 128, v 64
    _pc("head_dims_128_64", [33, 90], None, True, _FP90, dq=128, dv=64),
]

_VARLEN = [700, 0, 1, 129, 1000]

# On the GPU (q/k 192, v 128, bf16 unless noted).
PREFILL_GPU_CASES = [
    # both kernels
    _pc("varlen_causal_n8", _VARLEN, None, True, _FP_BOTH, seed=0, bench=True, n=8),
    _pc("varlen_noncausal_n8", _VARLEN, [300, 5, 0, 640, 64], False, _FP_BOTH, seed=0, n=8),
    _pc("chunk_noncausal_n8", [300, 5, 0, 64, 257], [1000, 3, 0, 640, 64], False, _FP_BOTH, bench=True, n=8),
    _pc(
        "causal_q_shorter_than_k_n8", [300, 5, 64, 200], [1000, 3, 640, 64], True, _FP_BOTH, seed=3003, bench=True, n=8
    ),
    _pc("fixed_2x1024_n16", [1024, 1024], None, True, _FP_BOTH, bench=True, n=16),
    # Triton kernel: f32, tuning variants
    _pc("varlen_causal_n8_f32", _VARLEN, None, True, _FP, seed=0, n=8, dtype=jnp.float32),
    _pc("varlen_noncausal_n8_f32", _VARLEN, [300, 5, 0, 640, 64], False, _FP, seed=0, n=8, dtype=jnp.float32),
    _pc("varlen_causal_n4_f32", [300, 0, 1, 129, 77], None, True, _FP, bench=True, n=4, dtype=jnp.float32),
    _pc(
        "tuning_bq64_bk32_w4_s3",
        [300, 17, 0, 513],
        None,
        True,
        _FP,
        dict(block_q=64, block_k=32, num_warps=4, num_stages=3),
        seed=0,
        bench=True,
        n=4,
    ),
    _pc(
        "tuning_bq128_bk128_w8_s2",
        [300, 17, 0, 513],
        None,
        True,
        _FP,
        dict(block_q=128, block_k=128, num_warps=8, num_stages=2),
        seed=0,
        n=4,
    ),
    _pc(
        "tuning_bq128_bk64_w8_s3",
        [300, 17, 0, 513],
        None,
        True,
        _FP,
        dict(block_q=128, block_k=64, num_warps=8, num_stages=3),
        seed=0,
        n=4,
    ),
    # Hopper kernel: its tuning, f16, start offsets, the padded path
    _pc("causal_1000_3000_n16", [1000, 3000], None, True, _FP90, seed=3002, bench=True, n=16),
    _pc("fixed_2x1024_n16_no_sched", [1024, 1024], None, True, _FP90, dict(schedule_barrier=False), seed=3004, n=16),
    _pc("varlen_causal_n4_no_sched", _VARLEN, None, True, _FP90, dict(schedule_barrier=False), bench=True, n=4),
    _pc("varlen_causal_n4_p_in_smem", _VARLEN, None, True, _FP90, dict(p_in_smem=True), seed=3005, bench=True, n=4),
    _pc(
        "varlen_causal_n4_bk64_s4",
        _VARLEN,
        None,
        True,
        _FP90,
        dict(block_k=64, num_stages=4),
        seed=3006,
        bench=True,
        n=4,
    ),
    _pc(
        "chunk_noncausal_n4_f16",
        [513, 77, 1],
        [900, 77, 2],
        False,
        _FP90,
        seed=3007,
        bench=True,
        n=4,
        dtype=jnp.float16,
    ),
    _pc("start_offsets_nan_before_n4", [10, 40, 333], [13, 21, 500], True, _FP90, seed=3008, n=4, q_start=3, k_start=5),
    _pc("tiny_n2", [3, 9], None, True, _FP90, seed=3009, n=2),
]


# ---------------------------------------------------------------------------------------------
# Sparse decode (DeepSeek-V3.2): each query row attends to the cache slots of its [K] table


def sparse_decode_inputs(
    seed, *, b, nq, n, k, lens, l=512, r=64, g=64, cache_dtype="bf16", q_dtype="bf16", causal=False, dense=False
):
    """(q, cache, topk_slots, kv_scale, block_table, seq_lens) with NaN poison: every cache row and scale that
    no table names is NaN, q rows with an empty table are NaN. Request i has lens[i] tokens in random pages;
    row (i, t) sees lens[i] (causal: lens[i] - (nq - 1 - t)) of them and names min(k, seen) - 1 of those (one
    -1 hole) in random order, scattered among -1 entries; `dense`: all it sees, in order, -1 after (the
    dense decode's rows: compare with mla_decode_reference on block_table / seq_lens)."""
    rng = np.random.default_rng(seed)
    lens = np.asarray(lens)
    used = [cdiv(int(x), g) for x in lens]
    max_pages = max(max(used), 1)
    spare = 3
    num_pages = sum(used) + spare
    perm = rng.permutation(num_pages)
    block_table = np.empty((b, max_pages), np.int32)
    pos = 0
    for i in range(b):
        block_table[i, : used[i]] = perm[pos : pos + used[i]]
        block_table[i, used[i] :] = rng.choice(perm[num_pages - spare :], max_pages - used[i])
        pos += used[i]
    if causal:
        seq_lens = lens[:, None] - (nq - 1) + np.arange(nq)[None, :]
    else:
        seq_lens = np.repeat(lens[:, None], nq, axis=1)
    seq_lens = np.where(lens[:, None] > 0, np.maximum(seq_lens, 0), 0).astype(np.int32)
    table = np.full((b, nq, k), -1, np.int32)
    for i in range(b):
        for t in range(nq):
            seen = int(seq_lens[i, t])
            if dense:
                chosen = np.arange(min(seen, k))
                cols = np.arange(chosen.size)
            else:
                count = max(min(k, seen) - 1, min(seen, 1))
                chosen = rng.choice(seen, count, replace=False) if count else np.zeros(0, int)
                cols = np.sort(rng.choice(k, count, replace=False))
            table[i, t, cols] = block_table[i, chosen // g] * g + chosen % g
    cache = np.full((num_pages * g, l + r), np.nan, np.float32)
    named = np.unique(table[table >= 0])
    cache[named] = rng.standard_normal((named.size, l + r))
    cache = cache.reshape(num_pages, g, l + r)
    q = rng.standard_normal((b, nq, n, l + r)).astype(np.float32)
    q[(table >= 0).sum(-1) == 0] = np.nan
    kv_scale = None
    if cache_dtype == "fp8":
        cache_j = jnp.asarray(cache * 2.0).astype(jnp.float8_e4m3fn)
        sc = np.full(num_pages * g, np.nan, np.float32)
        sc[named] = rng.uniform(0.25, 0.75, named.size)
        kv_scale = jnp.asarray(sc.reshape(num_pages, g))
    else:
        cache_j = jnp.asarray(cache).astype(jnp.bfloat16)
    q_j = jnp.asarray(q).astype(jnp.float32 if q_dtype == "f32" else jnp.bfloat16)
    return q_j, cache_j, jnp.asarray(table), kv_scale, jnp.asarray(block_table), jnp.asarray(seq_lens)


# (name, sparse_decode_inputs keywords, kernel keywords, DECODE_TOL kind): interpreted on CPU, small shapes
SPARSE_DECODE_CASES = [
    (
        "n16_g16_2splits_bf16",
        dict(b=3, nq=1, n=16, k=48, lens=[90, 0, 20], l=64, r=16, g=16),
        dict(num_kv_splits=2, block_kv=16),
        "bf16",
    ),
    (
        "n4_padded_heads_k40_f32q",
        dict(b=2, nq=1, n=4, k=40, lens=[70, 33], l=32, r=16, g=8, q_dtype="f32"),
        dict(block_kv=16),
        "f32",
    ),
    ("n128_two_head_blocks", dict(b=1, nq=1, n=128, k=32, lens=[50], l=32, r=16, g=16), dict(block_kv=16), "bf16"),
    (
        "q3_causal_multi_token_rows",
        dict(b=2, nq=3, n=16, k=24, lens=[40, 2], l=64, r=16, g=16, causal=True),
        dict(num_kv_splits=3, block_kv=16),
        "bf16",
    ),
    (
        "fp8_2splits",
        dict(b=2, nq=2, n=16, k=64, lens=[150, 9], l=64, r=16, g=32, cache_dtype="fp8"),
        dict(num_kv_splits=2, block_kv=32),
        "fp8",
    ),
    ("l512_r64_default_tuning", dict(b=2, nq=1, n=16, k=64, lens=[100, 64], l=512, r=64, g=64), {}, "bf16"),
]

# On the GPU (L = 512, R = 64, page 64, top-k 2048): the V3.2 shapes, ragged, short (< K) and empty rows.
SPARSE_DECODE_GPU_CASES = [
    ("n128_k2048_bf16", dict(b=3, nq=1, n=128, k=2048, lens=[5000, 700, 0]), {}, "bf16"),
    ("n16_k2048_fp8", dict(b=4, nq=1, n=16, k=2048, lens=[9000, 2048, 1, 3000], cache_dtype="fp8"), {}, "fp8"),
    ("q2_causal_n64_k2048_bf16", dict(b=2, nq=2, n=64, k=2048, lens=[4000, 30], causal=True), {}, "bf16"),
    (
        "n128_k2048_fp8_splits4",
        dict(b=2, nq=1, n=128, k=2048, lens=[3000, 2500], cache_dtype="fp8"),
        dict(num_kv_splits=4),
        "fp8",
    ),
]


# ---- block-scaled fp8 GEMM (pallas_kernels.fp8_matmul) ----

# On the GPU the fp8 wgmma accumulates each 128-deep block at reduced precision (Hopper: ~13 mantissa bits per
# 32-deep step, "FP22"; simulated: ~1.2e-4 of max|ref| at K = 7168), so float32 rounding (1e-5) is out of
# reach; the bugs looked for (a neighbouring block's or row's scale, a stage overwritten early) are >= 1e-2.
FP8_GEMM_GPU_TOL = 2e-3


def _pow2(idx, period: int, shift: int) -> np.ndarray:
    return np.exp2(np.asarray(idx) % period - shift).astype(np.float32)


def _e4m3_values(rng, shape) -> np.ndarray:
    """Random e4m3 values of every exponent and both signs, as float32."""
    v = np.clip(rng.standard_normal(shape) * 64, -448, 448).astype(np.float32)
    return v.astype(jnp.float8_e4m3fn).astype(np.float32)


def fp8_lossless_operands(rng, m, n, k, lead=(), *, act_block=True, act_row=True, w_block=True):
    """Operands of the block-scaled fp8 GEMM whose quantization is lossless, with scales that differ between
    neighbours, so that the float64 product of the dequantized inputs is the exact reference and a scale taken
    from the wrong K block, row, N block or expert is off by >= 2x on a block.

    x f32 [M, K] (bf16-exact): e4m3 values with a +-448 in every (row, 128-deep K block), times the activation
    scale xs [M, Kb] = 2^(j % 7 - 3) (act_block) * 2^(r % 5 - 2) (act_row) of K block j, row r, which
    `quantize_act` then recovers exactly. wq e4m3 [*lead, N, K] with scale_inv ws [*lead, Nb, Kb] =
    2^((e + i + 2 j) % 7 - 3) (w_block; else 1) for N block i, K block j of the e-th (flattened lead) weight.
    Returns (x, xs, wq, ws, wd: the dequantized weights in float64)."""
    kb, nb = k // 128, cdiv(n, 128)
    q = _e4m3_values(rng, (m, kb, 128))
    q[np.arange(m)[:, None], np.arange(kb)[None], rng.integers(0, 128, (m, kb))] = 448 * rng.choice([-1, 1], (m, kb))
    xs = np.ones((m, kb), np.float32)
    if act_block:
        xs = xs * _pow2(np.arange(kb), 7, 3)[None, :]
    if act_row:
        xs = xs * _pow2(np.arange(m), 5, 2)[:, None]
    x = (q * xs[..., None]).reshape(m, k)
    e = np.arange(int(np.prod(lead, dtype=int))).reshape(*lead, 1, 1)
    ws = _pow2(e + np.arange(nb)[:, None] + 2 * np.arange(kb)[None], 7, 3)  # [*lead, Nb, Kb]
    if not w_block:
        ws = np.ones_like(ws)
    wq = _e4m3_values(rng, (*lead, n, k))
    wd = wq.astype(np.float64) * np.repeat(np.repeat(ws, 128, axis=-2)[..., :n, :], 128, axis=-1)
    return x, xs, wq.astype(jnp.float8_e4m3fn), ws, wd
