"""Read and verify oscar artifact folders. safetensors, JSON and YAML only — never pickle.

Layout of an artifact directory (format v1, docs/DESIGN.md):

- ``rotations.safetensors``: per layer ``i`` — ``layers.{i}.k_rotation`` / ``v_rotation`` float32 ``[N, D, D]``
  (``N = 1`` per layer or ``H_kv`` per head; applied as ``x @ R``), ``layers.{i}.k_mean`` / ``v_mean`` float32
  ``[H_kv, D]`` (rotated space, per KV head; ``[1, D]`` = shared also accepted; zeros when centering is off), ``layers.{i}.k_eigenvalues`` /
  ``v_eigenvalues`` float32 ``[N, D]`` (ascending), ``layers.{i}.k_clip`` / ``v_clip`` float32 ``[1]``.
- ``manifest.json`` (:class:`~oscar_cli.artifact.manifest.Manifest`), ``recipe.yaml``, ``README.md``.

Example::

    art = open_artifact("artifacts/smollm2-135m/smollm2-135m-1a2b3c4d", expect_architecture=fingerprint)
    layer = art.layers[3]
    layer.k_rotation            # [N, D, D] float32
    layer.rotation_per_head("k", art.num_kv_heads)  # [H_kv, D, D] (expanded when N = 1)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from oscar_cli._files import sha256_file
from oscar_cli.artifact.manifest import (
    HASHED_FILES,
    MANIFEST_NAME,
    RECIPE_NAME,
    TENSORS_NAME,
    Manifest,
    architecture_mismatches,
)
from oscar_cli.errors import ArtifactError
from oscar_cli.transform import TRANSFORM_FIELDS, LayerTransform

TENSOR_FIELDS = TRANSFORM_FIELDS  # every field of a layer is stored
ORTHOGONALITY_TOLERANCE_ON_LOAD = 1e-5


@dataclass(frozen=True)
class Artifact:
    """A validated artifact: manifest, recipe and per-layer tensors."""

    path: Path
    manifest: Manifest
    layers: tuple[LayerTransform, ...]
    recipe: dict[str, Any]

    @property
    def method(self) -> str:
        return self.manifest.method

    @property
    def grouping(self) -> str:
        return self.manifest.grouping

    @property
    def num_layers(self) -> int:
        return self.manifest.num_layers

    @property
    def head_dim(self) -> int:
        return self.manifest.head_dim

    @property
    def num_kv_heads(self) -> int:
        return self.manifest.num_kv_heads

    def stacked(self, name: str) -> torch.Tensor:
        """One field for all layers stacked on a new dim 0, e.g. ``stacked("k_rotation") -> [L, N, D, D]``."""
        if name not in TENSOR_FIELDS:
            raise KeyError(f"unknown artifact field {name!r}; fields: {', '.join(TENSOR_FIELDS)}")
        values = [getattr(layer, name) for layer in self.layers]
        if isinstance(values[0], float):
            return torch.tensor(values, dtype=torch.float32)
        return torch.stack(values)

    def check_architecture(self, fingerprint: Mapping[str, Any]) -> None:
        """Raise ArtifactError if ``fingerprint`` (of the model to serve) differs from the artifact's."""
        diffs = architecture_mismatches(self.manifest.architecture, dict(fingerprint))
        if diffs:
            raise ArtifactError(
                f"artifact {self.path} was made for another model ({self.manifest.model['reference']}): "
                + "; ".join(diffs),
                hint="calibrate this model: oscar calibrate MODEL",
            )


def layer_tensors(layers: list[LayerTransform] | tuple[LayerTransform, ...]) -> dict[str, torch.Tensor]:
    """Flatten layers (layer ``i`` = position ``i``) into the safetensors key space (``layers.{i}.<field>``), float32 contiguous CPU."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        for name in TENSOR_FIELDS:
            value = getattr(layer, name)
            if value is None:
                raise ArtifactError(f"layer {i} has no {name}: an artifact stores every field of every layer")
            t = torch.tensor([value], dtype=torch.float32) if isinstance(value, float) else value
            out[f"layers.{i}.{name}"] = t.detach().to("cpu", torch.float32).contiguous()
    return out


def _read_manifest(path: Path) -> Manifest:
    if not path.is_dir():
        raise ArtifactError(f"artifact {path} not found (expected a directory)",
                            hint="run: oscar calibrate MODEL, or pass hf://ORG/NAME@REV")
    mpath = path / MANIFEST_NAME
    if not mpath.is_file():
        raise ArtifactError(f"artifact {path}: {MANIFEST_NAME} is missing (not an oscar artifact?)")
    try:
        data = json.loads(mpath.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"artifact {path}: {MANIFEST_NAME} is not valid JSON ({exc})") from None
    return Manifest.from_dict(data, where=f"{path}/{MANIFEST_NAME}")


def _expected_shapes(m: Manifest) -> dict[str, list[tuple[int, ...]]]:
    """Allowed shapes per tensor. Means may be per KV head ``[H_kv, D]`` (what oscar writes) or shared ``[1, D]``."""
    n, h, d = m.rotations_per_layer, m.num_kv_heads, m.head_dim
    means: list[tuple[int, ...]] = [(h, d), (1, d)] if h != 1 else [(1, d)]
    per: dict[str, list[tuple[int, ...]]] = {"k_rotation": [(n, d, d)], "v_rotation": [(n, d, d)], "k_mean": means, "v_mean": means,
           "k_eigenvalues": [(n, d)], "v_eigenvalues": [(n, d)], "k_clip": [(1,)], "v_clip": [(1,)]}
    return {f"layers.{i}.{k}": s for i in range(m.num_layers) for k, s in per.items()}


def verify_artifact(path: Path | str, *, check_hashes: bool = True) -> Manifest:
    """Validate an artifact directory: manifest, format_version, file hashes, tensor names/shapes/dtypes.

    Returns the manifest. Raises ArtifactVersionError (unknown format_version) or ArtifactError naming the
    file, tensor or field at fault.
    """
    path = Path(path)
    m = _read_manifest(path)
    for name in HASHED_FILES:
        if name not in m.files:
            raise ArtifactError(f"artifact {path}: manifest lists no sha256 for {name}")
    for name, digest in m.files.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"artifact {path}: file {name} is missing")
        if check_hashes and sha256_file(f) != digest:
            raise ArtifactError(
                f"artifact {path}: checksum mismatch for {name} (the file was modified or corrupted)",
                hint="re-download or re-run oscar calibrate",
            )
    _check_tensors(path, m)
    return m


def _check_tensors(path: Path, m: Manifest) -> None:
    from safetensors import safe_open

    expected = _expected_shapes(m)
    try:
        with safe_open(str(path / TENSORS_NAME), framework="pt") as f:
            keys = set(f.keys())
            missing = sorted(set(expected) - keys, key=_natural)
            extra = sorted(keys - set(expected), key=_natural)
            if missing:
                raise ArtifactError(f"artifact {path}: {TENSORS_NAME} lacks {missing[0]}"
                                    + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
            if extra:
                raise ArtifactError(f"artifact {path}: {TENSORS_NAME} has unexpected tensor {extra[0]}")
            for key, shapes in expected.items():
                sl = f.get_slice(key)
                got = tuple(sl.get_shape())
                if got not in shapes or sl.get_dtype() != "F32":
                    raise ArtifactError(
                        f"artifact {path}: tensor {key} has shape {list(got)} {sl.get_dtype()}, expected "
                        f"{' or '.join(str(list(s)) for s in shapes)} F32 (num_layers={m.num_layers}, H_kv={m.num_kv_heads}, "
                        f"head_dim={m.head_dim}, grouping={m.grouping})"
                    )
    except ArtifactError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ArtifactError(f"artifact {path}: {TENSORS_NAME} cannot be read ({exc})") from None


def _natural(key: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def load_artifact(path: Path | str, *, expect_architecture: Mapping[str, Any] | None = None) -> Artifact:
    """Verify and load a local artifact directory (see :func:`open_artifact` for references)."""
    from safetensors.torch import load_file

    path = Path(path)
    m = verify_artifact(path)
    tensors = load_file(str(path / TENSORS_NAME))
    layers = []
    for i in range(m.num_layers):
        t = {name: tensors[f"layers.{i}.{name}"] for name in TENSOR_FIELDS}
        if not all(torch.isfinite(v).all() for v in t.values()):
            raise ArtifactError(f"artifact {path}: layer {i} holds NaN or inf values")
        for which in ("k_rotation", "v_rotation"):
            r = t[which].double()
            err = float((r.transpose(-1, -2) @ r - torch.eye(m.head_dim, dtype=torch.float64)).abs().max())
            if err > ORTHOGONALITY_TOLERANCE_ON_LOAD:
                raise ArtifactError(f"artifact {path}: layers.{i}.{which} is not orthogonal (error {err:.1e})")
        layers.append(LayerTransform(
            k_rotation=t["k_rotation"], v_rotation=t["v_rotation"], k_mean=t["k_mean"],
            v_mean=t["v_mean"], k_eigenvalues=t["k_eigenvalues"], v_eigenvalues=t["v_eigenvalues"],
            k_clip=round(float(t["k_clip"][0]), 6), v_clip=round(float(t["v_clip"][0]), 6),
        ))
    recipe = yaml.safe_load((path / RECIPE_NAME).read_text(encoding="utf-8")) or {}
    art = Artifact(path=path, manifest=m, layers=tuple(layers), recipe=recipe)
    if expect_architecture is not None:
        art.check_architecture(expect_architecture)
    return art
