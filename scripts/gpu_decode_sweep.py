"""One device call for the v6 decode kernel: GPU tests, a config sweep against cuDNN/flash SDPA, the bench record.

Usage (on the H200, from the repo root; the package is not installed there):
    mkdir -p /tmp/pp && ln -sfn $PWD/kernels /tmp/pp/oscar_kernels
    PYTHONPATH=.:/tmp/pp python3 scripts/gpu_decode_sweep.py [tests] [sweep] [bench]
Writes $OUT/sweep.json (every measurement, errors recorded, never hidden), tests.log, bench.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from oscar_cli.bench import harness as H
from oscar_cli.bench.shapes import NAMED_SHAPES
from oscar_kernels import ops

OUT = Path(os.environ.get("OUT", "gpu_out"))
OUT.mkdir(parents=True, exist_ok=True)
SHAPE = NAMED_SHAPES["qwen3-8b"]
DEV = torch.device("cuda")
L2 = torch.cuda.get_device_properties(DEV).L2_cache_size
R: dict = {"env": H.environment(), "rows": [], "bf16": [], "errors": []}
T0 = time.time()


def save() -> None:
    (OUT / "sweep.json").write_text(json.dumps(R, indent=1, default=str))


def tests() -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu or unit", "-q", "-n", "8", "--no-header", "-p", "no:cacheprovider",
           "tests/test_kernels_pack.py", "tests/test_kernels_decode.py", "-k", os.environ.get("TEST_K", "not 97")]
    t = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=int(os.environ.get("TEST_TIMEOUT", "200")))
    (OUT / "tests.log").write_text(p.stdout + p.stderr)
    R["tests"] = {"rc": p.returncode, "seconds": time.time() - t, "tail": (p.stdout + p.stderr)[-2000:]}
    print("TESTS rc", p.returncode, f"{time.time() - t:.0f}s", (p.stdout + p.stderr)[-800:], flush=True)
    save()


def measure(cfg: ops.DecodeConfig, batch: int, ctx: int, splits: int | None = None) -> None:
    bc = H.BenchConfig(shape=SHAPE, rep_ms=40)
    try:
        us, g, s = H.bench_int2(SHAPE, batch, ctx, bc, DEV, L2, decode_config=cfg, splits=splits)
    except Exception as exc:  # noqa: BLE001 - recorded
        R["errors"].append({"cfg": cfg.__dict__, "cell": [batch, ctx], "error": repr(exc)[:500]})
        print("ERROR", cfg, batch, ctx, repr(exc)[:300], flush=True)
        return
    h = ops.LAST_LAUNCH.get("stage1")
    nbytes = H.int2_bytes(SHAPE, batch, ctx, 64, 256, 64)
    row = {"cfg": dict(cfg.__dict__), "batch": batch, "ctx": ctx, "splits": s, "eager_us": us, "graph_us": g,
           "regs": getattr(h, "n_regs", None), "spills": getattr(h, "n_spills", None),
           "gbps": nbytes / ((g or us) * 1e-6) / 1e9}
    R["rows"].append(row)
    print(f"[{time.time() - T0:4.0f}s] bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages} gp{cfg.min_gp} m{cfg.magic} "
          f"mode{cfg.mode} B={batch:<3d} ctx={ctx:<7d} S={s:<4d} eager {us:8.1f}  graph {g}  regs={row['regs']} "
          f"spills={row['spills']} {row['gbps']:.0f} GB/s", flush=True)
    save()


CELLS = [(1, 131072), (16, 131072), (1, 32768), (1, 4096)]
CONFIGS = [ops.DecodeConfig(), ops.DecodeConfig(maxnreg=128), ops.DecodeConfig(maxnreg=128, num_stages=3),
           ops.DecodeConfig(maxnreg=96), ops.DecodeConfig(maxnreg=168, block_nb=32)] if os.environ.get("SWEEP_SHORT") else [
    ops.DecodeConfig(), ops.DecodeConfig(num_stages=1), ops.DecodeConfig(num_stages=3), ops.DecodeConfig(num_warps=2),
    ops.DecodeConfig(block_n=128, num_warps=2), ops.DecodeConfig(num_warps=4), ops.DecodeConfig(block_nb=32),
    ops.DecodeConfig(min_gp=16)]


def sweep() -> None:
    copy = H.copy_bandwidth(DEV)
    R["copy_gbps"] = copy
    print(f"copy {copy:.0f} GB/s", flush=True)
    for b, c in CELLS:
        e, g = H.bench_bf16(SHAPE, b, c, H.BenchConfig(shape=SHAPE, rep_ms=40), DEV, L2)
        R["bf16"].append({"batch": b, "ctx": c, "eager": e, "graph": g})
        print(f"BF16 B={b} ctx={c} eager {e} graph {g}", flush=True)
        for cfg in CONFIGS:
            measure(cfg, b, c)
        if b == 1 and not os.environ.get("SWEEP_SHORT"):
            base = ops.default_num_splits(b, SHAPE.h_kv, c - 320, 64)
            for s in (base * 2, max(1, base // 2)):
                measure(ops.DecodeConfig(), b, c, splits=s)
        measure(ops.DecodeConfig(mode=1), b, c)  # load-only ceiling of the default config
    save()


def bench() -> None:
    p = subprocess.run([sys.executable, "-c", "from oscar_cli.main import main; main()", "--json", "bench",
                        "--batch", "1,16", "--ctx", "4k,32k,128k", "--plot", str(OUT / "bench.png")],
                       capture_output=True, text=True, timeout=300)
    (OUT / "bench.json").write_text(p.stdout)
    (OUT / "bench.log").write_text(p.stderr)
    print("BENCH rc", p.returncode, p.stderr[-600:], flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    stages = sys.argv[1:] or ["tests", "sweep", "bench"]
    for st in stages:
        {"tests": tests, "sweep": sweep, "bench": bench}[st]()
        print(f"== {st} done at {time.time() - T0:.0f}s", flush=True)
