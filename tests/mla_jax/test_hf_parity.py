"""Logit parity with Hugging Face transformers' own DeepseekV2/V3 code.

Fixtures: tiny random models saved by `scripts/make_hf_fixtures.py` with their float64 logits.
Tolerance: we compute in float32 (exact CPU matmuls); float32 rounding through a few layers on logits of
magnitude ~10 gives errors ~1e-5, so |ours - HF| <= 2e-4 absolute is tight yet robust. A wrong scale, a wrong
rope layout or a routing mistake moves logits by O(0.1-1).
"""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model
from mla_jax.checkpoint import SafetensorsFile, load_hf_checkpoint
from tests.mla_jax.helpers import FIXTURES

ATOL = 2e-4
NAMES = ["v2", "v2_lite", "v3"]


def _prompts(name):
    ref = SafetensorsFile(os.path.join(FIXTURES, name, "reference.safetensors"))
    i = 0
    while f"input_ids_{i}" in ref.keys():
        yield np.asarray(ref.get(f"input_ids_{i}")), np.asarray(ref.get(f"logits_{i}"), np.float64)
        i += 1


@pytest.fixture(scope="module", params=NAMES)
def fixture(request):
    return request.param, *load_hf_checkpoint(os.path.join(FIXTURES, request.param))


@pytest.mark.parametrize("algorithm", ["naive", "absorbed"])
def test_logits_match_hf(fixture, algorithm):
    name, cfg, params = fixture
    n = 0
    for ids, want in _prompts(name):
        got = np.asarray(model.forward(params, cfg, jnp.asarray(ids)[None], attention=algorithm)[0])
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"{name} prompt len {len(ids)}")
        n += 1
    assert n >= 3


def test_wrong_scale_breaks_parity(fixture):
    """The absorbed 576-wide dot still uses qk_head_dim^-0.5 (x mscale^2): the row width's scale is wrong."""
    name, cfg, params = fixture
    ids, want = next(_prompts(name))
    bad = cfg.cache_row_dim ** -0.5
    got = np.asarray(model.forward(params, cfg, jnp.asarray(ids)[None], attention="absorbed", scale=bad)[0])
    assert np.abs(got - want).max() > 100 * ATOL
