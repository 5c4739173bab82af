"""Accuracy of the fp8 latent-cache row formats (`mla_jax.cache.FP8_ROW_FORMATS`) on the demo model's real rows.

Run (CPU, ~30 s): .venv/bin/python scripts/fp8_cache_formats.py [--out results.json] [--group 16] [--paged-check]

What it measures, on the shipped demo model (mla_jax/data/demo: L=64, R=16, 4 layers, trained on Python code)
over text it never saw (this repository's own sources, tokenized with the demo's tokenizer):

1. rows: each layer's ``[kv_c_normed | k_pe]`` rows for real text, quantized -> dequantized in each format;
   per token and per channel group (the latent in ``group``-wide groups, the rope as one group) the relative
   error ||deq - x|| / ||x||.
2. attention output: per layer, the absorbed MQA (`mla_jax.reference.causal_mqa`, float32) of the layer's own
   absorbed queries over the dequantized rows against the same over the float32 rows: ||out - ref|| / ||ref||
   over the latent output [S, N, L] (what the decode kernels return). Each layer on its exact inputs, so the
   error is the format's alone. Beside it, the same with the lossy decode mode ``fp8_qk``'s query: q rounded to
   e4m3 with one f32 scale per row (token, head; `pallas_kernels.mla_decode_sm90_narrow.quantize_q_fp8`) before
   QK^T, P and V exact; and the error of the LSE (logsumexp over the causal context of the scaled logits, natural
   log) against the float32 rows with the exact q, max and mean |lse - lse_ref| per layer, with either q. The
   q rounding alone (float32 rows): ``fp8_qk_f32_rows``.
3. validation loss: mean token NLL of the full forward (absorbed attention) with every layer's rows fake-quantized
   (quantize -> dequantize) before the attention reads them, against the float32 rows. Every query then reads
   its whole causal context, itself included, from the quantized rows: what a decode step over the paged cache
   sees (a prefill in vLLM attends over its own chunk unquantized, so this is the pessimistic side), and the
   error of each layer propagates into the next.

``group`` defaults to L / 4, so the demo's latent has 4 scales per row like DeepSeek-V3's 512 / 128; ``--group
128`` is the literal vLLM grouping, which on L=64 is one scale for the whole latent.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import reference
from mla_jax.cache import FP8_ROW_FORMATS, dequantize_cache_rows, fp8_format_row_bytes, quantize_cache_rows
from mla_jax.checkpoint import load_model
from mla_jax.mla import absorb_q, mla_project, o_proj, v_up_proj
from mla_jax.model import decoder_layers, embed, lm_logits
from pallas_kernels.mla_decode_sm90_narrow import quantize_q_fp8

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "mla_jax" / "data" / "demo"
FORMATS = ("f32", "bf16", *FP8_ROW_FORMATS)  # "f32": the reference; "bf16": today's default cache, for scale
# Text the demo never saw (it was trained on the Python stdlib), frozen copies of some of this repo's modules as
# of 2026-12-01 (so that editing them does not move the numbers): the rows come from these files ...
_TEXT = "tests/fixtures/fp8_cache_text"
ROW_FILES = tuple(f"{_TEXT}/{m}.py.txt" for m in ("cache", "mla"))
# ... the validation loss from these.
VAL_FILES = tuple(f"{_TEXT}/{m}.py.txt" for m in ("allocator", "scheduler", "metadata", "sampling"))


def fake_quant(rows: jax.Array, fmt: str, *, kv_lora_rank: int, group: int) -> jax.Array:
    """rows [..., L+R] f32 -> what an attention reading a ``fmt`` cache (`FORMATS`) sees."""
    if fmt == "f32":
        return rows
    if fmt == "bf16":
        return rows.astype(jnp.bfloat16).astype(jnp.float32)
    packed = quantize_cache_rows(rows, fmt, kv_lora_rank=kv_lora_rank, group=group)
    return dequantize_cache_rows(packed, fmt, kv_lora_rank=kv_lora_rank)


def forward_absorbed(params, cfg, input_ids, attend):
    """Full causal forward of input_ids i32[B, S], as mla_forward_full(algorithm="absorbed") with each layer's
    attention `attend(q_mqa [S, N, L+R], rows f32[S, L+R]) -> latent [S, N, L]` (one sequence; what reads the
    rows decides how they are rounded).

    -> (logits f32[B, S, vocab], absorbed queries f32[layers, B, S, N, L+R], rows f32[layers, B, S, L+R]), the
    queries and rows as each layer computed them (before `attend`)."""
    B, S = input_ids.shape
    L, NL = cfg.kv_lora_rank, cfg.num_hidden_layers
    positions = jnp.arange(S, dtype=jnp.int32)

    def attn_one(p, hs):  # one sequence
        q, kv_c_normed, k_pe = mla_project(p, cfg, hs, positions)
        q_mqa = absorb_q(p, cfg, q)  # [S, N, L+R]
        rows = jnp.concatenate([kv_c_normed, k_pe[:, 0, :].astype(kv_c_normed.dtype)], -1).astype(jnp.float32)
        latent = attend(q_mqa, rows)  # [S, N, L]
        return o_proj(p, v_up_proj(p, latent).astype(hs.dtype)), q_mqa.astype(jnp.float32), rows

    def attention(p, h, state, layer):
        out, q_mqa, rows = jax.vmap(lambda hs: attn_one(p, hs))(h.reshape(B, S, -1))
        qs, rs = state
        return out.reshape(B * S, -1), (qs.at[layer].set(q_mqa), rs.at[layer].set(rows))

    state = (
        jnp.zeros((NL, B, S, cfg.num_attention_heads, L + cfg.qk_rope_head_dim), jnp.float32),
        jnp.zeros((NL, B, S, L + cfg.qk_rope_head_dim), jnp.float32),
    )
    x, (qs, rs) = decoder_layers(params, cfg, embed(params, cfg, input_ids.reshape(-1)), attention, state)
    return lm_logits(params, cfg, x).reshape(B, S, -1), qs, rs


@functools.partial(jax.jit, static_argnames=("cfg", "group"))
def forward_fake_quant(params, cfg, input_ids, fmt_index: jax.Array, group: int):
    """`forward_absorbed` with the attention reading rows fake-quantized in format ``FORMATS[fmt_index]`` (traced:
    one compile for all formats); "f32" is `model.forward(attention="absorbed")`."""
    L = cfg.kv_lora_rank
    quants = [functools.partial(fake_quant, fmt=f, kv_lora_rank=L, group=group) for f in FORMATS]

    def attend(q_mqa, rows):
        return reference.causal_mqa(q_mqa, jax.lax.switch(fmt_index, quants, rows), cfg.softmax_scale, L)

    return forward_absorbed(params, cfg, input_ids, attend)


def round_q_fp8(q: jax.Array) -> jax.Array:
    """q [..., D] -> what the ``fp8_qk`` decode mode's QK^T multiplies: q8 * scale (`quantize_q_fp8`: e4m3, one
    f32 scale per row)."""
    q8, scale = quantize_q_fp8(q)
    return q8.astype(jnp.float32) * scale[..., None]


def causal_mqa_lse(q: jax.Array, kv: jax.Array, scale: float, kv_lora_rank: int) -> tuple[jax.Array, jax.Array]:
    """`reference.causal_mqa` (q [S, N, L+R], rows [S, L+R] -> latent output [S, N, L]) and its LSE [S, N]: the
    natural-log logsumexp of scale * q.k over each query's causal context (what the decode kernels return)."""
    S = q.shape[0]
    logits = jnp.einsum("snd,td->snt", q.astype(jnp.float32), kv.astype(jnp.float32)) * scale
    lse = jax.nn.logsumexp(jnp.where(jnp.tril(jnp.ones((S, S), bool))[:, None], logits, -jnp.inf), axis=-1)
    return reference.causal_mqa(q, kv, scale, kv_lora_rank), lse


def attention_errors(mqa, qs, rs, ref_out, ref_lse, suffix: str = "") -> dict[str, list[float]]:
    """Per layer (leading axis) errors of ``mqa(qs, rs)`` -> (out, lse) against (ref_out, ref_lse):
    {"attn_out_err" + suffix: ||out - ref|| / ||ref||, "lse_err_max"/"lse_err_mean" + suffix: max / mean
    |lse - lse_ref| (nats) over the layer's queries and heads}."""
    o, lse = (np.asarray(a) for a in mqa(qs, rs))
    d = np.abs(lse - ref_lse).reshape(len(lse), -1)
    return {
        "attn_out_err" + suffix: [
            float(np.linalg.norm(o[i] - ref_out[i]) / np.linalg.norm(ref_out[i])) for i in range(len(o))
        ],
        "lse_err_max" + suffix: d.max(-1).tolist(),
        "lse_err_mean" + suffix: d.mean(-1).tolist(),
    }


def windows(tok, files, n: int, seq_len: int) -> np.ndarray:
    """n windows of seq_len tokens, spread evenly over the concatenated token stream of ``files`` -> i32[n, S]."""
    ids = []
    for f in files:
        ids += tok.encode((ROOT / f).read_text()).ids
    ids = np.asarray(ids, np.int32)
    if len(ids) < n * seq_len:
        raise ValueError(f"{files}: {len(ids)} tokens, need {n} x {seq_len}")
    starts = np.linspace(0, len(ids) - seq_len, n).astype(int)
    return np.stack([ids[s : s + seq_len] for s in starts])


def token_nll(logits: jax.Array, ids: jax.Array) -> np.ndarray:
    """-log p(next token) per position -> f32[B, S-1]."""
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    return np.asarray(-jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1)[..., 0])


def token_kl(ref_logits: jax.Array, logits: jax.Array) -> np.ndarray:
    """KL(p_ref || p) of the next-token distributions per position -> f32[B, S]."""
    lp_ref, lp = jax.nn.log_softmax(ref_logits, axis=-1), jax.nn.log_softmax(logits, axis=-1)
    return np.asarray(jnp.sum(jnp.exp(lp_ref) * (lp_ref - lp), axis=-1))


def group_errors(rows: np.ndarray, deq: np.ndarray, L: int, group: int) -> dict[str, np.ndarray]:
    """Relative error per token and channel group: {"latent": [..., L / group], "rope": [...]}."""

    def rel(x, d):
        return np.linalg.norm(d - x, axis=-1) / np.maximum(np.linalg.norm(x, axis=-1), 1e-30)

    lead = rows.shape[:-1]
    g = min(group, L)
    lat = rel(rows[..., :L].reshape(*lead, L // g, g), deq[..., :L].reshape(*lead, L // g, g))
    return {"latent": lat, "rope": rel(rows[..., L:], deq[..., L:])}


def measure(params, cfg, row_ids: np.ndarray, val_ids: np.ndarray, group: int) -> dict:
    """All three measurements (module docstring) -> a JSON-able dict (per-token errors included, as lists)."""
    L, R = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    _, qs, rs = forward_fake_quant(params, cfg, jnp.asarray(row_ids), 0, group)
    qs, rs = np.asarray(qs), np.asarray(rs)  # [layers, B, S, N, L+R], [layers, B, S, L+R]
    mqa = jax.jit(jax.vmap(jax.vmap(lambda q, kv: causal_mqa_lse(q, kv, cfg.softmax_scale, L))))
    ref_out, ref_lse = (np.asarray(a) for a in mqa(qs, rs))  # [layers, B, S, N, L], [layers, B, S, N]
    qs8 = np.asarray(round_q_fp8(jnp.asarray(qs)))  # the fp8_qk mode's q
    val = jnp.asarray(val_ids)
    ref_logits, _, _ = forward_fake_quant(params, cfg, val, 0, group)
    ref_nll = token_nll(ref_logits, val)  # [B, S-1]
    out = {
        "model": str(DEMO.relative_to(ROOT)),
        "dims": {"L": L, "R": R, "layers": cfg.num_hidden_layers, "heads": cfg.num_attention_heads},
        "group": min(group, L),
        "row_tokens": int(row_ids.size),
        "val_tokens": int(val_ids.size),
        "row_files": list(ROW_FILES),
        "val_files": list(VAL_FILES),
        "row_stats": {  # per layer: RMS and max |.| of the latent and of the rope values
            "latent_rms": np.sqrt((rs[..., :L] ** 2).mean((1, 2, 3))).tolist(),
            "rope_rms": np.sqrt((rs[..., L:] ** 2).mean((1, 2, 3))).tolist(),
            "latent_absmax": np.abs(rs[..., :L]).max((1, 2, 3)).tolist(),
            "rope_absmax": np.abs(rs[..., L:]).max((1, 2, 3)).tolist(),
        },
        "val_loss_f32": float(ref_nll.mean()),
        # the q rounding alone: fp8_qk's q over the float32 rows (per layer)
        "fp8_qk_f32_rows": attention_errors(mqa, qs8, rs, ref_out, ref_lse),
        "formats": {},
    }
    for k, fmt in enumerate(FORMATS[1:], start=1):
        deq = np.asarray(fake_quant(jnp.asarray(rs), fmt, kv_lora_rank=L, group=group))
        err = group_errors(rs, deq, L, group)
        exact_q = attention_errors(mqa, qs, deq, ref_out, ref_lse)
        fp8_qk = attention_errors(mqa, qs8, deq, ref_out, ref_lse, "_fp8_qk")
        logits, _, _ = forward_fake_quant(params, cfg, val, k, group)
        delta = (token_nll(logits, val) - ref_nll).mean(-1)  # [B]: the paired loss change of each window
        out["formats"][fmt] = {
            "row_bytes": 2 * (L + R)
            if fmt == "bf16"
            else fp8_format_row_bytes(fmt, kv_lora_rank=L, rope_dim=R, group=group),
            "row_bytes_v3": 1152 if fmt == "bf16" else fp8_format_row_bytes(fmt),
            # per layer: mean / max over tokens of the per-group relative error
            "latent_err_mean": err["latent"].mean((1, 2, 3)).tolist(),
            "latent_err_max": err["latent"].max((1, 2, 3)).tolist(),
            "rope_err_mean": err["rope"].mean((1, 2)).tolist(),
            "rope_err_max": err["rope"].max((1, 2)).tolist(),
            "latent_err": err["latent"].reshape(len(rs), -1).tolist(),  # [layers, tokens * groups]
            "rope_err": err["rope"].reshape(len(rs), -1).tolist(),  # [layers, tokens]
            "attn_out_err": exact_q["attn_out_err"],  # per layer
            "val_loss_delta": float(delta.mean()),
            "val_loss_delta_se": float(delta.std(ddof=1) / np.sqrt(len(delta))),  # standard error over windows
            "val_kl": float(token_kl(ref_logits, logits).mean()),  # mean KL(f32 || format) per token, nats
            # per layer, against the float32 rows with the exact q: the LSE with the exact q, and the output and
            # LSE with fp8_qk's q (rounded to e4m3 per row)
            "lse_err_max": exact_q["lse_err_max"],
            "lse_err_mean": exact_q["lse_err_mean"],
            **fp8_qk,
        }
    return out


def paged_check(params, cfg, ids: np.ndarray, group: int) -> dict[str, float]:
    """The fake quantization against the real cache: ids i32[B, S] decoded token by token through the paged fp8
    cache (`mla_jax.step.jit_step`, teacher-forced, via the tests' `run_schedule`) against `forward_fake_quant`
    with "per_token" rows -> {"fp8": max |logit difference|, "fp8_shift": how far the fp8 rows move the logits
    from the float32 rows' at all}. (The fp32 cache against the plain forward: tests/mla_jax/test_demo_model.py.)"""
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.mla_jax.helpers import run_schedule

    B, S = ids.shape
    steps = [[(b, 1) for b in range(B)]] * S
    got = run_schedule(params, cfg, ids.tolist(), steps, page_size=16, num_pages=B * -(-S // 16) + 1, cache_dtype="fp8")
    paged = np.zeros((B, S, cfg.vocab_size), np.float32)
    for r, pos, lg in got:
        paged[r, pos] = lg
    fq, ref = (
        np.asarray(forward_fake_quant(params, cfg, jnp.asarray(ids), FORMATS.index(f), group)[0])
        for f in ("per_token", "f32")
    )
    return {"fp8": float(np.abs(paged - fq).max()), "fp8_shift": float(np.abs(fq - ref).max())}


def load_demo():
    """The demo model in float32 and its tokenizer: (cfg, params, tokenizer)."""
    from tokenizers import Tokenizer

    cfg, params = load_model(str(DEMO), dtype="fp32")
    return cfg, params, Tokenizer.from_file(str(DEMO / "tokenizer.json"))


def run(group: int | None = None, num_windows: int = 8, seq_len: int = 256, demo=None) -> dict:
    """`measure` on the demo model (``demo``: `load_demo()`'s result, loaded here if None): ``num_windows`` windows
    of ``seq_len`` tokens each for the rows and for the loss (one shape: one compile)."""
    cfg, params, tok = load_demo() if demo is None else demo
    group = cfg.kv_lora_rank // 4 if group is None else group
    row_ids = windows(tok, ROW_FILES, num_windows, seq_len)
    val_ids = windows(tok, VAL_FILES, num_windows, seq_len)
    return measure(params, cfg, row_ids, val_ids, group)


def summary(res: dict) -> str:
    lines = [
        f"demo model L={res['dims']['L']} R={res['dims']['R']}, latent group {res['group']}; "
        f"val loss (f32 rows) {res['val_loss_f32']:.5f} over {res['val_tokens']} tokens",
        f"{'format':<10} {'B/row':>5} {'V3 B':>5} {'latent err':>10} {'rope err':>9} {'attn err per layer':>35} "
        f"{'dloss (se)':>20} {'KL':>8}",
    ]
    for fmt, r in res["formats"].items():
        attn = " ".join(f"{a:.2e}" for a in r["attn_out_err"])
        lines.append(
            f"{fmt:<10} {r['row_bytes']:>5} {r['row_bytes_v3']:>5} {np.mean(r['latent_err_mean']):>10.2e} "
            f"{np.mean(r['rope_err_mean']):>9.2e} {attn:>35} {r['val_loss_delta']:>+10.2e} "
            f"({r['val_loss_delta_se']:.1e}) {r['val_kl']:>8.2e}"
        )
    lines.append(
        "fp8_qk (q in e4m3, one scale per row), per layer: attention-output error with exact q -> fp8_qk q; "
        "LSE error max / mean (nats), exact q -> fp8_qk q"
    )
    rows = [("f32", None, res["fp8_qk_f32_rows"])] + [(f, r, r) for f, r in res["formats"].items()]
    for fmt, exact, qk in rows:
        per_layer = []
        for i in range(len(qk["attn_out_err"])):
            e = exact["attn_out_err"][i] if exact else 0.0
            x = (exact["lse_err_max"][i], exact["lse_err_mean"][i]) if exact else (0.0, 0.0)
            sfx = "" if exact is None else "_fp8_qk"
            per_layer.append(
                f"{e:.2e}->{qk['attn_out_err' + sfx][i]:.2e} "
                f"[{x[0]:.1e}/{x[1]:.1e}->{qk['lse_err_max' + sfx][i]:.1e}/{qk['lse_err_mean' + sfx][i]:.1e}]"
            )
        lines.append(f"{fmt:<10} " + "  ".join(per_layer))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the full results (per-token errors included) as JSON here")
    ap.add_argument("--group", type=int, default=None, help="latent values per scale (default L / 4)")
    ap.add_argument(
        "--paged-check", action="store_true", help="also check the fake quantization against the paged cache"
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    demo = load_demo()
    res = run(args.group, demo=demo)
    print(summary(res))
    if args.paged_check:
        cfg, params, tok = demo
        res["paged_check"] = paged_check(params, cfg, windows(tok, VAL_FILES, 2, 40), res["group"])
        print("max |logit difference|, paged decode vs fake quantization:", res["paged_check"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
