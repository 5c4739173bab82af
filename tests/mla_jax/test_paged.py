"""Step-by-step runs through the paged latent cache equal the full-sequence forward (issue: cache/metadata)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import layers, model
from mla_jax.metadata import BatchShape, MetadataError, ScheduledRequest, build_metadata, validate_metadata
from tests.mla_jax.helpers import full_logits, paged_config, run_schedule

ATOL = 1e-4  # float32 everywhere; paged vs full differ only by summation order


@pytest.fixture(scope="module")
def setup():
    cfg = paged_config()
    params = model.init_params(cfg, jax.random.key(0), std=0.2)
    rng = np.random.default_rng(1)
    seqs = [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in (40, 70, 24, 33)]
    return cfg, params, seqs, full_logits(params, cfg, seqs)


# (request, new tokens) per step: prompts chunked over steps, decodes, multi-token decodes, late arrivals.
MIXED = [
    [(0, 13), (1, 20)],
    [(0, 1), (1, 30), (2, 7)],
    [(0, 3), (1, 1), (2, 1), (3, 25)],
    [(0, 1), (1, 19), (2, 5), (3, 8)],
    [(0, 22), (2, 11)],
]


def _check(out, full, atol=ATOL):
    assert out
    for r, pos, got in out:
        np.testing.assert_allclose(got, full[r][pos], atol=atol, rtol=0, err_msg=f"request {r} position {pos}")


@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
def test_mixed_batches_match_full_forward(setup, page_size):
    cfg, params, seqs, full = setup
    out = run_schedule(
        params,
        cfg,
        seqs,
        MIXED,
        page_size=page_size,
        workspace_rows=3 * page_size,
        reorder_batch_threshold=4,
        num_pages=40,
    )
    _check(out, full)


def test_context_needing_many_chunks(setup):
    """W = 8 rows with G = 4: a 60-token context needs many chunks; two prefills share each chunk."""
    cfg, params, seqs, full = setup
    sched = [[(1, 60), (3, 20)], [(1, 5), (3, 10)], [(1, 5), (0, 4)]]
    _check(run_schedule(params, cfg, seqs, sched, page_size=4, workspace_rows=8, num_pages=64), full)


def test_decode_only_steps(setup):
    cfg, params, seqs, full = setup
    sched = [[(0, 10), (2, 9)]] + [[(0, 1), (2, 1)]] * 6
    _check(run_schedule(params, cfg, seqs, sched, page_size=16, workspace_rows=32), full)


def test_token_by_token_with_pallas_experts(setup):
    """Two requests fed one token a step through the grouped Pallas expert kernels (interpret mode on CPU, `-k
    decode_only or token_by_token` on the GPU): 2 tokens a step, so the MoE output rides the layer loop as
    `ExpertCopies` into the next layer's norm (`layers.moe_copies`), and every position matches the full forward."""
    cfg, params, seqs, full = setup
    assert layers.moe_copies(params["model"]["moe_layers"]["mlp"], cfg, 2, gmm_impl="pallas") is not None
    sched = [[(0, 1), (2, 1)]] * 6
    _check(run_schedule(params, cfg, seqs, sched, page_size=16, num_pages=16, gmm_impl="pallas"), full)


def test_pallas_backend(setup):
    """Same runs through the Pallas kernels (interpret mode on CPU)."""
    cfg, params, seqs, full = setup
    _check(
        run_schedule(
            params,
            cfg,
            seqs,
            MIXED[:3],
            page_size=16,
            workspace_rows=16,
            reorder_batch_threshold=4,
            backend="pallas",
            num_pages=40,
        ),
        full,
    )


def test_fp8_cache_within_tolerance(setup):
    """fp8 e4m3 rows with a per-token scale: 3 mantissa bits (rel. error <= 2^-4 per element) on the context;
    logits ~O(5) move by at most a few tenths."""
    cfg, params, seqs, full = setup
    out = run_schedule(
        params,
        cfg,
        seqs,
        MIXED,
        page_size=16,
        cache_dtype="fp8",
        workspace_rows=48,
        reorder_batch_threshold=4,
        fill=0.0,
    )
    err = max(np.abs(got - full[r][pos]).max() for r, pos, got in out)
    scale = max(np.abs(f).max() for f in full)
    assert err < 0.05 * scale, (err, scale)
    assert err > 1e-6  # fp8 really is lossy: the cache is not secretly full precision


def test_non_causal_multi_token_rows():
    """Non-causal decode rows all see the whole block. In a one-layer model (deeper layers would mix the future
    into the latents) the last row equals the causal result and earlier rows do not."""
    cfg = paged_config(num_hidden_layers=1)
    params = model.init_params(cfg, jax.random.key(5), std=0.2)
    seq = list(map(int, np.random.default_rng(2).integers(0, cfg.vocab_size, 14)))
    full = [np.asarray(model.forward(params, cfg, jnp.asarray([seq]))[0])]
    out = run_schedule(params, cfg, [seq], [[(0, 10)], [(0, 4)]], page_size=16, reorder_batch_threshold=4, causal=False)
    _check([o for o in out if o[1] in (9, 13)], full)
    first = [o for o in out if o[1] == 10][0]
    assert np.abs(first[2] - full[0][10]).max() > 1e-3  # row 0 of the block saw the tokens after it


def _req(n_new, ctx, pages):
    return ScheduledRequest(list(range(n_new)), ctx, pages)


def test_metadata_layout():
    reqs = [_req(9, 0, [3, 4, 5]), _req(1, 6, [7, 8]), _req(3, 4, [1, 2]), _req(2, 12, [9, 10, 11, 12])]
    md, order = build_metadata(reqs, page_size=4, num_pages=16, reorder_batch_threshold=3, workspace_rows=8)
    s = md.shape
    assert order == [1, 2, 3, 0]  # decodes (q <= 3) first, arrival order kept
    assert (s.num_decodes, s.decode_query_len, s.num_prefills, s.num_prefill_tokens) == (3, 3, 1, 9)
    np.testing.assert_array_equal(md.decode.seq_lens, [[7, 0, 0], [5, 6, 7], [13, 14, 0]])
    # request 1's token at position 6 lives in page 8 offset 2; padding rows write nowhere
    np.testing.assert_array_equal(md.slot_mapping[:3], [8 * 4 + 2, -1, -1])
    np.testing.assert_array_equal(md.positions[3:6], [4, 5, 6])
    np.testing.assert_array_equal(md.prefill.query_start_loc, [0, 9])
    # every decode row (padding rows point at row 0), then the last token of the prefill
    np.testing.assert_array_equal(md.logits_indices, [0, 0, 0, 3, 4, 5, 6, 7, 0, 9 + 8])
    assert md.decode.block_table[0, :2].tolist() == [7, 8]


def test_non_causal_metadata():
    md, _ = build_metadata([_req(3, 4, [1, 2])], page_size=4, num_pages=8, reorder_batch_threshold=3, causal=False)
    np.testing.assert_array_equal(md.decode.seq_lens, [[7, 7, 7]])


def test_static_shape_and_buckets():
    reqs = [_req(1, 5, [1, 2]), _req(1, 2, [3])]
    md, _ = build_metadata(reqs, page_size=4, num_pages=8, decode_buckets=[1, 2, 4, 8])
    assert md.shape.num_decodes == 2
    shape = BatchShape(num_decodes=4, decode_query_len=1, max_pages=4)
    md, _ = build_metadata(reqs, page_size=4, num_pages=8, shape=shape)
    assert md.shape == shape and md.decode.seq_lens[2:].sum() == 0 and (md.slot_mapping[2:] == -1).all()
    with pytest.raises(MetadataError, match="num_decodes"):
        build_metadata(reqs * 3, page_size=4, num_pages=8, shape=shape)


@pytest.mark.parametrize(
    "reqs,match",
    [
        ([_req(5, 4, [1, 2])], "past its block table"),
        ([_req(2, 0, [9])], "block id 9 out of range"),
        ([_req(0, 0, [1])], "token_ids is empty"),
        ([_req(9, 4, [1, 2, 3, 4])], "workspace_rows is 0"),
    ],
)
def test_bad_requests(reqs, match):
    with pytest.raises(MetadataError, match=match):
        build_metadata(reqs, page_size=4, num_pages=8)


def test_bad_metadata_fields():
    md, _ = build_metadata([_req(1, 5, [1, 2]), _req(6, 0, [3, 4])], page_size=4, num_pages=8)
    import dataclasses

    bad_slot = dataclasses.replace(md, slot_mapping=md.slot_mapping.copy())
    bad_slot.slot_mapping[0] = 8 * 4
    with pytest.raises(MetadataError, match="slot_mapping entry 32 out of range"):
        validate_metadata(bad_slot, num_pages=8, page_size=4)
    bad_dtype = dataclasses.replace(md, positions=md.positions.astype(np.int64))
    with pytest.raises(MetadataError, match="positions must be int32"):
        validate_metadata(bad_dtype, num_pages=8, page_size=4)
    dec = dataclasses.replace(md.decode, seq_lens=md.decode.seq_lens + 100)
    with pytest.raises(MetadataError, match="past the block table"):
        validate_metadata(dataclasses.replace(md, decode=dec), num_pages=8, page_size=4)


@pytest.mark.parametrize("name", ["v2_lite", "v3"])
def test_hf_fixture_incremental_decode(name):
    """HF checkpoints (R = 8, V != P) through the paged cache, prompt in two chunks then token-by-token decode,
    against HF's own logits."""
    import os

    from mla_jax.checkpoint import SafetensorsFile, load_hf_checkpoint
    from tests.mla_jax.helpers import FIXTURES

    cfg, params = load_hf_checkpoint(os.path.join(FIXTURES, name))
    ref = SafetensorsFile(os.path.join(FIXTURES, name, "reference.safetensors"))
    ids = [int(t) for t in ref.get("input_ids_2")]
    want = np.asarray(ref.get("logits_2"), np.float64)
    n = len(ids)
    sched = [[(0, 20)], [(0, 11)]] + [[(0, 1)]] * (n - 31)
    out = run_schedule(params, cfg, [ids], sched, page_size=16, workspace_rows=16)
    assert len(out) == n - 31 + 2
    for _, pos, got in out:
        np.testing.assert_allclose(got, want[pos], atol=2e-4, rtol=0, err_msg=f"position {pos}")
