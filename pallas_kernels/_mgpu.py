"""Helpers shared by the Mosaic GPU (Hopper) kernels."""
from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def wgmma_accumulate(acc, a, b, *, interpret: bool):
  """acc + a @ b with one wgmma accumulating into `acc`'s registers (waits for completion).

  `a` is a shared-memory ref or a register value, `b` a shared-memory ref. The Mosaic GPU interpreter
  (jax 0.11.2) can run neither `pl.run_state` over a wgmma accumulator ("MLIR translation rule for
  primitive 'wgmma' not found for platform cpu") nor a register-operand wgmma: there the product goes
  to a fresh zero accumulator and is added in registers (same math, one extra f32 rounding; it would
  double the registers on a GPU).
  """
  if interpret:
    def mm(acc_ref):
      plgpu.wgmma(acc_ref, a, b)
      return acc_ref[...]
    return acc + pl.run_scoped(mm, plgpu.ACC(acc.shape, jnp.float32))

  def mm(acc_ref):
    plgpu.wgmma(acc_ref, a, b)
  return pl.run_state(mm)(plgpu.ACC.init(acc))
