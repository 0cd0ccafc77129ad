"""Write oscar artifacts atomically: a hidden temp folder beside the target, renamed into place when complete.

Example::

    write_artifact("artifacts/smollm2-135m/try1", manifest, layers, recipe.to_yaml())
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from oscar_cli._files import atomic_write_json, atomic_write_text, sha256_file
from oscar_cli.artifact.card import render_model_card
from oscar_cli.artifact.io import layer_tensors, verify_artifact
from oscar_cli.artifact.manifest import HASHED_FILES, MANIFEST_NAME, README_NAME, RECIPE_NAME, TENSORS_NAME, Manifest
from oscar_cli.errors import ArtifactError
from oscar_cli.transform import LayerTransform


def _clean_stale_temps(parent: Path, name: str) -> None:
    """Remove leftovers of earlier interrupted writes of ``name`` (hidden ``.<name>.tmp-*`` folders)."""
    if not parent.is_dir():
        return
    for p in parent.glob(f".{name}.tmp-*"):
        try:
            pid = int(p.name.rsplit("-", 2)[-2])
        except (ValueError, IndexError):
            continue
        if pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_artifact(
    out: Path | str,
    manifest: Manifest,
    layers: list[LayerTransform] | tuple[LayerTransform, ...],
    recipe_yaml: str,
    *,
    overwrite: bool = False,
) -> Path:
    """Write an artifact directory atomically: everything goes to a hidden temp folder beside ``out``,
    which is renamed into place only when complete (Ctrl-C or an error removes it; a killed process's
    leftover is removed by the next write). ``manifest.files`` is filled with the sha256 of each file and
    ``README.md`` is the model card rendered from the final manifest.

    Raises:
        ArtifactError: ``out`` exists and ``overwrite`` is False.
    """
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and not overwrite:
        raise ArtifactError(f"artifact path {out} already exists", hint="pass --overwrite or choose --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clean_stale_temps(out.parent, out.name)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        save_file(layer_tensors(layers), str(tmp / TENSORS_NAME), metadata={"format": "oscar-artifact-v1"})
        atomic_write_text(tmp / RECIPE_NAME, recipe_yaml)
        files = {name: sha256_file(tmp / name) for name in HASHED_FILES}
        final = replace(manifest, files=files)
        final.validate()
        atomic_write_json(tmp / MANIFEST_NAME, final.to_dict())
        atomic_write_text(tmp / README_NAME, render_model_card(final.to_dict()))
        verify_artifact(tmp)
        if out.exists():
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.replace(out, trash)
            os.replace(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def update_manifest(path: Path | str, **changes: Any) -> Manifest:
    """Rewrite ``manifest.json`` with ``changes`` (e.g. ``evaluation={...}``) and re-hash every file.

    For ``oscar export`` after it completes ``README.md``. Atomic (temp file + rename).
    """
    path = Path(path)
    current = verify_artifact(path, check_hashes=False)
    files = {name: sha256_file(path / name) for name in current.files}
    new = replace(current, files=files, **changes)
    new.validate()
    atomic_write_json(path / MANIFEST_NAME, new.to_dict())
    return new
