#!/usr/bin/env python
"""`oscar eval-ruler` with an artifact's INT2 rows stored with 8-bit metadata (formula 10) instead of the
artifact's own, its rotations, means and clip ratios unchanged: the format's effect on RULER without recalibration
(`quant.meta_dtype: uint8` in a recipe also re-chooses the clips). Arguments are eval-ruler's:

  python scripts/ruler_meta8.py --json eval-ruler smollm2-135m --artifact ART --ctx 4k \\
      --tasks niah_multikey_1,niah_multivalue --samples 25 --methods oscar --device cpu --dtype float32 --out DIR

Use a fresh --out: results resume by the artifact's serving digest, which this override does not change.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

import oscar_cli.quant.methods as methods

_from_artifact = methods.oscar_from_artifact


def _with_meta8(ref: str, config: Any) -> methods.QuantMethod:
    return replace(_from_artifact(ref, config), meta_dtype=torch.uint8)


def main() -> int:
    methods.oscar_from_artifact = _with_meta8  # type: ignore[assignment]
    from oscar_cli.main import main as oscar_main

    oscar_main()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
