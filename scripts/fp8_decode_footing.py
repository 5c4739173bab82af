"""The fp8 decode modes' error against float32 on the decode benchmark's inputs, emulated densely (CPU).

Run (CPU, ~1 min): .venv/bin/python scripts/fp8_decode_footing.py [--b 4 --n 128 --ctx 2048] [--demo]

`bench/decode.py`'s inputs (q ~ N(0, 1) in bf16, an fp8 cache with one f32 scale a token) over one request's pages
in order, at two softmax scales: DeepSeek-V3's with YaRN (`testing.DECODE_SCALE`, the benchmark's) and 1/sqrt(192)
(the scale FlashMLA's fp8 error, 1.5-1.8%, was measured at on the H200 in 2026-12-01). Each mode's output
against the float32 attention over the dequantized cache with the exact q, ||out - ref|| / ||ref||:
- `p_only`: P rounded to e4m3 (P'' = p * token scale, as the fp8 P.V kernel stores it), q exact;
- `q1`: q as one e4m3 term a row (`fp8_q_split=False`), P exact; `q1_p`: both;
- `q2_p`: q as two e4m3 terms (q_hi and its residual, `fp8_q_split=True`) and P rounded.
And the footing (benchmark inputs only): `q1_p_own_q`, the default's error against the reference on the q it
multiplies; `flashmla` / `flashmla_own_q`, FlashMLA's fp8 kernel emulated (q in e4m3 at one scale a request, amax /
448; p in [0, 1] rounded to e4m3, its cache scale applied after) against the exact q and against its own q. Its own
test's 1.5-1.8% is the second (the first is ~3x that, as `q1_p` is): the footing of issue 20's 2%.
The wgmma's reduced-precision fp8 accumulation is not emulated (the GPU rows' rel_err have it).

--demo: the same modes on the demo model's real activations (mla_jax/data/demo, as scripts/fp8_cache_formats.py
reads them): each layer's absorbed queries and `[kv_c_normed | k_pe]` rows of 8 windows of 256 tokens of this
repository's sources, the rows in the cache's "per_token" fp8 format, every query over its causal context at the
model's own softmax scale; the error per layer. Then the validation loss with each mode in every layer's attention
(`demo_loss`: the full forward over 8 windows of text the demo never saw, each layer's rows fake-quantized to
"per_token" and its attention run as the mode runs it, errors propagating into the next layer): the mean token NLL
change against float32 rows and exact attention, its standard error over the windows, and the mean KL.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.decode import make_inputs  # noqa: E402
from pallas_kernels.mla_decode_sm90 import fp8_qk_reference_q  # noqa: E402
from pallas_kernels.testing import DECODE_SCALE  # noqa: E402

SCALES = {"v3_yarn": DECODE_SCALE, "inv_sqrt_192": 192**-0.5}


def attention(q, rows, kss, scale: float, l: int, round_p: bool, causal: bool = False, p_scaled: bool = True):
    """q [B, N, D] f32 over rows [B, S, D] (e4m3 values as f32) times kss [B, S]: out [B, N, L] f32, P'' optionally
    rounded to e4m3 before P.V (the kernel's running max over s + log scale keeps P'' <= 1; p_scaled=False: p <= 1
    rounded, then times the scale, as FlashMLA's per-tensor cache scale comes after). causal: q [B, S, N, D], query t
    over rows [0, t]; out [B, S, N, L]."""
    if causal:
        mask = jnp.tril(jnp.ones((q.shape[1], rows.shape[1]), bool))[None, :, None]  # [1, S, 1, S]
        s = jnp.einsum("btnd,bsd->btns", q, rows * kss[..., None]) * scale
        kb = kss[:, None, None, :]
    else:
        mask = True
        s = jnp.einsum("bnd,bsd->bns", q, rows * kss[..., None]) * scale
        kb = kss[:, None, :]
    m = jnp.where(mask, s + jnp.log(kb) if p_scaled else s, -jnp.inf).max(-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    e4m3 = lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32)  # noqa: E731
    pp = p * kb
    if round_p:
        pp = e4m3(pp) if p_scaled else e4m3(p) * kb
    eq = "btns,bsl->btnl" if causal else "bns,bsl->bnl"
    return jnp.einsum(eq, pp, rows[..., :l]) / p.sum(-1, keepdims=True)


def modes(q, rows, kss, scale: float, l: int, causal: bool = False, footing: bool = False) -> dict:
    """{mode: ||out - ref|| / ||ref||} (module docstring) for one set of inputs; footing: the footing entries too
    (q1_p_own_q, flashmla, flashmla_own_q; not causal)."""

    def attend(qx, round_p, **kw):
        return attention(qx, rows, kss, scale, l, round_p, causal, **kw)

    def rel(o, ref):
        return float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))

    ref = attend(q, False)
    q1, q2 = (fp8_qk_reference_q(q, split=split) for split in (False, True))
    o_q1p = attend(q1, True)
    out = dict(p_only=rel(attend(q, True), ref), q1=rel(attend(q1, False), ref), q1_p=rel(o_q1p, ref))
    out["q2_p"] = rel(attend(q2, True), ref)
    if footing:
        sq = jnp.abs(q).max(axis=(1, 2), keepdims=True) / 448.0  # one scale a request
        q_fm = (q / sq).astype(jnp.float8_e4m3fn).astype(jnp.float32) * sq
        o_fm = attend(q_fm, True, p_scaled=False)
        out.update(
            q1_p_own_q=rel(o_q1p, attend(q1, False)),
            flashmla=rel(o_fm, ref),
            flashmla_own_q=rel(o_fm, attend(q_fm, False)),
        )
    return out


def measure(b: int = 4, n: int = 128, ctx: int = 2048, l: int = 512, r: int = 64, seed: int = 1) -> dict:
    """{scale name: {mode: relative error}} (see the module docstring)."""
    q, cache, bt, _, ks = make_inputs(jax.random.key(seed), b, 1, n, ctx, "fp8", page=64, width=l + r)
    rows = cache[bt].reshape(b, ctx, -1).astype(jnp.float32)  # [B, S, D]
    kss = ks[bt].reshape(b, ctx)  # [B, S]
    q = q[:, 0].astype(jnp.float32)  # [B, N, D]
    return {name: modes(q, rows, kss, scale, l, footing=True) for name, scale in SCALES.items()}


def measure_demo(num_windows: int = 8, seq_len: int = 256) -> dict:
    """{mode: [error per layer]} on the demo model's activations (module docstring)."""
    from mla_jax.cache import quantize_cache_rows

    fcf = _load_fp8_cache_formats()
    cfg, params, tok = fcf.load_demo()
    ids = jnp.asarray(fcf.windows(tok, fcf.ROW_FILES, num_windows, seq_len))
    group = cfg.kv_lora_rank // 4  # fp8_cache_formats.run's (only the f32 rows, format 0, are read here)
    _, qs, rs = fcf.forward_fake_quant(params, cfg, ids, 0, group)  # [layers, B, S, N, D], [layers, B, S, D]
    out: dict[str, list[float]] = {}
    for layer in range(qs.shape[0]):
        packed = quantize_cache_rows(rs[layer], "per_token", kv_lora_rank=cfg.kv_lora_rank)
        rows, kss = packed.values.astype(jnp.float32), packed.scales[..., 0]
        errs = modes(qs[layer].astype(jnp.float32), rows, kss, cfg.softmax_scale, cfg.kv_lora_rank, causal=True)
        for k, v in errs.items():
            out.setdefault(k, []).append(v)
    return out


def _load_fp8_cache_formats():
    """scripts/fp8_cache_formats.py, imported once a process (as the tests' `load_script` names it)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module("fp8_cache_formats")


# each with the rows in the "per_token" fp8 format; "rows": the format's rounding alone (exact q and P)
LOSS_MODES = ("rows", "p_only", "q1_p", "q2_p")


@functools.partial(jax.jit, static_argnames=("cfg", "mode"))
def forward_mode(params, cfg, input_ids, mode: str):
    """Logits f32[B, S, vocab] of the full causal forward of input_ids i32[B, S] with every layer's absorbed
    attention run as decode mode `mode` runs it (`LOSS_MODES`; "f32": float32 rows, exact q and P)."""
    from mla_jax.cache import quantize_cache_rows

    L = cfg.kv_lora_rank

    def attend(q_mqa, rows):  # one sequence: q [S, N, D], rows f32[S, D]
        q_mqa = q_mqa.astype(jnp.float32)
        if mode == "f32":
            kss, round_p = jnp.ones(rows.shape[:1], jnp.float32), False
        else:
            packed = quantize_cache_rows(rows, "per_token", kv_lora_rank=L)
            rows, kss, round_p = packed.values.astype(jnp.float32), packed.scales[..., 0], mode != "rows"
            if mode not in ("rows", "p_only"):
                q_mqa = fp8_qk_reference_q(q_mqa, split=mode == "q2_p")
        return attention(q_mqa[None], rows[None], kss[None], cfg.softmax_scale, L, round_p, causal=True)[0]

    return _load_fp8_cache_formats().forward_absorbed(params, cfg, input_ids, attend)[0]


def demo_loss(num_windows: int = 8, seq_len: int = 256) -> dict:
    """{"val_loss_f32": mean token NLL, mode: {"val_loss_delta", "val_loss_delta_se", "val_kl"}} on the demo model
    over text it never saw (module docstring)."""
    fcf = _load_fp8_cache_formats()
    cfg, params, tok = fcf.load_demo()
    ids = jnp.asarray(fcf.windows(tok, fcf.VAL_FILES, num_windows, seq_len))
    ref_logits = forward_mode(params, cfg, ids, "f32")
    ref_nll = fcf.token_nll(ref_logits, ids)  # [B, S-1]
    out: dict = {"val_loss_f32": float(ref_nll.mean()), "val_tokens": int(ids.size)}
    for mode in LOSS_MODES:
        logits = forward_mode(params, cfg, ids, mode)
        delta = (fcf.token_nll(logits, ids) - ref_nll).mean(-1)  # [B]: each window's paired loss change
        out[mode] = {
            "val_loss_delta": float(delta.mean()),
            "val_loss_delta_se": float(delta.std(ddof=1) / np.sqrt(len(delta))),
            "val_kl": float(fcf.token_kl(ref_logits, logits).mean()),
        }
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--demo", action="store_true", help="the demo model's activations instead (per layer)")
    args = ap.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", "highest")
    res = {"attn_out_err": measure_demo(), "loss": demo_loss()} if args.demo else measure(args.b, args.n, args.ctx)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
