"""The converted (mla-jax) checkpoint directory, shared by the writer and the loader.

    OUT/
      mla_jax_checkpoint.json   format, versions, source, dtype, tensor counts, and every unit and group with
                                its leaves (shape, dtype, HF origin, CRC-32 of the bytes); written last
      config.json               the HF config, copied verbatim (+ tokenizer.json, tokenizer_config.json, ...)
      params/group_00000/ ...   one orbax PyTree checkpoint per group: {unit key: unit tree}

Units and groups are described in `plan`. The router (gate.weight, e_score_correction_bias) is always float32.
Each stored array's CRC-32 (`checksum`, ~4 GB/s on one core) is written at conversion and checked on load, so a
flipped byte in a group's files is an error naming the array, not silently different weights (orbax / tensorstore
store the chunks raw). Format 2 added the checksums; format 1 checkpoints are converted again.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

FORMAT = "mla-jax-orbax-groups"
FORMAT_VERSION = 2
METADATA = "mla_jax_checkpoint.json"
PARAMS_DIR = "params"
ROUTER = (("mlp", "gate", "weight"), ("mlp", "gate", "e_score_correction_bias"))


def is_router(path: tuple[str, ...]) -> bool:
    return path[-3:] in ROUTER


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def checksum(x: np.ndarray) -> str:
    """CRC-32 of an array's bytes (C order), as 8 hex digits."""
    return f"{zlib.crc32(np.ascontiguousarray(x).reshape(-1).view(np.uint8)):08x}"
