"""The fp8 decode modes' error against float32 on the decode benchmark's inputs, emulated densely (CPU).

Run (CPU, ~1 min): .venv/bin/python scripts/fp8_decode_footing.py [--b 4 --n 128 --ctx 2048]

`bench/decode.py`'s inputs (q ~ N(0, 1) in bf16, an fp8 cache with one f32 scale a token) over one request's pages
in order, at two softmax scales: DeepSeek-V3's with YaRN (`testing.DECODE_SCALE`, the benchmark's) and 1/sqrt(192)
(the scale FlashMLA's fp8 error, 1.5-1.8%, was measured at on the H200 in 2026-12-01). Each mode's output
against the float32 attention over the dequantized cache with the exact q, ||out - ref|| / ||ref||:
- `p_only`: P rounded to e4m3 (P'' = p * token scale, as the fp8 P.V kernel stores it), q exact;
- `q1`: q as one e4m3 term a row (`fp8_q_split=False`), P exact; `q1_p`: both;
- `q2_p`: q as two e4m3 terms (q_hi and its residual, the default fp8 P.V kernel) and P rounded.
The wgmma's reduced-precision fp8 accumulation is not emulated (the GPU rows' rel_err have it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.decode import make_inputs  # noqa: E402
from pallas_kernels.mla_decode_sm90 import fp8_qk_reference_q  # noqa: E402
from pallas_kernels.testing import DECODE_SCALE  # noqa: E402

SCALES = {"v3_yarn": DECODE_SCALE, "inv_sqrt_192": 192**-0.5}


def attention(q, rows, kss, scale: float, l: int, round_p: bool):
    """q [B, N, D] f32 over rows [B, S, D] (e4m3 values as f32) times kss [B, S]: out [B, N, L] f32, P'' optionally
    rounded to e4m3 before P.V (the kernel's running max over s + log scale keeps P'' <= 1)."""
    s = jnp.einsum("bnd,bsd->bns", q, rows * kss[..., None]) * scale
    m = (s + jnp.log(kss)[:, None, :]).max(-1, keepdims=True)
    p = jnp.exp(s - m)
    pp = p * kss[:, None, :]
    if round_p:
        pp = pp.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return jnp.einsum("bns,bsl->bnl", pp, rows[..., :l]) / p.sum(-1, keepdims=True)


def measure(b: int = 4, n: int = 128, ctx: int = 2048, l: int = 512, r: int = 64, seed: int = 1) -> dict:
    """{scale name: {mode: relative error}} (see the module docstring)."""
    q, cache, bt, _, ks = make_inputs(jax.random.key(seed), b, 1, n, ctx, "fp8", page=64, width=l + r)
    rows = cache[bt].reshape(b, ctx, -1).astype(jnp.float32)  # [B, S, D]
    kss = ks[bt].reshape(b, ctx)  # [B, S]
    q = q[:, 0].astype(jnp.float32)  # [B, N, D]
    q1 = fp8_qk_reference_q(q, split=False)
    q2 = fp8_qk_reference_q(q, split=True)
    out = {}
    for name, scale in SCALES.items():
        ref = attention(q, rows, kss, scale, l, False)

        def rel(qx, round_p, ref=ref, scale=scale):
            o = attention(qx, rows, kss, scale, l, round_p)
            return float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))

        out[name] = dict(p_only=rel(q, True), q1=rel(q1, False), q1_p=rel(q1, True), q2_p=rel(q2, True))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    print(json.dumps(measure(args.b, args.n, args.ctx), indent=1))


if __name__ == "__main__":
    main()
