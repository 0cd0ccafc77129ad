"""``oscar eval-kl``: KL/top-1 against BF16 on a tiny random model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers.evaldata import as_loader, prose
from helpers.tiny import tiny_loaded
from typer.testing import CliRunner

import oscar_cli.model as models_mod
from oscar_cli.errors import EvalError, OscarError
from oscar_cli.eval.kl import KLConfig, compare, cut_windows, run_kl
from oscar_cli.main import app
from oscar_cli.model.rope import rope_type

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
    assert "eval-kl: quarot-int2 @ 256 2/2" in res.stderr  # progress in logs (stderr is not a terminal here)
    bad = CliRunner().invoke(app, ["eval-kl", "tiny", "--text", str(tmp_path / "missing.txt"), "--ctx", "256"])
    assert isinstance(bad.exception, EvalError) and "no such file" in bad.exception.message


def _kl_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> tuple[object, object]:
    loaded = tiny_loaded(max_positions=256)
    monkeypatch.setattr(models_mod, "load_model", as_loader(loaded))
    text = prose(tmp_path) / "essay.txt"
    argv = ["--json", "eval-kl", "tiny", "--text", str(text), "--methods", "kivi-2", "--ctx", "300", "--tokens", "4",
            "--windows", "2", *extra]  # fmt: skip
    return CliRunner().invoke(app, argv), loaded


def test_windows_beyond_the_positions_run_under_yarn_with_one_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    res, loaded = _kl_cli(tmp_path, monkeypatch)
    assert res.exit_code == 0, res.output + str(res.exception)  # type: ignore[attr-defined]
    doc = json.loads(res.stdout)  # type: ignore[attr-defined]
    assert doc["config"]["rope_scaling"] == "yarn" and doc["config"]["rope_factor"] == 2.0
    assert loaded.model.config.rope_parameters["rope_type"] == "yarn"  # type: ignore[attr-defined]
    flat = re.sub(r"\s+", " ", res.stderr)  # type: ignore[attr-defined]  # the log wraps long lines
    assert flat.count("YaRN factor") == 1, flat
    assert "YaRN factor 2 (--ctx 300 + --tokens 4 is beyond the model's 256 positions)" in flat
    assert "scaled to 512 positions (--no-rope-scaling refuses instead)" in flat
    assert doc["metrics"]["bf16"]["300"]["kl"] == 0.0 and doc["metrics"]["kivi-2"]["300"]["kl"] > 0.0


def test_windows_beyond_the_positions_are_refused_with_no_rope_scaling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    res, loaded = _kl_cli(tmp_path, monkeypatch, "--no-rope-scaling")
    assert isinstance(res.exception, OscarError), res.output  # type: ignore[attr-defined]
    assert "--ctx + --tokens 304 is beyond the model's context of 256 tokens (--no-rope-scaling)" in res.exception.message  # type: ignore[attr-defined]
    assert rope_type(loaded.model.config) == "default"  # type: ignore[attr-defined]
    both, _ = _kl_cli(tmp_path, monkeypatch, "--no-rope-scaling", "--rope-factor", "2")
    assert both.exit_code == 2  # type: ignore[attr-defined]


def test_yarn_asked_within_the_positions_and_a_factor_too_small(tmp_path: Path) -> None:
    text = prose(tmp_path) / "essay.txt"
    cfg = KLConfig(text=str(text), lengths=[200], methods=["kivi-2"], tokens=4, windows=1, rope_scaling="yarn",
                   rope_factor=2.0)  # fmt: skip
    res = run_kl(cfg, loaded=tiny_loaded(max_positions=256))
    assert res.config["rope_scaling"] == "yarn" and res.config["rope_factor"] == 2.0
    cfg = KLConfig(text=str(text), lengths=[600], methods=["kivi-2"], tokens=4, windows=1, rope_factor=2.0)
    with pytest.raises(OscarError, match=r"--ctx \+ --tokens 604 is beyond 256 × 2 = 512 positions of YaRN"):
        run_kl(cfg, loaded=tiny_loaded(max_positions=256))
