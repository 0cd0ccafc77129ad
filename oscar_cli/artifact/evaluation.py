"""Evaluation results for the manifest and model card of a published artifact, from an ``oscar eval-ruler`` summary.

Example::

    evaluation = evaluation_from_ruler(json.loads(Path("ruler-results/summary.json").read_text()), manifest)
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oscar_cli.artifact.io import verify_artifact
from oscar_cli.errors import ArtifactError


def evaluation_from_ruler(summary: Mapping[str, Any], manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest.evaluation`` from an ``oscar eval-ruler`` ``summary.json``: one row per (method, task, ctx).

    Every method is kept (baselines give the card its comparison); only the artifact's own rows (method
    ``oscar``) become ``model-index`` claims. Refuses a summary measured on another model, or whose
    ``--artifact`` is a local directory holding other files than this artifact.

    Raises:
        ArtifactError: the summary does not belong to this artifact, or is not an eval-ruler summary.
    """
    scores, counts = summary.get("scores"), summary.get("counts") or {}
    if not isinstance(scores, Mapping) or not scores:
        raise ArtifactError("the eval summary has no scores (expected summary.json written by oscar eval-ruler)")
    have = str((summary.get("model") or {}).get("resolved") or "")
    want = str((manifest.get("model") or {}).get("resolved") or "")
    if have and want and have != want:
        raise ArtifactError(f"the eval summary was measured on {have}, the artifact is for {want}",
                            hint="evaluate this artifact's model: oscar eval-ruler MODEL --artifact ARTIFACT")
    used = (summary.get("config") or {}).get("artifact")
    if "oscar" in scores and isinstance(used, str) and not used.startswith("hf://") and Path(used).is_dir():
        if verify_artifact(Path(used)).files != manifest.get("files"):
            raise ArtifactError(f"the eval summary's oscar rows come from another artifact ({used})")
    rows = [
        {"task": task, "ctx": int(ctx), "metric": "string_match_all", "value": float(value), "method": method,
         "samples": int(((counts.get(method) or {}).get(task) or {}).get(ctx, 0))}
        for method, tasks in scores.items() for task, by_ctx in tasks.items() for ctx, value in by_ctx.items()
    ]
    rows.sort(key=lambda r: (r["method"] != "oscar", r["method"], r["task"], r["ctx"]))
    return {"source": "oscar eval-ruler", "complete": bool(summary.get("complete", True)), "results": rows,
            "environment": summary.get("environment") or {}}
