"""Where the Hopper decode kernel's warpgroups spend their time: Mosaic GPU profiler traces.

    PYTHONPATH=. python3 bench/trace_sm90.py --out DIR [--l 384] [--b 66] [--n 128] [--ctx 2048]
        [--splits 1] [--dtype bf16|fp8] [--fp8-qk [--two-q-terms]] [--stages S] [--fp8-stages F]

Each consumer loop marks its phases with `jax.named_scope` (qk, softmax, pv, and the barrier
waits); with `mla_decode_sm90.TRACE` set, the compiled kernel records every scope's start and end
per warpgroup. The trace buffer lives in shared memory, which the L=512 kernel fills to the limit,
so the traces are taken at a smaller latent width (default 384: same schedule and page size, 3/4
of the columns). B requests of N heads over ctx tokens, each head tile cut into `splits` pieces.

Writes DIR/trace-<tag>.json (the first 4 CTAs, for Perfetto) and DIR/trace-<tag>-summary.json,
and prints per warpgroup each scope's mean duration (us, the profiler's global timer) and its
share of the CTA's time; WG0's time outside its scopes is the softmax (logits, max, exp, sum, the
P store).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.decode import make_inputs  # noqa: E402
from pallas_kernels import mla_decode_sm90 as k90  # noqa: E402
from pallas_kernels.util import cdiv  # noqa: E402

WARPGROUPS = 3  # two consumers and the producer


def summarize(events):
    """{wg: {scope: (count, mean duration)}}, mean CTA span, from Perfetto B/E events."""
    per_wg = collections.defaultdict(lambda: collections.defaultdict(list))
    spans = collections.defaultdict(list)
    stacks = collections.defaultdict(list)
    for e in events:
        key = (e["pid"], e["tid"])
        spans[(e["tid"] - 1) // WARPGROUPS].append(e["ts"])
        if e["ph"] == "B":
            stacks[key].append(e)
        elif stacks[key]:
            b = stacks[key].pop()
            per_wg[(e["tid"] - 1) % WARPGROUPS][b["name"]].append(e["ts"] - b["ts"])
    span = float(np.mean([max(t) - min(t) for t in spans.values()]))
    return {
        wg: {name: (len(d), float(np.mean(d)), float(np.sum(d)) / len(spans)) for name, d in sorted(scopes.items())}
        for wg, scopes in sorted(per_wg.items())
    }, span


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--l", type=int, default=384)
    ap.add_argument("--b", type=int, default=66)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--splits", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp8"))
    ap.add_argument("--fp8-qk", action="store_true", help="fp8 cache: QK^T as an fp8 wgmma")
    ap.add_argument("--two-q-terms", action="store_true", help="with --fp8-qk: q as two e4m3 terms (fp8_q_split=True)")
    ap.add_argument("--stages", type=int, default=None, help="bf16 ring depth (kernel default)")
    ap.add_argument("--fp8-stages", type=int, default=None, help="fp8 ring depth (kernel default)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tag = (
        f"{args.b}x{args.n}x{args.ctx}-s{args.splits}-{args.dtype}-L{args.l}"
        + ("-qk8" if args.fp8_qk else "")
        + ("-q2" if args.two_q_terms else "")
        + (f"-st{args.stages}" if args.stages else "")
        + (f"-fst{args.fp8_stages}" if args.fp8_stages else "")
    )
    tuning = dict(num_stages=args.stages, fp8_stages=args.fp8_stages, fp8_qk=args.fp8_qk)
    if args.two_q_terms:
        tuning["fp8_q_split"] = True
    q, cache, bt, sl, ks = make_inputs(jax.random.key(0), args.b, 1, args.n, args.ctx, args.dtype, width=args.l + 64)
    pages = cdiv(cdiv(args.ctx, k90.PAGE_SIZE), args.splits)  # pages per CTA
    tmp = tempfile.mkdtemp()
    k90.TRACE = (8 * pages + 16, tmp)  # scopes per warpgroup: at most 6 a page (WG0)
    out = k90.mla_decode_sm90(
        q, cache, bt, sl, scale=0.1, kv_scale=ks, kv_lora_rank=args.l, num_kv_splits=args.splits, **tuning
    )
    jax.block_until_ready(out)
    jax.effects_barrier()  # the trace is written by a host callback
    k90.TRACE = None
    files = sorted(glob.glob(os.path.join(tmp, "*-trace.json")))
    if not files:
        sys.exit(f"{tag}: no trace written")
    events = json.load(open(files[-1]))["traceEvents"]
    scopes, span = summarize(events)
    summary = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("MLA_JAX_COMMIT", ""),
        "shape": dict(
            B=args.b, N=args.n, ctx=args.ctx, splits=args.splits, L=args.l, dtype=args.dtype, pages_per_cta=pages
        ),
        "tuning": tuning,
        "cta_span_us": span,
        "per_page_us": span / pages,
        "warpgroups": {
            str(wg): {name: dict(count=c, mean_us=m, per_cta_us=t) for name, (c, m, t) in s.items()}
            for wg, s in scopes.items()
        },
    }
    keep = set(sorted({e["tid"] for e in events})[: 4 * WARPGROUPS])
    with open(os.path.join(args.out, f"trace-{tag}.json"), "w") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": [e for e in events if e["tid"] in keep]}, f)
    with open(os.path.join(args.out, f"trace-{tag}-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{tag}: CTA span {span:.2f} us, per page {span / pages:.3f} us")
    for wg, s in scopes.items():
        for name, (c, m, t) in s.items():
            print(f"  wg{wg} {name:16s} n={c:6d} mean={m:7.3f} us  per CTA {t:8.2f} us ({100 * t / span:5.1f}%)")


if __name__ == "__main__":
    main()
