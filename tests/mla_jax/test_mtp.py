"""The MTP module: loading (HF layout, converted checkpoints, optional shared tensors) and its forward."""

import os

import jax
import numpy as np
import pytest

from mla_jax import model as M
from mla_jax.checkpoint import convert, export_hf, load_model, save_file
from mla_jax.checkpoint.hf import CheckpointDir
from mla_jax.engine import Engine, EngineConfig
from mla_jax.model import MTP_GROUP
from mla_jax.mtp import mtp_forward
from tests.mla_jax.helpers import tiny_config

TOKENIZER = '{"version": "1.0", "model": {"vocab": {"<|endoftext|>": 0}}}'


@pytest.fixture(scope="module")
def mtp_model():
    cfg = tiny_config(num_nextn_predict_layers=1)
    return cfg, M.init_params(cfg, jax.random.key(3))


def _flat(params):
    return {
        jax.tree_util.keystr(k): np.asarray(v, np.float32) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
    }


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert set(fa) == set(fb), sorted(set(fa) ^ set(fb))[:5]
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def test_init_adds_mtp_layer(mtp_model):
    cfg, params = mtp_model
    mtp = params["model"][MTP_GROUP]
    assert mtp["eh_proj"]["weight"].shape == (1, cfg.hidden_size, 2 * cfg.hidden_size)
    assert "W_UK_T" in mtp["self_attn"] and "experts" in mtp["mlp"]  # layer 3 >= first_k_dense_replace: MoE


def test_export_load_convert_roundtrip(tmp_path, mtp_model):
    cfg, params = mtp_model
    src = tmp_path / "hf"
    export_hf(params, cfg, TOKENIZER, src, dtype="fp32", eos_token=None)
    names = set(CheckpointDir(str(src)).keys())
    N = cfg.num_hidden_layers
    for rel in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight"):
        assert f"model.layers.{N}.{rel}" in names
    assert f"model.layers.{N}.mlp.experts.0.gate_proj.weight" in names
    cfg2, got = load_model(str(src))
    assert cfg2.num_mtp_layers == 1
    _assert_same(got, params)
    out = tmp_path / "conv"
    convert(str(src), str(out), dtype="fp32", log=None, progress=False)
    cfg3, conv = load_model(str(out))
    assert cfg3.num_mtp_layers == 1
    _assert_same(conv, params)


def _rewrite(src, drop=(), add=None):
    """Rewrites model.safetensors without the tensors in `drop` (and with `add`)."""
    ck = CheckpointDir(str(src))
    t = {n: ck.get(n) for n in ck.keys() if n not in drop}
    t.update(add or {})
    save_file(t, os.path.join(src, "model.safetensors"))


def test_optional_shared_tensors_and_stripped_mtp(tmp_path, mtp_model):
    cfg, params = mtp_model
    N = cfg.num_hidden_layers
    src = tmp_path / "hf"
    export_hf(params, cfg, TOKENIZER, src, dtype="fp32", eos_token=None)
    # DeepSeek's layout: the MTP layer carries its own copy of embed_tokens; shared_head.head may be absent.
    emb = np.asarray(params["model"]["embed_tokens"]["weight"])
    _rewrite(
        src, drop={f"model.layers.{N}.shared_head.head.weight"}, add={f"model.layers.{N}.embed_tokens.weight": emb}
    )
    for path in (src, tmp_path / "conv"):
        if path != src:
            convert(str(src), str(path), dtype="fp32", log=None, progress=False)
        _, got = load_model(str(path))
        mtp = got["model"][MTP_GROUP]
        assert "head" not in mtp["shared_head"]
        np.testing.assert_array_equal(np.asarray(mtp["embed_tokens"]["weight"][0]), emb)
    # A checkpoint without any MTP tensor but num_nextn_predict_layers: 1 loads without MTP (as before).
    _rewrite(src, drop={n for n in CheckpointDir(str(src)).keys() if n.startswith(f"model.layers.{N}.")})
    cfg4, got = load_model(str(src))
    assert cfg4.num_mtp_layers == 0 and MTP_GROUP not in got["model"]
    convert(str(src), str(tmp_path / "conv2"), dtype="fp32", log=None, progress=False)
    cfg5, got = load_model(str(tmp_path / "conv2"))
    assert cfg5.num_mtp_layers == 0 and MTP_GROUP not in got["model"]


def test_partial_mtp_layer_is_skipped(tmp_path, mtp_model):
    """An MTP layer with a tensor missing loads as no MTP layer (as every MTP tensor did before), and a request
    for MTP speculation on it is a clear error."""
    cfg, params = mtp_model
    src = tmp_path / "hf"
    export_hf(params, cfg, TOKENIZER, src, dtype="fp32", eos_token=None)
    _rewrite(src, drop={f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"})
    cfg2, got = load_model(str(src))
    assert cfg2.num_mtp_layers == 0 and MTP_GROUP not in got["model"]
    with pytest.raises(ValueError, match="speculative_method='mtp' needs MTP weights"):
        Engine(
            got,
            cfg2,
            EngineConfig(
                max_model_len=32,
                max_num_seqs=1,
                page_size=8,
                token_budget=16,
                num_speculative_tokens=1,
                speculative_method="mtp",
            ),
        )


def test_train_demo_mtp_loss_and_frozen_trunk():
    """scripts/train_demo.py's MTP loss is the cross-entropy of `mtp_forward` on token p+2; with the trunk
    frozen (--mtp-only) nothing outside the MTP layer gets a gradient, the shared embedding and lm_head
    included (no weight gradient computed for weights that do not train)."""
    import importlib.util
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if "train_demo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("train_demo", os.path.join(root, "scripts", "train_demo.py"))
        sys.modules["train_demo"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["train_demo"])
    td = sys.modules["train_demo"]
    cfg = tiny_config(num_hidden_layers=1, n_routed_experts=None, num_nextn_predict_layers=1)
    params = M.init_params(cfg, jax.random.key(2))
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)

    @jax.jit
    def losses(p):
        hidden = M.forward_hidden(p, cfg, ids[:, :-1])
        ref = td.cross_entropy(mtp_forward(p, cfg, ids[:, :-1], hidden), ids[:, 2:])
        return td.mtp_loss(p, cfg, ids)[1], ref

    mtp, want = losses(params)
    np.testing.assert_allclose(mtp, want, rtol=1e-5)
    grads = jax.jit(jax.grad(lambda p: td.objective(p, cfg, ids, 0.3, True)))(params)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        name = jax.tree_util.keystr(path)
        if MTP_GROUP not in name:
            assert not np.any(np.asarray(g)), name
    assert np.any(np.asarray(grads["model"][MTP_GROUP]["eh_proj"]["weight"]))
