"""The persistent compilation cache: a second engine start of the same configuration compiles nothing."""

import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import collections, json, logging, jax
    events = collections.Counter()
    jax.monitoring.register_event_listener(lambda e, **_: events.update([e]))
    hits = []  # (module name) of each persistent-cache hit, from jax's compiler log
    class Hits(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("Persistent compilation cache hit"):
                hits.append(record.args[0])
    log = logging.getLogger("jax._src.compiler")
    log.setLevel(logging.DEBUG)
    log.addHandler(Hits())
    from mla_jax import model
    from mla_jax.engine import Engine, EngineConfig
    from tests.mla_jax.helpers import tiny_config

    cfg = tiny_config(num_hidden_layers=2)
    params = model.init_params(cfg, jax.random.key(0))
    ec = EngineConfig(max_model_len=64, max_num_seqs=2, page_size=16, token_budget=32, decode_buckets=(1, 2))
    eng = Engine(params, cfg, ec)
    eng.warmup(prefill=True)
    first = eng.counter.count
    jax.clear_caches()  # drop the in-memory executables: the second start must come from disk
    before, hits[:] = dict(events), []
    eng = Engine(params, cfg, ec)
    eng.warmup(prefill=True)
    new = lambda e: events[e] - before.get(e, 0)
    print(json.dumps(dict(
        dir=jax.config.jax_compilation_cache_dir, first=first, second=eng.counter.count - first,
        misses=new("/jax/compilation_cache/cache_misses"), hits=new("/jax/compilation_cache/cache_hits"),
        step_hits=hits.count("jit_engine_step"))))
    """
)


def _run(env_cache: str) -> dict:
    env = {**os.environ, "MLA_JAX_COMPILE_CACHE": env_cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_start_loads_every_step_from_disk(tmp_path):
    r = _run(str(tmp_path / "cache"))
    assert r["dir"] == str(tmp_path / "cache")
    assert r["first"] >= 3  # two decode buckets and a prefill shape compiled
    # every step shape of the second start read from disk (one small helper program may still compile)
    assert r["step_hits"] == 3 and r["misses"] <= 1, r
    assert os.listdir(tmp_path / "cache")


def test_off_leaves_it_off(monkeypatch):
    """MLA_JAX_COMPILE_CACHE=off (the tests' setting, conftest.py): nothing is turned on (in this process: a
    persistent cache in a pytest worker once aborted a later interpreted kernel's compile)."""
    import jax

    from mla_jax.compile_cache import enable_compile_cache

    for off in ("off", "0", ""):
        monkeypatch.setenv("MLA_JAX_COMPILE_CACHE", off)
        assert enable_compile_cache() is None and not jax.config.jax_compilation_cache_dir


def test_cli_flag_turns_it_off(monkeypatch):
    from mla_jax import cli

    monkeypatch.setenv("MLA_JAX_COMPILE_CACHE", "/somewhere")
    assert cli.main(["generate", "--no-compile-cache", "--model", "/nonexistent-dir", "--prompt-ids", "1"]) == 2
    assert os.environ["MLA_JAX_COMPILE_CACHE"] == "off"


def test_gpu_page_size_is_the_benchmarked_one(monkeypatch):
    """On a GPU, `generate` and the CLI get page 64 and the default backend, which bench/e2e.py measures."""
    import jax

    from mla_jax import attention, engine
    from mla_jax.bench import e2e
    from tests.mla_jax.helpers import tiny_config

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert engine.default_page_size() == engine.GPU_PAGE_SIZE == e2e.GPU_PAGE_SIZE == 64
    seen = {}

    class Stop(Exception):
        pass

    def fake_engine(params, cfg, config, plan=None):
        seen["config"] = config
        raise Stop

    monkeypatch.setattr(engine, "Engine", fake_engine)
    cfg = tiny_config()
    try:
        engine.generate(None, cfg, [[1, 2, 3]])
    except Stop:
        pass
    assert seen["config"].page_size == 64
    assert seen["config"].backend in (None, attention.default_backend_name())
