"""Benchmark of the block-scaled fp8 GEMMs (pallas_kernels.fp8_matmul) against bf16 on one GPU.

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/fp8_gemm.py --out DIR [--budget-s 420] [--smoke]
    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/fp8_gemm.py --diagnose --out DIR [--smoke]

Shapes: the linears of DeepSeek-V3 (q_a, kv_a, q_b, o_proj, shared-expert and dense-MLP gate/down) and
DeepSeek-V2-Lite (q_proj, kv_a, o_proj, dense gate; its dense down_proj, K = 10944, is not a multiple of 128:
`fp8_matmul_xla` rows), and the routed experts: a V3 EP-8 shard (32 local experts, D 7168, I 2048) and
V2-Lite (64 experts, D 2048, I 1408), gate [E, I, D] and down [E, D, I], rows spread uniformly over the
experts. M = 1 .. 16384 rows.

impl per row:
- "fp8": the W8A8 Mosaic GPU kernel, activation quantization (`quantize_act`, an XLA fusion) included;
- "bf16": dense: XLA's bf16 dot (cuBLAS); grouped: our Pallas grouped_matmul in bf16 (bench/moe.py's
  kernel), the bf16 path the model runs;
- "xla_fp8": dense only: XLA's fp8 dot (e4m3 x e4m3 -> bf16, one scale per tensor: cuBLASLt fp8 GEMM), the
  fastest fp8 XLA offers, though without DeepSeek's block scales (a speed reference, not the same numerics);
- "fp8_xla": shapes the kernel does not take: `fp8_matmul_xla` (dequantize + dot);
- "fp8_st{n}" (with --stages n,..): the kernel at ring depth n instead of `default_stages`;
- "fp8_linear" / "bf16_linear" (dense, M <= `layers.FP8_LINEAR_MAX_T`): the Triton linear kernel
  (`pallas_kernels.linear`) with the block-FP8 weights (W8A8, x quantized in the kernel: what the model runs at
  decode sizes) and with the bf16 ones (the model's bf16 decode path); "fp8_linear_{s2,s8,bn32}": its tuning
  variants (ring depth 2 / 8, 32-wide N blocks);
- "fp8_triton" (grouped, M <= 8 x FP8_LINEAR_MAX_T): the Triton grouped kernel's W8A8 path (`grouped_matmul(...,
  rhs_scale=)`), what the model runs for fp8 experts at decode sizes (sorted rows here).
Before timing, each fp8 shape is checked (at the first and last M) against `fp8_matmul_xla` at float32
precision (the same numerics in XLA) to `FP8_GEMM_GPU_TOL` + bf16 rounding (2^-8): exit 1 on a mismatch (rows get
check_rel_err).

--diagnose (DIR/fp8-gemm-diagnose-h200.json, no timing; exit 1 if a kernel row fails) separates what can make
the kernel disagree with a reference, each row an error max|out - ref| / max|ref|:
- section "reference", random inputs (V3 q_a_proj, M 1 and 256): the kernel, the jitted XLA path (default and
  float32 precision), the XLA path as it was before `fp8_matmul._f32` (no barrier: XLA on GPU may fold the
  activations' f32 -> e4m3 -> f32) and the eager XLA path, each against the float64 product of the
  materialized quantized operands (err_vs_quantized) and of the unquantized activations (err_vs_unquantized).
  The inputs are the timing runs' (jax.random.normal in bf16), so these numbers compare with their checks; its
  tails are cut at one value, so most of its 128-wide blocks share one scale: a block-scale mix-up shows only
  in the "exact" section.
- section "exact": `testing.fp8_lossless_operands` (quantization lossless, reference exact) with scale patterns
  scales_1 (all 1), act_block (activation scale per K block), act_row (per row), w_block (weight scale per
  block), all; over bm 64 / 128 (M <= 64 or not), bn 64 (N % 128 == 64), ring depth 1-3, K splits 1 / 2 / 4 /
  default, and the grouped kernel (uneven groups, an empty one, NaN padding rows that must come out 0).

Rows (DIR/fp8-gemm-h200.json; --smoke: fp8-gemm-h200-smoke.json): op "fp8_gemm", model, name, kind
(dense/grouped), M, N, K, G (experts, grouped), impl, us (median wall time a call, back to back), at M <= 256 also
device_us / span_us / kernels_per_call / kernels_us (a traced pass: the GPU's busy time a call; at decode sizes `us`
is mostly the host's dispatch), TFLOPs (2 M N K / time), TBps (weight bytes / time: the decode roofline),
frac_matmul (of the bf16 matmul ceiling), frac_copy, speedup_vs_bf16 (bf16's time / this time, same shape and M);
time = device_us where measured, else us. Ceilings measured in the same run (mla_jax.bench.common).
--smoke: tiny shapes on a CPU under the Mosaic GPU interpreter (checks the plumbing only).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message=".*[Tt]riton.*")

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from mla_jax.layers import FP8_LINEAR_MAX_T  # noqa: E402
from pallas_kernels import fp8_matmul as F  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402
from pallas_kernels.linear import linear  # noqa: E402
from pallas_kernels.testing import FP8_GEMM_GPU_TOL, fp8_lossless_operands  # noqa: E402

DENSE = [  # (model, name, N, K)
    ("v3", "q_a_proj", 1536, 7168),
    ("v3", "kv_a_proj_with_mqa", 576, 7168),
    ("v3", "q_b_proj", 24576, 1536),
    ("v3", "o_proj", 7168, 16384),
    ("v3", "shared_gate_proj", 2048, 7168),
    ("v3", "mlp_gate_proj", 18432, 7168),
    ("v3", "mlp_down_proj", 7168, 18432),
    ("v2-lite", "q_proj", 3072, 2048),
    ("v2-lite", "kv_a_proj_with_mqa", 576, 2048),
    ("v2-lite", "o_proj", 2048, 2048),
    ("v2-lite", "mlp_gate_proj", 10944, 2048),
    ("v2-lite", "mlp_down_proj", 2048, 10944),
]
GROUPED = [  # (model, name, G, N, K)
    ("v3-ep8", "experts_gate_proj", 32, 2048, 7168),
    ("v3-ep8", "experts_down_proj", 32, 7168, 2048),
    ("v2-lite", "experts_gate_proj", 64, 1408, 2048),
    ("v2-lite", "experts_down_proj", 64, 2048, 1408),
]
MS = (1, 16, 128, 512, 2048, 4096, 16384)
SMOKE_DENSE = [("smoke", "dense", 128, 256), ("smoke", "ragged_k", 128, 200)]
SMOKE_GROUPED = [("smoke", "grouped", 3, 128, 256)]
SMOKE_MS = (1, 70)
DEVICE_TIME_MAX_M = 256  # rows up to this M also get device_us (a traced pass): a decode-size call's wall time is
# mostly the host's dispatch (part 30: 40-240 us a call at M <= 64, for GEMMs whose weight bytes need 2-6 us)
L2_BYTES = 64 << 20  # weights smaller than this cycle through 3 sets so L2 cannot hold them


def log(*a):
    print(*a, flush=True)


def _weights(key, lead, n, k, sets):
    out = []
    for s in range(sets):
        w = jax.random.normal(jax.random.fold_in(key, s), (*lead, n, k), jnp.float32) * k**-0.5
        wq, ws = F.quantize_weight_blocks(w)
        out.append((w.astype(jnp.bfloat16), wq, ws))
    return out


def _timed(fn, arg_sets, smoke):
    if smoke:
        return common.time_fn(fn, arg_sets, iters=1, reps=1, warmup=1)
    return common.time_fn(fn, arg_sets, iters=10, reps=5, warmup=2)


def _row(model, name, kind, m, n, k, g, impl, us, ceil, wbytes, **extra):
    r = dict(op="fp8_gemm", model=model, name=name, kind=kind, M=m, N=n, K=k, impl=impl)
    if g:
        r["G"] = g
    if us is not None:
        t = extra.get("device_us") or us  # the GPU's time where it was traced
        tf = 2 * m * n * k / (t * 1e-6) / 1e12
        tb = wbytes / (t * 1e-6) / 1e12
        r.update(us=round(us, 2), TFLOPs=round(tf, 2), TBps=round(tb, 3))
        if ceil.get("matmul_TFLOPs"):
            r["frac_matmul"] = round(tf / ceil["matmul_TFLOPs"], 3)
        if ceil.get("copy_TBps"):
            r["frac_copy"] = round(tb / ceil["copy_TBps"], 3)
    r.update(extra)
    return r


def _check(name, out, ref):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    rel = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))
    good = bool(np.all(np.isfinite(out))) and rel <= FP8_GEMM_GPU_TOL + 2.0**-8  # + bf16 out vs float32 math
    log(f"check {name}: max|err|/max|ref| = {rel:.2e} {'ok' if good else 'FAIL'}")
    return good, rel


def _sweep_fns(stages, make):
    """{impl: jitted fn} of the --stages variants ("fp8_st{n}")."""
    return {f"fp8_st{n}": jax.jit(make(n)) for n in stages}


def _measure(rows, base, impls, smoke, check_ref=None, **extra):
    """Times each impl of `impls` ({impl: (jitted fn, [args, ...])}) into a row of `base` + `extra`, with
    speedup_vs_bf16; with `check_ref`, impl "fp8" is first checked against it at float32 matmul precision
    (its row gets check_rel_err). Returns whether that check passed."""
    ok, results, shape_rows = True, {}, []
    label = f"{base['model']} {base['name']} M={base['m']}"
    for impl, (fn, args) in impls.items():
        row_extra = dict(extra)
        try:
            if impl == "fp8" and check_ref is not None:
                with jax.default_matmul_precision("highest"):
                    ref = check_ref(*args[0])
                good, rel = _check(label, fn(*args[0]), ref)
                ok &= good
                row_extra["check_rel_err"] = round(rel, 5)
            us = _timed(fn, args, smoke)
            if not smoke and base["m"] <= DEVICE_TIME_MAX_M:  # decode sizes: the wall time is the host's dispatch
                dev = common.device_time_us(fn, args)
                row_extra.update(dev)
            results[impl] = row_extra.get("device_us") or us
            shape_rows.append(_row(impl=impl, us=us, **base, **row_extra))
        except Exception as e:  # noqa: BLE001
            log(f"{label} {impl}: ERROR {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc()
            shape_rows.append(
                _row(impl=impl, us=None, error=f"{type(e).__name__}: {str(e)[:300]}", **base, **row_extra)
            )
    if "bf16" in results:
        for r in shape_rows:
            if r.get("us"):
                r["speedup_vs_bf16"] = round(results["bf16"] / (r.get("device_us") or r["us"]), 3)
    rows += shape_rows
    log(f"{label}: " + ", ".join(f"{i} {u:.1f} us" for i, u in results.items()))
    return ok


def bench_dense(shapes, ms, ceil, rows, smoke, deadline, stages=()):
    ok = True
    interp = smoke
    for model, name, n, k in shapes:
        if time.perf_counter() > deadline:
            log(f"budget spent: skipping {model} {name}")
            continue
        sets = 3 if n * k < L2_BYTES and not smoke else 1
        ws_ = _weights(jax.random.key(n * 7 + k), (), n, k, sets)
        wbytes = n * k  # fp8 weight bytes read per call (scales: 1/4096 of that)
        kernel_ok = F.unsupported_reason(n, k) is None
        fp8_fn = jax.jit(lambda x, w, s: F.fp8_matmul(x, w, s, interpret=interp))
        fp8_xla = jax.jit(lambda x, w, s: F.fp8_matmul_xla(x, w, s))
        check_ref = jax.jit(lambda x, w, s: F.fp8_matmul_xla(x, w, s, out_dtype=jnp.float32))
        sweep = _sweep_fns(stages, lambda st: lambda x, w, s: F.fp8_matmul(x, w, s, interpret=interp, stages=st))
        bf16_fn = jax.jit(lambda x, w: jnp.einsum("mk,nk->mn", x, w))
        lin_fp8 = jax.jit(lambda x, w, s: linear(x, (w,), scales=(s,), interpret=interp)[0])
        lin_bf16 = jax.jit(lambda x, w: linear(x, (w,), interpret=interp)[0])
        lin_fp8_variants = {
            f"fp8_linear_{tag}": jax.jit(lambda x, w, s, kw=kw: linear(x, (w,), scales=(s,), interpret=interp, **kw)[0])
            for tag, kw in (("s2", dict(num_stages=2)), ("s8", dict(num_stages=8)), ("bn32", dict(block_n=32)))
        }
        xla8 = jax.jit(
            lambda x, w: jax.lax.dot_general(
                x.astype(jnp.float8_e4m3fn), w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.bfloat16
            )
        )
        for m in ms:
            xs = [jax.random.normal(jax.random.key(m + s), (m, k), jnp.bfloat16) for s in range(sets)]
            args8 = [(x, w[1], w[2]) for x, w in zip(xs, ws_)]
            impls = {"bf16": (bf16_fn, [(x, w[0]) for x, w in zip(xs, ws_)])}
            impls["fp8" if kernel_ok else "fp8_xla"] = (fp8_fn if kernel_ok else fp8_xla, args8)
            if not smoke:
                impls["xla_fp8"] = (xla8, [(x, w[1]) for x, w in zip(xs, ws_)])
            if kernel_ok:
                impls |= {impl: (fn, args8) for impl, fn in sweep.items()}
            if m <= FP8_LINEAR_MAX_T:  # decode sizes: the Triton linear kernel, fp8 (what the model runs) and bf16
                impls["fp8_linear"] = (lin_fp8, args8)
                impls["bf16_linear"] = (lin_bf16, [(x, w[0]) for x, w in zip(xs, ws_)])
                # its fp8 tuning, untimed when written: 1-byte weight tiles of one 128-deep scale block a stage
                # put a quarter of the bf16 path's bytes in flight at its default depth
                impls |= {name: (fn, args8) for name, fn in lin_fp8_variants.items()}
            base = dict(model=model, name=name, kind="dense", m=m, n=n, k=k, g=0, ceil=ceil, wbytes=wbytes)
            ok &= _measure(rows, base, impls, smoke, check_ref if m in (ms[0], ms[-1]) else None)
    return ok


def bench_grouped(shapes, ms, ceil, rows, smoke, deadline, stages=()):
    ok = True
    interp = smoke
    for model, name, g, n, k in shapes:
        if time.perf_counter() > deadline:
            log(f"budget spent: skipping {model} {name}")
            continue
        ((w16, wq, ws),) = _weights(jax.random.key(g * n + k), (g,), n, k, 1)
        fp8_fn = jax.jit(lambda x, w, s, gs: F.fp8_grouped_matmul(x, w, s, gs, interpret=interp))
        check_ref = jax.jit(lambda x, w, s, gs: F.fp8_grouped_matmul_xla(x, w, s, gs, out_dtype=jnp.float32))
        bf16_fn = jax.jit(lambda x, w, gs: gm.grouped_matmul(x, w, gs, interpret=interp))
        fp8_tri = jax.jit(lambda x, w, s, gs: gm.grouped_matmul(x, w, gs, rhs_scale=s, interpret=interp))
        sweep = _sweep_fns(
            stages, lambda st: lambda x, w, s, gs: F.fp8_grouped_matmul(x, w, s, gs, interpret=interp, stages=st)
        )
        for m in ms:
            rng = np.random.default_rng(m)
            gs = jnp.asarray(rng.multinomial(m, np.ones(g) / g).astype(np.int32))
            hit = int((np.asarray(gs) > 0).sum())
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            impls = {"bf16": (bf16_fn, [(x, w16, gs)]), "fp8": (fp8_fn, [(x, wq, ws, gs)])}
            impls |= {impl: (fn, [(x, wq, ws, gs)]) for impl, fn in sweep.items()}
            if m <= FP8_LINEAR_MAX_T * 8:  # decode sizes (up to 64 tokens x top-8): the Triton grouped kernel, fp8
                impls["fp8_triton"] = (fp8_tri, [(x, wq, ws, gs)])
            base = dict(model=model, name=name, kind="grouped", m=m, n=n, k=k, g=g, ceil=ceil, wbytes=hit * n * k)
            check = check_ref if m in (ms[0], ms[-1]) else None
            ok &= _measure(rows, base, impls, smoke, check, experts_hit=hit)
    return ok


# ---- --diagnose ----

DIAG_REF = [("q_a_proj", 1536, 7168, (1, 256))]  # (name, N, K, Ms): random inputs
DIAG_EXACT = [  # (kind, M, N, K, G, k_splits, stages); None: the wrapper's default
    ("dense", 1, 1536, 7168, 0, None, None),
    ("dense", 64, 1536, 7168, 0, 1, 1),
    ("dense", 64, 1536, 7168, 0, 1, 2),
    ("dense", 64, 1536, 7168, 0, 1, 3),
    ("dense", 64, 1536, 7168, 0, 4, 2),
    ("dense", 256, 1536, 7168, 0, 1, 1),
    ("dense", 256, 1536, 7168, 0, 1, 2),
    ("dense", 256, 1536, 7168, 0, 2, 2),
    ("dense", 64, 576, 7168, 0, 1, 2),
    ("grouped", 512, 2048, 2048, 8, None, None),
    ("grouped", 512, 2048, 2048, 8, 1, 1),
]
DIAG_PATTERNS = {  # fp8_lossless_operands flags (act_block, act_row, w_block)
    "scales_1": (False, False, False),
    "act_block": (True, False, False),
    "act_row": (False, True, False),
    "w_block": (False, False, True),
    "all": (True, True, True),
}
SMOKE_DIAG_REF = [("smoke", 128, 384, (1, 70))]
SMOKE_DIAG_EXACT = [
    ("dense", 1, 128, 384, 0, None, None),
    ("dense", 70, 192, 384, 0, 1, 1),
    ("grouped", 40, 128, 256, 3, 1, 2),
]
SMOKE_DIAG_PATTERNS = ("scales_1", "all")


def _rel(out, ref):
    out = np.asarray(out, np.float64)
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)) if np.all(np.isfinite(out)) else float("inf")


def _xla_without_barrier(x, w, s):
    """`fp8_matmul_xla` as it was before `fp8_matmul._f32`: dequantizes with plain converts, which XLA on GPU
    may fold into the quantizing convert (then the activations are never rounded to e4m3)."""
    xq, xs = F.quantize_act(x)
    xd = xq.astype(jnp.float32) * jnp.repeat(xs, F.BLOCK, axis=1)
    wd = w.astype(jnp.float32) * jnp.repeat(jnp.repeat(s, F.BLOCK, axis=0), F.BLOCK, axis=1)[: w.shape[0], : w.shape[1]]
    return jnp.einsum("mk,nk->mn", xd, wd, preferred_element_type=jnp.float32)


def diagnose_reference(shapes, rows, smoke):
    """Random inputs: which reference does the kernel match, and what does each XLA path compute?"""
    f32 = jnp.float32
    impls = {
        "kernel": lambda x, w, s: F.fp8_matmul(x, w, s, out_dtype=f32, interpret=smoke),
        "xla_jit": jax.jit(lambda x, w, s: F.fp8_matmul_xla(x, w, s, out_dtype=f32)),
        "xla_jit_highest": jax.jit(lambda x, w, s: F.fp8_matmul_xla(x, w, s, out_dtype=f32)),
        "xla_jit_no_barrier": jax.jit(_xla_without_barrier),
        "xla_eager": lambda x, w, s: F.fp8_matmul_xla(x, w, s, out_dtype=f32),
    }
    ok = True
    for name, n, k, ms in shapes:
        w = jax.random.normal(jax.random.key(n * 7 + k), (n, k), f32) * k**-0.5
        wq, ws = jax.jit(F.quantize_weight_blocks)(w)
        wd = np.asarray(F.dequantize_weight_blocks(wq, ws), np.float64)  # eager: materialized e4m3 operands
        for m in ms:
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            xq, xs = jax.jit(F.quantize_act)(x)
            xd = np.asarray(xq, np.float64) * np.repeat(np.asarray(xs, np.float64), F.BLOCK, axis=1)
            ref_q, ref_u = xd @ wd.T, np.asarray(x, np.float64) @ wd.T
            for impl, fn in impls.items():
                try:
                    with jax.default_matmul_precision("highest" if impl != "xla_jit" else None):
                        out = jax.block_until_ready(fn(x, wq, ws))
                    r = dict(section="reference", impl=impl, name=name, M=m, N=n, K=k)
                    r |= dict(err_vs_quantized=_rel(out, ref_q), err_vs_unquantized=_rel(out, ref_u))
                    if impl == "kernel":
                        r["ok"] = r["err_vs_quantized"] <= FP8_GEMM_GPU_TOL
                        ok &= r["ok"]
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    r = dict(
                        section="reference", impl=impl, name=name, M=m, N=n, K=k, error=f"{type(e).__name__}: {e}"[:300]
                    )
                    ok &= impl != "kernel"
                rows.append(r)
                log(r)
    return ok


def diagnose_exact(configs, patterns, rows, smoke):
    """Lossless operands (exact reference) with each scale pattern, over tile shapes, ring depths, K splits."""
    ok = True
    for kind, m, n, k, g, k_splits, stages in configs:
        for pattern in patterns:
            act_block, act_row, w_block = DIAG_PATTERNS[pattern]
            rng = np.random.default_rng(m * 7 + n + k + g)
            lead = (g,) if kind == "grouped" else ()
            x, _, wq, ws, wd = fp8_lossless_operands(
                rng, m, n, k, lead, act_block=act_block, act_row=act_row, w_block=w_block
            )
            kw = dict(out_dtype=jnp.float32, k_splits=k_splits, stages=stages, interpret=smoke)
            r = dict(section="exact", pattern=pattern, kind=kind, M=m, N=n, K=k, G=g, k_splits=k_splits, stages=stages)
            try:
                if kind == "dense":
                    out = np.asarray(F.fp8_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(wq), jnp.asarray(ws), **kw))
                    r["err"] = _rel(out, x.astype(np.float64) @ wd.T)
                else:
                    sizes = rng.multinomial(m - 5, np.ones(g) / g).astype(np.int32)
                    sizes[1] = 0  # an empty group; its rows go to the next one
                    sizes[2] += m - 5 - sizes.sum()
                    x[m - 5 :] = np.nan  # padding rows
                    xb, gs = jnp.asarray(x, jnp.bfloat16), jnp.asarray(sizes)
                    out = np.asarray(F.fp8_grouped_matmul(xb, jnp.asarray(wq), jnp.asarray(ws), gs, **kw))
                    group, ref = np.repeat(np.arange(g), sizes), np.zeros((m - 5, n))
                    for e in range(g):
                        ref[group == e] = x[: m - 5][group == e].astype(np.float64) @ wd[e].T
                    r["err"] = _rel(out[: m - 5], ref)
                    r["padding_zero"] = bool(np.all(out[m - 5 :] == 0))
                r["ok"] = r["err"] <= FP8_GEMM_GPU_TOL and r.get("padding_zero", True)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                r |= dict(ok=False, error=f"{type(e).__name__}: {e}"[:300])
            ok &= r["ok"]
            rows.append(r)
            log(r)
    return ok


def diagnose(args):
    ceil = common.measure_ceilings(small=args.smoke)
    results = common.results_header(ceil)
    results["tolerance"] = FP8_GEMM_GPU_TOL
    rows = results["rows"]
    ok = diagnose_reference(SMOKE_DIAG_REF if args.smoke else DIAG_REF, rows, args.smoke)
    patterns = SMOKE_DIAG_PATTERNS if args.smoke else tuple(DIAG_PATTERNS)
    ok &= diagnose_exact(SMOKE_DIAG_EXACT if args.smoke else DIAG_EXACT, patterns, rows, args.smoke)
    results["failing"] = [
        {k: r[k] for k in ("section", "pattern", "impl", "kind", "M", "N", "K", "G", "k_splits", "stages") if k in r}
        for r in rows
        if r.get("ok") is False
    ]
    results["checks_passed"] = bool(ok)
    name = "fp8-gemm-diagnose-h200-smoke.json" if args.smoke else "fp8-gemm-diagnose-h200.json"
    common.write_results(os.path.join(args.out, name), results)
    verdict = "all kernel rows within" if ok else "FAILING rows beyond"
    log(f"diagnose: {verdict} {FP8_GEMM_GPU_TOL}: {results['failing']}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, Mosaic GPU interpreter (CPU check)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="no new shape starts after this")
    ap.add_argument("--ms", type=str, default=None, help="comma-separated M values (default 1..16384)")
    ap.add_argument("--stages", type=str, default="", help="also time these ring depths, e.g. 2,3,4 (fp8_st{n})")
    ap.add_argument("--shapes", type=str, default="", help="only shapes whose 'model name' contains one of these (,)")
    ap.add_argument("--diagnose", action="store_true", help="the correctness diagnostic instead of the timings")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("NPROC", "8")
    if args.diagnose:
        sys.exit(0 if diagnose(args) else 1)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    ceil = common.measure_ceilings(small=args.smoke)
    log(f"ceilings: {ceil}")
    results = common.results_header(ceil)
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (SMOKE_MS if args.smoke else MS)
    rows = results["rows"]
    stages = tuple(int(v) for v in args.stages.split(",") if v)
    picks = [p for p in args.shapes.split(",") if p]
    pick = lambda shapes: [s for s in shapes if not picks or any(p in f"{s[0]} {s[1]}" for p in picks)]  # noqa: E731
    ok = bench_grouped(pick(SMOKE_GROUPED if args.smoke else GROUPED), ms, ceil, rows, args.smoke, deadline, stages)
    ok &= bench_dense(pick(SMOKE_DENSE if args.smoke else DENSE), ms, ceil, rows, args.smoke, deadline, stages)
    results["checks_passed"] = bool(ok)
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    name = "fp8-gemm-h200-smoke.json" if args.smoke else "fp8-gemm-h200.json"
    common.write_results(os.path.join(args.out, name), results)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
