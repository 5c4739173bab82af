"""The engine: jit-compiled steps over static batch shapes, the scheduler, sampling, and `generate`.

Static shapes play the role of vLLM's CUDA graphs. A decode-only step is compiled once per decode bucket
(default 1, 2, 4, ..., 256 rows); a step with prefills once per (decode bucket, prefill-token bucket). Block
tables always have the width of `max_model_len`, the context workspace and chunk count are fixed, so nothing
else varies. Padding rows have seq_len 0 and slot -1: they write nowhere and attend to nothing. The cache is
donated to every step and updated in place.

Requests join (`add_request`) and leave (finished, or `abort`) between steps. With
`EngineConfig.enable_prefix_caching` a request whose tokens start with full pages already in the cache (kept from
earlier requests, `mla_jax.allocator`) prefills only the rest, the cached part as chunked context. A step in which
some request asks for top logprobs runs the step variant that returns them (`SamplingArrays.num_top_logprobs`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Hashable, Iterable, Sequence, TextIO

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax import attention, spec_decode
from mla_jax import step as step_lib
from mla_jax.allocator import PagePool
from mla_jax.cache import KVCache, cache_dtype, init_kv_cache, init_kv_cache_for
from mla_jax.chunking import workspace_rows as default_workspace_rows
from mla_jax.compile_cache import enable_compile_cache
from mla_jax.config import DeepseekConfig
from mla_jax.layers import GMM_IMPLS
from mla_jax.metadata import (
    AttentionMetadata,
    BatchShape,
    DecodeMetadata,
    PrefillMetadata,
    ScheduledRequest,
    build_metadata,
)
from mla_jax.model import Params
from mla_jax.mtp import has_mtp, num_draft_layers
from mla_jax.parallel import ParallelPlan, to_host
from mla_jax.sampling import SamplingArrays, SamplingParams
from mla_jax.scheduler import Request, Scheduler, Status
from pallas_kernels.util import cdiv


def _pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return tuple(out) + (hi,)


def default_gmm_impl() -> str:
    return "ragged_dot" if jax.default_backend() == "cpu" else "pallas"


GPU_PAGE_SIZE = 64  # the Hopper decode kernel's page (and the one every GPU benchmark measures)


def default_page_size() -> int:
    """Cache page size when the caller gives none: 64 on a GPU, so `generate` and the CLI run the decode
    kernel the benchmarks measured; 16 on a CPU, where small test models waste less of a page."""
    return GPU_PAGE_SIZE if jax.default_backend() == "gpu" else 16


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 4096
    max_num_seqs: int = 64
    page_size: int = 64
    num_pages: int | None = None  # None: enough for max_num_seqs full-length requests (+ the pad page)
    cache_dtype: str = "bf16"
    token_budget: int = 2048  # tokens per step (decodes + prefill chunks)
    max_prefills: int = 4  # prefill requests per step (a static shape)
    decode_buckets: tuple[int, ...] | None = None  # None: 1, 2, 4, ... up to max_num_seqs
    prefill_buckets: tuple[int, ...] | None = None  # None: 16, 32, ... up to token_budget
    backend: str | None = None  # None: "pallas_sm90" on Hopper, "pallas" on other GPUs, "xla" on CPU
    batch_invariant: bool = False  # decode with one KV split: outputs independent of the batch
    # MoE expert matmul: "ragged_dot" (XLA) or "pallas" (grouped GEMM kernel). None: "pallas" on GPU, where XLA
    # lowers ragged_dot to a dense expansion over every expert (bench/results/moe-h200.json), "ragged_dot" on
    # CPU, where the kernel would run interpreted.
    gmm_impl: str | None = None
    # Reuse cached full pages of earlier requests' prompts (`mla_jax.allocator`): a request whose tokens start
    # with cached pages prefills only the rest. Off by default here (the server turns it on).
    enable_prefix_caching: bool = False
    # Speculative decoding (`mla_jax.spec_decode`): k = num_speculative_tokens (1..4) drafts per request and
    # step, from DeepSeek's MTP layers ("mtp"; draft i from layer i % num_mtp_layers, as vLLM) or prompt lookup
    # ("ngram"), verified in one target step of k+1 query rows per request, on one device or a mesh. 0 / None:
    # off.
    num_speculative_tokens: int = 0
    speculative_method: str | None = None

    def __post_init__(self):
        """Each field checked on its own, so a bad value is a ValueError naming that field (not a
        ZeroDivisionError, or an error about another field, later)."""

        def pos_int(name, lo=1):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise ValueError(f"EngineConfig.{name} must be an int >= {lo}, got {v!r}")

        for name in ("max_model_len", "max_num_seqs", "page_size", "token_budget", "max_prefills"):
            pos_int(name)
        if self.num_pages is not None:
            pos_int("num_pages", 2)  # page 0 is the pad page
        for name in ("decode_buckets", "prefill_buckets"):
            v = getattr(self, name)
            if v is not None and (
                not isinstance(v, (tuple, list))
                or not v
                or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in v)
            ):
                raise ValueError(f"EngineConfig.{name} must be a non-empty tuple of ints >= 1, got {v!r}")
        try:
            cache_dtype(self.cache_dtype)
        except ValueError as e:
            raise ValueError(f"EngineConfig.cache_dtype: {e}") from None
        if self.backend is not None and self.backend not in attention.BACKENDS:
            raise ValueError(f"EngineConfig.backend must be one of {tuple(attention.BACKENDS)}, got {self.backend!r}")
        if self.gmm_impl is not None and self.gmm_impl not in GMM_IMPLS:
            raise ValueError(f"EngineConfig.gmm_impl must be one of {GMM_IMPLS}, got {self.gmm_impl!r}")
        for name in ("batch_invariant", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def resolved(self) -> "EngineConfig":
        k, method = self.num_speculative_tokens, self.speculative_method
        if k or method is not None:
            if method not in spec_decode.METHODS:
                raise ValueError(f"speculative_method must be one of {spec_decode.METHODS}, got {method!r}")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= spec_decode.MAX_SPECULATIVE_TOKENS:
                raise ValueError(
                    f"num_speculative_tokens must be an int in [1, {spec_decode.MAX_SPECULATIVE_TOKENS}] with "
                    f"speculative_method={method!r}, got {k!r}"
                )
        pages = self.num_pages or self.max_num_seqs * cdiv(self.max_model_len, self.page_size) + 1
        dec = self.decode_buckets or _pow2_buckets(1, self.max_num_seqs)
        pre = self.prefill_buckets or _pow2_buckets(min(16, self.token_budget), self.token_budget)
        if max(dec) < self.max_num_seqs:
            raise ValueError(f"largest decode bucket {max(dec)} < max_num_seqs {self.max_num_seqs}")
        if max(pre) < self.token_budget:
            raise ValueError(f"largest prefill bucket {max(pre)} < token_budget {self.token_budget}")
        return dataclasses.replace(
            self,
            num_pages=pages,
            decode_buckets=tuple(sorted(dec)),
            prefill_buckets=tuple(sorted(pre)),
            backend=self.backend or attention.default_backend_name(),
            gmm_impl=self.gmm_impl or default_gmm_impl(),
        )


@dataclasses.dataclass
class RequestOutput:
    request_id: Hashable
    token_ids: list[int]
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    new_token_ids: list[int]  # tokens produced by the last step (for streaming)
    # With SamplingParams.top_logprobs = n: per output token, the n most likely (token id, logprob), most likely
    # first.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of which accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified drafts (None without speculative decoding)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


class CompileCounter:
    """Counts XLA backend compilations (the role of counting CUDA-graph captures)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1
            self.seconds += duration


_COUNTER: CompileCounter | None = None


def compile_counter() -> CompileCounter:
    global _COUNTER
    if _COUNTER is None:
        _COUNTER = CompileCounter()
    return _COUNTER


def check_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, cfg: DeepseekConfig) -> list[int]:
    """A prompt (token ids: ints in [0, vocab)) and its SamplingParams checked against the model alone, before
    any engine exists; the prompt as a list of ints, or ValueError saying what is wrong. Float ids, strings and
    prompts longer than the model's max_position_embeddings are refused, not truncated or run."""
    if isinstance(prompt_token_ids, (str, bytes)):
        raise ValueError(f"the prompt is a {type(prompt_token_ids).__name__}: pass token ids (tokenize it first)")
    try:
        prompt = list(prompt_token_ids)
    except TypeError:
        raise ValueError(f"the prompt must be a sequence of token ids, got {type(prompt_token_ids).__name__}") from None
    if not prompt:
        raise ValueError("empty prompt")
    bad = next((t for t in prompt if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))), None)
    if bad is not None:
        raise ValueError(f"token ids must be ints, got {type(bad).__name__} {bad!r}")
    prompt = [int(t) for t in prompt]
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} out of vocab [0, {cfg.vocab_size})")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
    params.validate()
    if len(prompt) > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt length {len(prompt)} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    return prompt


class Engine:
    """Continuous batching over the paged cache, on one device or, with `plan`, on a mesh.

    On a mesh `config.page_size` is the physical page G of each device; under DCP the scheduler, allocator and
    metadata work in virtual pages of G*dcp tokens (so `config.num_pages`, if given, counts those, and each
    device holds num_pages * G rows per layer). In a multi-process run every process drives an engine with the
    same requests: host-side decisions are deterministic, so they stay in step."""

    def __init__(
        self,
        params: Params,
        cfg: DeepseekConfig,
        config: EngineConfig = EngineConfig(),
        *,
        plan: ParallelPlan | None = None,
    ):
        enable_compile_cache()  # a second start of this configuration loads its compiled steps from disk
        self.plan = plan
        if plan is not None:
            params = plan.shard_params(params, cfg)
            config = dataclasses.replace(config, page_size=config.page_size * plan.dcp)
        self.params, self.cfg = params, cfg
        self.config = c = config.resolved()
        self.spec_k = c.num_speculative_tokens if c.speculative_method else 0
        self.drafter = spec_decode.make_drafter(c.speculative_method, self.spec_k) if self.spec_k else None
        if c.speculative_method == "mtp" and cfg.use_sparse:
            raise ValueError(
                f"speculative_method='mtp': {cfg.model_type} uses sparse attention, whose MTP layers are not loaded; "
                "use speculative_method='ngram'"
            )
        if c.speculative_method == "mtp" and not has_mtp(params, cfg):
            raise ValueError(
                "speculative_method='mtp' needs MTP weights, but the checkpoint has none (config "
                f"num_nextn_predict_layers={cfg.num_nextn_predict_layers}, no model.layers.{cfg.num_hidden_layers}.*)"
            )
        self.pool = PagePool(c.num_pages, c.page_size, enable_prefix_caching=c.enable_prefix_caching)
        if self.pool.num_usable_pages < cdiv(c.max_model_len, c.page_size):
            raise ValueError(
                f"{c.num_pages} pages of {c.page_size} cannot hold one max_model_len ({c.max_model_len}) request"
            )
        self.cache = self._init_cache()
        self.scheduler = Scheduler(
            self.pool, max_num_seqs=c.max_num_seqs, token_budget=c.token_budget, max_prefills=c.max_prefills
        )
        self.max_pages = cdiv(c.max_model_len, c.page_size)
        self.workspace_rows = default_workspace_rows(c.max_model_len, c.max_prefills, c.page_size)
        chunk_min = (self.workspace_rows // c.max_prefills) // c.page_size * c.page_size
        self.max_chunks = cdiv(c.max_model_len, chunk_min)
        self._ids = 0
        self.counter = compile_counter()
        self.steps = 0
        self.num_computed_tokens = 0  # tokens run through the model so far (prefill chunks and decodes)
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, and accepted, over all requests
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0  # decode rows that verified k drafts (for `acceptance`)
        self.num_verify_accepted = 0  # drafts those accepted

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / verified drafts so far (None before any verification)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance(self) -> float | None:
        """Mean accepted drafts / k over the verifications of a full k drafts (the spec-h200.json figure)."""
        return self.num_verify_accepted / (self.num_verify_steps * self.spec_k) if self.num_verify_steps else None

    def _init_cache(self) -> KVCache:
        """The zeroed paged cache, laid out on the plan's mesh if there is one."""
        c, cfg = self.config, self.cfg
        # MTP drafting: one more latent cache layer per MTP layer it runs, same slots
        extra = num_draft_layers(cfg, self.spec_k) if c.speculative_method == "mtp" else 0
        if self.plan is not None:
            G = c.page_size // self.plan.dcp
            return self.plan.init_cache(
                cfg, c.num_pages, G, dtype=c.cache_dtype, num_layers=cfg.num_hidden_layers + extra
            )
        if extra:
            kw = dict(kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, allow_any_page_size=True)
            return init_kv_cache(cfg.num_hidden_layers + extra, c.num_pages, c.page_size, dtype=c.cache_dtype, **kw)
        return init_kv_cache_for(cfg, c.num_pages, c.page_size, dtype=c.cache_dtype, allow_any_page_size=True)

    # ---- requests ------------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or ValueError naming what is wrong. Reads only the (immutable) config, so
        it is safe to call from any thread while another one steps the engine."""
        prompt = check_prompt(prompt_token_ids, params, self.cfg)
        if self.spec_k and params.top_logprobs:
            raise ValueError("top_logprobs is not supported with speculative decoding (num_speculative_tokens > 0)")
        if len(prompt) + params.max_new_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt length {len(prompt)} + max_new_tokens {params.max_new_tokens} exceeds "
                f"max_model_len {self.config.max_model_len}"
            )
        return prompt

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        request_id: Hashable | None = None,
    ) -> Hashable:
        """Validates and queues a request; a bad one raises ValueError and leaves the engine untouched."""
        prompt = self.check_request(prompt_token_ids, params)
        if request_id is None:
            request_id = self._ids
            self._ids += 1
        known = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        if request_id in known:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.scheduler.add(request_id, prompt, params)
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Drops a waiting or running request between steps and frees its pages (cached ones stay cached);
        False if it is unknown or already finished. Its outputs so far are not reported again."""
        return self.scheduler.abort(request_id) is not None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- shapes ------------------------------------------------------------------------------------
    def _bucket(self, n: int, buckets: tuple[int, ...]) -> int:
        return next(b for b in buckets if b >= n)

    def batch_shape(self, num_decodes: int, num_prefill_tokens: int) -> BatchShape:
        c = self.config
        has_prefill = num_prefill_tokens > 0
        return BatchShape(
            num_decodes=self._bucket(num_decodes, c.decode_buckets) if num_decodes else 0,
            decode_query_len=1 + self.spec_k,
            num_prefills=c.max_prefills if has_prefill else 0,
            num_prefill_tokens=self._bucket(num_prefill_tokens, c.prefill_buckets) if has_prefill else 0,
            max_pages=self.max_pages,
            workspace_rows=self.workspace_rows if has_prefill else 0,
            max_chunks=self.max_chunks if has_prefill else 0,
        )

    def _run(self, md: AttentionMetadata, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        """One jitted step: (sampled tokens, their logprobs) on the host."""
        if self.plan is None:
            md, sampling = md.to_device(), jax.tree.map(jnp.asarray, sampling)
        else:
            md, sampling = self.plan.replicate(md), self.plan.replicate(sampling)
        tokens, logprobs, self.cache = step_lib.engine_step(
            self.params,
            self.cfg,
            self.cache,
            md,
            sampling,
            backend=self.config.backend,
            plan=self.plan,
            batch_invariant=self.config.batch_invariant,
            gmm_impl=self.config.gmm_impl,
        )
        return to_host(tokens), to_host(logprobs)

    def _run_spec(self, md: AttentionMetadata, sampling: SamplingArrays, spec: spec_decode.SpecArrays):
        """One jitted speculative step (`spec_decode.spec_step`): (tokens [E, k+1], num_out [E], logprobs
        [E, k+1], MTP drafts [E, k]) on the host, E = decode entries then prefills."""
        if self.plan is None:
            md, sampling, spec = md.to_device(), jax.tree.map(jnp.asarray, sampling), jax.tree.map(jnp.asarray, spec)
        else:
            md, sampling, spec = self.plan.replicate(md), self.plan.replicate(sampling), self.plan.replicate(spec)
        *out, self.cache = spec_decode.spec_step(
            self.params,
            self.cfg,
            self.cache,
            md,
            sampling,
            spec,
            backend=self.config.backend,
            plan=self.plan,
            batch_invariant=self.config.batch_invariant,
            gmm_impl=self.config.gmm_impl,
            num_speculative_tokens=self.spec_k,
            method=self.drafter.method,
        )
        return tuple(to_host(x) for x in out)

    def warmup(
        self, prefill: bool = True, top_logprobs: bool = False, all_shapes: bool = False, log: TextIO | None = None
    ) -> float:
        """Compiles every decode bucket (and, with `prefill`, the largest prefill bucket; with `all_shapes`, every
        prefill bucket alone and with every decode bucket, so that no step compiles later; with `top_logprobs`,
        the variants of these shapes that return top logprobs too); returns seconds. `log` gets a line per
        compiled shape with its time (the CLI passes stderr on a terminal)."""
        t0 = time.perf_counter()
        c = self.config
        shapes = [self.batch_shape(nd, 0) for nd in c.decode_buckets]
        if all_shapes:
            shapes += [self.batch_shape(nd, tp) for tp in c.prefill_buckets for nd in (0,) + c.decode_buckets]
        elif prefill:
            shapes.append(self.batch_shape(0, c.token_budget))
        for k, shape in enumerate(shapes):
            for top in (False, True) if top_logprobs else (False,):
                t1 = time.perf_counter()
                self._run_empty(shape, top)
                if log is not None:
                    what = f"{shape.num_decodes} decode rows" if shape.num_decodes else ""
                    if shape.num_prefill_tokens:
                        what += (" + " if what else "") + f"{shape.num_prefill_tokens} prefill tokens"
                    log.write(
                        f"compiled step {k + 1}/{len(shapes)} ({what}{', top logprobs' if top else ''}): "
                        f"{time.perf_counter() - t1:.2f} s\n"
                    )
                    log.flush()
        return time.perf_counter() - t0

    def _run_empty(self, shape: BatchShape, top_logprobs: bool = False) -> None:
        """A step of padding rows only: writes nothing, reads nothing, compiles the shape."""
        z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        md = AttentionMetadata(
            input_ids=z(shape.num_tokens),
            positions=z(shape.num_tokens),
            slot_mapping=np.full(shape.num_tokens, -1, np.int32),
            logits_indices=z(shape.num_logits),
            decode=DecodeMetadata(z(shape.num_decodes, shape.max_pages), z(shape.num_decodes, shape.decode_query_len)),
            prefill=PrefillMetadata(
                z(shape.num_prefills + 1),
                z(shape.num_prefills),
                z(shape.num_prefills, shape.max_pages),
                z(shape.max_chunks, shape.num_prefills),
                z(shape.max_chunks, shape.num_prefills + 1),
                np.zeros((), np.int32),
            ),
            shape=shape,
        )
        sp = [SamplingParams(top_logprobs=1)] if top_logprobs else []
        sampling = SamplingArrays.build(sp, [0] * len(sp), shape.num_logits)
        if self.spec_k:
            if not top_logprobs:  # no top-logprob variant: speculative engines refuse such requests
                self._run_spec(md, sampling, spec_decode.SpecArrays.empty(shape))
            return
        jax.block_until_ready(self._run(md, sampling))

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            if self.scheduler.has_unfinished:
                raise RuntimeError("scheduler made no progress (a request cannot fit in the page pool)")
            return []
        reqs = [ScheduledRequest(c.token_ids, c.start, self.pool.pages(c.request.request_id)) for c in chunks]
        # A decode is a request's last token (plus its drafts); anything else is a prefill chunk.
        is_decode = [c.num_tokens - c.num_drafts == 1 for c in chunks]
        nd = sum(is_decode)
        tp = sum(c.num_tokens for c, d in zip(chunks, is_decode) if not d)
        shape = self.batch_shape(nd, tp)
        md, order = build_metadata(
            reqs,
            page_size=self.config.page_size,
            num_pages=self.config.num_pages,
            workspace_rows=self.workspace_rows,
            shape=shape,
            is_decode=is_decode,
        )
        if self.spec_k:
            produced = self._spec_outputs(chunks, md, order, nd)
        else:
            produced = self._plain_outputs(chunks, md, order, nd)
        self.num_computed_tokens += sum(c.num_tokens for c in chunks)
        self.steps += 1
        outs = []
        for c, (toks, lps, tops) in zip(chunks, produced):
            r = c.request
            accepted = max(0, len(toks) - 1)
            r.num_computed_tokens = c.start + c.num_tokens - c.num_drafts + accepted
            if c.num_drafts:
                r.num_draft_tokens += c.num_drafts
                r.num_accepted_tokens += accepted
                self.num_draft_tokens += c.num_drafts
                self.num_accepted_tokens += accepted
                if c.num_drafts == self.spec_k:
                    self.num_verify_steps += 1
                    self.num_verify_accepted += accepted
            if self.spec_k:  # roll back the rows of rejected drafts
                self.pool.truncate(r.request_id, r.num_computed_tokens)
            self.scheduler.cache_computed(r)
            if not c.samples:
                continue
            reason, new = None, []
            for i, tok in enumerate(toks):
                new.append(tok)
                r.output_token_ids.append(tok)
                r.output_logprobs.append(lps[i])
                if tops is not None:
                    r.output_top_logprobs.append(tops)
                if tok in r.params.stop_token_ids:
                    reason = "stop"
                elif len(r.output_token_ids) >= r.params.max_new_tokens:
                    reason = "length"
                if reason:
                    break
            if reason:
                self.scheduler.finish(r, reason)
            outs.append(self._output(r, new))
        return outs

    def _plain_outputs(self, chunks, md, order, nd):
        """A step without speculation: per chunk ([sampled token] or [], logprobs, top logprobs or None)."""
        shape = md.shape
        # Logit row of each scheduled chunk (in `order`): decode b -> row b; prefill s -> row Td + s.
        rows = [k if k < nd else shape.num_decode_tokens + (k - nd) for k in range(len(order))]
        sp: list[SamplingParams | None] = [None] * shape.num_logits
        pos = [0] * shape.num_logits
        for row, oi in zip(rows, order):
            c = chunks[oi]
            if c.samples:
                sp[row] = c.request.params
                pos[row] = c.request.num_tokens  # position of the token being sampled
        tokens, logprobs = self._run(md, SamplingArrays.build(sp, pos, shape.num_logits))
        top_ids = top_lps = None
        if tokens.ndim == 2:  # column 0 the sampled token, then the top logprobs
            tokens, top_ids, logprobs, top_lps = tokens[:, 0], tokens[:, 1:], logprobs[:, 0], logprobs[:, 1:]
        produced: list = [([], [], None)] * len(chunks)
        for row, oi in zip(rows, order):
            c = chunks[oi]
            if not c.samples:
                continue
            tops = None
            if c.request.params.top_logprobs:
                k = c.request.params.top_logprobs
                tops = list(zip(top_ids[row, :k].tolist(), top_lps[row, :k].tolist()))
            produced[oi] = ([int(tokens[row])], [float(logprobs[row])], tops)
        return produced

    def _spec_outputs(self, chunks, md, order, nd):
        """A speculative step: per chunk (the accepted drafts + the target's next token, their logprobs, None);
        sets each sampling request's next drafts."""
        shape = md.shape
        Bd, Q, Td = shape.num_decodes, shape.decode_query_len, shape.num_decode_tokens
        G = self.config.page_size
        sp: list[SamplingParams | None] = [None] * shape.num_logits
        pos = [0] * shape.num_logits
        spec = spec_decode.SpecArrays.empty(shape)
        next_ids = spec.next_ids
        next_ids[:] = -1
        entries = []
        qsl = np.asarray(md.prefill.query_start_loc)
        for k, oi in enumerate(order):
            c = chunks[oi]
            r = c.request
            e = k if k < nd else Bd + (k - nd)
            entries.append(e)
            first = k * Q if k < nd else Td + int(qsl[k - nd])  # the chunk's first token row
            real = c.num_tokens - c.num_drafts
            toks = r.all_token_ids
            for i in range(real):  # the token after each real row, where it is known
                p = c.start + i + 1
                next_ids[first + i] = toks[p] if p < len(toks) else -1
            if c.samples:
                spec.capacity[e] = len(self.pool.pages(r.request_id)) * G
                for j in range(c.num_drafts + 1 if k < nd else 1):
                    row = k * Q + j if k < nd else Td + (k - nd)
                    sp[row] = r.params
                    pos[row] = r.num_tokens + j  # position of the token sampled at this row
            if k < nd:
                spec.num_drafts[k] = c.num_drafts
        tokens, num_out, logprobs, drafts = self._run_spec(md, SamplingArrays.build(sp, pos, shape.num_logits), spec)
        produced: list = [([], [], None)] * len(chunks)
        for e, oi in zip(entries, order):
            c = chunks[oi]
            if not c.samples:
                continue
            n = int(num_out[e])
            produced[oi] = (tokens[e, :n].tolist(), logprobs[e, :n].tolist(), None)
            r = c.request
            r.draft_token_ids = self.drafter.propose(r.all_token_ids + produced[oi][0], drafts[e])[: self.spec_k]
        return produced

    def _output(self, r: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(
            r.request_id,
            list(r.output_token_ids),
            list(r.output_logprobs) if r.params.logprobs or r.params.top_logprobs else None,
            r.status is Status.FINISHED,
            r.finish_reason,
            new,
            list(r.output_top_logprobs) if r.params.top_logprobs else None,
            r.num_cached_tokens,
            r.num_draft_tokens,
            r.num_accepted_tokens,
        )

    def run(self) -> dict[Hashable, RequestOutput]:
        """Steps until every request finishes; returns the final output of each."""
        final: dict[Hashable, RequestOutput] = {}
        while self.has_unfinished:
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return final


def generate(
    params: Params,
    cfg: DeepseekConfig,
    prompts: Iterable[Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
    config: EngineConfig | None = None,
    *,
    plan: ParallelPlan | None = None,
) -> list[RequestOutput]:
    """Generates for every prompt through the paged cache with continuous batching; outputs in prompt order.

    `sampling` is one SamplingParams for all prompts or one per prompt (per-request seeds, stop ids, ...).
    `plan` runs it on a mesh (`mla_jax.parallel.ParallelPlan`).
    """
    prompts = list(prompts)
    if not isinstance(sampling, SamplingParams):
        sampling = list(sampling)
        if len(sampling) != len(prompts):
            raise ValueError(f"{len(sampling)} SamplingParams for {len(prompts)} prompts")
    else:
        sampling = [sampling] * len(prompts)
    checked = []
    for i, (p, s) in enumerate(zip(prompts, sampling)):  # all of them before any work: say which one is bad
        try:
            checked.append(check_prompt(p, s, cfg))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    prompts = checked
    if config is None:
        longest = max((len(p) + s.max_new_tokens for p, s in zip(prompts, sampling)), default=1)
        config = EngineConfig(
            max_model_len=max(64, 1 << (longest - 1).bit_length()),
            max_num_seqs=max(1, min(64, 1 << (len(prompts) - 1).bit_length())),
            page_size=default_page_size(),
            token_budget=512,
        )
    for i, (p, s) in enumerate(zip(prompts, sampling)):
        if len(p) + s.max_new_tokens > config.max_model_len:
            raise ValueError(
                f"prompt {i}: prompt length {len(p)} + max_new_tokens {s.max_new_tokens} exceeds "
                f"max_model_len {config.max_model_len}"
            )
    engine = Engine(params, cfg, config, plan=plan)
    ids = [engine.add_request(p, s) for p, s in zip(prompts, sampling)]
    final = engine.run()
    return [final[i] for i in ids]
