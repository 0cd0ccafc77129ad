"""``oscar pull``: fetch a published artifact at a pinned revision into the Hugging Face cache."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from oscar_cli._output import SETTINGS, emit_json, info, stdout

EXAMPLES = """
[bold]Examples[/bold]

  oscar pull my-org/smollm2-135m-oscar@v0.1.0          # a release tag
  oscar pull hf://my-org/smollm2-135m-oscar@4f1c...e9   # a commit sha: immutable, works offline once cached
  oscar --json pull my-org/NAME@v0.1.0                  # {"ref", "commit", "path", ...}
  HF_HUB_OFFLINE=1 oscar pull my-org/NAME@v0.1.0        # from the cache only (verified the same way)
  oscar pull my-org/NAME@v0.1.0 --expect-digest sha256:9c1e...   # refuse any other content

Prints [bold]ORG/NAME@<commit sha>[/bold] then the local directory. Anything that takes an artifact also takes
[bold]hf://ORG/NAME@REV[/bold] and pulls it on first use.
"""


def pull(
    ref: Annotated[str, typer.Argument(help="ORG/NAME[@REV] or hf://ORG/NAME@REV (REV: tag, branch, sha).",
                                       show_default=False)],
    token: Annotated[
        str | None,
        typer.Option("--token", help="Hub token for private repos (default: HF_TOKEN or the login). Never printed.",
                     show_default=False),
    ] = None,
    endpoint: Annotated[
        str | None, typer.Option("--endpoint", help="Hub URL (default: HF_ENDPOINT or https://huggingface.co).")
    ] = None,
    cache_dir: Annotated[
        Path | None, typer.Option("--cache-dir", help="Hugging Face cache directory (default: HF_HUB_CACHE).")
    ] = None,
    expect_digest: Annotated[
        str | None,
        typer.Option("--expect-digest", help="Refuse the artifact unless its content digest is this sha256:<hex> "
                     "(as printed by oscar export and quoted in the model card and the tag message).",
                     show_default=False),
    ] = None,
) -> None:
    """Download an artifact at a pinned revision into the HF cache and verify every file against its manifest."""
    from oscar_cli.artifact.hub import checked_manifest, parse_hub_ref, pull_artifact, snapshot_blobs

    hub_ref = parse_hub_ref(ref)
    path = pull_artifact(ref, token=token, endpoint=endpoint, cache_dir=cache_dir, expect_digest=expect_digest)
    manifest = checked_manifest(path, snapshot_blobs(path))
    result: dict[str, Any] = {
        "ref": f"{hub_ref.repo_id}@{path.name}", "repo_id": hub_ref.repo_id, "revision": hub_ref.revision,
        "commit": path.name, "path": str(path), "model": (manifest.get("model") or {}).get("reference"),
        "method": manifest.get("method"), "format_version": manifest.get("format_version"),
        "digest": manifest.get("digest"),
    }
    if SETTINGS.json:
        emit_json(result)
        return
    info(f"verified {hub_ref} (model {result['model']}, method {result['method']}, digest {result['digest']})")
    stdout.print(result["ref"], highlight=False, markup=False)
    stdout.print(str(path), highlight=False, markup=False)


def register(app: typer.Typer) -> None:
    """Add ``oscar pull`` to the root app."""
    app.command("pull", epilog=EXAMPLES, rich_help_panel="Hub")(pull)
