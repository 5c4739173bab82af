import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax.checkpoint import CheckpointDir, hf_tensor_specs, load_hf_checkpoint
from mla_jax.mla import mla_forward_full
from mla_jax.module import MLAAttention
from tests.mla_jax.helpers import FIXTURES


@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_flax_module_runs_checkpoint_tensors(name):
    path = os.path.join(FIXTURES, name)
    cfg, params = load_hf_checkpoint(path)
    mod = MLAAttention(cfg)
    x = jax.random.normal(jax.random.key(0), (9, cfg.hidden_size))
    pos = jnp.arange(9, dtype=jnp.int32)
    # init declares exactly the checkpoint's self_attn tensors (names and shapes)
    shapes = jax.tree.map(lambda a: a.shape, mod.init(jax.random.key(1), x, pos)["params"])
    pre = "model.layers.0.self_attn."
    want = {k[len(pre) :].split(".")[0]: v for k, v in hf_tensor_specs(cfg).items() if k.startswith(pre)}
    assert {k: v["weight"] for k, v in shapes.items()} == want
    # apply on the raw HF tensors == the functional layer on the prepared (split) params
    ck = CheckpointDir(path)
    raw = {k: {"weight": jnp.asarray(np.asarray(ck.get(pre + k + ".weight")))} for k in want}
    layer0 = jax.tree.map(lambda a: a[0], params["model"]["dense_layers"]["self_attn"])
    for alg in ("naive", "absorbed"):
        got = mod.apply({"params": raw}, x, pos, algorithm=alg)
        np.testing.assert_allclose(got, mla_forward_full(layer0, cfg, x, pos, algorithm=alg), atol=1e-5)
