"""Build tests/fixtures/hf_fp8/: the tiny V3 fixture (tests/fixtures/hf/v3) quantized in DeepSeek-V3's format.

Run: .venv/bin/python scripts/make_fp8_fixture.py     (numpy + ml_dtypes only; deterministic)

DeepSeek-V3's FP8 checkpoint format (its `inference/fp8_cast_bf16.py` reverses it):
- every linear weight inside the decoder layers (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, dense
  MLP, routed and shared experts) is float8_e4m3fn [M, K] with a float32 `<name>_scale_inv`
  [ceil(M/128), ceil(K/128)]; the weight is `fp8 * scale_inv` per 128x128 block (partial blocks at the edges);
- the scale is the block's amax / 448 (e4m3's largest finite value);
- embed_tokens, lm_head, norms and the router weight stay bf16, e_score_correction_bias float32;
- config.json carries quantization_config {quant_method fp8, fmt e4m3, activation_scheme dynamic,
  weight_block_size [128, 128]};
- the MTP module is an extra layer model.layers.{num_hidden_layers}.* (enorm, hnorm, eh_proj, shared_head...),
  which inference skips.
The fixture dims are < 128 (one partial block per tensor) except kv_b_proj (128 rows: one full block).
Written as two shards with model.safetensors.index.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mla_jax.checkpoint import CheckpointDir, save_file  # noqa: E402

SRC = ROOT / "tests" / "fixtures" / "hf" / "v3"
OUT = ROOT / "tests" / "fixtures" / "hf_fp8"
BLOCK = 128
E4M3_MAX = 448.0
MAX_BYTES = 1_500_000
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\..*(_proj|_proj_with_mqa)\.weight$")


def quantize_blocks(w: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """float [M, K] -> (e4m3 [M, K], float32 scale_inv [ceil(M/b), ceil(K/b)]) with scale = block amax / 448."""
    M, K = w.shape
    q = np.empty((M, K), ml_dtypes.float8_e4m3fn)
    s = np.empty((-(-M // block), -(-K // block)), np.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block : (i + 1) * block, j * block : (j + 1) * block].astype(np.float32)
            amax = float(np.abs(blk).max())
            scale = np.float32(amax / E4M3_MAX if amax > 0 else 1.0)
            s[i, j] = scale
            q[i * block : (i + 1) * block, j * block : (j + 1) * block] = np.clip(
                blk / scale, -E4M3_MAX, E4M3_MAX
            ).astype(ml_dtypes.float8_e4m3fn)
    return q, s


def main() -> None:
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [BLOCK, BLOCK],
    }
    cfg["dtype"] = "bfloat16"
    n_layers = cfg["num_hidden_layers"]
    src = CheckpointDir(SRC)
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(src.keys()):
        w = np.array(src.get(name))
        if QUANTIZED.match(name):
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(w)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = w.astype(np.float32)
        else:
            tensors[name] = w.astype(ml_dtypes.bfloat16)
    # The MTP layer (a few of DeepSeek-V3's model.layers.61.* names), with one fp8 weight.
    rng = np.random.default_rng(61)
    D = cfg["hidden_size"]
    mtp = f"model.layers.{n_layers}."
    tensors[mtp + "enorm.weight"] = np.ones(D, ml_dtypes.bfloat16)
    tensors[mtp + "hnorm.weight"] = np.ones(D, ml_dtypes.bfloat16)
    tensors[mtp + "eh_proj.weight"], tensors[mtp + "eh_proj.weight_scale_inv"] = quantize_blocks(
        rng.normal(size=(D, 2 * D)).astype(np.float32)
    )
    tensors[mtp + "shared_head.norm.weight"] = np.ones(D, ml_dtypes.bfloat16)

    OUT.mkdir(parents=True, exist_ok=True)
    for f in OUT.iterdir():
        f.unlink()
    names = sorted(tensors)
    cut = next(i for i, n in enumerate(names) if n.startswith("model.layers.2."))
    shards = {"model-00001-of-00002.safetensors": names[:cut], "model-00002-of-00002.safetensors": names[cut:]}
    weight_map = {}
    for fname, part in shards.items():
        save_file({n: tensors[n] for n in part}, OUT / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    total = sum(t.nbytes for t in tensors.values())
    (OUT / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {
                    "total_size": total,
                    "generated_by": "scripts/make_fp8_fixture.py from tests/fixtures/hf/v3",
                },
                "weight_map": weight_map,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    size = sum(os.path.getsize(f) for f in OUT.iterdir())
    assert size < MAX_BYTES, f"fixture is {size} bytes"
    n_q = sum(n.endswith("_scale_inv") for n in tensors)
    print(f"wrote {OUT}: {len(tensors)} tensors ({n_q} fp8 weights with scales), {size} bytes")


if __name__ == "__main__":
    main()
