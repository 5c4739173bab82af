"""`make demo`: generation with a tiny random DeepSeek-V3-shaped model on CPU through the engine
(paged latent cache, continuous batching, greedy and sampled requests); prints token ids and tokens/s."""
from __future__ import annotations

import time

import jax

from mla_jax import model
from mla_jax.config import DeepseekConfig
from mla_jax.engine import Engine, EngineConfig
from mla_jax.sampling import SamplingParams

TINY_V3 = dict(model_type="deepseek_v3", vocab_size=512, hidden_size=128, num_hidden_layers=4,
               num_attention_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
               v_head_dim=32, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=16,
               n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2,
               norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096,
               rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=1024, mscale=1.0,
                                 mscale_all_dim=1.0))


def main() -> None:
    cfg = DeepseekConfig.from_dict(TINY_V3)
    params = model.init_params(cfg, jax.random.key(0), std=0.1)
    prompts = [[1, 17, 42, 7, 99], [5, 4, 3], [250, 251, 252, 253, 254, 255, 256, 257]]
    sampling = [SamplingParams(max_new_tokens=16),  # greedy
                SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1),
                SamplingParams(max_new_tokens=16, temperature=1.0, top_k=20, seed=2)]
    config = EngineConfig(max_model_len=64, max_num_seqs=4, page_size=16, token_budget=64, max_prefills=4,
                          cache_dtype="fp32")
    print(f"model: tiny random DeepSeek-V3 ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
          f"L={cfg.kv_lora_rank}, {cfg.n_routed_experts} experts), paged latent cache, {jax.default_backend()}")
    engine = Engine(params, cfg, config)
    print(f"warm-up compile of decode buckets {engine.config.decode_buckets}: {engine.warmup(prefill=False):.1f} s")
    ids = [engine.add_request(p, s) for p, s in zip(prompts, sampling)]
    t0 = time.perf_counter()
    final = engine.run()
    dt = time.perf_counter() - t0
    n = sum(len(final[i].token_ids) for i in ids)
    for p, i in zip(prompts, ids):
        print(f"prompt {p} -> {final[i].token_ids}")
    print(f"{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s ({engine.steps} steps, continuous batching; "
          "includes the prefill compile)")
    print("CLI: mla-jax generate --model tests/fixtures/hf/v3 --prompt-ids 1,2,3 --max-new-tokens 16")


if __name__ == "__main__":
    main()
