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
  HF_HUB_OFFLINE=1 oscar pull my-org/NAME@v0.1.0        # from the cache only

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
) -> None:
    """Download an artifact at a pinned revision into the HF cache and validate it."""
    from oscar_cli.artifact.hub import parse_hub_ref, pull_artifact

    hub_ref = parse_hub_ref(ref)
    path = pull_artifact(ref, token=token, endpoint=endpoint, cache_dir=cache_dir)
    manifest = _validate(path)
    result: dict[str, Any] = {
        "ref": f"{hub_ref.repo_id}@{path.name}", "repo_id": hub_ref.repo_id, "revision": hub_ref.revision,
        "commit": path.name, "path": str(path), "model": (manifest.get("model") or {}).get("reference"),
        "method": manifest.get("method"), "format_version": manifest.get("format_version"),
    }
    if SETTINGS.json:
        emit_json(result)
        return
    info(f"validated {hub_ref} (model {result['model']}, method {result['method']})")
    stdout.print(result["ref"], highlight=False, markup=False)
    stdout.print(str(path), highlight=False, markup=False)


def _validate(path: Path) -> dict[str, Any]:
    """The manifest of the pulled snapshot after full validation (format version, file hashes)."""
    from oscar_cli.artifact.hub import checked_manifest

    return checked_manifest(path)


def register(app: typer.Typer) -> None:
    """Add ``oscar pull`` to the root app."""
    app.command("pull", epilog=EXAMPLES, rich_help_panel="Hub")(pull)
