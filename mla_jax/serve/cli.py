"""`mla-jax serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop.

Argument definitions and the run function; `mla_jax.cli` registers them as the `serve` subcommand. Parsing
imports nothing heavy; `run` loads the model, builds the engine, compiles its step shapes, then serves until
SIGTERM or Ctrl-C: uvicorn stops accepting connections, lets open requests finish (up to
--timeout-graceful-shutdown seconds), the engine thread stops, and the process exits 0.
"""

from __future__ import annotations

import argparse
import sys

SERVE_EPILOG = """\
examples:
  mla-jax serve --model mla_jax/data/demo --port 8000
  mla-jax serve --model ~/ckpt/v2-lite --max-model-len 8192 --max-num-seqs 128 --cache-dtype fp8
  mla-jax serve --model ~/ckpt/v3 --tp 8 --page-size 64

  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
       -d '{"model": "mla_jax/data/demo", "prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'

Endpoints: /v1/completions, /v1/chat/completions (both with "stream": true), /v1/models, /health, /metrics.
The model name is --served-model-name (default: --model as given). Sampling defaults come from the checkpoint's
generation_config.json, the chat template from its tokenizer_config.json (or --chat-template). A request without
a seed samples with a random one; choice i of a request with "n" uses seed + i.
"""


def _ints(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {s!r}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    from mla_jax.attention import BACKENDS

    p.epilog = SERVE_EPILOG

    p.add_argument(
        "--model",
        required=True,
        metavar="DIR",
        help="HF checkpoint directory or converted orbax one (with tokenizer.json)",
    )
    p.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients use (default: --model as given)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="jinja chat template (a file, or the template text) instead of tokenizer_config.json's",
    )
    e = p.add_argument_group("engine")
    e.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="weight dtype (default: bf16 on GPU, fp32 on CPU)"
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + completion in tokens (default: the model's max_position_embeddings, at most 4096)",
    )
    e.add_argument("--max-num-seqs", type=int, default=64, help="requests in the running batch (default 64)")
    e.add_argument("--page-size", type=int, default=64, help="tokens per KV cache page (default 64)")
    e.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not read or write the persistent compilation cache (default ~/.cache/mla-jax/jax)",
    )
    e.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV cache pages (default: enough for max-num-seqs requests of max-model-len)",
    )
    e.add_argument(
        "--cache-dtype",
        choices=("bf16", "fp8", "fp32"),
        default=None,
        help="KV cache dtype (default: bf16 on GPU, fp32 on CPU)",
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per engine step, decodes plus prefill chunks (default 2048)",
    )
    e.add_argument("--max-prefills", type=int, default=4, help="prefill requests per step (default 4)")
    e.add_argument(
        "--decode-buckets",
        type=_ints,
        default=None,
        metavar="N,N,...",
        help="decode batch sizes compiled (default 1, 2, 4, ... up to max-num-seqs)",
    )
    e.add_argument(
        "--prefill-buckets",
        type=_ints,
        default=None,
        metavar="N,N,...",
        help="prefill token counts compiled (default 16, 32, ... up to max-num-batched-tokens)",
    )
    e.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default=None,
        help="attention backend (default: pallas_sm90 on Hopper, pallas on other GPUs, xla on CPU)",
    )
    e.add_argument(
        "--gmm-impl",
        choices=("ragged_dot", "pallas"),
        default=None,
        help="MoE expert matmul (default: pallas on GPU, ragged_dot on CPU)",
    )
    e.add_argument(
        "--batch-invariant", action="store_true", help="decode with one KV split: outputs independent of the batch"
    )
    e.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse cached KV pages of shared prompt prefixes (default on)",
    )
    e.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (mesh axis)")
    e.add_argument("--dcp", type=int, default=1, help="decode-context-parallel devices (mesh axis)")
    e.add_argument("--ep", type=int, default=1, help="expert-parallel devices (mesh axis)")
    e.add_argument(
        "--dp", type=int, default=1, help="data-parallel attention ranks (mesh axis; experts over all devices)"
    )
    e.add_argument(
        "--warmup",
        choices=("none", "basic", "full"),
        default="basic",
        help="compile before serving: basic (default) every decode bucket and the largest prefill "
        "bucket (with and without top-k/top-p when generation_config.json's defaults filter); full every step "
        "shape and sampling variant (nothing compiles while serving); none",
    )
    e.add_argument(
        "--warmup-logprobs", action="store_true", help="also compile the top-logprobs variants of the warm-up shapes"
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=5.0,
        metavar="S",
        help="on SIGTERM, seconds open requests get to finish (default 5)",
    )
    s.add_argument(
        "--uvicorn-log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace")
    )
    s.add_argument("--no-access-log", action="store_true", help="do not log each HTTP request")


def warmup_args(mode: str, logprobs: bool, defaults) -> dict | None:
    """`Engine.warmup`'s keyword arguments for `--warmup MODE` (None for "none"): every decode and prefill shape;
    the top-logprobs variants with `--warmup-logprobs`; the top-k/top-p variants when the checkpoint's sampling
    defaults (`GenerationDefaults`) filter, as most requests then will; "full": every variant of every shape."""
    if mode == "none":
        return None
    full = mode == "full"
    filtered = full or (defaults.temperature > 0 and (defaults.top_p < 1 or defaults.top_k > 0))
    return dict(prefill=True, top_logprobs=logprobs or full, all_shapes=full, filtered=filtered)


def _log(msg: str) -> None:
    print(f"mla-jax serve: {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import os
    import signal
    import time

    def usage(msg: str) -> int:
        print(f"mla-jax serve: error: {msg}", file=sys.stderr)
        return 2

    for name in ("max_num_seqs", "page_size", "max_num_batched_tokens", "max_prefills", "tp", "dcp", "ep", "dp"):
        if getattr(args, name) < 1:
            return usage(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.port < 65536:
        return usage(f"--port must be in [1, 65535], got {args.port}")
    from mla_jax.serve.chat import read_template_arg
    from mla_jax.serve.tokenizer import GenerationDefaults, ServeTokenizer

    template = read_template_arg(args.chat_template) if args.chat_template else None
    tok = ServeTokenizer(args.model, chat_template=template)  # before the model: fail fast without a tokenizer

    import jax
    import jax.numpy as jnp

    from mla_jax.checkpoint import load_model
    from mla_jax.dtypes import as_dtype
    from mla_jax.engine import Engine, EngineConfig

    on_cpu = jax.default_backend() == "cpu"
    plan = None
    if args.tp * args.dcp * args.ep * args.dp > 1:
        from mla_jax.parallel import ParallelPlan, make_mesh

        try:
            plan = ParallelPlan(make_mesh(tp=args.tp, dcp=args.dcp, ep=args.ep, dp=args.dp))
        except ValueError as e:
            return usage(str(e))
    t0 = time.perf_counter()
    cfg, params = load_model(
        args.model,
        dtype=jnp.dtype(as_dtype(args.dtype or ("fp32" if on_cpu else "bf16"))),
        mesh=plan.mesh if plan is not None else None,
    )
    _log(
        f"loaded {args.model} in {time.perf_counter() - t0:.1f} s ({cfg.num_hidden_layers} layers, "
        f"vocab {cfg.vocab_size}) on {jax.default_backend()}"
    )
    limit = cfg.max_position_embeddings
    max_len = args.max_model_len or min(limit, 4096)
    if max_len > limit:
        return usage(f"--max-model-len {max_len} exceeds the model's max_position_embeddings {limit}")
    try:
        config = EngineConfig(
            max_model_len=max_len,
            max_num_seqs=args.max_num_seqs,
            page_size=args.page_size,
            num_pages=args.num_pages,
            cache_dtype=args.cache_dtype or ("fp32" if on_cpu else "bf16"),
            token_budget=args.max_num_batched_tokens,
            max_prefills=args.max_prefills,
            decode_buckets=args.decode_buckets,
            prefill_buckets=args.prefill_buckets,
            backend=args.backend,
            batch_invariant=args.batch_invariant,
            gmm_impl=args.gmm_impl,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        engine = Engine(params, cfg, config, plan=plan)
    except ValueError as e:
        return usage(str(e))
    c = engine.config
    _log(
        f"engine: max_model_len {c.max_model_len}, max_num_seqs {c.max_num_seqs}, {c.num_pages} pages "
        f"{'per DP rank ' if engine.dp > 1 else ''}of "
        f"{c.page_size}, cache {c.cache_dtype}, backend {c.backend}, prefix caching "
        f"{'on' if c.enable_prefix_caching else 'off'}{', mesh ' + plan.describe() if plan else ''}"
    )
    defaults = GenerationDefaults.from_dir(args.model)
    if (kw := warmup_args(args.warmup, args.warmup_logprobs, defaults)) is not None:
        s = engine.warmup(**kw)
        _log(f"compiled the step shapes ({args.warmup}) in {s:.1f} s")

    import uvicorn

    from mla_jax.serve.app import build_app
    from mla_jax.serve.engine_loop import AsyncEngine
    from mla_jax.serve.metrics import ServeMetrics
    from mla_jax.serve.serving import OpenAIServing

    name = args.served_model_name or args.model
    async_engine = AsyncEngine(engine)
    metrics = ServeMetrics(async_engine, name)
    serving = OpenAIServing(
        async_engine,
        tok,
        model_name=name,
        max_model_len=c.max_model_len,
        defaults=defaults,
        metrics=metrics,
        root=os.path.abspath(args.model),
    )
    app = build_app(serving, metrics)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            access_log=not args.no_access_log,
            timeout_graceful_shutdown=args.timeout_graceful_shutdown,
        )
    )
    # uvicorn handles SIGTERM / SIGINT itself (graceful shutdown) and re-raises them once done; the handler it then
    # meets must not turn a clean shutdown into an error exit.
    signal.signal(signal.SIGTERM, lambda *_: None)
    _log(f"serving {name!r} on http://{args.host}:{args.port}")
    server.run()
    if not server.started:
        return 1  # could not bind (uvicorn logged why)
    _log("shut down")
    return 0
