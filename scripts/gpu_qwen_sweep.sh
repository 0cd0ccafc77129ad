#!/usr/bin/env bash
# Qwen2.5-Coder-1.5B-Instruct on one H200: calibrate (self-generated and prose, 8K+ sequences, and one under
# YaRN), eval-kl at 4K-32K for every artifact, then the RULER table: 8 NIAH tasks x RULER_SAMPLES x
# {4K,8K,16K,32K} x 5 methods, and {64K,128K} under YaRN (factor 4, applied by eval-ruler itself) for bf16,
# kivi-2 and oscar; finally oscar at 64K/128K with the artifact calibrated under YaRN, to compare with the
# native artifact that eval-ruler accepts under YaRN (same weights, only the RoPE scaling differs).
#
# Staging (here, before the calls; all paths git-ignored through .git/info/exclude):
#   bash ../shared/tools/stage-for-gpu.sh qwen2.5-coder-1.5b .gpu-qwen-stage   # 23 folders c00..c22 (<50 MB)
#   .gpu-qwen/whl/*.whl   wheels the device image lacks (py3.12): gguf 0.19.0, wonderwords 3.0.1, pydantic 2.14.4,
#                         pydantic_core 2.50.5, annotated_types 0.8.0, typing_inspection 0.4.5
#   .gpu-qwen/prose/      calibration prose, e.g. austen_emma.txt austen_pride_and_prejudice.txt
#   .gpu-qwen/heldout.txt held-out prose for eval-kl (not in prose/), e.g. austen_persuasion.txt
# Then, on one warm machine (it is held at most 30 min; every stage is resumable within it):
#   for each folder cKK (one call each, carry .gpu-qwen-stage/cKK):
#       mkdir -p /tmp/stage && cp .gpu-qwen-stage/cKK/* /tmp/stage/
#   call:  bash /tmp/stage/join.sh && bash scripts/gpu_qwen_sweep.sh stage      (carry .gpu-qwen)
#   call:  bash scripts/gpu_qwen_sweep.sh calibrate
#   call:  bash scripts/gpu_qwen_sweep.sh kl
#   call:  RULER_BUDGET=540 bash scripts/gpu_qwen_sweep.sh ruler-native   (repeat until it prints complete: True)
#   call:  RULER_BUDGET=540 bash scripts/gpu_qwen_sweep.sh ruler-yarn     (repeat likewise)
#   call:  RULER_BUDGET=270 bash scripts/gpu_qwen_sweep.sh rope-compare   (same artifact vs recalibrated under YaRN)
# Every call ends by packing the results so far into $OUT/qwen-sweep.tgz (kl-*.json, ruler-*/summary.json,
# samples.jsonl, heatmap.png, logs, artifacts' manifests) and printing the elapsed time of its stage; the
# totals per stage also accumulate in $STAGE/times.txt (copied into the archive).
# Knobs: RULER_SAMPLES (25), RULER_LONG_SAMPLES (25), RULER_COMPARE_SAMPLES (10), RULER_TASKS (all),
# RULER_BUDGET (seconds per eval-ruler run; the run stops starting batches after it and a rerun resumes),
# CAL_VARIANTS ("self-8k prose-8k prose-16k prose-8k-yarn4"), KL_CTX (4k,8k,16k,32704: 32K + 64 scored
# tokens would pass the 32,768 positions), BACKEND (reference | triton).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/stage/qwen
GGUF=/tmp/stage/out/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
GGUF_SHA=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046
export PYTHONPATH=/tmp/site OSCAR_CACHE_DIR=/tmp/stage/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$STAGE/out}
mkdir -p "$STAGE/art" "$STAGE/res" "$OUT"
BACKEND=${BACKEND:-reference}
oscar() { (cd /tmp && python3 -c "from oscar_cli.main import main; main()" "$@"); }  # /tmp: the installed copy, not ./oscar_cli
t_start=$(date +%s)

pack() {  # the results so far -> one archive in $OUT (the device returns at most 8 files)
    local stage=$1 secs=$(( $(date +%s) - t_start ))
    echo "$stage $secs" >> "$STAGE/times.txt"
    for a in "$STAGE"/art/*/; do
        [ -f "$a/manifest.json" ] && mkdir -p "$STAGE/res/art" && cp "$a/manifest.json" "$STAGE/res/art/$(basename "$a").json"
    done
    cp "$STAGE/times.txt" "$STAGE/res/"
    tar czf "$OUT/qwen-sweep.tgz" -C "$STAGE" res
    echo "stage $stage: ${secs} s wall on $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || echo cpu)"
    awk '{s[$1] += $2} END {for (k in s) printf "  total %s: %d s\n", k, s[k]}' "$STAGE/times.txt"
}

best_artifact() {  # the artifact whose oscar row has the lowest mean KL over KL_CTX (written by `kl`)
    cat "$STAGE/best"
}

ruler() {  # NAME CTX METHODS SAMPLES [extra eval-ruler args...]
    local name=$1 ctx=$2 methods=$3 samples=$4; shift 4
    mkdir -p "$STAGE/res/ruler-$name"
    oscar --json eval-ruler "$GGUF" --ctx "$ctx" --methods "$methods" --samples "$samples" \
        --tasks "${RULER_TASKS:-all}" --out "$STAGE/res/ruler-$name" --time-budget "${RULER_BUDGET:-540}" \
        --backend "$BACKEND" "$@" > "$STAGE/res/ruler-$name.json" 2> "$STAGE/res/ruler-$name.log" \
        || { tail -20 "$STAGE/res/ruler-$name.log"; exit 1; }
    grep -E "^eval-ruler: (YaRN|artifact|oscar is|[0-9]+ tasks|estimate)" "$STAGE/res/ruler-$name.log" || true
    python3 - "$STAGE/res/ruler-$name.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], "complete:", r["complete"], "evaluated:", r["evaluated"], "resumed:", r["resumed"], "seconds:", r["seconds"])
for m, per in r["mean"].items():
    print(f"  {m:12s}", {k: v for k, v in per.items()})
EOF
}

case "${1:-}" in
stage)
    if ls .gpu-qwen/whl/*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu-qwen/whl/*.whl
    fi
    # installed, not linked: the wheel maps recipes/ to oscar_cli.recipes
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site .
    echo "$GGUF_SHA  $GGUF" | sha256sum -c -
    rm -rf "$STAGE/prose" && cp -r .gpu-qwen/prose "$STAGE/prose" && cp .gpu-qwen/heldout.txt "$STAGE/heldout.txt"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    oscar info "$GGUF" | head -20  # first load: GGUF -> safetensors conversion into $OSCAR_CACHE_DIR (~2 min once)
    pack stage
    ;;
calibrate)
    for v in ${CAL_VARIANTS:-self-8k prose-8k prose-16k prose-8k-yarn4}; do
        [ -f "$STAGE/art/$v/manifest.json" ] && { echo "$v: done before"; continue; }
        src=self; [[ $v == prose-* ]] && src=$STAGE/prose
        seq=8192; tokens=32k; [[ $v == *-16k* ]] && { seq=16384; tokens=64k; }
        rope=(); [[ $v == *-yarn4 ]] && rope=(--rope-scaling yarn --rope-factor 4)
        t1=$(date +%s)
        oscar --json calibrate "$GGUF" --recipe qwen2.5-coder-1.5b --key-mean constant --int4-keys 0 --meta-bits 16 \
            --data "$src" --tokens "$tokens" --seq-len "$seq" ${rope[@]+"${rope[@]}"} --device cuda --out "$STAGE/art/$v" > "$STAGE/res/cal-$v.json" 2> "$STAGE/res/cal-$v.log" \
            || { tail -20 "$STAGE/res/cal-$v.log"; exit 1; }
        echo "calibrate $v: $(( $(date +%s) - t1 )) s"
    done
    pack calibrate
    ;;
kl)
    ctx=${KL_CTX:-4k,8k,16k,32704}
    first=1
    for a in "$STAGE"/art/*/; do
        v=$(basename "$a")
        [[ $v == *-yarn* ]] && continue  # eval-kl runs at native positions
        methods=oscar; [ $first = 1 ] && methods=naive-int2,quarot-int2,kivi-2,oscar
        first=0
        t1=$(date +%s)
        oscar --json eval-kl "$GGUF" --text "$STAGE/heldout.txt" --artifact "$a" --methods "$methods" --ctx "$ctx" \
            --tokens 64 --windows "${KL_WINDOWS:-8}" --backend "$BACKEND" > "$STAGE/res/kl-$v.json" 2> "$STAGE/res/kl-$v.log" \
            || { tail -20 "$STAGE/res/kl-$v.log"; exit 1; }
        echo "eval-kl $v: $(( $(date +%s) - t1 )) s"
    done
    python3 - "$STAGE" <<'EOF'
import glob, json, os, sys
stage = sys.argv[1]
rows = []
for f in sorted(glob.glob(f"{stage}/res/kl-*.json")):
    r = json.load(open(f))
    name = os.path.basename(f)[3:-5]
    for m, per in r["metrics"].items():
        print(f"{name:14s} {m:12s}", {L: v["kl"] for L, v in per.items()})
    kl = [v["kl"] for v in r["metrics"]["oscar"].values()]
    rows.append((sum(kl) / len(kl), name))
best = min(rows)[1]
open(f"{stage}/best", "w").write(f"{stage}/art/{best}\n")
print("lowest mean oscar KL:", best, "-> used for RULER")
EOF
    pack kl
    ;;
ruler-native)
    ruler native 4k,8k,16k,32k bf16,naive-int2,quarot-int2,kivi-2,oscar "${RULER_SAMPLES:-25}" --artifact "$(best_artifact)"
    pack ruler-native
    ;;
ruler-yarn)
    ruler yarn 64k,128k bf16,kivi-2,oscar "${RULER_LONG_SAMPLES:-25}" --artifact "$(best_artifact)"
    pack ruler-yarn
    ;;
rope-compare)
    # The native prose-8k artifact (accepted under YaRN with a note) against prose-8k-yarn4 (calibrated under
    # YaRN x4), on the same samples (same seed, tasks, lengths). RULER_COMPARE_SAMPLES (default 10) keeps it short.
    native_art=$STAGE/art/prose-8k; yarn_art=$STAGE/art/prose-8k-yarn4
    for a in "$native_art" "$yarn_art"; do
        [ -f "$a/manifest.json" ] || { echo "missing $a: run calibrate with prose-8k and prose-8k-yarn4"; exit 1; }
    done
    n=${RULER_COMPARE_SAMPLES:-10}
    if [ "$(best_artifact)" = "$native_art" ] && [ -f "$STAGE/res/ruler-yarn/samples.jsonl" ] \
        && [ ! -f "$STAGE/res/ruler-yarn-same/samples.jsonl" ]; then
        mkdir -p "$STAGE/res/ruler-yarn-same" && cp "$STAGE/res/ruler-yarn/samples.jsonl" "$STAGE/res/ruler-yarn-same/"
    fi
    ruler yarn-same 64k,128k oscar "$n" --artifact "$native_art"
    ruler yarn-recal 64k,128k oscar "$n" --artifact "$yarn_art"
    pack rope-compare
    ;;
*)
    echo "usage: $0 stage | calibrate | kl | ruler-native | ruler-yarn | rope-compare" >&2
    exit 2
    ;;
esac
