"""Shared benchmark plumbing: ceilings measured in the same run, timing, and the results JSON.

Results format: ../shared/notes/bench-results.md (one JSON object per benchmark file).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def time_fn(
    fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iters: int = 20, reps: int = 7, warmup: int = 3
) -> float:
    """Median microseconds per call of `fn(*args)`.

    Calls run back to back (async dispatch hides host overhead) cycling through `arg_sets`, whose
    total size should exceed L2 (60 MB on H200) so that repeated runs do not measure the cache.
    """
    for i in range(warmup):
        jax.block_until_ready(fn(*arg_sets[i % len(arg_sets)]))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = None
        for i in range(iters):
            out = fn(*arg_sets[i % len(arg_sets)])
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(samples)


# Tiny DeepSeek-V2-Lite-like dims for the benchmarks' --smoke runs on a CPU (num_key_value_heads = the heads).
SMOKE_DIMS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
)


def int_list(s: str) -> tuple[int, ...]:
    """A comma-separated argument ("1,8,32") as ints; empty items dropped ("" -> ())."""
    return tuple(int(x) for x in s.split(",") if x.strip())


def float_list(s: str) -> tuple[float, ...]:
    """A comma-separated argument as floats ("inf" allowed)."""
    return tuple(float(x) for x in s.split(",") if x.strip())


def add_common_args(
    ap: argparse.ArgumentParser, *, out_default: str | None, out_help: str, budget_min: float | None = None
) -> None:
    """The arguments every step benchmark shares: --out, --smoke, --layers, --backend, --gmm (and, with
    `budget_min`, --budget-min). `resolve_impls` fills in the engine's defaults for --backend / --gmm."""
    ap.add_argument("--out", default=out_default, help=out_help)
    ap.add_argument("--smoke", action="store_true", help="tiny dims and sizes: checks the script on a CPU")
    ap.add_argument("--layers", type=int, default=27, help="decoder layers of the V2-Lite-shaped model")
    ap.add_argument("--backend", default=None, help="attention backend (default: the engine's for this device)")
    ap.add_argument(
        "--gmm",
        choices=("ragged_dot", "pallas"),
        default=None,
        help="MoE expert matmul (default: the engine's for this device: pallas on GPU)",
    )
    if budget_min is not None:
        ap.add_argument("--budget-min", type=float, default=budget_min, help="start no new row after this many minutes")


def resolve_impls(args: argparse.Namespace) -> argparse.Namespace:
    """--backend / --gmm left unset -> the engine's defaults for this device."""
    from mla_jax import attention
    from mla_jax.engine import default_gmm_impl

    args.backend = args.backend or attention.default_backend_name()
    args.gmm = args.gmm or default_gmm_impl()
    return args


def v2_lite_config(layers: int, *, smoke: bool = False, **overrides: Any):
    """The DeepSeek-V2-Lite shape with `layers` decoder layers (`SMOKE_DIMS` with `smoke`), then `overrides`."""
    from mla_jax.config import DEEPSEEK_V2_LITE, DeepseekConfig

    d = {**DEEPSEEK_V2_LITE, "num_hidden_layers": layers} | (SMOKE_DIMS if smoke else {}) | overrides
    if "num_key_value_heads" in d:  # must equal the heads for MLA
        d["num_key_value_heads"] = d["num_attention_heads"]
    return DeepseekConfig.from_dict(d)


def v3_slice_config(layers: int, *, smoke: bool = False):
    """DeepSeek-V3's shape (128 heads, q LoRA, all 256 routed experts with group-limited routing) cut to `layers`
    decoder layers, the first dense and the rest MoE (V3 has 3 dense of 61): what one GPU holds (issue #25's V3
    slice: 22.5 GB of bf16 experts a MoE layer, half in fp8). `smoke`: tiny dims with the same structure."""
    from mla_jax.config import DEEPSEEK_V3, DeepseekConfig

    d = {**DEEPSEEK_V3, "num_hidden_layers": layers, "first_k_dense_replace": min(1, layers)}
    if smoke:
        d |= SMOKE_DIMS | dict(q_lora_rank=32, n_routed_experts=16, n_group=4, topk_group=2)
        d["num_key_value_heads"] = d["num_attention_heads"]
    return DeepseekConfig.from_dict(d)


# The V3 slice's 2 layers (1 dense, 1 MoE) keep `--weights bf16,fp8` well inside
# one H200: 29 GB of bf16 weights, and quantizing them to fp8 peaks near 60 GB (a stacked expert leaf's f32 copy).
BENCH_MODELS = {  # name -> (config, default layers, what the results call it)
    "v2-lite": (v2_lite_config, 27, "DeepSeek-V2-Lite"),
    "v3-slice": (v3_slice_config, 2, "DeepSeek-V3 (slice)"),
}


def bench_token_ids(n: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """n distinct-looking input ids (seeded, never 0): what the benchmarks' decode rows feed, one per query token.
    The same id in every request makes the requests' hidden states alike, so they route to the same experts and the
    step reads a fraction of the expert bytes the roofline counts (scripts/routing_diversity.py)."""
    return np.random.default_rng(seed).integers(1, vocab_size, n).astype(np.int32)


def decode_requests(
    batch: int, ctx: int, pages_per_req: int, vocab_size: int, *, q: int = 1, ids: Sequence[int] | None = None
):
    """The benchmarks' decode step: `batch` requests with ctx - 1 cached tokens and q new tokens each (`ids`,
    default `bench_token_ids`), request b on its own pages [1 + b * pages_per_req, 1 + (b + 1) * pages_per_req)."""
    from mla_jax.metadata import ScheduledRequest

    ids = [int(t) for t in (bench_token_ids(batch * q, vocab_size) if ids is None else ids)]
    P = pages_per_req
    return [
        ScheduledRequest(ids[b * q : (b + 1) * q], ctx - 1, list(range(1 + b * P, 1 + (b + 1) * P)))
        for b in range(batch)
    ]


def bench_ceilings(smoke: bool) -> dict[str, Any]:
    """`measure_ceilings` for a real run; a marked placeholder in --smoke (a CPU's figures mean nothing)."""
    if smoke:  # the real ceilings' 2 GiB copies and 8192^3 matmuls take minutes on a CPU
        return {"copy_TBps": 0.01, "matmul_TFLOPs": 0.1, "smoke": True, "note": "not measured in --smoke"}
    return measure_ceilings()


def time_step(
    step: Callable[[Any], tuple[Any, Any]], cache: Any, *, steps: int, reps: int, warmup: int = 3
) -> tuple[float, float, Any]:
    """(median seconds per call, seconds of the first call (compile + run), cache) of `step(cache) -> (out,
    cache)`, the donated cache threaded through; `reps` samples of `steps` back-to-back calls after `warmup`."""
    t0 = time.perf_counter()
    out, cache = step(cache)
    jax.block_until_ready(out)
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        out, cache = step(cache)
    jax.block_until_ready(out)
    samples = []
    for _ in range(reps):
        t1 = time.perf_counter()
        for _ in range(steps):
            out, cache = step(cache)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t1) / steps)
    return statistics.median(samples), first_s, cache


def measure_ceilings(*, small: bool = False) -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured now on this device. `small`
    (smoke runs on a CPU): a 32 MB copy and a 1024^3 matmul, so the figures mean nothing but cost nothing."""
    out: dict[str, float] = {}
    n, m = (1 << 24, 1024) if small else (1 << 30, 8192)
    try:  # torch's copy_ reaches the HBM ceiling; XLA's elementwise kernels do not.
        import torch

        if torch.cuda.is_available() and not small:
            x = torch.randn(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
            y = torch.empty_like(x)
            a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
            b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
            for _ in range(3):
                y.copy_(x)
                a @ b
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            ev[0].record()
            for _ in range(10):
                y.copy_(x)
            ev[1].record()
            for _ in range(10):
                a @ b
            ev[2].record()
            torch.cuda.synchronize()
            out["copy_TBps_torch"] = 2 * x.numel() * 2 * 10 / (ev[0].elapsed_time(ev[1]) * 1e-3) / 1e12
            out["matmul_TFLOPs_torch"] = 2 * 8192**3 * 10 / (ev[1].elapsed_time(ev[2]) * 1e-3) / 1e12
            del x, y, a, b
            torch.cuda.empty_cache()
    except ImportError:
        pass
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda v: v + jnp.bfloat16(1))
    us = time_fn(copy, [(x,)], iters=10, reps=5)
    out["copy_TBps_xla"] = 2 * n * 2 / (us * 1e-6) / 1e12
    del x
    k = jax.random.split(jax.random.key(1), 2)
    a = jax.random.normal(k[0], (m, m), jnp.bfloat16)
    b = jax.random.normal(k[1], (m, m), jnp.bfloat16)
    us = time_fn(jax.jit(jnp.dot), [(a, b)], iters=10, reps=5)
    out["matmul_TFLOPs_xla"] = 2 * m**3 / (us * 1e-6) / 1e12
    out["copy_TBps"] = max(out.get("copy_TBps_torch", 0.0), out["copy_TBps_xla"])
    out["matmul_TFLOPs"] = max(out.get("matmul_TFLOPs_torch", 0.0), out["matmul_TFLOPs_xla"])
    # 3 decimals, but 3 significant digits below 1: a loaded CPU's smoke copy (< 0.5 GB/s) must not round to 0
    return {k: round(v, 3) if v >= 1 else float(f"{v:.3g}") for k, v in out.items()}


def git_commit() -> str:
    if os.environ.get("MLA_JAX_COMMIT"):  # the GPU machine's copy of the tree may carry a stale .git
        return os.environ["MLA_JAX_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def results_header(ceilings: dict[str, float]) -> dict[str, Any]:
    """A results file's header: GPU, date, JAX version, commit, the ceilings measured in the same run and, when set,
    the XLA_FLAGS the run compiled with (they change what a row measures)."""
    flags = os.environ.get("XLA_FLAGS", "").strip()
    return {
        "gpu": jax.devices()[0].device_kind,
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "commit": git_commit(),
        "ceilings": ceilings,
        **({"xla_flags": flags} if flags else {}),
        "rows": [],
    }


def write_results(path: str, results: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


def profile_summary(trace_dir: str, *, top: int = 40) -> dict[str, Any]:
    """Device-side time of a `jax.profiler.trace` directory: per device line (stream / XLA ops), the total busy
    time, the event count and the `top` events by summed duration. Busy time against the traced wall time shows
    launch gaps; the top events show which fusions and kernels a step spends its time in."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return {"error": f"no .xplane.pb under {trace_dir}"}
    out: dict[str, Any] = {"xplane": paths[-1], "lines": []}
    for plane in ProfileData.from_file(paths[-1]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            agg: collections.Counter = collections.Counter()
            cnt: collections.Counter = collections.Counter()
            lo, hi = float("inf"), 0.0
            for ev in line.events:
                agg[ev.name] += ev.duration_ns
                cnt[ev.name] += 1
                lo, hi = min(lo, ev.start_ns), max(hi, ev.start_ns + ev.duration_ns)
            if not agg:
                continue
            out["lines"].append(
                {
                    "plane": plane.name,
                    "line": line.name,
                    "events": sum(cnt.values()),
                    "busy_ms": round(sum(agg.values()) / 1e6, 3),
                    "span_ms": round((hi - lo) / 1e6, 3),
                    "top": [
                        {"name": n[:160], "ms": round(t / 1e6, 3), "count": cnt[n]} for n, t in agg.most_common(top)
                    ],
                }
            )
    return out


def device_time_us(fn: Callable[..., Any], arg_sets: Sequence[tuple], *, iters: int = 20) -> dict[str, Any]:
    """Per call, from a profiler trace of `iters` back-to-back calls: `device_us`, the time the GPU's streams
    were busy (union of their kernel intervals), and `span_us`, first kernel start to last kernel end. Where
    `time_fn`'s wall time is well above `device_us`, the host (dispatch) limits the call, not the kernels.
    Returns {"error": ...} where the trace has no device stream (CPU) or cannot be read."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*arg_sets[0]))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            out = None
            for i in range(iters):
                out = fn(*arg_sets[i % len(arg_sets)])
            jax.block_until_ready(out)
        paths = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not paths:
            return {"error": "no trace written"}
        spans = []
        per_kernel: collections.Counter = collections.Counter()
        for plane in ProfileData.from_file(paths[0]).planes:
            if not plane.name.startswith("/device:"):
                continue
            for line in plane.lines:  # kernels sit on the "Stream #..." lines; the others are summaries
                if line.name.startswith("Stream"):
                    for ev in line.events:
                        spans.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                        per_kernel[ev.name[:80]] += ev.duration_ns
    if not spans:
        return {"error": "no device stream events in the trace"}
    spans.sort()
    busy, end = 0.0, -float("inf")
    for a, b in spans:  # union of intervals (streams may overlap)
        if b > end:
            busy += b - max(a, end)
            end = b
    return {
        "device_us": round(busy / iters / 1e3, 2),
        "span_us": round((spans[-1][1] - spans[0][0]) / iters / 1e3, 2),
        "kernels_per_call": len(spans) / iters,
        # where the device time goes: the 6 largest kernels, us per call
        "kernels_us": {k: round(t / iters / 1e3, 2) for k, t in per_kernel.most_common(6)},
    }


# Layer parts of a step, from the `jax.named_scope`s the step code opens (first match in the op's name wins).
STEP_PARTS = (
    "sample",
    "lm_head",
    "mla_project",
    "cache_write",
    "absorb_q",
    "prefill_attention",
    "attention",
    "v_up_proj",
    "o_proj",
    "moe_router",
    "moe_routed",
    "moe_shared",
    "mlp",
    "norm",
)


def hlo_op_parts(hlo_text: str) -> dict[str, str]:
    """Optimized HLO text (`compiled.as_text()`) -> {kernel name: step part} from each instruction's metadata
    op_name (the named scopes), for the parts in STEP_PARTS. XLA names a fusion's kernel after the instruction
    with "." and "-" as "_"; a Pallas call's kernel is named after the kernel (the scope above "pallas_call", or
    "mpmd_map" for a Mosaic GPU kernel)."""
    import re

    parts = {}
    pat = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]*)"')
    for line in hlo_text.splitlines():
        m = pat.match(line)
        if not m:
            continue
        scopes = m.group(2).split("/")
        part = next((p for p in STEP_PARTS if p in scopes), "other")
        parts[re.sub(r"[.\-]", "_", m.group(1))] = part
        if scopes[-1] in ("pallas_call", "mpmd_map") and len(scopes) > 1:  # Triton / Mosaic GPU kernels
            parts[re.sub(r"\W", "_", scopes[-2])] = part
    return parts


def res_meta(res: dict[str, Any]) -> dict[str, Any]:
    """A results dict's header without its rows (for the profile files beside it)."""
    return {k: v for k, v in res.items() if k != "rows"}


def profile_steps(step: Callable, cache: Any, lower: Callable, trace_dir: str, *, steps: int = 5):
    """Traces `steps` calls of step(cache) -> (out, cache) into `trace_dir` and returns (`kernel_breakdown` of
    them, the cache); `lower(cache)` is the step's lowering (its compiled HLO maps kernels to step parts, and is
    written beside the trace as step.hlo.txt)."""
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            out, cache = step(cache)
        jax.block_until_ready(out)
    hlo = lower(cache).compile().as_text()  # the compiled step (a cache hit)
    with open(os.path.join(trace_dir, "step.hlo.txt"), "w") as f:
        f.write(hlo)
    breakdown = kernel_breakdown(trace_dir, hlo, steps)
    print({k: breakdown.get(k) for k in ("kernels_per_step", "busy_us_per_step", "parts")}, flush=True)
    return breakdown, cache


def kernel_part(op_part: dict[str, str], name: str, op: str) -> str:
    """The step part of a traced kernel `name` launched by HLO op `op` (`hlo_op_parts`): a Pallas kernel launched
    from two places is named "<name>__1" in the second (e.g. in the layer loop), a Mosaic GPU one
    "<name>_mosaic_gpu_kernel"; either maps by its base name."""
    base = re.sub(r"(_mosaic_gpu_kernel)?(__\d+)?$", "", name)
    return op_part.get(name, op_part.get(base, op_part.get(op, "other")))


def kernel_breakdown(trace_dir: str, hlo_text: str, steps: int) -> dict[str, Any]:
    """Every GPU kernel of a traced run of `steps` identical steps: kernels per step, device-busy µs per
    step, µs and kernel count per step part (`STEP_PARTS`, via the HLO op that launched each kernel) and the
    per-kernel list (name, HLO op, part, count and µs per step), largest first."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return {"error": f"no .xplane.pb under {trace_dir}"}
    op_part = hlo_op_parts(hlo_text)
    gpu, host = [], []  # (name, hlo_op, ns): kernels on the GPU's streams; XLA's thunks of the step on a CPU
    for plane in ProfileData.from_file(paths[-1]).planes:  # planes, lines, events: one-pass iterables
        on_gpu = plane.name.startswith("/device:")
        for line in plane.lines:
            if on_gpu and not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                item = (ev.name[:120], str(stats.get("hlo_op", ev.name)), ev.duration_ns)
                if on_gpu:
                    gpu.append(item)
                elif any(m in str(stats.get("hlo_module", "")) for m in ("engine_step", "spec_step")):
                    host.append(item)
    events = gpu or host
    per: dict[tuple[str, str], list[float]] = {}
    for name, op, ns in events:
        acc = per.setdefault((name, op), [0, 0.0])
        acc[0] += 1
        acc[1] += ns
    n_events = len(events)
    kernels = []
    parts: dict[str, list[float]] = {}
    for (name, op), (cnt, ns) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        part = kernel_part(op_part, name, op)
        kernels.append(
            dict(name=name, hlo_op=op, part=part, per_step=round(cnt / steps, 2), us=round(ns / steps / 1e3, 2))
        )
        acc = parts.setdefault(part, [0.0, 0.0])
        acc[0] += cnt / steps
        acc[1] += ns / steps / 1e3
    return {
        "kernels_per_step": round(n_events / steps, 1),
        "busy_us_per_step": round(sum(k["us"] for k in kernels), 1),
        "parts": {
            p: dict(kernels=round(c, 1), us=round(u, 1)) for p, (c, u) in sorted(parts.items(), key=lambda x: -x[1][1])
        },
        "kernels": kernels,
    }
