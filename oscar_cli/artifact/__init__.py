"""oscar artifacts: a versioned directory of rotations, means and clip ratios for one model (format v1).

Public API::

    from oscar_cli.artifact import open_artifact, verify_artifact, write_artifact
    art = open_artifact("artifacts/smollm2-135m/smollm2-135m-1a2b3c4d")   # or "hf://ORG/NAME@REV"
    art.layers[i].k_rotation   # [N, D, D] float32, N = 1 (per layer) or H_kv (per head)

Modules, each importing only those above it: ``schema`` (pydantic schema of the manifest), ``manifest`` (the
manifest, its content digest), ``card`` (the model card), ``recovery`` (repair after a crashed write), ``io``
(read and verify a folder), ``write`` (race-free writes), ``build`` (the manifest of a calibration run),
``evaluation`` (eval results for the card), ``staging`` (what export uploads), ``hub`` (push/pull),
``reference`` (open a local path or an ``hf://`` reference).
"""

from __future__ import annotations

from oscar_cli.artifact.build import build_manifest
from oscar_cli.artifact.card import render_model_card
from oscar_cli.artifact.io import Artifact, load_artifact, verify_artifact
from oscar_cli.artifact.manifest import FORMAT_VERSION, Manifest, model_slug
from oscar_cli.artifact.reference import open_artifact
from oscar_cli.artifact.write import check_output, update_manifest, write_artifact

__all__ = [
    "FORMAT_VERSION",
    "Artifact",
    "Manifest",
    "build_manifest",
    "check_output",
    "load_artifact",
    "model_slug",
    "open_artifact",
    "render_model_card",
    "update_manifest",
    "verify_artifact",
    "write_artifact",
]
