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
import numpy as np

from mla_jax import attention, spec_decode
from mla_jax import step as step_lib
from mla_jax.allocator import PagePool, PoolTotals
from mla_jax.cache import KVCache, cache_dtype, init_kv_cache, init_kv_cache_for
from mla_jax.chunking import workspace_rows as default_workspace_rows
from mla_jax.compile_cache import enable_compile_cache
from mla_jax.config import DeepseekConfig
from mla_jax.layers import GMM_IMPLS
from mla_jax.metadata import AttentionMetadata, BatchShape, ScheduledRequest, build_metadata, empty_metadata
from mla_jax.model import Params
from mla_jax.mtp import has_mtp, num_draft_layers
from mla_jax.packed import Packed
from mla_jax.parallel import ParallelPlan, stack_metadata, to_host
from mla_jax.sampling import SamplingArrays, SamplingParams
from mla_jax.scheduler import PENDING, DPScheduler, Request, Scheduler, Status
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
    # Schedule and send step n+1 while step n runs on the device: decode rows read their input id from step
    # n's sampled ids on the device, and step n's outputs are processed after step n+1 is launched (so `step()`
    # returns each step's outputs one call later). A request that stops on a stop token costs one discarded
    # row. MTP speculative steps too (the next step's rows move by this one's accepted drafts on the device,
    # `spec_decode.follow_prev`); n-gram ones run synchronously (their drafts come from the accepted tokens).
    async_scheduling: bool = True

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
        for name in ("batch_invariant", "enable_prefix_caching", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")

    def resolved(self, dp: int = 1) -> "EngineConfig":
        """Defaults filled in. `dp` > 1 (data-parallel attention): `num_pages` and the decode buckets are per DP
        rank, of max_num_seqs / dp sequences each."""
        k, method = self.num_speculative_tokens, self.speculative_method
        if k or method is not None:
            if method not in spec_decode.METHODS:
                raise ValueError(f"speculative_method must be one of {spec_decode.METHODS}, got {method!r}")
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= spec_decode.MAX_SPECULATIVE_TOKENS:
                raise ValueError(
                    f"num_speculative_tokens must be an int in [1, {spec_decode.MAX_SPECULATIVE_TOKENS}] with "
                    f"speculative_method={method!r}, got {k!r}"
                )
        if dp > self.max_num_seqs or self.max_num_seqs % dp:
            raise ValueError(
                f"EngineConfig.max_num_seqs {self.max_num_seqs} does not divide over dp={dp} data-parallel ranks "
                "(each rank needs at least one sequence slot)"
            )
        seqs = self.max_num_seqs // dp  # per rank
        pages = self.num_pages or seqs * cdiv(self.max_model_len, self.page_size) + 1
        dec = self.decode_buckets or _pow2_buckets(1, seqs)
        pre = self.prefill_buckets or _pow2_buckets(min(16, self.token_budget), self.token_budget)
        if max(dec) < seqs:
            what = f"max_num_seqs / dp = {seqs}" if dp > 1 else f"max_num_seqs {seqs}"
            raise ValueError(f"largest decode bucket {max(dec)} < {what}")
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


def _start_host_copies(*xs: jax.Array) -> None:
    """Starts the device-to-host copy of each array this process holds whole (`to_host` then waits on them)."""
    for x in xs:
        if x.is_fully_addressable:
            x.copy_to_host_async()


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


@dataclasses.dataclass
class _Launched:
    """A step in flight: its chunks and the device arrays of its outputs, with, per chunk that samples, its logit
    row (a speculative step: its entry), None for the others."""

    chunks: list
    sampled: list[bool]  # per chunk: it sampled (ended at its request's last token at launch)
    tokens: jax.Array
    logprobs: jax.Array
    samples: list
    num_out: jax.Array | None = None  # speculative steps: outputs per entry, and the MTP drafts
    drafts: jax.Array | None = None


class Engine:
    """Continuous batching over the paged cache, on one device or, with `plan`, on a mesh.

    On a mesh `config.page_size` is the physical page G of each device; under DCP the scheduler, allocator and
    metadata work in virtual pages of G*dcp tokens (so `config.num_pages`, if given, counts those, and each
    device holds num_pages * G rows per layer). Under data-parallel attention (`plan.dp` > 1) every DP rank has
    its own page pool (`pools`; `config.num_pages` counts one rank's) and scheduler (`mla_jax.scheduler.DPScheduler`:
    `max_num_seqs` is split over the ranks, `token_budget` and `max_prefills` hold per rank), and each step runs
    every rank's share, in one static BatchShape (the largest bucket any rank needs), in one jitted step. In a
    multi-process run every process drives an engine with the same requests: host-side decisions are
    deterministic, so they stay in step."""

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
        self.dp = plan.dp if plan is not None else 1
        config.resolved(self.dp)  # bad fields (e.g. dp > max_num_seqs) fail before the params are placed
        if config.speculative_method and config.num_speculative_tokens and self.dp > 1:
            raise ValueError(f"speculative decoding with data-parallel attention (dp={self.dp}) is not supported")
        if plan is not None:
            params = plan.shard_params(params, cfg)
            config = dataclasses.replace(config, page_size=config.page_size * plan.dcp)
        self.params, self.cfg = params, cfg
        self.config = c = config.resolved(self.dp)
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
        self.pools = [
            PagePool(c.num_pages, c.page_size, enable_prefix_caching=c.enable_prefix_caching) for _ in range(self.dp)
        ]
        # DP: `pool` sums the ranks' pools (read-only page counts, for stats)
        self.pool = self.pools[0] if self.dp == 1 else PoolTotals(self.pools)
        if self.pools[0].num_usable_pages < cdiv(c.max_model_len, c.page_size):
            raise ValueError(
                f"{c.num_pages} pages of {c.page_size} cannot hold one max_model_len ({c.max_model_len}) request"
            )
        self.cache = self._init_cache()
        kw = dict(max_num_seqs=c.max_num_seqs, token_budget=c.token_budget, max_prefills=c.max_prefills)
        self.scheduler = Scheduler(self.pool, **kw) if self.dp == 1 else DPScheduler(self.pools, **kw)
        self.max_pages = cdiv(c.max_model_len, c.page_size)
        self.workspace_rows = default_workspace_rows(c.max_model_len, c.max_prefills, c.page_size)
        chunk_min = (self.workspace_rows // c.max_prefills) // c.page_size * c.page_size
        self.max_chunks = cdiv(c.max_model_len, chunk_min)
        # Async speculative steps take the last step's drafts on the device: MTP's, not the host's n-gram ones.
        self.async_scheduling = c.async_scheduling and (not self.spec_k or self.drafter.on_device)
        # The last step's sampled ids on the device, padded to the most logit rows a step has (fixed shape).
        buf = np.zeros(self.batch_shape(max(c.decode_buckets), 1).num_logits * self.dp, np.int32)  # DP: rank-major
        self.token_buffer = self._to_device(buf)
        if self.spec_k:  # the same for speculative steps: per entry, its outputs and drafts
            entries = max(c.decode_buckets) + c.max_prefills
            self.spec_carry = self._to_device(spec_decode.SpecCarry.zeros(entries, self.spec_k))
        self._inflight: _Launched | None = None  # async: the launched step whose outputs are not processed yet
        # request -> logit row (speculative steps: entry) of its pending output in the last step
        self._pending_rows: dict[Hashable, int] = {}
        self.device_wait_s = 0.0  # time step() spent blocked on sampled ids (the rest of its time is host work)
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
        return self.scheduler.has_unfinished or self._inflight is not None

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

    def _to_device(self, tree):
        """Host arrays on the device, or replicated over the plan's mesh."""
        return jax.device_put(tree) if self.plan is None else self.plan.replicate(tree)

    def _step_input(self, tree):
        """A step's host inputs as the jitted step takes them: on one device the numpy buffer itself (jit's C++
        dispatch transfers it for a fraction of `jax.device_put`'s host time), over a mesh replicated."""
        return tree if self.plan is None else self.plan.replicate(tree)

    def _dispatch(self, md: AttentionMetadata, sampling: SamplingArrays, prev_index: np.ndarray | None = None):
        """Launches one jitted step (asynchronously) and starts copying its sampled ids and logprobs to the host;
        returns them as device arrays. The host inputs go as one buffer (one transfer); rows with `prev_index`
        >= 0 take their input id from the previous step's ids on the device (`step.engine_step`)."""
        batch = self._step_input(step_lib.step_batch(md, sampling, prev_index))
        tokens, logprobs, self.cache, self.token_buffer = step_lib.engine_step(
            self.params,
            self.cfg,
            self.cache,
            batch,
            self.token_buffer,
            backend=self.config.backend,
            plan=self.plan,
            batch_invariant=self.config.batch_invariant,
            gmm_impl=self.config.gmm_impl,
        )
        _start_host_copies(tokens, logprobs)
        return tokens, logprobs

    def _run(self, md: AttentionMetadata, sampling: SamplingArrays) -> tuple[np.ndarray, np.ndarray]:
        """One step, synchronously: (sampled tokens, their logprobs) on the host."""
        tokens, logprobs = self._dispatch(md, sampling)
        return to_host(tokens), to_host(logprobs)

    def _dispatch_spec(self, md: AttentionMetadata, sampling: SamplingArrays, spec: spec_decode.SpecArrays):
        """Launches one jitted speculative step (`spec_decode.spec_step`) and starts copying its outputs to the
        host: (tokens [E, k+1], num_out [E], logprobs [E, k+1], MTP drafts [E, k]) as device arrays, E = decode
        entries then prefills."""
        batch = self._step_input(Packed.of((md, sampling, spec)))  # one transfer
        *out, self.cache, self.spec_carry = spec_decode.spec_step(
            self.params,
            self.cfg,
            self.cache,
            batch,
            self.spec_carry,
            backend=self.config.backend,
            plan=self.plan,
            batch_invariant=self.config.batch_invariant,
            gmm_impl=self.config.gmm_impl,
            num_speculative_tokens=self.spec_k,
            method=self.drafter.method,
        )
        _start_host_copies(*out)  # the four copies in flight together, not one after another
        return out

    def warmup(
        self,
        prefill: bool = True,
        top_logprobs: bool = False,
        all_shapes: bool = False,
        filtered: bool = False,
        log: TextIO | None = None,
    ) -> float:
        """Compiles every decode bucket (and, with `prefill`, the largest prefill bucket; with `all_shapes`, every
        prefill bucket alone and with every decode bucket, so that no greedy or plain-sampling step compiles
        later); with `top_logprobs`, the variants of these shapes that return top logprobs too; with `filtered`,
        those that sort the vocabulary for top-k / top-p sampling (all three: nothing compiles later; each
        variant doubles the compiles, docs/perf-notes.md). Returns seconds. `log` gets a line per compiled shape
        with its time (the CLI passes stderr on a terminal)."""
        t0 = time.perf_counter()
        c = self.config
        shapes = [self.batch_shape(nd, 0) for nd in c.decode_buckets]
        if all_shapes:
            shapes += [self.batch_shape(nd, tp) for tp in c.prefill_buckets for nd in (0,) + c.decode_buckets]
        elif prefill:
            shapes.append(self.batch_shape(0, c.token_budget))
        tops = (False, True) if top_logprobs else (False,)
        filters = (False, True) if filtered else (False,)
        if self.spec_k:  # speculative engines refuse top-logprob requests: no such variant
            tops = (False,)
        variants = [(top, filt) for top in tops for filt in filters]
        for k, shape in enumerate(shapes):
            for top, filt in variants:
                t1 = time.perf_counter()
                self._run_empty(shape, top, filt)
                if log is not None:
                    what = f"{shape.num_decodes} decode rows" if shape.num_decodes else ""
                    if shape.num_prefill_tokens:
                        what += (" + " if what else "") + f"{shape.num_prefill_tokens} prefill tokens"
                    what += ", top logprobs" if top else ""
                    what += ", top-k/top-p" if filt else ""
                    log.write(f"compiled step {k + 1}/{len(shapes)} ({what}): {time.perf_counter() - t1:.2f} s\n")
                    log.flush()
        return time.perf_counter() - t0

    def _run_empty(self, shape: BatchShape, top_logprobs: bool = False, filtered: bool = False) -> None:
        """A step of padding rows only: writes nothing, reads nothing, compiles the shape."""
        md = empty_metadata(shape)
        if self.dp > 1:
            md = stack_metadata([md] * self.dp)
        sp = SamplingParams(top_logprobs=int(top_logprobs), temperature=float(filtered), top_p=0.5 if filtered else 1)
        sampling = SamplingArrays.build([sp], [0], shape.num_logits * self.dp)  # row 0 selects the variant only
        if self.spec_k:
            jax.block_until_ready(self._dispatch_spec(md, sampling, spec_decode.SpecArrays.empty(shape)))
            return
        jax.block_until_ready(self._run(md, sampling))

    # ---- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules and launches a step; returns the outputs of the last step whose sampled ids are known: this
        one (synchronous), or the one launched by the previous call (`EngineConfig.async_scheduling`)."""
        launched = self._launch()
        if launched is None and self._inflight is None and self.scheduler.has_unfinished:
            raise RuntimeError("scheduler made no progress (a request cannot fit in the page pool)")
        if not self.async_scheduling:
            return self._complete(launched) if launched is not None else []
        done, self._inflight = self._inflight, launched
        return self._complete(done) if done is not None else []

    def _launch(self) -> "_Launched | None":
        """Schedule, build the metadata and launch the step (speculative steps also wait for it)."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return None
        pool_of = self.scheduler.pool_of
        reqs = [ScheduledRequest(c.token_ids, c.start, pool_of(c.request).pages(c.request.request_id)) for c in chunks]
        # A decode is a request's last token (plus its drafts); anything else is a prefill chunk.
        is_decode = [c.num_tokens - c.num_drafts == 1 for c in chunks]
        self.num_computed_tokens += sum(c.num_tokens for c in chunks)
        self.steps += 1
        if self.dp > 1:
            md, rows = self._dp_metadata(chunks, reqs, is_decode)
            return self._launch_plain(chunks, md, rows)
        nd = sum(is_decode)
        tp = sum(c.num_tokens for c, d in zip(chunks, is_decode) if not d)
        md, order = self._build(reqs, self.batch_shape(nd, tp), is_decode)
        if self.spec_k:
            return self._launch_spec(chunks, md, order, nd)
        return self._launch_plain(chunks, md, self._logit_rows(order, nd, md.shape))

    def _build(self, reqs, shape: BatchShape, is_decode) -> tuple[AttentionMetadata, list[int]]:
        """One rank's (or the one device's) metadata of `shape` and the order of `reqs` in it."""
        c = self.config
        kw = dict(page_size=c.page_size, num_pages=c.num_pages, workspace_rows=self.workspace_rows)
        return build_metadata(reqs, shape=shape, is_decode=is_decode, **kw)

    @staticmethod
    def _logit_rows(order, nd, shape: BatchShape, rank: int = 0) -> list[tuple[int, int, int]]:
        """(chunk index, logit row, token row of a decode or -1) of each chunk in `order`: decode b -> logit and
        token row b; prefill s -> logit row Td + s. Under DP rows are rank-major: rank r's start at r *
        num_logits (logits) and r * num_tokens (the flattened [dp, T] token rows)."""
        lo, to = rank * shape.num_logits, rank * shape.num_tokens
        return [
            (oi, lo + k, to + k) if k < nd else (oi, lo + shape.num_decode_tokens + (k - nd), -1)
            for k, oi in enumerate(order)
        ]

    def _dp_metadata(self, chunks, reqs, is_decode) -> tuple[AttentionMetadata, list[tuple[int, int, int]]]:
        """DP: every rank's metadata in the one BatchShape of the largest rank share (a rank without chunks gets
        `empty_metadata`), stacked on a leading [dp] axis; and `_logit_rows` of each chunk (rank-major)."""
        ranks = [[i for i, ch in enumerate(chunks) if ch.request.dp_rank == r] for r in range(self.dp)]
        nd = max(sum(is_decode[i] for i in idx) for idx in ranks)
        tp = max(sum(chunks[i].num_tokens for i in idx if not is_decode[i]) for idx in ranks)
        shape = self.batch_shape(nd, tp)
        mds, rows = [], []
        for r, idx in enumerate(ranks):
            if not idx:
                mds.append(empty_metadata(shape))
                continue
            md, order = self._build([reqs[i] for i in idx], shape, [is_decode[i] for i in idx])
            mds.append(md)
            n = sum(is_decode[i] for i in idx)
            rows += [(idx[oi], row, tok) for oi, row, tok in self._logit_rows(order, n, shape, r)]
        return stack_metadata(mds), rows

    def _launch_plain(self, chunks, md, rows) -> "_Launched":
        """Launches a step without speculation. Each chunk's rows count as computed from now on, and a chunk that
        samples gets a pending output (`PENDING`, filled in by `_complete`), so the next schedule sees it.
        `rows`: `_logit_rows` of the chunks."""
        shape = md.shape
        n = shape.num_logits * self.dp
        sp: list[SamplingParams | None] = [None] * n
        pos = [0] * n
        prev_index = np.full(shape.num_tokens * self.dp, -1, np.int32)
        for oi, row, tok in rows:
            c = chunks[oi]
            r = c.request
            if tok >= 0 and r.num_pending:  # its input is the last step's sampled id, still on the device
                prev_index[tok] = self._pending_rows[r.request_id]
            if c.samples:
                sp[row] = r.params
                pos[row] = r.num_tokens  # position of the token being sampled
        prev_index = prev_index.reshape(np.shape(md.input_ids))  # DP: [dp, T]
        tokens, logprobs = self._dispatch(md, SamplingArrays.build(sp, pos, n), prev_index)
        samples = [None] * len(chunks)  # per chunk that samples: its logit row
        self._pending_rows = {}
        for oi, row, _ in rows:
            c = chunks[oi]
            r = c.request
            r.num_computed_tokens = c.start + c.num_tokens
            if c.samples:
                samples[oi] = row
                r.output_token_ids.append(PENDING)
                r.num_pending += 1
                self._pending_rows[r.request_id] = row
        sampled = [x is not None for x in samples]
        return _Launched(chunks, sampled, tokens, logprobs, samples)

    def _complete(self, launched: "_Launched") -> list[RequestOutput]:
        """Processes a launched step's outputs: the pending ids filled in, stops, (speculative steps) the accepted
        drafts counted as computed, rejected rows rolled back and the next drafts, prefix-cache registration."""
        t0 = time.perf_counter()
        outputs = (launched.tokens, launched.logprobs, launched.num_out, launched.drafts)
        host = [None if x is None else to_host(x) for x in outputs]
        self.device_wait_s += time.perf_counter() - t0
        produced = self._spec_produced(launched, *host) if self.spec_k else self._plain_produced(launched, *host[:2])
        outs = []
        for oi, (c, (toks, lps, tops)) in enumerate(zip(launched.chunks, produced)):
            r = c.request
            if r.status is Status.FINISHED:  # finished or aborted while this step ran (async): nothing to report
                continue
            reason, new = None, []
            if launched.sampled[oi]:
                base = len(r.output_token_ids) - r.num_pending  # its pending id: the first (a later step's follow)
                r.output_token_ids[base : base + 1] = toks
                r.num_pending -= 1
                for i, tok in enumerate(toks):
                    new.append(tok)
                    r.output_logprobs.append(lps[i])
                    if tops is not None:
                        r.output_top_logprobs.append(tops)
                    if tok in r.params.stop_token_ids:
                        reason = "stop"
                    elif base + i + 1 >= r.params.max_new_tokens:
                        reason = "length"
                    if reason:
                        del r.output_token_ids[base + i + 1 :]  # drafts past a stop; async: a later step's pending id
                        r.num_pending = 0
                        break
            if self.spec_k and c.num_drafts:  # the verifier's count (accepted drafts past a stop included)
                accepted = len(toks) - 1
                r.num_draft_tokens += c.num_drafts
                r.num_accepted_tokens += accepted
                self.num_draft_tokens += c.num_drafts
                self.num_accepted_tokens += accepted
                if c.num_drafts == self.spec_k:
                    self.num_verify_steps += 1
                    self.num_verify_accepted += accepted
            if r.status is Status.RUNNING:  # (not preempted while this step ran)
                if self.spec_k:
                    self._spec_advance(r, len(toks) - 1 if launched.sampled[oi] else 0, host[3], launched.samples[oi])
                self.scheduler.cache_computed(r)  # before a finish frees the pages
            if reason:
                self.scheduler.finish(r, reason)
            if launched.sampled[oi]:
                outs.append(self._output(r, new))
        return outs

    def _spec_advance(self, r: Request, accepted: int, drafts: np.ndarray, sample) -> None:
        """After a speculative step: the accepted drafts count as computed (launch counted its real rows). With no
        later step of the request in flight, the pages of rejected rows go back (`PagePool.truncate`) and its next
        drafts are set: the n-gram proposal, or the step's MTP drafts (a step in flight took them on the device)."""
        # (at most its known tokens: drafts past a stop, or past max_new_tokens, which async steps can verify)
        r.num_computed_tokens = min(r.num_computed_tokens + accepted, r.num_tokens - r.num_pending)
        if r.num_pending or r.status is not Status.RUNNING:
            return
        r.num_unverified = 0
        self.pool.truncate(r.request_id, r.num_computed_tokens)
        if sample is not None:
            r.draft_token_ids = self.drafter.propose(r.all_token_ids, drafts[sample])[: self.spec_k]

    def _plain_produced(self, launched: "_Launched", tokens: np.ndarray, logprobs: np.ndarray) -> list:
        """Per chunk of a step without speculation: ([sampled token] or [], logprobs, top logprobs or None)."""
        top_ids = top_lps = None
        if tokens.ndim == 2:  # column 0 the sampled token, then the top logprobs
            tokens, top_ids, logprobs, top_lps = tokens[:, 0], tokens[:, 1:], logprobs[:, 0], logprobs[:, 1:]
        produced: list = [([], [], None)] * len(launched.chunks)
        for oi, c in enumerate(launched.chunks):
            if launched.samples[oi] is None:
                continue
            row = launched.samples[oi]
            tops = None
            if c.request.params.top_logprobs:
                k = c.request.params.top_logprobs
                tops = list(zip(top_ids[row, :k].tolist(), top_lps[row, :k].tolist()))
            produced[oi] = ([int(tokens[row])], [float(logprobs[row])], tops)
        return produced

    def _spec_produced(self, launched: "_Launched", tokens, logprobs, num_out, drafts) -> list:
        """Per chunk of a speculative step: (the accepted drafts + the target's next token, their logprobs, None)."""
        produced: list = [([], [], None)] * len(launched.chunks)
        for oi, smp in enumerate(launched.samples):
            if smp is not None:
                n = int(num_out[smp])
                produced[oi] = (tokens[smp, :n].tolist(), logprobs[smp, :n].tolist(), None)
        return produced

    def _launch_spec(self, chunks, md, order, nd) -> "_Launched":
        """Launches a speculative step. A decode whose last step is still in flight (async) takes its rows from
        that step's outputs on the device (`spec_decode.follow_prev`); the host counts its real rows as computed
        and gives each chunk that samples one pending output, which `_complete` replaces by the step's accepted
        drafts and next token."""
        shape = md.shape
        Bd, Q, Td = shape.num_decodes, shape.decode_query_len, shape.num_decode_tokens
        G = self.config.page_size
        sp: list[SamplingParams | None] = [None] * shape.num_logits
        pos = [0] * shape.num_logits
        spec = spec_decode.SpecArrays.empty(shape)
        next_ids = spec.next_ids
        next_ids[:] = -1
        entries = [0] * len(chunks)
        qsl = np.asarray(md.prefill.query_start_loc)
        for k, oi in enumerate(order):
            c = chunks[oi]
            r = c.request
            e = entries[oi] = k if k < nd else Bd + (k - nd)
            first = k * Q if k < nd else Td + int(qsl[k - nd])  # the chunk's first token row
            toks = r.all_token_ids
            for i in range(c.num_tokens - c.num_drafts):  # the token after each real row, where it is known
                p = c.start + i + 1
                next_ids[first + i] = toks[p] if p < len(toks) else -1  # (PENDING is -1 too)
            if c.samples:
                spec.capacity[e] = len(self.pool.pages(r.request_id)) * G
                for j in range(c.num_drafts + 1 if k < nd else 1):
                    row = k * Q + j if k < nd else Td + (k - nd)
                    sp[row] = r.params
                    pos[row] = r.num_tokens + j  # position of the token sampled at this row
            if k < nd:
                spec.num_drafts[k] = c.num_drafts
                if r.num_pending:  # its row 0 and drafts are outputs of the step in flight
                    spec.prev_entry[k] = self._pending_rows[r.request_id]
        sampled = [c.samples for c in chunks]
        tokens, num_out, logprobs, drafts = self._dispatch_spec(md, SamplingArrays.build(sp, pos, len(sp)), spec)
        samples = [None] * len(chunks)
        self._pending_rows = {}
        for oi, c in enumerate(chunks):
            r = c.request
            r.num_computed_tokens = c.start + c.num_tokens - c.num_drafts  # + its accepted drafts, at completion
            if sampled[oi]:
                samples[oi] = entries[oi]
                r.output_token_ids.append(PENDING)
                r.num_pending += 1
                r.num_unverified = c.num_drafts
                # async: the next step takes its drafts from this one's on the device; else `_complete` sets them
                r.draft_token_ids = [PENDING] * self.spec_k if self.async_scheduling else []
                self._pending_rows[r.request_id] = entries[oi]
        return _Launched(chunks, sampled, tokens, logprobs, samples, num_out, drafts)

    def _output(self, r: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(
            r.request_id,
            r.output_token_ids[: len(r.output_token_ids) - r.num_pending],
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
        dp = plan.dp if plan is not None else 1
        seqs = max(1, min(64, 1 << (len(prompts) - 1).bit_length()))
        config = EngineConfig(
            max_model_len=max(64, 1 << (longest - 1).bit_length()),
            max_num_seqs=cdiv(seqs, dp) * dp,  # DP: at least one sequence per rank
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
