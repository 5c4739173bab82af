"""The step's communication hook: the collectives that a model step makes when it runs on a mesh.

The model step (`mla_jax.step`) is written once, for one device's share of the work. On one device it runs
with `LOCAL`, whose every method is the identity; on a mesh, `mla_jax.parallel.ParallelPlan.comm` gives the
`Comm` of the plan and the step runs inside `jax.shard_map` (manual SPMD, Megatron style). What each method
does on a mesh (T tokens, Td decode tokens, N_loc heads on this device, W workspace rows):

    embed            vocab-split lookup, all-reduce [T, D] over the model axes
    reduce_heads     all-reduce [T, D] over the head axes ("tp", "dcp") after o_proj
    reduce_model     all-reduce [T, D] over the model axes ("ep", "tp", "dcp") after a split MLP / MoE
    expert_rank      this device's index among the expert axes (expert parallel: which experts are local)
    dispatch_tokens  DP: all-gather the MoE input [T, D] over "dp" -> [dp*T, D], every DP rank's tokens
    combine_tokens   DP: reduce-scatter the routed experts' partial [dp*T, D] over "dp" -> this rank's [T, D]
    local_view       DCP: this rank's slot_mapping (its own tokens; the others -1) and decode seq_lens
    gather_decode_q  DCP: all-gather the absorbed q [Td, N_loc, L+R] -> [Td, dcp*N_loc, L+R]
    combine_decode   DCP: all-gather the LSEs, reduce-scatter the LSE-rescaled latents back to N_loc heads
    gather_cache     DCP: each rank gathers its rows of a context chunk, all-gathered into the one-device layout

DCP (decode context parallel) is vLLM's layout: a block table entry is a *virtual* page of G*dcp tokens; each
DCP rank holds G of them in its physical page of the same id, so block tables are identical on all ranks.
Token position p lives on rank (p // I) % dcp at local index (p // (dcp*I)) * I + p % I, with I the interleave
(default G: whole pages, vLLM's `--dcp-kv-cache-interleave-size` = block size; I = 1 is vLLM's token
interleave). The host side (allocator, scheduler, `build_metadata`) uses the virtual page size G*dcp and is
otherwise unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from mla_jax.metadata import AttentionMetadata, DecodeMetadata
from pallas_kernels.util import cdiv

DCP = "dcp"


@dataclasses.dataclass(frozen=True)
class Comm:
    """The collectives of one step (hashable: part of the jitted step's static configuration).

    `head_axes` split the attention heads, `model_axes` everything else that is split inside a DP group (vocab,
    MLP intermediate, experts), `expert_axes` the routed experts (("dp",) + model_axes under DP); `dcp` > 1
    splits the latent cache by tokens over the "dcp" axis; `dp` > 1 gives each "dp" rank its own tokens."""

    head_axes: tuple[str, ...] = ()
    model_axes: tuple[str, ...] = ()
    head_shards: int = 1
    dcp: int = 1
    dcp_interleave: int | None = None  # I in tokens; None: the page size
    dp: int = 1
    expert_axes: tuple[str, ...] | None = None  # None: the model axes

    # ---- tensor / expert parallel -----------------------------------------------------------------
    def embed(self, table: jax.Array, ids: jax.Array, vocab: int) -> jax.Array:
        """table [vocab or vocab/n, D], ids i32[T] -> [T, D]."""
        v_loc = table.shape[0]
        if v_loc == vocab:
            return table[ids]
        local = ids - jax.lax.axis_index(self.model_axes) * v_loc
        mine = (local >= 0) & (local < v_loc)
        x = jnp.where(mine[:, None], table[jnp.clip(local, 0, v_loc - 1)], jnp.zeros((), table.dtype))
        return jax.lax.psum(x, self.model_axes)  # one non-zero term per token: exact

    def reduce_heads(self, x: jax.Array) -> jax.Array:
        """Sum of the heads' partial o_proj outputs over the devices that hold them."""
        return jax.lax.psum(x, self.head_axes) if self.head_shards > 1 else x

    def reduce_model(self, x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, self.model_axes) if self.model_axes else x

    def expert_rank(self) -> jax.Array:
        axes = self.model_axes if self.expert_axes is None else self.expert_axes
        return jax.lax.axis_index(axes) if axes else jnp.int32(0)

    # ---- data-parallel attention, expert-parallel MoE ---------------------------------------------
    # The token exchange is all-gather + reduce-scatter rather than all-to-all: it is exact with static shapes
    # (nothing dropped, no capacity factor: an all-to-all of static buffers must size each destination for every
    # token of every rank routed there), it reuses the one routing code path of `layers.moe` (each device keeps the
    # copies routed to its experts), and it moves no more bytes: each rank receives (dp-1)*T rows of D in the
    # all-gather, where an all-to-all of the T*K routed copies receives about T*K*(dp-1)/dp, the same or more for
    # DeepSeek's K = 6 or 8 at dp <= 8; the reduce-scatter returns as many. Its costs are the router and the sort
    # over dp*T tokens on every device (small next to the expert GEMMs) and a [dp*T*K, D] GEMM input buffer, whose
    # rows routed elsewhere sort past the local groups (the Pallas grouped GEMM skips them, storing zeros).
    def dispatch_tokens(self, x: jax.Array) -> jax.Array:
        """MoE input x [T, D] of this DP rank -> [dp*T, D], every rank's tokens (rank-major)."""
        return jax.lax.all_gather(x, "dp", axis=0, tiled=True) if self.dp > 1 else x

    def combine_tokens(self, y: jax.Array) -> jax.Array:
        """Routed experts' partial [dp*T, D] (this device's experts, every rank's tokens) -> [T, D]: summed over
        the DP ranks' experts, this rank's rows (still a partial over the model axes when those split experts)."""
        return jax.lax.psum_scatter(y, "dp", scatter_dimension=0, tiled=True) if self.dp > 1 else y

    # ---- decode context parallel ------------------------------------------------------------------
    def local_view(self, md: AttentionMetadata, page_size: int) -> AttentionMetadata:
        """This rank's slot_mapping and decode seq_lens (built once per step; `page_size` is the physical G)."""
        if self.dcp == 1:
            return md
        interleave = self.interleave(page_size)
        rank = jax.lax.axis_index(DCP)
        decode = DecodeMetadata(md.decode.block_table, dcp_local_len(md.decode.seq_lens, self.dcp, interleave, rank))
        return dataclasses.replace(
            md, slot_mapping=dcp_local_slots(md.slot_mapping, page_size, self.dcp, interleave, rank), decode=decode
        )

    def interleave(self, page_size: int) -> int:
        i = self.dcp_interleave or page_size
        if page_size % i:
            raise ValueError(f"dcp_interleave {i} does not divide the page size {page_size}")
        return i

    def gather_decode_q(self, q: jax.Array) -> jax.Array:
        """Absorbed q [Td, N_loc, L+R] -> [Td, dcp*N_loc, L+R]: every head of the tp group, against this rank's
        tokens."""
        return jax.lax.all_gather(q, DCP, axis=1, tiled=True) if self.dcp > 1 else q

    def combine_decode(self, latent: jax.Array, lse: jax.Array) -> jax.Array:
        """Partial results over this rank's tokens, latent [..., Nt, L] and lse f32[..., Nt] -> the attention over
        all ranks' tokens for this rank's Nt/dcp heads (vLLM's DCP combine)."""
        if self.dcp == 1:
            return latent
        lses = jax.lax.all_gather(lse, DCP)  # [dcp, ..., Nt]
        m = jnp.max(lses, axis=0)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        total = jnp.sum(jnp.exp(lses - m), axis=0)  # exp(-inf) = 0: ranks without tokens weigh nothing
        w = jnp.exp(lse - m) / jnp.where(total > 0, total, 1.0)
        part = jnp.where(w[..., None] > 0, latent.astype(jnp.float32) * w[..., None], 0.0)  # no NaN from empty rows
        return jax.lax.psum_scatter(part, DCP, scatter_dimension=latent.ndim - 2, tiled=True)

    def gather_cache(
        self,
        gather: Callable[..., jax.Array],
        kv_cache: jax.Array,
        block_table: jax.Array,
        chunk_starts: jax.Array,
        cu_chunk_lens: jax.Array,
        *,
        workspace_rows: int,
        kv_scale: jax.Array | None,
        out_dtype,
    ) -> jax.Array:
        """`gather` (a backend's `gather_cache`) with the one-device contract: workspace [W, L+R] of one context
        chunk. Under DCP each rank gathers its own rows of the chunk, the shares are all-gathered over "dcp" and
        laid out as the one-device workspace (sequence s's rows at cu_chunk_lens[s]..; the order inside a
        sequence does not matter to the non-causal chunk attention). All-gathering the 576-wide latent rows
        costs less than all-gathering queries and up-projecting every head's keys on every rank."""
        kw = dict(kv_scale=kv_scale, out_dtype=out_dtype)
        if self.dcp == 1:
            return gather(kv_cache, block_table, chunk_starts, cu_chunk_lens, workspace_rows=workspace_rows, **kw)
        dcp, interleave = self.dcp, self.interleave(kv_cache.shape[1])
        rank = jax.lax.axis_index(DCP)
        sp = block_table.shape[0]
        lens = cu_chunk_lens[1:] - cu_chunk_lens[:-1]  # [Sp] rows of each sequence in this chunk
        # Chunk starts are multiples of the virtual page G*dcp, hence of dcp*I: rank r's share of [a, a+n) starts
        # at local index a // dcp and holds dcp_local_len(n, r) rows.
        ranks = jnp.arange(dcp, dtype=jnp.int32)[:, None]
        lens_all = dcp_local_len(lens[None, :], dcp, interleave, ranks)  # [dcp, Sp]
        cu_all = jnp.concatenate([jnp.zeros((dcp, 1), jnp.int32), jnp.cumsum(lens_all, axis=1)], axis=1)
        w_loc = local_workspace_rows(workspace_rows, sp, dcp, interleave)
        ws = gather(
            kv_cache, block_table, chunk_starts // dcp, cu_all[rank].astype(jnp.int32), workspace_rows=w_loc, **kw
        )  # [w_loc, L+R]
        ws_all = jax.lax.all_gather(ws, DCP, axis=0, tiled=True)  # [dcp * w_loc, L+R], rank-major
        # Row g of the one-device workspace: sequence s, k-th row of s in this chunk; take it from the rank whose
        # share of s covers k (shares of s in rank order).
        rows = jnp.arange(workspace_rows, dtype=jnp.int32)
        seq = jnp.searchsorted(cu_chunk_lens[1:], rows, side="right", method="compare_all").astype(jnp.int32)
        valid = rows < cu_chunk_lens[-1]
        seq = jnp.minimum(seq, sp - 1)
        k = rows - cu_chunk_lens[seq]
        before = jnp.concatenate([jnp.zeros((1, sp), jnp.int32), jnp.cumsum(lens_all, axis=0)], axis=0)  # [dcp+1, Sp]
        src_rank = jnp.sum(k[None, :] >= before[1:dcp, seq], axis=0).astype(jnp.int32)
        src = src_rank * w_loc + cu_all[src_rank, seq] + k - before[src_rank, seq]
        src = jnp.clip(src, 0, dcp * w_loc - 1)
        return jnp.where(valid[:, None], ws_all[src], jnp.zeros((), ws_all.dtype))


LOCAL = Comm()  # one device: no collectives


# ------------------------------------------------------------------------------------------- DCP indexing


def dcp_local_len(n: jax.Array, dcp: int, interleave: int, rank: jax.Array | int) -> jax.Array:
    """Tokens among positions [0, n) that live on DCP rank `rank` (vLLM's get_dcp_local_seq_lens)."""
    span = dcp * interleave
    return (n // span) * interleave + jnp.clip(n % span - rank * interleave, 0, interleave)


def dcp_local_slots(
    slot_mapping: jax.Array, page_size: int, dcp: int, interleave: int, rank: jax.Array | int
) -> jax.Array:
    """Global slots (virtual page of page_size*dcp rows) -> this rank's physical slots, -1 where another rank
    owns the token (or for padding)."""
    gv = page_size * dcp
    block, o = slot_mapping // gv, slot_mapping % gv
    owner = (o // interleave) % dcp
    local = block * page_size + (o // (dcp * interleave)) * interleave + o % interleave
    return jnp.where((slot_mapping >= 0) & (owner == rank), local, -1).astype(slot_mapping.dtype)


def local_workspace_rows(workspace_rows: int, num_prefills: int, dcp: int, interleave: int) -> int:
    """Rows one rank's share of a context chunk can take: a sequence's share of a chunk of n rows is at most
    ceil(n / dcp) + I, and the chunks' rows add up to at most `workspace_rows`."""
    return max(1, min(workspace_rows, cdiv(workspace_rows, dcp) + num_prefills * interleave))
