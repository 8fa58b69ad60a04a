#!/usr/bin/env bash
# gpu_check.sh: everything fp8ext needs a GPU for, in one call on the lent machine (the device tool):
# build with CUDA for the local chip, run the whole test suite (GPU tests included), run benchmarks.
# Logs go to $OUT (the device tool brings that folder back), the short tables to stdout.
#
#   bash benchmarks/gpu_check.sh                 # build + tests + all benchmarks
#   bash benchmarks/gpu_check.sh tests quantize  # pick steps: build is implied; tests, quantize, ...
#   bash benchmarks/gpu_check.sh notebooks       # execute notebooks/*.ipynb; the executed, stamped copies go to $OUT
#   bash benchmarks/gpu_check.sh sanitize        # compute-sanitizer memcheck and racecheck over the kernel tests
#   bash benchmarks/gpu_check.sh stream_bw       # the HBM streaming ceiling of the weight-only kernel (nvcc, sm_90)
#   HF_BATCHES="8 16" bash benchmarks/gpu_check.sh hf   # the Hugging Face Llama: bf16, fp8ext (saved / recast), torchao
#   bash benchmarks/gpu_check.sh ckpt_preset ckpt_hf   # without / with activation checkpointing: preset 1b, HF Llama
# The lent machine has no Jupyter: for `notebooks`, carry wheels of nbclient, nbformat and ipykernel with their
# dependencies in .whl/ (pip download ... -d .whl; see the device tool's notes); they are installed from there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/benchmarks/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests quantize gemm linear}
PY=${PYTHON:-python3}

{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; nvcc --version | tail -2
  $PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

echo "== build"
if ! FP8EXT_CUDA=1 $PY -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1
fi
grep "fp8ext build: building" "$OUT/build.log"
$PY -c "import fp8ext; print(fp8ext.build_info(), 'cuda_available', fp8ext.cuda_available())"

status=0
for step in $steps; do
    case $step in
    tests)
        echo "== tests"
        # PYTEST_ARGS narrows the run, e.g. PYTEST_ARGS="-m cuda tests" for the GPU tests alone
        $PY -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -25 || status=1 ;;
    notebooks)
        echo "== notebooks"
        if [ -d .whl ]; then
            $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/nbsite .whl/*.whl > "$OUT/nb_install.log" 2>&1 || { tail "$OUT/nb_install.log"; status=1; }
            export PYTHONPATH=/tmp/nbsite${PYTHONPATH:+:$PYTHONPATH}
        fi
        # each code cell is stamped with its source's hash (tests/project/test_notebooks.py checks the committed stamps)
        # NOTEBOOKS="notebooks/a.ipynb ..." runs only those
        $PY benchmarks/run_notebooks.py "$OUT" ${NOTEBOOKS:-} || status=1 ;;
    sanitize)
        # Every kernel's GPU tests under compute-sanitizer: memcheck (out-of-bounds and misaligned accesses, leaks
        # of device memory) over the kernel test files, racecheck (shared-memory hazards) over the kernels that use
        # shared memory. cuDNN's kernels are excluded: its SDPA kernel (torch's attention, the reference of a few
        # tests) reports hazards that are not fp8ext's. The largest cases are left out (-k): under the sanitizer
        # they take minutes and run the code paths of the smaller ones; racecheck takes the weight-only kernel's
        # float64-reference and NaN/Inf cases only (its every-split sweep takes minutes there). One run per row
        # below: tool, -k expression, test files. SANITIZE_TIMEOUT (seconds per run, default 300) bounds each.
        echo "== sanitize"
        big="not 4096 and not 20000 and not 3000 and not 5000"
        kernels="tests/ops/test_cuda_kernels_vs_cpu.py tests/ops/test_fused.py tests/modules/test_fused_linear.py tests/ops/test_mx.py"
        kernels+=" tests/ops/test_mx_nonfinite.py tests/ops/test_quantize_blocks.py tests/inference/test_decode_attention.py"
        n=0
        while IFS='|' read -r tool k files; do
            n=$((n + 1)); log="$OUT/sanitize_${n}_$tool.log"
            existing=(); for f in $files; do [ -f "$f" ] && existing+=("$f"); done
            timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer --tool $tool --kernel-name-exclude kns=cudnn \
                --print-limit 20 $PY -m pytest -q -p no:cacheprovider -m cuda -k "$k" "${existing[@]}" > "$log" 2>&1
            rc=$?
            echo "$tool over ${existing[*]} (-k '$k'):"
            [ $rc = 124 ] && echo "  cut short after ${SANITIZE_TIMEOUT:-300} s (SANITIZE_TIMEOUT)"
            grep -E "ERROR SUMMARY|RACECHECK SUMMARY|[0-9]+ (passed|failed)" "$log" | tail -2 | sed 's/^/  /'
            if [ $rc != 0 ] || ! grep -qE "(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)" "$log"; then
                echo "  FAILED (exit $rc; $log)"; status=1
            fi
        done <<ROWS
memcheck|$big|$kernels tests/ops/test_cast_transpose_dbias.py tests/ops/test_small_formats.py tests/lowp/test_weight_only.py tests/ops/test_stochastic_rounding.py
racecheck|$big|$kernels
racecheck|float64 or nan_and_inf|tests/lowp/test_weight_only.py
ROWS
        ;;
    inference)
        echo "== bench_inference"
        $PY benchmarks/bench_inference.py 2>&1 | tee "$OUT/bench_inference.log" || status=1 ;;
    train)
        echo "== bench_train"
        bash benchmarks/bench_train.sh ${TRAIN_STAGES:-eager quality} || status=1 ;;
    validate)
        echo "== validate"
        $PY -m fp8ext.validate --report "$OUT/validate" | tee "$OUT/validate.log" || status=1 ;;
    stream_bw)
        # A standalone CUDA harness (no fp8ext inside): the HBM streaming ceiling of the weight-only decode kernel
        echo "== bench_stream_bw"
        bin=${TMPDIR:-/tmp}/bench_stream_bw
        if nvcc -std=c++17 -arch=sm_90a -O3 -o "$bin" benchmarks/bench_stream_bw.cu > "$OUT/bench_stream_bw_build.log" 2>&1; then
            "$bin" 2>&1 | tee "$OUT/bench_stream_bw.log" || status=1
        else
            tail -20 "$OUT/bench_stream_bw_build.log"; status=1
        fi ;;
    recipes)
        # FP8 recipes side by side (RECIPE_SECTIONS picks: linear host block error train)
        echo "== bench_recipes"
        $PY benchmarks/bench_recipes.py --sections ${RECIPE_SECTIONS:-linear host block error train} 2>&1 | tee "$OUT/bench_recipes.log" || status=1 ;;
    hf)
        # bench_hf.py's Hugging Face Llama, each variant in its own process: HF_VARIANTS at each of HF_BATCHES;
        # torchao's variant needs its wheel carried in .whl/ (installed from there)
        echo "== bench_hf"
        if ls .whl/torchao-*.whl > /dev/null 2>&1; then
            $PY -m pip install -q --no-index --no-deps --target /tmp/aosite .whl/torchao-*.whl > "$OUT/torchao_install.log" 2>&1 || status=1
            export PYTHONPATH=/tmp/aosite${PYTHONPATH:+:$PYTHONPATH}
        fi
        for b in ${HF_BATCHES:-8}; do
            (cd benchmarks && $PY bench_hf.py --batch "$b" --steps 8 --warmup 4 \
                --variants ${HF_VARIANTS:-bf16-compiled fp8ext-compiled fp8ext-recast-compiled torchao-compiled}) \
                > "$OUT/bench_hf_b$b.log" 2>&1 || status=1
            grep -E "compiled|eager|variant|failed" "$OUT/bench_hf_b$b.log"
            mv "$OUT/bench_hf_llama.json" "$OUT/bench_hf_llama_b$b.json" 2>/dev/null
        done ;;
    ckpt_preset|ckpt_hf)
        # activation checkpointing's cost: peak memory and tokens/s without and with it (each block / decoder layer
        # checkpointed), bf16 beside FP8 in the same call: fp8ext.train's preset (CKPT_PRESET, default 1b) or the
        # Hugging Face Llama (CKPT_VARIANTS)
        echo "== $step"
        if [ "$step" = ckpt_preset ]; then
            what="--preset ${CKPT_PRESET:-1b}"
        else
            what="--variants ${CKPT_VARIANTS:-bf16-eager fp8ext-eager bf16-compiled fp8ext-compiled}"
        fi
        (cd benchmarks && $PY bench_hf.py $what --activation_checkpointing both --batch ${CKPT_BATCH:-8} \
            --steps ${CKPT_STEPS:-10} --warmup 4) > "$OUT/bench_$step.log" 2>&1 || status=1
        grep -vE "^W[0-9]|Warning|warn" "$OUT/bench_$step.log" | tail -20 ;;
    quantize|gemm|linear|weight_only|decode_attention|block|fused_cast)
        echo "== bench_$step"
        $PY benchmarks/bench_$step.py 2>&1 | tee "$OUT/bench_$step.log" || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
    esac
done
exit $status
