"""The HF checkpoint loader: layouts (single, sharded, fused experts, FP8 blocks) and errors that name the tensor."""
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mla_jax import model
from mla_jax.checkpoint import dequantize_fp8_blocks, load_hf_checkpoint
from mla_jax.safetensors_io import CheckpointError, SafetensorsFile, save_file
from tests.mla_jax.helpers import assert_same_params, copy_fixture, read_tensors, rewrite_tensors










def test_sharded_equals_single_file(tmp_path):
    d = copy_fixture("v3", tmp_path)
    assert os.path.exists(d / "model.safetensors.index.json")
    cfg, sharded = load_hf_checkpoint(str(d))
    rewrite_tensors(d, read_tensors(d))
    _, single = load_hf_checkpoint(str(d))
    assert_same_params(sharded, single)


def test_fused_expert_layout(tmp_path):
    d = copy_fixture("v3", tmp_path)
    cfg, want = load_hf_checkpoint(str(d))
    t = read_tensors(d)
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        m = f"model.layers.{layer}.mlp.experts."
        E = cfg.n_routed_experts
        g = [t.pop(f"{m}{j}.gate_proj.weight") for j in range(E)]
        u = [t.pop(f"{m}{j}.up_proj.weight") for j in range(E)]
        dn = [t.pop(f"{m}{j}.down_proj.weight") for j in range(E)]
        t[m + "gate_up_proj"] = np.concatenate([np.stack(g), np.stack(u)], axis=1)
        t[m + "down_proj"] = np.stack(dn)
    rewrite_tensors(d, t)
    _, got = load_hf_checkpoint(str(d))
    assert_same_params(want, got)


def test_bf16_cast_and_mtp_skipped(tmp_path):
    d = copy_fixture("v2_lite", tmp_path)
    cfg, p32 = load_hf_checkpoint(str(d))
    t = {k: v.astype(ml_dtypes.bfloat16) for k, v in read_tensors(d).items()}
    t[f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"] = np.ones((4, 4), ml_dtypes.bfloat16)  # MTP
    rewrite_tensors(d, t)
    _, p16 = load_hf_checkpoint(str(d))
    w = p16["model"]["dense_layers"]["self_attn"]["q_proj"]["weight"]
    assert w.dtype == jnp.bfloat16
    assert p16["model"]["moe_layers"]["mlp"]["gate"]["weight"].dtype == jnp.float32  # router stays f32
    ids = jnp.arange(9)[None] % cfg.vocab_size
    a = model.forward(p32, cfg, ids)
    b = model.forward(p16, cfg, ids)
    assert float(jnp.abs(a - b).max()) < 0.5  # bf16 weights: close, not equal


def test_fp8_block_dequant_with_partial_blocks():
    rng = np.random.default_rng(0)
    M, K = 200, 130  # not multiples of 128
    w = rng.normal(size=(M, K)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(0.5, 2, size=(2, 2)).astype(np.float32)
    got = dequantize_fp8_blocks(w, s)
    want = w.astype(np.float32).copy()
    for i in range(M):
        for j in range(K):
            want[i, j] *= s[i // 128, j // 128]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(CheckpointError, match="scale_inv"):
        dequantize_fp8_blocks(w, s[:1], name="w")


def test_fp8_weights_load(tmp_path):
    d = copy_fixture("v2_lite", tmp_path)
    cfg, want = load_hf_checkpoint(str(d))
    t = read_tensors(d)
    name = "model.layers.0.self_attn.q_proj.weight"
    w = t[name]
    q = w.astype(ml_dtypes.float8_e4m3fn)
    t[name] = q
    t[name + "_scale_inv"] = np.ones((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), np.float32)
    rewrite_tensors(d, t)
    _, got = load_hf_checkpoint(str(d))
    np.testing.assert_array_equal(np.asarray(got["model"]["dense_layers"]["self_attn"]["q_proj"]["weight"][0]),
                                  q.astype(np.float32))
    del t[name + "_scale_inv"]
    rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match="q_proj.weight_scale_inv"):
        load_hf_checkpoint(str(d))


@pytest.mark.parametrize("mutation,match", [
    ("missing", "missing tensor 'model.layers.1.self_attn.o_proj.weight'"),
    ("unexpected", "unexpected tensor 'model.layers.0.bogus.weight'"),
    ("shape", r"model.layers.0.self_attn.kv_b_proj.weight' has shape \(3, 4\)"),
    ("dtype", "model.norm.weight' has dtype int32"),
])
def test_bad_tensors_are_named(tmp_path, mutation, match):
    d = copy_fixture("v2", tmp_path)
    t = read_tensors(d)
    if mutation == "missing":
        del t["model.layers.1.self_attn.o_proj.weight"]
    elif mutation == "unexpected":
        t["model.layers.0.bogus.weight"] = np.ones(3, np.float32)
    elif mutation == "shape":
        t["model.layers.0.self_attn.kv_b_proj.weight"] = np.ones((3, 4), np.float32)
    else:
        t["model.norm.weight"] = np.ones(t["model.norm.weight"].shape, np.int32)
    rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match=match):
        load_hf_checkpoint(str(d))


def test_truncated_and_corrupted_files(tmp_path):
    d = copy_fixture("v2", tmp_path)
    path = d / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_checkpoint(str(d))
    path.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="truncated"):
        load_hf_checkpoint(str(d))
    path.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    with pytest.raises(CheckpointError, match="corrupted"):
        load_hf_checkpoint(str(d))


def test_roundtrip_writer(tmp_path):
    t = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, ml_dtypes.bfloat16),
         "c": np.full((2, 2), 1.5, ml_dtypes.float8_e4m3fn)}
    save_file(t, tmp_path / "x.safetensors", metadata={"format": "np"})
    f = SafetensorsFile(tmp_path / "x.safetensors")
    for k, v in t.items():
        assert f.get(k).dtype == v.dtype
        np.testing.assert_array_equal(f.get(k), v)
    assert f.metadata == {"format": "np"}


def test_index_pointing_to_wrong_shard(tmp_path):
    d = copy_fixture("v3", tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    shards = sorted(set(idx["weight_map"].values()))
    idx["weight_map"][k] = next(s for s in shards if s != idx["weight_map"][k])
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=k):
        load_hf_checkpoint(str(d))
