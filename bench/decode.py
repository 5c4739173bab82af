"""Benchmark of the Pallas paged latent-MQA decode kernels on one GPU: the Triton-lowered
pallas_kernels/mla_decode.py (rows "pallas") and, on Hopper, the Mosaic GPU pallas_kernels/mla_decode_sm90.py
(rows "pallas_sm90"), side by side on the same inputs.

    PYTHONPATH=. python3 bench/decode.py --out DIR [--sweep] [--quick] [--kernels pallas,pallas_sm90]
        [--knob MODULE.NAME=V1,V2] [--only KEY=VALUE,...]

(a) checks the kernels against the float32 reference on fresh random inputs with NaN-poisoned unused
    pages: the GPU test cases marked `bench` in pallas_kernels/testing.py (exits 1 on any mismatch
    of the Triton kernel; an sm90 mismatch is logged, recorded under "checks" and its timing rows
    are skipped), (b) measures the copy/matmul ceilings, (c) times the
    kernels (bf16 and fp8 caches, page 64) and the XLA backend (the reference under jit, bf16) on the
    project's decode shapes and writes DIR/decode-h200.json, then the ragged batch (128 requests, lengths
    log-uniform in [256, 32k], seeded) against uniform requests of the same total tokens, per kernel, N 16 and
    128 (rows with `ragged` and `ragged_over_uniform`; --no-ragged skips them), and speculative verification rows
    (Q = 3 causal query tokens, 16 heads: rows with `Q`) through both kernels; (d) with --sweep also times
    tuning variants per shape (Triton: block_h, block_kv, num_warps, num_stages, num_kv_splits; sm90: num_kv_splits,
    num_stages, fp8_stages, fp8_qk) into DIR/decode-sweep.json. --knob runs an A/B of a kernel module's switch in
    one process (each value's rows on the same inputs, rows tagged `knob`; the check runs for the values other than
    the module's own, whose cases the GPU tests run: each value's check compiles ~14 kernels, 200-330 s from a cold
    cache); --only times a subset of the rows.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Triton lowering warns per call

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import mla_decode as md  # noqa: E402
from pallas_kernels import mla_decode_sm90 as k90  # noqa: E402
from pallas_kernels import mla_decode_sm90_narrow as k90_narrow  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.util import cdiv, num_sms  # noqa: E402

L, R = 512, 64
PAGE = 64
SCALE = testing.DECODE_SCALE  # DeepSeek-V3: 192^-0.5 * mscale^2
SHAPES = [(64, 16, 4096), (128, 16, 8192), (64, 128, 4096), (128, 128, 8192), (1, 128, 32768), (32, 16, 1024)]
ROW_BYTES = {"bf16": (L + R) * 2, "fp8": (L + R) + 4}
L2_BYTES = 60 << 20


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Inputs, built on device.


def random_cache(key, scale_key, num_pages, page, width, dtype):
    """A random page pool [num_pages, page, width] and, for fp8, its per-token scales."""
    if dtype == "bf16":
        return jax.random.normal(key, (num_pages, page, width), jnp.bfloat16), None
    cache = (jax.random.normal(key, (num_pages, page, width), jnp.float32) * 2.0).astype(jnp.float8_e4m3fn)
    return cache, jax.random.uniform(scale_key, (num_pages, page), jnp.float32, 0.25, 0.75)


def make_inputs(key, b, nq, n, ctx, dtype, *, page=PAGE, extra_pages=3, width=L + R):
    """Cache pool with B*ctx/page used pages in random order (plus spare pages), uniform lengths;
    rows `width` wide (L + R)."""
    ppr = ctx // page
    num_pages = b * ppr + extra_pages
    k = jax.random.split(key, 4)
    q = jax.random.normal(k[0], (b, nq, n, width), jnp.bfloat16)
    bt = jax.random.permutation(k[1], num_pages)[: b * ppr].reshape(b, ppr).astype(jnp.int32)
    cache, kv_scale = random_cache(k[2], k[3], num_pages, page, width, dtype)
    seq_lens = jnp.broadcast_to(ctx - nq + 1 + jnp.arange(nq, dtype=jnp.int32), (b, nq))  # causal rows
    return q, cache, bt, seq_lens, kv_scale


# Speculative verification rows (k = 2: 3 causal query tokens per request) at 16 heads: 48 rows, where the
# Hopper kernel was measured faster than Triton here (1.03-1.58x), which set `attention.SM90_MIN_ROWS`.
SPEC_SHAPES = [(8, 3, 16, 4096), (32, 3, 16, 1024), (32, 3, 16, 4096)]  # (B, Q, N, ctx)
RAGGED = dict(b=128, lo=256, hi=32768, seed=0)  # issue #21: lengths log-uniform in [256, 32k]


def ragged_lengths(b=RAGGED["b"], lo=RAGGED["lo"], hi=RAGGED["hi"], seed=RAGGED["seed"]) -> np.ndarray:
    """b request lengths, log-uniform in [lo, hi] (seeded: the same mix on every run)."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(np.log(lo), np.log(hi), b)).astype(np.int32)


def make_ragged_inputs(key, lens, n, dtype, *, page=PAGE, width=L + R):
    """Like `make_inputs` for per-request lengths `lens`: each request owns cdiv(len, page) pages of a
    shuffled pool; block table entries past a request's pages point at page 0 (never read)."""
    b = len(lens)
    ppr = [cdiv(int(x), page) for x in lens]
    max_pages, num_pages = max(ppr), sum(ppr) + 1
    k = jax.random.split(key, 4)
    q = jax.random.normal(k[0], (b, 1, n, width), jnp.bfloat16)
    perm = np.asarray(jax.random.permutation(k[1], np.arange(1, num_pages)))
    bt = np.zeros((b, max_pages), np.int32)
    offs = np.cumsum([0] + ppr)
    for i, m in enumerate(ppr):
        bt[i, :m] = perm[offs[i] : offs[i] + m]
    cache, kv_scale = random_cache(k[2], k[3], num_pages, page, width, dtype)
    seq_lens = jnp.asarray(np.asarray(lens, np.int32)[:, None])
    return q, cache, jnp.asarray(bt), seq_lens, kv_scale


def ragged_rows(timed_kernels, n, dtype, ceil) -> list[dict]:
    """Issue #21's ragged batch: 128 requests, lengths log-uniform in [256, 32k], against uniform requests
    with the same total tokens (B = 128, ctx = total / 128 rounded to a page): `ragged_over_uniform` per
    kernel (target <= 1.1x). `us` counts the same bytes in both, so TB/s compares directly."""
    lens = ragged_lengths()
    total = int(lens.sum())
    b = len(lens)
    ctx = max(PAGE, round(total / b / PAGE) * PAGE)
    rag = [make_ragged_inputs(jax.random.key(j), lens, n, dtype) for j in range(2)]
    uni = [make_inputs(jax.random.key(j), b, 1, n, ctx, dtype) for j in range(2)]
    rows = []
    for name, fn, extra in timed_kernels:
        try:
            us_r, us_u = timed(fn, rag, 20, 7), timed(fn, uni, 20, 7)
        except Exception as e:  # noqa: BLE001
            rows.append({"kernel": name, "N": n, "dtype": dtype, "ragged": True, **extra, "error": str(e)[:400]})
            continue
        row = row_for(name, b, n, ctx, dtype, us_r, ceil, **extra)  # bytes: the same total tokens
        row |= dict(
            ragged=RAGGED | {"dist": "log-uniform", "max_len": int(lens.max()), "total_tokens": total},
            uniform_us=round(us_u, 2),
            ragged_over_uniform=round(us_r / us_u, 3),
        )
        rows.append(row)
        log(f"{name} {dtype} ragged B={b} N={n} ({total} tokens): {us_r:.1f} us vs uniform ctx {ctx}: {us_u:.1f} us")
    return rows


def rel_and_lse_err(out, lse, ref, ref_lse) -> tuple[float, float]:
    """||out - ref|| / ||ref||, and max |lse - ref_lse| over the rows whose reference lse is finite (rows with
    tokens); numpy inputs."""
    fin = np.isfinite(ref_lse)
    rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    return float(rel), float(np.max(np.abs(np.where(fin, lse, 0.0) - np.where(fin, ref_lse, 0.0))))


def check_correctness(decode, kernel) -> bool:
    """Kernel vs float32 reference on the GPU: the `bench` cases of `kernel` in
    pallas_kernels/testing.py (bf16 and fp8, splits, causal Q>1, ragged, empty), at the GPU tests'
    tolerances."""
    ok = True
    for i, case in enumerate(testing.cases_for(testing.DECODE_GPU_CASES, kernel, bench=True)):
        inp, kw = case.inputs, case.kernel
        b, nq, n, g = inp["b"], inp["nq"], inp["n"], inp.get("g", PAGE)
        dtype, causal = inp.get("cache_dtype", "bf16"), inp.get("causal", False)
        try:
            q, cache, bt, sl, ks = case.make()
            out, lse = decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, **kw)
            kind = testing.decode_kind(case)
            tol, lse_tol = testing.decode_gpu_tolerance(kind)
            note = ""
            if kw.get("fp8_qk"):
                # The kernel's logits are those of its fp8 q (one e4m3 term, or two with fp8 P.V), accumulated by the
                # fp8 wgmma with reduced precision (pallas_kernels/testing.py DECODE_TOL); the error against the
                # exact q is reported, not checked: it is the mode's quantization error.
                exact = np.asarray(md.mla_decode_reference(q, cache, bt, sl, scale=SCALE, kv_scale=ks)[0], np.float32)
                exact_err = float(np.nanmax(np.abs(np.asarray(out, np.float32) - exact)))
                note = f" (vs exact q: max|err| {exact_err:.2e})"
            ref, ref_lse = testing.decode_reference(q, cache, bt, sl, ks, kw, case.l, scale=SCALE)
            out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
            lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
            # bf16 output rounding: elementwise |err| <= 2e-2 + 2e-2 |ref|, and 1e-2 relative in norm.
            err = float(np.max(np.abs(out - ref) - tol * np.abs(ref)))
            rel, lse_err = rel_and_lse_err(out, lse, ref, ref_lse)
            lse_fin = np.isfinite(ref_lse)
            good = (
                np.all(np.isfinite(out))
                and err < tol
                and rel < (testing.FP8_PV_NORM_TOL if kind == "fp8_pv" else tol / 2)
                and lse_err < lse_tol
                and np.array_equal(np.isfinite(lse), lse_fin)
            )
            log(
                f"check {i}: B={b} Q={nq} N={n} G={g} {dtype} causal={causal} {kw}: max(|err|-{tol}|ref|)={err:.2e} "
                f"rel={rel:.2e} lse_err={lse_err:.2e}{note} {'ok' if good else 'FAIL'}"
            )
        except Exception as e:  # noqa: BLE001
            good = False
            log(f"check {i}: ERROR {type(e).__name__}: {e}")
            traceback.print_exc()
        ok &= bool(good)
    return ok


# ----------------------------------------------------------------------------------------------
# Timing.


def timed(fn, arg_sets, iters, reps):
    return common.time_fn(fn, arg_sets, iters=iters, reps=reps, warmup=2)


def arg_sets_for(b, n, ctx, dtype, seed=0, pool_gb=0.0):
    """Input sets whose caches together exceed 3x L2; with pool_gb, one set whose page pool holds at least that
    many GB (a server's pool: the used pages spread over it in random order)."""
    nbytes = b * ctx * ROW_BYTES[dtype]
    n_sets = 1 if pool_gb else int(min(6, max(1, math.ceil(3 * L2_BYTES / nbytes))))
    extra = max(3, math.ceil(pool_gb * 1e9 / (PAGE * ROW_BYTES[dtype])) - b * (ctx // PAGE))
    return [make_inputs(jax.random.key(seed + j), b, 1, n, ctx, dtype, extra_pages=extra) for j in range(n_sets)]


def kernel_fn(**tuning):
    def f(q, cache, bt, sl, ks):
        return md.mla_decode(q, cache, bt, sl, scale=SCALE, kv_scale=ks, **tuning)

    return jax.jit(f)


def sm90_fn(rows64=False, **tuning):
    """The Hopper decode; rows64: the 64-row-tile kernel even where the narrow one would run (the A/B
    rows of few-row shapes: the narrow kernel's limit is lowered while the call is traced)."""

    def f(q, cache, bt, sl, ks):
        if not rows64:
            return k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, kv_scale=ks, **tuning)
        limit = k90_narrow.NARROW_MAX_ROWS
        k90_narrow.NARROW_MAX_ROWS = 0
        try:
            return k90.mla_decode_sm90(q, cache, bt, sl, scale=SCALE, kv_scale=ks, **tuning)
        finally:
            k90_narrow.NARROW_MAX_ROWS = limit

    return jax.jit(f)


def sm90_tile(b, rows, dtype):
    """Which Hopper kernel runs: "narrow" (tokens on M) or "rows64"."""
    return "narrow" if k90.uses_narrow(rows, jnp.float8_e4m3fn if dtype == "fp8" else jnp.bfloat16) else "rows64"


def sm90_splits(b, n, ctx):
    return k90.choose_num_kv_splits_sm90(b, cdiv(n, k90.TILE_M), cdiv(ctx, PAGE), num_sms())


def sm90_sweep_variants(dtype, splits, m_rows):
    variants = [{"num_kv_splits": s} for s in (splits * 2, max(1, splits // 2)) if s != splits and s <= 2 * 132]
    if dtype == "bf16":
        variants.append({"num_stages": 1})
    if dtype == "fp8":
        variants.append({"fp8_stages": 1})
        if k90.uses_fp8_pv(m_rows, "float8_e4m3fn"):  # the fp8 P.V kernel's ring: one page pair, not two
            variants.append({"fp8_qk": True, "fp8_stages": 2})
        else:  # fp8 QK^T (q quantized per row): fp8 ring depth vs V ring depth
            variants += [{"fp8_qk": True, "fp8_stages": 2}, {"fp8_qk": True, "num_stages": 2, "fp8_stages": 1}]
    return variants


def stage1_fn(**tuning):
    """Stage 1 alone (partials), to see what the LSE merge costs."""

    def f(q, cache, bt, sl, ks):
        tun = {k: tuning.get(k) for k in ("block_h", "block_kv", "num_warps", "num_stages", "num_kv_splits")}
        return md._mla_decode_impl(
            q,
            cache,
            bt,
            sl,
            ks,
            scale=SCALE,
            kv_lora_rank=L,
            batch_invariant=False,
            interpret=False,
            return_partials=True,
            **tun,
        )

    return jax.jit(f)


def xla_fn():
    def f(q, cache, bt, sl, ks):
        return md.mla_decode_reference(q, cache, bt, sl, scale=SCALE, kv_scale=ks)

    return jax.jit(f)


def row_for(kernel, b, n, ctx, dtype, us, ceil, nq=1, **extra):
    tbps = b * ctx * ROW_BYTES[dtype] / (us * 1e-6) / 1e12
    tflops = 2 * b * nq * n * ctx * (576 + 512) / (us * 1e-6) / 1e12
    row = {
        "kernel": kernel,
        "B": b,
        "N": n,
        "ctx": ctx,
        "page": PAGE,
        "dtype": dtype,
        "us": round(us, 2),
        "TBps": round(tbps, 3),
        "TFLOPs": round(tflops, 1),
        "frac_copy": round(tbps / ceil["copy_TBps"], 3),
        "frac_matmul": round(tflops / ceil["matmul_TFLOPs"], 3),
    }
    if nq > 1:
        row["Q"] = nq
    row.update(extra)
    return row


def variant_row(kernel, make_fn, v, sets, srow, ceil, device_time=False):
    """A sweep row for tuning variant `v`: its timing (compile included in compile_and_time_s), with
    device_time also the GPU's busy time per call (what decides at batch 1, where launch overhead
    dominates the wall time), or the error that stopped it (recorded, skipped)."""
    t0 = time.time()
    try:
        fn = make_fn()
        us = timed(fn, sets, 10, 3)
        extra = common.device_time_us(fn, sets) if device_time else {}
        return row_for(
            kernel,
            srow["B"],
            srow["N"],
            srow["ctx"],
            srow["dtype"],
            us,
            ceil,
            variant=v,
            compile_and_time_s=round(time.time() - t0, 1),
            **extra,
        )
    except Exception as e:  # noqa: BLE001
        return {**srow, "kernel": kernel, "variant": v, "error": f"{type(e).__name__}: {str(e)[-300:]}"}


def sweep_variants(n, dtype, num_splits_default):
    """Prune: one-at-a-time moves around the default, most informative first (compile time is the
    cost: ~1 s a bf16 variant, up to ~10 s an fp8 one at 16 rows)."""
    variants = [{}]
    if dtype == "fp8":
        variants.append({"fp8_mode": "dequant_tile"})
    s0 = num_splits_default
    for s in (s0 * 2, max(1, s0 // 2), s0 * 4, s0 * 8):  # x4, x8: few-request shapes
        if s != s0 and s <= 2 * 132:
            variants.append({"num_kv_splits": s})
    if s0 >= 8:  # few requests: splits finer than the default 128-token blocks allow, so that more SMs read
        variants += [{"block_kv": 64, "num_kv_splits": s0 * 2}, {"block_kv": 64, "num_kv_splits": s0 * 4}]
    if n <= 16:
        cand = {"block_kv": [32, 64, 128] if dtype == "fp8" else [64, 128], "num_stages": [2, 3], "num_warps": [4, 8]}
    else:
        cand = {"block_kv": [32, 64], "num_stages": [2, 3], "block_h": [32, 64], "num_warps": [8]}
    for k, vals in cand.items():
        for v in vals:
            variants.append({k: v})
    if n > 64:  # all 128 rows in one program: K read once, 16 warps to hold the [128, L] accumulator
        variants.append({"block_h": 128, "num_warps": 16, "block_kv": 32, "num_stages": 2})
    out, seen = [], set()
    for v in variants:
        key = tuple(sorted(v.items()))
        if key not in seen:
            seen.add(key)
            out.append(v)
    return out


_REFS: dict = {}  # the float32 references of the last input set `reference_f32` saw, by q_terms ("q": its q)


def reference_f32(args, q_terms: int = 0):
    """(out, lse) of the float32 reference over the dequantized cache as numpy, computed once for the rows of one
    input set: with the exact q (q_terms 0), or with the q an fp8_qk kernel multiplies (its 1 or 2 e4m3 terms,
    `fp8_qk_reference_q`)."""
    q, cache, bt, sl, ks = args
    if _REFS.get("q") is not q:
        _REFS.clear()
        _REFS["q"] = q  # kept: its id stays its own while cached
    if q_terms not in _REFS:
        qr = q if q_terms == 0 else k90.fp8_qk_reference_q(q, split=q_terms == 2)
        ref, ref_lse = md.mla_decode_reference(qr, cache, bt, sl, scale=SCALE, kv_scale=ks)
        _REFS[q_terms] = (np.asarray(ref, np.float32), np.asarray(ref_lse, np.float32))
    return _REFS[q_terms]


def fp8_qk_terms(n_rows: int, extra: dict) -> int:
    """The e4m3 terms of q a row's fp8_qk kernel multiplies (`k90.fp8_qk_q_terms`; 0: not fp8_qk)."""
    if not extra.get("fp8_qk"):
        return 0
    return k90.fp8_qk_q_terms(n_rows, "float8_e4m3fn", fp8_q_split=extra.get("fp8_q_split"))


def error_vs_f32(fn, args, q_terms: int = 0) -> dict:
    """The row's error on its own inputs against the float32 reference over the dequantized cache with the
    exact q (lossy modes included: their rounding of q is part of the error, as FlashMLA's rounding of P is of
    its): rel_err and lse_err (natural log) as `rel_and_lse_err`. An fp8_qk row (`q_terms` > 0) also gets them
    against the reference on the q it multiplies (rel_err_own_q, lse_err_own_q): FlashMLA's footing (its fp8 kernel
    takes q in e4m3, and its test's reference uses that q), where the mode's error is its rounding of P."""
    out, lse = (np.asarray(a, np.float32) for a in fn(*args))
    res = {}
    for suffix, terms in [("", 0)] + [("_own_q", q_terms)] * (q_terms > 0):
        rel, lse_err = rel_and_lse_err(out, lse, *reference_f32(args, terms))
        res |= {f"rel_err{suffix}": float(f"{rel:.3g}"), f"lse_err{suffix}": float(f"{lse_err:.3g}")}
    return res


def parse_knob(spec: str):
    """`MODULE.NAME=V1,V2,...` (--knob) -> (the pallas_kernels module, NAME, [values]): a module-level switch that
    the kernels read at trace time, each value a Python literal of the switch's current type."""
    target, sep, values = spec.partition("=")
    mod_name, dot, name = target.rpartition(".")
    if not (sep and dot and values):
        raise ValueError(f"--knob {spec!r}: expected MODULE.NAME=V1,V2 (e.g. mla_decode_sm90_narrow.PDL=False,True)")
    try:
        module = importlib.import_module(f"pallas_kernels.{mod_name}")
    except ImportError as e:
        raise ValueError(f"--knob {spec!r}: no module pallas_kernels.{mod_name}") from e
    if not hasattr(module, name):
        raise ValueError(f"--knob {spec!r}: pallas_kernels.{mod_name} has no {name}")
    current = getattr(module, name)
    try:  # one list of literals: a value may hold commas itself (a dict, a tuple)
        out = ast.literal_eval(f"[{values}]")
    except (ValueError, SyntaxError) as e:
        raise ValueError(f"--knob {spec!r}: {values!r} is not a comma-separated list of Python literals") from e
    for val in out:
        if type(val) is not type(current):
            raise ValueError(f"--knob {spec!r}: {val!r} is {type(val).__name__}, {name} is {type(current).__name__}")
    return module, name, out


def knob_values_to_check(values, default):
    """The --knob values whose sm90 check runs: those other than the module's own (the GPU tests check that one),
    or the module's own where it is the only value."""
    return [v for v in values if v != default] or list(values[:1])


def set_knob(module, name, value):
    """Set a module-level switch and drop the compiled kernels (they read it at trace time)."""
    setattr(module, name, value)
    jax.clear_caches()


def parse_only(spec: str) -> dict:
    """`KEY=V,KEY=V` (--only) -> {KEY: value}: the rows timed are those whose fields include these."""
    out = {}
    for item in filter(None, spec.split(",")):
        key, sep, v = item.partition("=")
        if not sep:
            raise ValueError(f"--only {spec!r}: {item!r} is not KEY=VALUE (e.g. fp8_qk=True)")
        try:
            out[key.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = v.strip()  # a bare word: a string (schedule=grid)
    return out


def kernel_row(name, fn, sets, b, n, ctx, dtype, ceil, extra, device_time=False, nq=1) -> dict:
    """One timed row of kernel `name` (with device_time also its device time from a profiler trace), or the
    error that stopped it (recorded, not raised)."""
    what = f"{name} {dtype} B={b}" + (f" Q={nq}" if nq > 1 else "") + f" N={n} ctx={ctx}"
    try:
        us = timed(fn, sets, 20, 7)
        if device_time:  # kernel time without host dispatch (see common.device_time_us)
            extra = {**extra, **common.device_time_us(fn, sets)}
        extra = {**extra, **error_vs_f32(fn, sets[0], fp8_qk_terms(nq * n, extra))}
        row = row_for(name, b, n, ctx, dtype, us, ceil, nq=nq, **extra)
        log(f"{what}: {us:.1f} us {extra} {row['TBps']} TB/s {row['TFLOPs']} TFLOP/s")
        return row
    except Exception as e:  # noqa: BLE001
        err = f"{type(e).__name__}: {str(e)[:400]}"
        log(f"{what} {extra}: ERROR {err}")
        row = {"kernel": name, "B": b, "N": n, "ctx": ctx, "page": PAGE, "dtype": dtype, **extra, "error": err}
        return row | ({"Q": nq} if nq > 1 else {})


def kernels_to_time(b, n, ctx, dtype, run_triton, run_sm90) -> list[tuple]:
    """(kernel, jitted fn, extra row fields) for each decode kernel timed at this shape."""
    out = []
    if run_triton:
        out.append(("pallas", kernel_fn(), {"num_kv_splits": md.choose_num_kv_splits(b, n, ctx, num_sms())}))
    if run_sm90:  # both schedules of the sm90 kernel (static splits; on-device work list)
        tile = sm90_tile(b, n, dtype)
        out.append(
            (
                "pallas_sm90",
                sm90_fn(schedule="grid"),
                {"schedule": "grid", "num_kv_splits": sm90_splits(b, n, ctx), "tile": tile},
            )
        )
        if tile == "narrow":  # the 64-row kernel on the same inputs
            out.append(
                (
                    "pallas_sm90",
                    sm90_fn(rows64=True, schedule="grid"),
                    {"schedule": "grid", "num_kv_splits": sm90_splits(b, n, ctx), "tile": "rows64"},
                )
            )
        out.append(("pallas_sm90", sm90_fn(schedule="worklist"), {"schedule": "worklist"}))
        if dtype == "fp8":  # QK^T as an fp8 wgmma (q quantized per row): its own rows
            out.append(
                (
                    "pallas_sm90",
                    sm90_fn(fp8_qk=True, schedule="grid"),
                    {"schedule": "grid", "fp8_qk": True, "num_kv_splits": sm90_splits(b, n, ctx)},
                )
            )
            if k90.uses_fp8_pv(n, "float8_e4m3fn"):  # 64-row tiles: q as two e4m3 terms too (the option)
                out.append(
                    (
                        "pallas_sm90",
                        sm90_fn(fp8_qk=True, fp8_q_split=True, schedule="grid"),
                        {
                            "schedule": "grid",
                            "fp8_qk": True,
                            "fp8_q_split": True,
                            "num_kv_splits": sm90_splits(b, n, ctx),
                        },
                    )
                )
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", action="store_true", help="also time tuning variants")
    ap.add_argument("--quick", action="store_true", help="two shapes, no xla row (a smoke run; --sweep still sweeps)")
    ap.add_argument("--shapes", default="", help="subset, e.g. 128x16x8192,1x128x32768")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check (tuning runs)")
    ap.add_argument(
        "--device-time",
        action="store_true",
        help="also record each kernel's device time from a profiler trace (device_us, span_us)",
    )
    ap.add_argument(
        "--sweep-budget-s",
        type=float,
        default=180.0,
        help="sweep time over all shapes (split evenly; later variants are skipped)",
    )
    ap.add_argument(
        "--no-ragged",
        action="store_true",
        help="skip the ragged-batch rows (128 requests, lengths log-uniform in [256, 32k], vs uniform)",
    )
    ap.add_argument(
        "--ragged-only",
        action="store_true",
        help="only the correctness check and the ragged-batch rows (no shape grid, no multi-token rows)",
    )
    ap.add_argument(
        "--pool-gb",
        default="",
        help="page pool sizes in GB, e.g. 1,16: each shape's rows again over a pool of at least that size (rows "
        "gain pool_gb; default: a pool of just the used pages)",
    )
    ap.add_argument(
        "--kernels",
        default="pallas,pallas_sm90",
        help="Pallas kernels to time: pallas (Triton) and/or pallas_sm90 (Hopper only)",
    )
    ap.add_argument(
        "--knob",
        default="",
        help="an A/B in one process: MODULE.NAME=V1,V2 (a pallas_kernels module's switch, e.g. "
        "mla_decode_sm90_narrow.PDL=False,True): each shape's rows for every value, on the same inputs, rows tagged "
        "`knob`; the sm90 check for every value but the module's own",
    )
    ap.add_argument("--only", default="", help="time only the rows whose fields include these, e.g. fp8_qk=True")
    args = ap.parse_args()
    try:
        knob = parse_knob(args.knob) if args.knob else None
        only = parse_only(args.only)
    except ValueError as e:
        ap.error(str(e))
    knob_values = knob[2] if knob else [None]
    knob_default = getattr(knob[0], knob[1]) if knob else None

    def with_knob(value) -> dict:
        """Set the knob to `value` (if any); the rows' tag for it."""
        if knob is None:
            return {}
        set_knob(knob[0], knob[1], value)
        return {"knob": f"{knob[1]}={value!r}"}

    def restore_knob():
        if knob is not None:
            set_knob(knob[0], knob[1], knob_default)

    t_start = time.time()
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind}, SMs: {num_sms()}, jax {jax.__version__}")
    kernels = args.kernels.split(",")
    run_triton = "pallas" in kernels
    run_sm90 = "pallas_sm90" in kernels and k90.is_sm90(dev)
    if "pallas_sm90" in kernels and not run_sm90:
        log(f"pallas_sm90: skipped, needs compute capability 9.x (got {getattr(dev, 'compute_capability', None)})")
    checks = {}

    if not args.no_check:
        if run_triton:
            ok = check_correctness(md.mla_decode, testing.MLA_DECODE)
            checks["pallas"] = "PASS" if ok else "FAIL"
            log(f"correctness: {'PASS' if ok else 'FAIL'} ({time.time() - t_start:.0f}s)")
            if not ok:
                sys.exit(1)
        if run_sm90:
            oks = []
            for value in knob_values_to_check(knob_values, knob_default) if knob else [None]:
                name = "pallas_sm90" + "".join(f"[{t}]" for t in with_knob(value).values())
                oks.append(check_correctness(k90.mla_decode_sm90, testing.MLA_DECODE_SM90))
                checks[name] = "PASS" if oks[-1] else "FAIL"
                log(f"correctness {name}: {checks[name]} ({time.time() - t_start:.0f}s)")
            restore_knob()
            run_sm90 = all(oks)  # time only a kernel that computes the right thing

    ceil = common.measure_ceilings()
    log(f"ceilings: {ceil}")
    results = common.results_header(ceil)
    results.update({k: v for k, v in (("knob", args.knob), ("only", args.only)) if v})
    if checks:
        results["checks"] = checks
    sweep = common.results_header(ceil)
    shapes = SHAPES[:1] + SHAPES[4:5] if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in sh.split("x")) for sh in args.shapes.split(",")]
    if args.ragged_only:
        if args.no_ragged:
            ap.error("--ragged-only and --no-ragged leave nothing to time")
        shapes = []
    dtypes = args.dtypes.split(",")

    pools = [float(x) for x in args.pool_gb.split(",") if x]
    for b, n, ctx in shapes:
        for dtype in dtypes:
            # the kernels over each --pool-gb pool (64-bit offsets above 4 GB in Triton), then over the used pages
            # (the last `sets`, which the XLA row and the sweep reuse)
            for pool in [*pools, 0.0]:
                sets = None  # the previous pool's memory back first
                sets = arg_sets_for(b, n, ctx, dtype, pool_gb=pool)
                tag = {"pool_gb": round(sets[0][1].size * sets[0][1].dtype.itemsize / 1e9, 2)} if pool else {}
                for value in knob_values:
                    knob_tag = with_knob(value)
                    for name, fn, extra in kernels_to_time(b, n, ctx, dtype, run_triton, run_sm90):
                        if any({"kernel": name, **extra}.get(k) != v for k, v in only.items()):
                            continue
                        extra = {**extra, **tag, **knob_tag}
                        results["rows"].append(
                            kernel_row(name, fn, sets, b, n, ctx, dtype, ceil, extra, args.device_time)
                        )
                restore_knob()
            splits = md.choose_num_kv_splits(b, n, ctx, num_sms())
            if dtype == "bf16" and not args.quick:
                us = timed(xla_fn(), sets, 5, 3)
                results["rows"].append(row_for("xla", b, n, ctx, dtype, us, ceil))
                log(f"xla    {dtype} B={b} N={n} ctx={ctx}: {us:.1f} us")
            if args.sweep and run_sm90:
                srow = {"B": b, "N": n, "ctx": ctx, "dtype": dtype, "kernel": "pallas_sm90"}
                for v in sm90_sweep_variants(dtype, sm90_splits(b, n, ctx), n):
                    sweep["rows"].append(
                        variant_row("pallas_sm90", lambda: sm90_fn(**v), v, sets, srow, ceil, args.device_time)
                    )
            if args.sweep and run_triton:
                srow = {"B": b, "N": n, "ctx": ctx, "dtype": dtype}
                try:
                    us = timed(stage1_fn(), sets, 10, 3)
                    sweep["rows"].append(row_for("pallas_stage1", b, n, ctx, dtype, us, ceil, num_kv_splits=splits))
                except Exception as e:  # noqa: BLE001
                    sweep["rows"].append({**srow, "kernel": "pallas_stage1", "error": str(e)[:300]})
                t_cfg = time.time()
                for v in sweep_variants(n, dtype, splits):
                    if time.time() - t_cfg > args.sweep_budget_s / (len(dtypes) * len(shapes)):
                        sweep["rows"].append({**srow, "kernel": "pallas", "variant": v, "error": "skipped: budget"})
                        continue
                    sweep["rows"].append(
                        variant_row("pallas", lambda: kernel_fn(**v), v, sets, srow, ceil, args.device_time)
                    )
            del sets
        # Written after every shape so a run cut short by a time limit still leaves its rows.
        common.write_results(os.path.join(args.out, "decode-h200.json"), results)
        if args.sweep:
            common.write_results(os.path.join(args.out, "decode-sweep.json"), sweep)

    if not args.quick and not args.ragged_only:  # multi-token rows: both kernels (called directly, whatever the
        # backend rule picks)
        for b, nq, n, ctx in SPEC_SHAPES:
            sets = [make_inputs(jax.random.key(j), b, nq, n, ctx, "bf16") for j in range(3)]
            for name, fn, extra in kernels_to_time(b, nq * n, ctx, "bf16", run_triton, run_sm90):
                if extra.get("schedule") != "worklist":  # each kernel once, with its default schedule
                    results["rows"].append(kernel_row(name, fn, sets, b, n, ctx, "bf16", ceil, extra, nq=nq))
        common.write_results(os.path.join(args.out, "decode-h200.json"), results)

    if not args.no_ragged and not args.quick:
        for n in (16, 128):
            for dtype in dtypes:
                # the static split grid as the step sizes it: from the block table width (the longest request)
                k = kernels_to_time(RAGGED["b"], n, int(ragged_lengths().max()), dtype, run_triton, run_sm90)
                results["rows"] += ragged_rows(k, n, dtype, ceil)
                common.write_results(os.path.join(args.out, "decode-h200.json"), results)

    log("\n kernel               dtype    B    N    ctx       us   TB/s  TFLOP/s  frac_copy  frac_mm")
    for r in results["rows"]:
        kname = r["kernel"] + (f"/{r['schedule']}" if "schedule" in r else "")
        if "error" in r:
            log(f" {kname:20s} {r['dtype']:5s} {r['B']:4d} {r['N']:4d} {r['ctx']:6d}  ERROR")
            continue
        log(
            f" {kname:20s} {r['dtype']:5s} {r['B']:4d} {r['N']:4d} {r['ctx']:6d} {r['us']:8.1f} "
            f"{r['TBps']:6.2f} {r['TFLOPs']:8.1f} {r['frac_copy']:10.3f} {r['frac_matmul']:8.3f}"
        )
    if args.sweep:
        log("\n best sweep variant per shape (us; default first):")
        groups = {}
        for r in sweep["rows"]:
            groups.setdefault((r["B"], r["N"], r["ctx"], r["dtype"]), []).append(r)
        for key, rows in groups.items():
            for r in rows:
                if r["kernel"] == "pallas_sm90" and "us" in r:
                    log(f" {key} pallas_sm90 {r['variant']}: {r['us']:.1f}")
            timed_rows = [r for r in rows if "us" in r and r["kernel"] == "pallas"]
            s1 = [r for r in rows if r["kernel"] == "pallas_stage1" and "us" in r]
            if not timed_rows:
                continue
            best = min(timed_rows, key=lambda r: r["us"])
            default = timed_rows[0]
            nerr = sum("error" in r for r in rows)
            stage1 = f" (stage1 {s1[0]['us']:.1f})" if s1 else ""
            log(f" {key}: default {default['us']:.1f}{stage1} best {best['us']:.1f} {best['variant']} errors={nerr}")
    log(f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
