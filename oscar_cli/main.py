"""The ``oscar`` command: a Typer root with global options and the error funnel.

Commands live one per file in ``oscar_cli/commands/`` and register themselves through
:func:`oscar_cli.commands.register_all`.

The global options ``--json`` and ``-v``/``--verbose`` are accepted before or after the subcommand
(``oscar --json info`` = ``oscar info --json``): :class:`OscarGroup` moves them in front of it before parsing.
Errors: an :class:`OscarError` is one ``error:`` line plus a ``hint:`` line on stderr, exit 1 (``OSCAR_DEBUG=1``
adds the traceback); a usage error is click's message, exit 2. Under ``--json`` each error also writes one JSON
document ``{"error": {"type", "message", "hint"}}`` on stdout, so a pipeline always gets a document.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer import _click as click  # typer vendors click: its Context and exceptions are these
from typer.core import TyperGroup

from oscar_cli._output import SETTINGS, configure_logging, emit_error, stderr
from oscar_cli._version import __version__
from oscar_cli.errors import OscarError

_VERBOSE = re.compile(r"^(-v+|--verbose)$")


def hoist_global_options(args: list[str]) -> list[str]:
    """``args`` with every ``--json`` / ``-v`` / ``-vv`` / ``--verbose`` moved to the front (before the subcommand);
    nothing after ``--`` moves. Every root option is a flag, so the front is where the root parses them."""
    cut = args.index("--") if "--" in args else len(args)
    head, tail = args[:cut], args[cut:]
    hoisted = [a for a in head if a == "--json" or _VERBOSE.match(a)]
    return hoisted + [a for a in head if not (a == "--json" or _VERBOSE.match(a))] + tail


def _usage_hint(exc: click.ClickException) -> str:
    ctx = getattr(exc, "ctx", None)
    return f"see '{ctx.command_path} --help'" if ctx is not None else "see 'oscar --help'"


class OscarGroup(TyperGroup):
    """The root group: global options anywhere on the line; a JSON error document for usage errors under
    ``--json`` (the human message still goes to stderr, from Typer)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = hoist_global_options(list(args))
        SETTINGS.json = "--json" in args[: args.index("--") if "--" in args else len(args)]
        return super().parse_args(ctx, args)

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            self._json_usage_error(exc)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            self._json_usage_error(exc)
            raise

    @staticmethod
    def _json_usage_error(exc: click.ClickException) -> None:
        if SETTINGS.json and not getattr(exc, "_oscar_reported", False):
            exc._oscar_reported = True  # type: ignore[attr-defined]
            emit_error(type(exc).__name__, exc.format_message(), _usage_hint(exc))

EXAMPLES = """
[bold]Examples[/bold]

  oscar --version
  oscar info smollm2-135m                       # resolve + load the embedded model, print identity and BPE table
  oscar --json info smollm2-135m                # the same as JSON on stdout
  oscar info smollm2-135m --json -v             # --json and -v also work after the command
  oscar --json info no/such-model               # an error: one line on stderr, {"error": {...}} on stdout, exit 1
  OSCAR_DEBUG=1 oscar info no/such-model        # full traceback instead of the one-line error
"""

app = typer.Typer(
    name="oscar",
    cls=OscarGroup,
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
        bool,
        typer.Option("--json", help="Machine-readable results (JSON) on stdout, also for errors; no progress bars. "
                     "Also accepted after the subcommand."),
    ] = False,
    verbose: Annotated[
        int,
        typer.Option("--verbose", "-v", count=True, help="More logs on stderr (-vv: debug). Also accepted after the "
                     "subcommand."),
    ] = 0,
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
    """Print an OscarError as one line plus a hint on stderr (and as JSON on stdout under --json); return the
    exit code."""
    if os.environ.get("OSCAR_DEBUG") == "1":
        traceback.print_exception(exc)
    hint = exc.hint or "set OSCAR_DEBUG=1 for the full traceback"
    if SETTINGS.json:
        emit_error(type(exc).__name__, exc.message, hint)
    # Messages are plain text: escape them so "[@REV]" or a path with brackets is not read as rich markup.
    stderr.print(f"[bold red]error:[/bold red] {escape(exc.message)}", markup=True, highlight=False)
    stderr.print(f"[dim]hint:[/dim] {escape(hint)}", markup=True, highlight=False)
    return exc.exit_code


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, funnel OscarError into one line + hint, exit 1."""
    try:
        app(args=argv, prog_name="oscar", standalone_mode=True)
    except OscarError as exc:
        sys.exit(report_error(exc))
    except KeyboardInterrupt:
        stderr.print("[bold red]interrupted[/bold red]")
        sys.exit(130)
    except Exception as exc:  # a bug: the traceback follows; a --json pipeline still gets its document
        if SETTINGS.json:
            emit_error(type(exc).__name__, str(exc) or type(exc).__name__,
                       "an unexpected error inside oscar: please report it with the traceback")
        raise
