"""Soak: 1,000 requests of random prompt and output lengths through the scheduler with a page pool small enough
to force preemption. Batch-invariant mode: every output equals the same request run alone, and every page is
free at the end."""

import jax
import numpy as np
import pytest

from mla_jax import model
from mla_jax.engine import Engine, EngineConfig
from mla_jax.sampling import SamplingParams
from tests.mla_jax.helpers import paged_config

CONFIG = dict(
    max_model_len=48,
    max_num_seqs=16,
    page_size=16,
    token_budget=64,
    max_prefills=2,
    # three decode and two prefill buckets (not every power of two: each step shape is a compile, most of the test's
    # time): batch-invariance is checked across step shapes, the solo runs' (decode 1) against the batched ones'
    decode_buckets=(1, 4, 16),
    prefill_buckets=(16, 64),
    cache_dtype="fp32",
    batch_invariant=True,
)


@pytest.mark.slow
def test_soak_1000_requests_with_preemption():
    cfg = paged_config(num_hidden_layers=2)
    params = model.init_params(cfg, jax.random.key(11), std=0.3)
    rng = np.random.default_rng(12)
    reqs = []
    for i in range(1000):
        prompt = rng.integers(0, cfg.vocab_size, int(rng.integers(1, 25))).tolist()
        hot = rng.random() < 0.3
        sp = SamplingParams(
            max_new_tokens=int(rng.integers(1, 12)),
            temperature=1.0 if hot else 0.0,
            seed=i,
            stop_token_ids=(int(rng.integers(0, cfg.vocab_size)),) if rng.random() < 0.2 else (),
        )
        reqs.append((prompt, sp))

    # 12 pages (11 usable) of 16 tokens for up to 16 requests of up to 36 tokens: preemption is certain.
    config = EngineConfig(**CONFIG, num_pages=12)
    eng = Engine(params, cfg, config)
    pending = list(range(len(reqs)))
    ids = {}
    final = {}
    steps = 0
    while pending or eng.has_unfinished:
        for _ in range(int(rng.integers(0, 6))):
            if pending:
                i = pending.pop(0)
                ids[eng.add_request(*reqs[i])] = i
        for o in eng.step():
            if o.finished:
                final[ids[o.request_id]] = o.token_ids
        steps += 1
        assert steps < 20000
    assert len(final) == len(reqs)
    assert eng.scheduler.num_preemptions > 10
    assert eng.pool.num_free_pages == eng.pool.num_usable_pages
    assert not eng.pool.request_ids

    # the same pool size (one request alone needs at most 3 pages): the solo runs' step shapes are the batched run's,
    # compiled already
    alone = Engine(params, cfg, config)
    mismatches = []
    for i, (prompt, sp) in enumerate(reqs):
        rid = alone.add_request(prompt, sp)
        out = alone.run()[rid].token_ids
        if out != final[i]:
            mismatches.append(i)
        n = len(out)
        assert n == sp.max_new_tokens or out[-1] in sp.stop_token_ids
    assert not mismatches, f"{len(mismatches)} requests differ from their solo run, e.g. {mismatches[:5]}"
