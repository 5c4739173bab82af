"""mla-jax: DeepSeek MLA (Multi-head Latent Attention) inference in JAX, with Pallas GPU kernels.

    import mla_jax

    cfg, params = mla_jax.load_model("path/to/DeepSeek-V2-Lite")        # HF directory or converted checkpoint
    outs = mla_jax.generate(params, cfg, [[100, 2, 3]], mla_jax.SamplingParams(max_new_tokens=32))

The public API is re-exported here; the modules hold the rest (`mla_jax.step` for the jitted model step,
`mla_jax.attention` for the kernel backends, `mla_jax.cache` for the paged latent cache, ...).
"""

from mla_jax.checkpoint import CheckpointError, convert, load_hf_checkpoint, load_model, quantize_params
from mla_jax.config import ConfigError, DeepseekConfig
from mla_jax.engine import Engine, EngineConfig, RequestOutput, generate
from mla_jax.memory import MemoryPlan, memory_plan
from mla_jax.model import forward, init_params, prepare_params
from mla_jax.module import MLAAttention
from mla_jax.parallel import ParallelPlan, make_mesh
from mla_jax.sampling import SamplingParams

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepseekConfig",
    "Engine",
    "EngineConfig",
    "MLAAttention",
    "MemoryPlan",
    "ParallelPlan",
    "RequestOutput",
    "SamplingParams",
    "convert",
    "forward",
    "generate",
    "init_params",
    "load_hf_checkpoint",
    "load_model",
    "make_mesh",
    "memory_plan",
    "prepare_params",
    "quantize_params",
]
