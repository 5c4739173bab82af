"""Batch metadata for one model step: the decode/prefill split, padded to static shapes.

vLLM's ordering: decode rows first, then prefill tokens. A request whose query length is at most
`reorder_batch_threshold` is a *decode* (the absorbed MQA path over the latent cache, `forward_mqa`), so short
extends, e.g. speculative-decoding verification blocks, count as decodes; longer ones are *prefills* (the
compute-friendly MHA path, `forward_mha`, with chunked context).

Decode rows are laid out as a uniform [Bd, Q] block (Q = the longest decode query, padded): token t of decode
request b is row b*Q + t, at position context + t. Multi-token rows are causal through per-row seq_lens (row t
sees context + t + 1 tokens) or, with `causal=False`, all rows see the same context + q_len tokens. Padding rows
have seq_len 0 and slot -1 (write nowhere).

Everything here is host-side numpy; `AttentionMetadata.to_device()` gives the jit-able pytree whose static
fields (the `BatchShape`) select the compiled step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mla_jax.chunking import plan_context_chunks
from pallas_kernels.util import cdiv


@dataclasses.dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, as the scheduler hands it over."""

    token_ids: Sequence[int]  # the new tokens of this step (>= 1)
    num_computed_tokens: int  # context: tokens of this request already in the cache
    block_ids: Sequence[int]  # the request's pages, covering num_computed_tokens + len(token_ids)


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """Static, padded sizes of a step: one compiled step function per distinct value."""

    num_decodes: int = 0  # Bd: decode requests (padded)
    decode_query_len: int = 1  # Q: query tokens per decode request
    num_prefills: int = 0  # Sp: prefill requests (padded)
    num_prefill_tokens: int = 0  # Tp: prefill tokens (padded)
    max_pages: int = 1  # block table width
    workspace_rows: int = 0  # W: context-chunk workspace rows (0: no prefill has context)
    max_chunks: int = 0  # C: context chunks (padded)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes * self.decode_query_len

    @property
    def num_tokens(self) -> int:
        return self.num_decode_tokens + self.num_prefill_tokens

    @property
    def num_logits(self) -> int:
        """Rows the step returns logits for: every decode token (verification needs them all) and the last
        token of each prefill."""
        return self.num_decode_tokens + self.num_prefills


def _static(**kw):
    return dataclasses.field(metadata=dict(static=True), **kw)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeMetadata:
    block_table: jax.Array  # i32[Bd, max_pages]
    seq_lens: jax.Array  # i32[Bd, Q]: cache tokens each decode row attends to (0 = padding row)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillMetadata:
    query_start_loc: jax.Array  # i32[Sp+1], within the prefill segment
    context_lens: jax.Array  # i32[Sp]: tokens already in the cache before this step
    block_table: jax.Array  # i32[Sp, max_pages]
    chunk_starts: jax.Array  # i32[C, Sp]: first context position of each chunk (page-aligned)
    cu_chunk_lens: jax.Array  # i32[C, Sp+1]: workspace rows of each sequence in each chunk
    num_chunks: jax.Array  # i32[]: real chunks (<= C)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    input_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]: page*G + offset, -1 = padding (written nowhere)
    logits_indices: jax.Array  # i32[num_logits]: token rows whose logits the step returns
    decode: DecodeMetadata
    prefill: PrefillMetadata
    shape: BatchShape = _static()

    def to_device(self) -> "AttentionMetadata":
        return jax.tree.map(jnp.asarray, self)


class MetadataError(ValueError):
    """Inconsistent batch metadata; the message names the field."""


def _bucket(n: int, buckets: Sequence[int] | None) -> int:
    if buckets is None:
        return n
    for b in sorted(buckets):
        if b >= n:
            return b
    raise MetadataError(f"{n} exceeds the largest bucket {max(buckets)}")


def split_decodes_and_prefills(
    query_lens: Sequence[int], reorder_batch_threshold: int = 1
) -> tuple[list[int], list[int]]:
    """Indices of decode requests (query_len <= threshold) and of prefills, each in arrival order."""
    dec = [i for i, q in enumerate(query_lens) if q <= reorder_batch_threshold]
    pre = [i for i, q in enumerate(query_lens) if q > reorder_batch_threshold]
    return dec, pre


def build_metadata(
    requests: Sequence[ScheduledRequest],
    *,
    page_size: int,
    num_pages: int,
    reorder_batch_threshold: int = 1,
    causal: bool = True,
    workspace_rows: int = 0,
    shape: BatchShape | None = None,
    decode_buckets: Sequence[int] | None = None,
    token_buckets: Sequence[int] | None = None,
    pad_page: int = 0,
    is_decode: Sequence[bool] | None = None,
) -> tuple[AttentionMetadata, list[int]]:
    """Builds the step's padded metadata (numpy) and the request order used (decodes first, then prefills).

    `shape` fixes every static size (it must be large enough); otherwise sizes are the exact need, rounded up
    to `decode_buckets` (decode requests) and `token_buckets` (prefill tokens) when given. `workspace_rows`
    (W) enables chunked context for prefills with a context; required when one has. `is_decode` classifies
    each request explicitly instead of by `reorder_batch_threshold` (speculative decoding: a decode is the last
    token plus drafts, a prefill chunk stays a prefill however short).
    """
    if not requests:
        raise MetadataError("empty batch")
    qlens = []
    for i, r in enumerate(requests):
        n = len(r.token_ids)
        if n < 1:
            raise MetadataError(f"request {i}: token_ids is empty")
        if r.num_computed_tokens < 0:
            raise MetadataError(f"request {i}: num_computed_tokens {r.num_computed_tokens} < 0")
        total = r.num_computed_tokens + n
        if total > len(r.block_ids) * page_size:
            raise MetadataError(
                f"request {i}: seq_len {total} is past its block table "
                f"({len(r.block_ids)} pages of {page_size} = {len(r.block_ids) * page_size} tokens)"
            )
        bad = [b for b in r.block_ids if not 0 <= b < num_pages]
        if bad:
            raise MetadataError(f"request {i}: block id {bad[0]} out of range [0, {num_pages})")
        qlens.append(n)
    if is_decode is None:
        dec, pre = split_decodes_and_prefills(qlens, reorder_batch_threshold)
    else:
        if len(is_decode) != len(requests):
            raise MetadataError(f"is_decode has {len(is_decode)} entries for {len(requests)} requests")
        dec = [i for i, d in enumerate(is_decode) if d]
        pre = [i for i, d in enumerate(is_decode) if not d]
    order = dec + pre
    need = BatchShape(
        num_decodes=len(dec),
        decode_query_len=max([qlens[i] for i in dec], default=1),
        num_prefills=len(pre),
        num_prefill_tokens=sum(qlens[i] for i in pre),
        max_pages=max(cdiv(requests[i].num_computed_tokens + qlens[i], page_size) for i in order),
    )
    ctx = [requests[i].num_computed_tokens for i in pre]
    if any(ctx) and workspace_rows <= 0:
        raise MetadataError("a prefill has context but workspace_rows is 0 (chunked context disabled)")
    plan = plan_context_chunks(ctx, workspace_rows, page_size) if any(ctx) else None
    if shape is None:
        shape = dataclasses.replace(
            need,
            num_decodes=_bucket(need.num_decodes, decode_buckets) if need.num_decodes else 0,
            num_prefill_tokens=_bucket(need.num_prefill_tokens, token_buckets) if need.num_prefills else 0,
            workspace_rows=workspace_rows if plan else 0,
            max_chunks=plan.num_chunks if plan else 0,
        )
    else:
        for f in ("num_decodes", "decode_query_len", "num_prefills", "num_prefill_tokens", "max_pages"):
            if getattr(need, f) > getattr(shape, f):
                raise MetadataError(f"batch needs {f}={getattr(need, f)} but the static shape has {getattr(shape, f)}")
        if plan is not None:
            if shape.workspace_rows != workspace_rows:
                raise MetadataError(
                    f"workspace_rows {workspace_rows} differs from the static shape's {shape.workspace_rows}"
                )
            if plan.num_chunks > shape.max_chunks:
                raise MetadataError(
                    f"context needs {plan.num_chunks} chunks but the static shape has max_chunks={shape.max_chunks}"
                )
    Bd, Q, Sp, MP = shape.num_decodes, shape.decode_query_len, shape.num_prefills, shape.max_pages
    Td, T = shape.num_decode_tokens, shape.num_tokens
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, -1, np.int32)
    logits_indices = np.zeros(shape.num_logits, np.int32)

    def table(reqs):
        bt = np.full((len(reqs), MP), pad_page, np.int32)
        for row, i in enumerate(reqs):
            bt[row, : len(requests[i].block_ids)] = requests[i].block_ids[:MP]
        return bt

    def place(i, start):
        r = requests[i]
        n = len(r.token_ids)
        pos = r.num_computed_tokens + np.arange(n)
        input_ids[start : start + n] = r.token_ids
        positions[start : start + n] = pos
        blocks = np.asarray(r.block_ids, np.int64)
        slot_mapping[start : start + n] = blocks[pos // page_size] * page_size + pos % page_size

    # Decode block [Bd, Q].
    dec_bt = np.full((Bd, MP), pad_page, np.int32)
    dec_bt[: len(dec)] = table(dec)
    dec_seq = np.zeros((Bd, Q), np.int32)
    for b, i in enumerate(dec):
        r, n = requests[i], qlens[i]
        place(i, b * Q)
        if causal:
            dec_seq[b, :n] = r.num_computed_tokens + np.arange(1, n + 1)
        else:
            dec_seq[b, :n] = r.num_computed_tokens + n
        logits_indices[b * Q : b * Q + n] = b * Q + np.arange(n)
    # Prefill segment.
    qsl = np.zeros(Sp + 1, np.int32)
    for s, i in enumerate(pre):
        qsl[s + 1] = qsl[s] + qlens[i]
        place(i, Td + qsl[s])
        logits_indices[Td + s] = Td + qsl[s + 1] - 1
    qsl[len(pre) + 1 :] = qsl[len(pre)]
    pre_bt = np.full((Sp, MP), pad_page, np.int32)
    pre_bt[: len(pre)] = table(pre)
    ctx_lens = np.zeros(Sp, np.int32)
    ctx_lens[: len(pre)] = ctx
    C = shape.max_chunks
    chunk_starts = np.zeros((C, Sp), np.int32)
    cu_chunk = np.zeros((C, Sp + 1), np.int32)
    num_chunks = 0
    if plan is not None:
        p = plan.pad_to(C)
        chunk_starts[:, : len(pre)] = p.chunk_starts
        cu_chunk[:, : len(pre) + 1] = p.cu_chunk_lens
        cu_chunk[:, len(pre) + 1 :] = p.cu_chunk_lens[:, -1:]
        num_chunks = plan.num_chunks
    md = AttentionMetadata(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        logits_indices=logits_indices,
        decode=DecodeMetadata(block_table=dec_bt, seq_lens=dec_seq),
        prefill=PrefillMetadata(
            query_start_loc=qsl,
            context_lens=ctx_lens,
            block_table=pre_bt,
            chunk_starts=chunk_starts,
            cu_chunk_lens=cu_chunk,
            num_chunks=np.asarray(num_chunks, np.int32),
        ),
        shape=shape,
    )
    validate_metadata(md, num_pages=num_pages, page_size=page_size)
    return md, order


def validate_metadata(md: AttentionMetadata, *, num_pages: int, page_size: int) -> None:
    """Host-side checks of (numpy or device) metadata: dtypes, shapes, slots and seq_lens in range."""
    s = md.shape
    expect = {
        "input_ids": (md.input_ids, (s.num_tokens,)),
        "positions": (md.positions, (s.num_tokens,)),
        "slot_mapping": (md.slot_mapping, (s.num_tokens,)),
        "logits_indices": (md.logits_indices, (s.num_logits,)),
        "decode.block_table": (md.decode.block_table, (s.num_decodes, s.max_pages)),
        "decode.seq_lens": (md.decode.seq_lens, (s.num_decodes, s.decode_query_len)),
        "prefill.query_start_loc": (md.prefill.query_start_loc, (s.num_prefills + 1,)),
        "prefill.context_lens": (md.prefill.context_lens, (s.num_prefills,)),
        "prefill.block_table": (md.prefill.block_table, (s.num_prefills, s.max_pages)),
        "prefill.chunk_starts": (md.prefill.chunk_starts, (s.max_chunks, s.num_prefills)),
        "prefill.cu_chunk_lens": (md.prefill.cu_chunk_lens, (s.max_chunks, s.num_prefills + 1)),
        "prefill.num_chunks": (md.prefill.num_chunks, ()),
    }
    for name, (a, shp) in expect.items():
        if np.dtype(a.dtype) != np.int32:
            raise MetadataError(f"{name} must be int32, got {a.dtype}")
        if tuple(a.shape) != shp:
            raise MetadataError(f"{name} has shape {tuple(a.shape)}, expected {shp}")
    slots = np.asarray(md.slot_mapping)
    bad = slots[(slots < -1) | (slots >= num_pages * page_size)]
    if bad.size:
        raise MetadataError(f"slot_mapping entry {int(bad[0])} out of range [-1, {num_pages * page_size})")
    for name, bt in (("decode.block_table", md.decode.block_table), ("prefill.block_table", md.prefill.block_table)):
        bt = np.asarray(bt)
        if bt.size and (bt.min() < 0 or bt.max() >= num_pages):
            raise MetadataError(f"{name} holds page ids outside [0, {num_pages})")
    cap = s.max_pages * page_size
    seq = np.asarray(md.decode.seq_lens)
    if seq.size and (seq.min() < 0 or seq.max() > cap):
        raise MetadataError(
            f"decode.seq_lens up to {int(seq.max())} is past the block table "
            f"({s.max_pages} pages of {page_size} = {cap} tokens)"
        )
    qsl = np.asarray(md.prefill.query_start_loc)
    if np.any(np.diff(qsl) < 0) or (qsl.size and qsl[-1] > s.num_prefill_tokens):
        raise MetadataError("prefill.query_start_loc must be non-decreasing and within the prefill tokens")
    ctx = np.asarray(md.prefill.context_lens)
    if ctx.size and (ctx.min() < 0 or (ctx + np.diff(qsl)).max() > cap):
        raise MetadataError(f"prefill context_lens + query lens exceed the block table ({cap} tokens)")
    if s.max_chunks and s.workspace_rows <= 0:
        raise MetadataError("max_chunks > 0 needs workspace_rows > 0")
    cu = np.asarray(md.prefill.cu_chunk_lens)
    if cu.size and cu[:, -1].max() > s.workspace_rows:
        raise MetadataError(f"a context chunk holds {int(cu[:, -1].max())} rows > workspace_rows {s.workspace_rows}")


def empty_metadata(shape: BatchShape) -> AttentionMetadata:
    """A step of padding rows only (slot -1, seq_len 0): writes nothing, reads nothing. Compiles a shape
    (`Engine.warmup`), and is the share of a DP rank with no requests in a step."""
    z = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    return AttentionMetadata(
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
