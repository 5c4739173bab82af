"""Hardening (issue #28), tried as a new user would: strict tensor names, NaN/Inf weights, checksums of converted
checkpoints, early validation of the CLI's flags and of `generate`'s inputs, progress on a terminal only, the
Makefile's stale-venv check, clean interruption of `convert`, and a seeded fuzz test of the loaders."""

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from mla_jax.checkpoint import CheckpointError, convert, load_model, mtp_layer_index
from mla_jax.config import DeepseekConfig
from tests.mla_jax.helpers import FIXTURES, copy_fixture, read_tensors, rewrite_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8_FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf_fp8")


def _edit_config(d, **changes):
    p = os.path.join(d, "config.json")
    with open(p) as f:
        c = json.load(f)
    c.update(changes)
    with open(p, "w") as f:
        json.dump(c, f)


def _quiet(**kw):
    return dict(log=None, progress=False, **kw)


# ------------------------------------------------------------------------------- 1. strict tensor names


def test_mtp_layer_index_accepts_only_declared_mtp_layers():
    cfg = DeepseekConfig.from_json(FP8_FIXTURE)  # 4 layers + num_nextn_predict_layers 1
    assert cfg.num_nextn_predict_layers == 1
    for rel in ("enorm.weight", "eh_proj.weight_scale_inv", "shared_head.head.weight", "self_attn.o_proj.weight"):
        assert mtp_layer_index(f"model.layers.4.{rel}", cfg) == 0, rel
    assert mtp_layer_index("model.layers.4.mlp.experts.3.up_proj.weight", cfg) == 0
    for name in (
        "model.layers.4.extra.weight",  # not an MTP or decoder tensor name
        "model.layers.5.enorm.weight",  # beyond num_nextn_predict_layers
        "model.layers.3.enorm.weight",  # a decoder layer
        "model.layers.4.mlp.experts.99.up_proj.weight",  # no such expert
        "model.norm.weight",
    ):
        assert mtp_layer_index(name, cfg) is None, name


@pytest.mark.parametrize(
    "what,match",
    [
        ("fewer_layers", r"unexpected tensor 'model\.layers\.3\..*num_hidden_layers 3"),
        ("fewer_layers_mtp", r"'model\.layers\.3\.\*' is not an MTP layer \(no 'model\.layers\.3\.enorm\.weight'\)"),
        ("junk_layer", r"unexpected tensor 'model\.layers\.9\.extra\.weight'"),
        ("junk_in_mtp", r"unexpected tensor 'model\.layers\.4\.extra\.weight'"),
    ],
)
def test_strict_names_on_load_and_convert(tmp_path, what, match):
    d = copy_fixture("v3", tmp_path)  # 4 layers, num_nextn_predict_layers 1, no MTP tensors
    if what == "fewer_layers":
        _edit_config(d, num_hidden_layers=3, num_nextn_predict_layers=0)
    elif what == "fewer_layers_mtp":
        _edit_config(d, num_hidden_layers=3)  # layer 3 would be taken for the MTP layer
    else:
        t = read_tensors(d)
        t["model.layers.9.extra.weight" if what == "junk_layer" else "model.layers.4.extra.weight"] = np.ones(3)
        if what == "junk_in_mtp":
            t |= {f"model.layers.4.{k}": np.ones(4, np.float32) for k in ("enorm.weight", "hnorm.weight")}
        rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match=match):
        load_model(str(d))
    with pytest.raises(CheckpointError, match=match):
        convert(str(d), str(tmp_path / "out"), **_quiet())
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------------------------- 2. NaN / Inf weights


@pytest.mark.parametrize(
    "tensor,value",
    [
        ("model.layers.2.mlp.experts.5.up_proj.weight", np.nan),  # a stacked expert: named with its index
        ("model.layers.0.self_attn.kv_b_proj.weight", np.inf),  # split into W_UK_T / W_UV on load
        ("lm_head.weight", -np.inf),
    ],
)
def test_nonfinite_weights_rejected_by_load_model(tmp_path, tensor, value):
    d = copy_fixture("v3", tmp_path)
    t = read_tensors(d)
    t[tensor].reshape(-1)[7] = value
    rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match=f"tensor '{tensor}' contains NaN or Inf"):
        load_model(str(d))


def test_nan_fp8_scale_rejected_by_load_and_convert(tmp_path):
    d = tmp_path / "fp8"
    shutil.copytree(FP8_FIXTURE, d)
    t = read_tensors(d)
    name = "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"
    t[name][0, 0] = np.nan
    rewrite_tensors(d, t)
    with pytest.raises(CheckpointError, match=f"tensor '{name}' contains NaN or Inf"):
        load_model(str(d))
    for keep_fp8 in (False, True):
        with pytest.raises(CheckpointError, match=f"tensor '{name}' contains NaN or Inf"):
            convert(str(d), str(tmp_path / "out"), keep_fp8=keep_fp8, **_quiet())


# --------------------------------------------------------------------------- 3. checksums of converted files


def _rewrite_group_array(out, unit, leaf_path, edit):
    """Replace one array of a converted checkpoint through orbax itself (valid files, wrong contents)."""
    import orbax.checkpoint as ocp

    gdir = os.path.join(out, "params", "group_00000")
    ck = ocp.PyTreeCheckpointer()
    tree = ck.restore(gdir)
    node = tree[unit]
    for k in leaf_path[:-1]:
        node = node[k]
    node[leaf_path[-1]] = edit(np.array(node[leaf_path[-1]]))
    shutil.rmtree(gdir)
    ck.save(gdir, tree)
    ck.close()


def test_checksums_catch_byte_corruption_and_no_verify_skips_them(tmp_path):
    src = os.path.join(FIXTURES, "v3")
    out = str(tmp_path / "out")
    convert(src, out, dtype="fp32", **_quiet())
    meta = json.load(open(os.path.join(out, "mla_jax_checkpoint.json")))
    assert all(len(lf["crc32"]) == 8 for u in meta["units"] for lf in u["leaves"])
    _, want = load_model(out)
    data = os.path.join(out, "params", "group_00000", "ocdbt.process_0", "d")
    big = max((os.path.join(data, f) for f in os.listdir(data)), key=os.path.getsize)
    raw = bytearray(open(big, "rb").read())
    raw[len(raw) // 2] ^= 0x10  # one flipped bit in the middle of the weights
    open(big, "wb").write(raw)
    with pytest.raises(CheckpointError, match=r"array \S+ \(from \S+\) fails its checksum"):
        load_model(out)
    import jax

    try:
        _, got = load_model(out, verify=False)  # skipped: loads, and the weights differ
    except CheckpointError as e:  # unless the flipped bit made a NaN / Inf, which the finite check names
        assert "contains NaN or Inf" in str(e)
    else:
        assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)))

    # Valid files with a NaN written in: the checksum names it, and without it the NaN check does.
    convert(src, out, dtype="fp32", force=True, **_quiet())
    _rewrite_group_array(out, "layer_001-core", ("self_attn", "o_proj", "weight"), lambda x: x * np.nan)
    with pytest.raises(CheckpointError, match=r"layer_001-core/self_attn/o_proj/weight .*fails its checksum"):
        load_model(out)
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.self_attn.o_proj.weight' contains NaN"):
        load_model(out, verify=False)


# ------------------------------------------------------------------ 5. clear errors: EngineConfig, generate


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(page_size=0), r"EngineConfig\.page_size must be an int >= 1, got 0"),
        (dict(max_model_len=-4), r"EngineConfig\.max_model_len must be"),
        (dict(max_num_seqs=0), r"EngineConfig\.max_num_seqs must be"),
        (dict(token_budget=0), r"EngineConfig\.token_budget must be"),
        (dict(max_prefills=1.5), r"EngineConfig\.max_prefills must be"),
        (dict(num_pages=1), r"EngineConfig\.num_pages must be an int >= 2"),
        (dict(decode_buckets=(0, 4)), r"EngineConfig\.decode_buckets"),
        (dict(cache_dtype="int8"), r"EngineConfig\.cache_dtype"),
        (dict(backend="cuda"), r"EngineConfig\.backend must be one of"),
        (dict(gmm_impl="dense"), r"EngineConfig\.gmm_impl must be one of"),
    ],
)
def test_engine_config_names_the_bad_field(kw, match):
    from mla_jax.engine import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)


def test_generate_names_the_bad_prompt_before_any_work():
    """Validation runs on the config alone: params=None proves nothing was built or run."""
    from mla_jax.engine import generate
    from mla_jax.sampling import SamplingParams
    from tests.mla_jax.helpers import tiny_config

    cfg = tiny_config()  # vocab 96, max_position_embeddings 256
    ok = [1, 2, 3]
    cases = [
        ([ok, [1, 2.5, 3]], SamplingParams(), r"prompt 1: token ids must be ints, got float 2\.5"),
        ([ok, ok, "hello"], SamplingParams(), r"prompt 2: the prompt is a str: pass token ids"),
        ([ok, [np.float32(3)]], SamplingParams(), r"prompt 1: token ids must be ints, got float32"),
        ([[True]], SamplingParams(), r"prompt 0: token ids must be ints, got bool"),
        ([ok, [5, 96]], SamplingParams(), r"prompt 1: token id 96 out of vocab \[0, 96\)"),
        ([ok, []], SamplingParams(), r"prompt 1: empty prompt"),
        ([ok, [1] * 257], SamplingParams(), r"prompt 1: prompt length 257 exceeds the model's max_position_emb"),
        ([ok], SamplingParams(temperature=float("inf")), r"prompt 0: temperature must be a finite number"),
        ([ok], SamplingParams(temperature=float("nan")), r"prompt 0: temperature must be a finite number"),
        ([ok], SamplingParams(top_p=float("nan")), r"prompt 0: top_p must be in \(0, 1\]"),
        ([ok, ok], [SamplingParams(), SamplingParams(max_new_tokens=0)], r"prompt 1: max_new_tokens"),
        ([ok, ok], [SamplingParams(), None], r"prompt 1: sampling params must be a SamplingParams"),
    ]
    for prompts, sp, match in cases:
        with pytest.raises(ValueError, match=match):
            generate(None, cfg, prompts, sp)


def test_engine_add_request_rejects_float_ids_and_long_prompts():
    from mla_jax.engine import Engine, EngineConfig
    from mla_jax.sampling import SamplingParams
    from tests.mla_jax.helpers import tiny_config

    cfg = tiny_config(num_hidden_layers=1, first_k_dense_replace=1, max_position_embeddings=32)
    eng = Engine(None, cfg, EngineConfig(max_model_len=64, max_num_seqs=2, page_size=16, token_budget=64))
    for prompt, match in [([1.0, 2.0], "token ids must be ints, got float 1.0"), ([1] * 33, "max_position_emb")]:
        with pytest.raises(ValueError, match=match):
            eng.add_request(prompt, SamplingParams(max_new_tokens=2))
    assert not eng.has_unfinished


# ------------------------------------------------------- 4, 5, 6. the CLI: flags first, clear errors, progress


# Runs `mla_jax.cli.main` (the `mla-jax` entry point) on each argv of a JSON list in one fresh process (one JAX
# import for all of them); prints [[exit code, stderr], ...].
BATCH_CLI = """
import contextlib, io, json, sys
from mla_jax.cli import main
out = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out.append([rc, err.getvalue()])
print(json.dumps(out))
"""


def _env():
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}


def _batch_cli(argvs):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", BATCH_CLI, json.dumps(argvs)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _tokenizer(path):
    """A byte-level BPE tokenizer with at most 256 tokens (the fixtures' vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def hello(world):\n    return world * 2\n"] * 20, trainer)
    tok.save(str(path))


def test_cli_validates_everything_before_loading(tmp_path):
    """Every bad flag or prompt is refused from config.json alone: the model directory has no weights, so any
    check made after loading would report the missing weights instead (the last case)."""
    bare = tmp_path / "bare"  # v3's config.json (vocab 256, max_position_embeddings 512) + a tokenizer, no weights
    bare.mkdir()
    shutil.copy(os.path.join(FIXTURES, "v3", "config.json"), bare)
    _tokenizer(bare / "tokenizer.json")
    badtok = tmp_path / "badtok"
    shutil.copytree(bare, badtok)
    (badtok / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    conv = tmp_path / "conv"
    convert(os.path.join(FIXTURES, "v2"), str(conv), **_quiet())
    meta = json.loads((conv / "mla_jax_checkpoint.json").read_text())
    del meta["units"][1]["leaves"][0]["crc32"]
    (conv / "mla_jax_checkpoint.json").write_text(json.dumps(meta))

    g = ["generate", "--model", str(bare)]
    ids = ["--prompt-ids", "1,2,3"]
    cases = [
        (g + ids + ["--top-p", "1.5"], 2, r"--top-p must be in \(0, 1\], got 1\.5"),
        (g + ids + ["--temperature", "inf"], 2, "--temperature must be a finite number >= 0, got inf"),
        (g + ids + ["--top-k", "-1"], 2, "--top-k must be an int >= 0"),
        (g + ids + ["--seed", "-1"], 2, "--seed must be an int"),
        (g + ids + ["--max-new-tokens", "0"], 2, "--max-new-tokens must be an int >= 1"),
        (
            g + ids + ["--max-new-tokens", "1000000000"],
            2,
            r"--max-new-tokens 1000000000: the prompt \(3 tokens\) \+ 1000000000 new tokens exceed the model's "
            r"max_position_embeddings 512; at most 509 new tokens fit",
        ),
        (
            g + ["--prompt-ids", ",".join(["7"] * 600)],
            2,
            r"the prompt \(600 tokens\) is longer than the model's max_position_embeddings 512",
        ),
        (g + ["--prompt-ids", "1,2.5"], 2, "--prompt-ids must be comma-separated integers"),
        (g + ["--prompt-ids", "1,256"], 2, r"--prompt-ids: token id 256 out of vocab \[0, 256\)"),
        (g + ids + ["--cache-dtype", "int8"], 2, "invalid choice"),
        (["generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"], 2, "nope: the directory does not exist"),
        (["generate", "--model", str(badtok), "--prompt", "hi"], 1, r"badtok/tokenizer\.json: not a valid tokenizer"),
        (["generate", "--model", str(conv)] + ids, 1, r"missing field 'units\[1\]\.leaves\[0\]\.crc32'"),
        (g + ids, 1, "neither a converted mla-jax checkpoint"),  # valid flags: only now is the model loaded
    ]
    import re

    for (argv, code, match), (rc, err) in zip(cases, _batch_cli([c[0] for c in cases])):
        assert rc == code and re.search(match, err), (argv[3:], rc, err)
        assert len(err.strip().splitlines()) == 1 or code == 2 and "usage:" in err, err  # one line, no traceback


def _one_layer_model(d):
    """A random one-layer dense HF checkpoint (vocab 64, hidden 32)."""
    from mla_jax.checkpoint import hf_tensor_specs, save_file

    cfg = dict(
        model_type="deepseek_v3",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=32,
        max_position_embeddings=128,
    )
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    specs = hf_tensor_specs(DeepseekConfig.from_dict(cfg))
    save_file({k: rng.standard_normal(v).astype(np.float32) * 0.1 for k, v in specs.items()}, d / "model.safetensors")
    return d


def test_cli_progress_on_a_terminal_only(tmp_path):
    """On a terminal `generate` shows the load bar and a line per compiled step; with --quiet nothing (and piped,
    test_cli's runs check, nothing either)."""
    import fcntl
    import pty
    import struct
    import subprocess
    import sys
    import termios

    d = _one_layer_model(tmp_path / "m")  # the smallest model: the compiles dominate this test
    argv = ["generate", "--model", str(d), "--prompt-ids", "5,9", "--max-new-tokens", "2", "--no-stop"]
    script = (
        "import sys; from mla_jax.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "print('=== quiet ===', file=sys.stderr, flush=True)\n"
        f"assert main({argv + ['--quiet']!r}) == 0\n"
    )
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 0-column terminal shows no bar
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=_env(),
        cwd=ROOT,
    )
    os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    p.wait(timeout=240)
    err = b"".join(chunks).decode(errors="replace")
    assert p.returncode == 0, err[-3000:]
    loud, quiet = err.split("=== quiet ===")
    assert "loading" in loud and f"loaded {d}" in loud and "compiled step 1/1 (1 decode rows): " in loud, loud
    for word in ("loading", "loaded", "compiled step", "prefill ("):
        assert word not in quiet, quiet
    assert "tokens/s" in quiet  # the summary line stays


# ------------------------------------------------------------------------- 8. interrupting `convert`

# `mla-jax convert ARGS`, sending itself SIGNAL 1 ms after the second group is written: it lands in the middle
# of the next group's writes (orbax's save, with its worker threads), where an interruption used to leave the
# partial directory behind.
SIGNALLING_CLI = """
import functools, os, signal, sys, threading
import mla_jax.checkpoint
from mla_jax.cli import main

sig = getattr(signal, sys.argv[1])

def hook(written):
    if written == 2:
        threading.Timer(0.001, os.kill, (os.getpid(), sig)).start()

mla_jax.checkpoint.convert = functools.partial(mla_jax.checkpoint.convert, on_group_written=hook)
sys.exit(main(["convert", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupted_convert_cleans_up_and_prints_one_line(tmp_path, sig):
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    src = os.path.join(FIXTURES, "v3")
    r = subprocess.run(
        [sys.executable, "-c", SIGNALLING_CLI, sig, src, str(out), "--max-group-mb", "0.02", "--dtype", "fp32"],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=240,
    )
    lines = [ln for ln in r.stderr.replace("\r", "\n").splitlines() if ln.strip() and not ln.startswith("converting")]
    assert r.returncode == 128 + getattr(signal, sig), r.stderr[-3000:]
    assert lines == [f"mla-jax convert: interrupted ({sig}); the partial output is removed"], r.stderr[-3000:]
    assert os.listdir(tmp_path) == []  # no OUT, no .out.partial-PID


# ---------------------------------------------------------------------- 8. the Makefile's venv, the README


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_makefile_rebuilds_a_stale_venv_and_names_a_wrong_python(tmp_path):
    import subprocess

    for f in ("Makefile", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, f), tmp_path)
    old = tmp_path / "python3.10"  # answers --version, fails everything else (our >= 3.12 check included)
    old.write_text('#!/bin/sh\ncase "$1" in --version) echo "Python 3.10.12";; *) exit 1;; esac\n')
    new = tmp_path / "python3.12"  # passes the check; its `-m venv` does nothing, so the pip step fails after
    new.write_text("#!/bin/sh\nexit 0\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(old, tmp_path / ".venv" / "bin" / "python")
    for p in (old, new, tmp_path / ".venv" / "bin" / "python"):
        p.chmod(0o755)
    stamp = tmp_path / ".venv" / ".installed"
    stamp.touch()
    os.utime(stamp, (os.path.getmtime(tmp_path / "pyproject.toml") + 10,) * 2)  # newer than pyproject.toml

    def make(py):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS"))}  # not a sub-make
        return subprocess.run(
            ["make", "--no-print-directory", "install", f"PY={py}"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )

    r = make(new)
    assert "removing .venv: made by another Python (Python 3.10.12)" in r.stdout, r.stdout + r.stderr
    assert not (tmp_path / ".venv" / "bin" / "python").exists()
    r = make(old)
    assert r.returncode != 0
    assert (
        f"make: mla-jax needs Python >= 3.12 and PY={old} is Python 3.10.12; install 3.12 and run: "
        "make PY=/path/to/python3.12 install"
    ) == r.stdout.strip(), r.stdout + r.stderr


def test_readme_says_how_to_get_the_cli_on_path():
    readme = open(os.path.join(ROOT, "README.md")).read()
    quickstart = readme[readme.index("## Quickstart") : readme.index("## Use")]
    assert ".venv/bin/mla-jax" in quickstart and "source .venv/bin/activate" in quickstart


# ------------------------------------------------------------------------------------------------- fuzz

FUZZ_CASES = int(
    os.environ.get("MLA_JAX_FUZZ_CASES", 60)
)  # ~0.05 s each once the first load compiled; seeded, so a failure names a reproducible case
JUNK = [0, -1, 10**12, 1.5, "x", None, [], {}, True]


def _header_flip(d, rng):
    """One byte of model.safetensors' JSON header xor'ed with a random bit pattern."""
    p = d / "model.safetensors"
    raw = bytearray(p.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    pos = 8 + int(rng.integers(n))
    raw[pos] ^= int(rng.integers(1, 256))
    p.write_bytes(bytes(raw))
    return f"header byte {pos}"


def _mutate_hf(d, tensors, cfg_dict, rng):
    """One random mutation of an HF checkpoint directory -> (description, expectation): "error" (must raise a
    named error), "same" (must load the reference params exactly) or "either" (one of the two, or for config
    values a load of a valid config)."""
    names = sorted(tensors)
    t = dict(tensors)
    name = names[int(rng.integers(len(names)))]
    kind = ["header", "shape", "dtype", "missing", "extra", "ignored", "mtp", "config"][int(rng.integers(8))]
    if kind == "header":
        return _header_flip(d, rng), "either"
    if kind == "config":
        key = sorted(cfg_dict)[int(rng.integers(len(cfg_dict)))]
        value = JUNK[int(rng.integers(len(JUNK)))]
        _edit_config(d, **{key: value})
        return f"config {key}={value!r}", "either"
    if kind == "shape":
        x = t[name]
        shape = list(x.shape)
        op = int(rng.integers(3))
        if op == 0:
            shape[int(rng.integers(len(shape)))] += int(rng.integers(1, 3))
        elif op == 1 and len(shape) > 1:
            shape = shape[:-2] + [shape[-2] * shape[-1]]
        else:
            shape = [1] + shape
        t[name] = np.resize(x, shape)
        desc = f"shape of {name} {x.shape} -> {tuple(shape)}"
    elif kind == "dtype":
        dt = [np.int32, np.int8, np.uint8, np.bool_, np.int64, ml_dtypes.float8_e5m2][int(rng.integers(6))]
        t[name] = t[name].astype(dt)
        desc = f"dtype of {name} -> {np.dtype(dt).name}"
    elif kind == "missing":
        del t[name]
        desc = f"missing {name}"
    elif kind == "extra":
        layer = int(rng.integers(0, 12))
        rel = ["extra.weight", "mlp.experts.99.up_proj.weight", "enorm.weight", "self_attn.o_proj.weight"]
        extra = f"model.layers.{layer}.{rel[int(rng.integers(len(rel)))]}"
        if extra in t:
            extra = "model.extra.weight"
        t[extra] = np.ones(4, np.float32)
        desc = f"extra {extra}"
    elif kind == "ignored":
        layer = int(rng.integers(0, 3))
        t[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
        rewrite_tensors(d, t)
        return "an ignored rotary_emb.inv_freq buffer", "same"
    else:  # a declared MTP layer, as DeepSeek-V3 ships it
        pre = f"model.layers.{cfg_dict['num_hidden_layers']}."
        t |= {pre + k: np.ones(4, np.float32) for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
        t[pre + "eh_proj.weight"] = np.ones((4, 8), np.float32)
        t[pre + "self_attn.o_proj.weight"] = np.ones((4, 4), np.float32)
        rewrite_tensors(d, t)
        _edit_config(d, num_nextn_predict_layers=1)
        return "a declared MTP layer", "same"
    rewrite_tensors(d, t)
    return desc, "error"


def _mutate_converted(d, meta, rng):
    """One random mutation of a converted checkpoint: a metadata field deleted or replaced by junk, or a byte of
    a group's files flipped."""
    if rng.integers(2):
        data = sorted(p for p in (d / "params").rglob("*") if p.is_file())
        p = data[int(rng.integers(len(data)))]
        raw = bytearray(p.read_bytes())
        if not raw:
            return f"empty {p.name}", "same"
        pos = int(rng.integers(len(raw)))
        raw[pos] ^= int(rng.integers(1, 256))
        p.write_bytes(bytes(raw))
        return f"byte {pos} of {p.relative_to(d)}", "either"
    m = json.loads(json.dumps(meta))
    node, path = m, []
    while isinstance(node, (dict, list)) and node and (not path or rng.random() < 0.7):
        keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
        k = keys[int(rng.integers(len(keys)))]
        if not isinstance(node[k], (dict, list)) or not node[k]:
            break
        node, path = node[k], path + [k]
    keys = sorted(node) if isinstance(node, dict) else list(range(len(node)))
    k = keys[int(rng.integers(len(keys)))]
    if isinstance(node, dict) and rng.integers(2):
        del node[k]
        desc = f"metadata {path + [k]} deleted"
    else:
        node[k] = JUNK[int(rng.integers(len(JUNK)))]
        desc = f"metadata {path + [k]} = {node[k]!r}"
    (d / "mla_jax_checkpoint.json").write_text(json.dumps(m))
    return desc, "either"


def test_fuzz_loaders_give_a_correct_load_or_a_named_error(tmp_path):
    """Seeded random mutations of a small HF checkpoint (header bytes, shapes, dtypes, missing / extra / MTP
    tensors, config values) and of its conversion (metadata fields, bytes of the group files): every load either
    returns the reference params bit for bit (or, for a changed config value, a model of valid shapes) or raises
    CheckpointError / ConfigError; any other exception, a hang (SIGALRM) or different params fail."""
    import signal

    from mla_jax.config import ConfigError
    from tests.mla_jax.helpers import assert_same_params

    base = copy_fixture("v2", tmp_path / "base")
    tensors = read_tensors(base)
    cfg_dict = json.loads((base / "config.json").read_text())
    ref_cfg, ref = load_model(str(base))
    conv = tmp_path / "base" / "conv"
    convert(str(base), str(conv), dtype="fp32", **_quiet())
    meta = json.loads((conv / "mla_jax_checkpoint.json").read_text())
    assert_same_params(load_model(str(conv))[1], ref)

    def hang(*_):
        raise TimeoutError("the load hangs")

    old = signal.signal(signal.SIGALRM, hang)
    rng = np.random.default_rng(int(os.environ.get("MLA_JAX_FUZZ_SEED", 28)))
    outcomes = {"error": 0, "loaded": 0}
    try:
        for case in range(FUZZ_CASES):
            d = tmp_path / f"case{case}"
            on_converted = case % 3 == 2
            shutil.copytree(conv if on_converted else base, d, ignore=shutil.ignore_patterns("conv"))
            if on_converted:
                desc, expect = _mutate_converted(d, meta, rng)
            else:
                desc, expect = _mutate_hf(d, tensors, cfg_dict, rng)
            where = f"case {case} ({'converted' if on_converted else 'HF'}): {desc}"
            signal.alarm(30)
            try:
                cfg, params = load_model(str(d))
            except (CheckpointError, ConfigError) as e:
                assert expect != "same", f"{where}: {e}"
                outcomes["error"] += 1
                if os.environ.get("MLA_JAX_FUZZ_SEED"):
                    print(where, "->", str(e)[:150])
                continue
            finally:
                signal.alarm(0)
            assert expect != "error", f"{where}: loaded"
            outcomes["loaded"] += 1
            if cfg == ref_cfg or expect == "same" or not desc.startswith("config"):
                assert_same_params(params, ref)  # no silent change of the weights
            shutil.rmtree(d)
    finally:
        signal.signal(signal.SIGALRM, old)
    assert outcomes["error"] > FUZZ_CASES // 3 and outcomes["loaded"] > 0, outcomes
