"""HF -> orbax conversion: parity with the direct loader, FP8 block dequantization, streaming memory, safety
against interruption, validation errors, the CLI, and restore onto an 8-device tensor-parallel mesh.

Params must be *equal* to the direct loader's (`load_hf_checkpoint`): the conversion only moves and casts data.
Logits on a mesh differ from single-device ones by reduction order only: float32 logits of magnitude ~12,
|diff| <= 1e-4 (measured ~1e-5).
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from mla_jax import model
from mla_jax.checkpoint import (
    CheckpointDir,
    CheckpointError,
    ConvertError,
    SafetensorsFile,
    build_params,
    convert,
    hf_tensor_specs,
    load_checkpoint,
    load_hf_checkpoint,
    load_model,
    read_metadata,
    save_file,
)
from mla_jax.config import ConfigError, DeepseekConfig
from mla_jax.sharding import param_shardings
from tests.mla_jax.helpers import FIXTURES, assert_same_params, copy_fixture, read_tensors, rewrite_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_fp8")
ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
E4M3 = ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------------------------------- helpers


def _prompt(name):
    """The fixture's first prompt and HF's float64 logits for it (the same call as test_hf_parity's, so the
    forward's compilation is shared when both files run)."""
    ref = SafetensorsFile(os.path.join(FIXTURES, name, "reference.safetensors"))
    return jnp.asarray(ref.get("input_ids_0"))[None], np.asarray(ref.get("logits_0"))


def _quiet(**kw):
    return dict(log=None, progress=False, **kw)


def _no_output(out):
    parent = os.path.dirname(out)
    assert not os.path.exists(out)
    assert not [f for f in os.listdir(parent) if f.startswith("." + os.path.basename(out) + ".")]


def ref_dequant(w8, s, block=(128, 128)):
    """Independent reference: an explicit loop over 128x128 blocks (edge blocks partial)."""
    w = np.asarray(w8).astype(np.float32)
    out = np.empty_like(w)
    bm, bk = block
    for i in range(0, w.shape[-2], bm):
        for j in range(0, w.shape[-1], bk):
            out[..., i : i + bm, j : j + bk] = (
                w[..., i : i + bm, j : j + bk] * np.asarray(s)[..., i // bm, j // bk, None, None]
            )
    return out


def quantize(w, rng, block=128):
    """float [..., M, K] -> e4m3 + float32 scale_inv with scale = block amax / 448, blocks given distinct
    magnitudes so a wrong block index shows."""
    w = (
        w
        * rng.uniform(0.25, 4.0, size=(*w.shape[:-2], -(-w.shape[-2] // block), -(-w.shape[-1] // block)))
        .repeat(block, -2)
        .repeat(block, -1)[..., : w.shape[-2], : w.shape[-1]]
    )
    s = np.zeros((*w.shape[:-2], -(-w.shape[-2] // block), -(-w.shape[-1] // block)), np.float32)
    q = np.zeros(w.shape, E4M3)
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            blk = w[..., i * block : (i + 1) * block, j * block : (j + 1) * block]
            amax = np.abs(blk).max(axis=(-1, -2))
            s[..., i, j] = amax / 448.0
            q[..., i * block : (i + 1) * block, j * block : (j + 1) * block] = (blk / s[..., i, j, None, None]).astype(
                E4M3
            )
    return q, s


def write_synthetic(d, cfg_dict, *, shard_bytes=None, seed=0, fp8=False, fused=False):
    """A random HF checkpoint for `cfg_dict` (float32; with fp8=True every layer *_proj weight is block-fp8)."""
    os.makedirs(d, exist_ok=True)
    cfg = DeepseekConfig.from_dict(cfg_dict)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_tensor_specs(cfg).items():
        if len(shape) == 1:
            x = (0.1 if "bias" in name else 1.0) + 0.1 * rng.standard_normal(shape, np.float32)
        else:
            x = (rng.standard_normal(shape, np.float32) / np.sqrt(shape[-1])).astype(np.float32)
        if (
            fp8
            and name.startswith("model.layers.")
            and name.endswith("_proj.weight")
            or (fp8 and name.endswith("kv_a_proj_with_mqa.weight"))
        ):
            tensors[name], tensors[name + "_scale_inv"] = quantize(x, rng)
        else:
            tensors[name] = x
    if fused:
        for i in range(cfg.num_hidden_layers):
            if not cfg.is_moe_layer(i):
                continue
            m = f"model.layers.{i}.mlp.experts."
            E = cfg.n_routed_experts
            get = [tensors.pop(f"{m}{j}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj") for j in range(E)]
            for j in range(E):
                for p in ("gate_proj", "up_proj", "down_proj"):
                    tensors.pop(f"{m}{j}.{p}.weight_scale_inv", None)
            gate, up, down = (np.stack(get[k * E : (k + 1) * E]).astype(np.float32) for k in range(3))
            gu = np.concatenate([gate, up], axis=1)
            if fp8:
                tensors[m + "gate_up_proj"], tensors[m + "gate_up_proj_scale_inv"] = quantize(gu, rng)
                tensors[m + "down_proj"], tensors[m + "down_proj_scale_inv"] = quantize(down, rng)
            else:
                tensors[m + "gate_up_proj"], tensors[m + "down_proj"] = gu, down
    names = list(tensors)
    shards, cur, size = [], [], 0
    for n in names:
        if cur and shard_bytes and size + tensors[n].nbytes > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += tensors[n].nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(tensors, os.path.join(d, "model.safetensors"))
    else:
        weight_map = {}
        for k, part in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n] for n in part}, os.path.join(d, fname))
            weight_map.update({n: fname for n in part})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg_dict, f)
    return cfg, tensors


# ----------------------------------------------------------------------------- parity with the direct loader


@pytest.mark.parametrize("name", ["v2", "v2_lite", "v3"])
def test_fixtures_roundtrip_equal_direct_loader(tmp_path, name):
    src = os.path.join(FIXTURES, name)
    out = str(tmp_path / "out")
    # v3 in many small groups (experts in chunks of 6 and 2): layers span groups; v2 / v2_lite in one group.
    res = convert(src, out, dtype="fp32", max_group_mb=0.05 if name == "v3" else 2048, **_quiet())
    cfg, got = load_checkpoint(out)
    cfg_direct, want = load_hf_checkpoint(src)
    assert cfg == cfg_direct
    assert_same_params(got, want)
    ids, hf_logits = _prompt(name)
    a = np.asarray(model.forward(got, cfg, ids)[0])
    b = np.asarray(model.forward(want, cfg, ids)[0])
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, hf_logits, atol=2e-4, rtol=0)  # and HF's own logits (test_hf_parity's bound)
    # The converted directory: HF config verbatim, metadata, one orbax checkpoint per group.
    with open(os.path.join(src, "config.json"), "rb") as f1, open(os.path.join(out, "config.json"), "rb") as f2:
        assert f1.read() == f2.read()
    meta = read_metadata(out)
    assert meta["dtype"] == "float32" and meta["keep_fp8"] is False
    assert {"jax", "orbax-checkpoint", "numpy"} <= set(meta["versions"])
    assert meta["tensors"]["source"] == len(CheckpointDir(src).keys())
    assert meta["tensors"]["skipped_mtp"] == 0 and meta["tensors"]["params"] == res.params
    n_files = 3 if name == "v3" else 1  # v3 is sharded with model.safetensors.index.json
    assert len(meta["source"]["files"]) == n_files
    groups = sorted(os.listdir(os.path.join(out, "params")))
    assert groups == sorted(g["name"] for g in meta["groups"]) and len(groups) == res.groups
    if name == "v3":
        assert res.groups > 10 and res.largest_group_bytes < res.stored_bytes / 6  # a dense layer's core
        assert [u["experts"] for u in meta["units"] if "experts-up_proj" in u["key"]] == [[0, 6], [6, 8]] * 2
    else:
        assert res.groups == 1


def test_bf16_default_tokenizer_and_load_model(tmp_path):
    src = copy_fixture("v3", tmp_path)
    (src / "tokenizer.json").write_text('{"version": "1.0"}')
    (src / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    out = str(tmp_path / "out")
    convert(str(src), out, **_quiet())  # default dtype bf16
    assert open(os.path.join(out, "tokenizer.json")).read() == '{"version": "1.0"}'
    assert os.path.exists(os.path.join(out, "tokenizer_config.json"))
    cfg, got = load_model(out)
    _, want = load_hf_checkpoint(str(src), dtype=jnp.bfloat16)
    assert_same_params(got, want)
    assert got["model"]["moe_layers"]["mlp"]["gate"]["weight"].dtype == jnp.float32  # router stays f32
    # dtype on load casts (here bf16 -> f32: exact); load_model accepts the HF directory too.
    _, up = load_model(out, dtype="fp32")
    assert_same_params(up, jax.tree.map(lambda x: x.astype(jnp.float32), want))
    _, hf = load_model(str(src), dtype=jnp.bfloat16)
    assert_same_params(hf, want)


def test_fused_expert_layout(tmp_path):
    d = copy_fixture("v3", tmp_path)
    cfg, want = load_hf_checkpoint(str(d))
    t = read_tensors(d)
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        m = f"model.layers.{layer}.mlp.experts."
        E = cfg.n_routed_experts
        g, u, dn = ([t.pop(f"{m}{j}.{p}.weight") for j in range(E)] for p in ("gate_proj", "up_proj", "down_proj"))
        t[m + "gate_up_proj"] = np.concatenate([np.stack(g), np.stack(u)], axis=1)
        t[m + "down_proj"] = np.stack(dn)
    rewrite_tensors(d, t)
    out = str(tmp_path / "out")
    convert(str(d), out, dtype="fp32", **_quiet())
    assert read_metadata(out)["source"]["fused_experts"] is True
    _, got = load_checkpoint(out)
    assert_same_params(got, want)


# ------------------------------------------------------------------------------------------------------ FP8


def _fp8_reference_params(src, cfg, dtype):
    """Our params built from the fixture with the test's own loop dequantization."""
    ck = CheckpointDir(src)

    def get(n):
        w = np.asarray(ck.get(n))
        if w.dtype == E4M3:
            return ref_dequant(w, ck.get(n + "_scale_inv"))
        return w

    return build_params(get, cfg, fused_experts=False, dtype=dtype)


def test_fp8_fixture_dequantized_and_kept(tmp_path, capsys):
    cfg = DeepseekConfig.from_json(FP8_FIXTURE)
    assert cfg.quantization.weight_block_size == (128, 128)
    ck = CheckpointDir(FP8_FIXTURE)
    assert os.path.exists(os.path.join(FP8_FIXTURE, "model.safetensors.index.json"))
    assert ck.spec("model.layers.0.self_attn.q_b_proj.weight")[0] == np.dtype(E4M3)
    mtp = [n for n in ck.keys() if n.startswith(f"model.layers.{cfg.num_hidden_layers}.")]
    assert mtp

    out = str(tmp_path / "fp32")
    convert(FP8_FIXTURE, out, dtype="fp32", progress=False, log=sys.stderr)
    assert f"skipping {len(mtp)} MTP tensors (model.layers.4.*)" in capsys.readouterr().err
    meta = read_metadata(out)
    assert meta["tensors"]["skipped_mtp"] == len(mtp)
    assert meta["source"]["quantization_config"]["fmt"] == "e4m3"
    _, got = load_checkpoint(out)
    assert_same_params(got, _fp8_reference_params(FP8_FIXTURE, cfg, jnp.float32))

    # Logits stay close to the float v3 model's it was quantized from (e4m3 keeps 3 mantissa bits: measured
    # correlation 0.994, same argmax; a wrong block scale gives ~0). `quantization` does not change the
    # forward, so dropping it shares the v3 compilation.
    ids, v3_logits = _prompt("v3")
    logits = np.asarray(model.forward(got, dataclasses.replace(cfg, quantization=None), ids)[0])
    assert np.corrcoef(logits.ravel(), v3_logits.ravel())[0, 1] > 0.98
    assert (logits.argmax(-1) == v3_logits.argmax(-1)).mean() >= 0.8

    # --keep-fp8: e4m3 + scale_inv on disk, dequantized on restore; equals dequantizing at conversion.
    keep = str(tmp_path / "keep")
    convert(FP8_FIXTURE, keep, keep_fp8=True, **_quiet())
    meta = read_metadata(keep)
    assert meta["keep_fp8"] is True and meta["dtype"] == "bfloat16"
    stored = {tuple(lf["path"]): lf["dtype"] for u in meta["units"] for lf in u["leaves"]}
    assert stored[("mlp", "experts", "gate_proj", "weight")] == "float8_e4m3fn"
    assert stored[("mlp", "experts", "gate_proj", "weight_scale_inv")] == "float32"
    assert stored[("self_attn", "o_proj", "weight")] == "float8_e4m3fn"
    assert (
        stored[
            (
                "self_attn",
                "W_UK_T",
            )
        ]
        == "bfloat16"
    )  # kv_b_proj is always dequantized (split per head)
    assert meta["bytes"]["stored"] < read_metadata(out)["bytes"]["stored"] / 2
    _, k32 = load_checkpoint(keep, dtype="fp32")
    _, bf = load_hf_checkpoint(FP8_FIXTURE, dtype=jnp.bfloat16)
    _, kbf = load_checkpoint(keep)
    assert_same_params(kbf, bf)
    # fp32 restore of the kept fp8 = the fp32 conversion, except leaves stored as bf16 at conversion.
    flat_keep = dict(jax.tree.flatten_with_path(k32)[0])
    for path, x in jax.tree.flatten_with_path(got)[0]:
        k = jax.tree_util.keystr(path)
        if "W_U" in k or "norm" in k or "embed" in k or "lm_head" in k:
            continue
        np.testing.assert_array_equal(np.asarray(flat_keep[path]), np.asarray(x), err_msg=k)


FP8_CFG = dict(
    model_type="deepseek_v3",
    vocab_size=64,
    hidden_size=200,
    num_hidden_layers=2,
    num_attention_heads=2,
    q_lora_rank=136,
    kv_lora_rank=160,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    intermediate_size=264,
    moe_intermediate_size=136,
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    max_position_embeddings=64,
    quantization_config={
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_multiblock_partial_edges(tmp_path, fused):
    """Dims 200, 136, 160, 264, 272: several 128-blocks with partial edges; fused gate_up splits mid-block."""
    src = str(tmp_path / "hf")
    cfg, t = write_synthetic(src, FP8_CFG, fp8=True, fused=fused, seed=7)
    assert t["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)  # [264, 200]
    out = str(tmp_path / "out")
    convert(src, out, dtype="fp32", max_group_mb=0.25, **_quiet())  # experts in chunks of 2 (109 KB each)
    assert [u["experts"] for u in read_metadata(out)["units"] if "up_proj" in u["key"]] == [[0, 2], [2, 4]]
    _, got = load_checkpoint(out)

    def get(n):
        w = t[n]
        return ref_dequant(w, t[n + "_scale_inv"]) if w.dtype == E4M3 else w

    want = build_params(get, cfg, fused_experts=fused, dtype=jnp.float32)
    assert_same_params(got, want)
    if fused:  # gate/up split at row 136 inside a 128-row block: the scales cannot be split
        with pytest.raises(ConvertError, match="gate_up_proj': cannot keep fp8 .* row 136"):
            convert(src, str(tmp_path / "keep"), keep_fp8=True, **_quiet())
        _no_output(str(tmp_path / "keep"))
    else:
        keep = str(tmp_path / "keep")
        convert(src, keep, keep_fp8=True, **_quiet())
        _, k = load_checkpoint(keep, dtype="fp32")
        e = ("model", "moe_layers", "mlp", "experts", "down_proj", "weight")
        np.testing.assert_array_equal(
            np.asarray(k["model"]["moe_layers"]["mlp"]["experts"]["down_proj"]["weight"]),
            np.asarray(got["model"]["moe_layers"]["mlp"]["experts"]["down_proj"]["weight"]),
            err_msg=str(e),
        )


# ------------------------------------------------------------------------------------------ mesh / sharding


def test_restore_on_tensor_parallel_mesh(tmp_path):
    assert jax.device_count() == 8
    src = os.path.join(FIXTURES, "v3")
    out = str(tmp_path / "out")
    convert(src, out, dtype="fp32", **_quiet())
    cfg, single = load_checkpoint(out)
    devs = np.array(jax.devices())

    # dp=2 x tp=4: 4 heads, vocab 256, intermediate 96 / 32 divide by 4; the 8 experts over all 8 devices.
    mesh = Mesh(devs.reshape(2, 4), ("dp", "tp"))
    _, sharded = load_checkpoint(out, mesh=mesh)
    want = param_shardings(sharded, cfg, mesh)
    for (path, x), s in zip(jax.tree.flatten_with_path(sharded)[0], jax.tree.leaves(want)):
        assert x.sharding == s, jax.tree_util.keystr(path)
    m = sharded["model"]
    tp = "tp"
    assert m["moe_layers"]["self_attn"]["W_UK_T"].sharding.spec == PartitionSpec(None, tp, None, None)
    assert m["moe_layers"]["self_attn"]["W_UV"].sharding.spec == PartitionSpec(None, tp, None, None)
    assert m["dense_layers"]["self_attn"]["q_b_proj"]["weight"].sharding.spec == PartitionSpec(None, tp, None)
    assert m["dense_layers"]["self_attn"]["o_proj"]["weight"].sharding.spec == PartitionSpec(None, None, tp)
    # routed experts split by expert over every device (dp outermost: expert parallelism across the DP ranks)
    experts = PartitionSpec(None, ("dp", tp), None, None)
    assert m["moe_layers"]["mlp"]["experts"]["gate_proj"]["weight"].sharding.spec == experts
    assert m["embed_tokens"]["weight"].sharding.spec == PartitionSpec(tp, None)
    assert sharded["lm_head"]["weight"].sharding.spec == PartitionSpec(tp, None)
    assert m["norm"]["weight"].sharding.is_fully_replicated
    assert m["moe_layers"]["self_attn"]["kv_a_proj_with_mqa"]["weight"].sharding.is_fully_replicated
    assert m["moe_layers"]["mlp"]["gate"]["weight"].sharding.is_fully_replicated
    w = m["moe_layers"]["mlp"]["experts"]["gate_proj"]["weight"]
    assert w.addressable_shards[0].data.shape == (2, 1, 32, 64)  # [layers, E/8, I, D]
    assert_same_params(jax.tree.map(np.asarray, sharded), jax.tree.map(np.asarray, single))
    ids, _ = _prompt("v3")
    a = np.asarray(model.forward(single, cfg, ids))
    b = np.asarray(model.forward(sharded, cfg, ids))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4)

    # tp=8: heads (4) do not divide -> attention replicated; experts (8), vocab (256) still split. (Loaded from
    # the HF directory: load_model places it with the same layout.)
    mesh8 = Mesh(devs.reshape(1, 8), ("dp", "tp"))
    _, s8 = load_model(src, mesh=mesh8)
    for x, s in zip(jax.tree.leaves(s8), jax.tree.leaves(param_shardings(s8, cfg, mesh8))):
        assert x.sharding == s
    m8 = s8["model"]
    assert m8["moe_layers"]["self_attn"]["W_UK_T"].sharding.is_fully_replicated
    assert m8["moe_layers"]["self_attn"]["o_proj"]["weight"].sharding.is_fully_replicated
    assert m8["moe_layers"]["mlp"]["experts"]["down_proj"]["weight"].sharding.spec == PartitionSpec(
        None, tp, None, None
    )
    assert m8["embed_tokens"]["weight"].sharding.spec == PartitionSpec(tp, None)
    with pytest.raises(ValueError, match="no 'tp' axis"):  # (a "dp"-only mesh is DP attention with EP over dp)
        param_shardings(single, cfg, Mesh(devs, ("sp",)))


# ------------------------------------------------------------------------------------------------- errors


def _mutate(d, what):
    t = read_tensors(d)
    cfgp = os.path.join(d, "config.json")
    cfg = json.loads(open(cfgp).read())
    q = "model.layers.0.self_attn.q_a_proj.weight"
    if what == "missing":
        del t["model.layers.1.self_attn.o_proj.weight"]
    elif what == "unexpected":
        t["model.layers.0.bogus.weight"] = np.ones(3, np.float32)
    elif what == "shape":
        t["model.layers.0.self_attn.kv_b_proj.weight"] = np.ones((3, 4), np.float32)
    elif what == "dtype":
        t["model.norm.weight"] = np.ones(t["model.norm.weight"].shape, np.int32)
    elif what == "nan":
        t["model.layers.2.mlp.experts.5.up_proj.weight"][3, 4] = np.nan
    elif what == "e5m2":
        t[q] = t[q].astype(ml_dtypes.float8_e5m2)
    elif what == "no_scale":
        t[q] = t[q].astype(E4M3)
    elif what == "scale_shape":
        t[q], t[q + "_scale_inv"] = t[q].astype(E4M3), np.ones((2, 2), np.float32)
    elif what == "scale_for_float":
        t[q + "_scale_inv"] = np.ones((1, 1), np.float32)
    elif what == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    elif what == "fmt_e5m2":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}
    if what in ("awq", "fmt_e5m2"):
        open(cfgp, "w").write(json.dumps(cfg))
    else:
        rewrite_tensors(d, t)


@pytest.mark.parametrize(
    "what,error,match",
    [
        ("missing", CheckpointError, "missing tensor 'model.layers.1.self_attn.o_proj.weight'"),
        ("unexpected", CheckpointError, "unexpected tensor 'model.layers.0.bogus.weight'"),
        ("shape", CheckpointError, r"'model.layers.0.self_attn.kv_b_proj.weight' has shape \(3, 4\)"),
        ("dtype", CheckpointError, "'model.norm.weight' has dtype int32"),
        ("nan", CheckpointError, "'model.layers.2.mlp.experts.5.up_proj.weight' contains NaN"),
        (
            "e5m2",
            CheckpointError,
            "'model.layers.0.self_attn.q_a_proj.weight' is float8_e5m2: unsupported quantization",
        ),
        (
            "no_scale",
            CheckpointError,
            "q_a_proj.weight' is fp8 but 'model.layers.0.self_attn.q_a_proj.weight_scale_inv' is missing",
        ),
        ("scale_shape", CheckpointError, r"q_a_proj.weight_scale_inv' has shape \(2, 2\), expected \(1, 1\)"),
        ("scale_for_float", CheckpointError, "q_a_proj.weight_scale_inv' is a block scale but"),
        ("awq", ConfigError, "quant_method 'awq' is not supported"),
        ("fmt_e5m2", ConfigError, "fmt 'e5m2' is not supported"),
    ],
)
def test_errors_name_the_tensor_and_leave_nothing(tmp_path, what, error, match):
    d = copy_fixture("v2", tmp_path)
    _mutate(d, what)
    out = str(tmp_path / "out")
    with pytest.raises(error, match=match):
        convert(str(d), out, **_quiet())
    _no_output(out)  # validated before writing, or (NaN, found mid-way) the partial directory removed


def test_truncated_and_corrupted_files(tmp_path):
    d = copy_fixture("v3", tmp_path)
    shard = d / "model-00002-of-00003.safetensors"
    data = shard.read_bytes()
    out = str(tmp_path / "out")
    shard.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: truncated: tensor"):
        convert(str(d), out, **_quiet())
    shard.write_bytes(data[:8] + b"\xff" * 32 + data[40:])
    with pytest.raises(CheckpointError, match="corrupted"):
        convert(str(d), out, **_quiet())
    _no_output(out)


def test_output_directory_rules(tmp_path):
    src = os.path.join(FIXTURES, "v2")
    out = tmp_path / "out"
    convert(src, str(out), dtype="fp32", **_quiet())
    created = read_metadata(str(out))["created"]
    with pytest.raises(ConvertError, match="already exists; pass --force"):
        convert(src, str(out), **_quiet())
    assert read_metadata(str(out))["created"] == created
    convert(src, str(out), force=True, **_quiet())  # replaced: now bf16
    assert read_metadata(str(out))["dtype"] == "bfloat16"
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no partial or old directory left
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ConvertError, match="not an mla-jax checkpoint .* refusing"):
        convert(src, str(other), force=True, **_quiet())
    assert (other / "notes.txt").read_text() == "keep me"
    with pytest.raises(ConvertError, match="must not be the HF directory"):
        convert(src, os.path.join(src, "sub"), **_quiet())
    # A converted checkpoint missing a group is refused, naming the group.
    shutil.rmtree(out / "params" / "group_00000")
    with pytest.raises(CheckpointError, match="group 'group_00000' is missing"):
        load_checkpoint(str(out))


# ---------------------------------------------------------------------------------------------------- CLI


def _cli(*args, env=None, **kw):
    return subprocess.run(
        [sys.executable, "-m", "mla_jax.cli", *args],
        capture_output=True,
        text=True,
        env=env or ENV,
        cwd=ROOT,
        timeout=120,
        **kw,
    )


def test_cli_convert_dry_run_help_and_errors(tmp_path, capsys):
    from mla_jax.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "convert" in capsys.readouterr().out
    r = _cli("convert", "--help")
    assert r.returncode == 0
    for opt in ("--dtype {bf16,fp32}", "--keep-fp8", "--dry-run", "--force", "HF_DIR", "OUT_DIR"):
        assert opt in r.stdout, opt

    out = str(tmp_path / "out")
    r = _cli("convert", FP8_FIXTURE, out, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(out)
    assert (
        "model.layers.{2..3}.mlp.experts.{0..7}.gate_proj.weight -> model/moe_layers/mlp/experts/gate_proj/"
        "weight [2, 8, 32, 64] bfloat16  (fp8 dequantized)"
    ) in r.stdout
    assert "-> model/dense_layers/self_attn/W_UK_T [2, 4, 16, 32] bfloat16" in r.stdout
    assert "skipping 5 MTP tensors (model.layers.4.*)" in r.stdout

    r = _cli("convert", os.path.join(FIXTURES, "v2"), out, "--dtype", "fp32")
    assert r.returncode == 0, r.stderr
    assert "converting 100.0%" in r.stderr and "/s" in r.stderr and f"wrote {out}" in r.stderr
    _, got = load_model(out)
    _, want = load_hf_checkpoint(os.path.join(FIXTURES, "v2"))
    assert_same_params(got, want)

    r = _cli("convert", os.path.join(FIXTURES, "v2"), out)
    assert r.returncode == 1
    assert r.stderr.strip() == f"mla-jax convert: error: {out} already exists; pass --force to replace it"
    assert main(["convert", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 1
    assert "mla-jax convert: error: config.json not found" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ interruption safety


PAUSED = "paused by the test hook"
# `mla-jax convert ARGS`, with an `on_group_written` hook that stops the conversion after N groups are on disk.
PAUSING_CLI = f"""
import functools, signal, sys
import mla_jax.checkpoint
from mla_jax.cli import main

def pause(written):
    if written == int(sys.argv[1]):
        print({PAUSED!r}, file=sys.stderr, flush=True)
        signal.pause()  # until the test's signal

mla_jax.checkpoint.convert = functools.partial(mla_jax.checkpoint.convert, on_group_written=pause)
sys.exit(main(["convert", *sys.argv[2:]]))
"""


def _run_until_paused(args, pause_after, sig=signal.SIGKILL):
    """Start the CLI, wait until the test hook says it paused after `pause_after` groups, then kill it."""
    p = subprocess.Popen(
        [sys.executable, "-c", PAUSING_CLI, str(pause_after), *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
        cwd=ROOT,
    )
    watchdog = threading.Timer(90, p.kill)
    watchdog.start()
    try:
        paused = any(PAUSED in line for line in iter(p.stderr.readline, ""))
    finally:
        os.kill(p.pid, sig)
        p.wait(timeout=60)
        watchdog.cancel()
        p.stderr.close()
    assert paused, "the conversion never reached the pause hook"
    return p.pid


def test_interrupted_conversion_is_never_loadable_and_rerun_replaces_it(tmp_path):
    src = os.path.join(FIXTURES, "v3")
    out = tmp_path / "out"
    pid = _run_until_paused([src, str(out), "--dtype", "fp32", "--max-group-mb", "0.05"], pause_after=5)
    assert not out.exists()
    partial = tmp_path / f".out.partial-{pid}"
    assert partial.is_dir() and len(os.listdir(partial / "params")) == 5
    with pytest.raises(CheckpointError, match="not a converted mla-jax checkpoint"):
        load_checkpoint(str(partial))
    with pytest.raises(CheckpointError, match="neither a converted"):
        load_model(str(partial))
    # Rerun (no --force needed: OUT does not exist): the stale partial directory is removed.
    convert(src, str(out), dtype="fp32", **_quiet())
    assert sorted(os.listdir(tmp_path)) == ["out"]
    _, got = load_model(str(out))
    _, want = load_hf_checkpoint(src)
    assert_same_params(got, want)

    # Terminating a --force run (SIGTERM unwinds: it removes its own partial directory) leaves the existing
    # checkpoint untouched; so would SIGKILL, as OUT is only swapped once the new one is complete.
    created = read_metadata(str(out))["created"]
    _run_until_paused([src, str(out), "--force", "--max-group-mb", "0.05"], pause_after=3, sig=signal.SIGTERM)
    assert read_metadata(str(out))["created"] == created
    assert sorted(os.listdir(tmp_path)) == ["out"]
    _, again = load_model(str(out))
    assert_same_params(again, want)
    convert(src, str(out), force=True, **_quiet())
    assert sorted(os.listdir(tmp_path)) == ["out"] and read_metadata(str(out))["dtype"] == "bfloat16"


# -------------------------------------------------------------------------------------------- streaming


# 10 layers, 16 experts x 192 x 256: ~100 MB float32 in 8 MB shards; the largest group is one 3 MB expert stack.
BIG_CFG = dict(
    model_type="deepseek_v3",
    vocab_size=2048,
    hidden_size=256,
    num_hidden_layers=10,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    intermediate_size=512,
    moe_intermediate_size=192,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    max_position_embeddings=256,
)

MEASURE = r"""
import json, resource, sys
from mla_jax.checkpoint import convert
warm, big, out = sys.argv[1:4]

def status():
    d = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmHWM"):
                d[k] = int(v.split()[0]) * 1024
    return d

# Warm up imports, orbax and tensorstore thread pools on a tiny model, then reset the peak-RSS mark.
convert(warm, out + "_warm", dtype="fp32", log=None, progress=False)
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = status()["VmRSS"]
r = convert(big, out, dtype="fp32", max_group_mb=4, log=None, progress=False)
peak = status()["VmHWM"]
print(json.dumps({"base": base, "peak": peak, "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "model": r.stored_bytes, "largest_group": r.largest_group_bytes, "groups": r.groups,
                  "seconds": r.seconds}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads peak RSS from /proc (Linux)")
def test_streaming_peak_memory_is_about_one_group(tmp_path):
    src = str(tmp_path / "big")
    write_synthetic(src, BIG_CFG, shard_bytes=8 << 20, seed=1)
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) >= 8
    r = subprocess.run(
        [sys.executable, "-c", MEASURE, os.path.join(FIXTURES, "v2"), src, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout.strip().splitlines()[-1])
    growth = m["peak"] - m["base"]
    print(
        f"\nstreaming: model {m['model'] / 1e6:.1f} MB in {m['groups']} groups, largest group "
        f"{m['largest_group'] / 1e6:.1f} MB, peak RSS growth {growth / 1e6:.1f} MB "
        f"(base {m['base'] / 1e6:.0f} MB, peak {m['peak'] / 1e6:.0f} MB), {m['seconds']:.1f} s"
    )
    assert m["model"] > 90e6 and m["largest_group"] < m["model"] / 25
    # Loading the whole model would grow RSS by >= the model; streaming stays at a few groups plus allocator
    # slack (measured ~30 MB, independent of the model size: the same at 145 MB).
    assert growth < 0.5 * m["model"], m
    meta = read_metadata(str(tmp_path / "out"))
    assert len(meta["source"]["files"]) == len([f for f in os.listdir(src) if f.endswith(".safetensors")])
    import orbax.checkpoint as ocp

    assert meta["groups"][0]["units"][0] == "embed"
    first = ocp.PyTreeCheckpointer().restore(str(tmp_path / "out" / "params" / meta["groups"][0]["name"]))
    np.testing.assert_array_equal(
        first["embed"]["model"]["embed_tokens"]["weight"], CheckpointDir(src).get("model.embed_tokens.weight")
    )
