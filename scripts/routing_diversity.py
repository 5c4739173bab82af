"""How many distinct routed experts a benchmark's decode step really hits, against the uniform-routing expectation
the e2e roofline assumes (E * (1 - (1 - k/E)^tokens) per MoE layer).

The e2e, spec and sparse benchmarks run random weights over a random cache. Their step's bytes, hence their
roofline, depend on how many experts the step's tokens route to; if the tokens' hidden states are alike (the
same input token in every request, the context's contribution small), they route alike and the step reads far
fewer expert bytes than the roofline counts. This runs the step on a CPU (XLA backend, the e2e inputs: B
requests at context ctx, random latent rows, each reading its own pages) and records each MoE layer's expert ids.

    .venv/bin/python scripts/routing_diversity.py --layers 3 --batch 32 --ctx 1024 --tokens same      (~30 s)
    .venv/bin/python scripts/routing_diversity.py --layers 3 --batch 1 --q 3 --tokens distinct

Measured on 2026-12-01 (V2-Lite shape, 3 layers, ctx 1024; the MoE layers' distinct experts, uniform expectation in
brackets): batch 32, token 7 everywhere (what the benchmarks fed until then): 6 and 8 of 64 (61.3); distinct ids:
62 and 62. A k = 2 verify step at batch 1 with [7, 7, 7]: 6 and 6 (16.4); distinct: 16 and 16. (The V3 slice does
not fit a 24 GB CPU; on the H200 its batch-32 step ran at 0.38x the uniform-routing roofline, which only collapsed
routing explains.)

The expert FFN width does not change the routing of the first MoE layer (which sees only dense layers before
it), so `--moe-width` shrinks it to fit a CPU's memory; later MoE layers' routing does depend on it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import layers, model
from mla_jax.bench.common import BENCH_MODELS, decode_requests
from mla_jax.cache import KVCache, init_kv_cache_for
from mla_jax.metadata import build_metadata
from mla_jax.step import jit_step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=tuple(BENCH_MODELS), default="v2-lite")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--q", type=int, default=1, help="query tokens per request (3: a k = 2 verify step)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument(
        "--tokens",
        choices=("same", "distinct"),
        default="distinct",
        help="input ids: token 7 everywhere, or bench_token_ids",
    )
    ap.add_argument(
        "--moe-width",
        type=int,
        default=128,
        help="moe_intermediate_size on the CPU (routing of the first MoE layer does not depend on it)",
    )
    args = ap.parse_args(argv)

    make_cfg = BENCH_MODELS[args.model][0]
    cfg = make_cfg(args.layers)
    cfg = dataclasses.replace(cfg, moe_intermediate_size=args.moe_width)
    params = model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
    B, Q, ctx, G = args.batch, args.q, args.ctx, args.page
    ppr = -(-(ctx + Q) // G)
    same = [7] * (B * Q) if args.tokens == "same" else None  # what the benchmarks fed before bench_token_ids
    reqs = decode_requests(B, ctx, ppr, cfg.vocab_size, q=Q, ids=same)
    num_pages = B * ppr + 1
    md = build_metadata(reqs, page_size=G, num_pages=num_pages, reorder_batch_threshold=Q)[0]
    cache = init_kv_cache_for(cfg, num_pages, G, dtype=jnp.bfloat16)
    kv = cache.kv_c_and_k_pe_cache
    cache = KVCache(jax.random.normal(jax.random.key(1), kv.shape, kv.dtype), cache.kv_scale)

    seen = []
    route = layers.route

    def recording_route(p_gate, cfg_, x):
        w, e = route(p_gate, cfg_, x)
        jax.debug.callback(lambda a: seen.append(np.asarray(a)), e)
        return w, e

    layers.route = recording_route
    try:
        jax.block_until_ready(jit_step(params, cfg, cache, md.to_device(), backend="xla"))
    finally:
        layers.route = route
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    T = B * Q
    expect = E * (1 - (1 - k / E) ** T)
    rows = []
    for i, e in enumerate(seen):
        e = e[:T]  # the step's real token rows (padding rows after them)
        rows.append(dict(moe_layer=i, tokens=T, distinct=int(np.unique(e).size), uniform_expectation=round(expect, 1)))
    out = dict(
        model=args.model, layers=args.layers, batch=B, q=Q, ctx=ctx, tokens=args.tokens, experts=E, top_k=k, rows=rows
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
