"""The ``oscar`` command: a Typer root with global options and the error funnel.

Commands live one per file in ``oscar_cli/commands/`` and register themselves through
:func:`oscar_cli.commands.register_all`.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Annotated

import typer
from rich.markup import escape

from oscar_cli import __version__
from oscar_cli._output import SETTINGS, configure_logging, stderr
from oscar_cli.errors import OscarError

EXAMPLES = """
[bold]Examples[/bold]

  oscar --version
  oscar info smollm2-135m                       # resolve + load the embedded model, print identity and BPE table
  oscar --json info smollm2-135m                # the same as JSON on stdout
  OSCAR_DEBUG=1 oscar info no/such-model        # full traceback instead of the one-line error
"""

app = typer.Typer(
    name="oscar",
    help="oscar: accurate and fast 2-bit (INT2) KV caches for long-context LLM serving.",
    epilog=EXAMPLES,
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _version_callback(value: bool | None) -> None:
    if value:
        typer.echo(f"oscar {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version and exit."),
    ] = None,
    json_out: Annotated[
        bool, typer.Option("--json", help="Machine-readable results (JSON) on stdout; no progress bars.")
    ] = False,
    verbose: Annotated[int, typer.Option("--verbose", "-v", count=True, help="More logs on stderr (-vv: debug).")] = 0,
) -> None:
    """oscar: accurate and fast 2-bit (INT2) KV caches for long-context LLM serving."""
    SETTINGS.json = json_out
    SETTINGS.verbose = verbose
    configure_logging(verbose)


def _register() -> None:
    from oscar_cli.commands import register_all

    register_all(app)


_register()


def report_error(exc: OscarError) -> int:
    """Print an OscarError as one line plus a hint on stderr; return the exit code."""
    if os.environ.get("OSCAR_DEBUG") == "1":
        traceback.print_exception(exc)
    # Messages are plain text: escape them so "[@REV]" or a path with brackets is not read as rich markup.
    stderr.print(f"[bold red]error:[/bold red] {escape(exc.message)}", markup=True, highlight=False)
    hint = exc.hint or "set OSCAR_DEBUG=1 for the full traceback"
    stderr.print(f"[dim]hint:[/dim] {escape(hint)}", markup=True, highlight=False)
    return exc.exit_code


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, funnel OscarError into one line + hint, exit 1."""
    try:
        app(args=argv, standalone_mode=True)
    except OscarError as exc:
        sys.exit(report_error(exc))
    except KeyboardInterrupt:
        stderr.print("[bold red]interrupted[/bold red]")
        sys.exit(130)
