"""End-to-end benchmark on the GPU: a DeepSeek-V2-Lite-shaped model with random bf16 weights.

    mla-jax bench --out DIR            (or: python3 -m mla_jax.bench.e2e --out DIR)
    mla-jax bench --smoke              (tiny dims on a CPU; prints the rows, writes nothing)

Decode step time and tokens/s at batch 1, 32, 128 with context 1k and 4k (the cache is filled with random rows,
every request reading its own pages), prefill throughput for 8 prompts of 2k tokens, warm-up compile time.
Each step time is set against its roofline: bytes of weights and KV the step must read over the copy bandwidth
measured in the same run. With --out, writes DIR/e2e-h200.json (format: shared/notes/bench-results.md);
without it, only prints.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import attention, model
from mla_jax.bench.common import measure_ceilings, profile_summary, results_header, write_results
from mla_jax.cache import KVCache
from mla_jax.checkpoint.fp8 import quantize_params
from mla_jax.config import DEEPSEEK_V2_LITE, DeepseekConfig
from mla_jax.engine import Engine, EngineConfig
from mla_jax.metadata import ScheduledRequest, build_metadata
from mla_jax.sampling import SamplingArrays
from mla_jax.step import engine_step

V2_LITE = DEEPSEEK_V2_LITE


def weight_bytes(params, cfg: DeepseekConfig, tokens: int) -> float:
    """Bytes of weights a step over `tokens` tokens must read: everything except routed experts, plus the
    expected number of distinct experts the tokens hit (E * (1 - (1 - k/E)^tokens)) per MoE layer."""
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    ex = params["model"]["moe_layers"]["mlp"]["experts"]
    expert_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(ex))
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = E * (1 - (1 - k / E) ** tokens)
    return total - expert_bytes + expert_bytes * hit / E


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="directory for e2e-h200.json (default: print only)")
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's for this GPU)")
    ap.add_argument("--layers", type=int, default=27, help="fewer layers for a quick look")
    ap.add_argument("--smoke", action="store_true", help="tiny dims and sizes: checks the script on a CPU")
    ap.add_argument(
        "--gmm",
        choices=("ragged_dot", "pallas"),
        default="pallas",
        help="MoE expert matmul (mla_jax.layers.expert_gmm)",
    )
    ap.add_argument(
        "--weights", choices=("bf16", "fp8"), default="bf16", help="fp8: block-FP8 linears and experts (W8A8)"
    )
    ap.add_argument("--batches", default="1,32,128", help="decode batch sizes")
    ap.add_argument("--ctxs", default="1024,4096", help="decode contexts (at most 4096)")
    ap.add_argument("--no-prefill", action="store_true", help="skip the prefill row")
    ap.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="trace 5 steps of the last decode shape into DIR; writes OUT/profile-decode.json",
    )
    args = ap.parse_args(argv)
    args.backend = args.backend or attention.default_backend_name()

    d = {**V2_LITE, "num_hidden_layers": args.layers}
    if args.smoke:
        d |= dict(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_attention_heads=4,
            kv_lora_rank=64,
            qk_nope_head_dim=32,
            qk_rope_head_dim=16,
            v_head_dim=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
        )
        if "num_key_value_heads" in d:  # must equal the heads for MLA
            d["num_key_value_heads"] = d["num_attention_heads"]
    cfg = DeepseekConfig.from_dict(d)
    ceilings = measure_ceilings(small=args.smoke)
    res = results_header(ceilings)
    res["model"] = f"DeepSeek-V2-Lite shape, random {args.weights} weights, {args.layers} layers"
    res["weights"] = args.weights
    res["backend"] = args.backend
    res["gmm_impl"] = args.gmm
    print("ceilings", ceilings, flush=True)
    params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    if args.weights == "fp8":
        params = quantize_params(params)[0]
    jax.block_until_ready(params)

    G, max_ctx = 64, 4096 + 64
    batches, ctxs = tuple(map(int, args.batches.split(","))), tuple(map(int, args.ctxs.split(",")))
    S, P = 2048, 8
    if args.smoke:
        G, max_ctx, batches, ctxs, S, P = 16, 128 + 16, (1, 4), (32, 128), 64, 2
    ec = EngineConfig(
        max_model_len=max_ctx,
        max_num_seqs=max(batches),
        page_size=G,
        num_pages=max(batches) * (max_ctx // G) + 1,
        token_budget=S * P,
        max_prefills=P,
        decode_buckets=tuple(sorted(set(batches) | {max(batches)})),
        prefill_buckets=(S * P,),
        backend=args.backend,
        gmm_impl=args.gmm,
    )
    eng = Engine(params, cfg, ec)
    t0 = time.perf_counter()
    eng.warmup(prefill=True)
    compile_s = time.perf_counter() - t0
    print(f"warm-up compile ({len(ec.decode_buckets)} decode buckets + 1 prefill shape): {compile_s:.1f} s", flush=True)
    # Random latent rows everywhere (decode reads only what seq_lens allow).
    kv = eng.cache.kv_c_and_k_pe_cache
    eng.cache = KVCache(jax.random.normal(jax.random.key(1), kv.shape, kv.dtype), eng.cache.kv_scale)
    del kv
    pages_per_req = max_ctx // G
    row_bytes = 2 * cfg.cache_row_dim

    for B in batches:
        for ctx in ctxs:
            reqs = [
                ScheduledRequest([7], ctx - 1, list(range(1 + b * pages_per_req, 1 + (b + 1) * pages_per_req)))
                for b in range(B)
            ]
            md, _ = build_metadata(reqs, page_size=G, num_pages=ec.num_pages, shape=eng.batch_shape(B, 0))
            md = md.to_device()
            sp = jax.tree.map(jnp.asarray, SamplingArrays.build([], [], md.shape.num_logits))

            def step(cache):
                t, _, cache = engine_step(
                    eng.params, cfg, cache, md, sp, backend=args.backend, batch_invariant=False, gmm_impl=args.gmm
                )
                return t, cache

            cache = eng.cache
            for _ in range(3):
                _, cache = step(cache)
            jax.block_until_ready(cache)
            times = []
            for _ in range(5):
                t1 = time.perf_counter()
                for _ in range(10):
                    tok, cache = step(cache)
                jax.block_until_ready(tok)
                times.append((time.perf_counter() - t1) / 10)
            if args.profile and (B, ctx) == (batches[-1], ctxs[-1]):
                with jax.profiler.trace(args.profile):
                    for _ in range(5):
                        tok, cache = step(cache)
                    jax.block_until_ready(tok)
                summary = profile_summary(args.profile)
                summary["shape"] = dict(batch=B, ctx=ctx, steps=5, backend=args.backend, gmm_impl=args.gmm)
                if args.out:
                    write_results(f"{args.out}/profile-decode.json", summary)
            eng.cache = cache
            step_s = float(np.median(times))
            nbytes = weight_bytes(params, cfg, B) + B * ctx * row_bytes * cfg.num_hidden_layers
            roof = nbytes / (ceilings["copy_TBps"] * 1e12)
            row = dict(
                batch=B,
                ctx=ctx,
                phase="decode",
                weights=args.weights,
                step_ms=round(step_s * 1e3, 3),
                tokens_per_s=round(B / step_s, 1),
                roofline_ms=round(roof * 1e3, 3),
                x_roofline=round(step_s / roof, 2),
                compile_s=round(compile_s, 1),
            )
            res["rows"].append(row)
            print(row, flush=True)

    if args.no_prefill:
        _finish(args, res)
        return
    # Prefill: P prompts of S new tokens in one step.
    reqs = [
        ScheduledRequest(
            list(np.random.default_rng(p).integers(0, cfg.vocab_size, S)),
            0,
            list(range(1 + p * pages_per_req, 1 + p * pages_per_req + S // G)),
        )
        for p in range(P)
    ]
    md, _ = build_metadata(
        reqs, page_size=G, num_pages=ec.num_pages, workspace_rows=eng.workspace_rows, shape=eng.batch_shape(0, S * P)
    )
    md = md.to_device()
    sp = jax.tree.map(jnp.asarray, SamplingArrays.build([], [], md.shape.num_logits))
    cache = eng.cache
    for _ in range(2):
        _, _, cache = engine_step(
            eng.params, cfg, cache, md, sp, backend=args.backend, batch_invariant=False, gmm_impl=args.gmm
        )
    jax.block_until_ready(cache)
    times = []
    for _ in range(3):
        t1 = time.perf_counter()
        tok, _, cache = engine_step(
            eng.params, cfg, cache, md, sp, backend=args.backend, batch_invariant=False, gmm_impl=args.gmm
        )
        jax.block_until_ready(tok)
        times.append(time.perf_counter() - t1)
    step_s = float(np.median(times))
    nbytes = weight_bytes(params, cfg, S * P)
    roof = nbytes / (ceilings["copy_TBps"] * 1e12)
    row = dict(
        batch=P,
        ctx=S,
        phase="prefill",
        weights=args.weights,
        step_ms=round(step_s * 1e3, 3),
        tokens_per_s=round(S * P / step_s, 1),
        roofline_ms=round(roof * 1e3, 3),
        x_roofline=round(step_s / roof, 2),
        compile_s=round(compile_s, 1),
    )
    res["rows"].append(row)
    print(row, flush=True)
    _finish(args, res)


def _finish(args, res) -> None:
    if args.out:
        write_results(f"{args.out}/e2e-h200.json", res)
    else:
        print("not written (no --out)", flush=True)


if __name__ == "__main__":
    main()
