"""The MoE layer's two grouped kernels at decode on one GPU, with their tuning: what `layers.moe` runs for 1-2
tokens (issue #22), the unsorted copies with the shared experts as more groups.

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/moe_decode.py --out DIR [--budget-s 150] [--smoke]

DeepSeek-V2-Lite's experts (64 of [1408, 2048], top-6, 2 shared experts: 2 chunks), stacked over 8 layers so that
each call reads a layer its predecessor did not (a decode step streams every layer's experts: L2 holds none):
"glu", `grouped_matmul(x [T, 2048], gate, up_rhs=up, row_groups=top-k [T, 6], shared_rhs=, shared_up_rhs=,
rhs_index=)` -> [T*8, 1408]; "down", the [T*8, 1408] rows through down_proj with the shared down_proj's chunks ->
[T*8, 2048]. (a) checks the default tuning against `grouped_matmul_reference` (exits 1 on a mismatch), (b) measures
the copy/matmul ceilings, (c) times the default and, within --budget-s, tuning variants (block_n, block_k,
num_warps, num_stages, num_k_splits), each by device time (common.device_time_us over 8 input sets: distinct
layers and experts).

Rows (DIR/moe-decode-h200.json, notes/bench-results.md's format): op "moe_decode", kernel (glu / down), T, tuning
(block_m, block_n, block_k, num_warps, num_stages, num_k_splits), default (bool), device_us, kernels_per_call,
weight_MB (the weights one call reads: its distinct experts and the shared chunks), TBps (weight_MB / device_us),
frac_copy. `best` names the fastest variant per (kernel, T). --smoke: tiny shapes, interpret mode, on a CPU (the
numbers mean nothing). Runtime on an H200: ~1 minute plus the budget.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", category=DeprecationWarning)  # the Triton lowering warns per call
warnings.filterwarnings("ignore", message=".*[Tt]riton.*")

if __package__ in (None, ""):  # `python3 bench/moe_decode.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_jax.bench import common  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

# (E experts, D hidden, I expert intermediate, K top-k, S shared chunks, layers)
V2_LITE = (64, 2048, 1408, 6, 2, 8)
SMOKE = (8, 64, 32, 2, 2, 2)
SETS = 8  # input sets cycled through: distinct layers and top-k
VARIANTS = dict(block_n=(16, 32, 64, 128), block_k=(64, 128, 256), num_warps=(2, 4, 8), num_stages=(2, 3, 4, 6))
SPLITS = (1, 2, 3, 4)


def weights(shape, smoke, key):
    """Stacked routed and shared weights in the HF layout: gate/up [Lyr, E, I, D] and [Lyr, S*I, D], down [Lyr, E,
    D, I] and [Lyr, D, S*I] (random: bandwidth does not depend on values)."""
    E, D, I, K, S, Lyr = shape
    ks = jax.random.split(key, 6)
    f = lambda k, s: (jax.random.normal(k, s, jnp.float32) * 0.02).astype(jnp.bfloat16)  # noqa: E731
    return dict(
        gate=f(ks[0], (Lyr, E, I, D)),
        up=f(ks[1], (Lyr, E, I, D)),
        down=f(ks[2], (Lyr, E, D, I)),
        sgate=f(ks[3], (Lyr, S * I, D)),
        sup=f(ks[4], (Lyr, S * I, D)),
        sdown=f(ks[5], (Lyr, D, S * I)),
    )


def input_sets(shape, t, seed=0):
    """SETS (x [T, D], top-k i32[T, K], layer) with distinct experts per token, and the distinct experts' count."""
    E, D, _, K, _, Lyr = shape
    rng = np.random.default_rng(seed + t)
    sets, distinct = [], []
    for s in range(SETS):
        ids = np.stack([rng.permutation(E)[:K] for _ in range(t)]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((t, D), np.float32), jnp.bfloat16)
        sets.append((x, jnp.asarray(ids), jnp.int32(s % Lyr)))
        distinct.append(len(np.unique(ids)))
    return sets, float(np.mean(distinct))


def glu_fn(w, interpret, **tuning):
    """The glu call as a function of (x, ids, layer); the weights are arguments of the jitted function (closed
    over, they would be lowered as GBs of constants)."""

    @jax.jit
    def f(w, x, ids, layer):
        kw = dict(row_groups=ids, up_rhs=w["up"], shared_rhs=w["sgate"], shared_up_rhs=w["sup"], rhs_index=layer)
        return gm.grouped_matmul(x, w["gate"], interpret=interpret, **kw, **tuning)

    return lambda *a: f(w, *a)


def down_fn(w, interpret, **tuning):
    @jax.jit
    def f(w, h, ids, layer):
        kw = dict(row_groups=ids, shared_rhs=w["sdown"], rhs_index=layer)
        return gm.grouped_matmul(h, w["down"], interpret=interpret, **kw, **tuning)

    return lambda *a: f(w, *a)


def check(shape, w, smoke) -> float:
    """Max |kernel - reference| over both kernels at T = 2 (default tuning)."""
    sets, _ = input_sets(shape, 2, seed=99)
    x, ids, layer = sets[1]
    err = 0.0
    g = glu_fn(w, smoke)(x, ids, layer)
    ref = gm.grouped_matmul_reference(
        x, w["gate"], row_groups=ids, up_rhs=w["up"], shared_rhs=w["sgate"], shared_up_rhs=w["sup"], rhs_index=layer
    )
    err = max(err, float(jnp.max(jnp.abs(g.astype(jnp.float32) - ref))))
    d = down_fn(w, smoke)(g, ids, layer)
    ref = gm.grouped_matmul_reference(g, w["down"], row_groups=ids, shared_rhs=w["sdown"], rhs_index=layer)
    return max(err, float(jnp.max(jnp.abs(d.astype(jnp.float32) - ref)) / max(1.0, float(jnp.max(jnp.abs(ref))))))


def variants(default):
    """The default, K splits with the default blocks, one-at-a-time moves of each knob, then pairs."""
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "num_k_splits")
    base = dict(zip(names, default))
    out = [base] + [base | {"num_k_splits": s} for s in SPLITS if s != base["num_k_splits"]]
    for name, values in VARIANTS.items():  # in the order of what sets the programs in flight most
        out += [base | {name: v} for v in values if v != base[name]]
    out += [base | {"block_n": n, "num_stages": st} for n, st in itertools.product((32, 128), (3, 6))]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--tokens", type=common.int_list, default=(1, 2))
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else V2_LITE
    E, D, I, K, S, Lyr = shape
    w = weights(shape, args.smoke, jax.random.key(0))
    err = check(shape, w, args.smoke)
    print(f"check: max err {err:.3g}")
    ceilings = common.bench_ceilings(args.smoke)
    results = common.results_header(ceilings) | {"shape": dict(zip("E D I K S layers".split(), shape))}
    results["check_err"] = err
    share = args.budget_s / (2 * len(args.tokens))  # each (kernel, T) its share of the budget
    best = {}
    for t in args.tokens:
        sets, distinct = input_sets(shape, t)
        h_sets = [(jnp.zeros((t * K + S * t, I), jnp.bfloat16), ids, layer) for _, ids, layer in sets]
        for kernel, make, arg_sets, per_expert in (
            ("glu", glu_fn, sets, 2 * I * D * 2),
            ("down", down_fn, h_sets, D * I * 2),
        ):
            m = t * (K + S)
            n, k = (I, D) if kernel == "glu" else (D, I)
            default = gm.default_tuning(m, n, k, m, jnp.bfloat16, by_row=True, glu=kernel == "glu")
            mb = (distinct + S) * per_expert / 1e6
            t_end = time.perf_counter() + share
            for i, tun in enumerate(variants(default)):
                if i and time.perf_counter() > t_end:
                    break
                try:
                    dt = common.device_time_us(make(w, args.smoke, **tun), arg_sets, iters=2 * SETS)
                except Exception as e:  # a variant Triton cannot compile (shared memory): recorded, skipped
                    dt = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row = dict(op="moe_decode", kernel=kernel, T=t, tuning=tun, default=i == 0, weight_MB=round(mb, 3))
                if "device_us" in dt:
                    tbps = mb / dt["device_us"]
                    row |= dict(device_us=dt["device_us"], kernels_per_call=dt.get("kernels_per_call"))
                    row |= dict(TBps=round(tbps, 3), frac_copy=round(tbps / ceilings["copy_TBps"], 3))
                    key = f"{kernel}-T{t}"
                    if key not in best or dt["device_us"] < best[key]["device_us"]:
                        best[key] = dict(device_us=dt["device_us"], tuning=tun)
                else:
                    row["error"] = dt.get("error")
                results["rows"].append(row)
                print(row)
    results["best"] = best
    name = "moe-decode-h200-smoke.json" if args.smoke else "moe-decode-h200.json"
    common.write_results(os.path.join(args.out, name), results)
    return 0 if err < (0.1 if not args.smoke else 1e-3) else 1


if __name__ == "__main__":
    sys.exit(main())
