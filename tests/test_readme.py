"""The README opens with exactly two set-up commands, and both exist as Makefile targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def _first_code_block(text: str) -> list[str]:
    m = re.search(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
    assert m, "README has no code block"
    lines = [ln.split("#", 1)[0].strip() for ln in m.group(1).splitlines()]
    return [ln for ln in lines if ln]


def test_readme_opens_with_two_make_commands() -> None:
    text = (ROOT / "README.md").read_text()
    head = text.split("\n## ", 1)[0]
    assert head.index("```") < head.index("Long-context"), "the set-up commands must come first"
    assert _first_code_block(text) == ["make demo", "make test"]


@pytest.mark.parametrize("target", ["demo", "test"])
def test_make_targets_exist(target: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(rf"^{target}:", makefile, re.M)


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_demo_script_is_strict_and_uses_oscar() -> None:
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert "set -euo pipefail" in demo
    assert re.search(r"^oscar ", demo, re.M), "the demo runs oscar commands"
