"""Multi-device serving on a `jax.sharding.Mesh`: tensor parallel heads, expert-parallel MoE, decode context
parallel (DCP), on one host or several.

Mesh axes (any subset; `make_mesh` builds ("ep", "tp", "dcp")):

    tp    attention heads, vocab, MLP intermediate, experts are split over it; the latent cache is replicated
    dcp   heads are split over it as well, and the latent cache is split by tokens (`mla_jax.comm`)
    ep    experts (and vocab, MLP intermediate) only; attention is computed redundantly on its replicas

Devices = tp * dcp * ep. vLLM's `-tp T -dcp D` (D divides T, DCP ranks are TP ranks) is `tp=T/D, dcp=D` here: the
heads go over ("tp", "dcp"), T-way, the cache D-way. The param layout is `mla_jax.sharding.param_shardings`
(heads over the head axes ("tp", "dcp"), everything else that is split over the model axes ("ep", "tp",
"dcp")); `load_model(DIR, mesh=plan.mesh)` restores a checkpoint straight into it.

A `ParallelPlan` is everything the one model step needs to run on the mesh: `mla_jax.step.forward_step(...,
plan=plan)` runs the same step function inside one `shard_map` over every mesh axis, with the plan's `Comm`
(`mla_jax.comm`: the collectives, explicit) in place of the one-device identity; `Engine(..., plan=plan)` and
`generate(..., plan=plan)` drive it. Activations between layers are replicated [T, D]. Per layer: one
all-reduce [T, D] after attention (over the head axes) and one after the MLP/MoE (over the model axes); DCP adds
the all-gather of the decode q and the LSE combine; lm_head gives vocab-split logits, all-gathered for sampling.

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
from mla_jax.model import Params, lm_head_weight
from mla_jax.sharding import DCP, EP, TP


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

    def comm(self, cfg: DeepseekConfig) -> Comm:
        """The step's collectives on this mesh (`mla_jax.comm`)."""
        return Comm(
            head_axes=self.head_axes,
            model_axes=self.model_axes,
            head_shards=self.head_shards,
            dcp=self.dcp,
            dcp_interleave=self.dcp_interleave,
        )

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
                raise ValueError(
                    f"{cfg.n_routed_experts} routed experts do not divide over {m} devices "
                    "(expert parallel); use moe='tp' or another mesh"
                )
            if self.moe == "tp" and cfg.moe_intermediate_size % m:
                raise ValueError(
                    f"moe_intermediate_size {cfg.moe_intermediate_size} does not divide over {m} devices (moe='tp')"
                )

    def param_shardings(self, params: Any, cfg: DeepseekConfig) -> Any:
        if not self.model_axes:  # a mesh of one axis-less device: everything replicated
            return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), params)
        return sharding.param_shardings(params, cfg, self.mesh, moe=self.moe)

    def param_specs(self, params: Any, cfg: DeepseekConfig) -> Any:
        return jax.tree.map(lambda s: s.spec, self.param_shardings(params, cfg))

    def logits_spec(self, params: Any, cfg: DeepseekConfig) -> P:
        """logits [num_logits, vocab] come out split like lm_head's rows (the vocab)."""
        lm_spec = lm_head_weight(self.param_specs(params, cfg))
        return P(None, lm_spec[0] if len(lm_spec) else None)

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
        page the block tables (and `build_metadata(page_size=G*dcp)`) use. `num_layers` (default: the model's)
        counts the MTP drafter's layers too when it runs."""
        check_page_size(page_size, allow_any_page_size=True)
        d = cache_dtype(dtype)
        fp8 = d == jnp.dtype(jnp.float8_e4m3fn)
        shape = (num_layers or cfg.num_hidden_layers, num_pages, page_size * self.dcp, cfg.cache_row_dim)
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
