"""`convert`: an HF DeepSeek V2 / V2-Lite / V3 checkpoint -> a converted mla-jax checkpoint (`layout`), streaming
one group at a time (`plan`).

    convert("path/to/DeepSeek-V3", "path/to/converted", dtype="bf16")     # or: mla-jax convert HF_DIR OUT_DIR

Safety: everything is written into a sibling `.OUT.partial-<pid>` directory, the metadata file last, which is
renamed to OUT only on success. An interrupted run leaves at most that partial directory (never loadable: no
metadata, no config.json); the next run removes partial directories of dead processes, so a plain rerun
(no --force needed when OUT does not exist) replaces it cleanly. An existing OUT is replaced only with
`force=True`, only when it is an mla-jax checkpoint or empty, and only once the new one is complete: OUT is
renamed aside, the new one renamed in, the old one deleted (a crash between the two renames leaves the old one
as `.OUT.old-<pid>`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from mla_jax.checkpoint.fp8 import SCALE_SUFFIX, dequantize_fp8_blocks, fp8_block, has_fp8_nan
from mla_jax.checkpoint.hf import CheckpointDir, CheckpointError
from mla_jax.checkpoint.layout import FORMAT, FORMAT_VERSION, METADATA, PARAMS_DIR, set_path
from mla_jax.checkpoint.plan import DEFAULT_MAX_GROUP_MB, ConvertError, Leaf, Plan, describe_plan, fmt_bytes, make_plan
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
    return np.asarray(s, np.float32)


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


def materialize(ckpt: CheckpointDir, leaf: Leaf, cfg: DeepseekConfig) -> np.ndarray:
    """Read, dequantize / slice / split and cast one leaf into a fresh array of its stored dtype."""
    block = fp8_block(cfg)
    out = np.empty(leaf.shape, as_dtype(leaf.dtype))
    if leaf.stacked:
        for j, name in enumerate(leaf.sources):  # one expert at a time: no [E, ...] float32 temporary
            out[j] = _finish(_read(ckpt, name, leaf.part, None, block), leaf, cfg, name)
    else:
        out[...] = _finish(_read(ckpt, leaf.sources[0], leaf.part, leaf.select, block), leaf, cfg, leaf.sources[0])
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
    plan = make_plan(ckpt, cfg, dtype=dtype, keep_fp8=keep_fp8, max_group_mb=max_group_mb)

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
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp)
    try:
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
            _write(plan, ckpt, tmp, bar, on_group_written)
        for f in EXTRA_FILES:
            if os.path.isfile(os.path.join(hf_dir, f)):
                shutil.copyfile(os.path.join(hf_dir, f), os.path.join(tmp, f))
        shutil.copyfile(os.path.join(hf_dir, "config.json"), os.path.join(tmp, "config.json"))
        with open(os.path.join(tmp, METADATA), "w") as fh:  # last: its presence marks a complete checkpoint
            json.dump(_metadata(plan, ckpt, hf_dir), fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        _fsync(tmp)
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in _stale_dirs(parent, name, ("partial", "old")):
        shutil.rmtree(stale, ignore_errors=True)
    res = result(out)
    say(
        f"wrote {out}: {plan.num_params} params, {fmt_bytes(plan.stored_bytes)} {plan.dtype.name}"
        f"{' + fp8' if keep_fp8 and plan.quantized else ''} in {len(plan.groups)} groups, {res.seconds:.1f} s"
    )
    return res


def _write(plan: Plan, ckpt: CheckpointDir, tmp: str, bar: tqdm, on_group_written) -> None:
    import orbax.checkpoint as ocp

    params_dir = os.path.join(tmp, PARAMS_DIR)
    os.mkdir(params_dir)
    ck = ocp.PyTreeCheckpointer()
    try:
        for k, g in enumerate(plan.groups):
            tree: dict = {}
            for u in g.units:
                for lf in u.leaves:
                    set_path(tree, (u.key,) + lf.path, materialize(ckpt, lf, plan.cfg))
            ck.save(os.path.join(params_dir, g.name), tree)
            del tree
            bar.set_postfix_str(f"{k + 1}/{len(plan.groups)} groups, {g.units[-1].key}", refresh=False)
            bar.update(g.source_bytes)
            if on_group_written is not None:
                on_group_written(k + 1)
    finally:
        ck.close()


def _metadata(plan: Plan, ckpt: CheckpointDir, hf_dir: str) -> dict:
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
                    {"path": list(lf.path), "shape": list(lf.shape), "dtype": lf.dtype, "from": lf.origin}
                    for lf in u.leaves
                ],
            }
            for u in plan.units
        ],
    }
