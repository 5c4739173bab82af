"""Speculative decoding on the GPU: the verify step against a plain decode step, the MTP draft cost, and
tokens/s with speculation on the demo model.

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/spec.py --out $OUT          # writes OUT/spec-h200.json
    PYTHONPATH=. python3 bench/spec.py --smoke                                    # tiny, on a CPU; prints only

Part 1, DeepSeek-V2-Lite shape (random bf16 weights plus one random MTP layer, like mla_jax/bench/e2e.py), per
batch B and context ctx: a plain decode step (one query row per request), the target's verify step with k+1
rows per request (`spec_decode.spec_step` with the n-gram method: target + acceptance, no drafting) for k =
1..4, and the same step with MTP drafting (`method="mtp"`: + the MTP layer over the k+1 rows and k-1 one-row
passes); rows carry `verify_over_plain`, `roofline_ratio` (the bytes the verify step must read over the plain
step's: the target's weights, counting the experts its tokens hit, + KV) and `mtp_draft_ms` (MTP step - verify
step). `--profile DIR` traces the plain and the k = 2 verify step and writes OUT/spec-profile-b{B}-h200.json
(kernels and µs per step part of each), and traces each demo row's generation (a third pass: kernels, device
busy time per step). Part 2, the shipped demo
model (mla_jax/data/demo): greedy generation of a few prompts, plain and with each drafter at k = 1..3, after
warm-up: tokens/s, `acceptance` (mean accepted drafts / k), `speedup`, and per step the wall time, the time
blocked on the device and the host's rest; each demo acceptance is also projected
onto the V2-Lite step times: (1 + acceptance k) x plain / (verify + draft). Ceilings and header as every
benchmark (`mla_jax.bench.common`). k = 2 rows carry `meets_target` (issue #24: verify <= 1.15x plain).

Order and time: the k = 2 rows (with the MTP step) for every batch and context first, then the demo part, then
k = 1, 3, 4 (each k compiles one step per batch, ~40 s at 27 layers; contexts share it). The JSON is written
after every row; no row but the first starts after --budget-min minutes (default 8.5, inside one 10-minute
command). If rows are left it says so: the same command plus `--resume OUT/spec-h200.json` measures only those
(the persistent compile cache serves the steps compiled before, on the same machine).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

from mla_jax import model
from mla_jax.bench.common import (
    add_common_args,
    bench_ceilings,
    decode_requests,
    int_list,
    profile_steps,
    profile_summary,
    res_meta,
    resolve_impls,
    results_header,
    time_step,
    v2_lite_config,
    write_results,
)
from mla_jax.bench.e2e import weight_bytes
from mla_jax.cache import KVCache, init_kv_cache
from mla_jax.compile_cache import enable_compile_cache
from mla_jax.engine import Engine, EngineConfig, default_page_size
from mla_jax.metadata import build_metadata
from mla_jax.packed import Packed
from mla_jax.sampling import SamplingArrays, SamplingParams
from mla_jax.spec_decode import SpecArrays, SpecCarry, spec_step
from mla_jax.step import engine_step, step_batch

RESULT_FILE = "spec-h200.json"
TARGET_K, TARGET_VERIFY_OVER_PLAIN = 2, 1.15  # issue #24: the verify step at k = 2 within 1.15x a plain step
DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mla_jax", "data", "demo")
PROMPTS = [
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def push(self, item):",
    "    for i, line in enumerate(",
    "def fibonacci(n):",
]


def _time(fn, cache, iters: int):
    """Median seconds per call of fn(cache) -> (out, cache) (donated cache threaded through)."""
    t, _, cache = time_step(fn, cache, steps=iters, reps=5, warmup=2)
    return t, cache


class VerifyBench:
    """Part 1 on the V2-Lite shape: one model, one cache (random latent rows), every (B, ctx, k) against it."""

    def __init__(self, args, res):
        self.cfg = cfg = v2_lite_config(args.layers, smoke=args.smoke, num_nextn_predict_layers=1)
        self.params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
        self.G = G = 16 if args.smoke else 64
        batches, ctxs, ks = (int_list(a) for a in (args.batches, args.ctxs, args.ks))
        self.pages_per_req = (max(ctxs) + max(ks) + G) // G + 1
        self.num_pages = max(batches) * self.pages_per_req + 1
        cache = init_kv_cache(
            cfg.num_hidden_layers + 1,
            self.num_pages,
            G,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            allow_any_page_size=True,
        )
        kv = cache.kv_c_and_k_pe_cache
        self.cache = KVCache(jax.random.normal(jax.random.key(1), kv.shape, kv.dtype), cache.kv_scale)
        del kv, cache
        self.args, self.res = args, res
        # what a step over n tokens must read: the target's weights (the experts its tokens hit; no MTP layer)
        # and the KV rows, over copy bandwidth: the verify step's roofline over the plain step's
        target = {**self.params, "model": {k: v for k, v in self.params["model"].items() if k != "mtp_layers"}}
        row_bytes = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
        self.step_bytes = lambda B, ctx, n: (  # noqa: E731
            weight_bytes(target, cfg, n) + B * ctx * row_bytes * cfg.num_hidden_layers
        )
        self.times: dict = {}  # (B, ctx) -> {"plain": s, k: (verify s, mtp s or None)}
        res["model"] = f"DeepSeek-V2-Lite shape, random bf16 weights + 1 MTP layer, {args.layers} layers"

    def _md(self, B: int, ctx: int, q: int):
        reqs = decode_requests(B, ctx, self.pages_per_req, self.cfg.vocab_size, q=q)
        md, _ = build_metadata(reqs, page_size=self.G, num_pages=self.num_pages, reorder_batch_threshold=q)
        return md

    def plain(self, B: int, ctx: int) -> float:
        """A plain decode step (`engine_step`, one row per request), timed once per (B, ctx)."""
        t = self.times.setdefault((B, ctx), {})
        if "plain" not in t:
            md = self._md(B, ctx, 1)
            batch = jax.device_put(step_batch(md, SamplingArrays.build([], [], md.shape.num_logits)))
            a = self.args

            def step(c):
                tok, _, c, _ = engine_step(self.params, self.cfg, c, batch, **self._kw())
                return tok, c

            t["plain"], self.cache = _time(step, self.cache, a.iters)
            t["plain_fn"] = step, lambda c: engine_step.lower(self.params, self.cfg, c, batch, **self._kw())
        return t["plain"]

    def _kw(self) -> dict:
        return dict(backend=self.args.backend, gmm_impl=self.args.gmm)

    def profile(self, B: int, ctx: int, k: int, verify, lower_verify) -> dict:
        """Kernel breakdowns (`kernel_breakdown`: kernels and µs per step part) of the plain and the verify
        step at (B, ctx), each from a device trace of 5 steps."""
        out = dict(batch=B, ctx=ctx, k=k, backend=self.args.backend, gmm_impl=self.args.gmm)
        plain, lower_plain = self.times[(B, ctx)]["plain_fn"]
        for name, fn, lower in (("plain", plain, lower_plain), ("verify", verify, lower_verify)):
            print(name, flush=True)
            d = f"{self.args.profile}/b{B}-ctx{ctx}-k{k}-{name}"
            out[name], self.cache = profile_steps(fn, self.cache, lower, d)
        return out

    def row(self, B: int, ctx: int, k: int, mtp: bool) -> dict:
        """The verify step with k+1 rows per request (and, with `mtp`, the step with MTP drafting)."""
        a, G = self.args, self.G
        t_plain = self.plain(B, ctx)
        mdk = self._md(B, ctx, k + 1)
        spk = SamplingArrays.build([], [], mdk.shape.num_logits)
        spec = SpecArrays.empty(mdk.shape)
        spec.num_drafts[:B] = k
        spec.next_ids[:] = 7
        spec.capacity[:B] = self.pages_per_req * G
        batch = jax.device_put(Packed.of((mdk, spk, spec)))

        kw = dict(self._kw(), num_speculative_tokens=k)
        carry = [jax.device_put(SpecCarry.zeros(mdk.shape.num_decodes + mdk.shape.num_prefills, k))]  # donated

        def run(c, method):
            *o, c, carry[0] = spec_step(self.params, self.cfg, c, batch, carry[0], **kw, method=method)
            return o[0], c

        t_ver, self.cache = _time(lambda c: run(c, "ngram"), self.cache, a.iters)
        t_mtp = None
        if mtp:
            t_mtp, self.cache = _time(lambda c: run(c, "mtp"), self.cache, a.iters)
        self.times[(B, ctx)][k] = (t_ver, t_mtp)
        row = dict(
            part="verify",
            k=k,
            batch=B,
            ctx=ctx,
            plain_ms=round(t_plain * 1e3, 3),
            verify_ms=round(t_ver * 1e3, 3),
            verify_over_plain=round(t_ver / t_plain, 3),
            roofline_ratio=round(self.step_bytes(B, ctx, B * (k + 1)) / self.step_bytes(B, ctx, B), 3),
        )
        if k == TARGET_K:
            row["meets_target"] = t_ver / t_plain <= TARGET_VERIFY_OVER_PLAIN
        if t_mtp is not None:
            row |= dict(mtp_step_ms=round(t_mtp * 1e3, 3), mtp_draft_ms=round((t_mtp - t_ver) * 1e3, 3))
        if a.profile and k == TARGET_K and B in int_list(a.profile_batches) and ctx == min(int_list(a.ctxs)):
            lower = lambda c: spec_step.lower(self.params, self.cfg, c, batch, carry[0], **kw, method="ngram")  # noqa: E731
            prof = self.profile(B, ctx, k, lambda c: run(c, "ngram"), lower)
            if a.out:
                write_results(os.path.join(a.out, f"spec-profile-b{B}-h200.json"), {**res_meta(self.res), **prof})
        return row


def demo_rows(args, res, done: set, more_time, save) -> None:
    """Part 2: the demo model (a tiny random MTP model with --smoke). Rows in `done` are skipped; `more_time()`
    says whether to start another row; `save()` writes the results so far."""
    from mla_jax.checkpoint import eos_token_ids, load_model

    if args.smoke:
        from tests.mla_jax.helpers import tiny_config

        cfg = tiny_config(num_nextn_predict_layers=1, vocab_size=128)
        params = model.init_params(cfg, jax.random.key(0))
        prompts = [list(range(i, i + 9)) * 2 for i in range(4)]
        stop, new = (), 16
    else:
        from tokenizers import Tokenizer

        cfg, params = load_model(DEMO_DIR, dtype=jnp.bfloat16)
        tok = Tokenizer.from_file(os.path.join(DEMO_DIR, "tokenizer.json"))
        prompts = [tok.encode(p).ids for p in PROMPTS]
        stop, new = eos_token_ids(DEMO_DIR), args.demo_tokens
    methods = ["ngram"] + (["mtp"] if cfg.num_mtp_layers else [])
    if not cfg.num_mtp_layers:
        res["demo_note"] = f"{DEMO_DIR} has no MTP layer (export one with scripts/train_demo.py --mtp-only)"
    sp = SamplingParams(max_new_tokens=new, stop_token_ids=tuple(stop))
    demo_ks = (1, 2) if args.smoke else int_list(args.demo_ks)
    for B in (1,) if args.smoke else int_list(args.demo_batches.replace("all", str(len(prompts)))):
        ps = prompts[:B]
        base = None
        for method, k in [(None, 0)] + [(m, k) for m in methods for k in demo_ks]:
            key = ("demo", method or "none", k, B)
            if key in done:
                base = base or next(r["tokens_per_s"] for r in res["rows"] if _key(r) == ("demo", "none", 0, B))
                continue
            if not more_time():
                return
            ec = EngineConfig(
                max_model_len=256,
                max_num_seqs=B,
                page_size=default_page_size(),  # 64 on a GPU: the decode kernel the verify rows measure
                token_budget=256,
                max_prefills=B,
                decode_buckets=(B,),
                prefill_buckets=(256,),
                num_speculative_tokens=k,
                speculative_method=method,
            )
            eng = Engine(params, cfg, ec)
            eng.warmup(all_shapes=True)
            for _ in range(2):  # the second pass is timed: the host side's first-call costs stay out
                for p in ps:
                    eng.add_request(p, sp)
                steps0, wait0, t0 = eng.steps, eng.device_wait_s, time.perf_counter()
                final = eng.run()
                dt = time.perf_counter() - t0
            steps, wait = eng.steps - steps0, eng.device_wait_s - wait0
            n = sum(len(o.token_ids) for o in final.values())
            tps = n / dt
            base = base or tps
            row = dict(
                part="demo",
                method=method or "none",
                k=k,
                batch=B,
                ctx=None,
                tokens=n,
                tokens_per_s=round(tps, 1),
                speedup=round(tps / base, 3),
                steps=steps,
                # per step: the wall time, the part of it blocked on the device's results, and the rest (host:
                # scheduler, metadata, drafting, outputs, dispatch); synchronous engines (n-gram speculation) wait for
                # every step, asynchronous ones overlap the host's work with the previous step
                ms_per_step=round(dt / steps * 1e3, 3),
                wait_ms_per_step=round(wait / steps * 1e3, 3),
                host_ms_per_step=round((dt - wait) / steps * 1e3, 3),
                async_scheduling=eng.async_scheduling,
            )
            if args.profile:  # a third, traced pass: the device's busy time and kernels per step
                for p in ps:
                    eng.add_request(p, sp)
                d = f"{args.profile}/demo-b{B}-{method or 'none'}-k{k}"
                steps0 = eng.steps
                with jax.profiler.trace(d):
                    eng.run()
                row |= _trace_per_step(d, eng.steps - steps0)
            if k:
                acc = eng.acceptance
                row |= dict(acceptance=None if acc is None else round(acc, 4), acceptance_rate=eng.acceptance_rate)
                if method == "mtp" and acc is not None:  # projected onto the V2-Lite shape's step times
                    for v in res["rows"]:
                        if v["part"] == "verify" and v["k"] == k and v.get("mtp_step_ms"):
                            proj = (1 + acc * k) * v["plain_ms"] / v["mtp_step_ms"]
                            key_v = f"B{v['batch']}_ctx{v['ctx']}"
                            row.setdefault("projected_v2_lite_speedup", {})[key_v] = round(proj, 3)
            res["rows"].append(row)
            print(row, flush=True)
            save()


def _trace_per_step(trace_dir: str, steps: int) -> dict:
    """The busiest device line of a trace of `steps` engine steps (prefill included): its kernels, busy time and
    span per step; busy against the step's wall time shows how much of it the GPU idles."""
    lines = profile_summary(trace_dir, top=0).get("lines") or []
    if not lines:
        return {"trace_error": f"no device line under {trace_dir}"}
    ln = max(lines, key=lambda x: x["busy_ms"])
    return dict(
        kernels_per_step=round(ln["events"] / steps, 1),
        device_busy_ms_per_step=round(ln["busy_ms"] / steps, 3),
        trace_span_ms_per_step=round(ln["span_ms"] / steps, 3),
    )


def _key(r: dict) -> tuple:
    return (
        ("verify", r["k"], r["batch"], r["ctx"]) if r["part"] == "verify" else ("demo", r["method"], r["k"], r["batch"])
    )


def main(argv: list[str] | None = None) -> None:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, out_default=None, out_help="directory for spec-h200.json (default: print only)", budget_min=8.5)
    ap.add_argument("--resume", default=None, metavar="FILE", help="a spec-h200.json: keep its rows, skip those")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctxs", default="1024,4096")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--mtp-ks", default="2", help="k values whose MTP draft cost is measured ('' for none)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--demo-tokens", type=int, default=128)
    ap.add_argument("--no-verify", action="store_true", help="only the demo part")
    ap.add_argument("--no-demo", action="store_true", help="only the verify part")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace the plain and the k = 2 verify step into DIR (at the smallest ctx, batches --profile-batches) "
        "and write OUT/spec-profile-b{B}-h200.json: kernels and µs per step part of each",
    )
    ap.add_argument("--profile-batches", default="1,32")
    ap.add_argument("--demo-ks", default="1,2,3", help="the demo part's k values")
    ap.add_argument("--demo-batches", default="1,all", help="the demo part's batches ('all': every prompt at once)")
    args = resolve_impls(ap.parse_args(argv))
    if args.smoke:
        args.layers, args.batches, args.ctxs, args.ks, args.iters = 2, "1,2", "32,64", "1,2", 2
    enable_compile_cache()  # a rerun (--resume) on the same machine loads the compiled steps
    res = results_header(bench_ceilings(args.smoke))
    res |= dict(
        backend=args.backend,
        gmm_impl=args.gmm,
        target=f"verify_over_plain <= {TARGET_VERIFY_OVER_PLAIN} at k = {TARGET_K} (rows' meets_target)",
    )
    print("ceilings", res["ceilings"], flush=True)
    if args.resume:
        with open(args.resume) as f:
            res["rows"] = json.load(f)["rows"]
    done = {_key(r) for r in res["rows"]}
    path = os.path.join(args.out, RESULT_FILE) if args.out else None
    left: list[str] = []

    rows_at_start = len(res["rows"])

    def more_time() -> bool:  # the first row always starts: a run that measures nothing wastes its command
        return len(res["rows"]) == rows_at_start or (time.perf_counter() - t_start) / 60 < args.budget_min

    def save() -> None:
        if path:
            write_results(path, res)

    batches, ctxs, ks, mtp_ks = (int_list(a) for a in (args.batches, args.ctxs, args.ks, args.mtp_ks))
    # The rows the target and the demo projection need first, then the other k (every k compiles one
    # step per batch, ~40 s at 27 layers), so a run cut by --budget-min has the important ones.
    order = [k for k in ks if k == TARGET_K] + [k for k in ks if k != TARGET_K]
    todo = [] if args.no_verify else [(k, B, ctx) for k in order for B in batches for ctx in ctxs]
    todo = [t for t in todo if ("verify",) + t not in done]
    bench = VerifyBench(args, res) if todo else None
    first = [t for t in todo if t[0] == order[0]]
    for phase in (first, "demo", [t for t in todo if t not in first]):
        if phase == "demo":
            if not args.no_demo:
                demo_rows(args, res, done, more_time, save)
            continue
        for k, B, ctx in phase:
            if not more_time():
                left.append(f"verify k={k} B={B} ctx={ctx}")
                continue
            row = bench.row(B, ctx, k, mtp=k in mtp_ks)
            res["rows"].append(row)
            print(row, flush=True)
            save()
    save()
    if not path:
        print("not written (no --out)", flush=True)
    elif left or not more_time():
        print(
            f"time budget ({args.budget_min} min) reached; {len(left)} verify rows left (and any demo rows): "
            f"continue with the same command plus --resume {path}",
            flush=True,
        )
    else:
        print("all rows done", flush=True)


if __name__ == "__main__":
    main()
