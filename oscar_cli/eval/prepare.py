"""Checks and setup shared by ``oscar eval-ruler`` and ``oscar eval-kl``, run before any model is loaded
where they can be: output folder, backend vs device, text files, the default method list, and the methods
themselves (an artifact whose only difference from the model is the RoPE scaling is accepted for the same
weights, with a note).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any

from oscar_cli.errors import ArtifactError, EvalError
from oscar_cli.method_registry import METHOD_NAMES, REGISTRY

logger = logging.getLogger(__name__)



def default_methods(artifact: str | None, *, reference: bool = True) -> tuple[list[str], str | None]:
    """The methods a run compares when ``--methods`` is not given, and a note when one is left out.

    With an artifact: all five. Without: every method that needs none (``oscar`` needs a calibration artifact,
    and calibrating one on the fly would silently spend minutes and pick data for the user).
    ``reference=False`` leaves out ``bf16`` (eval-kl computes it anyway as the reference).
    """
    names = [m for m in METHOD_NAMES if reference or m != "bf16"]
    if artifact is not None:
        return names, None
    note = (
        "oscar is left out: no --artifact given (make one with `oscar calibrate MODEL`, then pass --artifact ART; "
        "or pull one: --artifact hf://ORG/NAME@REV)"
    )
    return [m for m in names if not REGISTRY[m].needs_artifact], note


def check_out_dir(out: str | Path, what: str = "--out") -> Path:
    """``out`` as a folder that exists or can be made; one line when it is a file or cannot be written."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise EvalError(f"{what} {path} is a file, not a folder", hint=f"choose another {what} folder")
    parent = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not parent.is_dir():
        raise EvalError(f"{what} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise EvalError(f"{what} {path}: {parent} is not writable", hint=f"choose another {what} folder")
    return path


def check_backend(backend: str, device: str | None) -> None:
    """``--backend triton`` needs a CUDA device (or ``TRITON_INTERPRET=1``, Triton's CPU interpreter)."""
    if backend != "triton" or os.environ.get("TRITON_INTERPRET") == "1":
        return
    from oscar_cli.model.load import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        raise EvalError(
            f"--backend triton needs a CUDA device; this run is on {dev.type}",
            hint="use --backend reference on CPU (or TRITON_INTERPRET=1 for Triton's slow CPU interpreter)",
        )


def read_text_file(path: str | Path, what: str = "--text") -> str:
    """A UTF-8 text file's content; one line for a missing, binary or non-UTF-8 file."""
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"{what} {p}: no such file", hint="give a plain-text file of prose")
    data = p.read_bytes()
    if b"\0" in data[: 1 << 16]:
        raise EvalError(f"{what} {p} is a binary file (it holds NUL bytes)", hint="give a plain-text file of prose")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise EvalError(
            f"{what} {p} is not UTF-8 text (invalid byte at offset {exc.start})",
            hint="convert it to UTF-8, e.g. iconv -f latin1 -t utf-8",
        ) from None


def _rope_only_difference(artifact: str, config: Any, resolved: str | None) -> Any | None:
    """A copy of ``config`` with the artifact's RoPE type, when the artifact was made for the same weights
    (``resolved`` identity) and differs from ``config`` only in the RoPE scaling; else None."""
    from oscar_cli.artifact import open_artifact
    from oscar_cli.artifact.manifest import ARCHITECTURE_KEYS
    from oscar_cli.model import architecture_fingerprint

    try:
        manifest = open_artifact(artifact).manifest
    except ArtifactError:
        return None
    have, want = manifest.architecture, architecture_fingerprint(config)
    differ = {k for k in ARCHITECTURE_KEYS if k in have and k in want and have[k] != want[k]}
    if differ != {"rope_type"} or resolved is None or manifest.model.get("resolved") != resolved:
        return None
    other = copy.deepcopy(config)
    params = dict(getattr(other, "rope_parameters", None) or {})
    params["rope_type"] = have["rope_type"]
    other.rope_parameters = params
    return other


YARN_ARTIFACT_MEASUREMENT = "docs/RESULTS.md, \"YaRN: the same artifact or one recalibrated under YaRN\""


KEY_MEAN_YARN_MEASUREMENT = 'docs/RESULTS.md, "A constant key mean under YaRN"'


def rope_mismatch_note(artifact: str, calibrated: str, running: str, mean_scale: float | None = None) -> str:
    """The note for an artifact used under another RoPE than it was calibrated with (same weights).

    The default (accept it) follows the measurement in :data:`YARN_ARTIFACT_MEASUREMENT`: on SmolLM2-135M at
    12K under YaRN x2 an artifact calibrated without RoPE scaling had a lower next-token KL against BF16 (under
    the same YaRN) than one recalibrated under YaRN in every window measured, so running it is not refused;
    the note says so. ``mean_scale``: the constant key mean was multiplied by YaRN's attention factor
    (:func:`oscar_cli.quant.key_mean.with_scaled_constant_mean`), which the note states with its measurement.
    """
    head = f"artifact {artifact} was calibrated with {calibrated} RoPE; using it under {running} RoPE (same weights"
    if mean_scale is not None:
        head += (f"; its constant key mean scaled by YaRN's attention factor {mean_scale:.4g}, without which "
                 f"Qwen2.5-Coder-1.5B's next-token KL under YaRN x4 was 1.81 instead of 0.015, "
                 f"{KEY_MEAN_YARN_MEASUREMENT}")
    if calibrated == "default" and running == "yarn":
        return (
            f"{head}; measured no worse than one recalibrated under YaRN (next-token KL, SmolLM2-135M at 12K), "
            f"{YARN_ARTIFACT_MEASUREMENT}; `oscar calibrate MODEL --rope-scaling yarn --rope-factor F` makes one)"
        )
    return f"{head}; not measured in this direction; `oscar calibrate MODEL` without --rope-scaling makes one)"


def build_methods(
    names: list[str],
    config: Any,
    artifact: str | None,
    windows: tuple[int, int] | None,
    *,
    resolved: str | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """``{name: QuantMethod}`` for a model ``config`` and the notes to show.

    An artifact refused only because its RoPE scaling differs from ``config``'s (calibrated without YaRN,
    evaluated under it, or the reverse) is accepted when it was made for the same weights (``resolved``, the
    model identity its manifest records): the rotations describe the same key/value projections, and the
    note (:func:`rope_mismatch_note`) says so and what was measured. An artifact calibrated under plain RoPE
    with a constant key mean gets that mean times ``config``'s attention scaling (YaRN's cos/sin factor: the
    post-RoPE keys' mean grows with it; :func:`oscar_cli.quant.key_mean.with_scaled_constant_mean`). Any other
    mismatch is refused as before.
    """
    from oscar_cli.model.rope import attention_scaling, rope_type
    from oscar_cli.quant import build_method
    from oscar_cli.quant.key_mean import with_scaled_constant_mean

    methods: dict[str, Any] = {}
    notes: list[str] = []
    for m in names:
        try:
            methods[m] = build_method(m, config, artifact, windows)
        except ArtifactError:
            other = _rope_only_difference(artifact, config, resolved) if artifact and REGISTRY[m].needs_artifact else None
            if other is None or artifact is None:
                raise
            method = build_method(m, other, artifact, windows)
            has_mean = method.key_mean == "constant" and any(t.k_mean is not None for t in method.layers)
            scale = attention_scaling(config) if has_mean and rope_type(other) == "default" else 1.0
            methods[m] = with_scaled_constant_mean(method, scale) if scale != 1.0 else method
            notes.append(rope_mismatch_note(artifact, rope_type(other), rope_type(config),
                                            scale if scale != 1.0 else None))
    return methods, notes
