"""The `mla-jax` command line (`python -m mla_jax.cli` works too).

Subcommands register themselves in COMMANDS as (name, help, add_arguments, run); `run(args) -> exit code`.
A subcommand imports its module (and orbax) inside `run`; parsing imports only the attention backend registry
(for `--backend`'s choices). Exit codes: 0 ok,
1 the checkpoint or config is invalid or the conversion failed (one line on stderr naming the problem), 2 usage,
130 interrupted. SIGTERM unwinds like Ctrl-C so a conversion removes its partial output.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable

CONVERT_EPILOG = """\
examples:
  mla-jax convert ~/models/DeepSeek-V2-Lite ~/ckpt/v2-lite
  mla-jax convert ~/models/DeepSeek-V3 ~/ckpt/v3-fp8 --keep-fp8
  mla-jax convert ~/models/DeepSeek-V3 ~/ckpt/v3 --dry-run      # print the mapping, write nothing

OUT_DIR gets an orbax checkpoint (one sub-checkpoint per layer / expert chunk under params/), the HF config.json,
tokenizer files when present and mla_jax_checkpoint.json; load it with mla_jax.checkpoint.load_model(OUT_DIR).
The conversion writes into a hidden sibling directory and renames it to OUT_DIR only when complete: an
interrupted run never leaves a loadable OUT_DIR, and simply rerunning it cleans up and starts over. An existing
OUT_DIR is only replaced with --force (and only if it is an mla-jax checkpoint or empty).
"""


def _add_backend(p: argparse.ArgumentParser) -> None:
    from mla_jax.attention import BACKENDS  # the registry is the one list of names

    p.add_argument(
        "--backend",
        choices=tuple(BACKENDS),
        default=None,
        help="attention backend (default: pallas_sm90 on Hopper, pallas on other GPUs, xla on CPU)",
    )


def _add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "hf_dir",
        metavar="HF_DIR",
        help="Hugging Face checkpoint: config.json + model*.safetensors "
        "(single file, or shards with model.safetensors.index.json)",
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must not exist, unless --force)")
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="dtype of the stored weights (default bf16); the MoE router stays float32",
    )
    p.add_argument(
        "--keep-fp8",
        action="store_true",
        help="store DeepSeek-V3 fp8 e4m3 weights as fp8 + float32 weight_scale_inv instead of "
        "dequantizing them (half the disk of bf16); they are dequantized to the dtype on load",
    )
    p.add_argument(
        "--weights",
        choices=("bf16", "fp8"),
        default="bf16",
        help="fp8: store the linears and experts as e4m3 + 128x128 weight_scale_inv (an fp8 source's as is, "
        "a float source's block-quantized, the error reported) for `--weights fp8` at run time",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate and print the mapping (HF names -> param path, shape, dtype); write nothing",
    )
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR (an mla-jax checkpoint)")
    p.add_argument(
        "--max-group-mb",
        type=float,
        default=2048,
        metavar="MB",
        help="routed experts are written in chunks of at most this size (default 2048): the peak "
        "host memory is about the largest group",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _run_convert(args: argparse.Namespace) -> int:
    from mla_jax.checkpoint import convert

    convert(
        args.hf_dir,
        args.out_dir,
        dtype=args.dtype,
        keep_fp8=args.keep_fp8,
        weights=args.weights,
        force=args.force,
        dry_run=args.dry_run,
        max_group_mb=args.max_group_mb,
        progress=not args.quiet,
    )
    return 0


GENERATE_EPILOG = """\
examples:
  mla-jax generate --model ~/ckpt/v2-lite --prompt "def fibonacci(n):"
  mla-jax generate --model ~/models/DeepSeek-V2-Lite --prompt "Hello" --temperature 0.7 --top-p 0.9 --seed 1
  mla-jax generate --model tests/fixtures/hf/v3 --prompt-ids 1,2,3 --max-new-tokens 8

MODEL is a Hugging Face checkpoint directory or one written by `mla-jax convert`; the tokenizer is read from
its tokenizer.json. Text streams to stdout as it is generated; tokens/s goes to stderr.
"""


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR", help="HF checkpoint directory or converted orbax one")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with DIR/tokenizer.json)")
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 (default): off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 (default): off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="weight dtype (default: bf16 on GPU, fp32 on CPU)"
    )
    p.add_argument(
        "--cache-dtype",
        choices=("bf16", "fp8", "fp32"),
        default=None,
        help="KV cache dtype (default: bf16 on GPU, fp32 on CPU)",
    )
    _add_backend(p)
    p.add_argument("--no-stop", action="store_true", help="do not stop at the model's eos token")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksums of a converted checkpoint (faster load; NaN/Inf weights are still refused)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress (it shows on a terminal only anyway)")
    add_compile_cache_flag(p)
    p.add_argument(
        "--speculative-method",
        choices=("mtp", "ngram"),
        default=None,
        help="speculative decoding: drafts from the checkpoint's MTP layer or by prompt lookup (default: off)",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=2, help="drafts per step with --speculative-method")


def add_compile_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not read or write the persistent compilation cache (mla_jax.compile_cache; default "
        "~/.cache/mla-jax/jax, or $MLA_JAX_COMPILE_CACHE)",
    )


# SamplingParams' field names -> the flags that set them, so an error names the flag.
_FLAGS = {f: "--" + f.replace("_", "-") for f in ("max_new_tokens", "temperature", "top_k", "top_p", "seed")}


class UsageError(Exception):
    """A bad flag or prompt: `main` prints the message and exits 2, before anything is loaded."""


def _show_progress(args: argparse.Namespace) -> bool:
    """Progress bars and compile lines: on a terminal only, never with --quiet."""
    return not args.quiet and sys.stderr.isatty()


def _read_prompt(args: argparse.Namespace):
    """(tokenizer or None, prompt token ids) from --prompt (via MODEL/tokenizer.json) or --prompt-ids."""
    import os

    if args.prompt_ids is not None:
        try:
            return None, [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    tok_path = os.path.join(args.model, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise UsageError(f"no tokenizer.json in {args.model}; pass --prompt-ids")
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(tok_path)
    except Exception as e:  # the tokenizers library raises a bare Exception with serde's message
        from mla_jax.checkpoint import CheckpointError

        raise CheckpointError(f"{tok_path}: not a valid tokenizer file ({e})") from None
    return tok, tok.encode(args.prompt).ids


def _check_generate(args: argparse.Namespace):
    """Every flag and the prompt, from config.json alone (cheap), before the model is loaded or a cache
    allocated: (config, tokenizer, prompt ids, SamplingParams, EngineConfig). Raises UsageError saying what is
    wrong and, for lengths, what fits."""
    import os

    from mla_jax.checkpoint import eos_token_ids
    from mla_jax.config import DeepseekConfig
    from mla_jax.engine import EngineConfig, check_prompt, default_page_size
    from mla_jax.sampling import SamplingParams

    if not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model}: the directory does not exist")
    cfg = DeepseekConfig.from_json(args.model)
    sp = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop_token_ids=() if args.no_stop else eos_token_ids(args.model),
    )
    try:
        sp.validate()
    except ValueError as e:
        msg = str(e)
        field = msg.split(" ", 1)[0]
        raise UsageError(_FLAGS.get(field, field) + " " + msg.split(" ", 1)[1]) from None
    tok, prompt = _read_prompt(args)
    what = f"the prompt ({len(prompt)} tokens)"
    limit = cfg.max_position_embeddings
    if len(prompt) > limit:
        raise UsageError(f"{what} is longer than the model's max_position_embeddings {limit}")
    try:
        prompt = check_prompt(prompt, sp, cfg)
    except ValueError as e:
        raise UsageError(f"{'--prompt' if tok else '--prompt-ids'}: {e}") from None
    if len(prompt) + args.max_new_tokens > limit:
        raise UsageError(
            f"--max-new-tokens {args.max_new_tokens}: {what} + {args.max_new_tokens} new tokens exceed the model's "
            f"max_position_embeddings {limit}; at most {limit - len(prompt)} new tokens fit"
        )
    on_cpu = _on_cpu()
    max_len = max(64, 1 << (len(prompt) + args.max_new_tokens - 1).bit_length())
    try:
        econf = EngineConfig(
            max_model_len=max_len,
            max_num_seqs=1,
            page_size=default_page_size(),
            token_budget=min(max_len, 512),
            max_prefills=1,
            cache_dtype=args.cache_dtype or ("fp32" if on_cpu else "bf16"),
            backend=args.backend,
            num_speculative_tokens=args.num_speculative_tokens if args.speculative_method else 0,
            speculative_method=args.speculative_method,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg, tok, prompt, sp, econf


def _on_cpu() -> bool:
    import jax

    return jax.default_backend() == "cpu"


def _run_generate(args: argparse.Namespace) -> int:
    import time

    import jax
    import jax.numpy as jnp

    from mla_jax.checkpoint import load_model
    from mla_jax.dtypes import as_dtype
    from mla_jax.engine import Engine

    _, tok, prompt, sp, econf = _check_generate(args)
    show = _show_progress(args)
    dtype = jnp.dtype(as_dtype(args.dtype or ("fp32" if _on_cpu() else "bf16")))
    t0 = time.perf_counter()
    cfg, params = load_model(args.model, dtype=dtype, verify=not args.no_verify, progress=show)
    load_s = time.perf_counter() - t0
    if show:
        print(f"loaded {args.model} in {load_s:.1f} s", file=sys.stderr)
    engine = Engine(params, cfg, econf)
    try:
        rid = engine.add_request(prompt, sp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    warm_s = engine.warmup(prefill=False, log=sys.stderr if show else None)  # decode compiles stay out of tokens/s
    if show:
        print("prefill (its first step compiles too) ...", file=sys.stderr, flush=True)
    if tok is not None:
        sys.stdout.write(args.prompt)
    sys.stdout.flush()
    detok = None
    if tok is not None:  # incremental: each token adds its text (none while a multi-byte character is incomplete)
        from mla_jax.serve.detokenizer import IncrementalDetokenizer

        detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    ids, first = [], None
    t1 = time.perf_counter()
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id != rid:
                continue
            if first is None:
                first = time.perf_counter()  # prefill and compiles are done
            ids = o.token_ids
            if detok is not None:
                sys.stdout.write("".join(detok.add(t) for t in o.new_token_ids))
            else:
                sys.stdout.write(("" if len(ids) == 1 else ",") + ",".join(map(str, o.new_token_ids)))
            sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    sys.stdout.flush()
    n = len(ids)
    rate = (n - 1) / (end - first) if first and n > 1 and end > first else float("nan")
    spec = ""
    if engine.spec_k:
        acc = engine.acceptance_rate
        spec = (
            f"{args.speculative_method} speculation k={engine.spec_k}: {engine.num_accepted_tokens}/"
            f"{engine.num_draft_tokens} drafts accepted ({'n/a' if acc is None else f'{acc:.0%}'}); "
        )
    print(
        f"[{n} tokens; {rate:.1f} tokens/s after the first; {spec}first token after {first - t1:.2f} s "
        f"(incl. the prefill compile); decode compile {warm_s:.2f} s; model load {load_s:.2f} s; "
        f"{jax.default_backend()}, {engine.config.backend} backend]",
        file=sys.stderr,
    )
    return 0


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="directory for e2e-h200.json (default: print the rows only)")
    _add_backend(p)
    p.add_argument("--layers", type=int, default=27)
    p.add_argument("--smoke", action="store_true", help="tiny dims and sizes: check the benchmark on a CPU")


def _run_bench(args: argparse.Namespace) -> int:
    from mla_jax.bench import e2e

    argv = ["--layers", str(args.layers)] + (["--out", args.out] if args.out else [])
    e2e.main(argv + (["--backend", args.backend] if args.backend else []) + (["--smoke"] if args.smoke else []))
    return 0


# name, help, add_arguments, run.
COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = [
    ("generate", "generate text with a DeepSeek model, streaming it as it comes", _add_generate, _run_generate),
    (
        "convert",
        "convert a Hugging Face DeepSeek V2/V2-Lite/V3 checkpoint into an mla-jax orbax checkpoint",
        _add_convert,
        _run_convert,
    ),
    (
        "bench",
        "run the end-to-end benchmark (a DeepSeek-V2-Lite-shaped model, random weights) on the GPU",
        _add_bench,
        _run_bench,
    ),
    (
        "serve",
        "serve an OpenAI-compatible HTTP API (completions, chat, streaming) with continuous batching",
        lambda p: __import__("mla_jax.serve.cli", fromlist=["cli"]).add_arguments(p),
        lambda args: __import__("mla_jax.serve.cli", fromlist=["cli"]).run(args),
    ),
]
EPILOGS = {"convert": CONVERT_EPILOG, "generate": GENERATE_EPILOG}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-jax", description="DeepSeek MLA inference in JAX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_, add, run in COMMANDS:
        p = sub.add_parser(
            name,
            help=help_,
            description=help_[0].upper() + help_[1:] + ".",
            epilog=EPILOGS.get(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add(p)
        p.set_defaults(_run=run)
    return parser


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("mla-jax")
    except metadata.PackageNotFoundError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so partial output is cleaned up (SIGKILL cannot be: see convert's doc);
    # `convert` defers both to a safe point between arrays.
    signal.signal(signal.SIGTERM, _sigterm)
    from mla_jax.checkpoint import CheckpointError
    from mla_jax.config import ConfigError

    if getattr(args, "no_compile_cache", False):
        os.environ["MLA_JAX_COMPILE_CACHE"] = "off"  # read by every Engine (mla_jax.compile_cache)
    try:
        return args._run(args)
    except UsageError as e:
        print(f"mla-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"mla-jax {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        sig = signal.SIGTERM if str(e) == "SIGTERM" else signal.SIGINT
        done = "; the partial output is removed" if args.command == "convert" else ""
        print(f"\nmla-jax {args.command}: interrupted ({sig.name}){done}", file=sys.stderr)
        return 128 + sig


def _sigterm(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


if __name__ == "__main__":
    sys.exit(main())
