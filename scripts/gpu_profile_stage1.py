"""Stage 1 of the decode kernel alone, launched a few times for Nsight Compute (stall reasons, issue rate).

Usage (on the H200; the package is not installed there):
    mkdir -p /tmp/pp && ln -sfn $PWD/kernels /tmp/pp/oscar_kernels
    PYTHONPATH=.:/tmp/pp ncu --clock-control none -k regex:stage1 -s 2 -c 1 --section WarpStateStats \\
        --section SchedulerStats --section Occupancy python3 scripts/gpu_profile_stage1.py BATCH CTX [OVERRIDES]
(OVERRIDES: a JSON object of DecodeConfig fields over ``default_config(BATCH)``, e.g. '{"hoist_q": false}'.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch

from oscar_cli.bench.cases import int2_plans
from oscar_cli.bench.config import BenchConfig
from oscar_cli.bench.shapes import NAMED_SHAPES
from oscar_kernels import ops

SHAPE = NAMED_SHAPES["qwen3-8b"]


def main() -> None:
    b, c = int(sys.argv[1]), int(sys.argv[2])
    dev = torch.device("cuda")
    cfg = replace(ops.default_config(b), **(json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}))
    plans, _, s = int2_plans(SHAPE, b, c, BenchConfig(shape=SHAPE), dev,
                             torch.cuda.get_device_properties(dev).L2_cache_size, cfg)
    plan = plans[0]
    for _ in range(4):
        plan.run()
    torch.cuda.synchronize()
    print("splits", s, "config", cfg, flush=True)


if __name__ == "__main__":
    main()
