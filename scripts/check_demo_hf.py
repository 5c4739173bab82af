"""Check that Hugging Face transformers loads the demo model, and store its logits for our tests to compare with.

Run: /tmp/hfvenv/bin/python scripts/check_demo_hf.py [MODEL_DIR]     (default mla_jax/data/demo)
     (on the GPU machine: python3 scripts/check_demo_hf.py $OUT/demo; torch + transformers >= 5.17, CPU torch)

Loads MODEL_DIR with DeepseekV3ForCausalLM.from_pretrained (no missing, unexpected or mis-shaped tensors
allowed) and its tokenizer with PreTrainedTokenizerFast (must give the same ids as `tokenizers`), runs PROMPT
through the model in float64 (eager attention, no cache) and writes MODEL_DIR/hf_reference.safetensors:
input_ids i32[S] and logits f32[S, vocab], with the transformers/torch versions in its metadata.
tests/mla_jax/test_demo_model.py compares our float32 forward with these logits. Imports no jax.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
MAX_TOKENS = 16  # logits f32[16, 4096]: 256 KB


def main(argv: list[str]) -> int:
    model_dir = Path(argv[0]) if argv else ROOT / "mla_jax" / "data" / "demo"
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = tok.encode(PROMPT).ids[:MAX_TOKENS]
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    hf_ids = hf_tok(PROMPT, add_special_tokens=False)["input_ids"][:MAX_TOKENS]
    assert hf_ids == ids, f"PreTrainedTokenizerFast gives {hf_ids}, tokenizers gives {ids}"

    model, info = DeepseekV3ForCausalLM.from_pretrained(
        str(model_dir),
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    bad = {k: v for k, v in info.items() if v}
    assert not bad, f"transformers could not load every tensor: {bad}"
    model.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        l32 = model(input_ids=x, use_cache=False).logits[0].double()
        l64 = model.double()(input_ids=x, use_cache=False).logits[0]
    cfg = json.loads((model_dir / "config.json").read_text())
    assert l64.shape == (len(ids), cfg["vocab_size"]), l64.shape
    meta = {
        "prompt": PROMPT,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "note": "HF DeepseekV3ForCausalLM cast with model.double() (its router and RMSNorm stay float32), "
        "eager attention, position_ids 0..S-1, use_cache=False; logits stored as float32",
        "max_abs_diff_hf_float32_vs_float64": f"{(l32 - l64).abs().max().item():.3e}",
    }
    out = model_dir / "hf_reference.safetensors"
    save_file({"input_ids": np.asarray(ids, np.int32), "logits": l64.float().numpy()}, str(out), metadata=meta)
    greedy = tok.decode(l64.argmax(-1).tolist())
    print(
        f"transformers {transformers.__version__} loaded {model_dir}: {sum(p.numel() for p in model.parameters())} "
        f"params; {len(ids)} prompt tokens; HF fp32 vs fp64 max |diff| {meta['max_abs_diff_hf_float32_vs_float64']}; "
        f"next-token argmax: {greedy!r} -> {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
