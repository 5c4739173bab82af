"""Shared pieces of the multi-device tests, and the worker process `test_multihost.py` launches.

As a script: one of `--num-processes` JAX processes on localhost (`jax.distributed.initialize`, gloo CPU
collectives), each with `--local-devices` CPU devices; together they form one global mesh on which the worker runs
the teacher-forced paged schedule and a greedy `generate`, and writes the results (JSON) to `--out`.

    python -m tests.mla_jax.multihost_worker --process-id 0 --num-processes 2 --port 12345 --out r0.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# (request, new tokens) per step: chunked prompts, decodes, multi-token decodes (threshold 4), late arrivals,
# prefills whose context spans several chunks and pages on every DCP rank.
SCHEDULE = [
    [(0, 13), (1, 20)],
    [(0, 1), (1, 30), (2, 7)],
    [(0, 3), (1, 1), (2, 1), (3, 25)],
    [(0, 1), (1, 19), (2, 5), (3, 8)],
    [(0, 22), (2, 11)],
]
SEQ_LENS = (40, 70, 24, 33)
PAGE = 8  # physical page size G of every device (the virtual page is G * dcp)
NUM_PAGES = 32
PROMPTS = ((5, 23, 1, 40, 9, 17), 6)  # prompt lengths, new tokens


# XLA:CPU at optimisation level 0 compiles the step in ~60% of the time (8 s -> 5 s on 2 cores); the runs are
# tiny, so the slower code costs nothing. Tests compile their own jits with it (the library's are untouched).
FAST_COMPILE = {"xla_backend_optimization_level": 0}
REF_SHAPE = (8, 72)  # full-forward references: one padded batch shape (causal: padding after a row is ignored)


def fast_jit(fn, **jit_kwargs):
    """A jax.jit-decorated function recompiled with FAST_COMPILE (its own compile cache)."""
    import jax

    return jax.jit(getattr(fn, "__wrapped__", fn), compiler_options=FAST_COMPILE, **jit_kwargs)


_FORWARD = []


def _forward(params, cfg, ids):
    from mla_jax import model

    if not _FORWARD:
        _FORWARD.append(fast_jit(model.forward, static_argnames=("cfg", "attention", "scale")))
    return _FORWARD[0](params, cfg, ids)


def full_logits(params, cfg, seqs):
    """One-device full-forward logits of each sequence, f32[len, vocab] each."""
    import numpy as np

    ids = np.zeros(REF_SHAPE, np.int32)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    out = np.asarray(_forward(params, cfg, ids))
    return [out[i, : len(s)] for i, s in enumerate(seqs)]


def greedy_tokens(params, cfg, prompt_list, n):
    """One-device greedy decoding over the full forward, all prompts in one padded batch."""
    import numpy as np

    ids = np.zeros(REF_SHAPE, np.int32)
    for i, p in enumerate(prompt_list):
        ids[i, : len(p)] = p
    out = [[] for _ in prompt_list]
    for step in range(n):
        logits = np.asarray(_forward(params, cfg, ids))
        for i, p in enumerate(prompt_list):
            t = len(p) + step
            ids[i, t] = int(np.argmax(logits[i, t - 1]))
            out[i].append(int(ids[i, t]))
    return out


def fast_engine_step():
    """`step.engine_step` recompiled with FAST_COMPILE (patched in for the engine tests)."""
    from mla_jax import step

    return fast_jit(step.engine_step, static_argnames=step.STATIC_ARGNAMES, donate_argnames=("cache",))


def random_params(cfg, seed: int, std: float = 0.02):
    """Params like `model.init_params` (same tree, shapes and kinds of values: norms 1 + noise, router scaled by
    D^-1/2, embedding std 1), drawn with numpy: eager `init_params` compiles every random op shape (~18 s on 2
    cores), which the multi-process test would pay in every process."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mla_jax import model

    rng = np.random.default_rng(seed)
    abstract = jax.eval_shape(lambda k: model.init_params(cfg, k, std=std), jax.random.key(0))

    def one(path, a):
        name = jax.tree_util.keystr(path)
        x = rng.standard_normal(a.shape)
        if "norm" in name:
            x = 1.0 + 0.1 * x
        elif "gate']['weight" in name and "experts" not in name:
            x = x / cfg.hidden_size**0.5
        elif "e_score_correction_bias" in name:
            x = 0.05 * x
        elif "embed_tokens" in name:
            pass
        else:
            x = std * x
        return jnp.asarray(x.astype(np.float32), a.dtype)

    return jax.tree_util.tree_map_with_path(one, abstract)


def parallel_config(**overrides):
    """Tiny 2-layer model (1 dense + 1 MoE) whose dims divide over 8 devices: 8 heads, 8 experts, vocab 96,
    intermediate 48, expert intermediate 16."""
    from tests.mla_jax.helpers import paged_config

    return paged_config(**{"num_attention_heads": 8, "num_hidden_layers": 2, **overrides})


def sequences(cfg, seed=1):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, cfg.vocab_size, n))) for n in SEQ_LENS]


def prompts(cfg, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPTS[0]]


def engine_config():
    from mla_jax.engine import EngineConfig

    # Every prompt fits the first step (budget 128 >= 95 prompt tokens, 8 prefills), then decodes only: two
    # compiled shapes (mixed steps are covered by SCHEDULE).
    return EngineConfig(
        max_model_len=64,
        max_num_seqs=8,
        page_size=PAGE,
        token_budget=128,
        max_prefills=8,
        decode_buckets=(8,),
        prefill_buckets=(128,),
        cache_dtype="fp32",
    )


def fixed_shape(virtual_page: int, workspace_rows: int):
    """One static shape for every step of SCHEDULE (one compile per mesh)."""
    from mla_jax.metadata import BatchShape
    from pallas_kernels.util import cdiv

    max_pages = cdiv(max(SEQ_LENS), virtual_page)
    return BatchShape(
        num_decodes=4,
        decode_query_len=4,
        num_prefills=4,
        num_prefill_tokens=40,
        max_pages=max_pages,
        workspace_rows=workspace_rows,
        max_chunks=max_pages,
    )


def run_schedule_parallel(
    params,
    cfg,
    seqs,
    schedule,
    *,
    plan=None,
    page_size=PAGE,
    num_pages=NUM_PAGES,
    cache_dtype="fp32",
    backend="xla",
    reorder_batch_threshold=4,
    fill=float("nan"),
    return_state=False,
    compiler_options=FAST_COMPILE,
    gmm_impl="ragged_dot",
):
    """Teacher-forced run through the paged cache (`mla_jax.step.jit_step`) on `plan`'s mesh (None: one device),
    with the virtual page size page_size * dcp and one static shape. Under DP request r runs on rank r % dp, from
    that rank's pool of `num_pages` (ranks without requests in a step run an empty share). Returns [(request,
    position, logits)] (and with `return_state`, the final cache and the page pool, under DP the list of them)."""
    import jax
    import numpy as np

    from mla_jax import parallel
    from mla_jax import step as step_lib
    from mla_jax.allocator import PagePool
    from mla_jax.cache import init_kv_cache
    from mla_jax.metadata import build_metadata, empty_metadata
    from tests.mla_jax.helpers import step_logits, step_requests

    jit_step = jax.jit(
        step_lib.jit_step.__wrapped__,
        static_argnames=step_lib.STATIC_ARGNAMES,
        donate_argnames=("cache",),
        compiler_options=compiler_options,
    )

    dcp = plan.dcp if plan is not None else 1
    gv = page_size * dcp
    workspace = 4 * gv  # >= one virtual page for each of up to 4 prefills with context
    shape = fixed_shape(gv, workspace)
    dp = plan.dp if plan is not None else 1
    pools = [PagePool(num_pages, gv) for _ in range(dp)]
    if plan is None:
        cache = init_kv_cache(
            cfg.num_hidden_layers,
            num_pages,
            gv,
            kv_lora_rank=cfg.kv_lora_rank,
            rope_dim=cfg.qk_rope_head_dim,
            dtype=cache_dtype,
            allow_any_page_size=True,
            fill=fill,
        )
    else:
        cache = plan.init_cache(cfg, num_pages, page_size, dtype=cache_dtype, fill=fill)
        params = plan.shard_params(params, cfg)
    done = [0] * len(seqs)
    out = []
    for step in schedule:
        mds, orders, parts = [], [], []
        for rank in range(dp):
            part = [(r, n) for r, n in step if r % dp == rank]
            dn = list(done)  # step_requests advances nothing; step_logits does, per rank below
            if part:
                md, order = build_metadata(
                    step_requests(pools[rank], seqs, dn, part),
                    page_size=gv,
                    num_pages=num_pages,
                    reorder_batch_threshold=reorder_batch_threshold,
                    workspace_rows=workspace,
                    shape=shape,
                )
            else:
                md, order = empty_metadata(shape), []
            mds.append(md)
            orders.append(order)
            parts.append(part)
        if plan is None:
            logits, cache = jit_step(params, cfg, cache, mds[0].to_device(), backend=backend, gmm_impl=gmm_impl)
            logits = np.asarray(logits)
        else:
            md = mds[0] if dp == 1 else parallel.stack_metadata(mds)
            logits, cache = jit_step(
                params, cfg, cache, plan.put_metadata(md), plan=plan, backend=backend, gmm_impl=gmm_impl
            )
            logits = parallel.to_host(logits)
        logits = logits.reshape(dp, shape.num_logits, -1)  # DP: rank-major rows
        for rank in range(dp):
            nd = sum(n <= reorder_batch_threshold for _, n in parts[rank])  # real decodes (the shape pads them)
            out += step_logits(logits[rank], shape, nd, parts[rank], orders[rank], done)
    pool = pools if dp > 1 else pools[0]
    return (out, cache, pool) if return_state else out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--local-devices", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # cross-process collectives on CPU
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    jax.distributed.initialize(
        coordinator_address=f"localhost:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    from mla_jax import engine, parallel, step
    from mla_jax.sampling import SamplingParams

    assert jax.process_count() == args.num_processes
    assert jax.device_count() == args.num_processes * args.local_devices
    cfg = parallel_config()
    params = random_params(cfg, 0, std=0.2)  # the same params in every process
    # Devices of the processes interleaved (p0 d0, p1 d0, p0 d1, ...): the innermost axis, dcp, pairs devices of
    # different processes, so the DCP all-gathers / reduce-scatters and every all-reduce cross the process boundary.
    per_process = [[d for d in jax.devices() if d.process_index == i] for i in range(args.num_processes)]
    devices = [d for group in zip(*per_process) for d in group]
    plan = parallel.ParallelPlan(parallel.make_mesh(tp=args.tp, dcp=args.dcp, ep=args.ep, dp=args.dp, devices=devices))
    out = run_schedule_parallel(params, cfg, sequences(cfg), SCHEDULE, plan=plan)
    gen_params = random_params(cfg, 1, std=0.3)
    step.engine_step = fast_engine_step()
    gens = engine.generate(
        gen_params, cfg, prompts(cfg), SamplingParams(max_new_tokens=PROMPTS[1]), engine_config(), plan=plan
    )
    res = {
        "process_id": jax.process_index(),
        "devices": jax.device_count(),
        "plan": plan.describe(),
        "logits": [[r, pos, [float(v) for v in lg]] for r, pos, lg in out],
        "tokens": [o.token_ids for o in gens],
    }
    with open(args.out, "w") as f:
        json.dump(res, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    sys.exit(main())
