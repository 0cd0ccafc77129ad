"""Write oscar artifacts race-free: a private temp folder beside the target, renamed into place under a lock.

1. :func:`check_output` (also called before calibration starts) refuses an ``--out`` that cannot be written:
   below a regular file, in a folder without write permission, an existing path without ``overwrite``, or, with
   ``overwrite``, anything but a folder holding only an oscar artifact (a regular file, a symlink, a folder of
   other files).
2. The files are written into ``.<name>.tmp-<pid>-<random>`` (``mkdtemp``: created exclusively), hashed, the
   manifest gets ``files`` and its ``digest``, the card is rendered, and the folder is verified like a download.
3. Under an exclusive ``flock`` on the parent folder: leftovers of a crash are repaired (:func:`recover`), the
   target is checked again (another writer may have finished meanwhile: then this one fails, one line), and the
   temp folder is renamed into place; with ``overwrite`` the old artifact is first renamed to
   ``.<name>.old-<random>`` and removed after the swap. A crash between the two renames leaves that ``.old``
   folder, which the next write or load of the same path puts back (target missing) or removes (target present).

Modes: files ``0o666`` and folders ``0o777`` minus the umask, like any file the user creates.

Example::

    write_artifact("artifacts/smollm2-135m/try1", manifest, layers, recipe.to_yaml())
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from oscar_cli._files import atomic_write_json, atomic_write_text, new_file_mode, new_folder_mode, sha256_file
from oscar_cli.artifact.card import render_model_card
from oscar_cli.artifact.io import layer_tensors, verify_artifact
from oscar_cli.artifact.manifest import (
    HASHED_FILES,
    MANIFEST_NAME,
    README_NAME,
    RECIPE_NAME,
    TENSORS_NAME,
    Manifest,
    sealed,
)
from oscar_cli.artifact.recovery import locked, recover
from oscar_cli.errors import ArtifactError
from oscar_cli.transform import LayerTransform

DEFAULT_ROOT = Path("artifacts")
ARTIFACT_NAMES = frozenset((MANIFEST_NAME, README_NAME, *HASHED_FILES))


def _first_existing(path: Path) -> Path:
    p = path
    while not p.exists() and not p.is_symlink() and p != p.parent:
        p = p.parent
    return p


def check_output(out: Path | str | None, overwrite: bool) -> None:
    """Refuse (one-line ArtifactError) an output path the artifact cannot be written to; see the module docstring.

    ``out=None`` checks the default root ``artifacts/`` only (the folder name is known after the data).
    """
    target = Path(out) if out is not None else DEFAULT_ROOT / "x"
    existing = _first_existing(target.parent)
    if not existing.is_dir():
        raise ArtifactError(f"--out {target}: {existing} is a file, not a folder", hint="choose another --out")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ArtifactError(f"--out {target}: cannot write in {existing} (permission denied)",
                            hint="choose a folder you can write to with --out")
    if out is None or not (target.exists() or target.is_symlink()):
        return
    if not overwrite:
        raise ArtifactError(f"artifact path {target} already exists", hint="pass --overwrite or choose --out")
    why = _not_an_artifact(target)
    if why:
        raise ArtifactError(f"--overwrite refuses to replace {target}: {why}",
                            hint="--overwrite only replaces an oscar artifact folder; choose another --out")


def _not_an_artifact(path: Path) -> str | None:
    """Why ``path`` is not a folder holding only an oscar artifact (None when it is one)."""
    if path.is_symlink():
        return "it is a symbolic link"
    if not path.is_dir():
        return "it is a file, not an artifact folder"
    names = {p.name for p in path.iterdir()}
    if MANIFEST_NAME not in names:
        return f"it holds no {MANIFEST_NAME} (not an oscar artifact)"
    other = sorted(names - ARTIFACT_NAMES)
    if other:
        return f"it holds {other[0]}, which is not part of an oscar artifact"
    return None


def write_artifact(
    out: Path | str,
    manifest: Manifest,
    layers: list[LayerTransform] | tuple[LayerTransform, ...],
    recipe_yaml: str,
    *,
    overwrite: bool = False,
) -> Path:
    """Write an artifact folder (see the module docstring); returns ``out``.

    ``manifest.files`` gets the sha256 of each file and ``manifest.digest`` the content digest; ``README.md``
    is the model card rendered from that final manifest.

    Raises:
        ArtifactError: ``out`` cannot be written (:func:`check_output`), or another writer created it first.
    """
    from safetensors.torch import save_file

    out = Path(out)
    check_output(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover(out)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-{os.getpid()}-"))
    try:
        os.chmod(tmp, new_folder_mode())  # mkdtemp's 0o700 would make the artifact private
        save_file(layer_tensors(layers), str(tmp / TENSORS_NAME), metadata={"format": "oscar-artifact-v1"})
        os.chmod(tmp / TENSORS_NAME, new_file_mode())
        atomic_write_text(tmp / RECIPE_NAME, recipe_yaml)
        final = sealed(replace(manifest, files={name: sha256_file(tmp / name) for name in HASHED_FILES}))
        atomic_write_json(tmp / MANIFEST_NAME, final.to_dict())
        atomic_write_text(tmp / README_NAME, render_model_card(final.to_dict()))
        verify_artifact(tmp)
        with locked(out.parent):
            _publish(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    """The renames, under the parent's lock."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ArtifactError(f"artifact path {out} already exists (another process wrote it meanwhile)",
                                hint="pass --overwrite or choose --out")
        why = _not_an_artifact(out)
        if why:
            raise ArtifactError(f"--overwrite refuses to replace {out}: {why}")
        trash = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.old-"))
        os.replace(out, trash)
        os.replace(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out)


def update_manifest(path: Path | str, **changes: Any) -> Manifest:
    """Verify the artifact at ``path``, then rewrite its ``manifest.json`` with ``changes`` (e.g.
    ``evaluation={...}``) and a new digest (atomic: temp file + rename)."""
    path = Path(path)
    new = sealed(replace(verify_artifact(path), **changes))
    atomic_write_json(path / MANIFEST_NAME, new.to_dict())
    return new

