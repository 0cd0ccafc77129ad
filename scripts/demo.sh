#!/usr/bin/env bash
# The README's main job on the embedded model, stage by stage.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
stage() { printf '\n\033[1m== %s ==\033[0m\n' "$*" >&2; }

stage "1/4 info: resolve + load the embedded model, its identity and the INT2 bits-per-element table"
oscar --version
oscar info smollm2-135m   # first run converts the GGUF once (~30 s); later runs read the cache (seconds)

stage "2/4 calibrate: OSCAR rotations, means and per-layer clip ratios for the embedded model (4K self-generated tokens, ~1 min)"
# --data self (the offline default): the model writes its own calibration text from diverse seed prompts.
# 4K tokens in 1K sequences keep the demo short; the smollm2-135m recipe default is 24K in 8K sequences.
oscar calibrate smollm2-135m --tokens 4k --seq-len 1024 --out artifacts/demo/smollm2-135m --overwrite
python -c 'from oscar_cli.artifact import open_artifact as o; a = o("artifacts/demo/smollm2-135m")
print("verified:", a.path, a.method, len(a.layers), "layers, k_rotation", tuple(a.layers[0].k_rotation.shape))'

stage "3/4 eval-ruler: RULER niah_single_1 at 1K, 3 samples, bf16 vs oscar through the INT2 cache (CPU, ~1-2 min)"
# the artifact the calibrate stage above wrote (artifacts/demo/smollm2-135m)
# a rerun resumes from runs/demo-ruler/samples.jsonl (finished samples are skipped)
oscar eval-ruler smollm2-135m --tasks niah_single_1 --ctx 1k --samples 3 --methods bf16,oscar \
    --artifact artifacts/demo/smollm2-135m --out runs/demo-ruler

stage "4/4 export (dry run): validate the artifact, render its Hub model card with the eval scores, list the upload"
# offline and without a token: nothing is sent. To publish: drop --dry-run, set HF_TOKEN (docs/EXPORT.md)
oscar export artifacts/demo/smollm2-135m --repo-id my-org/smollm2-135m-oscar --tag v0.1.0 \
    --eval-summary runs/demo-ruler/summary.json --dry-run
