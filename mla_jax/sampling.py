"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p, per-request seeds.

The random key of a sample is derived from (request seed, position of the sampled token) only, so a request
samples the same tokens whatever else is in the batch and after a preemption and recompute.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # return the log-probability of each sampled token (under the raw model distribution)

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0 <= self.seed < 2**31:
            raise ValueError(f"seed must be in [0, 2^31), got {self.seed!r}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """Per logit row: f32 temperature, i32 top_k, f32 top_p, i32 seed, i32 position of the sampled token."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    seed: jax.Array
    position: jax.Array

    @staticmethod
    def build(params: list[SamplingParams | None], positions: list[int], rows: int) -> "SamplingArrays":
        """Rows without params (padding, unfinished prefill chunks) sample greedily and are ignored."""
        t = np.zeros(rows, np.float32)
        k = np.zeros(rows, np.int32)
        p = np.ones(rows, np.float32)
        s = np.zeros(rows, np.int32)
        pos = np.zeros(rows, np.int32)
        for i, (sp, ps) in enumerate(zip(params, positions)):
            if sp is None:
                continue
            t[i], k[i], p[i], s[i], pos[i] = sp.temperature, sp.top_k, sp.top_p, sp.seed, ps
        return SamplingArrays(t, k, p, s, pos)


def sample(logits: jax.Array, s: SamplingArrays) -> tuple[jax.Array, jax.Array]:
    """logits f32[R, vocab] -> (token ids i32[R], logprobs f32[R] of those tokens under log_softmax(logits))."""
    R, Vocab = logits.shape
    logprobs_all = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    temp = jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    scaled = logits / temp
    # Sort once (descending) for both filters; ties keep index order.
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)  # [R, vocab]
    rank = jnp.arange(Vocab)[None, :]
    keep = jnp.where(s.top_k[:, None] > 0, rank < s.top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly before each token
    keep &= before < s.top_p[:, None]  # top-p: smallest prefix reaching top_p (the first token always stays)
    filtered = jnp.where(keep, sorted_logits, -jnp.inf)

    def draw(seed, pos, row):
        key = jax.random.fold_in(jax.random.key(seed), pos)
        return jax.random.categorical(key, row)

    choice = jax.vmap(draw)(s.seed, s.position, filtered)  # index into the sorted order
    sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)
    tokens = jnp.where(s.temperature > 0, sampled, greedy)
    return tokens, jnp.take_along_axis(logprobs_all, tokens[:, None], axis=-1)[:, 0]
