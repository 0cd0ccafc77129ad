"""scripts/ruler_errors.py: a wrong RULER answer is another needle's value, a chimera, partial, or none."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.scripts import load_script

pytestmark = pytest.mark.unit

TEXT = ("One of the special magic numbers for tall-tree is: 1234567.\n"
        "One of the special magic numbers for red-door is: 7654321.\n"
        "One of the special magic uuids for x is: 0a1b2c3d-1111-4222-8333-444455556666.\n")


def _re() -> Any:
    return load_script("ruler_errors")


@pytest.mark.parametrize(("pred", "answers", "kind", "stray"), [
    (" 1234567.", ["1234567", "7654321"], "partial", None),
    (" 7654321.", ["1234567"], "other-needle", None),
    (" 1234561.", ["1234567"], "garbled", "1234561"),  # nearest: the expected value (1 edit)
    (" 7654329.", ["1234567"], "chimera", "7654329"),  # nearest: another needle's value
    (" 1234321.", ["1234567", "7654321"], "garbled", "1234321"),  # a tie (3 edits each): expected first
    (" 7654321 and 7654320", ["1234567"], "chimera", "7654320"),  # the first value not in the prompt
    (" I do not know.", ["1234567"], "no-answer", None),
    (" 123456", ["1234567"], "no-answer", None),  # six digits is not a value of this task
])
def test_classify_numbers(pred: str, answers: list[str], kind: str, stray: str | None) -> None:
    m = _re()
    assert m.classify(pred, answers, TEXT, m.NUMBER) == (kind, stray)


def test_classify_uuids_and_task_patterns() -> None:
    m = _re()
    assert m.value_pattern("niah_multikey_3") is m.UUID and m.value_pattern("niah_multikey_2") is m.NUMBER
    wrong = "0a1b2c3d-1111-4222-8333-444455550000"
    assert m.classify(f" {wrong}", ["ffffffff-1111-4222-8333-444455556666"], TEXT, m.UUID) == ("chimera", wrong)
    assert m.classify(f" {wrong}", ["0a1b2c3d-1111-4222-8333-444455556666"], TEXT, m.UUID) == ("garbled", wrong)
    assert m.classify(" 0a1b2c3d-1111-4222-8333-444455556666", ["ffffffff-1111-4222-8333-444455556666"], TEXT,
                      m.UUID) == ("other-needle", None)


@pytest.mark.parametrize(("a", "b", "d"), [("", "", 0), ("1234567", "1234567", 0), ("1234567", "1234667", 1),
                                           ("1234567", "234567", 1), ("abc", "", 3), ("kitten", "sitting", 3)])
def test_edit_distance(a: str, b: str, d: int) -> None:
    assert _re().edit_distance(a, b) == d == _re().edit_distance(b, a)


def test_method_label_keeps_two_artifacts_apart() -> None:
    m = _re()
    assert m.method_label({"method": "oscar", "method_source": "/a (oscar, rotations c874d386a306)"}) == "oscar[c874d386]"
    assert m.method_label({"method": "bf16", "method_source": "none"}) == "bf16"
