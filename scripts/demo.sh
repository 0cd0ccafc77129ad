#!/usr/bin/env bash
# The README's main job on the embedded model. Each issue adds a stage; stages run in order.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
stage() { printf '\n\033[1m== %s ==\033[0m\n' "$*" >&2; }

stage "1/1 resolve + load the embedded model, its identity and the INT2 bits-per-element table"
oscar --version
oscar info smollm2-135m   # first run converts the GGUF once (~30 s); later runs read the cache (seconds)
