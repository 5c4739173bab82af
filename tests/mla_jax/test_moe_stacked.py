"""gmm_impl="pallas": the layer scans hand the grouped-matmul kernel the stacked expert weights [layers, E, out,
in] (scan-invariant) and the layer index, so no per-layer slice of the experts is made (XLA materializes a
slice that feeds a custom call: a copy of every expert of the layer, each step).

Proofs that the copy is gone, each failing on the old code (experts scanned as xs):
- structural, read off the traced program: in every `scan` of the one-device and the 8-device step (and the
  full forward) the scanned operands hold no array of the experts' stacked shape, and the two grouped kernel
  calls (gate and up fused, down) read the three expert arrays at their full stacked shape; the same check flags the
  ragged_dot path, which still scans the experts;
- memory: the compiled step's temp bytes stay below half an expert matrix [E, I, D] (old: ~3 matrices, the
  layer's gate, up and down slices; ragged_dot still shows them); a GPU variant with V2-Lite's experts.
Numerics: pallas == ragged_dot for the one-device step and the full forward with two MoE layers of distinct
weights (a wrong layer index shows), and the 8-device step with pallas (expert parallel, moe="tp",
TP2xDCP2xEP2) against the one-device step.

Tolerances: float32; the interpret-mode kernel and ragged_dot differ only in summation order, and the mesh
changes the order of sums (all-reduces), logits of magnitude ~5: ATOL = 1e-4 as in test_paged.py and
test_parallel.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model, parallel, step
from mla_jax.cache import init_kv_cache
from mla_jax.metadata import ScheduledRequest, build_metadata
from tests.mla_jax.multihost_worker import FAST_COMPILE, parallel_config, random_params

ATOL = 1e-4
PAGE, NUM_PAGES = 4, 16


@pytest.fixture(scope="module")
def setup():
    # 1 dense + 2 MoE layers (the layer index matters); expert intermediate 64 so that no other param has an
    # expert's shape (with 16, W_UK_T [layers, N=8, P=16, L=32] would look like gate_proj [layers, E=8, 16, D=32])
    # and no expert dim is below the kernel's blocks (interpret mode would pad the stack: another shape)
    cfg = parallel_config(num_hidden_layers=3, moe_intermediate_size=64)
    params = random_params(cfg, 0, std=0.2)
    rng = np.random.default_rng(3)
    reqs = [
        ScheduledRequest(rng.integers(0, cfg.vocab_size, n).tolist(), 0, list(range(4 * i, 4 * i + 4)))
        for i, n in enumerate((7, 3, 11))
    ]
    md, _ = build_metadata(reqs, page_size=PAGE, num_pages=NUM_PAGES)
    return cfg, params, md


def _cache(cfg, dtype="fp32"):
    return init_kv_cache(
        cfg.num_hidden_layers,
        NUM_PAGES,
        PAGE,
        kv_lora_rank=cfg.kv_lora_rank,
        rope_dim=cfg.qk_rope_head_dim,
        dtype=dtype,
        allow_any_page_size=True,
    )


def _expert_shapes(group) -> set[tuple[int, ...]]:
    """Stacked shapes [layers, E, out, in] of a layer group's expert weights as one device holds them, checked to
    be the shape of no other param (the checks below find the experts by shape)."""

    def local(w):
        return tuple(w.addressable_shards[0].data.shape)

    shapes = {local(w) for w in jax.tree.leaves(group["mlp"]["experts"])}
    others = {local(w) for w in jax.tree.leaves({**group, "mlp": {**group["mlp"], "experts": None}})}
    assert not shapes & others, (shapes, others)  # gate/up [.., I, D], down [.., D, I] (the same when I == D)
    return shapes


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (jit, shard_map, scan, pallas_call bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub)


def _scan_xs(eqn) -> list:
    """A scan equation's scanned operands (its operands are consts, carry, xs)."""
    p = eqn.params
    if "num_consts" in p:  # older jax
        return list(eqn.invars[p["num_consts"] + p["num_carry"] :])
    _, _, xs = p["ft_in"].update(list(eqn.invars)).unpack()  # jax 0.11: a flat tree of the three groups
    return list(xs)


def _expert_operands(fn, shapes):
    """(shapes of scanned xs operands that look like stacked experts, shapes of expert-shaped operands of the
    kernel calls, number of kernel calls) in the jaxpr of fn()."""
    scanned, kernel_in, kernels = [], [], 0
    for eqn in _eqns(jax.make_jaxpr(fn)().jaxpr):
        if eqn.primitive.name == "scan":
            scanned += [v.aval.shape for v in _scan_xs(eqn) if v.aval.shape in shapes]
        elif eqn.primitive.name == "pallas_call" and str(eqn.params.get("name")).startswith("grouped_"):
            kernels += 1
            kernel_in += [v.aval.shape for v in eqn.invars if v.aval.shape in shapes]
    return scanned, kernel_in, kernels


def test_one_device_step_reads_stacked_experts_in_place(setup):
    cfg, params, md = setup
    shapes = _expert_shapes(params["model"]["moe_layers"])
    cache, mdd = _cache(cfg), md.to_device()
    for gmm_impl in ("pallas", "ragged_dot"):
        scanned, kernel_in, kernels = _expert_operands(
            lambda: step.jit_step(params, cfg, cache, mdd, gmm_impl=gmm_impl), shapes
        )
        if gmm_impl == "pallas":
            assert scanned == []  # the scan slices no expert weights
            # gate + up (one fused kernel), down: the three expert stacks, each read whole
            assert kernels == 2 and len(kernel_in) == 3
        else:  # the ragged_dot path still scans the experts: the check would catch the old pallas path
            assert len(scanned) == 3 and kernels == 0
    scanned, kernel_in, kernels = _expert_operands(
        lambda: model.forward(params, cfg, jnp.zeros((1, 5), jnp.int32), gmm_impl="pallas"), shapes
    )
    assert scanned == [] and kernels == 2 and len(kernel_in) == 3


def test_parallel_step_reads_stacked_experts_in_place(setup):
    cfg, params, md = setup
    for mesh, moe in ((dict(ep=8), "ep"), (dict(tp=2), "tp")):
        plan = parallel.ParallelPlan(parallel.make_mesh(**mesh), moe=moe)
        sp = plan.shard_params(params, cfg)
        shapes = _expert_shapes(sp["model"]["moe_layers"])
        cache, mdr = plan.init_cache(cfg, NUM_PAGES, PAGE, dtype="fp32"), plan.replicate(md)
        scanned, kernel_in, kernels = _expert_operands(
            lambda: step.jit_step(sp, cfg, cache, mdr, plan=plan, gmm_impl="pallas"), shapes
        )
        assert scanned == [] and kernels == 2 and len(kernel_in) == 3, (mesh, scanned, kernel_in)


def _step_temp_bytes(cfg, dtype, gmm_impl) -> tuple[int, int]:
    """(temp bytes of the compiled one-device decode step, bytes of one expert matrix [E, I, D]), compiled from
    abstract params (nothing allocated)."""
    params = jax.eval_shape(lambda k: model.init_params(cfg, k, dtype=dtype), jax.random.key(0))
    cache = jax.eval_shape(lambda: _cache(cfg, "bf16" if dtype == jnp.bfloat16 else "fp32"))
    md, _ = build_metadata([ScheduledRequest([1], 5, [0, 1])], page_size=PAGE, num_pages=NUM_PAGES)
    ma = step.jit_step.lower(params, cfg, cache, md.to_device(), gmm_impl=gmm_impl).compile().memory_analysis()
    one = cfg.n_routed_experts * cfg.moe_intermediate_size * cfg.hidden_size * jnp.dtype(dtype).itemsize
    return ma.temp_size_in_bytes, one


def test_step_temp_memory_holds_no_expert_copy():
    """The compiled step's scratch memory: a per-layer slice of the experts (what the scan over xs made, gate,
    up and down: ~3 matrices here, as ragged_dot, which still slices, shows) is gone with pallas."""
    cfg = parallel_config(num_hidden_layers=3, hidden_size=128, moe_intermediate_size=256, n_routed_experts=32)
    temp, one = _step_temp_bytes(cfg, jnp.float32, "pallas")
    assert temp < one / 2, (temp, one)  # ~0.7 MB vs 4 MB (the old pallas path: 13 MB)
    temp, one = _step_temp_bytes(cfg, jnp.float32, "ragged_dot")
    assert temp >= one, (temp, one)  # the measure does see a per-layer slice


@pytest.mark.gpu
def test_gpu_step_temp_memory_holds_no_expert_copy():
    """The same on the GPU (the real Triton kernel, no interpret mode) with DeepSeek-V2-Lite's experts
    (64 x 1408 x 2048 bf16, 369 MB a matrix): the step's scratch must be far below one matrix."""
    cfg = parallel_config(
        num_hidden_layers=3, hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64, num_experts_per_tok=6
    )
    temp, one = _step_temp_bytes(cfg, jnp.bfloat16, "pallas")
    assert temp < one / 4, (temp, one)


def _step_logits(params, cfg, md, gmm_impl, plan=None):
    if plan is None:
        f = jax.jit(step.jit_step.__wrapped__, static_argnames=("cfg", "gmm_impl"), compiler_options=FAST_COMPILE)
        return np.asarray(f(params, cfg, _cache(cfg), md.to_device(), gmm_impl=gmm_impl)[0])
    f = jax.jit(step.jit_step.__wrapped__, static_argnames=("cfg", "plan", "gmm_impl"), compiler_options=FAST_COMPILE)
    cache = plan.init_cache(cfg, NUM_PAGES, PAGE // plan.dcp, dtype="fp32")  # virtual pages of PAGE rows
    out = f(plan.shard_params(params, cfg), cfg, cache, plan.replicate(md), plan=plan, gmm_impl=gmm_impl)[0]
    return parallel.to_host(out)


def test_stacked_experts_numerics(setup):
    """pallas (stacked experts, layer index) == ragged_dot (scanned experts) on one device, for the step and
    the full forward; the 8-device step with pallas (expert parallel, moe="tp", TP2xDCP2xEP2) == one device."""
    cfg, params, md = setup
    want = _step_logits(params, cfg, md, "ragged_dot")
    one = _step_logits(params, cfg, md, "pallas")
    assert np.abs(one - want).max() < ATOL and np.abs(want).max() > 1
    ids = jnp.asarray(np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
    fwd = jax.jit(model.forward.__wrapped__, static_argnames=("cfg", "gmm_impl"), compiler_options=FAST_COMPILE)
    np.testing.assert_allclose(
        np.asarray(fwd(params, cfg, ids, gmm_impl="pallas")), np.asarray(fwd(params, cfg, ids)), atol=ATOL, rtol=0
    )
    for mesh, moe in ((dict(ep=8), "ep"), (dict(tp=2), "tp"), (dict(tp=2, dcp=2, ep=2), "ep")):
        plan = parallel.ParallelPlan(parallel.make_mesh(**mesh), moe=moe)
        got = _step_logits(params, cfg, md, "pallas", plan)
        assert np.abs(got - one).max() < ATOL, (mesh, moe)


def test_decode_copies_unsorted_under_expert_parallelism(setup):
    """A decode step of 2 tokens (4 copies <= layers.BY_ROW_MAX_COPIES: the grouped kernel takes them unsorted,
    other devices' copies as padding rows) on 8 expert-parallel devices == the one-device sorted ragged_dot."""
    cfg, params, _ = setup
    reqs = [ScheduledRequest([5], 6, list(range(4 * i, 4 * i + 4))) for i in range(2)]
    md, _ = build_metadata(reqs, page_size=PAGE, num_pages=NUM_PAGES)
    want = _step_logits(params, cfg, md, "ragged_dot")
    plan = parallel.ParallelPlan(parallel.make_mesh(ep=8), moe="ep")
    got = _step_logits(params, cfg, md, "pallas", plan)
    assert np.abs(got - want).max() < ATOL and np.abs(want).max() > 1
