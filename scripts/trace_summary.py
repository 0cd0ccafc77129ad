#!/usr/bin/env python3
"""Where a traced decode's GPU time goes: a summary of a torch-profiler (Chrome) trace.

    python3 scripts/trace_summary.py DIR_OR_TRACE [--steps N] [--top 25] [--out summary.json]

Reads every ``*.json`` / ``*.json.gz`` trace under DIR (vLLM's ``--stage profile`` writes one per worker) and reports,
over the GPU kernel events (``cat`` ``kernel``; memcpy/memset counted apart):

- kernels: count, summed duration, and per kernel name (top ``--top`` by summed time) count / total / mean;
- the GPU timeline: span from the first kernel's start to the last one's end, busy time (the union of kernel
  intervals) and idle time (span minus busy), with the idle gaps bucketed by length — many short gaps mean the
  GPU waits on launches (host-bound or eager launches), long gaps mean it waits on the host between steps;
- host launch calls: ``cudaLaunchKernel``-style calls versus ``cudaGraphLaunch`` (graph replays) by count;
- with ``--steps N`` (the traced decode steps): each of the above per step.

No GPU needed to run it; tests/test_trace_summary.py checks it on a synthetic trace.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

GAP_BUCKETS_US = (5.0, 20.0, 100.0, 1000.0)  # idle gaps < 5 us, < 20, < 100, < 1000, >= 1000


def load_events(path: Path) -> list[dict[str, Any]]:
    """Trace events of one trace file, or of every trace file under a directory."""
    files = sorted(p for p in path.rglob("*") if p.name.endswith((".json", ".json.gz"))) if path.is_dir() else [path]
    if not files:
        raise SystemExit(f"no *.json or *.json.gz trace under {path}")
    events: list[dict[str, Any]] = []
    for f in files:
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt") as fh:  # type: ignore[operator]
            doc = json.load(fh)
        events.extend(doc["traceEvents"] if isinstance(doc, dict) else doc)
    return events


def busy_and_gaps(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Union length of ``(start, end)`` intervals and the idle gaps between merged intervals (microseconds)."""
    busy, gaps = 0.0, []
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or cur_s is None:
            cur_s, cur_e = s, e
        elif s <= cur_e:
            cur_e = max(cur_e, e)
        else:
            busy += cur_e - cur_s
            gaps.append(s - cur_e)
            cur_s, cur_e = s, e
    if cur_e is not None and cur_s is not None:
        busy += cur_e - cur_s
    return busy, gaps


def summarize(events: list[dict[str, Any]], steps: int = 0, top: int = 25) -> dict[str, Any]:
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    copies = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"]
    if not kernels:
        raise SystemExit("the trace holds no GPU kernel events (was CUDA activity profiled?)")
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[str(e.get("name"))].append(float(e.get("dur", 0.0)))
    gpu = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in kernels + copies]
    span = max(b for _, b in gpu) - min(a for a, _ in gpu)
    busy, gaps = busy_and_gaps(gpu)
    buckets = {f"<{b:g}us": 0 for b in GAP_BUCKETS_US} | {f">={GAP_BUCKETS_US[-1]:g}us": 0}
    bucket_time = dict.fromkeys(buckets, 0.0)
    for g in gaps:
        key = next((f"<{b:g}us" for b in GAP_BUCKETS_US if g < b), f">={GAP_BUCKETS_US[-1]:g}us")
        buckets[key] += 1
        bucket_time[key] += g
    launches = defaultdict(int)
    for e in runtime:
        name = str(e.get("name", ""))
        if "GraphLaunch" in name:
            launches["graph_launch"] += 1
        elif "LaunchKernel" in name or "cuLaunch" in name:
            launches["kernel_launch"] += 1
    names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    kernel_us = sum(sum(v) for v in by_name.values())
    out: dict[str, Any] = {
        "kernels": len(kernels), "kernel_us": kernel_us, "copies": len(copies),
        "copy_us": sum(float(e.get("dur", 0.0)) for e in copies),
        "gpu_span_us": span, "gpu_busy_us": busy, "gpu_idle_us": span - busy,
        "idle_gaps": {k: {"count": buckets[k], "us": bucket_time[k]} for k in buckets},
        "host_launches": dict(launches),
        "top": [{"name": n[:120], "count": len(v), "total_us": sum(v), "mean_us": sum(v) / len(v),
                 "share": sum(v) / kernel_us if kernel_us else 0.0} for n, v in names[:top]],
    }
    if steps > 0:
        out["per_step"] = {"steps": steps, "kernels": len(kernels) / steps, "kernel_us": kernel_us / steps,
                           "gpu_span_us": span / steps, "gpu_busy_us": busy / steps,
                           "gpu_idle_us": (span - busy) / steps}
    return out


def render(s: dict[str, Any]) -> str:
    lines = [f"kernels {s['kernels']} ({s['kernel_us'] / 1e3:.2f} ms), copies {s['copies']} ({s['copy_us'] / 1e3:.2f} ms)",
             f"GPU span {s['gpu_span_us'] / 1e3:.2f} ms: busy {s['gpu_busy_us'] / 1e3:.2f} ms, "
             f"idle {s['gpu_idle_us'] / 1e3:.2f} ms",
             "idle gaps: " + ", ".join(f"{k} {v['count']} ({v['us'] / 1e3:.2f} ms)" for k, v in s["idle_gaps"].items()),
             f"host launches: {s['host_launches']}"]
    if "per_step" in s:
        p = s["per_step"]
        lines.append(f"per step ({p['steps']}): {p['kernels']:.0f} kernels, {p['kernel_us'] / 1e3:.3f} ms in kernels, "
                     f"span {p['gpu_span_us'] / 1e3:.3f} ms, idle {p['gpu_idle_us'] / 1e3:.3f} ms")
    lines.append(f"{'count':>7} {'total ms':>9} {'mean us':>8} {'share':>6}  kernel")
    lines += [f"{t['count']:7d} {t['total_us'] / 1e3:9.3f} {t['mean_us']:8.2f} {t['share']:6.1%}  {t['name']}"
              for t in s["top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a trace file or a directory holding traces")
    ap.add_argument("--steps", type=int, default=0, help="decode steps in the trace (for per-step figures)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, help="also write the summary as JSON")
    a = ap.parse_args(argv)
    s = summarize(load_events(a.trace), a.steps, a.top)
    print(render(s))
    if a.out:
        a.out.write_text(json.dumps(s, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
