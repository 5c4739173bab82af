"""mla-jax: DeepSeek MLA (Multi-head Latent Attention) inference in JAX, with Pallas GPU kernels."""
from mla_jax.checkpoint import CheckpointError, load_hf_checkpoint
from mla_jax.config import ConfigError, DeepseekConfig
from mla_jax.model import forward, init_params, prepare_params
from mla_jax.module import MLAAttention

__all__ = ["DeepseekConfig", "ConfigError", "CheckpointError", "load_hf_checkpoint", "forward", "init_params",
           "prepare_params", "MLAAttention"]
