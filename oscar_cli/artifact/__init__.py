"""oscar artifacts: a versioned directory of rotations, means and clip ratios for one model (format v1).

Public API::

    from oscar_cli.artifact import open_artifact, verify_artifact, write_artifact
    art = open_artifact("artifacts/smollm2-135m/smollm2-135m-1a2b3c4d")   # or "hf://ORG/NAME@REV"
    art.layers[i].k_rotation   # [N, D, D] float32, N = 1 (per layer) or H_kv (per head)

``hub.py`` (push/pull) is imported lazily by :func:`open_artifact` for ``hf://`` references.
"""

from __future__ import annotations

from oscar_cli.artifact.io import (
    Artifact,
    load_artifact,
    open_artifact,
    sha256_file,
    update_manifest,
    verify_artifact,
    write_artifact,
)
from oscar_cli.artifact.manifest import FORMAT_VERSION, Manifest, model_slug, render_model_card

__all__ = [
    "FORMAT_VERSION",
    "Artifact",
    "Manifest",
    "load_artifact",
    "model_slug",
    "open_artifact",
    "render_model_card",
    "sha256_file",
    "update_manifest",
    "verify_artifact",
    "write_artifact",
]
