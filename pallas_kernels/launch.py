"""Triton-lowered kernels as launch descriptions: run alone, or several side by side in one launch.

A `Launch` is one kernel's body, grid, inputs and outputs, every block the whole array (under the Triton lowering a
block only sets a base pointer; the body offsets itself from its program ids, which it takes as an argument rather
than from `pl.program_id`). `run([a])` is the kernel's own `pallas_call` on its own grid. `run([a, b])` puts both
kernels' programs in one launch: a flat grid of a's programs then b's, each program running its kernel's body with
its own ids (axis 0 fastest, as the separate grid orders them) on its kernel's refs.

Why: at decode sizes a step's small kernels are latency bound, each ~1.5-2 us of device time for a few KB of work
(docs/perf-notes.md, session 32's batch-1 trace); two that do not depend on each other (the cache write of the new
latent rows and absorb_q, both reading the q + kv projection's output) take one kernel's time side by side, where
XLA's command buffer runs them one after the other (its CONCURRENT scheduling did not overlap them: session 33).
Both kernels must take the same `num_warps` (one Triton compile); the launch pipelines loops with the larger
`num_stages`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

__all__ = ["Launch", "run"]


@dataclasses.dataclass(frozen=True)
class Launch:
    """body(ids, *input_refs, *output_refs): ids one i32 program id per grid axis; aliases (input index, output
    index) pairs updated in place (`input_output_aliases`)."""

    body: Callable
    grid: tuple[int, ...]
    inputs: tuple
    out_shape: tuple[jax.ShapeDtypeStruct, ...]
    aliases: tuple[tuple[int, int], ...] = ()
    num_warps: int = 4
    num_stages: int = 1
    name: str = "kernel"

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


def _unflatten(f, grid: tuple[int, ...]) -> tuple:
    """A flat program index -> one id per grid axis, axis 0 fastest."""
    ids = []
    for g in grid:
        ids.append(f % g)
        f = f // g
    return tuple(ids)


def run(launches: Sequence[Launch], *, interpret: bool = False, name: str | None = None) -> list[tuple]:
    """Each launch's outputs (a tuple per launch), from one `pallas_call`; see the module docstring."""
    launches = list(launches)
    if not launches:
        raise ValueError("run needs at least one Launch")
    if len({a.num_warps for a in launches}) != 1:
        raise ValueError(f"launches in one call share num_warps, got {[a.num_warps for a in launches]}")
    if any(a.programs < 1 for a in launches):
        raise ValueError(f"every launch needs a program, got grids {[a.grid for a in launches]}")
    n_in = [len(a.inputs) for a in launches]
    n_out = [len(a.out_shape) for a in launches]
    in_base = [sum(n_in[:i]) for i in range(len(launches))]
    out_base = [sum(n_out[:i]) for i in range(len(launches))]
    inputs = [x for a in launches for x in a.inputs]
    out_shape = [s for a in launches for s in a.out_shape]
    aliases = {in_base[i] + src: out_base[i] + dst for i, a in enumerate(launches) for src, dst in a.aliases}
    alone = len(launches) == 1
    grid = launches[0].grid if alone else (sum(a.programs for a in launches),)

    def kernel(*refs):
        ins, outs = refs[: len(inputs)], refs[len(inputs) :]

        def call(i, ids):
            a = launches[i]
            a.body(ids, *ins[in_base[i] : in_base[i] + n_in[i]], *outs[out_base[i] : out_base[i] + n_out[i]])

        if alone:
            call(0, tuple(pl.program_id(axis) for axis in range(len(grid))))
            return
        pid = pl.program_id(0)
        start = 0
        for i, a in enumerate(launches):
            lo, hi = start, start + a.programs
            pl.when((pid >= lo) & (pid < hi))(lambda i=i, lo=lo, a=a: call(i, _unflatten(pid - lo, a.grid)))
            start = hi

    whole = lambda shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))  # noqa: E731
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[whole(jnp.shape(x)) for x in inputs],
        out_specs=[whole(s.shape) for s in out_shape],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltriton.CompilerParams(
            num_warps=launches[0].num_warps, num_stages=max(a.num_stages for a in launches)
        ),
        interpret=interpret,
        name=name or "_".join(a.name for a in launches),
    )(*inputs)
    return [tuple(outs[out_base[i] : out_base[i] + n_out[i]]) for i in range(len(launches))]
