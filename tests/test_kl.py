"""``oscar eval-kl``: KL/top-1 against BF16 on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.evaldata import as_loader, prose
from helpers.tiny import tiny_loaded
from typer.testing import CliRunner

import oscar_cli.model as models_mod
from oscar_cli.errors import EvalError
from oscar_cli.eval.kl import KLConfig, compare, cut_windows, run_kl
from oscar_cli.main import app

pytestmark = pytest.mark.unit


def test_compare_and_windows() -> None:
    lp = torch.log_softmax(torch.randn(2, 3, 10), -1)
    targets = torch.zeros(2, 3, dtype=torch.long)
    same = compare(lp, lp, targets)
    assert same["kl"] == 0.0 and same["top1"] == 1.0
    other = compare(lp, torch.log_softmax(torch.randn(2, 3, 10), -1), targets)
    assert other["kl"] > 0
    w = cut_windows(list(range(100)), 20, 5, 3)
    assert w.shape == (3, 25) and w[0, 0] == 0 and w[-1, -1] == 99
    with pytest.raises(EvalError, match="a window needs 125"):
        cut_windows(list(range(100)), 120, 5, 2)


def test_run_kl_bf16_is_the_reference_and_int2_drifts(tmp_path: Path) -> None:
    text = prose(tmp_path) / "essay.txt"
    cfg = KLConfig(text=str(text), lengths=[300], methods=["naive-int2", "kivi-2"], tokens=8, windows=2)
    res = run_kl(cfg, loaded=tiny_loaded())
    assert res.metrics["bf16"][300]["kl"] == 0.0 and res.metrics["bf16"][300]["top1"] == 1.0
    assert res.metrics["naive-int2"][300]["kl"] > 0.0
    assert res.bpe["naive-int2"][300] == pytest.approx(4.0)


def test_eval_kl_cli_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models_mod, "load_model", as_loader(tiny_loaded()))
    text = prose(tmp_path) / "essay.txt"
    res = CliRunner().invoke(
        app, ["--json", "eval-kl", "tiny", "--text", str(text), "--methods", "quarot-int2", "--ctx", "256",
              "--tokens", "4", "--windows", "2"],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc["metrics"]) == {"bf16", "quarot-int2"}
    bad = CliRunner().invoke(app, ["eval-kl", "tiny", "--text", str(tmp_path / "missing.txt"), "--ctx", "256"])
    assert isinstance(bad.exception, EvalError) and "no such file" in bad.exception.message
