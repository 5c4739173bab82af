"""Logit parity with Hugging Face transformers' own DeepseekV2/V3/V3.2 and GlmMoeDsa code.

Fixtures: tiny random models saved by `scripts/make_hf_fixtures.py` with their float64 logits.
Tolerance: we compute in float32 (exact CPU matmuls); float32 rounding through a few layers on logits of
magnitude ~10 gives errors ~1e-5, so |ours - HF| <= 2e-4 absolute is tight yet robust. A wrong scale, a wrong
rope layout or a routing mistake moves logits by O(0.1-1).
"""

import dataclasses
import os

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model
from mla_jax.checkpoint import SafetensorsFile, load_hf_checkpoint
from mla_jax.indexer import causal_topk
from mla_jax.layers import rms_norm
from tests.mla_jax.helpers import FIXTURES

ATOL = 2e-4
NAMES = ["v2", "v2_lite", "v3", "v32", "glm_dsa"]
SPARSE = ["v32", "glm_dsa"]  # DeepSeek Sparse Attention, index_topk 16 < the longer prompts


def _prompts(name):
    ref = SafetensorsFile(os.path.join(FIXTURES, name, "reference.safetensors"))
    i = 0
    while f"input_ids_{i}" in ref.keys():
        yield np.asarray(ref.get(f"input_ids_{i}")), np.asarray(ref.get(f"logits_{i}"), np.float64)
        i += 1


def _padded(prompts):
    """The prompts' ids zero-padded into one batch i32[n, longest] (causal attention, the causal top-k and per-token
    routing ignore the padding: one forward, one compile, for every prompt length)."""
    ids = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    return jnp.asarray(ids)


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    return request.param, *load_hf_checkpoint(os.path.join(FIXTURES, request.param))


@pytest.mark.parametrize("algorithm", ["naive", "absorbed"])
def test_logits_match_hf(fixture, algorithm):
    name, cfg, params = fixture
    prompts = list(_prompts(name))
    logits = np.asarray(model.forward(params, cfg, _padded([ids for ids, _ in prompts]), attention=algorithm))
    for (ids, want), got in zip(prompts, logits):
        np.testing.assert_allclose(got[: len(ids)], want, atol=ATOL, rtol=0, err_msg=f"{name} prompt len {len(ids)}")
    assert len(prompts) >= 3


def test_wrong_scale_breaks_parity(fixture):
    """The absorbed 576-wide dot still uses qk_head_dim^-0.5 (x mscale^2): the row width's scale is wrong."""
    name, cfg, params = fixture
    ids, want = next(_prompts(name))
    bad = cfg.cache_row_dim**-0.5
    got = np.asarray(model.forward(params, cfg, jnp.asarray(ids)[None], attention="absorbed", scale=bad)[0])
    assert np.abs(got - want).max() > 100 * ATOL


@pytest.fixture(scope="module", params=SPARSE)
def sparse_fixture(request):
    return request.param, *load_hf_checkpoint(os.path.join(FIXTURES, request.param))


def test_indexer_topk_matches_hf(sparse_fixture):
    """Each indexer layer's top-k set, from HF's own layer inputs (float64 debug hidden states), equals HF's
    for every query row (rows with fewer than K causal tokens: their causal part)."""
    name, cfg, params = sparse_fixture
    ref = SafetensorsFile(os.path.join(FIXTURES, name, "reference.safetensors"))
    i = 1  # the debug prompt
    h = np.asarray(ref.get(f"debug_h_embed_{i}"), np.float32)
    S = h.shape[0]
    pos = jnp.arange(S, dtype=jnp.int32)
    checked = 0
    for li in range(cfg.num_hidden_layers):
        p = model.layer_params(params, cfg, li)
        if cfg.is_indexer_layer(li):
            x = rms_norm(p["input_layernorm"], jnp.asarray(h), cfg.rms_norm_eps)
            got = np.sort(
                np.asarray(causal_topk(p["self_attn"]["indexer"], cfg, x, model.q_latent(p["self_attn"], cfg, x), pos)),
                axis=-1,
            )
            want = np.asarray(ref.get(f"index_topk_{i}_layer{li}"))
            rows = np.arange(S)
            for s in rows:
                if s + 1 >= cfg.index_topk:
                    np.testing.assert_array_equal(got[s], want[s], err_msg=f"{name} layer {li} row {s}")
                else:  # fewer causal tokens than K: all of them, and nothing else
                    np.testing.assert_array_equal(got[s][got[s] >= 0], np.arange(s + 1))
            checked += 1
        h = np.asarray(ref.get(f"debug_h_{li}_{i}"), np.float32)
    assert checked == cfg.num_indexer_layers and S > cfg.index_topk


def test_sparsity_changes_the_logits(sparse_fixture):
    """The same model without the top-k (every token kept) is far from HF on the prompts longer than
    index_topk: the parity above really tests the sparse path."""
    name, cfg, params = sparse_fixture
    dense = dataclasses.replace(cfg, index_topk=1 << 20)
    prompts = list(_prompts(name))
    logits = np.asarray(model.forward(params, dense, _padded([ids for ids, _ in prompts])))
    longer = 0
    for (ids, want), got in zip(prompts, logits):
        if len(ids) > cfg.index_topk:
            assert np.abs(got[: len(ids)] - want).max() > 1.0
            longer += 1
    assert longer >= 2


def test_short_sequences_are_exactly_dense(sparse_fixture):
    """Sequences no longer than index_topk: the sparse forward equals the dense MLA forward bit for bit (the
    top-k keeps every causal token), for both algorithms."""
    name, cfg, params = sparse_fixture
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, cfg.index_topk)))
    dense = dataclasses.replace(cfg, index_topk=None, indexer_types=None)
    for algorithm in ("naive", "absorbed"):
        a = np.asarray(model.forward(params, cfg, ids, attention=algorithm))
        b = np.asarray(model.forward(params, dense, ids, attention=algorithm))
        np.testing.assert_array_equal(a, b)
