"""Every example in every ``--help`` parses against the real options; those that run offline on a CPU run.

Commands are discovered from the app (a new command is covered once it is registered). An example is a line of a
command's help or epilog (the text ``--help`` prints) that starts with ``oscar`` after optional ``VAR=value``
assignments; a trailing ``\\`` joins the next line, ``# ...`` is a comment, ``> FILE`` / ``| ...`` end it.
Parsing goes through click's ``make_context`` with ``resilient_parsing=False`` for the root and then the
subcommand, so option names, arity, types, choices and callbacks are all checked (values a command checks in
its body, e.g. ``bench --kernel``, are checked only by the examples that run).

``RUNNABLE`` lists the examples that must run as written offline on a CPU, with their exit status; each runs in
a temporary working directory with a private ``OSCAR_CACHE_DIR`` and the Hub switched off. The ones on the
embedded model (``RUNNABLE_EMBEDDED``, ``slow``) use the default oscar cache, like the other tests that load it,
so the one GGUF conversion (~50 s on 2 cores) is shared with them and with ``make demo``.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer.main
from rich.text import Text

from oscar_cli.main import app, main

ROOT = typer.main.get_command(app)
_EXAMPLE = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)*oscar(?:\s|$)")


@dataclass(frozen=True)
class Example:
    command: str  # "oscar" for the root, else the subcommand whose --help shows it
    line: str  # as shown (continuations joined, comment dropped)
    env: tuple[tuple[str, str], ...]
    argv: tuple[str, ...]  # after "oscar"
    comment: str = ""


def _help_texts(cmd: object) -> str:
    parts = [getattr(cmd, "help", None) or "", getattr(cmd, "epilog", None) or ""]
    return "\n".join(Text.from_markup(p).plain for p in parts)


def parse_examples(command: str, text: str) -> list[Example]:
    """The example lines of one help text."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].rstrip() + " " + lines[i].strip()
        i += 1
        if not _EXAMPLE.match(line):
            continue
        tokens = shlex.split(line, comments=True)
        for stop in (">", ">>", "|", "&&", ";"):
            if stop in tokens:
                tokens = tokens[: tokens.index(stop)]
        env = []
        while tokens[0] != "oscar":
            key, _, value = tokens.pop(0).partition("=")
            env.append((key, value))
        comment = line.split(" # ", 1)[1].strip() if " # " in line else ""
        out.append(Example(command, shlex.join(tokens), tuple(env), tuple(tokens[1:]), comment))
    return out


def discover() -> list[Example]:
    found = parse_examples("oscar", _help_texts(ROOT))
    for name, cmd in sorted(ROOT.commands.items()):  # type: ignore[attr-defined]
        found += parse_examples(name, _help_texts(cmd))
    return found


EXAMPLES = discover()


def parse_example(argv: tuple[str, ...]) -> dict[str, object]:
    """Parse ``oscar ARGV`` as the CLI would, without running it; return the subcommand's parameters."""
    ctx = ROOT.make_context("oscar", list(argv), resilient_parsing=False)
    rest = [*getattr(ctx, "_protected_args", getattr(ctx, "protected_args", [])), *ctx.args]
    if not rest:
        return dict(ctx.params)
    name, cmd, args = ROOT.resolve_command(ctx, rest)  # type: ignore[attr-defined]
    assert cmd is not None, f"no command {name!r}"
    sub = cmd.make_context(name, args, parent=ctx, resilient_parsing=False)
    return dict(sub.params)


# --- the example finder itself ----------------------------------------------------------------------------


@pytest.mark.unit
def test_example_lines_are_found_joined_and_cut() -> None:
    text = """Examples

  oscar info x --ctx 4k          # a comment
  OSCAR_DEBUG=1 HF_HUB_OFFLINE=1 oscar info 'a b'
  oscar eval-ruler m --tasks t \\
      --ctx 1k   # joined
  oscar --json bench > bench.json
  Writes artifacts/<model>/... unless --out; oscar is not at the start here
  # oscar in a comment line
"""
    got = parse_examples("x", text)
    assert [e.argv for e in got] == [("info", "x", "--ctx", "4k"), ("info", "a b"),
                                     ("eval-ruler", "m", "--tasks", "t", "--ctx", "1k"), ("--json", "bench")]
    assert got[1].env == (("OSCAR_DEBUG", "1"), ("HF_HUB_OFFLINE", "1"))


@pytest.mark.unit
@pytest.mark.parametrize("argv", [("info", "--no-such-option"), ("info", "--ctx", "12q"), ("no-such-command",),
                                  ("info", "--dtype", "int3"), ("info", "a", "b")])
def test_a_bad_example_would_fail_to_parse(argv: tuple[str, ...]) -> None:
    from typer._click.exceptions import UsageError

    with pytest.raises(UsageError):
        parse_example(argv)


# --- every example parses -------------------------------------------------------------------------------


@pytest.mark.unit
def test_every_command_and_the_root_show_examples() -> None:
    shown = {e.command for e in EXAMPLES}
    assert shown == {"oscar", *ROOT.commands}, f"commands without examples: {set(ROOT.commands) - shown}"  # type: ignore[attr-defined]


@pytest.mark.unit
@pytest.mark.parametrize("example", EXAMPLES, ids=[f"{e.command}:{e.line}" for e in EXAMPLES])
def test_example_parses_against_the_real_options(example: Example, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsed in an empty directory: an option that needs an existing file may say so (the example names a file
    the user has), nothing else may fail."""
    from typer._click.exceptions import BadParameter, UsageError

    monkeypatch.chdir(tmp_path)
    if example.command != "oscar":  # an example shown under a command runs that command
        assert example.command in example.argv, f"{example.line!r} is shown under `oscar {example.command} --help`"
    try:
        parse_example(example.argv)
    except typer.Exit as exc:  # --version exits 0 while parsing
        assert exc.exit_code == 0
    except BadParameter as exc:
        if not re.fullmatch(r"(?i)Invalid value for [^:]+: (File|Directory|Path) '[^']+' does not exist\.",
                            exc.format_message()):
            pytest.fail(f"`{example.line}` (oscar {example.command} --help): {exc.format_message()}")
    except UsageError as exc:
        pytest.fail(f"`{example.line}` (oscar {example.command} --help): {exc.format_message()}")


@pytest.mark.unit
def test_help_numbers_match_what_the_command_does() -> None:
    """The defaults the calibrate help quotes: the embedded model's recipe budget and the artifact path shape."""
    from oscar_cli._options import parse_ctx
    from oscar_cli.recipe import load_recipe

    text = _help_texts(ROOT.commands["calibrate"])  # type: ignore[attr-defined]
    budget = re.search(r"oscar calibrate\s+# embedded smollm2-135m, its recipe: (\d+K) self-generated tokens "
                       r"\((\d) x (\d+)K\)", text)
    assert budget, text
    data = load_recipe("smollm2-135m").data
    assert parse_ctx(budget.group(1)) == data.tokens
    assert int(budget.group(2)) * parse_ctx(budget.group(3) + "k") == data.tokens
    assert parse_ctx(budget.group(3) + "k") == data.seq_len
    path = re.search(r"artifacts/smollm2-135m/(smollm2-135m-[0-9a-f]{8})\b", text)
    assert path and load_recipe("smollm2-135m").name == "smollm2-135m"
    ruler = _help_texts(ROOT.commands["eval-ruler"])  # type: ignore[attr-defined]
    assert "ruler-results/<model>" in ruler  # the default --out


@pytest.mark.unit
@pytest.mark.parametrize("command", ["calibrate", "eval-ruler"])
def test_the_examples_called_the_readme_demo_are_the_demo(command: str) -> None:
    demo = (Path(__file__).resolve().parent.parent / "scripts" / "demo.sh").read_text().replace("\\\n", " ")
    runs = [shlex.split(x, comments=True) for x in demo.splitlines() if x.startswith(f"oscar {command} ")]
    shown = [e for e in EXAMPLES if e.command == command and "README demo" in e.comment]
    assert len(runs) == 1 and len(shown) == 1
    demo_args = runs[0][1:]
    if command == "calibrate":  # the demo also names its --out and --overwrite; the budget is the point
        demo_args = demo_args[: demo_args.index("--out")]
    assert list(shown[0].argv) == demo_args


# --- the examples that run offline on a CPU -------------------------------------------------------------

# example line (as shown, without its comment) -> exit status it must end with
RUNNABLE: dict[str, int] = {
    "oscar --version": 0,
    "oscar info no/such-model": 1,  # OSCAR_DEBUG=1: the traceback, then the one-line error
    "oscar --json info no/such-model": 1,  # the error as JSON on stdout
    "oscar pull my-org/NAME@v0.1.0": 1,  # HF_HUB_OFFLINE=1 and nothing cached: a one-line error
}
RUNNABLE_EMBEDDED: dict[str, int] = {
    "oscar info": 0,
    "oscar --json info smollm2-135m": 0,
    "oscar info smollm2-135m --json -v": 0,
}
_BY_LINE = {e.line: e for e in EXAMPLES}


@pytest.mark.unit
def test_the_runnable_examples_are_shown_in_help() -> None:
    missing = [line for line in (*RUNNABLE, *RUNNABLE_EMBEDDED) if line not in _BY_LINE]
    assert missing == [], f"examples no longer in any --help: {missing}"


def _run(line: str, tmp_path: Path, cache: Path | None, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the example through the console entry point (``oscar_cli.main.main``); (exit status, stdout, stderr)."""
    from huggingface_hub import constants

    example = _BY_LINE[line]
    monkeypatch.chdir(tmp_path)
    if cache is not None:
        monkeypatch.setenv("OSCAR_CACHE_DIR", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.delenv("OSCAR_DEBUG", raising=False)
    for key, value in example.env:
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    code: object = 0
    try:
        main(list(example.argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return (code if isinstance(code, int) else 0 if code is None else 1), out, err


@pytest.mark.unit
@pytest.mark.parametrize("line", RUNNABLE)
def test_runnable_example_runs(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(line, tmp_path, tmp_path / "oscar-cache", monkeypatch, capsys)
    assert code == RUNNABLE[line], out + err
    if code:
        assert err.count("error: ") == 1 and "hint: " in err  # the one-line error (after any OSCAR_DEBUG traceback)
    if "--version" in line:
        assert out.startswith("oscar ")
    if "--json" in _BY_LINE[line].argv:
        assert set(json.loads(out)) == {"error"}


@pytest.mark.slow
@pytest.mark.parametrize("line", RUNNABLE_EMBEDDED)
def test_runnable_example_on_the_embedded_model_runs(line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("gguf")
    code, out, err = _run(line, tmp_path, None, monkeypatch, capsys)
    assert code == RUNNABLE_EMBEDDED[line], err
    if "--json" in _BY_LINE[line].argv:
        assert json.loads(out)["model"]["reference"] == "smollm2-135m"
    else:
        assert "smollm2-135m" in out and "BPE" in out
