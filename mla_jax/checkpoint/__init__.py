"""Checkpoints: reading Hugging Face DeepSeek checkpoints, converting them to mla-jax's orbax format, loading
either kind, and exporting our params back to HF.

    cfg, params = load_model(path, mesh=mesh)       # a converted checkpoint or an HF directory
    convert(hf_dir, out_dir, dtype="bf16")          # or: mla-jax convert HF_DIR OUT_DIR

Modules:
    hf        safetensors files and HF directories, tensor by tensor through the `safetensors` library
    fp8       DeepSeek-V3 block-FP8: dequantization, and fp8 weights at run time (`quantize_params`)
    validate  an HF checkpoint against its config: names, shapes, dtypes, fp8 scales (headers only)
    params    HF tensors -> our params pytree; `load_hf_checkpoint`
    layout    the converted directory: metadata file, groups, format version
    plan      conversion planning: units and groups of the converted checkpoint
    write     `convert`: materializing, orbax writes, atomic output directory, metadata, progress
    load      `load_model`, `load_checkpoint`, `abstract_params`, `read_metadata`
    export    our params -> an HF DeepSeek-V3 checkpoint (`export_hf`)
"""

from mla_jax.checkpoint.export import export_hf, hf_config_dict, hf_tensors, merge_kv_b_proj
from mla_jax.checkpoint.fp8 import dequantize_fp8_blocks, quantize_params
from mla_jax.checkpoint.hf import CheckpointDir, CheckpointError, SafetensorsFile, eos_token_ids, save_file
from mla_jax.checkpoint.load import abstract_params, is_converted, load_checkpoint, load_model, read_metadata
from mla_jax.checkpoint.params import build_params, load_hf_checkpoint
from mla_jax.checkpoint.plan import ConvertError, make_plan
from mla_jax.checkpoint.validate import hf_tensor_specs, mtp_layer_index
from mla_jax.checkpoint.write import ConvertResult, convert

__all__ = [
    "CheckpointDir",
    "CheckpointError",
    "ConvertError",
    "ConvertResult",
    "SafetensorsFile",
    "abstract_params",
    "build_params",
    "convert",
    "dequantize_fp8_blocks",
    "eos_token_ids",
    "export_hf",
    "hf_config_dict",
    "hf_tensor_specs",
    "hf_tensors",
    "is_converted",
    "load_checkpoint",
    "load_hf_checkpoint",
    "load_model",
    "make_plan",
    "merge_kv_b_proj",
    "quantize_params",
    "mtp_layer_index",
    "read_metadata",
    "save_file",
]
