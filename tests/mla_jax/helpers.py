"""Tiny configs shared by the model tests."""
import os

from mla_jax.config import DeepseekConfig

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")


def tiny_config(**overrides) -> DeepseekConfig:
    d = dict(model_type="deepseek_v3", vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
             q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
             intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1,
             num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True,
             routed_scaling_factor=2.5, max_position_embeddings=256, rms_norm_eps=1e-6,
             rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16, mscale=1.0,
                               mscale_all_dim=0.8, beta_fast=32, beta_slow=1))
    d.update(overrides)
    return DeepseekConfig.from_dict(d)
