"""Decode cases each in a fresh process: which (head_dim, page, block_n, dtype, config) crashes on the GPU.

A kernel that faults poisons the CUDA context, so pytest-xdist reports every later test of the same worker as failed
too; this runs each case alone (``CUDA_LAUNCH_BLOCKING=1``) against the float64 oracle of the tests (the bisection of
a misaligned shared-memory write at head_dim 64, pages of 64, 128-token tiles: ``docs/KERNELS.md``). Usage, on the GPU
from the repo root (package not installed): ``PYTHONPATH=.:<dir with oscar_kernels -> kernels> python3
scripts/gpu_decode_isolate.py`` (all cases) or ``... gpu_decode_isolate.py '["name", D, page, block_n, "fp16",
{"hist_stages": 1}, [97, 40]]'`` (one case; ``DEV=cpu TRITON_INTERPRET=1`` runs it in the interpreter; under
``compute-sanitizer --tool memcheck`` it names the faulting source line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

# name, head_dim, page, block_n, activation dtype, overrides of the tests' one-warp config, history lengths
CASES = [
    ("a fail", 64, 64, 128, "fp16", {}, [97, 40]),
    ("b nopref", 64, 64, 128, "fp16", {"prefetch": False}, [97, 40]),
    ("c hs1", 64, 64, 128, "fp16", {"hist_stages": 1}, [97, 40]),
    ("d st2", 64, 64, 128, "fp16", {"num_stages": 2}, [97, 40]),
    ("e bf16", 64, 64, 128, "bf16", {}, [97, 40]),
    ("f d128", 128, 64, 128, "fp16", {}, [97, 40]),
    ("g p32", 64, 32, 128, "fp16", {}, [97, 40]),
    ("h p16", 64, 16, 128, "fp16", {}, [97, 40]),
    ("j w2", 64, 64, 128, "fp16", {"num_warps": 2}, [97, 40]),
    ("k whole", 64, 64, 128, "fp16", {}, [256, 128]),
    ("l long", 64, 64, 128, "fp16", {}, [1000, 700]),
    ("m p16b64", 64, 16, 64, "fp16", {}, [97, 40]),
    ("n d128bf", 128, 64, 128, "bf16", {}, [1000, 700]),
]


def run_all() -> None:
    for c in CASES:
        p = subprocess.run([sys.executable, __file__, json.dumps(c)], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"})
        lines = (p.stdout + p.stderr if p.returncode else p.stdout).strip().splitlines()
        print(c[0], "rc", p.returncode, lines[-1:], flush=True)


def run_one(case: list) -> None:
    import torch

    sys.path.insert(0, "tests")
    import test_kernels_decode as T  # the tests' case builder, oracle and budget

    _, d, page, bn, act, over, hist = case
    dt = torch.float16 if act == "fp16" else torch.bfloat16
    c = T.make_case(page + bn, 2, 8, 2, d, hist, [2, 3], [5, 4], page, dt, os.environ.get("DEV", "cuda"), meta=dt)
    out = T.run_op(c, num_splits=2, config=replace(T.WHOLE_BYTE, block_n=bn, **over), out=T._poisoned(c))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    T.assert_budget(out, c)
    print("OK")


if __name__ == "__main__":
    if len(sys.argv) == 1:
        run_all()
    else:
        run_one(json.loads(sys.argv[1]))
