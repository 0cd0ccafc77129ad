"""Hub model references -> a snapshot directory in the local Hugging Face cache, and its commit sha.

The cache is tried first (``local_files_only``), so a cached model resolves without the network; a missing
or incomplete snapshot is downloaded (config, tokenizer and safetensors files only) unless offline mode
(``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1``) is on. Each failure maps to one actionable line.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from oscar_cli.errors import HubError, ModelResolutionError

logger = logging.getLogger(__name__)

# What a causal LM needs; no *.bin / *.pt / *.gguf / *.onnx duplicates of the same weights.
CONFIG_PATTERNS = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
DOWNLOAD_PATTERNS = [*CONFIG_PATTERNS, "*.safetensors"]
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_SNAPSHOT_RE = re.compile(r"^models--(?P<org>[^/]+?)--(?P<name>[^/]+)$")


def snapshot_identity(path: Path) -> str | None:
    """``ORG/NAME@sha`` when ``path`` is an HF-cache snapshot (``.../models--ORG--NAME/snapshots/<sha>``)."""
    if path.parent.name != "snapshots" or not _SHA_RE.match(path.name):
        return None
    m = _SNAPSHOT_RE.match(path.parent.parent.name)
    return f"{m['org']}/{m['name']}@{path.name}" if m else None


def missing_files(snapshot: Path, weights: bool = True) -> str | None:
    """What a snapshot lacks to be loadable (None when it has config.json and, with ``weights``, every shard)."""
    if not (snapshot / "config.json").is_file():
        return "config.json"
    if not weights:
        return None
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return "a readable model.safetensors.index.json"
        absent = sorted(s for s in shards if not (snapshot / s).is_file())
        return f"{len(absent)} of {len(shards)} weight shards" if absent else None
    if not any(snapshot.glob("*.safetensors")):
        return "safetensors weights"
    return None


def _is_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _cached(repo_id: str, revision: str | None, patterns: list[str], weights: bool) -> tuple[Path | None, str]:
    """The cached snapshot for ``revision`` if complete, else ``(None, why not)`` (no network)."""
    from huggingface_hub import errors as hub_errors
    from huggingface_hub import snapshot_download

    # huggingface_hub >= 2 checks a cached snapshot against the repo's cached file listing filtered by the
    # patterns: the lookup must use the download's patterns, or a partial download counts as incomplete.
    incomplete = getattr(hub_errors, "IncompleteSnapshotError", ())
    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=patterns))
    except incomplete as exc:
        detail = str(exc).split(": ", 1)[-1].split(". ")[0]
        return None, f"incomplete in the local Hugging Face cache ({detail})"
    except hub_errors.LocalEntryNotFoundError:
        return None, "not in the local Hugging Face cache"
    lack = missing_files(path, weights)
    if lack is not None:
        return None, f"incomplete in the local Hugging Face cache (missing {lack})"
    return path, ""


def resolve_hub(repo_id: str, revision: str | None, *, forms_hint: str, weights: bool = True) -> tuple[Path, str]:
    """Return ``(snapshot directory, commit sha)`` for ``repo_id`` at ``revision`` (default ``main``).

    Offline, or for a commit sha, the local cache answers (no network). Online, a branch or tag is looked up
    on the Hub (one request), so ``main`` means today's ``main``; files already cached are not downloaded
    again, and if the Hub cannot be reached huggingface_hub falls back to the cache. ``weights=False``
    needs (and downloads) only the config and tokenizer files.

    Raises:
        ModelResolutionError: not cached while offline, unknown repo or revision, gated, no safetensors.
        HubError: the Hub could not be reached (and nothing cached) or answered with another error.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from oscar_cli.model.loaders import hf_progress

    shown = f"{repo_id}@{revision}" if revision else repo_id
    patterns = DOWNLOAD_PATTERNS if weights else CONFIG_PATTERNS
    problem = "not in the local Hugging Face cache"
    if _is_offline() or (revision is not None and _SHA_RE.match(revision)):
        path, problem = _cached(repo_id, revision, patterns, weights)
        if path is not None:
            return path, path.name
        if _is_offline():
            raise ModelResolutionError(
                f"{shown} is {problem} and offline mode is on (HF_HUB_OFFLINE)",
                hint=f"download it once online (without HF_HUB_OFFLINE), or use {forms_hint}",
            )
    logger.info("resolving %s on the Hugging Face Hub (cached files are reused)", shown)
    try:
        with hf_progress():
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ModelResolutionError(
            f"{repo_id} is gated: accept its license on huggingface.co first",
            hint="then log in: hf auth login (or set HF_TOKEN)",
        ) from None
    except RepositoryNotFoundError:
        raise ModelResolutionError(
            f"no model repo {repo_id} on the Hub (or it is private)",
            hint=f"check the spelling (private repos need HF_TOKEN), or use {forms_hint}",
        ) from None
    except RevisionNotFoundError:
        raise ModelResolutionError(f"revision {revision!r} not found in {repo_id}") from None
    except LocalEntryNotFoundError:
        raise HubError(
            f"{shown} is {problem} and the Hub cannot be reached",
            hint="check the network, or set HF_HUB_OFFLINE=1 and use a cached model, local directory or .gguf",
        ) from None
    except HfHubHTTPError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HubError(f"the Hub failed while fetching {shown}: {first}") from None
    lack = missing_files(path, weights)
    if lack is not None:
        raise ModelResolutionError(
            f"{shown} has no loadable transformers model (missing {lack})",
            hint="oscar loads safetensors repos; for GGUF repos download the .gguf and pass its path",
        )
    if not _SHA_RE.match(path.name):
        raise HubError(f"unexpected snapshot path for {shown}: {path}")
    return path, path.name
