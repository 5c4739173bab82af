"""MoE routing and the sorted ragged_dot expert path against a dense per-token reference in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import layers, model
from mla_jax.layers import LayerRow, moe, route
from tests.mla_jax.helpers import tiny_config
from tests.mla_jax.multihost_worker import random_params

CASES = {
    "v3_noaux_tc": dict(),
    "v3_no_norm": dict(norm_topk_prob=False),
    "v2_greedy": dict(
        model_type="deepseek_v2",
        topk_method="greedy",
        scoring_func="softmax",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
    ),
    "v2_group_limited": dict(
        model_type="deepseek_v2",
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        n_group=4,
        topk_group=2,
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
    ),
    "v2_norm": dict(
        model_type="deepseek_v2",
        topk_method="greedy",
        scoring_func="softmax",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        num_experts_per_tok=3,
    ),
}


def _np_route(p, cfg, x):
    logits = x.astype(np.float64) @ np.asarray(p["weight"], np.float64).T
    E, K, T = cfg.n_routed_experts, cfg.num_experts_per_tok, x.shape[0]
    if cfg.scoring_func == "softmax":
        s = np.exp(logits - logits.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
    else:
        s = 1 / (1 + np.exp(-logits))
    ids = np.zeros((T, K), int)
    w = np.zeros((T, K))
    for t in range(T):
        choice = s[t] + (np.asarray(p["e_score_correction_bias"]) if cfg.topk_method == "noaux_tc" else 0)
        groups = choice.reshape(cfg.n_group, -1)
        if cfg.topk_method == "noaux_tc":
            gs = np.sort(groups, axis=-1)[:, -2:].sum(-1)
        else:
            gs = groups.max(-1)
        keep = np.argsort(-gs)[: cfg.topk_group] if cfg.topk_method != "greedy" else np.arange(cfg.n_group)
        mask = np.repeat(np.isin(np.arange(cfg.n_group), keep), E // cfg.n_group)
        masked = np.where(mask, choice, -np.inf)
        ids[t] = np.argsort(-masked)[:K]
        w[t] = s[t, ids[t]]
        if cfg.norm_topk_prob and (cfg.topk_method == "noaux_tc" or K > 1):
            w[t] /= w[t].sum()
            if cfg.topk_method == "noaux_tc":
                w[t] *= cfg.routed_scaling_factor
        else:
            w[t] *= cfg.routed_scaling_factor
    return w, ids


def _silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_matches_dense_reference(case):
    cfg = tiny_config(**CASES[case])
    params = random_params(cfg, 7, std=0.3)
    p = jax.tree.map(lambda a: np.asarray(a[0], np.float64), params["model"]["moe_layers"]["mlp"])
    x = np.asarray(jax.random.normal(jax.random.key(8), (37, cfg.hidden_size)), np.float32)

    w_ref, ids_ref = _np_route(p["gate"], cfg, x)
    w, ids = route(jax.tree.map(jnp.asarray, p["gate"]), cfg, jnp.asarray(x))
    order = np.argsort(np.asarray(ids), axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, -1), np.sort(ids_ref, -1))
    np.testing.assert_allclose(np.sort(np.asarray(w), -1), np.sort(w_ref, -1), rtol=1e-5, atol=1e-6)
    assert len(np.unique(ids_ref)) > cfg.num_experts_per_tok  # routing differs across tokens

    ex = p["experts"]
    want = np.zeros_like(x, np.float64)
    for t in range(x.shape[0]):
        for k in range(cfg.num_experts_per_tok):
            e = ids_ref[t, k]
            h = _silu(ex["gate_proj"]["weight"][e] @ x[t]) * (ex["up_proj"]["weight"][e] @ x[t])
            want[t] += w_ref[t, k] * (ex["down_proj"]["weight"][e] @ h)
    sh = p["shared_experts"]
    want += (sh["down_proj"]["weight"] @ (_silu(sh["gate_proj"]["weight"] @ x.T) * (sh["up_proj"]["weight"] @ x.T))).T
    got = moe(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), p), cfg, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_pallas_grouped_matmul_in_moe():
    """The Pallas grouped GEMM (interpret mode) gives the MoE layer the same result as ragged_dot."""
    cfg = tiny_config()
    params = random_params(cfg, 9, std=0.3)
    p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    x = jax.random.normal(jax.random.key(10), (21, cfg.hidden_size))
    want = moe(p, cfg, x, gmm_impl="ragged_dot")
    got = moe(p, cfg, x, gmm_impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gmm_impl"):
        moe(p, cfg, x, gmm_impl="dense")


def _primitives(jaxpr):
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


@pytest.mark.parametrize("T, max_copies", [(1, None), (8, None), (9, None), (9, 16)])
def test_decode_copies_skip_the_sort(T, max_copies, monkeypatch):
    """Up to BY_GROUP_MAX_COPIES token copies (T x top-k) go to the grouped kernel unsorted (each copy its own item
    up to BY_ROW_MAX_COPIES, else items by expert; no argsort, no inverse permutation); more are sorted by expert
    (here past a limit of 16). Both give the ragged_dot result; under expert parallelism the other devices' copies
    come out 0 either way (`test_parallel`)."""
    if max_copies is not None:
        monkeypatch.setattr(layers, "BY_GROUP_MAX_COPIES", max_copies)
    cfg = tiny_config()
    K = cfg.num_experts_per_tok
    params = random_params(cfg, 9, std=0.3)
    p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size))
    got = moe(p, cfg, x, gmm_impl="pallas")
    want = moe(p, cfg, x, gmm_impl="ragged_dot")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    prims = _primitives(jax.make_jaxpr(lambda v: moe(p, cfg, v, gmm_impl="pallas"))(x).jaxpr)
    assert ("sort" in prims) == (T * K > layers.BY_GROUP_MAX_COPIES), sorted(prims)


@pytest.mark.parametrize("T, max_copies", [(1, None), (9, None), (9, 16)])
def test_fp8_experts_at_decode_sizes_take_the_triton_kernel(T, max_copies, monkeypatch):
    """Block-FP8 experts with gmm_impl "pallas" at decode sizes (`layers.fp8_experts_triton`) run the Triton grouped
    kernel's W8A8 path (gate and up in one call; unsorted copies at T = 1 and 9, items by expert at 9; sorted past
    BY_GROUP_MAX_COPIES, here 16), the fp8 shared experts as
    chunk groups of the same two calls, with the portable W8A8 path's output (`fp8_grouped_matmul_xla` through
    ragged_dot and a separate shared MLP: the same quantization, but gate and up rounded to bf16 before the SwiGLU,
    so the down projection's e4m3 rounding of its input differs: 1.8-2.5% apart in norm, each 5-7% from float32 on
    these weights; with float32 activations the two agree to float32 rounding); more than FP8_LINEAR_MAX_T tokens do
    not take it."""
    from mla_jax.checkpoint.fp8 import quantize_params

    if max_copies is not None:
        monkeypatch.setattr(layers, "BY_GROUP_MAX_COPIES", max_copies)
    cfg = tiny_config(hidden_size=128, moe_intermediate_size=128)
    params = quantize_params(random_params(cfg, 5, std=0.3))[0]
    p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    assert layers.is_fp8(p["experts"]["gate_proj"])
    x = jax.random.normal(jax.random.key(T), (T, cfg.hidden_size)).astype(jnp.bfloat16)
    want = moe(p, cfg, x, gmm_impl="ragged_dot").astype(jnp.float32)
    calls = []
    kernel = layers.gmm_kernel.grouped_matmul

    def spy(*a, **kw):
        calls.append(tuple(kw.get(k) is not None for k in ("rhs_scale", "up_rhs", "row_groups", "shared_scale")))
        return kernel(*a, **kw)

    monkeypatch.setattr(layers.gmm_kernel, "grouped_matmul", spy)
    got = moe(p, cfg, x, gmm_impl="pallas").astype(jnp.float32)
    by_row = T * cfg.num_experts_per_tok <= layers.BY_GROUP_MAX_COPIES
    assert calls == [(True, True, by_row, True), (True, False, by_row, True)], calls
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) < 0.04
    # float32 activations: no bf16 rounding between the GEMMs on either path, so the same quantized operands and the
    # same output up to the order of float32 sums
    x32 = x.astype(jnp.float32)
    got32, want32 = moe(p, cfg, x32, gmm_impl="pallas"), moe(p, cfg, x32, gmm_impl="ragged_dot")
    np.testing.assert_allclose(np.asarray(got32), np.asarray(want32), rtol=0, atol=1e-5 * float(jnp.abs(want32).max()))
    monkeypatch.setattr(layers, "FP8_LINEAR_MAX_T", T - 1)
    calls.clear()
    moe(p, cfg, x, gmm_impl="pallas")
    assert not calls


@pytest.mark.parametrize("T", [2])  # (sorted: test_decode_copies_skip_the_sort[9-16])
def test_shared_experts_run_in_the_routed_kernels(T):
    """With the grouped Pallas kernel the shared experts are S more copies per token in the routed experts'
    kernels (`shared_fusable`): the same MoE output as the separate shared MLP (ragged_dot) for 2 tokens (two
    tokens' rows in each shared chunk's item), and no dot of the shared weights outside the kernels (the only dot
    left is the router's)."""
    cfg = tiny_config()
    params = random_params(cfg, 9, std=0.3)
    p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    assert layers.shared_fusable("pallas", p["experts"], p["shared_experts"], True) == cfg.n_shared_experts
    assert layers.shared_fusable("ragged_dot", p["experts"], p["shared_experts"], True) == 0
    x = jax.random.normal(jax.random.key(20 + T), (T, cfg.hidden_size))
    got = moe(p, cfg, x, gmm_impl="pallas")
    want = moe(p, cfg, x, gmm_impl="ragged_dot")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    jaxpr = jax.make_jaxpr(lambda v: moe(p, cfg, v, gmm_impl="pallas"))(x).jaxpr
    dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1, dots  # the router's logits


@pytest.mark.parametrize("T", [1, 2, 9])  # 9: past BY_ROW_MAX_COPIES, items by expert
def test_decode_output_left_as_copies_for_the_next_norm(T):
    """A decode step's MoE output may stay uncombined (`moe(combine=False)`: the down kernel's copies in token order
    and the router weights, `ExpertCopies`): combined, it is moe()'s output bitwise. `moe_copies` says where: the
    Pallas kernel, copies in token order, nothing to reduce across devices; elsewhere moe(combine=False) refuses."""
    cfg = tiny_config()
    K, S = cfg.num_experts_per_tok, cfg.n_shared_experts
    params = random_params(cfg, 9, std=0.3)
    p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    x = jax.random.normal(jax.random.key(40 + T), (T, cfg.hidden_size))
    assert layers.moe_copies(p, cfg, T, gmm_impl="pallas") == S
    got = moe(p, cfg, x, gmm_impl="pallas", combine=False)
    assert isinstance(got, layers.ExpertCopies) and got.shared == S
    assert got.copies.shape == (T * (K + S), cfg.hidden_size) and got.weights.shape == (T, K)
    np.testing.assert_array_equal(np.asarray(got.combine()), np.asarray(moe(p, cfg, x, gmm_impl="pallas")))
    big = layers.BY_GROUP_MAX_COPIES // K + 1  # sorted copies
    assert layers.moe_copies(p, cfg, big, gmm_impl="pallas") is None
    assert layers.moe_copies(p, cfg, T, gmm_impl="ragged_dot") is None
    with pytest.raises(ValueError, match="combined in the layer"):
        moe(p, cfg, x, gmm_impl="ragged_dot", combine=False)
    # a dense layer's output in this form combines to itself
    f = jax.random.normal(jax.random.key(3), (T, cfg.hidden_size))
    np.testing.assert_array_equal(np.asarray(layers.ExpertCopies.of(f, K, S).combine()), np.asarray(f))


def test_forward_with_copies_carried_between_layers(monkeypatch):
    """One token a sequence (a decode-sized T): the layer loop carries the MoE output as `ExpertCopies` into the
    next layer's norm (the Pallas experts; the dense layer's output converted once at the MoE group's entry) and
    gives the logits of the combined path (ragged_dot)."""
    cfg = tiny_config(num_hidden_layers=4)
    params = random_params(cfg, 5, std=0.3)
    ids = jnp.asarray([[3]], jnp.int32)
    want = model.forward(params, cfg, ids, gmm_impl="ragged_dot")
    entries = []
    of = layers.ExpertCopies.of
    monkeypatch.setattr(layers.ExpertCopies, "of", staticmethod(lambda *a: entries.append(a[1:]) or of(*a)))
    got = model.forward(params, cfg, ids, gmm_impl="pallas")
    assert entries == [(cfg.num_experts_per_tok, cfg.n_shared_experts)]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("mode, T", [("ep", 1), ("tp", 9)])
def test_shared_experts_in_the_routed_kernels_on_shards(mode, T):
    """Two ranks (a vmap with an axis name stands in for the mesh): expert parallel (4 whole experts each, the
    shared expert's intermediate halved: one chunk each) or the experts' intermediate split (each rank every
    expert's half and the shared expert's half: two chunks). Each rank's routed + shared partial, all-reduced,
    equals the one-device MoE; another rank's copies come out 0, unsorted (-1) and sorted alike."""
    from mla_jax.comm import Comm

    cfg = tiny_config(moe_intermediate_size=16, n_shared_experts=2)  # shared intermediate 32: 16 a rank
    params = random_params(cfg, 9, std=0.3)
    p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    x = jax.random.normal(jax.random.key(30 + T), (T, cfg.hidden_size))
    want = moe(p, cfg, x, gmm_impl="ragged_dot")

    def halves(a, axis):
        return jnp.stack(jnp.split(a, 2, axis=axis))

    ex, sh = p["experts"], p["shared_experts"]
    cut = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}  # the intermediate axis of [out, in]
    shards = dict(p)
    shards["shared_experts"] = {n: {"weight": halves(sh[n]["weight"], a)} for n, a in cut.items()}
    if mode == "ep":
        shards["experts"] = {n: {"weight": halves(ex[n]["weight"], 0)} for n in cut}
    else:
        shards["experts"] = {n: {"weight": halves(ex[n]["weight"], a + 1)} for n, a in cut.items()}
    shards["gate"] = jax.tree.map(lambda a: jnp.stack([a, a]), p["gate"])
    comm = Comm(model_axes=("r",))
    rank0 = jax.tree.map(lambda a: a[0], shards)
    chunks = layers.shared_fusable("pallas", rank0["experts"], rank0["shared_experts"], True)
    assert chunks == (1 if mode == "ep" else 2)
    assert (
        layers.moe_copies(rank0, cfg, T, gmm_impl="pallas", comm=comm) is None
    )  # partial sums: all-reduced  # the shared half over a whole expert, or over half experts
    got = jax.vmap(lambda q: moe(q, cfg, x, gmm_impl="pallas", comm=comm), axis_name="r")(shards)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(got[1]))


@pytest.mark.parametrize("gmm_impl", ["pallas", "ragged_dot"])
def test_stacked_experts_at_layer(gmm_impl):
    """`moe(..., stacked={"experts": [layers, E, out, in], "shared_experts": [layers, out, in]}, layer=i)` (what
    the layer scans pass with `model.split_experts`) equals the MoE of layer i's own params; the layer may be
    traced."""
    cfg = tiny_config(num_hidden_layers=4)  # 3 MoE layers of distinct weights
    params = random_params(cfg, 11, std=0.3)  # numpy-drawn: no init_params compile for this config
    group = params["model"]["moe_layers"]
    scanned, stacked = model.split_experts(group, True, "pallas")
    assert set(stacked) == {"experts", "shared_experts"}
    assert "experts" not in scanned["mlp"] and "shared_experts" not in scanned["mlp"] and "experts" in group["mlp"]
    x = jax.random.normal(jax.random.key(12), (9, cfg.hidden_size))
    f = jax.jit(lambda p, i: moe(p, cfg, x, gmm_impl=gmm_impl, stacked=stacked, layer=i))
    g = jax.jit(lambda p: moe(p, cfg, x, gmm_impl=gmm_impl))
    for i in range(3):
        want = g(jax.tree.map(lambda a: a[i], group["mlp"]))
        got = f(jax.tree.map(lambda a: a[i], scanned["mlp"]), jnp.int32(i))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    kept, none = model.split_experts(group, True, "ragged_dot")
    assert kept is group and none is None  # the ragged_dot path scans them as before


def test_norms_and_fp8_linears_leave_the_scan_and_come_back_as_layer_rows():
    """`model.split_in_place` takes every layer norm and every stacked fp8 linear (not the routed experts) out of a
    group's scanned params; `with_layer_rows` puts them back as `LayerRow`s whose rows are the layer's own weights
    (what the norm kernel and the fp8 GEMM read in place)."""
    from mla_jax.checkpoint.fp8 import quantize_params

    cfg = tiny_config(num_hidden_layers=4, q_lora_rank=16)
    params = random_params(cfg, 13, std=0.3)
    for fp8 in (False, True):
        group = (quantize_params(params)[0] if fp8 else params)["model"]["moe_layers"]
        rest, rows = model.split_in_place(group)
        linears = [("self_attn", n) for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")]
        linears += [("mlp", "shared_experts", n) for n in ("gate_proj", "up_proj", "down_proj")]
        # the dense linears' weights (q_proj absent: q-LoRA), of an fp8 model only the float32 router's
        dense = {path for path in model.LAYER_LINEARS if path[1] != "q_proj" and (not fp8 or path[1] == "gate")}
        assert set(rows) == set(model.LAYER_NORMS + model.LAYER_ARRAYS) | (set(linears) if fp8 else set()) | dense
        assert "input_layernorm" not in rest and "kv_a_layernorm" not in rest["self_attn"]
        assert ("o_proj" in rest["self_attn"]) != fp8 and "input_layernorm" in group  # the group is untouched
        assert "weight" not in rest["mlp"]["gate"] and "e_score_correction_bias" in rest["mlp"]["gate"]
        assert "experts" in rest["mlp"]  # routed experts stay (split_experts takes them for the Pallas GEMM)
        layer = jax.tree.map(lambda a: a[2], rest)
        back = model.with_layer_rows(layer, rows, jnp.int32(2))
        for path, node in rows.items():
            got, want = back, group
            for key in path:
                got, want = got[key], want[key]
            if not isinstance(node, dict):  # a per-head array (W_UK_T, W_UV)
                got, want, node = {"": got}, {"": want}, {"": node}
            assert set(got) == set(want) == set(node)
            for name, row in got.items():
                assert isinstance(row, LayerRow) and row.shape == want[name].shape[1:]
                np.testing.assert_array_equal(np.asarray(row.stacked[row.index]), np.asarray(want[name][2]))
