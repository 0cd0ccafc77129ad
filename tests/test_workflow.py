"""The example publishing workflow (.github/workflows/publish-artifact.yml) only uses commands and options the
CLI really has, and handles the Hub token the safe way.

Every ``oscar ...`` invocation in a ``run:`` script is parsed by the real Click command tree
(``typer.main.get_command(app)``): an unknown command, an unknown option or a missing required argument fails
here, not in somebody's CI.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from oscar_cli.main import app

pytestmark = pytest.mark.unit

WORKFLOW = Path(__file__).resolve().parents[1] / ".github" / "workflows" / "publish-artifact.yml"
_SEPARATORS = {"&&", "||", "|", ";", "&"}
_REDIRECTS = {">", ">>", "<", ">&", "<&"}


def _load() -> dict[str, Any]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    if True in doc:  # YAML 1.1 reads the key `on` as the boolean True
        doc["on"] = doc.pop(True)
    return doc


def _steps() -> list[dict[str, Any]]:
    return [step for job in _load()["jobs"].values() for step in job["steps"]]


def shell_commands(script: str) -> list[list[str]]:
    """Split a ``run:`` script into simple commands (argv lists): continuations joined, comments, pipes,
    ``&&``/``;`` and redirections handled."""
    commands: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        current: list[str] = []
        skip_next = False
        for token in lexer:
            if skip_next:
                skip_next = False
            elif token in _SEPARATORS:
                commands.append(current)
                current = []
            elif token in _REDIRECTS or re.fullmatch(r"\d?[<>]+&?", token):
                skip_next = True  # the redirection target
            else:
                current.append(token)
        commands.append(current)
    return [c for c in commands if c]


def oscar_invocations() -> list[tuple[str, list[str]]]:
    """``(step name, argv after "oscar")`` for every oscar command in the workflow, in order."""
    out = []
    for step in _steps():
        for argv in shell_commands(step.get("run", "")):
            if argv[0] == "oscar":
                out.append((step.get("name", "?"), argv[1:]))
    return out


def _parse_command(command: Any, name: str, args: list[str], parent: Any) -> None:
    """Parse ``args`` with ``command``'s real option parser, without converting values (paths made by earlier
    steps do not exist here; ``$VARS`` are unexpanded). Raises Click's UsageError subclasses."""
    ctx = command.context_class(command, info_name=name, parent=parent)
    given, extra, _ = command.make_parser(ctx).parse_args(args=list(args))  # unknown option → NoSuchOption
    if extra:
        raise ValueError(f"unexpected extra argument(s) {extra}")
    missing = [p.name for p in command.params if p.required and p.name not in given]
    if missing:
        raise ValueError(f"missing required {', '.join(missing)}")


def check_invocation(argv: list[str]) -> str:
    """Parse ``oscar argv...`` with the real CLI; return the subcommand name ("" for root-only calls).

    Fails the test (with Click's message) on an unknown command or option, an option without its value, a
    missing required argument/option or an extra argument.
    """
    root = typer.main.get_command(app)
    if argv == ["--version"]:
        assert any("--version" in p.opts for p in root.params)
        return ""
    try:
        ctx = root.make_context("oscar", list(argv))
        rest = list(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", None) or []) + ctx.args
        assert rest, f"oscar {' '.join(argv)}: no command"
        name, args = rest[0], rest[1:]
        commands = root.commands  # type: ignore[attr-defined]
        if name not in commands:
            pytest.fail(f"oscar {' '.join(argv)}: no command {name!r} (registered: {', '.join(sorted(commands))})")
        _parse_command(commands[name], name, args, ctx)
    except pytest.fail.Exception:
        raise
    except Exception as exc:  # Click usage errors (NoSuchOption, BadOptionUsage, ...) and the checks above
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        pytest.fail(f"oscar {' '.join(argv)}: {type(exc).__name__}: {message}")
    return name


INVOCATIONS = oscar_invocations()


def test_shell_commands_parser() -> None:
    script = 'oscar --json export "$A" --tag "$V" > out.json\ncat out.json && oscar pull x \\\n  --token t # c'
    assert shell_commands(script) == [
        ["oscar", "--json", "export", "$A", "--tag", "$V"], ["cat", "out.json"], ["oscar", "pull", "x", "--token", "t"]
    ]


def test_checker_rejects_unknown_options_and_commands() -> None:
    """The check below can fail: a wrong option, command or a missing argument is caught."""
    assert check_invocation(["export", "a", "--repo-id", "o/n"]) == "export"
    for bad in (
        ["export", "a", "--repo-id", "o/n", "--no-such-option"],  # unknown option
        ["no-such-command"],
        ["export", "a"],  # missing required --repo-id
        ["export", "a", "--repo-id"],  # option without its value
        ["export", "a", "b", "--repo-id", "o/n"],  # extra argument
        ["--no-such-global", "export", "a", "--repo-id", "o/n"],
    ):
        with pytest.raises(pytest.fail.Exception):
            check_invocation(bad)


@pytest.mark.parametrize("step, argv", INVOCATIONS, ids=[f"{s}: oscar {' '.join(a[:2])}" for s, a in INVOCATIONS])
def test_each_oscar_invocation_exists(step: str, argv: list[str]) -> None:
    check_invocation(argv)


def test_pipeline_order_install_calibrate_eval_export() -> None:
    names = [check_invocation(argv) for _, argv in INVOCATIONS]
    for needed in ("calibrate", "eval-ruler", "export"):
        assert needed in names, f"the workflow should run oscar {needed}"
    publish = [i for i, (_, argv) in enumerate(INVOCATIONS) if "export" in argv and "--dry-run" not in argv]
    assert len(publish) == 1, "exactly one real (non --dry-run) export"
    assert names.index("calibrate") < names.index("eval-ruler") < publish[0]
    assert "--tag" in INVOCATIONS[publish[0]][1] and "--repo-id" in INVOCATIONS[publish[0]][1]
    assert "workflow_dispatch" in _load()["on"]


def test_token_comes_only_from_the_secret_env() -> None:
    text = WORKFLOW.read_text()
    assert not re.search(r"--token(?![\w-])", text), "never pass the token on a command line (process lists, logs)"
    doc = _load()
    for job in doc["jobs"].values():
        assert "secrets." not in str(job.get("env", {})), "secrets belong to the steps that need them"
    users = []
    for step in _steps():
        run = step.get("run", "")
        assert "${{" not in run, f"step {step.get('name')!r}: expressions inside run: allow script injection"
        assert "secrets" not in run and "HF_TOKEN" not in run
        env = step.get("env", {})
        if any("secrets." in str(v) for v in env.values()):
            assert env == {"HF_TOKEN": "${{ secrets.HF_TOKEN }}"}
            users.append({check_invocation(argv) for argv in
                          [a[1:] for a in shell_commands(run) if a[0] == "oscar"]})
    assert users and all(u <= {"export", "pull"} for u in users)
    assert any("export" in u for u in users), "the publishing export step gets HF_TOKEN"
