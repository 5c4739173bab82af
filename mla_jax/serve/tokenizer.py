"""A checkpoint's tokenizer side, as the server needs it: `tokenizer.json`, the special tokens and BOS rule of
`tokenizer_config.json`, its chat template, and the sampling defaults of `generation_config.json`.

BOS, as Hugging Face does it: a text prompt (`/v1/completions`) is encoded with the tokenizer's post-processor
(`add_special_tokens=True`, which adds BOS where tokenizer.json says so), and BOS is prepended when
tokenizer_config.json has `add_bos_token: true` and the encoding does not start with it already. A rendered chat
template is encoded with `add_special_tokens=False` (`apply_chat_template`'s rule): the template writes BOS
itself (`{{ bos_token }}`) if the model wants one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from mla_jax.checkpoint import eos_token_ids


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(v: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken dict ({"content": ...})."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults of generation_config.json, used where a request leaves a field out. Without the file:
    OpenAI's defaults (temperature 1, top_p 1), no top_k, no max_new_tokens."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None

    @staticmethod
    def from_dir(model_dir: str) -> "GenerationDefaults":
        g = _read_json(os.path.join(model_dir, "generation_config.json"))
        temperature = float(g.get("temperature", 1.0))
        if g.get("do_sample") is False:  # HF: do_sample false is greedy whatever the temperature
            temperature = 0.0
        top_k = int(g.get("top_k") or 0)
        return GenerationDefaults(
            temperature=temperature,
            top_p=float(g.get("top_p", 1.0)),
            top_k=max(top_k, 0),
            max_new_tokens=g.get("max_new_tokens"),
        )


class ServeTokenizer:
    """tokenizer.json plus what tokenizer_config.json says about special tokens, BOS and the chat template."""

    def __init__(self, model_dir: str, *, chat_template: str | None = None):
        from tokenizers import Tokenizer

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}: the server needs the checkpoint's tokenizer")
        self.tokenizer = Tokenizer.from_file(path)
        self.config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
        self.special_tokens = {
            k: t
            for k in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (t := _token_text(self.config.get(k))) is not None
        }
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id = self.tokenizer.token_to_id(bos) if bos else None
        self.add_bos_token = bool(self.config.get("add_bos_token", False))
        self.eos_token_ids = eos_token_ids(model_dir)
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (i := self.tokenizer.token_to_id(eos)) is not None and i not in self.eos_token_ids:
            self.eos_token_ids = self.eos_token_ids + (i,)
        self.vocab_size = self.tokenizer.get_vocab_size()
        from mla_jax.serve.chat import ChatTemplate, find_chat_template

        source = chat_template if chat_template is not None else find_chat_template(model_dir, self.config)
        self.chat_template = ChatTemplate(source, self.special_tokens) if source else None

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids: the post-processor's special tokens, BOS per tokenizer_config.json."""
        ids = self.tokenizer.encode(text, add_special_tokens=True).ids
        if self.add_bos_token and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_chat(self, text: str) -> list[int]:
        """A rendered chat template's ids: no special tokens added (the template has them)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (special tokens included; a piece of a multi-byte character decodes to
        the replacement character, as in vLLM)."""
        return self.tokenizer.decode([int(token_id)], skip_special_tokens=False)
