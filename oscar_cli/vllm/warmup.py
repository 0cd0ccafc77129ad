"""Compile the backend's eager (prefill and mixed) step kernels at engine start, not in a user's first request.

vLLM warms what it runs itself: its profiling forward (attention metadata None: the backend returns at once) and the
CUDA graphs of one-token decode batches. A step with a prefill chunk runs eagerly, and its Triton launches are
compiled per variant on first use: ``ops.rotate_kv`` takes 16-row tiles up to 64 tokens and 32-row tiles above,
quantize-on-write sizes its tiles from the token count below 16, and Triton compiles one variant per value class of
each integer argument (1, a multiple of 16, other). A request whose step is the first of
a new class pays the compile inside its TTFT. Measured on an H100 (2026-12-08, vLLM 0.25.0, 64-token pages, the
bench's own warm-up having run a 64-token and a 16,448-token prompt): a 4,096-token prompt's first request took
1.61-2.23 s to its only token against 0.11 s for vLLM's BF16, while the same prompt's next request generated 257
tokens in 1.96 s in all. vLLM's JIT monitor warns once per kernel name, so that compile was silent.

:func:`warm_up` runs :data:`WARM_STEPS` through a two-row copy of the layer (the same transforms, settings, kernels
and activation dtype; its own BF16 tiers and scratch pages, so no state of the served layer is touched): pure
prefill chunks and prefill chunks mixed with decodes whose token counts cover those classes on both sides of the
16/32-row tile switch and of the torch rotation above ``core.ROTATE_TRITON_MAX_ROWS``, with and without an INT2
history. :func:`warm_once` does it once per process and layer format, from the backend's profiling forward.
``OSCAR_VLLM_WARMUP=0`` skips it (a value other than 0 or 1 is refused in one line).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from oscar_cli.vllm import layout, spec
from oscar_cli.vllm.core import Attend, PagedInt2Layer, build_step
from oscar_cli.vllm.debug import WARMUP_ENV, warmup_enabled

_log = logging.getLogger("oscar_cli.vllm")

# One engine step per entry: (sequence, tokens) with decodes (1 token of a sequence whose prompt is done) first, as
# vLLM orders a batch. Sequences A and B hold rows 0 and 1; C takes row 0 after A's last step. The comments give
# each step's token count n (the rotation's rows) and its class: 16- or 32-row tiles, n and the tile count a
# multiple of 16 or not.
Script = tuple[tuple[tuple[str, int], ...], ...]
WARM_STEPS: Script = (
    (("A", 512),),                # n 512: 32-row tiles, n and 16 tiles multiples of 16; no history yet
    (("A", 97),),                 # n 97: 4 tiles; history 512 - sink
    (("A", 48),),                 # n 48: 16-row tiles, n a multiple of 16
    (("A", 1), ("B", 500)),       # mixed, n 501: 16 tiles, n other
    (("A", 1), ("B", 79)),        # mixed, n 80; B's history
    (("A", 1), ("B", 17)),        # mixed, n 18: 16-row tiles, n other
    (("A", 1), ("B", 1)),         # two decodes, eager
    (("C", 80),),                 # n 80: 32-row tiles, 3 tiles
    (("C", 4100),),               # n 4,100: above ROTATE_TRITON_MAX_ROWS (torch rotation), n other; history
    (("C", 33),),                 # n 33: 16-row tiles, n other
    (("C", 500),),                # n 500: 32-row tiles, 16 tiles, n other
)
ROWS = {"A": 0, "B": 1, "C": 0}


def prompts(steps: Script) -> dict[str, int]:
    """Each sequence's prompt: the sum of its chunks (an entry of 1 token is a decode: vLLM counts a one-token
    request as one, and a script's decodes come after the sequence's chunks)."""
    out: dict[str, int] = {}
    for step in steps:
        for name, n in step:
            out[name] = out.get(name, 0) + (n if n > 1 else 0)
    return out


_warmed: set[tuple[object, ...]] = set()


@dataclass
class WarmReport:
    steps: int = 0
    seconds: float = 0.0
    skipped: str | None = None
    token_counts: list[int] = field(default_factory=list)


def _blocks(steps: Script, block_size: int) -> dict[str, list[int]]:
    """Each sequence's pages: its own run of block ids from 1 (vLLM's block 0 is the null block)."""
    out: dict[str, list[int]] = {}
    nxt = 1
    for name in prompts(steps):
        total = sum(n for step in steps for s, n in step if s == name)
        pages = -(-total // block_size)
        out[name] = list(range(nxt, nxt + pages))
        nxt += pages
    return out


def warm_up(make_layer: Callable[[int], PagedInt2Layer], attend: Attend, steps: Script = WARM_STEPS,
            seed: int = 0) -> WarmReport:
    """Run ``steps`` (:data:`WARM_STEPS`) through ``make_layer(2)`` (a copy of the served layer with 2 rows of BF16
    tiers; sequences on :data:`ROWS`) on scratch pages of its format; returns what ran. Random activations: no
    kernel variant depends on the values."""
    t0 = time.perf_counter()
    layer = make_layer(2)
    dev, d, h_q, h_kv, p = layer.sink_k.device, layer.d, layer.h_q, layer.h_kv, layer.block_size
    blocks, total = _blocks(steps, p), prompts(steps)
    n_blocks = 1 + sum(len(b) for b in blocks.values())
    slot = spec.slot_bytes(d, layer.s.meta_bytes, layer.key_bits)
    kv = torch.zeros(n_blocks, p, h_kv, slot, dtype=torch.uint8, device=dev)
    k_pages, v_pages = layout.carve_pages(kv, d, layer.s.meta_dtype, layer.key_bits)
    k_low = layout.carve_low_plane(kv, d, layer.s.meta_dtype) if layer.key_bits == 4 else None
    state = torch.zeros(3, 2, dtype=torch.int32, device=dev)  # rows 0, 1 and the scratch row
    width = max(len(b) for b in blocks.values())
    done = {name: 0 for name in blocks}
    g = torch.Generator(device="cpu").manual_seed(seed)
    rep = WarmReport()
    for step in steps:
        qsl, seq, table, slots, rows, prefilling = [0], [], [], [], [], []
        for name, n in step:
            a = done[name]
            qsl.append(qsl[-1] + n)
            seq.append(a + n)
            table.append(blocks[name] + [0] * (width - len(blocks[name])))
            slots += [blocks[name][pos // p] * p + pos % p for pos in range(a, a + n)]
            rows.append(ROWS[name])
            prefilling.append(a < total[name])
        n_tok = qsl[-1]
        q = torch.randn(n_tok, h_q, d, generator=g).to(dev, layer.act)
        k = torch.randn(n_tok, h_kv, d, generator=g).to(dev, layer.act)
        v = torch.randn(n_tok, h_kv, d, generator=g).to(dev, layer.act)
        st = build_step(torch.tensor(qsl, dtype=torch.int32, device=dev), qsl,
                        torch.tensor(seq, dtype=torch.int32, device=dev), seq,
                        torch.tensor(table, dtype=torch.int32, device=dev),
                        torch.tensor(slots, dtype=torch.int64, device=dev), n_tok, rows, state, layer.s,
                        torch.tensor(prefilling))
        out = torch.empty(n_tok, h_q, d, dtype=layer.act, device=dev)
        layer.forward(q, k, v, k_pages, v_pages, st, out, attend=attend, k_low=k_low)
        for name, n in step:
            done[name] += n
        rep.steps += 1
        rep.token_counts.append(n_tok)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    rep.seconds = time.perf_counter() - t0
    return rep


def warm_once(key: tuple[object, ...], make_layer: Callable[[int], PagedInt2Layer], attend: Attend,
              device: torch.device, label: str = "") -> WarmReport:
    """:func:`warm_up` once per process and ``key`` (the layer's format: every layer of one format launches the same
    kernel variants), on CUDA outside a graph capture, unless ``OSCAR_VLLM_WARMUP=0``; logs one line."""
    if not warmup_enabled():
        return WarmReport(skipped=f"{WARMUP_ENV}=0")
    if device.type != "cuda":
        return WarmReport(skipped="not on CUDA (nothing to compile)")
    if torch.cuda.is_current_stream_capturing():
        return WarmReport(skipped="inside a CUDA graph capture")
    if key in _warmed:
        return WarmReport(skipped="already warmed in this process")
    rep = warm_up(make_layer, attend)
    _warmed.add(key)
    _log.warning("oscar: warmed the INT2 backend's prefill-step kernels%s in %.1f s (%d steps of %s tokens; "
                 "%s=0 skips this)", f" ({label})" if label else "", rep.seconds, rep.steps,
                 "/".join(map(str, rep.token_counts)), WARMUP_ENV)
    return rep
