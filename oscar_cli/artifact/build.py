"""The manifest of a calibration run: what ``oscar calibrate`` records next to the tensors it writes.

Example::

    manifest = build_manifest(recipe, reference="smollm2-135m", resolved="sha256:…", architecture=fingerprint,
                              data=data.identity, clip_layers=[c.to_dict() for c in choices], ...)
    write_artifact(out, manifest, layers, recipe.to_yaml())
"""

from __future__ import annotations

from typing import Any

import torch

from oscar_cli._version import __version__
from oscar_cli.artifact.manifest import Manifest
from oscar_cli.environment import environment
from oscar_cli.recipe import Recipe
from oscar_kernels.layout import UNIFORM_INNER

CLIP_OBJECTIVES = {  # what each clip.objective minimized (oscar_cli.calibration.clipping); "error" is the mean one
    "mean": "relative attention-output error, held-out tokens, INT2 tier only",
    "topk": "relative output error on each query's {k} most attended INT2 keys, held-out tokens (layers' error: "
            "the mean objective)",
}


def build_manifest(
    recipe: Recipe,
    *,
    reference: str,
    resolved: str,
    architecture: dict[str, Any],
    data: dict[str, Any],
    clip_layers: list[dict[str, Any]],
    orthogonality_error: float,
    statistics_tokens: int,
    holdout_tokens: int,
    timings: dict[str, float],
    device: str | torch.device,
    dtype: str | torch.dtype,
) -> Manifest:
    """The manifest of one calibration (``files`` and the digest are filled in by ``write_artifact``).

    Args:
        recipe: the resolved recipe the run used.
        reference, resolved: what the user typed, and its pinned identity (``ORG/NAME@sha`` or ``sha256:<hex>``).
        architecture: the model's fingerprint (``oscar_cli.model.architecture_fingerprint``).
        data: the calibration data's identity (source, sha256 of the token ids, tokens, ...).
        clip_layers: per-layer clip choices (``ClipChoice.to_dict()``).
        orthogonality_error: ``max |RᵀR - I|`` over every rotation written.
        statistics_tokens, holdout_tokens: how the token budget was split.
        timings: seconds per phase.
        device, dtype: where and in which dtype the model ran (recorded with the software versions).
    """
    return Manifest(
        oscar_version=__version__,
        model={"reference": reference, "resolved": resolved},
        architecture=dict(architecture),
        method=recipe.method,
        grouping=recipe.rotation.grouping,
        recipe=recipe.to_dict(),
        quant={
            "group_size": recipe.quant.group_size or int(architecture["head_dim"]),
            "meta_dtype": recipe.quant.meta_dtype,
            "sink": recipe.quant.sink,
            "recent": recipe.quant.recent,
            **({"keep": recipe.quant.keep.model_dump(exclude_none=True)} if recipe.quant.keep.fraction else {}),
            **({"levels": recipe.quant.levels} if recipe.quant.levels != UNIFORM_INNER else {}),
            **({"logit_correction": recipe.quant.logit_correction} if recipe.quant.logit_correction != "none" else {}),
            **({"key_subspace": recipe.quant.key_subspace} if recipe.quant.key_subspace else {}),
            **({"key_mean": recipe.quant.key_mean} if recipe.quant.key_mean != "constant" else {}),
        },
        data=dict(data),
        seed=recipe.data.seed,
        calibration={
            "k_target": recipe.statistics.k_target,
            "v_target": recipe.statistics.v_target,
            "composition": recipe.rotation.composition,
            "statistics_tokens": statistics_tokens,
            "holdout_tokens": holdout_tokens,
            "orthogonality_error": orthogonality_error,
            "clip": {"mode": recipe.clip.mode,
                     "objective": CLIP_OBJECTIVES[recipe.clip.objective].format(k=recipe.clip.topk_keys),
                     "layers": clip_layers},
            "timings_s": {k: round(v, 3) for k, v in timings.items()},
        },
        extra={"environment": environment(device, dtype)},
    )
