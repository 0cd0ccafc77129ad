"""Progress in logs: off a terminal (CI, ``2> log``, ``--json``) long commands print progress lines on stderr."""

from __future__ import annotations

import pytest

from oscar_cli import _output
from oscar_cli._output import LogLines

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_line_when_a_phase_finishes_and_at_most_every_15_s_before(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    p = LogLines("calibrate", clock=clock)
    task = p.add_task("capture", total=4)
    clock.t += 5
    p.advance(task)  # 5 s in: too soon for a line
    clock.t += 15
    p.advance(task)  # 20 s in, 2 of 4: a line with the time left at the rate so far
    clock.t += 1
    p.update(task, completed=3)  # 1 s after the last line: none
    clock.t += 1
    p.update(task, completed=4)  # finished: a line, whatever the time
    p.update(task, completed=4)  # once
    other = p.add_task("solve", total=None)
    clock.t += 16
    p.update(other, completed=7, description="solve (layer 7)")
    assert capsys.readouterr().err.splitlines() == [
        "calibrate: capture 2/4, 20 s elapsed, about 20 s left",
        "calibrate: capture 4/4, 22 s elapsed",
        "calibrate: solve (layer 7) 7, 16 s elapsed",
    ]


@pytest.mark.parametrize(("terminal", "log", "kind"), [(False, "bench", LogLines), (True, "bench", "rich"),
                                                       (False, None, "rich")])
def test_progress_chooses_bars_or_lines(monkeypatch: pytest.MonkeyPatch, terminal: bool, log: str | None,
                                        kind: object) -> None:
    monkeypatch.setattr(_output, "progress_enabled", lambda: terminal)
    with _output.progress(log=log) as p:
        if kind is LogLines:
            assert isinstance(p, LogLines) and p.label == "bench"
        else:
            assert not isinstance(p, LogLines)  # rich: drawn on a terminal, disabled (silent) without a label
