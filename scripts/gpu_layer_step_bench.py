#!/usr/bin/env python3
"""One attention layer's decode step in the vLLM backend (``PagedInt2Layer.forward`` on a decode-only batch: the
K/V rotation, the writes, the tier gather, the decode), timed in CUDA graphs, for the variants of the launches
around the decode: ``gather`` (the tier gather and the q rotation apart, six launches: ``OSCAR_VLLM_FUSED_GATHER=0``),
``fused-gather`` (the q rotation in the gather's launch, five: the engine's default),
``direct`` (``OSCAR_VLLM_DIRECT_TIERS``: no gather, four; the tier rows not prefetched, the default in place) and
``direct-tier-prefetch`` (the same with ``DecodeConfig(tier_prefetch=True)``: the tier rows prefetched into L2
before stage 1 waits; results before the default changed name this one ``direct`` and the default
``direct-no-tier-prefetch``).

No vLLM: the backend's own layer object and kernels, at the engine's shapes (Qwen3-8B: 32 query / 8 KV heads,
D 128, pages of 16 tokens, bf16, sink 64 and recent 256 tokens, batch-1 decode by default) over an INT2 history of
``--ctx`` tokens (random codes, valid metadata: speed does not depend on the values). A graph holds ``--layers``
forwards (36: one step's worth of layers, all the same layer), replayed ``--repeats`` times per variant, the
variants interleaved; the figure is the median µs per forward. The forwards of a graph go through ``--distinct``
layers (36: each its own pages, tiers and rotation state, as in the engine, so a layer's rows are not still in L2
from the forward before; 1 re-runs the same layer). A step of the engine pays this per layer plus what
the layer does not do (weights, norms, sampling): the differences between variants are what the engine's TPOT
moves by, times the number of layers.

    bash scripts/gpu_session.sh lstep            # on the device (carry .stage/whl): --ctx 4k,32k,128k
    python3 scripts/gpu_layer_step_bench.py --ctx 4k,128k --out layer-step.json

``--smoke``: CPU, Triton interpreter (``TRITON_INTERPRET=1``), a tiny layer and history, wall clock, no graphs: it
checks that every variant runs, not how fast.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("gather", "fused-gather", "direct", "direct-tier-prefetch")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ctx", default="4k,128k", help="INT2 history lengths, e.g. 4k,32k,128k (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="decode requests in the step (default: %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    p.add_argument("--layers", type=int, default=36, help="forwards per CUDA graph (default: %(default)s)")
    p.add_argument("--distinct", type=int, default=36,
                   help="distinct layers the graph's forwards cycle through (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="graph replays per variant (default: %(default)s)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes, wall clock")
    return p.parse_args(argv)


def tokens(text: str) -> int:
    t = text.strip().lower()
    return int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)


def build(variant: str, ctx: int, batch: int, dev: str, smoke: bool, seed: int = 0) -> Callable[[], object]:
    """A decode-only step of ``batch`` requests, each ``ctx`` tokens long, through one layer with ``variant``'s
    kernels; returns the forward (call it to run the step again: the same token rewritten, the same decode)."""
    import torch

    from oscar_cli.vllm import layout
    from oscar_cli.vllm.core import PagedInt2Layer, TritonKernels, build_step
    from oscar_kernels import ops

    d, hkv, hq, page, sink, recent = (64, 2, 4, 16, 4, 16) if smoke else (128, 8, 32, 16, 64, 256)
    gen = torch.Generator().manual_seed(seed)
    rk = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
    rv = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))[0].float()
    tensors = layout.LayerTensors(k_rotation=rk, v_rotation=rv, k_mean=0.1 * torch.randn(hkv, d, generator=gen),
                                  v_mean=0.1 * torch.randn(hkv, d, generator=gen), k_clip=0.92, v_clip=0.9)
    s = layout.Int2Settings(sink=sink, recent=recent)
    cfg = ops.default_config(batch)
    if variant == "direct-tier-prefetch":
        cfg = replace(cfg, tier_prefetch=True)
    kernels = TritonKernels(cfg, fused_gather=variant == "fused-gather", direct_tiers=variant.startswith("direct"))
    rows = max(batch, 4)
    act = torch.float16 if smoke else torch.bfloat16  # (the interpreter's bf16 dot is wrong: fp16 there)
    layer = PagedInt2Layer(tensors, s, rows, hq, hkv, d, page, act, dev, kernels=kernels)
    nb = -(-ctx // page) + 1
    slot_bytes = d // 2 + 8  # K and V codes, bf16 scale and zero of each
    kv = torch.randint(0, 256, (batch * nb + 1, page, hkv, slot_bytes), dtype=torch.uint8, device=dev,
                       generator=torch.Generator(device=dev).manual_seed(seed))
    kp, vp = layout.carve_pages(kv, d)
    for pages in (kp, vp):  # valid metadata (random bytes would make NaN and infinity scales)
        pages.scale.fill_(0.02)
        pages.zero.fill_(-0.03)
    table = torch.tensor([[1 + i * nb + j for j in range(nb)] for i in range(batch)], dtype=torch.int32)
    qsl, seq = list(range(batch + 1)), [ctx] * batch
    slots = torch.tensor([int(table[i, (ctx - 1) // page]) * page + (ctx - 1) % page for i in range(batch)])
    state = torch.zeros(rows + 1, 2, dtype=torch.int32, device=dev)
    state[:batch, 0] = s.recent  # the recent tier full, as after a long prefill
    st = build_step(torch.tensor(qsl, dtype=torch.int32, device=dev), qsl,
                    torch.tensor(seq, dtype=torch.int32, device=dev), seq, table.to(dev), slots.to(dev), batch,
                    list(range(batch)), state, s, torch.zeros(batch, dtype=torch.bool, device=dev))
    q = torch.randn(batch, hq, d, generator=gen).to(act).to(dev)
    k = torch.randn(batch, hkv, d, generator=gen).to(act).to(dev)
    v = torch.randn(batch, hkv, d, generator=gen).to(act).to(dev)
    out = torch.zeros(batch, hq, d, dtype=act, device=dev)

    def step() -> object:
        return layer.forward(q, k, v, kp, vp, st, out)

    return step


def time_graphs(steps: dict[str, list[Callable[[], object]]], layers: int, repeats: int) -> dict[str, list[float]]:
    """µs per forward for each replay of each variant's graph of ``layers`` forwards (cycling through the variant's
    distinct layers), the variants interleaved."""
    import torch

    from oscar_cli.bench.timing import capture_graph

    graphs = {}
    for name, fns in steps.items():
        g = capture_graph([fns[i % len(fns)] for i in range(layers)])
        g.replay()
        torch.cuda.synchronize()
        graphs[name] = g
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, g in graphs.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) * 1000.0 / layers)
    return times


def same_outputs(steps: dict[str, list[Callable[[], object]]]) -> dict[str, bool]:
    """Each variant's outputs, layer by layer, bitwise equal to the first variant's (the launch variants are the same
    arithmetic in other launches: their outputs must not differ in a bit)."""
    import torch

    def outs(fns: list[Callable[[], object]]) -> list[torch.Tensor]:
        return [torch.as_tensor(fn()).detach().clone() for fn in fns]

    names = list(steps)
    ref = outs(steps[names[0]])
    return {v: all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ref, outs(steps[v]),
                                                                                          strict=True))
            for v in names}


def time_wall(steps: dict[str, list[Callable[[], object]]], repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, fns in steps.items():
            t0 = time.perf_counter()
            for fn in fns:
                fn()
            times[name].append((time.perf_counter() - t0) * 1e6 / len(fns))
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad or not variants:
        raise SystemExit(f"--variants: expected some of {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton

    dev = "cpu" if args.smoke else "cuda"
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke on a CPU")
    ctxs = [64] if args.smoke else [tokens(c) for c in args.ctx.split(",")]
    rows: list[dict[str, Any]] = []
    for ctx in ctxs:
        n = 2 if args.smoke else max(1, min(args.distinct, args.layers))
        steps = {v: [build(v, ctx, args.batch, dev, args.smoke, seed=i) for i in range(n)] for v in variants}
        times = time_wall(steps, 2) if args.smoke else time_graphs(steps, args.layers, args.repeats)
        same = same_outputs(steps)
        for v in variants:
            us = statistics.median(times[v])
            rows.append({"variant": v, "ctx": ctx, "batch": args.batch, "us_per_layer": us,
                         "us_repeats": times[v], "ms_per_step_at_layers": us * args.layers / 1000.0,
                         "same_output_as_first": same[v]})
            print(f"{v:24s} batch {args.batch} ctx {ctx:7d}: {us:8.2f} µs per layer "
                  f"({us * args.layers / 1000.0:.3f} ms at {args.layers} layers)"
                  + ("" if same[v] else f"; OUTPUT DIFFERS from {variants[0]}'s"), flush=True)
    result = {"env": {"torch": torch.__version__, "triton": triton.__version__, "interpret": args.smoke,
                      "device": torch.cuda.get_device_name() if not args.smoke else "cpu"},
              "args": vars(args), "results": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
