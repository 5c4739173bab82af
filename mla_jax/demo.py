"""`make demo` (second half): the Python API on the shipped demo model (mla_jax/data/demo, a 7 M-parameter
DeepSeek-V3-architecture model trained on the Python standard library). Three prompts go through `generate`
together (paged latent cache, continuous batching), one greedy and two sampled with their own seeds."""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp

from mla_jax.checkpoint import eos_token_ids, load_model
from mla_jax.engine import generate
from mla_jax.sampling import SamplingParams

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo")


def main() -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(DEMO_DIR, "tokenizer.json"))
    cfg, params = load_model(DEMO_DIR, dtype=jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    prompts = [
        "import os\n\n\ndef list_python_files(root):",
        "class Stack:\n    def push(self, item):",
        "    for i, line in enumerate(",
    ]
    eos = eos_token_ids(DEMO_DIR)
    sampling = [
        SamplingParams(max_new_tokens=48, stop_token_ids=eos),  # greedy
        SamplingParams(max_new_tokens=48, temperature=0.7, top_p=0.95, seed=1, stop_token_ids=eos),
        SamplingParams(max_new_tokens=48, temperature=0.8, top_k=40, seed=2, stop_token_ids=eos),
    ]
    print(
        f"model: {DEMO_DIR} ({cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
        f"L={cfg.kv_lora_rank}, {cfg.n_routed_experts} experts), {jax.default_backend()}"
    )
    t0 = time.perf_counter()
    outs = generate(params, cfg, [tok.encode(p).ids for p in prompts], sampling)
    dt = time.perf_counter() - t0
    for p, s, o in zip(prompts, sampling, outs):
        how = "greedy" if s.temperature == 0 else f"temperature {s.temperature}, seed {s.seed}"
        print(f"--- {how}\n{p}{tok.decode(o.token_ids)}")
    n = sum(len(o.token_ids) for o in outs)
    print(f"--- {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s, including the compiles)")


if __name__ == "__main__":
    main()
