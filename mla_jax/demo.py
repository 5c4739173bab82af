"""`make demo`: greedy generation with a tiny random DeepSeek-V3-shaped model on CPU.

A greedy loop over the full forward: each step recomputes the whole sequence (no cache yet), then prints the
generated token ids and tokens/s.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from mla_jax import model
from mla_jax.config import DeepseekConfig

TINY_V3 = dict(model_type="deepseek_v3", vocab_size=512, hidden_size=128, num_hidden_layers=4,
               num_attention_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
               n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2,
               norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096,
               rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0,
                                 mscale_all_dim=1.0))


def greedy(params, cfg: DeepseekConfig, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Causal attention ignores the zero padding after position n-1, so one padded length (one compile)
    serves every step."""
    total = len(prompt) + max_new_tokens
    ids = jnp.zeros((1, total), jnp.int32).at[0, : len(prompt)].set(jnp.asarray(prompt, jnp.int32))
    for n in range(len(prompt), total):
        logits = model.forward(params, cfg, ids, attention="absorbed")
        ids = ids.at[0, n].set(jnp.argmax(logits[0, n - 1]).astype(jnp.int32))
    return [int(t) for t in ids[0, len(prompt):]]


def main() -> None:
    cfg = DeepseekConfig.from_dict(TINY_V3)
    params = model.init_params(cfg, jax.random.key(0), std=0.1)
    prompt = [1, 17, 42, 7, 99]
    n = 16
    greedy(params, cfg, prompt, n)  # compile outside the timing
    t0 = time.perf_counter()
    out = greedy(params, cfg, prompt, n)
    dt = time.perf_counter() - t0
    print(f"model: tiny random DeepSeek-V3 ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
          f"L={cfg.kv_lora_rank}, {cfg.n_routed_experts} experts)")
    print(f"prompt ids:    {prompt}")
    print(f"generated ids: {out}")
    print(f"{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s (CPU, full forward per token, no cache yet)")


if __name__ == "__main__":
    main()
