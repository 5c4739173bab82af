"""Benchmark of the per-head matmuls of MLA's absorbed decode path on one GPU: pallas_kernels/head_matmul.py
against the XLA einsums that mla.absorb_q / mla.v_up_proj ran before it (issue #22).

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/head_matmul.py --out DIR [--sweep] [--smoke]

Shapes (bf16): absorb_q, q [T, N, P+R] -> [T, N, L+R] through W_UK_T [N, P, L] with q_pe copied behind (P 128,
L 512, R 64; impl "pallas": `head_matmul(q, w, tail_in_x=True)`, "xla": einsum on q[..., :P] + concatenate), and
v_up_proj, latent [T, N, L] -> [T, N, V] through W_UV [N, L, V] (V 128; "pallas": `head_matmul`, "xla": einsum),
for N 16 (DeepSeek-V2-Lite) and 128 (V3), at T = 1, 8, 32, 64, 128 tokens (--tokens).

(a) checks the kernel against its float32 reference at every shape and T (bf16 tolerance; exits 1 on a mismatch,
    rows get check_err), (b) measures the copy/matmul ceilings, (c) times both impls: `us`, the wall time per call
    of back-to-back calls (common.time_fn), and `device_us`, the GPU's busy time per call from a profiler trace
    (common.device_time_us: what decides at batch 1, where launches dominate), cycling through enough input sets
    (distinct weights) that L2 cannot hold them, as in a decode step, where the other layers' weights evict them;
    (d) with --sweep, times one-at-a-time tuning moves around `default_tuning` at T = 1 and 32 (rows with
    `variant`, --sweep-budget-s caps it).

Rows (DIR/head-matmul-h200.json, format of notes/bench-results.md): op "head_matmul", model, name (absorb_q /
v_up_proj), N, K, M, R (the copied tail; 0 for v_up_proj), T, impl, us, device_us, span_us, kernels_per_call,
TBps (bytes: weight + x + out, over device_us, else us), TFLOPs (2 T N K M), frac_copy, frac_matmul, roofline_us
(max of the two ceilings' times), speedup_vs_xla (xla's time / this one's, device time where measured), tuning
(the kernel's block_t, block_n, block_k, num_warps, num_stages). --smoke: tiny shapes, interpret mode, on a CPU
(head-matmul-h200-smoke.json; the numbers mean nothing). Runtime on an H200: ~1-2 minutes, --sweep ~2 more.
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

if __package__ in (None, ""):  # `python3 bench/head_matmul.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import head_matmul as hm  # noqa: E402

SHAPES = [  # (model, name, N, K, M, R): absorb_q's K = P, M = L, R the rope tail; v_up_proj's K = L, M = V
    ("v2-lite", "absorb_q", 16, 128, 512, 64),
    ("v2-lite", "v_up_proj", 16, 512, 128, 0),
    ("v3", "absorb_q", 128, 128, 512, 64),
    ("v3", "v_up_proj", 128, 512, 128, 0),
]
SMOKE_SHAPES = [("smoke", "absorb_q", 4, 32, 64, 16), ("smoke", "v_up_proj", 4, 64, 32, 0)]
TOKENS = (1, 8, 32, 64, 128)
SMOKE_TOKENS = (1, 5, 40)
SWEEP_TOKENS = (1, 32)
L2_BYTES = 60 << 20  # H200: input sets cycle through more than this
TOL = 2e-2  # bf16 output: |out - ref| <= TOL (1 + |ref|)


def log(*a):
    print(*a, flush=True)


def make_sets(key, t, n, k, m, r, n_sets):
    """n_sets (x [T, N, K+R], w [N, K, M]) pairs, w scaled for unit outputs, each set its own weights."""
    sets = []
    for s in range(n_sets):
        kx, kw = jax.random.split(jax.random.fold_in(key, s))
        x = jax.random.normal(kx, (t, n, k + r), jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k, m), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        sets.append((x, w))
    return sets


def impl_fns(k, r, interpret, **tuning):
    """{impl: jitted fn(x, w)}: the kernel and the XLA code mla.py ran before it."""
    if r:

        def xla(q, w):  # absorb_q's jnp path
            ql_nope = jnp.einsum("tnp,npl->tnl", q[..., :k], w)  # [T, N, L]
            return jnp.concatenate([ql_nope, q[..., k:].astype(ql_nope.dtype)], axis=-1)

        def pallas(q, w):
            return hm.head_matmul(q, w, tail_in_x=True, interpret=interpret, **tuning)

    else:

        def xla(x, w):  # v_up_proj's jnp path
            return jnp.einsum("tnl,nlv->tnv", x, w)

        def pallas(x, w):
            return hm.head_matmul(x, w, interpret=interpret, **tuning)

    return {"pallas": jax.jit(pallas), "xla": jax.jit(xla)}


def check(fn, x, w, r):
    """max |out - ref| / (1 + |ref|) against the float32 reference; finite outputs required."""
    out = np.asarray(fn(x, w).astype(jnp.float32))
    ref = np.asarray(hm.head_matmul_reference(x, w, tail_in_x=bool(r)))
    if out.shape != ref.shape or not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.max(np.abs(out - ref) / (1.0 + np.abs(ref))))


def timed(fn, sets, smoke, device_time):
    if smoke:
        return common.time_fn(fn, sets, iters=1, reps=1, warmup=1), {}
    iters = max(20, len(sets))  # each timed run goes through every set (the timers cycle through the first `iters`)
    us = common.time_fn(fn, sets, iters=iters, reps=5, warmup=3)
    extra = common.device_time_us(fn, sets, iters=iters) if device_time else {}
    return us, extra


def make_row(model, name, t, n, k, m, r, impl, us, extra, ceil):
    dev = extra.get("device_us")
    sec = (dev if dev else us) * 1e-6
    nbytes = 2 * (n * k * m + t * n * (k + r) + t * n * (m + r))  # bf16 weight, x, out
    flops = 2 * t * n * k * m
    tbps, tflops = nbytes / sec / 1e12, flops / sec / 1e12
    row = dict(op="head_matmul", model=model, name=name, N=n, K=k, M=m, R=r, T=t, impl=impl, us=round(us, 2))
    row.update({key: v for key, v in extra.items() if key != "kernels_us"})
    row.update(TBps=round(tbps, 3), TFLOPs=round(tflops, 3))
    if ceil.get("copy_TBps") and ceil.get("matmul_TFLOPs"):
        row["frac_copy"] = round(tbps / ceil["copy_TBps"], 3)
        row["frac_matmul"] = round(tflops / ceil["matmul_TFLOPs"], 4)
        roof = max(nbytes / (ceil["copy_TBps"] * 1e12), flops / (ceil["matmul_TFLOPs"] * 1e12))
        row["roofline_us"] = round(roof * 1e6, 3)
    if "kernels_us" in extra:
        row["kernels_us"] = extra["kernels_us"]
    return row


def n_sets_for(n, k, m, smoke):
    return 1 if smoke else int(min(64, max(2, -(-2 * L2_BYTES // (2 * n * k * m)))))


def bench_shapes(shapes, tokens, ceil, rows, smoke):
    ok = True
    for model, name, n, k, m, r in shapes:
        for t in tokens:
            label = f"{model} {name} N={n} T={t}"
            sets = make_sets(jax.random.key(n * 1000 + t), t, n, k, m, r, n_sets_for(n, k, m, smoke))
            tuning = hm.default_tuning(t, n, k, m, jnp.bfloat16)
            times = {}
            shape_rows = []
            for impl, fn in impl_fns(k, r, smoke).items():
                try:
                    err = check(fn, *sets[0], r)
                    if impl == "pallas" and err > TOL:  # (xla's error is recorded only: XLA on a CPU sums in bf16)
                        ok = False
                        log(f"{label} {impl}: CHECK FAILED, max err {err:.3g} > {TOL}")
                    us, extra = timed(fn, sets, smoke, device_time=not smoke)
                    row = make_row(model, name, t, n, k, m, r, impl, us, extra, ceil)
                    row["check_err"] = round(err, 5)
                    if impl == "pallas":
                        row["tuning"] = dict(zip(("block_t", "block_n", "block_k", "num_warps", "num_stages"), tuning))
                    times[impl] = extra.get("device_us") or us
                    shape_rows.append(row)
                except Exception as e:  # noqa: BLE001
                    ok &= impl != "pallas"
                    log(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[:300]}")
                    traceback.print_exc()
                    shape_rows.append(
                        dict(op="head_matmul", model=model, name=name, N=n, K=k, M=m, R=r, T=t, impl=impl)
                        | dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                    )
            if "xla" in times:
                for row in shape_rows:
                    if row.get("us") is not None:
                        row["speedup_vs_xla"] = round(times["xla"] / (row.get("device_us") or row["us"]), 3)
            rows += shape_rows
            log(f"{label}: " + ", ".join(f"{i} {v:.2f} us" for i, v in times.items()))
    return ok


def sweep_variants(t, n, k, m):
    """One-at-a-time moves around the default tuning (a dict of head_matmul keywords each; {} = the default)."""
    bt, bn, bk, warps, stages = hm.default_tuning(t, n, k, m, jnp.bfloat16)
    out = [{}]
    out += [{"block_n": v} for v in (16, 32, 64, 128) if v != bn and v <= max(16, m)]
    out += [{"block_k": v} for v in (32, 64, 128, 256) if v != bk and v <= max(16, k)]
    out += [{"num_warps": v} for v in (2, 4, 8) if v != warps]
    out += [{"num_stages": v} for v in (1, 2, 3, 4) if v != stages]
    if t > 16:
        out += [{"block_t": v} for v in (16, 32, 64) if v != bt]
    return out


def sweep(shapes, ceil, rows, smoke, deadline):
    for model, name, n, k, m, r in shapes:
        for t in SWEEP_TOKENS if not smoke else (1,):
            sets = make_sets(jax.random.key(n * 1000 + t + 7), t, n, k, m, r, n_sets_for(n, k, m, smoke))
            for v in sweep_variants(t, n, k, m):
                if time.perf_counter() > deadline:
                    log("sweep budget spent")
                    return
                label = f"sweep {model} {name} N={n} T={t} {v or 'default'}"
                try:
                    fn = impl_fns(k, r, smoke, **v)["pallas"]
                    err = check(fn, *sets[0], r)
                    us, extra = timed(fn, sets, smoke, device_time=not smoke)
                    row = make_row(model, name, t, n, k, m, r, "pallas", us, extra, ceil)
                    row.update(variant=v, check_err=round(err, 5))
                    log(f"{label}: {us:.2f} us, device {extra.get('device_us')} us, err {err:.2g}")
                except Exception as e:  # noqa: BLE001
                    row = dict(op="head_matmul", model=model, name=name, N=n, K=k, M=m, R=r, T=t, impl="pallas")
                    row.update(variant=v, error=f"{type(e).__name__}: {str(e)[:300]}")
                    log(f"{label}: ERROR {row['error']}")
                rows.append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    ap.add_argument("--tokens", type=common.int_list, default=None, help="T values (default 1,8,32,64,128)")
    ap.add_argument("--sweep", action="store_true", help="also time tuning variants at T = 1 and 32")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = common.measure_ceilings(small=args.smoke)
    log(f"{jax.devices()[0].device_kind}: ceilings {ceil}")
    results = common.results_header(ceil)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    ok = bench_shapes(shapes, tokens, ceil, results["rows"], args.smoke)
    if args.sweep:
        sweep_rows = []
        sweep(shapes, ceil, sweep_rows, args.smoke, time.perf_counter() + args.sweep_budget_s)
        results["sweep"] = sweep_rows
    results["checks_passed"] = bool(ok)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    name = "head-matmul-h200-smoke.json" if args.smoke else "head-matmul-h200.json"
    common.write_results(os.path.join(args.out, name), results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
