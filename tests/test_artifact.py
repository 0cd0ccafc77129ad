"""Artifact format v1: atomic write, validated open, precise refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from oscar_cli.artifact import (
    Manifest,
    open_artifact,
    update_manifest,
    verify_artifact,
    write_artifact,
)
from oscar_cli.artifact.manifest import content_digest, model_slug
from oscar_cli.errors import ArtifactError, ArtifactVersionError
from oscar_cli.transform import LayerTransform

pytestmark = pytest.mark.unit

L, HQ, HKV, D = 2, 4, 2, 16
ARCH = {"model_type": "llama", "num_layers": L, "num_attention_heads": HQ, "num_key_value_heads": HKV,
        "head_dim": D, "rope_type": "default", "rope_theta": 10000.0, "max_position_embeddings": 512}


def _layers(n: int = 1, seed: int = 0) -> list[LayerTransform]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        rk = torch.linalg.qr(torch.randn(n, D, D, generator=g, dtype=torch.float64))[0].float()
        rv = torch.linalg.qr(torch.randn(n, D, D, generator=g, dtype=torch.float64))[0].float()
        out.append(LayerTransform(rk, rv, torch.randn(HKV, D, generator=g), torch.randn(HKV, D, generator=g),
                                  torch.rand(n, D, generator=g).sort().values, torch.rand(n, D).sort().values,
                                  0.96, 0.92))
    return out


def _manifest(grouping: str = "layer") -> Manifest:
    return Manifest(oscar_version="0.1.0", model={"reference": "tiny", "resolved": "sha256:" + "0" * 64},
                    architecture=dict(ARCH), method="oscar", grouping=grouping, recipe={"name": "t"},
                    quant={"group_size": None, "meta_dtype": "bfloat16", "sink": 8, "recent": 16},
                    data={"source": "self", "sha256": "1" * 64, "tokens": 100}, seed=0,
                    calibration={"clip": {"mode": "global"}})


def _write(tmp_path: Path, grouping: str = "layer", **kw: object) -> Path:
    n = 1 if grouping == "layer" else HKV
    m = _manifest(grouping)
    return write_artifact(tmp_path / "art", m, _layers(n), "name: t\n", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("grouping", ["layer", "head"])
def test_round_trip(tmp_path: Path, grouping: str) -> None:
    path = _write(tmp_path, grouping)
    assert sorted(p.name for p in path.iterdir()) == ["README.md", "manifest.json", "recipe.yaml",
                                                      "rotations.safetensors"]
    art = open_artifact(path, expect_architecture=ARCH)
    n = 1 if grouping == "layer" else HKV
    src = _layers(n)
    assert len(art.layers) == L and art.grouping == grouping
    for a, b in zip(art.layers, src, strict=True):
        assert torch.equal(a.k_rotation, b.k_rotation) and torch.equal(a.v_mean, b.v_mean)
        assert a.k_clip == pytest.approx(0.96) and a.v_clip == pytest.approx(0.92)
        assert a.rotation_per_head("k", HKV).shape == (HKV, D, D)
        assert a.mean_per_head("v", HKV).shape == (HKV, D)
    assert art.stacked("k_rotation").shape == (L, n, D, D)
    assert art.stacked("k_clip").shape == (L,)
    assert art.recipe["name"] == "t" and art.recipe["quant"]["sink"] == 64  # the full resolved recipe
    m = verify_artifact(path)
    assert m["model"]["reference"] == "tiny" and dict(m)["format_version"] == 1
    assert set(m.files) == {"rotations.safetensors", "recipe.yaml"}
    assert not list(tmp_path.glob(".*"))  # no temp leftovers


def test_existing_path_refused_unless_overwrite(tmp_path: Path) -> None:
    _write(tmp_path)
    with pytest.raises(ArtifactError, match="already exists"):
        _write(tmp_path)
    _write(tmp_path, overwrite=True)
    verify_artifact(tmp_path / "art")
    assert not list(tmp_path.glob(".*"))


@pytest.mark.parametrize("exc", [KeyboardInterrupt, RuntimeError])
def test_interrupted_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exc: type) -> None:
    import safetensors.torch

    def fail(*a: object, **k: object) -> None:
        raise exc("interrupted")

    monkeypatch.setattr(safetensors.torch, "save_file", fail)
    with pytest.raises(exc):
        _write(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_of_a_dead_process_is_cleaned(tmp_path: Path) -> None:
    stale = tmp_path / ".art.tmp-999999999-deadbeef"
    stale.mkdir()
    _write(tmp_path)
    assert not stale.exists()


def test_checksum_mismatch(tmp_path: Path) -> None:
    path = _write(tmp_path)
    (path / "recipe.yaml").write_text("name: tampered\n")
    with pytest.raises(ArtifactError, match="checksum mismatch for recipe.yaml"):
        open_artifact(path)


def test_unknown_format_version(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = json.loads((path / "manifest.json").read_text())
    data["format_version"] = 7
    (path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactVersionError, match="format_version 7 is not supported"):
        open_artifact(path)


def _reseal(path: Path, data: dict) -> None:
    """Write ``data`` as the manifest with a matching digest (what a hostile supplier can do)."""
    data["digest"] = content_digest(data)
    (path / "manifest.json").write_text(json.dumps(data))


def test_wrong_shapes(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = json.loads((path / "manifest.json").read_text())
    data["grouping"] = "head"  # claims [H_kv, D, D] rotations; the file holds [1, D, D]
    _reseal(path, data)
    with pytest.raises(ArtifactError, match=r"layers\.0\.k_rotation has shape \[1, 16, 16\]"):
        open_artifact(path)


def test_another_model_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path)
    other = dict(ARCH, num_layers=30, head_dim=64)
    with pytest.raises(ArtifactError, match="made for another model.*num_layers: artifact 2, model 30"):
        open_artifact(path, expect_architecture=other)


def test_missing_and_malformed(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        open_artifact(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        open_artifact(tmp_path / "empty")
    path = _write(tmp_path)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        open_artifact(path)


def test_hf_refs_are_delegated_to_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from oscar_cli.artifact import hub

    path = _write(tmp_path)
    seen = []
    monkeypatch.setattr(hub, "pull_artifact", lambda ref, *a, **k: seen.append(ref) or path)
    art = open_artifact("hf://org/name@v1")
    assert seen == ["hf://org/name@v1"] and art.path == path


def test_update_manifest_reseals_and_keeps_unknown_fields(tmp_path: Path) -> None:
    path = _write(tmp_path)
    data = json.loads((path / "manifest.json").read_text())
    data["license"] = "apache-2.0"
    _reseal(path, data)
    m = update_manifest(path, evaluation={"niah": 0.9})
    assert m.extra["license"] == "apache-2.0"
    again = verify_artifact(path)
    assert again.evaluation == {"niah": 0.9} and again.get("license") == "apache-2.0"
    assert again.digest == again.content_digest() != data["digest"]
    (path / "recipe.yaml").write_text("name: t2\n")  # a tampered file is never re-hashed into a new digest
    with pytest.raises(ArtifactError, match="checksum mismatch for recipe.yaml"):
        update_manifest(path, evaluation=None)


def test_export_helpers_fixture_artifact_is_accepted(tmp_path: Path) -> None:
    from helpers.fakehub import artifacts as fixtures  # tests/ is on sys.path (conftest.py)

    path = fixtures.make_artifact(tmp_path, 0)
    art = open_artifact(path)
    assert art.layers[0].mean_per_head("k", art.num_kv_heads).shape == (art.num_kv_heads, art.head_dim)


def test_model_slug() -> None:
    assert model_slug("Qwen/Qwen3-8B@main") == "qwen3-8b"
    assert model_slug("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
    assert model_slug("smollm2-135m") == "smollm2-135m"
    assert os.sep not in model_slug("a/b/c")


@pytest.mark.unit
@pytest.mark.parametrize("default_device", ["meta", "cpu"])
def test_artifact_loads_under_another_default_device(tmp_path: Path, default_device: str) -> None:
    """vLLM builds its layers under a CUDA default device and reads the artifact there: the loader's own tensors
    (orthogonality check, clip ratios) must not follow the default device (``meta`` stands in for CUDA on CPU)."""
    from helpers.fakehub.artifacts import make_artifact
    from helpers.tiny import tiny_config

    from oscar_cli.quant.methods import oscar_from_artifact

    art = make_artifact(tmp_path, 0)
    with torch.device(default_device):
        method = oscar_from_artifact(str(art), tiny_config())
    layer = method.layers[0]
    assert layer.k_rotation is not None and layer.k_rotation.device.type == "cpu"
