"""``oscar eval-ruler`` end to end on a tiny random model: usage errors, outputs, resume, context limit."""

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
from oscar_cli.errors import OscarError
from oscar_cli.main import app
from oscar_cli.model.rope import apply_yarn

pytestmark = pytest.mark.unit
runner = CliRunner()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--samples", "0"], "--samples"),
        (["--ctx", ""], "empty list of context lengths"),
        (["--tasks", "niah_single_9"], "valid tasks: niah_single_1"),
        (["--methods", "bf16,int3"], "valid methods: bf16, naive-int2, quarot-int2, kivi-2, oscar"),
    ],
)
def test_usage_errors_exit_2(args: list[str], needle: str) -> None:
    res = runner.invoke(app, ["eval-ruler", "tiny", *args])
    assert res.exit_code == 2, res.output
    flat = re.sub(r"\s+", " ", res.stderr.replace("│", " "))
    assert needle in flat, flat


def _run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> dict:
    loaded = tiny_loaded()
    monkeypatch.setattr(models_mod, "load_model", as_loader(loaded))
    hay = prose(tmp_path / "prose")
    args = [
        "--json", "eval-ruler", "tiny", "--tasks", "niah_single_1,niah_multivalue", "--ctx", "1k",
        "--samples", "2", "--methods", "bf16,naive-int2", "--haystack-dir", str(hay), "--out", str(tmp_path / "out"),
        "--max-new-tokens", "6", "--batch-size", "2", *extra,
    ]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output + str(res.exception)
    return json.loads(res.stdout)


def test_run_writes_outputs_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _run(tmp_path, monkeypatch)
    out = tmp_path / "out"
    lines = (out / "samples.jsonl").read_text().splitlines()
    assert first["evaluated"] == 8 and first["resumed"] == 0 and len(lines) == 8
    assert set(first["scores"]) == {"bf16", "naive-int2"}
    assert first["counts"]["bf16"]["niah_multivalue"]["1024"] == 2
    assert first["bpe"]["naive-int2"]["1024"]["formula"] == pytest.approx(2.0 + 32 / 16)
    assert (out / "heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["scores"] == first["scores"]
    rec = json.loads(lines[0])
    assert {"method", "task", "length", "index", "score", "pred", "answers", "prompt_tokens"} <= set(rec)
    assert rec["prompt_tokens"] + 128 <= 1024
    second = _run(tmp_path, monkeypatch)
    assert second["evaluated"] == 0 and second["resumed"] == 8
    assert second["scores"] == first["scores"]
    assert len((out / "samples.jsonl").read_text().splitlines()) == 8


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("seed", [7, 1234])
def test_another_seed_runs_its_own_prompts_beside_the_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    first = _run(tmp_path, monkeypatch)
    assert first["config"]["seed"] == 42
    other = _run(tmp_path, monkeypatch, "--seed", str(seed))
    assert other["evaluated"] == 8 and other["resumed"] == 0 and other["config"]["seed"] == seed
    recs = _records(tmp_path / "out")
    by_seed = {s: {(r["method"], r["task"], r["index"]): r["answers"] for r in recs if r["seed"] == s}
               for s in (42, seed)}
    assert len(recs) == 16 and len(by_seed[42]) == len(by_seed[seed]) == 8
    assert by_seed[42] != by_seed[seed]  # other needles: another set of prompts
    again = _run(tmp_path, monkeypatch)  # each seed's samples resume only for that seed
    assert again["evaluated"] == 0 and again["resumed"] == 8 and again["scores"] == first["scores"]


def test_another_haystack_reruns_the_essay_tasks_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _run(tmp_path, monkeypatch)  # niah_single_1 (noise haystack) and niah_multivalue (essay)
    essay = {r["haystack"] for r in _records(tmp_path / "out") if r["task"] == "niah_multivalue"}
    assert {r["haystack"] for r in _records(tmp_path / "out") if r["task"] == "niah_single_1"} == {""}
    assert len(essay) == 1 and essay.pop().startswith("sha256:") and first["config"]["haystack"].startswith("sha256:")
    (tmp_path / "prose" / "more.txt").write_text("Another text entirely, " * 400, encoding="utf-8")  # _run keeps it
    second = _run(tmp_path, monkeypatch)
    assert second["config"]["haystack"] != first["config"]["haystack"]
    assert second["resumed"] == 4 and second["evaluated"] == 4  # niah_single_1 resumes, niah_multivalue reruns


def test_records_from_before_the_seed_field_resume_as_seed_42(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path, monkeypatch)
    path = tmp_path / "out" / "samples.jsonl"
    legacy = [{k: v for k, v in r.items() if k not in ("seed", "haystack")} for r in _records(tmp_path / "out")]
    path.write_text("".join(json.dumps(r) + "\n" for r in legacy))
    assert _run(tmp_path, monkeypatch)["resumed"] == 8
    assert _run(tmp_path, monkeypatch, "--seed", "5")["resumed"] == 0


def test_length_beyond_context_runs_under_yarn_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = tiny_loaded(max_positions=1024)
    monkeypatch.setattr(models_mod, "load_model", as_loader(loaded))
    args = ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_1", "--ctx", "2k", "--samples", "1",
            "--methods", "bf16", "--out", str(tmp_path), "--max-new-tokens", "2"]  # fmt: skip
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output + str(res.exception)
    out = json.loads(res.stdout)
    assert out["config"]["rope_scaling"] == "yarn" and out["config"]["rope_factor"] == 2.0
    assert loaded.model.config.rope_parameters["rope_type"] == "yarn"
    assert loaded.model.config.max_position_embeddings == 2048
    notes = [ln for ln in res.stderr.splitlines() if "YaRN factor" in ln]
    assert len(notes) == 1 and "YaRN factor 2 (--ctx 2048 is beyond the model's 1024 positions)" in notes[0]
    rec = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert rec["rope"] == "yarn x2"  # part of the resume key: native and YaRN samples never mix


def test_no_rope_scaling_refuses_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models_mod, "load_model", as_loader(tiny_loaded(max_positions=1024)))
    res = runner.invoke(app, ["eval-ruler", "tiny", "--tasks", "niah_single_1", "--ctx", "2k", "--samples", "1",
                              "--methods", "bf16", "--out", str(tmp_path), "--no-rope-scaling"])  # fmt: skip
    assert isinstance(res.exception, OscarError)
    assert "beyond the model's context of 1024 tokens (--no-rope-scaling)" in res.exception.message


def test_apply_yarn_rebuilds_the_rotary_embedding() -> None:
    loaded = tiny_loaded(max_positions=1024)
    before = loaded.model.model.rotary_emb.inv_freq.clone()
    apply_yarn(loaded.model, 2.0)
    assert loaded.model.config.rope_parameters["rope_type"] == "yarn"
    assert loaded.model.config.max_position_embeddings == 2048
    assert not torch.equal(before, loaded.model.model.rotary_emb.inv_freq)
    with pytest.raises(OscarError, match="already uses yarn RoPE scaling"):
        apply_yarn(loaded.model, 2.0)


def test_essay_tasks_run_on_the_shipped_haystack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models_mod, "load_model", as_loader(tiny_loaded()))
    res = runner.invoke(app, ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_2", "--ctx", "1k", "--samples",
                              "1", "--methods", "bf16", "--out", str(tmp_path), "--max-new-tokens", "2"])  # fmt: skip
    assert res.exit_code == 0, res.output + str(res.exception)
    rec = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert 500 < rec["prompt_tokens"] <= 1024 - 128


def test_time_budget_stops_early_and_a_rerun_completes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import oscar_cli.eval.ruler as ruler_mod

    clock = iter(range(0, 10_000, 100))  # every perf_counter() call in ruler advances 100 s: the start, then per
    # batch a deadline check and its two timings, and two for each (task, length) built: the first batch (check 100,
    # build 200-300, batch 400-500) starts within a 450 s budget, the second (check 600) does not
    monkeypatch.setattr(ruler_mod, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    partial = _run(tmp_path, monkeypatch, "--time-budget", "450")
    assert partial["complete"] is False and partial["evaluated"] == 2  # one batch of 2
    monkeypatch.undo()
    rest = _run(tmp_path, monkeypatch)
    assert rest["complete"] is True and rest["resumed"] == partial["evaluated"]
    assert rest["evaluated"] + rest["resumed"] == 8


@pytest.mark.slow
def test_embedded_model_finds_the_needle_through_the_cache(tmp_path: Path) -> None:
    """The one embedded-model check: sample 0 of niah_single_1 at 1K, bf16 through the INT2 cache's path."""
    from oscar_cli.eval.ruler import RulerConfig, run_ruler

    cfg = RulerConfig(
        lengths=[1024], tasks=["niah_single_1"], methods=["bf16"], samples=1, out=str(tmp_path), max_new_tokens=16
    )
    res = run_ruler(cfg)
    rec = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert rec["answers"][0] in rec["pred"], rec
    assert res.scores["bf16"]["niah_single_1"][1024] == 100.0
    assert 1024 - 128 - 40 <= rec["prompt_tokens"] <= 1024 - 128
