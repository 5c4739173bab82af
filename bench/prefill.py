"""Benchmark of the prefill kernels (varlen flash attention, LSE merge, cache gather) on one GPU.

    PYTHONPATH=. python3 bench/prefill.py --out DIR [--sweep] [--quick] [--no-xla] [--shapes-only]
                                          [--kernels pallas,pallas_sm90]

(a) checks flash_prefill, merge_attn_states and gather_cache against their float32 references on
    fresh random inputs with NaN-poisoned padding (the flash kernels on the GPU test cases marked
    `bench` in pallas_kernels/testing.py; exits 1 on any mismatch of those), and, on Hopper, the
    Mosaic GPU kernel flash_prefill_sm90 (a mismatch or error of it is logged, recorded under
    "checks" and its timing rows are skipped); (b) measures the copy/matmul ceilings; (c) times causal
    bf16 prefill attention (q/k 192, v 128) on the project's shapes plus a varlen mix and a non-causal
    context-chunk case: the Pallas kernels side by side on the same inputs (rows "pallas": the
    Triton-lowered flash_prefill; "pallas_sm90": flash_prefill_sm90) vs cuDNN
    (`jax.nn.dot_product_attention(implementation="cudnn")`, V padded to 192) vs XLA where its
    [B, N, S, S] logits fit; (d) times merge_attn_states and gather_cache (xla vs pallas) against the
    copy ceiling; writes DIR/prefill-h200.json. --sweep times tuning variants of both kernels into
    DIR/prefill-sweep.json (a variant that fails to compile is recorded and skipped).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Triton lowering warns per call
warnings.filterwarnings("ignore", message=".*[Tt]riton.*")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import flash_prefill as fp  # noqa: E402
from pallas_kernels import flash_prefill_sm90 as fp90  # noqa: E402
from pallas_kernels import gather_cache as gc  # noqa: E402
from pallas_kernels import merge_attn_states as ma  # noqa: E402
from pallas_kernels import testing  # noqa: E402
from pallas_kernels.testing import locs  # noqa: E402
from pallas_kernels.util import cdiv  # noqa: E402

DQK, DV = 192, 128
SCALE = testing.PREFILL_SCALE  # DQK ** -0.5
SHAPES = [(1, 8192, 128), (4, 4096, 128), (8, 2048, 16)]
VARLEN_SEED = 7
VARLEN_N = 128
CHUNK = dict(b=8, q_len=1024, k_len=4096, n=128)  # context-chunk pass: non-causal, q_len != k_len
MERGE_SHAPE = (16384, 128, 128)
GATHER = dict(seqs=8, ctx=16384, chunk=8192, page=64, width=576)  # W = seqs * chunk = 65536


def log(*a):
    print(*a, flush=True)


def varlen_lens():
    return np.random.default_rng(VARLEN_SEED).integers(256, 4097, size=8).astype(np.int32)


# ----------------------------------------------------------------------------------------------
# Correctness on the GPU.


def _close(name, out, ref, atol, rtol, lse=None, ref_lse=None, lse_tol=1e-2):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = float(np.max(np.abs(out - ref) - rtol * np.abs(ref))) if out.size else 0.0
    good = bool(np.all(np.isfinite(out))) and err <= atol
    msg = f"max(|err|-{rtol}|ref|)={err:.2e}"
    if lse is not None:
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        fin = np.isfinite(ref_lse)
        lse_err = float(np.max(np.abs(np.where(fin, lse, 0) - np.where(fin, ref_lse, 0))))
        same_inf = bool(np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)))
        good = good and lse_err <= lse_tol and same_inf and not np.any(np.isnan(lse))
        msg += f" lse_err={lse_err:.2e} -inf_match={same_inf}"
    log(f"check {name}: {msg} {'ok' if good else 'FAIL'}")
    return good


def check_flash(flash, kernel) -> bool:
    """`flash` on the `bench` cases of `kernel` in pallas_kernels/testing.py, out at the tests'
    PREFILL_TOL, lse within 1e-2."""
    ok = True
    for case in testing.cases_for(testing.PREFILL_GPU_CASES, kernel, bench=True):
        name = case.name
        try:
            q, k, v, qs, ks = case.make()
            out, lse = flash(q, k, v, qs, ks, causal=case.causal, scale=case.scale, **case.kernel)
            ref, ref_lse = case.reference(q, k, v, qs, ks)
            ok &= _close(name, out, ref, *testing.PREFILL_TOL[jnp.dtype(q.dtype)], lse, ref_lse)
        except Exception as e:  # noqa: BLE001
            ok = False
            log(f"check {name}: ERROR {type(e).__name__}: {e}")
            traceback.print_exc()
    return ok


def check_correctness(triton=True) -> bool:
    """The Triton flash kernel (if timed), merge_attn_states and gather_cache."""
    ok = check_flash(fp.flash_prefill, testing.FLASH_PREFILL) if triton else True
    # merge: random partials with every -inf combination, NaN outputs behind -inf
    rng = np.random.default_rng(3)
    t, n, dv = 1000, 16, 128
    po, so = (rng.standard_normal((t, n, dv), np.float32) for _ in range(2))
    pl_, sl = (rng.standard_normal((t, n), np.float32) * 3 for _ in range(2))
    pl_[:50], po[:50] = -np.inf, np.nan
    sl[40:90], so[40:90] = -np.inf, np.nan
    m = np.maximum(pl_, sl)
    ms = np.where(np.isfinite(m), m, 0)
    pw, sw = np.exp(pl_ - ms), np.exp(sl - ms)
    tot = np.where(np.isfinite(m), pw + sw, 1)
    ref = np.where(pw[..., None] > 0, po * (pw / tot)[..., None], 0) + np.where(
        sw[..., None] > 0, so * (sw / tot)[..., None], 0
    )
    ref_lse = np.where(np.isfinite(m), np.log(tot) + ms, -np.inf)
    for impl in ("xla", "pallas"):
        for dtype in (jnp.bfloat16, jnp.float32):
            try:
                out, lse = ma.merge_attn_states(
                    jnp.asarray(po, dtype), jnp.asarray(pl_), jnp.asarray(so, dtype), jnp.asarray(sl), impl=impl
                )
                r = np.asarray(jnp.asarray(ref, dtype).astype(jnp.float32)) if dtype != jnp.float32 else ref
                ok &= _close(
                    f"merge {impl} {jnp.dtype(dtype).name}",
                    out,
                    r,
                    1e-2 if dtype != jnp.float32 else 1e-5,
                    1e-2 if dtype != jnp.float32 else 1e-5,
                    lse,
                    ref_lse,
                    1e-5,
                )
            except Exception as e:  # noqa: BLE001
                ok = False
                log(f"check merge {impl}: ERROR {type(e).__name__}: {e}")
                traceback.print_exc()
    # gather: shuffled pages, NaN unused pages, ragged chunks incl. empty, bf16 and fp8
    for dtype in ("bf16", "fp8"):
        cache, bt, starts, cu, w, ksc = _gather_inputs(
            5, dtype, page=64, lens=[3000, 0, 64, 777], starts=[1024, 0, 64, 0], small=True
        )
        ref = gc.gather_cache_reference(cache, bt, starts, cu, workspace_rows=w, kv_scale=ksc)
        for impl in ("xla", "pallas"):
            try:
                out = gc.gather_cache(
                    cache, bt, starts, cu, workspace_rows=w, kv_scale=ksc, out_dtype=jnp.float32, impl=impl
                )
                ok &= _close(f"gather {impl} {dtype}", out, ref, 0.0, 0.0)
            except Exception as e:  # noqa: BLE001
                ok = False
                log(f"check gather {impl} {dtype}: ERROR {type(e).__name__}: {e}")
                traceback.print_exc()
    return ok


def _gather_inputs(seed, dtype, *, page, lens, starts, small=False, width=576, ctx=None):
    """Cache with shuffled pages; pages no chunk reads are NaN (bf16) / NaN scale (fp8)."""
    rng = np.random.default_rng(seed)
    lens, starts = np.asarray(lens, np.int32), np.asarray(starts, np.int32)
    ctx_len = starts + lens if ctx is None else np.full(len(lens), ctx)
    n_pp = [max(1, cdiv(int(c), page)) for c in ctx_len]
    max_pages = max(n_pp) + 1
    num_pages = sum(n_pp) + 3
    perm = rng.permutation(num_pages).astype(np.int32)
    bt = np.empty((len(lens), max_pages), np.int32)
    read = np.zeros(num_pages, bool)
    pos = 0
    for s, n in enumerate(n_pp):
        bt[s, :n] = perm[pos : pos + n]
        bt[s, n:] = perm[-1]  # table padding points at a spare (NaN) page
        first, last = starts[s] // page, cdiv(starts[s] + lens[s], page)
        read[perm[pos + first : pos + last]] = lens[s] > 0
        pos += n
    cu = locs(lens)
    w = int(cu[-1]) + (37 if small else 0)
    if small:
        cache = rng.standard_normal((num_pages, page, width), np.float32)
    else:  # big pools: build on device
        cache = None
    if dtype == "bf16":
        c = (
            jnp.asarray(cache)
            if small
            else jax.random.normal(jax.random.key(seed), (num_pages, page, width), jnp.float32)
        )
        c = jnp.where(jnp.asarray(read)[:, None, None], c, jnp.nan).astype(jnp.bfloat16)
        ksc = None
    else:
        c = (
            jnp.asarray(cache)
            if small
            else jax.random.normal(jax.random.key(seed), (num_pages, page, width), jnp.float32)
        )
        c = (c * 2).astype(jnp.float8_e4m3fn)
        ksc = jnp.asarray(rng.uniform(0.25, 0.75, (num_pages, page)).astype(np.float32))
        ksc = jnp.where(jnp.asarray(read)[:, None], ksc, jnp.nan)
    return c, jnp.asarray(bt), jnp.asarray(starts), jnp.asarray(cu), w, ksc


# ----------------------------------------------------------------------------------------------
# Timing.


def timed(fn, arg_sets, iters=10, reps=5):
    return common.time_fn(fn, arg_sets, iters=iters, reps=reps, warmup=2)


def prefill_row(kernel, b, s, n, us, ceil, flops, **extra):
    tf = flops / (us * 1e-6) / 1e12
    row = {
        "kernel": kernel,
        "B": b,
        "S": s,
        "N": n,
        "dtype": "bf16",
        "causal": True,
        "us": round(us, 1),
        "TFLOPs": round(tf, 1),
        "frac_matmul": round(tf / ceil["matmul_TFLOPs"], 3),
    }
    row.update(extra)
    return row


def err_row(kernel, e, **extra):
    return {"kernel": kernel, **extra, "error": f"{type(e).__name__}: {str(e)[:400]}"}


def causal_flops(n, lens):
    return sum(2 * n * (DQK + DV) * int(x) ** 2 / 2 for x in lens)


def make_fixed(b, s, n, seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(k[0], (b * s, n, DQK), jnp.bfloat16)
    kk = jax.random.normal(k[1], (b * s, n, DQK), jnp.bfloat16)
    v = jax.random.normal(k[2], (b * s, n, DV), jnp.bfloat16)
    loc = jnp.arange(b + 1, dtype=jnp.int32) * s
    return q, kk, v, loc


def pallas_fn(causal=True, **tun):
    return jax.jit(lambda q, k, v, qs, ks: fp.flash_prefill(q, k, v, qs, ks, causal=causal, scale=SCALE, **tun))


def sm90_fn(causal=True, **tun):
    return jax.jit(lambda q, k, v, qs, ks: fp90.flash_prefill_sm90(q, k, v, qs, ks, causal=causal, scale=SCALE, **tun))


def flash_fns(kernels, causal=True):
    """(row name, jitted fn) of the Pallas kernels to time, in --kernels order."""
    make = {"pallas": pallas_fn, "pallas_sm90": sm90_fn}
    return [(name, make[name](causal=causal)) for name in kernels]


def dpa_fn(impl, causal=True, lengths=False):
    if lengths:
        return jax.jit(
            lambda q, k, v, ql, kl: jax.nn.dot_product_attention(
                q,
                k,
                v,
                is_causal=causal,
                scale=SCALE,
                query_seq_lengths=ql,
                key_value_seq_lengths=kl,
                implementation=impl,
            )
        )
    return jax.jit(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=SCALE, implementation=impl)
    )


def to_padded(x, lens, start, maxlen):
    """[T, N, H] packed -> [B, maxlen, N, H] (zeros past each length)."""
    idx = np.minimum(start[:-1, None] + np.arange(maxlen)[None, :], x.shape[0] - 1)
    valid = np.arange(maxlen)[None, :] < np.asarray(lens)[:, None]
    return jnp.where(jnp.asarray(valid)[..., None, None], x[jnp.asarray(idx)], 0)


def pad_v(v):
    return jnp.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, DQK - DV)])


def bench_prefill(ceil, results, args, kernels=("pallas",)):
    """Rows for the fixed shapes, the varlen mix and the context-chunk case; `kernels` are the
    Pallas kernels timed side by side on the same inputs ("pallas", "pallas_sm90")."""
    xla_todo = []
    for b, s, n in SHAPES:
        q, k, v, loc = make_fixed(b, s, n)
        fl = causal_flops(n, [s] * b)
        for name, fn in flash_fns(kernels):
            try:
                us = timed(fn, [(q, k, v, loc, loc)])
                results["rows"].append(prefill_row(name, b, s, n, us, ceil, fl))
            except Exception as e:  # noqa: BLE001
                results["rows"].append(err_row(name, e, B=b, S=s, N=n))
            log(results["rows"][-1])
        if args.shapes_only:
            continue
        q4, k4, v4 = (x.reshape(b, s, n, -1) for x in (q, k, pad_v(v)))
        del q, k, v
        try:
            us = timed(dpa_fn("cudnn"), [(q4, k4, v4)])
            results["rows"].append(prefill_row("cudnn", b, s, n, us, ceil, fl, v_padded_to=DQK))
        except Exception as e:  # noqa: BLE001
            results["rows"].append(err_row("cudnn", e, B=b, S=s, N=n))
        log(results["rows"][-1])
        del q4, k4, v4
        xla_todo.append((b, s, n, fl))
    if args.shapes_only:
        return

    # varlen mix, causal
    lens = varlen_lens()
    st = locs(lens)
    n = VARLEN_N
    fl = causal_flops(n, lens)
    k3 = jax.random.split(jax.random.key(1), 3)
    t = int(st[-1])
    q = jax.random.normal(k3[0], (t, n, DQK), jnp.bfloat16)
    k = jax.random.normal(k3[1], (t, n, DQK), jnp.bfloat16)
    v = jax.random.normal(k3[2], (t, n, DV), jnp.bfloat16)
    loc = jnp.asarray(st)
    extra = dict(varlen=[int(x) for x in lens], tokens=t)
    for name, fn in flash_fns(kernels):
        # flash_prefill_sm90 copies inputs padded to 8-row multiples when T is not one (TMA tiles)
        pad_note = {"padded_to_8": True} if name == "pallas_sm90" and t % 8 else {}
        try:
            us = timed(fn, [(q, k, v, loc, loc)])
            results["rows"].append(prefill_row(name, len(lens), int(lens.max()), n, us, ceil, fl, **extra, **pad_note))
        except Exception as e:  # noqa: BLE001
            results["rows"].append(err_row(name, e, B=len(lens), S=int(lens.max()), N=n, **extra))
        log(results["rows"][-1])
    mx = int(lens.max())
    qp, kp, vp = (to_padded(x, lens, st, mx) for x in (q, k, pad_v(v)))
    ln = jnp.asarray(lens)
    try:
        us = timed(dpa_fn("cudnn", lengths=True), [(qp, kp, vp, ln, ln)])
        results["rows"].append(prefill_row("cudnn", len(lens), mx, n, us, ceil, fl, v_padded_to=DQK, **extra))
    except Exception as e:  # noqa: BLE001
        results["rows"].append(err_row("cudnn", e, B=len(lens), S=mx, N=n, **extra))
    log(results["rows"][-1])
    del q, k, v, qp, kp, vp

    # context chunk: each sequence's new tokens against its own chunk rows, non-causal
    c = CHUNK
    fl = 2 * c["n"] * (DQK + DV) * c["q_len"] * c["k_len"] * c["b"]
    k3 = jax.random.split(jax.random.key(2), 3)
    q = jax.random.normal(k3[0], (c["b"] * c["q_len"], c["n"], DQK), jnp.bfloat16)
    k = jax.random.normal(k3[1], (c["b"] * c["k_len"], c["n"], DQK), jnp.bfloat16)
    v = jax.random.normal(k3[2], (c["b"] * c["k_len"], c["n"], DV), jnp.bfloat16)
    qs = jnp.arange(c["b"] + 1, dtype=jnp.int32) * c["q_len"]
    ks = jnp.arange(c["b"] + 1, dtype=jnp.int32) * c["k_len"]
    extra = dict(causal=False, q_len=c["q_len"], k_len=c["k_len"])
    for name, fn in flash_fns(kernels, causal=False):
        try:
            us = timed(fn, [(q, k, v, qs, ks)])
            results["rows"].append(prefill_row(name, c["b"], c["q_len"], c["n"], us, ceil, fl, **extra))
        except Exception as e:  # noqa: BLE001
            results["rows"].append(err_row(name, e, B=c["b"], S=c["q_len"], N=c["n"], **extra))
        log(results["rows"][-1])
    q4 = q.reshape(c["b"], c["q_len"], c["n"], DQK)
    k4 = k.reshape(c["b"], c["k_len"], c["n"], DQK)
    v4 = pad_v(v).reshape(c["b"], c["k_len"], c["n"], DQK)
    del q, k, v
    try:
        us = timed(dpa_fn("cudnn", causal=False), [(q4, k4, v4)])
        results["rows"].append(prefill_row("cudnn", c["b"], c["q_len"], c["n"], us, ceil, fl, v_padded_to=DQK, **extra))
    except Exception as e:  # noqa: BLE001
        results["rows"].append(err_row("cudnn", e, B=c["b"], S=c["q_len"], N=c["n"], **extra))
    log(results["rows"][-1])
    del q4, k4, v4

    # XLA last: its [B, N, S, S] f32 logits are tens of GB
    if args.no_xla:
        return
    mem = jax.devices()[0].memory_stats() or {}
    limit = mem.get("bytes_limit", 100e9)
    for b, s, n, fl in xla_todo:
        need = b * n * s * s * 6  # f32 logits + bf16 probabilities
        if need > 0.8 * limit:
            results["rows"].append(
                {"kernel": "xla", "B": b, "S": s, "N": n, "error": f"skipped: needs ~{need / 1e9:.0f} GB"}
            )
            log(results["rows"][-1])
            continue
        q, k, v, _ = make_fixed(b, s, n)
        q4, k4, v4 = (x.reshape(b, s, n, -1) for x in (q, k, pad_v(v)))
        del q, k, v
        try:
            us = timed(dpa_fn("xla"), [(q4, k4, v4)], iters=3, reps=3)
            results["rows"].append(prefill_row("xla", b, s, n, us, ceil, fl, v_padded_to=DQK))
        except Exception as e:  # noqa: BLE001
            results["rows"].append(err_row("xla", e, B=b, S=s, N=n))
        log(results["rows"][-1])
        del q4, k4, v4


def merge_row(kernel, us, ceil, **extra):
    t, n, dv = MERGE_SHAPE
    nbytes = 3 * t * n * dv * 2 + 3 * t * n * 4
    tb = nbytes / (us * 1e-6) / 1e12
    return {
        "op": "merge_attn_states",
        "kernel": kernel,
        "T": t,
        "N": n,
        "V": dv,
        "dtype": "bf16",
        "us": round(us, 1),
        "TBps": round(tb, 3),
        "frac_copy": round(tb / ceil["copy_TBps"], 3),
        **extra,
    }


def merge_inputs():
    t, n, dv = MERGE_SHAPE
    k = jax.random.split(jax.random.key(4), 4)
    return (
        jax.random.normal(k[0], (t, n, dv), jnp.bfloat16),
        jax.random.normal(k[1], (t, n), jnp.float32),
        jax.random.normal(k[2], (t, n, dv), jnp.bfloat16),
        jax.random.normal(k[3], (t, n), jnp.float32),
    )


def merge_fn(impl, **tun):
    return jax.jit(lambda a, b, c, d: ma.merge_attn_states(a, b, c, d, impl=impl, **tun))


def gather_row(kernel, dtype, w, us, ceil, **extra):
    width = GATHER["width"]
    in_b = width * (2 if dtype == "bf16" else 1) + (4 if dtype == "fp8" else 0)
    nbytes = w * (in_b + width * 2)
    tb = nbytes / (us * 1e-6) / 1e12
    return {
        "op": "gather_cache",
        "kernel": kernel,
        "W": w,
        "C": width,
        "page": GATHER["page"],
        "dtype": dtype,
        "us": round(us, 1),
        "TBps": round(tb, 3),
        "frac_copy": round(tb / ceil["copy_TBps"], 3),
        **extra,
    }


def gather_setup(dtype):
    g = GATHER
    s = g["seqs"]
    cache, bt, starts, cu, w, ksc = _gather_inputs(
        6, dtype, page=g["page"], lens=[g["chunk"]] * s, starts=[g["chunk"] // 2] * s, ctx=g["ctx"], width=g["width"]
    )
    return (cache, bt, starts, cu, ksc), w


def gather_fn(impl, w, **tun):
    return jax.jit(
        lambda c, bt, st, cu, ks: gc.gather_cache(c, bt, st, cu, workspace_rows=w, kv_scale=ks, impl=impl, **tun)
    )


def bench_memory_ops(ceil, results):
    args = merge_inputs()
    for impl in ("xla", "pallas"):
        try:
            us = timed(merge_fn(impl), [args], iters=20)
            results["rows"].append(merge_row(impl, us, ceil))
        except Exception as e:  # noqa: BLE001
            results["rows"].append({"op": "merge_attn_states", **err_row(impl, e)})
        log(results["rows"][-1])
    del args
    for dtype in ("bf16", "fp8"):
        args, w = gather_setup(dtype)
        for impl in ("xla", "pallas"):
            try:
                us = timed(gather_fn(impl, w), [args], iters=20)
                results["rows"].append(gather_row(impl, dtype, w, us, ceil))
            except Exception as e:  # noqa: BLE001
                results["rows"].append({"op": "gather_cache", **err_row(impl, e, dtype=dtype)})
            log(results["rows"][-1])


# ----------------------------------------------------------------------------------------------
# Sweep.

PREFILL_VARIANTS = [  # (block_q, block_k, num_warps, num_stages); the default runs first
    None,
    (128, 64, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 2),
    (128, 128, 8, 1),
    (64, 128, 4, 2),
    (256, 64, 8, 2),
    (256, 32, 8, 3),
    (128, 128, 16, 2),
    (64, 64, 4, 3),
    (64, 32, 4, 4),
    (128, 64, 8, 2),
    (128, 128, 4, 2),
]


SM90_VARIANTS = [  # flash_prefill_sm90 tuning; the default runs first
    None,
    dict(block_k=64, num_stages=3),
    dict(block_k=64, num_stages=4),
    dict(schedule_barrier=False),
    dict(block_k=64, num_stages=3, schedule_barrier=False),
    dict(p_in_smem=True),
]


def run_sweep(ceil, sweep, budget_s, kernels=("pallas",)):
    t_all = time.time()
    lens = varlen_lens()
    cases = [("fixed", b, s, n) for (b, s, n) in SHAPES] + [("varlen", len(lens), int(lens.max()), VARLEN_N)]
    per_case = budget_s * 0.8 / len(cases)
    for kind, b, s, n in cases:
        if kind == "fixed":
            q, k, v, loc = make_fixed(b, s, n)
            fl = causal_flops(n, [s] * b)
            extra = {}
        else:
            st = locs(lens)
            q, k, v, _ = make_fixed(1, int(st[-1]), n, seed=3)
            loc = jnp.asarray(st)
            fl = causal_flops(n, lens)
            extra = dict(varlen=[int(x) for x in lens])
        base = None
        variants = []
        if "pallas" in kernels:
            variants += [
                (
                    "pallas",
                    pallas_fn,
                    {} if var is None else dict(zip(("block_q", "block_k", "num_warps", "num_stages"), var)),
                    var is None,
                )
                for var in PREFILL_VARIANTS
            ]
        if "pallas_sm90" in kernels:
            variants += [("pallas_sm90", sm90_fn, var or {}, var is None) for var in SM90_VARIANTS]
        t_kernel = {}  # the case's budget is split evenly between the kernels
        for kname, make_fn, tun, is_default in variants:
            label = "default" if is_default else tun
            t_kernel.setdefault(kname, time.time())
            if time.time() - t_kernel[kname] > per_case / max(1, len(kernels)):
                sweep["rows"].append(
                    {"kernel": kname, "B": b, "S": s, "N": n, "variant": label, **extra, "error": "skipped: budget"}
                )
                continue
            t0 = time.time()
            try:
                f = make_fn(**tun)
                out = f(q, k, v, loc, loc)[0]
                diff = None
                if base is None:
                    base = out
                else:  # a variant that computes something else is a miscompile, not a speedup
                    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32))))
                del out
                us = timed(f, [(q, k, v, loc, loc)], iters=5, reps=3)
                row = prefill_row(
                    kname, b, s, n, us, ceil, fl, variant=label, **extra, compile_and_time_s=round(time.time() - t0, 1)
                )
                if diff is not None:
                    row["max_abs_diff_vs_default"] = diff
                sweep["rows"].append(row)
            except Exception as e:  # noqa: BLE001
                sweep["rows"].append(
                    {
                        "kernel": kname,
                        "B": b,
                        "S": s,
                        "N": n,
                        "variant": label,
                        **extra,
                        "error": f"{type(e).__name__}: {str(e)[-300:]}",
                    }
                )
            log(sweep["rows"][-1])
        del q, k, v, base
    # memory-bound ops: block_rows x num_warps
    args = merge_inputs()
    for br in (16, 32, 64, 128):
        for nw in (2, 4, 8):
            try:
                us = timed(merge_fn("pallas", block_rows=br, num_warps=nw), [args], iters=20)
                sweep["rows"].append(merge_row("pallas", us, ceil, variant=dict(block_rows=br, num_warps=nw)))
            except Exception as e:  # noqa: BLE001
                sweep["rows"].append(
                    {
                        "op": "merge_attn_states",
                        "kernel": "pallas",
                        "variant": dict(block_rows=br, num_warps=nw),
                        "error": f"{type(e).__name__}: {str(e)[-300:]}",
                    }
                )
            log(sweep["rows"][-1])
    del args
    g_args, w = gather_setup("bf16")
    for br in (8, 16, 32, 64):
        for nw in (2, 4, 8):
            try:
                us = timed(gather_fn("pallas", w, block_rows=br, num_warps=nw), [g_args], iters=20)
                sweep["rows"].append(
                    gather_row("pallas", "bf16", w, us, ceil, variant=dict(block_rows=br, num_warps=nw))
                )
            except Exception as e:  # noqa: BLE001
                sweep["rows"].append(
                    {
                        "op": "gather_cache",
                        "kernel": "pallas",
                        "variant": dict(block_rows=br, num_warps=nw),
                        "error": f"{type(e).__name__}: {str(e)[-300:]}",
                    }
                )
            log(sweep["rows"][-1])
    log(f"sweep took {time.time() - t_all:.0f}s")


def print_tables(results, sweep):
    log("\n kernel       B     S     N   causal       us  TFLOP/s  frac_mm")
    for r in results["rows"]:
        if "op" in r:
            continue
        if "error" in r:
            log(
                f" {r['kernel']:11s} {r.get('B', '')!s:>3} {r.get('S', '')!s:>5} {r.get('N', '')!s:>4}  "
                f"{r['error'][:80]}"
            )
            continue
        tag = " varlen" if "varlen" in r else (f" k_len={r['k_len']}" if "k_len" in r else "")
        log(
            f" {r['kernel']:11s} {r['B']:3d} {r['S']:5d} {r['N']:4d}  {str(r['causal']):6s} "
            f"{r['us']:9.1f} {r['TFLOPs']:8.1f} {r['frac_matmul']:8.3f}{tag}"
        )
    log("\n op                 kernel  dtype       us    TB/s  frac_copy")
    for r in results["rows"]:
        if "op" not in r:
            continue
        if "error" in r:
            log(f" {r['op']:18s} {r['kernel']:7s} ERROR {r['error'][:80]}")
            continue
        log(f" {r['op']:18s} {r['kernel']:7s} {r['dtype']:5s} {r['us']:8.1f} {r['TBps']:7.3f} {r['frac_copy']:9.3f}")
    if sweep is not None:
        log("\n sweep: best variant per case (us)")
        groups = {}
        for r in sweep["rows"]:
            key = (r.get("op", "prefill"), r.get("kernel"), r.get("B"), r.get("S"), r.get("N"), r.get("dtype"))
            groups.setdefault(key, []).append(r)
        for key, rows in groups.items():
            good = [r for r in rows if "us" in r]
            if not good:
                continue
            best = min(good, key=lambda r: r["us"])
            nerr = sum("error" in r for r in rows)
            log(
                f" {key}: first {good[0]['us']:.1f} ({good[0].get('variant')}) best {best['us']:.1f} "
                f"{best.get('variant')} errors/skips={nerr}"
            )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--sweep", action="store_true", help="also time tuning variants")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA attention rows")
    ap.add_argument(
        "--shapes-only",
        action="store_true",
        help="only the fixed shapes' Pallas rows (no cuDNN, varlen, chunk, memory-op or XLA rows): kernel A/Bs",
    )
    ap.add_argument(
        "--no-check", "--skip-check", dest="skip_check", action="store_true", help="skip the GPU correctness checks"
    )
    ap.add_argument(
        "--kernels",
        default="pallas,pallas_sm90",
        help="Pallas flash kernels to time: pallas (Triton) and/or pallas_sm90 (Hopper only)",
    )
    args = ap.parse_args()
    t_start = time.time()
    dev = jax.devices()[0]
    log(f"device: {dev.device_kind}, jax {jax.__version__}")
    kernels = [x for x in args.kernels.split(",") if x]
    unknown = sorted(set(kernels) - {"pallas", "pallas_sm90"})
    if unknown:
        ap.error(f"--kernels: unknown {unknown}; choose from pallas, pallas_sm90")
    if "pallas_sm90" in kernels and not fp90.is_sm90(dev):
        log(f"pallas_sm90: skipped, needs compute capability 9.x (got {getattr(dev, 'compute_capability', None)})")
        kernels.remove("pallas_sm90")
    checks = {}

    if not args.skip_check:
        ok = check_correctness(triton="pallas" in kernels)
        checks["pallas"] = "PASS" if ok else "FAIL"
        log(f"correctness: {'PASS' if ok else 'FAIL'} ({time.time() - t_start:.0f}s)")
        if not ok:
            sys.exit(1)
        if "pallas_sm90" in kernels:
            ok = check_flash(fp90.flash_prefill_sm90, testing.FLASH_PREFILL_SM90)
            checks["pallas_sm90"] = "PASS" if ok else "FAIL"
            log(f"correctness pallas_sm90: {'PASS' if ok else 'FAIL'} ({time.time() - t_start:.0f}s)")
            if not ok:  # time only a kernel that computes the right thing
                log("pallas_sm90: check failed, its timing rows are skipped")
                kernels.remove("pallas_sm90")

    ceil = common.measure_ceilings()
    log(f"ceilings: {ceil}")
    results = common.results_header(ceil)
    if checks:
        results["checks"] = checks
    results["kernels"] = kernels
    if not args.shapes_only:
        bench_memory_ops(ceil, results)
    bench_prefill(ceil, results, args, kernels)
    os.makedirs(args.out, exist_ok=True)
    common.write_results(os.path.join(args.out, "prefill-h200.json"), results)
    sweep = None
    if args.sweep:
        sweep = common.results_header(ceil)
        run_sweep(ceil, sweep, args.sweep_budget_s, kernels)
        common.write_results(os.path.join(args.out, "prefill-sweep.json"), sweep)
    print_tables(results, sweep)
    log(f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
