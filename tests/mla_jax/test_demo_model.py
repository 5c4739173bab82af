"""The embedded demo model and its pipeline (scripts/make_corpus.py -> scripts/train_demo.py -> mla_jax.checkpoint).

The checks on a model run on the shipped one (mla_jax/data/demo/) when it is there, else on a tiny model
trained and exported here (a few --tiny steps on a corpus of a few stdlib files). The pipeline itself (corpus,
training, checkpoint, export round trip) always runs on the tiny one.

Tolerances (all float32 on CPU):
- paged incremental decode vs teacher-forced full forward: the same weights through two algorithms (absorbed
  MQA over the paged latent cache vs naive MHA) differ only by float32 rounding, ~1e-6 on logits of size ~10;
  mean validation loss within 1e-4 nats, logits within 2e-3 absolute (room for a rare routing flip between the
  two paths, which the loss bound would still catch if it mattered).
- HF reference logits (float64 transformers run, stored by scripts/check_demo_hf.py): within 2e-4 absolute,
  as in test_hf_parity.py.
- export round trip: exact (the exported dtype's values come back bit for bit).
"""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_jax import model
from mla_jax.checkpoint import CheckpointDir, SafetensorsFile, export_hf, load_hf_checkpoint, merge_kv_b_proj
from mla_jax.engine import EngineConfig, generate
from mla_jax.mla import split_kv_b_proj
from mla_jax.sampling import SamplingParams
from tests.mla_jax.helpers import load_script, run_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# MLA_JAX_DEMO_DIR points the tests at another exported model (e.g. a fresh H200 run before it is copied in).
DEMO_DIR = os.environ.get("MLA_JAX_DEMO_DIR") or os.path.join(ROOT, "mla_jax", "data", "demo")
SHIPPED = os.path.exists(os.path.join(DEMO_DIR, "model.safetensors"))
MAX_SHIPPED_BYTES = 25 * 1024 * 1024


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Corpus of 12 stdlib files, 8 training steps of the tiny preset, export: (train_demo module, args, record)."""
    pytest.importorskip("optax", reason="training needs the `train` extra (optax)")
    td = load_script("train_demo")
    out = tmp_path_factory.mktemp("demo_pipeline")
    args = td.parse_args(
        [
            "--tiny",
            "--data",
            str(out / "corpus"),
            "--out",
            str(out / "run"),
            "--ckpt-dir",
            str(out / "ckpt"),
            "--steps",
            "8",
            "--corpus-files",
            "12",
            "--eval-every",
            "4",
            "--log-every",
            "2",
            "--eval-windows",
            "4",
            "--final-eval-windows",
            "8",
            "--sample-tokens",
            "0",
        ]
    )
    rec = td.run(args)
    return td, args, rec


@pytest.fixture(scope="module")
def demo(request):
    """(model dir, cfg, float32 params, tokenizer, validation token ids): the shipped model or the tiny one."""
    from tokenizers import Tokenizer

    if SHIPPED:
        path = DEMO_DIR
    else:
        _, args, _ = request.getfixturevalue("tiny_run")
        path = os.path.join(args.out, "demo")
    cfg, params = load_hf_checkpoint(path, dtype=jnp.float32)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    if SHIPPED:  # held-out text: the first validation-split file of this interpreter's stdlib
        mc = load_script("make_corpus")
        root = mc.stdlib_dir()
        rel = next(r for r in mc.list_sources(root) if mc.is_val(r) and mc.read_source(os.path.join(root, r)))
        val = np.asarray(tok.encode(mc.read_source(os.path.join(root, rel))).ids, np.int32)
    else:
        val = np.fromfile(os.path.join(args.data, "val.bin"), np.uint16).astype(np.int32)
    return path, cfg, params, tok, val


# ---- pipeline ----------------------------------------------------------------------------------------------
def test_corpus_is_deterministic_and_split_by_file(tiny_run, tmp_path):
    td, args, rec = tiny_run
    mc = load_script("make_corpus")
    again = mc.build_corpus(str(tmp_path / "c"), vocab_size=args.vocab_size, limit=args.corpus_files, quiet=True)
    with open(os.path.join(args.data, "corpus.json")) as f:
        first = json.load(f)
    assert again["sha256"] == first["sha256"]
    # Split by file: the hash rule picks the val files (a corpus this small may have none: then the last file).
    assert first["val_files"] == ([r for r in first["val_files"] if mc.is_val(r)] or first["val_files"][-1:])
    assert first["files"]["val"] >= 1 and first["tokens"]["val"] > 0 and first["bytes"]["train"] > 0
    assert rec["corpus"]["python"] and rec["corpus"]["eos_token_id"] == 0


def test_training_record_and_checkpoint(tiny_run):
    td, args, rec = tiny_run
    assert rec["run"]["steps"] == 8 and len(rec["curve"]) == 4 and len(rec["val_curve"]) == 2
    losses = [r["train_loss"] for r in rec["curve"]]
    assert all(math.isfinite(x) for x in losses)
    vocab = rec["model"]["config"]["vocab_size"]
    assert rec["curve"][0]["train_loss"] > rec["final_val_loss"] and rec["final_val_loss"] < math.log(vocab)
    assert all("load_max_over_mean" in r for r in rec["curve"])  # the routing-bias update ran
    with open(os.path.join(args.out, "train-demo.json")) as f:
        assert json.load(f)["final_val_loss"] == rec["final_val_loss"]
    # The checkpoint (safetensors, no pickle) restores params and optimizer state at its step.
    cfg = td.model_config(args.preset, vocab, args.seq_len)
    tx = td.make_optimizer(td.Hyper())
    p0 = td.init_train_params(cfg, 1)
    params, opt, step = td.load_checkpoint(os.path.join(args.ckpt_dir, "train_state.safetensors"), p0, tx.init(p0))
    assert step == 8
    bias = params["model"]["moe_layers"]["mlp"]["gate"]["e_score_correction_bias"]
    assert np.abs(np.asarray(bias)).max() > 0  # moved by the load rule, not by gradients


def test_routing_loads_mirror_forward(tiny_run):
    """The bias update counts loads with a forward that must be model.forward's."""
    td, args, rec = tiny_run
    cfg = td.model_config("tiny", 128, 32)
    params = td.init_train_params(cfg, 3)
    ids = jax.random.randint(jax.random.key(0), (2, 32), 0, 128)
    loads, logits = td.routing_loads(params, cfg, ids)
    want = model.forward(params, cfg, ids)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5, rtol=0)
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert loads.shape == (n_moe, cfg.n_routed_experts)
    assert (np.asarray(loads).sum(-1) == ids.size * cfg.num_experts_per_tok).all()


def test_kv_b_proj_merge_inverts_split(tiny_run):
    td, args, rec = tiny_run
    cfg = td.model_config("tiny", 128, 32)
    N, P, V, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    w = jax.random.normal(jax.random.key(1), (N * (P + V), L))
    np.testing.assert_array_equal(np.asarray(merge_kv_b_proj(*split_kv_b_proj(w, cfg))), np.asarray(w))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_export_round_trip(tiny_run, tmp_path, dtype):
    td, args, rec = tiny_run
    vocab = rec["model"]["config"]["vocab_size"]
    cfg = td.model_config(args.preset, vocab, args.seq_len)
    tx = td.make_optimizer(td.Hyper())
    p0 = td.init_train_params(cfg, 1)
    params, _, _ = td.load_checkpoint(os.path.join(args.ckpt_dir, "train_state.safetensors"), p0, tx.init(p0))
    files = export_hf(params, cfg, os.path.join(args.data, "tokenizer.json"), tmp_path, dtype=dtype)
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    with open(tmp_path / "config.json") as f:
        c = json.load(f)
    assert c["model_type"] == "deepseek_v3" and c["architectures"] == ["DeepseekV3ForCausalLM"]
    assert c["eos_token_id"] == 0
    names = CheckpointDir(str(tmp_path)).keys()
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert "model.layers.0.self_attn.kv_b_proj.weight" in names
    assert not any("W_UK_T" in n or "gate_up_proj" in n for n in names)
    cfg2, loaded = load_hf_checkpoint(str(tmp_path))
    assert cfg2 == cfg
    want_dt = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[dtype]
    flat_w = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_l = dict((jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(loaded)[0])
    assert len(flat_w) == len(flat_l)
    for p, x in flat_w:
        k = jax.tree_util.keystr(p)
        router = "'gate'" in k and "e_score_correction_bias" in k
        expect = np.asarray(x if router else x.astype(want_dt)).astype(np.float32)
        np.testing.assert_array_equal(np.asarray(flat_l[k]).astype(np.float32), expect, err_msg=k)


# ---- the demo model ----------------------------------------------------------------------------------------
def test_paged_decode_val_loss_equals_full_forward(demo):
    """Validation loss token by token through the paged latent cache (absorbed decode) == teacher-forced loss of
    the full forward (naive attention)."""
    path, cfg, params, tok, val = demo
    n = 40
    seqs = [val[:n].tolist(), val[len(val) // 2 : len(val) // 2 + n].tolist()]
    rows = run_schedule(params, cfg, seqs, [[(0, 1), (1, 1)]] * n, page_size=16, num_pages=16)
    paged = np.zeros((2, n, cfg.vocab_size), np.float32)
    for r, pos, lg in rows:
        paged[r, pos] = lg
    ids = jnp.asarray(np.asarray(seqs, np.int32))
    full = np.asarray(model.forward(params, cfg, ids, attention="naive"))

    def nll(logits):
        lp = jax.nn.log_softmax(jnp.asarray(logits[:, :-1]), axis=-1)
        return float(-jnp.take_along_axis(lp, ids[:, 1:, None], axis=-1).mean())

    loss_paged, loss_full = nll(paged), nll(full)
    assert abs(loss_paged - loss_full) <= 1e-4, (loss_paged, loss_full)
    np.testing.assert_allclose(paged, full, atol=2e-3, rtol=0)
    if SHIPPED:  # a trained model: far below the uniform loss
        assert loss_full < 0.7 * math.log(cfg.vocab_size)


def test_seeded_generation_is_deterministic(demo):
    path, cfg, params, tok, val = demo
    prompt = tok.encode("def parse(self, text):").ids
    # The engine shape `mla-jax generate` uses for a short prompt on CPU: the CLI test reuses these compiles.
    ec = EngineConfig(
        max_model_len=64,
        max_num_seqs=1,
        page_size=16,
        token_budget=64,
        max_prefills=1,
        cache_dtype="fp32",
        backend="xla",
    )

    def run(seed):
        sp = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, seed=seed)
        return generate(params, cfg, [prompt], sp, ec)[0].token_ids

    a, b, c = run(7), run(7), run(8)
    assert a == b  # same seed, same tokens
    assert a != c  # another seed, other tokens


def test_cli_generate_on_demo(demo, capsys):
    """What `make demo` runs: `mla-jax generate --model DIR --prompt ...` streams a continuation."""
    from mla_jax.cli import main

    path = demo[0]
    assert main(["generate", "--model", path, "--prompt", "import os\n", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith("import os\n") and len(out.out) > len("import os\n")
    assert "tokens/s" in out.err


def test_hf_reference_logits(demo):
    """transformers' DeepseekV3ForCausalLM on the same files (scripts/check_demo_hf.py) gives our logits."""
    path, cfg, params, tok, val = demo
    ref_path = os.path.join(path, "hf_reference.safetensors")
    if not os.path.exists(ref_path):
        pytest.skip("no hf_reference.safetensors: run /tmp/hfvenv/bin/python scripts/check_demo_hf.py DIR")
    ref = SafetensorsFile(ref_path)
    ids = np.asarray(ref.get("input_ids"))
    assert ids.tolist() == tok.encode(ref.metadata["prompt"]).ids[: len(ids)]
    want = np.asarray(ref.get("logits"), np.float64)
    for algorithm in ("naive", "absorbed"):
        got = np.asarray(model.forward(params, cfg, jnp.asarray(ids)[None], attention=algorithm)[0])
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=0, err_msg=algorithm)


@pytest.mark.skipif(not SHIPPED, reason="no shipped model in mla_jax/data/demo")
def test_shipped_model_files():
    files = {f: os.path.getsize(os.path.join(DEMO_DIR, f)) for f in os.listdir(DEMO_DIR)}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert sum(files.values()) <= MAX_SHIPPED_BYTES
    assert os.path.exists(os.path.join(DEMO_DIR, "hf_reference.safetensors")), "run scripts/check_demo_hf.py"
