#!/usr/bin/env bash
# RULER NIAH sweep + eval-kl of the embedded model on one GPU (the numbers in docs/RESULTS.md).
#
# The embedded GGUF (98 MB) is larger than one device call may carry (64 MiB), so the run is two calls made
# back to back (the machine stays warm ~30 s between them). Prepared here (all git-ignored via
# .git/info/exclude):
#   .gpu-ruler/p1/gguf.part00, .gpu-ruler/p2/gguf.part01   split -b 49500000 -d <gguf> gguf.part
#   .gpu-ruler/whl/*.whl      gguf 0.19.0 and wonderwords 3.0.1 (not on the device image)
#   .gpu-ruler/corpus/        essay haystack prose (austen_emma.txt)
#   .gpu-ruler/austen_persuasion.txt                       held-out prose for eval-kl
#   artifacts/smollm2-135m/<artifact>                       made on CPU with `oscar calibrate`
# Call 1: carry .gpu-ruler/p1 .gpu-ruler/whl .gpu-ruler/corpus .gpu-ruler/austen_persuasion.txt ARTIFACT
#         command: bash scripts/gpu_ruler_sweep.sh stage ARTIFACT
# Call 2: carry .gpu-ruler/p2
#         command: RULER_BUDGET=225 bash scripts/gpu_ruler_sweep.sh run
# (eval-kl contexts must leave room for the 64 scored tokens: 8K + 64 is beyond SmolLM2's 8192 positions.)
# Results land in $OUT: kl.json, ruler.json, samples.jsonl, heatmap.png and their logs.
# Comparing artifacts (docs/RESULTS.md, "Clip grid and clip mode on RULER"): call 1 `stage ART1 ART2 ...` (carry
# `artifacts` instead of one artifact; SKIP_TESTS=1 skips the cache's GPU tests), call 2 `compare`: one eval-ruler
# per artifact (RULER_CTX, default 4k,8k; methods oscar, plus COMPARE_BF16=1 adds bf16 to the first artifact's
# run; RULER_BUDGET seconds each), results in $OUT/cmp-NAME.{json,log,samples.jsonl}.
# To resume a partial sweep (docs/RESULTS.md), also carry .gpu-ruler/samples.jsonl in call 2
# (gunzip -c docs/results/ruler-smollm2-135m-h200.samples.jsonl.gz > .gpu-ruler/samples.jsonl) and add
# SKIP_KL=1; the artifact path /tmp/gpu-ruler/artifact is part of the oscar rows' resume key.
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/gpu-ruler
GGUF=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export PYTHONPATH=/tmp/site:$PWD OSCAR_CACHE_DIR=$STAGE/cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$STAGE/out}
mkdir -p "$STAGE" "$OUT"
oscar() { python3 -c "from oscar_cli.main import main; main()" "$@"; }
join_gguf() {  # call 2: part 1 staged by call 1, part 2 carried now; checked against the wheel's GGUF
    cat "$STAGE/gguf.part00" .gpu-ruler/p2/gguf.part01 > "$GGUF"
    echo "$GGUF_SHA  $GGUF" | sha256sum -c -
}

case "${1:-}" in
stage)
    art=${2:?artifact path}
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu-ruler/whl/*.whl
    ln -sfn "$PWD/oscar_kernels" /tmp/site/oscar_kernels  # the package is not installed there
    cp .gpu-ruler/p1/gguf.part00 "$STAGE/"
    rm -rf "$STAGE/corpus" "$STAGE/artifact"
    cp -r .gpu-ruler/corpus "$STAGE/corpus"
    cp .gpu-ruler/austen_persuasion.txt "$STAGE/"
    cp -r "$art" "$STAGE/artifact"
    rm -rf "$STAGE/compare" && mkdir -p "$STAGE/compare"
    for more in "${@:3}"; do cp -r "$more" "$STAGE/compare/$(basename "$more")"; done
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    [ -n "${SKIP_TESTS:-}" ] || python3 -m pytest tests/test_cache.py -m gpu -q -p no:cacheprovider
    ;;
compare)
    join_gguf
    first=1
    for art in "$STAGE"/compare/* "$STAGE/artifact"; do
        [ -d "$art" ] || continue
        name=$(basename "$art")
        methods=oscar
        if [ -n "${COMPARE_BF16:-}" ] && [ $first = 1 ]; then methods=bf16,oscar; fi
        first=0
        t1=$(date +%s)
        oscar --json eval-ruler "$GGUF" --artifact "$art" --haystack-dir "$STAGE/corpus" \
            --ctx "${RULER_CTX:-4k,8k}" --samples "${RULER_SAMPLES:-50}" --methods "$methods" \
            --tasks "${RULER_TASKS:-all}" --out "$STAGE/cmp-$name" --time-budget "${RULER_BUDGET:-150}" \
            > "$OUT/cmp-$name.json" 2> "$OUT/cmp-$name.log" || { tail -20 "$OUT/cmp-$name.log"; exit 1; }
        cp "$STAGE/cmp-$name/samples.jsonl" "$OUT/cmp-$name.samples.jsonl"
        python3 - "$OUT/cmp-$name.json" "$name" "$(( $(date +%s) - t1 ))" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(sys.argv[2], f"{sys.argv[3]} s", "complete:", r["complete"], "evaluated:", r["evaluated"], "mean:", r["mean"])
EOF
    done
    ;;
run)
    join_gguf
    methods=${RULER_METHODS:-bf16,naive-int2,quarot-int2,kivi-2,oscar}
    t0=$(date +%s)
    [ -n "${SKIP_KL:-}" ] || oscar --json eval-kl "$GGUF" --text "$STAGE/austen_persuasion.txt" --artifact "$STAGE/artifact" \
        --methods "${methods#bf16,}" --ctx "${KL_CTX:-2k,4k}" --tokens 64 --windows 8 \
        > "$OUT/kl.json" 2> "$OUT/kl.log" || { tail -20 "$OUT/kl.log"; exit 1; }
    echo "eval-kl: $(( $(date +%s) - t0 )) s"
    t1=$(date +%s)
    mkdir -p "$STAGE/ruler"
    if [ -f .gpu-ruler/samples.jsonl ] && [ ! -f "$STAGE/ruler/samples.jsonl" ]; then
        cp .gpu-ruler/samples.jsonl "$STAGE/ruler/"  # resume: finished samples are skipped
    fi
    oscar --json eval-ruler "$GGUF" --artifact "$STAGE/artifact" --haystack-dir "$STAGE/corpus" \
        --ctx "${RULER_CTX:-1k,2k,4k,8k}" --samples "${RULER_SAMPLES:-50}" --methods "$methods" \
        --tasks "${RULER_TASKS:-all}" --out "$STAGE/ruler" --time-budget "${RULER_BUDGET:-240}" \
        > "$OUT/ruler.json" 2> "$OUT/ruler.log" || { tail -20 "$OUT/ruler.log"; exit 1; }
    echo "eval-ruler: $(( $(date +%s) - t1 )) s"
    cp "$STAGE/ruler/samples.jsonl" "$STAGE/ruler/heatmap.png" "$OUT/"
    python3 - "$OUT/ruler.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
print("complete:", r["complete"], "evaluated:", r["evaluated"], "seconds:", r["seconds"])
for m, per in r["mean"].items():
    print(m, per, {L: v["formula"] for L, v in r["bpe"][m].items()})
EOF
    ;;
*)
    echo "usage: $0 stage ARTIFACT [ARTIFACT ...] | run | compare" >&2
    exit 2
    ;;
esac
