"""Speculative decoding on the GPU: the verify step against a plain decode step, the MTP draft cost, and
tokens/s with speculation on the demo model.

    JAX_PLATFORMS=cuda,cpu PYTHONPATH=. python3 bench/spec.py --out $OUT          # writes OUT/spec-h200.json
    PYTHONPATH=. python3 bench/spec.py --smoke                                    # tiny, on a CPU; prints only

Part 1, DeepSeek-V2-Lite shape (random bf16 weights plus one random MTP layer, like mla_jax/bench/e2e.py), per
batch B and context ctx: a plain decode step (one query row per request), the target's verify step with k+1
rows per request (`spec_decode.spec_step` with the n-gram method: target + acceptance, no drafting) for k =
1..4, and the same step with MTP drafting (`method="mtp"`: + the MTP layer over the k+1 rows and k-1 one-row
passes); rows carry `verify_over_plain` and `mtp_draft_ms` (MTP step - verify step). Part 2, the shipped demo
model (mla_jax/data/demo): greedy generation of a few prompts, plain and with each drafter at k = 1..3, after
warm-up: tokens/s, `acceptance` (mean accepted drafts / k) and `speedup`; each demo acceptance is also projected
onto the V2-Lite step times: (1 + acceptance k) x plain / (verify + draft). Ceilings and header as every
benchmark (`mla_jax.bench.common`). `--merge-from FILE` prepends the rows of an earlier spec-h200.json (runs
split by --batches stay under the device's 10 minutes a command).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import attention, model
from mla_jax.bench.common import SMOKE_DIMS, measure_ceilings, results_header, write_results
from mla_jax.cache import KVCache, init_kv_cache
from mla_jax.config import DEEPSEEK_V2_LITE, DeepseekConfig
from mla_jax.engine import Engine, EngineConfig, default_gmm_impl
from mla_jax.metadata import ScheduledRequest, build_metadata
from mla_jax.sampling import SamplingArrays, SamplingParams
from mla_jax.spec_decode import SpecArrays, spec_step
from mla_jax.step import engine_step, step_batch

DEMO_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mla_jax", "data", "demo")
PROMPTS = [
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def push(self, item):",
    "    for i, line in enumerate(",
    "def fibonacci(n):",
]


def _time(fn, cache, iters: int, reps: int = 5):
    """Median seconds per call of fn(cache) -> (out, cache) (donated cache threaded through)."""
    for _ in range(2):
        out, cache = fn(cache)
    jax.block_until_ready(cache)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out, cache = fn(cache)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return float(np.median(times)), cache


def verify_rows(args, res) -> dict:
    """Part 1; returns {(B, ctx): {"plain": s, k: (verify s, mtp s or None)}}."""
    d = {**DEEPSEEK_V2_LITE, "num_hidden_layers": args.layers, "num_nextn_predict_layers": 1}
    if args.smoke:
        d |= SMOKE_DIMS
    cfg = DeepseekConfig.from_dict(d)
    params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    G = 16 if args.smoke else 64
    batches, ctxs, ks = (tuple(map(int, a.split(","))) for a in (args.batches, args.ctxs, args.ks))
    mtp_ks = tuple(map(int, args.mtp_ks.split(","))) if args.mtp_ks else ()
    pages_per_req = (max(ctxs) + max(ks) + G) // G + 1
    num_pages = max(batches) * pages_per_req + 1
    cache = init_kv_cache(
        cfg.num_hidden_layers + 1,
        num_pages,
        G,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        allow_any_page_size=True,
    )
    kv = cache.kv_c_and_k_pe_cache
    cache = KVCache(jax.random.normal(jax.random.key(1), kv.shape, kv.dtype), cache.kv_scale)
    del kv
    be, gmm = args.backend, args.gmm
    res["model"] = f"DeepSeek-V2-Lite shape, random bf16 weights + 1 MTP layer, {args.layers} layers"
    out = {}
    for B in batches:
        for ctx in ctxs:
            blocks = [list(range(1 + b * pages_per_req, 1 + (b + 1) * pages_per_req)) for b in range(B)]

            def md_for(q):
                reqs = [ScheduledRequest([7] * q, ctx - 1, blocks[b]) for b in range(B)]
                md, _ = build_metadata(reqs, page_size=G, num_pages=num_pages, reorder_batch_threshold=q)
                return md

            md = md_for(1)
            batch = jax.device_put(step_batch(md, SamplingArrays.build([], [], md.shape.num_logits)))

            def plain(c, batch=batch):
                t, _, c, _ = engine_step(params, cfg, c, batch, backend=be, gmm_impl=gmm)
                return t, c

            t_plain, cache = _time(plain, cache, args.iters)
            out[(B, ctx)] = {"plain": t_plain}
            for k in ks:
                mdk = md_for(k + 1)
                spk = jax.tree.map(jnp.asarray, SamplingArrays.build([], [], mdk.shape.num_logits))
                spec = SpecArrays.empty(mdk.shape)
                spec.num_drafts[:B] = k
                spec.next_ids[:] = 7
                spec.capacity[:B] = pages_per_req * G
                mdk, spec = mdk.to_device(), jax.tree.map(jnp.asarray, spec)

                def run(c, method, mdk=mdk, spk=spk, spec=spec, k=k):
                    *o, c = spec_step(
                        params,
                        cfg,
                        c,
                        mdk,
                        spk,
                        spec,
                        backend=be,
                        gmm_impl=gmm,
                        num_speculative_tokens=k,
                        method=method,
                    )
                    return o[0], c

                t_ver, cache = _time(lambda c: run(c, "ngram"), cache, args.iters)
                t_mtp = None
                if k in mtp_ks:
                    t_mtp, cache = _time(lambda c: run(c, "mtp"), cache, args.iters)
                out[(B, ctx)][k] = (t_ver, t_mtp)
                row = dict(
                    part="verify",
                    k=k,
                    batch=B,
                    ctx=ctx,
                    plain_ms=round(t_plain * 1e3, 3),
                    verify_ms=round(t_ver * 1e3, 3),
                    verify_over_plain=round(t_ver / t_plain, 3),
                )
                if t_mtp is not None:
                    row |= dict(mtp_step_ms=round(t_mtp * 1e3, 3), mtp_draft_ms=round((t_mtp - t_ver) * 1e3, 3))
                res["rows"].append(row)
                print(row, flush=True)
    return out


def demo_rows(args, res, v2: dict) -> None:
    """Part 2: the demo model (a tiny random MTP model with --smoke)."""
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
    demo_ks = (1, 2) if args.smoke else (1, 2, 3)
    for B in (1,) if args.smoke else (1, len(prompts)):
        ps = prompts[:B]
        base = None
        for method, k in [(None, 0)] + [(m, k) for m in methods for k in demo_ks]:
            ec = EngineConfig(
                max_model_len=256,
                max_num_seqs=B,
                page_size=16,
                token_budget=256,
                max_prefills=B,
                decode_buckets=(B,),
                prefill_buckets=(256,),
                num_speculative_tokens=k,
                speculative_method=method,
            )
            eng = Engine(params, cfg, ec)
            eng.warmup(all_shapes=True)
            for p in ps:
                eng.add_request(p, sp)
            t0 = time.perf_counter()
            final = eng.run()
            dt = time.perf_counter() - t0
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
                steps=eng.steps,
            )
            if k:
                acc = eng.acceptance
                row |= dict(acceptance=None if acc is None else round(acc, 4), acceptance_rate=eng.acceptance_rate)
                if method == "mtp" and acc is not None:  # projected onto the V2-Lite shape's step times
                    for (vb, vctx), t in v2.items():
                        if k in t and t[k][1] is not None:
                            proj = (1 + acc * k) * t["plain"] / t[k][1]
                            row.setdefault("projected_v2_lite_speedup", {})[f"B{vb}_ctx{vctx}"] = round(proj, 3)
            res["rows"].append(row)
            print(row, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for spec-h200.json (default: print only)")
    ap.add_argument("--merge-from", default=None, metavar="FILE", help="prepend the rows of this spec-h200.json")
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's for this GPU)")
    ap.add_argument("--gmm", choices=("ragged_dot", "pallas"), default=None)
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctxs", default="1024,4096")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--mtp-ks", default="2", help="k values whose MTP draft cost is measured ('' for none)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--demo-tokens", type=int, default=128)
    ap.add_argument("--no-verify", action="store_true", help="only the demo part")
    ap.add_argument("--no-demo", action="store_true", help="only the verify part")
    ap.add_argument("--smoke", action="store_true", help="tiny dims and sizes: checks the script on a CPU")
    args = ap.parse_args(argv)
    args.backend = args.backend or attention.default_backend_name()
    args.gmm = args.gmm or default_gmm_impl()
    if args.smoke:
        args.layers, args.batches, args.ctxs, args.ks, args.iters = 2, "1,2", "32,64", "1,2", 2
    ceilings = measure_ceilings(small=args.smoke)
    res = results_header(ceilings)
    res |= dict(backend=args.backend, gmm_impl=args.gmm)
    print("ceilings", ceilings, flush=True)
    v2 = {} if args.no_verify else verify_rows(args, res)
    if not args.no_demo:
        demo_rows(args, res, v2)
    if not args.out:
        print("not written (no --out)", flush=True)
        return
    if args.merge_from:
        with open(args.merge_from) as f:
            res["rows"] = json.load(f)["rows"] + res["rows"]
    write_results(os.path.join(args.out, "spec-h200.json"), res)


if __name__ == "__main__":
    main()
