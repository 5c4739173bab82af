"""The HTTP app (FastAPI): OpenAI's `/v1/completions`, `/v1/chat/completions` (JSON or server-sent events in
OpenAI's chunk format, ending with `data: [DONE]`), `/v1/models`; `/health` (200 while the engine loop runs, 503
after it died); `/metrics` (Prometheus text format).

Bad requests get HTTP 400 with OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, the
message naming the field and the value, before anything reaches the engine. A client that disconnects is
noticed while its request waits or streams (a task listens for the ASGI disconnect message next to the
response), and its engine requests are aborted: their pages are freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from mla_jax.serve.engine_loop import EngineDeadError
from mla_jax.serve.metrics import CONTENT_TYPE, ServeMetrics
from mla_jax.serve.protocol import ChatCompletionRequest, CompletionRequest
from mla_jax.serve.serving import OpenAIServing, RequestError


class SSEResponse(StreamingResponse):
    """A StreamingResponse that also stops when the client disconnects before the next chunk is ready, and always
    closes its generator (whose `finally` aborts the engine requests)."""

    def __init__(self, content, **kw):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, **kw)

    async def __call__(self, scope, receive, send) -> None:
        async def disconnected():
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        streamer = asyncio.ensure_future(self.stream_response(send))
        try:
            done, _ = await asyncio.wait({watcher, streamer}, return_when=asyncio.FIRST_COMPLETED)
            if streamer in done:
                streamer.result()
        except OSError:  # the client went away while we sent
            pass
        finally:
            for t in (watcher, streamer):
                t.cancel()
            await asyncio.gather(watcher, streamer, return_exceptions=True)
            await self.body_iterator.aclose()


async def _until_disconnected(request: Request, coro) -> Any:
    """Runs `coro`; cancels it (which aborts its engine requests) if the client disconnects first. None then."""
    task = asyncio.ensure_future(coro)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        return None
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _parse(request: Request, model):
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON in the request body: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        field = str(first["loc"][0]) if first["loc"] else None
        if first["type"] == "missing":
            raise RequestError(f"{field}: field required", field) from None
        if len(errs) > 1 and all(x["loc"][:1] == first["loc"][:1] for x in errs) and field in data:
            # a union type (prompt, stop, content, ...): every alternative failed; name the field and its value
            raise RequestError(f"{field}: invalid type or value (got {data[field]!r}): {first['msg']}", field) from None
        where = ".".join(str(x) for x in first["loc"])
        more = f"; and {len(errs) - 1} more problem(s)" if len(errs) > 1 else ""
        raise RequestError(f"{where}: {first['msg']} (got {first.get('input')!r}){more}", field) from None


def build_app(serving: OpenAIServing, metrics: ServeMetrics | None = None, *, shutdown_engine: bool = True) -> FastAPI:
    """The app over a started or not yet started AsyncEngine (the lifespan starts it and shuts it down)."""
    engine = serving.engine

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if engine._thread is None:
            await engine.start()
        yield
        if shutdown_engine:
            await engine.aclose()

    app = FastAPI(
        title="mla-jax", description="OpenAI-compatible server for DeepSeek MLA models in JAX.", lifespan=lifespan
    )

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError):
        return JSONResponse(RequestError(str(e), status=503, type="server_error").body(), status_code=503)

    @app.get("/health")
    async def health():
        if engine.healthy:
            return Response(status_code=200)
        return JSONResponse({"error": str(engine.error or "the engine is not running")}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.get("/metrics")
    async def get_metrics():
        if metrics is None:
            return Response(status_code=404)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        jobs = serving.prepare_completion(req)
        if req.stream:
            return SSEResponse(serving.completion_stream(req, jobs))
        out = await _until_disconnected(request, serving.completion(req, jobs))
        return JSONResponse(out) if out is not None else Response(status_code=499)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        jobs = serving.prepare_chat(req)
        if req.stream:
            return SSEResponse(serving.chat_stream(req, jobs))
        out = await _until_disconnected(request, serving.chat(req, jobs))
        return JSONResponse(out) if out is not None else Response(status_code=499)

    return app
