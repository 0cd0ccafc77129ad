#!/usr/bin/env python3
"""Time of one reference-path decode step of an ``Int2Layer`` (store one token, return the dense K/V attention
reads) over stored histories of several lengths, on CPU.

    python3 scripts/cpu_reference_decode.py [--lengths 4096,16384] [--heads 2] [--head-dim 128] [--threads 1]
        [--steps 15] [--rounds 5]

Random bf16 keys/values, a random per-KV-head rotation with means and clip 0.9, the default sink/recent windows.
Per length: ``--rounds`` rounds of ``--steps`` timed steps (rounds interleaved over the lengths, so a busy machine
slows all alike); prints the fastest step and the median over rounds of each round's median, in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="4096,16384", help="stored tokens before the timed steps")
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from oscar_cli.quant import LayerTransform, oscar_method
    from oscar_cli.quant.int2_layer import Int2Layer

    h, d = args.heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(h, d, d, generator=g, dtype=torch.float64))
    t = LayerTransform(k_rotation=q.float(), k_mean=0.1 * torch.randn(h, d, generator=g),
                       v_mean=0.1 * torch.randn(h, d, generator=g), k_clip=0.9, v_clip=0.9)
    layers = {}
    for n in (int(x) for x in args.lengths.split(",")):
        layer = Int2Layer(oscar_method([t]), t, rotate_values=False)
        layer.update(*(torch.randn(1, h, n, d, generator=g).bfloat16() for _ in range(2)))
        layers[n] = layer
    one = torch.randn(1, h, 1, d, generator=g).bfloat16()
    times: dict[int, list[list[float]]] = {n: [] for n in layers}
    for _ in range(args.rounds):
        for n, layer in layers.items():
            ts = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                layer.update(one, one)
                ts.append(1e3 * (time.perf_counter() - t0))
            times[n].append(ts)
    res = {str(n): {"min_ms": round(min(min(r) for r in rs), 3),
                    "median_ms": round(statistics.median(statistics.median(r) for r in rs), 3)}
           for n, rs in times.items()}
    print(json.dumps({"heads": h, "head_dim": d, "threads": args.threads, "steps": res}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
