"""CLI commands, one module each. Each module defines ``register(app)`` adding its command(s).

To add a command: create ``oscar_cli/commands/<name>.py`` with ``register(app: typer.Typer)`` and add the
module name to ``COMMANDS`` below (one line; keep the list sorted).
"""

from __future__ import annotations

import importlib

import typer

COMMANDS: list[str] = [
    "bench",
    "calibrate",
    "eval_kl",
    "eval_ruler",
    "export",
    "generate",
    "info",
    "pull",
]


def register_all(app: typer.Typer) -> None:
    """Import each command module and let it register itself on ``app``."""
    for name in COMMANDS:
        module = importlib.import_module(f"oscar_cli.commands.{name}")
        module.register(app)
