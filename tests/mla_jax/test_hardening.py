"""Hardening (issue #28), tried as a new user would: strict tensor names, NaN/Inf weights, checksums of converted
checkpoints, early validation of the CLI's flags and of `generate`'s inputs, progress on a terminal only, the
Makefile's stale-venv check, clean interruption of `convert`, and a seeded fuzz test of the loaders."""

import json
import os

import numpy as np
import pytest

from mla_jax.checkpoint import CheckpointError, convert, load_model, mtp_layer_index
from mla_jax.config import DeepseekConfig
from tests.mla_jax.helpers import copy_fixture, read_tensors, rewrite_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_fp8")


def _edit_config(d, **changes):
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.update(changes)
    with open(p, "w") as f:
        json.dump(c, f)


def _quiet(**kw):
    return dict(log=None, progress=False, **kw)


# ------------------------------------------------------------------------------- 1. strict tensor names


def test_mtp_layer_index_accepts_only_declared_mtp_layers():
    cfg = DeepseekConfig.from_json(FP8_FIXTURE)  # 4 layers + num_nextn_predict_layers 1
    assert cfg.num_nextn_predict_layers == 1
    for rel in ("enorm.weight", "eh_proj.weight_scale_inv", "shared_head.head.weight", "self_attn.o_proj.weight"):
        assert mtp_layer_index(f"model.layers.4.{rel}", cfg) == 0, rel
    assert mtp_layer_index("model.layers.4.mlp.experts.3.up_proj.weight", cfg) == 0
    for name in (
        "model.layers.4.extra.weight",  # not an MTP or decoder tensor name
        "model.layers.5.enorm.weight",  # beyond num_nextn_predict_layers
        "model.layers.3.enorm.weight",  # a decoder layer
        "model.layers.4.mlp.experts.99.up_proj.weight",  # no such expert
        "model.norm.weight",
    ):
        assert mtp_layer_index(name, cfg) is None, name


@pytest.mark.parametrize(
    "what,match",
    [
        ("fewer_layers", r"unexpected tensor 'model\.layers\.3\..*num_hidden_layers 3"),
        ("fewer_layers_mtp", r"'model\.layers\.3\.\*' is not an MTP layer \(no 'model\.layers\.3\.enorm\.weight'\)"),
        ("junk_layer", r"unexpected tensor 'model\.layers\.9\.extra\.weight'"),
        ("junk_in_mtp", r"unexpected tensor 'model\.layers\.4\.extra\.weight'"),
    ],
)
def test_strict_names_on_load_and_convert(tmp_path, what, match):
    d = copy_fixture("v3", tmp_path)  # 4 layers, num_nextn_predict_layers 1, no MTP tensors
    if what == "fewer_layers":
        _edit_config(d, num_hidden_layers=3, num_nextn_predict_layers=0)
    elif what == "fewer_layers_mtp":
        _edit_config(d, num_hidden_layers=3)  # layer 3 would be taken for the MTP layer
    else:
        t = read_tensors(d)
        t["model.layers.9.extra.weight" if what == "junk_layer" else "model.layers.4.extra.weight"] = np.ones(3)
        if what == "junk_in_mtp":
            t |= {f"model.layers.4.{k}": np.ones(4, np.float32) for k in ("enorm.weight", "hnorm.weight")}
        rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match=match):
        load_model(str(d))
    with pytest.raises(CheckpointError, match=match):
        convert(str(d), str(tmp_path / "out"), **_quiet())
    assert not os.path.exists(tmp_path / "out")
