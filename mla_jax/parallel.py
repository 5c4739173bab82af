"""Multi-device serving on a `jax.sharding.Mesh`: tensor parallel heads, expert-parallel MoE, decode context
parallel (DCP), on one host or several.

Mesh axes (any subset; `make_mesh` builds ("ep", "tp", "dcp")):

    tp    attention heads, vocab, MLP intermediate, experts are split over it; the latent cache is replicated
    dcp   heads are split over it as well, and the latent cache is split by tokens (below)
    ep    experts (and vocab, MLP intermediate) only; attention is computed redundantly on its replicas

Devices = tp * dcp * ep. vLLM's `-tp T -dcp D` (D divides T, DCP ranks are TP ranks) is `tp=T/D, dcp=D` here: the
heads go over ("tp", "dcp"), T-way, the cache D-way. The param layout is `mla_jax.sharding.param_shardings`
(heads over the head axes ("tp", "dcp"), everything else that is split over the model axes ("ep", "tp",
"dcp")); `convert.load_model(DIR, mesh=plan.mesh)` restores a checkpoint straight into it.

The whole step is one `shard_map` over every mesh axis (manual SPMD, Megatron style): each device runs the usual
building blocks (`mla_project`, `forward_mqa`, `forward_mha`, ragged-dot experts) on its shard, through the same
attention backends, and the collectives are explicit. Activations between layers are replicated [T, D].
Communication (T tokens, Td decode tokens, N_loc = N / (tp*dcp) heads, W workspace rows):

    embedding     all-reduce [T, D] over the model axes (each device looks up its vocab rows, 0 elsewhere)
    attention     all-reduce [T, D] over ("tp", "dcp") after o_proj (each device's heads' partial sum)
      + DCP       all-gather absorbed q [Td, N_loc, L+R] -> [Td, dcp*N_loc, L+R] over "dcp"; all-gather the
                  LSEs [Td, dcp*N_loc]; reduce-scatter the LSE-rescaled latent outputs [Td, dcp*N_loc, L] f32
                  back to N_loc heads (vLLM's DCP combine); prefill context: all-gather each chunk's latent
                  rows [~W/dcp, L+R] over "dcp" (below)
    MLP / MoE     all-reduce [T, D] over the model axes: dense MLP and shared experts are split by the
                  intermediate dim, routed experts by expert (moe="ep") or by the intermediate dim (moe="tp");
                  routed and shared partial sums go into the one all-reduce
    lm_head       vocab-split logits; the engine step all-gathers them [num_logits, vocab] for sampling

Expert parallel token exchange: the activations entering the MoE are already replicated (the attention
all-reduce), which is the "all-gather dispatch": every device routes all T tokens (replicated router), keeps the
T*K token copies routed to its E/n experts (sorted by expert, the others moved past the ragged groups, which
`ragged_dot` leaves at 0), runs its experts and scatters the weighted rows into a [T, D] partial; the all-reduce
is the combine. No capacity factor, nothing dropped: exact, at the cost of an all-reduce rather than an
all-to-all of only the routed rows (the buffer per device is T*K rows, of which ~T*K/n are real).

DCP (decode context parallel), vLLM's layout: a block table entry is a *virtual* page of G*dcp tokens; each DCP
rank holds G of them in its physical page of the same id, so block tables are identical on all ranks. Token
position p lives on rank (p // I) % dcp at local index (p // (dcp*I)) * I + p % I, with I the interleave
(`dcp_interleave`, default G: whole pages, vLLM's `--dcp-kv-cache-interleave-size` = block size; any I dividing
G works, I = 1 is vLLM's token interleave). The global cache array is [layers, pages, G*dcp, L+R] sharded over
"dcp" on the in-page axis; with I = G it is exactly the one-device cache of page size G*dcp, cut into dcp
slices. The host side (allocator, scheduler, `build_metadata`) is unchanged: it uses the virtual page size
G*dcp. Inside the step each rank derives from the replicated metadata its local slot_mapping (its own tokens;
the others -1: cache writes go only to the owning rank), local decode seq_lens (vLLM's
`get_dcp_local_seq_lens`) and, for context chunks, local chunk starts and lengths.
  Decode: q is all-gathered over "dcp" (each rank needs all heads of its tp group against its tokens), the
decode kernel runs on the rank's share, returns latent + LSE, and the LSE combine above reduce-scatters the
exact softmax over all ranks. Prefill: new tokens attend to each other on every rank (their latents are
replicated); context chunks are gathered by each rank from its own pages (workspace of ~W/dcp rows), all-gathered
over "dcp" and reorganised into the one-device workspace layout (sequence s's rows at cu_chunk_lens[s]..; the
order inside a sequence is irrelevant to the non-causal chunk attention), then up-projected, attended and
LSE-merged exactly as on one device. All-gathering the 576-wide latent rows costs less than all-gathering
queries and up-projecting every head's keys on every rank, and keeps the one-device chunk math.

Multi-host: the same code; call `jax.distributed.initialize(...)` first (on CPU also
`jax.config.update("jax_cpu_collectives_implementation", "gloo")`), build the mesh from `jax.devices()` (all
processes' devices), and run the same host logic (scheduler, metadata) in every process: `replicate` turns the
host arrays into global replicated arrays, `to_host` reads results back.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax import attention
from mla_jax import engine as engine_lib
from mla_jax import sharding
from mla_jax.cache import KVCache, cache_dtype, check_page_size, write_kv_layer
from mla_jax.config import DeepseekConfig
from mla_jax.engine import Engine, EngineConfig, RequestOutput
from mla_jax.layers import expert_gmm, linear, mlp, rms_norm, route
from mla_jax.metadata import AttentionMetadata, DecodeMetadata
from mla_jax.mla import absorb_q, mla_project, o_proj, v_up_proj
from mla_jax.model import Params, layer_groups, lm_head_weight, split_experts
from mla_jax.sampling import SamplingArrays, SamplingParams, sample
from mla_jax.sharding import DCP, EP, TP
from mla_jax.step import mla_paged


def make_mesh(*, tp: int = 1, dcp: int = 1, ep: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("ep", "tp", "dcp") mesh over the first tp*dcp*ep of `devices` (default: all devices of all processes).

    Built with `Mesh(devices, names)` (Auto axes; `jax.make_mesh` defaults to Explicit axes, which the model's
    gathers do not support). "dcp" is innermost, so a DCP group is neighbouring devices (one host, NVLink)."""
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (("tp", tp), ("dcp", dcp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    n = tp * dcp * ep
    if n > len(devices):
        raise ValueError(f"tp={tp} x dcp={dcp} x ep={ep} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(ep, tp, dcp), (EP, TP, DCP))


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """How a model and its cache are laid out on `mesh` (hashable: a static argument of the jitted steps)."""

    mesh: Mesh
    moe: str = "ep"  # routed experts split by expert ("ep") or by their intermediate dim ("tp")
    dcp_interleave: int | None = None  # DCP interleave I in tokens (divides the page size); None: the page size

    def __post_init__(self):
        extra = [a for a in self.mesh.axis_names if a not in sharding.MODEL_AXES]
        if extra:
            raise ValueError(f"mesh axes {extra} are not supported; use {sharding.MODEL_AXES}")
        if self.moe not in sharding.MOE_MODES:
            raise ValueError(f"moe must be one of {sharding.MOE_MODES}, got {self.moe!r}")
        if self.dcp_interleave is not None and (not isinstance(self.dcp_interleave, int) or self.dcp_interleave < 1):
            raise ValueError(f"dcp_interleave must be an int >= 1 or None, got {self.dcp_interleave!r}")

    def size(self, axis: str) -> int:
        return int(self.mesh.shape.get(axis, 1))

    @property
    def tp(self) -> int:
        return self.size(TP)

    @property
    def dcp(self) -> int:
        return self.size(DCP)

    @property
    def ep(self) -> int:
        return self.size(EP)

    @property
    def num_devices(self) -> int:
        return int(self.mesh.size)

    @property
    def head_axes(self) -> tuple[str, ...]:
        return sharding.mesh_axes(self.mesh)[0]

    @property
    def model_axes(self) -> tuple[str, ...]:
        return sharding.mesh_axes(self.mesh)[1]

    @property
    def head_shards(self) -> int:
        return math.prod(self.size(a) for a in self.head_axes)

    @property
    def model_shards(self) -> int:
        return math.prod(self.size(a) for a in self.model_axes)

    def describe(self) -> str:
        return f"tp={self.tp} dcp={self.dcp} ep={self.ep} moe={self.moe} ({self.num_devices} devices)"

    # ---- params ------------------------------------------------------------------------------------
    def validate(self, cfg: DeepseekConfig) -> None:
        """Raises ValueError if the model's heads or experts do not divide over the mesh (no silent fallback:
        a replicated head set would be summed twice)."""
        N, h = cfg.num_attention_heads, self.head_shards
        if N % h:
            raise ValueError(f"{N} attention heads do not divide over tp*dcp = {h} devices")
        if cfg.n_routed_experts and self.model_shards > 1:
            m = self.model_shards
            if self.moe == "ep" and cfg.n_routed_experts % m:
                raise ValueError(f"{cfg.n_routed_experts} routed experts do not divide over {m} devices "
                                 "(expert parallel); use moe='tp' or another mesh")
            if self.moe == "tp" and cfg.moe_intermediate_size % m:
                raise ValueError(f"moe_intermediate_size {cfg.moe_intermediate_size} does not divide over {m} "
                                 "devices (moe='tp')")

    def param_shardings(self, params: Any, cfg: DeepseekConfig) -> Any:
        if not self.model_axes:  # a mesh of one axis-less device: everything replicated
            return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), params)
        return sharding.param_shardings(params, cfg, self.mesh, moe=self.moe)

    def shard_params(self, params: Params, cfg: DeepseekConfig) -> Params:
        """Place params on the mesh (a no-op for params already placed so). Works across processes when every
        process holds the same full params."""
        self.validate(cfg)
        return jax.tree.map(_put, params, self.param_shardings(params, cfg))

    # ---- cache -------------------------------------------------------------------------------------
    def cache_specs(self, fp8: bool) -> KVCache:
        """PartitionSpecs of the cache: split on the in-page axis over "dcp", otherwise replicated."""
        if self.dcp > 1:
            return KVCache(P(None, None, DCP, None), P(None, None, DCP) if fp8 else None)
        return KVCache(P(), P() if fp8 else None)

    def init_cache(self, cfg: DeepseekConfig, num_pages: int, page_size: int, *, dtype: Any = "bf16",
                   fill: float = 0.0) -> KVCache:
        """The stacked cache, created directly in its sharding (never whole on one device).

        `page_size` is the physical page G of each device; the global page axis holds G*dcp rows, the virtual
        page the block tables (and `build_metadata(page_size=G*dcp)`) use."""
        check_page_size(page_size, allow_any_page_size=True)
        d = cache_dtype(dtype)
        fp8 = d == jnp.dtype(jnp.float8_e4m3fn)
        shape = (cfg.num_hidden_layers, num_pages, page_size * self.dcp, cfg.cache_row_dim)
        specs = self.cache_specs(fp8)
        out = KVCache(NamedSharding(self.mesh, specs.kv_c_and_k_pe_cache),
                      NamedSharding(self.mesh, specs.kv_scale) if fp8 else None)

        def make():
            return KVCache(jnp.full(shape, fill, d), jnp.ones(shape[:3], jnp.float32) if fp8 else None)

        return jax.jit(make, out_shardings=out)()

    # ---- host <-> mesh -----------------------------------------------------------------------------
    def replicate(self, tree: Any) -> Any:
        """Host arrays (numpy metadata, sampling arrays) -> global arrays replicated on every device."""
        return jax.device_put(tree, NamedSharding(self.mesh, P()))


def _put(x: Any, s: NamedSharding) -> jax.Array:
    if isinstance(x, jax.Array) and x.sharding == s:
        return x
    if not s.is_fully_addressable and isinstance(x, jax.Array) and x.is_fully_addressable:
        x = np.asarray(x)  # a process-local copy -> this process's shards of the global array
    return jax.device_put(x, s)


def to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) global array as a numpy array in every process."""
    if x.is_fully_addressable:
        return np.asarray(x)
    if x.sharding.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ---------------------------------------------------------------------------------------------- DCP indexing


def dcp_local_len(n: jax.Array, dcp: int, interleave: int, rank: jax.Array | int) -> jax.Array:
    """Tokens among positions [0, n) that live on DCP rank `rank` (vLLM's get_dcp_local_seq_lens)."""
    span = dcp * interleave
    return (n // span) * interleave + jnp.clip(n % span - rank * interleave, 0, interleave)


def dcp_local_slots(slot_mapping: jax.Array, page_size: int, dcp: int, interleave: int, rank: jax.Array | int
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
    return max(1, min(workspace_rows, -(-workspace_rows // dcp) + num_prefills * interleave))


def _dcp_gather(gather: Any, dcp: int, interleave: int, rank: jax.Array) -> Any:
    """A `gather_cache` with the one-device contract over the DCP-split cache: each rank gathers its own rows of
    the chunk, the shares are all-gathered over "dcp" and laid out as the one-device workspace."""

    def dcp_gather(kv_cache, block_table, chunk_starts, cu_chunk_lens, *, workspace_rows, kv_scale=None,
                   out_dtype=jnp.bfloat16):
        sp = block_table.shape[0]
        lens = cu_chunk_lens[1:] - cu_chunk_lens[:-1]  # [Sp] rows of each sequence in this chunk
        # Chunk starts are multiples of the virtual page G*dcp, hence of dcp*I: rank r's share of [a, a+n) starts
        # at local index a // dcp and holds dcp_local_len(n, r) rows.
        ranks = jnp.arange(dcp, dtype=jnp.int32)[:, None]
        lens_all = dcp_local_len(lens[None, :], dcp, interleave, ranks)  # [dcp, Sp]
        cu_all = jnp.concatenate([jnp.zeros((dcp, 1), jnp.int32), jnp.cumsum(lens_all, axis=1)], axis=1)
        w_loc = local_workspace_rows(workspace_rows, sp, dcp, interleave)
        ws = gather(kv_cache, block_table, chunk_starts // dcp, cu_all[rank].astype(jnp.int32),
                    workspace_rows=w_loc, kv_scale=kv_scale, out_dtype=out_dtype)  # [w_loc, L+R]
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

    return dcp_gather


def _dcp_combine(latent: jax.Array, lse: jax.Array) -> jax.Array:
    """Partial decode results of this rank's tokens for all heads of its tp group, latent [..., Nt, L] and
    lse f32[..., Nt] -> the exact attention over all ranks' tokens for this rank's Nt/dcp heads, f32."""
    lses = jax.lax.all_gather(lse, DCP)  # [dcp, ..., Nt]
    m = jnp.max(lses, axis=0)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(lses - m), axis=0)  # exp(-inf) = 0: ranks without tokens weigh nothing
    w = jnp.exp(lse - m) / jnp.where(total > 0, total, 1.0)
    part = jnp.where(w[..., None] > 0, latent.astype(jnp.float32) * w[..., None], 0.0)  # no NaN from empty rows
    return jax.lax.psum_scatter(part, DCP, scatter_dimension=latent.ndim - 2, tiled=True)


@dataclasses.dataclass(frozen=True)
class _DcpStep:
    """This rank's view of the step's metadata (built once per step, used by every layer)."""

    slot_mapping: jax.Array
    decode: DecodeMetadata
    backend: attention.Backend  # the step's backend with the DCP context gather


def _mla_paged_dcp(p: dict, cfg: DeepseekConfig, x: jax.Array, md: AttentionMetadata, cache: KVCache,
                   layer: jax.Array, be: attention.Backend, d: _DcpStep) -> tuple[jax.Array, KVCache]:
    """`step.mla_paged` over the DCP-split cache; cfg has this device's N_loc heads. x [T, D] -> partial [T, D]."""
    s = md.shape
    N, L, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    q, kv_c_normed, k_pe = mla_project(p, cfg, x, md.positions)
    cache = write_kv_layer(cache, layer, kv_c_normed, k_pe, d.slot_mapping)  # own tokens only
    kv_flat, scale_flat, offset = cache.flat_layers(layer)
    outs = []
    Td = s.num_decode_tokens
    if Td:
        q_mqa = absorb_q(p, cfg, q[:Td]).astype(x.dtype)  # [Td, N, L+R]
        q_grp = jax.lax.all_gather(q_mqa, DCP, axis=1, tiled=True)  # [Td, dcp*N, L+R]: the tp group's heads
        q_grp = q_grp.reshape(s.num_decodes, s.decode_query_len, -1, L + R)
        latent, lse = attention.forward_mqa(be, q_grp, kv_flat, scale_flat, d.decode, offset,
                                            scale=cfg.softmax_scale, kv_lora_rank=L)  # [Bd, Q, dcp*N, L]
        latent = _dcp_combine(latent, lse)  # [Bd, Q, N, L]
        outs.append(v_up_proj(p, latent.reshape(Td, N, L)))
    if s.num_prefill_tokens:
        outs.append(attention.forward_mha(
            d.backend, p, cfg, q[Td:], kv_c_normed[Td:], k_pe[Td:], kv_flat, scale_flat, md.prefill, offset,
            workspace_rows=s.workspace_rows, max_chunks=s.max_chunks))
    attn = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return o_proj(p, attn.astype(x.dtype)), cache


# ------------------------------------------------------------------------------------------- other layers


def _psum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    return jax.lax.psum(x, axes) if axes else x


def _embed(table: jax.Array, ids: jax.Array, vocab: int, axes: tuple[str, ...]) -> jax.Array:
    v_loc = table.shape[0]
    if v_loc == vocab:
        return table[ids]
    local = ids - jax.lax.axis_index(axes) * v_loc
    mine = (local >= 0) & (local < v_loc)
    x = jnp.where(mine[:, None], table[jnp.clip(local, 0, v_loc - 1)], jnp.zeros((), table.dtype))
    return jax.lax.psum(x, axes)  # one non-zero term per token: exact


def _mlp(p: dict, x: jax.Array, inter: int, axes: tuple[str, ...]) -> jax.Array:
    y = mlp(p, x)
    return y if p["gate_proj"]["weight"].shape[0] == inter else jax.lax.psum(y, axes)


def _moe(p: dict, cfg: DeepseekConfig, x: jax.Array, axes: tuple[str, ...], gmm_impl: str,
         experts: dict | None = None, layer: jax.Array | None = None) -> jax.Array:
    """`layers.moe` on this device's experts (moe="ep": E/n whole experts; "tp": every expert's I/n slice).
    x [T, D] replicated -> [T, D] replicated, through one all-reduce of the routed + shared partial sums.
    `experts`, `layer`: the group's stacked experts [layers, E_loc, out, in] and the layer within the group
    (`model.split_experts`), in place of p["experts"]."""
    T, D = x.shape
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    weights, ids = route(p["gate"], cfg, x)  # [T, K], replicated
    ex, layer = (p["experts"], None) if experts is None else (experts, layer)  # layer indexes stacked ones
    e_loc, i_loc = ex["gate_proj"]["weight"].shape[-3:-1]
    flat = ids.reshape(-1)  # [T*K]
    if e_loc != E:  # expert parallel: keep the copies routed to experts [e0, e0 + e_loc)
        local = flat - jax.lax.axis_index(axes) * e_loc
        mine = (local >= 0) & (local < e_loc)
        key = jnp.where(mine, local, e_loc)  # other devices' copies sort last, past every group
    else:
        mine, key = jnp.ones_like(flat, bool), flat
    order = jnp.argsort(key, stable=True)
    token = order // K
    group_sizes = jnp.bincount(key, length=e_loc).astype(jnp.int32)  # key == e_loc is dropped
    xs = x[token]  # [T*K, D]

    def gmm(lhs, w):  # rows past the groups (other devices' copies) come out 0
        return expert_gmm(lhs, w, group_sizes, gmm_impl, layer)

    h = jax.nn.silu(gmm(xs, ex["gate_proj"]["weight"])) * gmm(xs, ex["up_proj"]["weight"])  # [T*K, I_loc]
    y = gmm(h, ex["down_proj"]["weight"])  # [T*K, D]; rows past the groups are 0
    w_sorted = jnp.where(mine[order], weights.reshape(-1)[order], 0.0).astype(y.dtype)
    routed = jnp.zeros((T, D), y.dtype).at[token].add(y * w_sorted[:, None])
    split, full = [], []
    (split if (e_loc != E or i_loc != cfg.moe_intermediate_size) else full).append(routed)
    if cfg.n_shared_experts:
        sh = mlp(p["shared_experts"], x)
        shared_inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        (split if p["shared_experts"]["gate_proj"]["weight"].shape[0] != shared_inter else full).append(
            sh.astype(y.dtype))
    out = sum(full, jnp.zeros((T, D), y.dtype))
    if split:
        out = out + jax.lax.psum(sum(split[1:], split[0]), axes)
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------- step


def _local_step(params: Params, cache: KVCache, md: AttentionMetadata, *, cfg: DeepseekConfig,
                plan: ParallelPlan, backend: str, batch_invariant: bool, gmm_impl: str
                ) -> tuple[jax.Array, KVCache]:
    """`step.forward_step` on one device's shards (inside shard_map)."""
    be = attention.get_backend(backend, batch_invariant=batch_invariant)
    model = params["model"]
    head_axes, model_axes = plan.head_axes, plan.model_axes
    n_loc = cfg.num_attention_heads // plan.head_shards
    cfg_loc = dataclasses.replace(cfg, num_attention_heads=n_loc)
    dcp = plan.dcp
    dstep = None
    if dcp > 1:
        G = cache.page_size  # physical rows per page on this device
        I = plan.dcp_interleave or G
        if G % I:
            raise ValueError(f"dcp_interleave {I} does not divide the page size {G}")
        rank = jax.lax.axis_index(DCP)
        dstep = _DcpStep(dcp_local_slots(md.slot_mapping, G, dcp, I, rank),
                         DecodeMetadata(md.decode.block_table, dcp_local_len(md.decode.seq_lens, dcp, I, rank)),
                         dataclasses.replace(be, gather_cache=_dcp_gather(be.gather_cache, dcp, I, rank)))
    eps = cfg.rms_norm_eps
    x = _embed(model["embed_tokens"]["weight"], md.input_ids, cfg.vocab_size, model_axes)  # [T, D]
    for name, start, n in layer_groups(cfg):
        is_moe = name == "moe_layers"
        scanned, experts = split_experts(model[name], is_moe, gmm_impl)

        def body(carry, p, is_moe=is_moe, start=start, experts=experts):
            h, cache, layer = carry  # layer: the model's layer index (the cache's); layer - start: the group's
            hn = rms_norm(p["input_layernorm"], h, eps)
            if dstep is None:
                a, cache = mla_paged(p["self_attn"], cfg_loc, hn, md, cache, layer, be)
            else:
                a, cache = _mla_paged_dcp(p["self_attn"], cfg_loc, hn, md, cache, layer, be, dstep)
            if n_loc != cfg.num_attention_heads:
                a = jax.lax.psum(a, head_axes)
            h = h + a
            hn = rms_norm(p["post_attention_layernorm"], h, eps)
            h = h + (_moe(p["mlp"], cfg, hn, model_axes, gmm_impl, experts, layer - start) if is_moe else
                     _mlp(p["mlp"], hn, cfg.intermediate_size, model_axes))
            return (h, cache, layer + 1), None

        (x, cache, _), _ = jax.lax.scan(body, (x, cache, jnp.int32(start)), scanned)
    x = rms_norm(model["norm"], x[md.logits_indices], eps)
    logits = linear({"weight": lm_head_weight(params)}, x).astype(jnp.float32)  # [num_logits, vocab/n]
    return logits, cache


def forward_step(params: Params, cfg: DeepseekConfig, cache: KVCache, md: AttentionMetadata, *,
                 plan: ParallelPlan, backend: str = "xla", batch_invariant: bool = False,
                 gmm_impl: str = "ragged_dot") -> tuple[jax.Array, KVCache]:
    """`mla_jax.step.forward_step` on the mesh: (logits f32[num_logits, vocab] split by vocab, updated cache).

    `md` is the replicated one-device metadata built with the virtual page size (page_size * dcp). `gmm_impl`:
    the experts' grouped matmul ("ragged_dot", or "pallas" for `mla_jax.layers.expert_gmm`'s kernel)."""
    plan.validate(cfg)
    if cache.num_layers != cfg.num_hidden_layers:
        raise ValueError(f"cache has {cache.num_layers} layers, the model {cfg.num_hidden_layers}")
    if cache.width != cfg.cache_row_dim:
        raise ValueError(f"cache rows are {cache.width} wide, the model needs L+R = {cfg.cache_row_dim}")
    if cache.page_size % plan.dcp:
        raise ValueError(f"cache page axis {cache.page_size} is not a multiple of dcp={plan.dcp}")
    pspecs = jax.tree.map(lambda s: s.spec, plan.param_shardings(params, cfg))
    cspecs = plan.cache_specs(cache.is_fp8)
    lm_spec = lm_head_weight(pspecs)
    logits_spec = P(None, lm_spec[0] if len(lm_spec) else None)
    f = functools.partial(_local_step, cfg=cfg, plan=plan, backend=backend, batch_invariant=batch_invariant,
                          gmm_impl=gmm_impl)
    return jax.shard_map(f, mesh=plan.mesh, in_specs=(pspecs, cspecs, P()), out_specs=(logits_spec, cspecs),
                         check_vma=False)(params, cache, md)  # Pallas calls carry no varying-axes types


STATIC_ARGNAMES = ("cfg", "plan", "backend", "batch_invariant", "gmm_impl")


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES, donate_argnames=("cache",))
def jit_step(params: Params, cfg: DeepseekConfig, cache: KVCache, md: AttentionMetadata, *, plan: ParallelPlan,
             backend: str = "xla", batch_invariant: bool = False, gmm_impl: str = "ragged_dot"
             ) -> tuple[jax.Array, KVCache]:
    """`forward_step` compiled once per (config, plan, backend, BatchShape); the cache is donated."""
    return forward_step(params, cfg, cache, md, plan=plan, backend=backend, batch_invariant=batch_invariant,
                        gmm_impl=gmm_impl)


@functools.partial(jax.jit, static_argnames=STATIC_ARGNAMES, donate_argnames=("cache",))
def engine_step(params: Params, cfg: DeepseekConfig, cache: KVCache, md: AttentionMetadata, sampling: SamplingArrays,
                *, plan: ParallelPlan, backend: str, batch_invariant: bool, gmm_impl: str = "ragged_dot"
                ) -> tuple[jax.Array, jax.Array, KVCache]:
    """`mla_jax.engine.engine_step` on the mesh: the logits are all-gathered and sampled on every device."""
    logits, cache = forward_step(params, cfg, cache, md, plan=plan, backend=backend, batch_invariant=batch_invariant,
                                 gmm_impl=gmm_impl)
    rep = NamedSharding(plan.mesh, P())
    tokens, logprobs = sample(jax.lax.with_sharding_constraint(logits, rep), sampling)
    return jax.lax.with_sharding_constraint(tokens, rep), jax.lax.with_sharding_constraint(logprobs, rep), cache


class ParallelEngine(Engine):
    """The engine on a mesh. `config.page_size` is the physical page G of each device; under DCP the scheduler,
    allocator and metadata work in virtual pages of G*dcp tokens (so `config.num_pages`, if given, counts those,
    and each device holds num_pages * G rows per layer). In a multi-process run every process drives an engine
    with the same requests: host-side decisions are deterministic, so they stay in step."""

    def __init__(self, params: Params, cfg: DeepseekConfig, config: EngineConfig = EngineConfig(), *,
                 plan: ParallelPlan):
        self.plan = plan
        super().__init__(plan.shard_params(params, cfg), cfg,
                         dataclasses.replace(config, page_size=config.page_size * plan.dcp))

    def _init_cache(self) -> KVCache:
        c = self.config
        return self.plan.init_cache(self.cfg, c.num_pages, c.page_size // self.plan.dcp, dtype=c.cache_dtype)

    def _run(self, md: AttentionMetadata, sampling: SamplingArrays):
        tokens, logprobs, self.cache = engine_step(self.params, self.cfg, self.cache, self.plan.replicate(md),
                                                   self.plan.replicate(sampling), plan=self.plan,
                                                   backend=self.config.backend,
                                                   batch_invariant=self.config.batch_invariant,
                                                   gmm_impl=getattr(self.config, "gmm_impl", "ragged_dot"))
        return to_host(tokens), to_host(logprobs)


def generate(params: Params, cfg: DeepseekConfig, prompts: Iterable[Sequence[int]],
             sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
             config: EngineConfig | None = None, *, plan: ParallelPlan) -> list[RequestOutput]:
    """`mla_jax.engine.generate` on the mesh of `plan`."""
    return engine_lib.generate(params, cfg, prompts, sampling, config,
                               make_engine=functools.partial(ParallelEngine, plan=plan))
