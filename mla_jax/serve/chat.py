"""Chat templates with Hugging Face `apply_chat_template` semantics.

The template is jinja2 in a sandboxed, immutable environment with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` filter that keeps non-ASCII text (`ensure_ascii=False`), and the globals
`raise_exception(message)` and `strftime_now(format)`. It is rendered with `messages`, `add_generation_prompt`,
`tools`, `documents`, the special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...) and any extra
keyword arguments (`chat_template_kwargs`). Where the template comes from, first found: the server's
`--chat-template` (a file or the template itself), `chat_template` in tokenizer_config.json (a string, or a list
of named templates: "default" is used), `chat_template.jinja`, `chat_template.json`.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence


class ChatTemplateError(ValueError):
    """The template raised (`raise_exception`, a jinja error) or the messages do not fit it."""


def find_chat_template(model_dir: str, tokenizer_config: dict[str, Any]) -> str | None:
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if isinstance(t, str) and t:
        return t
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path):
        with open(path) as f:
            return f.read()
    path = os.path.join(model_dir, "chat_template.json")
    if os.path.exists(path):
        with open(path) as f:
            t = json.load(f).get("chat_template")
        if isinstance(t, str) and t:
            return t
    return None


def read_template_arg(arg: str) -> str:
    """`--chat-template`: a path to a file holding the template, or the template text itself."""
    if os.path.exists(arg):
        with open(arg) as f:
            return f.read()
    if "{" not in arg:
        raise FileNotFoundError(f"--chat-template {arg!r}: no such file (and it is not a jinja template)")
    return arg


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str] | None = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        self._jinja_errors = (jinja2.exceptions.TemplateError,)
        self.source = source
        self.template = env.from_string(source)  # a syntax error surfaces here, at server start
        self.special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list | None = None,
        documents: list | None = None,
        **kwargs: Any,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
        if continue_final_message and (not messages or not isinstance(messages[-1].get("content"), str)):
            raise ChatTemplateError("continue_final_message needs a final message with text content")
        try:
            text = self.template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=documents,
                **{**self.special_tokens, **kwargs},
            )
        except self._jinja_errors as e:
            raise ChatTemplateError(f"chat template: {e}") from None
        if continue_final_message:  # HF: cut the text right after the final message's content
            final = messages[-1]["content"]
            i = text.rfind(final.strip()) if final.strip() else -1
            if i < 0:
                raise ChatTemplateError("continue_final_message: the final message is not in the rendered template")
            text = text[: i + len(final.strip())]
            if final != final.rstrip():  # keep the message's own trailing whitespace
                text += final[len(final.rstrip()) :]
        return text
