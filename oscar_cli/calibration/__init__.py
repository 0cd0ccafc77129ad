"""OSCAR calibration: capture → streaming statistics → rotations ``R = U·H·P`` → clip ratios → artifact.

Library entry points (the ``oscar calibrate`` command is a thin shell over them)::

    from oscar_cli.calibration import calibrate, calibrate_model
    from oscar_cli.recipe import load_recipe
    result = calibrate("smollm2-135m", recipe=load_recipe("smollm2-135m"))   # loads the model
    result = calibrate_model(model, tokenizer, recipe, reference="...", resolved="...")  # a loaded model
    result.artifact_path, result.layers, result.timings

Modules: :mod:`.capture` (registered attention wrapper), :mod:`.covariance` (float64 streaming targets),
:mod:`.rotation` (U·H·P and baselines), :mod:`.clipping` (held-out clip search), :mod:`.data` (calibration
tokens), :mod:`.run` (the pipeline).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CalibrationResult", "calibrate", "calibrate_model"]


def __getattr__(name: str) -> Any:  # lazy: importing the package must not import transformers
    if name in __all__:
        from oscar_cli.calibration import run

        return getattr(run, name)
    raise AttributeError(name)
