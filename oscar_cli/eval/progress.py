"""Progress of a long evaluation, readable on a terminal and in logs.

On a terminal (and not under ``--json``) a rich bar counts samples and shows, inside a long batch, its
prefill chunks. Otherwise — CI, ``2> log``, ``--json`` — one line per finished batch goes to stderr
(``done/total``, elapsed, ETA), and inside a batch of :data:`LONG_BATCH_TOKENS`+ prompt tokens one line per
prefill chunk. The ETA weighs every sample by its length (prefill dominates the cost) and counts the time from
the start of the first batch it measures (setup and the first prompt building happen once); a first batch cut to one
sample to report early gives no ETA (one sample alone carries the one-time warm-up and is slower per sample than a
batch: on an H200 at 128K its extrapolation would be several times the run's) and is left out of the rate once the
next batch finished, whose line gives the first ETA and the estimate.

Chunk progress comes from a forward pre-hook on the model (each forward call is one prefill chunk or one
decode step), so the generation loop needs no callback.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LONG_BATCH_TOKENS = 65536


def fmt_seconds(s: float) -> str:
    """``42 s``, ``3 min 05 s``, ``2 h 10 min``, ``665 days``."""
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    if s < 172800:
        return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"
    return f"{s / 86400:.0f} days"


class RunProgress:
    """Counts finished samples of a run (weighted by length for the ETA) and reports them.

    Args:
        label: the command (``eval-ruler``).
        total: samples this run will evaluate (resumed ones excluded).
        total_weight: the sum of their lengths (tokens).
        bar: a rich ``Progress`` to draw on (terminal), or None for log lines.
    """

    def __init__(self, label: str, total: int, total_weight: int, bar: Any | None = None) -> None:
        self.label, self.total, self.total_weight = label, total, max(1, total_weight)
        self.done = self.done_weight = 0
        self.t0 = time.perf_counter()
        self.bar = bar
        self.task = bar.add_task(label, total=total) if bar is not None else None
        self.batches = 0
        # the ETA's rate: the time since `_since` over the weight finished since then
        self._since: float | None = None
        self._weight = 0
        self._last_end = self.t0
        self.provisional = False  # the rate so far is that of one sample run alone
        self.first_alone = False

    def _line(self, text: str) -> None:
        print(f"{self.label}: {text}", file=sys.stderr, flush=True)

    def eta(self) -> float | None:
        """Seconds left, from the length-weighted rate of the batches measured so far (None before the first)."""
        if self._since is None or not self._weight:
            return None
        rate = (time.perf_counter() - self._since) / self._weight
        return rate * (self.total_weight - self.done_weight)

    def batch_done(self, n: int, length: int, seconds: float, what: str, alone: bool = False) -> None:
        """``n`` samples of ``length`` tokens finished (the batch took ``seconds``); ``alone``: a sample cut from
        the first batch to report early, measured only until another batch finished."""
        now = time.perf_counter()
        self.done += n
        self.done_weight += n * length
        self.batches += 1
        if self.batches == 1:
            self.first_alone = alone
        if self._since is None:  # the first batch: its own time, not what came before it
            self._since, self._weight, self.provisional = now - seconds, n * length, alone
        elif self.provisional:  # drop the lone sample: from its end (building in between included)
            self._since, self._weight, self.provisional = self._last_end, n * length, False
        else:
            self._weight += n * length
        self._last_end = now
        eta = self.eta()
        elapsed = now - self.t0
        if self.bar is not None:
            self.bar.update(self.task, advance=n, description=f"{self.label} {what}")
            return
        if self.provisional:
            left = ", ETA after the next batch (a first sample run alone, one-time warm-up included)"
        else:
            left = f", ETA {fmt_seconds(eta)}" if eta is not None else ""
        left = left if self.done < self.total else ""
        self._line(
            f"{self.done}/{self.total} samples ({100 * self.done / max(1, self.total):.0f} %), "
            f"{fmt_seconds(elapsed)} elapsed{left} — {what}: {n} in {fmt_seconds(seconds)}"
        )
        # the estimate after the first batch, or after the next one when the first was a lone sample
        if self.done >= self.total or eta is None or self.provisional:
            return
        if self.batches == 1 or (self.batches == 2 and self.first_alone):
            self._line(f"estimate: about {fmt_seconds(eta)} more for the {self.total - self.done} samples left")

    def chunk(self, done_tokens: int, total_tokens: int, what: str) -> None:
        """Prefill progress inside one batch (``done_tokens`` of ``total_tokens`` prompt positions)."""
        if self.bar is not None:
            self.bar.update(self.task, description=f"{self.label} {what}: prefill {done_tokens}/{total_tokens}")
        elif total_tokens >= LONG_BATCH_TOKENS:
            self._line(f"{what}: prefill {done_tokens}/{total_tokens} tokens, {fmt_seconds(time.perf_counter() - self.t0)} elapsed")


@contextmanager
def chunk_progress(model: Any, report: RunProgress, prompt_tokens: int, what: str) -> Iterator[None]:
    """Report prefill chunks of one batch: a forward pre-hook counts the positions each call feeds.

    Calls after the prompt is consumed are decode steps and are not reported.
    """
    seen = 0

    def hook(_module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        nonlocal seen
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or seen >= prompt_tokens:
            return
        seen += int(ids.shape[-1])
        report.chunk(min(seen, prompt_tokens), prompt_tokens, what)

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
