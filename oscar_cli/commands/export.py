"""``oscar export``: validate an artifact and publish it to the Hugging Face Hub, tagged and pinned."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from oscar_cli._output import SETTINGS, emit_json, info, stdout

EXAMPLES = """
[bold]Examples[/bold]

  oscar export artifacts/smollm2-135m/smollm2-135m-e1fda680 --repo-id my-org/smollm2-135m-oscar --tag v0.1.0
  oscar export ARTIFACT --repo-id my-org/NAME --dry-run       # list what would be uploaded; touches nothing
  oscar --json export ARTIFACT --repo-id my-org/NAME --tag v0.2.0 --private
  oscar export ARTIFACT --repo-id my-org/NAME --tag v0.2.0 --eval-summary ruler-results/summary.json
  HF_TOKEN=hf_... oscar export ARTIFACT --repo-id my-org/NAME # token from HF_TOKEN or `hf auth login`

Prints [bold]ORG/NAME@<commit sha>[/bold]: pin that (or the tag) in `oscar pull` / `hf://ORG/NAME@REV`.
Re-exporting an identical artifact makes no new commit; an existing tag is never moved.
"""

RepoIdOpt = Annotated[
    str, typer.Option("--repo-id", help="Target Hub repo ORG/NAME (created if missing).", show_default=False)
]
TagOpt = Annotated[
    str | None, typer.Option("--tag", help="Release tag for the uploaded commit, e.g. v0.1.0 (never moved).")
]
PrivateOpt = Annotated[
    bool, typer.Option("--private", help="Create the repo private (an existing repo keeps its visibility).")
]
DryRunOpt = Annotated[
    bool, typer.Option("--dry-run", help="Validate and list the files that would be uploaded; sends nothing (no network for a local ARTIFACT).")
]
TokenOpt = Annotated[
    str | None,
    typer.Option(
        "--token",
        help="Hub token with write access (default: HF_TOKEN, else the `hf auth login` token). Never printed.",
        show_default=False,
    ),
]
EndpointOpt = Annotated[
    str | None, typer.Option("--endpoint", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co).")
]
SkipExtraOpt = Annotated[
    bool, typer.Option("--skip-extra", help="Leave out files of the folder that the manifest does not list "
                       "(default: refuse such a folder, naming the file).")
]
MessageOpt = Annotated[str | None, typer.Option("--message", "-m", help="Commit message (default: generated).")]
EvalOpt = Annotated[
    Path | None,
    typer.Option(
        "--eval-summary",
        help="summary.json of `oscar eval-ruler` on this artifact: its scores go into the published manifest "
        "and model card (the local artifact is not modified).",
        exists=True, dir_okay=False, show_default=False,
    ),
]


def export(
    artifact: Annotated[
        str,
        typer.Argument(help="Artifact directory written by `oscar calibrate` (or hf://ORG/NAME@REV to re-publish).",
                       show_default=False),
    ],
    repo_id: RepoIdOpt,
    tag: TagOpt = None,
    private: PrivateOpt = False,
    dry_run: DryRunOpt = False,
    token: TokenOpt = None,
    endpoint: EndpointOpt = None,
    message: MessageOpt = None,
    eval_summary: EvalOpt = None,
    skip_extra: SkipExtraOpt = False,
) -> None:
    """Verify ARTIFACT (schema, content digest, hashes), render its model card, upload exactly the files its
    manifest lists plus the card to the Hub and tag the commit."""
    from oscar_cli.artifact.hub import push_artifact

    evaluation = _evaluation(eval_summary, artifact) if eval_summary is not None else None
    result = push_artifact(
        artifact, repo_id, tag=tag, private=private, token=token, endpoint=endpoint, dry_run=dry_run,
        commit_message=message, evaluation=evaluation, skip_extra=skip_extra,
    )
    if SETTINGS.json:
        emit_json(result.to_dict())
        return
    if dry_run:
        total = sum(f["size"] for f in result.files)
        for f in result.files:  # tab-separated: path, bytes, sha256 (rich would expand the tabs)
            sys.stdout.write(f"{f['path']}\t{f['size']}\t{f['sha256']}\n")
        info(
            f"dry run: would upload {len(result.files)} files ({total / 1024:.1f} KiB) to {repo_id}"
            + (f" and tag the commit {tag}" if tag else "") + f"; content digest {result.digest}; nothing was sent"
        )
        return
    if result.created_repo:
        info(f"created {'private' if private else 'public'} repo {repo_id}")
    if result.created_commit:
        info(f"uploaded {len(result.files)} files as commit {result.commit}")
    else:
        info(f"no change: {repo_id} already holds this artifact at {result.commit}")
    if tag:
        info(f"tagged {tag} -> {result.commit}" if result.created_tag else f"tag {tag} already names {result.commit}")
    info(f"content digest {result.digest}")
    stdout.print(result.ref, highlight=False, markup=False)


def _evaluation(summary_path: Path, artifact: str) -> dict[str, Any]:
    """``manifest.evaluation`` from an eval-ruler summary, checked against the artifact."""
    from oscar_cli.artifact.evaluation import evaluation_from_ruler
    from oscar_cli.artifact.hub import checked_manifest
    from oscar_cli.errors import ArtifactError

    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"cannot read the eval summary {summary_path} ({type(exc).__name__})") from None
    if not isinstance(summary, dict):
        raise ArtifactError(f"{summary_path} is not an oscar eval-ruler summary (expected a JSON object)")
    if artifact.startswith("hf://"):
        from oscar_cli.artifact.hub import pull_artifact, snapshot_blobs

        path = pull_artifact(artifact)
        return evaluation_from_ruler(summary, checked_manifest(path, snapshot_blobs(path)))
    return evaluation_from_ruler(summary, checked_manifest(Path(artifact)))


def register(app: typer.Typer) -> None:
    """Add ``oscar export`` to the root app."""
    app.command("export", epilog=EXAMPLES, rich_help_panel="Hub")(export)
