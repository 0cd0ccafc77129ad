"""Where output goes: results on stdout (a table or JSON), logs and progress on stderr.

Progress bars are drawn only when stderr is a terminal and ``--json`` is off. Otherwise (CI, ``2> log``,
``--json``) a command that asks for it (``progress(log="calibrate")``) gets progress as lines on stderr instead:
:class:`LogLines`, one line when a phase finishes and at most one every :data:`LogLines.EVERY_S` seconds in
between, with the count, the time elapsed and an estimate of the time left.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@dataclass
class OutputSettings:
    """Global output mode, set once by the CLI root callback."""

    json: bool = False
    verbose: int = 0


SETTINGS = OutputSettings()

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def configure_logging(verbose: int) -> None:
    """Send library logs (``logging.getLogger("oscar_cli...")``) to stderr through rich."""
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    handler = RichHandler(console=stderr, show_path=False, show_time=verbose > 1, markup=False)
    root = logging.getLogger("oscar_cli")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
    kroot = logging.getLogger("oscar_kernels")
    kroot.handlers[:] = [handler]
    kroot.setLevel(level)


def progress_enabled() -> bool:
    """True when progress bars should be drawn (stderr is a TTY and --json is off)."""
    return (not SETTINGS.json) and sys.stderr.isatty()


@dataclass
class _LineTask:
    description: str
    total: float | None
    start: float
    completed: float = 0.0
    last_line: float = 0.0
    finished: bool = False


class LogLines:
    """The subset of rich's ``Progress`` that commands use (``add_task``, ``update``, ``advance``), as lines on
    stderr for logs: ``LABEL: DESCRIPTION DONE/TOTAL, ELAPSED elapsed, about LEFT left`` when a task finishes and
    at most every :data:`EVERY_S` seconds before (the time left from the task's average rate so far)."""

    EVERY_S = 15.0

    def __init__(self, label: str, clock: Callable[[], float] | None = None) -> None:
        import time

        self.label = label
        self.clock = clock or time.perf_counter
        self.tasks: list[_LineTask] = []

    def add_task(self, description: str, total: float | None = None, **_: Any) -> TaskID:
        now = self.clock()
        self.tasks.append(_LineTask(description, total, now, last_line=now))
        return TaskID(len(self.tasks) - 1)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        self.update(task_id, advance=advance)

    def update(self, task_id: TaskID, *, completed: float | None = None, total: float | None = None,
               advance: float | None = None, description: str | None = None, **_: Any) -> None:
        t = self.tasks[task_id]
        if total is not None:
            t.total = total
        if description is not None:
            t.description = description
        if completed is not None:
            t.completed = completed
        if advance is not None:
            t.completed += advance
        now = self.clock()
        done = t.total is not None and t.completed >= t.total
        if t.finished or not (done or now - t.last_line >= self.EVERY_S):
            return
        t.last_line, t.finished = now, done
        from oscar_cli.eval.progress import fmt_seconds

        elapsed = now - t.start
        count = f"{t.completed:g}/{t.total:g}" if t.total is not None else f"{t.completed:g}"
        left = ""
        if not done and t.total and t.completed > 0:
            left = f", about {fmt_seconds(elapsed * (t.total - t.completed) / t.completed)} left"
        print(f"{self.label}: {t.description} {count}, {fmt_seconds(elapsed)} elapsed{left}", file=sys.stderr,
              flush=True)


@contextmanager
def progress(log: str | None = None) -> Iterator[Progress | LogLines]:
    """A rich Progress on stderr when it is a terminal and ``--json`` is off; otherwise :class:`LogLines` labelled
    ``log`` when given (progress in logs), else a disabled Progress (no output: the caller reports its own way).

    Usage::

        with progress(log="calibrate") as p:
            task = p.add_task("capture", total=n)
            p.advance(task)
    """
    if log is not None and not progress_enabled():
        yield LogLines(log)
        return
    p = Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        disable=not progress_enabled(),
        transient=False,
    )
    with p:
        yield p


def emit_json(obj: Any) -> None:
    """Write one JSON document to stdout (the machine-readable result of a command)."""
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")
    sys.stdout.flush()


def emit_error(kind: str, message: str, hint: str | None) -> None:
    """The JSON document of a failed command (under ``--json``): ``{"error": {"type", "message", "hint"}}``."""
    emit_json({"error": {"type": kind, "message": message, "hint": hint}})


def emit(result: Any, render: Callable[[Any], None]) -> None:
    """A command's result: one JSON document under ``--json``, else ``render(result)`` for people."""
    if SETTINGS.json:
        emit_json(result)
    else:
        render(result)


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__fspath__"):
        return str(o)
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def info(message: str) -> None:
    """A human status line on stderr (suppressed under --json)."""
    if not SETTINGS.json:
        stderr.print(message)
