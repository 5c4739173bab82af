"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p, per-request seeds.

The random key of a sample is derived from (request seed, position of the sampled token) only, so a request
samples the same tokens whatever else is in the batch and after a preemption and recompute. Two requests with the
same seed and prompt sample the same tokens: give each its own seed (the server draws one for a request without
a seed, and uses seed + i for choice i of `n`).

Top-n logprobs (OpenAI's `logprobs` / `top_logprobs`) are computed only in steps that have a request asking for
them: `SamplingArrays.num_top_logprobs` is a static field, 0 or `MAX_TOP_LOGPROBS`, so the common step has no
top-k at all and a step with such a request is one more compiled variant of its shape.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_TOP_LOGPROBS = 20  # the most alternatives a request may ask for (vLLM's default max_logprobs)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # return the log-probability of each sampled token (under the raw model distribution)
    top_logprobs: int = 0  # also return the this many most likely tokens at each position, with their logprobs

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        num = (int, float, np.integer, np.floating)
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, num)
            or not 0 <= self.temperature < np.inf
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, num) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        ints = (int, np.integer)
        if not isinstance(self.seed, ints) or not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be an int in [0, 2^31), got {self.seed!r}")
        if not isinstance(self.top_logprobs, ints) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, ints)]
        if bad:
            raise ValueError(f"stop_token_ids must be ints, got {bad[0]!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per logit row: f32 temperature, i32 top_k, f32 top_p, i32 seed, i32 position of the sampled token; and
    (static) how many top logprobs the step returns per row, 0 or MAX_TOP_LOGPROBS, and whether any sampled row
    filters by top-k / top-p: only then does the step sort the vocabulary (a sort of [rows, vocab] took 1.25 ms
    of a 19 ms batch-128 decode step on the H200), so greedy and plain-temperature steps never do."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    position: jax.Array
    num_top_logprobs: int = dataclasses.field(default=0, metadata=dict(static=True))
    filtered: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @staticmethod
    def build(params: list[SamplingParams | None], positions: list[int], rows: int) -> "SamplingArrays":
        """Rows without params (padding, unfinished prefill chunks) sample greedily and are ignored. The top
        logprobs are on (MAX_TOP_LOGPROBS of them) when any row asks for some."""
        t = np.zeros(rows, np.float32)
        k = np.zeros(rows, np.int32)
        p = np.ones(rows, np.float32)
        s = np.zeros(rows, np.int32)
        pos = np.zeros(rows, np.int32)
        for i, (sp, ps) in enumerate(zip(params, positions)):
            if sp is None:
                continue
            t[i], k[i], p[i], s[i], pos[i] = sp.temperature, sp.top_k, sp.top_p, sp.seed, ps
        top = MAX_TOP_LOGPROBS if any(sp is not None and sp.top_logprobs > 0 for sp in params) else 0
        filtered = any(sp is not None and sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1) for sp in params)
        return SamplingArrays(t, k, p, s, pos, top, filtered)


def _filtered_sorted(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """(order i32[R, vocab]: token ids by descending scaled logit, the scaled logits in that order with the tokens
    that top-k / top-p drop set to -inf)."""
    Vocab = logits.shape[-1]
    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = logits / temp
    # Sort once (descending) for both filters; ties keep index order.
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)  # [R, vocab]
    rank = jnp.arange(Vocab)[None, :]
    keep = jnp.where(s.top_k[:, None] > 0, rank < s.top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    # top-p: smallest prefix reaching top_p (the first token always stays); top_p = 1 keeps every token, also those
    # whose mass before them rounds to 1
    keep &= (before < s.top_p[:, None]) | (s.top_p[:, None] >= 1)
    return order, jnp.where(keep, sorted_logits, -jnp.inf)


def filtered_logprobs(logits: jax.Array, s: SamplingArrays) -> jax.Array:
    """logits f32[R, vocab] -> log-probabilities f32[R, vocab] (vocab order) of the distribution `sample` draws
    from at temperature > 0 (temperature, top-k, top-p; -inf for dropped tokens). Speculative sampling
    (`mla_jax.spec_decode.accept`) accepts and resamples against it."""
    if not s.filtered:  # nothing to drop: no sort
        return jax.nn.log_softmax(logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None], axis=-1)
    order, filtered = _filtered_sorted(logits, s)
    inv = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(jax.nn.log_softmax(filtered, axis=-1), inv, axis=-1)


def sample(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """logits f32[R, vocab] -> (token ids i32[R], logprobs f32[R] of those tokens under log_softmax(logits)).

    With `s.num_top_logprobs` = n > 0 both gain a trailing axis of 1 + n: column 0 the sampled token and its
    logprob, columns 1..n the n most likely tokens (most likely first) and theirs."""
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def draw(seed, pos, row):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        return jax.random.categorical(key, row)

    # Rows without a filter draw from the whole scaled row (no sort), in every step: so a row samples the same
    # token whether or not another row of the batch filters (and the step sorts).
    scaled = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    sampled = jax.vmap(draw)(s.seed, s.position, scaled).astype(jnp.int32)
    if s.filtered:
        order, filtered = _filtered_sorted(logits, s)
        choice = jax.vmap(draw)(s.seed, s.position, filtered)  # index into the sorted order
        in_order = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
        sampled = jnp.where((s.top_k > 0) | (s.top_p < 1), in_order, sampled)
    tokens = jnp.where(s.temperature > 0, sampled, greedy)
    logprobs = jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
    if not s.num_top_logprobs:
        return tokens, logprobs
    top_lp, top_ids = jax.lax.top_k(logprobs_all, s.num_top_logprobs)
    return (
        jnp.concatenate([tokens[:, None], top_ids.astype(jnp.int32)], axis=1),
        jnp.concatenate([logprobs[:, None], top_lp], axis=1),
    )
