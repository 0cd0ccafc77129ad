"""Running ``oscar`` in-process from a test: :func:`run_cli` and the ``restore_cli_state`` fixture (use it with
``pytestmark = pytest.mark.usefixtures("restore_cli_state")`` or an autouse wrapper)."""

from __future__ import annotations

import logging

import pytest

from oscar_cli.main import main


@pytest.fixture
def restore_cli_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI sets global output settings and logging; give later tests (other files) what they had."""
    from oscar_cli._output import SETTINGS

    monkeypatch.setattr(SETTINGS, "json", SETTINGS.json)
    monkeypatch.setattr(SETTINGS, "verbose", SETTINGS.verbose)
    for name in ("oscar_cli", "oscar_kernels"):
        log = logging.getLogger(name)
        monkeypatch.setattr(log, "handlers", list(log.handlers))
        monkeypatch.setattr(log, "level", log.level)
        monkeypatch.setattr(log, "propagate", log.propagate)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``oscar argv...`` in-process; return (exit code, stdout, stderr)."""
    try:
        main(list(argv))
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
