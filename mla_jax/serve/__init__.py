"""Serving: an OpenAI-compatible HTTP server over the engine (`mla-jax serve`).

Modules (only `app` and `cli`'s run need the web packages, fastapi and uvicorn; the rest is plain asyncio):
    engine_loop  `AsyncEngine`: the engine thread stepping continuously; requests join and leave at any step
    serving      OpenAI completions / chat completions: validation, n choices, stop strings, logprobs, SSE chunks
    detokenizer  incremental detokenization (tokenizers' DecodeStream) and stop strings with streaming hold-back
    tokenizer    tokenizer.json, tokenizer_config.json (BOS, special tokens), generation_config.json defaults
    chat         chat templates with Hugging Face semantics (jinja2)
    protocol     the request bodies (pydantic)
    metrics      Prometheus metrics
    app          the FastAPI app
    cli          `mla-jax serve` arguments and run
"""
