"""Where output goes: results on stdout (a table or JSON), logs and progress on stderr.

Progress bars are shown only when stderr is a terminal, and never with ``--json``.
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


@contextmanager
def progress() -> Iterator[Progress]:
    """A rich Progress on stderr; disabled (no output) when not a TTY or under --json.

    Usage::

        with progress() as p:
            task = p.add_task("capture", total=n)
            p.advance(task)
    """
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
