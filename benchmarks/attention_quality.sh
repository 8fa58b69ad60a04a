#!/usr/bin/env bash
# attention_quality.sh: FP8 attention's training quality and accuracy on one GPU.
#   1. the preset (default 1b) trained STEPS steps with FP8 linear layers three times, the same seed and batches:
#      with bf16 attention; with FP8 attention forward and backward (--fp8_attention --fp8_attention_backward fp8,
#      Transformer Engine's fp8_dpa); with FP8 attention whose backward runs in bf16 (--fp8_attention, the default);
#      FP8_BACKWARD=0 leaves the second out (cuDNN's FP8 backward on Hopper needs head_dim 128: the small preset
#      has 64);
#   2. each FP8-attention run compared with the bf16-attention one (python -m fp8ext.train.compare: validation
#      losses, tokens/s, a plot of both curves);
#   3. benchmarks/attention_accuracy.py on the first run's trained weights: per-head errors of FP8 and bf16
#      attention against float64 on the model's own activations.
# Run directories and logs (the first holds a checkpoint of several GB) go under RUNS; tables and plots under $OUT.
#
#   PRESET=1b STEPS=400 RECIPE=delayed LR=6e-4 bash benchmarks/attention_quality.sh
#   PRESET=small STEPS=400 BATCH=32 SEQ=512 LR=1e-3 FP8_BACKWARD=0 bash benchmarks/attention_quality.sh
# ACCURACY_ARGS are appended to attention_accuracy.py's (e.g. "--save DIR --save_layers 1,5,10").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/benchmarks/out}
PY=${PYTHON:-python3}
P=${PRESET:-1b}
N=${STEPS:-400}
RECIPE=${RECIPE:-delayed}
R=${RUNS:-/tmp/attention_quality}
mkdir -p "$OUT" "$R"
COMMON=(--preset "$P" --use_fp8 --fp8_recipe "$RECIPE" --max_steps "$N" --batch_size "${BATCH:-8}"
        --seq_len "${SEQ:-2048}" --lr "${LR:-6e-4}" --eval_every "${EVAL_EVERY:-100}" --eval_batches 16 --no_progress)
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
A="$R/bf16-attention"
B="$R/fp8-attention"
C="$R/fp8-attention-bf16-backward"
rm -rf "$A" "$B" "$C"
train() {  # train DIR ARGS...: one run, its log in DIR.log, its last line printed
    local dir=$1; shift
    $PY -m fp8ext.train "${COMMON[@]}" "${EXTRA[@]}" --out_dir "$dir" "$@" > "$dir.log" 2>&1 \
        || { echo "run failed: $dir"; tail -20 "$dir.log"; }
    tail -1 "$dir.log"
}
train "$A"
[ "${FP8_BACKWARD:-1}" = 1 ] && train "$B" --fp8_attention --fp8_attention_backward fp8 --no_save
train "$C" --fp8_attention --fp8_attention_backward high_precision --no_save
{ [ "${FP8_BACKWARD:-1}" = 1 ] && $PY -m fp8ext.train.compare "$A" "$B" --plot "$OUT/attention_quality.png"
  $PY -m fp8ext.train.compare "$A" "$C" --plot "$OUT/attention_quality_bf16_backward.png"; } 2>&1 \
    | tee "$OUT/attention_quality.txt"
read -r -a ACC <<< "${ACCURACY_ARGS:-}"
$PY benchmarks/attention_accuracy.py --checkpoint "$A" --preset "$P" --seq_len "${SEQ:-2048}" \
    --out "$OUT/attention_accuracy.json" --plot "$OUT/attention_accuracy.png" "${ACC[@]}" 2>&1 | tee "$OUT/attention_accuracy.txt"
