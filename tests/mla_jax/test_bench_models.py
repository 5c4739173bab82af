"""The benchmark model shapes (`mla_jax.bench.common.BENCH_MODELS`): the V3 slice keeps V3's structure at few layers,
and its smoke dims run one decode row of the e2e benchmark on CPU."""

import jax
import jax.numpy as jnp
import pytest

from mla_jax import model
from mla_jax.bench.common import BENCH_MODELS, v3_slice_config
from mla_jax.bench.e2e import main as e2e_main
from mla_jax.config import DEEPSEEK_V3


def test_v3_slice_is_v3_cut_to_a_dense_and_a_moe_layer():
    make, layers, _ = BENCH_MODELS["v3-slice"]
    cfg = make(layers)
    assert (cfg.num_hidden_layers, cfg.first_k_dense_replace) == (2, 1)
    keys = ("hidden_size", "num_attention_heads", "q_lora_rank", "n_routed_experts", "num_experts_per_tok", "n_group")
    for k in keys:
        assert getattr(cfg, k) == DEEPSEEK_V3[k], k
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16))
    experts = params["model"]["moe_layers"]["mlp"]["experts"]
    assert all(x.shape[:2] == (1, 256) for x in jax.tree.leaves(experts))  # one MoE layer, all 256 experts
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert 25e9 < nbytes < 32e9  # what the e2e benchmark puts on one GPU in bf16 (BENCH_MODELS' comment)


def test_v3_slice_smoke_runs_the_e2e_benchmark(tmp_path):
    cfg = v3_slice_config(2, smoke=True)
    assert cfg.n_routed_experts % cfg.n_group == 0 and cfg.q_lora_rank
    args = ["--smoke", "--model", "v3-slice", "--no-prefill", "--batches", "1", "--ctxs", "32"]
    e2e_main(args + ["--out", str(tmp_path)])
    assert (tmp_path / "e2e-v3-slice-h200.json").exists() and not (tmp_path / "e2e-h200.json").exists()


def test_roofline_bytes_count_the_embedding_rows_read_not_the_table():
    """`weight_bytes`: all weights but the routed experts and the embedding table, plus the expected experts hit and
    one embedding row per token (the whole table if tied to the lm_head)."""
    from mla_jax.bench.e2e import weight_bytes

    cfg = v3_slice_config(2, smoke=True)
    params = jax.eval_shape(lambda: model.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16))
    size = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    embed = params["model"]["embed_tokens"]["weight"]
    row = embed.shape[1] * embed.dtype.itemsize
    experts = size(params["model"]["moe_layers"]["mlp"]["experts"])
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    rest = size(params) - experts - size(embed)
    for t in (1, 3):
        assert weight_bytes(params, cfg, t) == pytest.approx(
            rest + experts * (1 - (1 - k / E) ** t) + t * row, rel=1e-12
        )
    tied = {**params}
    del tied["lm_head"]
    assert weight_bytes(tied, cfg, 1) == pytest.approx(
        rest - size(params["lm_head"]) + experts * k / E + size(embed), rel=1e-12
    )


def test_trace_kernels_map_to_their_step_parts():
    """A kernel of the trace finds its layer part from the optimized HLO's named scopes: a fusion by its name, a
    Pallas call by its kernel's, also as the layer loop's second copy ("<name>__1") and a Mosaic GPU kernel
    ("<name>_mosaic_gpu_kernel"); anything else is "other"."""
    from mla_jax.bench.common import hlo_op_parts, kernel_part

    hlo = "\n".join(
        [
            '  %input_reduce_fusion.2 = bf16[16]{0} fusion(%a), metadata={op_name="jit(s)/while/body/o_proj/dot"}',
            '  %pallas_call.7 = bf16[8]{0} custom-call(%b), metadata={op_name="jit(s)/mla_project/linear2_dot/'
            'pallas_call"}',
            '  %pallas_call.9 = bf16[8]{0} custom-call(%c), metadata={op_name="jit(s)/attention/mla_decode_sm90_g1/'
            'pallas_call"}',
            # a Mosaic GPU kernel (`plgpu.kernel`): its name scope sits above "mpmd_map"
            '  %custom-call.4 = bf16[8]{0} custom-call(%d), metadata={op_name="jit(s)/while/body/attention/'
            'jit(mla_decode_sm90)/mla_decode_sm90_narrow_bf16_m16_s64_stages2/mpmd_map"}',
        ]
    )
    parts = hlo_op_parts(hlo)
    assert kernel_part(parts, "input_reduce_fusion_2", "command_buffer_3") == "o_proj"
    assert kernel_part(parts, "linear2_dot", "command_buffer_3") == "mla_project"
    assert kernel_part(parts, "linear2_dot__1", "command_buffer_3") == "mla_project"
    assert kernel_part(parts, "mla_decode_sm90_g1_mosaic_gpu_kernel", "x") == "attention"
    assert kernel_part(parts, "memcpy32_post", "command_buffer_3") == "other"
    assert kernel_part(parts, "mla_decode_sm90_narrow_bf16_m16_s64_stages2_mosaic_gpu_kernel", "command_buffer_3") == (
        "attention"
    )


def test_results_header_names_the_xla_flags(monkeypatch):
    """A results file says which XLA_FLAGS its run compiled with (they change what a row measures), and has no such
    key when none were set."""
    from mla_jax.bench.common import results_header

    monkeypatch.setenv("XLA_FLAGS", " --xla_gpu_command_buffer_scheduling_mode=CONCURRENT ")
    head = results_header({"copy_TBps": 1.0})
    assert head["xla_flags"] == "--xla_gpu_command_buffer_scheduling_mode=CONCURRENT"
    assert {"gpu", "date", "jax", "commit", "ceilings", "rows"} <= set(head)
    monkeypatch.delenv("XLA_FLAGS")
    assert "xla_flags" not in results_header({})
