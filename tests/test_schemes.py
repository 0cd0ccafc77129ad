"""Per-layer fallback schemes: the rule, KIVI's held-out score, a broken layer fixed end to end, --strict."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers.calib import RESOLVED, serve_model_to_cli, tiny_recipe
from helpers.tiny import tiny_causal_lm
from typer.testing import CliRunner

from oscar_cli.calibration import run as run_mod
from oscar_cli.calibration import schemes as sch
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.errors import CalibrationError
from oscar_cli.method_registry import build_method
from oscar_cli.quant import use_method
from oscar_cli.quant.generation import cache_kwarg
from oscar_cli.quant.kivi import KiviLayer, dequantize_channels, quantize_channels

pytestmark = pytest.mark.unit


def _bpe(per_layer_bf16: float = 13.7, int2: float = 2.3):
    return lambda schemes: int2 + per_layer_bf16 * schemes.count("bf16") / len(schemes)


@pytest.mark.parametrize(
    ("errors", "want"),
    [
        ({"oscar": 0.5, "identity": 0.4, "kivi": 0.1}, "kivi"),  # far worse than KIVI: switch
        ({"oscar": 0.15, "identity": 0.4, "kivi": 0.1}, "oscar"),  # worse, but not 2x: keep
        ({"oscar": 0.05, "identity": 0.04, "hadamard": 0.02}, "hadamard"),
        ({"oscar": 0.05}, "oscar"),  # nothing else could be scored
    ],
)
def test_switch_rule(errors: dict[str, float], want: str) -> None:
    rep = sch.choose_schemes([sch.LayerScheme(0, {**errors, "bf16": 0.0})], _bpe())
    assert rep.layers[0].scheme == want and (rep.layers[0].reason != "") == (want != "oscar")


@pytest.mark.parametrize(("n_layers", "want_bf16"), [(30, [7]), (8, [])])  # +0.46 fits the budget, +1.7 does not
def test_bf16_outliers_within_the_bit_budget(n_layers: int, want_bf16: list[int]) -> None:
    layers = [sch.LayerScheme(i, {"oscar": 0.03, "kivi": 0.035, "bf16": 0.0}) for i in range(n_layers)]
    layers[7].errors = {"oscar": 1.5, "kivi": 1.2, "bf16": 0.0}
    rep = sch.choose_schemes(layers, _bpe())
    assert [s.index for s in rep.layers if s.scheme == "bf16"] == want_bf16
    assert rep.baseline == "kivi" and rep.bits_per_element["all_int2"] == pytest.approx(2.3)
    assert rep.bits_per_element["artifact"] == pytest.approx(2.3 + 13.7 * len(want_bf16) / n_layers)
    assert rep.artifact_error <= rep.oscar_error


def test_kivi_score_uses_the_cache_quantizer_and_the_tiers() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, t, 16, generator=g) for h, t in ((4, 32), (2, 256), (2, 256)))
    assert sch.KiviProblem(q, k, v, 0.25, sink=8, recent=32, meta_dtype="bfloat16").error() > 0
    everything_bf16 = sch.KiviProblem(q, k, v, 0.25, sink=256, recent=256, meta_dtype="bfloat16")
    assert not everything_bf16.has_int2 and everything_bf16.error() == 0.0
    # the key blocks it scores are the ones the cache's KIVI layer stores
    layer = KiviLayer(build_method("kivi-2", tiny_causal_lm().config))
    layer.update(k[..., :128, :], v[..., :128, :])
    assert torch.equal(layer.keys[..., :128, :], dequantize_channels(*quantize_channels(k[..., :128, :], None,
                                                                                        torch.bfloat16)))


def _break_layer(monkeypatch: pytest.MonkeyPatch, layer: int, scale: float = 50.0) -> None:
    """Calibration that fails on one layer: its centring means are garbage."""
    solve = run_mod._solve

    def broken(*a, **k):
        out = solve(*a, **k)
        t = out[layer]
        g = torch.Generator().manual_seed(1)
        out[layer] = replace(t, k_mean=t.k_mean + scale * torch.randn(t.k_mean.shape, generator=g),
                             v_mean=t.v_mean + scale * torch.randn(t.v_mean.shape, generator=g))
        return out

    monkeypatch.setattr(run_mod, "_solve", broken)


def test_broken_layer_is_fixed_recorded_and_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _break_layer(monkeypatch, 1)
    model = tiny_causal_lm("llama", layers=4)
    res = calibrate_model(model, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "a")
    assert res.schemes is not None and res.schemes.fixed and res.schemes.fixed[0].index == 1
    fixed = res.layers[1]
    assert fixed.scheme in ("identity", "hadamard", "kivi") and fixed.scheme_errors["oscar"] > 2 * min(
        e for s, e in fixed.scheme_errors.items() if s not in ("oscar", "bf16"))
    assert [s.scheme for i, s in enumerate(res.layers) if i != 1] == ["oscar"] * 3
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert [x["scheme"] for x in manifest["calibration"]["layers"]] == [s.scheme for s in res.layers]
    assert manifest["calibration"]["schemes"]["artifact_error"] < manifest["calibration"]["schemes"]["oscar_error"]
    meth = build_method("oscar", model.config, artifact=str(tmp_path / "a"))
    assert meth.extra["schemes"][1] == fixed.scheme
    if fixed.scheme == "kivi":
        assert meth.for_layer(1).kind == "kivi" and meth.for_layer(0).kind == "int2"
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    with use_method(model, meth) as session:
        cache = session.new_cache()
        model(ids, **{cache_kwarg(model): cache}, use_cache=True)
        assert cache.get_seq_length() == 300 and type(cache.oscar_layers[1]).__name__ == (
            "KiviLayer" if fixed.scheme == "kivi" else "Int2Layer")


def test_worse_than_baseline_warns_and_strict_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    _break_layer(monkeypatch, 0)
    monkeypatch.setattr(sch, "SWITCH_RATIO", 1e9)  # no fix: the broken layer ships as is
    monkeypatch.setattr(sch, "BF16_MAX_EXTRA_BPE", 0.0)
    model = tiny_causal_lm("llama", layers=4)
    with pytest.raises(CalibrationError, match="worse than the kivi baseline"):
        calibrate_model(model, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "s",
                        strict=True)
    assert not (tmp_path / "s").exists()
    with caplog.at_level(logging.WARNING, logger="oscar_cli"):
        res = calibrate_model(model, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "w")
    assert res.schemes is not None and res.schemes.worse_than_baseline and res.artifact_path.is_dir()
    assert any("WORSE THAN THE BASELINE" in r.getMessage() for r in caplog.records)


def test_cli_prints_fixed_layers_and_strict_fails_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_cli.main import app

    _break_layer(monkeypatch, 1)
    recipe = serve_model_to_cli(monkeypatch, tiny_causal_lm("llama", layers=4), "tiny", tmp_path)
    result = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "layer 1: served as" in result.stdout and "bits per element at 32K" in result.stdout
    monkeypatch.setattr(sch, "SWITCH_RATIO", 1e9)
    monkeypatch.setattr(sch, "BF16_MAX_EXTRA_BPE", 0.0)
    bad = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--out", str(tmp_path / "b"),
                                   "--strict"])
    assert bad.exit_code != 0 and isinstance(bad.exception, CalibrationError)
    assert "\n" not in bad.exception.message and not (tmp_path / "b").exists()
