"""Serving pieces without a server: incremental detokenization, stop strings with streaming hold-back, chat
templates (HF semantics), BOS and generation_config defaults, and the engine loop's abort and failure paths
(with a stub engine: no model, no compiles)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("jinja2")

from mla_jax.serve.chat import ChatTemplate, ChatTemplateError, find_chat_template  # noqa: E402
from mla_jax.serve.detokenizer import IncrementalDetokenizer, TextOutput  # noqa: E402
from mla_jax.serve.tokenizer import GenerationDefaults, ServeTokenizer  # noqa: E402

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "mla_jax", "data", "demo")


@pytest.fixture(scope="module")
def tok():
    return ServeTokenizer(DEMO)


TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)",
    "café → naïve 日本語 ✓ done",
    "    for i, line in enumerate(lines):\n        print(i)\n\n\nx = 1",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(tok, text):
    ids = tok.encode_prompt(text)
    prompt = tok.encode_prompt("# a prompt\n")
    d = IncrementalDetokenizer(tok.tokenizer, prompt_ids=prompt)
    pieces = [d.add(i) for i in ids + [0]]  # the special eos token adds nothing
    assert "".join(pieces) == tok.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[-1] == ""


@settings(max_examples=60, deadline=None)
@given(text=st.sampled_from(TEXTS), data=st.data())
def test_stop_strings_hold_back_and_cut(text, data):
    """Streamed pieces always add up to the final text; no released piece holds text a stop string could still
    claim; the text is cut at the earliest stop string."""
    tok = ServeTokenizer(DEMO)
    ids = tok.encode_prompt(text)
    n = len(text)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, min(n, a + 8)))
        stops.append(text[a:b] if data.draw(st.booleans()) else text[a:b] + "\x00")  # some never match
    include = data.draw(st.booleans())
    out = TextOutput(tok.tokenizer, stop=stops, include_stop_str_in_output=include)
    pieces, stopped = [], False
    for i in ids:
        stopped = out.add(i)
        pieces.append(out.delta())
        if stopped:
            break
    pieces.append(out.delta(final=True))
    if any(s in text for s in stops):
        # cut at the first stop string to complete (as the tokens arrive)
        assert stopped and out.stop_reason in stops
        if include:
            assert text.startswith(out.text) and out.text.endswith(out.stop_reason)
        else:
            assert text.startswith(out.text + out.stop_reason) and not any(s in out.text for s in stops)
    else:
        assert not stopped and out.text == text
    assert "".join(pieces) == out.text
    released = ""
    for p in pieces[:-1]:
        released += p
        assert not any(s in released for s in stops if not include)


def test_hold_back_is_minimal(tok):
    out = TextOutput(tok.tokenizer, stop=["STOP"])
    for i in tok.encode_prompt("abc ST"):
        out.add(i)
    assert out.delta() == "abc " and out.text == "abc ST"  # "ST" may begin "STOP": held back
    for i in tok.encode_prompt("ay"):
        out.add(i)
    assert out.delta() == "STay"  # it did not
    assert out.delta(final=True) == ""


def test_chat_template_hf_semantics():
    src = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] == 'system' and not loop.first %}{{ raise_exception('system must come first') }}"
        "{% endif %}\n"
        "<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}{{ extra | default('') }}"
        "{{ {'k': 'é'} | tojson }}"
    )
    t = ChatTemplate(src, {"bos_token": "<s>", "eos_token": "</s>"})
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    # trim_blocks / lstrip_blocks: the block tags leave no newlines or indentation behind
    assert t.render(msgs) == '<s><system>be brief</s>\n<user>hi</s>\n<assistant>{"k": "é"}'
    assert t.render(msgs, add_generation_prompt=False, extra="!").endswith('</s>\n!{"k": "é"}')
    with pytest.raises(ChatTemplateError, match="system must come first"):
        t.render(msgs[::-1])
    cont = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}")
    text = cont.render(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, "}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert text == "<user>hi</s><assistant>Hello, "
    assert (
        find_chat_template(
            "/nonexistent",
            {"chat_template": [{"name": "tool_use", "template": "a"}, {"name": "default", "template": "b"}]},
        )
        == "b"
    )


def test_bos_rule_and_generation_defaults(tmp_path):
    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(os.path.join(DEMO, f), tmp_path / f)
    plain = ServeTokenizer(str(tmp_path))
    assert plain.encode_prompt("x = 1")[0] != 0 and plain.eos_token_ids == (0,)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    cfg["chat_template"] = "{{ bos_token }}{{ messages[0]['content'] }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    bos = ServeTokenizer(str(tmp_path))
    ids = bos.encode_prompt("x = 1")
    assert ids[0] == 0 and ids[1:] == plain.encode_prompt("x = 1")
    assert bos.encode_prompt("<|endoftext|>x = 1") == ids  # not doubled
    rendered = bos.chat_template.render([{"role": "user", "content": "x = 1"}])
    assert bos.encode_chat(rendered) == ids  # the template's BOS, none added
    assert GenerationDefaults.from_dir(str(tmp_path)) == GenerationDefaults(1.0, 1.0, 0, None)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 40, "max_new_tokens": 100, "eos_token_id": [0, 5]})
    )
    assert GenerationDefaults.from_dir(str(tmp_path)) == GenerationDefaults(0.6, 0.9, 40, 100)
    assert ServeTokenizer(str(tmp_path)).eos_token_ids == (0, 5)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        ServeTokenizer(str(tmp_path / "nowhere"))


class StubEngine:
    """The Engine interface the loop uses: every request emits one token per step until max_new_tokens."""

    def __init__(self):
        from types import SimpleNamespace

        self.reqs = {}
        self.steps = 0
        self.num_computed_tokens = 0
        self.fail = False
        self.scheduler = SimpleNamespace(
            running=[], waiting=[], prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0
        )
        self.pool = SimpleNamespace(num_held_pages=0, num_usable_pages=10, num_cached_pages=0)
        self.cfg = SimpleNamespace(vocab_size=100)
        self.aborted = []

    def check_request(self, prompt, params):
        if not prompt:
            raise ValueError("empty prompt")
        params.validate()
        return list(prompt)

    def add_request(self, prompt, params, rid):
        self.reqs[rid] = [params.max_new_tokens, []]

    def abort(self, rid):
        self.aborted.append(rid)
        return self.reqs.pop(rid, None) is not None

    @property
    def has_unfinished(self):
        return bool(self.reqs)

    def step(self):
        import time

        from mla_jax.engine import RequestOutput

        time.sleep(0.002)
        self.steps += 1
        if self.fail:
            raise RuntimeError("boom")
        outs = []
        for rid, (n, toks) in list(self.reqs.items()):
            toks.append(len(toks))
            done = len(toks) == n
            outs.append(RequestOutput(rid, list(toks), None, done, "length" if done else None, [toks[-1]]))
            if done:
                del self.reqs[rid]
        return outs


def test_engine_loop_streams_aborts_and_fails():
    from mla_jax.sampling import SamplingParams
    from mla_jax.serve.engine_loop import AsyncEngine, EngineDeadError

    async def main():
        eng = StubEngine()
        ae = AsyncEngine(eng)
        await ae.start()
        with pytest.raises(ValueError, match="empty prompt"):
            ae.add_request([], SamplingParams())
        with pytest.raises(ValueError, match="top_p"):
            ae.add_request([1], SamplingParams(top_p=0))
        a = ae.add_request([1, 2], SamplingParams(max_new_tokens=5))
        b = ae.add_request([3], SamplingParams(max_new_tokens=1000))
        toks = [t async for d in a for t in d.token_ids]
        assert toks == [0, 1, 2, 3, 4] and a.finish_reason == "length" and a.ttft is not None and a.tpot is not None
        first = await b.__anext__()
        assert first.token_ids == [0]
        b.abort()
        for _ in range(200):
            if b.request_id in eng.aborted:
                break
            await asyncio.sleep(0.01)
        assert b.request_id in eng.aborted and b.finish_reason == "abort"
        # a failing step: open streams raise, the loop reports unhealthy, new requests are refused
        c = ae.add_request([1], SamplingParams(max_new_tokens=1000))
        await c.__anext__()
        eng.fail = True
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in c:
                pass
        assert not ae.healthy
        with pytest.raises(EngineDeadError):
            ae.add_request([1], SamplingParams())
        await ae.aclose()

    asyncio.run(main())


def test_warmup_modes_map_onto_engine_warmup():
    """`serve --warmup`: "none" compiles nothing, "basic" the shapes (and the filtered variants when the
    checkpoint's defaults filter, the logprob ones when asked), "full" every variant (`Engine.warmup`'s
    all_shapes, tested in test_engine to leave nothing to compile)."""
    from mla_jax.serve.cli import warmup_args

    greedy, nucleus = GenerationDefaults(temperature=0.0), GenerationDefaults(temperature=0.7, top_p=0.9)
    assert warmup_args("none", True, nucleus) is None
    basic = dict(prefill=True, top_logprobs=False, all_shapes=False, filtered=False)
    assert warmup_args("basic", False, greedy) == basic
    assert warmup_args("basic", False, GenerationDefaults()) == basic  # temperature 1, no top-k/top-p: unfiltered
    assert warmup_args("basic", True, nucleus) == basic | dict(top_logprobs=True, filtered=True)
    assert warmup_args("basic", False, GenerationDefaults(top_k=40)) == basic | dict(filtered=True)
    full = dict(prefill=True, top_logprobs=True, all_shapes=True, filtered=True)
    assert warmup_args("full", False, greedy) == full
