#!/usr/bin/env bash
# A GPU session's measurements, one part per 10-minute device call (part 1: what session 11 ran; the next list is in
# docs/perf-notes.md, "Next GPU session"):
#     MLA_JAX_COMMIT=<local HEAD> scripts/gpu_session.sh PART OUT     (on the H200 machine, from the repository root)
# The machine's copy of the tree may carry a stale .git: pass the commit, or the results name the wrong one.
# Each command has its own time limit inside the call's; logs and results go to OUT/PART (one folder, tar it if the
# files are many). Issue the next part at once: the machine is released after 30 s idle.
set -uo pipefail
part=${1:?part 1}
out=${2:?output directory}/p$part
mkdir -p "$out"
export JAX_PLATFORMS=cuda,cpu PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
export MLA_JAX_COMMIT=${MLA_JAX_COMMIT:?the local HEAD the tree was copied at}

run() {  # run LIMIT_S NAME CMD...: the command's output in OUT/NAME.log, its status and time on stdout
  local limit=$1 name=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - t0)) s"
  grep -v Warning "$out/$name.log" | tail -4 | cut -c1-300
}

verbose_tests() {  # verbose_tests LIMIT_S PYTEST_ARGS...: GPU tests in OUT/gpu-tests.log, interrupted (not killed) at
    # the limit so that the log names every result (-v)
    local limit=$1 t0=$SECONDS
    shift
    timeout -s INT "$limit" env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 8 -m gpu -p no:cacheprovider -rfE \
        --durations=5 "$@" >"$out/gpu-tests.log" 2>&1
    echo "gpu-tests: rc=$? $((SECONDS - t0)) s"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu-tests.log" | cut -c1-160 | tail -16
}

overlay_trees() {  # /tmp/wide: this tree with items by group up to 1024 copies; /tmp/base (if ab/base/ was carried):
    # this tree with ab/base's files over it (an earlier commit's, for an A/B in one call)
    rm -rf /tmp/wide /tmp/base && mkdir /tmp/wide && cp -r mla_jax pallas_kernels bench /tmp/wide/
    sed -i 's/^BY_GROUP_MAX_COPIES = 256$/BY_GROUP_MAX_COPIES = 1024/' /tmp/wide/mla_jax/layers.py
    grep -q "^BY_GROUP_MAX_COPIES = 1024" /tmp/wide/mla_jax/layers.py || echo "overlay_trees: no BY_GROUP_MAX_COPIES" >&2
    if [ -d ab/base ]; then
        mkdir /tmp/base && cp -r mla_jax pallas_kernels bench /tmp/base/ && cp -r ab/base/* /tmp/base/
    fi
}

sorted_tree() {  # /tmp/sorted: this tree with items by group up to 256 copies (the default before 1024, session 34):
    # batch 128's and the verify step's copies sorted
    rm -rf /tmp/sorted && mkdir /tmp/sorted && cp -r mla_jax pallas_kernels bench /tmp/sorted/
    sed -i 's/^BY_GROUP_MAX_COPIES = 1024$/BY_GROUP_MAX_COPIES = 256/' /tmp/sorted/mla_jax/layers.py
    grep -q "^BY_GROUP_MAX_COPIES = 256" /tmp/sorted/mla_jax/layers.py || echo "sorted_tree: no BY_GROUP_MAX_COPIES" >&2
}
ab_copy() {  # ab_copy DIR FILE SED_EXPR PATTERN: this tree's code in DIR with FILE edited by SED_EXPR (for an A/B in one
    # call); PATTERN must then be in FILE, else the knob moved (said on stderr)
    rm -rf "$1" && mkdir "$1" && cp -r mla_jax pallas_kernels bench "$1/"
    sed -i "$3" "$1/$2"
    grep -q "$4" "$1/$2" || echo "$1: no knob in $2" >&2
}

trace_ab() {  # trace_ab TAG SED_EXPR PATTERN: the 64-row kernel's bf16 trace (L=384) of this tree in OUT/trace-base
    # and of a copy with mla_decode_sm90.py edited by SED_EXPR (PATTERN then in it) in OUT/trace-TAG
    ab_copy "/tmp/$1" pallas_kernels/mla_decode_sm90.py "$2" "$3"
    run 40 trace-base python3 bench/trace_sm90.py --out "$out/trace-base" --dtype bf16
    (cd "/tmp/$1" && run 40 "trace-$1" python3 bench/trace_sm90.py --out "$out/trace-$1" --dtype bf16)
    grep -E "per page|wg[012] " "$out/trace-base.log" "$out/trace-$1.log" | head -30
}

knob_check() {  # knob_check TAG NAME=VALUE: the sm90 decode's GPU check cases with mla_decode_sm90.NAME = VALUE
    # (bench/decode.py --knob), and one small bf16 row, in OUT/decode-TAG-check
    run 400 "decode-$1-check" python3 bench/decode.py --out "$out/decode-$1-check" --quick --no-ragged --device-time \
        --kernels pallas_sm90 --shapes 1x128x32768 --dtypes bf16 --only schedule=grid --knob "mla_decode_sm90.$2"
    grep -E "^correctness|FAIL|^check" "$out/decode-$1-check.log" | cut -c1-160 | head -30
}

verify_b32k2() {  # verify_b32k2 NAME LIMIT_S BUDGET_MIN: the verify step at batch 32, k = 2, ctx 1k (issue 24's row) in
    # OUT/spec-NAME, from this directory's code
    run "$2" "spec-$1" python3 bench/spec.py --out "$out/spec-$1" --no-demo --batches 32 --ks 2 --ctxs 1024 \
        --mtp-ks "" --budget-min "$3"
}

caches_after_tests() {  # the e2e cache dtypes: bf16,fp8, or bf16 alone (noted in OUT/FALLBACK) if the GPU tests failed
    if ! grep -q " passed" "$out/gpu-tests.log" || grep -q "failed" "$out/gpu-tests.log"; then
        echo "decode GPU tests failed: e2e with the bf16 cache only" | tee "$out/FALLBACK" >&2
        echo bf16
    else
        echo bf16,fp8
    fi
}

case $part in
1)  # the norms read in place (LayerRow) on the GPU; the batch-1/128 step's copies (their compiled HLO); does a page
    # pool over 4 GB (64-bit offsets in the Triton lowering) slow the Triton decode (e2e's batch-128 attention ran at
    # half the kernel benchmark's bandwidth); do the per-layer weight copies at batch 128 go with XLA's dynamic-slice
    # fusion; the batch-1 attention's splits
    run 100 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider \
        tests/pallas_kernels/test_rms_norm.py tests/mla_jax/test_engine.py
    run 130 e2e-hlo python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,128 --ctxs 4096 --no-prefill \
        --profile "$out/prof"
    tar czf "$out/../hlo.tgz" -C "$out/prof" $(cd "$out/prof" && ls -d */step.hlo.txt)
    rm -rf "$out/prof"
    run 110 decode-pool python3 bench/decode.py --out "$out" --no-check --no-ragged --device-time --dtypes bf16 \
        --shapes 128x16x4096 --pool-gb 4.0,4.6,16
    mkdir -p "$out/dsf"
    run 80 e2e-dsf env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true python3 -m mla_jax.bench.e2e \
        --out "$out/dsf" --weights bf16 --batches 128 --ctxs 4096 --no-prefill --profile "$out/dsf/prof"
    rm -rf "$out/dsf/prof"
    run 70 decode-b1-sweep python3 bench/decode.py --out "$out" --no-check --no-ragged --device-time --dtypes bf16 \
        --shapes 1x16x4096,1x16x1024 --kernels pallas --sweep --sweep-budget-s 50 ;;
2)  # session 12, first call: the gpu tests of the model (the fp8 linears read in place, the Hopper decode at 16
    # rows over a pool above 4 GB, the batch-1 Triton splits), then batch 32 / 128 e2e with both weight formats
    run 220 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rfE \
        tests/mla_jax tests/pallas_kernels/test_mla_decode.py tests/pallas_kernels/test_fp8_matmul.py
    run 330 e2e-b32-128 python3 -m mla_jax.bench.e2e --out "$out" --weights bf16,fp8 --batches 32,128 \
        --ctxs 1024,4096 --no-prefill --profile "$out/prof"
    rm -rf "$out/prof"
    tar czf "$out.tgz" -C "$out" . && rm -rf "$out" ;;
3)  # session 12, second call: the unsorted decode copies (row_groups) and the fused gate/up kernel on the GPU,
    # the batch-1 step with both (profile), batch 8 / 128 with the fused gate/up; the batch-1 decode over a 16 GB
    # pool on both kernels (the Hopper one is what a large pool now gets); the fp8 step at batch 1 / 128
    run 150 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py tests/pallas_kernels/test_fp8_matmul.py \
        tests/mla_jax/test_moe_stacked.py -k "row_groups or glu or stacked or temp"
    run 200 e2e-bf16 python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,8,128 --ctxs 1024,4096 \
        --no-prefill --profile "$out/prof"
    rm -rf "$out/prof"
    run 70 decode-b1-pool python3 bench/decode.py --out "$out" --no-check --no-ragged --device-time --dtypes bf16 \
        --shapes 1x16x4096,1x16x1024 --pool-gb 16
    mkdir -p "$out/fp8"
    run 130 e2e-fp8 python3 -m mla_jax.bench.e2e --out "$out/fp8" --weights fp8 --batches 1,128 --ctxs 4096 \
        --no-prefill
    tar czf "$out.tgz" -C "$out" . && rm -rf "$out" ;;
4)  # session 12, third call: the router kernel, the in-kernel layer clamps and batch 1 back on Triton over a large
    # pool on the GPU; then the whole bf16 grid at this commit (the committed rows) and the fp8 step. Should the
    # router kernel fail its tests, the grid runs with the router's reference in its place (said in the log)
    run 100 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_moe_router.py tests/pallas_kernels/test_rms_norm.py \
        tests/pallas_kernels/test_grouped_matmul.py tests/pallas_kernels/test_fp8_matmul.py \
        -k "router or gates or norm or row_groups or glu or stacked"
    e2e="from mla_jax.bench.e2e import main; import sys; main(sys.argv[1:])"
    if ! grep -q "passed" "$out/gpu-tests.log" || grep -q "FAILED.*test_moe_router" "$out/gpu-tests.log"; then
        echo "router kernel failed on the GPU: the grid runs with moe_topk_reference" | tee "$out/ROUTER_FALLBACK"
        e2e="from pallas_kernels import moe_router as R; R.moe_topk = lambda l, b, **kw: R.moe_topk_reference(l, b, **kw); $e2e"
    fi
    run 260 e2e-bf16 python3 -c "$e2e" --out "$out" --weights bf16 --batches 1,8,32,128 --ctxs 1024,4096 \
        --no-prefill --profile "$out/prof"
    rm -rf "$out/prof"
    mkdir -p "$out/fp8"
    run 190 e2e-fp8 python3 -c "$e2e" --out "$out/fp8" --weights fp8 --batches 1,128 --ctxs 4096 --no-prefill
    tar czf "$out.tgz" -C "$out" . && rm -rf "$out" ;;
5)  # session 13, first call: the shared experts as groups of the routed kernels and the copies' rows read by the
    # kernel (grouped gpu tests, the MoE layer against ragged_dot), then the bf16 step at batch 1 / 128, ctx 4k,
    # with profiles and the batch-1 step's compiled HLO
    run 170 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 6 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py tests/mla_jax/test_moe_stacked.py \
        -k "row_groups or glu or shared or stacked"
    run 230 e2e-bf16 python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,128 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/prof"
    tar czf "$out/hlo-b1.tgz" -C "$out/prof" $(cd "$out/prof" && ls -d b1*/step.hlo.txt)
    rm -rf "$out/prof"
    tar czf "$out.tgz" -C "$out" . && rm -rf "$out" ;;
6)  # session 13, second call: the merged kernels on the GPU (shared experts as groups, the per-head matmul, the
    # fused latent cache write, the decode prologue in the Triton kernel), the model's paged step through them, then
    # the bf16 step at batch 1 / 128, ctx 4k, with profiles and the batch-1 HLO
    run 250 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        --durations=8 tests/pallas_kernels/test_grouped_matmul.py tests/pallas_kernels/test_head_matmul.py \
        tests/pallas_kernels/test_cache_write.py tests/pallas_kernels/test_mla_decode.py \
        -k "shared or head or cache or page_offset"
    run 120 gpu-paged env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/mla_jax/test_paged.py -k "mixed_batches and 16 or decode_only or pallas_backend"
    run 200 e2e-bf16 python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,128 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/prof"
    tar czf "$out/hlo-b1.tgz" -C "$out/prof" $(cd "$out/prof" && ls -d b1*/step.hlo.txt)
    rm -rf "$out/prof"
    tar czf "$out.tgz" -C "$out" . && rm -rf "$out" ;;
7)  # session 13, third call: the shared chunks as one item for all tokens, the rope in the absorb kernel and once
    # a step, the fixed cache-write test (GPU tests; the paged step through them); the decode MoE kernels' tuning
    # sweep; the batch-1 step with its profile
    run 200 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        --durations=5 tests/pallas_kernels/test_grouped_matmul.py tests/pallas_kernels/test_head_matmul.py \
        tests/pallas_kernels/test_cache_write.py -k "shared or rope or bitwise or tail"
    run 100 gpu-paged env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/mla_jax/test_paged.py -k "mixed_batches and 16 or decode_only or pallas_backend"
    run 190 moe-decode python3 bench/moe_decode.py --out "$out" --budget-s 140
    run 110 e2e-b1 python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/prof"
    tar czf "$out/hlo-b1.tgz" -C "$out/prof" $(cd "$out/prof" && ls -d b1*/step.hlo.txt)
    rm -rf "$out/prof"
    tar czf "$out.tgz" -C "$out" . && rm -rf "$out" ;;
8)  # session 13, last call (~240 s of device time left, so straight into OUT, most important first): the paged step
    # through every new kernel against the full forward at a tiny shape (the dense linear kernel, the router in the
    # norm, the rope in the absorb kernel, the shared chunks); then the bf16 step at batch 1 / 128, ctx 4k, with
    # profiles (should the paged test fail, with the dense linear kernel and the router fusion off, said in the
    # log); then the new kernels' own GPU tests
    out=${2:?}
    run 70 gpu-paged env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/mla_jax/test_paged.py -k "mixed_batches and 16 or decode_only or pallas_backend"
    e2e="from mla_jax.bench.e2e import main; import sys; main(sys.argv[1:])"
    if ! grep -q " passed" "$out/gpu-paged.log" || grep -q "failed" "$out/gpu-paged.log"; then
        echo "the paged step failed on the GPU: e2e with LINEAR_MAX_T = 0 (at c52e94f: also no router in the norm)" \
            | tee "$out/FALLBACK"
        e2e="import mla_jax.layers as L; L.LINEAR_MAX_T = 0; $e2e"
    fi
    run 190 e2e python3 -c "$e2e" --out "$out" --weights bf16 --batches 1,128 --ctxs 4096 --no-prefill --no-engine \
        --profile "$out/prof"
    rm -rf "$out/prof"
    run 120 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_linear.py tests/pallas_kernels/test_rms_norm.py ;;
9)  # session 14, first call (docs/perf-notes.md "Next GPU session" 1-2): the paged step against the full forward
    # (session 13's review moved the cache write and the gate's linear), what session 13's last call did not run,
    # then the tuning sweeps of the decode grouped kernels and the dense linear kernel (straight into OUT)
    out=${2:?}
    run 80 gpu-paged env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/mla_jax/test_paged.py -k "mixed_batches and 16 or decode_only or pallas_backend"
    run 120 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py tests/pallas_kernels/test_linear.py -k "shared or row or router"
    run 170 moe-decode python3 bench/moe_decode.py --out "$out" --budget-s 120
    run 200 linear python3 bench/linear.py --out "$out" --tokens 1,8,32 --sweep --sweep-budget-s 90 ;;
10) # session 14, second call: the e2e grid at the tuned defaults, with profiles (straight into OUT)
    out=${2:?}
    run 400 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,8,32,128 --ctxs 1024,4096 \
        --no-prefill --no-engine --profile "$out/prof"
    rm -rf "$out/prof"
    run 180 e2e-fp8 python3 -m mla_jax.bench.e2e --out "$out/fp8" --weights fp8 --batches 1,32,128 --ctxs 4096 \
        --no-prefill --no-engine ;;
11) # session 14, second call (straight into OUT, most important first): the GPU tests of the norm kernel's copies
    # combine, the retuned linear / grouped kernels and the paged step through them; the bf16 step at batch 1 / 128,
    # ctx 4k, with profiles and batch 1's compiled HLO; the linear kernel on the dense MLP's shapes (sweep); the logs
    # in one tar (OUT brings back at most 8 files)
    out=${2:?}
    run 150 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_rms_norm.py tests/pallas_kernels/test_linear.py \
        tests/pallas_kernels/test_grouped_matmul.py -k "not sorted"
    run 80 gpu-paged env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/mla_jax/test_paged.py -k "mixed_batches and 16 or decode_only or pallas_backend"
    run 200 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 1,128 --ctxs 4096 --no-prefill \
        --no-engine --profile "$out/prof"
    tar czf "$out/hlo-b1.tgz" -C "$out/prof" b1-ctx4096/step.hlo.txt 2>/dev/null
    rm -rf "$out/prof"
    mkdir -p "$out/lin"
    run 110 linear python3 bench/linear.py --out "$out/lin" --names mlp_gate_up,mlp_down --tokens 1,8,32 --sweep \
        --sweep-budget-s 60
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
12) # session 14, last call (straight into OUT, most important first): the norm kernel's GPU tests (the copies combine,
    # h kept in registers) and the paged step through the Pallas experts (ExpertCopies between layers); the e2e grid
    # (batch 1 / 8 / 32 / 128, ctx 1k / 4k) with profiles (should the norm tests fail: with KEEP_ROW = 0, said in
    # FALLBACK); the fp8 step; the logs in one tar
    out=${2:?}
    run 90 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 2 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_rms_norm.py
    run 80 gpu-paged env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -p no:cacheprovider -rfE \
        tests/mla_jax/test_paged.py -k "token_by_token or decode_only"
    e2e="from mla_jax.bench.e2e import main; import sys; main(sys.argv[1:])"
    if ! grep -q " passed" "$out/gpu-tests.log" || grep -q "failed" "$out/gpu-tests.log"; then
        echo "the norm kernel's GPU tests failed: e2e with KEEP_ROW = 0" | tee "$out/FALLBACK"
        e2e="import pallas_kernels.rms_norm as R; R.KEEP_ROW = 0; $e2e"
    fi
    run 330 e2e python3 -c "$e2e" --out "$out" --weights bf16 --batches 1,8,32,128 --ctxs 1024,4096 --no-prefill \
        --no-engine --profile "$out/prof"
    rm -rf "$out/prof"
    mkdir -p "$out/fp8"
    run 150 e2e-fp8 python3 -c "$e2e" --out "$out/fp8" --weights fp8 --batches 1,32,128 --ctxs 4096 --no-prefill \
        --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
13) # session 15, first call (straight into OUT, most important first): the narrow Hopper decode (tokens on M, rows
    # <= 32) in the Hopper decode's GPU tests and the transposed split merge; the decode benchmark at 16 heads, bf16,
    # Triton / narrow / 64-row kernel, over the used pages and over a 16 GB pool, device time; the bf16 e2e step at
    # batch 8 / 32 / 128, ctx 4k (16 heads over a 16 GB pool: the Hopper decode); the logs in one tar
    out=${2:?}
    run 150 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py
    run 170 decode python3 bench/decode.py --out "$out" --no-ragged --device-time --dtypes bf16 \
        --shapes 64x16x4096,128x16x8192,32x16x1024,8x16x4096,1x16x4096 --pool-gb 16
    run 200 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 8,32,128 --ctxs 4096 --no-prefill \
        --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
14) # session 15, second call (straight into OUT): the rest of part 13's decode shapes at 16 heads (its decode run
    # was cut after the first shape: the correctness checks took 136 s; they passed, and the gpu tests too), device
    # time, used pages and a 16 GB pool; the fp8 cast probe; the bf16 e2e step at batch 8 / 32 / 128, ctx 1k
    out=${2:?}
    run 160 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time --dtypes bf16 \
        --shapes 128x16x8192,32x16x1024,8x16x4096,1x16x4096,8x16x1024 --pool-gb 16
    run 80 fp8-cast python3 bench/fp8_cast.py --out "$out"
    run 150 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --batches 8,32,128 --ctxs 1024 --no-prefill \
        --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
15) # session 15, third call (straight into OUT): the Hopper and Triton decode GPU tests (the narrow kernel on an fp8
    # cache, in-kernel metadata, the parallel transposed merge); the decode benchmark at 16 heads, bf16 and fp8,
    # device time; the e2e step at batch 8 / 32 / 128, ctx 4k, bf16 and fp8 caches (bf16 only if the tests failed)
    out=${2:?}
    run 140 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py
    run 150 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --dtypes bf16,fp8 --shapes 64x16x4096,128x16x8192,32x16x1024,8x16x4096
    caches=$(caches_after_tests)
    run 190 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype $caches --batches 8,32,128 \
        --ctxs 4096 --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
16) # session 16 (straight into OUT): the narrow decode with QK^T in independent 128-column accumulators (bf16 and
    # fp8) and one-reduction q hi/lo split: the Hopper decode GPU tests; the A/B probe (fp8 V slots 1 vs 2; bf16
    # chunked vs one accumulator); the decode benchmark at 16 heads, bf16 and fp8; the e2e step at batch 8 / 32 /
    # 128, ctx 4k, bf16 and fp8 caches
    out=${2:?}
    run 110 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py
    run 90 probe python3 bench/narrow_probe.py "$out"
    run 130 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --dtypes bf16,fp8 --shapes 64x16x4096,128x16x8192,32x16x1024,8x16x4096
    caches=$(caches_after_tests)
    run 180 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype $caches --batches 8,32,128 \
        --ctxs 4096 --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
17) # session 17, first call (straight into OUT): the Hopper decode GPU tests (the narrow fp8 kernel with P.V of page
    # i - 1 beside QK^T of page i, two V slots); the decode benchmark at 16 heads, bf16 and fp8, Hopper kernels,
    # device time and the error against the float32 reference (rel_err, lse_err)
    out=${2:?}
    run 130 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py
    run 170 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 128x16x8192,64x16x4096,32x16x1024,8x16x4096
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
18) # session 17, third call (straight into OUT; the second ran out/probe A/Bs: P.V in flight beside QK^T lost to P.V
    # after the next page's softmax once the consumer had 240 registers): the Hopper decode GPU tests; the decode
    # benchmark at 16 heads, bf16 and fp8; the e2e step at batch 8 / 32 / 128, ctx 4k, bf16 and fp8 caches
    out=${2:?}
    run 110 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py
    run 170 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 128x16x8192,64x16x4096,32x16x1024,8x16x4096
    caches=$(caches_after_tests)
    run 190 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype $caches --batches 8,32,128 \
        --ctxs 4096 --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
19) # session 17, last call (straight into OUT): the narrow fp8 kernel's QK^T as one N = 2M chain (q_hi's rows then
    # q_lo's), in the session's last 300 s: the Hopper decode GPU tests of the fp8 and 16-head cases, the decode
    # benchmark at three 16-head shapes, bf16 and fp8; which 8-bit transposed
    # shared-memory store/load Mosaic GPU lowers (out/probe/t8.py, the fp8 P.V route) and ptxas's registers for
    # the narrow and 64-row kernels (out/probe/ptxas.py; both not committed: carry out/probe)
    out=${2:?}
    run 70 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py -k "fp8 or narrow or n16"
    [ -f out/probe/t8.py ] && run 40 t8 python3 out/probe/t8.py
    run 120 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 128x16x8192,64x16x4096,32x16x1024
    [ -f out/probe/ptxas.py ] && run 60 ptxas env MOSAIC_GPU_DUMP_PTXAS=1 python3 out/probe/ptxas.py
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
20) # session 18, first call (straight into OUT): which steps of the fp8 P.V route lower (out/probe/t8b.py: V through
    # a bf16 transposed staging store into a K-major e4m3 V^T, P likewise, one fp8 wgmma); the 16-head decode rows
    # that session 17's budget cut (32x16x1024, 8x16x4096) at the current kernel; ptxas's registers of the narrow
    # and 64-row kernels (out/probe/ptxas.py); the e2e step at batch 8 / 32 / 128, ctx 4k, both caches, profiled
    out=${2:?}
    [ -f out/probe/t8b.py ] && run 60 t8b python3 out/probe/t8b.py
    run 110 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 32x16x1024,8x16x4096
    [ -f out/probe/ptxas.py ] && run 70 ptxas env MOSAIC_GPU_DUMP_PTXAS=1 python3 out/probe/ptxas.py
    run 240 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype bf16,fp8 --batches 8,32,128 \
        --ctxs 4096 --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
21) # session 18, second call (straight into OUT; probes in out/probe, carried): what bounds the narrow fp8 decode
    # (device time with each part of the per-page work dropped: out/probe/ablate.py) and the 64-row kernel's
    # register splits (ptxas's spills and device time at 128 heads: out/probe/regs64.py)
    out=${2:?}
    run 170 ablate python3 out/probe/ablate.py "$out"
    run 300 regs64 env MOSAIC_GPU_DUMP_PTXAS=1 python3 out/probe/regs64.py "$out"
    grep -E "^===|spill stores|^\{" "$out/regs64.log" > "$out/regs64-summary.txt"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
22) # session 18, third call (straight into OUT; probes in out/probe, carried): the narrow fp8 decode's V cast with
    # wide shared-memory accesses (out/probe/castab.py: device time, and the error on ragged lengths with the rows
    # past them NaN); the 64-row kernel's register splits again, each compiled afresh (regs64.py)
    out=${2:?}
    run 200 castab python3 out/probe/castab.py "$out"
    run 150 regs64 env MOSAIC_GPU_DUMP_PTXAS=1 python3 out/probe/regs64.py "$out"
    grep -E "^===|spill stores|^\{" "$out/regs64.log" > "$out/regs64-summary.txt"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
23) # session 18, last call (straight into OUT): the Hopper decode GPU tests with the fp8 casts' wide accesses (both
    # kernels) and the 64-row bf16 split (232, 40); the decode benchmark, bf16 and fp8, 16 and 128 heads (two runs,
    # most important shapes first: OUT/a, OUT/b); the e2e step with the fp8 cache at batch 8 / 32 / 128, ctx 4k
    # (only if the tests pass); ptxas's registers (out/probe/ptxas.py, carried)
    out=${2:?}
    mkdir -p "$out/a" "$out/b"
    run 110 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py
    run 160 decode python3 bench/decode.py --out "$out/a" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 128x16x8192,64x16x4096,64x128x4096
    if [ "$(caches_after_tests)" = bf16,fp8 ]; then
        run 110 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype fp8 --batches 8,32,128 \
            --ctxs 4096 --no-prefill --no-engine
    fi
    run 130 decode-b python3 bench/decode.py --out "$out/b" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 128x128x8192,32x16x1024,1x128x32768
    [ -f out/probe/ptxas.py ] && run 40 ptxas env MOSAIC_GPU_DUMP_PTXAS=1 python3 out/probe/ptxas.py
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
24) # next session, first call (straight into OUT): the GPU tests of what session 18 built without a GPU (the fp8
    # cache write kernel, the one-kernel q split of the narrow fp8 decode, the 64-row exact fp8 kernel's cast split
    # between the producer and WG1) and of the Hopper decode in full; the decode benchmark (16 heads, and
    # 64x128x4096 for the cast split), bf16 and fp8; the e2e step with both caches at batch 1 / 8 / 32 / 128, ctx 4k,
    # profiled (only if the tests pass)
    out=${2:?}
    run 140 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_cache_write.py
    run 200 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes bf16,fp8 --shapes 128x16x8192,64x16x4096,32x16x1024,64x128x4096,8x16x4096
    caches=$(caches_after_tests)
    run 240 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype $caches --batches 1,8,32,128 \
        --ctxs 4096 --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
25) # session 19, second call: the GPU tests of util.round_e4m3 (written when Triton's own f32 -> e4m3 cast was suspected of rounding twice; part 24's
    # q split test failed) in the q split, the fp8 cache write and the narrow fp8 decode; the q split's rows per
    # program and warps (out/probe/hilo.py, carried); the fp8 16-head decode rows; the e2e step with the fp8 cache at
    # batch 1 / 8 / 32 / 128, ctx 4k, profiled (only if the tests pass)
    out=${2:?}
    run 130 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_util.py tests/pallas_kernels/test_cache_write.py \
        tests/pallas_kernels/test_mla_decode_sm90.py -k "util or cache_write or hilo or fp8"
    run 90 hilo env OUT="$out" python3 out/probe/hilo.py
    caches=$(caches_after_tests)
    if [ "$caches" = bf16,fp8 ]; then
        run 160 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype fp8 --batches 1,8,32,128 \
            --ctxs 4096 --no-prefill --no-engine --profile "$out/trace"
        rm -rf "$out/trace"
    fi
    run 120 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes fp8 --shapes 128x16x8192,64x16x4096,32x16x1024,8x16x4096
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
26) # session 19, third call: part 25's GPU tests again (their exactness threshold was wrong: q_hi + q_lo / 16 is exact
    # from s_hi 2^-6 up, not from 2^-14 of the row's largest; the kernels were right) with the q split at a program
    # per row; the fp8 e2e rows; the fp8 16-head decode rows; the 64-row fp8 kernel's register split (regs64.py)
    out=${2:?}
    run 130 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_util.py tests/pallas_kernels/test_cache_write.py \
        tests/pallas_kernels/test_mla_decode_sm90.py -k "util or cache_write or hilo or fp8"
    caches=$(caches_after_tests)
    if [ "$caches" = bf16,fp8 ]; then
        run 170 e2e python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype fp8 --batches 1,8,32,128 \
            --ctxs 4096 --no-prefill --no-engine --profile "$out/trace"
        rm -rf "$out/trace"
    fi
    run 150 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes fp8 --shapes 32x16x1024,8x16x4096,64x16x4096,128x16x8192
    run 70 regs64 python3 out/probe/regs64.py "$out"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
27) echo "part 27 became part 28's second half (session 20)" >&2; exit 2 ;;
28) # session 20, first call: the demo model's speculative steps (0.55-0.87x plain at 8672b25): wall, wait and host
    # time per step and a trace of each row's generation (kernels, device busy per step); then part 27's rows
    out=${2:?}
    run 150 spec-demo python3 bench/spec.py --out "$out" --no-verify --demo-ks 2 --demo-batches 1 \
        --profile "$out/trace" --budget-min 2.3
    rm -rf "$out/trace"
    run 210 decode-b1 python3 bench/decode.py --out "$out/b1" --quick --no-check --no-ragged --device-time --sweep \
        --kernels pallas,pallas_sm90 --dtypes bf16,fp8 --shapes 1x16x1024,1x16x4096 --sweep-budget-s 60
    run 170 decode python3 bench/decode.py --out "$out" --quick --no-check --no-ragged --device-time \
        --kernels pallas_sm90 --dtypes fp8 --shapes 64x128x4096,128x128x8192
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
29) # session 20, second call: the fp8-weight step (W8A8 linears and experts read in place; its rows are from 225d72a)
    # at batch 1 / 32 / 128, ctx 4k, profiled; the fp8-cache step at batch 1 through the narrow Hopper decode (the
    # batch-1 rule takes an fp8 cache since part 28); the fp8 GEMM, grouped and linear kernels' GPU tests (part 11
    # cut them)
    out=${2:?}
    run 280 e2e-fp8w python3 -m mla_jax.bench.e2e --out "$out/fp8w" --weights fp8 --batches 1,32,128 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    run 100 e2e-b1 python3 -m mla_jax.bench.e2e --out "$out/b1" --weights bf16 --cache-dtype fp8 --batches 1 \
        --ctxs 4096 --no-prefill --no-engine --profile "$out/trace1"
    rm -rf "$out/trace1"
    run 110 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_fp8_matmul.py tests/pallas_kernels/test_grouped_matmul.py \
        tests/pallas_kernels/test_linear.py
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
30) # session 21, first call (its results were lost with the session; part 32 re-measures): the fp8 linear and grouped kernels' W8A8 paths (session 20, CPU-tested only: block-FP8
    # weights in pallas_kernels.linear and grouped_matmul, taken at <= 64 tokens): their GPU tests, their decode-size
    # rows against the Mosaic W8A8 GEMMs and bf16, then the fp8-weight step at batch 1 / 32 / 128 (part 29 at 0cf314c:
    # 3.26 / 9.61 / 14.2 ms, 1249 kernels at batch 1)
    out=${2:?}
    run 120 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_linear.py tests/pallas_kernels/test_grouped_matmul.py -k "fp8"
    run 130 fp8-gemm python3 bench/fp8_gemm.py --out "$out" --ms 1,8,32,64,256 --budget-s 100
    run 280 e2e-fp8w python3 -m mla_jax.bench.e2e --out "$out/fp8w" --weights fp8 --batches 1,32,128 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
31) # a later call (not run yet): the ctx-1k step rows (from cee473d, before the narrow decode: batch 32 1.35x, 128
    # 1.71x roofline) at batch 1 / 8 / 32 / 128, both caches, profiled; the demo's speculative rows at k = 1..3
    out=${2:?}
    run 330 e2e-1k python3 -m mla_jax.bench.e2e --out "$out" --weights bf16 --cache-dtype bf16,fp8 \
        --batches 1,8,32,128 --ctxs 1024 --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    run 200 spec-demo python3 bench/spec.py --out "$out/spec" --no-verify --demo-batches 1,all --budget-min 3.2
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
32) # session 22, first call: the fp8 linear / grouped Triton kernels with x quantized once before the call (part 30
    # at 7bb5dd3, each program quantizing its own tiles: the fp8-weight step at batch 1 6.79 ms, 32 13.8, against 3.26 /
    # 9.61 through the Mosaic GEMMs): their GPU tests, then the fp8-weight step at batch 1 / 32, profiled
    out=${2:?}
    run 120 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_linear.py tests/pallas_kernels/test_grouped_matmul.py -k "fp8"
    run 300 e2e-fp8w python3 -m mla_jax.bench.e2e --out "$out/fp8w" --weights fp8 --batches 1,32 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    run 150 fp8-gemm python3 bench/fp8_gemm.py --out "$out" --ms 1,8,32,64 --budget-s 110
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
33) # a later call (not run yet): the fp8 GEMM rows at decode sizes with device time (the wall time there is dispatch),
    # then the bf16 and fp8-weight steps in one run at batch 1 / 32 / 128 (issue 25's batch-32 target: <= 0.65x bf16)
    out=${2:?}
    run 200 fp8-gemm python3 bench/fp8_gemm.py --out "$out" --ms 1,8,32,64,256 --budget-s 160
    run 380 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16,fp8 --batches 1,32,128 --ctxs 4096 \
        --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
34|35) # session 22, second and fourth calls. 34: part 32 showed the Triton fp8 kernels slow on the device too (V3
    # q_a_proj at one token 42 us, bf16's dot 9; the step at batch 1 4.77 ms, 32 14.0): the scales' loads a K step,
    # which Triton does not prefetch, now one load of all the tile's scales before the loop. 35 (the third call ran
    # out/probe/fp8lin.py: the e4m3 tiles cast to bf16 before the dot were not prefetched, 44-46 us for V3's q_a_proj
    # at 16 rows where a dot of the e4m3 tiles took 10.3-12.5 and bf16's Triton dot 12.3): the same commands with the
    # fp8 kernels' dots of e4m3 operands. GPU tests, the decode-size rows, then the bf16 and fp8-weight steps in one
    # run at batch 1 / 32 (batch 128 takes neither kernel), profiled
    out=${2:?}
    run 110 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_linear.py tests/pallas_kernels/test_grouped_matmul.py -k "fp8"
    run 150 fp8-gemm python3 bench/fp8_gemm.py --out "$out" --ms 1,8,32,64 --budget-s 110
    run 300 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16,fp8 --batches 1,32 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
36) # session 22, last call (~250 s of device time): part 35's GPU tests again (its 110 s limit cut the last of 19),
    # then the dense fp8 rows with each kernel's time (fp8_linear 21.9 us a call at one token where the probe's kernel
    # took 10.3: what the other 3 kernels cost)
    out=${2:?}
    run 150 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_linear.py tests/pallas_kernels/test_grouped_matmul.py -k "fp8"
    run 90 fp8-gemm python3 bench/fp8_gemm.py --out "$out" --ms 1,32 --budget-s 40 --shapes "v3 q_a_proj,v2-lite q_proj"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
37) # next session, first call: the fp8 shared experts as chunk groups of the routed Triton kernels (7928843,
    # CPU-tested), fp8 linears deeper than 2816 inputs back on the Mosaic GEMM, the activations' quantization as one
    # Triton kernel (fp8_quant; XLA ran three): the GPU tests of the fp8 kernels and of the fp8 model, then the bf16
    # and fp8-weight steps at batch 1 / 32 in one run, profiled (part 35 at 79384f6: fp8 2.78 / 7.39 ms, bf16 2.27 /
    # 9.58)
    out=${2:?}
    run 200 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_linear.py tests/pallas_kernels/test_grouped_matmul.py \
        tests/pallas_kernels/test_fp8_quant.py tests/pallas_kernels/test_fp8_matmul.py \
        tests/mla_jax/test_fp8_weights.py -k "fp8"
    run 300 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16,fp8 --batches 1,32 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
38) # next session, second call: the fp8-weight step at batch 128 (0cf314c: 14.2 ms; the Mosaic GEMMs above 64
    # tokens, now behind the one-kernel quantization) and the V3-shaped slice with fp8 weights at batch 1 / 32 (V3's
    # deep linears on the Mosaic GEMM, its experts and shared expert on the Triton kernels), both weights in one run
    out=${2:?}
    run 150 e2e-b128 python3 -m mla_jax.bench.e2e --out "$out/b128" --weights fp8 --batches 128 --ctxs 4096 \
        --no-prefill --no-engine
    run 330 e2e-v3 python3 -m mla_jax.bench.e2e --out "$out/v3" --model v3-slice --weights bf16,fp8 --batches 1,32 \
        --ctxs 4096 --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
39) # session 23, third call: where the fp8-weight step's batch-32 time goes (part 37: 6.80 ms, 0.709x bf16; the
    # target is 0.65x), profiled; the ctx-1k bf16 step rows (targets.py's worst rows are still cee473d's); the fp8
    # step at batch 128 last (part 38's 150 s limit cut it before its first row)
    out=${2:?}
    run 150 e2e-b32 python3 -m mla_jax.bench.e2e --out "$out/b32" --weights bf16,fp8 --batches 32 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    run 200 e2e-1k python3 -m mla_jax.bench.e2e --out "$out/1k" --weights bf16 --batches 1,8,32,128 --ctxs 1024 \
        --no-prefill --no-engine
    run 220 e2e-b128 python3 -m mla_jax.bench.e2e --out "$out/b128" --weights fp8 --batches 128 --ctxs 4096 \
        --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
40) # session 23, fourth call: the grouped kernel's fp8 SwiGLU output quantized in its epilogue (CPU-tested) on the
    # GPU, then the fp8 experts' tuning at T = 1 (copies in token order) and 32 (sorted): part 39's batch-32 profile
    # has the fp8 glu / down kernels at 95 / 51 us a layer, ~0.87 / 0.84 of copy, where bf16's run at ~0.95
    out=${2:?}
    run 120 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py -k "fp8"
    run 260 moe-decode python3 bench/moe_decode.py --out "$out" --weights fp8 --tokens 1,32 --budget-s 160
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
41) # session 23, last call (~350 s of device time left): the activations' quantization moved into the kernels that
    # make them (the norms' `quantize` output for fp8 attention / MLP / MoE inputs, the GLU epilogue for the down
    # projection; CPU-tested), GPU-tested, then the bf16 and fp8-weight steps at batch 1 / 32, profiled (part 37 at
    # 0d3bdf1: fp8 2.19 / 6.80 ms, bf16 2.28 / 9.60). Result: the norm kernels with the quantized output (128-wide
    # chunks; the router's programs a row 16 -> 1) took 36 / 23 us a layer against 4.2 / 3.8, the fp8 step 3.47 /
    # 8.00 ms: that change was reverted; the tests' log was cut at 90 s after 6 results, one F (name not logged)
    out=${2:?}
    run 90 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_rms_norm.py tests/pallas_kernels/test_grouped_matmul.py \
        tests/pallas_kernels/test_linear.py -k "gpu_normed or gpu_fp8_glu_output or gpu_fp8_decode_experts or prequantized"
    run 210 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16,fp8 --batches 1,32 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
42) # next session, first call: the grouped kernel's fp8 GLU epilogue quantization (89f2473; CPU-tested bit for bit,
    # its GPU test cut twice) and the fp8 experts' tuning from part 40 (by row 4 stages, sorted GLU 128 wide) on the
    # GPU; then the bf16 / fp8-weight steps at batch 1 / 32, profiled, on the current code (part 39: fp8 6.87 ms at
    # 32, 0.711x bf16; part 41's fp8 kernels: glu 454.7 / down 258.2 us a step at batch 1, the down projection's
    # quantization kernels gone)
    out=${2:?}
    run 200 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py -k "gpu_fp8"
    run 230 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16,fp8 --batches 1,32 --ctxs 4096 \
        --no-prefill --no-engine --profile "$out/trace"
    rm -rf "$out/trace"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
43) # next session, second call: the fp8 experts with two scale blocks a K step (block_k 256: two fp8 dots a step,
    # CPU-tested), against part 40's sweep (T = 32: glu 102.1 us at 0.83 of copy, down 58.5 at 0.73; bf16's ~0.95)
    out=${2:?}
    run 150 gpu-tests env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py -k "gpu_fp8_decode_experts"
    run 300 moe-decode python3 bench/moe_decode.py --out "$out" --weights fp8 --tokens 32,1 --budget-s 220
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
44) # session 24, after parts 42 / 43 (block_k 256 lost: removed): the fp8 GLU epilogue's GPU tests alone, verbose and
    # interrupted (not killed) at the limit, so the log names every result (three runs were cut without names);
    # then the baseline of issue 22's batch-32 target on the current code: the fp8-cache rows (last at 4c64bae) and
    # the bf16 rows at ctx 1k / 4k, batch 1 / 32 / 128
    out=${2:?}
    t0=$SECONDS
    timeout -s INT 240 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 3 -m gpu -p no:cacheprovider -rfE \
        --durations=5 tests/pallas_kernels/test_grouped_matmul.py -k "gpu_fp8_glu_output or gpu_fp8_shared" \
        >"$out/gpu-tests.log" 2>&1
    echo "gpu-tests: rc=$? $((SECONDS - t0)) s"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu-tests.log" | cut -c1-200 | tail -12
    run 280 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --cache-dtype fp8,bf16 \
        --batches 32,128,1 --ctxs 1024,4096 --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
45) # session 24: the grouped kernel's items by group (a decode batch's top-k unsorted: no sort, gather, inverse
    # permutation nor combine kernels) and its in-kernel work list (sorted rows), CPU-tested: their GPU tests, then
    # the step A/B in one call: this tree, then (if the caller put the earlier files under ab/base/, untracked) the
    # same rows with them
    out=${2:?}
    verbose_tests 200 tests/pallas_kernels/test_grouped_matmul.py \
        -k "gpu_shared_chunks_decode or gpu_fp8_shared_chunks or gpu_glu_decode or gpu_fp8_glu_output"
    e2e_rows() {  # e2e_rows NAME [PROFILE]: bf16 weights at batch 8 / 32 / 128 (ctx 1k, 4k), fp8 weights at 32
        run 150 "e2e-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-$1" --weights bf16 --batches 8,32,128 \
            --ctxs 1024,4096 --no-prefill --no-engine ${2:+--profile "$out/trace-$1"}
        run 60 "e2e-$1-fp8" python3 -m mla_jax.bench.e2e --out "$out/e2e-$1-fp8" --weights fp8 --batches 32 \
            --ctxs 4096 --no-prefill --no-engine
    }
    e2e_rows new
    if [ -d ab/base ]; then
        rm -rf /tmp/base && mkdir /tmp/base && cp -r mla_jax pallas_kernels bench /tmp/base/ && cp -r ab/base/* /tmp/base/
        (cd /tmp/base && out=$out e2e_rows base)
    fi
    rm -rf "$out"/trace-*
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
46) # next session, first call: items by group through `group_table` (4a84840, CPU-tested; part 45 measured the
    # per-program search it replaced: batch 8 -3%, 32 even, 128 1.7x slower) and the sorted path's in-kernel work list
    # (d58a314, not in part 45's rows: batch 128 took items by group there). GPU tests, then an A/B in one call at ctx
    # 1k: this tree (by group up to 256 copies: batch <= 42 at top-6), the sorted path of 4fc5932 (the caller puts its
    # grouped_matmul.py and layers.py under ab/base/, carried), and batch 128 by group (up to 1024 copies)
    out=${2:?}
    verbose_tests 200 tests/pallas_kernels/test_grouped_matmul.py \
        -k "gpu_shared_chunks_decode or gpu_fp8_shared_chunks or gpu_glu_decode or gpu_fp8_glu_output or gpu_group_table"
    e2e_rows() {  # e2e_rows NAME BATCHES: bf16 weights, ctx 1k
        run 120 "e2e-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-$1" --weights bf16 --batches "$2" \
            --ctxs 1024 --no-prefill --no-engine
    }
    e2e_rows new 8,32,128
    overlay_trees
    [ -d /tmp/base ] && (cd /tmp/base && out=$out e2e_rows base 8,32,128)
    (cd /tmp/wide && out=$out e2e_rows wide 128)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
47) # next session, second call: the fp8-weight step at batch 32 by group against sorted (part 45 cut both at 60 s),
    # then the two grouped kernels by group against sorted at T = 8 / 32 / 128 (kernel device time: the copy table
    # timed, the sort's XLA kernels not), bf16 and fp8, with a tuning sweep of each (by group up to 1024 copies in
    # /tmp/wide, so that T = 128 takes it too)
    out=${2:?}
    overlay_trees
    run 110 e2e-new-fp8 python3 -m mla_jax.bench.e2e --out "$out/e2e-new-fp8" --weights fp8 --batches 32 \
        --ctxs 4096 --no-prefill --no-engine
    [ -d /tmp/base ] && (cd /tmp/base && run 110 e2e-base-fp8 python3 -m mla_jax.bench.e2e \
        --out "$out/e2e-base-fp8" --weights fp8 --batches 32 --ctxs 4096 --no-prefill --no-engine)
    (cd /tmp/wide && run 330 moe-decode python3 bench/moe_decode.py --out "$out" --tokens 32,8,128 \
        --routing layers,sorted --weights bf16,fp8 --budget-s 240)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
48) # session 25, one call for part 46's essentials and the async speculative steps (d159a6b): the GPU tests of the
    # group table (4a84840, items by group in the default path up to 256 copies: never run on a GPU) and of the demo's
    # speculation (async MTP), the step at ctx 1k by group (this tree) against sorted (4fc5932 under ab/base/,
    # carried), then the demo's speculative rows at batch 1, k = 2 (MTP now asynchronous; session 20: 0.66x plain)
    out=${2:?}
    verbose_tests 170 tests/pallas_kernels/test_grouped_matmul.py tests/mla_jax/test_spec_decode.py \
        -k "gpu_group_table or gpu_glu_decode or gpu_shared_chunks_decode or demo_model"
    e2e_rows() {  # e2e_rows NAME: bf16 weights, ctx 1k, batch 8 / 32 / 128
        run 115 "e2e-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-$1" --weights bf16 --batches 8,32,128 \
            --ctxs 1024 --no-prefill --no-engine
    }
    e2e_rows new
    overlay_trees
    [ -d /tmp/base ] && (cd /tmp/base && out=$out e2e_rows base)
    run 140 spec-demo python3 bench/spec.py --out "$out/spec" --no-verify --demo-batches 1 --demo-ks 2 \
        --budget-min 1.6
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
49) # session 26, first call (the H200; the GPU tests of part 48 passed on an H100): part 46's A/B at ctx 1k, bf16:
    # this tree (by group up to 256 copies), by group up to 1024 copies at batch 128, the sorted path of 4fc5932
    # (ab/base/, carried); then the verify step at batch 32, k = 2 (576 copies: sorted here, by group in /tmp/wide)
    out=${2:?}
    e2e_rows() {  # e2e_rows NAME BATCHES: bf16 weights, ctx 1k
        run 120 "e2e-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-$1" --weights bf16 --batches "$2" \
            --ctxs 1024 --no-prefill --no-engine
    }
    e2e_rows new 8,32,128
    overlay_trees
    (cd /tmp/wide && out=$out e2e_rows wide 128)
    [ -d /tmp/base ] && (cd /tmp/base && out=$out e2e_rows base 8,32,128)
    (cd /tmp/wide && run 100 spec-wide python3 bench/spec.py --out "$out/spec-wide" --no-demo --batches 32 --ks 2 \
        --ctxs 1024 --mtp-ks "" --budget-min 1.4)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
50) # session 26, third call: the demo's speculative rows on the H200 (async MTP since d159a6b; part 48's H100 rows were
    # host-bound and noisy), then the verify rows at k = 2 on the current step (last at 225d72a), ctx 1k then 4k
    out=${2:?}
    run 200 spec-demo python3 bench/spec.py --out "$out/spec" --no-verify --demo-batches 1,all --demo-ks 1,2,3 \
        --budget-min 3.0
    resume=() && [ -f "$out/spec/spec-h200.json" ] && resume=(--resume "$out/spec/spec-h200.json")
    run 330 spec-verify python3 bench/spec.py --out "$out/spec" "${resume[@]}" --no-demo \
        --batches 1,8,32 --ks 2 --ctxs 1024,4096 --budget-min 5.2
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
51) # session 26, second call: the grouped kernels at T = 128 then 32 by group (up to 1024 copies, /tmp/wide) and
    # sorted, bf16 and fp8, with a tuning sweep (batch 128's experts ran at 0.69-0.78 of copy, batch 32's bf16 at ~1.0),
    # then the fp8-weight step at batch 32 (issue 25's 0.65x)
    out=${2:?}
    overlay_trees
    (cd /tmp/wide && run 380 moe-decode python3 bench/moe_decode.py --out "$out" --tokens 128,32 \
        --routing layers,sorted --weights bf16,fp8 --budget-s 280)
    run 170 e2e-new-fp8 python3 -m mla_jax.bench.e2e --out "$out/e2e-new-fp8" --weights bf16,fp8 --batches 32 \
        --ctxs 4096 --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
52) # session 26: the narrow Hopper decode's work list (7a2dad5, CPU-tested: interpreter, sm_90 lowering): its GPU
    # tests and the transposed segment merge's, then issue 21's ragged batch (128 requests, log-uniform [256, 32k]:
    # last measured at 8b4fe44, before the narrow kernel) and the 16-head uniform shapes, grid against work list
    out=${2:?}
    verbose_tests 120 tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py \
        -k "worklist or narrow or merge_segments"
    run 180 decode-ragged python3 bench/decode.py --out "$out/ragged" --ragged-only --dtypes bf16,fp8 \
        --kernels pallas_sm90,pallas
    run 130 decode-uniform python3 bench/decode.py --out "$out/uniform" --no-check --no-ragged --device-time \
        --shapes 128x16x8192,64x16x4096,32x16x1024,8x16x4096 --dtypes bf16,fp8 --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
53) # session 26, part 52 cut to what ~250 s of device time holds: the narrow work list's GPU tests, the ragged rows
    out=${2:?}
    verbose_tests 110 tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py \
        -k "narrow_worklist or worklist_n16 or merge_segments"
    run 130 decode-ragged python3 bench/decode.py --out "$out/ragged" --ragged-only --no-check --dtypes bf16,fp8 \
        --kernels pallas_sm90,pallas ;;
54) # session 27: the work list cut by ceil(pages / (total / 1.5 SMs)) with the online segment merge and the split-tile
    # list from the metadata kernel: its GPU tests, the ragged rows, the 16-head uniform shapes (grid against work list)
    out=${2:?}
    verbose_tests 90 tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py \
        -k "narrow_worklist or worklist_n16 or worklist_kernel or merge_segments or worklist_n128 or fp8_qk_worklist"
    run 200 decode-ragged python3 bench/decode.py --out "$out/ragged" --ragged-only --no-check --dtypes bf16,fp8 \
        --kernels pallas_sm90,pallas
    run 150 decode-uniform python3 bench/decode.py --out "$out/uniform" --no-check --no-ragged --device-time \
        --shapes 128x16x8192,64x16x4096,32x16x1024,8x16x4096 --dtypes bf16,fp8 --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
55) # session 27: the step with the narrow decode's work list from 64 requests on (the default now) against the grid
    # (a copy of this tree with NARROW_WORKLIST_MIN_BATCH out of reach), batch 128 at ctx 4k then 1k, bf16 (uniform
    # lengths: what the work list costs a step where it cannot win)
    out=${2:?}
    rm -rf /tmp/grid && mkdir /tmp/grid && cp -r mla_jax pallas_kernels bench /tmp/grid/
    sed -i 's/^NARROW_WORKLIST_MIN_BATCH = 64$/NARROW_WORKLIST_MIN_BATCH = 1 << 30/' /tmp/grid/pallas_kernels/mla_decode_sm90.py
    grep -q "^NARROW_WORKLIST_MIN_BATCH = 1 << 30" /tmp/grid/pallas_kernels/mla_decode_sm90.py || echo "no knob" >&2
    for ctx in 4096 1024; do
        run 110 "e2e-worklist-$ctx" python3 -m mla_jax.bench.e2e --out "$out/e2e-worklist-$ctx" --weights bf16 \
            --batches 128 --ctxs $ctx --no-prefill --no-engine
        (cd /tmp/grid && run 110 "e2e-grid-$ctx" python3 -m mla_jax.bench.e2e --out "$out/e2e-grid-$ctx" \
            --weights bf16 --batches 128 --ctxs $ctx --no-prefill --no-engine)
    done
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
57) # session 28 (after the A/B on an H100: heads fastest in the grid, 377 -> 600 TFLOP/s at 1x8192x128, and P's row
    # sum after the schedule barrier, both in the kernel since then): the prefill grid on the H200 (the targets' card:
    # 640 / 620 TFLOP/s at 1x8192x128 / 4x4096x128; the kernel before took 502 / 472 there), with cuDNN's rows
    out=${2:?}
    verbose_tests 100 tests/pallas_kernels/test_flash_prefill_sm90.py
    run 200 prefill python3 bench/prefill.py --out "$out/prefill" --no-xla --kernels pallas,pallas_sm90
    # the Triton prefill with heads fastest too (scripts/ab/prefill-triton-heads.patch), against this tree's, twice each
    pf="$PWD/scripts/ab/prefill-triton-heads.patch"  # rebuilt in session 29
    [ -f "$pf" ] && for v in heads base2 heads2; do
        rm -rf "/tmp/ab-$v" && mkdir "/tmp/ab-$v" && cp -r mla_jax pallas_kernels bench "/tmp/ab-$v/"
        (cd "/tmp/ab-$v" && { [ "${v#heads}" = "$v" ] || git apply "$pf"; } && run 60 "triton-$v" python3 bench/prefill.py \
            --out "$out/triton-$v" --shapes-only --no-check --kernels pallas)
    done
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
58) # session 28, first call: the Hopper decode's GPU tests (the 64-row kernel's grid pieces and row lengths now derived
    # in the kernel, fe01f46; the one-wave work list and the step's plan, 3604d94), then the decode rows at 128 heads,
    # 1x128x32768 and 32x16x1024 (device time, bf16 / fp8 / fp8_qk) of this tree and of 3604d94's kernel file
    # (ab/prologue/, carried: the XLA prologue before the 64-row kernel)
    out=${2:?}
    verbose_tests 200 tests/pallas_kernels/test_mla_decode_sm90.py
    decode_rows() {  # decode_rows NAME: this directory's kernels
        run 120 "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --no-check --no-ragged --device-time \
            --shapes 1x128x32768,64x128x4096,128x128x8192,32x16x1024 --dtypes bf16,fp8 --kernels pallas_sm90
    }
    decode_rows new
    if [ -f ab/prologue/mla_decode_sm90.py ]; then
        rm -rf /tmp/prologue && mkdir /tmp/prologue && cp -r mla_jax pallas_kernels bench /tmp/prologue/
        cp ab/prologue/mla_decode_sm90.py /tmp/prologue/pallas_kernels/
        (cd /tmp/prologue && out=$out decode_rows base)
    fi
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
59) # session 28, second call: the step at batch 128 with the work list (one wave, built once a step) against the grid,
    # ctx 1k then 4k (part 55 on the H100: +2.9% at 1k), then the ragged rows
    out=${2:?}
    rm -rf /tmp/grid && mkdir /tmp/grid && cp -r mla_jax pallas_kernels bench /tmp/grid/
    sed -i 's/^NARROW_WORKLIST_MIN_BATCH = 64$/NARROW_WORKLIST_MIN_BATCH = 1 << 30/' /tmp/grid/pallas_kernels/mla_decode_sm90.py
    grep -q "^NARROW_WORKLIST_MIN_BATCH = 1 << 30" /tmp/grid/pallas_kernels/mla_decode_sm90.py || echo "no knob" >&2
    for ctx in 1024 4096; do
        run 100 "e2e-worklist-$ctx" python3 -m mla_jax.bench.e2e --out "$out/e2e-worklist-$ctx" --weights bf16 \
            --batches 128 --ctxs $ctx --no-prefill --no-engine
        (cd /tmp/grid && run 100 "e2e-grid-$ctx" python3 -m mla_jax.bench.e2e --out "$out/e2e-grid-$ctx" \
            --weights bf16 --batches 128 --ctxs $ctx --no-prefill --no-engine)
    done
    run 120 decode-ragged python3 bench/decode.py --out "$out/ragged" --ragged-only --no-check --dtypes bf16,fp8 \
        --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
60) # session 29, first call: on an H200 (the targets' card), the prefill grid with heads fastest (part 57's rows
    # without the Triton A/B) and the decode rows at 128 heads, 1x128x32768 and 32x16x1024 since the 64-row kernel's
    # in-kernel prologue (fe01f46); on an H100, the ragged fp8 row at _WORKLIST_MIN_PAGES 4 / 8 / 16 (fp8 ragged
    # 1.24x its uniform, the piece's fixed cost) and the Triton prefill heads-fastest A/B
    out=${2:?}
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
        verbose_tests 90 tests/pallas_kernels/test_flash_prefill_sm90.py
        run 150 prefill python3 bench/prefill.py --out "$out/prefill" --no-xla --kernels pallas_sm90
        run 150 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
            --shapes 64x128x4096,128x128x8192,1x128x32768,32x16x1024 --dtypes bf16,fp8 --kernels pallas_sm90
    else
        for mp in 4 8 16; do
            rm -rf "/tmp/mp$mp" && mkdir "/tmp/mp$mp" && cp -r mla_jax pallas_kernels bench "/tmp/mp$mp/"
            sed -i "s/^_WORKLIST_MIN_PAGES = 4 /_WORKLIST_MIN_PAGES = $mp /" "/tmp/mp$mp/pallas_kernels/mla_decode_sm90.py"
            grep -q "^_WORKLIST_MIN_PAGES = $mp " "/tmp/mp$mp/pallas_kernels/mla_decode_sm90.py" || echo "no knob" >&2
            (cd "/tmp/mp$mp" && run 90 "ragged-mp$mp" python3 bench/decode.py --out "$out/ragged-mp$mp" --ragged-only \
                --no-check --dtypes fp8,bf16 --kernels pallas_sm90 --device-time)
        done
        pf="$PWD/scripts/ab/prefill-triton-heads.patch"  # rebuilt in session 29
        [ -f "$pf" ] && for v in heads base2 heads2; do
            rm -rf "/tmp/ab-$v" && mkdir "/tmp/ab-$v" && cp -r mla_jax pallas_kernels bench "/tmp/ab-$v/"
            (cd "/tmp/ab-$v" && { [ "${v#heads}" = "$v" ] || git apply "$pf"; } && run 60 "triton-$v" python3 \
                bench/prefill.py --out "$out/triton-$v" --shapes-only --no-check --kernels pallas)
        done
    fi
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
61) # session 29: the step on an H200 at batch 1 / 32 / 128, ctx 1k / 4k, bf16 weights and cache (batch 128 at ctx
    # 4k does not fit an H100), since the one-wave work list and the in-kernel prologue
    out=${2:?}
    run 400 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 1,32,128 --ctxs 1024,4096 \
        --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
62) # session 29: the fp8 q split / quantization in the kernels (no XLA or Triton kernel before each call): the Hopper
    # decode's GPU tests, then the 16-head rows and two 128-head rows (device time, bf16 / fp8 / fp8_qk) of this tree
    # and of the kernel files before (ab/qsplit_base/, carried)
    out=${2:?}
    verbose_tests 200 tests/pallas_kernels/test_mla_decode_sm90.py
    rows16() {  # rows16 NAME: this directory's kernels
        run 150 "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged \
            --device-time --shapes 32x16x1024,64x16x4096,128x16x8192,1x16x4096,1x128x32768,64x128x4096 --dtypes fp8,bf16 \
            --kernels pallas_sm90
    }
    rows16 new
    if [ -d ab/qsplit_base ]; then
        rm -rf /tmp/qbase && mkdir /tmp/qbase && cp -r mla_jax pallas_kernels bench /tmp/qbase/
        cp -r ab/qsplit_base/* /tmp/qbase/
        (cd /tmp/qbase && out=$out rows16 base)
    fi
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
63) # the 64-row kernel's fp8_qk q quantized in the kernel, reading its windows twice (1297d39; part 62's one-pass
    # version spilled: 41.1 against 31.0 us of kernel at 1x128x32768 on an H100) against this tree's XLA quantize
    # before the call: put 1297d39's pallas_kernels/mla_decode_sm90{,_narrow}.py under ab/q64two/pallas_kernels/
    # (gitignored via .git/info/exclude) and pass carry=["ab"]; the fp8 GPU tests of that tree, then fp8 rows of both
    out=${2:?}
    [ -d ab/q64two ] || { echo "part 63 needs ab/q64two (1297d39's two kernel files)" >&2; exit 2; }
    rm -rf /tmp/q64 && mkdir /tmp/q64 && cp -r mla_jax pallas_kernels bench tests pyproject.toml /tmp/q64/ && cp -r ab/q64two/* /tmp/q64/
    (cd /tmp/q64 && verbose_tests 80 tests/pallas_kernels/test_mla_decode_sm90.py -k "fp8 or split")
    run 80 decode-xla python3 bench/decode.py --out "$out/decode-xla" --quick --no-check --no-ragged --device-time \
        --shapes 1x128x32768,64x128x4096 --dtypes fp8 --kernels pallas_sm90
    (cd /tmp/q64 && run 80 decode-twopass python3 bench/decode.py --out "$out/decode-twopass" --quick --no-check \
        --no-ragged --device-time --shapes 1x128x32768,64x128x4096 --dtypes fp8 --kernels pallas_sm90)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
64) # session 29, last: the final narrow fp8 split (one row reduction) on the GPU, sized for ~5 minutes of device time:
    # the fp8 GPU tests, then the 16-head fp8 rows (on an H200 these are the 32x16x1024 target's rows)
    out=${2:?}
    verbose_tests 80 tests/pallas_kernels/test_mla_decode_sm90.py -k "fp8 or split"
    run 70 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 32x16x1024,1x16x4096 --dtypes fp8,bf16 --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
65) # (ran once, c2c88f4: the f16 A/B below lost, and its _PV_F16 knob is deleted since) session 30, first call: the final narrow fp8 split and the merged lse without a slice (ad54943) on the GPU: the
    # fp8 / split / merge GPU tests, the 16-head rows (the 32x16x1024 target: fp8 <= bf16); on an H200 also the
    # 128-head rows (in-kernel prologue, q split) and the prefill grid with heads fastest
    out=${2:?}
    verbose_tests 100 tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py \
        -k "fp8 or split or merge or tiny"
    run 100 decode16 python3 bench/decode.py --out "$out/decode16" --quick --no-check --no-ragged --device-time \
        --shapes 32x16x1024,1x16x4096,64x16x4096,128x16x8192 --dtypes fp8,bf16 --kernels pallas_sm90
    # the narrow fp8 kernel with its V slots and P in f16 (the cast one cvt a pair instead of five; P normalized per page)
    rm -rf /tmp/n16 && mkdir /tmp/n16 && cp -r mla_jax pallas_kernels bench /tmp/n16/
    sed -i "s/^_PV_F16 = False$/_PV_F16 = True/" /tmp/n16/pallas_kernels/mla_decode_sm90_narrow.py
    grep -q "^_PV_F16 = True$" /tmp/n16/pallas_kernels/mla_decode_sm90_narrow.py || echo "n16: no knob" >&2
    (cd /tmp/n16 && run 100 decode16-f16 python3 bench/decode.py --out "$out/decode16-f16" --quick --no-check \
        --no-ragged --device-time --shapes 32x16x1024,1x16x4096,64x16x4096,128x16x8192 --dtypes fp8 --kernels pallas_sm90)
    # the 64-row fp8 variants: V cast to f16 (one cvt a pair) and P.V in f16, now that the cast moves 8 B a thread
    run 150 sweep128 python3 bench/decode.py --out "$out/sweep128" --sweep --quick --no-check --no-ragged --device-time \
        --shapes 64x128x4096 --dtypes fp8 --kernels pallas_sm90
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
        run 150 decode128 python3 bench/decode.py --out "$out/decode128" --quick --no-check --no-ragged --device-time \
            --shapes 64x128x4096,128x128x8192,1x128x32768 --dtypes bf16,fp8 --kernels pallas_sm90
        run 130 prefill python3 bench/prefill.py --out "$out/prefill" --no-xla --kernels pallas_sm90
    fi
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
66) # session 30, second call: the transposed merge with >= 256 programs (batch 1 at 64 splits ran 32) against the file
    # before (ab/merge_base/, carried) at batch 1 / 8 / 32; batch 1's split count (the sweep); then part 63's rows
    # alone (the 64-row fp8_qk q quantized in the kernel, two passes, ab/q64two/, against XLA's; its tests later)
    out=${2:?}
    m16() {  # m16 NAME: this directory's kernels
        run 70 "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged \
            --device-time --shapes 1x16x4096,8x16x4096,32x16x1024 --dtypes bf16,fp8 --kernels pallas_sm90
    }
    m16 new
    if [ -d ab/merge_base ]; then
        rm -rf /tmp/mbase && mkdir /tmp/mbase && cp -r mla_jax pallas_kernels bench /tmp/mbase/ && cp -r ab/merge_base/* /tmp/mbase/
        (cd /tmp/mbase && out=$out m16 base)
    fi
    run 90 sweep-b1 python3 bench/decode.py --out "$out/sweep-b1" --sweep --quick --no-check --no-ragged --device-time \
        --shapes 1x16x4096 --dtypes bf16,fp8 --kernels pallas_sm90
    if [ -d ab/q64two ]; then
        rm -rf /tmp/q64 && mkdir /tmp/q64 && cp -r mla_jax pallas_kernels bench /tmp/q64/ && cp -r ab/q64two/* /tmp/q64/
        run 70 decode-xla python3 bench/decode.py --out "$out/decode-xla" --quick --no-check --no-ragged --device-time \
            --shapes 1x128x32768,64x128x4096 --dtypes fp8 --kernels pallas_sm90
        (cd /tmp/q64 && run 70 decode-twopass python3 bench/decode.py --out "$out/decode-twopass" --quick --no-check \
            --no-ragged --device-time --shapes 1x128x32768,64x128x4096 --dtypes fp8 --kernels pallas_sm90)
    fi
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
67) # session 30, for the next: the 64-row fp8_qk's q quantize as one Triton kernel (quantize_q_fp8_rows) against XLA's
    # three kernels (a copy with the call switched back), its GPU tests first; fp8 rows at 128 heads
    out=${2:?}
    verbose_tests 100 tests/pallas_kernels/test_mla_decode_sm90.py -k "quantize or fp8_qk"
    rows128() {
        run 80 "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged --device-time \
            --shapes 1x128x32768,64x128x4096 --dtypes fp8 --kernels pallas_sm90
    }
    rows128 new
    ab_copy /tmp/qxla pallas_kernels/mla_decode_sm90.py \
        's/q_rows, q_scale = quantize_q_fp8_rows(q.reshape(b, m_rows, d), l, interpret=bool(interpret))/q_rows, q_scale = quantize_q_fp8(q.reshape(b, m_rows, d))/' \
        "q_rows, q_scale = quantize_q_fp8(q.reshape"
    (cd /tmp/qxla && out=$out rows128 xla)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
68) # (ran once, 48712e9: bf16 won; the 64-row kernel's knob `_partial_dtype` is gone since, its staging shared with the
    # final output's, so its sed below no longer matches) session 31: split partials in bf16 (both Hopper decodes; the
    # merges read either dtype): the GPU tests, then the
    # rows that split (batch 1 at 128 / 16 heads, 32x16x1024) against a copy with f32 partials
    out=${2:?}
    verbose_tests 170 tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py
    rows() {
        run 150 "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged --device-time \
            --shapes 1x128x32768,1x16x4096,32x16x1024 --dtypes bf16,fp8 --kernels pallas_sm90
    }
    rows bf16
    ab_copy /tmp/pf32 pallas_kernels/mla_decode_sm90_narrow.py 's/^_PARTIAL_DTYPE = BF16$/_PARTIAL_DTYPE = jnp.float32/' \
        "^_PARTIAL_DTYPE = jnp.float32"
    sed -i 's/^    return cfg.final_dtype$/    return jnp.float32/' /tmp/pf32/pallas_kernels/mla_decode_sm90.py
    grep -q "^    return jnp.float32$" /tmp/pf32/pallas_kernels/mla_decode_sm90.py || echo "pf32: no 64-row knob" >&2
    (cd /tmp/pf32 && out=$out rows f32)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
69) # session 31: the merges load the partials without waiting for the lse (unmasked by `alive`, dead splits selected
    # away): the GPU tests, then rows with splits (bf16) against the masked merge (ab/mla_decode_masked.py, carried)
    out=${2:?}
    verbose_tests 170 tests/pallas_kernels/test_mla_decode_sm90.py tests/pallas_kernels/test_mla_decode.py
    rows() {
        run 120 "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged --device-time \
            --shapes 1x128x32768,1x16x4096,8x16x4096,32x16x1024 --dtypes bf16 --kernels pallas_sm90
    }
    rows unmasked
    rm -rf /tmp/masked && mkdir /tmp/masked && cp -r mla_jax pallas_kernels bench /tmp/masked/
    cp ab/mla_decode_masked.py /tmp/masked/pallas_kernels/mla_decode.py || echo "masked: no ab file" >&2
    (cd /tmp/masked && out=$out rows masked)
    rows unmasked2
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
70) # (ran once, f533f3b: the narrow kernel won and is the batch-1 route since 96eaffe, so the sed below no longer
    # matches; the decode rows alone still compare both kernels) session 31: one request's 16 rows of a bf16 cache,
    # Triton (the route since session 20) against the narrow Hopper
    # kernel since bf16 partials and the unmasked transposed merge: both kernels in one bench, then the batch-1 step
    # with each route (a copy whose batch-1 rule sends a bf16 cache's narrow rows to the Hopper kernel)
    out=${2:?}
    run 120 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 1x16x1024,1x16x4096,1x16x16384,1x32x4096 --dtypes bf16 --kernels pallas,pallas_sm90
    e2e() {
        run 170 "e2e-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-$1" --weights bf16 --batches 1 --ctxs 1024,4096 \
            --no-prefill --no-engine
    }
    e2e triton
    ab_copy /tmp/n1 mla_jax/attention.py \
        's/if q.shape\[0\] == 1 and not (narrow and jnp.dtype(cache.dtype) == jnp.float8_e4m3fn):/if q.shape[0] == 1 and not narrow:/' \
        "if q.shape\[0\] == 1 and not narrow:"
    (cd /tmp/n1 && out=$out e2e narrow)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
71) # session 31, for the next: where the batch-1 and batch-32 steps' time goes since the batch-1 route change (the
    # narrow kernel for a bf16 cache) and bf16 partials: e2e rows with a device trace (kernels a layer, by part), any
    # card (the H200 trace of batch 1 is from 35e307e, Triton's route)
    out=${2:?}
    run 300 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 1,32 --ctxs 4096 --no-prefill \
        --no-engine --profile /tmp/prof
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
72) # (ran in part 73, session 32: bf16 won and is in pallas_kernels/mla_decode.py since 31714ac) session 31: the portable
    # Triton decode's split partials in bf16 against f32
    echo "part 72 ran in part 73 (session 32)" >&2; exit 2 ;;
73) # (ran once on an H100; its H100 branch's A/B is taken since 31714ac, so that sed no longer matches) session 32, first
    # call: the 64-row decode's shared epilogue staging (115cfaa, never on a GPU): the Hopper
    # decode's GPU tests, the target decode rows (on an H200 the targets' own; on an H100 a regression check against
    # session 31's), then on an H200 part 70's batch-1 rows (the route decided on an H100), on an H100 part 72's A/B
    out=${2:?}
    verbose_tests 150 tests/pallas_kernels/test_mla_decode_sm90.py
    run 150 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 64x128x4096,128x128x8192,1x128x32768,32x16x1024 --dtypes bf16,fp8 --kernels pallas_sm90
    if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
        run 120 decode-b1 python3 bench/decode.py --out "$out/decode-b1" --quick --no-check --no-ragged --device-time \
            --shapes 1x16x1024,1x16x4096,1x16x16384,1x32x4096 --dtypes bf16 --kernels pallas,pallas_sm90
    else
        rows() {
            run 120 "triton-$1" python3 bench/decode.py --out "$out/triton-$1" --quick --no-ragged --device-time \
                --shapes 1x16x4096,8x16x4096,32x16x1024,1x128x32768 --dtypes bf16,fp8 --kernels pallas
        }
        rows f32
        ab_copy /tmp/tbf pallas_kernels/mla_decode.py \
            's/o_dtype = q.dtype if final and not return_partials else jnp.float32/o_dtype = jnp.float32 if return_partials else q.dtype/' \
            "o_dtype = jnp.float32 if return_partials else q.dtype"
        (cd /tmp/tbf && out=$out rows bf16)
    fi
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
74) # session 32, second call (any card): part 71's traces (the batch-1 / 32 steps since the batch-1 route change and
    # bf16 partials), then the verify step at batch 32, k = 2 (576 routed copies: sorted here, by group in /tmp/wide)
    out=${2:?}
    run 280 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 1,32 --ctxs 4096 --no-prefill \
        --no-engine --profile /tmp/prof
    verify_b32k2 new 110 1.4
    overlay_trees
    (cd /tmp/wide && out=$out verify_b32k2 wide 110 1.4)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
75) # session 32, third call, on an H200 (needs_h200: batch 128 at ctx 4k does not fit an H100): the targets' decode
    # rows (128 heads, 1x128x32768, 32x16x1024), the e2e rows (part 61, batch 32 first: 1.09x roofline on an H100
    # at ctx 4k against 1.33x on the H200 in session 26), then the prefill rows since heads-fastest (never on an H200)
    out=${2:?}
    run 130 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 32x16x1024,64x128x4096,128x128x8192,1x128x32768 --dtypes bf16,fp8 --kernels pallas_sm90
    run 320 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 32,128,1 --ctxs 4096,1024 \
        --no-prefill --no-engine
    run 130 prefill python3 bench/prefill.py --out "$out/prefill" --no-xla --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
76) # session 32, the H100 fallback of part 75: the batch-1 step's trace with its optimized HLO (which ops are the two
    # ~1 us XLA kernels a layer, `memcpy32_post` and `loop_add_multiply_fusion`: the scan's loop overhead?), the step
    # with the layer scans unrolled (no loop: its per-layer scalar kernels gone, compile time against the scan's),
    # then part 74's verify A/B with a budget that fits the tree's sorted row
    out=${2:?}
    run 130 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 1 --ctxs 4096 --no-prefill \
        --no-engine --profile /tmp/prof
    f=$(find /tmp/prof -name step.hlo.txt | head -1) && [ -n "$f" ] && gzip -c "$f" >"$out/step.hlo.txt.gz"
    ab_copy /tmp/unroll mla_jax/model.py 's/scanned, length=count)$/scanned, length=count, unroll=True)/' \
        "length=count, unroll=True)"
    (cd /tmp/unroll && run 150 e2e-unrolled python3 -m mla_jax.bench.e2e --out "$out/e2e-unrolled" --weights bf16 \
        --batches 1 --ctxs 4096 --no-prefill --no-engine)
    verify_b32k2 new 150 2.2
    overlay_trees
    (cd /tmp/wide && out=$out verify_b32k2 wide 150 2.2)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
77) # (superseded by parts 79 and 81, session 33)
    # session 32 (prepared, not run): the batch-1 trace with its optimized HLO, the step with both layer scans unrolled
    # (its per-layer scalar kernels gone? step and compile time against the scan's), then batch 128's trace and HLO at
    # ctx 1k (fits an H100): which copies are its 5 `memcpy128` and 4 `memcpy32_post` a layer (0.63 ms a step on the
    # H200, e95e17d's trace)
    out=${2:?}
    hlo() { f=/tmp/prof/$1/step.hlo.txt && [ -f "$f" ] && gzip -c "$f" >"$out/step-$1.hlo.txt.gz"; }
    run 110 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 1 --ctxs 4096 --no-prefill \
        --no-engine --profile /tmp/prof
    hlo b1-ctx4096
    ab_copy /tmp/unroll mla_jax/model.py 's/scanned, length=count)$/scanned, length=count, unroll=True)/' \
        "length=count, unroll=True)"
    (cd /tmp/unroll && run 150 e2e-unrolled python3 -m mla_jax.bench.e2e --out "$out/e2e-unrolled" --weights bf16 \
        --batches 1 --ctxs 4096 --no-prefill --no-engine)
    run 150 e2e-b128 python3 -m mla_jax.bench.e2e --out "$out/e2e-b128" --weights bf16 --batches 128 --ctxs 1024 \
        --no-prefill --no-engine --profile /tmp/prof
    hlo b128-ctx1024
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
78) # (superseded by part 82, session 33: the thresholds at 128 won and are taken)
    # session 32 (prepared): batch 128 takes none of the decode-size kernels (LINEAR_MAX_T, HEAD_MATMUL_MAX_T and
    # ROUTER_IN_NORM_MAX_T are 64: XLA's GEMMs, the slices of their fused output, a separate router GEMV and norm) and
    # sorts its 768 routed copies (BY_GROUP_MAX_COPIES 256): 1,052 kernels a step against batch 32's 426. The step at
    # batch 128, ctx 1k (fits an H100): this tree, the three thresholds at 128, by group up to 1024 copies, both
    out=${2:?}
    b128() { run 140 "e2e-b128-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-b128-$1" --weights bf16 --batches 128 \
        --ctxs 1024 --no-prefill --no-engine; }
    t128() {  # t128 DIR: the three token thresholds at 128 in DIR's copy
        sed -i 's/^LINEAR_MAX_T = 64$/LINEAR_MAX_T = 128/; s/^ROUTER_IN_NORM_MAX_T = 64$/ROUTER_IN_NORM_MAX_T = 128/' \
            "$1/mla_jax/layers.py"
        sed -i 's/^HEAD_MATMUL_MAX_T = 64$/HEAD_MATMUL_MAX_T = 128/' "$1/mla_jax/mla.py"
        [ "$(cat "$1/mla_jax/layers.py" "$1/mla_jax/mla.py" | grep -c '_MAX_T = 128$')" = 3 ] \
            || echo "t128: a threshold moved" >&2
    }
    b128 new
    overlay_trees  # /tmp/wide: by group up to 1024 copies
    rm -rf /tmp/t128 && mkdir /tmp/t128 && cp -r mla_jax pallas_kernels bench /tmp/t128/ && t128 /tmp/t128
    (cd /tmp/t128 && out=$out b128 t128)
    (cd /tmp/wide && out=$out b128 wide)
    t128 /tmp/wide && (cd /tmp/wide && out=$out b128 both)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
79) # session 33 (any card): the dense linears at one token as FMA tiles (a GEMV: no rows padded to the dot's 16;
    # q_proj + kv_a 7.6 us at 0.65 of copy, o_proj on XLA's GEMV 4.5 us at 0.61 on the H100), swept; the batch-1 step
    # (ctx 4k) with its trace and optimized HLO, then with the sweep's best FMA tile at one token and o_proj on the
    # kernel, then with XLA running a command buffer's independent kernels concurrently (its default, LHS, runs them
    # one after another: cache_write and absorb_q, 2 + 3.2 us a layer, need not wait for each other)
    out=${2:?}
    run 150 linear python3 bench/linear.py --out "$out/linear" --names q_kv_a,o_proj --tokens 1 --sweep \
        --sweep-budget-s 80
    b1() { run "$1" "e2e-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-$2" --weights bf16 --batches 1 --ctxs 4096 \
        --no-prefill --no-engine "${@:3}"; }
    b1 110 base --profile /tmp/prof
    f=/tmp/prof/b1-ctx4096/step.hlo.txt && [ -f "$f" ] && gzip -c "$f" >"$out/step-b1-ctx4096.hlo.txt.gz"
    tile=$(python3 - "$out/linear/linear-h200.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])).get("sweep", []) if r.get("name") == "q_kv_a" and r.get("T") == 1
        and r.get("variant", {}).get("block_t") == 1 and r.get("device_us") and r.get("check_err", 1) < 2e-2]
v = min(rows, key=lambda r: r["device_us"])["variant"] if rows else dict(block_n=8, block_k=1024, num_warps=4, num_stages=2)
print(f"({v['block_n']}, {v['block_k']}, {v['num_warps']}, {v['num_stages']})")
PY
)
    echo "fma tile: $tile"
    ab_copy /tmp/fma pallas_kernels/linear.py "s/^FMA_MAX_T = 0$/FMA_MAX_T = 1/; s/^FMA_TILE = .*$/FMA_TILE = $tile/" \
        "^FMA_MAX_T = 1$"
    sed -i 's/^XLA_GEMV_MAX_K = 2048$/XLA_GEMV_MAX_K = 0/' /tmp/fma/mla_jax/layers.py
    grep -q "^XLA_GEMV_MAX_K = 0$" /tmp/fma/mla_jax/layers.py || echo "/tmp/fma: no XLA_GEMV_MAX_K" >&2
    (cd /tmp/fma && out=$out b1 120 fma --profile /tmp/prof-fma)
    XLA_FLAGS=--xla_gpu_command_buffer_scheduling_mode=CONCURRENT b1 100 concurrent
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
80) # session 33 (any card), next: batch 128's experts, 0.77 / 0.74 of copy (glu / down, H200 trace e95e17d: 9.1 of
    # the step's 16.0 ms) where batch 32's reach ~1.0: the sorted bf16 kernels at T = 128 (never swept; 16-row tiles
    # of [0, M) for ~12 copies an expert, so most experts are read by two items), swept with this tree's tiles and
    # with each group's own tiles (GROUP_ALIGNED_TILES, /tmp/aligned); their GPU tests with aligned tiles
    out=${2:?}
    ab_copy /tmp/aligned pallas_kernels/grouped_matmul.py 's/^GROUP_ALIGNED_TILES = False$/GROUP_ALIGNED_TILES = True/' \
        "^GROUP_ALIGNED_TILES = True$"
    cp -r tests pyproject.toml /tmp/aligned/ && (cd /tmp/aligned && verbose_tests 120 \
        tests/pallas_kernels/test_grouped_matmul.py)
    run 130 moe python3 bench/moe_decode.py --out "$out/moe" --tokens 128 --weights bf16 --routing sorted \
        --budget-s 80
    (cd /tmp/aligned && run 130 moe-aligned python3 bench/moe_decode.py --out "$out/moe-aligned" --tokens 128 \
        --weights bf16 --routing sorted --budget-s 80)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;  # (its verify A/B is part 85's since session 34)
81) # session 33 (any card), after part 79: the batch-1 step (ctx 4k) without the layer loop's two ~1 us kernels a
    # layer (`loop_add_multiply_fusion`, `memcpy32_post`: the while loop's condition and its copy to the host?): both
    # layer scans unrolled; the loops as CUDA graph conditionals (+WHILE, +CONDITIONAL) and unrolled in the command
    # buffer; that with concurrent scheduling; this tree again for the spread
    out=${2:?}
    b1() { run "$1" "e2e-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-$2" --weights bf16 --batches 1 --ctxs 4096 \
        --no-prefill --no-engine; }
    cb="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL --xla_gpu_command_buffer_unroll_loops=true"
    b1 100 base
    XLA_FLAGS="$cb" b1 110 while
    XLA_FLAGS="$cb --xla_gpu_command_buffer_scheduling_mode=CONCURRENT" b1 110 while-concurrent
    ab_copy /tmp/unroll mla_jax/model.py 's/scanned, length=count)$/scanned, length=count, unroll=True)/' \
        "length=count, unroll=True)"
    (cd /tmp/unroll && out=$out b1 150 unrolled)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
82) # session 33 (any card): the decode-size kernels (linear, head matmul, the router in the norm) up to 128 tokens
    # where they stop at 64 today: batch 128 (ctx 1k: 1,052 kernels a step against batch 32's 426, 5 weight copies a
    # layer, `memcpy128`, for XLA's GEMMs of the scanned weights) and the verify step at batch 32, k = 2 (96 rows:
    # issue 24's 1.19x against 1.15x), each against this tree in the same call
    out=${2:?}
    rm -rf /tmp/t128 && mkdir /tmp/t128 && cp -r mla_jax pallas_kernels bench /tmp/t128/
    sed -i 's/^LINEAR_MAX_T = 64$/LINEAR_MAX_T = 128/; s/^ROUTER_IN_NORM_MAX_T = 64$/ROUTER_IN_NORM_MAX_T = 128/' \
        /tmp/t128/mla_jax/layers.py
    sed -i 's/^HEAD_MATMUL_MAX_T = 64$/HEAD_MATMUL_MAX_T = 128/' /tmp/t128/mla_jax/mla.py
    [ "$(cat /tmp/t128/mla_jax/layers.py /tmp/t128/mla_jax/mla.py | grep -c '_MAX_T = 128$')" = 3 ] \
        || echo "t128: a threshold moved" >&2
    b128() { run 130 "e2e-b128-$1" python3 -m mla_jax.bench.e2e --out "$out/e2e-b128-$1" --weights bf16 --batches 128 \
        --ctxs 1024 --no-prefill --no-engine; }
    (cd /tmp/t128 && b128 t128)
    b128 new
    (cd /tmp/t128 && verify_b32k2 t128 140 2.0)
    verify_b32k2 new 140 2.0
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
83) # session 33 (any card; prepared): the narrow decode kernel marked for programmatic dependent launch (it waits,
    # `griddepcontrol.wait`, before its first read, so Mosaic GPU launches it with PDL: its launch overlaps the end of
    # the kernel before it); its GPU tests, then the batch-1 step (ctx 4k / 1k) with and without it (PDL = False), and
    # with XLA's PDL for its own kernels too (--xla_gpu_enable_pdl=true: an unknown flag fails at once)
    out=${2:?}
    ab_copy /tmp/pdlt pallas_kernels/mla_decode_sm90_narrow.py 's/^PDL = False$/PDL = True/' "^PDL = True$"
    cp -r tests pyproject.toml /tmp/pdlt/ && (cd /tmp/pdlt && verbose_tests 150 tests/pallas_kernels/test_mla_decode_sm90.py)
    b1() { run "$1" "e2e-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-$2" --weights bf16 --batches 1 \
        --ctxs 4096,1024 --no-prefill --no-engine; }
    b1 130 nopdl
    ab_copy /tmp/pdl pallas_kernels/mla_decode_sm90_narrow.py 's/^PDL = False$/PDL = True/' "^PDL = True$"
    (cd /tmp/pdl && b1 130 pdl)
    (cd /tmp/pdl && XLA_FLAGS=--xla_gpu_enable_pdl=true b1 120 xla-pdl)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
84) # session 33 (any card; prepared; rewritten in session 34, after part 90 took items by group up to 1024 copies):
    # batch 128 (ctx 1k) with its device trace (by group since session 34); sorted (BY_GROUP_MAX_COPIES 256,
    # /tmp/sorted) in each group's own row tiles (GROUP_ALIGNED_TILES: the sorted path's, > 1024 copies); the router
    # back on its own GEMV (ROUTER_IN_NORM_MAX_T 64: the norm's 16 programs a row re-read the router's 512 KB from L2,
    # 64 MB a layer at 128 tokens)
    out=${2:?}
    b128() { run "$1" "e2e-b128-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-b128-$2" --weights bf16 \
        --batches 128 --ctxs 1024 --no-prefill --no-engine "${@:3}"; }
    b128 140 tree --profile /tmp/prof
    sorted_tree
    (cd /tmp/sorted && b128 120 sorted)
    sed -i 's/^GROUP_ALIGNED_TILES = False$/GROUP_ALIGNED_TILES = True/' /tmp/sorted/pallas_kernels/grouped_matmul.py
    (cd /tmp/sorted && b128 120 sorted-aligned)
    ab_copy /tmp/r64 mla_jax/layers.py 's/^ROUTER_IN_NORM_MAX_T = 128$/ROUTER_IN_NORM_MAX_T = 64/' \
        "^ROUTER_IN_NORM_MAX_T = 64$"
    (cd /tmp/r64 && b128 120 r64)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
85) # session 34 (any card): what the verify step at batch 32, k = 2 (96 rows, ctx 1k; 1.236x the plain step on an
    # H100 sorted, target 1.15x) spends beyond the plain step: both steps traced (spec.py --profile:
    # spec-profile-b32-h200.json, kernels and us per step part of each), its 576 routed copies by group (this tree since
    # session 34), then sorted (/tmp/sorted), traced too
    out=${2:?}
    vprof() { run "$1" "spec-$2" python3 bench/spec.py --out "$out/spec-$2" --no-demo --batches 32 --ks 2 \
        --ctxs 1024 --mtp-ks "" --budget-min 2.5 --profile "/tmp/sprof-$2" --profile-batches 32; }
    vprof 210 bygroup
    sorted_tree
    (cd /tmp/sorted && vprof 200 sorted)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
86) # session 34, on an H200 (needs_h200: batch 128 at ctx 4k does not fit an H100), after part 75: batch 128 at ctx 4k
    # and 1k (the targets' rows: 1.43x / 1.61x at 4fc5932, target 1.3x) by group (this tree since session 34) against
    # sorted (/tmp/sorted)
    out=${2:?}
    b128() { run "$1" "e2e-b128-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-b128-$2" --weights bf16 \
        --batches 128 --ctxs 4096,1024 --no-prefill --no-engine; }
    b128 180 tree
    sorted_tree
    (cd /tmp/sorted && b128 170 sorted)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
87) # session 34 (any card): absorb_q beside the cache write in one launch (mla.ABSORB_WITH_CACHE_WRITE, off until
    # measured: pallas_kernels/launch.py): its GPU tests (and the two kernels' own), then the batch-1 / 32 steps at
    # ctx 4k without and with it (batch 1: absorb_q 3.1 + cache_write 2.0 us a layer, one after the other, H100)
    out=${2:?}
    ab_copy /tmp/fuse mla_jax/mla.py 's/^ABSORB_WITH_CACHE_WRITE = False$/ABSORB_WITH_CACHE_WRITE = True/' \
        "^ABSORB_WITH_CACHE_WRITE = True$"
    cp -r tests pyproject.toml /tmp/fuse/ && (cd /tmp/fuse && verbose_tests 150 tests/pallas_kernels/test_launch.py \
        tests/pallas_kernels/test_cache_write.py tests/pallas_kernels/test_head_matmul.py)
    steps() { run "$1" "e2e-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-$2" --weights bf16 --batches 1,32 \
        --ctxs 4096 --no-prefill --no-engine; }
    steps 160 tree
    (cd /tmp/fuse && steps 160 fused)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
88) # (superseded by part 90, which ran in session 34; overlay_trees is this tree since) session 34 (any card; one
    # call): items by group's compact list (only the slots' tiles, 738ec3f; the default path
    # of batch 8-32's experts) under its GPU tests, then part 84's batch-128 A/B at ctx 1k: sorted (this tree, traced),
    # each group's own tiles (GROUP_ALIGNED_TILES), by group up to 1024 copies (the compact list: ~131 items where the
    # old list had 576, most empty)
    out=${2:?}
    verbose_tests 120 tests/pallas_kernels/test_grouped_matmul.py \
        -k "gpu_shared_chunks or gpu_fp8_shared or gpu_fp8_glu or gpu_group_table"
    b128() { run "$1" "e2e-b128-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-b128-$2" --weights bf16 \
        --batches 128 --ctxs 1024 --no-prefill --no-engine "${@:3}"; }
    b128 130 tree --profile /tmp/prof
    ab_copy /tmp/aligned pallas_kernels/grouped_matmul.py 's/^GROUP_ALIGNED_TILES = False$/GROUP_ALIGNED_TILES = True/' \
        "^GROUP_ALIGNED_TILES = True$"
    (cd /tmp/aligned && b128 110 aligned)
    overlay_trees
    (cd /tmp/wide && b128 110 wide)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
89) # session 34, on an H200 in what is left of a budget (needs_h200): the targets' e2e rows (batch 32 / 128 at ctx 4k
    # and 1k, then batch 1; batch 128 by group since session 34) and batch 128 sorted beside them
    out=${2:?}
    e2e() { run "$1" "e2e-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-$2" --weights bf16 --batches "$3" \
        --ctxs 4096,1024 --no-prefill --no-engine; }
    e2e 200 tree 128,32
    sorted_tree
    (cd /tmp/sorted && e2e 120 sorted 128)
    e2e 100 b1 1
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
90) # (ran once, db65fa9 on an H100: by group 14.755 ms against sorted 15.438, taken; the fp8 GLU test ran out of the
    # GPU's memory under -n 8) session 34 (any card), part 88 cut to ~5 minutes: the compact by-group list's GPU tests, batch 128 at ctx 1k
    # sorted (this tree) against by group up to 1024 copies
    out=${2:?}
    verbose_tests 90 tests/pallas_kernels/test_grouped_matmul.py -k "gpu_shared_chunks or gpu_fp8_glu or gpu_group_table"
    b128() { run "$1" "e2e-b128-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-b128-$2" --weights bf16 \
        --batches 128 --ctxs 1024 --no-prefill --no-engine; }
    b128 100 tree
    overlay_trees
    (cd /tmp/wide && b128 100 wide)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
91) # session 34, for the next (any card; one call, ~9 minutes): what session 34 changed or built, in order of value:
    # the by-group fp8 GPU tests with two processes (part 90's ran out of memory under -n 8); the verify step at batch
    # 32, k = 2 by group (the default since 3195620) against sorted; absorb_q beside the cache write (part 87's GPU
    # tests, then the batch-1 step, ctx 4k, without and with it)
    out=${2:?}
    timeout -s INT 100 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 2 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_grouped_matmul.py -k "gpu_fp8_glu or gpu_fp8_shared or gpu_fp8_decode" \
        >"$out/gpu-tests-fp8.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu-tests-fp8.log" | cut -c1-160 | tail -12
    verify_b32k2 bygroup 110 1.4
    sorted_tree
    (cd /tmp/sorted && out=$out verify_b32k2 sorted 110 1.4)
    ab_copy /tmp/fuse mla_jax/mla.py 's/^ABSORB_WITH_CACHE_WRITE = False$/ABSORB_WITH_CACHE_WRITE = True/' \
        "^ABSORB_WITH_CACHE_WRITE = True$"
    cp -r tests pyproject.toml /tmp/fuse/ && (cd /tmp/fuse && verbose_tests 70 tests/pallas_kernels/test_launch.py)
    b1() { run "$1" "e2e-b1-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-b1-$2" --weights bf16 --batches 1 \
        --ctxs 4096 --no-prefill --no-engine; }
    b1 80 tree
    (cd /tmp/fuse && b1 80 fused)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
92) # session 35 (any card; ~6 minutes): the Hopper prefill on a persistent grid (PERSISTENT, bbb33ce) against a CTA per
    # tile: its GPU tests, then the fixed shapes both ways twice (two processes a side, alternating), then the sweep
    # (both grids and the other variants in one process, the varlen mix included); on an H200 the full rows (cuDNN,
    # varlen, chunk) with the winner's default
    out=${2:?}
    verbose_tests 110 tests/pallas_kernels/test_flash_prefill_sm90.py
    ab_copy /tmp/pers pallas_kernels/flash_prefill_sm90.py 's/^PERSISTENT = False$/PERSISTENT = True/' "^PERSISTENT = True$"
    pf() { run 90 "prefill-$2" python3 bench/prefill.py --out "$out/prefill-$2" --shapes-only --no-check --no-xla \
        --kernels pallas_sm90; }
    pf x grid1
    (cd /tmp/pers && pf x pers1)
    pf x grid2
    (cd /tmp/pers && pf x pers2)
    run 200 prefill-sweep python3 bench/prefill.py --out "$out/sweep" --sweep --sweep-budget-s 150 --shapes-only \
        --no-check --no-xla --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
93) # session 35, on an H200 (needs_h200; ~9 minutes): part 75's targets' decode and e2e rows, then the prefill's fixed
    # shapes (the 640 / 620 TFLOP/s targets; the persistent grid lost on an H100, part 92)
    out=${2:?}
    run 130 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 32x16x1024,64x128x4096,128x128x8192,1x128x32768 --dtypes bf16,fp8 --kernels pallas_sm90
    run 300 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 32,128,1 --ctxs 4096,1024 \
        --no-prefill --no-engine
    run 90 prefill python3 bench/prefill.py --out "$out/prefill" --shapes-only --no-xla --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
94) # session 35, an H100 in what was left (~6 minutes): part 91's rows that its limits cut: the verify step at batch 32,
    # k = 2 by group (the default; part 91's sorted run: 1.228x), then the batch-1 step at ctx 4k without and with
    # absorb_q beside the cache write
    out=${2:?}
    ab_copy /tmp/fuse mla_jax/mla.py 's/^ABSORB_WITH_CACHE_WRITE = False$/ABSORB_WITH_CACHE_WRITE = True/' \
        "^ABSORB_WITH_CACHE_WRITE = True$"
    b1() { run "$1" "e2e-b1-$2" python3 -m mla_jax.bench.e2e --out "$out/e2e-b1-$2" --weights bf16 --batches 1 \
        --ctxs 4096 --no-prefill --no-engine; }
    b1 130 tree
    (cd /tmp/fuse && b1 130 fused)
    verify_b32k2 bygroup 110 1.5
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
95) # session 35, on an H200 in ~6.5 minutes (needs_h200): the targets' decode rows, then the e2e rows at batch 32 / 128
    out=${2:?}
    run 120 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 32x16x1024,64x128x4096,128x128x8192,1x128x32768 --dtypes bf16,fp8 --kernels pallas_sm90
    run 250 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 32,128 --ctxs 4096,1024 \
        --no-prefill --no-engine
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
96) # (ran in session 38 on 87371ec, an H100: the overlap and three consumers lost and are gone) session 35, for
    # the next (any card, ~6 minutes): the Hopper prefill with FA3's intra-warpgroup overlap
    # (OVERLAP) against the ping-pong alone: its GPU cases, the fixed shapes both ways twice, alternating; then three
    # consumer warpgroups (block_q 192); ncu's DRAM bytes and L2 hit rate of each: part 98
    out=${2:?}
    timeout -s INT 75 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 8 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_flash_prefill_sm90.py -k "overlap or 3wgs" >"$out/gpu-tests.log" 2>&1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu-tests.log" | cut -c1-160 | tail -6
    ab_copy /tmp/ovl pallas_kernels/flash_prefill_sm90.py 's/^OVERLAP = False$/OVERLAP = True/' "^OVERLAP = True$"
    pf() { run 45 "prefill-$1" python3 bench/prefill.py --out "$out/prefill-$1" --shapes-only --no-check --no-xla \
        --kernels pallas_sm90; }
    (cd /tmp/ovl && pf ovl1)
    pf base1
    (cd /tmp/ovl && pf ovl2)
    pf base2
    # the overlap with FA3's register split (240 a consumer thread, 24 for the producer)
    ab_copy /tmp/ovl240 pallas_kernels/flash_prefill_sm90.py \
        's/^OVERLAP = False$/OVERLAP = True/; s/^_REGS_OVERLAP = (232, 40)$/_REGS_OVERLAP = (240, 24)/' \
        "^_REGS_OVERLAP = (240, 24)$"
    (cd /tmp/ovl240 && pf ovl240)
    # three consumer warpgroups (192 query rows a CTA, 64-key tiles: 1.5x the FLOPs per K/V byte), with the overlap
    ab_copy /tmp/wg3 pallas_kernels/flash_prefill_sm90.py \
        's/^OVERLAP = False$/OVERLAP = True/; s/^BLOCK_Q = 128 /BLOCK_Q = 192 /' "^BLOCK_Q = 192 "
    (cd /tmp/wg3 && pf wg3)
    ab_copy /tmp/wg3r pallas_kernels/flash_prefill_sm90.py \
        's/^OVERLAP = False$/OVERLAP = True/; s/^BLOCK_Q = 128 /BLOCK_Q = 192 /; s/^_REGS_3WG = (160, 32)$/_REGS_3WG = (152, 56)/' \
        "^_REGS_3WG = (152, 56)$"
    (cd /tmp/wg3r && pf wg3-r152)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
97) # session 36 (any card, ~7 minutes): the fp8 P.V operands' GPU test (V^T in registers from ldmatrix.trans + prmt, P^T in
    # their token order, O^T's latent order undone; tests/pallas_kernels/test_mgpu.py), then part 96
    out=${2:?}
    timeout -s INT 60 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mgpu.py >"$out/gpu-tests-mgpu.log" 2>&1
    echo "mgpu tests: rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$out/gpu-tests-mgpu.log" | cut -c1-200 | tail -12
    "$0" 96 "$out" ;;
99 | 100 | 101) # session 36 (any card): fp8 P.V in the 64-row kernel (FP8_PV: O^T = V^T P^T, V^T in registers, q
    # split in two e4m3 terms): the operands' GPU test, the 64-row fp8_qk GPU cases with it, then the fp8 decode rows
    # both ways (the tree's fp8_qk rows cast V to bf16) and the bf16 rows beside them (each row's error against
    # float32 checks it too). 99: ~8 minutes, every fp8_qk case and three shapes; 100: ~5, two cases and two shapes;
    # 101: ~3, no decode tests and 64x128x4096 only
    out=${2:?}
    case $1 in
        99) tests=fp8_qk shapes=64x128x4096,128x128x8192,1x128x32768 limits="60 120 100 130" ;;
        100) tests="fp8_qk_n128 or fp8_qk_worklist_q2" shapes=64x128x4096,1x128x32768 limits="45 75 80 100" ;;
        *) tests="" shapes=64x128x4096 limits="40 0 60 75" ;;
    esac
    read -r t_ops t_cases t_pv8 t_tree <<<"$limits"
    timeout -s INT "$t_ops" env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mgpu.py >"$out/gpu-tests-mgpu.log" 2>&1
    echo "mgpu tests: rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$out/gpu-tests-mgpu.log" | cut -c1-200 | tail -8
    ab_copy /tmp/pv8 pallas_kernels/mla_decode_sm90.py 's/^FP8_PV = False$/FP8_PV = True/' "^FP8_PV = True$"
    cp -r tests pyproject.toml /tmp/pv8/
    if [ -n "$tests" ]; then
        (cd /tmp/pv8 && timeout -s INT "$t_cases" env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 4 -m gpu \
            -p no:cacheprovider -rfE tests/pallas_kernels/test_mla_decode_sm90.py -k "$tests" >"$out/gpu-tests-pv8.log" 2>&1)
        echo "pv8 tests: rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$out/gpu-tests-pv8.log" | cut -c1-200 | tail -14
    fi
    dec() { run "$2" "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged \
        --device-time --shapes "$shapes" --dtypes "$3" --kernels pallas_sm90; }
    (cd /tmp/pv8 && dec pv8 "$t_pv8" fp8)
    dec tree "$t_tree" fp8,bf16
    # 99: where its warpgroups' time goes (the profiler's named scopes; 2 fp8 stages leave room for the buffer)
    [ "$1" = 99 ] && (cd /tmp/pv8 && run 70 trace-pv8 python3 bench/trace_sm90.py --out "$out" --dtype fp8 --fp8-qk \
        --l 512 --fp8-stages 2)
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
102) # session 37 (any card): the fp8 P.V kernel (now the 64-row fp8_qk) with three consumers (WG0 QK^T + softmax
    # only, WG1 / WG2 the P.V halves; PV8_CONSUMERS = 3) against two (part 99's schedule, WG0 bounding it), each
    # QK^T chain in its own accumulator: the operands' GPU test (its bound from the fp8 adds' precision), the fp8_qk
    # GPU cases, the decode rows of both schedules beside bf16, then the three-consumer trace (~8 minutes)
    out=${2:?}
    timeout -s INT 40 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mgpu.py >"$out/gpu-tests-mgpu.log" 2>&1
    echo "mgpu tests: rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error|assert" "$out/gpu-tests-mgpu.log" | cut -c1-200 | tail -8
    timeout -s INT 75 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py -k fp8_qk >"$out/gpu-tests-pv8.log" 2>&1
    echo "pv8 tests: rc=$?"; grep -E "PASSED|FAILED|ERROR|passed|failed|Max abs|Mismatched" "$out/gpu-tests-pv8.log" | cut -c1-200 | tail -16
    dec() { run "$2" "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged \
        --device-time --shapes 64x128x4096,128x128x8192,1x128x32768 --dtypes "$3" --kernels pallas_sm90; }
    dec tree 130 fp8,bf16
    ab_copy /tmp/c2 pallas_kernels/mla_decode_sm90.py 's/^PV8_CONSUMERS = 3$/PV8_CONSUMERS = 2/' "^PV8_CONSUMERS = 2$"
    (cd /tmp/c2 && dec c2 100 fp8)
    run 70 trace-pv8 python3 bench/trace_sm90.py --out "$out" --dtype fp8 --fp8-qk --l 512 --fp8-stages 2
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
106) # (ran in session 38 on 87371ec, an H100; its knobs are gone since: one term of q is fp8_q_split=False, the
    # partial mask the only path, three consumers deleted) session 38 (any card, ~9 minutes): the fp8 P.V kernel's knobs. q1: one e4m3 term
    # of q (PV8_Q_TERMS = 1: one QK^T chain, FlashMLA's footing, its error against the exact q in each row's rel_err);
    # m: the logits' mask only past each piece's full pages (MASK_EVERY_PAGE = False, all three 64-row bodies); qm:
    # both; q3 / q3a: both with three consumers (WG0 QK^T and the softmax only), without / with the next page's
    # QK^T in flight during the softmax. The GPU decode cases of qm first, then the 128-head decode rows.
    out=${2:?}
    k=pallas_kernels/mla_decode_sm90.py
    q1='s/^PV8_Q_TERMS = 2$/PV8_Q_TERMS = 1/'
    m='s/^MASK_EVERY_PAGE = True$/MASK_EVERY_PAGE = False/'
    c3='s/^PV8_CONSUMERS = 2$/PV8_CONSUMERS = 3/'
    ahead='s/^PV8_QK_AHEAD = False$/PV8_QK_AHEAD = True/'
    ab_copy /tmp/q1 $k "$q1" "^PV8_Q_TERMS = 1$"
    ab_copy /tmp/m $k "$m" "^MASK_EVERY_PAGE = False$"
    ab_copy /tmp/qm $k "$q1; $m" "^MASK_EVERY_PAGE = False$"
    ab_copy /tmp/q3 $k "$q1; $m; $c3" "^PV8_CONSUMERS = 3$"
    ab_copy /tmp/q3a $k "$q1; $m; $c3; $ahead" "^PV8_QK_AHEAD = True$"
    cp -r tests pyproject.toml /tmp/qm/
    (cd /tmp/qm && timeout -s INT 90 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 4 -m gpu \
        -p no:cacheprovider -rfE tests/pallas_kernels/test_mla_decode_sm90.py -k "matches_reference" \
        >"$out/gpu-tests-qm.log" 2>&1)
    echo "qm tests: rc=$?"; grep -E "FAILED|passed|failed" "$out/gpu-tests-qm.log" | tail -6
    dec() { run "$2" "decode-$1" python3 bench/decode.py --out "$out/decode-$1" --quick --no-check --no-ragged \
        --device-time --shapes 64x128x4096,128x128x8192 --dtypes "$3" --kernels pallas_sm90; }
    dec tree 90 fp8,bf16
    for v in qm q1; do (cd /tmp/$v && dec $v 65 fp8); done
    (cd /tmp/m && dec m 90 fp8,bf16)
    for v in q3 q3a; do (cd /tmp/$v && dec $v 65 fp8); done
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
107) # session 39, for the next (an H200 where one comes, else any card; ~8 minutes): the 64-row decode's GPU cases
    # (one term of q the fp8 P.V default since session 40; fp8_qk_split_n128: two terms), then the targets'
    # decode rows (one-term fp8_qk rows beside the two-term ones). Session 39's H100 run of it: the tests need > 90 s
    # (18 of 27 in 90 s), the bench ~65 s a shape from a cold compilation cache
    out=${2:?}
    timeout -s INT 200 env MLA_JAX_COMPILE_CACHE=off python3 -m pytest -v -n 4 -m gpu -p no:cacheprovider -rfE \
        tests/pallas_kernels/test_mla_decode_sm90.py -k "matches_reference" >"$out/gpu-tests.log" 2>&1
    echo "decode tests: rc=$?"; grep -E "FAILED|passed|failed" "$out/gpu-tests.log" | tail -6
    run 280 decode python3 bench/decode.py --out "$out/decode" --quick --no-check --no-ragged --device-time \
        --shapes 64x128x4096,128x128x8192,1x128x32768,32x16x1024 --dtypes bf16,fp8 --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
108) # session 39, for the next (on an H200, needs_h200: batch 128 at ctx 4k does not fit an H100; ~8 minutes): the
    # targets' e2e rows (part 93's), then the prefill's fixed shapes (the overlap and three consumers gone)
    out=${2:?}
    run 320 e2e python3 -m mla_jax.bench.e2e --out "$out/e2e" --weights bf16 --batches 32,128,1 --ctxs 4096,1024 \
        --no-prefill --no-engine
    run 150 prefill python3 bench/prefill.py --out "$out/prefill" --shapes-only --no-xla --kernels pallas_sm90
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
109) # (ran in session 41 on f7a1bb7, an H100, where None meant one term too: 168 registers, 28 / 32 B spilled at 3 / 4
    # pages, 146-150 / 127 us a call; one fp8 P.V body at 4 pages since) session 39 (any card, ~2.5 minutes): why a deeper fp8 ring costs the two-term fp8 P.V kernel
    # (178 against 165 us at 4 and 3 pages, 64x128x4096) and helps the one-term one (111 against 131): ptxas's
    # registers and spills of each (MOSAIC_GPU_DUMP_PTXAS), then device time of each at 64x128x4096
    out=${2:?}
    cat >/tmp/pv8_ptxas.py <<'PY'
import sys, time
import jax
from pallas_kernels import mla_decode_sm90 as k90
from pallas_kernels.testing import decode_inputs
q, cache, bt, sl, ks = decode_inputs(0, b=64, nq=1, n=128, l=512, r=64, g=64, max_pages=64,
                                     lens=[4096] * 64, cache_dtype="fp8")
for split, fst in [(None, 3), (None, 4), (False, 3), (False, 4)]:
    f = jax.jit(lambda *a, split=split, fst=fst: k90.mla_decode_sm90(
        *a[:4], kv_scale=a[4], scale=0.07, fp8_qk=True, fp8_q_split=split, fp8_stages=fst, num_kv_splits=1))
    print(f"=== fp8_q_split={split} fp8_stages={fst}", file=sys.stderr, flush=True)
    jax.block_until_ready(f(q, cache, bt, sl, ks))
    t = time.perf_counter()
    for _ in range(50):
        out = f(q, cache, bt, sl, ks)
    jax.block_until_ready(out)
    print(f"=== fp8_q_split={split} fp8_stages={fst}: {(time.perf_counter() - t) / 50 * 1e6:.1f} us a call",
          file=sys.stderr, flush=True)
PY
    run 150 pv8-ptxas env MOSAIC_GPU_DUMP_PTXAS=1 python3 /tmp/pv8_ptxas.py
    grep -E "^===|registers|spill" "$out/pv8-ptxas.log" | head -40
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
110) # (ran in session 42 on 24b9867, an H100, as a --no-check row: 144.65 against 134.79 us at 64x128x4096, lost;
    # QK_WITH_PV is gone) session 39, for the next (any card, ~8.5 minutes): WG0 of the 64-row kernel issuing page i's P.V and page i + 1's
    # QK^T back to back, waited for once (QK_WITH_PV) against the default, in one process (bench/decode.py --knob:
    # the sm90 GPU check cases for each value, then both values' grid rows on the same inputs: bf16, exact fp8, the
    # fp8 P.V rows, which do not take it since session 41), then its bf16 trace (L=384: the trace buffer's room)
    out=${2:?}
    run 420 decode-qkpv python3 bench/decode.py --out "$out/decode-qkpv" --quick --no-ragged --device-time \
        --kernels pallas_sm90 --shapes 64x128x4096,128x128x8192 --dtypes bf16,fp8 --only schedule=grid \
        --knob mla_decode_sm90.QK_WITH_PV=False,True
    grep -E "^correctness|FAIL|knob" "$out/decode-qkpv.log" | cut -c1-200 | head -30
    k=pallas_kernels/mla_decode_sm90.py
    ab_copy /tmp/qkpv $k 's/^QK_WITH_PV = False$/QK_WITH_PV = True/' "^QK_WITH_PV = True$"
    mkdir -p "$out/trace"
    (cd /tmp/qkpv && run 40 trace-qkpv python3 bench/trace_sm90.py --out "$out/trace" --dtype bf16)
    grep -E "per page|wg[01] " "$out/trace-qkpv.log" | head -20
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
111) # (ran in session 41 on f7a1bb7, an H100: the pairs won with one term, 0.94x, and are the only fp8 P.V body
    # since; PV8_PAIRS is gone) session 40 (any card, ~9 minutes): the fp8 P.V kernel's pages in pairs, one a consumer (PV8_PAIRS: each
    # consumer's own page's QK^T and softmax side by side, both pages' P.V on its half) against the default, in one
    # process: the sm90 GPU check cases under each value, then the 128-head fp8 P.V rows (two terms, one) on the same
    # inputs, then the pairs' trace (2 fp8 pages: the trace buffer's room; a pair holds both)
    out=${2:?}
    run 400 decode-pairs python3 bench/decode.py --out "$out/decode-pairs" --quick --no-ragged --device-time \
        --kernels pallas_sm90 --shapes 64x128x4096,128x128x8192,1x128x32768 --dtypes fp8 \
        --only fp8_qk=True --knob mla_decode_sm90.PV8_PAIRS=False,True
    grep -E "^correctness|FAIL|knob" "$out/decode-pairs.log" | cut -c1-200 | head -30
    # the bf16 rows of the same shapes in the same call (the issue's "never slower than bf16")
    run 100 decode-bf16 python3 bench/decode.py --out "$out/decode-bf16" --quick --no-check --no-ragged \
        --device-time --kernels pallas_sm90 --shapes 64x128x4096,128x128x8192,1x128x32768 --dtypes bf16 \
        --only schedule=grid
    k=pallas_kernels/mla_decode_sm90.py
    ab_copy /tmp/pairs $k 's/^PV8_PAIRS = False$/PV8_PAIRS = True/' "^PV8_PAIRS = True$"
    mkdir -p "$out/trace"
    (cd /tmp/pairs && run 40 trace-pairs python3 bench/trace_sm90.py --out "$out/trace" --dtype fp8 --fp8-qk --l 512 \
        --fp8-stages 2)
    grep -E "per page|wg[01] " "$out/trace-pairs.log" | head -20
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
112) # session 41, for the next (any card, ~1.5 minutes): the fp8 P.V kernel's pairs traced at its own 4 fp8 pages (one term
    # of q: Q 36 KB, 190 KB with the ring, room for the trace buffer; part 111 traced 2, where the ring's depth showed),
    # then 2 pages beside it for the comparison
    out=${2:?}
    mkdir -p "$out/trace"
    for f in 4 2; do
        run 60 "trace-pairs-fst$f" python3 bench/trace_sm90.py --out "$out/trace" --dtype fp8 --fp8-qk --l 512 \
            --fp8-stages $f
        grep -E "per page|wg[01] " "$out/trace-pairs-fst$f.log" | head -20
    done
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
113) # (ran in session 42 on 24b9867, an H100: the check cases took 216 / 331 s a value and the 420 s limit cut the
    # rows, taken then with --no-check: 128 / 192 columns -1.7% at 64x128x4096, +3.8 / +4.6% at 128x128x8192, lost;
    # WG0_COLS is gone) session 42 (any card, ~7.5 minutes): the bf16 body's WG0 with fewer output columns (WG0_COLS: 128
    # or 192 of 512, WG1 the rest in two wgmmas; registers moved to WG1) against L / 2 each, in one process: the sm90
    # GPU check cases under each value, then the 128-head bf16 grid rows on the same inputs; then the trace of 128
    # (L=384: WG0 128 columns, WG1 256) beside the default's
    out=${2:?}
    run 420 decode-wg0c python3 bench/decode.py --out "$out/decode-wg0c" --quick --no-ragged --device-time \
        --kernels pallas_sm90 --shapes 64x128x4096,128x128x8192 --dtypes bf16 --only schedule=grid \
        --knob mla_decode_sm90.WG0_COLS=0,128,192
    grep -E "^correctness|FAIL|knob" "$out/decode-wg0c.log" | cut -c1-200 | head -30
    trace_ab wg0c 's/^WG0_COLS = 0$/WG0_COLS = 128/' "^WG0_COLS = 128$"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
114) # (ran in session 42 on 24b9867, an H100, as --no-check rows and then the check cases: -1.2 / -2.0%, taken; P
    # from WG0's registers is the only way since, WG0_P_REGS is gone) session 42 (any card, ~5 minutes): WG0's own
    # P.V with P from its registers (WG0_P_REGS) against the shared-memory copy, in one process: the sm90 GPU check cases under each value, then the 128-head bf16 grid
    # rows on the same inputs
    out=${2:?}
    run 300 decode-pregs python3 bench/decode.py --out "$out/decode-pregs" --quick --no-ragged --device-time \
        --kernels pallas_sm90 --shapes 64x128x4096,128x128x8192 --dtypes bf16 --only schedule=grid \
        --knob mla_decode_sm90.WG0_P_REGS=False,True
    grep -E "^correctness|FAIL|knob" "$out/decode-pregs.log" | cut -c1-200 | head -30
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
115) # session 42, for the next (any card, ~6 minutes): the bf16 body's slots in three buffers, two barrier groups
    # (SPLIT_SLOTS: the next page's WG0 latents and rope land once WG0's P.V is done) against whole slots, in one
    # process without the check cases (part 116 runs them): the 128-head bf16 rows and exact fp8 at 64x128x4096; then
    # both traces (L=384)
    out=${2:?}
    for dt in bf16 fp8; do  # (exact fp8 at one shape: its rows come with the fp8 P.V's, which SPLIT_SLOTS leaves)
        shapes=64x128x4096,128x128x8192 && [ $dt = fp8 ] && shapes=64x128x4096
        run 200 decode-slots-$dt python3 bench/decode.py --out "$out/decode-slots-$dt" --quick --no-check --no-ragged \
            --device-time --kernels pallas_sm90 --shapes $shapes --dtypes $dt --only schedule=grid \
            --knob mla_decode_sm90.SPLIT_SLOTS=False,True
        grep -oE "ctx=[0-9]+: .*'knob': '[^']*', 'device_us': [0-9.]+" "$out/decode-slots-$dt.log" |
            sed -E "s/ \{'sch.*'knob'/ /"
    done
    trace_ab slots 's/^SPLIT_SLOTS = False$/SPLIT_SLOTS = True/' "^SPLIT_SLOTS = True$"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
116) # session 42, for the next (any card, ~5 minutes): the sm90 decode's GPU check cases with SPLIT_SLOTS = True (bf16,
    # exact fp8, fp8_qk, both schedules), and one small row
    out=${2:?}
    knob_check slots SPLIT_SLOTS=True
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
117) # session 42, for the next (any card, ~5 minutes): the bf16 kernel's pages in pairs (BF16_PAIRS: each consumer its
    # own page's QK^T and softmax, both pages' P.V on its half; each slot's three parts released and reloaded one by
    # one) against one page at a time, in one process without the check cases (part 118 runs them): the 128-head bf16
    # rows and 1x128x32768; then both traces (L=384)
    out=${2:?}
    run 260 decode-pairs16 python3 bench/decode.py --out "$out/decode-pairs16" --quick --no-check --no-ragged \
        --device-time --kernels pallas_sm90 --shapes 64x128x4096,128x128x8192,1x128x32768 --dtypes bf16 \
        --only schedule=grid --knob mla_decode_sm90.BF16_PAIRS=False,True
    grep -oE "ctx=[0-9]+: .*'knob': '[^']*', 'device_us': [0-9.]+" "$out/decode-pairs16.log" | sed -E "s/ \{'sch.*'knob'/ /"
    trace_ab pairs16 's/^BF16_PAIRS = False$/BF16_PAIRS = True/' "^BF16_PAIRS = True$"
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
118) # session 42, for the next (any card, ~5 minutes): the sm90 decode's GPU check cases with BF16_PAIRS = True, and one
    # small row
    out=${2:?}
    knob_check pairs16 BF16_PAIRS=True
    (cd "$out" && tar czf logs.tgz ./*.log && rm ./*.log) ;;
*)  echo "part must be 1 to 118" >&2; exit 2 ;;
esac
