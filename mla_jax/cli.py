"""The `mla-jax` command line (`python -m mla_jax.cli` works too).

Subcommands register themselves in COMMANDS as (name, help, add_arguments, run); `run(args) -> exit code`.
A subcommand imports its module (and orbax) inside `run`, so parsing and `--help` stay cheap. Exit codes: 0 ok,
1 the checkpoint or config is invalid or the conversion failed (one line on stderr naming the problem), 2 usage,
130 interrupted. SIGTERM unwinds like Ctrl-C so a conversion removes its partial output.
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable

CONVERT_EPILOG = """\
examples:
  mla-jax convert ~/models/DeepSeek-V2-Lite ~/ckpt/v2-lite
  mla-jax convert ~/models/DeepSeek-V3 ~/ckpt/v3-fp8 --keep-fp8
  mla-jax convert ~/models/DeepSeek-V3 ~/ckpt/v3 --dry-run      # print the mapping, write nothing

OUT_DIR gets an orbax checkpoint (one sub-checkpoint per layer / expert chunk under params/), the HF config.json,
tokenizer files when present and mla_jax_checkpoint.json; load it with mla_jax.convert.load_model(OUT_DIR).
The conversion writes into a hidden sibling directory and renames it to OUT_DIR only when complete: an
interrupted run never leaves a loadable OUT_DIR, and simply rerunning it cleans up and starts over. An existing
OUT_DIR is only replaced with --force (and only if it is an mla-jax checkpoint or empty).
"""


def _add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("hf_dir", metavar="HF_DIR", help="Hugging Face checkpoint: config.json + model*.safetensors "
                   "(single file, or shards with model.safetensors.index.json)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="output directory (must not exist, unless --force)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                   help="dtype of the stored weights (default bf16); the MoE router stays float32")
    p.add_argument("--keep-fp8", action="store_true",
                   help="store DeepSeek-V3 fp8 e4m3 weights as fp8 + float32 weight_scale_inv instead of "
                   "dequantizing them (half the disk of bf16); they are dequantized to the dtype on load")
    p.add_argument("--dry-run", action="store_true",
                   help="validate and print the mapping (HF names -> param path, shape, dtype); write nothing")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_DIR (an mla-jax checkpoint)")
    p.add_argument("--max-group-mb", type=float, default=2048, metavar="MB",
                   help="routed experts are written in chunks of at most this size (default 2048): the peak "
                   "host memory is about the largest group")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line")


def _run_convert(args: argparse.Namespace) -> int:
    from mla_jax.convert import convert

    convert(args.hf_dir, args.out_dir, dtype=args.dtype, keep_fp8=args.keep_fp8, force=args.force,
            dry_run=args.dry_run, max_group_mb=args.max_group_mb, progress=not args.quiet)
    return 0


# name, help, add_arguments, run. `generate` and `bench` are added here later.
COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = [
    ("convert", "convert a Hugging Face DeepSeek V2/V2-Lite/V3 checkpoint into an mla-jax orbax checkpoint",
     _add_convert, _run_convert),
]
EPILOGS = {"convert": CONVERT_EPILOG}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mla-jax", description="DeepSeek MLA inference in JAX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_, add, run in COMMANDS:
        p = sub.add_parser(name, help=help_, description=help_[0].upper() + help_[1:] + ".",
                           epilog=EPILOGS.get(name), formatter_class=argparse.RawDescriptionHelpFormatter)
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
    # SIGTERM unwinds like Ctrl-C, so partial output is cleaned up (SIGKILL cannot be: see convert's doc).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    from mla_jax.config import ConfigError
    from mla_jax.safetensors_io import CheckpointError

    try:
        return args._run(args)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"mla-jax {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mla-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
