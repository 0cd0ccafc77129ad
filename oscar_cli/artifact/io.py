"""Read and verify oscar artifact folders. safetensors, JSON and YAML only — never pickle.

Layout of an artifact directory (format v1, docs/DESIGN.md):

- ``rotations.safetensors``: per layer ``i`` — ``layers.{i}.k_rotation`` / ``v_rotation`` float32 ``[N, D, D]``
  (``N = 1`` per layer or ``H_kv`` per head; applied as ``x @ R``), ``layers.{i}.k_mean`` / ``v_mean`` float32
  ``[H_kv, D]`` (rotated space, per KV head; ``[1, D]`` = shared also accepted; zeros when centering is off), ``layers.{i}.k_eigenvalues`` /
  ``v_eigenvalues`` float32 ``[N, D]`` (ascending), ``layers.{i}.k_clip`` / ``v_clip`` float32 ``[1]``; with
  ``quant.key_subspace: m`` in the manifest also ``layers.{i}.k_subspace`` float32 ``[N, D, m]`` (orthonormal
  columns in the rotated space, :mod:`oscar_cli.quant.key_subspace`); with ``quant.key_mean: rope`` also
  ``layers.{i}.k_mean_pre`` float32 ``[H_kv, D]`` (pre-RoPE key mean, unrotated, :mod:`oscar_cli.quant.key_mean`).
- ``manifest.json`` (:class:`~oscar_cli.artifact.manifest.Manifest`), ``recipe.yaml``, ``README.md``.

Example::

    art = open_artifact("artifacts/smollm2-135m/smollm2-135m-1a2b3c4d", expect_architecture=fingerprint)
    layer = art.layers[3]
    layer.k_rotation            # [N, D, D] float32
    layer.rotation_per_head("k", art.num_kv_heads)  # [H_kv, D, D] (expanded when N = 1)
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oscar_cli.artifact.manifest import (
    MANIFEST_NAME,
    RECIPE_NAME,
    TENSORS_NAME,
    Manifest,
    architecture_mismatches,
    content_digest,
)
from oscar_cli.artifact.recovery import recover
from oscar_cli.errors import ArtifactError, OscarError, RecipeError
from oscar_cli.quant.key_subspace import check_basis
from oscar_cli.recipe import read_recipe_yaml, recipe_from_dict
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
            return torch.tensor(values, dtype=torch.float32, device="cpu")
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
            t = torch.tensor([value], dtype=torch.float32, device="cpu") if isinstance(value, float) else value
            out[f"layers.{i}.{name}"] = t.detach().to("cpu", torch.float32).contiguous()
        if layer.k_subspace is not None:  # quant.key_subspace: every layer has one, or none does
            out[f"layers.{i}.k_subspace"] = layer.k_subspace.detach().to("cpu", torch.float32).contiguous()
        if layer.k_mean_pre is not None:  # quant.key_mean rope: every layer has one, or none does
            out[f"layers.{i}.k_mean_pre"] = layer.k_mean_pre.detach().to("cpu", torch.float32).contiguous()
    return out


MAX_MANIFEST_BYTES = 4 << 20
MAX_RECIPE_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_SAFETENSORS_HEADER = 8 << 20


def _read_file(path: Path, name: str, limit: int, links_within: Path | None) -> bytes:
    """The bytes of the artifact file ``path / name``: a regular file, not a symbolic link (unless it is one
    of a Hugging Face cache snapshot pointing into ``links_within``), at most ``limit`` bytes. Refused before
    a byte of it is read or hashed."""
    f = path / name
    try:
        st = os.lstat(f)
    except FileNotFoundError:
        raise ArtifactError(f"artifact {path}: file {name} is missing") from None
    except OSError as exc:
        raise ArtifactError(f"artifact {path}: {name} cannot be read ({exc.strerror})") from None
    flags = os.O_RDONLY | os.O_NOFOLLOW
    if stat.S_ISLNK(st.st_mode):
        target = f.resolve()
        if links_within is None:
            raise ArtifactError(f"artifact {path}: {name} is a symbolic link (an artifact holds its own files)",
                                hint="copy the file into the artifact folder")
        if not target.is_relative_to(links_within.resolve()):
            raise ArtifactError(f"artifact {path}: {name} links outside the cache's blobs (a crafted ETag?)",
                                hint="delete this snapshot from the Hugging Face cache and pull from a host you trust")
        f = target
    try:
        fd = os.open(f, flags)
    except OSError as exc:
        raise ArtifactError(f"artifact {path}: {name} cannot be read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ArtifactError(f"artifact {path}: {name} is not a regular file")
        if st.st_size > limit:
            raise ArtifactError(f"artifact {path}: {name} is {st.st_size} bytes, more than its manifest allows "
                                f"({limit})")
        return fh.read(limit + 1)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value (iterative: no recursion limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_manifest(path: Path, links_within: Path | None = None) -> Manifest:
    """Parse, validate (schema) and check the content digest of ``path/manifest.json``."""
    return _parse_manifest(path, _read_file(path, MANIFEST_NAME, MAX_MANIFEST_BYTES, links_within))


def _parse_manifest(path: Path, raw: bytes) -> Manifest:
    where = f"artifact {path}: {MANIFEST_NAME}"
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise ArtifactError(f"{where} is not UTF-8 text") from None
    except RecursionError:
        raise ArtifactError(f"{where} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, duplicate keys, NaN/Infinity
        raise ArtifactError(f"{where} is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    if _depth(data) > MAX_JSON_DEPTH:
        raise ArtifactError(f"{where} is nested deeper than {MAX_JSON_DEPTH} levels")
    m = Manifest.from_dict(data, where=where)
    if content_digest(data) != data["digest"]:
        raise ArtifactError(f"{where}: content digest mismatch (the manifest was modified after it was written)",
                            hint="re-download the artifact or re-run oscar calibrate")
    return m


def key_subspace(m: Manifest) -> int:
    """The manifest's ``quant.key_subspace`` ``m`` (0: off; then no layer stores ``k_subspace``)."""
    return int(m.quant.get("key_subspace") or 0)


def rope_key_mean(m: Manifest) -> bool:
    """Whether the manifest centres INT2 keys by position (``quant.key_mean: rope``; then every layer stores
    ``k_mean_pre``)."""
    return m.quant.get("key_mean") == "rope"


def _expected_shapes(m: Manifest) -> dict[str, list[tuple[int, ...]]]:
    """Allowed shapes per tensor. Means may be per KV head ``[H_kv, D]`` (what oscar writes) or shared ``[1, D]``."""
    n, h, d = m.rotations_per_layer, m.num_kv_heads, m.head_dim
    means: list[tuple[int, ...]] = [(h, d), (1, d)] if h != 1 else [(1, d)]
    per: dict[str, list[tuple[int, ...]]] = {"k_rotation": [(n, d, d)], "v_rotation": [(n, d, d)], "k_mean": means, "v_mean": means,
           "k_eigenvalues": [(n, d)], "v_eigenvalues": [(n, d)], "k_clip": [(1,)], "v_clip": [(1,)]}
    sub = key_subspace(m)
    if sub:
        per["k_subspace"] = [(n, d, sub)]
    if rope_key_mean(m):
        per["k_mean_pre"] = [(h, d)]
    return {f"layers.{i}.{k}": s for i in range(m.num_layers) for k, s in per.items()}


def _max_tensor_bytes(m: Manifest) -> int:
    """The largest ``rotations.safetensors`` the manifest's sizes allow (float32 data plus a header)."""
    n, h, d = m.rotations_per_layer, m.num_kv_heads, m.head_dim
    per_layer = 2 * n * d * d + (3 if rope_key_mean(m) else 2) * max(h, 1) * d + 2 * n * d + 2 + n * d * key_subspace(m)
    return 8 + MAX_SAFETENSORS_HEADER + 4 * per_layer * m.num_layers


@dataclass(frozen=True)
class VerifiedFolder:
    """What :func:`read_verified` checked: the manifest, the bytes of every file it lists and of itself
    (``blobs[MANIFEST_NAME]``), the recipe."""

    manifest: Manifest
    blobs: dict[str, bytes]
    recipe: dict[str, Any]

    @property
    def tensors(self) -> bytes:
        return self.blobs[TENSORS_NAME]


def read_verified(path: Path | str, *, links_within: Path | None = None) -> VerifiedFolder:
    """Read and verify an artifact folder: manifest (schema, digest), every listed file (plain file, not a
    link, bounded size, sha256), tensor names/shapes/dtypes from the header (before any tensor is allocated)
    and the recipe. ``links_within``: a Hugging Face cache repo folder whose blobs a snapshot's links may
    point to (pulled artifacts); local artifacts never hold links.

    Raises:
        ArtifactVersionError (unknown format_version) or ArtifactError naming the file, tensor or field at fault.
    """
    path = Path(path)
    recover(path)
    if not path.is_dir():
        raise ArtifactError(f"artifact {path} not found (expected a directory)",
                            hint="run: oscar calibrate MODEL, or pass hf://ORG/NAME@REV")
    raw = _read_file(path, MANIFEST_NAME, MAX_MANIFEST_BYTES, links_within)
    m = _parse_manifest(path, raw)
    limits = {TENSORS_NAME: _max_tensor_bytes(m), RECIPE_NAME: MAX_RECIPE_BYTES}
    blobs = {MANIFEST_NAME: raw}
    for name, digest in m.files.items():
        blob = _read_file(path, name, limits.get(name, MAX_RECIPE_BYTES), links_within)
        if hashlib.sha256(blob).hexdigest() != digest:
            raise ArtifactError(
                f"artifact {path}: checksum mismatch for {name} (the file was modified or corrupted)",
                hint="re-download or re-run oscar calibrate",
            )
        blobs[name] = blob
    _check_header(path, m, blobs[TENSORS_NAME])
    return VerifiedFolder(m, blobs, _check_recipe(path, m, blobs[RECIPE_NAME]))


def _check_recipe(path: Path, m: Manifest, blob: bytes) -> dict[str, Any]:
    """``recipe.yaml`` must be a valid recipe equal to the manifest's ``recipe``."""
    try:
        recipe = recipe_from_dict(read_recipe_yaml(blob, RECIPE_NAME)).to_dict()
    except RecipeError as exc:
        raise ArtifactError(f"artifact {path}: {exc.message}") from None
    if recipe != recipe_from_dict(m.recipe).to_dict():
        raise ArtifactError(f"artifact {path}: {RECIPE_NAME} differs from the manifest's recipe")
    return recipe


def verify_artifact(path: Path | str, *, links_within: Path | None = None) -> Manifest:
    """:func:`read_verified` and return the manifest."""
    return read_verified(path, links_within=links_within).manifest


def _header(path: Path, blob: bytes) -> dict[str, Any]:
    bad = f"artifact {path}: {TENSORS_NAME} is not a safetensors file"
    if len(blob) < 8:
        raise ArtifactError(bad)
    (n,) = struct.unpack("<Q", blob[:8])
    if n > min(MAX_SAFETENSORS_HEADER, len(blob) - 8):
        raise ArtifactError(bad + " (header size out of range)")
    try:
        header = json.loads(blob[8 : 8 + n].decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):
        raise ArtifactError(bad + " (unreadable header)") from None
    if not isinstance(header, dict):
        raise ArtifactError(bad + " (unreadable header)")
    header.pop("__metadata__", None)
    return header


def _check_header(path: Path, m: Manifest, blob: bytes) -> None:
    """Tensor names, dtypes and shapes from the safetensors header, against the manifest's sizes."""
    header = _header(path, blob)
    expected = _expected_shapes(m)
    missing = sorted(set(expected) - set(header), key=_natural)
    extra = sorted(set(header) - set(expected), key=_natural)
    if missing:
        raise ArtifactError(f"artifact {path}: {TENSORS_NAME} lacks {missing[0]}"
                            + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise ArtifactError(f"artifact {path}: {TENSORS_NAME} has unexpected tensor {str(extra[0])[:80]}")
    for key, shapes in expected.items():
        info = header[key]
        got = info.get("shape") if isinstance(info, dict) else None
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not isinstance(got, list) or tuple(got) not in shapes or dtype != "F32":
            raise ArtifactError(
                f"artifact {path}: tensor {key} has shape {str(got)[:40]} {str(dtype)[:8]}, expected "
                f"{' or '.join(str(list(s)) for s in shapes)} F32 (num_layers={m.num_layers}, H_kv={m.num_kv_heads}, "
                f"head_dim={m.head_dim}, grouping={m.grouping})"
            )


def _natural(key: str) -> tuple[Any, ...]:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in str(key).split("."))


def load_artifact(
    path: Path | str, *, expect_architecture: Mapping[str, Any] | None = None, links_within: Path | None = None
) -> Artifact:
    """Verify and load a local artifact directory (see ``open_artifact`` for references)."""
    from safetensors.torch import load as load_tensors

    path = Path(path)
    folder = read_verified(path, links_within=links_within)
    m = folder.manifest
    try:
        tensors = load_tensors(folder.tensors)
    except OscarError:
        raise
    except Exception as exc:  # safetensors' own error types for data that does not match its header
        raise ArtifactError(f"artifact {path}: {TENSORS_NAME} cannot be read ({str(exc)[:120]})") from None
    layers = []
    n_sub = key_subspace(m)
    for i in range(m.num_layers):
        t = {name: tensors[f"layers.{i}.{name}"] for name in TENSOR_FIELDS}
        if not all(torch.isfinite(v).all() for v in t.values()):
            raise ArtifactError(f"artifact {path}: layer {i} holds NaN or inf values")
        for which in ("k_rotation", "v_rotation"):
            r = t[which].double()
            err = float((r.transpose(-1, -2) @ r - torch.eye(m.head_dim, dtype=torch.float64, device=r.device)).abs().max())
            if err > ORTHOGONALITY_TOLERANCE_ON_LOAD:
                raise ArtifactError(f"artifact {path}: layers.{i}.{which} is not orthogonal (error {err:.1e})")
        for which in ("k_clip", "v_clip"):
            if not 0.0 <= float(t[which][0]) <= 1.0:
                raise ArtifactError(f"artifact {path}: layers.{i}.{which} = {float(t[which][0]):g} is not in [0, 1]")
        sub = None
        if n_sub:
            sub = tensors[f"layers.{i}.k_subspace"]
            why = None if torch.isfinite(sub).all() else f"layers.{i}.k_subspace holds NaN or inf values"
            why = why or check_basis(sub, n_sub, m.head_dim, f"layers.{i}.k_subspace")
            if why:
                raise ArtifactError(f"artifact {path}: {why}")
        pre = tensors[f"layers.{i}.k_mean_pre"] if rope_key_mean(m) else None
        if pre is not None and not torch.isfinite(pre).all():
            raise ArtifactError(f"artifact {path}: layers.{i}.k_mean_pre holds NaN or inf values")
        layers.append(LayerTransform(
            k_rotation=t["k_rotation"], v_rotation=t["v_rotation"], k_mean=t["k_mean"],
            v_mean=t["v_mean"], k_eigenvalues=t["k_eigenvalues"], v_eigenvalues=t["v_eigenvalues"],
            k_clip=round(float(t["k_clip"][0]), 6), v_clip=round(float(t["v_clip"][0]), 6), k_subspace=sub,
            k_mean_pre=pre,
        ))
    art = Artifact(path=path, manifest=m, layers=tuple(layers), recipe=folder.recipe)
    if expect_architecture is not None:
        art.check_architecture(expect_architecture)
    return art
