"""RULER's scoring (``scripts/eval/evaluate.py`` + ``eval/synthetic/constants.py``): ``string_match_all``."""

from __future__ import annotations

import re
from collections.abc import Sequence

_CTRL = re.compile(r"[\x00-\x1f]")


def postprocess(pred: str) -> str:
    """RULER's prediction cleanup: strip, then every control character becomes a newline."""
    return _CTRL.sub("\n", pred.strip())


def match_all(pred: str, refs: Sequence[str]) -> float:
    """One sample's ``string_match_all``: the fraction of references found (case-insensitive) in ``pred``."""
    if not refs:
        return 0.0
    p = postprocess(pred).lower()
    return sum(1.0 for r in refs if r.lower() in p) / len(refs)


def string_match_all(preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """RULER's metric: ``mean_i(Σ_r [r in pred_i] / len(refs_i)) × 100``, rounded to 2 decimals."""
    if not preds:
        return float("nan")
    return round(100.0 * sum(match_all(p, r) for p, r in zip(preds, refs, strict=True)) / len(preds), 2)
