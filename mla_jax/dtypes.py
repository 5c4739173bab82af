"""The one table of dtype names: the short names users pass (`--dtype bf16`, `cache_dtype="fp8"`) and the codes of
safetensors headers ("BF16", "F8_E4M3"), each to its numpy dtype (bf16 / fp8 through ml_dtypes)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)

DTYPES: dict[str, np.dtype] = {
    # short names
    "bf16": BF16,
    "fp16": F16,
    "fp32": F32,
    "fp8": FP8_E4M3,
    "fp8_e4m3": FP8_E4M3,
    # safetensors header codes
    "F64": np.dtype(np.float64),
    "F32": F32,
    "F16": F16,
    "BF16": BF16,
    "F8_E4M3": FP8_E4M3,
    "F8_E5M2": FP8_E5M2,
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


def as_dtype(d: Any) -> np.dtype:
    """A name of `DTYPES`, a numpy / ml_dtypes name ("bfloat16", "float8_e4m3fn") or any dtype-like -> numpy dtype."""
    if isinstance(d, str):
        if d in DTYPES:
            return DTYPES[d]
        if hasattr(ml_dtypes, d):
            return np.dtype(getattr(ml_dtypes, d))
    return np.dtype(d)
