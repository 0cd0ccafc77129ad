"""The ablation driver (scripts/ablate.py over oscar_cli.eval.ablation): variants, resumability, the table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.calib import TINY_RECIPE
from helpers.evaldata import prose
from helpers.scripts import load_script
from helpers.tiny import tiny_loaded

from oscar_cli.errors import EvalError, RecipeError
from oscar_cli.eval.ablation import check_held_out, markdown_table
from oscar_cli.eval.variants import default_variants, parse_variant, recipe_diff, safe_name
from oscar_cli.recipe import load_recipe

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

VARIANTS = {"rotation.grouping=head": {"rotation.grouping": ["layer", "head"]},
            "topk:clip.objective=topk": {"clip.objective": ["mean", "topk"]}}




def _ablate() -> Any:
    return load_script("ablate")


def _args(tmp_path: Path, *extra: str) -> list[str]:
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(load_recipe(overrides=TINY_RECIPE).to_yaml())
    text = prose(tmp_path / "held_out") / "essay.txt"
    args = ["tiny", "--recipe", str(recipe), "--text", str(text), "--ctx", "160", "--kl-tokens", "6",
            "--windows", "2", "--out", str(tmp_path / "abl")]
    for v in VARIANTS:
        args += ["--variant", v]
    return args + list(extra)


def test_driver_resumes_and_each_row_differs_from_base_in_its_knob_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ablate, loaded = _ablate(), tiny_loaded()
    # a budget of 0 s stops after the first row (the estimate needs one finished row)
    assert ablate.main(_args(tmp_path, "--budget", "0"), loaded=loaded) == 0
    err = capsys.readouterr().err
    assert "budget:" in err and "stopping before rotation.grouping=head, topk, kivi-2" in err
    state_path = tmp_path / "abl" / "ablation.json"
    first = json.loads(state_path.read_text())
    assert list(first["rows"]) == ["base"] and first["rows"]["base"]["status"] == "done"

    assert ablate.main(_args(tmp_path), loaded=loaded) == 0
    out = capsys.readouterr()
    assert "base: calibrating" not in out.err  # the finished row is not redone
    assert "rotation.grouping=head: calibrating" in out.err and "topk: calibrating" in out.err
    state = json.loads(state_path.read_text())
    assert state["rows"]["base"] == first["rows"]["base"]
    base = state["rows"]["base"]["recipe"]
    for spec, change in VARIANTS.items():
        row = state["rows"][spec.split(":")[0] if ":" in spec else spec]
        assert row["status"] == "done" and row["change"] == change
        assert {k: list(v) for k, v in recipe_diff(base, row["recipe"]).items()} == change
        assert Path(row["artifact"]).is_dir() and set(row["kl"]) == {"160"} and "32768" in row["bpe"]
    assert set(state["references"]) == {"kivi-2"}

    lines = out.out.strip().splitlines()
    assert lines[0].startswith("| variant | change vs base | BPE @32K")
    rows = {ln.split(" | ")[0].strip("| "): ln.split(" | ")[1] for ln in lines[2:]}
    assert rows == {"base": "—", "rotation.grouping=head": "rotation.grouping layer→head",
                    "topk": "clip.objective mean→topk", "kivi-2": "reference method"}
    assert markdown_table(state) == out.out.strip()

    assert ablate.main(_args(tmp_path), loaded=loaded) == 0  # everything done: nothing recalibrated
    assert "calibrating" not in capsys.readouterr().err
    assert ablate.main(_args(tmp_path, "--windows", "3"), loaded=loaded) == 1  # other prompts: refused
    assert "different eval" in capsys.readouterr().err


def test_variant_specs() -> None:
    base = load_recipe(overrides=TINY_RECIPE)
    split = parse_variant("sink/recent=0/40", base)
    assert split.name == "sink/recent=0/40"
    assert recipe_diff(base.to_dict(), split.recipe.to_dict()) == {"quant.sink": (8, 0), "quant.recent": (32, 40)}
    named = parse_variant("long:data.seq_len=512", base)
    assert named.name == "long" and named.recipe.data.seq_len == 512
    assert parse_variant("group_size=8", base).recipe.quant.group_size == 8
    for bad, match in [("grouping", "KEY=VALUE"), ("groupin=head", "not a recipe knob"), ("sink/recent=8", "2 keys"),
                       ("rotation.grouping=layer", "changes nothing"), ("mean=1", "not a recipe knob")]:
        with pytest.raises(EvalError, match=match):
            parse_variant(bad, base)
    with pytest.raises(EvalError) as exc:
        parse_variant("groupin=head", base)
    assert exc.value.hint is not None and "grouping" in exc.value.hint
    with pytest.raises(RecipeError, match="rotation.grouping"):
        parse_variant("rotation.grouping=heads", base)


def test_default_variants_are_valid_single_levers() -> None:
    base = load_recipe(overrides=TINY_RECIPE)
    specs = default_variants(base, native_positions=4096, head_dim=16)
    assert specs[0] == "clip.objective=topk" and "data.seq_len=512" in specs and "sink/recent=0/40" in specs
    for s in specs:
        diff = recipe_diff(base.to_dict(), parse_variant(s, base).recipe.to_dict())
        assert len(diff) == (2 if s.startswith("sink/recent") else 1)
    assert not any("seq_len" in s for s in default_variants(base, native_positions=256, head_dim=16))


def test_evaluation_text_must_be_held_out(tmp_path: Path) -> None:
    folder = prose(tmp_path / "calib")
    with pytest.raises(EvalError, match="would not be held out"):
        check_held_out(str(folder / "essay.txt"), str(folder))
    with pytest.raises(EvalError, match="would not be held out"):
        check_held_out(str(folder / "essay.txt"), str(folder / "essay.txt"))
    check_held_out(str(folder / "essay.txt"), str(tmp_path / "other.txt"))
    check_held_out(str(folder / "essay.txt"), "self")


def test_a_variant_whose_data_holds_the_evaluation_text_is_refused(tmp_path: Path) -> None:
    ablate = _ablate()
    text = prose(tmp_path / "held_out") / "essay.txt"
    args = [a for a in _args(tmp_path) if a not in VARIANTS and a != "--variant"]
    assert ablate.main(args + ["--variant", f"data.source={text}"], loaded=tiny_loaded()) == 1
    assert not (tmp_path / "abl" / "ablation.json").exists()  # refused before any work


def test_ruler_rows_run_every_seed_in_the_chosen_haystack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ablate, loaded = _ablate(), tiny_loaded()
    hay = prose(tmp_path / "hay")
    args = [a for a in _args(tmp_path) if a not in VARIANTS and a != "--variant"] + [
        "--variant", "sink/recent=0/40", "--references", "bf16", "--ruler-ctx", "1k", "--ruler-tasks",
        "niah_single_2", "--ruler-samples", "1", "--ruler-seed", "7,8", "--ruler-haystack-dir", str(hay)]
    assert ablate.main(args, loaded=loaded) == 0, capsys.readouterr().err
    state = json.loads((tmp_path / "abl" / "ablation.json").read_text())
    ev = state["eval"]
    assert ev["ruler_seeds"] == [7, 8] and "ruler_seed" not in ev and ev["ruler_haystack"].startswith("sha256:")
    for name in ("base", "sink/recent=0/40", "bf16"):
        lines = (tmp_path / "abl" / "ruler" / safe_name(name) / "samples.jsonl").read_text().splitlines()
        recs = [json.loads(x) for x in lines]
        assert sorted(r["seed"] for r in recs) == [7, 8]  # one sample per seed
        assert {r["haystack"] for r in recs} == {ev["ruler_haystack"]}
        row = state["rows"].get(name) or state["references"][name]
        assert row["ruler"]["1024"] == pytest.approx(sum(r["score"] for r in recs) / len(recs), abs=0.01)
    capsys.readouterr()
    # the same --out with one of the seeds compares other prompts: refused, nothing rerun
    assert ablate.main([a if a != "7,8" else "7" for a in args], loaded=loaded) == 1
    assert "different eval" in capsys.readouterr().err


@pytest.mark.parametrize(("seeds", "needle"), [("7,x", "non-negative integers"), ("", "non-negative integers"),
                                               ("-1", "non-negative integers"), ("7,7", "repeated")])
def test_bad_ruler_seeds_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], seeds: str,
                                             needle: str) -> None:
    assert _ablate().main(_args(tmp_path, "--ruler-seed", seeds), loaded=tiny_loaded()) == 1
    err = capsys.readouterr().err
    assert "--ruler-seed" in err and needle in err
    assert not (tmp_path / "abl" / "ablation.json").exists()


@pytest.mark.parametrize("seeds", [[42], [7]])
def test_one_seed_keeps_the_eval_key_of_earlier_state_files(seeds: list[int]) -> None:
    from oscar_cli.eval.ablation import AblationConfig

    key = AblationConfig(text="t", ctx=[1024], out="o", ruler_seeds=seeds).eval_key("abc")
    assert key["ruler_seed"] == seeds[0] and "ruler_seeds" not in key and "ruler_haystack" not in key
