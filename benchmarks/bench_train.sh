#!/usr/bin/env bash
# bench_train.sh: fp8ext.train on one GPU, bf16 next to FP8 in the same session:
#   speed: a preset (default 1b) eager and compiled, fused and separate QKV projections (tokens/s, MFU, memory);
#   quality: the small preset trained the same number of steps in bf16, FP8 delayed and FP8 current scaling.
# Each run gets its own time limit and the script goes on when one fails. Run directories go under $OUT/runs,
# packed into $OUT/bench_train_runs.tar.gz; the table is printed and written to $OUT/bench_train.md.
#
#   bash benchmarks/bench_train.sh [eager] [compiled] [quality] [unfused] [multi]   (default: the first three)
#   unfused: the preset eager with torch's RMSNorm, RoPE and SwiGLU (--no_fused_kernels), bf16 and FP8.
#   (compiled-bf16 and compiled-fp8 run one half of `compiled` each)
#   multi: the preset on 1 GPU and on 2, 4, 8 ... and all GPUs of the machine (torchrun, DDP and FSDP2), bf16 and
#   FP8, the same batch per GPU: tokens/s, scaling efficiency (tokens/s on N GPUs / (N x on 1)), peak memory per
#   GPU, FP8 scales equal on all ranks. SPEED_STEPS sets the steps per run.
#   PRESET=1b SPEED_STEPS=40 QUALITY_STEPS=400 (the defaults) choose sizes; the table covers every run in $OUT/runs.
#   NGPU (default: every GPU torch sees) and EXTRA_ARGS (appended to every run) serve dry runs on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/benchmarks/out}
PY=${PYTHON:-python3}
P=${PRESET:-1b}
S=${SPEED_STEPS:-40}
Q=${QUALITY_STEPS:-400}
STAGES=${*:-eager compiled quality}
R="$OUT/runs"
mkdir -p "$R"
# NVLink multicast stays off (the lent machines' rule; it can take a shared host's GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=${NGPU:-$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"  # appended to every run (a dry run: EXTRA_ARGS="--device cpu ...")
LAUNCH=""  # empty: one process; "torchrun N": N processes on this host
run() {  # name, time limit (s), arguments...
    local name=$1 limit=$2; shift 2
    echo "== $name"
    local launcher=(-m fp8ext.train)
    [ -n "$LAUNCH" ] && launcher=(-m torch.distributed.run --standalone --nproc_per_node="$LAUNCH" -m fp8ext.train)
    timeout "$limit" $PY "${launcher[@]}" --no_progress --no_save --out_dir "$R/$name" "$@" "${EXTRA[@]}" > "$R/$name.log" 2>&1 \
        || { echo "$name FAILED (rc $?)"; tail -20 "$R/$name.log"; }
    tail -1 "$R/$name.log"
}
SPEED=(--preset "$P" --batch_size 8 --seq_len 2048 --max_steps "$S" --eval_every 1000000 --eval_batches 2)
QUAL=(--preset small --batch_size 32 --seq_len 512 --max_steps "$Q" --eval_every "$Q" --eval_batches 16 --lr 1e-3)
for stage in $STAGES; do
    case $stage in
    eager)
        run "$P-bf16" 240 "${SPEED[@]}"
        run "$P-fp8" 240 "${SPEED[@]}" --use_fp8
        run "$P-bf16-separate-qkv" 240 "${SPEED[@]}" --separate_qkv
        run "$P-fp8-separate-qkv" 240 "${SPEED[@]}" --separate_qkv --use_fp8 ;;
    unfused)  # torch's ops for RMSNorm, RoPE and SwiGLU instead of fp8ext's fused kernels
        run "$P-bf16-unfused" 240 "${SPEED[@]}" --no_fused_kernels
        run "$P-fp8-unfused" 240 "${SPEED[@]}" --no_fused_kernels --use_fp8 ;;
    compiled)
        run "$P-bf16-compiled" 300 "${SPEED[@]}" --compile
        run "$P-fp8-compiled" 300 "${SPEED[@]}" --compile --use_fp8 ;;
    compiled-bf16)  # one compiled run per device call, where a call cannot hold both
        run "$P-bf16-compiled" 470 "${SPEED[@]}" --compile ;;
    compiled-fp8)
        run "$P-fp8-compiled" 470 "${SPEED[@]}" --compile --use_fp8 ;;
    quality)
        run small-bf16 240 "${QUAL[@]}"
        run small-fp8-delayed 240 "${QUAL[@]}" --use_fp8
        run small-fp8-current 240 "${QUAL[@]}" --use_fp8 --fp8_recipe current ;;
    multi)
        if [ "$NGPU" -lt 2 ]; then echo "multi: needs 2 or more GPUs, this machine has $NGPU"; continue; fi
        [ -f "$R/$P-bf16/run.json" ] || run "$P-bf16" 240 "${SPEED[@]}"
        [ -f "$R/$P-fp8/run.json" ] || run "$P-fp8" 240 "${SPEED[@]}" --use_fp8
        for n in $(seq 2 "$NGPU"); do  # 2, 4, 8, ... up to NGPU, and NGPU itself
            [ $(( n & (n - 1) )) -eq 0 ] || [ "$n" -eq "$NGPU" ] || continue
            LAUNCH=$n
            run "$P-bf16-ddp$n" 300 "${SPEED[@]}"
            run "$P-fp8-ddp$n" 300 "${SPEED[@]}" --use_fp8
            run "$P-bf16-fsdp$n" 300 "${SPEED[@]}" --fsdp
            run "$P-fp8-fsdp$n" 300 "${SPEED[@]}" --fsdp --use_fp8
        done
        LAUNCH="" ;;
    *) echo "unknown stage $stage" ;;
    esac
done
$PY - "$R" "$P" "$NGPU" <<'EOF' | tee "$OUT/bench_train.md"
import json, pathlib, sys
root, p, ngpu = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
def info(name):
    f = root / name / "run.json"
    return json.loads(f.read_text()) if f.is_file() else None
rows = [f"{p}-bf16", f"{p}-fp8", f"{p}-bf16-separate-qkv", f"{p}-fp8-separate-qkv", f"{p}-bf16-unfused",
        f"{p}-fp8-unfused", f"{p}-bf16-compiled",
        f"{p}-fp8-compiled", "small-bf16", "small-fp8-delayed", "small-fp8-current"]
counts = [n for n in range(2, ngpu + 1) if n & (n - 1) == 0 or n == ngpu]
multi = [f"{p}-{prec}-{mode}{n}" for n in counts for mode in ("ddp", "fsdp") for prec in ("bf16", "fp8")]
rows += [r for r in multi if (root / (r + ".log")).is_file()]  # the multi-GPU runs, where they were made
first = next((info(r) for r in rows if info(r)), {})
print(f"# fp8ext.train on {first.get('device_name', '?')}, torch {first.get('torch', '?')}")
print("| run | tokens/s | MFU (bf16 peak) | peak memory GiB | val loss |")
print("|---|---:|---:|---:|---:|")
for r in rows:
    i = info(r)
    if not i:
        print(f"| {r} | {'failed' if (root / (r + '.log')).is_file() else 'not run'} | | | |"); continue
    m = [json.loads(l) for l in (root / r / "metrics.jsonl").read_text().splitlines()]
    mfu = sorted(x["mfu"] for x in m if x.get("mfu"))[len(m) // 2] if any(x.get("mfu") for x in m) else None
    vl = i.get("final_val_loss")
    print(f"| {r} | {i['tokens_per_s']:,.0f} | {'' if mfu is None else f'{mfu:.1%}'} | "
          f"{i.get('peak_memory_gib') or 0:.1f} | {'' if vl is None else f'{vl:.4f}'} |")
def ratio(a, b, key="tokens_per_s"):
    ia, ib = info(a), info(b)
    return ib[key] / ia[key] if ia and ib and ia.get(key) and ib.get(key) else None
for a, b, what in ((f"{p}-bf16", f"{p}-fp8", "FP8 / bf16, eager"), (f"{p}-bf16-compiled", f"{p}-fp8-compiled", "FP8 / bf16, compiled"),
                   (f"{p}-bf16-separate-qkv", f"{p}-bf16", "fused / separate QKV, bf16"),
                   (f"{p}-fp8-separate-qkv", f"{p}-fp8", "fused / separate QKV, FP8"),
                   (f"{p}-bf16-unfused", f"{p}-fp8-unfused", "FP8 / bf16, eager, torch's RMSNorm/RoPE/SwiGLU"),
                   (f"{p}-bf16-unfused", f"{p}-bf16", "fused kernels / torch's ops, bf16"),
                   (f"{p}-fp8-unfused", f"{p}-fp8", "fused kernels / torch's ops, FP8")):
    r = ratio(a, b)
    print(f"- tokens/s {what}: {'n/a' if r is None else f'{r:.3f}x'}")
for n in counts:
    for mode in ("ddp", "fsdp"):
        for prec in ("bf16", "fp8"):
            one, many = info(f"{p}-{prec}"), info(f"{p}-{prec}-{mode}{n}")
            if one and many and one.get("tokens_per_s") and many.get("tokens_per_s"):
                eff = many["tokens_per_s"] / (n * one["tokens_per_s"])
                same = many.get("fp8_scales_equal_across_ranks")
                print(f"- {prec} {mode.upper()} on {n} GPUs: {many['tokens_per_s'] / one['tokens_per_s']:.2f}x the "
                      f"tokens/s of 1 GPU, scaling efficiency {eff:.1%}"
                      + ("" if same is None else f"; FP8 scales equal on all ranks: {same}"))
        r = ratio(f"{p}-bf16-{mode}{n}", f"{p}-fp8-{mode}{n}")
        print(f"- tokens/s FP8 / bf16, {mode.upper()} on {n} GPUs: {'n/a' if r is None else f'{r:.3f}x'}")
for c in (f"{p}-bf16-compiled", f"{p}-fp8-compiled"):
    if info(c) and "graph_breaks" in info(c):
        print(f"- graph breaks in {c}: {info(c)['graph_breaks']}")
for b in ("small-fp8-delayed", "small-fp8-current"):
    r = ratio("small-bf16", b, "final_val_loss")
    print(f"- validation loss {b} vs bf16: {'n/a' if r is None else f'{r - 1:+.2%}'}")
EOF
tar czf "$OUT/bench_train_runs_$(echo $STAGES | tr ' ' '_').tar.gz" -C "$OUT" runs && rm -rf "$R"  # logs and metrics
