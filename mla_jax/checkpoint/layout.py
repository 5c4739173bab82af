"""The converted (mla-jax) checkpoint directory, shared by the writer and the loader.

    OUT/
      mla_jax_checkpoint.json   format, versions, source, dtype, tensor counts, and every unit and group with
                                its leaves (shape, dtype, HF origin); written last
      config.json               the HF config, copied verbatim (+ tokenizer.json, tokenizer_config.json, ...)
      params/group_00000/ ...   one orbax PyTree checkpoint per group: {unit key: unit tree}

Units and groups are described in `plan`. The router (gate.weight, e_score_correction_bias) is always float32.
"""

from __future__ import annotations

from typing import Any

FORMAT = "mla-jax-orbax-groups"
FORMAT_VERSION = 1
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
