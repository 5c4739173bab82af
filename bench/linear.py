"""Benchmark of the dense decode linears on one GPU: pallas_kernels/linear.py against the XLA einsums that
mla.mla_project_q_kv / mla.o_proj / layers.route ran before it (issue #22).

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/linear.py --out DIR [--sweep] [--v3] [--smoke]

Shapes (HF [out, in] weights; x bf16 [T, K]): DeepSeek-V2-Lite's q_proj + kv_a_proj_with_mqa ([3072 | 576, 2048],
one kernel call; XLA: two einsums), o_proj [2048, 2048], the dense first layer's MLP (gate_proj + up_proj
[10944 | 10944, 2048], down_proj [2048, 10944]) and the router's logits (f32 weight [64, 2048], x cast to f32, f32
out); with --v3 DeepSeek-V3's bf16 q_a_proj + kv_a_proj_with_mqa [1536 | 576, 7168], q_b_proj
[24576, 1536], o_proj [7168, 16384] and router [256, 7168]. T = 1, 8, 32, 64, 128 (--tokens). Each shape twice:
`stacked` False (plain weights) and True (weights stacked over `LAYERS` layers, the layer a traced index, as the
layer loop hands them: the kernel reads the layer in place, XLA slices it, `layers.layer_row`, which it may
materialize as a copy before a GEMM).

(a) checks the kernel against its float32 reference at every shape and T (bf16 tolerance, the router's float32
    one; exits 1 on a mismatch, rows get check_err), (b) measures the copy/matmul ceilings, (c) times both impls:
    `us`, the wall time per call of back-to-back calls (common.time_fn), and `device_us`, the GPU's busy time per
    call from a profiler trace (common.device_time_us: what decides at batch 1, where launches dominate), cycling
    through enough input sets (distinct weights, or distinct layers of the stack) that L2 cannot hold them, as in a
    decode step; (d) with --sweep, times one-at-a-time tuning moves around `default_tuning` at T = 1 and 32 (rows
    with `variant`, --sweep-budget-s caps it).

Rows (DIR/linear-h200.json, format of notes/bench-results.md): op "linear", model, name, Ns (the weights' out dims),
K, T, stacked, w_dtype, impl ("pallas" / "xla"), us, device_us, span_us, kernels_per_call, TBps (bytes: weights +
x + outputs, over device_us, else us), TFLOPs (2 T K sum(Ns)), frac_copy, frac_matmul, roofline_us (max of the two
ceilings' times), speedup_vs_xla (xla's time / this one's, device time where measured), tuning (the kernel's
block_t, block_n, block_k, num_warps, num_stages), check_err. --smoke: tiny shapes, interpret mode, on a CPU
(linear-h200-smoke.json; the numbers mean nothing). Runtime on an H200: ~2-3 minutes, --sweep ~2.5 more.
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

if __package__ in (None, ""):  # `python3 bench/linear.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import linear as lin  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
SHAPES = [  # (model, name, Ns, K, weight dtype)
    ("v2-lite", "q_kv_a", (3072, 576), 2048, BF16),
    ("v2-lite", "o_proj", (2048,), 2048, BF16),
    ("v2-lite", "router", (64,), 2048, F32),
    ("v2-lite", "mlp_gate_up", (10944, 10944), 2048, BF16),  # the dense first layer's MLP
    ("v2-lite", "mlp_down", (2048,), 10944, BF16),
]
V3_SHAPES = [
    ("v3", "q_a_kv_a", (1536, 576), 7168, BF16),
    ("v3", "q_b_proj", (24576,), 1536, BF16),
    ("v3", "o_proj", (7168,), 16384, BF16),
    ("v3", "router", (256,), 7168, F32),
]
SMOKE_SHAPES = [("smoke", "q_kv_a", (48, 20), 40, BF16), ("smoke", "router", (8,), 40, F32)]
TOKENS = (1, 8, 32, 64, 128)
SMOKE_TOKENS = (1, 5)
SWEEP_TOKENS = (1, 32)
LAYERS = 26  # V2-Lite's MoE layers: the stack the layer loop reads
L2_BYTES = 60 << 20  # H200: input sets cycle through more than this


def log(*a):
    print(*a, flush=True)


def weight_bytes(ns, k, w_dtype):
    return sum(ns) * k * jnp.dtype(w_dtype).itemsize


def n_sets_for(ns, k, w_dtype, smoke):
    return 1 if smoke else int(min(LAYERS, max(2, -(-2 * L2_BYTES // weight_bytes(ns, k, w_dtype)))))


def make_sets(key, t, ns, k, w_dtype, stacked, n_sets):
    """n_sets argument tuples: (x, *weights) each with its own weights, or with `stacked` (x, *stacks, index) over one
    set of stacks [LAYERS, N, K] (n_sets distinct layers)."""
    kx, kw = jax.random.split(key)
    n_w = LAYERS if stacked else n_sets
    ws = [
        (jax.random.normal(jax.random.fold_in(kw, j), (n_w, n, k), F32) * k**-0.5).astype(w_dtype)
        for j, n in enumerate(ns)
    ]
    sets = []
    for s in range(n_sets):
        x = jax.random.normal(jax.random.fold_in(kx, s), (t, k), BF16)
        if stacked:
            sets.append((x, *ws, jnp.int32((s * 7) % LAYERS)))
        else:
            sets.append((x, *(w[s] for w in ws)))
    return sets


def impl_fns(n_w, w_dtype, stacked, interpret, **tuning):
    """{impl: jitted fn(x, *weights[, index])}: the kernel and the XLA code the model ran before it."""
    out_dtype = F32 if w_dtype == F32 else None

    def split(args):
        return (args[0], args[1 : 1 + n_w], args[1 + n_w] if stacked else None)

    def pallas(*args):
        x, ws, i = split(args)
        return lin.linear(x, ws, rhs_index=i, out_dtype=out_dtype, interpret=interpret, **tuning)

    def xla(*args):
        x, ws, i = split(args)
        if stacked:  # layers.layer_row: the layer sliced out of the stack
            ws = [jax.lax.dynamic_index_in_dim(w, i, keepdims=False) for w in ws]
        if w_dtype == F32:  # layers.route's logits
            return tuple(jnp.einsum("td,ed->te", x.astype(F32), w.astype(F32)) for w in ws)
        return tuple(jnp.einsum("...i,oi->...o", x, w) for w in ws)  # layers.linear, one each

    return {"pallas": jax.jit(pallas), "xla": jax.jit(xla)}


def check(fn, args, n_w, w_dtype, stacked):
    """max |out - ref| / (1 + |ref|) against the float32 reference; finite outputs required."""
    x, ws = args[0], args[1 : 1 + n_w]
    index = args[1 + n_w] if stacked else None
    outs = fn(*args)
    refs = lin.linear_reference(x, ws, rhs_index=index)
    err = 0.0
    for out, ref in zip(outs, refs):
        out, ref = np.asarray(out.astype(F32)), np.asarray(ref)
        if out.shape != ref.shape or not np.all(np.isfinite(out)):
            return float("inf")
        err = max(err, float(np.max(np.abs(out - ref) / (1.0 + np.abs(ref)))))
    return err


def tol(w_dtype):
    return 1e-5 if w_dtype == F32 else 2e-2  # the router is exact float32; bf16 rounds the output


def timed(fn, sets, smoke, device_time):
    if smoke:
        return common.time_fn(fn, sets, iters=1, reps=1, warmup=1), {}
    iters = max(20, len(sets))
    us = common.time_fn(fn, sets, iters=iters, reps=5, warmup=3)
    extra = common.device_time_us(fn, sets, iters=iters) if device_time else {}
    return us, extra


def base_row(model, name, ns, k, t, w_dtype, stacked, impl):
    return dict(op="linear", model=model, name=name, Ns=list(ns), K=k, T=t, stacked=stacked) | dict(
        w_dtype=jnp.dtype(w_dtype).name, impl=impl
    )


def make_row(model, name, ns, k, t, w_dtype, stacked, impl, us, extra, ceil):
    dev = extra.get("device_us")
    sec = (dev if dev else us) * 1e-6
    out_bytes = 4 if w_dtype == F32 else 2
    nbytes = weight_bytes(ns, k, w_dtype) + 2 * t * k + out_bytes * t * sum(ns)
    flops = 2 * t * k * sum(ns)
    tbps, tflops = nbytes / sec / 1e12, flops / sec / 1e12
    row = base_row(model, name, ns, k, t, w_dtype, stacked, impl) | dict(us=round(us, 2))
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


def bench_shapes(shapes, tokens, ceil, rows, smoke):
    ok = True
    for model, name, ns, k, w_dtype in shapes:
        for stacked in (False, True):
            for t in tokens:
                label = f"{model} {name} T={t}{' stacked' if stacked else ''}"
                key = jax.random.key(sum(ns) + t + 1000 * stacked)
                sets = make_sets(key, t, ns, k, w_dtype, stacked, n_sets_for(ns, k, w_dtype, smoke))
                cdt = lin.compute_dtype(BF16, w_dtype)
                tuning = lin.default_tuning(t, ns, k, cdt)
                times, shape_rows = {}, []
                for impl, fn in impl_fns(len(ns), w_dtype, stacked, smoke).items():
                    try:
                        err = check(fn, sets[0], len(ns), w_dtype, stacked)
                        if impl == "pallas" and err > tol(w_dtype):  # (xla's error is recorded only)
                            ok = False
                            log(f"{label} {impl}: CHECK FAILED, max err {err:.3g} > {tol(w_dtype)}")
                        us, extra = timed(fn, sets, smoke, device_time=not smoke)
                        row = make_row(model, name, ns, k, t, w_dtype, stacked, impl, us, extra, ceil)
                        row["check_err"] = round(err, 7)
                        if impl == "pallas":
                            keys = ("block_t", "block_n", "block_k", "num_warps", "num_stages")
                            row["tuning"] = dict(zip(keys, tuning))
                        times[impl] = extra.get("device_us") or us
                        shape_rows.append(row)
                    except Exception as e:  # noqa: BLE001
                        ok &= impl != "pallas"
                        log(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[:300]}")
                        traceback.print_exc()
                        shape_rows.append(
                            base_row(model, name, ns, k, t, w_dtype, stacked, impl)
                            | dict(error=f"{type(e).__name__}: {str(e)[:300]}")
                        )
                if "xla" in times:
                    for row in shape_rows:
                        if row.get("us") is not None:
                            row["speedup_vs_xla"] = round(times["xla"] / (row.get("device_us") or row["us"]), 3)
                rows += shape_rows
                log(f"{label}: " + ", ".join(f"{i} {v:.2f} us" for i, v in times.items()))
    return ok


def sweep_variants(t, ns, k, cdt):
    """One-at-a-time moves around the default tuning (a dict of linear keywords each; {} = the default)."""
    bt, bn, bk, warps, stages = lin.default_tuning(t, ns, k, cdt)
    f32 = jnp.dtype(cdt) == F32
    out = [{}]
    out += [{"block_n": v} for v in ((1, 2, 4, 8, 16) if f32 else (16, 32, 64)) if v != bn]
    out += [{"block_k": v} for v in (64, 128, 256, 512, 1024) if v != bk and v <= max(16, k)]
    out += [{"num_warps": v} for v in (1, 2, 4, 8) if v != warps]
    out += [{"num_stages": v} for v in (1, 2, 3, 4, 6) if v != stages]
    if t > 16 or f32:
        out += [{"block_t": v} for v in ((1, 2, 4, 8) if f32 else (16, 32, 64)) if v != bt and v <= max(t, 16)]
    return out


def sweep(shapes, ceil, rows, smoke, deadline):
    for model, name, ns, k, w_dtype in shapes:
        cdt = lin.compute_dtype(BF16, w_dtype)
        for t in SWEEP_TOKENS if not smoke else (1,):
            sets = make_sets(
                jax.random.key(sum(ns) + t + 7), t, ns, k, w_dtype, True, n_sets_for(ns, k, w_dtype, smoke)
            )
            for v in sweep_variants(t, ns, k, cdt):
                if time.perf_counter() > deadline:
                    log("sweep budget spent")
                    return
                label = f"sweep {model} {name} T={t} {v or 'default'}"
                try:
                    fn = impl_fns(len(ns), w_dtype, True, smoke, **v)["pallas"]
                    err = check(fn, sets[0], len(ns), w_dtype, True)
                    us, extra = timed(fn, sets, smoke, device_time=not smoke)
                    row = make_row(model, name, ns, k, t, w_dtype, True, "pallas", us, extra, ceil)
                    row.update(variant=v, check_err=round(err, 7))
                    log(f"{label}: {us:.2f} us, device {extra.get('device_us')} us, err {err:.2g}")
                except Exception as e:  # noqa: BLE001
                    row = base_row(model, name, ns, k, t, w_dtype, True, "pallas")
                    row.update(variant=v, error=f"{type(e).__name__}: {str(e)[:300]}")
                    log(f"{label}: ERROR {row['error']}")
                rows.append(row)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    ap.add_argument("--tokens", type=common.int_list, default=None, help="T values (default 1,8,32,64,128)")
    ap.add_argument("--v3", action="store_true", help="also DeepSeek-V3's bf16 shapes")
    ap.add_argument("--sweep", action="store_true", help="also time tuning variants at T = 1 and 32")
    ap.add_argument("--sweep-budget-s", type=float, default=150.0)
    ap.add_argument("--names", default=None, help="only these shapes (comma-separated names, e.g. mlp_gate_up)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ceil = common.measure_ceilings(small=args.smoke)
    log(f"{jax.devices()[0].device_kind}: ceilings {ceil}")
    results = common.results_header(ceil)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES + (V3_SHAPES if args.v3 else [])
    if args.names:
        names = set(args.names.split(","))
        unknown = names - {s[1] for s in shapes}
        if unknown:
            ap.error(f"--names: no shape named {sorted(unknown)} (shapes: {[s[1] for s in shapes]})")
        shapes = [s for s in shapes if s[1] in names]
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else TOKENS)
    ok = bench_shapes(shapes, tokens, ceil, results["rows"], args.smoke)
    if args.sweep:
        sweep_rows = []
        sweep(
            [s for s in shapes if s in SHAPES or args.smoke],
            ceil,
            sweep_rows,
            args.smoke,
            time.perf_counter() + args.sweep_budget_s,
        )
        results["sweep"] = sweep_rows
    results["checks_passed"] = bool(ok)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    name = "linear-h200-smoke.json" if args.smoke else "linear-h200.json"
    common.write_results(os.path.join(args.out, name), results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
