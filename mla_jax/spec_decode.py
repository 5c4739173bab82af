"""Speculative decoding: drafters, the verify step, and acceptance.

Each engine step verifies, for every decode request, its last token t_n plus up to k draft tokens d_1..d_m as
m + 1 query rows of one target step (the decode block [Bd, k+1]: row j at position n + j, causal through
per-row seq_lens; padding rows write nowhere). Row j's logits give the target's token after d_j (`accept`):

    greedy:  accept while d_{j+1} == argmax(row j); then emit the target's token of the first mismatch row
    sampled: accept d_{j+1} with probability p_j(d_{j+1}) (p: the target's filtered distribution, the drafts
             being deterministic, i.e. a one-hot draft distribution); at the first rejection resample from
             p_j without d_{j+1} renormalized, after m acceptances sample the bonus token from p_m.

Both preserve the target's distribution exactly (greedy: the target's own greedy tokens). A step emits
a + 1 tokens (a accepted drafts); the engine rolls the request back to n + a + 1 computed tokens, so the target
cache rows of rejected drafts are rewritten by the next step and pages emptied by the rollback are freed
(`PagePool.truncate`).

Drafters (`Drafter`): `NgramDrafter` proposes from the request's own tokens on the host (prompt lookup);
`MtpDrafter` takes the drafts the step's MTP module made on device (`mla_jax.mtp`): after verification, in the
same jitted step, the MTP layer runs over every computed row (the target's hidden states, the next tokens, its
own cache layer at the same slots; rows of rejected drafts write nowhere), then k - 1 more single-row passes
feed its own hidden state and draft back in, pass i through MTP layer i % num_mtp_layers (`mla_jax.mtp.draft_layer`,
vLLM's choice: a checkpoint's MTP layers chain, a single one is reused).

Async scheduling (MTP; the engine's default): step n+1 is launched before the host has read step n's outputs, so
the host's work hides under the device's as in plain decoding. The host builds a decode's rows as if step n
accepted no draft, with pages for the worst case (k accepted), and `follow_prev` moves them on the device by the
accepted count from step n's outputs (`SpecCarry`): row 0's input is step n's last output token, rows 1..k its
MTP drafts. The host learns step n's tokens one call later, counts its accepted drafts as computed then, and
rolls pages back once no step of the request is in flight. The n-gram drafter proposes on the host from the
accepted tokens, so its steps stay synchronous.

The step is one code path everywhere (`_verify_device`, `_draft_first`, `_draft_next`: each on one device's
shards): on a mesh (`ParallelPlan`: TP / EP / DCP) `spec_step` runs each part in a `shard_map` as
`mla_jax.step.forward_step` does, all in one jitted step, the logits all-gathered before acceptance so every
device accepts and drafts the same tokens (one manual computation for the whole step crashed Shardy's
canonicalizer, `ManualComputationUnusedInputsPattern`, in XLA's CPU compile; split, it compiles).
Sparse-attention models (V3.2) verify through the same layer loop (`mla_jax.sparse` scores and attends per token
row, so a verify row j sees exactly the keys below its position); n-gram drafter only: their MTP layers are not
loaded (`DeepseekConfig.num_mtp_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mla_jax import attention
from mla_jax.comm import LOCAL, Comm
from mla_jax.config import DeepseekConfig
from mla_jax.metadata import AttentionMetadata, BatchShape, DecodeMetadata, PrefillMetadata
from mla_jax.model import Params, lm_logits
from mla_jax.mtp import draft_layer, full_vocab, mtp_hidden, mtp_logits
from mla_jax.packed import Packed
from mla_jax.sampling import SamplingArrays, filtered_logprobs
from mla_jax.step import _device_hidden, mla_paged

if TYPE_CHECKING:
    from mla_jax.parallel import ParallelPlan

METHODS = ("mtp", "ngram")
MAX_SPECULATIVE_TOKENS = 4


class Drafter:
    """Proposes up to k draft tokens for a request after a step that sampled its next token. `on_device`:
    the drafts come out of the step itself (MTP) and `propose` receives them."""

    method: str = ""
    on_device: bool = False

    def __init__(self, k: int):
        self.k = k

    def propose(self, token_ids: list[int], device_drafts: np.ndarray | None) -> list[int]:
        raise NotImplementedError


class MtpDrafter(Drafter):
    """DeepSeek's MTP module, run by the step (`spec_step`) right after verification."""

    method = "mtp"
    on_device = True

    def propose(self, token_ids, device_drafts):
        return [int(t) for t in device_drafts[: self.k]]


class NgramDrafter(Drafter):
    """Prompt lookup (vLLM's n-gram proposer): the longest suffix of the tokens so far, of min_n..max_n tokens,
    that occurred before; the k tokens that followed its latest earlier occurrence (fewer near the end, none
    without a match)."""

    method = "ngram"

    def __init__(self, k: int, min_n: int = 1, max_n: int = 4):
        super().__init__(k)
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids, device_drafts=None):
        t = np.asarray(token_ids, np.int64)
        L = len(t)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            suffix = t[L - n :]
            win = np.lib.stride_tricks.sliding_window_view(t[: L - 1], n)  # windows starting at 0..L-1-n
            hits = np.flatnonzero((win == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return t[start : start + self.k].tolist()
        return []


def make_drafter(method: str, k: int) -> Drafter:
    if method == "mtp":
        return MtpDrafter(k)
    if method == "ngram":
        return NgramDrafter(k)
    raise ValueError(f"speculative_method must be one of {METHODS}, got {method!r}")


def accept(
    logits: jax.Array, drafts: jax.Array, num_drafts: jax.Array, s: SamplingArrays
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Verification of E requests with K = k + 1 rows each.

    logits f32[E, K, vocab]: row j the target's logits for the token after draft j (row 0: after the last
    real token); drafts i32[E, K-1]; num_drafts i32[E] (m <= K-1; rows past m are ignored); `s` per row [E*K]
    (position: of the token sampled at that row). Returns (tokens i32[E, K], of which the first num_out are
    the output; num_out i32[E] = accepted drafts + 1; logprobs f32[E, K] of the tokens under log_softmax)."""
    E, K, Vocab = logits.shape
    flat = logits.reshape(E * K, Vocab)
    j = jnp.arange(K)[None, :]  # [1, K]
    d = jnp.concatenate([drafts, jnp.zeros((E, 1), jnp.int32)], axis=1)  # [E, K]
    has_draft = j < num_drafts[:, None]  # [E, K]
    greedy = jnp.argmax(flat, axis=-1).astype(jnp.int32).reshape(E, K)
    lp = filtered_logprobs(flat, s)  # [E*K, vocab]
    p_d = jnp.exp(jnp.take_along_axis(lp, d.reshape(-1, 1), axis=-1)[:, 0])  # [E*K]
    keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(s.seed, s.position)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1)))(keys)  # [E*K]
    is_d = jnp.arange(Vocab)[None, :] == d.reshape(-1, 1)
    resid = jnp.where(has_draft.reshape(-1, 1) & is_d & (p_d[:, None] < 1), -jnp.inf, lp)  # p without the draft
    corrected = jax.vmap(jax.random.categorical)(keys, resid).astype(jnp.int32).reshape(E, K)
    sampled = (s.temperature > 0).reshape(E, K)
    ok = jnp.where(sampled, (u < p_d).reshape(E, K), d == greedy) & has_draft
    a = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)  # [E] accepted drafts
    final = jnp.where(sampled, corrected, greedy)
    tokens = jnp.where(j < a[:, None], d, jnp.where(j == a[:, None], final, 0))
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(flat, axis=-1), tokens.reshape(-1, 1), axis=-1)
    return tokens, a + 1, logprobs.reshape(E, K)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecArrays:
    """Per step, host-built: num_drafts i32[Bd] (drafts among each decode request's k+1 rows); next_ids i32[T]:
    the token after each row's where the host knows it (prompt tokens), -1 where it is this step's output;
    capacity i32[Bd + Sp]: tokens the pages of each request that samples this step hold (rows at or past it
    write nowhere), 0 for the others; prev_entry i32[Bd]: for a decode whose last step is still in flight
    (async scheduling), that step's entry in `SpecCarry`, whose outputs give its rows (`follow_prev`); -1: the
    host's rows."""

    num_drafts: jax.Array
    next_ids: jax.Array
    capacity: jax.Array
    prev_entry: jax.Array

    @staticmethod
    def empty(shape: BatchShape) -> "SpecArrays":
        return SpecArrays(
            np.zeros(shape.num_decodes, np.int32),
            np.zeros(shape.num_tokens, np.int32),
            np.zeros(shape.num_decodes + shape.num_prefills, np.int32),
            np.full(shape.num_decodes, -1, np.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SpecCarry:
    """The last speculative step's outputs, kept on the device for the next step (async scheduling launches it
    before the host has read them): per entry (decode requests, then prefills; rows past the step's E unused)
    tokens i32[S, k+1] (the first num_out are its output), num_out i32[S], drafts i32[S, k] (MTP; zeros for
    "ngram"). S is fixed by the engine (its largest decode bucket + max_prefills): every step has one signature."""

    tokens: jax.Array
    num_out: jax.Array
    drafts: jax.Array

    @staticmethod
    def zeros(entries: int, k: int) -> "SpecCarry":
        z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        return SpecCarry(z(entries, k + 1), z(entries), z(entries, k))

    def put(self, tokens: jax.Array, num_out: jax.Array, drafts: jax.Array) -> "SpecCarry":
        E = tokens.shape[0]
        t, n, d = self.tokens.at[:E].set(tokens), self.num_out.at[:E].set(num_out), self.drafts.at[:E].set(drafts)
        return SpecCarry(t, n, d)


def follow_prev(
    md: AttentionMetadata, sampling: SamplingArrays, spec: SpecArrays, prev: SpecCarry, page_size: int
) -> tuple[AttentionMetadata, SamplingArrays]:
    """The decode rows of requests whose last step is in flight, from that step's outputs on the device.

    The host built such a request's rows as if its last step accepted no draft: row 0 at position n (its
    computed tokens then), rows 1..m at n + j, its input ids placeholders. The step accepted a = num_out - 1
    drafts, so row j is at n + a + j; its input is the step's last output token (row 0) or its MTP draft j
    (rows 1..m); its slot comes from the block table at that position (-1 at or past `capacity`: pages the host
    allocated for the worst case, a = k, cover every row that can still matter), its seq_len is position + 1
    (0 past capacity), and its sampling position moves with it. Rows of other requests are unchanged."""
    s = md.shape
    Bd, Q, Td = s.num_decodes, s.decode_query_len, s.num_decode_tokens
    if not Bd:
        return md, sampling
    e = jnp.maximum(spec.prev_entry, 0)
    follow = (spec.prev_entry >= 0)[:, None]  # [Bd, 1]
    n_out = prev.num_out[e]  # [Bd]
    last = jnp.take_along_axis(prev.tokens[e], jnp.maximum(n_out - 1, 0)[:, None], axis=1)  # [Bd, 1]
    ids = jnp.concatenate([last, prev.drafts[e][:, : Q - 1]], axis=1)  # [Bd, Q]
    seq = md.decode.seq_lens  # [Bd, Q]
    real = seq > 0
    shift = jnp.where(follow, n_out[:, None] - 1, 0)
    pos = md.positions[:Td].reshape(Bd, Q) + shift
    live = real & (pos < spec.capacity[:Bd, None])
    bt = md.decode.block_table  # [Bd, MP]
    page = jnp.take_along_axis(bt, jnp.clip(pos // page_size, 0, bt.shape[1] - 1), axis=1)
    slot = jnp.where(live, page * page_size + pos % page_size, -1)
    pick = lambda new, old: jnp.where(follow, new, old.reshape(Bd, Q)).reshape(-1)  # noqa: E731
    md = dataclasses.replace(
        md,
        input_ids=md.input_ids.at[:Td].set(pick(jnp.where(real, ids, 0), md.input_ids[:Td])),
        positions=md.positions.at[:Td].set(pos.reshape(-1)),
        slot_mapping=md.slot_mapping.at[:Td].set(pick(slot, md.slot_mapping[:Td])),
        decode=dataclasses.replace(md.decode, seq_lens=jnp.where(follow, jnp.where(live, pos + 1, 0), seq)),
    )
    position = sampling.position.at[:Td].add(jnp.broadcast_to(shift, (Bd, Q)).reshape(-1))
    return md, dataclasses.replace(sampling, position=position)


def _decode_only(md_positions, input_ids, slots, block_table, seq_lens) -> AttentionMetadata:
    """Metadata of a step of E one-row decodes (an MTP drafting pass)."""
    E, MP = block_table.shape
    z = lambda *s: jnp.zeros(s, jnp.int32)  # noqa: E731
    return AttentionMetadata(
        input_ids=input_ids,
        positions=md_positions,
        slot_mapping=slots,
        logits_indices=jnp.arange(E, dtype=jnp.int32),
        decode=DecodeMetadata(block_table, seq_lens[:, None]),
        prefill=PrefillMetadata(z(1), z(0), z(0, MP), z(0, 0), z(0, 1), z()),
        shape=BatchShape(num_decodes=E, decode_query_len=1, max_pages=MP),
    )


def _verify_device(
    params: Params,
    cache,
    md: AttentionMetadata,
    sampling: SamplingArrays,
    spec: SpecArrays,
    *,
    cfg: DeepseekConfig,
    comm: Comm,
    backend: str,
    batch_invariant: bool,
    gmm_impl: str,
):
    """Target step + acceptance on one device's shards: (tokens i32[E, Q], num_out i32[E], logprobs f32[E, Q],
    last hidden states [T, D], cache). Every output but the cache is the same on every device of a mesh (the
    logits are all-gathered before acceptance)."""
    s = md.shape
    Bd, Q, Sp, Td = s.num_decodes, s.decode_query_len, s.num_prefills, s.num_decode_tokens
    kw = dict(cfg=cfg, comm=comm, backend=backend, batch_invariant=batch_invariant, gmm_impl=gmm_impl)
    x, cache = _device_hidden(params, cache, md, **kw)  # [T, D]
    logits = full_vocab(lm_logits(params, cfg, x[md.logits_indices]), comm, cfg.vocab_size)  # [Td + Sp, vocab]
    rows = lambda a, lo, hi: jax.tree.map(lambda v: v[lo:hi], a)  # noqa: E731
    toks, nout, lps = [], [], []
    if Bd:
        t, n, lp = accept(
            logits[:Td].reshape(Bd, Q, -1),
            md.input_ids[:Td].reshape(Bd, Q)[:, 1:],
            spec.num_drafts,
            rows(sampling, 0, Td),
        )
        toks, nout, lps = [t], [n], [lp]
    if Sp:
        z = jnp.zeros((Sp, 0), jnp.int32)
        t, n, lp = accept(logits[Td:, None], z, jnp.zeros(Sp, jnp.int32), rows(sampling, Td, Td + Sp))
        pad = lambda a: jnp.pad(a, ((0, 0), (0, Q - 1))) if Q > 1 else a  # noqa: E731
        toks, nout, lps = toks + [pad(t)], nout + [n], lps + [pad(lp)]
    tokens, num_out, logprobs = (jnp.concatenate(a, axis=0) for a in (toks, nout, lps))
    return tokens, num_out, logprobs, x, cache


def _mtp_attention(cfg: DeepseekConfig, comm: Comm, backend: str, batch_invariant: bool, page_size: int):
    """attn(view, j): MTP layer j's attention (an `AttentionFn`) over its cache layer num_hidden_layers + j;
    `view` the global metadata (this rank's part taken here, as `_device_hidden` does for the target)."""
    be = attention.get_backend(backend)
    N = cfg.num_hidden_layers
    heads = cfg.num_attention_heads // comm.head_shards
    cfg_loc = cfg if heads == cfg.num_attention_heads else dataclasses.replace(cfg, num_attention_heads=heads)

    def attn(view, j):
        view = comm.local_view(view, page_size)
        return lambda p, h, c, layer: mla_paged(
            p, cfg_loc, h, view, c, layer + N + j, be, comm=comm, batch_invariant=batch_invariant
        )

    return attn


def _draft_first(
    params: Params,
    cache,
    md: AttentionMetadata,
    spec: SpecArrays,
    x: jax.Array,
    tokens: jax.Array,
    num_out: jax.Array,
    *,
    cfg: DeepseekConfig,
    comm: Comm,
    backend: str,
    batch_invariant: bool,
    gmm_impl: str,
):
    """The first MTP pass, over every row of the step after `_verify_device` (x: the target's last hidden states
    [T, D]): the next token of decode row j is output j (rows past the accepted ones write nowhere); a prefill's
    last row's is its sampled token. Returns (MTP hidden state [E, D], position i32[E], first draft i32[E] of
    each entry's last computed row, cache)."""
    s = md.shape
    Bd, Q, Sp, Td = s.num_decodes, s.decode_query_len, s.num_prefills, s.num_decode_tokens
    nxt = spec.next_ids
    slots = md.slot_mapping
    sel = []
    if Bd:
        dec_next = jnp.where(nxt[:Td].reshape(Bd, Q) >= 0, nxt[:Td].reshape(Bd, Q), tokens[:Bd])
        valid = jnp.arange(Q)[None, :] < num_out[:Bd, None]
        nxt = jnp.concatenate([dec_next.reshape(-1), nxt[Td:]])
        slots = jnp.concatenate([jnp.where(valid.reshape(-1), slots[:Td], -1), slots[Td:]])
        sel.append(jnp.arange(Bd) * Q + num_out[:Bd] - 1)
    if Sp:
        last = md.logits_indices[Td:]
        samples = spec.capacity[Bd:] > 0  # padding prefill entries (logits row 0) sample nothing
        is_last = (jnp.arange(s.num_tokens)[:, None] == last[None, :]) & samples[None, :]  # [T, Sp]
        sampled_next = jnp.sum(jnp.where(is_last, tokens[Bd:, 0][None, :], 0), axis=1)
        nxt = jnp.where(is_last.any(axis=1) & (nxt < 0), sampled_next, nxt)
        sel.append(last)
    nxt = jnp.maximum(nxt, 0)  # padding rows (write nowhere, never selected)
    attn = _mtp_attention(cfg, comm, backend, batch_invariant, cache.page_size)
    md1 = dataclasses.replace(md, slot_mapping=slots)
    h, cache = mtp_hidden(params, cfg, x, nxt, md.positions, attn(md1, 0), cache, j=0, gmm_impl=gmm_impl, comm=comm)
    sel = jnp.concatenate(sel)
    h, pos = h[sel], md.positions[sel]  # [E, D], [E]
    d = jnp.argmax(mtp_logits(params, cfg, h, j=0, comm=comm), axis=-1).astype(jnp.int32)
    return h, pos, d, cache


def _draft_next(
    params: Params,
    cache,
    block_table: jax.Array,
    capacity: jax.Array,
    h: jax.Array,
    d: jax.Array,
    pos: jax.Array,
    *,
    i: int,
    cfg: DeepseekConfig,
    comm: Comm,
    backend: str,
    batch_invariant: bool,
    gmm_impl: str,
):
    """MTP pass i >= 1 (layer `draft_layer(cfg, i)`): one row per entry at position pos + i, fed the previous
    pass's hidden state h [E, D] and draft d i32[E]; writes its cache row below `capacity` only. Returns (h, d,
    cache)."""
    j = draft_layer(cfg, i)
    G, MP = cache.page_size * comm.dcp, block_table.shape[1]  # the block tables' (virtual, under DCP) page size
    p = pos + i
    live = (capacity > 0) & (p < MP * G)
    page = jnp.take_along_axis(block_table, jnp.minimum(p // G, MP - 1)[:, None], axis=1)[:, 0]
    slot = jnp.where(live & (p < capacity), page * G + p % G, -1)
    view = _decode_only(p, d, slot, block_table, jnp.where(live, p + 1, 0))
    attn = _mtp_attention(cfg, comm, backend, batch_invariant, cache.page_size)
    h, cache = mtp_hidden(params, cfg, h, d, p, attn(view, j), cache, j=j, gmm_impl=gmm_impl, comm=comm)
    return h, jnp.argmax(mtp_logits(params, cfg, h, j=j, comm=comm), axis=-1).astype(jnp.int32), cache


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "backend", "plan", "batch_invariant", "gmm_impl", "num_speculative_tokens", "method"),
    donate_argnames=("cache", "prev"),
)
def spec_step(
    params: Params,
    cfg: DeepseekConfig,
    cache,
    batch: Packed,
    prev: SpecCarry,
    *,
    backend: str,
    plan: ParallelPlan | None = None,
    batch_invariant: bool = False,
    gmm_impl: str = "ragged_dot",
    num_speculative_tokens: int,
    method: str,
):
    """Target step + verification (+ MTP drafting): (tokens i32[Bd+Sp, Q], num_out i32[Bd+Sp], logprobs
    f32[Bd+Sp, Q], drafts i32[Bd+Sp, k] (MTP; zeros for "ngram"), cache, carry).

    `batch` is `Packed.of((md, sampling, spec))` (one host→device transfer). Entries: the Bd decode requests (Q =
    k+1 rows each), then the Sp prefills (their last row; one output). `sampling` holds one row per logit row
    (decode rows, then one per prefill). `prev` (donated) is the last step's `SpecCarry`: decodes with
    `spec.prev_entry` >= 0 take their rows from it (`follow_prev`); the returned carry holds this step's outputs.
    With `plan` each part runs in a `shard_map` over its mesh as `mla_jax.step.forward_step` does (md, sampling,
    spec and the parts' hand-offs replicated; the outputs too)."""
    md, sampling, spec = batch.unpack()
    md, sampling = follow_prev(md, sampling, spec, prev, cache.page_size)  # (the global array's: DCP's virtual)
    kw = dict(cfg=cfg, backend=backend, batch_invariant=batch_invariant, gmm_impl=gmm_impl)
    k, E = num_speculative_tokens, md.shape.num_decodes + md.shape.num_prefills
    if plan is None:
        comm, cspecs = LOCAL, None

        def on_mesh(f, in_specs, out_specs):
            return f

    else:
        if cfg.use_sparse:
            raise NotImplementedError(f"{cfg.model_type}: sparse attention on a mesh (ParallelPlan) is not supported")
        plan.validate(cfg)
        if cache.page_size % plan.dcp:
            raise ValueError(f"cache page axis {cache.page_size} is not a multiple of dcp={plan.dcp}")
        comm, cspecs = plan.comm(cfg), plan.cache_specs(cache.is_fp8)

        def on_mesh(f, in_specs, out_specs):
            pspecs = plan.param_specs(params, cfg)
            return jax.shard_map(
                f, mesh=plan.mesh, in_specs=(pspecs, cspecs) + in_specs, out_specs=out_specs, check_vma=False
            )  # Pallas calls carry no varying-axes types

    tokens, num_out, logprobs, x, cache = on_mesh(
        functools.partial(_verify_device, comm=comm, **kw), (P(), P(), P()), (P(), P(), P(), P(), cspecs)
    )(params, cache, md, sampling, spec)
    if method != "mtp":
        drafts = jnp.zeros((E, k), jnp.int32)
        return tokens, num_out, logprobs, drafts, cache, prev.put(tokens, num_out, drafts)
    h, pos, d, cache = on_mesh(functools.partial(_draft_first, comm=comm, **kw), (P(),) * 5, (P(), P(), P(), cspecs))(
        params, cache, md, spec, x, tokens, num_out
    )
    drafts = [d]
    bt = jnp.concatenate([md.decode.block_table, md.prefill.block_table], axis=0)  # [E, MP]
    for i in range(1, k):
        h, d, cache = on_mesh(functools.partial(_draft_next, i=i, comm=comm, **kw), (P(),) * 5, (P(), P(), cspecs))(
            params, cache, bt, spec.capacity, h, d, pos
        )
        drafts.append(d)
    drafts = jnp.stack(drafts, axis=1)
    return tokens, num_out, logprobs, drafts, cache, prev.put(tokens, num_out, drafts)
