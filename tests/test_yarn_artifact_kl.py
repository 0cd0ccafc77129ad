"""scripts/yarn_artifact_kl.py: two artifacts against BF16 under one YaRN, per window, paired, resumable."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from helpers.calib import TINY_RECIPE
from helpers.evaldata import prose
from helpers.scripts import load_script
from helpers.tiny import tiny_loaded

import oscar_cli.model as models_mod
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.model.rope import apply_yarn
from oscar_cli.recipe import load_recipe

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]




def _artifact(tmp_path: Path, yarn: float | None) -> str:
    loaded = tiny_loaded(max_positions=256)
    model = copy.deepcopy(loaded.model)
    if yarn:
        apply_yarn(model, yarn)
    res = calibrate_model(model, None, load_recipe(overrides=TINY_RECIPE), reference="tiny",
                          resolved=loaded.identity.resolved, out=tmp_path / f"art-{yarn}")  # fmt: skip
    return str(res.artifact_path)


def test_two_artifacts_scored_per_window_under_one_yarn_and_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(models_mod, "load_model", lambda *a, **k: tiny_loaded(max_positions=256))
    script = load_script("yarn_artifact_kl")
    native, yarn = _artifact(tmp_path, None), _artifact(tmp_path, 2.0)
    text = prose(tmp_path) / "essay.txt"
    out = tmp_path / "kl.json"
    argv = ["--model", "tiny", "--text", str(text), "--artifact", f"native={native}", "--artifact", f"yarn={yarn}",
            "--ctx", "300", "--tokens", "4", "--windows", "3", "--rope-factor", "2", "--out", str(out)]  # fmt: skip
    assert script.main([*argv, "--time-budget", "0"]) == 0  # no window starts: an empty, complete record
    assert json.loads(out.read_text())["stopped_by_time_budget"] is True
    assert script.main(argv) == 0
    doc = json.loads(out.read_text())
    err = capsys.readouterr().err
    assert "YaRN factor 2" in err and "native: artifact" in err and "measured no worse" in err
    assert "yarn: artifact" not in err  # calibrated under the same YaRN: no note
    rows = doc["per_window"]["300"]
    assert [r["window"] for r in rows] == [0, 1, 2] and all(r["native"]["kl"] > 0 and r["yarn"]["kl"] > 0 for r in rows)
    summ = doc["summary"]["300"]
    diffs = [r["native"]["kl"] - r["yarn"]["kl"] for r in rows]
    assert summ["paired_kl"]["mean"] == pytest.approx(sum(diffs) / 3, abs=1e-6)
    assert summ["paired_kl"]["se"] is not None and summ["paired_kl"]["native_lower_in"] == sum(d < 0 for d in diffs)
    before = out.read_text()
    assert script.main([*argv, "--resume", "--windows", "3"]) == 0  # everything there: nothing reruns
    assert json.loads(out.read_text())["per_window"] == json.loads(before)["per_window"]
    with pytest.raises(SystemExit, match="another setup"):
        script.main([*argv[:-2], "--tokens", "5", "--out", str(out), "--resume"])
