"""Micro-benchmark of the vLLM decode write path at the engine's shapes: ``ops.quantize_write`` of K (``"rows"``)
and V (``"token_quads"``), clip on/off, clip threshold ``select`` vs ``sort``, ``block_t`` from N vs 16, 4 warps vs 1; and the
step's rotation, ``ops.rotate_kv`` vs the torch path ``(x.float() @ r).to(bf16)`` for K and V; and a decode step's
writes of one layer (K and V with their clips on decode slots, V without atomics, the BF16 tiers) as the three
launches the backend made before (``OSCAR_VLLM_FUSED_WRITE=0``) against one ``ops.write_step`` (its default).

V token-quad word updates (``tq_update``, ``exclusive_words``), at the backend's settings (clip sort, block_t from
N, 4 warps), clip on and off: ``and_or`` (two atomics) and ``xor`` (a load + one atomic) on the random slots, and
``and_or``, ``xor`` and ``exclusive`` (plain read-modify-write, no atomics) on decode slots: one token per page,
distinct pages, as a decode batch writes (the exclusive case needs them). The plain V cases above use the
launcher's default update (``xor``).

Shapes: H_kv 8, D 128, G 128, pages of 16 tokens, a cache of 4096 pages, bf16 inputs and metadata, a per-head
mean (as the backend passes), clip ratio 0.96, random distinct valid slots; N in {1, 8, 64, 512} tokens.
Each case is timed in a CUDA graph of ``--launches`` launches (50) replayed ``--repeats`` times (7): the figure is
the median over the replays of µs per launch, without eager launch overhead. One failing case records its error
string and the rest go on (a fault that poisons the CUDA context makes later cases fail too: their errors say so).

Usage, on the GPU from the repo root (package not installed: a directory holding ``oscar_kernels -> kernels``)::

    mkdir -p /tmp/ok && ln -sfn $PWD/kernels /tmp/ok/oscar_kernels
    PYTHONPATH=.:/tmp/ok python3 scripts/gpu_write_bench.py --out write_bench.json

``--smoke`` runs every case kind on CPU in the Triton interpreter (``TRITON_INTERPRET=1``, N=1, 2 iterations,
wall-clock, no CUDA graphs, 1 head of D=64 to keep the interpreter's ``tl.sort`` short): it checks that the script
runs, not how fast anything is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

H_KV, D, G, PAGE, PAGES, CLIP = 8, 128, 128, 16, 4096, 0.96
GROUP = 4  # query heads per KV head (Qwen3-8B: 32 over 8)
NS = (1, 8, 64, 512)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--n", type=int, nargs="+", default=list(NS), help="token counts N (default: %(default)s)")
    p.add_argument("--launches", type=int, default=50, help="launches per CUDA graph (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="graph replays timed (default: %(default)s)")
    p.add_argument("--pages", type=int, default=PAGES, help="cache pages (default: %(default)s)")
    p.add_argument("--ops", help="comma-separated case kinds to run (quantize_write, step_writes, rotate_kv, "
                   "torch_rotate; default: all, and the V-update check)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, N=1, 2 iterations, no graphs")
    return p.parse_args(argv)


def time_graph(fn: Callable[[], object], launches: int, repeats: int) -> list[float]:
    """µs per launch of ``fn`` for each replay of a CUDA graph holding ``launches`` calls."""
    import torch

    fn()  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm the side stream (allocator, cuBLAS workspace)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1000.0 / launches)
    return out


def time_wall(fn: Callable[[], object], iters: int) -> list[float]:
    """µs per call, wall clock, no warm-up (smoke mode: CPU interpreter, nothing to compile)."""
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def run_case(row: dict[str, Any], fn: Callable[[], object], timer: Callable[[Callable[[], object]], list[float]]
             ) -> dict[str, Any]:
    """Time one case into ``row``; an exception is recorded as ``row["error"]`` and does not propagate."""
    try:
        us = timer(fn)
        row.update(us_per_launch=statistics.median(us), us_repeats=us, error=None)
    except Exception as e:  # noqa: BLE001 - one bad case must not stop the others
        row.update(us_per_launch=None, us_repeats=[], error=f"{type(e).__name__}: {e}"[:2000])
    return row


def cases(n: int, pages: int, dev: str, h_kv: int = H_KV, d: int = D) -> list[tuple[dict[str, Any], Callable[[], object]]]:
    """(description, thunk) of every case at ``n`` tokens."""
    import torch

    from oscar_kernels import ops
    from oscar_kernels.write_ops import auto_block_t

    gen = torch.Generator().manual_seed(n)
    bf16 = torch.bfloat16
    k = torch.randn(n, h_kv, d, generator=gen).to(bf16).to(dev)
    v = torch.randn(n, h_kv, d, generator=gen).to(bf16).to(dev)
    mean = (torch.randn(h_kv, d, generator=gen) * 0.1).to(dev)
    r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float().to(dev)
    slots = torch.randperm(pages * PAGE, generator=gen)[:n].to(dev)
    if n > pages:
        raise ValueError(f"decode slots: {n} tokens need as many pages, got --pages {pages}")
    decode_slots = (torch.randperm(pages, generator=gen)[:n] * PAGE + torch.randint(0, PAGE, (n,), generator=gen)).to(dev)
    caches = {lay: ops.new_paged_cache(pages, h_kv, PAGE, d, min(G, d), bf16, dev, layout=lay) for lay in ops.LAYOUTS}
    out: list[tuple[dict[str, Any], Callable[[], object]]] = []
    # clip ratio, clip method, block_t (None: from N), num_warps (the launcher's default is 4; 1 warp keeps a row's
    # reductions inside one warp when BLOCK_T is small)
    configs = [(0.0, "select", None, 4), (0.0, "select", 16, 4), (CLIP, "select", None, 4), (CLIP, "sort", None, 4),
               (CLIP, "select", 16, 4), (CLIP, "sort", 16, 4), (CLIP, "select", None, 1), (CLIP, "sort", None, 1)]
    for layout, x in (("rows", k), ("token_quads", v)):
        for clip, method, bt, warps in configs:
            def fn(x: torch.Tensor = x, layout: str = layout, clip: float = clip, method: str = method,
                   bt: int | None = bt, warps: int = warps) -> None:
                ops.quantize_write(x, caches[layout], slots, mean=mean, clip_ratio=clip, layout=layout,
                                   clip_method=method, block_t=bt, num_warps=warps)

            name = f"quantize_write {'K rows' if layout == 'rows' else 'V token_quads'} " + \
                (f"clip {method}" if clip else "noclip") + f" block_t {'auto' if bt is None else bt}" + \
                f" warps {warps}"
            out.append(({"name": name, "op": "quantize_write", "n": n, "layout": layout, "clip_ratio": clip,
                         "clip_method": method if clip else None, "block_t": bt if bt else auto_block_t(n, False),
                         "block_t_auto": bt is None, "num_warps": warps, "slots": "random",
                         "tq_update": "xor" if layout == "token_quads" else None}, fn))
    # V word updates: atomics (and+or, xor) on random and decode slots; no atomics (exclusive) on decode slots only
    variants = [("random", "and_or"), ("random", "xor"), ("decode", "and_or"), ("decode", "xor"),
                ("decode", "exclusive")]
    for clip in (CLIP, 0.0):
        for kind, update in variants:
            def vfn(clip: float = clip, sl: torch.Tensor = decode_slots if kind == "decode" else slots,
                    update: str = update) -> None:
                ops.quantize_write(v, caches["token_quads"], sl, mean=mean, clip_ratio=clip, layout="token_quads",
                                   clip_method="sort", exclusive_words=update == "exclusive",
                                   tq_update="xor" if update == "exclusive" else update)

            name = f"quantize_write V token_quads {'clip sort' if clip else 'noclip'} block_t auto warps 4 " \
                f"slots {kind} {update}"
            out.append(({"name": name, "op": "quantize_write", "n": n, "layout": "token_quads", "clip_ratio": clip,
                         "clip_method": "sort" if clip else None, "block_t": auto_block_t(n, False),
                         "block_t_auto": True, "num_warps": 4, "slots": kind, "tq_update": update}, vfn))

    # the decode step's writes of one layer as the backend makes them (decode slots, clips, tiers): three launches
    # (K, V, tiers) against one (ops.write_step, the backend's default)
    rows = n + 1
    tiers = tuple(torch.zeros(rows, h_kv, t, d, dtype=bf16, device=dev) for t in (4, 4, 16, 16))
    tok = torch.arange(n, device=dev)
    tier_index = (tok, tok % 4, tok, tok % 16)

    def three_writes() -> None:
        ops.quantize_write(k, caches["rows"], decode_slots, mean=mean, clip_ratio=CLIP, layout="rows")
        ops.quantize_write(v, caches["token_quads"], decode_slots, mean=mean, clip_ratio=CLIP, layout="token_quads",
                           exclusive_words=True)
        ops.tier_write(k, v, *tiers, *tier_index)

    def fused_writes() -> None:
        ops.write_step(k, v, caches["rows"], caches["token_quads"], decode_slots, tiers, *tier_index, k_mean=mean,
                       v_mean=mean, k_clip=CLIP, v_clip=CLIP, exclusive_words=True)

    out.append(({"name": "decode step writes: K + V + tiers, three launches", "op": "step_writes", "n": n,
                 "fused": False}, three_writes))
    out.append(({"name": "decode step writes: K + V + tiers, ops.write_step (one launch)", "op": "step_writes",
                 "n": n, "fused": True}, fused_writes))

    def triton_rotate(block_t: int | None = None) -> Callable[[], None]:
        def run() -> None:
            ops.rotate_kv(k, v, r, r, dtype=bf16, block_t=block_t)
        return run

    def torch_rotate() -> None:
        (k.float() @ r).to(bf16)
        (v.float() @ r).to(bf16)

    out.append(({"name": "rotate K+V ops.rotate_kv", "op": "rotate_kv", "n": n, "block_t": None}, triton_rotate()))
    for bt in (16, 32, 64):  # the launcher's tile choice against each fixed one
        out.append(({"name": f"rotate K+V ops.rotate_kv block_t {bt}", "op": "rotate_kv", "n": n, "block_t": bt},
                    triton_rotate(bt)))
    out.append(({"name": "rotate K+V torch (x.float() @ r).to(bf16)", "op": "torch_rotate", "n": n}, torch_rotate))
    # with the decode's query rotation in the same launch, as the backend runs a step whose decodes read the tiers in
    # place (n decode queries of GROUP query heads per KV head: Qwen3-8B's 32 over 8)
    q = torch.randn(n, GROUP * h_kv, d, device=dev).to(bf16)
    gq = ops.GatherQuery(q, r, torch.empty_like(q), 1.0)

    def triton_rotate_q() -> None:
        ops.rotate_kv(k, v, r, r, dtype=bf16, query=gq)
    out.append(({"name": "rotate K+V ops.rotate_kv + the query", "op": "rotate_kv", "n": n, "block_t": None,
                 "query_heads": GROUP * h_kv}, triton_rotate_q))
    return out


def check_updates(n: int, pages: int, dev: str, h_kv: int = H_KV, d: int = D) -> dict[str, Any]:
    """Bytes of the V word updates against each other over pages of random stale bytes (on the GPU: concurrent
    programs, which the interpreter's tests cannot show): decode slots (one per page) by ``and_or``, ``xor`` and
    ``exclusive``; ``n`` consecutive slots (every row's words shared by 15 other rows) by ``and_or`` and ``xor``.
    A mismatch is the row's error."""
    import torch

    from oscar_kernels import ops

    row: dict[str, Any] = {"name": "check V updates: same bytes", "op": "check_updates", "n": n, "us_per_launch": None,
                           "us_repeats": [], "error": None}
    try:
        gen = torch.Generator().manual_seed(n + 1)
        v = torch.randn(n, h_kv, d, generator=gen).to(torch.bfloat16).to(dev)
        mean = (torch.randn(h_kv, d, generator=gen) * 0.1).to(dev)
        base = ops.new_paged_cache(pages, h_kv, PAGE, d, min(G, d), torch.bfloat16, dev, layout="token_quads")
        stale = torch.randint(0, 256, base.packed.shape, generator=gen, dtype=torch.uint8).to(dev)
        decode = (torch.randperm(pages, generator=gen)[:n] * PAGE + torch.randint(0, PAGE, (n,), generator=gen)).to(dev)
        dense = torch.arange(n, dtype=torch.int64, device=dev) + PAGE
        bad = []
        for kind, sl, updates in (("decode", decode, ("and_or", "xor", "exclusive")), ("dense", dense, ("and_or", "xor"))):
            got = {}
            for update in updates:
                cache = ops.new_paged_cache(pages, h_kv, PAGE, d, min(G, d), torch.bfloat16, dev, layout="token_quads")
                cache.packed.copy_(stale)
                ops.quantize_write(v, cache, sl, mean=mean, clip_ratio=CLIP, layout="token_quads", clip_method="sort",
                                   exclusive_words=update == "exclusive", tq_update="xor" if update == "exclusive" else update)
                got[update] = cache.packed.cpu()
            bad += [f"{kind} {u}: {int((got[u] != got['and_or']).sum())} bytes differ from and_or"
                    for u in updates[1:] if not torch.equal(got[u], got["and_or"])]
        row["error"] = "; ".join(bad) or None
    except Exception as e:  # noqa: BLE001 - recorded like a failing case
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    return row


def environment(dev: str) -> dict[str, Any]:
    import torch
    import triton

    env: dict[str, Any] = {"torch": torch.__version__, "triton": triton.__version__, "device": dev,
                           "cuda": torch.version.cuda, "interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    if dev == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>5}  {'µs/launch':>10}  case"]
    for row in rows:
        if row.get("us_per_launch") is not None:
            us = f"{row['us_per_launch']:10.2f}"
        else:  # a check row has no time: it passed unless it carries an error
            us = f"{'FAILED' if row.get('error') else 'ok':>10}"
        lines.append(f"{row['n']:>5}  {us}  {row['name']}" + (f"  [{row['error'][:120]}]" if row.get("error") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton defines any kernel
    import torch

    dev = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_write_bench: no CUDA device (use --smoke on CPU)", file=sys.stderr)
        return 2
    ops_known = {"quantize_write", "step_writes", "rotate_kv", "torch_rotate"}
    wanted = set(args.ops.split(",")) if args.ops else None  # None: every kind, and the V-update check
    if wanted is not None and not wanted <= ops_known:
        print(f"gpu_write_bench: --ops: unknown {sorted(wanted - ops_known)}; known: {', '.join(sorted(ops_known))}",
              file=sys.stderr)
        return 2
    ns = [1] if args.smoke else args.n
    pages = min(args.pages, 8) if args.smoke else args.pages
    h_kv, d = (1, 64) if args.smoke else (H_KV, D)  # the interpreter's tl.sort of 8 heads x 128 takes minutes
    t0 = time.perf_counter()

    def timer(fn: Callable[[], object]) -> list[float]:
        return time_wall(fn, 2) if args.smoke else time_graph(fn, args.launches, args.repeats)

    rows: list[dict[str, Any]] = []
    for n in ns:
        try:
            todo = cases(n, pages, dev, h_kv, d)
        except Exception as e:  # noqa: BLE001 - setup of one N must not stop the others
            rows.append({"name": "setup", "n": n, "us_per_launch": None, "us_repeats": [],
                         "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        if wanted is None:
            rows.append(check_updates(n, pages, dev, h_kv, d))
            print(table(rows[-1:]).splitlines()[1], flush=True)
        for desc, fn in todo:
            if wanted is not None and desc["op"] not in wanted:
                continue
            rows.append(run_case(desc, fn, timer))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    print()
    print(table(rows))
    result = {"env": environment(dev),
              "config": {"h_kv": h_kv, "d": d, "group": min(G, d), "page_size": PAGE, "pages": pages, "clip_ratio": CLIP,
                         "dtype": "bf16", "meta_dtype": "bf16", "mean": True, "launches_per_graph": args.launches,
                         "repeats": args.repeats, "timing": "wall clock" if args.smoke else "CUDA graph replay", "ops": args.ops,
                         "smoke": args.smoke},
              "seconds": time.perf_counter() - t0, "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    bad = sum(1 for r in rows if r.get("error"))
    print(f"{len(rows)} cases, {bad} failed, {result['seconds']:.1f} s", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
