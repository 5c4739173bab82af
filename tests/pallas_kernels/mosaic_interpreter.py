"""Running the Hopper (Mosaic GPU) kernels under the Mosaic GPU interpreter in the CPU tests.

The interpreter runs each of a kernel's 3 warpgroups as a jitted program that blocks in host
callbacks at barriers; XLA's CPU runtime has one worker per core (2 on CI), so 3 warpgroups
deadlock unless NPROC (read by XLA when it creates the CPU client) allows more. tests/conftest.py
sets it; it is set here too, before this module touches JAX, for runs without that conftest.
"""

from __future__ import annotations

import os

os.environ.setdefault("NPROC", "8")  # >= 3 XLA CPU workers for the interpreter's 3 warpgroups

import jax  # noqa: E402
import pytest  # noqa: E402
from jax._src import xla_bridge  # noqa: E402
from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: E402

NPROC_IN_TIME = not xla_bridge.backends_are_initialized() or int(os.environ.get("NPROC", "0") or 0) >= 4


def require_nproc():
    if not NPROC_IN_TIME:
        pytest.skip(
            "JAX's CPU client was created before NPROC was raised: the interpreter's 3 "
            "warpgroups would deadlock on 2 workers (set NPROC=8 in tests/conftest.py)"
        )


def run_interpreted(kernel, *args, **kw):
    """kernel(*args, interpret=<race-detecting params>, **kw), blocked on: the one helper that
    touches interpreter internals (private API: race state and reset)."""
    require_nproc()
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc

    params = plgpu.InterpretGPUParams(detect_races=True)
    try:
        out = jax.block_until_ready(kernel(*args, interpret=params, **kw))
    except Exception:
        ipc.reset_gpu_interpret_mode_state()  # the interpreter's shared state survives a failure
        raise
    assert not ipc.get_races().races_found, "the interpreter's race detector fired"
    return out
