"""Sparse-attention (DSA) checkpoints: the indexer tensors are validated, loaded (FP8 ones dequantized) and
converted like the rest; layers sharing an earlier top-k get their group's indexer as a placeholder."""

import os

import ml_dtypes
import numpy as np
import pytest

from mla_jax import model
from mla_jax.checkpoint import CheckpointError, convert, load_hf_checkpoint, load_model
from tests.mla_jax.helpers import FIXTURES, assert_same_params, copy_fixture, read_tensors, rewrite_tensors

FP8 = ml_dtypes.float8_e4m3fn


def _quantize_blocks(w, block=128):
    """w [M, K] -> (e4m3 [M, K], scale_inv f32 [ceil(M/128), ceil(K/128)]) with one amax scale per block."""
    m, k = w.shape
    s = np.zeros((-(-m // block), -(-k // block)), np.float32)
    q = np.zeros(w.shape, FP8)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block]
            s[i, j] = max(np.abs(blk).max() / 448.0, 1e-12)
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / s[i, j]).astype(FP8)
    return q, s


@pytest.mark.parametrize("name", ["v32", "glm_dsa"])
def test_convert_roundtrip_equals_hf_load(tmp_path, name):
    d = copy_fixture(name, tmp_path)
    cfg, want = load_hf_checkpoint(str(d))
    convert(str(d), str(tmp_path / "out"), dtype="fp32", log=None)
    cfg2, got = load_model(str(tmp_path / "out"))
    assert cfg2 == cfg
    assert_same_params(want, got)
    assert "indexer" in model.layer_params(got, cfg, cfg.num_hidden_layers - 1)["self_attn"]


def test_shared_layer_holds_its_group_indexer():
    cfg, params = load_hf_checkpoint(os.path.join(FIXTURES, "glm_dsa"))
    lead, shared = (model.layer_params(params, cfg, i)["self_attn"]["indexer"] for i in (0, 1))
    np.testing.assert_array_equal(np.asarray(lead["wq_b"]["weight"]), np.asarray(shared["wq_b"]["weight"]))


def test_fp8_indexer_weights_load_and_convert(tmp_path):
    """DeepSeek-V3.2's FP8 checkpoints quantize the indexer's wq_b / wk in 128x128 blocks: loaded dequantized,
    converted with and without --keep-fp8, all three equal."""
    d = copy_fixture("v32", tmp_path)
    t = read_tensors(d)
    deq = {}
    for i in range(3):
        for k in ("wq_b", "wk"):
            name = f"model.layers.{i}.self_attn.indexer.{k}.weight"
            q, s = _quantize_blocks(t[name])
            t[name], t[name + "_scale_inv"] = q, s
            deq[(i, k)] = q.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[: q.shape[0], : q.shape[1]]
    rewrite_tensors(d, t)
    cfg, params = load_hf_checkpoint(str(d))
    for (i, k), w in deq.items():
        got = np.asarray(model.layer_params(params, cfg, i)["self_attn"]["indexer"][k]["weight"])
        np.testing.assert_array_equal(got, w)
    for keep in (False, True):
        out = tmp_path / f"out{keep}"
        convert(str(d), str(out), dtype="fp32", keep_fp8=keep, log=None)
        assert_same_params(params, load_model(str(out))[1])


@pytest.mark.parametrize(
    "mutation,match",
    [
        ("missing", "missing tensor 'model.layers.2.self_attn.indexer.k_norm.bias'"),
        ("shape", r"model.layers.0.self_attn.indexer.wk.weight' has shape \(3, 4\)"),
        ("shared", "unexpected tensor 'model.layers.1.self_attn.indexer.wk.weight'"),
    ],
)
def test_bad_indexer_tensors_are_named(tmp_path, mutation, match):
    d = copy_fixture("glm_dsa", tmp_path)
    t = read_tensors(d)
    if mutation == "missing":
        del t["model.layers.2.self_attn.indexer.k_norm.bias"]
    elif mutation == "shape":
        t["model.layers.0.self_attn.indexer.wk.weight"] = np.ones((3, 4), np.float32)
    else:  # layer 1 shares layer 0's top-k: it has no indexer of its own
        t["model.layers.1.self_attn.indexer.wk.weight"] = t["model.layers.0.self_attn.indexer.wk.weight"]
    rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(str(d))


def test_export_roundtrip(tmp_path):
    """export_hf writes V3.2 checkpoints (indexer tensors, weights_proj in f32, the index fields in config.json)
    that load back to the same config and params."""
    import json

    from mla_jax.checkpoint import export_hf

    cfg, params = load_hf_checkpoint(os.path.join(FIXTURES, "v32"))
    tok = json.dumps({"model": {"vocab": {"a": 0, "<|endoftext|>": 1}}, "added_tokens": []})
    export_hf(params, cfg, tok, tmp_path, dtype="fp32")
    cfg2, got = load_hf_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    assert_same_params(params, got)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV32ForCausalLM"] and config["index_topk"] == cfg.index_topk
