"""Recipes: defaults complete and commented, per-model diffs, validation with key paths, round trip."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from oscar_cli.errors import RecipeError
from oscar_cli.recipe import (
    Recipe,
    default_recipe_dict,
    load_recipe,
    recipe_for_model,
    recipe_from_dict,
    shipped_recipe_names,
)

pytestmark = pytest.mark.unit


def test_defaults_file_matches_dataclass_defaults_and_every_knob_is_commented() -> None:
    assert recipe_from_dict(default_recipe_dict()) == Recipe()
    text = resources.files("oscar_cli.recipes").joinpath("defaults.yaml").read_text()
    for line in text.splitlines():
        if ":" in line and not line.lstrip().startswith("#") and not line.rstrip().endswith(":"):
            assert "#" in line, f"knob without a comment: {line!r}"


def test_shipped_per_model_files_load_and_only_differ() -> None:
    names = shipped_recipe_names()
    for expected in ("defaults", "smollm2-135m", "qwen3-8b", "qwen3-4b", "llama-3.1-8b"):
        assert expected in names
    for name in names:
        r = load_recipe(name)
        assert r.name == ("default" if name == "defaults" else name)
    assert load_recipe("qwen3-8b").data.tokens == 20480
    assert load_recipe("qwen3-8b").clip.k_ratio == 0.96  # inherited
    # Qwen2.5's keys are centred by position, 8 layers' keys at 4 bits, 8-bit metadata (measured: docs/RESULTS.md);
    # --int4-keys 0 --meta-bits 16: 2-bit keys and 16-bit scale/zero (the rope row of docs/RESULTS.md)
    qwen = load_recipe("qwen2.5-coder-1.5b").quant
    assert (qwen.key_mean, qwen.int4_keys, qwen.meta_dtype) == ("rope", 8, "uint8")
    served = load_recipe("qwen2.5-coder-1.5b", {"quant": {"int4_keys": 0, "meta_dtype": "bfloat16"}}).quant
    assert (served.key_mean, served.int4_keys, served.meta_dtype) == ("rope", 0, "bfloat16")
    assert load_recipe("qwen2.5-coder-1.5b", {"quant": {"key_mean": "constant"}}).quant.key_mean == "constant"
    # SmolLM2's recipe adds INT4 keys on 4 layers and 8-bit metadata (docs/RESULTS.md); the defaults stay plain
    # INT2 for an unknown model
    small = load_recipe("smollm2-135m").quant
    assert (small.key_mean, small.int4_keys, small.meta_dtype) == ("rope", 4, "uint8")
    plain = load_recipe().quant
    assert (plain.key_mean, plain.int4_keys, plain.meta_dtype) == ("constant", 0, "bfloat16")


def test_recipe_for_model_picks_longest_prefix() -> None:
    assert recipe_for_model("qwen3-8b") == "qwen3-8b"
    assert recipe_for_model("Qwen3-8B-Instruct") == "qwen3-8b"
    assert recipe_for_model("llama-3.1-8b-instruct") == "llama-3.1-8b"
    assert recipe_for_model("mistral-7b") == "defaults"


def test_unknown_key_is_rejected_with_its_path(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("clip:\n  k_ratoi: 0.9\n")
    with pytest.raises(RecipeError, match=r"unknown key clip\.k_ratoi") as info:
        load_recipe(f)
    assert "k_ratio" in (info.value.hint or "")
    with pytest.raises(RecipeError, match="unknown key colour"):
        load_recipe(overrides={"colour": "red"})


@pytest.mark.parametrize(
    ("override", "pattern"),
    [
        ({"clip": {"k_ratio": 1.5}}, r"clip\.k_ratio"),
        ({"data": {"tokens": "many"}}, r"data\.tokens must be an integer"),
        ({"data": {"tokens": 0}}, r"data\.tokens must be >= 1"),
        ({"statistics": {"v_target": "magic"}}, r"statistics\.v_target"),
        ({"rotation": {"center_keys": "yes"}}, r"rotation\.center_keys must be true or false"),
        ({"clip": {"k_grid": []}}, r"clip\.k_grid must be a non-empty list"),
        ({"quant": {"meta_dtype": "int8"}}, r"quant\.meta_dtype"),
        ({"method": "spinquant"}, r"method"),
    ],
)
def test_invalid_values_name_the_key(override: dict, pattern: str) -> None:
    with pytest.raises(RecipeError, match=pattern):
        load_recipe(overrides=override)


def test_round_trip_and_yaml(tmp_path: Path) -> None:
    r = load_recipe("smollm2-135m", overrides={"data": {"tokens": 4096}, "quant": {"group_size": 32}})
    assert recipe_from_dict(r.to_dict()) == r
    f = tmp_path / "r.yaml"
    f.write_text(r.to_yaml())
    assert load_recipe(f) == r
    assert r.replace({"clip": {"mode": "global"}}).clip.mode == "global"


def test_missing_file_and_unknown_name() -> None:
    with pytest.raises(RecipeError, match="not found"):
        load_recipe("nope/none.yaml")
    with pytest.raises(RecipeError, match="unknown recipe"):
        load_recipe("qwen9-1t")


def test_not_yaml_mapping(tmp_path: Path) -> None:
    f = tmp_path / "list.yaml"
    f.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="mapping"):
        load_recipe(f)


def test_default_clip_grids_keep_the_floor_that_ruler_needs() -> None:
    """Offered ratios of 0.8-0.85, the search's average-error objective takes them on deep layers and RULER NIAH
    halves on the same rotations (docs/RESULTS.md, "Clip grid"): a grid below the floor needs new RULER evidence."""
    clip = Recipe().clip
    assert min(r for r in clip.k_grid if r > 0) >= 0.9
    assert min(r for r in clip.v_grid if r > 0) >= 0.88
    assert 0.0 in clip.k_grid and 0.0 in clip.v_grid  # "no clipping" stays a candidate
