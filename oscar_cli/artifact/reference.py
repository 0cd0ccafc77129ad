"""Open an artifact by reference: a local directory, or ``hf://ORG/NAME[@REV]`` (pulled into the HF cache first).

Example::

    art = open_artifact("hf://my-org/smollm2-135m-oscar@v0.1.0", expect_architecture=model.config)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oscar_cli.artifact import hub
from oscar_cli.artifact.io import Artifact, load_artifact
from oscar_cli.model import architecture_fingerprint


def open_artifact(ref: str | Path, *, expect_architecture: Mapping[str, Any] | Any | None = None) -> Artifact:
    """Open an artifact by reference: a local directory, or ``hf://ORG/NAME[@REV]`` (pulled through
    ``oscar_cli.artifact.hub.pull_artifact``). ``expect_architecture`` is a fingerprint dict or a
    transformers config; a mismatch raises ArtifactError naming the differing fields."""
    links_within = None
    if isinstance(ref, str) and hub.is_hub_ref(ref):
        path = Path(hub.pull_artifact(ref))
        links_within = hub.snapshot_blobs(path)  # a cache snapshot: its files are links into the repo's blobs
    else:
        path = Path(ref)
    fingerprint = expect_architecture
    if fingerprint is not None and not isinstance(fingerprint, Mapping):
        fingerprint = architecture_fingerprint(fingerprint)
    return load_artifact(path, expect_architecture=fingerprint, links_within=links_within)
