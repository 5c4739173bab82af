"""`convert`: an HF DeepSeek V2 / V2-Lite / V3 checkpoint -> a converted mla-jax checkpoint (`layout`), streaming
one group at a time (`plan`).

    convert("path/to/DeepSeek-V3", "path/to/converted", dtype="bf16")     # or: mla-jax convert HF_DIR OUT_DIR

Safety: everything is written into a sibling `.OUT.partial-<pid>` directory, the metadata file last, which is
renamed to OUT only on success. An interrupted run leaves at most that partial directory (never loadable: no
metadata, no config.json); the next run removes partial directories of dead processes, so a plain rerun
(no --force needed when OUT does not exist) replaces it cleanly. An existing OUT is replaced only with
`force=True`, only when it is an mla-jax checkpoint or empty, and only once the new one is complete: OUT is
renamed aside, the new one renamed in, the old one deleted (a crash between the two renames leaves the old one
as `.OUT.old-<pid>`). SIGINT / SIGTERM never land inside orbax's save or between the renames (`_Interrupts`):
the partial directory is removed and `Interrupted` raised. Each stored array's checksum goes into the metadata.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from mla_jax.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks, fp8_block, has_fp8_nan, quantize_fp8_blocks
from mla_jax.checkpoint.hf import CheckpointDir, CheckpointError
from mla_jax.checkpoint.layout import FORMAT, FORMAT_VERSION, METADATA, PARAMS_DIR, checksum, set_path
from mla_jax.checkpoint.plan import DEFAULT_MAX_GROUP_MB, ConvertError, Leaf, Plan, describe_plan, fmt_bytes, make_plan
from mla_jax.checkpoint.validate import check_float_dtype
from mla_jax.config import DeepseekConfig
from mla_jax.dtypes import FP8_E4M3, as_dtype
from mla_jax.model import param_groups
from pallas_kernels.util import cdiv

EXTRA_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


# -------------------------------------------------------------------------------------------- materialize


def _quantized(ckpt: CheckpointDir, name: str, part: str, select, block, stats) -> np.ndarray:
    """A float source block-quantized for an fp8 leaf (weights="fp8"): its e4m3 ("fp8") or scales ("scale");
    the "fp8" read adds its error to `stats` (max_rel, err2, ref2, tensors)."""
    experts = None if select is None else (slice(select[0], select[1]),)
    x = ckpt.get(name, None if select is None else experts + (slice(select[2], select[3]),))
    check_float_dtype(name, x.dtype)
    q, s = quantize_fp8_blocks(x, block)
    if part == "scale":
        return s
    if stats is not None:
        xf = np.asarray(x, np.float32)
        d = dequantize_fp8_blocks(q, s, block, name) - xf
        stats["max_rel"] = max(stats.get("max_rel", 0.0), float(np.abs(d).max() / max(np.abs(xf).max(), 1e-30)))
        stats["err2"] = stats.get("err2", 0.0) + float(np.sum(d.astype(np.float64) ** 2))
        stats["ref2"] = stats.get("ref2", 0.0) + float(np.sum(xf.astype(np.float64) ** 2))
        stats["tensors"] = stats.get("tensors", 0) + 1
    return q


def _read(ckpt: CheckpointDir, name: str, part: str, select, block) -> np.ndarray:
    """A source tensor as its stored float dtype ("value", fp8 dequantized to float32), raw e4m3 ("fp8") or its
    float32 scales ("scale"), optionally restricted to experts [e0, e1) and rows [r0, r1) of a fused tensor;
    only that part is read."""
    experts = None if select is None else (slice(select[0], select[1]),)
    q = ckpt.spec(name)[0] == FP8_E4M3
    if part == "value" and not q:
        return ckpt.get(name, None if select is None else experts + (slice(select[2], select[3]),))
    w, s = ckpt.get(name, experts), ckpt.get(name + SCALE_SUFFIX, experts)
    if select is not None:
        r0, r1 = select[2:]
        if part == "value":  # dequantize whole row blocks, then slice (r0 need not be block-aligned)
            return dequantize_fp8_blocks(w, s, block, name)[:, r0:r1]
        w, s = w[:, r0:r1], s[:, r0 // block[0] : cdiv(r1, block[0])]
    if part == "value":
        return dequantize_fp8_blocks(w, s, block, name)
    if part == "fp8":
        if has_fp8_nan(w):
            raise CheckpointError(f"tensor '{name}' contains NaN")
        return w
    s = np.asarray(s, np.float32)
    if not np.isfinite(s).all():
        raise CheckpointError(f"tensor '{name}{SCALE_SUFFIX}' contains NaN or Inf (corrupted?)")
    return s


def _finish(x: np.ndarray, leaf: Leaf, cfg: DeepseekConfig, name: str) -> np.ndarray:
    if leaf.op:
        N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        w = np.asarray(x).reshape(N, P + V, L)
        x = w[:, :P, :] if leaf.op == "uk" else np.swapaxes(w[:, P:, :], 1, 2)
    if leaf.part == "fp8":
        return x
    x = np.asarray(x)
    if x.dtype.kind in "fV" and not np.isfinite(x).all():
        raise CheckpointError(f"tensor '{name}' contains NaN or Inf (corrupted?)")
    return x


def materialize(ckpt: CheckpointDir, leaf: Leaf, cfg: DeepseekConfig, stats: dict | None = None) -> np.ndarray:
    """Read, dequantize / quantize / slice / split and cast one leaf into a fresh array of its stored dtype.
    `stats` collects the block-quantization error of float sources stored as fp8 (weights="fp8")."""
    block = fp8_block(cfg)
    out = np.empty(leaf.shape, as_dtype(leaf.dtype))

    def read(name, select):
        if leaf.part in ("fp8", "scale") and ckpt.spec(name)[0] != FP8_E4M3:
            return _quantized(ckpt, name, leaf.part, select, block, stats)
        return _read(ckpt, name, leaf.part, select, block)

    if leaf.stacked:
        for j, name in enumerate(leaf.sources):  # one expert at a time: no [E, ...] float32 temporary
            out[j] = _finish(read(name, None), leaf, cfg, name)
    else:
        out[...] = _finish(read(leaf.sources[0], leaf.select), leaf, cfg, leaf.sources[0])
    return out


# ------------------------------------------------------------------------------------------------ convert


@dataclasses.dataclass
class ConvertResult:
    out_dir: str | None
    groups: int
    params: int
    source_bytes: int
    stored_bytes: int
    largest_group_bytes: int
    skipped_mtp: int
    seconds: float


def _versions() -> dict[str, str]:
    from importlib import metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("mla-jax", "jax", "jaxlib", "orbax-checkpoint", "numpy", "ml_dtypes", "tensorstore", "safetensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_dirs(parent: str, name: str, kinds: tuple[str, ...]) -> list[str]:
    """Partial / old directories of OUT left by processes that are gone."""
    pat = re.compile(r"\." + re.escape(name) + r"\.(" + "|".join(kinds) + r")-(\d+)$")
    out = []
    for entry in os.listdir(parent):
        m = pat.match(entry)
        if m and int(m.group(2)) != os.getpid() and not _pid_alive(int(m.group(2))):
            out.append(os.path.join(parent, entry))
    return out


def _replaceable(path: str) -> bool:
    return (
        os.path.isdir(path)
        and not os.path.islink(path)
        and (not os.listdir(path) or os.path.exists(os.path.join(path, METADATA)))
    )


def _check_output(src: str, out: str, force: bool) -> None:
    src, out = os.path.realpath(src), os.path.realpath(out)
    if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
        raise ConvertError(f"output {out} must not be the HF directory {src}, inside it, or contain it")
    if os.path.lexists(out):
        if not force:
            raise ConvertError(f"{out} already exists; pass --force to replace it")
        if not _replaceable(out):
            raise ConvertError(
                f"{out} exists and is not an mla-jax checkpoint (no {METADATA}); refusing to "
                "replace it, even with --force"
            )


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert(
    hf_dir: str,
    out_dir: str,
    *,
    dtype: Any = "bf16",
    keep_fp8: bool = False,
    weights: str = "bf16",
    force: bool = False,
    dry_run: bool = False,
    max_group_mb: float = DEFAULT_MAX_GROUP_MB,
    log: TextIO | None = sys.stderr,
    progress: bool = True,
    on_group_written: Callable[[int], None] | None = None,
) -> ConvertResult:
    """Convert `hf_dir` (config.json + safetensors, single or sharded) into `out_dir`; see the module doc.

    Everything is validated from the headers before anything is written. `dry_run` prints the mapping to stdout
    and writes nothing. `log` gets the messages and, with `progress`, one progress bar (source bytes, rate;
    None: silent). `on_group_written(n)` is called once the first n groups are on disk (a test interrupts the
    conversion there)."""
    t0 = time.monotonic()
    cfg = DeepseekConfig.from_json(hf_dir)
    ckpt = CheckpointDir(hf_dir)
    plan = make_plan(ckpt, cfg, dtype=dtype, keep_fp8=keep_fp8, max_group_mb=max_group_mb, weights=weights)
    quant_stats: dict = {}

    def say(msg: str) -> None:
        if log is not None:
            log.write(msg + "\n")
            log.flush()

    def result(out):
        return ConvertResult(
            out,
            len(plan.groups),
            plan.num_params,
            plan.source_bytes,
            plan.stored_bytes,
            plan.largest_group.nbytes,
            len(plan.skipped),
            time.monotonic() - t0,
        )

    if dry_run:
        lines = describe_plan(plan, os.path.abspath(hf_dir), os.path.abspath(out_dir) + " (dry run)")
        try:
            _check_output(hf_dir, out_dir, force)
        except ConvertError as e:
            lines.append(f"  note: a real run would fail: {e}")
        print("\n".join(lines))
        return result(None)
    _check_output(hf_dir, out_dir, force)
    if keep_fp8 and not plan.quantized:
        say("note: --keep-fp8: the source has no fp8 weights; nothing to keep")
    if plan.skipped:
        say(
            f"skipping {len(plan.skipped)} MTP tensors (model.layers.{cfg.num_hidden_layers}.*): multi-token "
            "prediction is not used for inference here"
        )

    out = os.path.abspath(out_dir)
    parent, name = os.path.dirname(out), os.path.basename(out)
    os.makedirs(parent, exist_ok=True)
    for stale in _stale_dirs(parent, name, ("partial",)):
        say(f"removing {stale}: left by an interrupted conversion")
        shutil.rmtree(stale, ignore_errors=True)
    tmp = os.path.join(parent, f".{name}.partial-{os.getpid()}")
    with interrupt_guard() as deferred:
        shutil.rmtree(tmp, ignore_errors=True)
        os.mkdir(tmp)
        try:
            _write_all(
                plan, ckpt, hf_dir, out_dir, force, tmp, out, log, progress, on_group_written, deferred, quant_stats
            )
        except BaseException:
            with ignored_interrupts():  # a second Ctrl-C must not stop the clean-up half-way
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    for stale in _stale_dirs(parent, name, ("partial", "old")):
        shutil.rmtree(stale, ignore_errors=True)
    res = result(out)
    if quant_stats:
        q = _quant_report(quant_stats)
        say(
            f"fp8: {q['tensors']} float weights block-quantized (128x128, e4m3): relative error rms "
            f"{q['rms_rel']:.4f}, max {q['max_rel']:.4f} (of each tensor's max |w|)"
        )
    say(
        f"wrote {out}: {plan.num_params} params, {fmt_bytes(plan.stored_bytes)} {plan.dtype.name}"
        f"{' + fp8' if keep_fp8 and plan.quantized else ''} in {len(plan.groups)} groups, {res.seconds:.1f} s"
    )
    return res


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised by a conversion at a safe point (between arrays); str() is the signal's name."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Interrupts:
    """SIGINT / SIGTERM as `Interrupted`, except inside `deferred()` sections, where the first one waits for the
    section's end: orbax's save runs worker threads that would go on writing into the partial directory after
    it is removed (an interrupted conversion then left it behind, with pages of tracebacks). A second signal
    raises at once."""

    def __init__(self):
        self.pending: int | None = None
        self.depth = 0

    def handler(self, signum, frame):
        if self.depth and self.pending is None:
            self.pending = signum
            return
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
        if self.pending is not None and not self.depth:
            raise Interrupted(self.pending)


@contextlib.contextmanager
def interrupt_guard():
    """Installs `_Interrupts`' handler for SIGINT / SIGTERM within (main thread only: elsewhere signals are the
    caller's and `deferred()` does nothing); yields its `deferred`."""
    if threading.current_thread() is not threading.main_thread():
        yield contextlib.nullcontext
        return
    guard = _Interrupts()
    old = {s: signal.signal(s, guard.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield guard.deferred
    finally:
        for s, h in old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def ignored_interrupts():
    """SIGINT / SIGTERM ignored within (main thread only): for clean-up that must finish."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _write_all(plan, ckpt, hf_dir, out_dir, force, tmp, out, log, progress, on_group_written, deferred, quant_stats):
    """The groups, extra files and metadata into `tmp`, then `tmp` renamed to `out` (see the module doc)."""
    parent, name = os.path.dirname(out), os.path.basename(out)
    bar = tqdm(
        total=plan.source_bytes,
        unit="B",
        unit_scale=True,
        file=log,
        disable=not progress or log is None,
        desc="converting",
        bar_format="{desc} {percentage:5.1f}%|{bar}| {n_fmt}{unit}/{total_fmt}{unit} "
        "[{elapsed}<{remaining}, {rate_fmt}{postfix}]",
    )
    with bar:
        sums = _write(plan, ckpt, tmp, bar, on_group_written, deferred, quant_stats)
    for f in EXTRA_FILES:
        if os.path.isfile(os.path.join(hf_dir, f)):
            shutil.copyfile(os.path.join(hf_dir, f), os.path.join(tmp, f))
    shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(tmp, "config.json"))
    with open(os.path.join(tmp, METADATA), "w") as fh:  # last: its presence marks a complete checkpoint
        meta = _metadata(plan, ckpt, hf_dir, sums)
        if quant_stats:
            meta["fp8_quantization"] = _quant_report(quant_stats)
        json.dump(meta, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync(tmp)
    with deferred():  # the two renames are not interrupted between them
        if os.path.lexists(out):
            _check_output(hf_dir, out_dir, force)  # it may have appeared meanwhile
            old = os.path.join(parent, f".{name}.old-{os.getpid()}")
            os.rename(out, old)
            try:
                os.rename(tmp, out)
            except BaseException:
                os.rename(old, out)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        _fsync(parent)


def _quant_report(stats: dict) -> dict:
    return {
        "tensors": int(stats["tensors"]),
        "rms_rel": float(np.sqrt(stats["err2"] / max(stats["ref2"], 1e-30))),
        "max_rel": float(stats["max_rel"]),
    }


def _write(
    plan: Plan, ckpt: CheckpointDir, tmp: str, bar: tqdm, on_group_written, deferred, stats=None
) -> dict[tuple, str]:
    """Every group as an orbax checkpoint under tmp/params; returns {(unit key, *leaf path): checksum}."""
    import orbax.checkpoint as ocp

    sums: dict[tuple, str] = {}

    params_dir = os.path.join(tmp, PARAMS_DIR)
    os.mkdir(params_dir)
    ck = ocp.PyTreeCheckpointer()
    try:
        for k, g in enumerate(plan.groups):
            tree: dict = {}
            for u in g.units:
                for lf in u.leaves:
                    x = materialize(ckpt, lf, plan.cfg, stats)
                    sums[(u.key,) + lf.path] = checksum(x)
                    set_path(tree, (u.key,) + lf.path, x)
            with deferred():  # never interrupted inside orbax's save (see `_Interrupts`)
                ck.save(os.path.join(params_dir, g.name), tree)
            del tree
            bar.set_postfix_str(f"{k + 1}/{len(plan.groups)} groups, {g.units[-1].key}", refresh=False)
            bar.update(g.source_bytes)
            if on_group_written is not None:
                on_group_written(k + 1)
    finally:
        ck.close()
    return sums


def _metadata(plan: Plan, ckpt: CheckpointDir, hf_dir: str, sums: dict[tuple, str]) -> dict:
    with open(os.path.join(hf_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds"),
        "source": {
            "path": os.path.abspath(hf_dir),
            "files": {os.path.basename(f.path): os.path.getsize(f.path) for f in ckpt.files},
            "model_type": plan.cfg.model_type,
            "transformers_version": hf_cfg.get("transformers_version"),
            "quantization_config": hf_cfg.get("quantization_config"),
            "fused_experts": plan.fused_experts,
        },
        "dtype": plan.dtype.name,
        "keep_fp8": bool(plan.keep_fp8 and plan.quantized),
        "weights": plan.weights,
        "fp8_block": list(fp8_block(plan.cfg)),
        "versions": _versions(),
        "tensors": {
            "source": plan.source_tensors,
            "skipped_mtp": len(plan.skipped),
            "ignored": len(plan.ignored),
            "fp8_weights": len(plan.quantized),
            "params": plan.num_params,
            "stored_arrays": sum(len(u.leaves) for u in plan.units),
        },
        "bytes": {"source": plan.source_bytes, "stored": plan.stored_bytes, "largest_group": plan.largest_group.nbytes},
        "stacks": {name: {"first_layer": start, "num_layers": n} for name, start, n in param_groups(plan.cfg)},
        "groups": [{"name": g.name, "units": [u.key for u in g.units]} for g in plan.groups],
        "units": [
            {
                "key": u.key,
                "stack": u.stack,
                "index": u.index,
                "layer": u.layer,
                "experts": list(u.experts) if u.experts else None,
                "leaves": [
                    {
                        "path": list(lf.path),
                        "shape": list(lf.shape),
                        "dtype": lf.dtype,
                        "from": lf.origin,
                        "crc32": sums[(u.key,) + lf.path],
                    }
                    for lf in u.leaves
                ],
            }
            for u in plan.units
        ],
    }
