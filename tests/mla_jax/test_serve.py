"""The HTTP server end to end: one real `mla-jax serve` process on a free 127.0.0.1 port with the demo model on CPU
(a copy with a chat template and a generation_config.json), queried with the official `openai` client and httpx.

Outputs are compared with `generate` run in this process with the server's engine config; bad requests must get
400 naming the problem while a stream runs on unaffected; a disconnect mid-stream must free its pages; SIGTERM
must drain and exit 0 (the last test)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

# One server for the whole module: with pytest-xdist, `--dist loadgroup` keeps these tests on one worker.
pytestmark = pytest.mark.xdist_group("serve")

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "mla_jax", "data", "demo")
NAME = "demo"
TEMPLATE = (
    "{% for m in messages %}{{ '### ' + m['role'] + '\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\\n' }}{% endif %}"
)
# The server's engine, small enough to compile quickly: 3 step shapes (decode 16, prefill 64, both).
ENGINE = dict(
    max_model_len=128,
    max_num_seqs=16,
    page_size=16,
    token_budget=64,
    max_prefills=2,
    decode_buckets=(16,),
    prefill_buckets=(64,),
    cache_dtype="fp32",
)
ARGS = [
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "16",
    "--page-size",
    "16",
    "--max-num-batched-tokens",
    "64",
    "--max-prefills",
    "2",
    "--decode-buckets",
    "16",
    "--prefill-buckets",
    "64",
    "--cache-dtype",
    "fp32",
    # the default warm-up (decode 16, prefill 64), with --warmup-logprobs: the mixed step compiles at its first use
    # (the engine tests check that warmup(all_shapes=True) leaves nothing to compile; "full" compiles 12 steps
    # here, 6 of them variants these tests never run)
    "--warmup",
    "basic",
    "--warmup-logprobs",
    "--no-access-log",
    "--timeout-graceful-shutdown",
    "10",
]
GEN_MAX_NEW = 24  # generation_config.json's max_new_tokens: the default max_tokens of chat requests
STARTUP_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, port, log_path, compile_cache):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        import jax

        # the server compiles into a persistent cache (which this process does not read: see `ref`) with the same
        # XLA flags (inherited) and jax config (the tests' matmul precision) as this process: the same programs
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": compile_cache,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        }
        if jax.config.jax_default_matmul_precision:
            env["JAX_DEFAULT_MATMUL_PRECISION"] = str(jax.config.jax_default_matmul_precision)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mla_jax.cli",
                "serve",
                "--model",
                model_dir,
                "--served-model-name",
                NAME,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                *ARGS,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def output(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        pytest.fail(f"server not ready after {STARTUP_S} s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo_serve")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(DEMO, f), d / f)
    tc = json.loads((d / "tokenizer_config.json").read_text())
    tc["chat_template"] = TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(tc))
    (d / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 0, "do_sample": False, "max_new_tokens": GEN_MAX_NEW})
    )
    return str(d)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """A persistent compilation cache shared by the server process and this one (restored afterwards)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = str(tmp_path_factory.mktemp("jax_cache"))
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {n: getattr(jax.config, n) for n in names}
    try:
        yield path
    finally:
        for n, v in old.items():
            jax.config.update(n, v)
        compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def server(model_dir, compile_cache, tmp_path_factory):
    srv = Server(model_dir, _free_port(), str(tmp_path_factory.mktemp("serve_log") / "server.log"), compile_cache)
    try:
        yield srv
    finally:
        srv.stop()


class Reference:
    """`generate` in this process with the server's engine config (its steps compile here, at first use)."""

    def __init__(self, model_dir):
        import jax.numpy as jnp

        from mla_jax.checkpoint import load_model
        from mla_jax.engine import EngineConfig
        from mla_jax.serve.tokenizer import ServeTokenizer

        self.tok = ServeTokenizer(model_dir)
        self.cfg, self.params = load_model(model_dir, dtype=jnp.float32)
        self.config = EngineConfig(**ENGINE)

    def run(self, prompts_ids, params):
        from mla_jax.engine import generate

        return generate(self.params, self.cfg, prompts_ids, params, self.config)

    def greedy(self, prompts, max_tokens, *, chat=False, stop=(0,), **kw):
        from mla_jax.sampling import SamplingParams

        ids = [self.tok.encode_chat(p) if chat else self.tok.encode_prompt(p) for p in prompts]
        outs = self.run(ids, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=tuple(stop), **kw))
        return [(self.tok.decode(o.token_ids), o) for o in outs]


@pytest.fixture(scope="module")
def ref(server, model_dir):
    # The reference compiles in this process without the persistent cache: a cache left enabled in a pytest
    # worker is seen by whatever test that worker runs next (a crash in an interpreted kernel test's compile).
    r = Reference(model_dir)  # loads the model while the server compiles
    server.wait_ready()
    return r


@pytest.fixture(scope="module")
def client(server, ref):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(root):",
    "class Stack:\n    def push(self, item):",
    "    for i, line in enumerate(",
    "# Copyright",
    "return",
    "x = [",
    "while True:\n",
]


def _metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def _metric(m, name, **labels) -> float:
    want = {"model_name": NAME, **labels}
    for key, v in m.items():
        base, _, rest = key.partition("{")
        if base == name and dict(re.findall(r'(\w+)="([^"]*)"', rest)) == want:
            return v
    return 0.0


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 128


def test_completions_match_generate(client, ref):
    want = ref.greedy(PROMPTS[:3], 20)
    r = client.completions.create(model=NAME, prompt=PROMPTS[:3], max_tokens=20, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [t for t, _ in want]
    assert r.usage.completion_tokens == sum(len(o.token_ids) for _, o in want)
    assert r.usage.prompt_tokens == sum(len(ref.tok.encode_prompt(p)) for p in PROMPTS[:3])
    for c, (_, o) in zip(r.choices, want):
        assert c.finish_reason == ("stop" if o.finish_reason == "stop" else "length")
    # streaming: the pieces add up to the same text; the last chunk has the finish reason, then usage
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(pieces) == want[0][0] and len(pieces) > 3
    assert finish == r.choices[0].finish_reason and usage.completion_tokens == len(want[0][1].token_ids)


def test_logprobs(client, ref):
    from mla_jax.sampling import SamplingParams

    ids = ref.tok.encode_prompt(PROMPTS[1])
    (o,) = ref.run([ids], SamplingParams(max_new_tokens=8, stop_token_ids=(0,), logprobs=True, top_logprobs=3))
    r = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(o.token_ids)
    assert lp.tokens == [ref.tok.token_text(t) for t in o.token_ids]
    for got, want, top, want_top in zip(lp.token_logprobs, o.logprobs, lp.top_logprobs, o.top_logprobs):
        assert got == pytest.approx(want, abs=1e-4)
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(got, abs=1e-4)  # greedy: the top one
        assert sorted(top.values(), reverse=True)[:3] == pytest.approx([v for _, v in want_top], abs=1e-4)
    # chat, streaming: top_logprobs alternatives per token
    entries = []
    for chunk in client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    ):
        for c in chunk.choices:
            if c.logprobs is not None:
                entries += c.logprobs.content
    assert entries and all(
        len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == pytest.approx(e.logprob) for e in entries
    )


def test_chat_matches_generate(client, ref):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    text = "### system\nYou write Python.\n### user\ndef add(a, b):\n### assistant\n"  # the template, by hand
    ((want, o),) = ref.greedy([text], 16, chat=True)
    r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == len(ref.tok.encode_chat(text))
    pieces, roles = [], []
    for chunk in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=16, temperature=0, stream=True
    ):
        for c in chunk.choices:
            roles.append(c.delta.role)
            pieces.append(c.delta.content or "")
    assert roles[0] == "assistant" and "".join(pieces) == want
    # no temperature / max_tokens: generation_config.json's defaults (greedy, max_new_tokens)
    ((want24, o24),) = ref.greedy([text], GEN_MAX_NEW, chat=True, stop=())
    r = client.chat.completions.create(model=NAME, messages=messages, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want24 and r.usage.completion_tokens == GEN_MAX_NEW


def test_16_concurrent_streaming_clients(server, ref):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]
    want = [t for t, _ in ref.greedy(prompts, 24)]

    async def one(client, prompt):
        pieces = []
        stream = await client.completions.create(model=NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        async for chunk in stream:
            pieces += [c.text for c in chunk.choices]
        return "".join(pieces)

    async def main():
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(main()) == want


def test_stop_strings(client, ref):
    ((full, o),) = ref.greedy([PROMPTS[2]], 32, stop=())
    # a stop string spanning several tokens, starting a few tokens in
    start = len(ref.tok.decode(o.token_ids[:4]))
    stop = full[start : start + 7]
    assert len(stop) == 7 and full.find(stop) == start
    for include in (False, True):
        want = full[: start + (len(stop) if include else 0)]
        kw = dict(
            model=NAME,
            prompt=PROMPTS[2],
            max_tokens=32,
            temperature=0,
            stop=[stop, "never appears"],
            extra_body={"include_stop_str_in_output": include, "ignore_eos": True},
        )
        r = client.completions.create(**kw)
        assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
        pieces = [c.text for chunk in client.completions.create(**kw, stream=True) for c in chunk.choices]
        assert "".join(pieces) == want
        assert all(stop not in p for p in pieces[:-1])


def test_n_choices_and_seeds(client, ref):
    from mla_jax.sampling import SamplingParams

    ids = ref.tok.encode_prompt(PROMPTS[3])
    want = [
        ref.tok.decode(o.token_ids)
        for o in ref.run(
            [ids] * 3,
            [SamplingParams(temperature=1.0, seed=7 + i, max_new_tokens=12, stop_token_ids=(0,)) for i in range(3)],
        )
    ]
    kw = dict(model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=1.0, n=3, seed=7)
    r = client.completions.create(**kw)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want  # choice i samples with seed + i
    assert len(set(want)) > 1
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == want


def test_bad_requests_named_while_others_run(server, ref):
    ((want, _),) = ref.greedy([PROMPTS[0]], 60, stop=())
    long_prompt = list(range(1, 130))
    bad = [  # (body, field named in param, text the message must contain)
        ('{"prompt": "x", ', None, "invalid JSON"),
        ({"model": "gpt-4", "prompt": "x"}, "model", "gpt-4"),
        ({"prompt": long_prompt}, "prompt", "maximum context length is 128"),
        ({"prompt": "x", "max_tokens": 500}, "max_tokens", "501 tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature", "-1"),
        ({"prompt": "x", "top_p": 0}, "top_p", "top_p"),
        ({"prompt": "x", "n": 0}, "n", "n must be"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be"),
        ({"prompt": "x", "logprobs": 50}, "logprobs", "50"),
        ({"prompt": [1, 2, 99999]}, "prompt", "99999"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"max_tokens": 3}, "prompt", "required"),
        ({"prompt": "x", "temperature": "hot"}, "temperature", "hot"),
    ]
    chat_bad = [
        ({"messages": []}, "messages", "empty"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs", "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tools"),
    ]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:

            async def stream():
                text = ""
                async with c.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        "model": NAME,
                        "prompt": PROMPTS[0],
                        "max_tokens": 60,
                        "temperature": 0,
                        "stream": True,
                        "ignore_eos": True,
                    },
                ) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            text += "".join(ch["text"] for ch in json.loads(line[6:])["choices"])
                return text

            task = asyncio.create_task(stream())
            answers = []
            for path, cases in (("/v1/completions", bad), ("/v1/chat/completions", chat_bad)):
                for body, param, text in cases:
                    if isinstance(body, str):
                        r = await c.post(path, content=body, headers={"Content-Type": "application/json"})
                    else:
                        r = await c.post(path, json=body)
                    answers.append((body, param, text, r.status_code, r.json()))
            return await task, answers

    text, answers = asyncio.run(main())
    for body, param, needle, status, js in answers:
        assert status == 400, (body, js)
        err = js["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
        assert needle in err["message"], (body, err)
    assert text == want  # the stream running meanwhile is unaffected


def test_disconnect_frees_pages(server):
    before = _metrics(server)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={
                "model": NAME,
                "prompt": PROMPTS[1],
                "max_tokens": 100,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks (with their blank separators), then hang up
            assert any(g.startswith("data: ") for g in got)
            m = _metrics(server)
            assert _metric(m, "mla_jax:num_requests_running") == 1 and _metric(m, "mla_jax:kv_cache_pages_used") > 0
    deadline = time.monotonic() + 60
    while True:
        m = _metrics(server)
        aborted = _metric(m, "mla_jax:request_success_total", finished_reason="abort")
        if (
            _metric(m, "mla_jax:num_requests_running") == 0
            and _metric(m, "mla_jax:kv_cache_pages_used") == 0
            and aborted == _metric(before, "mla_jax:request_success_total", finished_reason="abort") + 1
        ):
            break
        assert time.monotonic() < deadline, "the disconnected request still holds pages"
        time.sleep(0.1)
    generated = _metric(m, "mla_jax:generation_tokens_total") - _metric(before, "mla_jax:generation_tokens_total")
    assert generated < 100  # stopped early, not run to max_tokens


def test_prefix_cache_hits_and_metrics(server, client, ref):
    prompt = (
        'import os\nimport sys\nimport argparse\n\n\ndef main(argv):\n    """Parse the command line and run '
        'the tool."""\n    parser = argparse.ArgumentParser(description='
    )
    assert len(ref.tok.encode_prompt(prompt)) > 33  # at least 2 full pages of 16
    ((want, _),) = ref.greedy([prompt], 10)
    before = _metrics(server)
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    assert first.choices[0].text == again.choices[0].text == want
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    m = _metrics(server)
    hits = _metric(m, "mla_jax:prefix_cache_hits_total") - _metric(before, "mla_jax:prefix_cache_hits_total")
    assert hits >= 32 and 0 < _metric(m, "mla_jax:prefix_cache_hit_rate") < 1
    for name in (
        "num_requests_waiting",
        "kv_cache_pages_total",
        "kv_cache_usage_perc",
        "generation_tokens_per_second",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_count",
        "time_per_output_token_seconds_count",
        "e2e_request_latency_seconds_count",
    ):
        assert any(k.startswith(f"mla_jax:{name}") for k in m), name
    assert _metric(m, "mla_jax:time_to_first_token_seconds_count") > 10
    assert _metric(m, "mla_jax:kv_cache_pages_total") == 128


def test_sigterm_drains_and_exits_cleanly(server):
    """Last: SIGTERM while a stream runs; the stream still completes, the process exits 0 without a traceback."""
    with httpx.Client(base_url=server.url, timeout=60) as c:
        with c.stream(
            "POST",
            "/v1/completions",
            json={
                "model": NAME,
                "prompt": PROMPTS[0],
                "max_tokens": 40,
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            },
        ) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
    assert "data: [DONE]" in rest
    assert server.proc.wait(60) == 0
    out = server.output()
    assert "Traceback" not in out and "mla-jax serve: shut down" in out
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
