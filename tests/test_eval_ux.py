"""``oscar eval-ruler`` / ``eval-kl`` as users type them: one-line errors for bad input, progress and run-size lines
off a terminal, the default method list without an artifact, and artifacts whose only difference is RoPE."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.tiny import tiny_loaded

import oscar_cli.model as models_mod
from oscar_cli.calibration.run import calibrate_model
from oscar_cli.eval.kl import cut_windows
from oscar_cli.eval.progress import RunProgress, chunk_progress, fmt_seconds
from oscar_cli.main import main
from oscar_cli.model.rope import MAX_YARN_FACTOR, apply_yarn, plan_yarn
from oscar_cli.recipe import load_recipe

pytestmark = pytest.mark.unit

TINY_RECIPE = {"data": {"source": "random", "tokens": 1536, "seq_len": 256, "batch_size": 2},
               "clip": {"holdout_tokens": 256, "holdout_queries": 48}, "quant": {"sink": 8, "recent": 32}}  # fmt: skip


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the console entry point; (exit code, stdout, stderr)."""
    code: Any = 0
    try:
        main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return (code if isinstance(code, int) else 1), out, err


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The tiny model with 1024 positions; every load_model() call gets a fresh copy (YaRN changes it)."""
    loaded = tiny_loaded(max_positions=1024)
    monkeypatch.setattr(models_mod, "load_model", lambda *a, **k: tiny_loaded(max_positions=1024))
    monkeypatch.delenv("OSCAR_DEBUG", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return loaded


def _one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code, _, err = _main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    return lines[0]


def _text(path: Path, words: int) -> Path:
    path.write_text(" ".join(f"w{i % 97}" for i in range(words)), encoding="utf-8")
    return path


RULER = ["eval-ruler", "tiny", "--tasks", "niah_single_1", "--ctx", "1k", "--samples", "1", "--methods", "bf16"]


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--out", "FILE"], "is a file, not a folder"),
        (["--haystack-dir", "/nonexistent/prose"], "--haystack-dir /nonexistent/prose: no such folder"),
        (["--haystack-dir", "FILE"], "is a file, not a folder"),
        (["--backend", "triton", "--device", "cpu"], "--backend triton needs a CUDA device; this run is on cpu"),
        (["--ctx", "64k"], "needs YaRN factor 64 over the model's 1024 positions; YaRN is supported up to factor 32"),
        (["--ctx", "4k", "--rope-factor", "2"], "--ctx 4096 is beyond 1024 × 2 = 2048 positions of YaRN"),
    ],
)
def test_eval_ruler_bad_input_is_one_line(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    afile = tmp_path / "a-file.txt"
    afile.write_text("x")
    extra = [str(afile) if e == "FILE" else e for e in extra]
    argv = [*RULER, "--out", str(tmp_path / "out"), *extra]  # a repeated option: the last one counts
    line = _one_line_error(argv, capsys)
    assert needle in line, line
    assert not (tmp_path / "out" / "samples.jsonl").exists()  # refused before anything ran


@pytest.mark.parametrize(
    ("content", "extra", "needle"),
    [
        (b"\x7fELF\x02\x01\x01\0\0\0" + bytes(range(256)) * 20, [], "is a binary file"),
        ("café ".encode("latin-1") * 500, [], "is not UTF-8 text (invalid byte at offset 3)"),
        (None, ["--windows", "1000", "--ctx", "256", "--tokens", "16"], "--windows 1000 of 256 + 16 tokens do not fit"),
        (None, ["--backend", "triton", "--device", "cpu"], "--backend triton needs a CUDA device"),
    ],
)
def test_eval_kl_bad_input_is_one_line(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, extra: list[str], needle: str
) -> None:
    text = tmp_path / "t.txt"
    if content is None:
        _text(text, 1700)  # ~5,000 characters: tokens of the character-level tokenizer
    else:
        text.write_bytes(content)
    line = _one_line_error(["eval-kl", "tiny", "--text", str(text), "--methods", "kivi-2", *extra], capsys)
    assert needle in line, line


def test_windows_must_not_score_the_same_positions_twice() -> None:
    ids = list(range(5000))
    assert cut_windows(ids, 1000, 64, 62).shape == (62, 1064)  # starts 1 + (5000 - 1064) // 64 = 62 apart by >= 64
    for windows in (63, 1000):
        with pytest.raises(Exception, match="at most 62 fit"):
            cut_windows(ids, 1000, 64, windows)


def test_yarn_plan() -> None:
    assert plan_yarn(32768, 131072, None, None) == 4.0  # Qwen2.5's documented factor for 128K
    assert plan_yarn(8192, 131072, None, None) == 16.0
    assert plan_yarn(32768, 32768, None, None) is None
    assert plan_yarn(32768, 40000, None, None) == 2.0
    assert plan_yarn(1024, 1024, "yarn", 4.0) == 4.0  # asked for explicitly
    assert MAX_YARN_FACTOR == 32
    with pytest.raises(Exception, match="unknown --rope-scaling 'ntk'"):
        plan_yarn(1024, 2048, "ntk", None)
    with pytest.raises(Exception, match="YaRN needs a factor above 1"):
        plan_yarn(1024, 1024, "yarn", 1.0)


def test_run_size_estimate_and_progress_lines_off_a_terminal(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_1", "--ctx", "1k", "--samples", "3",
            "--methods", "bf16,kivi-2", "--out", str(tmp_path), "--batch-size", "2", "--max-new-tokens", "2"]  # fmt: skip
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    json.loads(out)  # stdout holds only the result
    lines = [ln for ln in err.splitlines() if ln.startswith("eval-ruler: ")]
    assert "eval-ruler: 1 tasks × 3 samples × 1 lengths × 2 methods = 6 samples" in lines
    assert any(ln.startswith("eval-ruler: on cpu this is about ") and "GFLOP/s measured here" in ln for ln in lines)
    assert "eval-ruler: oscar is left out" not in err  # --methods was given
    batches = [ln for ln in lines if " samples (" in ln and "elapsed" in ln]
    assert [ln.split(" samples")[0] for ln in batches] == ["eval-ruler: 2/6", "eval-ruler: 3/6", "eval-ruler: 5/6",
                                                           "eval-ruler: 6/6"]  # fmt: skip
    assert "ETA" in batches[0] and "ETA" not in batches[-1]
    assert sum(ln.startswith("eval-ruler: estimate: about ") for ln in lines) == 1
    built = [i for i, ln in enumerate(lines) if ln.startswith("eval-ruler: building prompts: niah_single_1 @ 1024 (")]
    size = lines.index("eval-ruler: 1 tasks × 3 samples × 1 lengths × 2 methods = 6 samples")
    cost = next(i for i, ln in enumerate(lines) if ln.startswith("eval-ruler: on cpu this is about "))
    assert len(built) == 1 and size < cost < built[0] < lines.index(batches[0])  # built once, for both methods
    code, _, err = _main(argv, capsys)  # resumed: nothing left to run, nothing built
    assert code == 0 and "= 6 samples (6 already in" in err and "on cpu this is about" not in err
    assert "building" not in err


def test_first_sample_alone_off_a_terminal(tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No --batch-size: the first line comes after one sample, with no ETA (it says the next batch gives one), and
    the estimate after the next batch; a run of one sample has one line and no estimate."""
    argv = ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_1", "--ctx", "1k", "--samples", "3",
            "--methods", "bf16,kivi-2", "--out", str(tmp_path / "a"), "--max-new-tokens", "2"]  # fmt: skip
    code, _, err = _main(argv, capsys)
    assert code == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("eval-ruler: ")]
    batches = [ln for ln in lines if " samples (" in ln and "elapsed" in ln]
    assert [ln.split(" samples")[0] for ln in batches] == ["eval-ruler: 1/6", "eval-ruler: 3/6", "eval-ruler: 6/6"]
    assert ", ETA after the next batch (a first sample run alone, one-time warm-up included) — bf16 @ 1k: 1 in " \
        in batches[0]
    assert ", ETA " in batches[1] and "after the next batch" not in batches[1]
    estimates = [ln for ln in lines if ln.startswith("eval-ruler: estimate: about ")]
    assert len(estimates) == 1 and estimates[0].endswith("more for the 3 samples left")
    assert lines.index(batches[0]) < lines.index(batches[1]) < lines.index(estimates[0])
    one = [*argv[:7], "--samples", "1", "--methods", "bf16", "--out", str(tmp_path / "b"), "--max-new-tokens", "2"]
    code, _, err = _main(one, capsys)
    assert code == 0, err
    batches = [ln for ln in err.splitlines() if " samples (" in ln and "elapsed" in ln]
    assert len(batches) == 1 and batches[0].startswith("eval-ruler: 1/1 samples (100 %), ") and "ETA" not in err
    assert "estimate" not in err


def test_eta_leaves_out_what_came_before_and_a_lone_first_sample(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The rate counts from the first measured batch's start; a lone first sample gives no ETA and is dropped from
    the rate once the next batch finished (the time between them, building, is kept)."""
    from types import SimpleNamespace

    from oscar_cli.eval import progress as progress_mod

    now = [0.0]
    monkeypatch.setattr(progress_mod, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    report = RunProgress("eval-ruler", 17, 1700)
    now[0] = 10.0  # 6 s of building, then one sample alone in 4 s: 4 s per 100 tokens, 1600 left
    report.batch_done(1, 100, 4.0, "bf16 @ 100", alone=True)
    now[0] = 22.0  # 2 s of building, then 8 samples in 10 s: 12 s per 800 tokens, 800 left
    report.batch_done(8, 100, 10.0, "bf16 @ 100")
    now[0] = 32.0
    report.batch_done(8, 100, 10.0, "bf16 @ 100")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "eval-ruler: 1/17 samples (6 %), 10 s elapsed, ETA after the next batch (a first sample run alone, one-time "
        "warm-up included) — bf16 @ 100: 1 in 4 s",
        "eval-ruler: 9/17 samples (53 %), 22 s elapsed, ETA 12 s — bf16 @ 100: 8 in 10 s",
        "eval-ruler: estimate: about 12 s more for the 8 samples left",
        "eval-ruler: 17/17 samples (100 %), 32 s elapsed — bf16 @ 100: 8 in 10 s",
    ]
    now[0] = 0.0
    report = RunProgress("eval-ruler", 9, 900)
    now[0] = 10.0  # a whole first batch: 8 s for 800 tokens (the 2 s before it are not extrapolated), 100 left
    report.batch_done(8, 100, 8.0, "bf16 @ 100")
    assert capsys.readouterr().err.splitlines() == [
        "eval-ruler: 8/9 samples (89 %), 10 s elapsed, ETA 1 s — bf16 @ 100: 8 in 8 s",
        "eval-ruler: estimate: about 1 s more for the 1 samples left",
    ]


def test_no_artifact_default_leaves_oscar_out_with_a_note(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_1", "--ctx", "1k", "--samples", "1",
            "--out", str(tmp_path), "--max-new-tokens", "1", "--batch-size", "1"]  # fmt: skip
    code, out, err = _main(argv, capsys)
    assert code == 0, err
    res = json.loads(out)
    assert res["config"]["methods"] == ["bf16", "naive-int2", "quarot-int2", "kivi-2"]
    assert any("oscar is left out: no --artifact given" in n for n in res["notes"])
    assert "oscar is left out" in err


def test_chunk_progress_inside_a_long_batch(tiny: Any, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from oscar_cli.eval import progress as progress_mod
    from oscar_cli.quant import greedy_generate, left_pad, use_method
    from oscar_cli.quant.methods import bf16_method

    report = RunProgress("eval-ruler", 1, 300)
    progress_mod.LONG_BATCH_TOKENS, saved = 200, progress_mod.LONG_BATCH_TOKENS
    try:
        with use_method(tiny.model, bf16_method()) as session:
            ids, mask = left_pad([[5 + i % 100 for i in range(300)]], 0, torch.device("cpu"))
            with chunk_progress(tiny.model, report, ids.shape[1], "bf16 @ 300"):
                greedy_generate(tiny.model, session.new_cache(), ids, mask, 3, [4], chunk_size=128)
    finally:
        progress_mod.LONG_BATCH_TOKENS = saved
    err = capsys.readouterr().err
    chunks = [ln.split(" tokens")[0] for ln in err.splitlines() if "prefill" in ln]
    assert chunks == ["eval-ruler: bf16 @ 300: prefill 128/300", "eval-ruler: bf16 @ 300: prefill 256/300",
                      "eval-ruler: bf16 @ 300: prefill 300/300"]  # fmt: skip; decode steps are not counted


def test_fmt_seconds() -> None:
    assert [fmt_seconds(s) for s in (4.2, 65, 7300, 5.7e7)] == ["4 s", "1 min 05 s", "2 h 01 min", "660 days"]


def _artifact(tmp_path: Path, loaded: Any, resolved: str, yarn: float | None = None) -> Path:
    import copy

    model = copy.deepcopy(loaded.model)
    if yarn:
        apply_yarn(model, yarn)
    res = calibrate_model(model, None, load_recipe(overrides=TINY_RECIPE), reference="tiny", resolved=resolved,
                          out=tmp_path / f"art-{yarn}-{resolved[-4:]}")  # fmt: skip
    return Path(res.artifact_path)


def test_an_artifact_differing_only_in_rope_is_accepted_for_the_same_weights(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    same = _artifact(tmp_path, tiny, tiny.identity.resolved)
    other = _artifact(tmp_path, tiny, "sha256:" + "2" * 64)
    under_yarn = _artifact(tmp_path, tiny, tiny.identity.resolved, yarn=2.0)
    base = ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_1", "--samples", "1", "--methods", "oscar",
            "--max-new-tokens", "1", "--batch-size", "1"]  # fmt: skip
    code, out, err = _main([*base, "--ctx", "1536", "--artifact", str(same), "--out", str(tmp_path / "o1")], capsys)
    assert code == 0, err
    notes = json.loads(out)["notes"]
    assert any("was calibrated with default RoPE; using it under yarn RoPE (same weights" in n for n in notes), notes
    mismatch = [n for n in notes if "was calibrated with" in n]
    assert len(mismatch) == 1 and "measured no worse than one recalibrated under YaRN" in mismatch[0], notes
    assert "--rope-scaling yarn --rope-factor F" in mismatch[0]
    line = _one_line_error([*base[1:], "--ctx", "1536", "--artifact", str(other), "--out", str(tmp_path / "o2")], capsys)
    assert "was made for another model" in line and "rope_type" in line
    code, out, err = _main([*base, "--ctx", "1536", "--artifact", str(under_yarn), "--out", str(tmp_path / "o3")], capsys)
    assert code == 0 and not any("calibrated with" in n for n in json.loads(out)["notes"]), err


@pytest.mark.parametrize("change", ["quant.sink", "calibration.layers"])
def test_an_artifact_rewritten_in_place_does_not_resume_the_old_answers(
    tiny: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    """The same path and the same rotations file, served otherwise (another sink, or a layer served as BF16):
    eval-ruler reruns its samples instead of resuming the old artifact's, and the summary counts only new ones."""
    from dataclasses import replace

    from oscar_cli.artifact import load_artifact, write_artifact
    from oscar_cli.artifact.manifest import RECIPE_NAME

    art = _artifact(tmp_path, tiny, tiny.identity.resolved)
    argv = ["--json", "eval-ruler", "tiny", "--tasks", "niah_single_1", "--samples", "2", "--methods", "bf16,oscar",
            "--ctx", "1k", "--max-new-tokens", "1", "--batch-size", "2", "--artifact", str(art),
            "--out", str(tmp_path / "o")]  # fmt: skip
    code, out, err = _main(argv, capsys)
    assert code == 0 and json.loads(out)["evaluated"] == 4, err
    code, out, err = _main(argv, capsys)
    assert code == 0 and json.loads(out)["resumed"] == 4, err
    old = load_artifact(art)
    m = old.manifest
    if change == "quant.sink":
        m = replace(m, quant={**m.quant, "sink": m.quant["sink"] + 8})
    else:
        rows = [{"index": i, "scheme": "bf16" if i == 0 else "oscar"} for i in range(m.num_layers)]
        m = replace(m, calibration={**m.calibration, "layers": rows})
    write_artifact(art, m, old.layers, (art / RECIPE_NAME).read_text(), overwrite=True)
    assert load_artifact(art).manifest.files["rotations.safetensors"] == old.manifest.files["rotations.safetensors"]
    code, out, err = _main(argv, capsys)
    doc = json.loads(out)
    assert code == 0 and doc["resumed"] == 2 and doc["evaluated"] == 2, err  # bf16 resumed, oscar rerun
    assert doc["counts"]["oscar"]["niah_single_1"]["1024"] == 2
    recs = [json.loads(x) for x in (tmp_path / "o" / "samples.jsonl").read_text().splitlines()]
    oscar = [r for r in recs if r["method"] == "oscar"]
    assert len(oscar) == 4 and len({r["artifact_serving"] for r in oscar}) == 2
    assert {r["artifact_serving"] for r in recs if r["method"] == "bf16"} == {""}


def test_a_constant_key_mean_is_scaled_by_yarns_attention_factor(tiny: Any, tmp_path: Path) -> None:
    """An artifact calibrated under plain RoPE, served under YaRN: its constant key means times YaRN's cos/sin factor
    (0.1·ln F + 1 for factor F), everything else as calibrated; the note says so and names the measurement."""
    import copy
    import math

    from oscar_cli.eval.prepare import KEY_MEAN_YARN_MEASUREMENT, build_methods
    from oscar_cli.model.rope import attention_scaling
    from oscar_cli.quant import build_method

    art = _artifact(tmp_path, tiny, tiny.identity.resolved)
    plain = build_method("oscar", tiny.model.config, str(art), None)
    model = copy.deepcopy(tiny.model)
    apply_yarn(model, 4.0)
    a = attention_scaling(model.config)
    assert a == pytest.approx(0.1 * math.log(4.0) + 1) and attention_scaling(tiny.model.config) == 1.0
    methods, notes = build_methods(["oscar"], model.config, str(art), None, resolved=tiny.identity.resolved)
    got = methods["oscar"]
    assert any(t.k_mean is not None for t in plain.layers)
    for p, g in zip(plain.layers, got.layers, strict=True):
        assert (p.k_mean is None) == (g.k_mean is None)
        if p.k_mean is not None:
            assert torch.allclose(g.k_mean, p.k_mean * a, rtol=1e-6, atol=0)
        assert torch.equal(g.v_mean, p.v_mean) and torch.equal(g.k_rotation, p.k_rotation) and g.k_clip == p.k_clip
    assert len(notes) == 1 and f"scaled by YaRN's attention factor {a:.4g}" in notes[0]
    assert KEY_MEAN_YARN_MEASUREMENT in notes[0]


def test_the_rope_mismatch_note_states_what_was_measured() -> None:
    from oscar_cli.eval.prepare import YARN_ARTIFACT_MEASUREMENT, rope_mismatch_note

    forward = rope_mismatch_note("ART", "default", "yarn")
    assert "measured no worse than one recalibrated under YaRN" in forward and YARN_ARTIFACT_MEASUREMENT in forward
    backward = rope_mismatch_note("ART", "yarn", "default")  # calibrated under YaRN, run without it: not measured
    assert "not measured in this direction" in backward and "measured no worse" not in backward
    assert (Path(__file__).parents[1] / "docs" / "RESULTS.md").read_text().count(
        "## YaRN: the same artifact or one recalibrated under YaRN"
    ) == 1  # the section the note points to
    scaled = rope_mismatch_note("ART", "default", "yarn", 1.1386)
    assert "constant key mean scaled by YaRN's attention factor 1.139" in scaled
    assert (Path(__file__).parents[1] / "docs" / "RESULTS.md").read_text().count(
        "## A constant key mean under YaRN"
    ) == 1


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--rope-scaling", "yarn"], "calibrating under YaRN needs both --rope-scaling yarn and --rope-factor F"),
        (["--rope-factor", "4"], "calibrating under YaRN needs both"),
    ],
)
def test_calibrate_rope_options_need_each_other(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, extra: list[str], needle: str
) -> None:
    monkeypatch.delenv("OSCAR_DEBUG", raising=False)
    code, _, err = _main(["calibrate", "smollm2-135m", *extra], capsys)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 1 and len(lines) == 1 and needle in lines[0], err


def test_calibrate_under_yarn_records_it_in_the_artifact(tiny_model_dir: Path, tmp_path: Path, oscar_cache: Path) -> None:
    """``oscar calibrate --rope-scaling yarn --rope-factor 2``: the model is calibrated under YaRN and the artifact's
    fingerprint says so (eval-ruler then uses it under YaRN without a note)."""
    from oscar_cli.artifact import open_artifact
    from oscar_cli.calibration.run import calibrate

    recipe = load_recipe(overrides={**TINY_RECIPE, "data": {**TINY_RECIPE["data"], "seq_len": 128}})
    res = calibrate(str(tiny_model_dir), recipe=recipe, out=tmp_path / "art", rope_scaling="yarn", rope_factor=2.0)
    manifest = open_artifact(res.artifact_path).manifest
    assert manifest.architecture["rope_type"] == "yarn" and manifest.architecture["max_position_embeddings"] == 512
