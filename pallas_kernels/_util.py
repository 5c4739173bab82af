"""Small helpers shared by the kernels: sizes and the device's SM count."""
from __future__ import annotations

import jax
import numpy as np

H200_SMS = 132


def is_pow2(x) -> bool:
  return isinstance(x, (int, np.integer)) and x > 0 and (x & (x - 1)) == 0


def next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def num_sms() -> int:
  """SM count of the default device (132 on H200); 132 when unknown (CPU, interpret mode)."""
  try:
    n = getattr(jax.devices()[0], "core_count", None)
    return int(n) if n else H200_SMS
  except Exception:  # pragma: no cover - no backend at all
    return H200_SMS
