"""Where the Hopper decode kernel's warpgroups spend their time: Mosaic GPU profiler traces.

    PYTHONPATH=. python3 bench/trace_sm90.py --out DIR [--l 384] [--b 132] [--n 64] [--ctx 2048]

Each consumer loop marks its phases with `jax.named_scope` (qk, softmax, pv, and the barrier
waits); with `mla_decode_sm90.TRACE` set, the compiled kernel records every scope's start and end
per warpgroup. The trace buffer lives in shared memory, which the L=512 kernel fills to the limit,
so the traces are taken at a smaller latent width (default 384: same schedule and page size, 3/4
of the columns). One CTA per request (splits 1), B requests of N heads over ctx tokens.

Writes DIR/trace-<pipeline>.json (the first 4 CTAs, for Perfetto) and DIR/trace-summary.json, and
prints per pipeline and warpgroup each scope's mean duration and its share of the CTA's time.
Durations are in the trace's time unit (the profiler's clock; compare them with each other).
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pallas_kernels import mla_decode_sm90 as k90  # noqa: E402

WARPGROUPS = 3  # two consumers and the producer


def inputs(b, n, ctx, l, r=64, seed=0):
  g = k90.PAGE_SIZE
  pages = -(-ctx // g)
  k = jax.random.split(jax.random.key(seed), 2)
  q = jax.random.normal(k[0], (b, 1, n, l + r), jnp.bfloat16)
  cache = jax.random.normal(k[1], (b * pages, g, l + r), jnp.bfloat16)
  bt = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
  return q, cache, bt, jnp.full((b, 1), ctx, jnp.int32)


def summarize(events):
  """{wg: {scope: (count, mean duration)}}, mean CTA span, from Perfetto B/E events."""
  per_wg = collections.defaultdict(lambda: collections.defaultdict(list))
  spans = collections.defaultdict(list)
  stacks = collections.defaultdict(list)
  for e in events:
    key = (e["pid"], e["tid"])
    spans[e["tid"] // WARPGROUPS].append(e["ts"])
    if e["ph"] == "B":
      stacks[key].append(e)
    elif stacks[key]:
      b = stacks[key].pop()
      per_wg[(e["tid"] - 1) % WARPGROUPS][b["name"]].append(e["ts"] - b["ts"])
  span = float(np.mean([max(t) - min(t) for t in spans.values()]))
  return {wg: {name: (len(d), float(np.mean(d)), float(np.sum(d)) / len(spans))
               for name, d in sorted(scopes.items())}
          for wg, scopes in sorted(per_wg.items())}, span


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default="bench/results")
  ap.add_argument("--l", type=int, default=384)
  ap.add_argument("--b", type=int, default=132)
  ap.add_argument("--n", type=int, default=64)
  ap.add_argument("--ctx", type=int, default=2048)
  ap.add_argument("--pipelines", default="serial,seesaw")
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  q, cache, bt, sl = inputs(args.b, args.n, args.ctx, args.l)
  pages = -(-args.ctx // k90.PAGE_SIZE)
  summary = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
             "shape": dict(B=args.b, N=args.n, ctx=args.ctx, L=args.l, pages_per_cta=pages)}
  for pipeline in args.pipelines.split(","):
    tmp = tempfile.mkdtemp()
    k90.TRACE = (5 * pages + 16, tmp)   # scopes per warpgroup: at most 4 a page (serial WG0)
    jax.clear_caches()
    out = k90.mla_decode_sm90(q, cache, bt, sl, scale=0.1, kv_lora_rank=args.l, num_kv_splits=1,
                              pipeline=pipeline)
    jax.block_until_ready(out)
    jax.effects_barrier()   # the trace is written by a host callback
    k90.TRACE = None
    files = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))
    if not files:
      print(f"{pipeline}: no trace written")
      continue
    events = json.load(open(files[-1]))["traceEvents"]
    scopes, span = summarize(events)
    summary[pipeline] = {"cta_span": span, "per_page": span / pages, "warpgroups": {
        str(wg): {name: dict(count=c, mean=m, per_cta=t) for name, (c, m, t) in s.items()}
        for wg, s in scopes.items()}}
    keep = {t for t in sorted({e["tid"] for e in events})[:4 * WARPGROUPS]}
    with open(os.path.join(args.out, f"trace-{pipeline}.json"), "w") as f:
      json.dump({"displayTimeUnit": "ns",
                 "traceEvents": [e for e in events if e["tid"] in keep]}, f)
    print(f"{pipeline}: CTA span {span:.2f}, per page {span / pages:.3f}")
    for wg, s in scopes.items():
      for name, (c, m, t) in s.items():
        print(f"  wg{wg} {name:16s} n={c:6d} mean={m:8.3f} per CTA {t:9.2f} "
              f"({100 * t / span:5.1f}%)")
  with open(os.path.join(args.out, "trace-summary.json"), "w") as f:
    json.dump(summary, f, indent=1)


if __name__ == "__main__":
  main()
