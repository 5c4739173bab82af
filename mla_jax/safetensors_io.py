"""A small, strict safetensors reader/writer over numpy memmaps (bf16 and fp8 through ml_dtypes).

Only safetensors is ever loaded: no pickle. Every problem (truncated file, bad header, offsets out of range,
unknown dtype) raises `CheckpointError` naming the file and tensor.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupted or does not match the config; the message names the tensor."""


DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """Header parsed and validated up front; tensors are read lazily as memmap views."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            size = os.path.getsize(self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e.strerror})") from None
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{self.path}: truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(f"{self.path}: corrupted or truncated header (length {n}, file {size} B)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{self.path}: corrupted header ({e})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: corrupted header (not an object)")
        self.metadata = header.pop("__metadata__", None) or {}
        self._data_start = 8 + n
        self._entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype = DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except KeyError as k:
                raise CheckpointError(f"{self.path}: tensor '{name}' has unsupported dtype or missing field {k}")\
                    from None
            except (TypeError, ValueError):
                raise CheckpointError(f"{self.path}: tensor '{name}' has a malformed header entry") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if end - begin != nbytes or begin < 0:
                raise CheckpointError(f"{self.path}: tensor '{name}' offsets [{begin}, {end}) do not match "
                                      f"its shape {shape} and dtype {e['dtype']}")
            if self._data_start + end > size:
                raise CheckpointError(f"{self.path}: truncated: tensor '{name}' ends at byte "
                                      f"{self._data_start + end} but the file has {size}")
            self._entries[name] = (dtype, shape, begin, end)

    def keys(self) -> list[str]:
        return list(self._entries)

    def spec(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        dtype, shape, _, _ = self._entries[name]
        return dtype, shape

    def nbytes(self, name: str) -> int:
        _, _, b, e = self._entries[name]
        return e - b

    def get(self, name: str) -> np.ndarray:
        """A read-only memmap view of the tensor (no copy until used)."""
        dtype, shape, begin, end = self._entries[name]
        if end == begin:
            return np.zeros(shape, dtype)
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_start + begin, shape=(end - begin,))
        return mm.view(dtype).reshape(shape)


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
                if name not in files[fname]._entries:
                    raise CheckpointError(f"{index}: tensor '{name}' is listed in {fname} but not stored there")
                self._where[name] = files[fname]
        else:
            names = sorted(f for f in os.listdir(self.path)
                           if f.startswith("model") and f.endswith(".safetensors"))
            if not names:
                raise CheckpointError(f"{self.path}: no model.safetensors or model.safetensors.index.json")
            for fname in names:
                sf = SafetensorsFile(os.path.join(self.path, fname))
                for k in sf.keys():
                    if k in self._where:
                        raise CheckpointError(f"{self.path}: tensor '{k}' is stored twice ({fname})")
                    self._where[k] = sf
        self.files = list(files.values()) or list({id(v): v for v in self._where.values()}.values())

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def spec(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        return self._where[name].spec(name)

    def nbytes(self, name: str) -> int:
        return self._where[name].nbytes(name)

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor '{name}'")
        return self._where[name].get(name)


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (numpy, incl. ml_dtypes bf16/fp8) as one safetensors file."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _NAMES:
            raise CheckpointError(f"tensor '{name}': dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # align the data section
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())


def iter_tensors(ckpt: CheckpointDir) -> Iterator[tuple[str, np.ndarray]]:
    for name in ckpt.keys():
        yield name, ckpt.get(name)
