"""What ``oscar export`` uploads: exactly the verified files an artifact's manifest lists, plus its model card.

The folder is verified first (:func:`~oscar_cli.artifact.io.read_verified`: schema, digest, every listed file's
sha256, no symbolic links); the staged copies are the verified bytes themselves, so a file swapped after the
check is never uploaded. Anything else in the folder (a stray ``credentials.json``, a link, a hidden file) is
refused with one line naming it, or left out with ``skip_extra``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from oscar_cli._files import sha256_file
from oscar_cli.artifact.card import render_model_card
from oscar_cli.artifact.io import read_verified
from oscar_cli.artifact.manifest import MANIFEST_NAME, README_NAME, sealed
from oscar_cli.errors import ArtifactError

logger = logging.getLogger(__name__)


def extra_entries(path: Path, listed: set[str], *, links_allowed: bool = False) -> list[str]:
    """Entries of the folder ``path`` that are not part of the artifact (sorted): names outside ``listed`` +
    manifest + card, and (unless ``links_allowed``: a Hugging Face cache snapshot) any symbolic link."""
    keep = listed | {MANIFEST_NAME, README_NAME}
    out = []
    with os.scandir(path) as it:
        for entry in it:
            if entry.name not in keep or (entry.is_symlink() and not links_allowed):
                out.append(entry.name)
    return sorted(out)


def stage_artifact(
    path: Path,
    repo_id: str,
    staging: Path,
    *,
    evaluation: Any = None,
    skip_extra: bool = False,
    links_within: Path | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Write the upload of the artifact at ``path`` into the empty folder ``staging``.

    ``evaluation`` (``evaluation.evaluation_from_ruler``) goes into the staged manifest, which is then sealed
    with a new digest; otherwise the manifest is staged byte for byte. Returns the staged manifest and the
    file list (``path``, ``size``, ``sha256``).

    Raises:
        ArtifactError: the artifact fails verification, or the folder holds a file it does not list.
    """
    folder = read_verified(path, links_within=links_within)
    extras = extra_entries(path, set(folder.manifest.files), links_allowed=links_within is not None)
    if extras and not skip_extra:
        raise ArtifactError(
            f"artifact {path}: {extras[0]} is not part of the artifact"
            + (f" (+{len(extras) - 1} more)" if len(extras) > 1 else "")
            + "; export uploads only the files its manifest lists",
            hint="remove it from the folder, or pass --skip-extra to leave it out",
        )
    if extras:
        logger.warning("leaving out %d file(s) the manifest does not list: %s", len(extras), ", ".join(extras))
    manifest = folder.manifest
    for name, blob in folder.blobs.items():
        (staging / name).write_bytes(blob)
    if evaluation is not None:
        manifest = sealed(dataclasses.replace(manifest, evaluation=evaluation))
        (staging / MANIFEST_NAME).write_text(_json(manifest.to_dict()), encoding="utf-8")
    staged = manifest.to_dict()
    (staging / README_NAME).write_text(render_model_card(staged, repo_id), encoding="utf-8")
    read_verified(staging)  # what is uploaded is itself a valid artifact
    files = [
        {"path": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(staging.iterdir()) if p.is_file()
    ]
    return staged, files


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2) + "\n"
