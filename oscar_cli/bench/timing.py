"""How ``oscar bench`` times a launch: medians of ``triton.testing.do_bench`` (eager, after warm-up) and of CUDA-graph
replays, over rotating input copies that exceed the L2 cache (cold-L2 timing), and the copy bandwidth they are
compared with."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

log = logging.getLogger(__name__)


def median_us(fn: Callable[[], Any], rep_ms: int = 100) -> float:
    """Median time of ``fn`` in µs (``triton.testing.do_bench``, 25 ms warm-up)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")) * 1e3


def capture_graph(fns: Sequence[Callable[..., Any]]) -> torch.cuda.CUDAGraph:
    """``fns`` captured back to back in one CUDA graph, after one warm run of them on a side stream (compiles and
    allocator / cuBLAS workspaces outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    return graph


def graph_us(fns: Sequence[Callable[..., Any]], rep_ms: int = 100) -> float | None:
    """Median µs per call of ``fns`` captured back to back in one CUDA graph (None if capture fails)."""
    try:
        return median_us(capture_graph(fns).replay, rep_ms) / len(fns)
    except RuntimeError as exc:
        log.info("graph capture failed: %s", exc)
        torch.cuda.synchronize()
        return None


def rotating(make: Callable[[int], Any], bytes_each: int, l2_bytes: int, most: int = 64) -> list[Any]:
    """Enough independent copies of an input set to exceed 4x the L2 cache (at least 1)."""
    n = max(1, min(most, math.ceil(4 * l2_bytes / max(bytes_each, 1))))
    return [make(i) for i in range(n)]


def graph_over(items: list[Any], call: Callable[[Any], Any], rep_ms: int = 100) -> float | None:
    """:func:`graph_us` of ``call(item)`` for every rotating input set, back to back in one graph (a single set is
    captured four times, so one replay is never a single launch)."""
    return graph_us([partial(call, t) for t in (items if len(items) > 1 else items * 4)], rep_ms)


def cycle(items: list[Any], call: Callable[[Any], Any]) -> Callable[[], Any]:
    """A no-argument function calling ``call`` on the next of ``items`` each time (eager timing over rotating sets)."""
    state = {"i": 0}

    def fn() -> Any:
        state["i"] = (state["i"] + 1) % len(items)
        return call(items[state["i"]])

    return fn


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9
