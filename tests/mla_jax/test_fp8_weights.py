"""FP8 block-scaled weights at run time (`load_model(..., weights="fp8")`, `quantize_params`): what is kept in
fp8, and the fp8 model's accuracy against the dequantized model.

On CPU the fp8 linears run `fp8_matmul_xla`, which has the GPU kernel's numerics (activations quantized per
token per 128 channels, float32 products of the dequantized operands), so these logits are the W8A8 model's.

Tolerances (measured, with margin):
- tests/fixtures/hf_fp8 (a 4-layer random-init V3, hidden 64): tiny random models amplify any rounding (the
  bf16 model alone is 6-14% rms off the float32 one, depending on the tokens); the fp8 model's logits are
  21-29% rms off the float32-dequantized model: bound 35%.
- the shipped demo model (trained, hidden 256) block-quantized: weights 2.6% rms error (bound 3.5%), logits
  4.1% rms (bound 8%), validation loss delta 0.03 nats on two 64-token windows of held-out text (bound 0.06).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model
from mla_jax.checkpoint import load_model
from mla_jax.checkpoint.fp8 import FP8_LINEARS, dequantize_fp8_blocks, quantize_params
from mla_jax.checkpoint.hf import CheckpointDir, SafetensorsFile
from mla_jax.demo import DEMO_DIR
from pallas_kernels import fp8_matmul as F

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_fp8")
BF16_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "v3")


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a))))


def _fp8_leaves(params):
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {jax.tree_util.keystr(k): v for k, v in flat}


@pytest.fixture(scope="module")
def fixture_models():
    cfg, p8 = load_model(FP8_FIXTURE, weights="fp8")
    _, pf = load_model(FP8_FIXTURE, dtype="fp32")
    return cfg, p8, pf


def test_fp8_checkpoint_kept_in_fp8(fixture_models):
    """Every FP8_LINEARS weight stays e4m3 with its HF scale_inv, bit for bit as stored; kv_b_proj is
    dequantized into W_UK_T / W_UV; embeddings, norms, router stay float."""
    cfg, p8, _ = fixture_models
    leaves = _fp8_leaves(p8)
    fp8 = {k for k, v in leaves.items() if v.dtype == jnp.float8_e4m3fn}
    assert fp8 and all(any(f"'{n}']['weight']" in k for n in FP8_LINEARS) for k in fp8)
    for k in fp8:
        assert leaves[k.replace("['weight']", "['weight_scale_inv']")].dtype == jnp.float32
    attn = p8["model"]["moe_layers"]["self_attn"]
    assert attn["W_UK_T"].dtype == jnp.bfloat16 and "kv_b_proj" not in attn
    assert p8["model"]["embed_tokens"]["weight"].dtype == jnp.bfloat16
    assert p8["model"]["moe_layers"]["mlp"]["gate"]["weight"].dtype == jnp.float32
    ckpt = CheckpointDir(FP8_FIXTURE)
    i = cfg.first_k_dense_replace  # first MoE layer: index 0 of the moe stack
    raw = ckpt.get(f"model.layers.{i}.mlp.experts.3.down_proj.weight")
    raw_s = ckpt.get(f"model.layers.{i}.mlp.experts.3.down_proj.weight_scale_inv")
    got = p8["model"]["moe_layers"]["mlp"]["experts"]["down_proj"]
    np.testing.assert_array_equal(np.asarray(got["weight"][0, 3]).view(np.uint8), raw.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got["weight_scale_inv"][0, 3]), raw_s)


def test_fp8_fixture_logits_close_to_dequantized(fixture_models):
    cfg, p8, pf = fixture_models
    ids = (jnp.arange(24, dtype=jnp.int32)[None] * 7) % cfg.vocab_size
    l8, lf = (np.asarray(model.forward(p, cfg, ids)) for p in (p8, pf))
    assert np.all(np.isfinite(l8))
    assert _rms(l8 - lf) / _rms(lf) <= 0.35


def test_bf16_checkpoint_quantized_at_load():
    """A float checkpoint is block-quantized as it is read (the same quantizer as `quantize_params`)."""
    _, p8 = load_model(BF16_FIXTURE, weights="fp8")
    w = p8["model"]["dense_layers"]["mlp"]["gate_proj"]
    assert w["weight"].dtype == jnp.float8_e4m3fn and w["weight_scale_inv"].dtype == jnp.float32
    wd = F.dequantize_weight_blocks(w["weight"][0], w["weight_scale_inv"][0])
    ref = jnp.asarray(CheckpointDir(BF16_FIXTURE).get("model.layers.0.mlp.gate_proj.weight"), jnp.float32)
    assert float(jnp.abs(wd - ref).max()) <= float(jnp.abs(ref).max()) * 2.0**-4
    with pytest.raises(ValueError, match="weights must be one of"):
        load_model(BF16_FIXTURE, weights="int4")


@pytest.mark.skipif(not os.path.exists(os.path.join(DEMO_DIR, "model.safetensors")), reason="no shipped demo model")
def test_demo_model_fp8_validation_loss():
    from tokenizers import Tokenizer

    spec = importlib.util.spec_from_file_location("make_corpus", os.path.join(ROOT, "scripts", "make_corpus.py"))
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    tok = Tokenizer.from_file(os.path.join(DEMO_DIR, "tokenizer.json"))
    root = mc.stdlib_dir()
    rel = next(r for r in mc.list_sources(root) if mc.is_val(r) and mc.read_source(os.path.join(root, r)))
    val = np.asarray(tok.encode(mc.read_source(os.path.join(root, rel))).ids, np.int32)
    n = 64
    ids = jnp.asarray(np.stack([val[:n], val[len(val) // 2 : len(val) // 2 + n]]))

    cfg, p = load_model(DEMO_DIR, dtype=jnp.float32)
    p8, err = quantize_params(p)
    assert err["tensors"] == 17 + 10 * cfg.num_mtp_layers and err["rms_rel"] <= 0.035 and err["max_rel"] <= 2.0**-4

    def nll(params):
        lg = model.forward(params, cfg, ids)
        lp = jax.nn.log_softmax(lg[:, :-1], axis=-1)
        return float(-jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1).mean()), np.asarray(lg)

    (loss, lg), (loss8, lg8) = nll(p), nll(p8)
    assert abs(loss8 - loss) <= 0.06, (loss, loss8)
    assert _rms(lg8 - lg) / _rms(lg) <= 0.08


def test_numpy_quantizer_matches_device_quantizer():
    from mla_jax.checkpoint.fp8 import quantize_fp8_blocks

    w = np.random.default_rng(5).standard_normal((2, 200, 300)).astype(np.float32)
    q, s = quantize_fp8_blocks(w)
    qj, sj = F.quantize_weight_blocks(jnp.asarray(w))
    np.testing.assert_array_equal(q.view(np.uint8), np.asarray(qj).view(np.uint8))
    np.testing.assert_allclose(s, np.asarray(sj), rtol=1e-6)


@pytest.mark.parametrize("src", [BF16_FIXTURE, FP8_FIXTURE])
def test_convert_weights_fp8_round_trip(src, tmp_path):
    """`convert --weights fp8` stores the FP8_LINEARS as e4m3 + scale (a float source block-quantized, its error
    reported and recorded), and `load_model(..., weights="fp8")` restores exactly what the HF path keeps."""
    import io
    import json

    from mla_jax.checkpoint import convert
    from mla_jax.checkpoint.layout import METADATA

    log = io.StringIO()
    out = str(tmp_path / "ck")
    convert(src, out, weights="fp8", log=log, progress=False)
    with open(os.path.join(out, METADATA)) as f:
        meta = json.load(f)
    assert meta["weights"] == "fp8"
    if src == BF16_FIXTURE:
        q = meta["fp8_quantization"]
        assert q["tensors"] > 0 and 0 < q["rms_rel"] <= 0.035 and q["max_rel"] <= 2.0**-4
        assert "block-quantized" in log.getvalue()
    else:
        assert "fp8_quantization" not in meta  # stored as is, nothing quantized
    _, got = load_model(out, weights="fp8")
    _, want = load_model(src, weights="fp8")
    g, w = _fp8_leaves(got), _fp8_leaves(want)
    assert set(g) == set(w)
    for k in w:
        if w[k].dtype == jnp.float8_e4m3fn or k.endswith("scale_inv']"):
            assert g[k].dtype == w[k].dtype, k
            np.testing.assert_array_equal(np.asarray(g[k]).view(np.uint8), np.asarray(w[k]).view(np.uint8), k)


def test_fp8_weights_on_mesh_match_one_device():
    """fp8 params on a TP 2 x EP 2 mesh (paged steps, shard_map): the block scales are laid out with their
    weights (dense MLP split in whole 128-blocks, experts by E, the rest replicated where a shard would cut a
    block), and the logits equal the one-device fp8 run up to the order of sums: most rows exactly; a sum order
    that flips the e4m3 rounding of one quantized activation moves a row by up to ~0.1 (logits ~5). Casting
    the attention output to bf16 before o_proj (a bug once) moved every row by ~0.4."""
    from mla_jax import parallel
    from mla_jax.sharding import param_shardings
    from tests.mla_jax.multihost_worker import (
        SCHEDULE,
        parallel_config,
        random_params,
        run_schedule_parallel,
        sequences,
    )

    cfg = parallel_config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, v_head_dim=32)
    params, _ = quantize_params(random_params(cfg, 0, std=0.2))
    seqs = sequences(cfg)
    plan = parallel.ParallelPlan(parallel.make_mesh(tp=2, ep=2))
    sh = param_shardings(params, cfg, plan.mesh)
    dense = sh["model"]["dense_layers"]["mlp"]["down_proj"]
    assert dense["weight"].spec == dense["weight_scale_inv"].spec and dense["weight"].spec[2] is not None
    out = run_schedule_parallel(params, cfg, seqs, SCHEDULE, plan=plan)
    one = {(r, pos): lg for r, pos, lg in run_schedule_parallel(params, cfg, seqs, SCHEDULE)}
    errs = np.asarray([float(np.abs(lg - one[r, pos]).max()) for r, pos, lg in out])
    assert len(errs) == 17 and np.all(np.isfinite(errs)) and errs.max() < 0.25, errs
    assert np.mean(errs < 1e-3) >= 0.5, errs


@pytest.mark.parametrize("tokens", [16, 80])
def test_fp8_model_lowers_with_the_kernels_for_gpu(monkeypatch, h200, tokens):
    """With the GPU dispatch forced, the whole fp8 model (dense linears, experts read in place inside the layer
    scan) lowers for CUDA: at decode sizes (<= FP8_LINEAR_MAX_T tokens) the Triton linear and grouped kernels'
    W8A8 paths (q_a + kv_a in one call, gate and up in one, the shared experts' chunks in the routed kernels), above
    them the Mosaic GPU W8A8 GEMMs; shapes, dtypes and the stacked weights' indexing."""
    from mla_jax import layers
    from mla_jax.memory import abstract_params
    from tests.mla_jax.helpers import tiny_config

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    dims = dict(hidden_size=256, vocab_size=512, num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128)
    dims |= dict(qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, intermediate_size=512)
    cfg = tiny_config(moe_intermediate_size=128, **dims)
    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    f = jax.jit(lambda p, i: model.forward(p, cfg, i, gmm_impl="pallas"))
    txt = f.trace(abstract_params(cfg, weights="fp8"), ids).lower(lowering_platforms=("cuda",)).as_text()
    linear_fp8 = re.findall(r'name = "(linear\d)_fp8_bt', txt)
    grouped_fp8 = re.findall(r'name = "(grouped_\w+?)_fp8_bm', txt)
    if tokens <= layers.FP8_LINEAR_MAX_T:  # (identical kernel calls are lowered once: kinds, not counts)
        assert set(linear_fp8) == {"linear1", "linear2"}, linear_fp8  # q_a + kv_a, gate + up in one call
        # the shared experts as chunk groups of the routed kernels
        assert set(grouped_fp8) == {"grouped_glu_shared", "grouped_matmul_shared"}, grouped_fp8
        assert "fp8_matmul" not in txt
        # the GLU's output quantized in its epilogue (128-wide N blocks) for the down projection
        assert re.search(r'name = "grouped_glu\w*_q"', txt)
    else:
        assert not linear_fp8 and not grouped_fp8
        assert txt.count("fp8_matmul") >= 3 * 4 + 3 + 2 * 6
    # the layer scan hands the kernels whole stacked weights (`layers.LayerRow`): the only fp8 weight slices left are
    # those of the linears the Mosaic GPU kernel does not take (kv_a_proj's N = 160), which XLA's dot path reads
    sliced = re.findall(r"dynamic_slice [^\n]*sizes = \[1, (\d+), (\d+)\] : \(tensor<[^>]*xf8E4M3FN>", txt)
    assert all(F.unsupported_reason(int(n), int(k)) is not None for n, k in sliced), sliced
    assert bool(sliced) == (tokens > layers.FP8_LINEAR_MAX_T), sliced


TOKENIZER = '{"version": "1.0", "model": {"vocab": {"<|endoftext|>": 0}}}'


def test_export_fp8_round_trip(fixture_models, tmp_path):
    """export_hf(dtype="fp8") of the FP8 fixture loaded in fp8 writes DeepSeek's format back: every FP8_LINEARS
    weight and its scale_inv byte for byte as the source stored them, the quantization_config, the rest bf16;
    loading the export with weights="fp8" gives the same params (float leaves cast to bf16). Exported in fp32,
    the fp8 pairs come out dequantized (not their raw e4m3 values)."""
    import json

    from mla_jax.checkpoint import export_hf, load_hf_checkpoint

    cfg, p8, _ = fixture_models
    export_hf(p8, cfg, TOKENIZER, tmp_path / "fp8", dtype="fp8", eos_token=None)
    with open(tmp_path / "fp8" / "config.json") as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [128, 128]
    src, out = CheckpointDir(FP8_FIXTURE), CheckpointDir(str(tmp_path / "fp8"))
    kept = [n for n in src.keys() if n.rsplit(".", 2)[-2] in FP8_LINEARS and src.spec(n)[0] == jnp.float8_e4m3fn]
    assert kept and all(n in out.keys() for n in kept)
    for n in kept:
        assert out.spec(n)[0] == jnp.float8_e4m3fn, n
        np.testing.assert_array_equal(out.get(n).view(np.uint8), src.get(n).view(np.uint8), n)
        np.testing.assert_array_equal(out.get(n + "_scale_inv"), src.get(n + "_scale_inv"), n)
    assert out.spec("model.layers.0.self_attn.kv_b_proj.weight")[0] == jnp.bfloat16
    assert not any(n.endswith("_scale_inv") and n[: -len("_scale_inv")] not in kept for n in out.keys())
    cfg2, back = load_hf_checkpoint(str(tmp_path / "fp8"), weights="fp8")
    # the fixture's MTP layer is incomplete (not loaded), so the export has none
    assert dataclasses.replace(cfg2, num_nextn_predict_layers=1, mtp_loaded=False) == cfg
    got, want = _fp8_leaves(back), _fp8_leaves(p8)
    assert set(got) == set(want)
    for k, x in want.items():
        if x.dtype == jnp.float8_e4m3fn:
            np.testing.assert_array_equal(np.asarray(got[k]).view(np.uint8), np.asarray(x).view(np.uint8), k)
        elif "scale_inv" in k:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(x), k)
        elif "e_score_correction_bias" not in k:
            np.testing.assert_array_equal(
                np.asarray(got[k], np.float32), np.asarray(x.astype(jnp.bfloat16), np.float32)
            )

    export_hf(p8, cfg, TOKENIZER, tmp_path / "f32", dtype="fp32", eos_token=None)
    with open(tmp_path / "f32" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    n = kept[0]
    deq = dequantize_fp8_blocks(src.get(n), src.get(n + "_scale_inv"))
    np.testing.assert_array_equal(CheckpointDir(str(tmp_path / "f32")).get(n), deq)


def test_export_fp8_from_float_reports_error(tmp_path):
    """A float model exported in fp8: its FP8_LINEARS block-quantized (error in the safetensors metadata),
    reloaded within e4m3 rounding of each block."""
    import json

    from mla_jax.checkpoint import export_hf, load_hf_checkpoint

    cfg, pf = load_model(BF16_FIXTURE, dtype="fp32")
    export_hf(pf, cfg, TOKENIZER, tmp_path, dtype="fp8", eos_token=None)
    err = json.loads(SafetensorsFile(str(tmp_path / "model.safetensors")).metadata["fp8_quantization"])
    assert err["tensors"] > 0 and 0 < err["rms_rel"] <= 0.035 and err["max_rel"] <= 2.0**-4
    _, back = load_hf_checkpoint(str(tmp_path), weights="fp8")
    w = back["model"]["dense_layers"]["mlp"]["gate_proj"]
    ref = np.asarray(pf["model"]["dense_layers"]["mlp"]["gate_proj"]["weight"][0])
    wd = np.asarray(F.dequantize_weight_blocks(w["weight"][0], w["weight_scale_inv"][0]))
    assert np.abs(wd - ref).max() <= np.abs(ref).max() * 2.0**-4


def test_fp8_decode_step_shared_chunks_match_the_unfused_step(monkeypatch):
    """The fp8 model's decode step (3 requests, a token each, over random cached rows: the routed copies unsorted,
    the fp8 shared experts as chunk groups of the routed Triton kernels, the copies combined by the next layer's
    norm) against the same step with gmm_impl ragged_dot (the portable W8A8 experts, a separate shared MLP, the MoE
    output combined in the layer). float32 activations: the same quantized operands, so the same logits up to the
    order of float32 sums (a wrong chunk, scale block or combine moves them by the shared experts' share, ~30%)."""
    import dataclasses

    from mla_jax import layers, step
    from mla_jax.cache import init_kv_cache_for
    from mla_jax.metadata import ScheduledRequest, build_metadata
    from tests.mla_jax.multihost_worker import parallel_config, random_params

    cfg = parallel_config(hidden_size=256, intermediate_size=512, moe_intermediate_size=128, v_head_dim=32)
    params, _ = quantize_params(random_params(cfg, 0, std=0.2))
    moe_p = jax.tree.map(lambda a: a[0], params["model"]["moe_layers"]["mlp"])
    assert layers.moe_copies(moe_p, cfg, 3, gmm_impl="pallas") == cfg.n_shared_experts  # fused, left uncombined
    page, pages = 4, 16
    rng = np.random.default_rng(5)
    reqs = [
        ScheduledRequest([int(rng.integers(cfg.vocab_size))], ctx, list(range(4 * i, 4 * i + 4)))
        for i, ctx in enumerate((5, 2, 9))
    ]
    md, _ = build_metadata(reqs, page_size=page, num_pages=pages, is_decode=[True] * 3)
    cache0 = init_kv_cache_for(cfg, pages, page, dtype="fp32", allow_any_page_size=True)
    rows = rng.standard_normal(cache0.kv_c_and_k_pe_cache.shape).astype(np.float32)
    calls = []
    kernel = layers.gmm_kernel.grouped_matmul

    def spy(*a, **kw):
        calls.append(kw.get("shared_scale") is not None)
        return kernel(*a, **kw)

    monkeypatch.setattr(layers.gmm_kernel, "grouped_matmul", spy)

    f = jax.jit(step.jit_step.__wrapped__, static_argnames=("cfg", "gmm_impl"))  # its own cache: traced here

    def logits(gmm_impl, p=params):
        cache = dataclasses.replace(cache0, kv_c_and_k_pe_cache=jnp.asarray(rows))
        return np.asarray(f(p, cfg, cache, md, gmm_impl=gmm_impl)[0], np.float32)

    fused, unfused = logits("pallas"), logits("ragged_dot")
    assert calls and all(calls), calls  # the step traced the grouped kernels with the shared chunks
    no_shared = logits(
        "ragged_dot",
        jax.tree_util.tree_map_with_path(
            lambda path, a: jnp.zeros_like(a) if "shared_experts" in jax.tree_util.keystr(path) else a, params
        ),
    )
    diff = np.linalg.norm(fused - unfused) / np.linalg.norm(unfused)
    share = np.linalg.norm(no_shared - unfused) / np.linalg.norm(unfused)
    assert np.isfinite(fused).all() and diff < 1e-4 and share > 0.1, (diff, share)
