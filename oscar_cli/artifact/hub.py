"""oscar artifacts on the Hugging Face Hub: publish (``push_artifact``), fetch (``pull_artifact``), ``hf://`` refs.

A reference is ``hf://ORG/NAME@REV`` (``REV`` = a tag, a branch or a 40-hex commit sha; the sha is the only
immutable pin). ``oscar pull`` also accepts it without the scheme. Publishing is

1. verify the artifact (schema, content digest, sha256 of every listed file, tensors) and stage exactly the files
   its manifest lists plus the rendered card in a temporary directory (:mod:`~oscar_cli.artifact.staging`; a
   folder holding anything else is refused unless ``skip_extra``; the artifact directory is never modified);
3. ``create_repo`` if missing; refuse early if ``--tag`` exists with other content;
4. ``upload_folder`` to ``main`` (``parent_commit`` = the head seen in 3, ``delete_patterns="*"`` so the repo
   mirrors the artifact); unchanged files are skipped by the client, and an identical artifact makes no commit;
5. ``create_tag(revision=<that commit>)``: the tag names exactly the uploaded commit, never a later ``main``.
   The commit and tag messages carry the artifact's content digest, as does the card.

Pulling (:func:`pull_artifact`) fetches ``manifest.json`` first, verifies it (schema, digest; optionally against
an expected digest), then fetches only the files it lists plus the card, and verifies every one of them.

A failure before 5 leaves no tag; every Hub/network failure becomes one :class:`HubError` line. The token
(``--token``, else ``HF_TOKEN``, else the ``hf auth login`` file) is passed to ``huggingface_hub`` only.
"""

from __future__ import annotations

import hashlib
import logging
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oscar_cli._version import __version__
from oscar_cli.artifact.hub_errors import TOKEN_HINT, hub_errors, quiet_hub_logs
from oscar_cli.artifact.io import read_manifest, verify_artifact
from oscar_cli.artifact.manifest import MANIFEST_NAME, README_NAME
from oscar_cli.artifact.staging import stage_artifact
from oscar_cli.errors import ArtifactError, HubError

logger = logging.getLogger(__name__)

HF_SCHEME = "hf://"
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REPO_ID_RE = re.compile(rf"^{_PART}/{_PART}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


@dataclass(frozen=True)
class HubRef:
    """A parsed artifact reference on the Hub: ``repo_id`` (``ORG/NAME``) and an optional ``revision``."""

    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return f"{HF_SCHEME}{self.repo_id}" + (f"@{self.revision}" if self.revision else "")

    @property
    def pinned(self) -> bool:
        """True when the revision is a full commit sha (immutable)."""
        return self.revision is not None and SHA_RE.match(self.revision) is not None


def is_hub_ref(ref: object) -> bool:
    """True for ``hf://...`` strings: the form ``open_artifact`` hands to :func:`pull_artifact`."""
    return isinstance(ref, str) and ref.startswith(HF_SCHEME)


def validate_repo_id(repo_id: str) -> str:
    """Return ``repo_id`` if it is ``ORG/NAME`` with Hub-legal parts; raise :class:`HubError` otherwise."""
    if not (
        isinstance(repo_id, str)
        and _REPO_ID_RE.match(repo_id)
        and len(repo_id) <= 96
        and "--" not in repo_id
        and ".." not in repo_id
    ):
        raise HubError(
            f"invalid Hub repo id {repo_id!r}: expected ORG/NAME (letters, digits, '-', '_', '.')",
            hint="e.g. my-org/smollm2-135m-oscar",
        )
    return repo_id


def validate_tag(tag: str) -> str:
    """Return ``tag`` if usable as a release tag (not a sha, not ``main``); raise :class:`HubError` otherwise."""
    if not _TAG_RE.match(tag) or SHA_RE.match(tag) or tag in ("main", "HEAD") or ".." in tag:
        raise HubError(f"invalid tag {tag!r}: use a version such as v0.1.0", hint="tags match [A-Za-z0-9._+-]+")
    return tag


def parse_hub_ref(ref: str) -> HubRef:
    """Parse ``hf://ORG/NAME[@REV]`` or ``ORG/NAME[@REV]``; raise :class:`HubError` on anything else."""
    body = ref[len(HF_SCHEME):] if ref.startswith(HF_SCHEME) else ref
    repo_id, sep, revision = body.partition("@")
    if sep and not revision.strip():
        raise HubError(f"empty revision in {ref!r}", hint="use ORG/NAME@v0.1.0 or ORG/NAME@<40-hex sha>")
    if sep and (any(c.isspace() for c in revision) or revision.startswith("-")):
        raise HubError(f"invalid revision {revision!r} in {ref!r}")
    return HubRef(validate_repo_id(repo_id), revision if sep else None)


# -- publishing ---------------------------------------------------------------------------------------------
@dataclass
class PushResult:
    """What ``push_artifact`` did (or, with ``dry_run``, would do)."""

    repo_id: str
    commit: str | None
    tag: str | None
    files: list[dict[str, Any]] = field(default_factory=list)
    created_repo: bool = False
    created_commit: bool = False
    created_tag: bool = False
    dry_run: bool = False
    private: bool = False
    endpoint: str = ""
    digest: str = ""

    @property
    def ref(self) -> str:
        """``ORG/NAME@sha`` (the pinned reference), or ``ORG/NAME`` on a dry run."""
        return f"{self.repo_id}@{self.commit}" if self.commit else self.repo_id

    def to_dict(self) -> dict[str, Any]:
        return {
            "ref": self.ref, "repo_id": self.repo_id, "commit": self.commit, "tag": self.tag,
            "url": f"{self.endpoint}/{self.repo_id}" if self.endpoint else None,
            "created_repo": self.created_repo, "created_commit": self.created_commit,
            "created_tag": self.created_tag, "dry_run": self.dry_run, "private": self.private, "digest": self.digest,
            "files": self.files,
        }


def git_blob_sha1(path: Path) -> str:
    """The git blob SHA-1 of a file (the ``oid`` the Hub reports for non-LFS files)."""
    h = hashlib.sha1(usedforsecurity=False)
    h.update(f"blob {path.stat().st_size}\0".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def checked_manifest(path: Path, links_within: Path | None = None) -> dict[str, Any]:
    """Verify an artifact folder (:func:`~oscar_cli.artifact.io.verify_artifact`: schema, digest, sha256 of
    every listed file, no links, tensor names/shapes/dtypes) and return its manifest as a dict.

    Raises:
        ArtifactError / ArtifactVersionError: naming the file, tensor or field at fault.
    """
    return verify_artifact(path, links_within=links_within).to_dict()


def make_api(token: str | None, endpoint: str | None) -> Any:
    """An ``HfApi`` for ``endpoint`` (default: ``HF_ENDPOINT`` / huggingface.co) tagged with oscar's user agent."""
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint, token=token, library_name="oscar-kv", library_version=__version__)


def resolve_token(token: str | None) -> str | None:
    """``--token``, else ``HF_TOKEN`` / the ``hf auth login`` file (via ``huggingface_hub.get_token``)."""
    if token:
        return token
    from huggingface_hub import get_token

    try:
        return get_token()
    except Exception as exc:  # the OIDC exchange (HF_OIDC_RESOURCE, CI Trusted Publishers) can fail
        raise HubError(f"could not obtain a Hub token ({type(exc).__name__})", hint=TOKEN_HINT) from None


def push_artifact(
    path: str | Path,
    repo_id: str,
    *,
    tag: str | None = None,
    private: bool = False,
    token: str | None = None,
    endpoint: str | None = None,
    dry_run: bool = False,
    commit_message: str | None = None,
    evaluation: dict[str, Any] | None = None,
    skip_extra: bool = False,
) -> PushResult:
    """Validate the artifact at ``path`` and publish it to ``repo_id`` (see the module docstring).

    ``evaluation`` (see ``evaluation.evaluation_from_ruler``) is written into the *published* manifest and
    card; the local artifact directory is never modified. ``skip_extra`` leaves out files of the folder that the
    manifest does not list (by default they are refused).

    Returns:
        A :class:`PushResult`; ``commit`` is the sha now holding exactly these files (``None`` on a dry run).

    Raises:
        HubError: bad repo id or tag, no token, tag exists with other content, auth/network/server failure.
        ArtifactError: the artifact is missing or fails validation.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import RepositoryNotFoundError

    validate_repo_id(repo_id)
    if tag is not None:
        validate_tag(tag)
    links_within = None
    if is_hub_ref(str(path)):  # re-publish a released artifact (e.g. to another org): pull it first
        path = pull_artifact(str(path), token=token, endpoint=endpoint)
        links_within = snapshot_blobs(Path(path))
    path = Path(path)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    result = PushResult(repo_id=repo_id, commit=None, tag=tag, dry_run=dry_run, private=private, endpoint=endpoint)
    with tempfile.TemporaryDirectory(prefix="oscar-export-") as tmp:
        staging = Path(tmp)
        manifest, result.files = stage_artifact(path, repo_id, staging, evaluation=evaluation,
                                                skip_extra=skip_extra, links_within=links_within)
        result.digest = manifest["digest"]
        if dry_run:
            return result
        token = resolve_token(token)
        if not token:
            raise HubError("publishing needs a Hugging Face token with write access", hint=TOKEN_HINT)
        api = make_api(token, endpoint)
        with quiet_hub_logs(), hub_errors("export", repo_id, endpoint):
            try:
                api.repo_info(repo_id)
            except RepositoryNotFoundError:
                api.create_repo(repo_id, private=private, exist_ok=True)
                result.created_repo = True
                logger.info("created %s repo %s", "private" if private else "public", repo_id)
            else:
                if private:
                    logger.warning("%s already exists: --private does not change its visibility", repo_id)
            refs = api.list_repo_refs(repo_id)
            head = next((b.target_commit for b in refs.branches if b.name == "main"), None)
            existing = next((t.target_commit for t in refs.tags if t.name == tag), None) if tag else None
            if existing is not None:
                return _existing_tag(api, result, staging, existing)
            message = commit_message or _commit_message(manifest, tag)
            info = api.upload_folder(
                repo_id=repo_id, folder_path=staging, commit_message=message, revision="main",
                parent_commit=head, delete_patterns="*",
            )
        result.commit = info.oid
        result.created_commit = info.oid != head
        if tag is not None:
            with quiet_hub_logs(), hub_errors(
                f"export: uploaded {repo_id}@{info.oid} but tagging it {tag} failed", repo_id, endpoint
            ):
                api.create_tag(repo_id, tag=tag, revision=info.oid, tag_message=message, exist_ok=False)
            result.created_tag = True
    return result


def _existing_tag(api: Any, result: PushResult, staging: Path, target: str) -> PushResult:
    """The tag exists: succeed (idempotent re-run) only if its tree holds exactly the staged files."""
    remote = {
        e.path: e.blob_id for e in api.list_repo_tree(result.repo_id, revision=target, recursive=True)
        if getattr(e, "blob_id", None) and e.path != ".gitattributes"
    }
    local = {f["path"]: git_blob_sha1(staging / f["path"]) for f in result.files}
    if remote != local:
        raise HubError(
            f"tag {result.tag} already exists on {result.repo_id} (at {target[:12]}) with different content",
            hint="tags are releases and are never moved: publish this artifact under a new version tag",
        )
    logger.info("%s@%s already holds this artifact as tag %s: nothing to do", result.repo_id, target, result.tag)
    result.commit = target
    return result


def _commit_message(manifest: dict[str, Any], tag: str | None) -> str:
    model = (manifest.get("model") or {}).get("reference", "model")
    method = manifest.get("method", "oscar")
    return (f"oscar export: {method} artifact for {model}" + (f" ({tag})" if tag else "")
            + f"\n\ncontent digest: {manifest['digest']}")


# -- fetching -----------------------------------------------------------------------------------------------
def snapshot_blobs(snapshot: Path) -> Path:
    """The ``blobs`` folder of the Hugging Face cache repo holding ``snapshot`` (``…/snapshots/<sha>``): the
    only place a snapshot's links may point to."""
    return snapshot.parent.parent / "blobs"


def pull_artifact(
    ref: str,
    *,
    token: str | None = None,
    endpoint: str | None = None,
    cache_dir: str | Path | None = None,
    expect_digest: str | None = None,
) -> Path:
    """Download and verify the artifact ``ref`` (``hf://ORG/NAME@REV`` or ``ORG/NAME[@REV]``) in the HF cache.

    ``manifest.json`` comes first and is verified (schema, content digest, and ``expect_digest`` when given);
    then only the files it lists plus ``README.md`` are fetched, and each is checked against the manifest. A
    commit sha already in the cache resolves without the network; offline (``HF_HUB_OFFLINE=1`` or the Hub
    unreachable) a tag or branch resolves from the cache when it was pulled before, and is verified the same way.

    Returns:
        The snapshot directory (its name is the resolved commit sha).

    Raises:
        HubError: bad reference, unknown repo/revision, auth failure, offline without a cached copy, a file name
            the Hub client refuses (``../``).
        ArtifactError: the pulled files fail verification, or the digest is not ``expect_digest``.
    """
    from huggingface_hub import constants

    hub_ref = parse_hub_ref(ref)
    endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
    if not hub_ref.revision:
        logger.warning("%s is not pinned: fetching the head of main; pin @<sha> for reproducibility", hub_ref)
    kwargs: dict[str, Any] = {"revision": hub_ref.revision, "cache_dir": cache_dir, "token": token or None}
    first = _snapshot(hub_ref, endpoint, [MANIFEST_NAME], kwargs)
    manifest = read_manifest(first, snapshot_blobs(first))
    if expect_digest is not None and manifest.digest != expect_digest:
        raise ArtifactError(f"{hub_ref}: content digest {manifest.digest} is not the expected {expect_digest}",
                            hint="the repo holds another artifact than the one you pinned; check the digest")
    kwargs["revision"] = first.name  # the commit the manifest came from, never a tag that moved meanwhile
    path = _snapshot(hub_ref, endpoint, [MANIFEST_NAME, README_NAME, *manifest.files], kwargs)
    verify_artifact(path, links_within=snapshot_blobs(path))
    return path


def _snapshot(hub_ref: HubRef, endpoint: str, files: list[str], kwargs: dict[str, Any]) -> Path:
    """``snapshot_download`` of exactly ``files`` (the cache first for a pinned sha)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rev = kwargs.get("revision")
    if rev and SHA_RE.match(rev):
        try:
            with quiet_hub_logs():
                path = Path(snapshot_download(hub_ref.repo_id, local_files_only=True, allow_patterns=files, **kwargs))
            if all((path / f).exists() for f in files if f != README_NAME):
                return path
        except (LocalEntryNotFoundError, ValueError):
            pass
    with quiet_hub_logs(), _hub_progress_bars(), hub_errors("pull", hub_ref.repo_id, endpoint, hub_ref.revision):
        return Path(snapshot_download(hub_ref.repo_id, endpoint=endpoint, allow_patterns=files, **kwargs))


@contextmanager
def _hub_progress_bars() -> Iterator[None]:
    """huggingface_hub's download bars only where oscar shows progress (a TTY, no --json); restored after.

    Plain calls (not ``with disable_progress_bars()``) so huggingface_hub 1.x, where it is a function, works too.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    from oscar_cli._output import progress_enabled

    if progress_enabled() or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()
