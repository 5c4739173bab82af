"""Tiny configs, checkpoint-editing helpers and the scripts' loader shared by the model tests."""

import dataclasses
import importlib.util
import os
import shutil
import sys

from mla_jax.config import DeepseekConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_script(name: str, folder: str = "scripts"):
    """`folder`/`name`.py (scripts/, bench/) as a module (loaded once a process; those folders are not packages)."""
    key = name if folder == "scripts" else f"{folder}_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(ROOT, folder, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def tiny_config(**overrides) -> DeepseekConfig:
    d = dict(
        model_type="deepseek_v3",
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_scaling=dict(
            type="yarn",
            factor=4.0,
            original_max_position_embeddings=16,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32,
            beta_slow=1,
        ),
    )
    d.update(overrides)
    return DeepseekConfig.from_dict(d)


def full_logits(params, cfg, seqs):
    """The full forward's logits f32[len(s), vocab] of each sequence, from one forward over them zero-padded to one
    length (causal attention, the causal top-k and per-token routing ignore the padding: one compile)."""
    import jax.numpy as jnp
    import numpy as np

    from mla_jax import model

    ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    logits = np.asarray(model.forward(params, cfg, jnp.asarray(ids)))
    return [logits[i, : len(s)] for i, s in enumerate(seqs)]


def paged_config(**overrides) -> DeepseekConfig:
    """Tiny config whose head dims the Pallas kernels accept (powers of two >= 16)."""
    return tiny_config(**{"qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, **overrides})


def run_schedule(
    params,
    cfg,
    seqs,
    schedule,
    *,
    page_size,
    num_pages=64,
    cache_dtype="fp32",
    backend="xla",
    workspace_rows=0,
    reorder_batch_threshold=1,
    causal=True,
    fill=float("nan"),
    index_dtype=None,
    gmm_impl="ragged_dot",
):
    """Teacher-forced run through the paged cache (and, for a sparse config, the index-key cache in
    `index_dtype`), the MoE experts through `gmm_impl`: `schedule` is a list of steps, each a list of (request
    index, number of new tokens). Returns
    [(request, position, logits f32[vocab])] for every logit row the steps produce, to compare with the full
    forward at that position."""
    from mla_jax.allocator import PagePool
    from mla_jax.cache import init_kv_cache_for

    pool = PagePool(num_pages, page_size)
    cache = init_kv_cache_for(
        cfg, num_pages, page_size, dtype=cache_dtype, allow_any_page_size=True, fill=fill, index_dtype=index_dtype
    )
    return run_steps(
        params,
        cfg,
        cache,
        pool,
        seqs,
        schedule,
        backend=backend,
        workspace_rows=workspace_rows,
        reorder_batch_threshold=reorder_batch_threshold,
        causal=causal,
        gmm_impl=gmm_impl,
    )


def run_steps(
    params,
    cfg,
    cache,
    pool,
    seqs,
    schedule,
    *,
    backend="xla",
    workspace_rows=0,
    reorder_batch_threshold=1,
    causal=True,
    gmm_impl="ragged_dot",
):
    """`run_schedule`'s steps over a given cache and its page pool."""
    import numpy as np

    from mla_jax.metadata import build_metadata
    from mla_jax.step import jit_step

    page_size, num_pages = pool.page_size, pool.num_pages
    kw = dict(
        page_size=page_size,
        num_pages=num_pages,
        reorder_batch_threshold=reorder_batch_threshold,
        causal=causal,
        workspace_rows=workspace_rows,
    )
    # Every step padded to one static shape (the field-wise max of the steps' own), as the engine's buckets pad
    # them: padding rows in every step, and one compilation per schedule instead of one per step.
    ahead = [0] * len(seqs)
    steps = []
    for step in schedule:
        reqs = step_requests(pool, seqs, ahead, step)
        steps.append((step, reqs, build_metadata(reqs, **kw)[0].shape))
        for r, n in step:
            ahead[r] += n
    shape = dataclasses.replace(
        steps[0][2], **{f.name: max(getattr(s, f.name) for *_, s in steps) for f in dataclasses.fields(steps[0][2])}
    )
    done = [0] * len(seqs)
    out = []
    for step, reqs, own in steps:
        md, order = build_metadata(reqs, shape=shape, **kw)
        logits, cache = jit_step(params, cfg, cache, md.to_device(), backend=backend, gmm_impl=gmm_impl)
        out += step_logits(np.asarray(logits), md.shape, own.num_decodes, step, order, done)
    return out


def step_requests(pool, seqs, done, step):
    """The ScheduledRequests of one schedule step: (request, new tokens) pairs get their pages (allocated on
    first sight, appended after) and the next `n` tokens of their sequence."""
    from mla_jax.metadata import ScheduledRequest

    reqs = []
    for r, n in step:
        if r not in pool:
            pool.allocate(r, n)
        else:
            pool.append(r, n)
        reqs.append(ScheduledRequest(seqs[r][done[r] : done[r] + n], done[r], pool.pages(r)))
    return reqs


def step_logits(logits, shape, num_decodes, step, order, done):
    """[(request, position, logits)] of one step (decode rows: every query token; prefills: the last one), in
    the metadata's `order`; advances `done`. `num_decodes`: the real decode rows (a static shape pads them)."""
    rows = []
    for k, oi in enumerate(order):
        r, n = step[oi]
        if k < num_decodes:
            rows += [(r, done[r] + t, logits[k * shape.decode_query_len + t]) for t in range(n)]
        else:
            rows.append((r, done[r] + n - 1, logits[shape.num_decode_tokens + k - num_decodes]))
    for r, n in step:
        done[r] += n
    return rows


def copy_fixture(name, tmp_path):
    """A writable copy of an HF fixture directory."""
    dst = tmp_path / name
    shutil.copytree(os.path.join(FIXTURES, name), dst)
    return dst


def read_tensors(d):
    """Every tensor of a checkpoint directory as a numpy array."""
    import numpy as np

    from mla_jax.checkpoint import CheckpointDir

    ck = CheckpointDir(d)
    return {k: np.array(ck.get(k)) for k in ck.keys()}


def rewrite_tensors(d, tensors):
    """Replace a checkpoint directory's weights by `tensors` in one model.safetensors."""
    from mla_jax.checkpoint import save_file

    for f in os.listdir(d):
        if f.startswith("model") and (f.endswith(".safetensors") or f.endswith(".index.json")):
            os.remove(os.path.join(d, f))
    save_file(tensors, os.path.join(d, "model.safetensors"))


def assert_same_params(a, b):
    """Same tree, dtypes, shapes and values (bitwise)."""
    import jax
    import numpy as np

    la, ta = jax.tree.flatten_with_path(a)[0], jax.tree.structure(a)
    lb, tb = jax.tree.flatten_with_path(b)[0], jax.tree.structure(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, (jax.tree_util.keystr(path), x.dtype, y.dtype)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))
