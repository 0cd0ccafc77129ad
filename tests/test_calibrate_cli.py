"""End-to-end calibration on tiny random models, bad input, data sources, and the ``oscar calibrate`` command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.calib import RESOLVED, serve_model_to_cli, tiny_recipe
from helpers.tiny import CharTokenizer, tiny_causal_lm
from typer.testing import CliRunner

from oscar_cli.artifact import open_artifact
from oscar_cli.calibration import run as run_mod
from oscar_cli.calibration.data import local_texts, pack, prepare_data
from oscar_cli.calibration.run import calibrate_model, plan_budget
from oscar_cli.errors import ArtifactError, CalibrationError, UnsupportedModelError
from oscar_cli.recipe import load_recipe


@pytest.mark.unit
@pytest.mark.parametrize(
    ("family", "over"),
    [
        ("llama", {}),
        ("qwen3", {"rotation": {"grouping": "head"}, "statistics": {"v_target": "softmax"}}),
        ("qwen2", {"method": "hadamard", "clip": {"mode": "global"}}),
        ("mistral", {"method": "identity", "statistics": {"k_target": "ktk", "v_target": "sv"}}),
        ("llama", {"clip": {"objective": "topk", "topk_keys": 4}}),
    ],
)
def test_calibrate_tiny_models_end_to_end(tmp_path: Path, family: str, over: dict) -> None:
    model = tiny_causal_lm(family, heads=6)
    recipe = tiny_recipe(**over)
    res = calibrate_model(model, None, recipe, reference=f"tiny-{family}", resolved=RESOLVED, out=tmp_path / "a")
    art = open_artifact(res.artifact_path, expect_architecture=res.manifest.architecture)
    n = 2 if recipe.rotation.grouping == "head" else 1
    for layer in art.layers:
        assert layer.k_rotation.shape == (n, 16, 16) and layer.k_mean.shape == (2, 16)
        eye = torch.eye(16)
        assert torch.allclose(layer.k_rotation.transpose(-1, -2) @ layer.k_rotation, eye.expand(n, 16, 16),
                              atol=1e-6)
        if recipe.method == "identity":
            assert torch.equal(layer.k_rotation[0], eye)
        if recipe.clip.mode == "search":
            assert layer.k_clip in recipe.clip.k_grid and layer.v_clip in recipe.clip.v_grid
        else:
            assert (layer.k_clip, layer.v_clip) == (0.96, 0.92)
    m = art.manifest
    assert m.data["tokens"] == 1536 and len(m.data["sha256"]) == 64 and m.method == recipe.method
    assert m.calibration["statistics_tokens"] == 1280 and m.calibration["holdout_tokens"] == 256
    clip_layers = m.calibration["clip"]["layers"]
    assert len(clip_layers) == 2 and all(c["error"] >= 0 for c in clip_layers)
    objective = m.calibration["clip"]["objective"]
    assert ("4 most attended" in objective) == (recipe.clip.objective == "topk"), objective
    assert set(res.timings) == {"data", "capture", "solve", "clip", "write"}


@pytest.mark.unit
def test_oscar_rotation_beats_identity_on_held_out_error(tmp_path: Path) -> None:
    """The calibrated rotation must lower the held-out INT2 attention error versus no rotation."""
    model = tiny_causal_lm("llama")
    with torch.no_grad():  # give keys an outlier channel, as real models have
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight[3::16] *= 8.0
    fixed = {"clip": {"mode": "global", "k_ratio": 0.0, "v_ratio": 0.0}, "rotation": {"center_keys": False,
                                                                                     "center_values": False}}
    errs = {}
    for method in ("identity", "oscar"):
        r = tiny_recipe(method=method, **fixed)
        res = calibrate_model(model, None, r, reference="t", resolved=RESOLVED, out=tmp_path / method)
        errs[method] = sum(s.clip_error or 0.0 for s in res.layers)
    assert errs["oscar"] < errs["identity"]


@pytest.mark.unit
def test_global_clips_without_held_out_tokens_write_valid_json(tmp_path: Path) -> None:
    from oscar_cli.calibration import calibrate_model as lazy

    model = tiny_causal_lm("llama")
    r = tiny_recipe(clip={"mode": "global", "holdout_tokens": 0})
    res = lazy(model, None, r, reference="t", resolved=RESOLVED, out=tmp_path / "g")
    manifest = json.loads((res.artifact_path / "manifest.json").read_text(), parse_constant=lambda c: 1 / 0)
    assert manifest["calibration"]["holdout_tokens"] == 0
    assert all(c["error"] is None for c in manifest["calibration"]["clip"]["layers"])
    assert json.dumps(res.to_dict(), allow_nan=False)


@pytest.mark.unit
def test_bad_input_is_refused_with_reasons(tmp_path: Path) -> None:
    sliding = tiny_causal_lm("mistral")
    sliding.config.sliding_window = 64
    with pytest.raises(UnsupportedModelError, match="sliding"):
        calibrate_model(sliding, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "x")
    odd = tiny_causal_lm("llama", head_dim=12)
    with pytest.raises(CalibrationError, match="head_dim 12 is not a power of two"):
        calibrate_model(odd, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "x")
    res = calibrate_model(odd, None, tiny_recipe(rotation={"composition": "plain"}), reference="t", resolved=RESOLVED,
                          out=tmp_path / "plain")
    assert res.artifact_path.is_dir()
    with pytest.raises(CalibrationError, match="token budget 300 is too small"):
        plan_budget(tiny_recipe(data={"tokens": 300}), 16)
    with pytest.raises(CalibrationError, match="no longer than sink"):
        plan_budget(tiny_recipe(quant={"sink": 200, "recent": 104}), 16)
    with pytest.raises(ArtifactError, match="already exists"):
        calibrate_model(odd, None, tiny_recipe(rotation={"composition": "plain"}), reference="t", resolved=RESOLVED,
                        out=tmp_path / "plain")


@pytest.mark.unit
@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupt_mid_run_leaves_no_artifact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type) -> None:
    model = tiny_causal_lm("llama")
    calls = {"n": 0}
    real = run_mod.run_forward

    def flaky(m: Any, ids: torch.Tensor) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise exc("stop")
        real(m, ids)

    monkeypatch.setattr(run_mod, "run_forward", flaky)
    with pytest.raises(exc):
        calibrate_model(model, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "art")
    assert list(tmp_path.iterdir()) == []
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.unit
def test_local_files_folder_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("hello world " * 40)
    (tmp_path / "d" / "b.jsonl").write_text("\n".join(json.dumps({"text": f"line {i} " * 10}) for i in range(20)))
    texts, ident = local_texts(str(tmp_path / "d"), "text")
    assert len(texts) == 21 and ident["files"] == 2 and len(ident["files_sha256"]) == 64
    cfg = tiny_recipe(data={"source": str(tmp_path / "d"), "seq_len": 64}).data
    data = prepare_data(cfg.source, cfg, model=None, tokenizer=CharTokenizer(), device=torch.device("cpu"), n_seq=4)
    assert data.sequences.shape == (4, 64) and data.identity["tokens"] == 256
    again = prepare_data(cfg.source, cfg, model=None, tokenizer=CharTokenizer(), device=torch.device("cpu"), n_seq=4)
    assert again.identity["sha256"] == data.identity["sha256"]
    with pytest.raises(CalibrationError, match="fewer than"):
        prepare_data(cfg.source, cfg, model=None, tokenizer=CharTokenizer(), device=torch.device("cpu"), n_seq=400)
    (tmp_path / "bad.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(CalibrationError, match="no string field 'text'"):
        local_texts(str(tmp_path / "bad.jsonl"), "text")
    (tmp_path / "d" / "numbers.json").write_text(json.dumps({"speed": 1}))  # data, not text: skipped, recorded
    texts, ident = local_texts(str(tmp_path / "d"), "text")
    assert len(texts) == 21 and ident["skipped_files"] == ["numbers.json"] and ident["files"] == 2
    with pytest.raises(CalibrationError, match="not found"):
        local_texts(str(tmp_path / "missing"), "text")


@pytest.mark.unit
def test_hf_dataset_unavailable_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")

    def offline(*a: Any, **k: Any) -> None:
        raise ConnectionError("Couldn't reach 'nope/none' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    cfg = tiny_recipe(data={"source": "hf:nope/none"}).data
    with pytest.raises(CalibrationError, match="cannot load the dataset 'nope/none'") as info:
        prepare_data(cfg.source, cfg, model=None, tokenizer=CharTokenizer(), device=torch.device("cpu"), n_seq=2)
    assert "cache" in (info.value.hint or "")


@pytest.mark.unit
def test_self_generation_without_tokenizer_reports_tokens_per_second() -> None:
    model = tiny_causal_lm("llama")
    cfg = tiny_recipe(data={"source": "self", "seq_len": 64, "gen_batch_size": 4, "gen_max_new_tokens": 40}).data
    data = prepare_data("self", cfg, model=model, tokenizer=None, device=torch.device("cpu"), n_seq=3)
    assert data.sequences.shape == (3, 64) and data.generated_tokens > 0 and data.tokens_per_second > 0


@pytest.mark.unit
def test_pack() -> None:
    seqs = pack([[1, 2, 3], [4, 5]], 4, 1, eos=9)
    assert seqs.tolist() == [[1, 2, 3, 9]]


@pytest.mark.unit
def test_cli_json_and_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_cli.main import app

    recipe = serve_model_to_cli(monkeypatch, tiny_causal_lm("qwen3"), "tiny-qwen3", tmp_path)
    out = tmp_path / "art"
    args = ["calibrate", "tiny-qwen3", "--recipe", str(recipe), "--tokens", "1536", "--seq-len", "256", "--seed",
            "3", "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["artifact"] == str(out) and len(doc["layers"]) == 2 and doc["data"]["tokens"] == 1536
    # off a terminal (and under --json) progress comes as lines on stderr, one per finished phase at least
    for phase in ("capture", "solve 2/2", "clip search 2/2", "write 1/1"):
        assert f"calibrate: {phase}" in result.stderr, result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["seed"] == 3 and manifest["recipe"]["data"]["seq_len"] == 256
    again = CliRunner().invoke(app, args)
    assert again.exit_code != 0 and isinstance(again.exception, ArtifactError)
    bad = CliRunner().invoke(app, ["calibrate", "tiny-qwen3", "--recipe", str(recipe), "--tokens", "lots"])
    assert bad.exit_code == 2


def test_key_mean_option_sets_the_recipe_knob(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--key-mean rope`` calibrates keys centred by position (the manifest's recipe says so and the artifact holds
    each layer's pre-RoPE mean); anything but constant or rope is a usage error."""
    from oscar_cli.main import app

    recipe = serve_model_to_cli(monkeypatch, tiny_causal_lm("qwen3"), "tiny-qwen3", tmp_path)
    out = tmp_path / "art"
    args = ["calibrate", "tiny-qwen3", "--recipe", str(recipe), "--tokens", "1536", "--seq-len", "256",
            "--out", str(out), "--key-mean", "rope"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["recipe"]["quant"]["key_mean"] == "rope"
    from oscar_cli.artifact import open_artifact

    assert open_artifact(out).layers[0].k_mean_pre is not None
    bad = CliRunner().invoke(app, [*args[:-1], "learned"])
    assert bad.exit_code == 2 and "--key-mean" in bad.output


@pytest.mark.parametrize(("bits", "dtype"), [(8, "uint8"), (16, "bfloat16")])
def test_meta_bits_option_sets_the_metadata_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bits: int,
                                                  dtype: str) -> None:
    """``--meta-bits 8`` writes an artifact whose INT2 rows keep one-byte scale and zero (formula 10): the manifest's
    quant layout says so, the method built from it stores uint8 metadata and counts 8 bits; 12 is a usage error."""
    from oscar_cli.main import app
    from oscar_cli.quant import build_method

    model = tiny_causal_lm("qwen3")
    recipe = serve_model_to_cli(monkeypatch, model, "tiny-qwen3", tmp_path)
    out = tmp_path / "art"
    args = ["calibrate", "tiny-qwen3", "--recipe", str(recipe), "--tokens", "1536", "--seq-len", "256",
            "--out", str(out), "--meta-bits", str(bits)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quant"]["meta_dtype"] == dtype and manifest["recipe"]["quant"]["meta_dtype"] == dtype
    meth = build_method("oscar", model.config, artifact=str(out))
    assert meth.meta_dtype == (torch.uint8 if bits == 8 else torch.bfloat16)
    bad = CliRunner().invoke(app, [*args[:-1], "12"])
    assert bad.exit_code == 2 and "--meta-bits" in bad.output


@pytest.mark.slow
def test_embedded_model_small_budget(tmp_path: Path) -> None:
    """The one test on the embedded model: 2K tokens of the repo's docs through the real command."""
    pytest.importorskip("gguf")
    from oscar_cli.main import app
    from oscar_cli.model import architecture_fingerprint, load_config

    docs = Path(__file__).resolve().parent.parent / "docs"
    out = tmp_path / "smollm2"
    result = CliRunner().invoke(app, ["calibrate", "smollm2-135m", "--data", str(docs), "--tokens", "2k",
                                      "--seq-len", "1024", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["data"]["tokens"] == 2048 and len(doc["layers"]) == 30
    _, config = load_config("smollm2-135m")
    art = open_artifact(out, expect_architecture=architecture_fingerprint(config))
    assert art.layers[0].k_rotation.shape == (1, 64, 64) and art.layers[0].k_mean.shape == (3, 64)
    grid = load_recipe("smollm2-135m").clip
    assert all(layer.k_clip in grid.k_grid and layer.v_clip in grid.v_grid for layer in art.layers)
    # keys of a real model are anisotropic: the target's top eigenvalue is far above the mean
    assert all(s["k_spread"] > 2.0 for s in doc["layers"])
