#!/usr/bin/env python
"""Benchmark ``oscar calibrate``: per-phase time, peak memory, generation tokens/s. Not a test.

Two setups (docs/BENCHMARKS.md "Calibration" records the numbers):

  # the embedded model on this CPU, 16K tokens (generation timed separately from capture+solve+clip)
  python scripts/bench_calibrate.py --model smollm2-135m --tokens 16k --data self
  # Qwen3-8B architecture with random bf16 weights on a GPU, 20K tokens, end to end
  python scripts/bench_calibrate.py --random-arch qwen3-8b --device cuda --tokens 20k --data self

Prints one JSON document (also written to ``--json-out``): timings, ``capture_solve_clip_s``, ``end_to_end_s``,
``peak_rss_mb``, ``peak_gpu_mb``, versions, git sha, date and the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Architectures buildable with random weights (no download): the attention geometry of the real models.
RANDOM_ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, num_hidden_layers=36, vocab_size=151936,
                     max_position_embeddings=40960, rope_theta=1000000.0, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, num_hidden_layers=30, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(model_type="qwen3", hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, num_hidden_layers=2, vocab_size=512,
                 max_position_embeddings=4096, rope_theta=10000.0, tie_word_embeddings=True),
}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _random_model(name: str, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(RANDOM_ARCHS[name])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from oscar_cli import __version__
    from oscar_cli._options import parse_ctx
    from oscar_cli.calibration.run import calibrate_model
    from oscar_cli.recipe import load_recipe, recipe_for_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model reference (oscar_cli.model.load_model)")
    ap.add_argument("--random-arch", choices=sorted(RANDOM_ARCHS), help="random weights of this architecture")
    ap.add_argument("--recipe", default=None, help="recipe name or file (default: per-model recipe)")
    ap.add_argument("--tokens", default="16k")
    ap.add_argument("--data", default="self", help="self | random | a file/folder | hf:<id>")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default="/tmp/oscar-bench-artifact")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_avg = os.getloadavg()
    t_start = time.perf_counter()
    if args.random_arch:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype]
        dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        model, tokenizer = _random_model(args.random_arch, device, dtype), None
        reference, resolved = f"random:{args.random_arch}", "sha256:" + "0" * 64
        slug = args.random_arch
    else:
        from oscar_cli.model import load_model

        loaded = load_model(args.model, device=args.device, dtype=args.dtype)
        model, tokenizer = loaded.model, loaded.tokenizer
        reference, resolved, slug = loaded.identity.reference, loaded.identity.resolved, args.model
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t_model = time.perf_counter() - t_start
    recipe = load_recipe(args.recipe or recipe_for_model(slug),
                         {"data": {"tokens": parse_ctx(args.tokens), "source": args.data}})
    cpu0 = time.process_time()
    res = calibrate_model(model, tokenizer, recipe, reference=reference, resolved=resolved, out=args.out,
                          overwrite=True)
    calibrate_cpu = time.process_time() - cpu0
    end_to_end = time.perf_counter() - t_start
    t = res.timings
    import transformers

    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python scripts/bench_calibrate.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": reference,
        "recipe": recipe.name,
        "data": res.data,
        "generation_tokens_per_s": round(res.generation_tokens_per_s, 1),
        "model_load_s": round(t_model, 2),
        "timings_s": {k: round(v, 2) for k, v in t.items()},
        "capture_solve_clip_s": round(t["capture"] + t["solve"] + t["clip"], 2),
        "end_to_end_s": round(end_to_end, 2),
        "calibrate_process_cpu_s": round(calibrate_cpu, 2),  # all threads; with --threads 1 ~ an idle core's wall
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if torch.cuda.is_available() else None,
        "device": str(next(model.parameters()).device),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in load_avg],
        "versions": {"oscar": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
        "git": _git_sha(),
        "clip_choices": [(s.k_clip, s.v_clip) for s in res.layers],
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
