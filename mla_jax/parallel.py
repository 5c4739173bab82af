"""Multi-device serving on a `jax.sharding.Mesh`: data-parallel attention, tensor parallel heads, expert-parallel
MoE, decode context parallel (DCP), on one host or several.

Mesh axes (any subset; `make_mesh` builds ("dp", "ep", "tp", "dcp")):

    dp    data-parallel attention: each DP rank serves its own requests from its own page pool (the cache's page
          axis is split over it), with its own block tables; only the routed experts are split over it (with the
          model axes: expert parallel over every device), the rest is replicated over it
    tp    attention heads, vocab, MLP intermediate, experts are split over it; the latent cache is replicated
    dcp   heads are split over it as well, and the latent cache is split by tokens (`mla_jax.comm`)
    ep    experts (and vocab, MLP intermediate) only; attention is computed redundantly on its replicas

Devices = dp * tp * dcp * ep; a DP group is the tp * dcp * ep devices of one DP rank. vLLM's `-tp T -dcp D` (D
divides T, DCP ranks are TP ranks) is `tp=T/D, dcp=D` here: the heads go over ("tp", "dcp"), T-way, the cache
D-way; vLLM's `-dp D --enable-expert-parallel` is `dp=D`. The param layout is `mla_jax.sharding.param_shardings`
(heads over the head axes ("tp", "dcp"), routed experts over ("dp",) + the model axes, everything else that is
split over the model axes ("ep", "tp", "dcp")); `load_model(DIR, mesh=plan.mesh)` restores a checkpoint straight
into it.

A `ParallelPlan` is everything the one model step needs to run on the mesh: `mla_jax.step.forward_step(...,
plan=plan)` runs the same step function inside one `shard_map` over every mesh axis, with the plan's `Comm`
(`mla_jax.comm`: the collectives, explicit) in place of the one-device identity; `Engine(..., plan=plan)` and
`generate(..., plan=plan)` drive it. Activations between layers are replicated [T, D]. Per layer: one
all-reduce [T, D] after attention (over the head axes) and one after the MLP/MoE (over the model axes); DCP adds
the all-gather of the decode q and the LSE combine; lm_head gives vocab-split logits, all-gathered for sampling.

Data parallel (MLA has one KV head, so TP replicates the whole latent cache on every GPU; DP does not): the step's
metadata has a leading [dp] axis, one per-rank `AttentionMetadata` of the same static `BatchShape` each
(`stack_metadata`; a rank with nothing to do gets `metadata.empty_metadata`: it writes and reads nothing, and
still takes part in every MoE collective), sharded over "dp"; the logits come out [dp * num_logits, vocab],
rank-major. The MoE dispatches every rank's tokens to the experts' ranks and back (`Comm.dispatch_tokens`,
`Comm.combine_tokens`: an all-gather and a reduce-scatter over "dp"). The host side keeps one page pool and
scheduler per rank (`mla_jax.scheduler.DPScheduler`).

Expert parallel token exchange: the activations entering the MoE are already replicated (the attention
all-reduce), which is the "all-gather dispatch": every device routes all T tokens (replicated router), keeps the
T*K token copies routed to its E/n experts and scatters the weighted rows into a [T, D] partial; the all-reduce
is the combine. No capacity factor, nothing dropped: exact, at the cost of an all-reduce rather than an
all-to-all of only the routed rows.

DCP: the global cache array is [layers, pages, G*dcp, L+R] sharded over "dcp" on the in-page axis; with the
interleave I = G it is exactly the one-device cache of page size G*dcp, cut into dcp slices. The host side
(allocator, scheduler, `build_metadata`) uses the virtual page size G*dcp.

Multi-host: the same code; call `jax.distributed.initialize(...)` first (on CPU also
`jax.config.update("jax_cpu_collectives_implementation", "gloo")`), build the mesh from `jax.devices()` (all
processes' devices), and run the same host logic (scheduler, metadata) in every process: `replicate` turns the
host arrays into global replicated arrays, `to_host` reads results back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from mla_jax import sharding
from mla_jax.cache import KVCache, cache_dtype, check_page_size
from mla_jax.comm import Comm
from mla_jax.config import DeepseekConfig
from mla_jax.metadata import AttentionMetadata
from mla_jax.model import Params, lm_head_weight
from mla_jax.sharding import DCP, DP, EP, TP


def make_mesh(
    *, tp: int = 1, dcp: int = 1, ep: int = 1, dp: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ("dp", "ep", "tp", "dcp") mesh over the first dp*ep*tp*dcp of `devices` (default: all devices of all
    processes).

    Built with `Mesh(devices, names)` (Auto axes; `jax.make_mesh` defaults to Explicit axes, which the model's
    gathers do not support). "dcp" is innermost, so a DCP group is neighbouring devices (one host, NVLink); "dp"
    outermost, so a DP group (its tp*dcp*ep devices) is neighbouring devices too."""
    devices = list(jax.devices() if devices is None else devices)
    for name, v in (("tp", tp), ("dcp", dcp), ("ep", ep), ("dp", dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    n = dp * tp * dcp * ep
    if n > len(devices):
        raise ValueError(f"dp={dp} x tp={tp} x dcp={dcp} x ep={ep} needs {n} devices, {len(devices)} available")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(dp, ep, tp, dcp), (DP, EP, TP, DCP))


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    """How a model and its cache are laid out on `mesh` (hashable: a static argument of the jitted steps)."""

    mesh: Mesh
    moe: str = "ep"  # routed experts split by expert ("ep") or by their intermediate dim ("tp")
    dcp_interleave: int | None = None  # DCP interleave I in tokens (divides the page size); None: the page size

    def __post_init__(self):
        extra = [a for a in self.mesh.axis_names if a not in sharding.MESH_AXES]
        if extra:
            raise ValueError(f"mesh axes {extra} are not supported; use {sharding.MESH_AXES}")
        if self.moe not in sharding.MOE_MODES:
            raise ValueError(f"moe must be one of {sharding.MOE_MODES}, got {self.moe!r}")
        if self.moe != "ep" and self.dp > 1:
            raise ValueError(
                f"moe={self.moe!r} with dp={self.dp}: data-parallel attention runs the routed experts expert-parallel "
                "over every device (moe='ep'); an intermediate-dim split would replicate all experts on every DP rank"
            )
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
    def dp(self) -> int:
        return self.size(DP)

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

    @property
    def expert_axes(self) -> tuple[str, ...]:
        return sharding.expert_axes(self.mesh)

    @property
    def expert_shards(self) -> int:
        """Devices the routed experts are split over (moe="ep"): dp * model shards."""
        return math.prod(self.size(a) for a in self.expert_axes)

    def comm(self, cfg: DeepseekConfig) -> Comm:
        """The step's collectives on this mesh (`mla_jax.comm`)."""
        return Comm(
            head_axes=self.head_axes,
            model_axes=self.model_axes,
            head_shards=self.head_shards,
            dcp=self.dcp,
            dcp_interleave=self.dcp_interleave,
            dp=self.dp,
            expert_axes=self.expert_axes,
        )

    def describe(self) -> str:
        return f"dp={self.dp} tp={self.tp} dcp={self.dcp} ep={self.ep} moe={self.moe} ({self.num_devices} devices)"

    # ---- params ------------------------------------------------------------------------------------
    def validate(self, cfg: DeepseekConfig) -> None:
        """Raises ValueError if the model's heads or experts do not divide over the mesh (no silent fallback:
        a replicated head set would be summed twice)."""
        N, h = cfg.num_attention_heads, self.head_shards
        if N % h:
            raise ValueError(f"{N} attention heads do not divide over tp*dcp = {h} devices")
        if cfg.n_routed_experts and self.expert_shards > 1:
            m = self.expert_shards if self.moe == "ep" else self.model_shards
            if self.moe == "ep" and cfg.n_routed_experts % m:
                fix = "use another mesh" if self.dp > 1 else "use moe='tp' or another mesh"
                raise ValueError(
                    f"{cfg.n_routed_experts} routed experts do not divide over {m} devices (expert parallel); {fix}"
                )
            if self.moe == "tp" and cfg.moe_intermediate_size % m:
                raise ValueError(
                    f"moe_intermediate_size {cfg.moe_intermediate_size} does not divide over {m} devices (moe='tp')"
                )

    def param_shardings(self, params: Any, cfg: DeepseekConfig) -> Any:
        if not self.expert_axes:  # a mesh of one axis-less device: everything replicated
            return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), params)
        return sharding.param_shardings(params, cfg, self.mesh, moe=self.moe)

    def param_specs(self, params: Any, cfg: DeepseekConfig) -> Any:
        return jax.tree.map(lambda s: s.spec, self.param_shardings(params, cfg))

    def logits_spec(self, params: Any, cfg: DeepseekConfig) -> P:
        """logits [num_logits, vocab] come out split like lm_head's rows (the vocab); under DP the rows are
        [dp * num_logits], rank-major."""
        lm_spec = lm_head_weight(self.param_specs(params, cfg))
        return P(DP if self.dp > 1 else None, lm_spec[0] if len(lm_spec) else None)

    def shard_params(self, params: Params, cfg: DeepseekConfig) -> Params:
        """Place params on the mesh (a no-op for params already placed so). Works across processes when every
        process holds the same full params."""
        self.validate(cfg)
        return jax.tree.map(_put, params, self.param_shardings(params, cfg))

    # ---- cache -------------------------------------------------------------------------------------
    def cache_specs(self, fp8: bool) -> KVCache:
        """PartitionSpecs of the cache [layers, pages, G*dcp, L+R]: the page axis over "dp" (each DP rank its own
        pool), the in-page axis over "dcp", otherwise replicated."""
        pages = DP if self.dp > 1 else None
        rows = DCP if self.dcp > 1 else None
        return KVCache(P(None, pages, rows, None), P(None, pages, rows) if fp8 else None)

    def init_cache(
        self,
        cfg: DeepseekConfig,
        num_pages: int,
        page_size: int,
        *,
        dtype: Any = "bf16",
        fill: float = 0.0,
        num_layers: int | None = None,
    ) -> KVCache:
        """The stacked cache, created directly in its sharding (never whole on one device).

        `page_size` is the physical page G of each device; the global page axis holds G*dcp rows, the virtual
        page the block tables (and `build_metadata(page_size=G*dcp)`) use. `num_pages` is per DP rank: the
        global page axis holds dp * num_pages pages, rank r's pool is pages [r*num_pages, (r+1)*num_pages),
        which its block tables number 0..num_pages-1. `num_layers` (default: the model's) counts the MTP
        drafter's layers too when it runs."""
        check_page_size(page_size, allow_any_page_size=True)
        d = cache_dtype(dtype)
        fp8 = d == jnp.dtype(jnp.float8_e4m3fn)
        shape = (num_layers or cfg.num_hidden_layers, num_pages * self.dp, page_size * self.dcp, cfg.cache_row_dim)
        specs = self.cache_specs(fp8)
        out = KVCache(
            NamedSharding(self.mesh, specs.kv_c_and_k_pe_cache),
            NamedSharding(self.mesh, specs.kv_scale) if fp8 else None,
        )

        def make():
            return KVCache(jnp.full(shape, fill, d), jnp.ones(shape[:3], jnp.float32) if fp8 else None)

        return jax.jit(make, out_shardings=out)()

    # ---- host <-> mesh -----------------------------------------------------------------------------
    def replicate(self, tree: Any) -> Any:
        """Host arrays (numpy metadata, sampling arrays) -> global arrays replicated on every device."""
        return jax.device_put(tree, NamedSharding(self.mesh, P()))

    def put_metadata(self, md: AttentionMetadata) -> AttentionMetadata:
        """The step's host metadata -> global arrays: replicated, or under DP (`stack_metadata`: a leading [dp]
        axis) split over "dp", each rank getting its own."""
        if self.dp == 1:
            return self.replicate(md)
        return jax.device_put(md, NamedSharding(self.mesh, P(DP)))


def stack_metadata(per_rank: Sequence[AttentionMetadata]) -> AttentionMetadata:
    """DP: one host `AttentionMetadata` per rank, all of the same `BatchShape` -> one with a leading [dp] axis on
    every array (what `ParallelPlan.put_metadata` and the DP step take)."""
    shapes = {m.shape for m in per_rank}
    if len(shapes) != 1:
        raise ValueError(f"DP ranks' metadata differ in BatchShape: {sorted(map(str, shapes))}")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *per_rank)


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
