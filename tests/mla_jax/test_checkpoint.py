"""The HF checkpoint loader: layouts (single, sharded, fused experts, FP8 blocks) and errors that name the tensor."""

import json
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from safetensors import safe_open

from mla_jax import model
from mla_jax.checkpoint import CheckpointError, SafetensorsFile, dequantize_fp8_blocks, load_hf_checkpoint, save_file
from tests.mla_jax.helpers import assert_same_params, copy_fixture, read_tensors, rewrite_tensors

E4M3 = ml_dtypes.float8_e4m3fn


def _raw_safetensors(path, header, data):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


# ------------------------------------------------- what the safetensors library does and does not do for us


def test_overlapping_offsets_are_rejected(tmp_path):
    """The library validates offsets: two tensors sharing bytes (our former reader accepted them) are refused."""
    p = tmp_path / "x.safetensors"
    _raw_safetensors(
        p,
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        bytes(12),
    )
    with pytest.raises(CheckpointError, match="x.safetensors: corrupted .*offset"):
        SafetensorsFile(p)


def test_gap_library_reads_no_fp8(tmp_path):
    """Why `SafetensorsFile` maps float8 bytes itself: the library returns no array for F8_E4M3 / F8_E5M2 in any
    framework we have (it looks the type up in numpy, which has none). Fails the day the library can."""
    w = np.arange(-8, 8, dtype=np.float32).reshape(4, 4).astype(E4M3)
    p = tmp_path / "w.safetensors"
    save_file({"w": w, "e": w.astype(ml_dtypes.float8_e5m2)}, p)
    for framework in ("numpy", "flax"):
        with safe_open(p, framework=framework) as f:
            for name in ("w", "e"):
                with pytest.raises(Exception, match="float8"):
                    f.get_tensor(name)
                with pytest.raises(Exception, match="float8"):
                    f.get_slice(name)[:1]
    f = SafetensorsFile(p)
    assert f.spec("w") == (np.dtype(E4M3), (4, 4))
    np.testing.assert_array_equal(f.get("w"), w)
    np.testing.assert_array_equal(f.get("w", (slice(1, 3),)), w[1:3])
    np.testing.assert_array_equal(f.get("e"), w.astype(ml_dtypes.float8_e5m2))


def test_gap_library_writes_strided_arrays_as_their_buffer_owner_only(tmp_path):
    """Why `save_file` wraps the library's: it writes a transposed view's buffer as it is, and the file it renames
    into place is 0600 whatever the umask. Fails the day the library writes the array's values with the usual
    permissions."""
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    lib, ours, plain = tmp_path / "lib.safetensors", tmp_path / "ours.safetensors", tmp_path / "plain"
    safetensors.numpy.save_file({"t": a.T}, lib)
    with safe_open(lib, framework="numpy") as f:
        assert not np.array_equal(f.get_tensor("t"), a.T)
    plain.write_bytes(b"")  # the mode open() gives a new file
    if os.stat(plain).st_mode & 0o777 != 0o600:
        assert os.stat(lib).st_mode & 0o777 == 0o600
    save_file({"t": a.T}, ours)
    np.testing.assert_array_equal(SafetensorsFile(ours).get("t"), a.T)
    assert os.stat(ours).st_mode == os.stat(plain).st_mode


def test_reads_only_the_slice_asked_for(tmp_path):
    t = {"f": np.arange(24, dtype=np.float32).reshape(2, 3, 4), "b": np.ones((3, 2), ml_dtypes.bfloat16)}
    save_file(t, tmp_path / "x.safetensors")
    f = SafetensorsFile(tmp_path / "x.safetensors")
    np.testing.assert_array_equal(f.get("f", (slice(1, 2), slice(0, 2))), t["f"][1:2, 0:2])
    assert f.get("b").dtype == ml_dtypes.bfloat16 and f.nbytes("b") == 12 and f.nbytes("f") == 96


# -------------------------------------------------------------------------------------------- the loader


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
    mtp = f"model.layers.{cfg.num_hidden_layers}."  # one MTP layer, declared by num_nextn_predict_layers
    for k in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        t[mtp + k] = np.ones((4,), ml_dtypes.bfloat16)
    rewrite_tensors(d, t)
    hf_cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**hf_cfg, "num_nextn_predict_layers": 1}))
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
    np.testing.assert_array_equal(
        np.asarray(got["model"]["dense_layers"]["self_attn"]["q_proj"]["weight"][0]), q.astype(np.float32)
    )
    del t[name + "_scale_inv"]
    rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match="q_proj.weight_scale_inv"):
        load_hf_checkpoint(str(d))


@pytest.mark.parametrize(
    "mutation,match",
    [
        ("missing", "missing tensor 'model.layers.1.self_attn.o_proj.weight'"),
        ("unexpected", "unexpected tensor 'model.layers.0.bogus.weight'"),
        ("shape", r"model.layers.0.self_attn.kv_b_proj.weight' has shape \(3, 4\)"),
        ("dtype", "model.norm.weight' has dtype int32"),
    ],
)
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
    t = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.ones(5, ml_dtypes.bfloat16),
        "c": np.full((2, 2), 1.5, ml_dtypes.float8_e4m3fn),
    }
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
