"""Opt-in step diagnostics of the INT2 backend in vLLM (no vLLM import; off unless an environment variable is set).

- ``OSCAR_VLLM_DEBUG_STEPS=1``: one log line per metadata build (requests, decodes, prefill chunks, tokens, longest
  sequence, build time; the build reads the block table back from the GPU, so its time includes waiting for the
  previous step) and one per forward of the first attention layer (decode / prefill split, time to completion:
  the forward is synchronized, so this slows the engine down). Forwards inside a CUDA-graph capture are not timed.
- ``OSCAR_VLLM_PDL=0``: the decode kernels launch without programmatic dependent launches (an A/B switch for a
  stall inside the decode's CUDA graph; ``1`` forces them on; unset: the measured default).
- ``OSCAR_VLLM_TORCH_ROTATE=1``: the K/V rotation of every batch runs in torch (a cuBLAS float32 GEMM per tensor,
  as before the Triton rotation), not only of batches above ``core.ROTATE_TRITON_MAX_ROWS`` tokens (an A/B switch
  for the rotation's cost and rounding; ``0`` or unset: the Triton kernel up to that size).
- ``OSCAR_VLLM_FUSED_WRITE=0``: a step's key pages, value pages and BF16 tiers of a layer are written by three
  launches instead of one (``ops.write_step``, the same bytes; an A/B switch for the decode step's fixed cost; ``1``
  or unset: one launch, the measured default: docs/VLLM.md).
- ``OSCAR_VLLM_FUSED_GATHER=0``: the decode's query rotation runs in its own launch instead of the tier gather's,
  so the decode plan makes three launches instead of two (the same bits; an A/B switch; ``1`` or unset: in the
  gather's launch, the measured default: docs/VLLM.md).
- ``OSCAR_VLLM_DIRECT_TIERS=1``: no tier gather in any decode step: stage 1 reads the sink and ring rows where the
  layer keeps them (``ops.TierIndex``, the same centring and order, so the same bits) and the query rotation runs
  in the K/V rotation's launch: four launches per layer and decode step instead of five (takes precedence over
  ``OSCAR_VLLM_FUSED_GATHER``). ``0``: the gather in every step. Unset: by the step's batch, in place from
  ``core.DIRECT_TIERS_FROM_BATCH`` (8) decode requests on (on an H100 the fused gather measured faster up to 4-6
  requests, reading in place from 8: docs/VLLM.md, "the crossing by batch").
- ``OSCAR_VLLM_WARMUP=0``: no engine-start compile of the eager steps' kernels (``warmup.warm_once``); a request
  that is the first of its token-count class then compiles inside its TTFT (``1`` or unset: the warm-up runs).
- ``OSCAR_VLLM_STACKS_EVERY=N``: every N seconds, Python's :mod:`faulthandler` writes the stack of every thread of
  every vLLM process that loaded the plugin to stderr: a stalled engine shows where it waits.

All are inherited by vLLM's engine-core process (set them before the engine starts).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

STEPS_ENV = "OSCAR_VLLM_DEBUG_STEPS"
STACKS_ENV = "OSCAR_VLLM_STACKS_EVERY"
_log = logging.getLogger("oscar_cli.vllm")
_stacks_armed = False


PDL_ENV = "OSCAR_VLLM_PDL"


def switch(env: str) -> bool | None:
    """An A/B switch's value: ``1`` True, ``0`` False, unset or empty None; anything else is refused in one line."""
    raw = os.environ.get(env, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{env}: expected 0 or 1, got {raw!r}")
    return None if raw == "" else raw == "1"


def pdl_override() -> bool | None:
    return switch(PDL_ENV)


TORCH_ROTATE_ENV = "OSCAR_VLLM_TORCH_ROTATE"
FUSED_WRITE_ENV = "OSCAR_VLLM_FUSED_WRITE"
FUSED_GATHER_ENV = "OSCAR_VLLM_FUSED_GATHER"
DIRECT_TIERS_ENV = "OSCAR_VLLM_DIRECT_TIERS"
WARMUP_ENV = "OSCAR_VLLM_WARMUP"


def torch_rotate_forced() -> bool:
    return switch(TORCH_ROTATE_ENV) is True


def fused_write() -> bool:
    return switch(FUSED_WRITE_ENV) is not False


def fused_gather() -> bool:
    return switch(FUSED_GATHER_ENV) is not False


def direct_tiers() -> bool | None:
    """True: every decode step reads the tiers in place; False: none does; None (unset): by the step's batch
    (``core.direct_tiers_for``)."""
    return switch(DIRECT_TIERS_ENV)


def warmup_enabled() -> bool:
    return switch(WARMUP_ENV) is not False


def steps_enabled() -> bool:
    return os.environ.get(STEPS_ENV) == "1"


def arm_stack_dumps() -> float | None:
    """Start periodic stack dumps when ``OSCAR_VLLM_STACKS_EVERY`` is a positive number of seconds (once per
    process); returns the period, or None when off. A malformed value is refused in one line."""
    global _stacks_armed
    raw = os.environ.get(STACKS_ENV, "").strip()
    if not raw:
        return None
    try:
        every = float(raw)
    except ValueError:
        raise ValueError(f"{STACKS_ENV}: expected seconds (e.g. 60), got {raw!r}") from None
    if every <= 0:
        return None
    if not _stacks_armed:
        faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)
        _stacks_armed = True
    return every


class StepLog:
    """Counts steps and writes the per-step lines of ``OSCAR_VLLM_DEBUG_STEPS`` (a no-op object when it is off)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = steps_enabled() if enabled is None else enabled
        self.step = 0
        self.lines: list[str] = []  # the latest lines (tests read them; bounded)

    def _emit(self, line: str) -> None:
        _log.warning("%s", line)  # vLLM shows warnings of any logger; info of foreign loggers may be dropped
        self.lines = [*self.lines[-63:], line]

    def note(self, line: str) -> None:
        if self.enabled:
            self._emit(line)

    def build(self, t0: float, num_reqs: int, num_decodes: int, num_prefills: int, num_tokens: int,
              max_seq: int, capture: bool) -> None:
        if not self.enabled:
            return
        self.step += 1
        kind = "capture" if capture else "step"
        self._emit(f"oscar {kind} {self.step}: {num_reqs} requests ({num_decodes} decodes, {num_prefills} prefill "
                   f"chunks), {num_tokens} tokens, longest {max_seq}; build {1e3 * (time.perf_counter() - t0):.1f} ms")

    def forward(self, fn: Callable[[], Any], num_decodes: int, num_prefills: int, device: torch.device) -> Any:
        """Run ``fn`` (one layer's forward); when enabled and not capturing a CUDA graph, synchronize and log its
        time."""
        cuda = device.type == "cuda"
        if not self.enabled or (cuda and torch.cuda.is_current_stream_capturing()):
            return fn()
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
        self._emit(f"oscar step {self.step} layer 0 forward: {num_decodes} decodes, {num_prefills} prefill chunks, "
                   f"{1e3 * (time.perf_counter() - t0):.1f} ms")
        return out


STEPS = StepLog()  # shared by the metadata builder and the impls of this process
