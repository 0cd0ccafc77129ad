"""One device call for the decode kernels: GPU tests, config sweeps against cuDNN/flash SDPA, the bench record.

Usage (on the H200, from the repo root; the package is not installed there):
    mkdir -p /tmp/pp && ln -sfn $PWD/kernels /tmp/pp/oscar_kernels
    PYTHONPATH=.:/tmp/pp python3 scripts/gpu_decode_sweep.py [tests] [sanitize] [sweep] [hist] [variants] [breakdown] [diag] [flashinfer] [layout] [bench]
(env SWEEP=short|full picks the config list, TEST_FILES / TEST_K the GPU test files and -k filter (default: every
test; the decode grid's lengths are ids len1 ... len4097, so "not len4097" skips one length, while "not 97" would
skip both 97 and 4097), TEST_TIMEOUT its limit in seconds, CELLS
the (batch, context) cells, e.g. CELLS=1x4096,16x131072, VARIANTS the variants stage's configs.)
Writes $OUT/sweep.json (every measurement, errors recorded, never hidden; per-kernel graph times under
"breakdown"), tests.log, bench.json.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from oscar_cli.bench.backends import bench_bf16, bench_flashinfer, bench_int2
from oscar_cli.bench.cases import int2_bytes, int2_plan, int2_plans
from oscar_cli.bench.config import BenchConfig
from oscar_cli.bench.environment import environment
from oscar_cli.bench.shapes import NAMED_SHAPES
from oscar_cli.bench.timing import copy_bandwidth, graph_over
from oscar_kernels import ops

OUT = Path(os.environ.get("OUT", "gpu_out"))
OUT.mkdir(parents=True, exist_ok=True)
SHAPE = NAMED_SHAPES["qwen3-8b"]
DEV = torch.device("cuda")
L2 = torch.cuda.get_device_properties(DEV).L2_cache_size
R: dict = {"env": environment(), "rows": [], "bf16": [], "errors": []}
T0 = time.time()


def save() -> None:
    (OUT / "sweep.json").write_text(json.dumps(R, indent=1, default=str))


def _run_logged(name: str, cmd: list[str], timeout_s: int) -> None:
    """Run ``cmd``, write its output to ``$OUT/<name>.log`` and ``R[name]`` (rc None on a timeout: what ran is kept)."""
    t = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        log, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:  # the partial output comes as bytes (or None) even with text=True
        part = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr)]
        log, rc = f"timed out after {exc.timeout} s\n{part[0]}{part[1]}", None
    (OUT / f"{name}.log").write_text(log)
    R[name] = {"rc": rc, "seconds": time.time() - t, "tail": log[-2000:]}
    print(name.upper(), "rc", rc, f"{time.time() - t:.0f}s", log[-800:], flush=True)
    save()


def tests() -> None:
    _run_logged("tests", [sys.executable, "-m", "pytest", "-m", "gpu or unit", "-q", "-n", "8", "--no-header",
                          "-p", "no:cacheprovider",
                          *os.environ.get("TEST_FILES", "tests/test_kernels_pack.py tests/test_kernels_decode.py tests/test_tier_ops.py "
                                                        "tests/test_rotate_ops.py").split(),
                          "-k", os.environ.get("TEST_K", "")],
                int(os.environ.get("TEST_TIMEOUT", "200")))


def sanitize() -> None:
    """compute-sanitizer's memcheck over GPU tests in one process (env SANITIZE_FILES, SANITIZE_K): out-of-bounds and
    misaligned accesses by name and source line, which a plain run reports only as a poisoned CUDA context."""
    _run_logged("sanitize", ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", "--print-limit", "20",
                             sys.executable, "-m", "pytest", "-m", "gpu or unit", "-q", "--no-header",
                             "-p", "no:cacheprovider",
                             *os.environ.get("SANITIZE_FILES", "tests/test_kernels_decode.py").split(),
                             "-k", os.environ.get("SANITIZE_K", "smaller_than_the_tile or large_pages")],
                int(os.environ.get("SANITIZE_TIMEOUT", "300")))


def measure(cfg: ops.DecodeConfig, batch: int, ctx: int, splits: int | None = None) -> None:
    bc = BenchConfig(shape=SHAPE, rep_ms=40)
    try:
        plans, _, s = int2_plans(SHAPE, batch, ctx, bc, DEV, L2, cfg, splits)
        us, g = bench_int2(plans, bc.rep_ms)
        del plans
    except Exception as exc:  # noqa: BLE001 - recorded
        R["errors"].append({"cfg": cfg.__dict__, "cell": [batch, ctx], "error": repr(exc)[:500]})
        print("ERROR", cfg, batch, ctx, repr(exc)[:300], flush=True)
        return
    h = ops.LAST_LAUNCH.get("stage1")
    nbytes = int2_bytes(SHAPE, batch, ctx, 64, 256, 64)
    row = {"cfg": dict(cfg.__dict__), "batch": batch, "ctx": ctx, "splits": s, "eager_us": us, "graph_us": g,
           "regs": getattr(h, "n_regs", None), "spills": getattr(h, "n_spills", None),
           "gbps": nbytes / ((g or us) * 1e-6) / 1e9, "pipeline": pipeline_facts(h)}
    R["rows"].append(row)
    print(f"[{time.time() - T0:4.0f}s] bn{cfg.block_n} w{cfg.num_warps} st{cfg.num_stages}/{cfg.hist_stages} "
          f"hq{int(cfg.hoist_q)} reg{cfg.maxnreg} "
          f"pdl{int(cfg.pdl)} mc{cfg.merge_cols} bp{cfg.merge_block_p} "
          f"B={batch:<3d} ctx={ctx:<7d} S={s:<4d} eager {us:8.1f}  graph {g}  regs={row['regs']} "
          f"spills={row['spills']} {row['gbps']:.0f} GB/s", flush=True)
    save()


def pipeline_facts(h: object) -> dict:
    """What the compiler's loop pipeliner made of stage 1 (from the TTGIR): the buffer depth of the INT2 V-code
    tile (``memdesc<Nx128x16xi8>``: 1 = no overlap between a tile's copies and the previous tile's math) and the
    ``async_wait`` counts."""
    try:
        ir = h.asm["ttgir"]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - facts are optional
        return {}
    return {"v_tile_buffers": sorted({int(x) for x in re.findall(r"memdesc<(\d+)x128x16xi8", ir)}),
            "async_wait_nums": sorted({int(x) for x in re.findall(r"async_wait[^{]*\{num = (\d+)", ir)}),
            "sync_loads_in_ir": len(re.findall(r"= tt\.load ", ir))}


def cells_with_bf16() -> Iterator[tuple[int, int]]:
    """The copy bandwidth, then every cell of CELLS after measuring the BF16 baselines (cuDNN, flash) for it, so
    each INT2 measurement of a stage has its BF16 reference from the same run."""
    copy = copy_bandwidth(DEV)
    R["copy_gbps"] = copy
    print(f"copy {copy:.0f} GB/s", flush=True)
    for b, c in CELLS:
        e, g = bench_bf16(SHAPE, b, c, BenchConfig(shape=SHAPE, rep_ms=40), DEV, L2)
        R["bf16"].append({"batch": b, "ctx": c, "eager": e, "graph": g})
        print(f"BF16 B={b} ctx={c} eager {e} graph {g}", flush=True)
        yield b, c


def hist() -> None:
    """The INT2 loop's own pipelining depth (``hist_stages``: 2-4 single-, 5 double-buffered), every cell, BF16 in the
    run."""
    for b, c in cells_with_bf16():
        base = ops.default_config(b)
        for hs in (2, 3, 5, 7):
            measure(replace(base, hist_stages=hs), b, c)
        if b >= 16:
            for reg in (None, 168):
                measure(replace(base, hist_stages=5, maxnreg=reg), b, c)
    save()


def variants() -> None:
    """``default_config(batch)`` and the overrides in env VARIANTS (a JSON list of DecodeConfig field dicts, e.g.
    ``[{"merge_cols": 128}, {"maxnreg": null, "min_batch": 16}]``; ``min_batch``, ``max_batch`` and ``max_ctx``
    limit an entry to some cells, ``splits`` fixes the split count), every cell, BF16 in the run."""
    over = json.loads(os.environ.get("VARIANTS", "[]"))
    for b, c in cells_with_bf16():
        base = ops.default_config(b)
        measure(base, b, c)
        for o in over:
            o = dict(o)
            sp = o.pop("splits", None)
            if b >= o.pop("min_batch", 0) and b <= o.pop("max_batch", 1 << 30) and c <= o.pop("max_ctx", 1 << 30):
                measure(replace(base, **o), b, c, splits=sp)
    save()


def joint_case(case: dict, mode: str) -> dict:
    """The same cache values in another memory layout (the kernels read them through the views' strides):
    ``meta``: the four metadata arrays of a (page, KV head) adjacent, one 4·P-element block; ``all``: K codes, V codes
    and the four metadata rows of a (page, KV head) in one contiguous block (P·D/4 + D·P/4 + 8·P bytes)."""
    from oscar_kernels.reference import QuantizedRows

    kq, vq = case["k_cache"], case["v_cache"]
    pages, h, p, dq = kq.packed.shape
    metas = (kq.scale, kq.zero, vq.scale, vq.zero)
    if mode == "meta":
        buf = torch.empty(pages, h, 4, p, dtype=kq.scale.dtype, device=kq.scale.device)
        new = [buf[:, :, i, :, None] for i in range(4)]
        kc, vc = kq.packed, vq.packed
    else:
        kb, vb = p * dq, dq * p  # one 64-token page: V rows of 16 bytes
        blk = kb + vb + 8 * p
        raw = torch.empty(pages * h * blk, dtype=torch.uint8, device=kq.packed.device)
        kc = raw.as_strided((pages, h, p, dq), (h * blk, blk, dq, 1), 0)
        vc = raw.as_strided((pages, h, dq * 4, p // 4), (h * blk, blk, p // 4, 1), kb)
        kc.copy_(kq.packed)
        vc.copy_(vq.packed)
        mb = raw.view(torch.bfloat16)
        new = [mb.as_strided((pages, h, p, 1), (h * blk // 2, blk // 2, 1, 1), (kb + vb) // 2 + i * p) for i in range(4)]
    for dst, src in zip(new, metas, strict=True):
        dst.copy_(src)
    out = dict(case)
    out["k_cache"] = QuantizedRows(kc, new[0], new[1])
    out["v_cache"] = QuantizedRows(vc, new[2], new[3])
    return out


def layout() -> None:
    """Memory layout of the paged cache, same kernel (env LAYOUTS, default every one): separate tensors with pages of
    16/32/64/128/256 tokens (``page16`` ...), the metadata of a 64-token page adjacent (``meta``), everything of a
    (page, KV head) in one block (``all``), the non-paged layout (``nonpaged``). Joint layouts must give bitwise
    the outputs of the separate tensors; measurements interleaved and repeated."""
    R["layout"] = []
    names = os.environ.get("LAYOUTS", "page64,meta,all,page16,page32,page128,page256,nonpaged").split(",")
    for b, c in cells_with_bf16():
        cfg = ops.default_config(b)
        for rep in range(2):
            for name in names:
                page = int(name[4:]) if name.startswith("page") else 64
                bc = BenchConfig(shape=SHAPE, rep_ms=40, page_size=page, paged=name != "nonpaged")
                plans, cases, s = int2_plans(SHAPE, b, c, bc, DEV, L2, cfg)
                same = None
                if name in ("meta", "all"):  # the same values re-laid out; the separate tensors' output is the oracle
                    ref = plans[0].run().clone()
                    cases = [joint_case(x, name) for x in cases]
                    ws = ops.make_workspace(b, SHAPE.h_q, SHAPE.d, s, DEV)
                    plans = [int2_plan(x, s, cfg, ws, plans[0].out, True) for x in cases]
                    same = bool(torch.equal(plans[0].run(), ref))
                g = graph_over(plans, lambda p: p.run(), 40)
                row = {"batch": b, "ctx": c, "layout": name, "rep": rep, "splits": s, "sets": len(cases),
                       "graph_us": g, "bitwise_equal": same}
                R["layout"].append(row)
                print("LAYOUT", row, flush=True)
                del plans, cases
                torch.cuda.empty_cache()
        save()

CELLS = [(1, 131072), (16, 131072), (1, 32768), (1, 4096), (16, 32768)]
if os.environ.get("CELLS"):  # e.g. CELLS=1x4096,1x32768
    CELLS = [(int(b), int(c)) for b, c in (x.split("x") for x in os.environ["CELLS"].split(","))]
D = ops.DecodeConfig
CONFIGS = {
    "short": [D(), D(maxnreg=128), D(maxnreg=168), D(maxnreg=192), D(num_stages=3), D(pdl=False), D(merge_cols=128),
              D(hoist_q=True, maxnreg=168), D(prefetch=False)],
    "full": [D(), D(num_stages=1), D(num_stages=3), D(num_warps=2), D(block_n=128, num_warps=2), D(num_warps=4),
             D(block_nb=32), D(min_gp=16)],
}[os.environ.get("SWEEP", "short")]


def sweep() -> None:
    for b, c in cells_with_bf16():
        for cfg in CONFIGS:
            measure(cfg, b, c)
        if b == 1 and os.environ.get("SWEEP", "short") == "full":
            base = ops.default_num_splits(b, SHAPE.h_kv, c - 320, 64)
            for s in (base * 2, max(1, base // 2)):
                measure(ops.DecodeConfig(), b, c, splits=s)
    save()


def diag() -> None:
    """Memory vs. compute at batch 1: the same kernel with every block-table entry pointing at one page (the
    history then comes from L1/L2), next to the real shuffled pages; and deeper pipelining."""
    R["diag"] = []
    bc = BenchConfig(shape=SHAPE, rep_ms=40)
    for b, c in ((1, 131072), (1, 32768), (16, 131072)):
        cfg = ops.default_config(b)
        for one_page in (False, True):
            plans, cases, _ = int2_plans(SHAPE, b, c, bc, DEV, L2, cfg)
            if one_page:  # the plans read these tensors: every history token now comes from page 0
                for x in cases:
                    x["block_table"].zero_()
            row = {"batch": b, "ctx": c, "one_page": one_page, "cfg": dict(cfg.__dict__),
                   "stage1": graph_over(plans, partial(_launch, part="stage1"), 40),
                   "all": graph_over(plans, lambda p: p.run(), 40)}
            R["diag"].append(row)
            print("DIAG", row, flush=True)
            del cases, plans
        for st in (3, 4):
            measure(replace(cfg, num_stages=st), b, c)
    save()


def _launch(p: ops.DecodePlan, part: str) -> None:
    """One of the plan's three kernels alone (rotate q, stage 1, merge + rotate back)."""
    k = p._kernels
    fn, (grid, args, kw) = {"rotate": (k._rotate_q_kernel, p._rot), "stage1": (k._decode_stage1_kernel, p._stage1),
                            "merge": (k._merge_rotate_kernel, p._merge)}[part]
    fn[grid](*args, **kw)


def breakdown() -> None:
    """Graph time of each of the three decode kernels alone, and of all three (fixed costs at small batch); env
    BREAKDOWN_SPLITS (e.g. "128,256") repeats each cell at those split counts instead of the default one."""
    R["breakdown"] = []
    bc = BenchConfig(shape=SHAPE, rep_ms=40)
    split_list = [int(x) for x in os.environ.get("BREAKDOWN_SPLITS", "").split(",") if x] or [None]
    for b, c in CELLS:
        cfg = ops.default_config(b)
        for sp in split_list:
            plans, _, s = int2_plans(SHAPE, b, c, bc, DEV, L2, cfg, splits=sp)
            row = {"batch": b, "ctx": c, "splits": s, "cfg": dict(cfg.__dict__)}
            for part in ("rotate", "stage1", "merge"):
                row[part] = graph_over(plans, partial(_launch, part=part), 40)
            row["all"] = graph_over(plans, lambda p: p.run(), 40)
            R["breakdown"].append(row)
            print("BREAKDOWN", row, flush=True)
            del plans
    save()


def flashinfer() -> None:
    """FlashInfer's paged BF16 decode at 1 x 4K, tensor-core and CUDA-core kernels: compiles its JIT kernels (cached
    for a ``bench`` stage after it) and shows whether it runs here at all."""
    bc = BenchConfig(shape=SHAPE, rep_ms=40)
    for tc in (True, False):
        t = time.time()
        e, g = bench_flashinfer(SHAPE, 1, 4096, bc, DEV, L2, tc)
        R.setdefault("flashinfer", []).append({"tensor_cores": tc, "eager": e, "graph": g, "seconds": time.time() - t})
        print("FLASHINFER", "tc" if tc else "cuda-cores", e, g, f"{time.time() - t:.0f}s", flush=True)
    save()


def bench() -> None:
    p = subprocess.run([sys.executable, "-c", "from oscar_cli.main import main; main()", "--json", "bench",
                        "--batch", "1,16", "--ctx", "4k,32k,128k", "--plot", str(OUT / "bench.png")],
                       capture_output=True, text=True, timeout=int(os.environ.get("BENCH_TIMEOUT", "300")))
    (OUT / "bench.json").write_text(p.stdout)
    (OUT / "bench.log").write_text(p.stderr)
    print("BENCH rc", p.returncode, p.stderr[-600:], flush=True)


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    stages = sys.argv[1:] or ["tests", "sweep", "bench"]
    for st in stages:
        {"tests": tests, "sanitize": sanitize, "sweep": sweep, "hist": hist, "variants": variants, "bench": bench,
         "breakdown": breakdown, "diag": diag, "flashinfer": flashinfer, "layout": layout}[st]()
        print(f"== {st} done at {time.time() - T0:.0f}s", flush=True)
