"""Train the embedded demo model: a small DeepSeek-V3-architecture model on the Python standard library.

H200 (device tool `run`, repo root, carry [".cache/demo-corpus"]):
    python3 scripts/train_demo.py --data .cache/demo-corpus --out $OUT --max-minutes 7.5
CPU check of the whole pipeline (a few steps, tiny dims):
    .venv/bin/python scripts/train_demo.py --tiny --out /tmp/demo-tiny
MTP layer for speculative decoding, trained alone on the frozen shipped model (its trunk exported unchanged):
    python3 scripts/train_demo.py --data .cache/demo-corpus --out $OUT --mtp-only --init mla_jax/data/demo \
        --mtp-layers 1 --max-minutes 5

The corpus (tokenizer.json, train.bin, val.bin, corpus.json) comes from scripts/make_corpus.py; when --data has
none, it is built first (needs the `tokenizers` package). Writes OUT/demo/ (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json: the HF DeepSeek-V3 checkpoint of the params with the best validation
loss) and OUT/train-demo.json (config, corpus record, hyperparameters, the train/val loss curve, the final
validation loss of the exported weights, samples). Checkpoints of the float32 params and optimizer state go to
--ckpt-dir (safetensors, every --ckpt-every steps; --resume continues from one).

Model: MLA with a latent bottleneck (L=64 vs N*(P+V)=512), separate rope dims, q-LoRA; one dense layer, then MoE
layers with sigmoid routing, a shared expert and group-limited top-k (`noaux_tc`). The loss is next-token
cross-entropy through `mla_jax.model.forward` (naive attention). AdamW (decoupled weight decay on matrices),
linear warmup then cosine to 10% over min(--steps, the time budget), gradient clipping, float32 master weights
with bf16 compute on GPU (float32 on CPU).

Routing bias: DeepSeek-V3's aux-loss-free balancing. `e_score_correction_bias` gets no gradient (it only steers
the top-k choice); after each step bias += u * sign(mean_load - load) per MoE layer, the loads counted on the
first quarter of the step's batch by a forward that mirrors `model.forward` (`routing_loads`, checked against it
in the tests). No auxiliary loss.

MTP (`--mtp-layers 1`): DeepSeek-V3's multi-token-prediction loss, `--mtp-lambda` times the cross-entropy of
the MTP module (`mla_jax.mtp.mtp_forward`: position p reads the trunk's last hidden state h_p and token p+1,
predicts token p+2) added to the next-token loss. `--mtp-only --init DIR` loads the HF model in DIR, freezes
it (its hidden states, embedding and lm_head under stop_gradient: no weight gradient is computed for them),
trains only the MTP layer on its loss (a fresh one, or with --mtp-warm-start the one DIR ships), selects by MTP
validation loss, and checks that the exported trunk tensors equal DIR's bit for bit. The MTP layer shares the trunk's
embedding and lm_head (no `embed_tokens` / `shared_head.head` of its own); its routing bias stays 0.

MoE matmuls: JAX lowers `ragged_dot` on GPU to XLA's ragged-dot instruction; its transpose for the expert-weight
gradient (ragged contracting dims) is not something we could test on a GPU beforehand, so this script switches
to JAX's portable dense decomposition (`jax_ragged_dot_use_ragged_dot_instruction=False`), the same code CPU
runs. It costs E x the routed-expert FLOPs, which this small model can afford. `--native-ragged-dot` keeps the
instruction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from mla_jax import model  # noqa: E402
from mla_jax.checkpoint import SafetensorsFile, save_file  # noqa: E402
from mla_jax.config import DeepseekConfig  # noqa: E402
from mla_jax.layers import mlp, moe, rms_norm, route  # noqa: E402
from mla_jax.mla import mla_forward_full  # noqa: E402
from mla_jax.mtp import mtp_forward  # noqa: E402

# Dims: rope/nope/v/latent are powers of two >= 16 so the Pallas kernels accept them.
PRESETS: dict[str, dict[str, Any]] = {
    "demo": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=768,
        moe_intermediate_size=96,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    ),
    # For a few minutes of CPU training (2 cores): the same architecture, narrower, 8 experts.
    "small": dict(
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=384,
        moe_intermediate_size=64,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=4,
        topk_group=2,
    ),
}
# No trailing newline: byte-level BPE merges "\n" with the indentation after it, so a prompt that ends in a bare
# "\n" asks for an unindented next line.
SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self):"]


def model_config(preset: str, vocab_size: int, max_len: int) -> DeepseekConfig:
    d = dict(
        model_type="deepseek_v3",
        vocab_size=vocab_size,
        max_position_embeddings=max_len,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        **PRESETS[preset],
    )
    return DeepseekConfig.from_dict(d)


def count_params(params, cfg: DeepseekConfig) -> dict[str, int]:
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    experts = sum(
        int(np.prod(x.shape))
        for x in jax.tree.leaves(params["model"].get("moe_layers", {}).get("mlp", {}).get("experts", {}))
    )
    E, K = cfg.n_routed_experts or 1, cfg.num_experts_per_tok or 1
    emb = int(np.prod(params["model"]["embed_tokens"]["weight"].shape))
    head = int(np.prod(params["lm_head"]["weight"].shape)) if "lm_head" in params else 0
    return {
        "total": total,
        "routed_experts": experts,
        "active_per_token": total - experts + experts * K // E,
        "embedding": emb,
        "lm_head": head,
        "non_embedding": total - emb - head,
    }


# ---- params ------------------------------------------------------------------------------------------------
def _path_has(path, name: str) -> bool:
    return any(getattr(k, "key", None) == name for k in path)


def init_train_params(cfg: DeepseekConfig, seed: int) -> model.Params:
    """GPT-2-style init in our param layout: N(0, 0.02) matrices, residual-out projections (o_proj, down_proj)
    scaled by 1/sqrt(2 * layers), norms 1, routing bias 0, router N(0, 1/D)."""
    params = model.init_params(cfg, jax.random.key(seed), std=0.02)
    out_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    key = jax.random.key(seed + 1)

    def fix(path, x):
        names = [getattr(k, "key", None) for k in path]
        if any(n is not None and ("norm" in n) for n in names):
            return jnp.ones_like(x)
        if "e_score_correction_bias" in names:
            return jnp.zeros_like(x)
        if "embed_tokens" in names:
            return 0.02 * jax.random.normal(jax.random.fold_in(key, 0), x.shape, x.dtype)
        if "o_proj" in names or "down_proj" in names:
            return x * out_scale
        return x

    return jax.tree_util.tree_map_with_path(fix, params)


def weight_decay_mask(params):
    """1.0 for the weight matrices (decayed), 0.0 for norm weights and the router (weight and bias). By name:
    layer leaves carry a leading stacking axis, so ndim does not tell a norm from a matrix."""

    def m(path, x):
        names = [str(getattr(k, "key", "")) for k in path]
        return 0.0 if any("norm" in n for n in names) or "gate" in names else 1.0

    return jax.tree_util.tree_map_with_path(m, params)


def frozen_mask(params):
    """True for leaves the optimizer must not touch: the routing bias (updated by the load rule instead)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: _path_has(p, "e_score_correction_bias"), params)


def cast_for_compute(params, dtype):
    """Compute copy: weights in `dtype`; the router (gate weight and bias) stays float32 as at inference."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if _path_has(p, "gate") else x.astype(dtype), params)


# ---- loss, routing loads -----------------------------------------------------------------------------------
def cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray) -> jnp.ndarray:
    """Mean next-token NLL (nats): logits f32[B, S, vocab], targets i32[B, S]."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(lse - tgt)


def lm_loss(params, cfg: DeepseekConfig, ids: jnp.ndarray) -> jnp.ndarray:
    """ids i32[B, S+1] -> mean cross-entropy of predicting ids[:, 1:] from ids[:, :-1] (naive attention)."""
    logits = model.forward(params, cfg, ids[:, :-1], attention="naive")
    return cross_entropy(logits, ids[:, 1:])


def mtp_loss(params, cfg: DeepseekConfig, ids: jnp.ndarray, *, frozen_trunk: bool = False):
    """ids i32[B, S+1] -> (next-token loss, MTP loss: predicting ids[:, 2:] from the trunk's hidden states and
    ids[:, 1:-1]). With frozen_trunk the trunk's hidden states carry no gradient."""
    trunk = params
    if frozen_trunk:
        trunk = {**params, "model": {k: v for k, v in params["model"].items() if k != model.MTP_GROUP}}
        trunk = jax.lax.stop_gradient(trunk)
    x = ids[:, :-1]
    B, S = x.shape
    hidden = model.forward_hidden(trunk, cfg, x, attention="naive")  # [B, S, D]
    main = cross_entropy(model.lm_logits(trunk, cfg, hidden.reshape(B * S, -1)).reshape(B, S, -1), ids[:, 1:])
    if frozen_trunk:  # the shared embedding and lm_head too: no gradient for weights that do not train
        params = {**trunk, "model": {**trunk["model"], model.MTP_GROUP: params["model"][model.MTP_GROUP]}}
    return main, cross_entropy(mtp_forward(params, cfg, x, hidden), ids[:, 2:])


def routing_loads(params, cfg: DeepseekConfig, input_ids: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The forward of `model.forward`, also counting tokens per routed expert: input_ids i32[B, S] ->
    (loads i32[n_moe_layers, E], logits f32[B, S, vocab]). Same building blocks in the same order."""
    B, S = input_ids.shape
    mp = params["model"]
    x = mp["embed_tokens"]["weight"][input_ids.reshape(-1)]
    positions = jnp.arange(S, dtype=jnp.int32)
    E = cfg.n_routed_experts
    loads = []
    for name, _, _ in model.layer_groups(cfg):
        is_moe = name == "moe_layers"

        def body(h, p, is_moe=is_moe):
            hn = rms_norm(p["input_layernorm"], h, cfg.rms_norm_eps).reshape(B, S, -1)
            a = jax.vmap(lambda hs: mla_forward_full(p["self_attn"], cfg, hs, positions, algorithm="naive"))(hn)
            h = h + a.reshape(B * S, -1)
            hn = rms_norm(p["post_attention_layernorm"], h, cfg.rms_norm_eps)
            if is_moe:
                _, ids = route(p["mlp"]["gate"], cfg, hn)
                load = jnp.bincount(ids.reshape(-1), length=E).astype(jnp.int32)
            else:
                load = jnp.zeros((E,), jnp.int32)
            h = h + (moe(p["mlp"], cfg, hn) if is_moe else mlp(p["mlp"], hn))
            return h, load

        x, lo = jax.lax.scan(body, x, mp[name])
        if is_moe:
            loads.append(lo)
    x = rms_norm(mp["norm"], x, cfg.rms_norm_eps)
    logits = jnp.einsum("td,vd->tv", x, model.lm_head_weight(params)).astype(jnp.float32).reshape(B, S, -1)
    return jnp.concatenate(loads, axis=0), logits


# ---- optimizer and step ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Hyper:
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip: float = 1.0
    bias_rate: float = 1e-3  # aux-loss-free bias update speed u
    probe_frac: float = 0.25  # share of the batch whose routing loads drive the bias update


def make_optimizer(h: Hyper):
    import optax

    return optax.chain(optax.clip_by_global_norm(h.clip), optax.scale_by_adam(b1=h.b1, b2=h.b2, eps=1e-8))


def lr_at(h: Hyper, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to min_lr_frac * lr as progress goes 0 -> 1."""
    if step < h.warmup_steps:
        return h.lr * (step + 1) / h.warmup_steps
    c = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    return h.lr * (h.min_lr_frac + (1 - h.min_lr_frac) * c)


def objective(params, cfg: DeepseekConfig, ids, mtp_lambda: float, mtp_only: bool):
    """The training loss: next-token CE (+ mtp_lambda x the MTP loss with MTP layers; the MTP loss alone with
    mtp_only)."""
    if not cfg.num_mtp_layers:
        return lm_loss(params, cfg, ids)
    main, mtp = mtp_loss(params, cfg, ids, frozen_trunk=mtp_only)
    return mtp if mtp_only else main + mtp_lambda * mtp


def make_train_step(
    cfg: DeepseekConfig, h: Hyper, tx, params_template, compute_dtype, mtp_lambda: float = 0.3, mtp_only=False
):
    import optax

    decay = weight_decay_mask(params_template)
    frozen = frozen_mask(params_template)
    if mtp_only:  # only the MTP layer trains
        frozen = jax.tree_util.tree_map_with_path(lambda p, f: f or not _path_has(p, model.MTP_GROUP), frozen)
    has_bias = cfg.n_routed_experts is not None and cfg.topk_method == "noaux_tc" and h.bias_rate > 0 and not mtp_only

    def loss_fn(params, ids):
        return objective(cast_for_compute(params, compute_dtype), cfg, ids, mtp_lambda, mtp_only)

    @jax.jit
    def step(params, opt_state, ids, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, ids)
        grads = jax.tree.map(lambda g, f: jnp.zeros_like(g) if f else g, grads, frozen)
        gnorm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        updates = jax.tree.map(
            lambda u, p, d, f: jnp.zeros_like(p) if f else -lr * (u + h.weight_decay * d * p),
            updates,
            params,
            decay,
            frozen,
        )
        new = optax.apply_updates(params, updates)
        metrics = {"loss": loss, "grad_norm": gnorm}
        if has_bias:
            rows = max(1, int(ids.shape[0] * h.probe_frac))
            loads, _ = routing_loads(
                cast_for_compute(jax.lax.stop_gradient(params), compute_dtype), cfg, ids[:rows, :-1]
            )
            loads = loads.astype(jnp.float32)  # [n_moe, E]
            mean = jnp.mean(loads, axis=-1, keepdims=True)
            mp = dict(new["model"])
            moe = dict(mp["moe_layers"])
            mlp = dict(moe["mlp"])
            gate = dict(mlp["gate"])
            gate["e_score_correction_bias"] = gate["e_score_correction_bias"] + h.bias_rate * jnp.sign(mean - loads)
            mlp["gate"] = gate
            moe["mlp"] = mlp
            mp["moe_layers"] = moe
            new = {**new, "model": mp}
            metrics["load_max_over_mean"] = jnp.mean(jnp.max(loads, axis=-1) / mean[:, 0])
        return new, opt_state, metrics

    return step


def make_eval(cfg: DeepseekConfig, compute_dtype, mtp_only: bool = False):
    """The selection loss: next-token CE (the MTP loss with mtp_only)."""

    @jax.jit
    def ev(params, ids):
        if mtp_only:
            return mtp_loss(cast_for_compute(params, compute_dtype), cfg, ids, frozen_trunk=True)[1]
        return lm_loss(cast_for_compute(params, compute_dtype), cfg, ids)

    return ev


# ---- data --------------------------------------------------------------------------------------------------
def load_corpus(data_dir: str, *, build_files: int | None = None, vocab_size: int = 4096) -> dict:
    """{'train': uint16 memmap, 'val': uint16 array, 'record': corpus.json, 'tokenizer': path}; builds the
    corpus with scripts/make_corpus.py when data_dir has none."""
    if not os.path.exists(os.path.join(data_dir, "train.bin")):
        if _HERE not in sys.path:
            sys.path.insert(0, _HERE)
        import make_corpus

        print(f"no corpus in {data_dir}: building it from this interpreter's stdlib", flush=True)
        make_corpus.build_corpus(data_dir, vocab_size=vocab_size, limit=build_files)
    with open(os.path.join(data_dir, "corpus.json")) as f:
        record = json.load(f)
    train = np.memmap(os.path.join(data_dir, "train.bin"), dtype=np.uint16, mode="r")
    val = np.fromfile(os.path.join(data_dir, "val.bin"), dtype=np.uint16)
    return {"train": train, "val": val, "record": record, "tokenizer": os.path.join(data_dir, "tokenizer.json")}


def train_batch(stream: np.ndarray, batch: int, seq: int, seed: int, step: int) -> np.ndarray:
    """Random windows of seq+1 tokens; a function of (seed, step) only, so a resumed run sees the same data."""
    rng = np.random.default_rng([seed, step])
    off = rng.integers(0, len(stream) - seq - 1, size=batch)
    return np.stack([stream[o : o + seq + 1] for o in off]).astype(np.int32)


def val_windows(stream: np.ndarray, seq: int, limit: int | None = None) -> np.ndarray:
    """Non-overlapping windows of seq+1 tokens covering the val stream ([n, seq+1]); `limit` picks n evenly."""
    n = (len(stream) - 1) // seq
    idx = np.arange(n)
    if limit is not None and limit < n:
        idx = np.linspace(0, n - 1, limit).round().astype(int)
    return np.stack([stream[i * seq : i * seq + seq + 1] for i in idx]).astype(np.int32)


def eval_loss(ev, params, windows: np.ndarray, batch: int) -> float:
    """Mean loss over windows (all of the same length, so the batch means weigh tokens equally)."""
    total, n = 0.0, 0
    for i in range(0, len(windows), batch):  # a shorter last batch compiles once more
        w = windows[i : i + batch]
        total += float(ev(params, jnp.asarray(w))) * len(w)
        n += len(w)
    return total / n


# ---- checkpoints -------------------------------------------------------------------------------------------
def _flat(tree, prefix: str) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + jax.tree_util.keystr(p): np.asarray(jax.device_get(x)) for p, x in leaves}


def save_checkpoint(path: str, params, opt_state, step: int, meta: dict) -> None:
    """float32 params + optimizer state as one safetensors file (no pickle); written atomically."""
    tensors = {**_flat(params, "params"), **_flat(opt_state, "opt")}
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"step": str(step), "meta": json.dumps(meta)})
    os.replace(tmp, path)


def load_checkpoint(path: str, params_template, opt_template):
    f = SafetensorsFile(path)

    def fill(tree, prefix):
        paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
        vals = []
        for p, x in paths:
            name = prefix + jax.tree_util.keystr(p)
            a = np.array(f.get(name))
            if a.size == 1 and x.size == 1:  # save_file stores 0-d arrays (Adam's count) as shape (1,)
                a = a.reshape(x.shape)
            if a.shape != tuple(x.shape):
                raise ValueError(f"{path}: '{name}' has shape {a.shape}, expected {tuple(x.shape)}")
            vals.append(jnp.asarray(a, x.dtype))
        return jax.tree_util.tree_unflatten(treedef, vals)

    return fill(params_template, "params"), fill(opt_template, "opt"), int(f.metadata["step"])


# ---- samples -----------------------------------------------------------------------------------------------
def samples(params, cfg: DeepseekConfig, tokenizer_path: str, eos_id: int, max_new_tokens: int = 96) -> list[dict]:
    """Greedy and sampled continuations of SAMPLE_PROMPTS through the engine (paged cache, xla backend)."""
    from tokenizers import Tokenizer

    from mla_jax.engine import EngineConfig, generate
    from mla_jax.sampling import SamplingParams

    tok = Tokenizer.from_file(tokenizer_path)
    prompts = [tok.encode(p).ids for p in SAMPLE_PROMPTS]
    sps = [
        SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(eos_id,)),
        SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, top_p=0.95, seed=1, stop_token_ids=(eos_id,)),
    ]
    out = []
    for sp in sps:
        longest = max(len(p) for p in prompts) + max_new_tokens
        ec = EngineConfig(
            max_model_len=max(64, 1 << (longest - 1).bit_length()),
            max_num_seqs=4,
            page_size=16,
            token_budget=256,
            max_prefills=4,
            cache_dtype="fp32",
            backend="xla",
        )
        res = generate(params, cfg, prompts, sp, ec)
        for text, r in zip(SAMPLE_PROMPTS, res):
            out.append(
                {
                    "prompt": text,
                    "temperature": sp.temperature,
                    "top_p": sp.top_p,
                    "seed": sp.seed,
                    "completion": tok.decode(r.token_ids),
                }
            )
    return out


# ---- main --------------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train the embedded DeepSeek-V3-architecture demo model.")
    p.add_argument("--data", default=".cache/demo-corpus", help="corpus dir from scripts/make_corpus.py")
    p.add_argument("--out", required=True, help="writes OUT/demo/ (HF checkpoint) and OUT/train-demo.json")
    p.add_argument("--ckpt-dir", default=".cache/train-demo", help="training checkpoints (f32 params + Adam)")
    p.add_argument("--resume", default=None, help="continue from this checkpoint file")
    p.add_argument("--tiny", action="store_true", help="tiny dims and a few steps: a quick CPU check")
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--steps", type=int, default=None, help="maximum steps (default 100000; --tiny 30)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="wall budget of the whole script (training stops --reserve-minutes before)",
    )
    p.add_argument(
        "--reserve-minutes",
        type=float,
        default=None,
        help="kept for the final eval, export and samples (default 1.5; --tiny 0.5)",
    )
    p.add_argument("--batch-size", type=int, default=None, help="default 64 (--tiny 4)")
    p.add_argument("--seq-len", type=int, default=None, help="default 512 (--tiny 64)")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--bias-rate", type=float, default=1e-3, help="aux-loss-free bias update speed (0: off)")
    p.add_argument(
        "--compute-dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="forward/backward dtype (master weights stay fp32); default bf16 on GPU, fp32 on CPU",
    )
    p.add_argument("--export-dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--eval-every", type=int, default=None, help="default 100 (--tiny 10)")
    p.add_argument("--eval-windows", type=int, default=None, help="val windows per periodic eval (64; --tiny 8)")
    p.add_argument(
        "--final-eval-windows",
        type=int,
        default=None,
        help="val windows for the final loss of the exported weights (default: all)",
    )
    p.add_argument("--log-every", type=int, default=None, help="default 50 (--tiny 5)")
    p.add_argument("--ckpt-every", type=int, default=None, help="default 1000 (--tiny 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--corpus-files", type=int, default=None, help="when building the corpus: keep only the first N files (tests)"
    )
    p.add_argument("--vocab-size", type=int, default=None, help="when building the corpus (default 4096)")
    p.add_argument("--sample-tokens", type=int, default=96, help="tokens per sample in the record (0: none)")
    p.add_argument("--mtp-layers", type=int, default=0, help="MTP layers trained with DeepSeek's MTP loss (0: none)")
    p.add_argument("--mtp-lambda", type=float, default=0.3, help="weight of the MTP loss")
    p.add_argument("--mtp-only", action="store_true", help="train only the MTP layer(s) on the frozen --init model")
    p.add_argument("--init", default=None, help="with --mtp-only: the HF model directory to start from")
    p.add_argument(
        "--mtp-warm-start",
        action="store_true",
        help="with --mtp-only: continue from the MTP layer(s) --init ships instead of a fresh one",
    )
    p.add_argument(
        "--native-ragged-dot",
        action="store_true",
        help="keep XLA's ragged-dot instruction for the MoE matmuls on GPU (see the module doc)",
    )
    a = p.parse_args(argv)
    tiny = a.tiny
    dflt = dict(
        preset="tiny" if tiny else "demo",
        steps=30 if tiny else 100_000,
        batch_size=4 if tiny else 64,
        seq_len=64 if tiny else 512,
        lr=3e-3 if tiny else 2e-3,
        warmup_steps=5 if tiny else 200,
        eval_every=10 if tiny else 100,
        eval_windows=8 if tiny else 64,
        log_every=5 if tiny else 50,
        ckpt_every=20 if tiny else 1000,
        vocab_size=512 if tiny else 4096,
        reserve_minutes=0.5 if tiny else 1.5,
    )
    for k, v in dflt.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if tiny and a.corpus_files is None:
        a.corpus_files = 40
    if a.mtp_only and not (a.init and a.mtp_layers > 0):
        p.error("--mtp-only needs --init DIR and --mtp-layers >= 1")
    return a


def run(args: argparse.Namespace) -> dict:
    """Trains, exports and writes the record (see the module doc); returns the record."""
    flag = "jax_ragged_dot_use_ragged_dot_instruction"
    old = getattr(jax.config, flag)
    jax.config.update(flag, args.native_ragged_dot)
    try:
        return _run(args)
    finally:
        jax.config.update(flag, old)  # callers in the same process (tests) keep their setting


def _run(args: argparse.Namespace) -> dict:
    t_start = time.time()
    backend = jax.default_backend()
    compute_dtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[
        args.compute_dtype or ("fp32" if backend == "cpu" else "bf16")
    ]
    budget_s = args.max_minutes * 60 if args.max_minutes else float("inf")
    train_deadline = t_start + budget_s - args.reserve_minutes * 60

    data = load_corpus(args.data, build_files=args.corpus_files, vocab_size=args.vocab_size)
    crec = data["record"]
    vocab = crec["vocab_size"]
    vocab = -(-vocab // 64) * 64  # lm_head rows padded to a multiple of 64 (unused ids are never targets)
    cfg = model_config(args.preset, vocab, args.seq_len)
    if args.mtp_only:  # the trunk of --init, frozen; a fresh MTP layer
        from mla_jax.checkpoint import load_hf_checkpoint

        cfg0, trunk = load_hf_checkpoint(args.init, dtype=jnp.float32)
        if cfg0.vocab_size != vocab:
            raise ValueError(f"--init {args.init}: vocab {cfg0.vocab_size} != the corpus's {vocab}")
        cfg = dataclasses.replace(cfg0, num_nextn_predict_layers=args.mtp_layers)
    elif args.mtp_layers:
        cfg = dataclasses.replace(cfg, num_nextn_predict_layers=args.mtp_layers)
    h = Hyper(lr=args.lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, bias_rate=args.bias_rate)
    tx = make_optimizer(h)
    params = init_train_params(cfg, args.seed)
    if args.mtp_only:  # a fresh MTP layer, or with --mtp-warm-start the one --init ships
        warm = args.mtp_warm_start and cfg0.num_mtp_layers == args.mtp_layers
        if args.mtp_warm_start and not warm:
            raise ValueError(
                f"--mtp-warm-start: {args.init} has {cfg0.num_mtp_layers} MTP layers, not {args.mtp_layers}"
            )
        mtp = (trunk if warm else params)["model"][model.MTP_GROUP]
        params = {**trunk, "model": {**trunk["model"], model.MTP_GROUP: mtp}}
    opt_state = tx.init(params)
    start_step = 0
    if args.resume:
        params, opt_state, start_step = load_checkpoint(args.resume, params, opt_state)
        print(f"resumed from {args.resume} at step {start_step}", flush=True)
    counts = count_params(params, cfg)
    print(
        f"model: {args.preset} {counts}; corpus {crec['tokens']} tokens; {backend}, compute "
        f"{jnp.dtype(compute_dtype).name}; batch {args.batch_size}x{args.seq_len}",
        flush=True,
    )

    step_fn = make_train_step(cfg, h, tx, params, compute_dtype, args.mtp_lambda, args.mtp_only)
    ev = make_eval(cfg, compute_dtype, args.mtp_only)
    val_small = val_windows(data["val"], args.seq_len, args.eval_windows)
    os.makedirs(args.ckpt_dir, exist_ok=True)
    ckpt_path = os.path.join(args.ckpt_dir, "train_state.safetensors")
    out_dir = os.path.join(args.out, "demo")
    os.makedirs(args.out, exist_ok=True)

    curve: list[dict] = []
    vcurve: list[dict] = []
    best = (float("inf"), -1, None)
    acc: list = []
    step = start_step
    loop_t0 = None
    steps_done_at_t0 = start_step
    compile_s = None
    stop_reason = "steps"
    ckpt_meta = {"preset": args.preset, "seed": args.seed, "vocab_size": vocab}

    def do_eval(step):
        nonlocal best
        v = eval_loss(ev, params, val_small, args.batch_size)
        vcurve.append(
            {
                "step": step,
                "tokens": step * args.batch_size * args.seq_len,
                "elapsed_s": round(time.time() - t_start, 1),
                "val_loss": round(v, 5),
            }
        )
        if v < best[0]:
            best = (v, step, jax.device_get(params))
        print(f"step {step}: val {v:.4f} (best {best[0]:.4f} @ {best[1]})", flush=True)

    while step < args.steps:
        now = time.time()
        if now > train_deadline:
            stop_reason = "time"
            break
        if loop_t0 is None:
            progress = step / args.steps
        else:
            frac_t = (now - loop_t0) / max(1e-9, train_deadline - loop_t0)
            progress = max(step / args.steps, frac_t)
        lr = lr_at(h, step, progress)
        ids = jnp.asarray(train_batch(data["train"], args.batch_size, args.seq_len, args.seed, step))
        params, opt_state, m = step_fn(params, opt_state, ids, jnp.float32(lr))
        step += 1
        if loop_t0 is None:  # the first step compiled: time from here
            jax.block_until_ready(m["loss"])
            compile_s = time.time() - now
            loop_t0 = time.time()
            steps_done_at_t0 = step
        acc.append((m, lr))
        if step % args.log_every == 0 or step == args.steps:
            ms = jax.device_get([a[0] for a in acc])
            row = {
                "step": step,
                "tokens": step * args.batch_size * args.seq_len,
                "elapsed_s": round(time.time() - t_start, 1),
                "lr": acc[-1][1],
                "train_loss": round(float(np.mean([x["loss"] for x in ms])), 5),
                "grad_norm": round(float(np.mean([x["grad_norm"] for x in ms])), 4),
            }
            if "load_max_over_mean" in ms[0]:
                row["load_max_over_mean"] = round(float(np.mean([x["load_max_over_mean"] for x in ms])), 3)
            if not math.isfinite(row["train_loss"]):
                raise FloatingPointError(f"loss is {row['train_loss']} at step {step}")
            curve.append(row)
            acc = []
            rate = (step - steps_done_at_t0) / max(1e-9, time.time() - loop_t0)
            print(
                f"step {step}: train {row['train_loss']:.4f} lr {lr:.2e} gnorm {row['grad_norm']:.3f} "
                f"{rate:.2f} steps/s",
                flush=True,
            )
        if step % args.eval_every == 0:
            do_eval(step)
        if step % args.ckpt_every == 0:
            save_checkpoint(ckpt_path, params, opt_state, step, ckpt_meta)
    train_s = time.time() - (loop_t0 or time.time())
    if not vcurve or vcurve[-1]["step"] != step:
        do_eval(step)
    save_checkpoint(ckpt_path, params, opt_state, step, ckpt_meta)

    # Export the best params, load them back as a user would, and score the whole val split with them.
    from mla_jax.checkpoint import export_hf, load_hf_checkpoint

    best_val, best_step, best_params = best
    files = export_hf(
        best_params,
        cfg,
        data["tokenizer"],
        out_dir,
        dtype=args.export_dtype,
        eos_token=crec["eos_token"],
        model_max_length=args.seq_len,
        metadata={"trained_by": "scripts/train_demo.py", "step": str(best_step)},
    )
    cfg2, loaded = load_hf_checkpoint(out_dir, dtype=jnp.float32)
    assert cfg2 == cfg, "exported config.json does not round-trip"
    if args.mtp_only:
        check_trunk_unchanged(args.init, out_dir, cfg)
    ev32 = ev if compute_dtype == jnp.float32 else make_eval(cfg, jnp.float32, args.mtp_only)
    val_all = val_windows(data["val"], args.seq_len, args.final_eval_windows)
    final_val = eval_loss(ev32, loaded, val_all, args.batch_size)
    print(
        f"exported step {best_step} to {out_dir} {files}; val loss of the exported weights (fp32 compute, "
        f"{len(val_all)} windows): {final_val:.4f}",
        flush=True,
    )
    steps_run = step - start_step
    rec = {
        "what": "training record of the embedded demo model (scripts/train_demo.py)",
        "date": time.strftime("%Y-%m-%d"),
        "device": f"{backend}: {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "python": platform.python_version(),
        "argv": sys.argv[1:] if __name__ == "__main__" else None,
        "model": {
            "preset": args.preset,
            "config": json.loads(open(os.path.join(out_dir, "config.json")).read()),
            "params": counts,
        },
        "corpus": {k: v for k, v in crec.items() if k not in ("dropped_files",)},
        "hyper": {
            **dataclasses.asdict(h),
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "tokens_per_step": args.batch_size * args.seq_len,
            "max_steps": args.steps,
            "max_minutes": args.max_minutes,
            "compute_dtype": jnp.dtype(compute_dtype).name,
            "master_dtype": "float32",
            "export_dtype": args.export_dtype,
            "seed": args.seed,
            "optimizer": "AdamW (optax clip_by_global_norm + scale_by_adam, decoupled decay on matrices)",
            "schedule": "linear warmup, cosine to min_lr_frac over min(max_steps, time budget)",
            "routing_bias": "aux-loss-free: bias += bias_rate * sign(mean_load - load) per step",
            "moe_matmul": "native ragged-dot" if args.native_ragged_dot else "dense decomposition",
        },
        "run": {
            "steps": step,
            "steps_this_run": steps_run,
            "resumed_from_step": start_step,
            "tokens_seen": step * args.batch_size * args.seq_len,
            "stop": stop_reason,
            "compile_s": round(compile_s or 0.0, 1),
            "train_s": round(train_s, 1),
            "steps_per_s": round((step - steps_done_at_t0) / train_s, 3) if train_s > 0 else None,
            "wall_s": round(time.time() - t_start, 1),
        },
        "exported": {"step": best_step, "val_loss_at_export_step": round(best_val, 5), "files": files},
        "final_val_loss": round(final_val, 5),
        "final_val_loss_note": f"mean next-token NLL (nats) over {len(val_all)} non-overlapping "
        f"{args.seq_len}-token windows of the val split "
        f"({'all' if args.final_eval_windows is None else 'evenly spaced'}), exported "
        f"{args.export_dtype} "
        "weights loaded back, fp32 compute",
        "final_val_bits_per_byte": round(final_val / math.log(2) / crec["bytes_per_token"], 4),
        "curve": curve,
        "val_curve": vcurve,
        "samples": [],
    }
    if cfg.num_mtp_layers:
        rec["mtp"] = {
            "layers": cfg.num_mtp_layers,
            "lambda": None if args.mtp_only else args.mtp_lambda,
            "mtp_only": args.mtp_only,
            "init": args.init,
            "final_val_loss_is": "MTP loss (token p+2)" if args.mtp_only else "next-token loss",
            "acceptance": mtp_acceptance(
                loaded, cfg, data["tokenizer"], crec["eos_token_id"], args.sample_tokens or 64
            ),
        }
        print(f"MTP acceptance: {rec['mtp']['acceptance']}", flush=True)
    write_record(args.out, rec)  # before the samples: a run killed during them keeps its record
    if args.sample_tokens and time.time() < t_start + budget_s - 20:
        try:
            rec["samples"] = samples(loaded, cfg, data["tokenizer"], crec["eos_token_id"], args.sample_tokens)
        except Exception as e:  # the record is still written; the error is kept in it
            rec["samples"] = [{"error": f"{type(e).__name__}: {e}"}]
        for s in rec["samples"]:
            print(json.dumps(s), flush=True)
    rec["run"]["wall_s"] = round(time.time() - t_start, 1)
    write_record(args.out, rec)
    print(
        f"done in {rec['run']['wall_s']} s: {step} steps, final val loss {final_val:.4f} -> "
        f"{os.path.join(args.out, 'train-demo.json')}",
        flush=True,
    )
    return rec


def check_trunk_unchanged(init_dir: str, out_dir: str, cfg: DeepseekConfig) -> None:
    """Every trunk tensor of init_dir's model.safetensors (an MTP layer it has aside) is in out_dir's with the
    same dtype and bytes."""
    a = SafetensorsFile(os.path.join(init_dir, "model.safetensors"))
    b = SafetensorsFile(os.path.join(out_dir, "model.safetensors"))
    mtp = tuple(f"model.layers.{cfg.num_hidden_layers + j}." for j in range(cfg.num_mtp_layers))
    for name in a.keys():
        if name.startswith(mtp):
            continue
        x, y = np.asarray(a.get(name)), np.asarray(b.get(name))
        if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
            raise AssertionError(f"exported trunk tensor {name} differs from {init_dir}'s")


def mtp_acceptance(params, cfg: DeepseekConfig, tokenizer_path: str, eos_id: int, max_new_tokens: int) -> dict:
    """Greedy speculative decoding with the MTP drafter on SAMPLE_PROMPTS: {f"k={k}": accepted / drafted}."""
    from tokenizers import Tokenizer

    from mla_jax.engine import EngineConfig, generate
    from mla_jax.sampling import SamplingParams

    tok = Tokenizer.from_file(tokenizer_path)
    prompts = [tok.encode(p).ids for p in SAMPLE_PROMPTS]
    longest = max(len(p) for p in prompts) + max_new_tokens
    out = {}
    for k in (1, 2, 3):
        ec = EngineConfig(
            max_model_len=max(64, 1 << (longest - 1).bit_length()),
            max_num_seqs=4,
            page_size=16,
            token_budget=256,
            max_prefills=4,
            cache_dtype="fp32",
            backend="xla",
            num_speculative_tokens=k,
            speculative_method="mtp",
        )
        res = generate(params, cfg, prompts, SamplingParams(max_new_tokens=max_new_tokens), ec)
        drafted = sum(r.num_draft_tokens for r in res)
        out[f"k={k}"] = round(sum(r.num_accepted_tokens for r in res) / max(1, drafted), 4)
    return out


def write_record(out: str, rec: dict) -> None:
    tmp = os.path.join(out, "train-demo.json.tmp")
    with open(tmp, "w") as f:
        json.dump(rec, f, indent=1)
        f.write("\n")
    os.replace(tmp, os.path.join(out, "train-demo.json"))


def main(argv=None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
