"""Calibration inputs for tests: seeded random rotations / layer transforms and a tiny recipe.

``TINY_RECIPE``: recipe overrides that calibrate a tiny model in about a second (1,536 random tokens, sequences
of 256, sink 8, recent 32); ``tiny_recipe(**over)`` loads it (``over``: further sections to replace).
``RESOLVED``: a placeholder model identity for ``calibrate_model``. ``rewrite_tensors(folder, edit)``: edit an
artifact's tensors and re-sign its manifest; ``check_tampered_tensor``: layer 0's copy broken, then layer 1's
removed, each refused on load.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from oscar_cli.quant import LayerTransform
from oscar_cli.recipe import load_recipe

RESOLVED = "sha256:" + "0" * 64
TINY_RECIPE = {"data": {"source": "random", "tokens": 1536, "seq_len": 256, "batch_size": 2},
               "clip": {"holdout_tokens": 256, "holdout_queries": 48}, "quant": {"sink": 8, "recent": 32}}


def tiny_recipe(**over: Any) -> Any:
    r = load_recipe(overrides=TINY_RECIPE)
    return r.replace(over) if over else r


def random_orthogonal(n: int, d: int, seed: int) -> torch.Tensor:
    """``n`` seeded random orthogonal ``d x d`` matrices (float32, QR with a sign fix)."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)).float()


def random_transform(seed: int, n: int = 1, clip: float = 0.9, d: int = 16) -> LayerTransform:
    """A seeded random layer transform: ``n`` rotations of ``d x d``, small means, one clip ratio."""
    g = torch.Generator().manual_seed(seed + 100)
    return LayerTransform(
        k_rotation=random_orthogonal(n, d, seed),
        v_rotation=random_orthogonal(n, d, seed + 1),
        k_mean=0.1 * torch.randn(n, d, generator=g),
        v_mean=0.1 * torch.randn(n, d, generator=g),
        k_clip=clip,
        v_clip=clip,
    )


def serve_model_to_cli(monkeypatch: Any, model: Any, reference: str, folder: Path) -> Path:
    """Make ``oscar calibrate REFERENCE`` load ``model`` (no files, no Hub) and write the tiny recipe under
    ``folder``; returns the recipe file."""
    import oscar_cli.model as models

    ident = SimpleNamespace(reference=reference, resolved=RESOLVED)
    monkeypatch.setattr(models, "load_config", lambda ref, revision=None: (ident, model.config))
    monkeypatch.setattr(models, "load_model", lambda ref, **k: SimpleNamespace(model=model, tokenizer=None,
                                                                               identity=ident))
    recipe = folder / "tiny.yaml"
    recipe.write_text(load_recipe(overrides=TINY_RECIPE).to_yaml())
    return recipe


def rewrite_tensors(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Edit ``rotations.safetensors`` and re-sign the manifest as oscar would (digest and file hash)."""
    import hashlib

    from safetensors.torch import load_file, save_file

    from oscar_cli.artifact.manifest import content_digest

    tensors = load_file(str(folder / "rotations.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "rotations.safetensors"))
    man = json.loads((folder / "manifest.json").read_text())
    man["files"]["rotations.safetensors"] = hashlib.sha256((folder / "rotations.safetensors").read_bytes()).hexdigest()
    man["digest"] = content_digest(man)
    (folder / "manifest.json").write_text(json.dumps(man))


def check_tampered_tensor(folder: Path, name: str, broken: Any, message: str) -> None:
    """An artifact whose ``layers.0.<name>`` is replaced by ``broken(tensor)`` is refused with ``message`` (a
    regex), and one whose ``layers.1.<name>`` is missing with "lacks layers.1.<name>" (both re-signed)."""
    import pytest

    from oscar_cli.artifact import open_artifact
    from oscar_cli.errors import ArtifactError

    def edit(t: dict) -> None:
        t[f"layers.0.{name}"] = broken(t[f"layers.0.{name}"])

    rewrite_tensors(folder, edit)
    with pytest.raises(ArtifactError, match=message):
        open_artifact(folder)
    rewrite_tensors(folder, lambda t: t.pop(f"layers.1.{name}"))
    with pytest.raises(ArtifactError, match=rf"lacks layers.1.{name}"):
        open_artifact(folder)


def copy_chosen_pair(tmp_path: Path, monkeypatch: Any, quant: dict[str, Any], count: int) -> tuple[Any, ...]:
    """Calibrate a 4-layer tiny llama plainly (``tmp_path/p``) and with ``quant`` (``tmp_path/a``), every row
    counted as peaked (``copy_score.SHARP`` 0: the random model has no focused heads); returns ``(model, plain,
    result, manifest of a, the count layers the copy score chooses)``."""
    from helpers.tiny import tiny_causal_lm
    from oscar_cli.calibration import copy_score
    from oscar_cli.calibration.copy_score import CopyScore, choose_key_layers
    from oscar_cli.calibration.run import calibrate_model

    monkeypatch.setattr(copy_score, "SHARP", 0.0)
    model = tiny_causal_lm("llama", layers=4)
    plain = calibrate_model(model, None, tiny_recipe(), reference="t", resolved=RESOLVED, out=tmp_path / "p")
    res = calibrate_model(model, None, tiny_recipe(quant=quant), reference="t", resolved=RESOLVED, out=tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    copies = [row["copy"] for row in manifest["calibration"]["layers"]]
    want = choose_key_layers([CopyScore(c["rows"], c["peaked"], c["flipped"]) for c in copies], count, ["oscar"] * 4)
    return model, plain, res, manifest, want
