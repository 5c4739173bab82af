#!/usr/bin/env bash
# The next GPU session's measurements (docs/perf-notes.md, "Next GPU session"), one part per 10-minute device call:
#     scripts/gpu_session.sh PART OUT        (on the H200 machine, from the repository root)
# Each command has its own time limit inside the call's; logs and results go to OUT/PART (one folder, tar it if the
# files are many). Issue the next part at once: the machine is released after 30 s idle.
set -uo pipefail
part=${1:?part 1-4}
out=${2:?output directory}/p$part
mkdir -p "$out"
export JAX_PLATFORMS=cuda,cpu PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false

run() {  # run LIMIT_S NAME CMD...: the command's output in OUT/NAME.log, its status and time on stdout
  local limit=$1 name=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s"
  grep -v Warning "$out/$name.log" | tail -4 | cut -c1-300
}

case $part in
1)  # the kernels that run in every GPU step since the last run, then the V3 slice (the alignment fix, fp8)
    run 200 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 6 -m gpu -p no:cacheprovider \
        tests/pallas_kernels/test_rms_norm.py tests/mla_jax/test_engine.py tests/pallas_kernels/test_mla_decode_sm90.py
    run 330 e2e-v3 python3 -m mla_jax.bench.e2e --out "$out" --model v3-slice --weights bf16,fp8 --batches 1,32,128 \
        --ctxs 1024 ;;
2)  # V2-Lite with distinct input ids, traced (kernels_per_step at the current code)
    run 560 e2e-bf16 python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,8,32,128 --ctxs 1024,4096 \
        --profile "$out/prof" ;;
3)  # fp8 weights with real routing; the verify step with distinct drafts and 48 rows on the Hopper decode
    run 280 e2e-fp8 python3 -m mla_jax.bench.e2e --out "$out" --weights fp8 --batches 1,32,128 --ctxs 1024,4096
    run 280 spec python3 bench/spec.py --out "$out" --ks 1,2,3 --batches 1,8,32 --ctxs 1024 --no-demo ;;
4)  # the work-list metadata kernel (ragged rows), then the rest of the gpu suite
    run 240 decode python3 bench/decode.py --out "$out" --device-time --shapes 128x16x8192 --no-check --dtypes bf16
    run 300 gpu-tests-rest python3 -m pytest -v -n 6 -m gpu -p no:cacheprovider tests ;;
*)  echo "part must be 1-4" >&2; exit 2 ;;
esac
