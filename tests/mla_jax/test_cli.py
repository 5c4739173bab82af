"""`mla-jax generate` end to end (subprocess), with a tokenizer trained here for the tiny HF fixture."""

import os
import shutil
import subprocess
import sys

import pytest

from tests.mla_jax.helpers import FIXTURES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args, timeout=240):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "mla_jax.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The v3 fixture plus a byte-level BPE tokenizer with the fixture's 256-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("m") / "v3"
    shutil.copytree(os.path.join(FIXTURES, "v3"), d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]
    )
    tok.train_from_iterator(["def hello(world):\n    return world * 2\n"] * 20, trainer)
    assert tok.get_vocab_size() <= 256
    tok.save(str(d / "tokenizer.json"))
    return d


def test_generate_text_streams_and_reports_speed(model_dir):
    r = _cli("generate", "--model", str(model_dir), "--prompt", "def hello", "--max-new-tokens", "6", "--no-stop")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def hello") and len(r.stdout) > len("def hello\n")
    assert "tokens/s" in r.stderr
    assert "loading" not in r.stderr and "compiled step" not in r.stderr  # progress shows on a terminal only


def test_generate_ids_greedy_matches_python_api(model_dir):
    import jax.numpy as jnp

    from mla_jax.checkpoint import load_hf_checkpoint
    from mla_jax.engine import generate
    from mla_jax.sampling import SamplingParams

    r = _cli("generate", "--model", str(model_dir), "--prompt-ids", "5,9,200", "--max-new-tokens", "5", "--no-stop")
    assert r.returncode == 0, r.stderr
    got = [int(t) for t in r.stdout.strip().split(",")]
    cfg, params = load_hf_checkpoint(str(model_dir), dtype=jnp.float32)
    want = generate(params, cfg, [[5, 9, 200]], SamplingParams(max_new_tokens=5))[0].token_ids
    assert got == want


@pytest.mark.parametrize(
    "args,code,msg",
    [
        (["--prompt-ids", "1,x"], 2, "comma-separated integers"),
        (["--prompt-ids", "1,999"], 2, "out of vocab"),
        (["--prompt-ids", "1", "--max-new-tokens", "0"], 2, "--max-new-tokens must be"),
    ],
)
def test_generate_bad_input(model_dir, args, code, msg):
    r = _cli("generate", "--model", str(model_dir), *args)
    assert r.returncode == code and msg in r.stderr, (r.returncode, r.stderr)


def test_generate_needs_tokenizer_for_text():
    r = _cli("generate", "--model", os.path.join(FIXTURES, "v2"), "--prompt", "hi")
    assert r.returncode == 2 and "no tokenizer.json" in r.stderr


def test_help_lists_commands():
    r = _cli("--help")
    assert r.returncode == 0
    for cmd in ("generate", "convert", "bench"):
        assert cmd in r.stdout


def test_bench_smoke_writes_only_where_told(tmp_path):
    """`mla-jax bench --smoke` runs on a CPU (the benchmark lives in the package: no checkout needed) and
    writes its results only into --out."""
    import json

    results = os.path.join(ROOT, "bench", "results")
    before = {f: os.path.getmtime(os.path.join(results, f)) for f in os.listdir(results)}
    r = _cli("bench", "--smoke", "--layers", "2", "--out", str(tmp_path), timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((tmp_path / "e2e-h200.json").read_text())
    assert {row["phase"] for row in res["rows"]} == {"decode", "prefill", "engine"} and res["ceilings"]["copy_TBps"] > 0
    assert {f: os.path.getmtime(os.path.join(results, f)) for f in os.listdir(results)} == before
