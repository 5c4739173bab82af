"""Safetensors files and HF checkpoint directories, read tensor by tensor through the `safetensors` library.

`safetensors.safe_open` parses and validates each header (dtypes, shapes, offsets in range, no overlapping or
uncovered bytes). Tensors (or slices of them) are read one at a time with pread, so a 700 GB checkpoint never
has to fit in memory (its default mmap backend keeps every page read mapped: the process's RSS would grow
toward the checkpoint's size). Only safetensors is ever loaded: no pickle. Own code covers what the library
cannot do:

- float8 tensors: it returns no numpy array for F8_E4M3 / F8_E5M2 (it looks the type up in numpy, which has
  none), so their bytes are memory-mapped here at the offsets the header gives (`tensor_spans`);
- error messages: a file it rejects is described here, naming the first truncated tensor when there is one;
- writing: its `save_file` writes a strided array's buffer as it is (a transposed view comes back
  untransposed) and leaves the file readable by its owner only, so `save_file` makes the arrays contiguous
  first and gives the file the usual permissions.

Every problem raises `CheckpointError` naming the file and tensor.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from mla_jax.dtypes import DTYPES, FP8_E4M3, FP8_E5M2

Index = tuple[slice, ...]


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted or does not match the config; the message names the tensor."""


def tensor_spans(path: str) -> tuple[int, dict[str, tuple[int, int]]]:
    """(start of the data section, {tensor: (begin, end) byte offsets in it}) from a safetensors header: where a
    tensor's bytes are, which the library does not expose. Raises ValueError when the header cannot be read."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size:
            raise ValueError(f"header length {n} exceeds the file ({size} B)")
        header = json.loads(f.read(n))
    return 8 + n, {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def _rejected(path: str, err: Exception) -> CheckpointError:
    size = os.path.getsize(path)
    if size < 8:
        return CheckpointError(f"{path}: truncated (no safetensors header)")
    try:
        start, spans = tensor_spans(path)
        past = sorted((start + end, name) for name, (_, end) in spans.items() if start + end > size)
    except (ValueError, TypeError, KeyError, struct.error, UnicodeDecodeError, AttributeError):
        past = []
    if past:
        end, name = past[0]
        return CheckpointError(f"{path}: truncated: tensor '{name}' ends at byte {end} but the file has {size}")
    return CheckpointError(f"{path}: corrupted ({err})")


class SafetensorsFile:
    """One safetensors file: header validated up front, tensors read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._file = safe_open(self.path, framework="numpy", backend="pread")
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        except SafetensorError as e:
            raise _rejected(self.path, e) from None
        self.metadata: dict[str, str] = self._file.metadata() or {}
        self._specs: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        for name in self._file.keys():
            s = self._file.get_slice(name)
            if s.get_dtype() not in DTYPES:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype {s.get_dtype()}")
            self._specs[name] = (DTYPES[s.get_dtype()], tuple(s.get_shape()))
        self._spans: tuple[int, dict[str, tuple[int, int]]] | None = None

    def keys(self) -> list[str]:
        return list(self._specs)

    def __contains__(self, name: str) -> bool:
        return name in self._specs

    def spec(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._specs[name]

    def nbytes(self, name: str) -> int:
        dtype, shape = self._specs[name]
        return math.prod(shape) * dtype.itemsize

    def get(self, name: str, index: Index | None = None) -> np.ndarray:
        """The tensor, or `index` (slices of its leading axes) of it, as a fresh array; only that part is read."""
        dtype, shape = self._specs[name]
        if dtype in (FP8_E4M3, FP8_E5M2):
            return np.array(self._fp8(name, dtype, shape)[index or ()])
        if not index:
            return self._file.get_tensor(name)
        return self._file.get_slice(name)[index]

    def _fp8(self, name: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        if self._spans is None:
            self._spans = tensor_spans(self.path)
        start, spans = self._spans
        begin, end = spans[name]
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype, mode="r", offset=start + begin, shape=shape)


class CheckpointDir:
    """All tensors of an HF checkpoint directory: `model.safetensors`, or shards listed by
    `model.safetensors.index.json`."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: not a directory")
        index = os.path.join(self.path, "model.safetensors.index.json")
        files: dict[str, SafetensorsFile] = {}
        self._where: dict[str, SafetensorsFile] = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: invalid index ({e})") from None
            for name, fname in weight_map.items():
                if fname not in files:
                    files[fname] = SafetensorsFile(os.path.join(self.path, fname))
                if name not in files[fname]:
                    raise CheckpointError(f"{index}: tensor '{name}' is listed in {fname} but not stored there")
                self._where[name] = files[fname]
        else:
            names = sorted(f for f in os.listdir(self.path) if f.startswith("model") and f.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
            for fname in names:
                files[fname] = sf = SafetensorsFile(os.path.join(self.path, fname))
                for k in sf.keys():
                    if k in self._where:
                        raise CheckpointError(f"{self.path}: tensor '{k}' is stored twice ({fname})")
                    self._where[k] = sf
        self.files = list(files.values())

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def spec(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._where[name].spec(name)

    def nbytes(self, name: str) -> int:
        return self._where[name].nbytes(name)

    def get(self, name: str, index: Index | None = None) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor '{name}'")
        return self._where[name].get(name, index)


def save_file(
    tensors: Mapping[str, np.ndarray], path: str | os.PathLike, metadata: Mapping[str, str] | None = None
) -> None:
    """Write numpy tensors (bf16 / fp8 through ml_dtypes too) as one safetensors file, with the permissions
    `open()` would give it (the library renames a 0600 temporary file into place)."""
    path = os.fspath(path)
    try:
        safetensors.numpy.save_file(
            {k: np.ascontiguousarray(v) for k, v in tensors.items()},
            path,
            metadata=dict(metadata) if metadata else None,
        )
    except SafetensorError as e:
        raise CheckpointError(f"{path}: {e}") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def eos_token_ids(model_dir: str | os.PathLike) -> tuple[int, ...]:
    """The end-of-sequence ids of an HF model directory: `eos_token_id` of generation_config.json, then of
    config.json (an int or a list in either), without repeats; () when neither names one."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return tuple(dict.fromkeys(ids))
