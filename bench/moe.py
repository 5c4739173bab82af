"""Benchmark of the MoE expert GEMMs on one GPU: XLA's ragged_dot vs the Pallas grouped matmul.

    PYTHONPATH=. python3 bench/moe.py --out DIR [--sweep] [--smoke]

What is timed: the routed-expert MLP on token copies already sorted by expert, as
`mla_jax.layers.moe` runs it: h = silu(gmm(xs, gate)) * gmm(xs, up); y = gmm(h, down), bf16 weights
in the HF layout [E, out, in]. Shapes: DeepSeek-V2-Lite (D 2048, I 1408, 64 experts, top-6) and a
V3-like expert-parallel shard (D 7168, I 2048, 32 local experts of 256, top-8: the copies routed to
other shards sort past the groups as padding rows, ~7/8 of the T*8 rows), at T = 1, 32, 128
(decode) and 16384 (prefill) tokens.

(a) checks the Pallas kernel against its float32 reference (random groups, NaN-poisoned padding
    rows, decode and prefill tilings, K splits, f32, both rhs layouts) and the whole routed MLP
    against the dense all-experts formulation; exits 1 on any mismatch;
(b) times `jax.lax.ragged_dot_general` in subprocesses, one per XLA flag setting, so that a fatal
    XLA error or an unknown flag cannot end the run: "xla" (this jaxlib's defaults), "xla_cudnn"
    (--xla_gpu_experimental_use_ragged_dot_fusion=true: cuDNN's grouped GEMM) and "xla_dense" (the
    same flag =false: the zero-padded dense expansion). A variant whose lowering the default run
    already showed is skipped. Rows record the lowering seen in the compiled HLO and XLA's temp
    buffer size. The workers run before this process allocates much (it does not preallocate);
(c) measures the copy/matmul ceilings;
(d) times impl "pallas" (grouped_matmul, default tuning) and "dense" (every expert on every token:
    einsums over [E, T, I], routing weights folded in before the down projection; where memory
    allows);
(e) with --sweep, times Pallas tuning variants per shape and GEMM into DIR/moe-sweep-h200.json.

Rows (DIR/moe-h200.json, format of notes/bench-results.md): op "moe_experts", model, T, E (local
experts), E_total, top_k, D, I, rows (M = T*top_k), routed_rows (copies routed to the local
experts), experts_hit, impl, us (median), TFLOPs (useful: 2*routed_rows*3*D*I), TBps (weights of
the experts hit, experts_hit*3*D*I*2 bytes, over the time: the decode roofline), frac_matmul,
frac_copy, roofline_us (max of the two ceilings' times), frac_roofline.
--smoke: tiny shapes, interpret mode, on a CPU (writes moe-h200-smoke.json).
Runtime on an H200: ~4 minutes without --sweep; the sweep adds --sweep-budget-s (default 90 s:
~3 variants per shape and GEMM; 300 s covers the lists).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Triton lowering warns per call
warnings.filterwarnings("ignore", message=".*[Tt]riton.*")
# The XLA workers run while this process is alive: allocate on demand, not 75% of the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

if __package__ in (None, ""):  # `python3 bench/moe.py` (also how the workers are started)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

CONFIGS = {  # D hidden, I expert intermediate, E local experts, E_total routed experts, top_k
    "v2-lite": dict(D=2048, I=1408, E=64, E_total=64, top_k=6),
    "v3-ep8": dict(D=7168, I=2048, E=32, E_total=256, top_k=8),
}
TOKENS = (1, 32, 128, 16384)
SMOKE_CONFIGS = {
    "v2-lite": dict(D=64, I=48, E=8, E_total=8, top_k=2),
    "v3-ep8": dict(D=96, I=64, E=4, E_total=16, top_k=4),
}
SMOKE_TOKENS = (1, 5, 40)
DECODE_SETS = 3  # decode cases cycle through 3 input sets (distinct weights) so L2 cannot hold them
FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion"
XLA_VARIANTS = (("xla", None), ("xla_cudnn", f"{FLAG}=true"), ("xla_dense", f"{FLAG}=false"))
WORKER_BUDGET_S = 60.0
DN = jax.lax.RaggedDotDimensionNumbers(  # rhs [E, out, in]: contract lhs dim 1 with rhs dim 2
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------------
# Inputs, built on device from a seed (the XLA workers rebuild exactly the same ones).


@functools.partial(jax.jit, static_argnames=("t", "d", "i", "e", "e_total", "k"))
def _make(key, *, t, d, i, e, e_total, k):
    kx, ks, kg, ku, kd = jax.random.split(key, 5)
    x = jax.random.normal(kx, (t, d), jnp.bfloat16)  # [T, D]
    top, ids = jax.lax.top_k(jax.random.uniform(ks, (t, e_total)), k)  # uniform routing, distinct
    wts = jax.nn.softmax(4.0 * top, axis=-1)  # [T, k] f32
    flat = ids.reshape(-1)
    mine = flat < e  # this shard holds experts [0, E)
    key_ = jnp.where(mine, flat, e)  # other shards' copies sort past every group (padding rows)
    order = jnp.argsort(key_, stable=True)
    token = order // k
    gs = jnp.bincount(key_, length=e).astype(jnp.int32)  # [E]
    xs = x[token]  # [T*k, D]
    wg = (jax.random.normal(kg, (e, i, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    wu = (jax.random.normal(ku, (e, i, d), jnp.float32) * d**-0.5).astype(jnp.bfloat16)
    wd = (jax.random.normal(kd, (e, d, i), jnp.float32) * i**-0.5).astype(jnp.bfloat16)
    w_local = jnp.where(ids < e, wts, 0.0)
    combine = (
        jnp.zeros((t, e), jnp.float32).at[jnp.arange(t)[:, None], jnp.minimum(ids, e - 1)].add(w_local)
    )  # [T, E] routing weights of the local experts
    w_sorted = jnp.where(mine[order], wts.reshape(-1)[order], 0.0)  # [T*k]
    return dict(x=x, xs=xs, gs=gs, wg=wg, wu=wu, wd=wd, combine=combine, token=token, w_sorted=w_sorted)


def make_case(cfg, t, seed):
    c = dict(t=t, d=cfg["D"], i=cfg["I"], e=cfg["E"], e_total=cfg["E_total"], k=cfg["top_k"])
    n_sets = DECODE_SETS if t <= 128 else 1
    sets = [_make(jax.random.key(seed * 100 + s), **c) for s in range(n_sets)]
    gs = np.stack([np.asarray(s["gs"]) for s in sets])
    info = dict(
        rows=t * cfg["top_k"],
        routed_rows=round(float(gs.sum(1).mean()), 2),
        experts_hit=round(float((gs > 0).sum(1).mean()), 2),
    )
    return sets, info


# ----------------------------------------------------------------------------------------------
# The timed functions.


def ragged_gmm(lhs, w, gs):
    return jax.lax.ragged_dot_general(lhs, w, gs, DN)


def pallas_gmm(lhs, w, gs, *, interpret=False, **tuning):
    return gm.grouped_matmul(lhs, w, gs, interpret=interpret, **tuning)


def expert_mlp(gmm):
    """Sorted rows xs [M, D] -> [M, D] through gate/up/down, as mla_jax.layers.moe."""

    def f(xs, gs, wg, wu, wd):
        h = jax.nn.silu(gmm(xs, wg, gs)) * gmm(xs, wu, gs)  # [M, I]
        return gmm(h, wd, gs)

    return jax.jit(f)


@jax.jit
def dense_mlp(x, combine, wg, wu, wd):
    """Every local expert on every token, routing weights folded in: x [T, D] -> [T, D]."""
    h = jax.nn.silu(jnp.einsum("td,eid->eti", x, wg)) * jnp.einsum("td,eid->eti", x, wu)  # [E, T, I]
    h = h * combine.T[:, :, None].astype(h.dtype)
    return jnp.einsum("eti,edi->td", h, wd)  # one dot contracting (E, I)


@jax.jit
def combine_rows(y, token, w_sorted, x):
    """Routed rows y [M, D] -> [T, D] weighted sum per token (the scatter of layers.moe)."""
    return jnp.zeros(x.shape, jnp.float32).at[token].add(y.astype(jnp.float32) * w_sorted[:, None])


def mlp_args(s):
    return (s["xs"], s["gs"], s["wg"], s["wu"], s["wd"])


def dense_args(s):
    return (s["x"], s["combine"], s["wg"], s["wu"], s["wd"])


def compile_with_info(fn, args, *, ragged=False):
    """Compile once; report the lowering XLA chose (from the optimized HLO) and its temp buffer."""
    compiled = fn.lower(*args).compile()
    info = {}
    try:
        txt = compiled.as_text()
        # Opcodes and custom-call kinds, not op_name metadata (which always says ragged_dot_general).
        if "__cudnn$fusion" in txt:
            info["lowering"] = "cudnn"
        elif "groupedMatmul" in txt:
            info["lowering"] = "cublaslt_grouped"
        elif "ragged-dot(" in txt:
            info["lowering"] = "ragged_dot_op"
        elif ragged:
            info["lowering"] = "dense_expansion"
        elif "__gpu$xla.gpu.triton" in txt:
            info["lowering"] = "pallas_triton"
        else:
            info["lowering"] = "xla"
    except Exception:  # noqa: BLE001
        pass
    try:
        info["temp_MB"] = round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 1)
    except Exception:  # noqa: BLE001
        pass
    return compiled, info


def timed(fn, arg_sets, smoke):
    if smoke:
        return common.time_fn(fn, arg_sets, iters=2, reps=1, warmup=1)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    first = time.perf_counter() - t0
    if first > 0.05:  # slow (dense prefill): a few calls are enough
        return common.time_fn(fn, arg_sets, iters=2, reps=3, warmup=1)
    return common.time_fn(fn, arg_sets, iters=20, reps=5, warmup=3)


def row(model, cfg, t, info, impl, us, **extra):
    d, i = cfg["D"], cfg["I"]
    flops = 2 * info["routed_rows"] * 3 * d * i
    wbytes = info["experts_hit"] * 3 * d * i * 2
    r = {
        "op": "moe_experts",
        "model": model,
        "T": t,
        "E": cfg["E"],
        "E_total": cfg["E_total"],
        "top_k": cfg["top_k"],
        "D": d,
        "I": i,
        "rows": info["rows"],
        "routed_rows": info["routed_rows"],
        "experts_hit": info["experts_hit"],
        "impl": impl,
        "dtype": "bf16",
        "weight_MB": round(wbytes / 1e6, 1),
    }
    if us is not None:
        tf, tb = flops / (us * 1e-6) / 1e12, wbytes / (us * 1e-6) / 1e12
        r.update(us=round(us, 1), TFLOPs=round(tf, 2), TBps=round(tb, 3))
    r.update(extra)
    return r


def add_fractions(r, ceil):
    """Fractions of the ceilings measured in this run (the XLA workers ran before they were)."""
    if "us" not in r or not (ceil.get("matmul_TFLOPs") and ceil.get("copy_TBps")):
        return
    flops = 2 * r["routed_rows"] * 3 * r["D"] * r["I"]
    wbytes = r["experts_hit"] * 3 * r["D"] * r["I"] * 2
    roof = max(flops / (ceil["matmul_TFLOPs"] * 1e12), wbytes / (ceil["copy_TBps"] * 1e12)) * 1e6
    r.update(
        frac_matmul=round(r["TFLOPs"] / ceil["matmul_TFLOPs"], 3),
        frac_copy=round(r["TBps"] / ceil["copy_TBps"], 3),
        roofline_us=round(roof, 1),
        frac_roofline=round(roof / r["us"], 3),
    )


def err_text(e):
    return f"{type(e).__name__}: {str(e)[:400]}"


# ----------------------------------------------------------------------------------------------
# Correctness.


def _close(name, out, ref, atol, rtol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    err = float(np.max(np.abs(out - ref) - rtol * np.abs(ref))) if out.size else 0.0
    good = bool(np.all(np.isfinite(out))) and err <= atol
    log(f"check {name}: max(|err|-{rtol}|ref|)={err:.2e} {'ok' if good else 'FAIL'}")
    return good


def check_correctness(configs, smoke) -> bool:
    ok = True
    interp = smoke
    tol = {jnp.bfloat16: (2e-2, 2e-2), jnp.float32: (1e-4, 1e-4)}

    def run(name, fn):
        nonlocal ok
        try:
            ok &= fn()
        except Exception as e:  # noqa: BLE001
            ok = False
            log(f"check {name}: ERROR {err_text(e)}")
            traceback.print_exc()

    def gmm_case(name, lhs, w, gs, poison=True, transpose_rhs=True, dtype=jnp.bfloat16, **tun):
        def f():
            a = lhs
            if poison:  # rows past the groups are padding: NaN must not leak, output must be 0
                total = int(np.asarray(gs).sum())
                a = a.at[total:].set(jnp.nan)
            out = gm.grouped_matmul(a, w, gs, transpose_rhs=transpose_rhs, interpret=interp, **tun)
            ref = gm.grouped_matmul_reference(a, w, gs, transpose_rhs=transpose_rhs)
            zero = bool(np.all(np.asarray(out[int(np.asarray(gs).sum()) :], np.float32) == 0))
            if not zero:
                log(f"check {name}: padding rows not 0 FAIL")
            return _close(name, out, ref, *tol[dtype]) and zero

        run(name, f)

    t_small = 5 if smoke else 64
    for model, cfg in configs.items():
        s = _make(
            jax.random.key(7), t=t_small, d=cfg["D"], i=cfg["I"], e=cfg["E"], e_total=cfg["E_total"], k=cfg["top_k"]
        )
        h = jax.random.normal(jax.random.key(8), (s["xs"].shape[0], cfg["I"]), jnp.bfloat16)
        gmm_case(f"{model} T={t_small} gate", s["xs"], s["wg"], s["gs"])
        gmm_case(f"{model} T={t_small} down", h, s["wd"], s["gs"])
        gmm_case(f"{model} T={t_small} gate k-split 4", s["xs"], s["wg"], s["gs"], num_k_splits=4)

        # the whole routed MLP (three kernels, scatter) against the dense all-experts formulation
        def full(s=s, model=model):
            y = expert_mlp(functools.partial(pallas_gmm, interpret=interp))(*mlp_args(s))
            got = combine_rows(y, s["token"], s["w_sorted"], s["x"])
            want = dense_mlp(*dense_args(s)).astype(jnp.float32)
            rel = float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
            good = bool(jnp.all(jnp.isfinite(got))) and rel < 2e-2
            log(f"check {model} T={t_small} routed MLP vs dense: rel err {rel:.2e} {'ok' if good else 'FAIL'}")
            return good

        run(f"{model} routed MLP", full)

    # prefill-sized row tiles (128) on the V2-Lite shape
    cfg = configs["v2-lite"]
    t_big = 40 if smoke else 2048
    s = _make(jax.random.key(9), t=t_big, d=cfg["D"], i=cfg["I"], e=cfg["E"], e_total=cfg["E_total"], k=cfg["top_k"])
    gmm_case(f"v2-lite T={t_big} gate (default tiles)", s["xs"], s["wg"], s["gs"], poison=False)
    gmm_case(
        f"v2-lite T={t_big} gate bm128", s["xs"], s["wg"], s["gs"], poison=False, block_m=128, block_n=128, block_k=64
    )
    # float32 and the [G, K, N] layout, odd sizes
    rng = np.random.default_rng(3)
    sizes = rng.integers(0, 40, 16).astype(np.int32)
    m = int(sizes.sum()) + 11
    for dtype in (jnp.float32, jnp.bfloat16):
        lhs = jnp.asarray(rng.standard_normal((m, 200)), dtype)
        w = jnp.asarray(rng.standard_normal((16, 200, 300)) / np.sqrt(200), dtype)
        gmm_case(
            f"[G,K,N] {jnp.dtype(dtype).name} odd sizes", lhs, w, jnp.asarray(sizes), transpose_rhs=False, dtype=dtype
        )
    return ok


# ----------------------------------------------------------------------------------------------
# Timing: Pallas and dense here, XLA ragged_dot in workers.


def bench_main(configs, tokens, results, smoke):
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 100e9)
    for model, cfg in configs.items():
        for t in tokens:
            sets, info = make_case(cfg, t, seed=t)
            log(
                f"{model} T={t}: rows {info['rows']}, routed {info['routed_rows']:.0f}, "
                f"experts hit {info['experts_hit']:.1f}"
            )
            args = [mlp_args(s) for s in sets]
            try:
                tun = dict(
                    zip(
                        ("block_m", "block_n", "block_k", "num_warps", "num_stages", "num_k_splits"),
                        gm.default_tuning(info["rows"], cfg["I"], cfg["D"], cfg["E"], jnp.bfloat16),
                    )
                )
                fn, ci = compile_with_info(expert_mlp(functools.partial(pallas_gmm, interpret=smoke)), args[0])
                us = timed(fn, args, smoke)
                results["rows"].append(row(model, cfg, t, info, "pallas", us, tuning_gate=tun, **ci))
            except Exception as e:  # noqa: BLE001
                results["rows"].append(row(model, cfg, t, info, "pallas", None, error=err_text(e)))
            log(results["rows"][-1])
            need = 4 * cfg["E"] * t * cfg["I"] * 2 + 3 * cfg["E"] * cfg["I"] * cfg["D"] * 2
            if need > 0.5 * limit:
                results["rows"].append(
                    row(model, cfg, t, info, "dense", None, error=f"skipped: needs ~{need / 1e9:.0f} GB")
                )
            else:
                try:
                    dargs = [dense_args(s) for s in sets]
                    fn, ci = compile_with_info(dense_mlp, dargs[0])
                    us = timed(fn, dargs, smoke)
                    results["rows"].append(row(model, cfg, t, info, "dense", us, **ci))
                except Exception as e:  # noqa: BLE001
                    results["rows"].append(row(model, cfg, t, info, "dense", None, error=err_text(e)))
            log(results["rows"][-1])
            del sets, args


def worker(name, out_path, configs, tokens, smoke, budget_s):
    """One XLA flag setting (XLA_FLAGS set by the parent): ragged_dot rows, written as they come."""
    t_start = time.time()
    rows = []

    def flush():
        with open(out_path, "w") as f:
            json.dump(rows, f)

    # numerics of this lowering, on the small check shape (not fatal: reported in the row)
    try:
        cfg = configs["v2-lite"]
        s = _make(
            jax.random.key(7),
            t=5 if smoke else 64,
            d=cfg["D"],
            i=cfg["I"],
            e=cfg["E"],
            e_total=cfg["E_total"],
            k=cfg["top_k"],
        )
        out = jax.jit(ragged_gmm)(s["xs"], s["wg"], s["gs"])
        ref = gm.grouped_matmul_reference(s["xs"], s["wg"], s["gs"])
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref) - 2e-2 * jnp.abs(ref)))
        rows.append({"op": "check", "impl": name, "model": "v2-lite", "max_err": err, "ok": bool(err <= 2e-2)})
    except Exception as e:  # noqa: BLE001
        rows.append({"op": "check", "impl": name, "error": err_text(e)})
    log(rows[-1])
    flush()
    for model, cfg in configs.items():
        for t in tokens:
            sets, info = make_case(cfg, t, seed=t)
            if time.time() - t_start > budget_s:
                rows.append(row(model, cfg, t, info, name, None, error="skipped: budget"))
            else:
                try:
                    args = [mlp_args(s) for s in sets]
                    fn, ci = compile_with_info(expert_mlp(ragged_gmm), args[0], ragged=True)
                    us = timed(fn, args, smoke)
                    rows.append(row(model, cfg, t, info, name, us, **ci))
                except Exception as e:  # noqa: BLE001
                    rows.append(row(model, cfg, t, info, name, None, error=err_text(e)))
            log(rows[-1])
            flush()
            del sets


def run_xla_variants(results, smoke, budget_s):
    """Each flag setting in its own process; skip a flag whose lowering the default already uses."""
    seen = set()
    for name, flag in XLA_VARIANTS:
        if name == "xla_cudnn" and seen == {"cudnn"}:
            results["xla_variants"][name] = dict(flag=flag, note="skipped: the default already uses cuDNN")
            continue
        if name == "xla_dense" and seen == {"dense_expansion"}:
            results["xla_variants"][name] = dict(flag=flag, note="skipped: the default is the dense expansion")
            continue
        env = dict(os.environ)
        if flag:
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--worker",
            name,
            "--worker-out",
            path,
            "--worker-budget-s",
            str(budget_s),
        ] + (["--smoke"] if smoke else [])
        log(f"--- worker {name}: XLA_FLAGS={env.get('XLA_FLAGS', '')!r}")
        t0 = time.time()
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=budget_s + 60)
            rc, err = p.returncode, (p.stderr or "")
            out_tail = (p.stdout or "")[-3000:]
        except subprocess.TimeoutExpired as e:
            rc, err, out_tail = "timeout", str(e.stderr or ""), str(e.stdout or "")[-3000:]
        log(out_tail)
        rows = []
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, ValueError):
            pass
        os.unlink(path)
        note = dict(flag=flag, rc=rc, seconds=round(time.time() - t0, 1))
        if rc != 0:
            unknown = "unknown flag" in err.lower()
            note["error"] = "flag not recognized by this XLA" if unknown else "worker failed: " + err[-1500:]
            log(f"worker {name} rc={rc}: {note['error'][:1500]}")
        results["xla_variants"][name] = note
        results["rows"].extend(rows)
        if name == "xla":
            seen = {r.get("lowering") for r in rows if r.get("op") == "moe_experts" and "us" in r}


# ----------------------------------------------------------------------------------------------
# Sweep.

DECODE_VARIANTS = [  # (block_m, block_n, block_k, num_warps, num_stages, num_k_splits)
    (16, 64, 128, 4, 4, 1),
    (16, 32, 128, 4, 4, 1),
    (16, 128, 128, 4, 4, 1),
    (16, 64, 256, 4, 3, 1),
    (16, 64, 64, 4, 6, 1),
    (16, 64, 128, 4, 4, 2),
    (16, 64, 128, 4, 4, 4),
    (16, 32, 256, 4, 4, 2),
    (32, 64, 128, 4, 4, 1),
    (16, 64, 128, 8, 4, 1),
    (16, 16, 256, 2, 4, 1),
]
PREFILL_VARIANTS = [
    (128, 128, 64, 8, 3, 1),
    (128, 128, 64, 4, 4, 1),
    (128, 256, 64, 8, 3, 1),
    (64, 128, 64, 4, 4, 1),
    (128, 128, 32, 4, 4, 1),
    (128, 64, 64, 4, 4, 1),
    (256, 128, 64, 8, 3, 1),
    (128, 128, 128, 8, 2, 1),
    (64, 256, 64, 8, 3, 1),
    (128, 256, 32, 8, 4, 1),
]
TUNING_KEYS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "num_k_splits")


def run_sweep(configs, tokens, sweep, budget_s, smoke):
    cases = [(m, cfg, t) for m, cfg in configs.items() for t in tokens]
    per_gemm = budget_s / (2 * len(cases))
    for model, cfg, t in cases:
        sets, info = make_case(cfg, t, seed=t)
        hs = [jax.random.normal(jax.random.key(j), (info["rows"], cfg["I"]), jnp.bfloat16) for j in range(len(sets))]
        variants = DECODE_VARIANTS if t <= 128 else PREFILL_VARIANTS
        for gemm in ("gate", "down"):
            arg_sets = (
                [(s["xs"], s["wg"], s["gs"]) for s in sets]
                if gemm == "gate"
                else [(h, s["wd"], s["gs"]) for h, s in zip(hs, sets)]
            )
            n, k = arg_sets[0][1].shape[1:]
            flops = 2 * info["routed_rows"] * n * k
            wbytes = info["experts_hit"] * n * k * 2
            base = None
            t_gemm = time.time()
            for var in [None] + variants:
                tun = {} if var is None else dict(zip(TUNING_KEYS, var))
                r = {
                    "op": "moe_gemm_sweep",
                    "model": model,
                    "T": t,
                    "gemm": gemm,
                    "N": n,
                    "K": k,
                    "variant": "default" if var is None else tun,
                }
                if time.time() - t_gemm > per_gemm:
                    sweep["rows"].append({**r, "error": "skipped: budget"})
                    continue
                try:
                    f = jax.jit(functools.partial(pallas_gmm, interpret=smoke, **tun))
                    out = f(*arg_sets[0])
                    if base is None:
                        base = out
                    else:  # a variant that computes something else is a miscompile, not a speedup
                        r["max_abs_diff_vs_default"] = float(
                            jnp.max(jnp.abs(out.astype(jnp.float32) - base.astype(jnp.float32)))
                        )
                    del out
                    us = (
                        common.time_fn(f, arg_sets, iters=2, reps=1, warmup=1)
                        if smoke
                        else common.time_fn(f, arg_sets, iters=12, reps=3, warmup=3)
                    )
                    tf, tb = flops / (us * 1e-6) / 1e12, wbytes / (us * 1e-6) / 1e12
                    r.update(us=round(us, 1), TFLOPs=round(tf, 2), TBps=round(tb, 3))
                except Exception as e:  # noqa: BLE001
                    r["error"] = err_text(e)
                sweep["rows"].append(r)
                log(r)
            del base
        del sets, hs


# ----------------------------------------------------------------------------------------------


def print_table(results):
    log("\n model     T      impl        us     TFLOP/s  TB/s(w)  frac_roof  lowering / error")
    for r in results["rows"]:
        if r.get("op") != "moe_experts":
            continue
        if "us" not in r:
            log(f" {r['model']:8s} {r['T']:6d} {r['impl']:10s} {r.get('error', '')[:90]}")
            continue
        log(
            f" {r['model']:8s} {r['T']:6d} {r['impl']:10s} {r['us']:9.1f} {r['TFLOPs']:8.2f} "
            f"{r['TBps']:8.3f} {r.get('frac_roofline', float('nan')):9.3f}  {r.get('lowering', '')} "
            f"temp {r.get('temp_MB', '?')} MB"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU check)")
    ap.add_argument("--sweep", action="store_true", help="also time Pallas tuning variants")
    ap.add_argument("--sweep-budget-s", type=float, default=90.0)
    ap.add_argument("--skip-check", action="store_true", help="skip the correctness checks")
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA ragged_dot workers")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--worker-budget-s", type=float, default=WORKER_BUDGET_S, help=argparse.SUPPRESS)
    args = ap.parse_args()
    configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    tokens = SMOKE_TOKENS if args.smoke else TOKENS
    if args.worker:
        worker(args.worker, args.worker_out, configs, tokens, args.smoke, args.worker_budget_s)
        return

    t_start = time.time()
    log(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if not args.skip_check:
        ok = check_correctness(configs, args.smoke)
        log(f"correctness: {'PASS' if ok else 'FAIL'} ({time.time() - t_start:.0f}s)")
        if not ok:
            sys.exit(1)
    results = common.results_header({})
    results["xla_variants"] = {}
    if not args.no_xla:  # first, while this process holds little GPU memory
        run_xla_variants(results, args.smoke, 20.0 if args.smoke else WORKER_BUDGET_S)
        log(f"xla workers done ({time.time() - t_start:.0f}s)")
    if args.smoke:  # a CPU has no meaningful ceilings
        ceil = {"note": "smoke run on CPU: ceilings not measured"}
    else:
        ceil = common.measure_ceilings()
    log(f"ceilings: {ceil}")
    results["ceilings"] = ceil
    os.makedirs(args.out, exist_ok=True)
    suffix = "-smoke" if args.smoke else ""
    # A time limit (`timeout` sends SIGTERM) should still leave the rows measured so far on disk.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        bench_main(configs, tokens, results, args.smoke)
        log(f"pallas + dense done ({time.time() - t_start:.0f}s)")
    finally:
        for r in results["rows"]:
            add_fractions(r, ceil)
        common.write_results(os.path.join(args.out, f"moe-h200{suffix}.json"), results)
    if args.sweep:
        sweep = common.results_header(ceil)
        run_sweep(configs, tokens, sweep, args.sweep_budget_s, args.smoke)
        common.write_results(os.path.join(args.out, f"moe-sweep-h200{suffix}.json"), sweep)
    print_table(results)
    log(f"total {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
