"""The copy score (calibration.copy_score) and ``quant.bf16_keys``: which rows count, peak and flip; how layers
are chosen; what the artifact records and how it is served."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers.calib import copy_chosen_pair, random_orthogonal, serve_model_to_cli, tiny_recipe
from helpers.tiny import tiny_causal_lm
from typer.testing import CliRunner

from oscar_cli.calibration.copy_score import CopyScore, choose_key_layers, copy_flips
from oscar_cli.errors import RecipeError
from oscar_cli.method_registry import build_method
from oscar_cli.quant import use_method
from oscar_cli.quant.generation import cache_kwarg
from oscar_cli.recipe import Recipe, recipe_from_dict

pytestmark = pytest.mark.unit

D = 16


def _copying(t: int, tq: int, h_kv: int, g: int, target: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys of random directions; every query is 12x the key at ``target`` (its attention peaks there)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.nn.functional.normalize(torch.randn(1, h_kv, t, D, generator=gen), dim=-1)
    q = (12.0 * k[:, :, target]).repeat_interleave(g, 1)[:, :, None].expand(1, h_kv * g, tq, D).clone()
    return q, k


@pytest.mark.parametrize(("h_kv", "g", "n_rot"), [(1, 1, 1), (2, 3, 1), (2, 2, 2)])
@pytest.mark.parametrize(("sink", "recent"), [(0, 0), (8, 16), (4, 40)])
def test_rows_peaks_and_flips(h_kv: int, g: int, n_rot: int, sink: int, recent: int) -> None:
    """Rows: (query, head) pairs with INT2 history (``sink ≤ j ≤ i − recent``); every row peaks on the history key
    it copies; exact keys never flip; keys that swap the target with another history key flip every row and
    lose the target's weight; a target in the sink is BF16: no row peaks on history."""
    t, tq, target = 96, 24, 20
    q, k = _copying(t, tq, h_kv, g, target)
    rot = random_orthogonal(n_rot, D, 1)
    rows = h_kv * g * sum(1 for i in range(t - tq, t) if i - recent >= sink)
    same = copy_flips(q, k, rot, None, 1.0, sink, recent, lambda y: y)
    assert (same.rows, same.peaked, same.flipped) == (rows, rows, 0) and same.lost == pytest.approx(0, abs=1e-4)

    def swap(y: torch.Tensor) -> torch.Tensor:  # the target's key and key 30's trade places
        out = y.clone()
        out[:, :, [target, 30]] = y[:, :, [30, target]]
        return out

    bad = copy_flips(q, k, rot, None, 1.0, sink, recent, swap)
    assert (bad.rows, bad.peaked, bad.flipped) == (rows, rows, rows)
    assert bad.lost / rows > 0.9 and bad.score == 1.0 and bad.lost_weight == pytest.approx(bad.lost / rows)
    in_sink = copy_flips(q, k, rot, None, 1.0, target + 1, recent, swap)
    assert in_sink.peaked == 0 and in_sink.flipped == 0


@pytest.mark.parametrize("mean_kind", ["constant", "per-position"])
def test_a_key_mean_is_added_back_and_chunks_change_nothing(mean_kind: str) -> None:
    """The logits are those of the served keys plus their mean (constant or per position): a quantizer exact on
    centred keys flips nothing; the counts do not depend on the query chunk."""
    q, k = _copying(80, 30, 2, 2, 11)
    mean = torch.randn(2, D) if mean_kind == "constant" else torch.randn(1, 2, 80, D)
    a = copy_flips(q, k, None, mean, 1.0, 4, 8, lambda y: y.bfloat16().float(), chunk=7)
    b = copy_flips(q, k, None, mean, 1.0, 4, 8, lambda y: y.bfloat16().float())
    assert (a.rows, a.peaked, a.flipped) == (b.rows, b.peaked, b.flipped) and a.flipped == 0
    assert a.lost == pytest.approx(b.lost, abs=1e-4)


def test_choose_key_layers() -> None:
    """Largest score first, only layers served by their own transform and with a flip; returned in layer order."""
    s = [CopyScore(100, 10, f) for f in (0, 5, 1, 9, 3)]
    schemes = ["oscar", "oscar", "oscar", "bf16", "oscar"]
    assert choose_key_layers(s, 2, schemes) == [1, 4]
    assert choose_key_layers(s, 9, schemes) == [1, 2, 4]
    assert choose_key_layers([None, *s[1:]], 1, schemes) == [1]


def test_recipe_knob() -> None:
    """``quant.bf16_keys`` is left out of recipe dicts while 0, and refused with a keep budget or a data-free
    method (both in one line)."""
    assert "bf16_keys" not in Recipe().to_dict()["quant"]
    on = Recipe().replace({"quant": {"bf16_keys": 3}})
    assert on.to_dict()["quant"]["bf16_keys"] == 3 and recipe_from_dict(on.to_dict()) == on
    with pytest.raises(RecipeError, match="both use the BF16 keep tier"):
        recipe_from_dict({"quant": {"bf16_keys": 2, "keep": {"fraction": 0.01}}})
    with pytest.raises(RecipeError, match="needs method oscar"):
        recipe_from_dict({"method": "hadamard", "quant": {"bf16_keys": 2}})
    with pytest.raises(RecipeError, match="quant.bf16_keys"):
        recipe_from_dict({"quant": {"bf16_keys": -1}})


def test_calibration_records_copy_scores_and_keeps_the_chosen_keys_in_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every layer's copy score is in the manifest; with ``quant.bf16_keys: 2`` the two layers of largest score
    get ``quant.keep`` (fraction 1, keys, those layers), the served method keeps only their keys and the reported
    bits per element count them. (The random tiny model has no focused heads: ``SHARP`` 0 makes every row peak.)"""
    model, plain, res, manifest, want = copy_chosen_pair(tmp_path, monkeypatch, {"bf16_keys": 2}, 2)
    copies = [row["copy"] for row in manifest["calibration"]["layers"]]
    assert all(c["rows"] > 0 and 0 <= c["flipped"] <= c["peaked"] <= c["rows"] for c in copies)
    assert manifest["calibration"]["bf16_keys"] == want and res.to_dict()["bf16_keys"] == want
    assert [s.copy_score for s in res.layers] == [c["score"] for c in copies]
    meth = build_method("oscar", model.config, artifact=str(tmp_path / "a"))
    assert len(want) == 2
    assert manifest["quant"]["keep"] == {"fraction": 1.0, "score": "knorm", "side": "keys", "layers": want}
    assert [meth.for_layer(i).keep_fraction for i in range(4)] == [float(i in want) for i in range(4)]
    assert res.schemes is not None and plain.schemes is not None
    assert res.schemes.bits_per_element["artifact"] > plain.schemes.bits_per_element["artifact"]
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with use_method(model, meth) as session:
        cache = session.new_cache()
        model(ids, **{cache_kwarg(model): cache}, use_cache=True)
        assert [lay.keep is not None for lay in cache.oscar_layers] == [i in want for i in range(4)]


def test_cli_prints_the_layers_whose_keys_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_cli.main import app

    recipe = serve_model_to_cli(monkeypatch, tiny_causal_lm("llama", layers=4), "tiny", tmp_path)
    recipe.write_text(tiny_recipe(quant={"bf16_keys": 1}).to_yaml())
    result = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    assert "keys in BF16 (quant.bf16_keys, reference path): layers none (no INT2 key flipped" in result.stdout
    from oscar_cli.calibration import copy_score

    monkeypatch.setattr(copy_score, "SHARP", 0.0)
    result = CliRunner().invoke(app, ["calibrate", "tiny", "--recipe", str(recipe), "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert re.search(r"keys in BF16 \(quant.bf16_keys, reference path\): layers \d \(copy score 0\.\d{4}\)\n",
                     result.stdout), result.stdout
