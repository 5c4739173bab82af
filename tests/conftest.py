import os

# Tests run on CPU in float32 with exact matmuls; 8 virtual devices for sharding tests. XLA's CPU backend at LLVM
# optimization level 0: the suite's small programs spend most of their time in compilation, and this cuts the
# suite's CPU time by ~40% (test_paged: 229 -> 128 s) without slowing the interpreted kernels (test_mla_decode_sm90:
# 88 -> 82 s).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The Mosaic GPU interpreter runs each of a kernel's 3 warpgroups as an XLA CPU program blocking on barriers:
# it needs >= 3 XLA CPU workers (one per core by default, 2 on CI). Read when the CPU client starts.
os.environ.setdefault("NPROC", "8")
# No persistent compilation cache in the test processes (a cache read back into an interpreted Pallas kernel's
# compile aborted a worker once); tests/mla_jax/test_compile_cache.py turns it on in a subprocess.
os.environ["MLA_JAX_COMPILE_CACHE"] = "off"

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture
def h200(monkeypatch):
    """Pallas's Triton lowering on CPU as for an H200: its device query (compute capability, SM count) answered, so a
    test can lower a Triton kernel for the GPU (`.lower(lowering_platforms=("cuda",))`) and check its IR."""
    from jax._src.pallas.triton import gpu_info, pallas_call_registration

    monkeypatch.setattr(
        pallas_call_registration.gpu_info_lib,
        "get_gpu_info",
        lambda: gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200),
    )
