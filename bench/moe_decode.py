"""The MoE layer's two grouped kernels at decode on one GPU, with their tuning: what `layers.moe` runs for a decode
batch (issue #22), the shared experts as more groups; bf16 or block-FP8 experts (issue #25).

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/moe_decode.py --out DIR [--budget-s 150] [--tokens 1,2,32]
        [--weights bf16,fp8] [--routing layers,sorted] [--smoke]

DeepSeek-V2-Lite's experts (64 of [1408, 2048], top-6, 2 shared experts: 2 chunks), stacked over 8 layers so that
each call reads a layer its predecessor did not (a decode step streams every layer's experts: L2 holds none):
"glu", `grouped_matmul(x, gate, up_rhs=up, shared_rhs=, shared_up_rhs=, rhs_index=)` -> [T*8, 1408]; "down", the
[T*8, 1408] rows through down_proj with the shared down_proj's chunks -> [T*8, 2048]. Routing "layers" (default):
what `layers.moe` runs, the top-k given as is up to `BY_GROUP_MAX_COPIES` routed copies (`row_groups=` [T, 6]: each
copy its own item up to 16, else items by group, the kernel's copy table timed), sorted by expert past it; "sorted":
sorted at every T (`group_sizes=`; the sort, the gather of the copies and the combine are not timed, the work list
and with fp8 the activations' quantization are), for an A/B of the two at one T. fp8: e4m3 experts with random
128x128 block scales (W8A8). (a) checks the default tuning against `grouped_matmul_reference` (exits 1 on a
mismatch), (b) measures the copy/matmul ceilings, (c) times the default and, within --budget-s, tuning variants
(block_m, block_n, block_k, num_warps, num_stages, num_k_splits), each by device time (common.device_time_us over 8
input sets: distinct layers and experts).

Rows (DIR/moe-decode-h200.json, notes/bench-results.md's format): op "moe_decode", kernel (glu / down), T, weights
(bf16 / fp8), routing ("top_k" / "sorted"), tuning, default (bool), device_us, kernels_per_call, weight_MB (the
weights one call reads: its distinct experts and the shared chunks, with fp8 their scales), TBps (weight_MB /
device_us), frac_copy. `best` names the fastest variant per (kernel, T, weights, routing). --smoke: tiny shapes,
interpret mode, on a CPU (the numbers mean
nothing). Runtime on an H200: ~1 minute plus the budget.
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
from mla_jax.layers import BY_GROUP_MAX_COPIES  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402

# (E experts, D hidden, I expert intermediate, K top-k, S shared chunks, layers)
V2_LITE = (64, 2048, 1408, 6, 2, 8)
SMOKE = (8, 128, 128, 2, 2, 2)  # fp8 shared chunks: whole 128-wide scale blocks
SETS = 8  # input sets cycled through: distinct layers and top-k
VARIANTS = dict(block_n=(16, 32, 64, 128), block_k=(64, 128, 256), num_warps=(2, 4, 8), num_stages=(2, 3, 4, 6))
SPLITS = (1, 2, 3, 4)


def weights(shape, smoke, key, fp8=False):
    """Stacked routed and shared weights in the HF layout: gate/up [Lyr, E, I, D] and [Lyr, S*I, D], down [Lyr, E,
    D, I] and [Lyr, D, S*I] (random: bandwidth does not depend on values); fp8: e4m3, each with its block scales
    f32 [..., cdiv(out, 128), cdiv(in, 128)] under the name + "_scale"."""
    E, D, I, K, S, Lyr = shape
    ks = jax.random.split(key, 12)
    shapes = dict(
        gate=(Lyr, E, I, D),
        up=(Lyr, E, I, D),
        down=(Lyr, E, D, I),
        sgate=(Lyr, S * I, D),
        sup=(Lyr, S * I, D),
        sdown=(Lyr, D, S * I),
    )
    out = {}
    for i, (name, sh) in enumerate(shapes.items()):
        v = jax.random.normal(ks[i], sh, jnp.float32)
        if not fp8:
            out[name] = (v * 0.02).astype(jnp.bfloat16)
            continue
        out[name] = v.astype(jnp.float8_e4m3fn)
        blocks = (*sh[:-2], -(-sh[-2] // gm.FP8_BLOCK), -(-sh[-1] // gm.FP8_BLOCK))
        out[name + "_scale"] = jax.random.uniform(ks[6 + i], blocks, jnp.float32, 0.005, 0.02)
    return out


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


def by_row(t: int, shape, routing: str = "layers") -> bool:
    """Whether t tokens' copies go to the kernels as their top-k (else sorted): as `layers.moe` decides ("layers"),
    or never ("sorted")."""
    return routing == "layers" and t * shape[3] <= BY_GROUP_MAX_COPIES


def per_copy(t: int, shape) -> bool:
    """Whether a top-k of t tokens is one item a copy in the kernel (else items by group: tuned as sorted rows)."""
    return t * shape[3] <= gm.PER_COPY_MAX_COPIES


def sorted_copies(shape, ids):
    """`layers.moe`'s sort of a token's top-k [T, K] and the S shared chunks: (each sorted copy's token i32[T*C],
    group_sizes i32[E + S])."""
    E, _, _, K, S, _ = shape
    t = ids.shape[0]
    key = np.concatenate([np.asarray(ids), np.broadcast_to(E + np.arange(S), (t, S))], axis=1).reshape(-1)
    order = np.argsort(key, kind="stable")
    sizes = np.bincount(key, minlength=E + S).astype(np.int32)
    return jnp.asarray(order // (K + S), jnp.int32), jnp.asarray(sizes)


def _kw(w, names, **kw):
    """grouped_matmul's weight keywords: the weights named (keyword -> w key), with fp8 their scales."""
    for arg, name in names.items():
        kw[arg] = w[name]
        if name + "_scale" in w:
            kw["rhs_scale" if arg == "rhs" else arg.replace("_rhs", "_scale")] = w[name + "_scale"]
    return kw


GLU_W = dict(rhs="gate", up_rhs="up", shared_rhs="sgate", shared_up_rhs="sup")
DOWN_W = dict(rhs="down", shared_rhs="sdown")


def call(w, names, lhs, routing, layer, fn=gm.grouped_matmul, **kw):
    """`fn` (grouped_matmul, or its reference) with `names`' weights: routing is the top-k [T, K] (copies in token
    order) or a sort's (tokens, group_sizes), lhs then gathered by the sorted copies' tokens (the glu's x) or already
    sorted."""
    kw = _kw(w, names, rhs_index=layer, **kw)
    rhs = kw.pop("rhs")
    if isinstance(routing, tuple):
        tokens, sizes = routing
        lhs = lhs[tokens] if lhs.shape[0] != tokens.shape[0] else lhs
        return fn(lhs, rhs, sizes, **kw)
    return fn(lhs, rhs, row_groups=routing, **kw)


def kernel_fn(w, names, interpret, **tuning):
    """The call as a function of (lhs, routing, layer); the weights are arguments of the jitted function (closed
    over, they would be lowered as GBs of constants)."""
    f = jax.jit(lambda w, lhs, routing, layer: call(w, names, lhs, routing, layer, interpret=interpret, **tuning))
    return lambda *a: f(w, *a)


def check(shape, w, smoke, t) -> float:
    """Max |kernel - reference| / max(1, max |reference|) over both kernels at T = t (default tuning)."""
    sets, _ = input_sets(shape, t, seed=99)
    x, ids, layer = sets[1]
    routing = ids if by_row(t, shape) else sorted_copies(shape, ids)
    err = 0.0
    g = kernel_fn(w, GLU_W, smoke)(x, routing, layer)
    for names, lhs, out in ((GLU_W, x, g), (DOWN_W, g, None)):
        out = kernel_fn(w, DOWN_W, smoke)(g, routing, layer) if out is None else out
        ref = call(w, names, lhs, routing, layer, fn=gm.grouped_matmul_reference)
        e = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / max(1.0, float(jnp.max(jnp.abs(ref))))
        err = max(err, e if np.isfinite(e) else float("inf"))
    return err


def variants(default, fp8=False, sorted_=False):
    """The default, K splits with the default blocks, one-at-a-time moves of each knob, then pairs (fp8: K steps
    stay one scale block, N blocks within one; sorted copies: row tiles of 16 or 32 too)."""
    names = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "num_k_splits")
    base = dict(zip(names, default))
    out = [base] + [base | {"num_k_splits": s} for s in SPLITS if s != base["num_k_splits"]]
    knobs = dict(VARIANTS)
    if fp8:
        knobs["block_k"] = ()
    if sorted_:
        knobs = {"block_m": (16, 32), **knobs}
    for name, values in knobs.items():  # in the order of what sets the programs in flight most
        out += [base | {name: v} for v in values if v != base[name]]
    pairs = [base | {"block_n": n, "num_stages": st} for n, st in itertools.product((32, 128), (3, 6))]
    if fp8:
        pairs += [base | {"block_n": 128, "num_warps": wp, "num_stages": st} for wp, st in ((8, 3), (8, 4), (4, 2))]
    seen, uniq = set(), []
    for v in out + pairs:
        if tuple(v.items()) not in seen:
            seen.add(tuple(v.items()))
            uniq.append(v)
    return uniq


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--tokens", type=common.int_list, default=(1, 2))
    ap.add_argument("--weights", default="bf16", help="bf16, fp8 or both (bf16,fp8)")
    ap.add_argument("--routing", default="layers", help="layers (as layers.moe), sorted, or both (layers,sorted)")
    args = ap.parse_args(argv)
    shape = SMOKE if args.smoke else V2_LITE
    E, D, I, K, S, Lyr = shape
    kinds = [k.strip() for k in args.weights.split(",") if k.strip()]
    if not kinds or set(kinds) - {"bf16", "fp8"}:
        ap.error(f"--weights: bf16 and/or fp8, not {args.weights!r}")
    routings = [r.strip() for r in args.routing.split(",") if r.strip()]
    if not routings or set(routings) - {"layers", "sorted"}:
        ap.error(f"--routing: layers and/or sorted, not {args.routing!r}")
    ws = {kind: weights(shape, args.smoke, jax.random.key(0), fp8=kind == "fp8") for kind in kinds}
    errs = {f"{kind}-T{t}": check(shape, ws[kind], args.smoke, t) for kind in kinds for t in sorted({2, *args.tokens})}
    print(f"check: max err {errs}")
    err = max(errs.values())
    ceilings = common.bench_ceilings(args.smoke)
    results = common.results_header(ceilings) | {"shape": dict(zip("E D I K S layers".split(), shape))}
    results["check_err"] = errs
    runs = [(kind, t, r) for kind in kinds for t in args.tokens for r in routings]
    runs = [(kind, t, r) for kind, t, r in runs if r == "layers" or by_row(t, shape) or len(routings) == 1]
    share = args.budget_s / (2 * len(runs))  # each (kernel, T, weights, routing) its share of the budget
    best = {}
    for kind, t, routing in runs:
        w, fp8 = ws[kind], kind == "fp8"
        wbytes = 1 + 4 / gm.FP8_BLOCK**2 if fp8 else 2  # bytes a weight element (fp8: and its share of a scale)
        sets, distinct = input_sets(shape, t)
        top_k = by_row(t, shape, routing)
        rows = top_k and per_copy(t, shape)  # one item a copy
        if not top_k:
            sets = [(x, sorted_copies(shape, ids), layer) for x, ids, layer in sets]
        h_sets = [(jnp.zeros((t * K + S * t, I), jnp.bfloat16), r, layer) for _, r, layer in sets]
        for kernel, names, arg_sets, per_expert in (
            ("glu", GLU_W, sets, 2 * I * D * wbytes),
            ("down", DOWN_W, h_sets, D * I * wbytes),
        ):
            m = t * (K + S)
            n, k = (I, D) if kernel == "glu" else (D, I)
            g = m if rows else E + S
            default = gm.default_tuning(m, n, k, g, jnp.bfloat16, by_row=rows, glu=kernel == "glu", fp8=fp8)
            mb = (distinct + S) * per_expert / 1e6
            t_end = time.perf_counter() + share
            for i, tun in enumerate(variants(default, fp8, not rows)):
                if i and time.perf_counter() > t_end:
                    break
                try:
                    fn = kernel_fn(w, names, args.smoke, **tun)
                    dt = common.device_time_us(fn, arg_sets, iters=2 * SETS)
                except Exception as e:  # a variant Triton cannot compile (shared memory): recorded, skipped
                    dt = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row = dict(op="moe_decode", kernel=kernel, T=t, weights=kind, routing="top_k" if top_k else "sorted")
                row |= dict(tuning=tun, default=i == 0)
                row["weight_MB"] = round(mb, 3)
                if "device_us" in dt:
                    tbps = mb / dt["device_us"]
                    row |= dict(device_us=dt["device_us"], kernels_per_call=dt.get("kernels_per_call"))
                    row |= dict(TBps=round(tbps, 3), frac_copy=round(tbps / ceilings["copy_TBps"], 3))
                    key = f"{kernel}-T{t}-{kind}-{row['routing']}"
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
