"""Dtype names -> numpy dtypes (bf16 / fp8 through ml_dtypes): the short names users pass (`--dtype bf16`,
`cache_dtype="fp8"`; the one table in `pallas_kernels.util.DTYPE_NAMES`) and the codes of safetensors headers
("BF16", "F8_E4M3")."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

from pallas_kernels.util import BF16, DTYPE_NAMES, F16, F32, FP8

FP8_E4M3 = FP8
FP8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)

DTYPES: dict[str, np.dtype] = {
    **DTYPE_NAMES,  # the short names ("bf16", "fp32", "fp8", ...), shared with the kernels
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
