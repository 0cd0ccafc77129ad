"""Every allocation and free of a block of torch code, on any device, and the live-bytes peak of named phases.

:class:`AllocationTrace` runs the block under ``torch.profiler.profile(profile_memory=True)``: PyTorch's allocators
(the CPU one included, which ``torch.cuda.max_memory_allocated`` has no counterpart for) report each allocation
and free with its size and a nanosecond timestamp. Replaying them in order gives the bytes live at every moment,
counted from the start of the trace (tensors that existed before it count 0; freeing one counts negative).
Phases are ``torch.profiler.record_function`` ranges (:meth:`AllocationTrace.phase`, or
:func:`phase_hooks` around a module's forward); :meth:`AllocationTrace.phases` gives, per occurrence, the live
bytes at its start, the peak inside it and the bytes it leaves behind.

Used by ``scripts/cpu_cache_memory.py`` (where the cache's peak comes from) and the tests bounding it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

MEMORY_EVENT = "[memory]"


@dataclass(frozen=True)
class PhaseMemory:
    """Live bytes around one occurrence of a phase (relative to the start of the trace)."""

    name: str
    start: int  # live at its start
    peak: int  # highest live inside it
    end: int  # live when it returns

    @property
    def transient(self) -> int:
        """Peak above what was live when it started: the scratch it needed."""
        return self.peak - self.start

    @property
    def retained(self) -> int:
        """What it left allocated."""
        return self.end - self.start


class AllocationTrace:
    """Record the allocations of a ``with`` block (see the module docstring).

    Args:
        device: only allocations on this device type count (``"cpu"``, ``"cuda"``).
    """

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device).type
        self._prof: Any = None
        self._times: list[int] = []
        self._live: list[int] = []  # live bytes just after each event
        self._ranges: list[tuple[str, int, int]] = []

    def __enter__(self) -> AllocationTrace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        self._prof = profile(activities=acts, profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        mem, ranges = [], []
        for e in events:
            if e.name() == MEMORY_EVENT:
                if _device_type(e) == self.device:
                    mem.append((int(e.start_ns()), int(e.nbytes())))
            else:
                ranges.append((e.name(), int(e.start_ns()), int(e.start_ns() + e.duration_ns())))
        mem.sort(key=lambda m: m[0])
        live = 0
        for t, n in mem:
            live += n
            self._times.append(t)
            self._live.append(live)
        self._ranges = sorted(ranges, key=lambda r: r[1])

    @staticmethod
    def phase(name: str) -> AbstractContextManager[Any]:
        """Mark the code inside as one occurrence of phase ``name``."""
        return torch.profiler.record_function(name)

    def live_at(self, t: int) -> int:
        """Bytes live just after the last event at or before ``t`` (ns)."""
        i = bisect.bisect_right(self._times, t)
        return self._live[i - 1] if i else 0

    def peak(self) -> int:
        """The highest live bytes over the whole trace."""
        return max(self._live, default=0)

    def phases(self, name: str) -> list[PhaseMemory]:
        """Every occurrence of phase ``name``, in order."""
        out = []
        for n, t0, t1 in self._ranges:
            if n != name:
                continue
            i, j = bisect.bisect_left(self._times, t0), bisect.bisect_right(self._times, t1)
            start, end = self.live_at(t0 - 1), self.live_at(t1)
            out.append(PhaseMemory(name, start, max([start, *self._live[i:j]]), end))
        return out


def _device_type(event: Any) -> str:
    kind = str(event.device_type()).rsplit(".", 1)[-1].lower()
    return kind


@contextmanager
def phase_hooks(module: torch.nn.Module, name: str) -> Iterator[None]:
    """Mark every forward of ``module`` as an occurrence of phase ``name`` while the block runs."""
    stack: list[Any] = []

    def enter(*_: Any) -> None:
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        stack.append(rf)

    def leave(*_: Any) -> None:
        stack.pop().__exit__(None, None, None)

    handles = [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
