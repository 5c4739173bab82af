"""OpenAI completions and chat completions over the `AsyncEngine`, independent of the web framework.

A request is checked completely before anything reaches the engine: model name, types, sampling values, prompt
length against max_model_len; a problem raises `RequestError` (HTTP 400) naming the field and the value. Then
each choice (each prompt times `n`) is one engine request; all of them share one queue, so their tokens are
handled in the order the engine produced them. Per choice, `TextOutput` detokenizes incrementally and applies
stop strings: a stop string ends the choice (finish_reason "stop") and aborts its engine request, which frees its
pages. When the consumer stops early (a client disconnect cancels the generator), every unfinished choice is
aborted.

Sampling defaults (fields a request leaves out) come from generation_config.json. Seeds: sampling is keyed by
(seed, position), so two requests with the same seed and prompt sample the same tokens. A request without a seed
gets a random one; choice i of a request samples with seed + i (mod 2^31), so the n choices differ and a seeded
request is reproducible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import secrets
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from mla_jax.sampling import MAX_TOP_LOGPROBS, SamplingParams
from mla_jax.serve.chat import ChatTemplateError
from mla_jax.serve.detokenizer import TextOutput
from mla_jax.serve.engine_loop import AsyncEngine, EngineDeadError, RequestStream, StepDelta
from mla_jax.serve.protocol import ChatCompletionRequest, CompletionRequest
from mla_jax.serve.tokenizer import GenerationDefaults, ServeTokenizer

MAX_N = 128  # choices per request


class RequestError(Exception):
    """A bad request: HTTP `status` with OpenAI's error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        *,
        code: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _lp(x: float) -> float:
    """A logprob JSON can carry (vLLM's floor for -inf)."""
    return max(float(x), -9999.0)


@dataclasses.dataclass
class Prompt:
    ids: list[int]
    text: str | None  # the prompt as text (for echo), when it was given as text


@dataclasses.dataclass
class Job:
    """One choice to generate: an engine request and how its text is produced."""

    index: int  # choice index in the response
    prompt: Prompt
    params: SamplingParams
    stop: list[str]
    include_stop_str_in_output: bool
    skip_special_tokens: bool


@dataclasses.dataclass
class ChoiceState:
    job: Job
    stream: RequestStream
    text: TextOutput
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_offset: int = 0  # for completions logprobs

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class ChoiceUpdate:
    """New output of one choice: tokens, their logprobs, the text now safe to send, and the finish reason on the
    choice's last update."""

    choice: ChoiceState
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str | None


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer: ServeTokenizer,
        *,
        model_name: str,
        max_model_len: int,
        defaults: GenerationDefaults | None = None,
        metrics: Any = None,
        root: str | None = None,
    ):
        self.engine = engine
        self.tok = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.defaults = defaults or GenerationDefaults()
        self.metrics = metrics
        self.root = root
        self.created = int(time.time())
        self.vocab_size = engine.engine.cfg.vocab_size

    # ---- models ------------------------------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "mla-jax",
                    "root": self.root or self.model_name,
                    "parent": None,
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                "model",
                code="model_not_found",
            )

    # ---- validation --------------------------------------------------------------------------------------
    def _common(self, req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
        """Sampling fields shared by both endpoints, checked; the defaults filled in."""
        if not isinstance(req.n, int) or not 1 <= req.n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {req.n!r}", "n")
        t = self.defaults.temperature if req.temperature is None else req.temperature
        if not (math.isfinite(t) and t >= 0):
            raise RequestError(f"temperature must be a number >= 0, got {req.temperature!r}", "temperature")
        top_p = self.defaults.top_p if req.top_p is None else req.top_p
        if not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise RequestError(f"top_p must be in (0, 1], got {req.top_p!r}", "top_p")
        top_k = self.defaults.top_k if req.top_k is None else req.top_k
        if top_k < -1:
            raise RequestError(f"top_k must be -1 or 0 (off) or a positive integer, got {req.top_k!r}", "top_k")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(req, name)
            if v not in (None, 0, 0.0):
                raise RequestError(f"{name} is not supported (got {v!r}; only 0)", name)
        if req.repetition_penalty not in (None, 1, 1.0):
            raise RequestError(
                f"repetition_penalty is not supported (got {req.repetition_penalty!r}; only 1)", "repetition_penalty"
            )
        if req.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if req.min_tokens:
            raise RequestError(f"min_tokens is not supported (got {req.min_tokens!r}; only 0)", "min_tokens")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = list(req.stop_token_ids or [])
        bad = [i for i in stop_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise RequestError(
                f"stop_token_ids: token id {bad[0]} out of vocab [0, {self.vocab_size})", "stop_token_ids"
            )
        eos = () if req.ignore_eos else self.tok.eos_token_ids
        seed = secrets.randbelow(2**31) if req.seed is None else req.seed % 2**31
        return dict(
            temperature=float(t),
            top_p=float(top_p),
            top_k=max(int(top_k), 0),
            seed=seed,
            stop=[s for s in stop if s],
            stop_token_ids=tuple(dict.fromkeys([*eos, *stop_ids])),
        )

    def _max_tokens(self, requested: int | None, prompt_len: int, field: str, prompt_field: str) -> int:
        L = self.max_model_len
        if prompt_len >= L:
            raise RequestError(
                f"This model's maximum context length is {L} tokens. However, your prompt has "
                f"{prompt_len} tokens; it must be shorter than {L} to leave room for the completion.",
                prompt_field,
                code="context_length_exceeded",
            )
        if requested is None:
            n = L - prompt_len
            return n if self.defaults.max_new_tokens is None else min(n, int(self.defaults.max_new_tokens))
        if not isinstance(requested, int) or requested < 1:
            raise RequestError(f"{field} must be an integer >= 1, got {requested!r}", field)
        if prompt_len + requested > L:
            raise RequestError(
                f"This model's maximum context length is {L} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                f"completion). Please reduce the prompt or {field}.",
                field,
                code="context_length_exceeded",
            )
        return requested

    def _jobs(
        self,
        prompts: list[Prompt],
        req,
        common: dict[str, Any],
        *,
        max_tokens: int | None,
        field: str,
        prompt_field: str,
        logprobs: bool,
        top_logprobs: int,
    ) -> list[Job]:
        jobs = []
        for p_i, prompt in enumerate(prompts):
            bad = [t for t in prompt.ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"{prompt_field}: token id {bad[0]} out of vocab [0, {self.vocab_size})", prompt_field
                )
            if not prompt.ids:
                raise RequestError(f"{prompt_field}: the prompt is empty (no tokens)", prompt_field)
            mt = self._max_tokens(max_tokens, len(prompt.ids), field, prompt_field)
            for j in range(req.n):
                sp = SamplingParams(
                    temperature=common["temperature"],
                    top_k=common["top_k"],
                    top_p=common["top_p"],
                    seed=(common["seed"] + j) % 2**31,
                    max_new_tokens=mt,
                    stop_token_ids=common["stop_token_ids"],
                    logprobs=logprobs,
                    top_logprobs=top_logprobs,
                )
                try:
                    self.engine.engine.check_request(prompt.ids, sp)
                except ValueError as e:
                    raise RequestError(str(e)) from None
                jobs.append(
                    Job(
                        p_i * req.n + j,
                        prompt,
                        sp,
                        common["stop"],
                        req.include_stop_str_in_output,
                        req.skip_special_tokens,
                    )
                )
        return jobs

    def prepare_completion(self, req: CompletionRequest) -> list[Job]:
        self._check_model(req.model)
        common = self._common(req)
        if req.best_of not in (None, req.n):
            raise RequestError(f"best_of is not supported (got {req.best_of!r}; only equal to n)", "best_of")
        if req.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs!r}", "logprobs")
        p = req.prompt
        if isinstance(p, str):
            prompts = [Prompt(self.tok.encode_prompt(p), p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [Prompt(self.tok.encode_prompt(x), x) for x in p]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [Prompt(list(x), None) for x in p]
        elif p:
            prompts = [Prompt(list(p), None)]
        else:
            raise RequestError("prompt must not be empty", "prompt")
        return self._jobs(
            prompts,
            req,
            common,
            max_tokens=req.max_tokens,
            field="max_tokens",
            prompt_field="prompt",
            logprobs=req.logprobs is not None,
            top_logprobs=req.logprobs or 0,
        )

    def prepare_chat(self, req: ChatCompletionRequest) -> list[Job]:
        self._check_model(req.model)
        common = self._common(req)
        if req.tools or req.tool_choice not in (None, "none"):
            raise RequestError("tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise RequestError(
                f"response_format {req.response_format.get('type')!r} is not supported (only text)", "response_format"
            )
        if req.top_logprobs is not None:
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise RequestError(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs!r}", "top_logprobs"
                )
            if req.top_logprobs and not req.logprobs:
                raise RequestError("top_logprobs needs logprobs to be true", "top_logprobs")
        if not req.messages:
            raise RequestError("messages must not be empty", "messages")
        if self.tok.chat_template is None:
            raise RequestError(
                "this model has no chat template (tokenizer_config.json has none; start the server "
                "with --chat-template)",
                "messages",
            )
        messages = []
        for i, m in enumerate(req.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):  # text parts -> one string, as templates expect
                texts = []
                for part in m.content:
                    part = part if isinstance(part, dict) else part.model_dump()
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise RequestError(
                            f"messages[{i}].content: only text parts are supported, got {part.get('type')!r}",
                            f"messages[{i}].content",
                        )
                    texts.append(part["text"])
                d["content"] = "\n".join(texts)
            messages.append(d)
        try:
            text = self.tok.chat_template.render(
                messages,
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                continue_final_message=req.continue_final_message,
                **(req.chat_template_kwargs or {}),
            )
        except ChatTemplateError as e:
            raise RequestError(str(e), "messages") from None
        prompts = [Prompt(self.tok.encode_chat(text), text)]
        mt = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return self._jobs(
            prompts,
            req,
            common,
            max_tokens=mt,
            field=field,
            prompt_field="messages",
            logprobs=req.logprobs,
            top_logprobs=req.top_logprobs or 0,
        )

    # ---- running -----------------------------------------------------------------------------------------
    async def run(self, jobs: Sequence[Job]) -> AsyncIterator[ChoiceUpdate]:
        """Generates every job; yields updates as the engine produces tokens. Closing the generator early aborts
        the unfinished choices (their pages are freed)."""
        queue: asyncio.Queue = asyncio.Queue()
        choices: list[ChoiceState] = []
        try:
            for job in jobs:
                stream = self.engine.add_request(job.prompt.ids, job.params, queue=queue, tag=len(choices))
                text = TextOutput(
                    self.tok.tokenizer,
                    stop=job.stop,
                    prompt_ids=job.prompt.ids,
                    include_stop_str_in_output=job.include_stop_str_in_output,
                    skip_special_tokens=job.skip_special_tokens,
                )
                choices.append(ChoiceState(job, stream, text))
            open_ = len(choices)
            while open_:
                tag, item = await queue.get()
                c = choices[tag]
                if isinstance(item, BaseException):
                    raise item
                if c.done:  # outputs already in flight when a stop string ended it
                    continue
                up = self._update(c, item)
                if up.finish_reason is not None:
                    open_ -= 1
                    self._observe(c)
                yield up
        finally:
            for c in choices:
                if not c.done:
                    c.stream.abort()
                    c.finish_reason = "abort"
                    self._observe(c)

    def _update(self, c: ChoiceState, d: StepDelta) -> ChoiceUpdate:
        ids = d.token_ids
        stopped = False
        for k, tok in enumerate(ids):
            last = k == len(ids) - 1
            if last and d.finished and d.finish_reason == "stop" and tok in c.job.params.stop_token_ids:
                c.stop_reason = tok  # a stop token ends the text; it is not part of it
                break
            if c.text.add(tok):
                stopped = True
                ids = ids[: k + 1]  # the token that completed the stop string is the last one
                break
        c.token_ids += ids
        n = len(ids)
        lps = d.logprobs[:n] if d.logprobs is not None else None
        tops = d.top_logprobs[:n] if d.top_logprobs is not None else None
        finish = None
        if stopped:
            c.stream.abort()
            finish, c.stop_reason = "stop", c.text.stop_reason
        elif d.finished:
            finish = d.finish_reason
        text = c.text.delta(final=finish is not None)
        c.finish_reason = finish
        return ChoiceUpdate(c, ids, lps, tops, text, finish)

    def _observe(self, c: ChoiceState) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(c.stream, c.finish_reason, len(c.job.prompt.ids), len(c.token_ids))

    # ---- response formatting -----------------------------------------------------------------------------
    @staticmethod
    def _usage(jobs: Sequence[Job], choices: dict[int, ChoiceState]) -> dict[str, Any]:
        """Token counts: each prompt once (whatever n), every choice's tokens so far; cached_tokens are the prompt
        tokens read from the prefix cache (each prompt's first choice)."""
        seen, prompt_tokens, cached = set(), 0, 0
        for j in jobs:
            if id(j.prompt) not in seen:
                seen.add(id(j.prompt))
                prompt_tokens += len(j.prompt.ids)
                if j.index in choices:
                    cached += choices[j.index].stream.num_cached_tokens
        completion = sum(len(c.token_ids) for c in choices.values())
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _completion_logprobs(self, up: ChoiceUpdate) -> dict[str, Any] | None:
        if up.logprobs is None:
            return None
        c = up.choice
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for k, tok in enumerate(up.token_ids):
            s = self.tok.token_text(tok)
            out["tokens"].append(s)
            out["token_logprobs"].append(_lp(up.logprobs[k]))
            top = {self.tok.token_text(i): _lp(v) for i, v in (up.top_logprobs[k] if up.top_logprobs else [])}
            top.setdefault(s, _lp(up.logprobs[k]))  # the sampled token is always listed
            out["top_logprobs"].append(top)
            out["text_offset"].append(c.text_offset)
            c.text_offset += len(s)
        return out

    def _chat_logprobs(self, up: ChoiceUpdate) -> dict[str, Any] | None:
        if up.logprobs is None:
            return None

        def entry(i, v):
            s = self.tok.token_text(i)
            return {"token": s, "logprob": _lp(v), "bytes": list(s.encode("utf-8"))}

        content = []
        for k, tok in enumerate(up.token_ids):
            e = entry(tok, up.logprobs[k])
            e["top_logprobs"] = [entry(i, v) for i, v in (up.top_logprobs[k] if up.top_logprobs else [])]
            content.append(e)
        return {"content": content}

    @staticmethod
    def _merge_logprobs(acc: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any] | None:
        if new is None:
            return acc
        if acc is None:
            return new
        for k, v in new.items():
            acc[k] = acc[k] + v
        return acc

    async def completion(self, req: CompletionRequest, jobs: list[Job]) -> dict[str, Any]:
        texts = {j.index: [] for j in jobs}
        lps: dict[int, Any] = {j.index: None for j in jobs}
        choices: dict[int, ChoiceState] = {}
        for j in jobs:
            if req.echo:
                texts[j.index].append(self._echo_text(j.prompt))
        async for up in self.run(jobs):
            i = up.choice.job.index
            choices[i] = up.choice
            texts[i].append(up.text)
            lps[i] = self._merge_logprobs(lps[i], self._completion_logprobs(up))
        out_choices = [
            {
                "index": j.index,
                "text": "".join(texts[j.index]),
                "logprobs": lps[j.index],
                "finish_reason": choices[j.index].finish_reason,
                "stop_reason": choices[j.index].stop_reason,
            }
            for j in jobs
        ]
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": out_choices,
            "usage": self._usage(jobs, choices),
        }

    def _echo_text(self, prompt: Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tok.decode(prompt.ids)

    def completion_stream(self, req: CompletionRequest, jobs: list[Job]) -> AsyncIterator[str]:
        opening = [
            {"index": j.index, "text": self._echo_text(j.prompt), "logprobs": None, "finish_reason": None}
            for j in jobs
            if req.echo
        ]

        def choice(up):
            lp = self._completion_logprobs(up)
            return {"index": up.choice.job.index, "text": up.text, "logprobs": lp, "finish_reason": up.finish_reason}

        return self._stream(req, jobs, "cmpl", "text_completion", opening, choice)

    async def _stream(self, req, jobs: list[Job], prefix: str, obj: str, opening: list, choice) -> AsyncIterator[str]:
        """The SSE stream of both endpoints: each of `opening`'s choices in a chunk of its own, then a chunk per
        update that carries text, logprobs or a finish (`choice(up)` builds its choice), the usage chunk if asked
        (per chunk with continuous_usage_stats), then [DONE]; an engine failure is an error event."""
        rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        seen: dict[int, ChoiceState] = {}

        def chunk(choices, usage=None):
            d = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return _sse(d)

        try:
            for c in opening:
                yield chunk([c])
            async for up in self.run(jobs):
                seen[up.choice.job.index] = up.choice
                c = choice(up)
                if not up.text and up.finish_reason is None and c["logprobs"] is None:
                    continue
                if up.finish_reason is not None:
                    c["stop_reason"] = up.choice.stop_reason
                yield chunk([c], self._usage(jobs, seen) if continuous else None)
            if include_usage:
                yield chunk([], self._usage(jobs, seen))
        except EngineDeadError as e:
            yield _sse(RequestError(str(e), status=500, type="server_error").body())
        yield "data: [DONE]\n\n"

    async def chat(self, req: ChatCompletionRequest, jobs: list[Job]) -> dict[str, Any]:
        texts = {j.index: [] for j in jobs}
        lps: dict[int, Any] = {j.index: None for j in jobs}
        choices: dict[int, ChoiceState] = {}
        async for up in self.run(jobs):
            i = up.choice.job.index
            choices[i] = up.choice
            texts[i].append(up.text)
            lps[i] = self._merge_logprobs(lps[i], self._chat_logprobs(up))
        out = [
            {
                "index": j.index,
                "message": {"role": "assistant", "content": "".join(texts[j.index])},
                "logprobs": lps[j.index],
                "finish_reason": choices[j.index].finish_reason,
                "stop_reason": choices[j.index].stop_reason,
            }
            for j in jobs
        ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": out,
            "usage": self._usage(jobs, choices),
        }

    def chat_stream(self, req: ChatCompletionRequest, jobs: list[Job]) -> AsyncIterator[str]:
        opening = [
            {"index": j.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for j in jobs
        ]

        def choice(up):
            return {
                "index": up.choice.job.index,
                "delta": {"content": up.text} if up.text else {},
                "logprobs": self._chat_logprobs(up),
                "finish_reason": up.finish_reason,
            }

        return self._stream(req, jobs, "chatcmpl", "chat.completion.chunk", opening, choice)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
