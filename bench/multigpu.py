"""Multi-GPU decode benchmark: tensor parallel, decode context parallel (DCP) and data-parallel attention with
expert-parallel MoE (DP) for a DeepSeek-V2-Lite-shaped model with random bf16 weights, against one GPU.

    PYTHONPATH=. python3 bench/multigpu.py --out DIR                     # every config the visible GPUs allow
    PYTHONPATH=. python3 bench/multigpu.py --out DIR --tp 1,2 --dcp 1 --dp 1   # a subset
    PYTHONPATH=. python3 bench/multigpu.py --out DIR --tp 1 --dcp 1      # the DP rows (and the baseline) only
    PYTHONPATH=. python3 bench/multigpu.py --out DIR --resume FILE       # skip the rows FILE already has
    python3 bench/multigpu.py --smoke --out /tmp/x                       # tiny dims on 8 virtual CPU devices

Configs: tp in {1, 2, 4} x dcp in {1, 2, 4} on tp*dcp devices (`mla_jax.parallel`: heads split tp*dcp-way, the
latent cache dcp-way, experts over all devices; vLLM's `-tp T -dcp D` is tp=T/D, dcp=D here), and dp in {2, 4, 8}
x --dp-tp {1, 2} (DP groups of TP 1 or 2, dcp 1: each DP rank its own batch/dp requests and page pool, experts over
all devices; vLLM's `-dp N -tp T --enable-expert-parallel`); configs needing more GPUs than are visible are
skipped. Batch 32 and 128 (over all DP ranks), context 4k and 32k: every request decodes one token after
ctx-1 cached tokens (random latent rows), each reading its own pages; the step is `mla_jax.step.engine_step`
with the plan (forward + all-gather of the logits + sampling), timed as mla_jax.bench.e2e times it. The one-GPU
baseline is the same step without a plan (path "single"); `speedup` = its step time / this one and `scaling_eff` =
speedup / devices. A configuration whose weights + cache do not fit (e.g. batch 128 x 32k on one GPU: a 130 GB
cache) is listed under "skipped" with the reason. `roofline_ms` = (weights read per device + its KV share) / copy
bandwidth, communication not counted (weights other than the routed experts split over tp*dcp, replicated over dp;
the experts the batch hits split over all devices).

Run time: ~30-60 s per row (one compile per shape, then 3 + 50 timed steps); the full grid on 4 GPUs is 28 rows,
more than one 10-minute command. The script writes the JSON after every row and stops starting new rows after
--budget-min minutes; run it again with --resume on the file it wrote to continue (it prints the command).
Writes DIR/multigpu-h200.json (format: ../shared/notes/bench-results.md; rows carry `dp`, `tp` and `dcp`).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before jax is imported: 8 virtual CPU devices
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
else:  # the cache takes most of the memory: let JAX's pool grow past its default 75%
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.90")

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from mla_jax import model, parallel  # noqa: E402
from mla_jax.bench.common import (  # noqa: E402
    add_common_args,
    bench_ceilings,
    decode_requests,
    int_list,
    resolve_impls,
    results_header,
    time_step,
    v2_lite_config,
    write_results,
)
from mla_jax.bench.e2e import weight_bytes  # noqa: E402
from mla_jax.cache import KVCache  # noqa: E402
from mla_jax.config import DeepseekConfig  # noqa: E402
from mla_jax.metadata import BatchShape, build_metadata  # noqa: E402
from mla_jax.parallel import stack_metadata  # noqa: E402
from mla_jax.sampling import SamplingArrays  # noqa: E402
from mla_jax.step import engine_step, step_batch  # noqa: E402
from pallas_kernels.util import cdiv  # noqa: E402

RESULT_FILE = "multigpu-h200.json"


def device_bytes_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU: no stats
        return None
    return stats.get("bytes_limit")


def per_device_param_bytes(params, cfg: DeepseekConfig, plan: parallel.ParallelPlan | None) -> int:
    """Bytes of the params on the most loaded device (split leaves divided by their shard count)."""
    if plan is None:
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    total = 0
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(plan.param_shardings(params, cfg))):
        shards = 1
        for entry in s.spec:
            for a in entry if isinstance(entry, tuple) else (entry,):
                if a is not None:
                    shards *= plan.size(a)
        total += x.size * x.dtype.itemsize // shards
    return total


def random_cache(shape: tuple[int, ...], sharding, dtype) -> KVCache:
    """Random latent rows without a full-size temporary: one random [G*dcp, L+R] page broadcast to every page and
    layer (values only need to look like latents), created directly in its sharding."""

    def make(key):
        page = jax.random.normal(key, shape[2:], jnp.float32).astype(dtype)
        return KVCache(jnp.broadcast_to(page, shape), None)

    kw = {} if sharding is None else {"out_shardings": KVCache(sharding, None)}
    return jax.jit(make, **kw)(jax.random.key(1))


def run_row(*, params, cfg, plan, batch, ctx, page, backend, gmm, steps, reps, ceilings, nbytes_weights):
    """One decode measurement; returns the row. `plan` None: the plain one-device engine_step. Under DP each rank
    decodes batch/dp of the requests from its own pool of pages."""
    dcp = plan.dcp if plan is not None else 1
    dp = plan.dp if plan is not None else 1
    gv = page * dcp  # virtual page of the block tables
    pages_per_req = cdiv(ctx, gv)
    local = batch // dp  # requests per DP rank
    num_pages = local * pages_per_req + 1  # per rank
    shape = (cfg.num_hidden_layers, dp * num_pages, gv, cfg.cache_row_dim)
    if plan is None:
        cache = random_cache(shape, None, jnp.bfloat16)
    else:
        cache = random_cache(shape, NamedSharding(plan.mesh, plan.cache_specs(False).kv_c_and_k_pe_cache), jnp.bfloat16)
    reqs = decode_requests(local, ctx, pages_per_req, cfg.vocab_size)
    md, _ = build_metadata(
        reqs,
        page_size=gv,
        num_pages=num_pages,
        shape=BatchShape(num_decodes=local, decode_query_len=1, max_pages=pages_per_req),
    )
    sp = SamplingArrays.build([], [], md.shape.num_logits * dp)
    if dp > 1:  # every rank the same layout of its own pool
        md = stack_metadata([md] * dp)
    inputs = step_batch(md, sp)  # (not `batch`: the request count is used below)
    inputs = jax.device_put(inputs) if plan is None else plan.replicate(inputs)

    def step(cache):
        t, _, cache, _ = engine_step(params, cfg, cache, inputs, plan=plan, backend=backend, gmm_impl=gmm)
        return t, cache

    step_s, compile_s, cache = time_step(step, cache, steps=steps, reps=reps)
    del cache
    devices = plan.num_devices if plan is not None else 1
    kv_bytes = local * ctx * 2 * cfg.cache_row_dim * cfg.num_hidden_layers / dcp
    dense = nbytes_weights(0)  # everything but the routed experts: split over tp*dcp, replicated over dp
    per_device = dense / (devices // dp) + (nbytes_weights(batch) - dense) / devices
    roof = (per_device + kv_bytes) / (ceilings["copy_TBps"] * 1e12)
    return dict(
        dp=dp,
        tp=plan.tp if plan is not None else 1,
        dcp=dcp,
        devices=devices,
        gmm_impl=gmm,
        path="parallel" if plan is not None else "single",
        batch=batch,
        ctx=ctx,
        phase="decode",
        step_ms=round(step_s * 1e3, 3),
        tokens_per_s=round(batch / step_s, 1),
        roofline_ms=round(roof * 1e3, 3),
        x_roofline=round(step_s / roof, 2),
        compile_s=round(compile_s, 1),
    )


def _key(r: dict) -> tuple:
    """A row's (or skip's) identity; rows of runs before DP have no "dp": 1."""
    return (r["path"], r.get("dp", 1), r["tp"], r["dcp"], r["batch"], r["ctx"])


def add_scaling(rows: list[dict]) -> None:
    """speedup and scaling_eff against the one-GPU baseline (path "single") at the same batch and context."""
    base = {(r["batch"], r["ctx"]): r["step_ms"] for r in rows if r["path"] == "single"}
    for r in rows:
        b = base.get((r["batch"], r["ctx"]))
        r["speedup"] = round(b / r["step_ms"], 3) if b else None
        r["scaling_eff"] = round(b / r["step_ms"] / r["devices"], 3) if b else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out_default="bench/results", out_help=f"directory for {RESULT_FILE}", budget_min=9.0)
    ap.add_argument("--tp", type=int_list, default=(1, 2, 4))
    ap.add_argument("--dcp", type=int_list, default=(1, 2, 4))
    ap.add_argument("--dp", type=int_list, default=(1, 2, 4, 8), help="data-parallel attention ranks (1: none)")
    ap.add_argument("--dp-tp", type=int_list, default=(1, 2), help="TP inside a DP group for the dp > 1 rows (dcp 1)")
    ap.add_argument("--batch", type=int_list, default=(32, 128))
    ap.add_argument("--ctx", type=int_list, default=(4096, 32768))
    ap.add_argument("--page", type=int, default=64, help="physical page size G of each device")
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain one-GPU engine_step rows")
    ap.add_argument("--resume", default=None, help="a previous result file: keep its rows, skip those measurements")
    args = resolve_impls(ap.parse_args())
    t_start = time.perf_counter()

    steps, reps = 10, 5
    if args.smoke:  # tiny dims on 8 virtual CPU devices (8 heads: every mesh divides them; batch 8: every dp)
        args.layers, args.batch, args.ctx, args.page = 2, (8,), (32, 128), 16
        steps, reps = 2, 2
    cfg = v2_lite_config(args.layers, smoke=args.smoke, **({"num_attention_heads": 8} if args.smoke else {}))
    backend, gmm = args.backend, args.gmm
    n_dev = jax.device_count()
    ceilings = bench_ceilings(args.smoke)
    res = results_header(ceilings)
    res["model"] = f"DeepSeek-V2-Lite shape, random bf16 weights, {cfg.num_hidden_layers} layers"
    res["backend"] = backend
    res["gmm_impl"] = gmm
    res["visible_devices"] = n_dev
    res["page"] = args.page
    res["skipped"] = []
    done: set[tuple] = set()
    if args.resume:
        with open(args.resume) as f:
            prev = json.load(f)
        res["rows"] = prev.get("rows", [])
        res["skipped"] = prev.get("skipped", [])
        done = {_key(r) for r in res["rows"] + res["skipped"]}
    out_path = os.path.join(args.out, RESULT_FILE)
    print("ceilings", ceilings, f"| {n_dev} devices, backend {backend}", flush=True)

    t0 = time.perf_counter()
    params_dev = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    params_host = jax.device_get(params_dev)  # every layout is placed from the host copy
    del params_dev
    print(
        f"params: {sum(x.nbytes for x in jax.tree.leaves(params_host)) / 1e9:.1f} GB "
        f"({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )
    nbytes_weights = lambda b: weight_bytes(params_host, cfg, b)  # noqa: E731
    limit = device_bytes_limit()

    configs: list[tuple[str, int, int, int]] = [] if args.no_baseline else [("single", 1, 1, 1)]
    # dp=tp=dcp=1 through shard_map is the one-GPU baseline again; keep it only when asked for alone
    for dp in args.dp:
        for tp in args.tp if dp == 1 else args.dp_tp:
            for dcp in args.dcp if dp == 1 else (1,):
                if dp * tp * dcp > 1 or args.no_baseline:
                    configs.append(("parallel", dp, tp, dcp))
    todo = []
    for path, dp, tp, dcp in configs:
        name = f"dp={dp} tp={tp} dcp={dcp}"
        if dp * tp * dcp > n_dev:
            print(f"skip {name}: needs {dp * tp * dcp} devices, {n_dev} visible", flush=True)
            continue
        if cfg.num_attention_heads % (tp * dcp) or cfg.n_routed_experts % (dp * tp * dcp):
            print(f"skip {name}: heads or experts do not divide", flush=True)
            continue
        for b in args.batch:
            if b % dp:
                print(f"skip {name} batch {b}: not a multiple of dp", flush=True)
                continue
            todo += [(path, dp, tp, dcp, b, c) for c in args.ctx if (path, dp, tp, dcp, b, c) not in done]

    left = list(todo)
    cur = None  # (path, dp, tp, dcp) whose params are placed
    params = plan = None
    for key in todo:
        path, dp, tp, dcp, batch, ctx = key
        if (time.perf_counter() - t_start) / 60 > args.budget_min:
            break
        if cur != (path, dp, tp, dcp):
            params = plan = None
            gc.collect()
            if path == "single":
                params = jax.device_put(params_host, jax.devices()[0])
            else:
                plan = parallel.ParallelPlan(parallel.make_mesh(dp=dp, tp=tp, dcp=dcp))
                params = plan.shard_params(params_host, cfg)
            jax.block_until_ready(params)
            cur = (path, dp, tp, dcp)
        cache_bytes = (
            batch // dp * cdiv(ctx, args.page * dcp) * args.page * 2 * cfg.cache_row_dim * cfg.num_hidden_layers
        )
        need = per_device_param_bytes(params_host, cfg, plan) + cache_bytes
        if limit and need > 0.92 * limit:
            skip = dict(
                path=path,
                dp=dp,
                tp=tp,
                dcp=dcp,
                batch=batch,
                ctx=ctx,
                reason=f"memory: ~{need / 1e9:.0f} GB per device > 92% of {limit / 1e9:.0f} GB",
            )
            res["skipped"].append(skip)
            print("skip", skip, flush=True)
        else:
            try:
                row = run_row(
                    params=params,
                    cfg=cfg,
                    plan=plan,
                    batch=batch,
                    ctx=ctx,
                    page=args.page,
                    backend=backend,
                    gmm=gmm,
                    steps=steps,
                    reps=reps,
                    ceilings=ceilings,
                    nbytes_weights=nbytes_weights,
                )
                row["mem_gb_per_device"] = round(need / 1e9, 1)
                res["rows"].append(row)
                print(row, flush=True)
            except Exception as e:  # noqa: BLE001  (an OOM in one row should not lose the others)
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                skip = dict(path=path, dp=dp, tp=tp, dcp=dcp, batch=batch, ctx=ctx, reason=f"oom: {str(e)[:200]}")
                res["skipped"].append(skip)
                print("skip", skip, flush=True)
            gc.collect()
        left.remove(key)
        add_scaling(res["rows"])
        write_results(out_path, res)
    add_scaling(res["rows"])
    write_results(out_path, res)
    if left:
        print(
            f"{len(left)} rows left after {args.budget_min} min; continue with:\n  PYTHONPATH=. python3 "
            f"bench/multigpu.py{' --smoke' if args.smoke else ''} --out {args.out} --resume {out_path}"
            + "".join(
                f" --{k} {','.join(map(str, v))}"
                for k, v in (
                    ("tp", args.tp),
                    ("dcp", args.dcp),
                    ("dp", args.dp),
                    ("dp-tp", args.dp_tp),
                    ("batch", args.batch),
                    ("ctx", args.ctx),
                )
            ),
            flush=True,
        )
    else:
        print("all rows done", flush=True)


if __name__ == "__main__":
    main()
